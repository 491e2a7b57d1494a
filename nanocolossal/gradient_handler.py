"""Colossal-AI's gradient handlers: synchronise gradients in one pass *after* backward.

    gradient_handler = [dict(type='DataParallelGradientHandler')]     # in the config

selects this instead of the overlapped DistributedDataParallel (ddp.py). The result is the
same -- every replica ends with the gradients averaged over its data-parallel group -- but
the all-reduce starts only when backward has finished, so nothing overlaps: the step takes
backward time + communication time, where DDP hides most of the communication behind
backward (README: measured difference). It is simpler, and it is what Colossal-AI's
engine does after `engine.backward`:

    for each dtype: flatten all gradients -> one all-reduce -> divide by the group size -> copy back

Every trainable parameter takes part (a parameter that got no gradient here contributes
zeros, so all ranks send the same message) and so gets a gradient, zeros where no rank
computed one. Parameters and buffers are broadcast from the group's first rank at the
start, as DDP does, so the replicas start equal.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .context import gpc
from .ddp import _coalesced_broadcast

HANDLERS = ("DataParallelGradientHandler",)


class DataParallelGradientHandler:
    """All-reduce (average) the gradients of `model` over the data-parallel group, after
    backward."""

    def __init__(self, model: nn.Module, group: Optional[dist.ProcessGroup] = None) -> None:
        self.group = group if group is not None else gpc.data_group
        self.size = dist.get_world_size(self.group)
        self.params = [p for p in model.parameters() if p.requires_grad]
        _coalesced_broadcast(list(model.parameters()) + list(model.buffers()),
                             dist.get_global_rank(self.group, 0), self.group)

    @torch.no_grad()
    def handle_gradient(self) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self.params:
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=self.group)
            flat /= self.size
            for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(synced)
