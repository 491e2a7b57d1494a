"""Pipeline schedules as plain data: what each rank computes, sends and receives, in order.

The model is cut into P * V parts ("virtual stages"); rank r holds chunks c = 0..V-1, and
chunk c is part v = c * P + r (zbv places them in a V, below). A batch is cut into M
micro-batches. Each rank runs a list of steps: forward F(c, m), backward B(c, m), and
communication batches (sends and receives posted together, so two neighbours sending to each
other at once cannot deadlock).

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

Zero bubble, ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): a backward is two
computations. B, the gradient of the stage's input, is what the previous stage waits for; W, the
gradient of the weights, nobody waits for. So B alone travels back (faster), and rank r runs each
W `r` backwards late: the W's it kept back fill the cool-down's idle time. Same warm-up and
order of F and B as 1F1B; a micro-batch's activations are held until its W, at most P per rank
(1F1B's peak, on rank 0). (F, B and W each take one unit here:)

    rank 0 |F0F1F2F3......B0W0F4B1W1F5B2W2F6B3W3F7B4W4B5W5B6W6B7W7|
    rank 1 |..F0F1F2....B0F3B1W0F4B2W1F5B3W2F6B4W3F7B5W4B6W5B7W6W7|
    rank 2 |....F0F1..B0F2B1F3B2W0F4B3W1F5B4W2F6B5W3F7B6W4B7W5W6W7|
    rank 3 |......F0B0F1B1F2B2F3B3W0F4B4W1F5B5W2F6B6W3F7B7W4W5W6W7|

Each rank idles (P - 1)(f + b - w) beside 1F1B's (P - 1)(f + b + w) (its backward is b + w): a
third when the three cost the same (bubble 11% here against 27%). Integer activations have no
gradient to send; on the first stage B computes nothing (the input is data), W everything.

ZB-V (the same paper's V-shaped schedule; torch's ScheduleZBVZeroBubble): two chunks per rank
placed in a V -- chunk 0 is part r going down the ranks, chunk 1 is part 2P - 1 - r coming back
up -- so rank 0 holds the first part and the last (the loss), and rank P - 1 the two middle ones,
which it hands over in memory. Each backward splits into B and W as in ZB-H1. Rank r runs
2(P - r) - 1 forwards of chunk 0, then forwards of both chunks in turn, then chunk 1's F, B, W
until it is steady at F, B, W of each chunk; the W's it holds back fill the cool-down. With F, B
and W of a chunk (half a stage) equal, a rank idles only while micro-batch 0 comes down the V to
it and the last goes back: (P - 1) F, against 1F1B's (P - 1)(2F + 2B + 2W) in these units; each
rank holds at most 2P chunks' activations (half a stage each): 1F1B's peak. It needs M >= 2P - 1.
Its messages go both ways between neighbours, so they are timed (`on_time_plan`):

    rank 0 |F0aF1aF2aF3aF4aF5aF6aF0bB0bW0bF1bB1bW1bF2bB2bW2bF3bB3bW3bF7aB0aW0aF4bB4bW4bB1aW1a...
    rank 3 |.........F0aF0bF1aF1bF2aF2bF3aF3bB0bW0bF4aB0aW0aF4bB1bW1bF5aB1aW1aF5bB2bW2bF6aB2a...

`one_f_one_b` below is 1F1B on one rank as the textbooks draw it, in one screen, and is what the
executor (schedule.py) runs for 1F1B; `round_plan` is the same loop generalised to GPipe and
interleaved chunks (a test proves it gives `one_f_one_b`'s plan), with ZB-H1's order from
`zero_bubble_order`; ZB-V's order (`zbv_order`) runs with its messages on time (`on_time_plan`).
`build_plan` picks among the three.
`simulate.py` executes plans symbolically and draws the timelines above:
`python -m nanocolossal.pipeline --show --stages 4 --microbatches 8 [--schedule zero_bubble|zbv]`.
"""
from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Union

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble", "zbv")


@dataclass(frozen=True)
class Compute:
    kind: str   # "F", "B" or "W" (zero-bubble plans: B is the input's gradient, W the weights')
    chunk: int
    mb: int


@dataclass(frozen=True)
class Transfer:
    """One point-to-point message: `what` ("act" forward, "grad" backward) of micro-batch `mb`
    from virtual stage `src` to virtual stage `dst`."""
    what: str
    src: int
    dst: int
    mb: int


@dataclass(frozen=True)
class Comm:
    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]


Step = Union[Compute, Comm]


class PlanError(ValueError):
    pass


def check_sizes(schedule: str, P: int, M: int, V: int) -> None:
    """Raise PlanError for a combination no schedule can run."""
    if schedule not in SCHEDULES:
        raise PlanError(f"unknown schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    if P < 1 or M < 1 or V < 1:
        raise PlanError(f"stages, micro-batches and chunks must be >= 1, got P={P}, M={M}, V={V}")
    if schedule == "zbv" and V != 2:
        raise PlanError(f"zbv runs two chunks per rank (a V), got NUM_CHUNKS={V}; set "
                        f"NUM_CHUNKS=2")
    if schedule not in ("interleaved", "zbv") and V != 1:
        raise PlanError(f"{schedule} runs one chunk per rank; use the interleaved schedule for "
                        f"NUM_CHUNKS={V}")
    if schedule == "interleaved" and P < 2:
        raise PlanError("the interleaved schedule needs at least 2 pipeline stages")
    if schedule == "zbv" and M < 2 * P - 1:
        raise PlanError(f"zbv needs NUM_MICRO_BATCHES >= 2 x pipeline size - 1 = {2 * P - 1} "
                        f"(rank 0's forwards before micro-batch 0 comes back up the V), got {M}")
    if schedule == "interleaved" and M % P != 0:
        raise PlanError(f"the interleaved schedule needs NUM_MICRO_BATCHES a multiple of the "
                        f"pipeline size: M={M}, P={P}; use M={((M + P - 1) // P) * P}")
    if M < P:
        raise PlanError(f"NUM_MICRO_BATCHES={M} is smaller than the pipeline size {P}: stages "
                        f"would idle most of the time; use at least {P} micro-batches")


def warmup_count(schedule: str, P: int, M: int, V: int, rank: int) -> int:
    """Forwards a rank runs before its first backward."""
    if schedule == "gpipe":
        return M * V
    if schedule in ("1f1b", "zero_bubble"):
        return min(P - rank - 1, M)
    # Megatron: with one group of micro-batches interleaving degenerates to all-forward-first
    if M == P:
        return M * V
    return min((P - rank - 1) * 2 + (V - 1) * P, M * V)


def virtual_stage(chunk: int, rank: int, P: int, v_shape: bool = False) -> int:
    """Which of the P * V model parts chunk `chunk` of pipeline rank `rank` is: part c * P + r,
    looping down the ranks; in a V (zbv) the odd chunks come back up, chunk 1 of rank r being
    part 2P - 1 - r (so parts P - 1 and P, the bottom of the V, share rank P - 1)."""
    if v_shape and chunk % 2:
        return (chunk + 1) * P - 1 - rank
    return chunk * P + rank


def stage_rank(v: int, P: int, v_shape: bool = False) -> int:
    """The pipeline rank that holds part v (virtual_stage's inverse)."""
    chunk, r = divmod(v, P)
    return P - 1 - r if v_shape and chunk % 2 else r


def handed_over(t: Transfer, P: int, v_shape: bool) -> bool:
    """Whether transfer t stays on one rank (zbv's parts P - 1 and P): handed over in memory."""
    return stage_rank(t.src, P, v_shape) == stage_rank(t.dst, P, v_shape)


def v_shaped(schedule: str) -> bool:
    """Whether `schedule` places its chunks in a V (zbv) rather than looping (interleaved)."""
    return schedule == "zbv"


def one_f_one_b(P: int, M: int, rank: int) -> list[Step]:
    """1F1B on pipeline rank `rank` of P, M micro-batches: the textbook loop.

    Before each forward a rank receives its input activation (unless it is the first stage),
    before each backward the gradient of its output (unless it is the last); after each it sends
    the result on. One communication batch between two computations posts the sends of the one
    before with the receives of the one after, so neighbours never wait on each other in a ring.
    """
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
    for m in range(warmup):                      # warm-up
        run("F", m)
    for i in range(M - warmup):                  # steady state: one forward, one backward
        run("F", warmup + i)
        run("B", i)
    for m in range(M - warmup, M):               # cool-down: drain the backwards in flight
        run("B", m)
    if sends:
        plan.append(Comm(sends, ()))
    return plan


def zero_bubble_order(P: int, M: int, rank: int) -> list[Compute]:
    """ZB-H1 on pipeline rank `rank`: 1F1B's forwards and input-gradient backwards B, each
    weight gradient W run `rank` backwards after its B, and the W's left over at the end."""
    warmup = min(P - rank - 1, M)
    order = [Compute("F", 0, m) for m in range(warmup)]
    done_b = done_w = 0

    def backward() -> None:
        nonlocal done_b, done_w
        order.append(Compute("B", 0, done_b))
        done_b += 1
        if done_b - done_w > rank:  # rank r keeps r weight gradients back for the cool-down
            order.append(Compute("W", 0, done_w))
            done_w += 1

    for m in range(warmup, M):                   # steady state: F, B (and a W once lagging)
        order.append(Compute("F", 0, m))
        backward()
    while done_b < M:                            # cool-down: the B's still in flight
        backward()
    order += [Compute("W", 0, m) for m in range(done_w, M)]  # the deferred W's fill the bubble
    return order


def zbv_order(P: int, M: int, rank: int) -> list[Compute]:
    """ZB-V on pipeline rank `rank`: chunk 0 (part `rank`, on the way down the V) and chunk 1
    (part 2P - 1 - rank, on the way back up), each backward split into B and W.

    Counted as if there were at least 2P - 1 micro-batches (rank 0's forwards until micro-batch
    0 comes back to it); the steps of micro-batches beyond M are then left out."""
    n = max(M, 2 * P - 1)
    order: list[Compute] = []
    done = {(kind, c): 0 for kind in "FBW" for c in (0, 1)}

    def run(kind: str, chunk: int) -> None:
        m = done[kind, chunk]
        done[kind, chunk] += 1
        if m < M:
            order.append(Compute(kind, chunk, m))

    for _ in range(2 * (P - rank) - 1):          # warm-up: down the V until chunk 1 has work
        run("F", 0)
    for _ in range(rank):                        # both chunks' forwards, in turn
        run("F", 1)
        run("F", 0)
    for _ in range(P - rank):                    # chunk 1's first backwards
        run("F", 1)
        run("B", 1)
        run("W", 1)
    while done["F", 0] < n or done["F", 1] < done["F", 0]:  # steady state: each chunk F, B, W
        if done["F", 0] < n:
            run("F", 0)
        run("B", 0)
        run("W", 0)
        run("F", 1)
        run("B", 1)
        run("W", 1)
    for _ in range(rank):                        # cool-down: the B's first, both chunks
        run("B", 0)
        run("B", 1)
    for _ in range(P - rank):
        run("B", 0)
        run("W", 0)
    for c in (1, 0):                             # the deferred W's fill the bubble
        while done["W", c] < done["B", c]:
            run("W", c)
    return order


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


def _rounds(schedule: str, P: int, M: int, V: int, rank: int,
            forward_only: bool) -> list[list[Compute]]:
    """The compute steps of one rank, grouped into rounds that run with no communication between
    them: warm-up forwards alone, then (forward, backward) pairs, then the remaining backwards."""
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
    # warm-up: forwards only, until the first micro-batch's gradient can come back
    warmup_rounds = [[f] for f in forwards[:warmup]]
    # steady state: one forward, one backward -- the number of activations held stays constant
    steady_rounds = [[forwards[warmup + i], backwards[i]] for i in range(steady)]
    # cool-down: the backwards of the micro-batches still in flight drain the pipeline
    cooldown_rounds = [[b] for b in backwards[steady:]]
    rounds = warmup_rounds + steady_rounds + cooldown_rounds
    # plain 1F1B communicates after every step, so activations leave at once
    if schedule != "interleaved":
        rounds = [[step] for steps in rounds for step in steps]
    return rounds


def compute_order(schedule: str, P: int, M: int, V: int, rank: int,
                  forward_only: bool = False) -> list[Compute]:
    """The forwards and backwards of one rank, in the order it runs them."""
    return [step for steps in _rounds(schedule, P, M, V, rank, forward_only) for step in steps]


def _needs(step: Compute, v: int, last: int) -> list[Transfer]:
    """What compute step `step` of part v receives: a forward its input, a backward the gradient
    of its output (none for the first and last parts, and none for W)."""
    if step.kind == "F" and v > 0:
        return [Transfer("act", v - 1, v, step.mb)]
    if step.kind == "B" and v < last:
        return [Transfer("grad", v + 1, v, step.mb)]
    return []


def _gives(step: Compute, v: int, last: int) -> list[Transfer]:
    """What compute step `step` of part v sends on: a forward its output, a backward its input's
    gradient."""
    if step.kind == "F" and v < last:
        return [Transfer("act", v, v + 1, step.mb)]
    if step.kind == "B" and v > 0:
        return [Transfer("grad", v, v - 1, step.mb)]
    return []


def build_plan(schedule: str, P: int, M: int, V: int, rank: int,
               forward_only: bool = False) -> list[Step]:
    """What rank `rank` runs: for training under 1F1B the textbook loop (`one_f_one_b`), for zbv
    messages on time (`on_time_plan`), for the others `round_plan`."""
    if schedule == "1f1b" and not forward_only:
        check_sizes(schedule, P, M, V)
        return one_f_one_b(P, M, rank)
    if schedule == "zbv":
        return on_time_plan(schedule, P, M, V, rank, forward_only)
    return round_plan(schedule, P, M, V, rank, forward_only)


def round_plan(schedule: str, P: int, M: int, V: int, rank: int,
               forward_only: bool = False) -> list[Step]:
    """Compute steps with their communication. Between two rounds, one batch posts the previous
    round's sends together with every receive the next round needs. GPipe and 1F1B use rounds of
    one step (Megatron's send_forward_recv_backward and send_backward_recv_forward), so an
    activation leaves as soon as it is computed. Interleaved 1F1B pairs each steady-state
    forward with its backward (Megatron's send_forward_backward_recv_forward_backward):
    posting a backward's receive only after the paired forward would let the ranks wait on
    each other around the ring -- the simulator finds that deadlock. For 1F1B this gives
    `one_f_one_b`'s plan (a test proves it), which is the loop generalised."""
    last = P * V - 1
    plan: list[Step] = []
    pending: list[Transfer] = []
    for steps in _rounds(schedule, P, M, V, rank, forward_only):
        recvs = [t for step in steps
                 for t in _needs(step, virtual_stage(step.chunk, rank, P), last)]
        if pending or recvs:
            plan.append(Comm(tuple(pending), tuple(recvs)))
        plan += steps
        pending = [t for step in steps
                   for t in _gives(step, virtual_stage(step.chunk, rank, P), last)]
    if pending:
        plan.append(Comm(tuple(pending), ()))
    return plan


def on_time_plan(schedule: str, P: int, M: int, V: int, rank: int,
                 forward_only: bool = False) -> list[Step]:
    """Compute steps with messages timed by the clock of `earliest_starts` (every step one unit):
    a message is posted, by its sender and its receiver alike, in the batch at the time its
    receiver starts the step that needs it. Both ends post each message at the same time, so the
    batches at time t wait only on batches at time t, and those only on steps that started
    before t: no ring of ranks can wait on each other, whatever the order of steps (zbv's sends
    to both neighbours, in both directions, would deadlock with `build_plan`'s batches)."""
    v_shape, last = v_shaped(schedule), P * V - 1
    orders = [compute_order(schedule, P, M, V, r, forward_only) for r in range(P)]
    rows = earliest_starts(orders, P, V, v_shape, {"F": 1, "B": 1, "W": 1})
    starts = {(s.kind, virtual_stage(s.chunk, r, P, v_shape), s.mb): start
              for r, row in enumerate(rows) for start, _, s in row}
    at: dict[int, tuple[list, list]] = {}   # time -> (sends, receives) of this rank
    for start, _, step in rows[rank]:
        v = virtual_stage(step.chunk, rank, P, v_shape)
        for t in _needs(step, v, last):
            if not handed_over(t, P, v_shape):
                at.setdefault(start, ([], []))[1].append(t)
        for t in _gives(step, v, last):
            needed = starts.get(("F" if t.what == "act" else "B", t.dst, t.mb))
            if needed is not None and not handed_over(t, P, v_shape):
                at.setdefault(needed, ([], []))[0].append(t)
    plan: list[Step] = []
    times = sorted(at)
    for start, _, step in rows[rank] + [(float("inf"), None, None)]:
        while times and times[0] <= start:   # the batches due before this step
            sends, recvs = at[times.pop(0)]
            plan.append(Comm(tuple(sends), tuple(recvs)))
        if step is not None:
            plan.append(step)
    return plan


def earliest_starts(orders: list[list[Compute]], P: int, V: int, v_shape: bool,
                    cost: dict[str, float]) -> list[list[tuple]]:
    """Each rank's (start, end, step) when every step starts as soon as its rank is free and its
    input is there (communication free): a forward after the previous part's forward, B after
    the next part's B (the last part's after its own forward), W after its B."""
    end: dict[tuple, float] = {}   # (kind, virtual stage, mb) -> finish time
    rows: list[list] = [[] for _ in range(P)]
    free, idx = [0] * P, [0] * P
    last = P * V - 1
    while any(idx[r] < len(orders[r]) for r in range(P)):
        moved = False
        for r in range(P):
            while idx[r] < len(orders[r]):
                s = orders[r][idx[r]]
                v = virtual_stage(s.chunk, r, P, v_shape)
                if s.kind == "F":  # a forward needs the previous virtual stage's forward
                    dep = ("F", v - 1, s.mb) if v > 0 else None
                elif s.kind == "B":  # the next stage's B, or its own forward on the last
                    dep = ("B", v + 1, s.mb) if v < last else ("F", v, s.mb)
                else:  # W needs the output's gradient, which its B received
                    dep = ("B", v, s.mb)
                if dep is not None and dep not in end:
                    break
                start = max(free[r], end[dep] if dep else 0)
                end[(s.kind, v, s.mb)] = free[r] = start + cost[s.kind]
                rows[r].append((start, start + cost[s.kind], s))
                idx[r] += 1
                moved = True
        if not moved:
            raise PlanError("compute orders wait on each other")
    return rows


def all_plans(schedule: str, P: int, M: int, V: int = 1,
              forward_only: bool = False) -> list[list[Step]]:
    return [build_plan(schedule, P, M, V, r, forward_only) for r in range(P)]


def chunk_name(chunk: int, V: int) -> str:
    """Chunk suffix of a step label: none without interleaving, a, b, ... up to 26 chunks, else
    .0, .1, ..."""
    if V == 1:
        return ""
    return string.ascii_lowercase[chunk] if V <= len(string.ascii_lowercase) else f".{chunk}"


def step_label(step: "Compute", V: int) -> str:
    """"F3" / "B3", or "F3b" for chunk 1 of an interleaved schedule."""
    return f"{step.kind}{step.mb}{chunk_name(step.chunk, V)}"
