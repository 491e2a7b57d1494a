"""The zero=dict(...) config (checked with the others: config_checks.py), in two spellings:
Colossal-AI's first, zero=dict(level=1|2|3, reduce_bucket_size_mb=25, overlap_communication=True,
offload=None|'cpu'), and v0.1's zero=dict(model_config=..., optimizer_config=...), level 3 here,
read by compat/zero_v01.py. ELEMENTWISE: the optimizers ZeRO can step segment by segment.
"""
from __future__ import annotations

import torch

from ..compat.zero_v01 import v01_settings
from ..config import Config

ZERO_KEYS = ("level", "reduce_bucket_size_mb", "overlap_communication", "offload")
OFFLOAD = ("cpu",)  # where zero.offload may put the masters and the optimizer state (offload.py)


def zero_settings(cfg: Config) -> tuple[dict, dict, list[str]]:
    """(zero=dict(level, ...) settings, loss-scaler arguments, notes for the log) of either
    spelling; the v0.1 one is checked here."""
    zero = cfg.zero
    if "model_config" not in zero and "optimizer_config" not in zero:
        return dict(zero), {}, []
    return v01_settings(zero, bool(cfg.get("fp16")))


# optimizers whose update of an element depends only on that element's gradient and state
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop,
               torch.optim.Adagrad)

