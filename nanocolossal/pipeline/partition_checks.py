"""build_pipeline_model's refusals (partition.py calls `check_partition` by one line): a model
that is not an nn.Sequential, too few layers, a partition that cannot be cut."""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..context import gpc


def check_partition(layers: Any, parts: int, partition: Any,
                    sample_input: Optional[torch.Tensor]) -> None:
    if not isinstance(layers, nn.Sequential):
        raise TypeError(f"[rank {gpc.rank}] build_pipeline_model needs an "
                        f"nn.Sequential (got {type(layers).__name__}); write "
                        "the model as nn.Sequential(stem, block1, ..., head)")
    n = len(layers)
    if n < parts:
        raise ValueError(f"[rank {gpc.rank}] the model has {n} layers but the pipeline needs "
                         f"{parts} parts (pipeline size x NUM_CHUNKS); use fewer stages/chunks or "
                         f"split the model into more layers")
    if not isinstance(partition, str):
        sizes = list(partition)
        counts = all(isinstance(s, int) and s >= 1 for s in sizes)
        if len(sizes) != parts or not counts or sum(sizes) != n:
            raise ValueError(f"[rank {gpc.rank}] partition {sizes} must be {parts} positive layer "
                             f"counts summing to {n}, the number of layers")
    elif partition not in ("uniform", "parameters", "profile"):
        raise ValueError(f"[rank {gpc.rank}] unknown partition {partition!r}; use 'uniform', "
                         f"'parameters', 'profile' or a list of layer counts")
    elif partition == "profile" and sample_input is None:
        raise ValueError(f"[rank {gpc.rank}] partition='profile' "
                         "needs sample_input=<one input batch>")
