"""The lines that run: how much of the library a reader must follow to see one run through.

For a training command, every function of the nanocolossal package that executes on rank 0 is
recorded (`sys.setprofile`, every thread); a function counts with its whole span, `def` to its
last line, docstring included, and the spans of a file are united (a nested function inside an
outer one that ran costs nothing more). Module bodies and class bodies (run once, at import) do
not count; functions they call do. Functions in check modules -- a file named `checks.py` or
`*_checks.py`, or under a `checks/` package -- are counted apart: a check called by one line from
the core is not on the reader's path.

    python bench/path_lines.py -- torchrun --nproc_per_node 2 train_pipeline.py --max-steps 3
    python bench/path_lines.py --all [--json F]     # the seven runs of docs/path_lines.md

How: the command's script is replaced by this file in `--trace` mode, which installs the profiler
on rank 0 and runs the script as `__main__`; at exit rank 0 writes what ran to $PATH_LINES_OUT.
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import runpy
import socket
import subprocess
import sys
import tempfile
import threading
from inspect import CO_OPTIMIZED
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nanocolossal"

RUNS = {  # name -> the command, as the README runs it (short: 3 steps)
    "main job (1F1B)": ["train_pipeline.py", "--epochs", "1", "--max-steps", "3"],
    "train_ddp.py": ["train_ddp.py", "--epochs", "1", "--synthetic-size", "256"],
    "train_amp.py": ["train_amp.py", "--max-steps", "3"],
    "GPT, tensor 1d": ["train_gpt.py", "--config", "configs/gpt.py", "--max-steps", "3"],
    "GPT, ring attention": ["train_gpt.py", "--config", "configs/gpt_seq.py", "--max-steps", "3"],
    "GPT, experts": ["train_gpt.py", "--config", "configs/gpt_moe.py", "--max-steps", "3"],
    "GPT, ZeRO 3": ["train_gpt.py", "--config", "ZERO3", "--max-steps", "3"],
}
ZERO3 = Path(tempfile.gettempdir()) / "path_lines_gpt_zero3.py"  # configs/gpt_zero.py at level 3


def is_check_module(path: Path) -> bool:
    return path.name == "checks.py" or path.name.endswith("_checks.py") or "checks" in path.parts


def _trace(script: str, args: list[str]) -> None:
    """Rank 0 records every package function it enters; the script then runs as __main__."""
    seen: set = set()
    package = str(PACKAGE)

    def record(frame, event, arg):
        if event == "call":
            code = frame.f_code
            if code.co_filename.startswith(package) and code.co_flags & CO_OPTIMIZED:
                seen.add(code)

    def save() -> None:
        sys.setprofile(None)
        spans = [(c.co_filename, c.co_name, c.co_firstlineno,
                  max((line for _, _, line in c.co_lines() if line), default=c.co_firstlineno))
                 for c in seen]
        Path(os.environ["PATH_LINES_OUT"]).write_text(json.dumps(spans))

    if os.environ.get("RANK", "0") == "0":
        atexit.register(save)
        threading.setprofile(record)
        sys.setprofile(record)
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


def measure(command: list[str]) -> dict:
    """Run `command` (torchrun ... SCRIPT ARGS, or python SCRIPT ARGS) with rank 0 traced."""
    script_at = next(i for i, a in enumerate(command) if a.endswith(".py"))
    traced = [*command[:script_at], __file__, "--trace", *command[script_at:]]
    if traced[0] == "torchrun":  # on a free port: several measurements may run at once
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        traced = [sys.executable, "-m", "torch.distributed.run", f"--master_port={port}",
                  *traced[1:]]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = {**os.environ, "PATH_LINES_OUT": out.name, "OMP_NUM_THREADS": "1"}
        subprocess.run(traced, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)
        spans = json.loads(Path(out.name).read_text())
    return summarize(spans)


def summarize(spans: list) -> dict:
    """Lines (the union of spans per file), functions and files, the core and checks apart."""
    result = {}
    for part, keep in (("core", False), ("checks", True)):
        mine = [s for s in spans if is_check_module(Path(s[0])) == keep]
        lines = {(f, n) for f, _, first, last in mine for n in range(first, last + 1)}
        result[part] = {"lines": len(lines), "functions": len(mine),
                        "files": len({s[0] for s in mine})}
    by_file: dict[str, set] = {}
    for f, _, first, last in spans:
        by_file.setdefault(str(Path(f).relative_to(PACKAGE)), set()).update(range(first, last + 1))
    result["by_file"] = {f: len(lines) for f, lines in sorted(by_file.items())}
    result["functions"] = sorted(f"{Path(f).relative_to(PACKAGE)}:{first}-{last} {name}"
                                 for f, name, first, last in spans)
    return result


def main() -> None:
    if sys.argv[1:2] == ["--trace"]:
        return _trace(sys.argv[2], sys.argv[3:])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="the seven runs of the book's table")
    parser.add_argument("--json", type=str, default=None, help="write the results here too")
    parser.add_argument("--show", type=str, default=None,
                        help="also list the functions that ran in files whose path contains this")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- torchrun ... script args")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    ZERO3.write_text(f"exec(open({str(ROOT / 'configs/gpt_zero.py')!r}).read())\n"
                     f"zero = dict(level=3)\n")
    named = {name: ["torchrun", "--nproc_per_node", "2",
                    *[str(ZERO3) if a == "ZERO3" else a for a in cmd]]
             for name, cmd in RUNS.items()}
    runs = named if args.all else {" ".join(command): command}
    results = {}
    print("| run | lines that run (checks apart) | functions | files | checks' lines |")
    print("|---|---|---|---|---|")
    for name, command in runs.items():
        r = results[name] = measure(command)
        print(f"| {name} | {r['core']['lines']:,} | {r['core']['functions']} | "
              f"{r['core']['files']} | {r['checks']['lines']:,} |", flush=True)
        if args.show:
            print("\n".join(f"    {f}" for f in r["functions"] if args.show in f))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
