"""Colossal-AI's gradient handlers: synchronise gradients in one pass *after* backward.

    gradient_handler = [dict(type='DataParallelGradientHandler')]     # in the config

selects this instead of the overlapped DistributedDataParallel (ddp.py). The result is the
same -- every replica ends with the gradients averaged over its gradient group (data x sequence
ranks) -- but nothing overlaps: the step takes backward time + communication time, where DDP
hides most of the communication behind backward (README: measured difference). It is simpler,
and it is what Colossal-AI's engine does after `engine.backward`:

    for each dtype: flatten all gradients -> divide by the group size -> one all-reduce -> copy back

(dividing first, as DDP does: under fp16 loss scaling each rank's scaled gradient may fit where
their sum overflows.) As in DDP, every trainable parameter takes part, with zeros where this rank
has no gradient and one flag per parameter: one no rank computed a gradient for keeps grad=None,
as in one process (zeros would let weight decay and momentum move it). Parameters and buffers
are broadcast from the group's first rank at the start, so the replicas start equal.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .checks import check_still_frozen
from .collectives import broadcast_coalesced, by_dtype
from .context import gpc
from .extensions import Extension


@torch.no_grad()
def sum_gradients(params: list[nn.Parameter], group: Optional[dist.ProcessGroup],
                  divisor: int) -> None:
    """grad = (sum over `group` of grad) / divisor, one all-reduce per dtype, with the flags."""
    for same in by_dtype(params).values():
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in same]
        had = torch.tensor([p.grad is not None for p in same]).to(same[0])  # its dtype, device
        flat = torch.cat([_flatten_dense_tensors(grads) / divisor, had])
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(flat, group=group)
        n = flat.numel() - len(same)
        summed = _unflatten_dense_tensors(flat[:n], grads)
        for p, synced, anyone in zip(same, summed, flat[n:].tolist()):
            if not anyone:  # no rank has a gradient: leave None, as one process would
                continue
            if p.grad is None:
                p.grad = synced.clone()
            else:
                p.grad.copy_(synced)


class DataParallelGradientHandler(Extension):
    """Average the gradients of `model` over the gradient group after the last backward of each
    accumulation group (extensions.py: end_group); broadcasts the parameters once, as DDP does."""

    def __init__(self, model: nn.Module, group: Optional[dist.ProcessGroup] = None) -> None:
        self.model = model
        self.group = group if group is not None else gpc.gradient_group
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.frozen = [p for p in model.parameters() if not p.requires_grad]
        broadcast_coalesced(list(model.parameters()) + list(model.buffers()),
                             dist.get_global_rank(self.group, 0), self.group)

    def handle_gradient(self) -> None:
        check_still_frozen(self.model, self.frozen, "DataParallelGradientHandler")
        sum_gradients(self.params, self.group, dist.get_world_size(self.group))

    def end_group(self) -> None:
        self.handle_gradient()
