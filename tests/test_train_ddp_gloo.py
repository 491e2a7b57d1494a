"""train_ddp.py end to end under a real torchrun, on the synthetic stand-in (no MNIST here)."""
import re
import sys

import pytest
from dist_helpers import ROOT, free_port, run_cmd


@pytest.mark.timeout(150)
@pytest.mark.parametrize("extra", [[], ["--sync-bn", "--debug"]], ids=["ddp", "ddp-syncbn-debug"])
def test_gloo_train_ddp_two_ranks_learns(tmp_path, extra):
    result = run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                      "--master_port", str(free_port()), str(ROOT / "train_ddp.py"), "--epochs", "1",
                      "--synthetic-size", "2400", "--data", str(tmp_path), *extra], timeout=120, cwd=tmp_path)
    assert result.returncode == 0, result.stdout
    assert "synthetic MNIST-shaped stand-in" in result.stdout
    assert f"sync_bn={bool(extra)}" in result.stdout
    assert ("timeout 300 s, debug mode" in result.stdout) == ("--debug" in extra)
    accuracy = float(re.search(r"final test accuracy ([0-9.]+)", result.stdout).group(1))
    assert accuracy > 0.6, f"test accuracy {accuracy} (chance is 0.1)"
