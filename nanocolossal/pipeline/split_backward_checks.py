"""What the split backward (split_backward.py) cannot see: a recomputation inside a stage.

B and W find the weights by walking autograd's graph from the stage's output. A reentrant checkpoint
(nc.utils.checkpoint, torch's `use_reentrant=True`) is one node in that graph whose weights appear
only when its backward recomputes the block: W never reaches them (the block would not train) and B,
a backward with `inputs=`, cannot run it. torch's non-reentrant checkpoint keeps the block's nodes
in the graph, so the walk sees its weights.
"""
from __future__ import annotations

from typing import Iterable

from torch.autograd.graph import Node

from ..config import ConfigError
from ..context import gpc


def refuse_recomputation(nodes: Iterable[Node]) -> None:
    for node in nodes:
        if getattr(node, "_forward_cls", type).__name__ == "CheckpointFunction":
            raise ConfigError(
                f"[rank {gpc.rank}] the zero-bubble schedules (zero_bubble, zbv) split each "
                f"backward into B and W by walking autograd's graph, where a block checkpointed "
                f"by nc.utils.checkpoint (or torch's reentrant checkpoint) in this stage hides "
                f"its weights; checkpoint it with torch.utils.checkpoint.checkpoint(block, x, "
                f"use_reentrant=False), or use PIPELINE_SCHEDULE='1f1b'")
