"""What activation checkpointing (activation_checkpoint.py) refuses or says: a backward that would
miss the recomputation's gradients, a config key with nothing to recompute (the key's values:
config_checks.py)."""
from __future__ import annotations

import torch

from .context import gpc
from .logging import get_dist_logger


def check_backward() -> None:
    """The recomputation's parameter gradients land in .grad: only loss.backward() reads them."""
    if not torch.autograd._is_checkpoint_valid():
        raise RuntimeError(f"[rank {gpc.rank}] activation checkpointing recomputes in a backward "
                           f"of its own, whose parameter gradients land in .grad: "
                           f"torch.autograd.grad(...) and backward(inputs=...) would miss them; "
                           f"call loss.backward(), or use torch.utils.checkpoint(..., "
                           f"use_reentrant=False)")


def warn_if_nothing_recomputes(model: torch.nn.Module) -> None:
    """ACTIVATION_CHECKPOINT is read by nc.nn's transformer Blocks (block_mode, which sets their
    `recompute`); a model built of other blocks would train with nothing recomputed: say so."""
    mode = gpc.config.get("ACTIVATION_CHECKPOINT")
    if mode and not any(hasattr(m, "recompute") for m in model.modules()):
        where = "this pipeline stage holds" if gpc.pipeline_size > 1 else "this model has"
        get_dist_logger().warning(
            f"[rank {gpc.rank}] ACTIVATION_CHECKPOINT={mode!r} recomputes nanocolossal.nn's "
            f"transformer Blocks, and {where} none: nothing is checkpointed here; where the "
            f"blocks are your own, build them as nc.nn.transformer.Block, or call "
            f"nc.utils.checkpoint(block, x) in the model's forward")
