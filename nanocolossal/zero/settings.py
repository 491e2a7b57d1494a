"""The zero=dict(...) config, in two spellings: Colossal-AI's first, zero=dict(level=1|2|3,
reduce_bucket_size_mb=25, overlap_communication=True, offload=None|'cpu'), and v0.1's
zero=dict(model_config=..., optimizer_config=...), level 3 here (compat/zero_v01.py); both read
and checked without torch in config_checks.py. ELEMENTWISE: the optimizers ZeRO can step by segment.
"""
from __future__ import annotations

import torch

from ..config_checks import ZERO_KEYS as ZERO_KEYS
from ..config_checks import zero_settings as zero_settings

# optimizers whose update of an element depends only on that element's gradient and state
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop,
               torch.optim.Adagrad)

