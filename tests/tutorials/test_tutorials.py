"""The tutorials' own code (the Engine/Trainer and pipeline tutorials), with only `colossalai` ->
`nanocolossal` changed (and `.cuda()` removed), run on 2 CPU ranks for one epoch on tiny CIFAR-10
files in torchvision's real format, whose test set leaves a last batch smaller than the others.

The ranks start as torchrun starts them (RANK, WORLD_SIZE, ... in the environment, the tutorial
run as `__main__` in its folder), forked from a process that imported torch already
(dist_helpers.run_script); the `torchrun` command line itself is tested in test_launch.py.
Diff engine_resnet.py / trainer_resnet.py / pipeline_resnet.py against the tutorials to see that
nothing else changed. These train ResNets, so they are marked slow and sit outside `-k gloo`.
"""
import re
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from cifar_files import write_cifar  # noqa: E402
from dist_helpers import run_script  # noqa: E402

HERE = Path(__file__).resolve().parent
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _run(tmp_path, tutorial, env=None):
    shutil.copy(HERE / tutorial, tmp_path / tutorial)
    out = run_script(HERE / "run_tutorial.py", [tutorial], nproc=2, cwd=tmp_path, timeout=280,
                     env=env)
    return out.replace("\r", "\n")


@pytest.fixture
def engine_dir(tmp_path):
    """The Engine/Trainer tutorial's layout: config.py and ./data beside the script (1 epoch of
    batch 16)."""
    config = (HERE / "config.py").read_text().replace("BATCH_SIZE = 128", "BATCH_SIZE = 16")
    (tmp_path / "config.py").write_text(config.replace("NUM_EPOCHS = 200", "NUM_EPOCHS = 1"))
    # 40 train images; test batches of 16 and 2
    write_cifar(tmp_path / "data", per_batch=8, test_size=18)
    return tmp_path


def test_tutorial_engine_loop(engine_dir):
    out = _run(engine_dir, "engine_resnet.py")
    assert re.search(r"initialize: AMP O1 \(TORCH\)( in float32 on this CPU)?, DDP x2", out), out
    assert re.search(r"Epoch 0 - train loss: [0-9.]+, test loss: [0-9.e+-]+, acc: [0-9.]+, lr: ",
                     out), out


def test_tutorial_trainer_with_hooks(engine_dir):
    shutil.copy(HERE / "engine_resnet.py", engine_dir / "engine_resnet.py")
    out = _run(engine_dir, "trainer_resnet.py")
    assert re.search(r"epoch 1 train: .*loss [0-9.]+.*time: epoch", out), out
    assert re.search(r"epoch 1 test: loss [0-9.e+-]+, accuracy [0-9.]+", out), out
    assert "epoch 1 memory" in out


def test_tutorial_pipeline_resnet50(tmp_path):
    # 80 train; test batches of 64 and 6 (M = 4)
    write_cifar(tmp_path / "data", per_batch=16, test_size=70)
    out = _run(tmp_path, "pipeline_resnet.py",
               env={"DATA": str(tmp_path / "data"), "TUTORIAL_EPOCHS": "1"})
    assert "initialize: pipeline 1f1b x2 stages, 4 micro-batches" in out, out
    accuracy = re.search(r"epoch 1 test: loss [0-9.e+-]+, accuracy ([0-9.]+)", out)
    assert accuracy, out
    # the last test batch of 6 does not split into 4 equal micro-batches: it must still count
    assert round(float(accuracy.group(1)) * 70) == pytest.approx(
        float(accuracy.group(1)) * 70, abs=1e-3
    ), "accuracy is a count over all 70 test images"
