"""ZeRO level 3's storage: each unit's parameters kept as this rank's shard only, whole only
while gathered (sharded_model.py decides when).

The layout is levels 1-2's (optimizer.py: padded flat buffers, rank r steps the r-th shard),
cut once more by *unit* (sharded_model.py: e.g. one block of a ModuleList); what changes is who
holds it:

    between uses    local = my shard (a copy, ceil(numel/N) elements), the only one I keep;
                    the full buffer's storage is resized to 0 bytes, and every parameter points at
                    one shared NaN element (right shape, stride 0): shapes stay readable
                    (checkpoint layouts, optimizer state_dict), and a stray read (outside the
                    forward) gives NaN gradients, which the step refuses by name
    gather()        storage back to full size, all-gather every rank's `local` into it, and the
                    parameters become views of it again (async_op: a prefetch; wait() before use)
    free()          storage to 0 bytes, parameters back to the NaN placeholder

Resizing the storage (not dropping the tensor) matters: autograd may have saved views of a parameter
in forward (Linear saves weight.t()), and the re-gather before backward refills what they read. The
optimizer's segments are views of `local`: the step updates the shard in place, and the next forward
gathers the new values.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from .comm import gather_shards
from .optimizer import FlatBuffer, ShardedOptimizer
from .optimizer_checks import refuse_non_finite


@functools.cache
def placeholder(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The single NaN element every freed parameter of this dtype and device points at."""
    return torch.full((), math.nan, dtype=dtype, device=device)


class ShardedFlatBuffer(FlatBuffer):
    """A FlatBuffer whose full tensor exists only between gather() and free()."""

    def __init__(self, params: list[nn.Parameter], indices: list[int], size: int,
                 rank: int) -> None:
        super().__init__(params, indices, size, rank)  # full buffer, parameters as views of it
        self.size, self.rank, self.gathered = size, rank, True
        self.works: list = []  # a prefetch's transfers in flight
        begin = rank * self.shard
        self.local = self.data[begin: begin + self.shard].clone()  # my shard, kept
        self.nbytes = self.data.untyped_storage().nbytes()
        where = dict(zip(indices, self.offsets))
        for s in self.segments:  # the optimizer steps segments of `local`, not of `data`
            at = where[s.index] + s.lo - begin
            s.param = nn.Parameter(self.local[at: at + s.hi - s.lo])
        self.free()

    def gather(self, group: Optional[dist.ProcessGroup], async_op: bool = False) -> None:
        """async_op (a prefetch): start the transfer; wait() before the parameters are read."""
        if self.gathered:
            return
        self.data.untyped_storage().resize_(self.nbytes)
        if self.size > 1:
            self.works = gather_shards(self.data, self.local, group, async_op)
        else:
            self.data.copy_(self.local)
        for p, offset in zip(self.params, self.offsets):
            p.data = self.data[offset: offset + p.numel()].view(p.shape)
        self.gathered = True

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.works = []

    def free(self) -> None:
        if not self.gathered:
            return
        self.wait()  # (a prefetch nobody used: its transfer still writes into the storage)
        nan = placeholder(self.data.dtype, self.data.device)
        for p in self.params:
            p.data = nan.expand(p.shape)
        self.data.untyped_storage().resize_(0)
        self.gathered = False


class ParamShardedOptimizer(ShardedOptimizer):
    """Level 3: the level 1-2 optimizer with one flat buffer per (unit, param group, dtype, device),
    each keeping only my shard between uses; `unit_of[id(p)]`: p's unit index."""

    buffer_class = ShardedFlatBuffer
    before_step = None  # ShardedModel's: the unit order checked, the call counts forgotten

    def step(self) -> bool:
        if self.before_step is not None:
            self.before_step()
        # a stray read of a freed parameter gives NaN. AMP already checks (and skips such a
        # step with a warning, as one process would); without AMP, the step refuses it
        if not self.check_finite:
            refuse_non_finite(self)  # (optimizer_checks.py)
        return super().step()

    def _kind(self, p: nn.Parameter) -> tuple:
        return (self.unit_of[id(p)], p.dtype, p.device)

    def buffers_of(self, unit: int) -> list[ShardedFlatBuffer]:
        return [b for b in self.buffers if self.unit_of[id(b.params[0])] == unit]
