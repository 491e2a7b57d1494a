"""Many tensors in one collective: flatten those of one dtype, communicate once, copy back.

A flat buffer has one dtype, so tensors are grouped by dtype first (`by_dtype`); each group is
one message. DDP's buckets, the gradient handlers' all-reduce and the broadcasts that make
replicas start equal (replicas.py) and keep their buffers equal (BatchNorm statistics) all send
flat messages: one large collective costs about what one small one does.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .context import gpc


def by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    """Tensors grouped by dtype (in order): one flat message each, since a flat buffer has one."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups


def broadcast_coalesced(tensors: list[torch.Tensor], src: int, group) -> None:
    """Broadcast many tensors as one flat message per dtype."""
    for group_tensors in by_dtype(tensors).values():
        flat = _flatten_dense_tensors([t.data for t in group_tensors])
        dist.broadcast(flat, src=src, group=group)
        for t, synced in zip(group_tensors, _unflatten_dense_tensors(flat, group_tensors)):
            t.data.copy_(synced)


def broadcast_buffers(module: nn.Module, group: Optional[dist.ProcessGroup] = None) -> None:
    """Give every replica the group's first rank's buffers (BatchNorm statistics)."""
    buffers = list(module.buffers())
    group = group or gpc.gradient_group
    if buffers and dist.get_world_size(group) > 1:
        broadcast_coalesced(buffers, dist.get_global_rank(group, 0), group)
