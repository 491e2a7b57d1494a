"""amp.py's and amp_scaler.py's refusals, and step's skip counters; each called by one line from
the core (the config's fp16=dict(...): config_checks.py)."""
from __future__ import annotations

from typing import Any, Union

import torch

from .context import gpc
from .logging import get_dist_logger


def check_initialize(opt_level: str, dtype: torch.dtype, opt_levels: tuple[str, ...]) -> None:
    """amp.initialize: a known opt level, a half dtype."""
    if opt_level not in opt_levels:
        raise ValueError(f"[rank {gpc.rank}] unknown opt_level {opt_level!r}; use one of "
                         f"{', '.join(opt_levels)}")
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"[rank {gpc.rank}] amp dtype must be "
                         f"torch.float16 or torch.bfloat16, got {dtype}")


def check_scaler_settings(s: Any) -> None:
    """DynamicLossScaler's arguments: a scale that can grow, back off, and stay in its range."""
    rules = {
        "growth_factor > 1": s.growth_factor > 1,
        "0 < backoff_factor < 1": 0 < s.backoff_factor < 1,
        "growth_interval >= 1": s.growth_interval >= 1,
        "hysteresis >= 1": s.hysteresis >= 1,
        "0 < min_scale <= init_scale <= max_scale": 0 < s.min_scale <= s.scale <= s.max_scale,
    }
    broken = [rule for rule, holds in rules.items() if not holds]
    if broken:
        raise ValueError(f"DynamicLossScaler needs {' and '.join(broken)}; got {vars(s)}")


def check_not_stuck(scaler: Any) -> None:
    """At min_scale, max_consecutive_overflows overflows in a row: the loss itself is inf/nan."""
    at_the_floor = scaler.scale <= scaler.min_scale
    if at_the_floor and scaler.consecutive_overflows >= scaler.max_consecutive_overflows:
        raise FloatingPointError(
            f"[rank {gpc.rank}] step {scaler.steps}: gradients overflowed "
            f"{scaler.consecutive_overflows} steps in a row and the loss scale is down to "
            f"min_scale={scaler.min_scale:g}; the loss is probably NaN/inf (check the "
            f"inputs, the learning rate, or a division by zero in the loss)")


def count_skipped(optimizer: Any, skipped: Union[bool, torch.Tensor]) -> None:
    """MixedPrecisionOptimizer.step's counters (tensors where the device decided); a skip that no
    scaler's back-off reports is logged."""
    if skipped is True and optimizer.scaler is None:
        get_dist_logger().warning(f"non-finite gradient on some rank: this step is skipped on "
                                  f"every rank ({optimizer.skipped_steps + 1} skipped so far)")
    optimizer._last_skipped = skipped
    optimizer._skipped = optimizer._skipped + skipped
