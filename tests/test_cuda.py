"""The CUDA path: nccl, cuda:local_rank, fp16 autocast with a real GradScaler beside ours.

CI has no GPU, so every test here skips there; they run where one is visible
(`pytest tests/test_cuda.py tests/test_amp.py`). The AMP matrix of test_amp.py also runs on CUDA.
"""
import re
import sys

import pytest
import torch
import torch.distributed as dist
from dist_helpers import ROOT, free_port, run_cmd, run_ranks
from torch import nn
from torch.testing import assert_close

import nanocolossal as nc
from nanocolossal import amp
from nanocolossal.context import gpc

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="no CUDA device here (CI has none)"),
              pytest.mark.timeout(300)]


def _launch_worker(rank, world_size, port):
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    t = torch.full((3,), float(rank + 1), device=gpc.device)
    dist.all_reduce(t)
    return gpc.backend, str(gpc.device), gpc.local_rank, t.device.type, t.tolist()


def test_cuda_launch_picks_nccl_and_the_local_gpu():
    backend, device, local_rank, where, total = run_ranks(_launch_worker, 1, cuda=True,
                                                          timeout=120)[0]
    assert (backend, device, local_rank, where,
            total) == ("nccl", "cuda:0", 0, "cuda", [1.0, 1.0, 1.0])


def test_cuda_o1_fp16_equals_torch_autocast_with_grad_scaler():
    """Ours (O1, dynamic scale) and torch's recipe skip the same steps and scale alike; the weights
    agree to fp16 tolerance (one bias element differed by 1.5e-5 after 12 steps on an H100)."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10)).cuda()
    theirs = [p.detach().clone().requires_grad_() for p in plain.parameters()]
    # starts too high: the first steps overflow
    settings = dict(init_scale=2.0**24, growth_interval=4)
    model, opt = amp.initialize(plain, torch.optim.SGD(plain.parameters(), lr=0.1), "O1",
                                **settings)
    ref_model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10)).cuda()
    for p, q in zip(ref_model.parameters(), theirs):
        p.data = q.data
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cuda", **settings)
    g = torch.Generator().manual_seed(1)
    ours_scales, torch_scales = [], []
    for _ in range(12):
        x = torch.randn(32, 64, generator=g).cuda()
        y = torch.randint(0, 10, (32,), generator=g).cuda()
        opt.zero_grad()
        opt.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
        ours_scales.append(opt.loss_scale)
        ref_opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = nn.functional.cross_entropy(ref_model(x), y)
        scaler.scale(loss).backward()
        scaler.step(ref_opt)
        scaler.update()
        torch_scales.append(scaler.get_scale())
    assert ours_scales == torch_scales and opt.skipped_steps > 0, (ours_scales, opt.skipped_steps)
    for ours, ref in zip(model.parameters(), ref_model.parameters()):
        assert_close(ours, ref, rtol=1e-3, atol=1e-4)


def _script(tmp_path, script, *args, nproc=1):
    result = run_cmd([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                      "--master_port", str(free_port()), str(ROOT / script), "--data",
                      str(tmp_path), *args],
                     timeout=240, cwd=tmp_path, cuda=True)
    out = result.stdout.replace("\r", "\n")
    assert result.returncode == 0, out
    return out


def test_cuda_train_amp_uses_fp16_autocast_on_the_gpu(tmp_path):
    out = _script(tmp_path, "train_amp.py", "--epochs", "1", "--synthetic-size", "512",
                  "--batch-size", "64")
    assert "initialize: AMP O1 (TORCH)" in out and "on this CPU" not in out, out
    assert "backend nccl, device cuda" in out, out


def test_cuda_train_ddp_with_syncbn_learns(tmp_path):
    out = _script(tmp_path, "train_ddp.py", "--epochs", "1", "--synthetic-size", "2400",
                  "--sync-bn")
    assert float(re.search(r"final test accuracy ([0-9.]+)", out).group(1)) > 0.6, out


def test_cuda_train_tensor_single_gpu(tmp_path):
    config = tmp_path / "one_gpu.py"
    config.write_text("BATCH_SIZE = 32\nNUM_EPOCHS = 1\n")  # the tutorial's config asks for 8 GPUs
    out = _script(tmp_path, "train_tensor.py", "--config", str(config), "--max-steps", "5",
                  "--synthetic-size", "256")
    assert re.search(r"final train loss [0-9.]+", out), out
