"""Zero bubble (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): a backward split in two.

A backward is two computations. B, the gradient of the stage's input, is what the previous stage
waits for; W, the gradient of the weights, nobody waits for. So B alone travels back (faster),
and the W's a rank holds back fill the time it would idle. Integer activations have no gradient
to send; on the first stage B computes nothing (the input is data), W everything.

ZB-H1 (`zero_bubble_order`): 1F1B's warm-up and order of F and B (plan.py), and rank r runs each
W `r` backwards late: the W's it kept back fill the cool-down's idle time. A micro-batch's
activations are held until its W, at most P per rank (1F1B's peak, on rank 0). (P=4, M=8; F, B
and W each take one unit:)

    rank 0 |F0F1F2F3......B0W0F4B1W1F5B2W2F6B3W3F7B4W4B5W5B6W6B7W7|
    rank 1 |..F0F1F2....B0F3B1W0F4B2W1F5B3W2F6B4W3F7B5W4B6W5B7W6W7|
    rank 2 |....F0F1..B0F2B1F3B2W0F4B3W1F5B4W2F6B5W3F7B6W4B7W5W6W7|
    rank 3 |......F0B0F1B1F2B2F3B3W0F4B4W1F5B5W2F6B6W3F7B7W4W5W6W7|

Each rank idles (P - 1)(f + b - w) beside 1F1B's (P - 1)(f + b + w) (its backward is b + w): a
third when the three cost the same (bubble 11% here against 27%).

ZB-V (`zbv_order`; torch's ScheduleZBVZeroBubble): two chunks per rank placed in a V (steps.py)
-- chunk 0 ("a") is part r going down the ranks, chunk 1 ("b") is part 2P - 1 - r coming back
up -- so rank 0 holds the first part and the last (the loss), and rank P - 1 the two middle
ones, which it hands over in memory. A micro-batch's forward, P = 4:

               rank 0     rank 1     rank 2     rank 3
    chunk 0    part 0 --> part 1 --> part 2 --> part 3
                                                  |  (in memory)
    chunk 1    part 7 <-- part 6 <-- part 5 <-- part 4
               (the loss)

Rank r runs 2(P - r) - 1 forwards of chunk 0, then forwards of both chunks in turn, then chunk 1's
F, B, W until it is steady at F, B, W of each chunk; the W's it holds back fill the cool-down. With
F, B and W of a chunk (half a stage) equal, a rank idles only while micro-batch 0 comes down the V
to it and the last goes back: (P - 1) F, against 1F1B's (P - 1)(2F + 2B + 2W) in these units; each
rank holds at most 2P chunks' activations (half a stage each): 1F1B's peak. It needs M >= 2P - 1.

    rank 0 |F0aF1aF2aF3aF4aF5aF6aF0bB0bW0bF1bB1bW1bF2bB2bW2bF3bB3bW3bF7aB0aW0aF4bB4bW4bB1aW1a...
    rank 3 |.........F0aF0bF1aF1bF2aF2bF3aF3bB0bW0bF4aB0aW0aF4bB1bW1bF5aB1aW1aF5bB2bW2bF6aB2a...

Its messages go both ways between neighbours, so plan.py's batches between rounds could wait on each
other in a ring; `on_time_plan` posts each message at the time its receiver needs it, on the clock
of `earliest_starts` (which simulate.py's timelines also use).
"""
from __future__ import annotations

from .steps import Comm, Compute, PlanError, Step, handed_over, received_by, sent_by, virtual_stage


def zero_bubble_order(P: int, M: int, rank: int) -> list[Compute]:
    """ZB-H1 on pipeline rank `rank` (above): each W `rank` backwards after its B."""
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
    """ZB-V on pipeline rank `rank` (above), counted as if there were at least 2P - 1 micro-batches
    (rank 0's forwards until micro-batch 0 comes back to it), the steps beyond M left out."""
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


def on_time_plan(orders: list[list[Compute]], P: int, V: int, rank: int,
                 v_shape: bool) -> list[Step]:
    """Rank `rank`'s compute steps (`orders`: every rank's) with messages on the clock of
    `earliest_starts` (every step one unit): sender and receiver post a message in the batch at
    the time its receiver starts the step that needs it. Batches at time t wait only on batches
    at t, and those on steps started before t: no ring of ranks waits on itself, whatever the
    order (zbv's sends go both ways; `round_plan`'s batches would deadlock)."""
    last = P * V - 1
    rows = earliest_starts(orders, P, V, v_shape, {"F": 1, "B": 1, "W": 1})
    starts = {(s.kind, virtual_stage(s.chunk, r, P, v_shape), s.mb): start
              for r, row in enumerate(rows) for start, _, s in row}
    at: dict[int, tuple[list, list]] = {}   # time -> (sends, receives) of this rank
    for start, _, step in rows[rank]:
        v = virtual_stage(step.chunk, rank, P, v_shape)
        for t in received_by(step, v, last):
            if not handed_over(t, P, v_shape):
                at.setdefault(start, ([], []))[1].append(t)
        for t in sent_by(step, v, last):
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
    free = [0] * P  # when each rank is next idle
    idx = [0] * P  # each rank's next step
    while any(idx[r] < len(orders[r]) for r in range(P)):
        moved = False
        for r in range(P):
            while idx[r] < len(orders[r]):
                s = orders[r][idx[r]]
                v = virtual_stage(s.chunk, r, P, v_shape)
                if s.kind == "F":  # a forward needs the previous virtual stage's forward
                    dep = ("F", v - 1, s.mb) if v > 0 else None
                elif s.kind == "B":  # the next stage's B, or its own forward on the last
                    dep = ("B", v + 1, s.mb) if v < P * V - 1 else ("F", v, s.mb)
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
