"""The zero=dict(...) config, checked when the config is loaded (registered with config).

Two spellings. Colossal-AI's first: zero=dict(level=1|2|3, reduce_bucket_size_mb=25,
overlap_communication=True). Colossal-AI v0.1's ShardedModelV2 / ShardedOptimizerV2 arguments:
zero=dict(model_config=dict(...), optimizer_config=dict(...)), which is level 3 here. Of its
keys, the loss-scaler ones map onto our scaler (they apply with fp16=dict(mode=AMP_TYPE.TORCH,
dtype='float16')); the others name machinery we do not have and are logged as such.

check_optimizer: what initialize refuses -- an optimizer that cannot step pieces of parameters.
"""
from __future__ import annotations

import numbers
from typing import Any, Mapping, Optional

import torch
from torch import nn

from ..amp import MixedPrecisionOptimizer
from ..checks import forward_talks
from ..config import AMP_TYPE, Config, ConfigError, parallel_settings, register_check
from ..context import gpc

ZERO_KEYS = ("level", "reduce_bucket_size_mb", "overlap_communication")
# v0.1 optimizer_config -> DynamicLossScaler's arguments (amp_scaler.py)
V01_SCALER = {"initial_scale": "init_scale", "min_scale": "min_scale",
              "growth_factor": "growth_factor", "backoff_factor": "backoff_factor",
              "growth_interval": "growth_interval", "hysteresis": "hysteresis",
              "max_scale": "max_scale"}
# v0.1 keys with no meaning here, and why
V01_NO_MEANING = {
    "shard_strategy": "parameters are always flattened per unit and cut in N equal slices",
    "reduce_scatter_bucket_size_mb": "level 3 reduces each unit's gradients as one piece",
    "fp32_reduce_scatter": "gradients are reduced in the parameters' dtype",
    "gradient_predivide_factor": "gradients are divided by N before they are summed",
    "reuse_fp16_shard": "gradient shards are kept apart from the parameter shards",
    "offload_config": "no CPU offload here",
    "use_memory_tracer": "no memory tracer here",
    "warmup_non_model_data_ratio": "no memory tracer here",
    "gpu_margin_mem_ratio": "no CPU offload of optimizer states here",
}
PLACEMENTS = ("cuda", "cpu", "auto")


def zero_settings(cfg: Config) -> tuple[dict, dict, list[str]]:
    """(zero=dict(level, ...) settings, loss-scaler arguments, notes for the log) of either
    spelling; the v0.1 one is checked here."""
    zero = cfg.zero
    if "model_config" not in zero and "optimizer_config" not in zero:
        return dict(zero), {}, []
    unknown = sorted(set(zero) - {"model_config", "optimizer_config"})
    if unknown:
        raise ConfigError(f"unknown zero key(s) {unknown} beside model_config/optimizer_config "
                          f"(Colossal-AI v0.1's spelling, level 3 here)")
    model, opt = zero.get("model_config", {}) or {}, zero.get("optimizer_config", {}) or {}
    for name, part, known in (("model_config", model, V01_NO_MEANING.keys() | {
            "tensor_placement_policy"}), ("optimizer_config", opt, V01_NO_MEANING.keys() |
                                          V01_SCALER.keys())):
        bad = sorted(set(part) - set(known)) if isinstance(part, Mapping) else None
        if bad is None or bad:
            raise ConfigError(f"zero.{name}: unknown key(s) {bad if bad else part!r}; Colossal-AI "
                              f"v0.1's keys are {', '.join(sorted(known))}")
    notes = [f"zero: {key} ignored: {V01_NO_MEANING[key]}" for key in (*model, *opt)
             if key in V01_NO_MEANING]
    placement = model.get("tensor_placement_policy", "cuda")
    if placement not in PLACEMENTS:
        raise ConfigError(f"zero.model_config.tensor_placement_policy must be one of "
                          f"{', '.join(PLACEMENTS)}, got {placement!r}")
    if placement != "cuda":
        notes.append(f"zero: tensor_placement_policy={placement!r} ignored: shards stay on the "
                     f"model's device (no CPU offload here)")
    scaler = {V01_SCALER[k]: v for k, v in opt.items() if k in V01_SCALER}
    if scaler and not cfg.get("fp16"):
        notes.append(f"zero: optimizer_config's {', '.join(k for k in opt if k in V01_SCALER)} "
                     f"ignored: they set the loss scaler of fp16=dict(mode=AMP_TYPE.TORCH, "
                     f"dtype='float16'), and this config has no fp16")
        scaler = {}
    return dict(level=3), scaler, notes


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
    if level == 1 and zero.get("overlap_communication") is False:
        raise ConfigError("zero.overlap_communication=False applies to levels 2 and 3; level 1 "
                          "reduces gradients with DDP, which always overlaps: remove it")
    if cfg.get("gradient_handler"):
        raise ConfigError("zero and gradient_handler both say how gradients are reduced; remove "
                          "gradient_handler (zero reduces them itself)")
    if P > 1 and level == 3:  # 1F1B runs a stage's forward M times before its first backward
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
            f"we can step piece by piece (each rank steps only slices of parameters, so an update "
            f"that needs a whole parameter -- LAMB's or LARS's trust ratio -- would be wrong); use "
            f"one of {', '.join(c.__name__ for c in ELEMENTWISE)}, or remove zero")
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
