"""The zero=dict(...) config, checked when the config is loaded (registered with config).

Two spellings. Colossal-AI's first: zero=dict(level=1|2|3, reduce_bucket_size_mb=25,
overlap_communication=True, offload=None|'cpu'). Colossal-AI v0.1's
zero=dict(model_config=dict(...), optimizer_config=dict(...)) is level 3 here, read by
compat/zero_v01.py.

check_optimizer: what initialize refuses -- an optimizer that cannot step segments of parameters.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..amp import MixedPrecisionOptimizer
from ..checks import forward_talks
from ..compat.zero_v01 import v01_settings
from ..config import Config, ConfigError
from ..context import gpc

ZERO_KEYS = ("level", "reduce_bucket_size_mb", "overlap_communication", "offload")
OFFLOAD = ("cpu",)  # where zero.offload may put the masters and the optimizer state (offload.py)

def zero_settings(cfg: Config) -> tuple[dict, dict, list[str]]:
    """(zero=dict(level, ...) settings, loss-scaler arguments, notes for the log) of either
    spelling; the v0.1 one is checked here."""
    zero = cfg.zero
    if "model_config" not in zero and "optimizer_config" not in zero:
        return dict(zero), {}, []
    return v01_settings(zero, bool(cfg.get("fp16")))


def _gathers_in_forward(model: nn.Module) -> Optional[str]:
    zero = zero_settings(gpc.config)[0] if "zero" in gpc.config else {}
    return "ZeRO level 3 gathers the parameters" if zero.get("level") == 3 else None


forward_talks(_gathers_in_forward)  # (checks.py: uneven evaluation batches refused)


# optimizers whose update of an element depends only on that element's gradient and state
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop,
               torch.optim.Adagrad)


def check_optimizer(optimizer: torch.optim.Optimizer, mixed: MixedPrecisionOptimizer,
                     model: nn.Module, level: int) -> None:
    """What ZeRO can shard: an element-wise optimizer, fresh, over every trainable parameter."""
    if type(optimizer) not in ELEMENTWISE:
        raise ConfigError(
            f"[rank {gpc.rank}] zero: {type(optimizer).__name__} is not an element-wise optimizer "
            f"we can step segment by segment (each rank steps only parts of parameters, so an "
            f"update that needs a whole parameter -- LAMB's or LARS's trust ratio -- would be "
            f"wrong); use one of {', '.join(c.__name__ for c in ELEMENTWISE)}, or remove zero")
    if mixed.master_pairs():  # (whole-model masters: mixed.py's classes make shards of them)
        raise TypeError(f"[rank {gpc.rank}] {type(mixed).__name__} holds O2's fp32 masters of "
                        f"the whole model; shard it with zero.mixed's MixedShardedOptimizer "
                        f"(levels 1-2) or MixedParamShardedOptimizer (level 3)")
    # (Adagrad fills its state, step 0, in its constructor: that is not a step)
    if any(float(state.get("step", 1)) > 0 for state in optimizer.state.values()):
        raise ConfigError(f"[rank {gpc.rank}] zero: the optimizer has already stepped; pass a "
                          f"fresh optimizer to initialize (load its state after, with "
                          f"engine.optimizer.load_state_dict)")
    stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in stepped]
    if missing:
        raise ConfigError(f"[rank {gpc.rank}] zero: trainable parameter(s) {', '.join(missing[:4])}"
                          f" are not in the optimizer; ZeRO shards what the optimizer steps: pass "
                          f"all of model.parameters(), or set requires_grad=False on them")
