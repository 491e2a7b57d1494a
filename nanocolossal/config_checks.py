"""Every check a config gets when it is loaded, in one list.

`load_config` (config.py) ends with `validate_config(cfg)`: the layout first (config.py's
`parallel_settings`: the sizes, each tensor mode's grid), then each feature's section in
SECTIONS' order -- a check returns at once where the config lacks its section -- then the keys
every script reads. Each raises ConfigError naming the key, what is wrong and what to write:

    section                                  check                          the feature
    fp16=dict(mode=..., ...)                 check_fp16_config              amp_settings.py
    zero=dict(level=..., ...)                check_zero                     zero/
    ddp=dict(...)                            check_ddp_config               ddp.py
    gradient_handler=[dict(type=...)]        check_gradient_handler_config  gradient_handler.py
    PIPELINE_SCHEDULE, NUM_MICRO_BATCHES...  check_pipeline_config          pipeline/schedules.py
    ACTIVATION_CHECKPOINT                    check_activation_checkpoint    activation_checkpoint.py
    parallel.tensor's attention=, SEQ_LEN    check_sequence_config          sequence.py
    parallel.moe, NUM_EXPERTS, MOE_*         check_moe                      moe/settings.py

Checks that need the model or the data run later, in `initialize` (engine/initialize.py's
check_inputs).
"""
from __future__ import annotations

import numbers
from typing import Any, Mapping

from .activation_checkpoint import MODES
from .amp_settings import check_fp16
from .config import AMP_TYPE, Config, ConfigError, is_positive_int, moe_size, parallel_settings
from .ddp import DDP_OPTIONS
from .moe.settings import moe_model_settings
from .pipeline.schedules import check_pipeline_config
from .sequence import ATTENTION, sequence_attention
from .tensor.zigzag import check_length
from .zero.settings import OFFLOAD, ZERO_KEYS, zero_settings

MOE_KEYS = ("NUM_EXPERTS", "MOE_TOP_K", "MOE_CAPACITY_FACTOR", "MOE_EVAL_CAPACITY_FACTOR",
            "MOE_AUX_WEIGHT")


def validate_config(cfg: Config) -> None:
    """Raise ConfigError for any value we understand but cannot honour."""
    parallel_settings(cfg)
    for check in SECTIONS:
        check(cfg)
    for key in ("gradient_accumulation", "BATCH_SIZE", "NUM_EPOCHS"):
        value = cfg.get(key)
        if value is not None and not is_positive_int(value):
            raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    if "debug" in cfg and not isinstance(cfg.debug, bool):
        raise ConfigError(f"debug must be True or False, got {cfg.debug!r}")
    for key in ("clip_grad_norm", "timeout"):
        value = cfg.get(key)
        positive = isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0
        if value is not None and not positive:
            raise ConfigError(f"{key} must be a positive number, got {value!r}")


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


def check_ddp_config(cfg: Config) -> None:
    ddp = cfg.get("ddp", {})
    if not isinstance(ddp, Mapping):
        raise ConfigError(f"ddp must be a dict of {', '.join(DDP_OPTIONS)}; got {ddp!r}")
    unknown = sorted(set(ddp) - set(DDP_OPTIONS))
    if unknown:
        raise ConfigError(f"ddp must be a dict of {', '.join(DDP_OPTIONS)}; got {ddp!r} "
                          f"(unknown: {', '.join(unknown)})")
    if ddp.get("compress") not in (None, "bf16", "fp16"):
        raise ConfigError(f"ddp.compress must be None, 'bf16' or 'fp16', got {ddp['compress']!r}")


def check_gradient_handler_config(cfg: Config) -> None:
    handlers = cfg.get("gradient_handler")
    if handlers is None:
        return
    entries = handlers if isinstance(handlers, (list, tuple)) else [handlers]
    extra = sorted({k for h in entries if isinstance(h, Mapping) for k in h} - {"type"})
    if extra:
        raise ConfigError(f"gradient_handler entries take only type, e.g. "
                          f"[dict(type='DataParallelGradientHandler')] (unknown: "
                          f"{', '.join(extra)})")
    types = [h.get("type") if isinstance(h, Mapping) else h for h in entries]
    # both all-reduce over gpc.gradient_group: data ranks, times sequence ranks if any
    if types not in (["DataParallelGradientHandler"], ["SequenceParallelGradientHandler"]):
        raise ConfigError(f"gradient_handler {types} is not supported; use "
                          f"[dict(type='DataParallelGradientHandler')] (or leave it out for "
                          f"overlapped DDP)")


def check_activation_checkpoint(cfg: Mapping) -> None:
    """ACTIVATION_CHECKPOINT: 'full', 'selective', a positive integer N, or None (off)."""
    mode = cfg.get("ACTIVATION_CHECKPOINT")
    if not (mode is None or mode in MODES or is_positive_int(mode)):
        raise ConfigError(f"ACTIVATION_CHECKPOINT={mode!r}: use 'full' (recompute each block), "
                          f"'selective' (recompute attention's softmax(q k^T) v), an integer N "
                          f"(every N-th block in full) or leave it out")


def check_sequence_config(cfg: Config) -> None:
    """parallel.tensor's attention= names a kind we have; all-to-all gives every sequence rank
    whole heads, so the config's HEADS (train_gpt.py's) must divide by N; ring attention's
    blocks are equal, so its SEQ_LEN must divide into 2N zig-zag stripes."""
    tensor = (cfg.get("parallel") or {}).get("tensor")
    if not isinstance(tensor, Mapping):
        return
    kind, n, heads = sequence_attention(cfg), tensor.get("size", 1), cfg.get("HEADS")
    if kind not in ATTENTION:
        raise ConfigError(f"parallel.tensor attention={kind!r} is not a kind of sequence-parallel "
                          f"attention; use 'ring' (the default) or 'all_to_all' (Ulysses)")
    if kind == "all_to_all" and isinstance(heads, int) and heads % n:
        raise ConfigError(f"parallel.tensor attention='all_to_all' gives each of {n} sequence "
                          f"ranks whole heads, but HEADS = {heads} does not divide by {n}; use "
                          f"HEADS a multiple of {n}, a size dividing {heads}, or "
                          f"attention='ring'")
    seq_len = cfg.get("SEQ_LEN")
    if tensor.get("mode") == "sequence" and kind == "ring" and isinstance(seq_len, int):
        check_length(seq_len, n, "SEQ_LEN = ")


def check_moe(cfg: Mapping) -> None:
    """Refuse a bad MoE config, or one that does not compose, by key."""
    ep = moe_size(cfg)
    if ep == 1 and not any(key in cfg for key in MOE_KEYS):
        return
    settings = moe_model_settings(cfg)
    if ep == 1:
        return
    _, T, mode, _, _ = parallel_settings(cfg)
    refused = {"tensor": T > 1 and mode != "sequence",
               "sequence": mode == "sequence", "zero": "zero" in cfg}
    why = {"tensor": f"experts are whole MLPs on their ranks, not {mode} shards",
           "sequence": "tokens are already split over the sequence ranks",
           "zero": "ZeRO shards every parameter over the data ranks, experts are not replicated "
                   "there"}
    for key, bad in refused.items():
        if bad:
            where = "parallel.tensor" if key in ("tensor", "sequence") else "zero"
            raise ConfigError(f"parallel.moe (expert parallelism x{ep}) does not combine with "
                              f"{where} ({key}): {why[key]}; remove one of them")
    if settings is not None:
        E = settings["num_experts"]
        if E % ep and ep % E:
            raise ConfigError(f"NUM_EXPERTS={E} does not fit parallel.moe size {ep}: one must "
                              f"divide the other (E/EP experts per rank, or each expert on EP/E "
                              f"ranks)")


def check_fp16_config(cfg: Mapping[str, Any]) -> None:
    """fp16=dict(mode=AMP_TYPE.X, ...), checked when a config is loaded."""
    fp16 = cfg.get("fp16")
    if fp16 is None:
        return
    if not isinstance(fp16, Mapping) or "mode" not in fp16:
        raise ConfigError(f"fp16 must be a dict with a mode, e.g. dict(mode=AMP_TYPE.TORCH), "
                          f"got {fp16!r}")
    try:
        AMP_TYPE.parse(fp16["mode"])
    except ValueError as e:
        raise ConfigError(f"fp16.mode: {e}") from None
    check_fp16(fp16)


SECTIONS = (check_fp16_config, check_zero, check_ddp_config, check_gradient_handler_config,
            check_pipeline_config, check_activation_checkpoint, check_sequence_config, check_moe)
