"""What counted targets refuse (loss_weights.py calls it in one line)."""
from __future__ import annotations

from .context import gpc


def check_group_ended(open_group: bool) -> None:
    """A group is read after the engine's step ends the one before (or skipped whole, resuming)."""
    if open_group:
        raise RuntimeError(
            f"[rank {gpc.rank}] the training loader read the next accumulation group while the "
            f"engine's group was still open: its last batches would weigh by another group's "
            f"counted targets (loss_weights.py). Train each batch of initialize's loader before "
            f"reading the next (a prefetching loader goes inside: pass it to initialize), and "
            f"close an epoch's short last group with engine.close_group() before its last batch")
