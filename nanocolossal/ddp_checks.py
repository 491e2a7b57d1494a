"""What DDP (ddp.py) checks when it wraps a model: one call from its constructor."""
from __future__ import annotations

from typing import Optional

import torch.distributed as dist
from torch import nn

from .checks import check_same_model, refuse_unfreezing
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
