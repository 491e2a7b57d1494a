"""The zero=dict(...) config, checked when the config is loaded (registered with config).

Two spellings. Colossal-AI's first: zero=dict(level=1|2|3, reduce_bucket_size_mb=25,
overlap_communication=True, offload=None|'cpu'). Colossal-AI v0.1's
zero=dict(model_config=dict(...), optimizer_config=dict(...)) is level 3 here, read by
compat/zero_v01.py.

check_optimizer: what initialize refuses -- an optimizer that cannot step segments of parameters.
"""
from __future__ import annotations

import numbers
from typing import Any, Mapping, Optional

import torch
from torch import nn

from ..amp import MixedPrecisionOptimizer
from ..checks import forward_talks
from ..compat.zero_v01 import v01_settings
from ..config import AMP_TYPE, Config, ConfigError, parallel_settings, register_check
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


def check_zero(cfg: Config) -> None:
    """zero=dict(level=1|2|3, reduce_bucket_size_mb=25, overlap_communication=True), or v0.1's
    dict(model_config=..., optimizer_config=...)."""
    if "zero" not in cfg:
        return
    P = parallel_settings(cfg)[0]
    if not isinstance(cfg.zero, Mapping):
        raise ConfigError(f"zero must be a dict such as dict(level=2), got {cfg.zero!r}")
    zero: Any = zero_settings(cfg)[0]
    unknown = sorted(set(zero) - set(ZERO_KEYS))
    if unknown:
        raise ConfigError(f"unknown zero key(s) {unknown}; zero understands {', '.join(ZERO_KEYS)}")
    level = zero.get("level")
    if level not in (1, 2, 3) or isinstance(level, bool):
        raise ConfigError(f"zero level must be 1, 2 or 3, got {level!r}: zero=dict(level=1) "
                          f"shards the optimizer state, 2 also the gradients, 3 also the "
                          f"parameters")
    size = zero.get("reduce_bucket_size_mb", 25)
    if not isinstance(size, numbers.Real) or isinstance(size, bool) or size <= 0:
        raise ConfigError(f"zero.reduce_bucket_size_mb must be a positive number, got {size!r}")
    if not isinstance(zero.get("overlap_communication", True), bool):
        raise ConfigError("zero.overlap_communication must be True or False")
    offload = zero.get("offload")
    if offload is not None and offload not in OFFLOAD:
        raise ConfigError(f"zero.offload={offload!r}: only 'cpu' is built here (fp32 masters and "
                          f"optimizer state in CPU memory, the step on the CPU); use "
                          f"offload='cpu', or remove offload to keep them on the model's device")
    if level == 1 and zero.get("overlap_communication") is False:
        raise ConfigError("zero.overlap_communication=False applies to levels 2 and 3; level 1 "
                          "reduces gradients with DDP, which always overlaps: remove it")
    if cfg.get("gradient_handler"):
        raise ConfigError("zero and gradient_handler both say how gradients are reduced; remove "
                          "gradient_handler (zero reduces them itself)")
    if P > 1 and level == 3:  # every micro-batch's forward and backward would gather the stage
        raise ConfigError(f"zero level 3 with a pipeline (pipeline={P}) is not supported: a stage "
                          f"would gather its parameters for each of its micro-batches, forward and "
                          f"backward (2M all-gathers a step); use zero level 1 or 2 with a "
                          f"pipeline (ZeRO over each stage's data ranks), or level 3 without one")
    fp16 = cfg.get("fp16")
    if isinstance(fp16, Mapping) and "mode" in fp16:
        mode = AMP_TYPE.parse(fp16["mode"])
        level_amp = {AMP_TYPE.TORCH: "O1", AMP_TYPE.NAIVE: "O2"}.get(mode,
                                                                     fp16.get("opt_level", "O1"))
        if level_amp == "O3":  # no fp32 masters to shard: the state would be half
            raise ConfigError(f"zero with fp16 {mode.name} O3 (half parameters, no fp32 master "
                              f"weights) is not supported; use O2 (mode=AMP_TYPE.NAIVE) with zero, "
                              f"or fp16=dict(mode=AMP_TYPE.TORCH) (O1)")


register_check(check_zero)  # validate_config runs it when a config is loaded


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
