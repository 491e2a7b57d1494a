"""The Engine on 2 gloo ranks gives what one process gives on the whole batch."""
import copy

import pytest
import torch
from dist_helpers import run_ranks
from torch import nn
from torch.testing import assert_close

import nanocolossal as nc
from nanocolossal.amp import AMP_TYPE
from nanocolossal.context import gpc

pytestmark = pytest.mark.timeout(120)
B = 3  # samples per rank per micro-batch


def _lesson_worker(rank, world_size, port, xs, ys):
    nc.launch(dict(gradient_accumulation=2), rank=rank, world_size=world_size,
              host="127.0.0.1", port=port)
    torch.manual_seed(0)  # every rank builds the model the reference builds
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    engine, *_ = nc.initialize(model, optimizer, nn.CrossEntropyLoss(), verbose=False)
    stepped = []
    for x, y in zip(xs, ys):
        for micro_x, micro_y in zip(x.chunk(2), y.chunk(2)):  # 2 micro-batches of 4 samples
            micro_x, micro_y = micro_x.chunk(world_size)[rank], micro_y.chunk(world_size)[rank]
            engine.zero_grad()  # acts before the first micro-step only
            engine.backward(engine.criterion(engine(micro_x), micro_y))  # adds loss / 2
            stepped.append(engine.step())  # averages over the ranks and steps on the last only
    return engine.model.state_dict(), stepped


def test_gloo_engine_accumulation_on_two_ranks_equals_one_big_step():
    """Each batch as 2 micro-steps on each of 2 ranks, gradients accumulated: one optimizer step
    per batch, the step one process takes on the whole batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    xs, ys = torch.randn(3, 8, 4, dtype=torch.float64), torch.randint(0, 3, (3, 8))  # 3 batches
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for x, y in zip(xs, ys):  # the whole batch of 8, one step
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    for rank, (state, stepped) in enumerate(run_ranks(_lesson_worker, 2, xs, ys)):
        assert stepped == [False, True] * 3
        assert_close(state, model.state_dict(), msg=lambda m: f"rank {rank}: {m}")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))


def _batch(step, n):
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(n, 6, generator=g), torch.randint(0, 4, (n,), generator=g)


def _engine(config, rank, world_size, port, lr=0.1):
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    engine, *_ = nc.initialize(model, opt, nn.CrossEntropyLoss(), verbose=False)
    return engine


def _accumulation_worker(rank, world_size, port, n_accum, clip, extra=None):
    config = {"gradient_accumulation": n_accum, **({"clip_grad_norm": clip} if clip else {}),
              **(extra or {})}
    engine = _engine(config, rank, world_size, port)
    single = _model()
    single_opt = torch.optim.SGD(single.parameters(), lr=0.1, momentum=0.9)
    norms = []
    for step in range(3):
        xs, ys = _batch(step, world_size * n_accum * B)
        stepped = []
        for micro in range(n_accum):  # this rank's b samples of each micro-batch
            lo = (micro * world_size + rank) * B
            engine.zero_grad()
            loss = engine.criterion(engine(xs[lo:lo + B]), ys[lo:lo + B])
            engine.backward(loss)
            stepped.append(engine.step())
        assert stepped == [False] * (n_accum - 1) + [True]
        single_opt.zero_grad()
        nn.functional.cross_entropy(single(xs), ys).backward()
        if clip:
            norms.append((engine.last_grad_norm,
                          torch.nn.utils.clip_grad_norm_(single.parameters(), clip).item()))
        single_opt.step()
    for (name, p), q in zip(engine.model.named_parameters(), single.parameters()):
        assert_close(p, q, msg=lambda m: f"{name}: {m}")
    return norms, list(engine.model.state_dict())


def test_deep_engine_gradient_accumulation_equals_one_big_step():
    (_, keys), _ = run_ranks(_accumulation_worker, 2, 4, 0.0)
    assert keys == list(_model().state_dict()), "engine.model.state_dict() has no wrapper prefixes"


def test_gloo_gradient_handler_equals_one_process_with_accumulation_and_clipping():
    """Colossal-AI's after-backward all-reduce instead of DDP: the same training."""
    handler = {"gradient_handler": [dict(type="DataParallelGradientHandler")]}
    for norms, _ in run_ranks(_accumulation_worker, 2, 2, 0.05, handler):
        for ours, single in norms:
            assert ours == pytest.approx(single, rel=1e-5)


class Branchy(nn.Module):
    """A trunk, a branch used only when asked, and a branch nothing uses."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.branch, self.never = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, use_branch: bool = False) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return self.head(h + torch.tanh(self.branch(h)) if use_branch else h)


def _unused_worker(rank, world_size, port, branch_ranks, config):
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    model, single = Branchy(), Branchy()

    def sgd(m):  # weight decay and momentum would move a parameter given a zero gradient
        return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    engine, *_ = nc.initialize(model, sgd(model), nn.CrossEntropyLoss(), verbose=False)
    single_opt = sgd(single)
    for step in range(3):
        x, y = _batch(step, world_size * B)
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x[rank * B:(rank + 1) * B], rank in branch_ranks),
                                         y[rank * B:(rank + 1) * B]))
        engine.step()
        single_opt.zero_grad()
        loss = sum(nn.functional.cross_entropy(single(x[r * B:(r + 1) * B], r in branch_ranks),
                                               y[r * B:(r + 1) * B], reduction="sum")
                   for r in range(world_size))
        (loss / len(y)).backward()
        single_opt.step()
    for (name, p), q in zip(model.named_parameters(), single.parameters()):
        assert_close(p, q, msg=lambda m: f"{name}: {m}")
        assert (p.grad is None) == (q.grad is None), f"{name}: grad None-ness differs"
    assert model.never.weight.grad is None
    assert torch.equal(model.never.weight, Branchy().never.weight), "unused: never moved"


@pytest.mark.parametrize("branch_ranks", [(), (1,), (0, 1)], ids=["nowhere", "one-rank", "all"])
@pytest.mark.parametrize("sync", ["handler", "ddp"])
def test_deep_a_parameter_no_rank_used_keeps_no_gradient_and_does_not_move(sync, branch_ranks):
    """Weight decay and momentum move a parameter whose gradient is zero, not one whose gradient
    is None: a parameter no rank used must stay None (one process), one some rank used gets the
    average on every rank."""
    config = {"gradient_handler": [dict(type="DataParallelGradientHandler")]} if sync == "handler" \
        else {}
    run_ranks(_unused_worker, 2, branch_ranks, config)


def _grads_worker(rank, world_size, port, ddp):
    engine = _engine({"ddp": ddp}, rank, world_size, port)
    x, y = _batch(0, 2 * B)
    engine.zero_grad()
    engine.backward(engine.criterion(engine(x[rank * B:(rank + 1) * B]),
                                     y[rank * B:(rank + 1) * B]))
    grads = [p.grad for p in engine.model.parameters()]
    return [g.clone() for g in grads], len({g.untyped_storage().data_ptr() for g in grads})


def test_deep_ddp_options_from_the_config_reach_ddp_and_keep_training_exact():
    """ddp=dict(gradient_as_bucket_view=True): the grads are views of one bucket, the result
    unchanged."""
    assert run_ranks(_grads_worker, 2, {})[0][1] == 4, "by default each parameter owns its grad"
    assert run_ranks(_grads_worker, 2, {"gradient_as_bucket_view": True})[0][1] == 1
    run_ranks(_accumulation_worker, 2, 2, 0.0,
              {"ddp": {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.0002}})


def test_deep_ddp_compress_from_the_config_all_reduces_in_bf16():
    exact = run_ranks(_grads_worker, 2, {})[0][0]
    compressed = run_ranks(_grads_worker, 2, {"compress": "bf16"})[0][0]
    for e, c in zip(exact, compressed):
        assert_close(c, e, rtol=2**-7, atol=1e-3)  # bf16 keeps 8 bits of mantissa
    assert any(not torch.equal(c, e) for e, c in zip(exact, compressed)), "the wire really was bf16"
    for c in compressed:  # each averaged gradient went over the wire as bf16
        assert torch.equal(c, c.bfloat16().float())


def test_gloo_engine_clipping_uses_the_whole_batch_norm():
    for norms, _ in run_ranks(_accumulation_worker, 2, 1, 0.05):
        for ours, single in norms:
            assert ours == pytest.approx(single, rel=1e-5)
        assert all(single > 0.05 for _, single in norms), "the clip really clipped"


def _overflow_worker(rank, world_size, port, fp16):
    engine = _engine({"fp16": fp16}, rank, world_size, port)
    before = copy.deepcopy(engine.model.state_dict())
    x, y = _batch(0, 2 * B)
    engine.zero_grad()
    engine.backward(engine.criterion(engine(x[rank * B:(rank + 1) * B]),
                                     y[rank * B:(rank + 1) * B]))
    if rank == 1:  # after DDP's all-reduce: only rank 1 knows
        engine.model[0].weight.grad[0, 0] = float("inf")
    stepped = engine.step()
    unchanged = all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())
    return stepped, engine.optimizer.loss_scale, unchanged


def test_gloo_engine_overflow_on_one_rank_skips_on_all():
    fp16 = {"mode": AMP_TYPE.TORCH, "init_scale": 1024.0, "dtype": "float16"}
    assert run_ranks(_overflow_worker, 2, fp16,
                     timeout=60) == [(False, 512.0, True), (False, 512.0, True)]


@pytest.mark.parametrize("mode", [AMP_TYPE.TORCH, AMP_TYPE.NAIVE])
def test_deep_engine_bf16_non_finite_on_one_rank_skips_on_all(mode):
    """bf16 has no scaler, but an inf on one rank must still keep every rank's weights."""
    fp16 = {"mode": mode, "dtype": "bfloat16"}
    assert run_ranks(_overflow_worker, 2, fp16,
                     timeout=60) == [(False, 1.0, True), (False, 1.0, True)]


def _config_worker(rank, world_size, port, fp16):
    engine = _engine({"sync_bn": True, "fp16": fp16}, rank, world_size, port)
    return (type(engine.forward_module).__name__, engine.model[0].weight.dtype,
            engine.optimizer.scaler is not None, nc.cpu_half.cpu_half_dtype())


def test_gloo_initialize_applies_config():
    for wrapper, dtype, scaled, _ in run_ranks(_config_worker, 2,
                                               {"mode": "naive", "dtype": "float16"}):
        assert wrapper == "DistributedDataParallel" and dtype == torch.float16 and scaled


def test_gloo_initialize_picks_the_cpus_half_type_for_fp16_on_cpu():
    """bf16 where this CPU has bfloat16 instructions, else float32 -- rank 0's answer, so every
    rank agrees."""
    results = run_ranks(_config_worker, 2, {"mode": AMP_TYPE.NAIVE})
    assert len({r[3] for r in results}) == 1, "one decision for the whole job"
    for _, dtype, scaled, half in results:
        assert half == (torch.bfloat16 if nc.cpu_half.has_bf16_instructions() else None)
        # bf16 has fp32's range: nothing to scale
        assert dtype == (half or torch.float32) and not scaled


def test_initialize_without_launch_is_plain_single_process():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, train_dl, test_dl, sched = nc.initialize(model, optimizer, nn.CrossEntropyLoss(), [1],
                                                     None, "sched")
    assert engine.model is model and engine.forward_module is model
    assert train_dl == [1] and sched == "sched"
    x, y = _batch(0, 4)
    output, label, loss = engine.execute_schedule((x, y))
    assert output.shape == (4, 4) and torch.equal(label, y) and loss.requires_grad
    assert engine.step() is True


BAD_BATCHES = {  # a batch that is not (inputs, labels), and what the error says
    "a tensor of two rows": (torch.randn(2, 6), r"got a tensor of shape \(2, 6\)"),
    "a triple": ((torch.randn(4, 6), torch.zeros(4), torch.zeros(4)), "got a tuple of 3"),
    "a dict": ({"x": torch.randn(4, 6)}, "got a dict"),
    "no labels": ((torch.randn(4, 6), None), "labels are None"),
}


@pytest.mark.parametrize("name", BAD_BATCHES)
def test_a_batch_that_is_not_inputs_and_labels_is_refused_before_it_runs(name):
    """A tensor of two rows unpacks into (inputs, labels) without a word: row 0 trained to predict
    row 1. The engine refuses every batch that is not a pair, naming the rank."""
    model = _model()
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               nn.CrossEntropyLoss(), verbose=False)
    batch, message = BAD_BATCHES[name]
    with pytest.raises(TypeError, match=r"\[rank 0\] .*" + message):
        engine.execute_schedule(batch)
    assert all(p.grad is None for p in model.parameters())
    engine.execute_schedule(_batch(0, 4), forward_only=True)  # a pair: fine


@pytest.mark.parametrize("fp16, cpu_half, level, compute, weights, scale", [
    ({"mode": AMP_TYPE.TORCH, "dtype": "float16"}, None,
     "O1 (TORCH)", torch.float16, torch.float32, 2.0**16),
    ({"mode": AMP_TYPE.NAIVE, "initial_scale": 2.0**12, "dtype": "float16"}, None,
     "O2 (NAIVE)", torch.float16, torch.float16, 2.0**12),
    ({"mode": AMP_TYPE.APEX, "opt_level": "O3", "dtype": torch.bfloat16}, None,
     "O3 (APEX)", torch.bfloat16, torch.bfloat16, 1.0),
    # no dtype: a CPU with fast bf16 kernels computes in bf16 (no scaling needed) ...
    ({"mode": "apex"}, torch.bfloat16, "O1 (APEX)", torch.bfloat16, torch.float32, 1.0),
    # ... one without them in float32, the same training at full speed
    ({"mode": AMP_TYPE.TORCH}, None, "O1 (TORCH) in float32 on this CPU", torch.float32,
     torch.float32, 1.0),
    ({"mode": AMP_TYPE.TORCH, "dtype": "bfloat16"}, None,  # asked for by name: kept
     "O1 (TORCH)", torch.bfloat16, torch.float32, 1.0),
], ids=["torch-fp16", "naive-fp16-scale", "apex-O3-bf16", "cpu-fast-bf16", "cpu-slow-half",
        "cpu-slow-bf16-asked"])
def test_fp16_config_picks_the_opt_level_dtype_and_loss_scale(monkeypatch, capsys, fp16,
                                                              cpu_half, level, compute, weights,
                                                              scale):
    monkeypatch.setattr(nc.cpu_half, "cpu_half_dtype", lambda: cpu_half)  # this CPU's answer
    gpc.config = nc.load_config({"fp16": fp16})
    model = _model()
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               nn.CrossEntropyLoss())
    assert f"initialize: AMP {level}" in capsys.readouterr().out
    seen = []
    model[0].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    engine(_batch(0, 4)[0])
    assert seen == [compute] and model[0].weight.dtype == weights
    assert engine.optimizer.loss_scale == scale


@pytest.mark.parametrize("fp16", [
    {"mode": AMP_TYPE.NAIVE},  # CPU default: bf16, no scaler
    {"mode": AMP_TYPE.NAIVE, "dtype": "float16"},
    {"mode": AMP_TYPE.APEX, "opt_level": "O2", "loss_scale": None},
    {"mode": AMP_TYPE.APEX, "opt_level": "O2", "loss_scale": None, "dtype": "float16"},
    {"mode": AMP_TYPE.APEX, "opt_level": "O3", "dtype": "bfloat16"},
    {"mode": AMP_TYPE.APEX, "opt_level": "O3", "dtype": "float16", "loss_scale": 128.0},
    {"mode": AMP_TYPE.TORCH},
])
def test_engine_amp_modes_train_every_weight(fp16):
    gpc.config = nc.load_config({"fp16": fp16})
    model = _model()
    before = copy.deepcopy(model.state_dict())
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               nn.CrossEntropyLoss(), verbose=False)
    for step in range(3):
        engine.zero_grad()
        engine.execute_schedule(_batch(step, 8))
        assert engine.step() is True
    for key, value in engine.model.state_dict().items():
        assert not torch.equal(value.float(),
                               before[key].float()), f"{key} never trained under {fp16}"


def _handler_buffers_worker(rank, world_size, port, config):
    """The gradient handler and ZeRO level 3 have no per-forward buffer broadcast: BatchNorm
    statistics move apart in training, and engine.eval() gives every replica rank 0's."""
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 4))
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               nn.CrossEntropyLoss(), verbose=False)
    x, y = _batch(0, 2 * B)
    engine.zero_grad()
    engine.backward(engine.criterion(engine(x[rank * B:(rank + 1) * B]),
                                     y[rank * B:(rank + 1) * B]))
    engine.step()
    moved = model[1].running_mean.clone()
    engine.eval()
    return moved, model[1].running_mean.clone()


@pytest.mark.parametrize("config", [
    {"gradient_handler": [dict(type="DataParallelGradientHandler")]}, {"zero": dict(level=3)}],
    ids=["gradient_handler", "zero-3"])
def test_deep_without_ddp_every_replica_evaluates_with_rank0s_buffers(config):
    (moved0, eval0), (moved1, eval1) = run_ranks(_handler_buffers_worker, 2, config)
    assert not torch.equal(moved0, moved1), "each replica's statistics moved with its own batch"
    assert torch.equal(eval0, moved0) and torch.equal(eval1, moved0)


def _seeded_worker(rank, world_size, port, config):
    """A model built under a per-rank seed (nanoGPT seeds 1337 + rank), trained 3 steps."""
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    torch.manual_seed(1337 + rank)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               nn.CrossEntropyLoss(), verbose=False)
    per = 8 // world_size
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x[rank * per:][:per]), y[rank * per:][:per]))
        engine.step()
    return engine.model.state_dict()  # (O2: bf16, compared at bf16 precision)


BF16_O2 = {"fp16": {"mode": AMP_TYPE.NAIVE, "dtype": "bfloat16"}}
SEEDED = {"DDP": {}, "DDP, O2": BF16_O2,
          "gradient handler, O2": {**BF16_O2, "gradient_handler": [
              {"type": "DataParallelGradientHandler"}]},
          "ZeRO 1, O2": {**BF16_O2, "zero": {"level": 1}}, "ZeRO 2": {"zero": {"level": 2}},
          "ZeRO 3": {"zero": {"level": 3}}, "ZeRO 3, O2": {**BF16_O2, "zero": {"level": 3}}}


@pytest.mark.parametrize("layout", SEEDED)
def test_deep_replicas_built_under_per_rank_seeds_start_as_rank_0s(layout):
    """initialize gives every replica rank 0's parameters (and buffers) before AMP copies fp32
    masters out of them and ZeRO cuts them into shards: two ranks train as one process built
    from rank 0's seed (without: O2 replicas drift apart by 0.8, ZeRO 3 trains a mix)."""
    [want] = run_ranks(_seeded_worker, 1, SEEDED[layout], timeout=60)
    tol = dict(atol=5e-3, rtol=0) if "O2" in layout else {}  # bf16: a ulp or two apart
    for got in run_ranks(_seeded_worker, 2, SEEDED[layout], timeout=60):
        assert_close(got, want, **tol, msg=lambda m: f"{layout}: {m}")


# -- a backward without a step: dropped by zero_grad, as torch drops it; one past the engine ------

def _dropped_backward_worker(rank, world_size, port, config, steps, junk=True):
    """A junk batch's backward, dropped by zero_grad before any step (`junk` 'closed': one
    micro-step of a group closed early, as an epoch's short last group is); then `steps` real
    steps on this rank's share of the whole batches."""
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    model = _model()
    if gpc.pipeline_size > 1:
        model = nc.pipeline.build_pipeline_model(model)
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               nn.CrossEntropyLoss(), verbose=False)

    micro = config.get("gradient_accumulation", 1)

    def backward(batch):  # a whole group: this rank's share in `micro` micro-steps
        if gpc.pipeline_size > 1:  # every stage takes the whole batch: the schedule splits it
            engine.execute_schedule(batch)
            return
        x, y = batch
        for m in range(micro):
            engine.zero_grad()  # a no-op after the group's first micro-step
            share = slice(rank * micro + m, None, world_size * micro)
            engine.backward(engine.criterion(engine(x[share]), y[share]))
            if m < micro - 1:
                engine.step()  # not the group's end: no step
    junk_x, junk_y = _batch(99, 4)
    if junk == "closed":
        engine.close_group()
        engine.zero_grad()
        share = slice(rank, None, world_size)
        engine.backward(engine.criterion(engine(junk_x[share] * 100), junk_y[share]))
    elif junk:
        backward((junk_x * 100, junk_y))
    if junk and "fp16" in config:  # the loop looks at the unscaled gradients before it drops them
        engine.optimizer.unscale_()
    for step in range(steps):
        engine.zero_grad()
        backward(_batch(step, 4))
        engine.step()
    return {k: v.clone() for k, v in engine.model.state_dict().items()}


FP16 = {"mode": AMP_TYPE.TORCH, "dtype": "float16", "init_scale": 1024.0}


@pytest.mark.parametrize("config", [{}, {"zero": {"level": 1}}, {"zero": {"level": 2}},
                                    {"zero": {"level": 3}},
                                    {"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2},
                                    {"gradient_accumulation": 2},
                                    {"gradient_accumulation": 2, "zero": {"level": 2}}],
                         ids=["ddp", "zero1", "zero2", "zero3", "pipeline", "accumulation 2",
                              "accumulation 2 x zero2"])
def test_gloo_a_backward_dropped_by_zero_grad_leaves_nothing_behind(config):
    """torch's zero_grad drops gradients no step used (a dry run, a batch the loop skips); a
    whole group that took no step is dropped alike by the engine's: the steps that follow are one
    process's steps without that batch."""
    want = _two_steps_one_process()
    held = {}
    for rank, state in enumerate(run_ranks(_dropped_backward_worker, 2, config, 2)):
        # (a pipeline stage holds its layers, under the whole model's keys)
        assert_close(state, {k: want[k] for k in state}, msg=lambda m: f"rank {rank}: {m}")
        held.update(state)
    assert held.keys() == want.keys()


def _two_steps_one_process():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(_batch(step, 4)[0]), _batch(step, 4)[1]).backward()
        optimizer.step()
    return model.state_dict()


def test_gloo_a_closed_group_that_took_no_step_is_dropped_by_zero_grad():
    """A group closed early (close_group: an epoch's short last group) is whole after its first
    backward: a zero_grad before its step drops it, and the close, like any whole group's."""
    want = _two_steps_one_process()
    config = {"gradient_accumulation": 2}
    for rank, state in enumerate(run_ranks(_dropped_backward_worker, 2, config, 2, "closed")):
        assert_close(state, want, msg=lambda m: f"rank {rank}: {m}")


O2 = {"mode": AMP_TYPE.NAIVE, "dtype": "float16", "initial_scale": 1024.0}


@pytest.mark.parametrize("config", [{"fp16": FP16}, {"fp16": FP16, "zero": {"level": 1}},
                                    {"fp16": O2}],
                         ids=["fp16", "fp16 x zero1", "fp16 O2"])
def test_gloo_a_backward_unscaled_then_dropped_by_zero_grad_leaves_no_overflow_flag(config):
    """A loop that looks at the unscaled gradients (their norm, say) and then drops the batch:
    its overflow check goes with it, and the next steps unscale their own gradients (under O2:
    into the fp32 masters), as one process under the same AMP that never saw that batch."""
    want = run_ranks(_dropped_backward_worker, 1, {"fp16": config["fp16"]}, 2, False)[0]
    for rank, state in enumerate(run_ranks(_dropped_backward_worker, 2, config, 2)):
        # (fp16 sums of two ranks' halves round apart by ~1e-5; a stale flag is 0.05-30 off)
        assert_close(state, want, rtol=1e-3, atol=1e-3, msg=lambda m: f"rank {rank}: {m}")


def _outside_backward_worker(rank, world_size, port):
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    model = _model()
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               nn.CrossEntropyLoss(), verbose=False)
    x, y = _batch(0, 2)
    engine.zero_grad()
    engine.criterion(engine(x), y).backward()  # past the engine
    try:
        engine.step()
    except RuntimeError as e:
        return str(e)
    return "stepped"


def test_gloo_a_step_after_a_backward_past_the_engine_is_an_error():
    """loss.backward() skips the engine's loss scale, accumulation and averaging over ranks, and
    the engine, which counts its own backwards, would not step: say so instead."""
    for rank, message in enumerate(run_ranks(_outside_backward_worker, 2)):
        assert message.startswith(f"[rank {rank}] engine.step() found gradients but no "
                                  f"engine.backward(loss)"), message
