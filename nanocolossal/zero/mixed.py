"""ZeRO levels 1-3 with AMP O2: half model parameters, fp32 master weights only for my shard --
the ZeRO paper's mixed-precision Adam.

One process under O2 (amp.py) keeps a half model, and, for the optimizer, an fp32 master copy
of every half parameter plus Adam's two fp32 states: 2 + 2 + (4 + 8) bytes per parameter. Here
the half parameters are flattened into half flat buffers exactly as optimizer.py flattens fp32
ones, and each rank makes fp32 masters only of the segments in its shard:

                    rank 0            rank 1           ...  rank N-1
    half params     [ whole model ]   [ whole model ]       [ whole model ]     2 Psi
    half grads      level 1: all (DDP's average); level 2: my shard only        2 Psi | 2 Psi/N
    fp32 masters    [ shard 0 ]       [ shard 1 ]           [ shard N-1 ]       4 Psi/N
    Adam states     [ shard 0 ]       [ shard 1 ]           [ shard N-1 ]       8 Psi/N

    backward  half gradients (x loss scale S) averaged by DDP (level 1) or all-reduced in
              buckets, my shard's half segments kept (level 2, gradients.py)
    unscale   my half segments -> fp32 master gradients, x 1/S, inf/nan check all-reduced (MAX)
              over the whole job: an overflow on any rank skips the step everywhere
    step      the inner optimizer steps my fp32 master segments; each is copied (rounded) into
              its half segment of the flat buffer; one all-gather gives everyone the new model

Memory per rank after backward, before the step (bytes; parameters kept in fp32 -- O2's
normalisation layers -- count 4 + 4 + 8/N as optimizer.py's fp32 table):
    level 1   2 Psi + 2 Psi      + 12 Psi/N    (+ DDP's persistent half buckets, 2 Psi)
    level 2   2 Psi + 2 Psi/N    + 12 Psi/N    (a half gradient shard; during unscale and the
              step it becomes an fp32 shard, 4 Psi/N, and the half one is freed)
    level 3   2 Psi/N + 2 Psi/N  + 12 Psi/N    (the half parameters too: each unit's half
              shard is gathered for its forward and backward, sharded_model.py; the step rounds
              my masters into my half shard, and the next gather sends them)
"Shard" is ceil(Psi/N) elements on all ranks but the last ones (padding holds no master).

The loss scale, overflow skipping and clipping are MixedPrecisionOptimizer's, run on the
shard: each gradient element is in exactly one shard, so the norm's squares add up once.

Checkpoints: state_dict() returns what one process's O2 MixedPrecisionOptimizer returns -- the
plain optimizer state and "masters", one whole fp32 tensor per half parameter in its order --
gathered from every rank's segments; load_state_dict() keeps mine: any data size, or one
process's O2. O3 (half parameters, no masters: nothing fp32 to shard) is refused (settings.py).

Before a launch, `nanocolossal plan` computes these bytes (nanocolossal/plan/formulas.py).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..amp import MixedPrecisionOptimizer
from ..amp_scaler import unscale_grads
from .offload import Offload
from .optimizer import FlatBuffer, ShardedOptimizer
from .sharded_params import ParamShardedOptimizer
from .state import saved_master


def attach_masters(buffer: FlatBuffer, offload: Optional[Offload] = None) -> None:
    """Half segments are stepped through fp32 masters: segment.param becomes the master the inner
    optimizer updates, segment.view the model's segment it is copied into. With offload every
    segment has one, on the CPU (offload.py)."""
    half = buffer.data.dtype in (torch.float16, torch.bfloat16)
    for s in buffer.segments:
        s.view = s.param if half or offload else None  # an fp32 segment is its own master
        if offload is not None:
            s.param = offload.master(s.view)
        elif half:
            s.param = nn.Parameter(s.view.detach().float())


class MixedShardedOptimizer(ShardedOptimizer):
    """ZeRO level 1/2 around an O2 MixedPrecisionOptimizer: masters for my shard only. With
    `offload` (any precision) every segment has a master, on the CPU (offload.py)."""

    def __init__(self, mixed: MixedPrecisionOptimizer, model: nn.Module, level: int,
                 group: Optional[dist.ProcessGroup] = None,
                 unit_of: Optional[dict[int, int]] = None,
                 offload: Optional[Offload] = None) -> None:
        self.offload = offload
        mixed.drop_masters()  # each rank makes its shard's instead (attach_masters)
        super().__init__(mixed, model, level, group, unit_of)
        # MixedPrecisionOptimizer's (model, master) pairs become (half segment, fp32 segment):
        # its unscale_ reads the half gradients, its step copies the masters back
        self._master_pairs = [(s.view, s.param) for s in self._mastered()]
        self.follow_loads(model)

    def make_buffer(self, params: list[nn.Parameter], indices: list[int]) -> FlatBuffer:
        buffer = super().make_buffer(params, indices)
        attach_masters(buffer, self.offload)
        return buffer

    def _mastered(self) -> list:
        return [s for b in self.buffers for s in b.segments if s.view is not None]

    def _halves(self) -> list:
        """The segments one process's O2 keeps masters of (offload also masters fp32 ones)."""
        return [s for s in self._mastered() if s.view.dtype != s.param.dtype]

    def grad_target(self, s: Any) -> nn.Parameter:  # gradients onto the model's segments
        return s.param if s.view is None else s.view

    def _grads_to_masters(self) -> None:
        if self.offload is None:
            return super()._grads_to_masters()
        self.offload.copy_out(self._master_pairs)

    def _unscale_and_check(self) -> torch.Tensor:
        """Offload: unscale and check where the gradients are -- one fused pass on the device,
        not a slow one on the CPU -- then copy them out. Half gradients with a loss scale keep
        the CPU path (unscaled there in fp32, as without offload)."""
        if self.offload is None or not self.check_finite:
            return super()._unscale_and_check()
        pairs = [(v, m) for v, m in self._master_pairs if v.grad is not None]
        as_masters = all(v.grad.dtype == m.dtype for v, m in pairs)
        if not pairs or not (as_masters or self.backward_scale == 1.0):
            return super()._unscale_and_check()
        found = unscale_grads([v.grad for v, _ in pairs], self.backward_scale)
        self._grads_to_masters()  # the copy-out
        return found

    def _masters_to_model(self) -> None:
        if self.offload is None:
            return super()._masters_to_model()
        self.offload.copy_in(self._master_pairs)

    def overflow_flag(self) -> torch.Tensor:
        found = super().overflow_flag()  # (level 1 collects first) half -> fp32 master gradients
        if self.offload is not None and found.device != self.offload.device:
            # offload: the optimizer and clipping run on the CPU, so the flag they read lives
            # there -- read once, blocking (a fused CPU optimizer's own non_blocking copy of a
            # device flag could run before the copy lands)
            found = self._flag = found.to(self.offload.device)
        for view, _ in self._master_pairs:  # the fp32 shard replaces the model's
            view.grad = None
        return found

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for view, _ in self._master_pairs:
            view.grad = None

    def master_bytes(self) -> int:
        """Bytes of fp32 masters this rank holds (live tensors)."""
        return sum(m.numel() * m.element_size() for _, m in self._master_pairs)

    # -- checkpoints: one process's O2 layout (state.py) --------------------------------------
    def half_indices(self) -> list[int]:
        """Indices of the parameters one process's O2 keeps masters for, in its order."""
        return [i for i, p in enumerate(self.model_params)
                if p.dtype in (torch.float16, torch.bfloat16)]

    def master_segments(self) -> list:
        return [(s.index, s.lo, s.hi, s.param.detach().cpu()) for s in self._halves()]

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self._loaded = False  # the masters come from `state`, below
        with torch.no_grad():
            for s in self._mastered():
                master = saved_master(state, self, s)
                if master is not None:
                    s.param.copy_(master)
                    s.view.copy_(s.param)
                else:  # saved without O2, or an fp32 segment: masters of the loaded model
                    s.param.copy_(s.view)


class MixedParamShardedOptimizer(MixedShardedOptimizer, ParamShardedOptimizer):
    """ZeRO level 3 around an O2 MixedPrecisionOptimizer: half parameters sharded by unit, fp32
    masters for my shard only -- the paper's (2 + 2 + 12) Psi / N. (Its buffers keep only my
    shard, sharded_params.py; the masters are of the segments of that shard.)"""
