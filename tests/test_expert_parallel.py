"""Expert parallelism on gloo ranks equals one process holding every expert.

Every rank builds, from the same seed, the one-process model (all experts, ep_group=None) and
the expert-parallel one, and trains the first on the global batch, the second on its own share.
Float64; gradients are compared at every step before AdamW (which hides a gradient scaled by a
constant), parameters after 3 steps. Each rank's data is drawn from a different distribution,
so per-rank load-balancing statistics differ from the global ones and an average of per-rank
losses fails.
"""
import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from torch import nn
from torch.testing import assert_close

import nanocolossal as nc
from nanocolossal.moe import MoeLayer, allreduce_moe_gradients, build_moe_groups, moe_aux_loss
from nanocolossal.traffic import count_collectives

pytestmark = pytest.mark.timeout(60)
D_MODEL, D_HIDDEN, B, S = 6, 8, 2, 5  # B samples of S tokens per rank
AUX_WEIGHT = 0.1
TIGHT = dict(rtol=1e-10, atol=1e-12)


def _lesson_worker(rank, world_size, port, xs, ys):
    nc.launch(dict(parallel=dict(moe=dict(size=2)), MOE_AUX_WEIGHT=0.1), rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    torch.manual_seed(0)  # the reference's draws: this rank keeps 2 of the 4 experts
    model = nn.Sequential(
        nn.Linear(4, 6),
        MoeLayer(6, 8, num_experts=4, top_k=2, capacity_factor_train=4.0,  # drops no token
                 ep_group=nc.gpc.ep_group, data_group=nc.gpc.gradient_group),
        nn.Linear(6, 3)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    engine, *_ = nc.initialize(model, optimizer, nn.CrossEntropyLoss(), verbose=False)
    for x, y in zip(xs, ys):
        x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]  # my half of the batch
        engine.zero_grad()
        loss = engine.criterion(engine(x), y)  # tokens to their experts' ranks and back
        engine.backward(loss)  # + 0.1 x the load-balancing loss (over the whole batch)
        engine.step()
    return engine.model.state_dict()  # the shared layers and my experts


def test_gloo_expert_parallel_on_two_ranks_equals_one_process_holding_every_expert():
    """4 experts split over 2 ranks, each rank's tokens sent to the experts' ranks and back,
    train as one process holding all 4 experts on the whole batch (load-balancing loss too)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6),
                          MoeLayer(6, 8, num_experts=4, top_k=2, capacity_factor_train=4.0),
                          nn.Linear(6, 3)).double()
    xs, ys = torch.randn(3, 8, 4, dtype=torch.float64), torch.randint(0, 3, (3, 8))  # 3 batches
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for x, y in zip(xs, ys):
        optimizer.zero_grad()
        (nn.functional.cross_entropy(model(x), y) + 0.1 * moe_aux_loss(model)).backward()
        optimizer.step()
    expected, (first, second) = model.state_dict(), run_ranks(_lesson_worker, 2, xs, ys)
    assert first.keys() != second.keys() and first.keys() | second.keys() == expected.keys()
    for rank, state in enumerate((first, second)):  # the shared layers, and this rank's experts
        assert_close(state, {k: expected[k] for k in state}, msg=lambda m: f"rank {rank}: {m}")


class Net(nn.Module):
    """A dense layer (non-expert gradients beyond the router's), then a residual MoE layer."""

    def __init__(self, num_experts, top_k, ep_group=None, data_group=None, **moe_args):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(D_MODEL, D_MODEL)
        self.moe = MoeLayer(D_MODEL, D_HIDDEN, num_experts, top_k, ep_group=ep_group,
                            data_group=data_group, **moe_args)
        self.double()

    def forward(self, x):
        h = self.inp(x)
        return h + self.moe(h)


def _batch(world_size, step):
    """The global batch; rank r's share is rows r*B..r*B+B-1, shifted by r (its own mix)."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(world_size * B, S, D_MODEL, generator=g, dtype=torch.float64)
    x += torch.arange(world_size, dtype=torch.float64).repeat_interleave(B).view(-1, 1, 1) * 0.5
    return x, torch.randn(x.shape, generator=g, dtype=torch.float64)


def _loss(model, x, y, aux_weight):
    return ((model(x) - y) ** 2).mean() + aux_weight * moe_aux_loss(model)


def _mine(t, rank):
    return t[rank * B:(rank + 1) * B]


def _compare(dist_model, ref_model, what, **tol):
    ref = dict(ref_model.named_parameters())
    for name, p in dist_model.named_parameters():
        theirs = ref[name].grad if what == "grad" else ref[name]
        mine = p.grad if what == "grad" else p
        assert_close(mine, theirs, **tol, msg=lambda m, n=name: f"{what} of {n}: {m}")


def _train_equal(rank, world_size, port, ep_size, num_experts, top_k):
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    groups = build_moe_groups(ep_size, num_experts)
    cf = dict(capacity_factor_train=float(num_experts), min_capacity=1)  # drops nothing
    ref = Net(num_experts, top_k, **cf)
    mine = Net(num_experts, top_k, groups.ep_group, dist.group.WORLD, **cf)
    opts = [torch.optim.AdamW(m.parameters(), lr=0.02, weight_decay=0.01) for m in (ref, mine)]
    for step in range(3):
        x, y = _batch(world_size, step)
        for opt in opts:
            opt.zero_grad()
        _loss(ref, x, y, AUX_WEIGHT).backward()
        with count_collectives() as sent:
            loss = _loss(mine, _mine(x, rank), _mine(y, rank), AUX_WEIGHT)
        loss.backward()
        allreduce_moe_gradients(mine, dist.group.WORLD, groups.expert_data_group)
        assert_close(mine.moe.aux_loss, ref.moe.aux_loss, **TIGHT)
        assert mine.moe.routing.dropped_choices == 0
        _compare(mine, ref, "grad", **TIGHT)
        for opt in opts:
            opt.step()
    _compare(mine, ref, "param", rtol=0, atol=1e-6)
    _compare(mine, ref, "param", **TIGHT)
    # the last forward's two all-to-alls (dispatch, combine): E*C*d elements each
    assert sent["all_to_all_single"] == 2 * num_experts * mine.moe.routing.capacity * D_MODEL
    return sorted({k.split(".")[2] for k in mine.state_dict() if k.startswith("moe.experts.")})


@pytest.mark.parametrize("world_size,ep_size,num_experts", [
    (2, 2, 4),  # 2 experts per rank
    (4, 4, 4),  # 1 expert per rank
    (4, 2, 4),  # data 2 x expert 2: expert gradients summed over {0, 2} and {1, 3}
    (4, 4, 2),  # EP > E: each expert on 2 ranks, exchange blocks {0, 1} {2, 3}
], ids=["ep2-e4", "ep4-e4", "dp2xep2-e4", "ep4-e2-replicated"])
@pytest.mark.parametrize("top_k", [1, 2], ids=["top1", "top2"])
def test_deep_moe_training_equals_one_process(world_size, ep_size, num_experts, top_k):
    held = run_ranks(_train_equal, world_size, ep_size, num_experts, top_k, timeout=45)
    block = min(ep_size, num_experts)
    want = [[str(e) for e in range(r % block * num_experts // block,
                                   (r % block + 1) * num_experts // block)] for r in
            range(world_size)]
    assert [sorted(h, key=int) for h in held] == want


def _drops(rank, world_size, port, top_k):
    """Capacity 1.0 drops tokens; each rank routes as one process would route its tokens."""
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    groups = build_moe_groups(2, 4)
    args = dict(capacity_factor_train=1.0, min_capacity=1)
    ref = Net(4, top_k, **args)
    mine = Net(4, top_k, groups.ep_group, dist.group.WORLD, **args)
    x, y = _batch(world_size, 0)
    # the global batch in one process: the aux loss
    ref(x)
    global_aux = ref.moe.aux_loss.detach()
    # each rank's share alone in one process: the drops, the output, the gradients
    grads = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
    for r in range(world_size):
        ref.zero_grad()
        ((ref(_mine(x, r)) - _mine(y, r)) ** 2).mean().backward()
        for n, p in ref.named_parameters():
            grads[n] += p.grad / world_size
        if r == rank:
            theirs, out = ref.moe.routing, ref(_mine(x, r)).detach()
    out_mine = mine(_mine(x, rank))
    routing = mine.moe.routing
    assert routing.capacity == 3  # ceil(1.0 * 10 / 4)
    for field in ("expert", "position", "kept", "weight"):
        assert_close(getattr(routing, field), getattr(theirs, field), **TIGHT)
    assert torch.equal(routing.dispatch_mask(), theirs.dispatch_mask())
    assert_close(out_mine, out, **TIGHT)
    assert_close(mine.moe.aux_loss, global_aux, **TIGHT)
    ((out_mine - _mine(y, rank)) ** 2).mean().backward()
    allreduce_moe_gradients(mine, dist.group.WORLD, groups.expert_data_group)
    for n, p in mine.named_parameters():
        assert_close(p.grad, grads[n], **TIGHT, msg=lambda m, n=n: f"grad of {n}: {m}")
    return routing.dropped_tokens, routing.dropped_choices


@pytest.mark.parametrize("top_k", [1, 2], ids=["top1", "top2"])
def test_deep_moe_drops_equal_one_process_per_rank(top_k):
    drops = run_ranks(_drops, 2, top_k, timeout=30)
    # (dropped tokens, dropped choices) per rank: this data drops on rank 1 (and on rank 0 with
    # top-2 only second choices, which keep their token)
    assert drops == ([(0, 0), (2, 2)] if top_k == 1 else [(0, 9), (1, 11)])


def _empty_expert(rank, world_size, port, nobody):
    """E = 2, EP = 2: rank 1 holds expert 1. Rank 1's tokens all choose expert 0; with `nobody`
    rank 0's do too, so expert 1 receives no token at all."""
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    groups = build_moe_groups(2, 2)
    models = [Net(2, 1, capacity_factor_train=2.0, min_capacity=1),
              Net(2, 1, groups.ep_group, dist.group.WORLD, capacity_factor_train=2.0,
                  min_capacity=1)]
    x, y = _batch(world_size, 0)
    x[B:, :, 0] = x[B:, :, 0].abs() + 0.1  # rank 1: feature 0 positive -> expert 0
    if nobody:
        x[:B, :, 0] = x[:B, :, 0].abs() + 0.1
    for m in models:
        with torch.no_grad():
            m.inp.weight.copy_(torch.eye(D_MODEL))
            m.inp.bias.zero_()
            m.moe.router.gate.weight.zero_()
            m.moe.router.gate.weight[0, 0], m.moe.router.gate.weight[1, 0] = 5.0, -5.0
    ref, mine = models
    _loss(ref, x, y, AUX_WEIGHT).backward()
    _loss(mine, _mine(x, rank), _mine(y, rank), AUX_WEIGHT).backward()
    local = (mine.moe.routing.expert[:, 0] == 1).sum().item()
    expert1 = [p.grad.clone() for n, p in mine.named_parameters() if n.startswith("moe.experts.1")]
    allreduce_moe_gradients(mine, dist.group.WORLD, groups.expert_data_group)
    _compare(mine, ref, "grad", **TIGHT)
    return local, [bool(g.eq(0).all()) for g in expert1]


@pytest.mark.parametrize("nobody", [False, True], ids=["from-rank0-only", "no-token-at-all"])
def test_deep_moe_expert_without_tokens(nobody):
    (sent0, _), (sent1, zero_grads) = run_ranks(_empty_expert, 2, nobody, timeout=30)
    assert sent1 == 0 and (sent0 == 0) == nobody
    assert len(zero_grads) == 4 and all(zero_grads) == nobody  # zeros, not None, when unused


def _bad_inputs(rank, world_size, port):
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    world = dist.group.WORLD
    with pytest.raises(ValueError, match=rf"\[rank {rank}\] num_experts=3 does not fit an "
                                         r"expert-parallel size of 4.*one must divide"):
        MoeLayer(4, 4, 3, ep_group=world)
    with pytest.raises(ValueError, match=rf"\[rank {rank}\] capacity_factor_train=0.0.*> 0"):
        MoeLayer(4, 4, 4, capacity_factor_train=0.0, ep_group=world)
    with pytest.raises(ValueError, match=rf"\[rank {rank}\] capacity_factor_eval=-1.*> 0"):
        MoeLayer(4, 4, 4, capacity_factor_eval=-1, ep_group=world)
    with pytest.raises(ValueError, match=rf"\[rank {rank}\] top_k=3.*MOE_TOP_K=1 or 2"):
        MoeLayer(4, 4, 4, top_k=3, ep_group=world)
    with pytest.raises(ValueError, match=rf"\[rank {rank}\] data-parallel size 4 is not a "
                                         r"multiple of the expert-parallel size 3"):
        build_moe_groups(3, 3)
    # ranks with different token counts: every rank raises the same error, nobody waits
    layer = MoeLayer(4, 4, 4, ep_group=world, data_group=world)
    with pytest.raises(ValueError, match=rf"\[rank {rank}\] MoE layer: the data-parallel ranks "
                                         rf"route different numbers of tokens \(this rank "
                                         rf"{3 if rank == 1 else 2}, mean 2.25\)"):
        layer(torch.randn(3 if rank == 1 else 2, 4))
    return True


def test_gloo_moe_bad_inputs():
    assert all(run_ranks(_bad_inputs, 4, timeout=30))
