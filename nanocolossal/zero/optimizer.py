"""ZeRO levels 1 and 2: shard the optimizer state (and, at level 2, the gradients) over the
data-parallel ranks, so no rank holds what another already holds.

Plain data parallelism keeps N identical copies of everything. The optimizer state is the
biggest part (Adam: two fp32 numbers per parameter) and each rank only needs *its* part of it:

                    rank 0          rank 1          ...  rank N-1
    parameters      [ whole model ] [ whole model ]      [ whole model ]
    gradients       [ all (level 1) or shard 0 ] [ all (1) or shard 1 ] ...   (level 2: a shard)
    optimizer state [ shard 0 ]     [ shard 1 ]          [ shard N-1 ]

How: the parameters of each param group (per dtype and device) are copied into one flat buffer,
padded to a multiple of N, and the model's parameters become views of it. Rank r steps only the
segments of parameters in its shard, the r-th of N equal parts (a parameter may straddle two
shards). The inner torch optimizer is built on the segments -- one Parameter each, so a
parameter that got no gradient anywhere keeps grad=None and is skipped as one process skips it.
Only element-wise optimizers can step a segment of a parameter (SGD, Adam, AdamW, RMSprop,
Adagrad; LAMB's norm is refused). After the step, one all-gather per flat buffer.

    level 1: backward -> DDP all-reduce (every rank: all averaged gradients)
             step     -> take my shard of the gradients (views), step it, all-gather parameters
    level 2: backward -> all-reduce in buckets (gradients.py): I keep only my shard
             step     -> step my shard, all-gather the parameters

Memory per rank, Psi parameters, N ranks (bytes; the ZeRO paper's mixed-precision Adam in
brackets, whose K=12 is fp32 masters + two fp32 states):
    plain data parallel   4 Psi params + 4 Psi grads + 8 Psi Adam states   [(2+2+12) Psi]
    level 1               4 Psi + 4 Psi + 8 Psi/N                          [4 Psi + 12 Psi/N]
    level 2               4 Psi + 4 Psi/N + 8 Psi/N                        [2 Psi + 14 Psi/N]
(level 1 here also keeps DDP's buckets, another 4 Psi; level 2's buckets are transient.) The
optimizer state a rank holds is exactly 8 bytes x the elements of its shard that are parameters
(padding is never stepped): ceil(Psi/N) on every rank but the last ones.

Traffic per step, per rank (elements): DDP's all-reduce is a reduce-scatter + an all-gather,
2 Psi (N-1)/N. Level 1 adds an all-gather of the parameters: 3 Psi (N-1)/N. So does level 2: its
buckets do not fall on shard boundaries, so it all-reduces them (gradients.py says why). Level 3
reduce-scatters each unit's gradients (sharded_model.py; gloo all-reduces: zero/comm.py).

With a pipeline or tensor parallelism, "the data-parallel ranks" are those holding the same
stage and tensor slice (gpc.gradient_group): each shards what it holds (ZeRO cuts my tensor slice
further). Clipping adds every rank's shard squares over that group, then the stages' and tensor
ranks' sums. A weight two stages share (pipeline/tied.py) sums both stages' gradients: tied.py.

fp16: the scaler's overflow check is agreed job-wide (amp.py). AMP O1 keeps fp32 parameters; O2
(half parameters, fp32 masters) shards the masters too: mixed.py, the paper's formulas. Before a
launch, `nanocolossal plan` computes these bytes (nanocolossal/plan/formulas.py).
"""
from __future__ import annotations

import inspect
import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..amp import MixedPrecisionOptimizer
from ..checkpoint.zero import ShardedState
from ..context import gpc
from .comm import gather_shards
from .optimizer_checks import check_optimizer, refuse_new_parameters


class Segment:
    """The segment [lo, hi) of parameter `index` (flattened) that this rank steps: a view of the
    flat buffer wrapped as the Parameter the inner optimizer updates."""

    def __init__(self, index: int, lo: int, hi: int, param: nn.Parameter) -> None:
        self.index, self.lo, self.hi, self.param = index, lo, hi, param
        # the model's own view of the segment where `param` is a master apart from it (O2,
        # offload: mixed.py); None where the segment is its own master
        self.view: Optional[nn.Parameter] = None


class FlatBuffer:
    """Some parameters (one group, dtype, device) as one flat tensor in N equal shards."""

    def __init__(self, params: list[nn.Parameter], indices: list[int], size: int,
                 rank: int) -> None:
        self.params, self.indices = params, indices
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]
        self.numel = sum(self.numels)
        self.shard = math.ceil(self.numel / size)  # padded: N shards of equal size
        self.data = torch.zeros(self.shard * size, dtype=params[0].dtype, device=params[0].device)
        for p, at, n in zip(params, self.offsets, self.numels):
            self.data[at: at + n].copy_(p.detach().reshape(-1))
            p.data = self.data[at: at + n].view_as(p)  # the parameter now lives in the buffer
        at = dict(zip(indices, self.offsets))
        self.segments = [Segment(i, lo, hi, nn.Parameter(self.data[at[i] + lo: at[i] + hi]))
                         for i, lo, hi in self.shard_segments(rank)]

    def shard_segments(self, rank: int) -> list[tuple[int, int, int]]:
        """(index, lo, hi): the segments [lo, hi) of parameters (flattened) in shard `rank`."""
        begin, end = rank * self.shard, (rank + 1) * self.shard
        segments = []
        for index, at, n in zip(self.indices, self.offsets, self.numels):
            lo, hi = max(begin, at), min(end, at + n)
            if lo < hi:  # a segment of this parameter lies in the shard
                segments.append((index, lo - at, hi - at))
        return segments


def _same_optimizer(optimizer: torch.optim.Optimizer, groups: list[dict]) -> torch.optim.Optimizer:
    """A new optimizer of the same type and settings over `groups`."""
    accepted = inspect.signature(type(optimizer)).parameters
    return type(optimizer)(groups, **{k: v for k, v in optimizer.defaults.items() if k in accepted})


class ShardedOptimizer(ShardedState, MixedPrecisionOptimizer):
    """ZeRO level 1/2 around the optimizer `initialize` built: same calls, sharded state. `mixed`:
    AMP's wrapper (loss scaler, overflow check); `group`: the ranks holding the same parameters
    (gpc.gradient_group: data x sequence ranks)."""

    buffer_class = FlatBuffer  # level 3 (sharded_params.py): one that keeps only my shard

    def __init__(self, mixed: MixedPrecisionOptimizer, model: nn.Module, level: int,
                 group: Optional[dist.ProcessGroup] = None,
                 unit_of: Optional[dict[int, int]] = None) -> None:
        optimizer = mixed.optimizer
        check_optimizer(optimizer, mixed, model)
        self.model, self.level = model, level
        self.unit_of = unit_of or {}  # level 3: id(param) -> its unit (sharded_model.py)
        self.group = group if group is not None else gpc.gradient_group
        self.size = dist.get_world_size(self.group) if self.group is not None else 1
        self.rank = dist.get_rank(self.group) if self.group is not None else 0
        self.user, self.user_groups = optimizer, optimizer.param_groups
        self.model_params = [p for g in optimizer.param_groups for p in g["params"]]
        self.shapes = [p.shape for p in self.model_params]  # (level 3 frees the parameters)
        self.buffers: list[FlatBuffer] = []
        groups, start = [], 0
        for g in optimizer.param_groups:
            segments: list[Segment] = []
            kinds: dict[tuple, list[int]] = {}  # one flat buffer per (dtype, device) in a group
            for i, p in enumerate(g["params"]):
                kinds.setdefault(self._kind(p), []).append(start + i)
            for indices in kinds.values():
                buffer = self.make_buffer([self.model_params[i] for i in indices], indices)
                self.buffers.append(buffer)
                segments += buffer.segments
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": [s.param for s in segments]})
            start += len(g["params"])
        self.segments_of: dict[nn.Parameter, list[Segment]] = {p: [] for p in self.model_params}
        self.index_of: dict[int, int] = {}  # id(segment parameter) -> its model parameter
        for buffer in self.buffers:
            for s in buffer.segments:
                self.segments_of[self.model_params[s.index]].append(s)
                self.index_of[id(s.param)] = s.index
        super().__init__(_same_optimizer(optimizer, groups), mixed.scaler,
                         check_finite=mixed.check_finite)

    def make_buffer(self, params: list[nn.Parameter], indices: list[int]) -> FlatBuffer:
        """One flat buffer and my segments of it (mixed.py gives them masters)."""
        return self.buffer_class(params, indices, self.size, self.rank)

    def _kind(self, p: nn.Parameter) -> tuple:
        """Parameters of one param group with the same kind share a flat buffer."""
        return (p.dtype, p.device)

    def grad_target(self, s: Segment) -> nn.Parameter:
        """Where the gradient of segment `s` arrives (under O2, mixed.py: its half view)."""
        return s.param

    def receive_grad(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        """Level 2: add my segments of `param`'s averaged gradient (a transient bucket slot) to
        what earlier backwards of this step left there, as .grad accumulates in one process."""
        for s in self.segments_of[param]:
            target, averaged = self.grad_target(s), grad.reshape(-1)[s.lo:s.hi]
            target.grad = averaged.clone() if target.grad is None else target.grad.add_(averaged)

    def _collect_grads(self) -> None:
        """Level 1: my segments of the gradients DDP averaged (views: no copy). A parameter no
        rank computed a gradient for has none, so its segments have none either."""
        for p, segments in self.segments_of.items():
            for s in segments:
                self.grad_target(s).grad = None if p.grad is None else p.grad.reshape(-1)[s.lo:s.hi]

    def overflow_flag(self) -> torch.Tensor:
        if self.level == 1 and self._flag is None:
            self._collect_grads()
        return super().overflow_flag()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.model_params:  # the full gradients too (level 1: DDP's averages)
            p.grad = None
        self.optimizer.zero_grad(set_to_none=True)

    def holders(self, param: nn.Parameter) -> int:
        return super().holders(self.model_params[self.index_of[id(param)]])  # a segment's origin

    def clip_grad_norm_(self, max_norm: float,
                        group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
        """All gradients' norm: my shard's squares summed over the gradient group (data x
        sequence ranks, `self.group`), then over `group`."""
        mine = {id(p): 1.0 for p in self.params()}  # every segment is split over self.group
        return super().clip_grad_norm_(max_norm, group, split_over=(mine, self.group))

    @property
    def param_groups(self) -> list[dict]:
        """The user's groups, over the model's parameters: an LR scheduler (built before
        initialize or after) changes lr there, and each step passes it on to my segments'."""
        return self.user_groups

    def step(self) -> bool:
        refuse_new_parameters(self.model, self.segments_of)  # added after initialize?
        for user, inner in zip(self.user_groups, self.optimizer.param_groups):
            inner.update({k: v for k, v in user.items() if k != "params"})
        stepped = super().step()  # unscale, agreed overflow check, step my segments
        self.user._opt_called = True  # torch's schedulers watch the user's step(), not ours
        # a skipped step changed nothing anywhere: no gather; level 3 gathers before each use
        if stepped and self.size > 1 and self.level < 3:
            for buffer in self.buffers:  # everyone's updated shard into everyone's buffer
                gather_shards(buffer.data, buffer.data.chunk(self.size)[self.rank], self.group)
        return stepped
