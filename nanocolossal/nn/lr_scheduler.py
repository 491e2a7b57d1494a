"""Colossal-AI's learning-rate schedulers (`colossalai.nn.lr_scheduler`), with their formulas.

Each takes `total_steps` (n) -- the number of times `.step()` will be called: epochs when the
LRSchedulerHook steps by epoch, optimizer steps when it steps per iteration -- and scales
every parameter group's base learning rate `base` at step t = 0, 1, ..., n - 1:

    CosineAnnealingLR        t < w: base * (t + 1) / w            (warm-up, w = warmup_steps)
                             else:  eta_min + (base - eta_min) * (1 + cos(pi * (t-w) / (n-w))) / 2
    CosineAnnealingWarmupLR  the same (Colossal-AI's name when w > 0)
    LinearWarmupLR           t < w: base * (t + 1) / (w + 1)   else: base * (n - t) / (n - w)
    MultiStepLR              base * gamma ** (number of milestones <= t)
    StepLR                   base * gamma ** (t // step_size)
    ExponentialLR            base * gamma ** t
    PolynomialLR             t < w: base * (t + 1) / w
                             else:  (base - end_lr) * (1 - (t - w) / (n - w)) ** power + end_lr

From t = n on, each schedule holds its value at t = n: where the decay ends for the warm-up
schedulers (0, eta_min, end_lr), the formula at t = n for the others.

A run shorter than its warm-up (n <= w: a short trial of a script written for many epochs) is
accepted, as Colossal-AI accepts it: its n steps all warm up, and the decay, which never
starts, is over at t = n like any other's. w = 0 starts decaying at once.

They are torch LambdaLR schedulers, so state_dict/load_state_dict, get_last_lr and
checkpointing work as for any torch scheduler.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from typing import Callable, Optional, Sequence

import torch
from torch.optim.lr_scheduler import LambdaLR

from ..context import gpc

__all__ = ["CosineAnnealingLR", "CosineAnnealingWarmupLR", "ExponentialLR", "LinearWarmupLR",
           "MultiStepLR", "PolynomialLR", "StepLR"]


class _Schedule(LambdaLR):
    """LambdaLR of the rule lr(t, base), whose factor for a group is lr(t, base) / base."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int,
                 warmup_steps: Optional[int], lr: Callable[[int, float], float],
                 last_epoch: int) -> None:
        if total_steps < 0 or (warmup_steps or 0) < 0:  # (None: a schedule without warm-up)
            needs, got = "total_steps >= 0", f"total_steps={total_steps}"
            if warmup_steps is not None:
                needs, got = f"{needs} and warmup_steps >= 0", f"{got}, warmup_steps={warmup_steps}"
            raise ValueError(f"[rank {gpc.rank}] {type(self).__name__} needs {needs}, got {got}")
        bases = [group.get("initial_lr", group["lr"]) for group in optimizer.param_groups]
        factors = [lambda t, b=base: lr(t, b) / b if b else 0.0 for base in bases]
        super().__init__(optimizer, factors, last_epoch)


def _warmup_then(n: int, w: int, decay: Callable[[float, float], float],
                 ramp: int) -> Callable[[int, float], float]:
    """lr(t, base): the linear warm-up base * (t + 1) / ramp for t < w, then decay(p, base) as the
    progress p through the decay goes from 0 (t = w) towards 1 (t = n)."""
    def lr(t: int, base: float) -> float:
        if t >= n:  # over -- also when n <= w, where the decay never started: hold its end
            return decay(1.0, base)
        if t < w:
            return base * (t + 1) / ramp
        return decay((t - w) / (n - w), base)  # here w <= t < n, so n - w >= 1
    return lr


class CosineAnnealingLR(_Schedule):
    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0,
                 eta_min: float = 0.0, last_epoch: int = -1) -> None:
        def cosine(p: float, base: float) -> float:
            return eta_min + (base - eta_min) * (1 + math.cos(math.pi * p)) / 2
        lr = _warmup_then(total_steps, warmup_steps, cosine, ramp=warmup_steps)
        super().__init__(optimizer, total_steps, warmup_steps, lr, last_epoch)


class CosineAnnealingWarmupLR(CosineAnnealingLR):
    """CosineAnnealingLR by Colossal-AI's name for it with a warm-up (the same arguments)."""


class LinearWarmupLR(_Schedule):
    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0,
                 last_epoch: int = -1) -> None:
        def linear(p: float, base: float) -> float:
            return base * (1 - p)  # = base * (n - t) / (n - w)
        # Colossal-AI's warm-up ends one step below base: (t + 1) / (w + 1)
        lr = _warmup_then(total_steps, warmup_steps, linear, ramp=warmup_steps + 1)
        super().__init__(optimizer, total_steps, warmup_steps, lr, last_epoch)


class MultiStepLR(_Schedule):
    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int,
                 milestones: Optional[Sequence[int]] = None,
                 gamma: float = 0.1, last_epoch: int = -1) -> None:
        marks = sorted(milestones or [])

        def lr(t: int, base: float) -> float:
            return base * gamma ** bisect_right(marks, min(t, total_steps))
        super().__init__(optimizer, total_steps, None, lr, last_epoch)


class StepLR(_Schedule):
    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int, step_size: int = 1,
                 gamma: float = 0.1, last_epoch: int = -1) -> None:
        def lr(t: int, base: float) -> float:
            return base * gamma ** (min(t, total_steps) // step_size)
        super().__init__(optimizer, total_steps, None, lr, last_epoch)


class ExponentialLR(_Schedule):
    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int, gamma: float = 1.0,
                 last_epoch: int = -1) -> None:
        def lr(t: int, base: float) -> float:
            return base * gamma ** min(t, total_steps)
        super().__init__(optimizer, total_steps, None, lr, last_epoch)


class PolynomialLR(_Schedule):
    def __init__(self, optimizer: torch.optim.Optimizer, total_steps: int, end_lr: float = 0.0001,
                 power: float = 1.0, warmup_steps: int = 0, last_epoch: int = -1) -> None:
        def polynomial(p: float, base: float) -> float:
            return (base - end_lr) * (1 - p) ** power + end_lr
        lr = _warmup_then(total_steps, warmup_steps, polynomial, ramp=warmup_steps)
        super().__init__(optimizer, total_steps, warmup_steps, lr, last_epoch)
