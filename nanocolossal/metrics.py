"""Metrics over data-parallel ranks that equal the single-process numbers exactly.

Averaging per-rank accuracies is wrong whenever shards differ in size (the last batch, or
an evaluation sampler with pad=False): 3/3 on one rank and 1/2 on the other is 80%, not
the 75% a mean of ratios gives. So Accuracy keeps integer *counts* and all-reduces them:

    rank 0: correct=3, total=3  \\
                                  all_reduce(SUM) -> correct=4, total=5 -> 0.8 on every rank
    rank 1: correct=1, total=2  /

Integers sum exactly (in float64, up to 2**53), so the result is bit-identical to one process
on the whole set. With pipelines only the last stage sees outputs, and with tensor parallelism
several tensor ranks hold each output, so with either the default group is the whole world:
other stages add zero counts, every sample is counted equally often (the ratio is exact), and
every rank (rank 0 logs) learns the result.

A mean over ranks with weights w (e.g. each rank's sample count) is sum(w v) / sum(w): the exact
whole-dataset mean when each v is a per-rank mean over w samples (all_reduce_mean(weight=w)).
`compute()` and `all_reduce_mean()` are collectives: every rank of the group must call them.
"""
from __future__ import annotations

from typing import Mapping, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .context import gpc


def _reduce_group(group: Optional[ProcessGroup]) -> Optional[ProcessGroup]:
    """The group to reduce over (default: the data ranks, or the world: see above); None alone."""
    if not gpc.is_initialized:
        return None
    if group is None:
        group = dist.group.WORLD if gpc.pipeline_size > 1 or gpc.tensor_size > 1 else gpc.data_group
    return group if dist.get_world_size(group) > 1 else None


class Accuracy:
    """Top-1 accuracy, exact across the ranks (the data ranks, or the world: _reduce_group)."""

    def __init__(self, group: Optional[ProcessGroup] = None) -> None:
        self.group = group
        self.reset()

    def reset(self) -> None:
        self.correct = 0
        self.total = 0

    @torch.no_grad()
    def update(self, output: torch.Tensor, target: torch.Tensor) -> None:
        """output: logits (N, C) or predicted labels (N,); target: labels (N,)."""
        pred = output.argmax(dim=-1) if output.dim() == target.dim() + 1 else output
        if pred.shape != target.shape:
            raise ValueError(f"[rank {gpc.rank}] Accuracy.update: predictions of shape "
                             f"{tuple(pred.shape)} do not match targets of shape "
                             f"{tuple(target.shape)}")
        self.correct += int((pred == target).sum())
        self.total += target.numel()

    def compute(self) -> float:
        """Global correct / global total: a collective over _reduce_group's ranks."""
        correct, total = all_reduce_sum([self.correct, self.total], self.group)
        if total == 0:
            raise ValueError("Accuracy.compute: no samples seen on any rank; call update() first")
        return correct / total


Number = Union[float, int, torch.Tensor]
Values = Union[Mapping[str, Number], Number]  # a scalar, or a dict of them


def all_reduce_mean(values: Values, group: Optional[ProcessGroup] = None,
                    weight: Optional[float] = None) -> Union[dict[str, float], float]:
    """Mean over `group`'s ranks of a scalar or a dict (same keys everywhere), maybe weighted."""
    keys = list(values) if isinstance(values, Mapping) else None
    scalars = [values[k] for k in keys] if keys is not None else [values]
    w = 1.0 if weight is None else float(weight)
    *sums, total_weight = all_reduce_sum([float(v) * w for v in scalars] + [w], group)
    means = [s / total_weight for s in sums]
    return dict(zip(keys, means)) if keys is not None else means[0]


def all_reduce_sum(values: list[float], group: Optional[ProcessGroup] = None) -> list[float]:
    """Sums over the ranks of `group` (default: _reduce_group's) of a few scalars, in float64."""
    packed = torch.tensor(values, dtype=torch.float64)
    group = _reduce_group(group)
    if group is not None:
        packed = packed.to(gpc.device)
        dist.all_reduce(packed, group=group)
        packed = packed.cpu()
    return packed.tolist()
