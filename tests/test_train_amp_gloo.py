"""train_amp.py end to end under a real torchrun: the Engine loop, then the Trainer resuming from its checkpoint."""
import re
import sys

import pytest
from dist_helpers import ROOT, free_port, run_cmd


def _torchrun(tmp_path, *args):
    return run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                    "--master_port", str(free_port()), str(ROOT / "train_amp.py"), "--synthetic-size", "512",
                    "--batch-size", "32", "--data", str(tmp_path), *args], timeout=150, cwd=tmp_path)


@pytest.mark.timeout(320)
def test_gloo_train_amp_engine_then_trainer_resume(tmp_path):
    ckpt = str(tmp_path / "ckpt.pt")
    first = _torchrun(tmp_path, "--epochs", "1", "--checkpoint", ckpt)
    assert first.returncode == 0, first.stdout
    assert re.search(r"initialize: AMP O1 \(TORCH\)( in float32 on this CPU)?, DDP x2", first.stdout), first.stdout
    assert "Epoch 0 - train loss" in first.stdout
    second = _torchrun(tmp_path, "--epochs", "2", "--checkpoint", ckpt, "--resume", "--trainer")
    assert second.returncode == 0, second.stdout
    assert f"resumed from {ckpt} after epoch 1" in second.stdout
    assert re.search(r"epoch 2 train: .*loss [0-9.]+.*throughput", second.stdout), second.stdout
    assert re.search(r"epoch 2 test: loss [0-9.e+]+, accuracy", second.stdout), second.stdout
    assert "epoch 1 train" not in second.stdout, "the resumed run starts at epoch 2"
