"""The executor's refusals and misuse errors (executor.py calls each by one line), said before
anything is sent, with the rank and what to change."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..context import gpc
from .plan_checks import SCHEDULES, check_sizes
from .steps import PlanError


def check_on_this_pipeline(name: str, M: int, V: int) -> None:
    """The plan's sizes against the launched pipeline, the error naming this rank."""
    try:
        check_sizes(name, gpc.pipeline_size, M, V)
    except PlanError as e:
        raise PlanError(f"[rank {gpc.rank}] {e}") from None


def check_schedule(name: str, M: int, V: int) -> None:
    """make_schedule's: the name, and once launched the sizes against the real pipeline."""
    if gpc.pipeline_size > 1:
        check_on_this_pipeline(name, M, V)
    elif name not in SCHEDULES:
        raise PlanError(f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}")


def check_call(executor: Any, chunks: list, batch: Any, criterion: Optional[Callable],
               forward_only: bool, return_loss: bool) -> None:
    """The model's chunks and the batch fit the plan; the last stage has a criterion."""
    M = executor.num_microbatches
    V = executor.num_chunks
    check_on_this_pipeline(executor.name, M, V)
    if len(chunks) != V:
        raise ValueError(f"[rank {gpc.rank}] {executor.name} schedule expects {V} model chunk(s), "
                         f"got {len(chunks)}; build the model with build_pipeline_model(..., "
                         f"num_chunks={V})")
    n = len(batch[0])
    if n < M:
        raise ValueError(f"[rank {gpc.rank}] batch size {n} is smaller than "
                         f"NUM_MICRO_BATCHES={M}; use batches of at least {M} samples (or "
                         f"drop_last=True in the dataloader)")
    needs_loss = return_loss or not forward_only
    if executor.output_rank() == gpc.pipeline_rank and criterion is None and needs_loss:
        raise ValueError(f"[rank {gpc.rank}] the last pipeline stage needs a criterion to "
                         f"compute the loss")


def check_output(output: Any, v: int) -> None:
    if not isinstance(output, torch.Tensor):
        raise TypeError(f"[rank {gpc.rank}] pipeline part {v} returned "
                        f"{type(output).__name__}; stages must return one tensor")


def check_input_used(x: torch.Tensor, v: int, m: int) -> None:
    """A floating input no gradient reached: zeros sent back would give the earlier stage's
    parameters zero gradients where one process leaves them None (momentum, decay move them)."""
    if x.grad is None:
        raise RuntimeError(
            f"[rank {gpc.rank}] pipeline part {v} did not use its input in micro-batch {m}: no "
            f"gradient flows back to part {v - 1}, whose parameters one process would leave "
            f"without a gradient; make part {v} use its input, or end part {v - 1} with an output "
            f"that needs no gradient (integer ids, or .detach())")
