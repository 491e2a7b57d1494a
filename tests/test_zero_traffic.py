"""What a training step hands to collectives, counted (nanocolossal.traffic), equals the traffic
formulas of ddp.py and zero/ exactly -- elements per step on every rank, for plain DDP and ZeRO
levels 1-3 on 2 and 4 ranks, with a branch used on even steps only and a layer never used.

Net (zero_models.py): Psi = 141 parameters in P = 8 tensors, two param groups (weights, biases),
so two flat buffers, each padded to a multiple of N (level 3: two per unit a, b, side, never):

    DDP       all-reduce  Psi + P               (the gradients and one "used" flag per tensor)
    level 1   all-reduce  Psi + P               (DDP) + gather pad(Psi): the updated shards
    level 2   all-reduce  Psi + P               (gloo's stand-in for a reduce-scatter: the
              transient buckets) + gather pad(Psi)
    level 3   gather      pad(units used + prefetched) + pad(units used)   (forward, backward)
              all-reduce  pad(all units) + P    (each unit's gradients -- gloo's stand-in for a
                                                 reduce-scatter, NCCL's is one -- and a "used"
                                                 flag per tensor; unused units too, flags 0, so
                                                 every rank issues the same calls)
                          + 2                   (before the step: the units' order, the same on
                                                 every rank? zero/sharded_model_checks.py)
                          + 1                   (any non-finite gradient? a parameter read
                                                 outside the forward reads NaN: sharded_params.py)
    every level: all-reduce + 1                 (the cross entropy's targets counted over the
                                                 data ranks: loss_weights.py)

Level 3 prefetches, as each unit starts its forward, the unit that followed it in the previous
forward: on an odd step `side` (used the step before, skipped now) is gathered for nothing --
the price of guessing the order, counted here.

(`gather`: zero/comm.py's all-gather, on gloo one broadcast per shard.) These are the formulas'
Psi terms with the padding and flags made exact. What a ring then sends per rank (the paper's
2 Psi, 3 Psi, ...) is bench/bench_zero.py's, on a model large enough for padding not to matter.
"""
import math

import pytest
from dist_helpers import run_ranks_cached
from torch import nn
from torch.testing import assert_close
from zero_models import B, Net, grouped_adamw, net_batch

import nanocolossal as nc
from nanocolossal.traffic import count_collectives
from nanocolossal.zero import comm

pytestmark = pytest.mark.timeout(120)
UNITS = ("a", "b", "side", "never")  # level 3's units: the model's children
GROUPS = ("weight", "bias")          # grouped_adamw's param groups: one flat buffer each


def _numel(unit, group):
    return getattr(getattr(Net(), unit), group).numel()


def _padded(n, N):
    return math.ceil(n / N) * N


def expected(level, N, used, previous=()):
    """Elements handed to each kind of collective in one step that runs the units `used`, after
    a step that ran `previous`."""
    psi, P = sum(p.numel() for p in Net().parameters()), len(list(Net().parameters()))
    if level == 0:
        return {"all_reduce": psi + P + 1}
    if level in (1, 2):
        whole = sum(_padded(sum(_numel(u, g) for u in UNITS), N) for g in GROUPS)
        return {"all_reduce": psi + P + 1, "broadcast": whole}
    prefetched = {previous[previous.index(u) + 1] for u in used if u in previous[:-1]}
    forward = sum(_padded(_numel(u, g), N) for u in {*used, *prefetched} for g in GROUPS)
    backward = sum(_padded(_numel(u, g), N) for u in used for g in GROUPS)
    every = sum(_padded(_numel(u, g), N) for u in UNITS for g in GROUPS)
    return {"broadcast": forward + backward, "all_reduce": every + P + 2 + 1 + 1}


def _worker(rank, world_size, port, level, reduce_scatter=False):
    nc.launch({"zero": dict(level=level)} if level else {}, rank=rank, world_size=world_size,
              host="127.0.0.1", port=port)
    if reduce_scatter:  # as on NCCL (gloo has one too, slower than its all-reduce)
        comm.ALL_REDUCE_INSTEAD.discard("gloo")
    model = Net()
    engine, *_ = nc.initialize(model, grouped_adamw(model), nn.CrossEntropyLoss(), verbose=False)
    counts = []
    for step in range(3):
        engine.model.use_side = step % 2 == 0
        xs, ys = net_batch(step, world_size * B)
        mine = slice(rank * B, (rank + 1) * B)
        with count_collectives() as counted:
            engine.zero_grad()
            engine.backward(engine.criterion(engine(xs[mine]), ys[mine]))
            assert engine.step()
        counts.append(dict(counted))
    comm.ALL_REDUCE_INSTEAD.add("gloo")
    return counts, {k: v.clone() for k, v in engine.model.state_dict().items()}


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("level", [0, 1, 2, 3], ids=["ddp", "zero1", "zero2", "zero3"])
def test_gloo_elements_handed_to_collectives_per_step_equal_the_formula(level, world_size):
    for rank, (counts, _) in enumerate(run_ranks_cached(_worker, world_size, level)):
        previous = ()
        for step, counted in enumerate(counts):
            used = ("a", "b", "side") if step % 2 == 0 else ("a", "b")
            assert counted == expected(level, world_size, used, previous), \
                f"rank {rank} step {step}"
            previous = used



@pytest.mark.parametrize("world_size", [2, 4])
def test_deep_zero3_with_a_reduce_scatter_hands_it_the_units_and_trains_the_same(world_size):
    """As on NCCL: level 3 reduce-scatters each unit's gradients (the paper's 3 Psi a step, not
    gloo's 4) -- pad(all units) reduce-scattered, only the flags all-reduced -- and trains to
    the parameters of the all-reduce that stands in for it on gloo."""
    native = run_ranks_cached(_worker, world_size, 3)
    for rank, (counts, state) in enumerate(run_ranks_cached(_worker, world_size, 3, True)):
        previous = ()
        for step, counted in enumerate(counts):
            used = ("a", "b", "side") if step % 2 == 0 else ("a", "b")
            want = expected(3, world_size, used, previous)
            every = sum(_padded(_numel(u, g), world_size) for u in UNITS for g in GROUPS)
            want["all_reduce"] -= every
            want[comm.REDUCE_SCATTER] = every
            assert counted == want, f"rank {rank} step {step}"
            previous = used
        for key, value in state.items():
            assert_close(value, native[rank][1][key], rtol=1e-6, atol=1e-7)
