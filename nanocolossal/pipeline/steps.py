"""What a pipeline plan is made of: the steps a rank runs, and which rank holds which part.

The model is cut into P * V parts ("virtual stages"); rank r holds chunks c = 0..V-1, and chunk c is
part v = c * P + r -- looping down the ranks -- or, in a V (zbv), the odd chunks come back up:
chunk 1 of rank r is part 2P - 1 - r, so parts P - 1 and P share rank P - 1. (P = 4, V = 2:)

    looping (interleaved)       in a V (zbv)
    rank 0 | part 0, part 4     rank 0 | part 0, part 7
    rank 1 | part 1, part 5     rank 1 | part 1, part 6
    rank 2 | part 2, part 6     rank 2 | part 2, part 5
    rank 3 | part 3, part 7     rank 3 | part 3, part 4

A batch is cut into M micro-batches. A plan is a list of steps: compute steps -- forward F(c, m),
backward B(c, m), and where the backward is split (zero_bubble.py) the weights' gradient W(c, m) --
and communication batches (sends and receives posted together, so two neighbours sending to each
other at once cannot deadlock). A forward receives its part's input activation and sends its output
on; a backward receives its output's gradient and sends its input's back; a message between two
parts on one rank is handed over in memory.
"""
from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class Compute:
    kind: str   # "F", "B" or "W" (zero-bubble plans: B is the input's gradient, W the weights')
    chunk: int
    mb: int


@dataclass(frozen=True, order=True)
class Transfer:
    """One message: `what` ("act" forward, "grad" backward) of micro-batch `mb`, part src to dst."""
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


def virtual_stage(chunk: int, rank: int, P: int, v_shape: bool = False) -> int:
    """Which of the P * V model parts chunk `chunk` of pipeline rank `rank` is (see above)."""
    return (chunk + 1) * P - 1 - rank if v_shape and chunk % 2 else chunk * P + rank


def stage_rank(v: int, P: int, v_shape: bool = False) -> int:
    """The pipeline rank that holds part v (virtual_stage's inverse)."""
    chunk, r = divmod(v, P)
    return P - 1 - r if v_shape and chunk % 2 else r


def uniform_sizes(n: int, parts: int) -> list[int]:
    """partition='uniform': n layers into parts, the first n % parts one layer longer."""
    return [n // parts + (1 if k < n % parts else 0) for k in range(parts)]


def handed_over(t: Transfer, P: int, v_shape: bool) -> bool:
    """Whether transfer t stays on one rank (zbv's parts P - 1 and P): handed over in memory."""
    return stage_rank(t.src, P, v_shape) == stage_rank(t.dst, P, v_shape)


def v_shaped(schedule: str) -> bool:
    """Whether `schedule` places its chunks in a V (zbv) rather than looping (interleaved)."""
    return schedule == "zbv"


def received_by(step: Compute, v: int, last: int) -> list[Transfer]:
    """What step `step` of part v receives: F its input, B its output's gradient (W: none)."""
    if step.kind == "F" and v > 0:
        return [Transfer("act", v - 1, v, step.mb)]
    if step.kind == "B" and v < last:
        return [Transfer("grad", v + 1, v, step.mb)]
    return []


def sent_by(step: Compute, v: int, last: int) -> list[Transfer]:
    """What step `step` of part v sends on: F its output, B its input's gradient."""
    if step.kind == "F" and v < last:
        return [Transfer("act", v, v + 1, step.mb)]
    if step.kind == "B" and v > 0:
        return [Transfer("grad", v, v - 1, step.mb)]
    return []


def chunk_name(chunk: int, V: int) -> str:
    """A step label's chunk: none for V = 1, a, b, ... up to 26 chunks, else .0, .1, ..."""
    if V == 1:
        return ""
    return string.ascii_lowercase[chunk] if V <= len(string.ascii_lowercase) else f".{chunk}"


def step_label(step: Compute, V: int) -> str:
    """"F3" / "B3", or "F3b" for chunk 1 of an interleaved schedule."""
    return f"{step.kind}{step.mb}{chunk_name(step.chunk, V)}"
