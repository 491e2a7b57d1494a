"""train_amp.py end to end on 2 ranks: stopped mid-epoch and resumed, the Engine loop and the
Trainer each end bit-identical to one straight run of the Engine loop (one resume path,
progress.py, for both; and the two loops are the same training)."""
import re
import sys

import pytest
import torch
from dist_helpers import ROOT, run_script

import nanocolossal as nc


def _train(tmp_path, *args):
    args = ["--synthetic-size", "16", "--batch-size", "4", "--epochs", "2", "--model",
            "resnet18", "--data", str(tmp_path), *args]
    return run_script(ROOT / "train_amp.py", args, nproc=2, cwd=tmp_path)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """2 epochs of 2 steps (16 images / (4 per rank x 2 ranks)) by the Engine loop, never
    stopped: the reference for both loops, since the Trainer must train exactly alike."""
    path = tmp_path_factory.mktemp("straight")
    out = _train(path, "--checkpoint", "straight.pt")
    assert re.search(r"initialize: AMP O1 \(TORCH\)( in float32 on this CPU)?, DDP x2", out), out
    assert "Epoch 0 - train loss" in out and "Epoch 1 - train loss" in out, out
    return torch.load(path / "straight.pt", weights_only=False)


@pytest.mark.timeout(320)
# both loops on ResNet-18: resuming does not depend on the model, and the tutorial's ResNet-34
# costs twice the compute (test_train_amp_default_model_builds_and_classifies builds it)
@pytest.mark.parametrize("loop", [[], ["--trainer"]], ids=["engine-loop", "trainer"])
def test_deep_train_amp_stopped_mid_epoch_and_resumed_equals_the_straight_run(tmp_path, loop,
                                                                               straight):
    # in the middle of epoch 2
    stopped = _train(tmp_path, *loop, "--checkpoint", "resumed.pt", "--max-steps", "3")
    assert "Epoch 1 -" not in stopped, stopped
    if loop:
        assert "epoch 2 train" in stopped, stopped
    resumed = _train(tmp_path, *loop, "--checkpoint", "resumed.pt", "--resume")
    assert "resumed from resumed.pt: epoch 2, step 3" in resumed, resumed
    # the resumed run starts in epoch 2
    assert "Epoch 0 -" not in resumed and "epoch 1 train" not in resumed, resumed
    if loop:
        assert re.search(r"epoch 2 train: .*loss [0-9.]+.*throughput", resumed), resumed
        assert re.search(r"epoch 2 test: loss [0-9.e+]+, accuracy", resumed), resumed
    a, b = straight, torch.load(tmp_path / "resumed.pt", weights_only=False)
    assert a["epoch"] == b["epoch"] == 2
    assert a["extra"] == b["extra"] == {"step": 4, "batch_in_epoch": 0}
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    # the AMP optimizer's: torch's state and the loss scaler
    opt_a, opt_b = a["optimizer"], b["optimizer"]
    for s, r in zip(opt_a["optimizer"]["state"].values(), opt_b["optimizer"]["state"].values()):
        assert torch.equal(s["momentum_buffer"], r["momentum_buffer"])
    assert opt_a["scaler"] == opt_b["scaler"] and a["lr_scheduler"] == b["lr_scheduler"]


def test_deep_train_amp_names_a_model_it_does_not_know(tmp_path):
    config = tmp_path / "config.py"
    config.write_text("BATCH_SIZE = 4\nNUM_EPOCHS = 1\nMODEL = 'vgg'\n")
    with pytest.raises(AssertionError, match=r"\[rank 0\] MODEL must be one of "
                                             r"\['resnet18', 'resnet34'\], got 'vgg'"):
        run_script(ROOT / "train_amp.py", ["--config", str(config), "--data", str(tmp_path)],
                   nproc=1, cwd=tmp_path)


def test_train_amp_default_model_builds_and_classifies():
    sys.path.insert(0, str(ROOT))
    from train_amp import MODELS
    name = nc.load_config(ROOT / "configs" / "amp_cifar10.py").MODEL  # the tutorial's ResNet-34
    model = MODELS[name](num_classes=10).eval()
    assert name == "resnet34" and model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
