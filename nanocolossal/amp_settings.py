"""The config's fp16=dict(...) -> amp.initialize's arguments, in Colossal-AI's three spellings.

    fp16 = dict(mode=AMP_TYPE.TORCH)                                  # O1: torch autocast
    fp16 = dict(mode=AMP_TYPE.NAIVE, initial_scale=2**16)             # O2: half model, fp32 masters
    fp16 = dict(mode=AMP_TYPE.APEX, opt_level='O2', min_loss_scale=1) # apex's amp.initialize

Each mode's keys are the ones its Colossal-AI backend takes -- torch's GradScaler, Colossal-AI's
naive FP16Optimizer, apex's amp.initialize -- renamed onto one DynamicLossScaler (amp_scaler.py)
and amp.initialize (amp.py). Every mode also takes `dtype` ('float16' | 'bfloat16') and the
scaler's own names. A key with no effect here is an error naming it: a config ported from
Colossal-AI must not run on silently without what it asked for.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from .compat.apex import NO_EFFECT, RENAMED
from .config import AMP_TYPE, ConfigError

# the scaler's own arguments (amp_scaler.DynamicLossScaler), accepted in every mode
SCALER = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "hysteresis",
          "min_scale", "max_scale", "max_consecutive_overflows")
MODE_KEYS = {  # beyond SCALER, RENAMED, mode, dtype, enabled
    AMP_TYPE.TORCH: (),
    AMP_TYPE.NAIVE: (),
    AMP_TYPE.APEX: ("opt_level", "loss_scale", "keep_batchnorm_fp32", "master_weights"),
}


def check_fp16(fp16: Mapping[str, Any]) -> None:
    """Refuse keys that fp16's mode does not take, naming them and what to do."""
    mode = AMP_TYPE.parse(fp16["mode"])
    allowed = {"mode", "dtype", "enabled", *SCALER, *RENAMED, *MODE_KEYS[mode]}
    for key in fp16:
        if key in allowed:
            continue
        hint = NO_EFFECT.get(key, f"{mode.name} takes {', '.join(sorted(allowed - {'mode'}))}")
        raise ConfigError(f"fp16.{key} has no effect with mode=AMP_TYPE.{mode.name}: {hint}")
    if fp16.get("dtype") not in (None, "float16", "bfloat16", torch.float16, torch.bfloat16):
        raise ConfigError(f"fp16.dtype must be 'float16' or 'bfloat16', got {fp16['dtype']!r}")
    level = fp16.get("opt_level", "O1")
    if "master_weights" in fp16 and fp16["master_weights"] != (level == "O2"):
        raise ConfigError(f"fp16.master_weights={fp16['master_weights']} with opt_level {level}: "
                          f"here only O2 keeps fp32 master weights; use opt_level 'O2' for "
                          f"masters, 'O1' or 'O3' without, and leave master_weights out")


def amp_settings(fp16: Mapping[str, Any], cpu_half: Optional[torch.dtype],
                 on_cpu: bool) -> tuple[str, Optional[dict]]:
    """fp16=dict(mode=AMP_TYPE.X, ...) -> (opt_level, keyword arguments for amp.initialize), or
    (opt_level, None) to stay in float32: `enabled=False`, or on a CPU (`on_cpu`) with no dtype
    asked for whose fast half type `cpu_half` (cpu_half.py) is None."""
    check_fp16(fp16)
    fp16 = dict(fp16)
    mode = AMP_TYPE.parse(fp16.pop("mode"))
    for theirs, ours in RENAMED.items():
        if theirs in fp16:
            fp16[ours] = fp16.pop(theirs)
    level = fp16.pop("opt_level", "O1")
    opt_level = {AMP_TYPE.TORCH: "O1", AMP_TYPE.NAIVE: "O2"}.get(mode, level)
    fp16.pop("master_weights", None)  # (check_fp16: the level's own choice)
    if fp16.pop("enabled", True) is False:
        return opt_level, None
    if isinstance(fp16.get("dtype"), str):
        fp16["dtype"] = getattr(torch, fp16["dtype"])
    if "dtype" not in fp16 and on_cpu:
        # CPUs have no fast fp16 kernels; bf16 (fp32's range: no loss scaling) where it is fast
        if cpu_half is None:
            return opt_level, None
        fp16["dtype"] = cpu_half
    return opt_level, fp16
