"""What counted targets refuse (loss_weights.py calls it in one line)."""
from __future__ import annotations

from typing import Optional

import torch

from .context import gpc


def check_group_ended(open_group: bool, differs: Optional[torch.Tensor]) -> None:
    """A group is read after the engine's step ends the one before (or skipped whole, resuming),
    and the group before was trained on the targets read for it (one host read per group)."""
    if open_group:
        raise RuntimeError(
            f"[rank {gpc.rank}] the training loader read the next accumulation group while the "
            f"engine's group was still open: its last batches would weigh by another group's "
            f"counted targets (loss_weights.py). Train each batch of initialize's loader before "
            f"reading the next (a prefetching loader goes inside: pass it to initialize), and "
            f"close an epoch's short last group with engine.close_group() before its last batch")
    if differs is not None and bool(differs):
        raise RuntimeError(
            f"[rank {gpc.rank}] the accumulation group just stepped was weighed by the targets "
            f"read ahead for another group: its losses counted other targets (loss_weights.py). "
            f"Train the batches of initialize's loader in the order it yields them, from one "
            f"iterator (a prefetching loader goes inside: pass it to initialize), and change "
            f"labels (ignore_index) in the dataset or collate_fn, not after the loader")
