"""bench/bench_gpt_gpu.py runs where CI runs: on the CPU with its tiny shape (no timing asserted).

Its figures mean something on a GPU only (bench/gpu_check.sh); here the four sides train the
same shape, the Engine and the bare loops start from the same weights (so their losses agree),
and the JSON holds every field the table and the goals are read from.
"""
import json
import sys

import pytest
from dist_helpers import ROOT, run_cmd

SIDE_FIELDS = {"ms", "tokens_per_s", "mfu", "peak_gib", "last_loss", "params"}


def _bench(*args):
    """`python -m bench_gpt_gpu ARGS` in bench/ (run_cmd forks a `-m` from a process that
    imported torch already)."""
    return run_cmd([sys.executable, "-m", "bench_gpt_gpu", *args], timeout=100,
                   cwd=ROOT / "bench")


@pytest.mark.timeout(120)
def test_the_gpu_bench_runs_on_the_cpu_and_writes_its_json(tmp_path):
    out = tmp_path / "gpt_gpu.json"
    result = _bench("--cpu-small", "--steps", "2", "--warmup", "1", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    data = json.loads(out.read_text())
    assert data["benchmark"] == "gpt_gpu" and data["compile"] is False
    assert data["shape"] == {"dim": 64, "layers": 2, "heads": 4, "seq": 64, "batch": 2,
                             "vocab": 512}
    assert set(data["sides"]) == {"engine", "bare", "bare_fp32_loss", "reference"}
    for name, side in data["sides"].items():
        assert set(side) == SIDE_FIELDS, name
        assert side["ms"] > 0 and side["tokens_per_s"] > 0, name
        assert side["params"] == data["params"], "the three models have the same size"
    N, shape = data["params"], data["shape"]
    assert data["flops_per_token"] == 6 * N + 12 * shape["layers"] * shape["dim"] * shape["seq"]
    engine = data["sides"]["engine"]
    for bare in ("bare", "bare_fp32_loss"):  # the same module from the same weights
        assert engine["last_loss"] == pytest.approx(data["sides"][bare]["last_loss"], rel=1e-2)
    assert set(data["ratios"]) == {
        "engine_over_reference_time", "engine_over_reference_memory", "engine_over_bare_time",
        "engine_over_bare_fp32_loss_time", "engine_over_bare_fp32_loss_memory"}
    assert [g["goal"] for g in data["goals"]] == [
        "engine / reference time <= 1.05", "engine / reference memory <= 1.1",
        "engine / bare time <= 1.03", "engine / bare_fp32_loss time <= 1.03"]
    assert "goal engine / bare time <= 1.03" in result.stdout


def test_host_bound_without_a_gpu_is_refused_saying_why():
    result = _bench("--host-bound", "--cpu-small")
    assert result.returncode == 2
    assert "--host-bound measures what a GPU's host spends launching a step" in result.stdout
