"""What DDP (ddp.py) checks when it wraps a model (one call from its constructor), and the
error naming a bucket whose all-reduce failed."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch.distributed as dist
from torch import nn

from .checks import check_same_model, peer_failed, ready_twice, refuse_unfreezing
from .context import gpc


def check_ddp(ddp: nn.Module, compress: Optional[str]) -> None:
    """A launched job; a compression we have; the same model on every rank of the group (else
    the buckets would pair different gradients, or hang); and no parameter frozen now is
    unfrozen later (it has no bucket slot: it would never be averaged)."""
    if compress not in (None, "bf16", "fp16"):
        raise ValueError(f"[rank {gpc.rank}] compress must be None, 'bf16' or 'fp16', got "
                         f"{compress!r}")
    if not dist.is_initialized():
        raise RuntimeError("DistributedDataParallel needs a launched job: call "
                           "nanocolossal.launch* first")
    check_same_model(ddp.module, ddp.process_group, "DistributedDataParallel")
    refuse_unfreezing(ddp, ddp.module, lambda: ddp.name)


@contextmanager
def named_failure(ddp: Any, bucket: Any) -> Iterator[None]:
    """A failed all-reduce (a peer stopped) raised as an error naming the bucket and group."""
    try:
        yield
    except RuntimeError as e:
        raise peer_failed(f"DDP gradient all-reduce of bucket {ddp.buckets.index(bucket) + 1} of "
                          f"{len(ddp.buckets)}", ddp.process_group, e) from e


def check_first_gradient(ddp: Any, bucket: Any, i: int) -> None:
    """A parameter's hook fires once a backward: a second gradient would miss its bucket."""
    if bucket.filled[i]:
        raise ready_twice(ddp.module, bucket.params[i], ddp.name, ddp.other_way)
