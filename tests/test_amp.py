import copy

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import nanocolossal as nc
from nanocolossal import amp, cpu_half
from nanocolossal.amp import AMP_TYPE, DynamicLossScaler
from nanocolossal.config import load_config
from nanocolossal.context import gpc

PATTERN = [False] * 7 + [True] + [False] * 3 + [True, True] + [False] * 10 + [True] + [False] * 9


def _grad_scaler_sequence(pattern, **kwargs) -> list[float]:
    """Drive torch.amp.GradScaler through real steps whose gradient is inf where pattern says so."""
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", **kwargs)
    scales = []
    for overflow in pattern:
        scaler.scale(p.sum()).backward()  # grad = scale
        if overflow:
            p.grad.fill_(float("inf"))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return scales


def test_scaler_sequence_equals_torch_grad_scaler():
    settings = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    ours = DynamicLossScaler(**settings)
    sequence = []
    for overflow in PATTERN:
        ours.update(overflow)
        sequence.append(ours.scale)
    assert sequence == _grad_scaler_sequence(PATTERN, **settings)
    assert len(set(sequence)) > 3  # the pattern really exercises growth and backoff


def test_scaler_hysteresis_tolerates_overflows_until_refilled_by_growth():
    s = DynamicLossScaler(init_scale=8.0, growth_interval=2, hysteresis=2)
    scales = []
    for overflow in [True, True, True, False, False, True, False]:
        s.update(overflow)
        scales.append(s.scale)
    # 1st overflow tolerated; 2nd and 3rd back off; growth after 2 clean steps refills hysteresis;
    # the next overflow is tolerated again.
    assert scales == [8.0, 4.0, 2.0, 2.0, 4.0, 4.0, 4.0]


def test_scaler_respects_min_and_max():
    s = DynamicLossScaler(init_scale=4.0, growth_interval=1, min_scale=2.0, max_scale=16.0)
    for _ in range(5):
        s.update(False)
    assert s.scale == 16.0
    for _ in range(5):
        s.update(True)
    assert s.scale == 2.0


def test_scaler_state_dict_round_trip():
    settings = dict(init_scale=64.0, growth_interval=3, hysteresis=2)
    s = DynamicLossScaler(**settings)
    for overflow in [False, True, False, False]:
        s.update(overflow)
    t = DynamicLossScaler(**settings)
    t.load_state_dict(copy.deepcopy(s.state_dict()))
    for overflow in [True, True, False, False, False, True]:  # restored, it continues identically
        s.update(overflow)
        t.update(overflow)
        assert t.state_dict() == s.state_dict()


def test_scaler_raises_when_the_loss_itself_is_nan():
    s = DynamicLossScaler(init_scale=4.0, min_scale=1.0, max_consecutive_overflows=5)
    for _ in range(4):
        s.update(True)
    with pytest.raises(FloatingPointError,
                       match=r"step 5: gradients overflowed 5 steps in a row .* probably NaN/inf"):
        s.update(True)


def test_scaler_rejects_bad_settings():
    with pytest.raises(ValueError, match="backoff_factor"):
        DynamicLossScaler(backoff_factor=2.0)


def _net(device="cpu"):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(),
                         nn.Linear(32, 4)).to(device)


def _train(model, opt, steps=30, use_scale_loss=False):
    device = next(model.parameters()).device
    # the same data on every device: drawn on the CPU, then moved
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 4, generator=g)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 16, generator=g)
        x, y = x.to(device), (x @ w).to(device)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        if use_scale_loss:
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
        else:
            loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_o2_keeps_fp32_masters_half_model_and_fp32_batchnorm():
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = amp.initialize(model, opt, opt_level="O2")
    assert model[0].weight.dtype == torch.float16 and model[3].weight.dtype == torch.float16
    assert model[1].weight.dtype == torch.float32 and model[1].running_mean.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in opt.params())
    _train(model, opt, steps=5)
    masters = {id(half): master for half, master in opt.master_pairs()}
    assert len(masters) == 4
    for p in model.parameters():
        if p.dtype == torch.float16:
            assert torch.equal(p, masters[id(p)].half()), "half weights are the rounded masters"


@pytest.mark.parametrize("opt_level, dtype", [("O1", torch.float16), ("O2", torch.float16),
                                              ("O1", torch.bfloat16), ("O3", torch.float16)])
def test_mixed_precision_training_tracks_fp32(opt_level, dtype):
    reference = _net()
    ref_losses = _train(reference, torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9))
    model = _net()
    # a scale this loss never overflows
    scaling = {} if dtype == torch.bfloat16 else {"init_scale": 256.0}
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                opt_level, dtype=dtype, **scaling)
    losses = _train(model, opt, use_scale_loss=True)
    assert losses[-1] < 0.2 * losses[0], "it learns"
    assert abs(losses[-1] - ref_losses[-1]) < 0.01 * ref_losses[-1], (losses[-1], ref_losses[-1])
    assert (opt.scaler is None) == (dtype == torch.bfloat16), "bf16 needs no loss scaling"
    assert opt.scaler is None or opt.scaler.consecutive_overflows == 0 and opt.loss_scale == 256.0


def test_overflow_skips_the_step_and_backs_off():
    model = nn.Linear(4, 2)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1",
                                init_scale=1024.0)
    before = copy.deepcopy(model.state_dict())
    opt.backward(model(torch.randn(3, 4)).sum())
    model.weight.grad[0, 0] = float("nan")
    assert opt.step() is False and opt.last_step_skipped
    assert opt.loss_scale == 512.0
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key])
    opt.zero_grad()
    opt.backward(model(torch.randn(3, 4)).sum())
    assert opt.step() is True and not torch.equal(model.weight, before["weight"])


def test_clip_grad_norm_acts_on_unscaled_gradients():
    torch.manual_seed(0)
    plain = nn.Linear(8, 8)
    model = copy.deepcopy(plain)
    x = torch.randn(4, 8)
    (plain(x) ** 2).sum().backward()
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5).item()
    opt = amp.MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                      DynamicLossScaler(init_scale=2.0**12))
    opt.backward((model(x) ** 2).sum())  # gradients are 4096x too large until unscaled
    assert opt.clip_grad_norm(0.5) == pytest.approx(expected, rel=1e-6)
    for p, q in zip(plain.parameters(), model.parameters()):
        assert_close(q.grad, p.grad)


def test_initialize_rejects_unknown_opt_level_and_dtype():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="unknown opt_level 'O4'"):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O4")
    with pytest.raises(ValueError, match="float16 or torch.bfloat16"):
        amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), "O1",
                       dtype=torch.float64)


LEVELS_X_DTYPES_X_SCALERS = [(level, dtype, scale) for level in ("O1", "O2", "O3")
                             for dtype in (torch.float16,
                                           torch.bfloat16) for scale in ("dynamic", None, 256.0)]


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (CI has none)")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_level, dtype, loss_scale", LEVELS_X_DTYPES_X_SCALERS)
def test_every_amp_combination_trains_every_weight(opt_level, dtype, loss_scale, device):
    """O2 without a scaler once never updated the half weights (masters got no gradients)."""
    reference = _net(device)
    ref_losses = _train(reference, torch.optim.SGD(reference.parameters(), lr=0.05, momentum=0.9),
                        steps=20)
    model = _net(device)
    before = {k: v.float().clone() for k, v in model.state_dict().items()}
    # a scale this loss never overflows
    start = {"init_scale": 256.0} if loss_scale == "dynamic" else {}
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                opt_level, loss_scale=loss_scale, dtype=dtype, **start)
    losses = _train(model, opt, steps=20, use_scale_loss=True)
    for name in ("0.weight", "0.bias", "1.weight", "3.weight", "3.bias"):
        assert not torch.equal(model.state_dict()[name].float(),
                               before[name]), f"{name} never trained"
    assert opt.skipped_steps == 0
    assert abs(losses[-1] - ref_losses[-1]) < 0.05 * ref_losses[-1] + 1e-3, (
        losses[-1],
        ref_losses[-1],
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
def test_bf16_skips_a_non_finite_step_without_a_scaler(opt_level, device):
    model = _net(device)
    model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level,
                                dtype=torch.bfloat16)
    assert opt.scaler is None
    before = copy.deepcopy(dict(model.named_parameters()))
    opt.backward(model(torch.randn(8, 16, device=device)).sum())
    model[3].weight.grad[0, 0] = float("inf")
    assert opt.step() is False and opt.last_step_skipped and opt.skipped_steps == 1
    for key, value in model.named_parameters():
        assert torch.equal(value, before[key]), f"{key} took a non-finite step"
    opt.zero_grad()
    opt.backward(model(torch.randn(8, 16, device=device)).sum())
    assert opt.step() is True and not torch.equal(model[3].weight, before["3.weight"])


@pytest.mark.parametrize("bad", [None, float("inf"), float("nan")])
def test_unscale_and_check_equals_torchs_fused_kernel(bad):
    """The plain loop (also the stand-in for bf16 on CUDA, where the fused kernel has no bf16
    version) and the fused kernel give the same gradients and the same flag."""
    grads = [torch.randn(5, 3) * 64, torch.randn(7) * 64]
    if bad is not None:
        grads[1][4] = bad
    ours, fused = [g.clone() for g in grads], [g.clone() for g in grads]
    found_ours, found_fused = torch.zeros(1), torch.zeros(1)
    inv_scale = torch.full((1,), 1 / 64)
    amp.unscale_and_check(ours, found_ours, inv_scale)
    torch._amp_foreach_non_finite_check_and_unscale_(fused, found_fused, inv_scale)
    assert found_ours.item() == found_fused.item() == float(bad is not None)
    for a, b in zip(ours, fused):
        assert_close(a, b, equal_nan=True)


def test_unscale_grads_flags_once_and_unscales_every_dtype_and_shape():
    """Two bad gradients still give a flag of 1 (a flag, not a count), as the fused kernel's; a
    0-d gradient and an fp16 one are unscaled too (one group per dtype)."""
    grads = [torch.tensor(64.0), torch.full((3,), float("inf")), torch.full((2,), 128.0).half(),
             torch.tensor([float("nan"), 32.0])]
    loop = [g.clone() for g in grads]
    found_loop = torch.zeros(1)
    amp.unscale_and_check(loop, found_loop, torch.full((1,), 1 / 32))
    found = amp.unscale_grads(grads, loss_scale=32.0)
    assert found.item() == found_loop.item() == 1.0
    assert grads[0].item() == 2.0 and grads[2].tolist() == [4.0, 4.0]
    assert grads[2].dtype == torch.float16
    for a, b in zip(grads, loop):
        assert_close(a, b, equal_nan=True)
    assert amp.unscale_grads([torch.ones(2)], loss_scale=4.0).item() == 0.0


# Clipping under a loss scaler: clip_grad_norm unscales the gradients, and the step after it must
# not unscale them again (the wrapper remembers it did). Checked against one plain fp32 process
# doing torch's clip_grad_norm_ then step, with a max_norm that clips and one that does not.
CLIP_STEPS, CLIP_LR = 3, 0.1
CLIP_NORMS = {"clips": 0.05, "does not clip": 100.0}


def _clip_net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _clip_batches():
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g))
            for _ in range(CLIP_STEPS)]


def _plain_clip_then_step(max_norm):
    model = _clip_net()
    opt = torch.optim.SGD(model.parameters(), lr=CLIP_LR, momentum=0.9)
    norms, weights = [], [[p.detach().clone() for p in model.parameters()]]  # before each step
    for x, y in _clip_batches():
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        weights.append([p.detach().clone() for p in model.parameters()])
    return weights, norms  # weights: initial, then after each step


def _wrapper_fp32(max_norm, monkeypatch):
    """The wrapper alone on an fp32 model: a power-of-two scale is exact, so results are too."""
    model = _clip_net()
    opt = amp.MixedPrecisionOptimizer(torch.optim.SGD(model.parameters(), lr=CLIP_LR, momentum=0.9),
                                      DynamicLossScaler(init_scale=2.0**12))
    return model, opt, None


def _amp_initialize(opt_level, dtype, loss_scale):
    def make(max_norm, monkeypatch):
        model = _clip_net()
        scale = {"init_scale": 2.0**10} if loss_scale == "dynamic" else {}  # fp16 never overflows
        model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=CLIP_LR,
                                                           momentum=0.9),
                                    opt_level, loss_scale=loss_scale, dtype=dtype, **scale)
        return model, opt, None
    return make


def _config(fp16):
    """nc.initialize with gpc.config = {fp16, clip_grad_norm}: the Engine clips, then steps."""
    def make(max_norm, monkeypatch):
        monkeypatch.setattr(gpc, "config", load_config({"fp16": fp16, "clip_grad_norm": max_norm}))
        model = _clip_net()
        engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=CLIP_LR,
                                                          momentum=0.9),
                                   nn.MSELoss(), verbose=False)
        return engine.model, engine.optimizer, engine
    return make


# (setup, scaler expected, tolerance on the update relative to its size). Unscaling twice divides
# the update by the scale (>= 256 here; under O2 it instead re-reads the scaled fp16 gradients and
# loses the clip), so it misses by ~100% of it, far beyond any of these. bf16 has no scaler: the
# same path without one.
CLIP_SETUPS = {
    "wrapper-fp32-dynamic": (_wrapper_fp32, True, 1e-5),
    "O1-fp16-dynamic": (_amp_initialize("O1", torch.float16, "dynamic"), True, 1e-2),
    "O1-fp16-fixed": (_amp_initialize("O1", torch.float16, 512.0), True, 1e-2),
    "O2-fp16-dynamic": (_amp_initialize("O2", torch.float16, "dynamic"), True, 1e-2),
    "O1-bf16-dynamic": (_amp_initialize("O1", torch.bfloat16, "dynamic"), False, 5e-2),
    "config-torch-fp16": (_config({"mode": AMP_TYPE.TORCH, "dtype": "float16",
                                   "init_scale": 2.0**10}), True, 1e-2),
    "config-apex-O2-fp16-fixed": (_config({"mode": AMP_TYPE.APEX, "opt_level": "O2",
                                           "dtype": "float16", "loss_scale": 256.0}), True, 1e-2),
}


@pytest.mark.parametrize("clip", list(CLIP_NORMS))
@pytest.mark.parametrize("setup", list(CLIP_SETUPS))
def test_clip_then_step_under_a_loss_scaler_equals_plain_clip_then_step(setup, clip, monkeypatch):
    """Once unscaled for clipping, the gradients are not unscaled again by step()."""
    max_norm = CLIP_NORMS[clip]
    expected, ref_norms = _plain_clip_then_step(max_norm)
    if clip == "clips":
        assert all(n > 2 * max_norm for n in ref_norms), ("the clip really clips", ref_norms)
    else:
        assert all(n < max_norm / 2 for n in ref_norms), ("the clip leaves them be", ref_norms)
    make, scaled, tol = CLIP_SETUPS[setup]
    model, opt, engine = make(max_norm, monkeypatch)
    assert (opt.scaler is not None) == scaled and (not scaled or opt.loss_scale > 1)
    masters = list(opt.params())  # the fp32 weights the optimizer updates (O2: the masters)
    initial = [p.detach().float().clone() for p in masters]  # (O2: the rounded fp16 weights)
    for step, ((x, y), ref_norm, ref_weights) in enumerate(zip(_clip_batches(), ref_norms,
                                                                expected[1:])):
        if engine is not None:
            engine.zero_grad()
            engine.execute_schedule((x, y))
            assert engine.step(), "a step is taken (no overflow here)"
            norm = engine.last_grad_norm
        else:
            opt.zero_grad()
            with amp.scale_loss(nn.functional.mse_loss(model(x), y), opt) as scaled_loss:
                scaled_loss.backward()
            norm = opt.clip_grad_norm(max_norm)
            assert opt.step(), "a step is taken (no overflow here)"
        assert norm == pytest.approx(ref_norm, rel=tol), f"step {step}: the true gradients' norm"
        # the updates so far (not the weights, which they barely move) equal plain fp32's
        ours = torch.cat([(p.detach().float() - p0).flatten() for p, p0 in zip(masters, initial)])
        ref = torch.cat([(p - p0).flatten() for p, p0 in zip(ref_weights, expected[0])])
        assert (ours - ref).norm() <= tol * ref.norm(), (
            f"{setup}, max_norm={max_norm}, step {step}: the weights moved {ours.norm():.4g}, "
            f"plain fp32's {ref.norm():.4g}")
    assert opt.skipped_steps == 0
    if tol <= 1e-5:
        for p, q in zip(masters, expected[-1]):
            assert_close(p.detach(), q)


def test_cpu_half_dtype_follows_the_instruction_set_not_a_timing(monkeypatch):
    """bf16 exactly where the CPU has bfloat16 instructions, however busy the machine is: a run
    and its resumed half must compute alike. Decided once, then cached until reset."""
    monkeypatch.setattr(cpu_half, "_cache", {})  # this test's own cache; the real one is kept
    asked, real = [], cpu_half.has_bf16_instructions
    for native, expected in ((True, torch.bfloat16), (False, None)):
        monkeypatch.setattr(cpu_half, "has_bf16_instructions",
                            lambda native=native: asked.append(1) or native)
        cpu_half.reset_cpu_half_dtype()
        assert [cpu_half.cpu_half_dtype() for _ in range(3)] == [expected] * 3
        assert cpu_half.stored_choice() == str(expected or torch.float32).removeprefix("torch.")
    assert len(asked) == 2, "asked once per job, then cached"
    has_avx512_bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert real() == has_avx512_bf16
