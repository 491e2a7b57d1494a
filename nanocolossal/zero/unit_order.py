"""Level 3's one rule, checked: every data rank gathers the same units in the same order.

The ranks' shards meet by order: the k-th all-gather of rank 0 pairs with the k-th of rank 1.
A unit that only some ranks run (a branch taken on rank 0's data alone) breaks the pairing.
Units of different sizes make gloo abort; units of the same size give every rank a parameter
built from two units' shards -- a silently wrong forward, and a wrong step after it. So:

    every step     each rank folds the units it gathered since the last step (prefetches too)
                   into one number, a rolling hash of their indices; before the optimizer steps,
                   one all-reduce of [h, -h] with MAX tells whether every rank has the same h. If
                   not, every rank raises: the wrong values are never applied
    debug=True     the same check before each gather, so the error names the unit at once

A mismatch in a training forward often breaks the pairing of later collectives first (the
backward's gathers and reductions, a prefetch): gloo then aborts on a size difference or waits
out the job's timeout -- loud, not silent. What pairs up by chance is caught at the step, and a
forward after the last step (a final evaluation) is not checked. Cost: one all-reduce of two
integers per step (debug=True: one per gather).
"""
from __future__ import annotations

from collections import deque
from typing import Optional

import torch.distributed as dist

from ..context import gpc
from .comm import same_everywhere

_PRIME = 2**61 - 1  # the hash stays an int64 (an all-reduce's element)


class UnitOrder:
    """The gathers of one ShardedModel since the last step, checked across its data group."""

    def __init__(self, group: Optional[dist.ProcessGroup], debug: bool) -> None:
        self.group, self.debug = group, debug
        self.fingerprint, self.names = 0, deque(maxlen=8)  # (names: the last few, for errors)

    def saw(self, index: int, name: str) -> None:
        """Unit number `index` (named `name`) is about to be gathered."""
        if self.debug and not same_everywhere(index, self.group, gpc.device):
            raise RuntimeError(f"[rank {gpc.rank}] zero level 3: this rank gathers unit {name!r} "
                               f"while another data rank gathers another: every data rank must "
                               f"run the same units (branch inside a unit)")
        self.fingerprint = (self.fingerprint * 1_000_003 + index + 1) % _PRIME
        self.names.append(name)

    def check(self) -> None:
        """Before a step (collective over the data group): the same gathers on every rank?"""
        agreed = same_everywhere(self.fingerprint, self.group, gpc.device)
        names, self.fingerprint = list(self.names), 0
        self.names.clear()
        if not agreed:
            raise RuntimeError(
                f"[rank {gpc.rank}] zero level 3: the data ranks gathered different units since "
                f"the last step (this rank, last: {', '.join(names) or 'none'}), so parameters "
                f"were put together from different units' shards; every data rank must run the "
                f"same units in the same order: move a branch inside a unit (a child module), "
                f"or use zero level 2 (debug=True names the first unit that differs)")
