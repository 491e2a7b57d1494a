"""ZeRO level 2's gradient path: reduce gradients in buckets while backward runs and keep only
my shard's segments of them, so each rank holds 1/N of the gradients.

DDP (ddp.py) all-reduces buckets and writes every averaged gradient back: each rank ends with
all Psi of them, in persistent buckets on top. Here DDP's machinery is reused -- the buckets,
their fixed launch order, the "used" flags that keep grad=None for a parameter nobody used --
with three changes: a bucket's buffer exists only from its first gradient until its reduction
is done; once a bucket is launched its parameters' .grad are freed; at the end of backward each
rank copies only the segments of the averaged gradients in its shard (receive_grad).

    backward   | grad L4 L3 | grad L2 L1 | grad L0 |
    reduce     |            |  bucket 0  |  bucket 1  | bucket 2 |
    .grad      L4 L3 freed     L2 L1 freed   ...                 ^ keep my shard's segments

With overlap_communication=False the buckets are launched only after backward (every .grad
lives until then; simpler to follow in a trace).

A reduce-scatter is what this needs: each rank receives the sum of only its segments, Psi (N-1)/N
elements sent per rank. But a reduce-scatter hands rank r the r-th N-th of the tensor it is
given, and a bucket -- parameters in backward's order -- does not fall on the shard boundaries
of the flat buffers (cutting it there would wait for the whole backward). So each bucket is
all-reduced (2 Psi (N-1)/N) and each rank keeps its segments. Level 3 shards every unit on its
own and reduce-scatters it (sharded_model.py); FSDP2 shards per unit for level 2 too.

Accumulation: under no_sync() (the Engine's first N-1 micro-steps) nothing is reduced and .grad
accumulates in full, as with DDP; the last micro-step reduces it once.
"""
from __future__ import annotations

from typing import Collection, Optional

import torch
from torch import nn

from ..ddp import DistributedDataParallel, _Bucket
from .optimizer import ShardedOptimizer


class _TransientBucket(_Bucket):
    """A bucket whose buffer is allocated when first needed and dropped after use."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        super().__init__(params)
        self.buffer: Optional[torch.Tensor] = None  # (until the first gradient arrives)

    def allocate(self) -> None:
        if self.buffer is None:  # gradients, then one "used" flag per parameter
            p = self.params[0]
            self.buffer = torch.zeros(self.numel + len(self.params), dtype=p.dtype, device=p.device)


class ShardKeepingDDP(DistributedDataParallel):
    """DDP whose backward leaves each rank only its segments of the averaged gradients."""

    bucket_class = _TransientBucket
    name, other_way = "zero", ""

    def __init__(self, module: nn.Module, optimizer: ShardedOptimizer, bucket_cap_mb: float = 25,
                 overlap_communication: bool = True, broadcast_buffers: bool = True,
                 reduced_elsewhere: Collection[nn.Parameter] = ()) -> None:
        self.sharded_optimizer = optimizer
        self.overlap = overlap_communication
        super().__init__(module, process_group=optimizer.group, bucket_cap_mb=bucket_cap_mb,
                         broadcast_buffers=broadcast_buffers, reduced_elsewhere=reduced_elsewhere)

    def _grad_ready(self, param: nn.Parameter) -> None:
        if self.require_sync:
            self._where[param][0].allocate()
        super()._grad_ready(param)

    def _launch_ready(self) -> None:
        if self.overlap:  # else everything is launched at the end of backward
            super()._launch_ready()

    def _launch(self, bucket: _TransientBucket) -> None:
        bucket.allocate()
        super()._launch(bucket)  # writes every slot (grad / N, or zeros), starts the all-reduce
        for p in bucket.params:  # in the bucket now: the full gradient is not kept
            p.grad = None

    def _finish(self) -> None:
        """End of backward: every bucket reduced, keep my shard's segments, free the buckets."""
        for bucket in self._reduced_buckets():
            used = (bucket.flags() > 0).tolist()  # one read per bucket, not per parameter
            for i, p in enumerate(bucket.params):
                if used[i]:  # (a gradient no rank computed: my segments keep grad=None)
                    self.sharded_optimizer.receive_grad(p, bucket.view(i))
            bucket.buffer = bucket.wire = bucket.work = None
            bucket.filled = [False] * len(bucket.params)
            bucket.ready = 0
