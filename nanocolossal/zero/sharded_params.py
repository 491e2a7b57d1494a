"""ZeRO level 3's storage: each unit's parameters kept as this rank's shard only, whole only
while gathered (sharded_model.py decides when).

Levels 1-2 (optimizer.py) flatten the parameters of each param group into one padded flat
buffer and the model's parameters are views of it; rank r steps the r-th of N equal shards.
Level 3 keeps exactly that layout, cut once more by *unit* (unit_order.py: a module that runs,
e.g. one block of a ModuleList), and changes who holds the buffer:

    between uses    local = my shard (a copy, ceil(numel/N) elements), the only one I keep;
                    the full buffer's storage is resized to 0 bytes, and every parameter points at
                    one shared NaN element (right shape, stride 0): shapes stay readable
                    (checkpoint layouts, optimizer state_dict), and a stray read (outside the
                    forward) gives NaN gradients, which the step refuses by name
    gather()        storage back to full size, all-gather every rank's `local` into it, and the
                    parameters become views of it again (async_op: a prefetch; wait() before use)
    free()          storage to 0 bytes, parameters back to the NaN placeholder

Resizing the storage (not dropping the tensor) matters: autograd may have saved views of a
parameter in forward (Linear saves weight.t()); they keep pointing at this storage, so the
re-gather before backward refills what they read. The optimizer's segments are views of
`local`, so the step updates the shard in place and nothing is gathered after it: the next
forward gathers the new values.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..context import gpc
from .comm import gather_shards
from .optimizer import FlatBuffer, ShardedOptimizer

_PLACEHOLDERS: dict[tuple, torch.Tensor] = {}  # one NaN element per (dtype, device)


def placeholder(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The single element every freed parameter of this dtype and device points at."""
    key = (dtype, device)
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = torch.full((), math.nan, dtype=dtype, device=device)
    return _PLACEHOLDERS[key]


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

    def keep_my_shard(self) -> None:
        """After the full buffer was written (a loaded state_dict): keep only my shard of it."""
        if self.gathered:  # (a load that brought no parameters gathered nothing)
            self.local.copy_(self.data[self.rank * self.shard: (self.rank + 1) * self.shard])


class ParamShardedOptimizer(ShardedOptimizer):
    """Level 3: the level 1-2 optimizer with one flat buffer per (unit, param group, dtype, device),
    each holding only this rank's shard between uses: ParamShardedOptimizer(mixed, model, 3,
    group, unit_of), `unit_of[id(p)]` p's unit index."""

    buffer_class = ShardedFlatBuffer
    before_step = None  # set by ShardedModel: the unit order checked (a step on shards of
                        # mixed-up units would stick), the forwards' call counts forgotten

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # see step: a stray read of a freed parameter gives NaN. AMP already checks (and skips
        # such a step with a warning, as one process would); without AMP, refuse it here
        self.refuse_non_finite, self.check_finite = not self.check_finite, True

    def step(self) -> bool:
        if self.before_step is not None:
            self.before_step()
        if self.refuse_non_finite and self.unscale_():
            raise self._non_finite()
        return super().step()

    def _non_finite(self) -> RuntimeError:
        """Between uses a parameter points at a NaN element: read outside the model's forward
        (a penalty over model.parameters() in the loop) it turns every gradient NaN. One
        all-reduced flag per step refuses such a step rather than apply it to every shard."""
        names = self.param_names()
        bad = [names[self.index_of[id(p)]][0] for p in self.params()
               if p.grad is not None and not torch.isfinite(p.grad).all()]
        return RuntimeError(
            f"[rank {gpc.rank}] zero level 3: non-finite gradients "
            f"({', '.join(dict.fromkeys(bad[:4])) or 'on another rank'}); the step was not "
            f"taken. Between uses each rank holds only its shard and a parameter reads NaN: "
            f"compute anything that reads parameters (a penalty over model.parameters()) inside "
            f"the model's forward, or use the optimizer's weight_decay; if the training itself "
            f"diverged, lower the learning rate")

    def _kind(self, p: nn.Parameter) -> tuple:
        return (self.unit_of[id(p)], p.dtype, p.device)

    def buffers_of(self, unit: int) -> list[ShardedFlatBuffer]:
        return [b for b in self.buffers if self.unit_of[id(b.params[0])] == unit]

    def param_segments(self) -> list:
        """My shard of each parameter, in the model's dtype (a checkpoint's segments, state.py)."""
        return [(s.index, s.lo, s.hi, self.grad_target(s).detach().cpu().clone())
                for b in self.buffers for s in b.segments]

    def load_state_dict(self, state: dict) -> None:
        """As levels 1-2; a state cut to my segments (load.py) also brings my parameter segments
        (a plain one leaves them to the model's load_state_dict)."""
        super().load_state_dict(state)
        params = state.get("params") or {}
        with torch.no_grad():
            for segment in [s for b in self.buffers for s in b.segments]:
                values = params.get((segment.index, segment.lo, segment.hi))
                if values is not None:
                    self.grad_target(segment).copy_(values)

    def shard_bytes(self) -> int:
        """Bytes of parameters this rank keeps between uses: its shard of every buffer."""
        return sum(b.local.numel() * b.local.element_size() for b in self.buffers)
