"""The MoE layer in one process: routing, capacity and the aux loss against hand-computed
numbers, the layer against a per-token loop, and the errors."""
import copy

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from nanocolossal.moe import (
    LocalExperts,
    MoeLayer,
    Placement,
    Router,
    Routing,
    assign_slots,
    expert_capacity,
    expert_parameters,
    load_balancing_loss,
    moe_aux_loss,
)

pytestmark = pytest.mark.timeout(30)


def _probs_with_choices(choices, num_experts):
    """Probabilities whose argmax per row is `choices`."""
    probs = torch.full((len(choices), num_experts), 0.1, dtype=torch.float64)
    probs[torch.arange(len(choices)), torch.tensor(choices)] = 0.9
    return probs / probs.sum(1, keepdim=True)


def test_top1_slots_and_drops_by_hand():
    probs = _probs_with_choices([0, 0, 1, 0, 0], 2)
    expert, position, kept, weight = assign_slots(probs, top_k=1, capacity=2)
    assert expert.squeeze(1).tolist() == [0, 0, 1, 0, 0]
    assert position.squeeze(1).tolist() == [0, 1, 0, 2, 3]  # queue order = batch order
    assert kept.squeeze(1).tolist() == [True, True, True, False, False]
    assert_close(weight.squeeze(1), probs.max(1).values * kept.squeeze(1))
    mask = torch.zeros(5, 2, 2, dtype=torch.bool)
    mask[0, 0, 0] = mask[1, 0, 1] = mask[2, 1, 0] = True
    routing = Routing(expert, position, kept, weight, probs, 2, torch.tensor(0.0))
    assert torch.equal(routing.dispatch_mask(), mask)
    assert routing.dropped_tokens == routing.dropped_choices == 2


def test_top2_second_choices_queue_after_all_first_choices():
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.6, 0.1, 0.3], [0.2, 0.7, 0.1], [0.1, 0.2, 0.7]],
                         dtype=torch.float64)
    expert, position, kept, weight = assign_slots(probs, top_k=2, capacity=2)
    assert expert.tolist() == [[0, 1], [0, 2], [1, 0], [2, 1]]
    # first choices: e0 gets t0 t1, e1 t2, e2 t3; second choices queue behind them
    assert position.tolist() == [[0, 1], [1, 1], [0, 2], [0, 2]]
    assert kept.tolist() == [[True, True], [True, True], [True, False], [True, False]]
    want = torch.tensor([[0.5 / 0.8, 0.3 / 0.8], [0.6 / 0.9, 0.3 / 0.9], [0.7 / 0.9, 0.0],
                         [0.7 / 0.9, 0.0]], dtype=torch.float64)
    assert_close(weight, want)


def test_ties_go_to_the_lower_expert():
    expert, *_ = assign_slots(torch.full((3, 4), 0.25), top_k=2, capacity=3)
    assert expert.tolist() == [[0, 1]] * 3


@pytest.mark.parametrize("tokens,experts,factor,minimum,want", [
    (100, 10, 1.1, 1, 11),   # 11.000000000000002 in floats: still 11
    (6, 4, 1.0, 1, 2),       # 1.5 rounds up
    (6, 4, 1.0, 4, 4),       # the minimum
    (16, 4, 1.25, 1, 5),
    (10, 4, 4.0, 1, 10),     # factor >= E: C >= T, nothing can drop
])
def test_capacity(tokens, experts, factor, minimum, want):
    assert expert_capacity(tokens, experts, factor, minimum) == want


def test_train_and_eval_capacity_factors():
    router = Router(4, 4)  # Colossal-AI's defaults: 1.25 train, 2.0 eval, min 4
    assert router.capacity(32) == 10
    router.eval()
    assert router.capacity(32) == 16
    assert router.capacity(4) == 4


def test_aux_loss_by_hand():
    probs = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.2, 0.8], [0.9, 0.1]], dtype=torch.float64,
                         requires_grad=True)
    aux = load_balancing_loss(probs, probs.argmax(1))
    # f = [3/4, 1/4] (first choices), P = [0.6, 0.4] (mean probabilities), E = 2
    assert_close(aux, torch.tensor(2 * (0.75 * 0.6 + 0.25 * 0.4), dtype=torch.float64))
    aux.backward()  # only P carries gradient: E * f_e / N
    assert_close(probs.grad, torch.tensor([[0.375, 0.125]] * 4, dtype=torch.float64))


def _naive(layer, x):
    """Every token through its chosen experts one at a time, weighted by its gates."""
    probs = layer.router.gate(x).softmax(-1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        top = probs[t].topk(layer.router.top_k)
        gates = top.values / top.values.sum() if layer.router.top_k == 2 else top.values
        for g, e in zip(gates, top.indices):
            out[t] += g * layer.experts[str(int(e))](x[t])
    return out


@pytest.mark.parametrize("top_k", [1, 2])
def test_layer_equals_per_token_loop(top_k):
    torch.manual_seed(0)
    layer = MoeLayer(6, 8, 4, top_k, capacity_factor_train=4.0).double()
    x = torch.randn(3, 5, 6, dtype=torch.float64)
    assert_close(layer(x), _naive(layer, x.view(-1, 6)).view_as(x))
    assert layer.routing.dropped_choices == 0


def test_dropped_tokens_output_zero():
    torch.manual_seed(0)
    layer = MoeLayer(6, 8, 4, 1, capacity_factor_train=0.5, min_capacity=1).double()
    x = torch.randn(20, 6, dtype=torch.float64)
    out = layer(x)
    kept = layer.routing.kept.squeeze(1)
    assert layer.routing.capacity == 3 and layer.routing.dropped_tokens == int((~kept).sum()) > 0
    assert torch.all(out[~kept] == 0)
    assert_close(out[kept], _naive(layer, x)[kept])


def test_jitter_only_in_training_and_off_by_default():
    torch.manual_seed(0)
    x = torch.randn(16, 6)
    for eps, differs in ((0.0, False), (0.2, True)):
        layer = MoeLayer(6, 8, 4, jitter_eps=eps)
        layer(x)
        train = layer.routing.probs
        layer.eval()
        layer(x)
        assert (not torch.equal(train, layer.routing.probs)) == differs
        assert_close(layer.routing.probs, layer.router.gate(x).softmax(-1))  # eval: no noise


def test_experts_match_one_process_under_the_same_seed():
    torch.manual_seed(3)
    whole = LocalExperts(6, 8, Placement(4, 1, 0))
    torch.manual_seed(3)
    part = LocalExperts(6, 8, Placement(4, 2, 1))  # ep rank 1 of 2: experts 2 and 3
    assert list(part.keys()) == ["2", "3"]
    for key, value in part.state_dict().items():
        assert torch.equal(value, whole.state_dict()[key])
    torch.manual_seed(3)
    replica = LocalExperts(6, 8, Placement(2, 4, 3))  # E=2 on 4 ranks: rank 3 holds expert 1
    assert list(replica.keys()) == ["1"]


def test_expert_parameters_keys_and_aux_sum():
    torch.manual_seed(0)
    model = nn.Sequential(MoeLayer(4, 8, 2), MoeLayer(4, 8, 2))
    copied = copy.deepcopy(model)  # found by module: a deepcopy keeps them (flags would not)
    experts = {id(p) for p in expert_parameters(copied)}
    names = {n for n, p in copied.named_parameters() if id(p) in experts}
    assert names == {f"{i}.experts.{e}.{j}.{w}" for i in (0, 1) for e in (0, 1)
                     for j in (0, 2) for w in ("weight", "bias")}
    with pytest.raises(ValueError, match="has not run a forward yet"):
        moe_aux_loss(model)
    model(torch.randn(10, 4))
    assert_close(moe_aux_loss(model), model[0].aux_loss + model[1].aux_loss)
    assert moe_aux_loss(nn.Linear(2, 2)) == 0  # e.g. a pipeline stage without MoE layers


def test_router_runs_in_float32_under_autocast():
    layer = MoeLayer(8, 16, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(torch.randn(10, 8))
    assert out.dtype == torch.bfloat16 and layer.routing.probs.dtype == torch.float32


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_experts=3, top_k=1), None),  # fine: E = 3 with EP = 1
    (dict(num_experts=4, top_k=3), r"\[rank 0\] top_k=3.*use MOE_TOP_K=1 or 2"),
    (dict(num_experts=1, top_k=2), r"\[rank 0\] top_k=2 needs at least 2 experts"),
    (dict(num_experts=4, capacity_factor_train=0), r"\[rank 0\] capacity_factor_train=0.*> 0"),
    (dict(num_experts=4, min_capacity=0), r"\[rank 0\] min_capacity=0 must be at least 1"),
    (dict(num_experts=4, jitter_eps=1.5), r"\[rank 0\] jitter_eps=1.5 must be in \[0, 1\)"),
])
def test_bad_layer_arguments(kwargs, message):
    if message is None:
        MoeLayer(4, 4, **kwargs)
        return
    with pytest.raises(ValueError, match=message):
        MoeLayer(4, 4, **kwargs)


def test_experts_and_ep_size_must_nest():
    with pytest.raises(ValueError, match=r"\[rank 0\] num_experts=6 does not fit an expert-"
                                         r"parallel size of 4.*size in \[1, 2, 3, 6\]"):
        Placement(6, 4, 0)
    assert Placement(2, 4, 3).local_experts == [1] and Placement(8, 4, 3).local_experts == [6, 7]
    assert Placement(2, 4, 3).split_sizes(5) == [0, 0, 5, 5]
