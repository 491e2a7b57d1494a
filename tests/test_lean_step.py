"""The Engine's step asks the device nothing unless it must decide (amp.py: step).

A host read of a device tensor (`.item()`, `bool(t)`, `float(t)`) makes the CPU wait for the
GPU, so the next step cannot be queued while this one runs. Clipping keeps its norm on the
device (engine.last_grad_norm reads it when asked); the non-finite check keeps its flag there,
and an optimizer that skips on its own (torch's fused AdamW, the flag as `found_inf`) steps
without reading it. A plain optimizer needs the host to decide: one read per step. On CPU the
reads are counted; on CUDA the sync debug mode refuses any synchronisation.
"""
import copy

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import nanocolossal as nc
from nanocolossal.amp import AMP_TYPE, MixedPrecisionOptimizer
from nanocolossal.config import load_config
from nanocolossal.context import gpc

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (CI has none)")
READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


def _net(device="cpu"):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4)).to(device)


def _batch(step, device="cpu"):
    g = torch.Generator().manual_seed(step)
    return torch.randn(16, 8, generator=g).to(device), torch.randint(0, 4, (16,), generator=g).to(
        device)


def test_a_fused_optimizer_skips_on_the_device_as_the_host_would():
    """bf16's path (no scaler, a non-finite check): fused AdamW told by the flag, against the
    host deciding for a plain AdamW. The same steps are skipped, the weights and the state
    agree, and only the fused one returns its answer as a tensor."""
    runs = []
    for fused in (True, False):
        model = _net()
        opt = MixedPrecisionOptimizer(torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused),
                                      check_finite=True)
        taken = []
        for step in range(4):
            x, y = _batch(step)
            opt.zero_grad()
            opt.backward(nn.functional.cross_entropy(model(x), y))
            if step == 1:
                model[2].weight.grad[0, 0] = float("inf")
            before = copy.deepcopy(model.state_dict())
            taken.append(opt.step())
            if step == 1:  # nothing moved
                for key, value in model.state_dict().items():
                    assert torch.equal(value, before[key]), key
        runs.append((model, opt, taken))
    (fused_model, fused_opt, fused_taken), (model, opt, taken) = runs
    assert all(torch.is_tensor(t) for t in fused_taken) and taken == [True, False, True, True]
    assert [bool(t) for t in fused_taken] == taken
    assert fused_opt.skipped_steps == opt.skipped_steps == 1
    assert not fused_opt.last_step_skipped and not opt.last_step_skipped
    for p, q in zip(fused_model.parameters(), model.parameters()):
        assert_close(p, q)
        assert fused_opt.optimizer.state[p]["step"] == opt.optimizer.state[q]["step"] == 3
        assert_close(fused_opt.optimizer.state[p]["exp_avg"], opt.optimizer.state[q]["exp_avg"])


def _engine(fp16, fused, monkeypatch, device="cpu"):
    """nc.initialize on one process: the config's AMP, clipping that really clips."""
    config = {"clip_grad_norm": 0.1, **({"fp16": fp16} if fp16 else {})}
    monkeypatch.setattr(gpc, "config", load_config(config))
    monkeypatch.setattr(gpc, "device", torch.device(device))
    model = _net(device)
    kernel = {"fused": True} if fused else {"foreach": True}
    engine, *_ = nc.initialize(model, torch.optim.AdamW(model.parameters(), lr=0.1, **kernel),
                               nn.CrossEntropyLoss(), verbose=False)
    return engine


def _train_step(engine, step):
    engine.zero_grad()
    engine.execute_schedule(_batch(step, gpc.device))
    return engine.step()


BF16 = {"mode": AMP_TYPE.TORCH, "dtype": "bfloat16"}
FP16 = {"mode": AMP_TYPE.TORCH, "dtype": "float16"}
# name: (fp16 config, fused AdamW, host reads in a step)
STEPS = {
    "fp32": (None, True, 0),
    "fp32 foreach": (None, False, 0),  # nothing to decide
    "bf16 fused": (BF16, True, 0),      # the flag goes to the optimizer
    "bf16 foreach": (BF16, False, 1),   # the host decides whether to step
    "fp16 fused": (FP16, True, 1),      # the loss scaler's update needs the flag on the host
}


@pytest.mark.parametrize("case", list(STEPS))
def test_the_engine_step_reads_the_device_only_to_decide(case, monkeypatch):
    fp16, fused, expected = STEPS[case]
    engine = _engine(fp16, fused, monkeypatch)
    _train_step(engine, 0)  # the optimizer's state exists
    reads, inner = [], engine.optimizer.optimizer
    step, outside = inner.step, [True]

    def own_step():  # torch's optimizer reads its CPU step counts; a bare loop runs it too
        outside[0] = False
        step()
        outside[0] = True
    with monkeypatch.context() as m:
        m.setattr(inner, "step", own_step)
        for name in READS:
            method = getattr(torch.Tensor, name)
            m.setattr(torch.Tensor, name, lambda t, *a, _n=name, _f=method:
                      (outside[0] and reads.append(_n)) or _f(t, *a))
        _train_step(engine, 1)
    assert len(reads) == expected, reads
    assert engine.last_grad_norm > 0.1, "the clip really clips (and its norm is read now)"
    assert engine.optimizer.skipped_steps == 0


@CUDA
@pytest.mark.parametrize("case", ["fp32", "bf16 fused"])
def test_cuda_the_engine_step_does_not_synchronise(case, monkeypatch):
    """torch.cuda.set_sync_debug_mode('error') raises on any cudaStreamSynchronize and any
    blocking copy between host and device."""
    fp16, fused, _ = STEPS[case]
    engine = _engine(fp16, fused, monkeypatch, device="cuda")
    batch = _batch(1, "cuda")
    _train_step(engine, 0)
    engine.zero_grad()
    engine.execute_schedule(batch)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        taken = engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert bool(taken) and engine.last_grad_norm > 0.1


class _CountCalls(torch.overrides.TorchFunctionMode):
    """Counts the torch ops Python calls (each a dispatch on the host, a launch on a GPU);
    reads of a tensor's metadata (numel, device, dtype) dispatch nothing and are not counted."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name not in ("__get__", "numel"):
            self.calls.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.bfloat16,), (torch.float64,)])
def test_the_non_finite_check_costs_the_host_the_same_for_any_number_of_gradients(dtypes):
    """bf16's check (no scaler): one fused norm over the list and a few ops on its result, as
    many torch calls for 200 gradients as for 2 -- and it still finds a NaN in the last one."""
    from nanocolossal.amp_scaler import find_non_finite
    counts = []
    for n in (2, 200):
        grads = [torch.ones(3, dtype=dtypes[i % len(dtypes)]) for i in range(n)]
        grads[-1][1] = float("nan")
        found = torch.zeros(1)
        with _CountCalls() as mode:
            find_non_finite(grads, found)
        counts.append(len(mode.calls))
        assert found.item() == 1.0
    assert counts[0] == counts[1], counts


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float64), (torch.bfloat16,
                                                                     torch.float64)])
def test_the_non_finite_check_on_mixed_dtypes_finds_only_what_is_not_finite(dtypes):
    """A list of several dtypes is compared in float64: a finite float64 gradient beyond fp32's
    range is not an overflow, and an inf in the half one still is."""
    from nanocolossal.amp_scaler import find_non_finite
    grads = [torch.ones(3, dtype=dtypes[0]), torch.full((2,), 1e300, dtype=dtypes[1])]
    found = torch.zeros(1)
    find_non_finite(grads, found)
    assert found.item() == 0.0
    grads[0][2] = float("inf")
    find_non_finite(grads, found)
    assert found.item() == 1.0
