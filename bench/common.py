"""What the benchmarks share: saving results, and starting themselves on several ranks."""
import json
import os
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def write_result(path: str, result: dict) -> None:
    """Write a benchmark's result as JSON and say where."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2) + "\n")
    print(f"  wrote {path}")


def run_on_ranks(main: Callable[[], None], script: str, nproc: int = 2, port: int = 29511) -> None:
    """Run `main` here if a launcher started us, else re-run `script` on `nproc` ranks with
    our own `nanocolossal run` (MASTER_PORT overrides the port)."""
    if "RANK" in os.environ:
        main()
        return
    from nanocolossal.run import main as run
    sys.exit(run(["--nproc_per_node", str(nproc), "--master_port",
                  os.environ.get("MASTER_PORT", str(port)), script, *sys.argv[1:]]))
