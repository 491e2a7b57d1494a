"""The MoE config, checked when the config is loaded (config_checks.check_moe, moe/checks.py).

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
(checked at launch, config_checks.check_world: the world size is not known before). A pipeline
composes (each stage's expert groups are carved out of that stage's data ranks, and every stage's
load-balancing loss joins its backward per micro-batch: pipeline/moe_aux.py). What does not compose
is refused when the config is loaded, by name: tensor parallelism of every mode (1d, 2d, 2.5d, 3d)
and sequence parallelism (the experts' tokens would be split or sharded a second way), and ZeRO
(which flattens all parameters into one data-parallel shard: experts are not replicated there).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional

from ..checks import forward_talks
from .checks import check_moe_settings
from .layer import moe_layers
from .router import CAPACITY_FACTOR_EVAL

AUX_WEIGHT = 0.01  # Colossal-AI's MoeLoss default


def moe_model_settings(cfg: Mapping) -> Optional[dict[str, Any]]:
    """MoeLayer's arguments from the config's keys, or None without NUM_EXPERTS."""
    check_moe_settings(cfg)  # also for a model of the user's own MoE layers, without NUM_EXPERTS
    if "NUM_EXPERTS" not in cfg:
        return None
    train = float(cfg.get("MOE_CAPACITY_FACTOR", 1.25))
    evaluation = float(cfg.get("MOE_EVAL_CAPACITY_FACTOR", max(CAPACITY_FACTOR_EVAL, train)))
    return dict(num_experts=cfg["NUM_EXPERTS"], top_k=cfg.get("MOE_TOP_K", 1),
                capacity_factor_train=train, capacity_factor_eval=evaluation)


def moe_aux_weight(cfg: Mapping) -> float:
    """MOE_AUX_WEIGHT: the load-balancing loss's weight in the training loss (0.01 by default)."""
    return float(cfg.get("MOE_AUX_WEIGHT", AUX_WEIGHT))


forward_talks(lambda model: "the model's MoE layers exchange tokens" if moe_layers(model) else None)
