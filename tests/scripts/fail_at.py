"""Run a training script, killing one rank right after its N-th optimizer step.

    torchrun --max-restarts 1 --nproc_per_node 2 tests/scripts/fail_at.py 1:11 train_ddp.py [args]

Fault injection for the restart tests, kept out of the library and the scripts: a global
optimizer-step hook counts steps and SIGKILLs (no clean-up) the chosen rank. It fires on a job's
first attempt only, so the job that `torchrun --max-restarts` starts again runs through.
`run(spec, script, args)` is the same for a worker that torchrun's agent forks (rank_pool.py).
"""
import gc
import os
import runpy
import signal
import sys

from torch.optim.optimizer import register_optimizer_step_post_hook


def arm(spec: str) -> None:
    """"rank:N": that rank dies after its N-th optimizer step, on the first attempt only."""
    rank, at = (int(v) for v in spec.split(":"))
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" or int(os.environ["RANK"]) != rank:
        return
    steps = 0

    def die_at(optimizer, args, kwargs) -> None:
        nonlocal steps
        steps += 1
        if steps == at:
            os.kill(os.getpid(), signal.SIGKILL)

    register_optimizer_step_post_hook(die_at)


def run(spec: str, script: str, args: list) -> None:
    arm(spec)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))  # as if the script had been started
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    # torch's objects stop being tracked: the interpreter's exit then skips a final sweep over
    # them that takes over a second per process (the tests start many)
    gc.freeze()
    run(sys.argv[1], sys.argv[2], sys.argv[3:])
    gc.freeze()  # again: what the script made (torch._dynamo's objects, the model) skips it too
