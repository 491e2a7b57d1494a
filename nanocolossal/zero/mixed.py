"""ZeRO levels 1-3 with AMP O2: half model parameters, fp32 master weights only for my shard --
the ZeRO paper's mixed-precision Adam.

One process under O2 (amp.py) keeps a half model, and, for the optimizer, an fp32 master copy
of every half parameter plus Adam's two fp32 states: 2 + 2 + (4 + 8) bytes per parameter. Here
the half parameters are flattened into half flat buffers exactly as optimizer.py flattens fp32
ones, and each rank makes fp32 masters (4 Psi/N) only of the segments in its shard, beside its
shard of Adam's states (8 Psi/N):

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

O3 (half parameters, no masters: nothing fp32 to shard) is refused (config_checks.py).
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


class MixedShardedOptimizer(ShardedOptimizer):
    """ZeRO level 1/2 around an O2 MixedPrecisionOptimizer: masters for my shard only. With
    `offload` (any precision) every segment has a master, on the CPU (offload.py)."""

    # one process's O2 layout: a master per half parameter (checkpoint/zero.py)
    masters_halves = True

    def __init__(self, mixed: MixedPrecisionOptimizer, model: nn.Module, level: int,
                 group: Optional[dist.ProcessGroup] = None,
                 unit_of: Optional[dict[int, int]] = None,
                 offload: Optional[Offload] = None) -> None:
        self.offload = offload
        mixed.drop_masters()  # each rank makes its shard's instead (make_buffer)
        super().__init__(mixed, model, level, group, unit_of)
        # MixedPrecisionOptimizer's (model, master) pairs become (half segment, fp32 segment):
        # its unscale_ reads the half gradients, its step copies the masters back
        self._master_pairs = [(s.view, s.param) for b in self.buffers for s in b.segments
                              if s.view is not None]
        self.follow_loads(model)

    def make_buffer(self, params: list[nn.Parameter], indices: list[int]) -> FlatBuffer:
        """Half segments are stepped through fp32 masters: segment.param becomes the master the
        inner optimizer updates, segment.view the model's segment it is copied into."""
        buffer = super().make_buffer(params, indices)
        half = buffer.data.dtype in (torch.float16, torch.bfloat16)
        for s in buffer.segments:
            s.view = s.param if half or self.offload else None  # fp32: its own master
            if self.offload is not None:
                s.param = self.offload.master(s.view)
            elif half:
                s.param = nn.Parameter(s.view.detach().float())
        return buffer

    def grad_target(self, s: Any) -> nn.Parameter:  # gradients onto the model's segments
        return s.param if s.view is None else s.view

    def _grads_to_masters(self) -> None:
        if self.offload is None:
            return super()._grads_to_masters()
        self.offload.copy_out(self._master_pairs)

    def _unscale_and_check(self) -> torch.Tensor:
        """Offload: unscale and check on the device in one fused pass, then copy out (offload.py);
        half gradients with a loss scale are unscaled on the CPU, in fp32."""
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
            # the CPU's optimizer and clipping read it there: copied once, blocking (a fused CPU
            # optimizer's own non_blocking copy could run before the flag lands)
            found = self._flag = found.to(self.offload.device)
        for view, _ in self._master_pairs:  # the fp32 shard replaces the model's
            view.grad = None
        return found

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for view, _ in self._master_pairs:
            view.grad = None


class MixedParamShardedOptimizer(MixedShardedOptimizer, ParamShardedOptimizer):
    """ZeRO level 3 around an O2 MixedPrecisionOptimizer: fp32 masters for my shard only."""
