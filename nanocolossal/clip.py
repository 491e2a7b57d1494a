"""Gradient clipping by the global norm, when the model is held by many ranks.

One process (torch.nn.utils.clip_grad_norm_):

    norm = sqrt( sum_p |g_p|^2 )          g_p  <-  g_p * min(1, max_norm / (norm + 1e-6))

Every rank must clip by the norm of the *whole* model, so every element of every gradient must
count exactly once, wherever it lives:

    who holds g_p                                 what its rank adds, and where the sum runs
    data-parallel replicas (same averaged g_p)    |g_p|^2 on each; no sum (they agree already)
    another pipeline stage / tensor slice         |g_p|^2, summed over the model group
    k ranks of the model group, identically       |g_p|^2 / k (a LayerNorm every tensor rank
      (tensor-replicated, tied across stages)       holds, a tied embedding on 2 stages)
    one rank of another group (ZeRO's segments    |g_p|^2 x w_p, summed over that group first,
      over the data ranks, MoE's experts over       then with the rest over the model group
      the expert-parallel ranks)                    (w_p = 1 / its holders there)

`global_norm` is that table (`group_norm` adds its two sums); `clip_` scales by the one
coefficient; `clip_grad_norm_` is both, what an optimizer's clip_grad_norm_ calls (fp32's:
plain_optimizer.py; AMP's, on unscaled gradients and never on a step about to be skipped: amp.py).
The norm stays on the device, a 0-d tensor nobody waits for (`last_grad_norm` reads it when
asked). Sums run in float32 (half gradients overflow), float64 for a float64 model (a float32
coefficient would round its clipped gradients). `nanocolossal plan` computes these elements
sent before a launch (plan/traffic.py).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from .context import gpc

# (weight by id(param), group): parameters split over another group than the model's
SplitOver = tuple[dict[int, float], Optional[dist.ProcessGroup]]


def one_process_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The naive version: the norm of every gradient in one process."""
    return torch.stack([g.norm() for g in grads]).norm()


def model_holders(param: nn.Parameter) -> int:
    """Ranks of the model group holding this exact parameter: the tensor ranks with an identical
    copy (`tensor_replicas`, tensor/base.py; unmarked: all) times the pipeline stages sharing it
    (`pipeline_copies`: pipeline/tied.py). Sequence ranks split tokens, not weights: there the
    norm sums over the stages alone (gpc.other_parts_group), so 1 x copies."""
    tensor = 1 if gpc.sequence_size > 1 else getattr(param, "tensor_replicas", gpc.tensor_size)
    return tensor * getattr(param, "pipeline_copies", 1)


def weighted_squares(grads: list[torch.Tensor], weights: list[float], acc: torch.dtype,
                     device: torch.device) -> torch.Tensor:
    """sum_p |g_p|^2 x w_p, accumulated in `acc` on `device` (0 without gradients)."""
    if not grads:
        return torch.zeros((), device=device, dtype=acc)
    # built on the host, sent without waiting (a blocking copy would wait for the device)
    w = torch.tensor(weights, dtype=acc).to(device, non_blocking=True)
    return (torch.stack(torch._foreach_norm(grads)).to(acc) ** 2 * w).sum()


def summed(t: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """t summed over `group` (unchanged without one). Reduced on gpc.device -- NCCL sums no CPU
    tensor, and ZeRO offload's squares are on the CPU -- and brought back to t's device."""
    if group is None or dist.get_world_size(group) == 1:
        return t
    on = t.to(gpc.device)
    dist.all_reduce(on, group=group)
    return on.to(t.device)


def group_norm(model_squares: torch.Tensor, split_squares: torch.Tensor,
               model_group: Optional[dist.ProcessGroup],
               split_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The global norm from this rank's two sums of weighted squares: the split parameters' over
    `split_group` first (a stage's experts count once, in its sum), then all over `model_group`."""
    return summed(model_squares + summed(split_squares, split_group), model_group).sqrt()


def global_norm(params: list[nn.Parameter], holders: Callable[[nn.Parameter], int],
                model_group: Optional[dist.ProcessGroup],
                split_over: Optional[SplitOver], acc: torch.dtype) -> torch.Tensor:
    """The table above for the gradients of `params`: each weighed by 1 / its holders in the
    model group, those in `split_over` also by their weight, summed over its group first."""
    device = params[0].grad.device if params else gpc.device
    weight_of, split_group = split_over or ({}, None)
    own = [p for p in params if id(p) not in weight_of]
    split = [p for p in params if id(p) in weight_of]
    own_squares = weighted_squares([p.grad for p in own], [1 / holders(p) for p in own], acc,
                                   device)
    split_squares = weighted_squares([p.grad for p in split],
                                     [weight_of[id(p)] / holders(p) for p in split], acc, device)
    return group_norm(own_squares, split_squares, model_group, split_group)


def clip_(grads: list[torch.Tensor], max_norm: float, norm: torch.Tensor,
          keep: Optional[torch.Tensor] = None) -> None:
    """Scale every gradient by min(1, max_norm / (norm + 1e-6)), torch's coefficient; by 1 where
    `keep` (a 0-d bool on the device: a step about to be skipped keeps its gradients)."""
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    if keep is not None:
        coef = torch.where(keep, torch.ones_like(coef), coef)
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float,
                    holders: Callable[[nn.Parameter], int],
                    group: Optional[dist.ProcessGroup] = None,
                    split_over: Optional[SplitOver] = None,
                    skip: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Clip the gradients of `params` to their global norm (`group` holds the model's other
    parts, `split_over` the parameters split over another group); returns the norm as a 0-d
    tensor, inf where `skip` (a 0-d bool: an overflowed step keeps its gradients)."""
    acc = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
    with_grads = [p for p in params if p.grad is not None]
    norm = global_norm(with_grads, holders, group, split_over, acc)
    clip_([p.grad for p in with_grads], max_norm, norm, keep=skip)
    return norm if skip is None else torch.where(skip, torch.full_like(norm, math.inf), norm)
