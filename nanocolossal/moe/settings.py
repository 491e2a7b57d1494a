"""The MoE config, checked when the config is loaded (registered with config).

Colossal-AI's MoE tutorial writes the expert-parallel size as a parallel entry:

    MOE_MODEL_PARALLEL_SIZE = 2
    parallel = dict(moe=dict(size=MOE_MODEL_PARALLEL_SIZE))   # EP; `moe=2` works too

and the model's keys, read by train_gpt.py (`moe_model_settings`: MoeLayer's arguments) and
`initialize` (`moe_aux_weight`, for the aux-loss extension: pipeline/moe_aux.py):

    NUM_EXPERTS = 4              # E, per MoE layer
    MOE_TOP_K = 1                # 1 (Switch) or 2 (GShard)
    MOE_CAPACITY_FACTOR = 1.25   # training; >= NUM_EXPERTS never drops a token
    MOE_EVAL_CAPACITY_FACTOR     # evaluation: Colossal-AI's 2.0, or the training one if larger
    MOE_AUX_WEIGHT = 0.01        # the load-balancing loss's weight in the training loss

Expert parallelism is carved out of the data-parallel ranks, so EP must divide the data size D
(checked at launch, layout.check_moe_world: the world size is not known before). A pipeline
composes (each stage's expert groups are carved out of that stage's data ranks, and every
stage's load-balancing loss joins its backward per micro-batch: pipeline/moe_aux.py). What does
not compose is refused here, by name: tensor parallelism of every mode (1d, 2d, 2.5d, 3d) and
sequence parallelism (the experts' tokens would be split or sharded a second way), and ZeRO
(which flattens all parameters into one data-parallel shard: experts are not replicated there).
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Mapping, Optional

from ..checks import forward_talks
from ..config import ConfigError, is_positive_int
from .layer import moe_layers
from .router import CAPACITY_FACTOR_EVAL

AUX_WEIGHT = 0.01  # Colossal-AI's MoeLoss default


def _number(cfg: Mapping, key: str, default: float, positive: bool) -> float:
    value = cfg.get(key, default)
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value <= 0 if positive else value < 0):
        raise ConfigError(f"{key} must be a number {'> 0' if positive else '>= 0'}, got {value!r}"
                          + (" (1.25 is usual; >= NUM_EXPERTS never drops a token)"
                             if "CAPACITY" in key else ""))
    return float(value)


def moe_model_settings(cfg: Mapping) -> Optional[dict[str, Any]]:
    """MoeLayer's arguments from the config's keys, or None without NUM_EXPERTS."""
    moe_aux_weight(cfg)  # also for a model of the user's own MoE layers, without NUM_EXPERTS
    if "NUM_EXPERTS" not in cfg:
        return None
    experts, top_k = cfg["NUM_EXPERTS"], cfg.get("MOE_TOP_K", 1)
    if not is_positive_int(experts):
        raise ConfigError(f"NUM_EXPERTS must be a positive integer, got {experts!r}")
    if top_k not in (1, 2) or isinstance(top_k, bool) or top_k > experts:
        raise ConfigError(f"MOE_TOP_K must be 1 (Switch) or 2 (GShard) and at most NUM_EXPERTS="
                          f"{experts}, got {top_k!r}")
    train = _number(cfg, "MOE_CAPACITY_FACTOR", 1.25, positive=True)
    return dict(num_experts=experts, top_k=top_k, capacity_factor_train=train,
                capacity_factor_eval=_number(cfg, "MOE_EVAL_CAPACITY_FACTOR",
                                             max(CAPACITY_FACTOR_EVAL, train), positive=True))


def moe_aux_weight(cfg: Mapping) -> float:
    """MOE_AUX_WEIGHT: the load-balancing loss's weight in the training loss (0.01 by default)."""
    return _number(cfg, "MOE_AUX_WEIGHT", AUX_WEIGHT, positive=False)


forward_talks(lambda model: "the model's MoE layers exchange tokens" if moe_layers(model) else None)
