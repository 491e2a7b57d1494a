"""ZeRO levels 1 and 2 on gloo ranks give what one process gives on the whole batch, and hold
only their shard of the optimizer state."""
import copy
import math

import pytest
import torch
from dist_helpers import run_ranks, run_ranks_cached
from torch import nn
from torch.testing import assert_close
from zero_models import (
    STEPS,
    B,
    Net,
    grouped_adamw,
    launch_net,
    net_batch,
    train_engine,
    train_single,
    zero_config,
)

import nanocolossal as nc
from nanocolossal.amp import AMP_TYPE
from nanocolossal.checkpoint import (
    load_checkpoint,
    load_optimizer_state,
    read_file,
    save_checkpoint,
)
from nanocolossal.config import ConfigError, load_config
from nanocolossal.context import gpc

pytestmark = pytest.mark.timeout(120)


def _lesson_worker(rank, world_size, port, level, xs, ys):
    nc.launch(dict(zero=dict(level=level)), rank=rank, world_size=world_size, host="127.0.0.1",
              port=port)
    torch.manual_seed(0)  # every rank builds the model the reference builds
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()  # 67: padded
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    engine, *_ = nc.initialize(model, optimizer, nn.CrossEntropyLoss(), verbose=False)
    for x, y in zip(xs, ys):
        x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]  # my half of the batch
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()  # my shard of the momentum steps my shard; then all-gathered
    return engine.model.state_dict()


@pytest.mark.parametrize("level", [1, 2])
def test_gloo_zero_on_two_ranks_equals_one_process(level):
    """Sharding the optimizer state (level 1) and the gradients (level 2) over 2 data ranks
    changes what each rank holds, not the training: it equals one process on the whole batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    xs, ys = torch.randn(3, 8, 4, dtype=torch.float64), torch.randint(0, 3, (3, 8))  # 3 batches
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for x, y in zip(xs, ys):  # the whole batch of 8 in one process
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    for rank, state in enumerate(run_ranks(_lesson_worker, 2, level, xs, ys)):
        assert_close(state, model.state_dict(), msg=lambda m: f"rank {rank}: {m}")


def _worker(rank, world_size, port, level, accum=1, clip=0.0, bf16=False, overlap=True):
    zero = dict(level=level, reduce_bucket_size_mb=2e-4)  # a few parameters per bucket
    engine = launch_net(rank, world_size, port, zero_config(zero, accum, clip, bf16, overlap))
    norms = train_engine(engine, STEPS, rank, world_size, accum)
    single = Net()
    single_norms = train_single(single, grouped_adamw(single), STEPS, n=world_size * accum * B,
                                clip=clip, bf16=bf16)
    tol = dict(atol=3e-3, rtol=0) if bf16 else {}  # bf16 sums of other batch splits round apart
    for (name, p), q in zip(engine.model.named_parameters(), single.parameters()):
        assert_close(p, q, **tol, msg=lambda m: f"{name}: {m}")
    assert_close(engine.model.never.weight, Net().never.weight, rtol=0, atol=0)  # never moved
    return norms, single_norms


@pytest.mark.parametrize("level", [1, 2])
def test_deep_zero_adamw_equals_one_process(level):
    """2 ranks (4 ranks: the clipping and no-overlap tests, which compare the same way)."""
    run_ranks(_worker, 2, level, timeout=90)


def test_deep_zero_level2_without_overlap_equals_one_process():
    """Buckets reduced only after backward, in order: the same training."""
    run_ranks(_worker, 4, 2, 2, 0.0, False, False, timeout=90)


def _two_backwards_worker(rank, world_size, port, config):
    """Each step: engine.backward twice (two losses, each synchronised), then one step."""
    engine = launch_net(rank, world_size, port, config)
    single = Net()
    opt = grouped_adamw(single)
    for step in range(3):
        xs, ys = net_batch(step, world_size * 2 * B)
        n = world_size * B
        halves = [(xs[h * n:][:n], ys[h * n:][:n]) for h in range(2)]
        engine.zero_grad()
        opt.zero_grad()
        for x, y in halves:
            engine.backward(engine.criterion(engine(x[rank * B:][:B]), y[rank * B:][:B]))
            nn.functional.cross_entropy(single(x), y).backward()
        engine.step()
        opt.step()
    for (name, p), q in zip(engine.model.state_dict().items(), single.state_dict().values()):
        assert_close(p, q, msg=lambda m: f"{name}: {m}")  # (state_dict: level 3 gathers)


HANDLER = {"gradient_handler": [{"type": "DataParallelGradientHandler"}]}


@pytest.mark.parametrize("config", [{}, {"zero": {"level": 1}}, {"zero": {"level": 2}},
                                    {"zero": {"level": 3}}, HANDLER],
                         ids=["ddp", "zero1", "zero2", "zero3", "handler"])
def test_deep_two_backwards_before_a_step_add_up_as_in_one_process(config):
    """loss_a.backward(); loss_b.backward(); step(): .grad holds the sum of both, as it does in
    one process -- at level 2 each backward's reduced segments are added to my shard's."""
    run_ranks(_two_backwards_worker, 2, config, timeout=90)


@pytest.mark.parametrize("level", [1, 2])
def test_deep_zero_gradient_accumulation(level):
    run_ranks(_worker, 2, level, 3, timeout=90)


@pytest.mark.parametrize("level", [1, 2])
def test_deep_zero_clipping_really_clips(level):
    for norms, single_norms in run_ranks(_worker, 4, level, 2, 0.05, timeout=90):
        assert all(n > 0.05 for n in single_norms)  # the threshold is below every norm
        assert norms == pytest.approx(single_norms, rel=1e-5)


@pytest.mark.parametrize("level", [1, 2])
def test_deep_zero_bf16_autocast_equals_one_process(level):
    run_ranks(_worker, 2, level, 1, 0.0, True, timeout=90)


def _memory_worker(rank, world_size, port, level):
    nc.launch({"zero": dict(level=level)}, rank=rank, world_size=world_size, host="127.0.0.1",
              port=port)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 9), nn.Tanh(), nn.Linear(9, 5))  # Psi = 149
    engine, *_ = nc.initialize(model, torch.optim.AdamW(model.parameters()),
                               nn.CrossEntropyLoss(), verbose=False)
    xs, ys = net_batch(0, B)
    engine.zero_grad()
    engine.backward(engine.criterion(engine(torch.randn(B, 10)), ys))
    engine.step()
    return engine.optimizer.state_bytes()


@pytest.mark.parametrize("level", [1, 2])
def test_deep_zero_optimizer_state_bytes_per_rank_equal_the_formula(level):
    psi = 10 * 9 + 9 + 9 * 5 + 5
    for n in (1, 2, 4):
        measured = run_ranks(_memory_worker, n, level, timeout=60)
        shard = math.ceil(psi / n)  # AdamW: 2 fp32 states per element of the rank's shard
        expected = [2 * 4 * min(shard, psi - r * shard) for r in range(n)]
        assert measured == expected, (n, measured, expected)
        assert max(measured) == 2 * 4 * shard and sum(measured) == 2 * 4 * psi


def _save_worker(rank, world_size, port, level, path):
    engine = launch_net(rank, world_size, port, {"zero": dict(level=level)})
    train_engine(engine, 3, rank, world_size, 1)
    save_checkpoint(path, 3, engine.model, engine.optimizer)


def _resume_worker(rank, world_size, port, level, path):
    engine = launch_net(rank, world_size, port, {"zero": dict(level=level)})
    assert load_checkpoint(path, engine.model, engine.optimizer)["epoch"] == 3
    train_engine(engine, 2, rank, world_size, 1, first=3)
    return {k: v.clone() for k, v in engine.model.state_dict().items()}


def test_deep_zero_checkpoint_is_one_shard_file_per_data_rank(tmp_path):
    """4 ranks save: each writes only its segments of the optimizer state (no rank gathers it
    all), the segments cover every element that has state exactly once, and the main file keeps
    only the skeleton. A shard file left from another save is refused, naming the files."""
    path = tmp_path / "ckpt.pt"
    run_ranks(_save_worker, 4, 2, path, timeout=60)
    main = read_file(path, "cpu")["optimizer"]
    assert main["zero_files"] == 4 and "optimizer" not in main and "state" not in main
    covered = {}  # parameter index -> elements with state, over all files
    for r in range(4):
        segments = read_file(tmp_path / f"ckpt-zero{r}.pt", "cpu")
        mine = sum(hi - lo for parts in segments["state"].values() for lo, hi, _ in parts)
        assert mine <= math.ceil(121 / 4) + math.ceil(20 / 4), "one shard of each flat buffer"
        for index, parts in segments["state"].items():
            for lo, hi, state in parts:
                assert state["exp_avg"].numel() == hi - lo
                covered.setdefault(index, []).append((lo, hi))
    net = Net()  # grouped_adamw's order: the weights, then the biases
    names = [n for kind in ("weight", "bias") for n, _ in net.named_parameters()
             if n.endswith(kind)]
    for index, name in enumerate(names):  # each element once (`never` has no state at all)
        spans = sorted(covered.get(index, []))
        if name.startswith("never."):
            assert spans == [], name
            continue
        assert [lo for lo, _ in spans] == [0] + [hi for _, hi in spans[:-1]], name
        assert spans[-1][1] == net.get_parameter(name).numel(), name
    stale = tmp_path / "old"
    run_ranks(_save_worker, 4, 2, stale / "ckpt.pt", timeout=60)
    (stale / "ckpt-zero1.pt").replace(tmp_path / "ckpt-zero1.pt")
    with pytest.raises(RuntimeError, match="ckpt-zero1.pt: epoch None.*different saves|"
                                           "different saves.*ckpt-zero1.pt"):
        load_optimizer_state(path)


@pytest.mark.parametrize("level", [1, 2])
def test_deep_zero_checkpoint_resumes_exactly_into_another_data_size(level, tmp_path):
    """Saved by 2 ranks after 3 steps: the state is the plain optimizer's (it loads into one
    process's AdamW), and 2 more steps on 4 ranks, or in one process, end where 5 steps end."""
    path = tmp_path / "ckpt.pt"
    run_ranks(_save_worker, 2, level, path, timeout=60)
    single = Net()  # the reference: one process on the same global batches
    opt = grouped_adamw(single)
    train_single(single, opt, 3, n=2 * B)
    plain = Net()
    plain_opt = grouped_adamw(plain)
    state = read_file(path, "cpu")
    plain.load_state_dict(state["model"])
    plain_opt.load_state_dict(load_optimizer_state(path)["optimizer"])
    assert_close(plain_opt.state_dict(), opt.state_dict())
    for world_size in (2, 4):  # steps 3-4 on 2 or 4 ranks: 6 or 12 samples per step
        resumed = run_ranks(_resume_worker, world_size, level, path, timeout=60)[0]
        expected = Net()
        expected.load_state_dict(single.state_dict())
        expected_opt = grouped_adamw(expected)
        expected_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        train_single(expected, expected_opt, 2, first=3, n=world_size * B)
        assert_close(resumed, expected.state_dict())
    train_single(plain, plain_opt, 2, first=3, n=4 * B)  # the plain AdamW goes on the same way
    assert_close(plain.state_dict(), expected.state_dict())


def _bad_optimizer_worker(rank, world_size, port, kind):
    nc.launch({"zero": dict(level=1)}, rank=rank, world_size=world_size, host="127.0.0.1",
              port=port)
    model = Net()

    class LARS(torch.optim.SGD):  # needs each whole parameter's norm
        pass

    opt = (LARS(model.parameters(), lr=0.1) if kind == "lars"
           else torch.optim.SGD(model.a.parameters(), lr=0.1))
    with pytest.raises(ConfigError) as e:
        nc.initialize(model, opt, verbose=False)
    assert f"[rank {gpc.rank}]" in str(e.value)
    return str(e.value)


def test_deep_zero_refuses_whole_parameter_optimizers_and_missing_parameters():
    lars, missing = (run_ranks(_bad_optimizer_worker, 2, kind, timeout=60)[0]
                     for kind in ("lars", "missing"))
    assert "LARS is not an element-wise optimizer" in lars and "AdamW" in lars
    assert "b.weight" in missing and "not in the optimizer" in missing


def _added_after_initialize_worker(rank, world_size, port, level):
    engine = launch_net(rank, world_size, port, {"zero": dict(level=level)})
    engine.model.late = nn.Linear(5, 5)  # trainable, in no shard: it would never step
    xs, ys = net_batch(0, world_size * B)
    engine.zero_grad()
    engine.backward(engine.criterion(engine(xs[rank * B:(rank + 1) * B]),
                                     ys[rank * B:(rank + 1) * B]))
    with pytest.raises(ConfigError) as e:
        engine.step()
    assert str(e.value).startswith(f"[rank {rank}] zero: parameter(s) late.weight, late.bias "
                                   f"were added to the model after nc.initialize")


@pytest.mark.parametrize("level", [1, 2, 3])
def test_deep_zero_refuses_a_parameter_added_after_initialize(level):
    run_ranks(_added_after_initialize_worker, 2, level, timeout=60)


def _unfrozen_after_initialize_worker(rank, world_size, port, level):
    nc.launch({"zero": dict(level=level)}, rank=rank, world_size=world_size, host="127.0.0.1",
              port=port)
    model = Net()
    model.side.weight.requires_grad_(False)  # frozen when ZeRO cuts the shards
    engine, *_ = nc.initialize(model, grouped_adamw(model), nn.CrossEntropyLoss(), verbose=False)
    xs, ys = net_batch(0, world_size * B)
    x, y = xs[rank * B:(rank + 1) * B], ys[rank * B:(rank + 1) * B]
    engine.zero_grad()
    engine.backward(engine.criterion(engine(x), y))
    engine.step()
    model.side.weight.requires_grad_(True)  # unfrozen: one process would train it from now on
    with pytest.raises(RuntimeError) as e:
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()
    return str(e.value)


@pytest.mark.parametrize("level", [1, 2, 3])
def test_gloo_zero_refuses_a_parameter_unfrozen_after_initialize(level):
    """A parameter frozen when ZeRO builds its shards gets no gradient path: unfrozen later it
    would never train (level 3: never be gathered with a gradient). Every rank says so."""
    for rank, message in enumerate(run_ranks(_unfrozen_after_initialize_worker, 2, level,
                                             timeout=60)):
        assert message.startswith(f"[rank {rank}] zero: side.weight did not require grad when "
                                  f"zero was built"), message


def _log_line_worker(rank, world_size, port, level):
    from nanocolossal.engine.initialize import describe_zero
    return describe_zero(launch_net(rank, world_size, port, {"zero": dict(level=level)}).optimizer)


@pytest.mark.parametrize("level", [1, 2, 3])
def test_deep_zero_log_line_says_what_each_rank_keeps_in_bytes(level):
    """Net's 141 fp32 elements in two flat buffers (121 weights, 20 biases), each cut in 2:
    rank 0 keeps 61 + 10, rank 1 60 + 10. Level 3 cuts each unit's two buffers: a (42, 7),
    b and side (35, 5), never (9, 3): rank 0 keeps 21+4 + 2 x (18+3) + 5+2 = 74, rank 1 67."""
    kept = {1: "optimizer state", 2: "optimizer state and gradients",
            3: "optimizer state, gradients and parameters"}[level]
    shares = (74, 67) if level == 3 else (71, 70)
    for rank, (line, mine) in enumerate(zip(run_ranks(_log_line_worker, 2, level, timeout=60),
                                            shares)):
        assert line == (f"ZeRO level {level} x2: this rank keeps the {kept} of {mine} of 141 "
                        f"elements: {4 * mine / 2**20:.2f} MiB instead of {4 * 141 / 2**20:.2f} "
                        f"MiB for each (at the parameters' precision)"), rank


@pytest.mark.parametrize("config, message", [
    ({"zero": dict(level=4)}, "zero level must be 1, 2 or 3"),
    ({"zero": dict(level=2, bucket=1)}, "unknown zero key(s) ['bucket']"),
    ({"zero": dict(level=1), "gradient_handler": [dict(type="DataParallelGradientHandler")]},
     "remove gradient_handler"),
    ({"zero": dict(level=3), "fp16": dict(mode=AMP_TYPE.APEX, opt_level="O3")}, "APEX O3"),
    ({"zero": dict(level=3), "parallel": dict(pipeline=2)}, "each of its micro-batches"),
    ({"zero": dict(level=1, overlap_communication=False)}, "applies to levels 2 and 3"),
])
def test_zero_config_errors(config, message):
    with pytest.raises(ConfigError) as e:
        load_config(config)
    assert message in str(e.value)


def _fp16_worker(rank, world_size, port, level, per_rank):
    """fp16 autocast with the dynamic scaler; step 2's batch holds a huge input, so its
    gradients overflow: every rank skips that step and backs the scale off together."""
    config = {"fp16": dict(mode=AMP_TYPE.TORCH, dtype="float16")}
    if level:
        config["zero"] = dict(level=level)
    engine = launch_net(rank, world_size, port, config)
    for step in range(5):
        engine.model.use_side = step % 2 == 0
        xs, ys = net_batch(step, world_size * per_rank)
        if step == 2:
            xs[-1, 0] = 1e6  # the last rank's sample: inf in fp16
        lo = rank * per_rank
        engine.zero_grad()
        engine.backward(engine.criterion(engine(xs[lo:lo + per_rank]), ys[lo:lo + per_rank]))
        assert engine.step() == (step != 2)
    return ({k: v.clone() for k, v in engine.model.state_dict().items()},
            engine.optimizer.loss_scale, engine.optimizer.skipped_steps)


@pytest.mark.parametrize("level", [1, 2, 3])
def test_deep_zero_fp16_overflow_skipped_by_every_rank(level):
    single, scale, skipped = run_ranks_cached(_fp16_worker, 1, 0, 4 * B)[0]
    assert skipped == 1 and scale == 2.0**15
    for params, rank_scale, rank_skipped in run_ranks(_fp16_worker, 4, level, B, timeout=90):
        assert (rank_scale, rank_skipped) == (scale, skipped)
        assert_close(params, single, atol=3e-3, rtol=0)  # fp16 sums of other splits round apart


class Twice(nn.Module):
    """One layer called twice, each call in its own reentrant checkpoint: each checkpoint's
    backward hands the layer's gradient on, so it arrives twice."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 5)

    def forward(self, x):
        for _ in range(2):
            x = torch.utils.checkpoint.checkpoint(self.a, x, use_reentrant=True)
        return self.b(x)


def _twice_worker(rank, world_size, port, level):
    nc.launch({"zero": dict(level=level)}, rank=rank, world_size=world_size, host="127.0.0.1",
              port=port)
    model = Twice()
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               nn.CrossEntropyLoss(), verbose=False)
    xs, ys = net_batch(0, B)
    try:
        engine.backward(engine.criterion(engine(xs.requires_grad_()), ys))
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("level", [1, 2])
def test_deep_zero_a_gradient_arriving_twice_names_the_fix_zero_takes(level):
    """Reentrant checkpointing of a layer used twice hands its first gradient to the reduction
    before the second arrives: the error names the parameter and the one fix that works with
    ZeRO (not the gradient handler, which zero refuses)."""
    for rank, message in enumerate(run_ranks(_twice_worker, 2, level, timeout=60)):
        assert message.startswith(f"[rank {rank}] zero: a.") and \
            message.endswith("use_reentrant=False"), message
        assert "checkpoint the uses together in one call" in message, message
