"""Benchmark: how long `nanocolossal plan` takes to answer "will it fit?" for a 7B-parameter GPT
on 64 ranks of 80 GiB, its own layout and every other one searched.

    python bench/bench_plan.py [--repeat 3] [--json bench/results/plan.json]

Two figures: the whole command in a fresh process (`python -m nanocolossal.plan`, Python's
start and the imports included: what a user waits for; torch is not imported, only --model
needs it), and the planning alone in this process (the formulas, the schedule simulations and
the search), best of --repeat. The 7B config is the one tests/test_plan.py checks for its answer.
"""
import argparse
import contextlib
import io
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import write_result

ROOT = Path(__file__).resolve().parent.parent
SEVEN_B = dict(VOCAB=32000, SEQ_LEN=4096, DIM=4096, DEPTH=32, HEADS=32, MLP_RATIO=4,
               BATCH_SIZE=8, NUM_MICRO_BATCHES=8,
               parallel=dict(pipeline=4, tensor=dict(size=8, mode="1d")), zero=dict(level=1),
               ACTIVATION_CHECKPOINT="full", fp16=dict(mode="torch", dtype="bfloat16"))
ARGS = ["--world", "64", "--memory", "80GiB", "--search"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", default=str(ROOT / "bench/results/plan.json"))
    args = parser.parse_args()
    from nanocolossal.plan import main as plan
    from nanocolossal.plan.activations import _flights
    from nanocolossal.plan.formulas import _grouped
    from nanocolossal.plan.model import rank_tensors, tensors
    with tempfile.TemporaryDirectory() as folder:
        config = Path(folder) / "gpt7b.py"
        config.write_text("".join(f"{k} = {v!r}\n" for k, v in SEVEN_B.items()))
        command = [sys.executable, "-m", "nanocolossal.plan", "--config", str(config), *ARGS]
        whole, alone = [], []
        for _ in range(args.repeat):
            start = time.perf_counter()
            out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
            whole.append(time.perf_counter() - start)
            for cache in (_flights, _grouped, rank_tensors, tensors):  # plan from scratch
                cache.cache_clear()
            start = time.perf_counter()
            with contextlib.redirect_stdout(io.StringIO()):
                plan(["--config", str(config), *ARGS])
            alone.append(time.perf_counter() - start)
    fits = next(line for line in out.stdout.splitlines() if "layouts fit" in line)
    result = {"command_s": min(whole), "planning_s": min(alone), "answer": fits.strip()}
    print("| 7B GPT on 64 ranks of 80 GiB, searched | seconds (best of %d) |" % args.repeat)
    print("|---|---|")
    print(f"| the command, fresh process | {result['command_s']:.2f} |")
    print(f"| the planning alone | {result['planning_s']:.2f} |")
    print(f"answer: {result['answer']}")
    write_result(args.json, result)


if __name__ == "__main__":
    main()
