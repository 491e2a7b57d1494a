"""Pipeline schedules as plain data: what each rank computes, sends and receives, in order.

A plan is a list of steps (steps.py: F(c, m), B(c, m) of chunk c and micro-batch m, messages).

GPipe: all forwards, then all backwards. Simple, but every rank holds all M micro-batches'
activations at the peak. (P=4, M=8; a forward takes one time unit (2 columns), a backward two)

    rank 0 |F0F1F2F3F4F5F6F7..................B0B0B1B1B2B2B3B3B4B4B5B5B6B6B7B7|
    rank 1 |..F0F1F2F3F4F5F6F7............B0B0B1B1B2B2B3B3B4B4B5B5B6B6B7B7....|
    rank 2 |....F0F1F2F3F4F5F6F7......B0B0B1B1B2B2B3B3B4B4B5B5B6B6B7B7........|
    rank 3 |......F0F1F2F3F4F5F6F7B0B0B1B1B2B2B3B3B4B4B5B5B6B6B7B7............|

1F1B: rank r runs min(P - r - 1, M) warm-up forwards, then alternates one forward and one
backward, then drains the remaining backwards. Same bubble, but rank r never holds more
than P - r micro-batches' activations:

    rank 0 |F0F1F2F3............B0B0F4B1B1F5B2B2F6B3B3F7B4B4..B5B5..B6B6..B7B7|
    rank 1 |..F0F1F2........B0B0F3B1B1F4B2B2F5B3B3F6B4B4F7B5B5..B6B6..B7B7....|
    rank 2 |....F0F1....B0B0F2B1B1F3B2B2F4B3B3F5B4B4F6B5B5F7B6B6..B7B7........|
    rank 3 |......F0B0B0F1B1B1F2B2B2F3B3B3F4B4B4F5B5B5F6B6B6F7B7B7............|

Interleaved 1F1B (Megatron): with V chunks per rank each step is 1/V as long, so the bubble
shrinks by V. Forwards go through chunks in groups of P micro-batches; warm-up is
(P - r - 1) * 2 + (V - 1) * P forwards; M must be a multiple of P.

The bubble: with forward cost f and backward cost b, every schedule here idles
(P - 1) * (f + b) per rank (divided by V when interleaved), out of M * (f + b) of work:
bubble fraction = (P - 1) / (V * M + P - 1).

Zero bubble (ZB-H1, ZB-V; zero_bubble.py) splits each backward in two, B the input's gradient
and W the weights', and fills the bubble with the W's nobody waits for.

`one_f_one_b` below is 1F1B on one rank as the textbooks draw it, in one screen: what the executor
(executor.py) runs for 1F1B, training and evaluation (forwards only). Before each forward a rank
receives its input activation (unless it is the first stage), before each backward the gradient of
its output (unless it is the last); one communication batch between two computations posts the sends
of the one before with the receives of the one after, so neighbours never wait on each other in a
ring. `round_plan` generalises the loop to GPipe, interleaved chunks and ZB-H1's order; ZB-V's runs
with its messages on time (`on_time_plan`). `simulate.py` executes plans symbolically and draws the
timelines above: `python -m nanocolossal.pipeline --show --stages 4 --microbatches 8`.
"""
from __future__ import annotations

from .plan_checks import SCHEDULES as SCHEDULES
from .plan_checks import check_sizes
from .steps import Comm, Compute, Step, Transfer, received_by, sent_by, v_shaped, virtual_stage
from .steps import PlanError as PlanError
from .zero_bubble import on_time_plan, zbv_order, zero_bubble_order


def one_f_one_b(P: int, M: int, rank: int, forward_only: bool = False) -> list[Step]:
    """1F1B on pipeline rank `rank` of P, M micro-batches: the textbook loop (see above)."""
    first, last = rank == 0, rank == P - 1
    plan: list[Step] = []
    sends: tuple[Transfer, ...] = ()

    def run(kind: str, m: int) -> None:
        nonlocal sends
        if kind == "F":
            needs = () if first else (Transfer("act", rank - 1, rank, m),)
        else:
            needs = () if last else (Transfer("grad", rank + 1, rank, m),)
        if sends or needs:
            plan.append(Comm(sends, needs))
        plan.append(Compute(kind, 0, m))
        if kind == "F":
            sends = () if last else (Transfer("act", rank, rank + 1, m),)
        else:
            sends = () if first else (Transfer("grad", rank, rank - 1, m),)

    warmup = min(P - rank - 1, M)  # forwards until the first micro-batch's gradient can return
    if forward_only:  # evaluation: the forwards alone
        warmup = M
    for m in range(warmup):                      # warm-up
        run("F", m)
    for i in range(M - warmup):                  # steady state: one forward, one backward
        run("F", warmup + i)
        run("B", i)
    for m in range(M - warmup, 0 if forward_only else M):  # cool-down: the backwards in flight
        run("B", m)
    if sends:
        plan.append(Comm(sends, ()))
    return plan


def _interleaved_step(k: int, kind: str, P: int, V: int) -> Compute:
    """A rank's k-th forward (or backward) in interleaved 1F1B.

    Micro-batches go in groups of P; a group runs through chunk 0, 1, ..., V-1 (backwards: V-1
    down to 0) before the next group starts. For P = 2, V = 2, M = 4:

        k               0  1  2  3  4  5  6  7
        group           0  0  0  0  1  1  1  1     k // (P * V)
        forward chunk   0  0  1  1  0  0  1  1     (k % (P * V)) // P
        backward chunk  1  1  0  0  1  1  0  0     V - 1 - forward chunk
        micro-batch     0  1  0  1  2  3  2  3     group * P + k % P
    """
    group, within = divmod(k, P * V)
    chunk = within // P
    return Compute(kind, chunk if kind == "F" else V - 1 - chunk, group * P + within % P)


def warmup_count(schedule: str, P: int, M: int, V: int, rank: int) -> int:
    """Forwards a rank runs before its first backward."""
    if schedule == "gpipe":
        return M * V
    if schedule in ("1f1b", "zero_bubble"):
        return min(P - rank - 1, M)
    # Megatron: with one group of micro-batches interleaving degenerates to all-forward-first
    return M * V if M == P else min((P - rank - 1) * 2 + (V - 1) * P, M * V)


def _rounds(schedule: str, P: int, M: int, V: int, rank: int,
            forward_only: bool) -> list[list[Compute]]:
    """One rank's compute steps in rounds, each run with no communication inside it."""
    check_sizes(schedule, P, M, V)
    if schedule in ("zero_bubble", "zbv"):
        order = (zero_bubble_order if schedule == "zero_bubble" else zbv_order)(P, M, rank)
        return [[s] for s in order if not forward_only or s.kind == "F"]
    if schedule == "interleaved":
        forwards = [_interleaved_step(k, "F", P, V) for k in range(M * V)]
        backwards = [_interleaved_step(k, "B", P, V) for k in range(M * V)]
    else:
        forwards = [Compute("F", 0, m) for m in range(M)]
        backwards = [Compute("B", 0, m) for m in range(M)]
    if forward_only:
        return [[f] for f in forwards]
    warmup = warmup_count(schedule, P, M, V, rank)
    steady = len(forwards) - warmup
    rounds = ([[f] for f in forwards[:warmup]]  # warm-up: until a gradient can come back
              + [[forwards[warmup + i], backwards[i]] for i in range(steady)]  # one F, one B
              + [[b] for b in backwards[steady:]])  # cool-down: the backwards still in flight
    if schedule != "interleaved":
        rounds = [[step] for steps in rounds for step in steps]
    return rounds


def compute_order(schedule: str, P: int, M: int, V: int, rank: int,
                  forward_only: bool = False) -> list[Compute]:
    """The forwards and backwards of one rank, in the order it runs them."""
    return [step for steps in _rounds(schedule, P, M, V, rank, forward_only) for step in steps]


def build_plan(schedule: str, P: int, M: int, V: int, rank: int,
               forward_only: bool = False) -> list[Step]:
    """What rank `rank` runs: 1F1B's loop, zbv's messages on time, or `round_plan`."""
    if schedule == "1f1b":
        check_sizes(schedule, P, M, V)
        return one_f_one_b(P, M, rank, forward_only)
    if schedule == "zbv":
        orders = [compute_order(schedule, P, M, V, r, forward_only) for r in range(P)]
        return on_time_plan(orders, P, V, rank, v_shaped(schedule))
    return round_plan(schedule, P, M, V, rank, forward_only)


def round_plan(schedule: str, P: int, M: int, V: int, rank: int,
               forward_only: bool = False) -> list[Step]:
    """Compute steps with their messages: between two rounds, one batch posts the previous
    round's sends with every receive the next needs. GPipe and 1F1B use rounds of one step
    (Megatron's send_forward_recv_backward), so an activation leaves at once; interleaved 1F1B
    pairs each steady forward with its backward (send_forward_backward_recv_forward_backward):
    a backward's receive posted after the paired forward would deadlock around the ring (the
    simulator finds it). For 1F1B it gives `one_f_one_b`'s plan (a test proves it)."""
    last = P * V - 1
    plan: list[Step] = []
    pending: list[Transfer] = []
    for steps in _rounds(schedule, P, M, V, rank, forward_only):
        recvs = [t for step in steps
                 for t in received_by(step, virtual_stage(step.chunk, rank, P), last)]
        if pending or recvs:
            plan.append(Comm(tuple(pending), tuple(recvs)))
        plan += steps
        pending = [t for step in steps
                   for t in sent_by(step, virtual_stage(step.chunk, rank, P), last)]
    if pending:
        plan.append(Comm(tuple(pending), ()))
    return plan


def all_plans(schedule: str, P: int, M: int, V: int = 1,
              forward_only: bool = False) -> list[list[Step]]:
    return [build_plan(schedule, P, M, V, r, forward_only) for r in range(P)]
