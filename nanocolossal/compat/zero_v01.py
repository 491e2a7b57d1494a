"""Colossal-AI v0.1's ZeRO spelling: ShardedModelV2 / ShardedOptimizerV2's arguments.

    zero = dict(model_config=dict(tensor_placement_policy='cuda', shard_strategy=...),
                optimizer_config=dict(initial_scale=2**5, ...))

is level 3 here (config_checks.py's zero_settings); tensor_placement_policy='cpu' is offload='cpu'
(zero/offload.py). Of its other keys, the loss-scaler ones map onto our scaler (they
apply with fp16=dict(mode=AMP_TYPE.TORCH, dtype='float16')); the others name machinery we do not
have and are logged as such; an unknown key is an error naming the known ones.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..config import ConfigError

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
    "offload_config": "CPU offload is tensor_placement_policy='cpu'",
    "use_memory_tracer": "no memory tracer here",
    "warmup_non_model_data_ratio": "no memory tracer here",
    "gpu_margin_mem_ratio": "offloaded optimizer states stay on the CPU",
}
PLACEMENTS = ("cuda", "cpu", "auto")


def v01_settings(zero: Mapping[str, Any], has_fp16: bool) -> tuple[dict, dict, list[str]]:
    """(dict(level=3), loss-scaler arguments, notes for the log) of a v0.1 zero dict."""
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
    if placement == "auto":
        notes.append("zero: tensor_placement_policy='auto' ignored: shards stay on the model's "
                     "device ('cpu' offloads the masters and optimizer state)")
    scaler = {V01_SCALER[k]: v for k, v in opt.items() if k in V01_SCALER}
    if scaler and not has_fp16:
        notes.append(f"zero: optimizer_config's {', '.join(k for k in opt if k in V01_SCALER)} "
                     f"ignored: they set the loss scaler of fp16=dict(mode=AMP_TYPE.TORCH, "
                     f"dtype='float16'), and this config has no fp16")
        scaler = {}
    return dict(level=3, offload="cpu" if placement == "cpu" else None), scaler, notes
