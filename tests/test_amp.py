import copy
import sys

import pytest
import torch
from amp_probes import (
    BATCH,
    DIM,
    MODELS,
    MODES,
    SEQ,
    VOCAB,
    install_probes,
    patch_attention,
    probe_batches,
    probed_criterion,
)
from dist_helpers import ROOT, run_ranks
from models import my_share
from run_records import record_run, record_steps
from torch import nn
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal import amp, cpu_half
from nanocolossal.amp import AMP_TYPE, DynamicLossScaler
from nanocolossal.config import load_config
from nanocolossal.context import gpc
from nanocolossal.pipeline import build_pipeline_model

sys.path.insert(0, str(ROOT))
from train_gpt import gpt  # noqa: E402

PATTERN = [False] * 7 + [True] + [False] * 3 + [True, True] + [False] * 10 + [True] + [False] * 9


def _lesson_worker(rank, world_size, port, xs, ys):
    nc.launch(dict(fp16=dict(mode=AMP_TYPE.TORCH, dtype="bfloat16")), rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    torch.manual_seed(0)  # every rank builds the model the reference builds
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))  # fp32 weights (O1)
    computed_in = set()
    model[0].register_forward_hook(lambda module, args, out: computed_in.add(out.dtype))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    engine, *_ = nc.initialize(model, optimizer, nn.CrossEntropyLoss(), verbose=False)
    for x, y in zip(xs, ys):
        x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]  # my half of the batch
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))  # forward under autocast, loss in fp32
        engine.step()
    return engine.model.state_dict(), computed_in


def test_gloo_amp_bf16_on_two_data_ranks_tracks_one_process():
    """Mixed precision (O1: autocast to bfloat16, fp32 weights) on 2 data ranks tracks one
    process's autocast run on the whole batch, to bf16's rounding of the half-batch sums."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    xs, ys = torch.randn(3, 8, 4), torch.randint(0, 3, (3, 8))  # 3 batches
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for x, y in zip(xs, ys):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        nn.functional.cross_entropy(out.float(), y).backward()
        optimizer.step()
    for rank, (state, computed_in) in enumerate(run_ranks(_lesson_worker, 2, xs, ys)):
        assert computed_in == {torch.bfloat16}
        assert_close(state, model.state_dict(), rtol=0, atol=3e-3,
                     msg=lambda m: f"rank {rank}: {m}")


def _o1_worker(rank, world_size, port, x, y, as_function, dtype):
    # fp16: a loss scale of 1, so that the gradients compare as they are
    nc.launch(dict(fp16=dict(mode=AMP_TYPE.TORCH, dtype=dtype, init_scale=1.0)), rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    criterion = nn.functional.cross_entropy if as_function else nn.CrossEntropyLoss()
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5), criterion,
                               verbose=False)
    output, _, loss = engine.execute_schedule((x, y))
    return output.dtype, loss, [p.grad for p in engine.model.parameters()]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("as_function", [False, True], ids=["module", "function"])
def test_o1_engine_runs_the_loss_under_autocast_and_keeps_no_fp32_output(as_function, dtype):
    """O1 under the Engine: the output stays half as autocast made it (no fp32 copy of the logits
    held through backward), the criterion runs under autocast, which computes cross-entropy in
    fp32: the loss and gradients are those of the fp32 loss on the cast output."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with torch.autocast("cpu", dtype=getattr(torch, dtype)):
        out = model(x)
    loss = nn.functional.cross_entropy(out.float(), y)
    loss.backward()
    got_dtype, engine_loss, grads = run_ranks(_o1_worker, 1, x, y, as_function, dtype)[0]
    assert got_dtype == getattr(torch, dtype)
    assert engine_loss.dtype == torch.float32
    assert_close(engine_loss, loss.detach(), rtol=0, atol=0)
    assert_close(grads, [p.grad for p in model.parameters()], rtol=0, atol=0)


def _reused_criterion_worker(rank, world_size, port, x, y):
    nc.launch(dict(fp16=dict(mode=AMP_TYPE.TORCH, dtype="bfloat16")), rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    criterion = nn.CrossEntropyLoss()
    for _ in range(2):  # two engines, one criterion object
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5),
                                   criterion, verbose=False)
    _, _, loss = engine.execute_schedule((x, y))
    grads = [p.grad.clone() for p in engine.model.parameters()]
    engine.step()
    after = torch.is_autocast_enabled("cpu"), nn.Linear(4, 3)(x).dtype  # what runs next
    return loss, grads, after


@pytest.mark.timeout(60)
def test_o1_criterion_shared_by_two_engines_leaves_autocast_off_after_the_loss():
    """A criterion object passed to two initialize calls: the second engine's loss and gradients
    are one process's, and autocast is off after the step (before: the criterion's two autocast
    hooks left in the order they entered, and autocast stayed on for whatever ran next -- an
    evaluation, another fp32 model: its Linear computed in bf16)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    loss = nn.functional.cross_entropy(out.float(), y)
    loss.backward()
    engine_loss, grads, after = run_ranks(_reused_criterion_worker, 1, x, y)[0]
    assert after == (False, torch.float32)
    assert_close(engine_loss, loss.detach(), rtol=0, atol=0)
    assert_close(grads, [p.grad for p in model.parameters()], rtol=0, atol=0)


def test_a_model_prepared_twice_for_o1_leaves_autocast_off_after_its_forward():
    """amp.initialize twice on one model (two initialize calls): its autocasts are left innermost
    first, so autocast is off after the forward and the next fp32 model computes in fp32."""
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        amp.initialize(model, optimizer, "O1", dtype=torch.bfloat16)
    out = model(torch.randn(2, 4))
    assert out.dtype == torch.float32  # the apex-style output cast
    assert not torch.is_autocast_enabled("cpu")
    assert nn.Linear(4, 3)(torch.randn(2, 4)).dtype == torch.float32


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


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_amp_trains_when_the_default_dtype_is_float64(opt_level):
    """A float64 default dtype leaves the overflow flag and 1/S in fp32, as torch's fused unscale
    kernel needs; an O1 model in float64 stays float64 (autocast skips it), output included."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        before = copy.deepcopy(model)
        model, opt = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                    opt_level)
        out = model(torch.randn(8, 4))
        with amp.scale_loss(nn.functional.cross_entropy(out, torch.tensor([0, 1] * 4)),
                            opt) as scaled:
            scaled.backward()
        opt.step()
    finally:
        torch.set_default_dtype(previous)
    assert out.dtype == (torch.float64 if opt_level == "O1" else torch.float32)
    moved = [not torch.equal(a.double(), b.double())
             for a, b in zip(model.parameters(), before.parameters())]
    assert all(moved), moved


def _float64_worker(rank, world_size, port, config):
    torch.set_default_dtype(torch.float64)  # (the pool resets it after the job)
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    before = copy.deepcopy(model.state_dict())
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               nn.CrossEntropyLoss(), verbose=False)
    torch.manual_seed(1 + rank)  # each rank its own batches
    for _ in range(2):
        engine.zero_grad()
        engine.execute_schedule((torch.randn(8, 4), torch.randint(0, 3, (8,))))
        assert engine.step()
    moved = [not torch.equal(a, b) for a, b in zip(engine.model.state_dict().values(),
                                                   before.values())]
    return moved, {k: v.double() for k, v in engine.model.state_dict().items()}


@pytest.mark.parametrize("mode", ["TORCH", "NAIVE"])
def test_gloo_amp_engine_on_two_ranks_when_the_default_dtype_is_float64(mode):
    """The whole engine path -- fp16 loss scaling, the overflow flag all-reduced over the ranks,
    clipping -- under a float64 default dtype: both ranks step every time and stay replicas."""
    config = dict(fp16=dict(mode=getattr(AMP_TYPE, mode), dtype="float16"), clip_grad_norm=1.0)
    (moved, state), (_, other) = run_ranks(_float64_worker, 2, config)
    assert all(moved), moved
    assert_close(state, other, rtol=0, atol=0)


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
def test_bf16_skips_a_non_finite_step_without_a_scaler(opt_level, device, capsys):
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
    assert ("non-finite gradient on some rank: this step is skipped on every rank (1 skipped so "
            "far)") in capsys.readouterr().out  # no scaler backs off to say it: the log does
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


@pytest.mark.parametrize("bad", [None, float("inf"), float("-inf"), float("nan")])
def test_unscale_grads_with_nothing_scaled_only_checks_and_writes_no_gradient(bad):
    """bf16 trains unscaled (scale 1): the check must still see an inf or a NaN in any gradient
    of any dtype, and it must not pass over the gradients writing them (a second pass over every
    gradient each step, for nothing)."""
    grads = [torch.randn(5, 3), torch.randn(7).bfloat16(), torch.tensor(2.0).half()]
    if bad is not None:
        grads[1][4] = bad
    before = [g.clone() for g in grads]
    with WritesTo(grads) as writes:
        assert amp.unscale_grads(grads, loss_scale=1.0).tolist() == [float(bad is not None)]
    assert writes.ops == []
    for g, kept in zip(grads, before):
        assert_close(g, kept, equal_nan=True)
    assert amp.unscale_grads([], loss_scale=1.0).tolist() == [0.0]  # a shard with no gradient
    empty = [torch.zeros(0), torch.zeros(0, 4).bfloat16()]  # a zero-size parameter's gradient
    assert amp.unscale_grads(empty, loss_scale=1.0).tolist() == [0.0]
    assert amp.unscale_grads(empty + grads, loss_scale=1.0).tolist() == [float(bad is not None)]


class WritesTo(TorchDispatchMode):
    """Records the in-place ops (name ending in `_`) that take one of `tensors` as an argument."""

    def __init__(self, tensors):
        super().__init__()
        self.ids, self.ops = {id(t) for t in tensors}, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        flat = [a for arg in args for a in (arg if isinstance(arg, (list, tuple)) else [arg])]
        if func._schema.name.endswith("_") and any(id(a) in self.ids for a in flat):
            self.ops.append(func._schema.name)
        return func(*args, **(kwargs or {}))


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


# -- fp16 dynamic loss scaling x layouts: one process each ---------------------------------------
# Silent differences in the fp16 DYNAMIC LOSS SCALER between a layout and ONE process running the
# same AMP config on the whole batch. The scaler (amp_scaler.DynamicLossScaler) is the same code
# on every rank; what a layout can get wrong is the *input* of its update (did some rank
# overflow? amp.MixedPrecisionOptimizer.unscale_ all-reduces the flag), the loss scale each
# stage / micro-step multiplies by, the gradient reduction (a SUM of loss-scaled fp16 gradients
# may overflow where the mean does not: the gradient handler divides before it reduces, as DDP
# does), and the scaler's state across a checkpoint. So each run here uses a small
# growth_interval (the scale GROWS during the test), an inf injected into one gradient on the
# LAST rank only at a chosen step (one process: on its only rank), hysteresis where noted, and a
# clip threshold that really clips, and compares step by step:
#
#     steps taken / skipped, the loss scale after every step, the losses, the clipped gradient
#     norms (inf exactly where a step overflowed), and the final parameters.
#
# Tolerance: the layouts sum partial products and gradients in another order (split matmuls,
# all-reduced gradients), each fp16 rounding may differ by half an ulp; after <= 5 SGD steps at
# lr 0.1 with weights ~0.1-1 that stays ~1e-4..1e-3 (the AMP-layout tests below measured ~2e-4); we
# allow 2e-3 (= 2 ulp(1) of fp16) on parameters and losses, 2e-2 relative on norms (a norm of
# clipped, rounded gradients). The scaler's own numbers (scale, steps taken) are compared EXACTLY:
# they are powers of two and booleans, no rounding can excuse a difference there.
#
# Each backend's options do what they say: apex's min_loss_scale / max_loss_scale /
# keep_batchnorm_fp32 keys are mapped (amp_settings.py maps each backend's keys or names the ones
# with no effect), and enabled=False turns AMP off.

CLIP, TOL = 0.05, 2e-3  # (BATCH, SEQ, VOCAB, DIM: amp_probes.py's)

# growth_interval=2: over 5 steps the scale grows (x2 every 2 clean steps) and backs off once
SCALER = dict(initial_scale=2.0 ** 8, growth_interval=2, growth_factor=2.0, backoff_factor=0.5)
SCALER_MODES = {
    "O1": dict(mode=AMP_TYPE.TORCH, dtype="float16", **SCALER),
    "O2": dict(mode=AMP_TYPE.NAIVE, dtype="float16", **SCALER),
    "apex O1": dict(mode=AMP_TYPE.APEX, opt_level="O1", dtype="float16", **SCALER),
    "apex O2": dict(mode=AMP_TYPE.APEX, opt_level="O2", dtype="float16", **SCALER),
    "apex O3": dict(mode=AMP_TYPE.APEX, opt_level="O3", dtype="float16", **SCALER),
    "O2 hyst2": dict(mode=AMP_TYPE.NAIVE, dtype="float16", hysteresis=2, **SCALER),
    "O1 hyst2": dict(mode=AMP_TYPE.TORCH, dtype="float16", hysteresis=2, **SCALER),
}


# -- models --------------------------------------------------------------------------------------

def _scaler_cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


def _scaler_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(),
                         nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 5))


def _scaler_gpt(moe=False):
    torch.manual_seed(0)
    return gpt(vocab=VOCAB, seq_len=SEQ, dim=DIM, depth=2, heads=2, mlp_ratio=2,
               moe=dict(num_experts=2, top_k=2, capacity_factor_train=2.0,
                        capacity_factor_eval=2.0) if moe else None)


SCALER_MODELS = {"cnn": _scaler_cnn, "mlp": _scaler_mlp, "gpt": _scaler_gpt,
                 "gpt_moe": lambda: _scaler_gpt(True)}


def _scaler_batches(model, steps, seed=7):
    return probe_batches(model, steps, seed, side=5)  # (a 5x5 image: the scaler tests' CNN)


def _build(model_name, config, batches):
    model = SCALER_MODELS[model_name]()
    if gpc.pipeline_size > 1:
        model = build_pipeline_model(model, num_chunks=config.get("NUM_CHUNKS", 1),
                                     partition="uniform")
    crit = nn.CrossEntropyLoss() if model_name in ("cnn", "mlp") else \
        col_nn.VocabParallelCrossEntropyLoss()
    engine, loader, *_ = nc.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), crit,
        my_share(batches), verbose=False)
    return engine, loader


def _state(engine):
    return {k: v.detach().double().clone() for k, v in
            nc.checkpoint.strip_prefixes(engine.model.state_dict()).items()
            if torch.is_tensor(v) and v.is_floating_point()}


def _scaler_train(rank, world, port, model_name, config, steps, inject):
    nc.launch(dict(config), rank=rank, world_size=world, host="127.0.0.1", port=port, seed=1,
              timeout=60)
    engine, loader = _build(model_name, config, _scaler_batches(model_name, steps))
    out = record_steps(engine, loader, inject)
    out["skipped"] = engine.optimizer.skipped_steps
    out["scaler"] = engine.optimizer.scaler.state_dict()
    out["state"] = _state(engine)
    return out


def _compare(ref, runs, need_state=True):
    for rank, run in enumerate(runs):
        assert run["took"] == ref["took"], f"rank {rank}: took {run['took']} vs {ref['took']}"
        assert run["scales"] == ref["scales"], \
            f"rank {rank}: scales {run['scales']} vs {ref['scales']}"
        assert run["skipped"] == ref["skipped"], f"rank {rank}"
        assert run["scaler"] == ref["scaler"], f"rank {rank}: {run['scaler']} vs {ref['scaler']}"
        assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=TOL,
                     atol=TOL, msg=lambda m: f"rank {rank} losses {run['losses']} vs "
                                             f"{ref['losses']}: {m}")
        assert [n is None for n in run["norms"]] == [n is None for n in ref["norms"]]
        assert [n == float("inf") for n in run["norms"]] == \
            [n == float("inf") for n in ref["norms"]], (run["norms"], ref["norms"])
        fin = [(a, b) for a, b in zip(run["norms"], ref["norms"])
               if b is not None and b != float("inf")]
        assert_close(torch.tensor([a for a, _ in fin]), torch.tensor([b for _, b in fin]),
                     rtol=10 * TOL, atol=TOL, msg=lambda m: f"rank {rank} norms "
                                                         f"{run['norms']} vs {ref['norms']}: {m}")
        same = [k for k in set(ref["state"]) & set(run["state"])
                if run["state"][k].shape == ref["state"][k].shape]
        assert same or not need_state, "nothing to compare"
        for key in same:
            assert_close(run["state"][key], ref["state"][key], rtol=0, atol=TOL,
                         msg=lambda m, key=key: f"rank {rank} {key}: {m}")


SCALER_HANDLER = [dict(type="DataParallelGradientHandler")]
# name: (model, world, mode, parallel, extra config, steps, inject step)
SCALER_CASES = {
    "ddp2 SyncBN O1 inf@2": ("cnn", 2, "O1", {}, dict(sync_bn=True), 5, 2),
    "handler2 SyncBN apexO1 inf@3": ("cnn", 2, "apex O1", {},
                                     dict(sync_bn=True, gradient_handler=SCALER_HANDLER), 5, 3),
    # 6 micro-steps = 3 optimizer steps: overflow in the first / the second micro-step
    "accum2 ddp O2 inf@micro0": ("cnn", 2, "O2", {}, dict(sync_bn=True, gradient_accumulation=2),
                                 8, 4),
    "accum2 handler O2 inf@micro1": ("mlp", 2, "O2", {},
                                     dict(gradient_accumulation=2, gradient_handler=SCALER_HANDLER),
                                     8, 5),
    "pipe 1f1b O2 hyst2 inf@1": ("mlp", 2, "O2 hyst2", {"pipeline": 2},
                                 dict(NUM_MICRO_BATCHES=2), 5, 1),
    "pipe interleaved apexO2 inf@2": ("gpt", 2, "apex O2", {"pipeline": 2},
                                      dict(NUM_MICRO_BATCHES=2, NUM_CHUNKS=2), 5, 2),
    "tensor1d O1 inf@2": ("gpt", 2, "O1", {"tensor": {"size": 2, "mode": "1d"}}, {}, 5, 2),
    "sequence2 O1 hyst2 inf@0": ("gpt", 2, "O1 hyst2", {"tensor": {"size": 2, "mode": "sequence"}},
                                 {}, 5, 0),
    "moe2 O2 inf@2": ("gpt_moe", 2, "O2", {"moe": {"size": 2}}, dict(MOE_AUX_WEIGHT=0.1), 5, 2),
    "zero1 O2 inf@2": ("mlp", 2, "O2", {}, dict(zero=dict(level=1)), 5, 2),
    "zero2 O1 hyst2 inf@1": ("mlp", 2, "O1 hyst2", {}, dict(zero=dict(level=2)), 5, 1),
    "zero3 O2 inf@3": ("mlp", 2, "O2", {}, dict(zero=dict(level=3)), 5, 3),
    "zero3 O1 inf@2": ("mlp", 2, "O1", {}, dict(zero=dict(level=3)), 5, 2),
    "ddp2 apexO3 inf@2": ("mlp", 2, "apex O3", {}, {}, 5, 2),
    "zero1 accum2 O2 inf@micro0": ("mlp", 2, "O2", {}, dict(zero=dict(level=1),
                                                            gradient_accumulation=2), 8, 4),
    "zero2 accum2 O2 hyst2 inf@micro0": ("mlp", 2, "O2 hyst2", {}, dict(
        zero=dict(level=2), gradient_accumulation=2), 8, 4),
    "zero3 accum2 O1 inf@micro1": ("mlp", 2, "O1", {}, dict(zero=dict(level=3),
                                                            gradient_accumulation=2), 8, 5),
    "pipe gpipe O1 inf@3": ("gpt", 2, "O1", {"pipeline": 2},
                            dict(NUM_MICRO_BATCHES=2, PIPELINE_SCHEDULE="gpipe"), 5, 3),
    "pipe2 x ddp2 handler apexO1 inf@2": ("mlp", 4, "apex O1", {"pipeline": 2},
                                          dict(NUM_MICRO_BATCHES=2,
                                               gradient_handler=SCALER_HANDLER), 5, 2),
    "pipe2 x zero2 x2 gpt O2 inf@2": ("gpt", 4, "O2", {"pipeline": 2},
                                      dict(NUM_MICRO_BATCHES=2, zero=dict(level=2)), 5, 2),
    "sequence2 x zero2 O2 inf@2": ("gpt", 2, "O2", {"tensor": {"size": 2, "mode": "sequence"}},
                                   dict(zero=dict(level=2)), 5, 2),
    # the inf in an expert's gradient: on the last rank, an expert the other rank does not hold
    "moe2 O1 inf@3 in an expert": ("gpt_moe", 2, "O1", {"moe": {"size": 2}},
                                   dict(MOE_AUX_WEIGHT=0.1), 5, (3, "experts")),
    "tensor2d x4 apexO2 inf@2 in a norm": ("gpt", 4, "apex O2", {"tensor": {"size": 4,
                                                                            "mode": "2d"}},
                                           {}, 5, (2, "norm")),
    "pipe 1f1b TENSOR_SHAPE O2 inf@2": ("mlp", 2, "O2", {"pipeline": 2},
                                        dict(NUM_MICRO_BATCHES=2, TENSOR_SHAPE=(2, 16)), 5, 2),
    "pipe2 x tensor1d2 O2 hyst2 inf@1": ("gpt", 4, "O2 hyst2",
                                         {"pipeline": 2, "tensor": {"size": 2, "mode": "1d"}},
                                         dict(NUM_MICRO_BATCHES=2), 5, 1),
    "pipe2 x moe2 O1 inf@2": ("gpt_moe", 4, "O1", {"pipeline": 2, "moe": {"size": 2}},
                              dict(MOE_AUX_WEIGHT=0.1, NUM_MICRO_BATCHES=2), 5, 2),
    "tensor1d2 x zero2 x2 O2 inf@2": ("gpt", 4, "O2", {"tensor": {"size": 2, "mode": "1d"}},
                                      dict(zero=dict(level=2)), 5, 2),
    "pipe2 x zero1 x2 O2 inf@2": ("mlp", 4, "O2", {"pipeline": 2},
                                  dict(NUM_MICRO_BATCHES=2, zero=dict(level=1)), 5, 2),
}
# keys one process keeps (the others name a layout); a reference is shared by the cases that can
_REF_KEYS = ("gradient_accumulation", "MOE_AUX_WEIGHT")
_SCALER_REFS = {}


def _where(inject, ranks):
    """record_steps' inject: SCALER_CASES give a step, or (step, name of the parameter to hit)."""
    step, *name = inject if isinstance(inject, tuple) else (inject,)
    return (step, ranks, *name)


def _scaler_reference(model_name, mode, extra, steps, inject):
    kept = tuple(sorted((k, v) for k, v in extra.items() if k in _REF_KEYS))
    key = (model_name, mode, kept, steps, inject)
    if key not in _SCALER_REFS:
        config = dict(fp16=SCALER_MODES[mode], clip_grad_norm=CLIP, **dict(kept))
        _SCALER_REFS[key] = run_ranks(_scaler_train, 1, model_name, config, steps,
                                      _where(inject, [0]), timeout=90)[0]
    return _SCALER_REFS[key]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", SCALER_CASES)
def test_deep_fp16_scaler_growth_and_one_rank_overflow_match_one_process(case):
    model_name, world, mode, parallel, extra, steps, inject = SCALER_CASES[case]
    ref = _scaler_reference(model_name, mode, extra, steps, inject)
    # the test means something: one process skipped the injected step, and the scale grew
    assert ref["skipped"] == 1 and float("inf") in ref["norms"], ref
    assert max(ref["scales"]) > SCALER_MODES[mode]["initial_scale"], ref["scales"]
    config = dict(fp16=SCALER_MODES[mode], clip_grad_norm=CLIP, parallel=parallel, **extra)
    runs = run_ranks(_scaler_train, world, model_name, config, steps, _where(inject, [world - 1]),
                     timeout=90)
    _compare(ref, runs, need_state="tensor" not in parallel)  # tensor shards: other shapes


# -- a SUM of loss-scaled half gradients overflows where their mean does not --------------------

def _edge_train(rank, world, port, config):
    """Linear(4, 1) from zero weights, MSE to -0.3 on all-ones inputs: d loss / d w = 0.6 per
    element on the whole batch AND on each half of it; x 2^16 = 39322, which fp16 holds (max
    65504) -- but 2 x 39322 it does not. One process steps; a reduction that sums the ranks'
    scaled half gradients before dividing by the ranks would see inf and skip."""
    nc.launch(dict(config), rank=rank, world_size=world, host="127.0.0.1", port=port, seed=1,
              timeout=60)
    model = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    batches = [(torch.ones(BATCH, 4), torch.full((BATCH, 1), -0.3)) for _ in range(2)]
    engine, loader, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                       nn.MSELoss(), my_share(batches), verbose=False)
    out = record_steps(engine, loader)
    out["state"] = _state(engine)
    return out


EDGE = dict(init_scale=2.0 ** 16, growth_interval=1000)
EDGE_CASES = {
    "ddp O2": ({}, "O2"),
    "zero2 O2": (dict(zero=dict(level=2)), "O2"),
    "zero3 O2": (dict(zero=dict(level=3)), "O2"),
    "handler O1": (dict(gradient_handler=SCALER_HANDLER), "O1"),  # fp32 gradients: no overflow
    "handler O2": (dict(gradient_handler=SCALER_HANDLER), "O2"),
    "handler apex O3": (dict(gradient_handler=SCALER_HANDLER), "apex O3"),
}
# the handler divides before its all-reduce, as DDP does (summing first would overflow here)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", EDGE_CASES)
def test_deep_fp16_data_parallel_reduction_does_not_overflow_where_one_process_does_not(case):
    extra, mode = EDGE_CASES[case]
    fp16 = {k: v for k, v in SCALER_MODES[mode].items() if k not in SCALER} | EDGE
    ref = run_ranks(_edge_train, 1, dict(fp16=fp16), timeout=60)[0]
    assert ref["took"] == [True, True] and ref["scales"] == [2.0 ** 16] * 2, ref
    runs = run_ranks(_edge_train, 2, dict(fp16=fp16, **extra), timeout=60)
    for rank, run in enumerate(runs):
        assert (run["took"], run["scales"]) == (ref["took"], ref["scales"]), \
            f"rank {rank}: took {run['took']} scales {run['scales']} vs one process " \
            f"{ref['took']} {ref['scales']}"
        assert_close(run["state"]["weight"], ref["state"]["weight"], rtol=0, atol=TOL)


# -- the scaler's state survives a checkpoint: resumed == uninterrupted, step for step -----------

def _segments(engine, loader, injects):
    """record_steps over loader[0:3] then loader[3:5], each with its own injected overflow."""
    first = record_steps(engine, loader[:3], injects[0])
    second = record_steps(engine, loader[3:], injects[1])
    return {k: first[k] + second[k] for k in first}, first


def _resume_train(rank, world, port, model_name, config, path):
    """Steps 0-4 with an overflow on the last rank at steps 1 and 3, three ways in one job:
    uninterrupted; steps 0-2 then save; a fresh model/optimizer that loads and runs steps 3-4."""
    nc.launch(dict(config), rank=rank, world_size=world, host="127.0.0.1", port=port, seed=1,
              timeout=60)
    batches, last = _scaler_batches(model_name, 5), [gpc.world_size - 1]
    injects = ((1, last), (0, last))
    engine, loader = _build(model_name, config, batches)
    whole, _ = _segments(engine, list(loader), injects)
    whole["state"], whole["scaler"] = _state(engine), engine.optimizer.scaler.state_dict()

    engine, loader = _build(model_name, config, batches)
    first = record_steps(engine, list(loader)[:3], injects[0])
    saved_scaler = engine.optimizer.scaler.state_dict()
    nc.checkpoint.save_checkpoint(path, 0, engine.model, engine.optimizer)
    del engine
    engine, loader = _build(model_name, config, batches)
    nc.checkpoint.load_checkpoint(path, engine.model, engine.optimizer)
    loaded_scaler = engine.optimizer.scaler.state_dict()
    second = record_steps(engine, list(loader)[3:], injects[1])
    resumed = {k: first[k] + second[k] for k in first}
    resumed["state"], resumed["scaler"] = _state(engine), engine.optimizer.scaler.state_dict()
    return whole, resumed, saved_scaler, loaded_scaler


RESUME_CASES = {
    "pipe 1f1b O2 hyst2": ("mlp", "O2 hyst2", {"pipeline": 2}, dict(NUM_MICRO_BATCHES=2)),
    "zero2 O1 hyst2": ("mlp", "O1 hyst2", {}, dict(zero=dict(level=2))),
    "zero3 O2 hyst2": ("mlp", "O2 hyst2", {}, dict(zero=dict(level=3))),
    "tensor1d O1 hyst2": ("gpt", "O1 hyst2", {"tensor": {"size": 2, "mode": "1d"}}, {}),
    "ddp SyncBN apexO2": ("cnn", "apex O2", {}, dict(sync_bn=True)),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", RESUME_CASES)
def test_deep_fp16_scaler_state_survives_checkpoint_resume_exactly(case, tmp_path):
    model_name, mode, parallel, extra = RESUME_CASES[case]
    config = dict(fp16=SCALER_MODES[mode], clip_grad_norm=CLIP, parallel=parallel, **extra)
    runs = run_ranks(_resume_train, 2, model_name, config, str(tmp_path / "ckpt.pt"), timeout=90)
    for rank, (whole, resumed, saved, loaded) in enumerate(runs):
        # the test means something: the save lands mid-count (a growth tracker, and with
        # hysteresis=2 a spent hysteresis credit, that a reset would lose)
        assert whole["took"] == [True, False, True, False, True], whole["took"]
        assert saved["growth_tracker"] == 1, saved
        if "hysteresis" in SCALER_MODES[mode]:
            assert saved["hysteresis_tracker"] == 1, saved
        assert loaded == saved, f"rank {rank}: loaded {loaded} vs saved {saved}"
        for key in ("took", "scales", "norms", "losses", "scaler"):
            assert resumed[key] == whole[key], f"rank {rank} {key}: {resumed[key]} vs {whole[key]}"
        for key, value in whole["state"].items():
            assert_close(resumed["state"][key], value, rtol=0, atol=0,
                         msg=lambda m, key=key: f"rank {rank} {key}: {m}")


# -- the Trainer under fp16: skipped steps, the LR hook, max_steps + resume ----------------------

class _Record(nc.hooks.BaseHook):
    def __init__(self, lr_scheduler):
        super().__init__(priority=50)  # after the LR hook
        self.lr_scheduler = lr_scheduler
        self.out = dict(took=[], scales=[], lrs=[], losses=[])

    def after_train_iter(self, trainer, output, label, loss):
        self.out["took"].append(trainer.last_step_taken)
        self.out["scales"].append(trainer.engine.optimizer.loss_scale)
        self.out["lrs"].append(self.lr_scheduler.get_last_lr()[0])
        self.out["losses"].append(nc.metrics.all_reduce_mean(loss.item()))


def _inject_on_backward(engine, call, ranks, per=1):
    """An inf in the first parameter's gradient on `ranks`, at its `call`-th backward (counted
    from 0; returns the counter, to move it on after a resume)."""
    first = next(p for p in engine.model.parameters() if p.requires_grad)
    seen = [0]

    def hook(g):
        seen[0] += 1  # (a pipeline stage: `per` micro-batch backwards a batch, all hit)
        if (seen[0] - 1) // per == call and gpc.rank in ranks:
            return g.index_fill(0, torch.tensor([0]), float("inf"))
        return g
    first.register_hook(hook)
    return seen


def _trainer_train(rank, world, port, config, path, batches_n, inject_at, stop_at,
                   model_name="cnn"):
    """Trainer.fit over `batches_n` batches (one epoch), LRSchedulerHook per step taken; with
    `stop_at`: fit(max_steps=stop_at) with SaveCheckpointHook, then a fresh Trainer that resumes."""
    nc.launch(dict(config), rank=rank, world_size=world, host="127.0.0.1", port=port, seed=1,
              timeout=60)
    batches = _scaler_batches(model_name, batches_n)

    def build():
        model = SCALER_MODELS[model_name]()
        if gpc.pipeline_size > 1:
            model = build_pipeline_model(model, partition="uniform")
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
        engine, loader, *_ = nc.initialize(model, opt, nn.CrossEntropyLoss(),
                                           my_share(batches), verbose=False)
        seen = _inject_on_backward(engine, inject_at, [gpc.world_size - 1],
                                   config.get("NUM_MICRO_BATCHES", 1))
        return nc.trainer.Trainer(engine), loader, sched, seen

    trainer, loader, sched, _ = build()
    record = _Record(sched)
    hooks = [nc.hooks.LRSchedulerHook(sched, by_epoch=False), record]
    if stop_at is None:
        trainer.fit(loader, epochs=1, hooks=hooks)
        out = record.out
    else:
        trainer.fit(loader, epochs=1, max_steps=stop_at,
                    hooks=hooks + [nc.hooks.SaveCheckpointHook(path, lr_scheduler=sched)])
        out = record.out
        trainer, loader, sched, seen = build()
        assert trainer.resume(path, sched)
        # the same global batch (backwards: one per batch, a stage's one per micro-batch)
        seen[0] = trainer.batch_in_epoch * config.get("NUM_MICRO_BATCHES", 1)
        record = _Record(sched)
        trainer.fit(loader, epochs=1, hooks=[nc.hooks.LRSchedulerHook(sched, by_epoch=False),
                                             record])
        out = {k: out[k] + record.out[k] for k in out}
    out["state"] = _state(trainer.engine)
    out["scaler"] = trainer.engine.optimizer.scaler.state_dict()
    return out


TRAINER_LAYOUTS = {"ddp": {}, "zero2": dict(zero=dict(level=2)), "zero3": dict(zero=dict(level=3)),
                   # (the mlp: the cnn's BatchNorm would normalise each micro-batch alone)
                   "pipe2": dict(parallel=dict(pipeline=2), NUM_MICRO_BATCHES=2)}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("accumulation,layout", [(1, "ddp"), (2, "ddp"), (2, "zero2"),
                                                 (1, "zero3"), (1, "pipe2")])
def test_deep_fp16_trainer_skips_lr_hook_and_resume_match_one_process(accumulation, layout,
                                                                     tmp_path):
    """8 batches; an overflow on the last rank at backward 3 (with accumulation 2: the second
    micro-step of step 1). One process vs DDP x2 SyncBN O2 (or ZeRO) vs the same stopped by
    max_steps after step 2 and resumed from the Trainer's checkpoint."""
    config = dict(fp16=SCALER_MODES["O2 hyst2"], clip_grad_norm=CLIP,
                  gradient_accumulation=accumulation)
    model_name = "mlp" if layout == "pipe2" else "cnn"
    ref = run_ranks(_trainer_train, 1, config, None, 8, 3, None, model_name, timeout=90)[0]
    assert ref["took"].count(True) == 8 // accumulation - 1, ref["took"]
    assert max(ref["scales"]) > SCALER["initial_scale"] and min(ref["lrs"]) < 0.1 * 0.8, ref
    layout = dict(config, sync_bn=True, **TRAINER_LAYOUTS[layout])
    for stop in (None, 2):
        path = str(tmp_path / f"ckpt{stop}.pt")
        runs = run_ranks(_trainer_train, 2, layout, path, 8, 3, stop, model_name, timeout=90)
        for rank, run in enumerate(runs):
            for key in ("took", "scales", "lrs", "scaler"):
                assert run[key] == ref[key], f"stop {stop} rank {rank} {key}: {run[key]} vs " \
                                             f"{ref[key]}"
            assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=TOL,
                         atol=TOL)
            common = set(ref["state"]) & set(run["state"])  # (a pipeline stage: its layers)
            assert common
            for key in common:
                assert_close(run["state"][key], ref["state"][key], rtol=0, atol=TOL,
                             msg=lambda m, key=key: f"stop {stop} rank {rank} {key}: {m}")


@pytest.mark.timeout(240)
def test_deep_fp16_zero_v01_optimizer_config_scaler_keys_match_one_process_fp16_keys():
    """Colossal-AI v0.1's spelling puts the scaler in zero.optimizer_config (config_checks.py's
    zero_settings): it must act exactly as the same keys in fp16=dict(...) act on one process
    (here with hysteresis=2 and an overflow at step 1, then a second one at step 3)."""
    fp16 = SCALER_MODES["O1 hyst2"]
    ref = _scaler_reference("mlp", "O1 hyst2", {}, 5, 1)
    plain = {k: v for k, v in fp16.items() if k in ("mode", "dtype")}
    optimizer_config = {k: v for k, v in fp16.items() if k not in ("mode", "dtype")}
    config = dict(fp16=plain, clip_grad_norm=CLIP,
                  zero=dict(model_config=dict(), optimizer_config=optimizer_config))
    runs = run_ranks(_scaler_train, 2, "mlp", config, 5, (1, [1]), timeout=90)
    _compare(ref, runs)


# -- a checkpoint saved by one layout, resumed by another: the scaler's counters travel ----------

def _phases(rank, world, port, model_name, config, path, load, save, lo, hi, overflow_at):
    """Steps lo..hi-1 (an overflow on the last rank at each step in `overflow_at`), after
    loading `path` if `load`, saving it after if `save`."""
    nc.launch(dict(config), rank=rank, world_size=world, host="127.0.0.1", port=port, seed=1,
              timeout=60)
    engine, loader = _build(model_name, config, _scaler_batches(model_name, 5))
    if load:
        nc.checkpoint.load_checkpoint(path, engine.model, engine.optimizer)
    out = dict(losses=[], norms=[], took=[], scales=[])
    for step, batch in list(enumerate(loader))[lo:hi]:
        inject = (0, [gpc.world_size - 1]) if step in overflow_at else None
        for k, v in record_steps(engine, [batch], inject).items():
            out[k] += v
    if save:
        nc.checkpoint.save_checkpoint(path, 0, engine.model, engine.optimizer)
    out["scaler"], out["state"] = engine.optimizer.scaler.state_dict(), _state(engine)
    out["skipped"] = None
    return out


XRESUME = {  # name: (model, mode, (world, extra) that saves, (world, extra) that loads)
    "zero2 x2 -> one process": ("mlp", "O2 hyst2", (2, dict(zero=dict(level=2))), (1, {})),
    "one process -> zero3 x2": ("mlp", "O2 hyst2", (1, {}), (2, dict(zero=dict(level=3)))),
    "zero1 x2 O1 -> ddp x2": ("mlp", "O1 hyst2", (2, dict(zero=dict(level=1))), (2, {})),
    "ddp x2 SyncBN -> zero2 x2 SyncBN": ("cnn", "O2 hyst2", (2, dict(sync_bn=True)),
                                          (2, dict(sync_bn=True, zero=dict(level=2)))),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", XRESUME)
def test_deep_fp16_scaler_state_crosses_layouts_in_a_checkpoint(case, tmp_path):
    """Overflows at steps 1 and 3 with hysteresis=2, saved after step 2 (growth tracker 1,
    hysteresis credit 1): the loading layout must back off at step 3 and grow where one process
    does."""
    model_name, mode, (w1, e1), (w2, e2) = XRESUME[case]
    base = dict(fp16=SCALER_MODES[mode], clip_grad_norm=CLIP)
    path, overflow_at = str(tmp_path / "ckpt.pt"), (1, 3)
    ref = run_ranks(_phases, 1, model_name, base, path + "-ref", False, False, 0, 5, overflow_at,
                    timeout=90)[0]
    assert ref["took"] == [True, False, True, False, True], ref["took"]
    first = run_ranks(_phases, w1, model_name, {**base, **e1}, path, False, True, 0, 3,
                      overflow_at, timeout=90)
    second = run_ranks(_phases, w2, model_name, {**base, **e2}, path, True, False, 3, 5,
                       overflow_at, timeout=90)
    for rank, run in enumerate(second):
        joined = {k: first[0][k] + run[k] for k in ("losses", "norms", "took", "scales")}
        _compare(ref, [{**run, **joined}])


def _apex_options(rank, world, port, config):
    nc.launch(dict(config), rank=rank, world_size=world, host="127.0.0.1", port=port, seed=1,
              timeout=60)
    engine, loader = _build("cnn", config, _scaler_batches("cnn", 4))
    dtypes = {str(p.dtype) for p in engine.model.parameters() if p.dim() == 1}  # biases, BN
    return record_steps(engine, loader)["scales"], dtypes, engine.optimizer.scaler is None


APEX = dict(mode=AMP_TYPE.APEX, dtype="float16", loss_scale="dynamic", initial_scale=2.0 ** 8,
            growth_interval=1)
APEX_OPTIONS = {  # name: (fp16, scales after each step, dtypes of the 1-d parameters, no scaler)
    # apex's own scaler bounds (min_loss_scale / max_loss_scale) cap the growing scale at 512
    "O2 min/max_loss_scale": (dict(APEX, opt_level="O2", min_loss_scale=2.0 ** 7,
                                   max_loss_scale=2.0 ** 9), [2.0 ** 9] * 4,
                              {"torch.float16", "torch.float32"}, False),
    # keep_batchnorm_fp32 overrides the level: O3 keeps BatchNorm fp32, O2 casts it
    "O3 keep_batchnorm_fp32": (dict(APEX, opt_level="O3", keep_batchnorm_fp32=True),
                               [2.0 ** 9, 2.0 ** 10, 2.0 ** 11, 2.0 ** 12],
                               {"torch.float16", "torch.float32"}, False),
    "O2 keep_batchnorm_fp32=False": (dict(APEX, opt_level="O2", keep_batchnorm_fp32=False),
                                     [2.0 ** 9, 2.0 ** 10, 2.0 ** 11, 2.0 ** 12],
                                     {"torch.float16"}, False),
    # enabled=False: no AMP at all (fp32, no scaler), as Colossal-AI's TORCH mode
    "TORCH enabled=False": (dict(mode=AMP_TYPE.TORCH, dtype="float16", enabled=False),
                            [1.0] * 4, {"torch.float32"}, True),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", APEX_OPTIONS)
def test_gloo_fp16_backend_options_do_what_they_say(name):
    fp16, scales, dtypes, no_scaler = APEX_OPTIONS[name]
    assert run_ranks(_apex_options, 1, dict(fp16=fp16), timeout=60)[0] == \
        (scales, dtypes, no_scaler)


# -- AMP x layouts: dtypes, steps and scales as one process --------------------------------------
# Silent AMP differences between a layout and ONE process. Under AMP O2 one process keeps torch's
# normalisation layers in fp32, so a 2d O2 job must keep its LayerNorm2D in fp32 too, and so on
# for every layer a layout swaps in. Here, for every layout a user can reach (DDP with SyncBN /
# plain BatchNorm, tensor 1d / 2d, sequence (ring attention), pipeline GPipe / 1F1B /
# interleaved, experts, the vocab-parallel GPT), the same plain model is run on one process and
# on the layout under the same AMP settings, and compared on
#
#     (a) the dtype of every parameter and buffer after initialize (by plain-model name),
#     (b) the dtype of the activations that matter: every module's output (by plain-model name),
#         the logits and the loss, the attention scores and softmax, the router's probabilities,
#     (c) the parameters, losses and (clipped) gradient norms after 3 steps, to half precision,
#     (d) the loss scaler (scale per step, steps taken) when one rank's gradients overflow.
#
# Tolerance for (c): the layouts sum partial products in another order (split matmuls, ring
# attention blocks, all-reduced gradients), so each rounding may differ by one half-ulp of the
# half type. After 3 SGD steps at lr 0.1 with weights of size ~0.1-1, existing measurements
# (test_composition.py's table) put layout-vs-one-process at ~1e-3 (bf16) and ~2e-4 (fp16);
# we allow 1e-2 (bf16: 8-bit mantissa, ulp(1)=7.8e-3) and 2e-3 (fp16: ulp(1)=9.8e-4). A dtype
# mismatch of a whole layer (e.g. fp32 vs bf16 LayerNorm) shows up exactly in (a)/(b).
#
# Every fp16 config names its dtype (MODES): an unnamed one would let the CPU probe pick. The
# models, their batches and the dtype probes are amp_probes.py's; CLIP is the one above.


# -- one generic run: the same code on one process and on a layout ------------------------------

def _layout_train(rank, world, port, model_name, config, steps=3, inject=None):
    nc.launch(dict(config), rank=rank, world_size=world, host="127.0.0.1", port=port, seed=1)
    seen = {}
    undo = patch_attention(seen)
    try:
        model = MODELS[model_name]()
        install_probes(model, seen)
        if gpc.pipeline_size > 1:
            model = build_pipeline_model(model, num_chunks=config.get("NUM_CHUNKS", 1),
                                         partition="uniform")
        crit = probed_criterion(model_name, seen)
        engine, loader, *_ = nc.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), crit,
            my_share(probe_batches(model_name, steps)), verbose=False)
        out = record_run(engine, loader, inject)
        out["seen"] = {k: sorted(v) for k, v in seen.items()}
        out["state"] = {k: v.detach().double().clone() for k, v in
                        nc.checkpoint.strip_prefixes(engine.model.state_dict()).items()
                        if torch.is_tensor(v) and v.is_floating_point()}
        return out
    finally:
        undo()


_REFS = {}


def _reference(model_name, mode, extra=(), inject=None):
    key = (model_name, mode, tuple(sorted(dict(extra).items())), inject)
    if key not in _REFS:
        config = dict(fp16=MODES[mode], clip_grad_norm=CLIP, **dict(extra))
        _REFS[key] = run_ranks(_layout_train, 1, model_name, config, 3,
                               None if inject is None else (inject, [0]), timeout=60)[0]
    return _REFS[key]


def _compare_dtypes(ref, run, rank):
    common = set(ref["dtypes"]) & set(run["dtypes"])
    assert common, "no parameter in common?"
    wrong = {k: (run["dtypes"][k], ref["dtypes"][k]) for k in sorted(common)
             if run["dtypes"][k] != ref["dtypes"][k]}
    assert not wrong, f"rank {rank}: (layout, one process) dtypes differ: {wrong}"
    seen_common = set(ref["seen"]) & set(run["seen"])
    wrong = {k: (run["seen"][k], ref["seen"][k]) for k in sorted(seen_common)
             if run["seen"][k] != ref["seen"][k]}
    assert not wrong, f"rank {rank}: (layout, one process) activation dtypes differ: {wrong}"


def _compare_numbers(ref, run, rank, tol):
    assert run["took"] == ref["took"], f"rank {rank}: steps taken {run['took']} vs {ref['took']}"
    assert run["scales"] == ref["scales"], f"rank {rank}: scales {run['scales']} vs {ref['scales']}"
    assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=tol, atol=tol)
    assert_close(torch.tensor([n or 0.0 for n in run["norms"]]),
                 torch.tensor([n or 0.0 for n in ref["norms"]]), rtol=10 * tol, atol=tol)
    # (a tensor-parallel shard has another shape: the losses and norms above cover it)
    same = [k for k in set(ref["state"]) & set(run["state"])
            if run["state"][k].shape == ref["state"][k].shape]
    for key in same:
        assert_close(run["state"][key], ref["state"][key], rtol=0, atol=tol,
                     msg=lambda m, key=key: f"rank {rank} {key}: {m}")


HANDLER = [dict(type="DataParallelGradientHandler")]

# layout name: (model, processes, parallel, extra config)
LAYOUTS = {
    "ddp2 SyncBN": ("cnn", 2, {}, (("sync_bn", True),)),
    "ddp2 BatchNorm": ("cnn", 2, {}, ()),
    "handler2 SyncBN": ("cnn", 2, {}, (("sync_bn", True), ("gradient_handler", HANDLER))),
    "tensor 1d x2 gpt": ("gpt", 2, {"tensor": {"size": 2, "mode": "1d"}}, ()),
    "tensor 2d x4 gpt": ("gpt", 4, {"tensor": {"size": 4, "mode": "2d"}}, ()),
    "sequence x2 gpt": ("gpt", 2, {"tensor": {"size": 2, "mode": "sequence"}}, ()),
    "pipeline 1f1b gpt": ("gpt", 2, {"pipeline": 2}, (("NUM_MICRO_BATCHES", 2),)),
    "pipeline gpipe gpt": ("gpt", 2, {"pipeline": 2}, (("NUM_MICRO_BATCHES", 2),
                                                       ("PIPELINE_SCHEDULE", "gpipe"))),
    "pipeline interleaved gpt": ("gpt", 2, {"pipeline": 2}, (("NUM_MICRO_BATCHES", 2),
                                                             ("NUM_CHUNKS", 2))),
    "pipeline 1f1b mlp": ("mlp", 2, {"pipeline": 2}, (("NUM_MICRO_BATCHES", 2),)),
    "moe ep2 gpt": ("gpt_moe", 2, {"moe": {"size": 2}}, (("MOE_AUX_WEIGHT", 0.1),)),
}

CASES = [(layout, "O2 bf16") for layout in LAYOUTS] + [
    (layout, mode) for mode in ("O1 bf16", "O3 bf16", "O2 fp16")
    for layout in ("ddp2 SyncBN", "sequence x2 gpt", "pipeline 1f1b mlp", "moe ep2 gpt",
                   "tensor 1d x2 gpt")] + [("tensor 2d x4 gpt", "O1 bf16")]  # (O1: SUMMA's casts)

# plain BatchNorm under DDP normalises each rank's half batch: by design not one process's numbers
DTYPES_ONLY = {"ddp2 BatchNorm"}

# Ring attention keeps its scores and online softmax in float32 whatever the input dtype, as
# FlashAttention keeps its softmax statistics: N blocks' running sums of exp() in a half type
# would lose precision one process's single softmax does not (tensor/ring_attention.py). That
# is the one dtype a sequence layout is expected to differ in; everything else must match.
RING_ATTENTION = {"attention scores": ["torch.float32"], "attention softmax": ["torch.float32"]}
# What the cases pin: under O1 the 1d Column/RowLinear1D add their bias inside autocast, so a 1d
# Linear output keeps the half type (tensor/base.add_bias); a pipeline stage's output is not cast
# to float32, so a later stage's residual stream stays half (amp.initialize's `outputs`); 2d x O1
# runs backward with _SummaABT's operands in one dtype (tensor/summa.autocast_operands).


def _ref_extra(extra):
    """One process has no pipeline: the schedule keys do not apply there."""
    return tuple((k, v) for k, v in extra if k in ("MOE_AUX_WEIGHT",))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout,mode", CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_deep_amp_layout_dtypes_and_steps_match_one_process(layout, mode):
    model_name, world, parallel, extra = LAYOUTS[layout]
    ref = _reference(model_name, mode, _ref_extra(extra))
    if layout.startswith("sequence"):
        ref = {**ref, "seen": {**ref["seen"], **RING_ATTENTION}}
    config = dict(fp16=MODES[mode], clip_grad_norm=CLIP, parallel=parallel, **dict(extra))
    runs = run_ranks(_layout_train, world, model_name, config, 3, None, timeout=90)
    assert any(n and n > CLIP for n in ref["norms"]), "clipping really clips"
    tol = 2e-3 if "fp16" in mode else 1e-2
    for rank, run in enumerate(runs):
        _compare_dtypes(ref, run, rank)
        if layout not in DTYPES_ONLY:
            _compare_numbers(ref, run, rank, tol)


OVERFLOW = {  # layout: fp16 mode
    "ddp2 SyncBN": "O2 fp16",
    "ddp2 BatchNorm": "APEX O2 fp16",
    "tensor 1d x2 gpt": "O2 fp16",
    "tensor 2d x4 gpt": "O2 fp16",
    "pipeline 1f1b gpt": "O2 fp16",
    "pipeline interleaved gpt": "O1 fp16",
    "moe ep2 gpt": "O2 fp16",
    "sequence x2 gpt": "O1 fp16",
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", OVERFLOW)
def test_deep_fp16_overflow_on_one_rank_gives_one_process_scaler_state(layout):
    """An inf in the 2nd step's gradient on the LAST rank only (one process: its only rank):
    every rank skips that step, the scale halves and regrows as one process's does."""
    mode = OVERFLOW[layout]
    model_name, world, parallel, extra = LAYOUTS[layout]
    ref = _reference(model_name, mode, _ref_extra(extra), inject=1)
    assert ref["took"] == [True, False, True] and ref["skipped"] == 1, ref["took"]
    assert ref["scales"][1] == ref["scales"][0] / 2, ref["scales"]
    config = dict(fp16=MODES[mode], clip_grad_norm=CLIP, parallel=parallel, **dict(extra))
    runs = run_ranks(_layout_train, world, model_name, config, 3, (1, [world - 1]), timeout=90)
    for rank, run in enumerate(runs):
        assert run["took"] == ref["took"], f"rank {rank}: {run['took']} vs {ref['took']}"
        assert run["scales"] == ref["scales"], f"rank {rank}: {run['scales']} vs {ref['scales']}"
        assert run["skipped"] == ref["skipped"], f"rank {rank}"
        assert [n is None or n == float("inf") for n in run["norms"]] == \
            [n is None or n == float("inf") for n in ref["norms"]], (run["norms"], ref["norms"])


# -- weights loaded into the model after initialize: the fp32 masters follow them ---------------

def _load_after_initialize(rank, world, port, config, lr):
    nc.launch(config, rank=rank, world_size=world, host="127.0.0.1", port=port)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=lr),
                               nn.MSELoss(), verbose=False)
    loaded = {k: torch.full(v.shape, 0.5) for k, v in engine.model.state_dict().items()}
    engine.model.load_state_dict(loaded)
    x, y = torch.ones(2, 4), torch.zeros(2, 2)
    engine.zero_grad()
    engine.backward(engine.criterion(engine(x), y))
    engine.step()
    return {k: v.float() for k, v in nc.checkpoint.strip_prefixes(
        engine.model.state_dict()).items()}


@pytest.mark.parametrize("config", [
    {"fp16": {"mode": AMP_TYPE.NAIVE, "dtype": "bfloat16"}},
    {"fp16": {"mode": AMP_TYPE.APEX, "opt_level": "O2", "dtype": "float16"}},
    {"fp16": {"mode": AMP_TYPE.NAIVE, "dtype": "bfloat16"}, "zero": {"level": 2}},
    {"fp16": {"mode": AMP_TYPE.NAIVE, "dtype": "bfloat16"}, "zero": {"level": 3}},
], ids=["O2 bf16", "apex O2 fp16", "O2 bf16 x zero2", "O2 bf16 x zero3"])
def test_deep_weights_loaded_after_initialize_are_what_the_next_step_starts_from(config):
    """O2 steps fp32 masters and copies them into the half model: a model.load_state_dict after
    initialize must reach the masters, or the step writes the old weights back. With lr 0 the
    weights stay the loaded ones."""
    for rank, state in enumerate(run_ranks(_load_after_initialize, 2, config, 0.0)):
        for key, value in state.items():
            assert torch.equal(value, torch.full_like(value, 0.5)), (rank, key, value)
