"""A weight two pipeline stages share (pipeline/tied.py), when ZeRO holds its gradient in shards.

Without ZeRO, or at level 1, the stages all-reduce the whole gradient (pipeline/tied.py). At
levels 2-3 the data ranks of a stage hold disjoint segments of it, which the stages' shards need
not cut alike. So each rank writes its segments into a whole-sized buffer (zeros elsewhere), the
data ranks sum it into the whole, the stages sum it across, and each rank keeps its segments. One
extra element counts the segments that had a gradient: none anywhere keeps grad=None.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..pipeline.tied import Tied
from .optimizer import ShardedOptimizer


def sum_sharded_tied_gradients(optimizer: ShardedOptimizer, tied: Tied) -> None:
    """Each tied weight steps with the sum of its stages' gradients, kept as my segments."""
    for param, group in tied:
        segments = optimizer.segments_of.get(param, [])  # none: this optimizer does not step it
        whole = torch.zeros(param.numel() + 1, dtype=param.dtype, device=param.device)
        for s in segments:
            if optimizer.grad_target(s).grad is not None:
                whole[s.lo:s.hi] = optimizer.grad_target(s).grad
                whole[-1] = 1
        if dist.get_world_size(optimizer.group) > 1:  # the data ranks' segments: the whole
            dist.all_reduce(whole, group=optimizer.group)
        dist.all_reduce(whole, group=group)            # the stages' wholes: the sum
        for s in segments:
            optimizer.grad_target(s).grad = whole[s.lo:s.hi].clone() if whole[-1] else None
