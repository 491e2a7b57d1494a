"""ZeRO offload (zero=dict(level=L, offload='cpu')): masters and optimizer state on the CPU, the
step there; the training is the non-offloaded run's, bit for bit in float32 (here the CPU stands
in for both devices, so each tensor is counted by the side that holds it: zero/offload.py)."""
import pytest
import torch
from dist_helpers import run_ranks
from torch import nn
from torch.testing import assert_close

import nanocolossal as nc
import nanocolossal.zero.mixed as zero_mixed
from nanocolossal.amp import AMP_TYPE
from nanocolossal.checkpoint import load_checkpoint, save_checkpoint
from nanocolossal.config import ConfigError, load_config

pytestmark = pytest.mark.timeout(120)


def _lesson_worker(rank, world_size, port, offload, xs, ys):
    nc.launch(dict(zero=dict(level=2, offload=offload)), rank=rank, world_size=world_size,
              host="127.0.0.1", port=port)
    torch.manual_seed(0)  # every rank builds the model the reference builds
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))  # float32, 67: padded
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    engine, *_ = nc.initialize(model, optimizer, nn.CrossEntropyLoss(), verbose=False)
    for x, y in zip(xs, ys):
        x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]  # my half of the batch
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()  # my gradient shard to the CPU, AdamW there, my shard back, all-gather
    return engine.model.state_dict()


def test_gloo_zero_offload_equals_zero_bit_for_bit():
    """Moving the masters and AdamW's state to the CPU changes where the step runs, not what it
    computes: the same bits as ZeRO 2 without offload, and one process within rounding."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    xs, ys = torch.randn(3, 8, 4), torch.randint(0, 3, (3, 8))  # 3 batches of 8
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    for x, y in zip(xs, ys):  # the whole batch in one process
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    on_device = run_ranks(_lesson_worker, 2, None, xs, ys)
    for rank, state in enumerate(run_ranks(_lesson_worker, 2, "cpu", xs, ys)):
        assert all(torch.equal(state[k], on_device[rank][k]) for k in state), rank
        assert_close(state, model.state_dict(), msg=lambda m: f"rank {rank}: {m}")


# -- the bytes each side holds --------------------------------------------------------------
class LinearLoss(nn.Module):
    def forward(self, out, c):
        return (out.float() * c).sum() / out.shape[0]


def _batch(step, n):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, 10, generator=g), torch.randn(n, 5, generator=g)


def _launch(rank, world_size, port, config, dtype=torch.float32):
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 9), nn.Tanh(), nn.Linear(9, 5)).to(dtype)  # Psi = 149
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    optimizer = torch.optim.AdamW([{"params": weights, "weight_decay": 0.1},
                                   {"params": biases, "lr": 0.03}], lr=0.02)
    return nc.initialize(model, optimizer, LinearLoss(), verbose=False)[0]


def _config(level, offload="cpu", bf16=False, **extra):
    config = dict(zero=dict(level=level, offload=offload, reduce_bucket_size_mb=2e-4), **extra)
    if bf16:
        config["fp16"] = dict(mode=AMP_TYPE.NAIVE, dtype="bfloat16")
    return config


def _bytes(tensors):
    """Bytes of the storages behind `tensors`, each storage once (a flat buffer counts whole)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors}.values())


def _grad_bytes(params):
    return sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)


def _sides(engine):
    """(device-side bytes: parameters, gradients; offload-side: masters, their gradients, the
    optimizer state), from live tensors; the two sides share no storage."""
    opt, params = engine.optimizer, list(engine.model.parameters())
    views, masters = [v for v, _ in opt.master_pairs()], [m for _, m in opt.master_pairs()]
    states = [t for s in opt.optimizer.state.values() for k, t in s.items() if k != "step"]
    held = opt.shard_bytes() if opt.level == 3 else _bytes(params)  # level 3: my shard only
    device = [held, _grad_bytes(params + views)]
    offload = [_bytes(masters), _grad_bytes(masters), _bytes(states)]
    device_ptrs = {t.untyped_storage().data_ptr() for t in params + views}
    assert not device_ptrs & {t.untyped_storage().data_ptr() for t in masters + states}
    assert all(t.device == opt.offload.device for t in masters + states)
    return device, offload


def _bytes_worker(rank, world_size, port, level, bf16):
    engine = _launch(rank, world_size, port, _config(level, bf16=bf16))
    x, c = _batch(0, world_size * 2)
    for step in range(2):  # after the second backward: states exist, gradients are fresh
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x[rank::world_size]), c[rank::world_size]))
        if step == 0:
            assert engine.step()
    after_backward = _sides(engine)
    engine.optimizer.overflow_flag()  # the step's first act: the copy-out
    in_step = _sides(engine)
    assert engine.step()
    return after_backward, in_step


@pytest.mark.parametrize("level, bf16", [(1, False), (2, False), (3, False), (2, True),
                                         (3, True)])
def test_deep_zero_offload_bytes_per_side_equal_the_formula(level, bf16):
    """Device: the parameters (4 Psi; bf16 2 Psi; level 3 my shard) and the gradients as the level
    keeps them until the copy-out (level 1: DDP's, all; 2-3: my shard, then none). CPU: 4 Psi/N
    masters + 8 Psi/N AdamW state, + 4 Psi/N gradients from the copy-out on."""
    b, n, psi = 2 if bf16 else 4, 2, 149
    # one flat buffer per param group (weights, biases); level 3: per unit too, each padded
    buffers = (90, 9, 45, 5) if level == 3 else (90 + 45, 9 + 5)
    shards = [-(-g // n) for g in buffers]
    mine = [sum(min(s, max(0, g - r * s)) for g, s in zip(buffers, shards)) for r in range(n)]
    params = [b * sum(shards) if level == 3 else b * n * sum(shards)] * n  # level 3: my shard
    for r, (after_backward, in_step) in enumerate(run_ranks(_bytes_worker, n, level, bf16)):
        grads = b * psi if level == 1 else b * mine[r]
        assert after_backward == ([params[r], grads], [4 * mine[r], 0, 8 * mine[r]]), r
        assert in_step == ([params[r], grads if level == 1 else 0],
                           [4 * mine[r], 4 * mine[r], 8 * mine[r]]), r


# -- the same training, however the config spells it ------------------------------------------
def _train_worker(rank, world_size, port, config, accum=1, load=None, save=None,
                  dtype=torch.float32):
    """4 steps of world_size x accum x 2 samples (steps 2-3 only after `load`; `save` after 2)."""
    engine = _launch(rank, world_size, port, config, dtype)
    first = load_checkpoint(load, engine.model, engine.optimizer)["epoch"] if load else 0
    for step in range(first, 4):
        x, c = (t.to(dtype) for t in _batch(step, world_size * accum * 2))
        for micro in range(accum):
            lo = (micro * world_size + rank) * 2
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x[lo:lo + 2]), c[lo:lo + 2]))
            assert engine.step() or micro < accum - 1
        if save and step == 1:
            save_checkpoint(save, 2, engine.model, engine.optimizer)
    return engine.model.state_dict(), getattr(engine.optimizer, "offload", None) is not None


def _assert_equal(got, want):
    for rank, ((state, _), (expected, _)) in enumerate(zip(got, want)):
        bad = [k for k in expected if not torch.equal(state[k], expected[k])]
        assert not bad, f"rank {rank}: {bad} differ"


@pytest.mark.parametrize("level, bf16, clip, accum", [
    (1, False, 0.0, 1), (2, False, 0.05, 1), (3, False, 0.05, 1),
    (2, False, 0.0, 2), (2, True, 0.0, 1), (3, True, 0.05, 2)])
def test_deep_zero_offload_equals_zero_without(level, bf16, clip, accum):
    """Levels 1-3, AMP O2 in bf16, clipping (its squares summed on the CPU side) and gradient
    accumulation (gradients add up on the device; one copy-out per step). Plain level 3 in
    float32 is test_deep_v01_tensor_placement_policy_cpu_is_offload's run; level 2,
    test_gloo_zero_offload_equals_zero_bit_for_bit's."""
    extra = dict(gradient_accumulation=accum, **({"clip_grad_norm": clip} if clip else {}))
    got = run_ranks(_train_worker, 2, _config(level, bf16=bf16, **extra), accum)
    assert all(offloaded for _, offloaded in got)
    _assert_equal(got, run_ranks(_train_worker, 2, _config(level, None, bf16, **extra), accum))


@pytest.mark.parametrize("level, dtype", [(2, torch.float32), (3, torch.float64)])
def test_deep_zero_offload_checkpoint_loads_with_and_without_offload(level, dtype, tmp_path):
    """An offloaded run's checkpoint is the plain one: resumed with or without offload (and a
    plain one resumed with it), steps 2-3 give the straight run's bits."""
    offloaded, plain = tmp_path / "offloaded.pt", tmp_path / "plain.pt"
    straight = run_ranks(_train_worker, 2, _config(level, None), 1, None, plain, dtype)
    _assert_equal(run_ranks(_train_worker, 2, _config(level), 1, None, offloaded, dtype),
                  straight)
    for path, place in ((offloaded, None), (offloaded, "cpu"), (plain, "cpu")):
        _assert_equal(run_ranks(_train_worker, 2, _config(level, place), 1, path, None, dtype),
                      straight)


def test_deep_v01_tensor_placement_policy_cpu_is_offload():
    """Colossal-AI v0.1's zero=dict(model_config=dict(tensor_placement_policy='cpu')): level 3
    with offload, the same bits as level 3 without."""
    v01 = dict(zero=dict(model_config=dict(tensor_placement_policy="cpu")))
    got = run_ranks(_train_worker, 2, v01)
    assert all(offloaded for _, offloaded in got)
    _assert_equal(got, run_ranks(_train_worker, 2, dict(zero=dict(level=3))))


def _load_worker(rank, world_size, port, level, offload):
    engine = _launch(rank, world_size, port, _config(level, offload))
    torch.manual_seed(1)  # a pretrained model, loaded after initialize
    engine.model.load_state_dict({k: torch.randn(v.shape) for k, v in
                                  engine.model.state_dict().items()})
    x, c = _batch(0, 2 * world_size)
    engine.zero_grad()
    engine.backward(engine.criterion(engine(x[rank::world_size]), c[rank::world_size]))
    assert engine.step()
    return engine.model.state_dict(), None


@pytest.mark.parametrize("level", [1, 2, 3])
def test_deep_zero_offload_masters_follow_a_model_loaded_after_initialize(level):
    """The step updates the weights just loaded into the model, not the CPU's older copies:
    the fp32 masters follow a model load as the model's own segments do without offload."""
    _assert_equal(run_ranks(_load_worker, 2, level, "cpu"),
                  run_ranks(_load_worker, 2, level, None))


# -- the non-finite check: where the gradients are, before the copy-out ----------------------
def _skip_worker(rank, world_size, port, config):
    """4 steps; step 1's batch holds an inf (on the last rank): every rank skips that step.
    Returns each step's (taken, checked on the device), the loss scale, the weights."""
    engine = _launch(rank, world_size, port, config)
    checked, unscale = [], zero_mixed.unscale_grads

    def spy(grads, scale):  # offload's own check (this rank's process only): on the views?
        views = [v.grad for v, _ in engine.optimizer.master_pairs() if v.grad is not None]
        checked.append(len(views) > 0 and [g.data_ptr() for g in grads] ==
                       [g.data_ptr() for g in views])
        return unscale(grads, scale)
    zero_mixed.unscale_grads = spy
    try:
        log = [_skip_step(engine, rank, world_size, step, checked) for step in range(4)]
    finally:  # the rank runs other tests' jobs next
        zero_mixed.unscale_grads = unscale
    return log, engine.optimizer.loss_scale, engine.model.state_dict()


def _skip_step(engine, rank, world_size, step, checked):
    x, c = _batch(step, world_size * 2)
    if step == 1:
        x[-1, 0] = float("inf")
    engine.zero_grad()
    engine.backward(engine.criterion(engine(x[rank * 2:rank * 2 + 2]), c[rank * 2:rank * 2 + 2]))
    checked.clear()
    taken = bool(engine.step())
    return taken, checked == [True]


CHECKS = [  # (level, AMP mode, dtype): where the check runs follows from the last two
    (1, AMP_TYPE.TORCH, "float16"),    # fp32 gradients: unscaled and checked on the device
    (2, AMP_TYPE.NAIVE, "bfloat16"),   # half gradients, nothing to unscale: checked there
    (3, AMP_TYPE.TORCH, "bfloat16"),
    (2, AMP_TYPE.NAIVE, "float16"),    # half gradients and a scale: the CPU, in fp32
]
CHECK_MATRIX = [(level, mode, dtype) for level in (1, 2, 3)
                for mode in (AMP_TYPE.TORCH, AMP_TYPE.NAIVE) for dtype in ("float16", "bfloat16")
                if (level, mode, dtype) not in CHECKS]


@pytest.mark.parametrize("level, mode, dtype", CHECKS)
def test_gloo_zero_offload_checks_gradients_on_the_model_s_device(level, mode, dtype):
    """The inf/nan check (and unscaling, where the gradients are fp32) reads the gradients on
    the model's device -- one fused pass there, not a slow one on the CPU -- before the
    copy-out; the skipped step, the loss scale and the weights are those without offload."""
    _check_where_and_what(level, mode, dtype)


@pytest.mark.parametrize("level, mode, dtype", CHECK_MATRIX)
def test_deep_zero_offload_check_every_level_x_opt_level_x_half_type(level, mode, dtype):
    _check_where_and_what(level, mode, dtype)


def _check_where_and_what(level, mode, dtype):
    on_device = not (mode == AMP_TYPE.NAIVE and dtype == "float16")
    config = _config(level, fp16=dict(mode=mode, dtype=dtype))
    got = run_ranks(_skip_worker, 2, config)
    want = run_ranks(_skip_worker, 2, _config(level, None, fp16=dict(mode=mode, dtype=dtype)))
    for (log, scale, state), (wlog, wscale, wstate) in zip(got, want):
        # the inf's step skipped (fp16 may skip its first too: the scaler starts high)
        assert [t for t, _ in log] == [t for t, _ in wlog] and not log[1][0]
        assert all(where == on_device for _, where in log), log
        assert scale == wscale
        assert all(torch.equal(state[k], wstate[k]) for k in wstate)


@pytest.mark.parametrize("zero, message", [
    (dict(level=2, offload="nvme"), "zero.offload='nvme': only 'cpu' is built here"),
    (dict(level=1, offload=True), "zero.offload=True: only 'cpu' is built here"),
    (dict(model_config=dict(tensor_placement_policy="nvme")),
     "tensor_placement_policy must be one of cuda, cpu, auto"),
])
def test_zero_offload_refusals_say_what_to_use(zero, message):
    with pytest.raises(ConfigError) as e:
        load_config(dict(zero=zero))
    assert message in str(e.value)


def _cuda_worker(rank, world_size, port, fp16):
    extra = {"fp16": fp16, "clip_grad_norm": 0.05} if fp16 else {}
    engine = _launch(rank, world_size, port, _config(2, **extra))
    opt = engine.optimizer
    x, c = _batch(0, 2)
    engine.zero_grad()
    engine.backward(engine.criterion(engine(x.cuda()), c.cuda()))
    if fp16:  # checked on the GPU; read by the CPU's clipping and step
        assert opt.overflow_flag().device.type == "cpu"
    assert engine.step()
    torch.cuda.synchronize()
    assert all(m.device.type == "cpu" and m.is_pinned() for _, m in opt.master_pairs())
    assert all(v.is_cuda for v, _ in opt.master_pairs())
    assert all(p.is_cuda for p in engine.model.parameters())
    assert all(t.device.type == "cpu" for s in opt.optimizer.state.values() for t in s.values())
    for v, m in opt.master_pairs():  # the copy-in landed
        assert torch.equal(v.detach().cpu(), m.detach())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fp16", [None, dict(mode=AMP_TYPE.TORCH, dtype="bfloat16")])
def test_cuda_zero_offload_masters_are_pinned_cpu_tensors_and_the_model_on_cuda(fp16):
    """(bf16 with clipping: the check on the GPU, its flag on the CPU for clipping and step.)"""
    run_ranks(_cuda_worker, 1, fp16, cuda=True, timeout=120)
