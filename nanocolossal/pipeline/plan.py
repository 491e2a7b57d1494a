"""Pipeline schedules as plain data: what each rank computes, sends and receives, in order.

The model is cut into P * V parts ("virtual stages"); rank r holds chunks c = 0..V-1, and
chunk c is part v = c * P + r. A batch is cut into M micro-batches. Each rank runs a list
of steps: forward F(c, m), backward B(c, m), and communication batches (sends and receives
posted together, so two neighbours sending to each other at once cannot deadlock).

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

`python -m nanocolossal.pipeline --show --stages 4 --microbatches 8 [--chunks 2]` prints these.

`simulate` executes plans symbolically (no processes): it checks that every send meets its
receive, that nothing deadlocks, and counts the activations each rank holds.
"""
from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Union

SCHEDULES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True)
class Compute:
    kind: str   # "F" or "B"
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
    if schedule != "interleaved" and V != 1:
        raise PlanError(f"{schedule} runs one chunk per rank; use the interleaved schedule for "
                        f"NUM_CHUNKS={V}")
    if schedule == "interleaved" and P < 2:
        raise PlanError("the interleaved schedule needs at least 2 pipeline stages")
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
    if schedule == "1f1b":
        return min(P - rank - 1, M)
    # Megatron: with one group of micro-batches interleaving degenerates to all-forward-first
    if M == P:
        return M * V
    return min((P - rank - 1) * 2 + (V - 1) * P, M * V)


def virtual_stage(chunk: int, rank: int, P: int) -> int:
    """Which of the P * V model parts chunk `chunk` of pipeline rank `rank` is."""
    return chunk * P + rank


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


def _units(schedule: str, P: int, M: int, V: int, rank: int,
           forward_only: bool) -> list[list[Compute]]:
    """The compute steps of one rank, grouped into units that run with no communication between
    them: warm-up forwards alone, then (forward, backward) pairs, then the remaining backwards."""
    check_sizes(schedule, P, M, V)
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
    warmup_units = [[f] for f in forwards[:warmup]]
    # steady state: one forward, one backward -- the number of activations held stays constant
    steady_units = [[forwards[warmup + i], backwards[i]] for i in range(steady)]
    # cool-down: the backwards of the micro-batches still in flight drain the pipeline
    cooldown_units = [[b] for b in backwards[steady:]]
    units = warmup_units + steady_units + cooldown_units
    # plain 1F1B communicates after every step, so activations leave at once
    if schedule != "interleaved":
        units = [[step] for unit in units for step in unit]
    return units


def compute_order(schedule: str, P: int, M: int, V: int, rank: int,
                  forward_only: bool = False) -> list[Compute]:
    """The forwards and backwards of one rank, in the order it runs them."""
    return [step for unit in _units(schedule, P, M, V, rank, forward_only) for step in unit]


def build_plan(schedule: str, P: int, M: int, V: int, rank: int,
               forward_only: bool = False) -> list[Step]:
    """Compute steps with their communication. Between two units, one batch posts the previous
    unit's sends together with every receive the next unit needs. GPipe and 1F1B use units of
    one step (Megatron's send_forward_recv_backward and send_backward_recv_forward), so an
    activation leaves as soon as it is computed. Interleaved 1F1B pairs each steady-state
    forward with its backward (Megatron's send_forward_backward_recv_forward_backward):
    posting a backward's receive only after the paired forward would let the ranks wait on
    each other around the ring -- the simulator finds that deadlock."""
    last = P * V - 1
    plan: list[Step] = []
    pending: list[Transfer] = []
    for unit in _units(schedule, P, M, V, rank, forward_only):
        recvs = []
        for step in unit:
            v = virtual_stage(step.chunk, rank, P)
            if step.kind == "F" and v > 0:
                recvs.append(Transfer("act", v - 1, v, step.mb))
            if step.kind == "B" and v < last:
                recvs.append(Transfer("grad", v + 1, v, step.mb))
        if pending or recvs:
            plan.append(Comm(tuple(pending), tuple(recvs)))
        plan += unit
        pending = []
        for step in unit:
            v = virtual_stage(step.chunk, rank, P)
            if step.kind == "F" and v < last:
                pending.append(Transfer("act", v, v + 1, step.mb))
            if step.kind == "B" and v > 0:
                pending.append(Transfer("grad", v, v - 1, step.mb))
    if pending:
        plan.append(Comm(tuple(pending), ()))
    return plan


def all_plans(schedule: str, P: int, M: int, V: int = 1,
              forward_only: bool = False) -> list[list[Step]]:
    return [build_plan(schedule, P, M, V, r, forward_only) for r in range(P)]


class DeadlockError(RuntimeError):
    pass


def simulate(plans: list[list[Step]], P: int, V: int = 1) -> dict:
    """Run plans symbolically with rendezvous semantics: a transfer completes only when the sender
    and the receiver have both posted it. Returns {"max_in_flight": [per rank], "transfers": n};
    raises PlanError (or DeadlockError) where a plan computes before its input arrives or waits
    forever."""
    pos = [0] * len(plans)
    completed: set[Transfer] = set()
    received: list[set] = [set() for _ in plans]
    done_f: list[set] = [set() for _ in plans]
    in_flight, max_in_flight = [0] * len(plans), [0] * len(plans)
    rank_of = lambda v: v % P  # noqa: E731
    while any(pos[r] < len(plans[r]) for r in range(len(plans))):
        posted = {}
        for r, plan in enumerate(plans):  # what each rank waits on right now
            if pos[r] < len(plan) and isinstance(plan[pos[r]], Comm):
                for t in plan[pos[r]].sends:
                    posted[("send", t)] = r
                for t in plan[pos[r]].recvs:
                    posted[("recv", t)] = r
        progress = False
        for (side, t), r in posted.items():
            if side == "send" and ("recv", t) in posted and t not in completed:
                completed.add(t)
                received[rank_of(t.dst)].add(t)
                progress = True
        for r, plan in enumerate(plans):
            while pos[r] < len(plan):
                step = plan[pos[r]]
                if isinstance(step, Comm):
                    if not all(t in completed for t in step.sends + step.recvs):
                        break
                else:
                    v = virtual_stage(step.chunk, r, P)
                    if step.kind == "F":
                        if v > 0 and Transfer("act", v - 1, v, step.mb) not in received[r]:
                            raise PlanError(f"rank {r}: forward {step} before receiving its input")
                        done_f[r].add((step.chunk, step.mb))
                        in_flight[r] += 1
                        max_in_flight[r] = max(max_in_flight[r], in_flight[r])
                    else:
                        if (step.chunk, step.mb) not in done_f[r]:
                            raise PlanError(f"rank {r}: backward {step} before its forward")
                        if v < P * V - 1 and Transfer("grad", v + 1, v, step.mb) not in received[r]:
                            raise PlanError(f"rank {r}: backward {step} "
                                            "before receiving its gradient")
                        in_flight[r] -= 1
                pos[r] += 1
                progress = True
        if not progress:
            stuck = {r: plans[r][pos[r]] for r in range(len(plans)) if pos[r] < len(plans[r])}
            raise DeadlockError(f"pipeline plans deadlock; ranks wait at {stuck}")
    return {"max_in_flight": max_in_flight, "transfers": len(completed)}


def timeline(schedule: str, P: int, M: int, V: int = 1, f_cost: int = 1, b_cost: int = 2) -> dict:
    """Earliest start times of each rank's compute steps given costs (communication free)."""
    orders = [compute_order(schedule, P, M, V, r) for r in range(P)]
    end: dict[tuple, int] = {}   # (kind, virtual stage, mb) -> finish time
    rows: list[list] = [[] for _ in range(P)]
    free, idx = [0] * P, [0] * P
    last = P * V - 1
    while any(idx[r] < len(orders[r]) for r in range(P)):
        moved = False
        for r in range(P):
            while idx[r] < len(orders[r]):
                s = orders[r][idx[r]]
                v = virtual_stage(s.chunk, r, P)
                if s.kind == "F":  # a forward needs the previous virtual stage's forward
                    dep = ("F", v - 1, s.mb)
                else:  # a backward needs the next stage's backward, or its own forward on the last
                    dep = ("B", v + 1, s.mb) if v < last else ("F", v, s.mb)
                if s.kind == "F" and v == 0:
                    dep = None
                if dep is not None and dep not in end:
                    break
                start = max(free[r], end[dep] if dep else 0)
                cost = f_cost if s.kind == "F" else b_cost
                end[(s.kind, v, s.mb)] = free[r] = start + cost
                rows[r].append((start, start + cost, s))
                idx[r] += 1
                moved = True
        if not moved:
            raise DeadlockError("compute orders wait on each other")
    makespan = max(free)
    busy = sum(e - s for row in rows for s, e, _ in row)
    return {"rows": rows, "makespan": makespan, "bubble": 1 - busy / (P * makespan)}


def chunk_name(chunk: int, V: int) -> str:
    """Chunk suffix of a step label: none without interleaving, a, b, ... up to 26 chunks, else
    .0, .1, ..."""
    if V == 1:
        return ""
    return string.ascii_lowercase[chunk] if V <= len(string.ascii_lowercase) else f".{chunk}"


def step_label(step: "Compute", V: int) -> str:
    """"F3" / "B3", or "F3b" for chunk 1 of an interleaved schedule."""
    return f"{step.kind}{step.mb}{chunk_name(step.chunk, V)}"


def render(schedule: str, P: int, M: int, V: int = 1) -> str:
    """An ASCII timeline, one row per rank, one column per unit of time (a backward costs 2)."""
    t = timeline(schedule, P, M, V)
    width = len(str(M - 1)) + 1 + len(chunk_name(V - 1, V))
    lines = []
    for r, row in enumerate(t["rows"]):
        cells = ["." * width] * t["makespan"]
        for start, stop, s in row:
            label = step_label(s, V).ljust(width)
            for time in range(start, stop):
                cells[time] = label
        lines.append(f"rank {r} |{''.join(cells)}|")
    ideal = (P - 1) / (V * M + P - 1)
    lines.append(f"{schedule}: P={P} stages, M={M} micro-batches, V={V} chunk(s); bubble "
                 f"{t['bubble']:.1%} (formula (P-1)/(V*M+P-1) = {ideal:.1%}); chunks a, b, ... "
                 f"when interleaved")
    return "\n".join(lines)
