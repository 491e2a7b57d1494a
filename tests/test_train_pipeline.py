"""train_pipeline.py end to end on 2 ranks started as torchrun would (short synthetic runs)."""
import json
import re
import sys

import pytest
import torch
from dist_helpers import ROOT, run_script
from torch import nn

from nanocolossal.pipeline.plan import PlanError, check_sizes


def _train(tmp_path, *args):
    # 2 batches of 16 (4 micro-batches of 4): the trace records the second
    return run_script(ROOT / "train_pipeline.py",
                      ["--epochs", "1", "--synthetic-size", "32", "--batch-size", "16",
                       "--data", str(tmp_path), *args], nproc=2, cwd=tmp_path)


@pytest.mark.timeout(200)
def test_gloo_train_pipeline_1f1b_logs_loss_accuracy_and_writes_a_trace(tmp_path):
    # the main job's flags on ResNet-18 (ResNet-50's build: test_model_choices_are_flat_...)
    out = _train(tmp_path, "--trace", str(tmp_path / "trace.json"), "--model",
                 "resnet18").replace("\r", "\n")
    assert "initialize: pipeline 1f1b x2 stages, 4 micro-batches" in out
    assert re.search(r"epoch 1 train: .*loss [0-9.]+",
                     out) and re.search(r"epoch 1 test: loss [0-9.]+, accuracy", out)
    events = [
        e
        for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
        if e["ph"] == "X"
    ]
    for rank in (0, 1):
        names = [e["name"] for e in events if e["pid"] == rank]
        assert {"F0", "F3", "B0", "B3"} <= set(names), names


@pytest.mark.timeout(200)
@pytest.mark.parametrize("flags, schedule", [(["--chunks", "2"], "interleaved"),
                                             (["--schedule", "zbv"], "zbv")],
                         ids=["interleaved", "zbv"])
def test_deep_train_pipeline_two_chunks_a_rank(tmp_path, flags, schedule):
    # ResNet-18: the schedule is what is new here, and its 10 layers cut into 2 x 2 chunks as well
    # (--schedule zbv takes its two chunks without --chunks)
    out = _train(tmp_path, *flags, "--partition", "parameters", "--model",
                 "resnet18").replace("\r", "\n")
    assert f"initialize: pipeline {schedule} x2 stages, 4 micro-batches, 2 chunk(s)" in out
    assert "test accuracy" in out


def _script_config(*flags):
    sys.path.insert(0, str(ROOT))
    from train_pipeline import build_config, parse_args
    return build_config(parse_args(list(flags)))


def test_schedule_zbv_takes_two_chunks_unless_told_otherwise():
    """`--schedule zbv` alone runs the V's two chunks a rank (the config file's NUM_CHUNKS = 1
    is for its own 1F1B), as `python -m nanocolossal.pipeline --show` does; a --chunks given is
    kept, so a wrong one is refused when the schedule is planned, not quietly replaced."""
    cfg = _script_config("--schedule", "zbv")
    assert (cfg.PIPELINE_SCHEDULE, cfg.NUM_CHUNKS) == ("zbv", 2)
    check_sizes("zbv", cfg.parallel["pipeline"], cfg.NUM_MICRO_BATCHES, cfg.NUM_CHUNKS)
    assert _script_config().NUM_CHUNKS == 1  # other schedules keep the file's
    cfg = _script_config("--schedule", "zbv", "--chunks", "3")
    with pytest.raises(PlanError, match=r"zbv runs two chunks per rank .*NUM_CHUNKS=3; set "
                                        r"NUM_CHUNKS=2"):
        check_sizes("zbv", cfg.parallel["pipeline"], cfg.NUM_MICRO_BATCHES, cfg.NUM_CHUNKS)


def test_model_choices_are_flat_sequentials_and_a_bad_name_is_named():
    sys.path.insert(0, str(ROOT))
    from train_pipeline import resnet
    for name, layers in (("resnet18", 1 + 8 + 1), ("resnet50", 1 + 16 + 1)):
        model = resnet(name)  # stem, one layer per residual block, classifier: cut anywhere
        assert isinstance(model, nn.Sequential) and len(model) == layers
        assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    with pytest.raises(ValueError, match=r"MODEL must be one of .*'resnet50'\], got 'vgg'"):
        resnet("vgg")
