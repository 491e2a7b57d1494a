"""train_ddp.py end to end on 2 ranks, on the synthetic stand-in (no MNIST here)."""
import re

import pytest
from dist_helpers import ROOT, run_script


@pytest.mark.timeout(150)
@pytest.mark.parametrize("extra", [[], ["--sync-bn", "--debug"]], ids=["ddp", "ddp-syncbn-debug"])
def test_deep_train_ddp_two_ranks_learns(tmp_path, extra):
    out = run_script(ROOT / "train_ddp.py",
                     ["--epochs", "1", "--synthetic-size", "2400", "--data", str(tmp_path),
                      *extra], nproc=2, cwd=tmp_path, timeout=120)
    assert "synthetic MNIST-shaped stand-in" in out
    assert f"sync_bn={bool(extra)}" in out
    assert ("timeout 300 s, debug mode" in out) == ("--debug" in extra)
    accuracy = float(re.search(r"final test accuracy ([0-9.]+)", out).group(1))
    assert accuracy > 0.6, f"test accuracy {accuracy} (chance is 0.1)"
