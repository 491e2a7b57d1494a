"""train_tensor.py end to end: with dropout 0, the same seed and global batch, the final train loss
is the same for one process, Megatron 1d over 2 ranks and the tutorial's pipeline 2 x 2d 4 on 8
ranks; and a run stopped mid-epoch resumes bit-identically, dropout included."""
import re

import pytest
import torch
from dist_helpers import ROOT, run_script

from nanocolossal.checkpoint import merge_checkpoint

LAYOUTS = {
    "one process": (1, ""),
    "1d x2": (2, "parallel = dict(tensor=dict(size=2, mode='1d'))\n"),
    "pipeline 2 x 2d 4": (8, "parallel = dict(pipeline=2, tensor=dict(size=4, mode='2d'))\n"
                             "NUM_MICRO_BATCHES = 2\n"),
}


def _final_loss(tmp_path, name):
    nproc, parallel = LAYOUTS[name]
    config = tmp_path / f"{name.replace(' ', '_')}.py"
    config.write_text("BATCH_SIZE = 16\nNUM_EPOCHS = 1\n" + parallel)
    out = run_script(ROOT / "train_tensor.py",
                     ["--config", str(config), "--max-steps", "3", "--seed", "5",
                      "--synthetic-size", "64", "--data", str(tmp_path)],
                     nproc=nproc, cwd=tmp_path).replace("\r", "\n")
    return float(re.search(r"final train loss ([0-9.e+-]+)", out).group(1))


@pytest.mark.timeout(300)
def test_deep_train_tensor_final_loss_is_the_same_for_every_layout(tmp_path):
    losses = {name: _final_loss(tmp_path, name) for name in LAYOUTS}
    reference = losses["one process"]
    for name, loss in losses.items():
        assert loss == pytest.approx(reference, rel=1e-4), losses


@pytest.mark.timeout(300)
def test_deep_train_tensor_resumes_mid_epoch_with_the_same_dropout_masks(tmp_path):
    """1d over 2 ranks with dropout: stopped at step 3 of 4 (mid epoch 2) and resumed, the run
    ends bit-identical to one that never stopped -- the sharded dropout redraws the same masks."""
    config = tmp_path / "tensor_1d.py"
    config.write_text("BATCH_SIZE = 16\nNUM_EPOCHS = 2\n" + LAYOUTS["1d x2"][1])

    def train(name, *args):
        return run_script(ROOT / "train_tensor.py",
                          ["--config", str(config), "--dropout", "0.2", "--synthetic-size", "32",
                           "--data", str(tmp_path), "--checkpoint", name, *args],
                          nproc=2, cwd=tmp_path).replace("\r", "\n")
    train("straight.pt")
    train("resumed.pt", "--max-steps", "3", "--checkpoint-every", "2")
    assert "resumed from resumed.pt: epoch 2, step 3" in train("resumed.pt", "--resume")
    straight, resumed = (merge_checkpoint(tmp_path / n) for n in ("straight.pt", "resumed.pt"))
    assert list(straight) == list(resumed)
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key
