"""Pipeline plans and partitioning, checked without starting any process."""
import itertools
from collections import Counter

import pytest
import torch
from torch import nn

from nanocolossal.context import gpc
from nanocolossal.pipeline import (
    PlanError,
    all_plans,
    balanced_split,
    build_pipeline_model,
    compute_order,
    render,
    simulate,
)
from nanocolossal.pipeline.__main__ import main as show_main
from nanocolossal.pipeline.plan import build_plan, one_f_one_b, round_plan
from nanocolossal.pipeline.simulate import bubble_formula, timeline
from nanocolossal.pipeline.steps import Comm, Compute, stage_rank, step_label, v_shaped

GRID = [
    (s, P, M, V)
    for s in ("gpipe", "1f1b", "interleaved", "zero_bubble", "zbv")
    for P in (2, 3, 4)
    for V in (1, 2)
    for M in range(P, 3 * P + 1)
    if (s in ("interleaved", "zbv")) == (V == 2) and (s != "interleaved" or M % P == 0)
    and (s != "zbv" or M >= 2 * P - 1)
]


def _fifo(plans, P, v_shape=False):
    """Per ordered pair of ranks, the sequence of messages as the sender posts them and as the
    receiver does."""
    where = lambda v: stage_rank(v, P, v_shape)  # noqa: E731
    sent, got = {}, {}
    for r, plan in enumerate(plans):
        for step in plan:
            if isinstance(step, Comm):
                key = lambda t: (t.what, t.src, t.dst, t.mb)  # noqa: E731  (p2p.py's order)
                for t in sorted(step.sends, key=key):
                    sent.setdefault((r, where(t.dst)), []).append(t)
                for t in sorted(step.recvs, key=key):
                    got.setdefault((where(t.src), r), []).append(t)
    return sent, got


@pytest.mark.parametrize("schedule, P, M, V", GRID)
@pytest.mark.parametrize("forward_only", [False, True])
def test_plans_match_every_send_and_finish_without_deadlock(schedule, P, M, V, forward_only):
    plans = all_plans(schedule, P, M, V, forward_only)
    sent, got = _fifo(plans, P, v_shaped(schedule))
    assert sent == got, (
        "each receive matches a send, in the same order per pair of ranks (NCCL is FIFO)"
    )
    assert all(where != (r, r) for where in sent for r in range(P)), "no message to oneself"
    result = simulate(plans, P, V, v_shaped(schedule))
    assert result["transfers"] == sum(len(v) for v in sent.values())
    for r, plan in enumerate(plans):
        computes = Counter((s.kind, s.chunk, s.mb) for s in plan if isinstance(s, Compute))
        kinds = ["F"] if forward_only else ["F", "B"] + ["W"] * (schedule in ("zero_bubble",
                                                                               "zbv"))
        assert computes == Counter(itertools.product(kinds, range(V),
                                                     range(M))), "each step exactly once"


@pytest.mark.parametrize("schedule, P, M, V", [g for g in GRID if g[0] not in ("gpipe", "zbv")])
def test_warmup_counts_follow_the_formulas(schedule, P, M, V):
    for r in range(P):
        order = compute_order(schedule, P, M, V, r)
        forwards_before_first_backward = next(i for i, s in enumerate(order) if s.kind == "B")
        if schedule in ("1f1b", "zero_bubble"):
            warmup = min(P - r - 1, M)
        else:  # Megatron's formula; with M == P everything is warm-up
            warmup = M * V if M == P else min((P - r - 1) * 2 + (V - 1) * P, M * V)
        # after the warm-up, each backward is preceded by its paired forward
        assert forwards_before_first_backward == (warmup if warmup == M * V else warmup + 1)


@pytest.mark.parametrize("schedule, P, M, V", GRID)
def test_in_flight_activations_stay_within_the_bound(schedule, P, M, V):
    held = simulate(all_plans(schedule, P, M, V), P, V, v_shaped(schedule))["max_in_flight"]
    for r in range(P):
        if schedule == "1f1b":
            assert held[r] == min(P - r, M)
        elif schedule == "gpipe":
            assert held[r] == M
        elif schedule == "zero_bubble":
            # until its B, a micro-batch is held as in 1F1B; until its deferred W, by P at most
            order = compute_order(schedule, P, M, V, r)
            waiting_for_b = [sum((s.kind == "F") - (s.kind == "B") for s in order[:i + 1])
                             for i in range(len(order))]
            assert max(waiting_for_b) == min(P - r, M) and held[r] == P
        elif schedule == "zbv":  # 2P chunks (half a stage each) once steady: 1F1B's peak, P
            assert held[r] == 2 * P
        else:  # warm-up forwards plus the one in flight in steady state (M == P: all warm-up)
            warmup = M * V if M == P else (P - r - 1) * 2 + (V - 1) * P
            assert held[r] <= min(warmup + 1, M * V)


@pytest.mark.parametrize("schedule, P, M, V",
                         [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 2, 4, 1),
                          ("interleaved", 4, 8, 2), ("interleaved", 2, 6, 2)])
def test_bubble_equals_the_formula(schedule, P, M, V):
    assert timeline(schedule, P, M, V)["bubble"] == pytest.approx((P - 1) / (V * M + P - 1))


@pytest.mark.parametrize("P, M", [(2, 2), (2, 5), (4, 4), (4, 8), (5, 12)])
@pytest.mark.parametrize("f, b, w", [(1, 1, 1), (2, 2, 1), (1, 2, 1), (3, 2, 2), (2, 3, 2)])
def test_zero_bubble_bubble_equals_the_papers_formula(P, M, f, b, w):
    """ZB-H1 idles (P - 1)(f + b - w) per rank (Qi et al. 2023), against 1F1B's (P - 1)(f + b + w):
    a third of it when the three cost the same."""
    zb = timeline("zero_bubble", P, M, 1, f, b, w)
    idle = (P - 1) * (f + b - w)
    assert zb["bubble"] == pytest.approx(idle / (idle + M * (f + b + w)))
    assert zb["makespan"] - M * (f + b + w) == idle
    one_f_one_b_idle = timeline("1f1b", P, M, 1, f, b, w)["makespan"] - M * (f + b + w)
    assert one_f_one_b_idle == (P - 1) * (f + b + w)


@pytest.mark.parametrize("P, M", [(2, 3), (2, 8), (3, 5), (4, 8), (5, 12)])
@pytest.mark.parametrize("cost", [1, 2, 3])
def test_zbv_idles_only_while_the_first_micro_batch_comes_down_the_v(P, M, cost):
    """ZB-V with F = B = W for a chunk (the paper's condition): a rank idles (P - 1) F, while
    micro-batch 0 reaches it and the last one leaves; everything else is work, 2M(F + B + W)."""
    t = timeline("zbv", P, M, 2, cost, cost, cost)
    assert t["makespan"] - 2 * M * 3 * cost == (P - 1) * cost
    assert t["bubble"] == pytest.approx(bubble_formula("zbv", P, M, 2, cost, cost, cost))


@pytest.mark.parametrize("f, b, w", [(2, 2, 1), (1, 2, 1), (3, 2, 2), (2, 1, 1)])
def test_zbv_fixed_order_idles_more_when_the_costs_differ(f, b, w):
    """The V's order is the paper's for equal costs: with others it may idle more, never less."""
    P, M = 4, 8
    idle = timeline("zbv", P, M, 2, f, b, w)["makespan"] - 2 * M * (f + b + w)
    assert idle >= (P - 1) * f


@pytest.mark.parametrize("schedule, V", [("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1),
                                         ("zbv", 2)])
@pytest.mark.parametrize("P, M", [(2, 4), (4, 8)])
def test_every_schedules_simulated_bubble_equals_its_papers_formula(schedule, V, P, M):
    """One F, B and W each (a backward B + W where unsplit): the simulator's bubble is the
    formula's -- 1F1B and interleaved (P - 1)/(VM + P - 1), ZB-H1 (P - 1)(F + B - W) idle, ZB-V
    (P - 1) F -- and ZB-V's is the smallest, ZB-H1's next."""
    bubbles = timeline(schedule, P, M, V)["bubble"]
    assert bubbles == pytest.approx(bubble_formula(schedule, P, M, V))
    order = {"zbv": 0, "zero_bubble": 1, "interleaved": 2, "1f1b": 3}
    others = {s: timeline(s, P, M, 2 if s in ("zbv", "interleaved") else 1)["bubble"]
              for s in order}
    assert sorted(others, key=others.get) == sorted(order, key=order.get)


@pytest.mark.parametrize("args, message", [
    (("zbv", 4, 8, 1), "zbv runs two chunks per rank \\(a V\\), got NUM_CHUNKS=1"),
    (("zbv", 4, 6, 2), "zbv needs NUM_MICRO_BATCHES >= 2 x pipeline size - 1 = 7 .*got 6"),
    (("1f1b", 4, 3, 1), "NUM_MICRO_BATCHES=3 is smaller than the pipeline size 4"),
    (("interleaved", 4, 6, 2), "multiple of the pipeline size: M=6, P=4; use M=8"),
    (("1f1b", 2, 4, 2), "use the interleaved schedule for NUM_CHUNKS=2"),
    (("zigzag", 2, 4, 1), "unknown schedule 'zigzag'"),
])
def test_impossible_plans_are_clear_errors(args, message):
    with pytest.raises(PlanError, match=message):
        all_plans(*args)


def test_show_prints_a_timeline(capsys):
    assert show_main(["--show", "--stages", "2", "--microbatches", "4"]) == 0
    out = capsys.readouterr().out
    assert "rank 0 |F0F1....B0B0F2B1B1F3B2B2..B3B3|" in out and "bubble 20.0%" in out
    assert "rank 0: 2, rank 1: 1" in out
    assert show_main(["--stages", "4", "--microbatches", "6", "--chunks", "2"]) == 2
    assert "use M=8" in capsys.readouterr().err
    assert "F0a" in render("interleaved", 2, 4, 2) and "F0b" in render("interleaved", 2, 4, 2)
    assert show_main(["--schedule", "zero_bubble", "--stages", "2", "--microbatches", "4"]) == 0
    out = capsys.readouterr().out
    assert "rank 0 |F0F1..B0W0F2B1W1F3B2W2B3W3|" in out and "bubble 7.7%" in out
    assert "rank 0: 2, rank 1: 2" in out
    assert show_main(["--schedule", "zbv", "--stages", "2", "--microbatches", "4"]) == 0
    out = capsys.readouterr().out
    assert "rank 0 |F0aF1aF2aF0bB0bW0bF1bB1bW1bF3aB0aW0aF2bB2bW2bB1aW1a" in out
    assert "rank 0: 4, rank 1: 4" in out and "bubble 4.0%" in out


# ---- partitioning ----------------------------------------------------------------------------

@pytest.mark.parametrize("costs, parts",
                         [([5, 1, 1, 1, 1, 5], 3), ([1] * 7, 3), ([9, 1, 1, 1], 2), ([3, 3, 3], 3)])
def test_balanced_split_is_optimal(costs, parts):
    sizes = balanced_split(costs, parts)
    assert sum(sizes) == len(costs) and min(sizes) >= 1

    def worst(sz):
        out, i = [], 0
        for s in sz:
            out.append(sum(costs[i:i + s]))
            i += s
        return max(out)
    best = min(worst(c) for c in itertools.product(range(1, len(costs) + 1),
                                                   repeat=parts) if sum(c) == len(costs))
    assert worst(sizes) == best


def _layers(n=8):
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(4, 4) if i % 2 == 0 else nn.Tanh() for i in range(n)])


@pytest.fixture
def two_stages(monkeypatch):
    """Pretend to be a 2-stage pipeline (partitioning only reads these fields)."""
    def at(rank):
        monkeypatch.setattr(gpc, "pipeline_size", 2)
        monkeypatch.setattr(gpc, "pipeline_rank", rank)
    return at


def test_stage_state_dict_keys_are_the_sequentials(two_stages):
    full = _layers()
    keys = []
    for rank in (0, 1):
        two_stages(rank)
        stage = build_pipeline_model(_layers(), partition="uniform")
        keys.append(list(stage.state_dict()))
    assert keys == [["0.weight", "0.bias", "2.weight", "2.bias"],
                    ["4.weight", "4.bias", "6.weight", "6.bias"]]
    two_stages(1)
    chunks = build_pipeline_model(_layers(), num_chunks=2, partition="uniform")  # parts 1 and 3
    assert list(chunks.state_dict()) == ["2.weight", "2.bias", "6.weight", "6.bias"]
    chunks.load_state_dict({k: v for k, v in full.state_dict().items() if k[0] in "26"})
    assert torch.equal(chunks[1].get_submodule("6").weight, full[6].weight)


def test_parameters_partition_balances_parameter_counts(two_stages):
    two_stages(0)
    layers = nn.Sequential(nn.Linear(100, 100), nn.Linear(100, 10), nn.Linear(10, 10),
                           nn.Linear(10, 10))
    assert list(build_pipeline_model(layers, partition="parameters").state_dict())[0] == "0.weight"
    # the big layer alone
    assert len(list(build_pipeline_model(layers, partition="parameters").children())) == 1


class Heavy(nn.Module):
    """Lots of compute, no parameters: invisible to a parameter count, obvious to a clock."""

    def __init__(self):
        super().__init__()
        self.register_buffer("w", torch.randn(256, 256) / 16)

    def forward(self, x):
        for _ in range(40):
            x = torch.tanh(x @ self.w)
        return x


def test_profile_partition_sees_compute_that_parameters_miss(two_stages):
    two_stages(0)

    def layers():
        torch.manual_seed(0)
        return nn.Sequential(Heavy(), nn.Linear(256, 256), nn.Linear(256, 256), nn.Linear(256, 256))
    by_params = build_pipeline_model(layers(), partition="parameters")
    by_time = build_pipeline_model(layers(), partition="profile", sample_input=torch.randn(64, 256))
    assert [name for name, _ in by_params.named_children()] == ["0", "1"]  # Heavy counts as free
    assert [name for name, _ in by_time.named_children()] == ["0"]         # Heavy alone on stage 0


def test_profiling_leaves_the_model_and_the_rng_as_seeded(two_stages):
    """Profiling times forward/backward of each layer, which moves BatchNorm statistics and
    advances the RNG (dropout) -- on rank 0 only. Both must be as seeded afterwards, or stage 0
    starts from another model than one process."""
    two_stages(0)
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 8))
    seeded = {k: v.clone() for k, v in layers.state_dict().items()}
    sample = torch.randn(16, 8)
    rng = torch.get_rng_state()
    stage = build_pipeline_model(layers, partition="profile", sample_input=sample)
    assert torch.equal(torch.get_rng_state(), rng), "profiling consumed random numbers"
    for key, value in stage.state_dict().items():
        assert torch.equal(value, seeded[key]), f"profiling changed {key}"
    assert all(p.grad is None for p in stage.parameters())


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(layers=nn.Linear(2, 2)), TypeError, "needs an nn.Sequential"),
    (dict(layers=nn.Sequential(nn.Linear(2, 2)), num_chunks=1), ValueError,
     "has 1 layers but the pipeline needs 2"),
    (dict(partition=[1, 2]), ValueError,
     r"partition \[1, 2\] must be 2 positive layer counts summing to 8"),
    (dict(partition="size"), ValueError, "unknown partition 'size'"),
    (dict(partition="profile"), ValueError, "needs sample_input"),
])
def test_partition_errors(two_stages, kwargs, error, message):
    two_stages(0)
    kwargs.setdefault("layers", _layers())
    with pytest.raises(error, match=message):
        build_pipeline_model(**kwargs)


@pytest.mark.parametrize("V, first, last", [(10, "F0a", "F1j"), (30, "F0.0", "F1.29")])
def test_more_than_eight_chunks_render_with_distinct_labels(V, first, last):
    text = render("interleaved", 2, 2, V)
    assert first in text and last in text
    labels = {step_label(s, V) for s in build_plan("interleaved", 2, 2, V,
                                                   0) if isinstance(s, Compute)}
    assert len(labels) == 2 * V * 2  # F and B of each (chunk, micro-batch) on rank 0, all distinct


@pytest.mark.parametrize("P", [1, 2, 3, 4, 5])
def test_the_textbook_1f1b_loop_is_the_plan_the_executor_runs(P):
    """one_f_one_b (warm-up, steady 1F1B, cool-down, written as three loops) is what runs for
    1F1B, and gives the same computations and communication batches, in the same order, as
    round_plan, the loop generalised that GPipe and interleaved 1F1B run."""
    for M in range(P, 3 * P + 2):
        for rank in range(P):
            assert build_plan("1f1b", P, M, 1, rank) == one_f_one_b(P, M, rank)
            assert one_f_one_b(P, M, rank) == round_plan("1f1b", P, M, 1, rank), (P, M, rank)


# ---- the split backward zero-bubble plans run ---------------------------------------------------

def test_split_backward_is_one_backward_in_two_steps_computing_nothing_twice():
    """B (the input's gradient) then W (the weights') give one backward's gradients, exactly,
    for the same floating-point operations; two backwards (inputs=[x], then inputs=weights)
    would compute the activations' gradients twice. A weight used twice is still summed (by a
    backward from the output into it)."""
    from torch.utils.flop_counter import FlopCounterMode

    from nanocolossal.pipeline.split_backward import SplitBackward, TwoBackwards
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                        nn.Linear(8, 8)).double()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    weights, grad = list(net.parameters()), torch.randn(4, 8, dtype=torch.float64)

    def flops(run):
        for w in weights + [x]:
            w.grad = None
        out = net(x)
        with FlopCounterMode(display=False) as counter:
            run(out)
        return counter.get_total_flops(), [w.grad for w in weights + [x]]

    def split(out, how=SplitBackward):
        step = how([out], [grad], x, weights)
        step.input_grad()
        assert all(w.grad is None for w in weights) and x.grad is not None
        step.weight_grads()

    one, expected = flops(lambda out: out.backward(grad))
    ours, got = flops(split)
    naive, naive_got = flops(lambda out: split(out, TwoBackwards))
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert all(torch.equal(a, b) for a, b in zip(naive_got, expected))
    assert ours == one < naive
    net[4].weight = net[0].weight  # used twice: first layer and last
    weights = list(net.parameters())
    _, expected = flops(lambda out: out.backward(grad))
    assert all(torch.equal(a, b) for a, b in zip(flops(split)[1], expected))


def test_show_zbv_needs_no_microbatches_flag_for_any_stage_count(capsys):
    for stages in (2, 3, 4, 5, 6):
        assert show_main(["--show", "--schedule", "zbv", "--stages", str(stages)]) == 0, stages
        assert f"zbv: P={stages} stages" in capsys.readouterr().out
