"""A rank killed mid-epoch under `torchrun --max-restarts 1`: the restarted job resumes from its
last checkpoint (mid-epoch) and ends bit-identical to a run that was never interrupted.

The job runs under torchrun's own elastic agent (what `torchrun` runs), with its workers forked
from a process that imported torch rather than started as fresh interpreters
(dist_helpers.torchrun_fail_at): a start or a restart then costs a fork, not seconds of imports.
The `torchrun` command line itself is tested in test_launch.py.
"""
import re

import pytest
import torch
from dist_helpers import ROOT, BackgroundCmd, run_script, torchrun_fail_at

from nanocolossal.checkpoint import merge_pipeline_checkpoint


def _killed_and_restarted(tmp_path, script, args, fail_at="1:11") -> BackgroundCmd:
    """Start, under torchrun's agent with --max-restarts 1, a job whose rank dies after step N."""
    return torchrun_fail_at(ROOT / script, args, fail_at, cwd=tmp_path)


def _finish(job: BackgroundCmd) -> str:
    result = job.finish(timeout=200)
    assert result.returncode == 0, result.stdout[-3000:]
    return result.stdout


def _assert_identical(a: dict, b: dict):
    assert list(a) == list(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.timeout(300)
def test_deep_ddp_restart_after_a_killed_rank_is_bit_identical(tmp_path):
    # 8 steps per epoch; checkpoints at steps 3, 6, 8, 9, ...
    args = ["--epochs", "2", "--synthetic-size", "800", "--batch-size", "50",
            "--checkpoint-every", "3", "--data", str(tmp_path), "--resume"]
    # the killed job (a rank dies in epoch 2) runs while the pool runs the uninterrupted one:
    # torchrun's start and restart leave a core idle most of the time
    with _killed_and_restarted(tmp_path, "train_ddp.py",
                               [*args, "--checkpoint", "restarted.pt"]) as job:
        run_script(ROOT / "train_ddp.py", [*args, "--checkpoint", "straight.pt"], nproc=2,
                   cwd=tmp_path)
        out = _finish(job)
    assert "resumed from restarted.pt: epoch 2, step 9" in out
    straight = torch.load(tmp_path / "straight.pt", weights_only=False)
    restarted = torch.load(tmp_path / "restarted.pt", weights_only=False)
    assert straight["extra"] == restarted["extra"] == {"step": 16, "batch_in_epoch": 0}
    _assert_identical(straight["model"], restarted["model"])
    for s, r in zip(straight["optimizer"]["state"].values(),
                    restarted["optimizer"]["state"].values()):
        assert torch.equal(s["momentum_buffer"], r["momentum_buffer"])


@pytest.mark.timeout(300)
def test_deep_pipeline_restart_after_a_killed_rank_is_bit_identical(tmp_path):
    # 5 steps per epoch (of 8 images, micro-batches of 2): saves at 3, 5, 6, 9, 10. ResNet-18:
    # the same pipeline as ResNet-50's, cut and checkpointed the same way, at a third of the compute
    args = ["--epochs", "2", "--synthetic-size", "40", "--batch-size", "8", "--model", "resnet18",
            "--partition", "parameters", "--checkpoint-every", "3", "--data", str(tmp_path),
            "--resume"]
    with _killed_and_restarted(tmp_path, "train_pipeline.py",
                               [*args, "--checkpoint", "restarted.pt"],
                               # the second stage dies in epoch 2, a step after a save
                               fail_at="1:7") as job:
        run_script(ROOT / "train_pipeline.py", [*args, "--checkpoint", "straight.pt"], nproc=2,
                   cwd=tmp_path)
        out = _finish(job)
    assert "resumed from restarted.pt: epoch 2, step 6" in out.replace("\r", "\n")
    merged = [merge_pipeline_checkpoint([tmp_path / f"{name}-stage{s}.pt" for s in (0, 1)])
              for name in ("straight", "restarted")]
    _assert_identical(*merged)


@pytest.mark.timeout(200)
def test_deep_torchrun_exits_nonzero_when_a_rank_dies_without_restarts(tmp_path):
    result = torchrun_fail_at(ROOT / "train_ddp.py",
                              ["--epochs", "1", "--synthetic-size", "400", "--batch-size", "50",
                               "--data", str(tmp_path)],
                              "1:2", cwd=tmp_path, max_restarts=0).finish(timeout=150)
    assert result.returncode != 0
    # the injected SIGKILL, not a crash: the agent reports whichever failure it saw first, rank
    # 1 killed (exit code -9) or rank 0 losing its peer mid-collective (gloo says "reset" or
    # "closed", by when the kill lands)
    killed = re.search(r"rank\s*:\s*1 .*\n.*exitcode\s*:\s*-9", result.stdout)
    lost_peer = re.search(r"rank\s*:\s*0 .*\n.*exitcode\s*:\s*1 ", result.stdout) and \
        re.search(r"Connection (reset|closed) by peer", result.stdout)
    assert killed or lost_peer, result.stdout[-3000:]
    assert "training complete" not in result.stdout
