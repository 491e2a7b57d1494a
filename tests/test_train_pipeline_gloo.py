"""train_pipeline.py end to end under a real torchrun with 2 ranks (short runs on the synthetic stand-in)."""
import json
import re
import sys

import pytest
from dist_helpers import ROOT, free_port, run_cmd


def _torchrun(tmp_path, *args):
    return run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                    "--master_port", str(free_port()), str(ROOT / "train_pipeline.py"), "--epochs", "1",
                    "--synthetic-size", "256", "--batch-size", "32", "--data", str(tmp_path), *args],
                   timeout=150, cwd=tmp_path)


@pytest.mark.timeout(200)
def test_gloo_train_pipeline_1f1b_logs_loss_accuracy_and_writes_a_trace(tmp_path):
    result = _torchrun(tmp_path, "--trace", str(tmp_path / "trace.json"))
    out = result.stdout.replace("\r", "\n")
    assert result.returncode == 0, out
    assert "initialize: pipeline 1f1b x2 stages, 4 micro-batches" in out
    assert re.search(r"epoch 1 train: .*loss [0-9.]+", out) and re.search(r"epoch 1 test: loss [0-9.]+, accuracy", out)
    events = [e for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    for rank in (0, 1):
        names = [e["name"] for e in events if e["pid"] == rank]
        assert {"F0", "F3", "B0", "B3"} <= set(names), names


@pytest.mark.timeout(200)
def test_gloo_train_pipeline_interleaved(tmp_path):
    result = _torchrun(tmp_path, "--chunks", "2", "--partition", "parameters")
    out = result.stdout.replace("\r", "\n")
    assert result.returncode == 0, out
    assert "initialize: pipeline interleaved x2 stages, 4 micro-batches, 2 chunk(s)" in out
    assert "test accuracy" in out
