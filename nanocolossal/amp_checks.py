"""amp.py's, amp_scaler.py's and amp_settings.py's refusals, and step's skip counters; each
called by one line from the core."""
from __future__ import annotations

from typing import Any, Mapping, Union

import torch

from .compat.apex import NO_EFFECT, RENAMED
from .config import AMP_TYPE, ConfigError
from .context import gpc
from .logging import get_dist_logger

# the scaler's own arguments (amp_scaler.DynamicLossScaler), accepted in every mode
SCALER = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "hysteresis",
          "min_scale", "max_scale", "max_consecutive_overflows")
MODE_KEYS = {AMP_TYPE.TORCH: (), AMP_TYPE.NAIVE: (),  # beyond SCALER, RENAMED, mode, dtype, enabled
             AMP_TYPE.APEX: ("opt_level", "loss_scale", "keep_batchnorm_fp32", "master_weights")}


def check_fp16(fp16: Mapping[str, Any]) -> None:
    """fp16=dict(...): refuse keys its mode does not take, naming them and what to do."""
    mode = AMP_TYPE.parse(fp16["mode"])
    allowed = {"mode", "dtype", "enabled", *SCALER, *RENAMED, *MODE_KEYS[mode]}
    for key in [k for k in fp16 if k not in allowed]:  # the first such key
        hint = NO_EFFECT.get(key, f"{mode.name} takes {', '.join(sorted(allowed - {'mode'}))}")
        raise ConfigError(f"fp16.{key} has no effect with mode=AMP_TYPE.{mode.name}: {hint}")
    if fp16.get("dtype") not in (None, "float16", "bfloat16", torch.float16, torch.bfloat16):
        raise ConfigError(f"fp16.dtype must be 'float16' or 'bfloat16', got {fp16['dtype']!r}")
    level = fp16.get("opt_level", "O1")
    if "master_weights" in fp16 and fp16["master_weights"] != (level == "O2"):
        raise ConfigError(f"fp16.master_weights={fp16['master_weights']} with opt_level {level}: "
                          f"here only O2 keeps fp32 master weights; use opt_level 'O2' for "
                          f"masters, 'O1' or 'O3' without, and leave master_weights out")


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
