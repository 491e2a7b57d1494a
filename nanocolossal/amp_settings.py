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

from .compat.apex import RENAMED
from .config import AMP_TYPE
from .config_checks import check_fp16


def amp_settings(fp16: Mapping[str, Any], cpu_half: Optional[torch.dtype],
                 on_cpu: bool) -> tuple[str, Optional[dict]]:
    """fp16=dict(...) -> (opt_level, amp.initialize's keyword arguments), or (opt_level, None) to
    stay in float32: `enabled=False`, or `on_cpu` with no dtype asked and `cpu_half` None."""
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
