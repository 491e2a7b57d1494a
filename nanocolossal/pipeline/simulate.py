"""Run pipeline plans without processes: check them, and draw their timelines.

`simulate(plans, P, V)` executes every rank's plan symbolically with rendezvous semantics -- a
transfer completes only when its sender and its receiver have both posted it -- so a plan that
computes before its input arrives, or waits forever, is an error found on a laptop, not a hang
on a cluster. It also counts the activations each rank holds (GPipe: M; 1F1B: P - rank; ZB-H1,
which holds them until W: P; ZB-V: 2P chunks', P micro-batches').

`timeline` gives each compute step its earliest start under costs (forward f, input gradient b,
weight gradient w, an unsplit backward b + w; communication free; zero_bubble.py's
`earliest_starts`) and `render` draws it, as in the docstrings of plan.py and zero_bubble.py; the
bubble it measures is the formula's there (`bubble_formula`).

Before a launch, `nanocolossal plan` computes these activation bytes and bubbles
(nanocolossal/plan/activations.py).
"""
from __future__ import annotations

from .plan import compute_order
from .steps import (
    Comm,
    Compute,
    PlanError,
    Step,
    Transfer,
    chunk_name,
    handed_over,
    stage_rank,
    step_label,
    v_shaped,
    virtual_stage,
)
from .zero_bubble import earliest_starts


class DeadlockError(RuntimeError):
    pass


def simulate(plans: list[list[Step]], P: int, V: int = 1, v_shape: bool = False) -> dict:
    """Run plans symbolically (above; a hand-over between two parts on one rank, zbv's, is at
    once) -> {"max_in_flight": [per rank], "transfers": n}; PlanError or DeadlockError."""
    pos = [0] * len(plans)
    completed: set[Transfer] = set()
    received: list[set] = [set() for _ in plans]
    done_f: list[set] = [set() for _ in plans]
    done_b: list[set] = [set() for _ in plans]
    # activations are held until the weights' gradient: W where the backward is split, else B
    split = [any(isinstance(s, Compute) and s.kind == "W" for s in plan) for plan in plans]
    in_flight = [0] * len(plans)
    max_in_flight = [0] * len(plans)
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
                received[stage_rank(t.dst, P, v_shape)].add(t)
                progress = True
        for r, plan in enumerate(plans):
            while pos[r] < len(plan):
                step = plan[pos[r]]
                if isinstance(step, Comm):
                    if not all(t in completed for t in step.sends + step.recvs):
                        break
                else:
                    v = virtual_stage(step.chunk, r, P, v_shape)
                    if step.kind == "F":
                        if v > 0 and Transfer("act", v - 1, v, step.mb) not in received[r]:
                            raise PlanError(f"rank {r}: forward {step} before receiving its input")
                        done_f[r].add((step.chunk, step.mb))
                        received[r] |= _handed_over(Transfer("act", v, v + 1, step.mb), P, V,
                                                    v_shape)
                        in_flight[r] += 1
                        max_in_flight[r] = max(max_in_flight[r], in_flight[r])
                    elif step.kind == "B":
                        if (step.chunk, step.mb) not in done_f[r]:
                            raise PlanError(f"rank {r}: backward {step} before its forward")
                        if v < P * V - 1 and Transfer("grad", v + 1, v, step.mb) not in received[r]:
                            raise PlanError(f"rank {r}: backward {step} "
                                            "before receiving its gradient")
                        done_b[r].add((step.chunk, step.mb))
                        received[r] |= _handed_over(Transfer("grad", v, v - 1, step.mb), P, V,
                                                    v_shape)
                        in_flight[r] -= not split[r]
                    else:  # W: the weights' gradient, from the output gradient B received
                        if (step.chunk, step.mb) not in done_b[r]:
                            raise PlanError(f"rank {r}: weight gradient {step} before its B")
                        in_flight[r] -= 1
                pos[r] += 1
                progress = True
        if not progress:
            stuck = {r: plans[r][pos[r]] for r in range(len(plans)) if pos[r] < len(plans[r])}
            raise DeadlockError(f"pipeline plans deadlock; ranks wait at {stuck}")
    return {"max_in_flight": max_in_flight, "transfers": len(completed)}


def _handed_over(t: Transfer, P: int, V: int, v_shape: bool) -> set[Transfer]:
    """{t} if it stays on its rank (between two of the P * V parts), else nothing."""
    inside = 0 <= min(t.src, t.dst) and max(t.src, t.dst) < P * V
    return {t} if inside and handed_over(t, P, v_shape) else set()


def timeline(schedule: str, P: int, M: int, V: int = 1, f_cost: int = 1, b_cost: int = 1,
             w_cost: int = 1) -> dict:
    """Each rank's compute steps at their earliest starts under the costs above."""
    orders = [compute_order(schedule, P, M, V, r) for r in range(P)]
    split = any(s.kind == "W" for s in orders[0])
    cost = {"F": f_cost, "B": b_cost if split else b_cost + w_cost, "W": w_cost}
    rows = earliest_starts(orders, P, V, v_shaped(schedule), cost)
    makespan = max(row[-1][1] for row in rows if row)
    busy = sum(e - s for row in rows for s, e, _ in row)
    return {"rows": rows, "makespan": makespan, "bubble": 1 - busy / (P * makespan)}


def bubble_formula(schedule: str, P: int, M: int, V: int = 1, f: float = 1, b: float = 1,
                   w: float = 1) -> float:
    """The papers' bubble fraction (above). ZB-V's costs are a chunk's (half a stage), its
    2M * (f + b + w) of work; exact when f = b = w, the paper's condition (else it idles more)."""
    if schedule == "zero_bubble":
        idle = (P - 1) * (f + b - w)
        work = M * (f + b + w)
    elif schedule == "zbv":
        idle = (P - 1) * f
        work = 2 * M * (f + b + w)
    else:
        return (P - 1) / (V * M + P - 1)
    return idle / (idle + work)


def render(schedule: str, P: int, M: int, V: int = 1) -> str:
    """An ASCII timeline, one row per rank (F, B and W cost 1 column; an unsplit backward 2)."""
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
    formula = {"zero_bubble": "(P-1)(F+B-W)/((P-1)(F+B-W)+M(F+B+W))",
               "zbv": "(P-1)F/((P-1)F+2M(F+B+W))"}.get(schedule, "(P-1)/(V*M+P-1)")
    lines.append(f"{schedule}: P={P} stages, M={M} micro-batches, V={V} chunk(s); bubble "
                 f"{t['bubble']:.1%} (formula {formula} = {bubble_formula(schedule, P, M, V):.1%})"
                 f"; chunks a, b, ... when interleaved")
    return "\n".join(lines)
