"""Every check a config gets when it is loaded, in one list.

`load_config` (config.py) ends with `validate_config(cfg)`: the layout first (`check_parallel`:
the sizes, each tensor mode's grid), then each feature's section in
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

Checks needing the model or the data run later, in `initialize` (engine/checks.py's check_inputs).
Nothing here imports torch, so that `nanocolossal plan` runs the same checks (plan/layouts.py's
read): a feature's config words (fp16's keys, ZERO_KEYS, DDP_OPTIONS) live here, read by it.
"""
from __future__ import annotations

import math
import numbers
import sys
from typing import Any, Mapping

from .compat.apex import NO_EFFECT, RENAMED
from .compat.zero_v01 import v01_settings
from .config import AMP_TYPE, ConfigError, ep_size, is_positive_int, parallel_settings, size_of
from .moe.checks import check_moe_settings
from .pipeline.plan_checks import check_pipeline_config

MOE_KEYS = ("NUM_EXPERTS", "MOE_TOP_K", "MOE_CAPACITY_FACTOR", "MOE_EVAL_CAPACITY_FACTOR",
            "MOE_AUX_WEIGHT")


def validate_config(cfg: Mapping) -> None:
    """Raise ConfigError for any value we understand but cannot honour."""
    check_parallel(cfg)
    for check in SECTIONS:
        check(cfg)
    for key in ("gradient_accumulation", "BATCH_SIZE", "NUM_EPOCHS"):
        value = cfg.get(key)
        if value is not None and not is_positive_int(value):
            raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    if "debug" in cfg and not isinstance(cfg["debug"], bool):
        raise ConfigError(f"debug must be True or False, got {cfg['debug']!r}")
    for key in ("clip_grad_norm", "timeout"):
        value = cfg.get(key)
        positive = isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0
        if value is not None and not positive:
            raise ConfigError(f"{key} must be a positive number, got {value!r}")


# the parallel table's keys: each a layout axis (layout.py)
PARALLEL_KEYS = ("pipeline", "data", "tensor", "sequence", "moe")
TENSOR_MODES = ("1d", "2d", "2.5d", "3d", "sequence")


def check_parallel(cfg: Mapping) -> None:
    """`parallel`: known keys, positive sizes, a tensor mode we have and its grid's shape."""
    parallel = cfg.get("parallel") or {}
    if not isinstance(parallel, Mapping):
        raise ConfigError(f"parallel must be a dict such as dict(pipeline=2), got {parallel!r}")
    unknown = set(parallel) - set(PARALLEL_KEYS)
    if unknown:
        raise ConfigError(f"unknown parallel key(s) {sorted(unknown)}; supported: "
                          f"{', '.join(PARALLEL_KEYS)} (data size is world // (pipeline * "
                          f"tensor) unless given)")
    if "sequence" in parallel and _checked_size(parallel["sequence"], "sequence") > 1:
        raise ConfigError("sequence parallelism is written parallel=dict(tensor=dict(size=N, "
                          "mode='sequence')), as Colossal-AI: the sequence ranks take the tensor "
                          "ranks' place, so it combines with pipeline and data, not with a "
                          "1d/2d tensor split; remove parallel.sequence")
    _checked_size(parallel.get("pipeline", 1), "pipeline")
    if parallel.get("data") is not None:
        _checked_size(parallel["data"], "data")
    tensor = parallel.get("tensor", 1)
    mode = tensor.get("mode") if isinstance(tensor, Mapping) else None
    if mode is not None and not isinstance(mode, str):
        raise ConfigError(f"parallel.tensor mode must be a string such as '1d', got {mode!r}")
    # (attention: check_sequence_config checks it)
    extra = {"2.5d": ("depth",), "sequence": ("attention",)}.get(mode, ())
    T = _checked_size(tensor, "tensor", ("size", "mode", *extra))
    if (T > 1 or mode is not None) and mode not in TENSOR_MODES:  # a typo even at size 1
        raise ConfigError(f"parallel.tensor needs mode='1d', '2d', '2.5d', '3d' or 'sequence' "
                          f"(got {mode!r}), e.g. tensor=dict(size={T}, mode='1d')")
    if T > 1 and mode in ("2d", "2.5d", "3d"):
        check_grid(T, mode, tensor.get("depth") if mode == "2.5d" else 1)


def _checked_size(value: Any, key: str, known: tuple[str, ...] = ("size",)) -> int:
    """A size, as N or dict(size=N, ...); a key the dict does not know (a misspelt one, or one
    for another mode) is refused."""
    unknown = sorted(set(value) - set(known)) if isinstance(value, Mapping) else []
    if unknown:
        raise ConfigError(f"unknown parallel.{key} key(s) {unknown}; parallel.{key} "
                          f"understands {', '.join(known)}")
    size = size_of(value)
    if not is_positive_int(size):
        raise ConfigError(f"parallel.{key} must be a positive "
                          f"integer (or dict(size=N)), got {value!r}")
    return size


def check_grid(T: int, mode: str, depth: Any = 1) -> None:
    """A 2d grid (T = q * q), a 2.5d stack of grids (T = q * q * depth) or a 3d cube
    (T = q ** 3), or a ConfigError naming the numbers."""
    if mode == "3d":
        q = round(T ** (1 / 3))
        if q ** 3 != T:
            below = max(n for n in range(1, q + 2) if n ** 3 <= T)
            raise ConfigError(f"parallel.tensor size {T} is not a cube, which mode='3d' needs "
                              f"(a q x q x q cube); use size {below ** 3} or {(below + 1) ** 3}")
        return
    if mode == "2.5d" and not is_positive_int(depth):
        raise ConfigError(f"parallel.tensor mode='2.5d' needs depth, a positive integer (the "
                          f"number of stacked q x q grids), got {depth!r}; e.g. "
                          f"tensor=dict(size={T}, mode='2.5d', depth=2)")
    q = math.isqrt(T // depth)
    if mode == "2d" and q * q != T:
        raise ConfigError(f"parallel.tensor size {T} is not a perfect square, which mode='2d' "
                          f"needs (a q x q grid); use size {q * q} or {(q + 1) ** 2}")
    if q * q * depth != T:
        raise ConfigError(f"parallel.tensor size {T} is not q * q * depth for depth {depth}, "
                          f"which mode='2.5d' needs ({depth} stacked q x q grids); use size "
                          f"{max(q, 1) ** 2 * depth} or {(q + 1) ** 2 * depth}")


def check_world(cfg: Mapping, world_size: int) -> None:
    """At launch, once the world size is known: W = D * P * T, parallel.data (if given) is that
    D, and EP divides D (expert groups are carved out of the data ranks)."""
    P, T, _, wanted, _ = parallel_settings(cfg)
    if world_size % (P * T) != 0:
        raise ConfigError(f"world size {world_size} is not divisible by pipeline x tensor = {P} "
                          f"x {T} = {P * T}; launch a multiple of {P * T} processes or change "
                          f"parallel")
    D = world_size // (P * T)
    if wanted is not None and wanted != D:
        raise ConfigError(f"parallel.data={wanted} but world size {world_size} // (pipeline x "
                          f"tensor) = {D}; drop parallel.data (it is inferred) or launch "
                          f"{wanted * P * T} processes")
    ep = ep_size(cfg)
    if D % ep:
        step = ep * P * T
        raise ConfigError(f"parallel.moe size {ep} does not divide the data-parallel size "
                          f"{D} (world size {world_size}): expert parallelism is carved "
                          f"out of the data ranks; launch a multiple of {step} processes "
                          f"(e.g. {step * (D // ep + 1)}), or use a moe size dividing {D}")


ZERO_KEYS = ("level", "reduce_bucket_size_mb", "overlap_communication", "offload")


def zero_settings(cfg: Mapping) -> tuple[dict, dict, list[str]]:
    """(zero=dict(level, ...) settings, loss-scaler arguments, notes for the log) of either
    spelling; the v0.1 one is checked here."""
    zero = cfg["zero"]
    if "model_config" not in zero and "optimizer_config" not in zero:
        return dict(zero), {}, []
    return v01_settings(zero, bool(cfg.get("fp16")))


def check_zero(cfg: Mapping) -> None:
    """zero=dict(level=1|2|3, reduce_bucket_size_mb=25, overlap_communication=True), or v0.1's
    dict(model_config=..., optimizer_config=...)."""
    if "zero" not in cfg:
        return
    P = parallel_settings(cfg)[0]
    if not isinstance(cfg["zero"], Mapping):
        raise ConfigError(f"zero must be a dict such as dict(level=2), got {cfg['zero']!r}")
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
    offload = zero.get("offload")  # where the masters and optimizer state live (offload.py)
    if offload not in (None, "cpu"):
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
        # O3: no fp32 masters to shard, the state would be half
        if {AMP_TYPE.TORCH: "O1", AMP_TYPE.NAIVE: "O2"}.get(mode, fp16.get("opt_level")) == "O3":
            raise ConfigError(f"zero with fp16 {mode.name} O3 (half parameters, no fp32 master "
                              f"weights) is not supported; use O2 (mode=AMP_TYPE.NAIVE) with zero, "
                              f"or fp16=dict(mode=AMP_TYPE.TORCH) (O1)")


DDP_OPTIONS = ("bucket_cap_mb", "gradient_as_bucket_view", "compress")  # config's ddp=dict(...)


def check_ddp_config(cfg: Mapping) -> None:
    ddp = cfg.get("ddp", {})
    unknown = sorted(set(ddp) - set(DDP_OPTIONS)) if isinstance(ddp, Mapping) else None
    if unknown != []:  # not a dict, or keys DDP does not take
        raise ConfigError(f"ddp must be a dict of {', '.join(DDP_OPTIONS)}; got {ddp!r}"
                          + (f" (unknown: {', '.join(unknown)})" if unknown else ""))
    if ddp.get("compress") not in (None, "bf16", "fp16"):
        raise ConfigError(f"ddp.compress must be None, 'bf16' or 'fp16', got {ddp['compress']!r}")
    level = zero_settings(cfg)[0].get("level", 0) if cfg.get("zero") else 0  # either spelling
    instead = ("gradient_handler" if cfg.get("gradient_handler")
               else f"zero level {level}" if level >= 2 else None)
    if ddp and instead:  # their gradients never pass through DDP
        raise ConfigError(f"ddp={dict(ddp)} sets DDP's options, but {instead} reduces the "
                          f"gradients without DDP; leave ddp out (zero level 1 takes "
                          f"reduce_bucket_size_mb)")


def check_gradient_handler_config(cfg: Mapping) -> None:
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


SEQUENCE_ATTENTION = ("ring", "all_to_all")  # parallel.tensor attention=: how ranks meet


def check_sequence_config(cfg: Mapping) -> None:
    """parallel.tensor's attention= names a kind we have; all-to-all gives every sequence rank
    whole heads, so the config's HEADS (train_gpt.py's) must divide by N; ring attention's
    blocks are equal, so its SEQ_LEN must divide into 2N zig-zag stripes."""
    tensor = (cfg.get("parallel") or {}).get("tensor")
    if not isinstance(tensor, Mapping):
        return
    kind, n, heads = tensor.get("attention", "ring"), tensor.get("size", 1), cfg.get("HEADS")
    if kind not in SEQUENCE_ATTENTION:
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


def check_length(length: int, n: int, what: str = "") -> None:
    """Ring attention's length: 2n equal stripes (`what`: how the message names the length;
    before launch, as a config is checked, the error hook names the rank)."""
    if length % (2 * n):
        lo, hi = length // (2 * n) * 2 * n, (length // (2 * n) + 1) * 2 * n
        dist = sys.modules.get("torch.distributed")  # never imported: no process group either
        rank = f"[rank {dist.get_rank()}] " if dist and dist.is_initialized() else ""
        raise ConfigError(f"{rank}sequence length {what}{length} does not split into 2 x {n} "
                          f"zig-zag stripes for {n} sequence-parallel ranks; use a multiple of "
                          f"{2 * n} (nearest: "
                          f"{', '.join(str(x) for x in (lo, hi) if x > 0)})")


def check_moe(cfg: Mapping) -> None:
    """Refuse a bad MoE config, or one that does not compose, by key."""
    moe = (cfg.get("parallel") or {}).get("moe", 1)
    if isinstance(moe, Mapping) and set(moe) - {"size"}:
        raise ConfigError(f"parallel.moe takes only size (the expert-parallel size EP), got "
                          f"unknown key(s) {sorted(set(moe) - {'size'})}; e.g. moe=dict(size=2)")
    ep = ep_size(cfg)
    if not is_positive_int(ep):
        raise ConfigError(f"parallel.moe size must be a positive integer (moe=dict(size=EP)), "
                          f"got {ep!r}")
    if ep == 1 and not any(key in cfg for key in MOE_KEYS):
        return
    check_moe_settings(cfg)
    if ep == 1:
        return
    _, T, mode, _, _ = parallel_settings(cfg)
    why = None
    if mode == "sequence":
        why = "parallel.tensor (sequence): tokens are already split over the sequence ranks"
    elif T > 1:
        why = f"parallel.tensor (tensor): experts are whole MLPs on their ranks, not {mode} shards"
    elif "zero" in cfg:
        why = ("zero (zero): ZeRO shards every parameter over the data ranks, experts are not "
               "replicated there")
    if why:
        raise ConfigError(f"parallel.moe (expert parallelism x{ep}) does not combine with {why}; "
                          f"remove one of them")
    E = cfg.get("NUM_EXPERTS")
    if E is not None and E % ep and ep % E:
        raise ConfigError(f"NUM_EXPERTS={E} does not fit parallel.moe size {ep}: one must divide "
                          f"the other (E/EP experts per rank, or each expert on EP/E ranks)")


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


# the scaler's own arguments (amp_scaler.DynamicLossScaler), accepted in every mode
SCALER = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "hysteresis",
          "min_scale", "max_scale", "max_consecutive_overflows")
MODE_KEYS = {AMP_TYPE.TORCH: (), AMP_TYPE.NAIVE: (),  # beyond SCALER, RENAMED, mode, dtype, enabled
             AMP_TYPE.APEX: ("opt_level", "loss_scale", "keep_batchnorm_fp32", "master_weights")}


def check_fp16(fp16: Mapping[str, Any]) -> None:
    """fp16=dict(...): refuse keys its mode does not take, naming them and what to do."""
    mode = AMP_TYPE.parse(fp16["mode"])
    allowed = {"mode", "dtype", "enabled", *SCALER, *RENAMED, *MODE_KEYS[mode]}
    for key in [k for k in fp16 if k not in allowed]:  # the first such key
        hint = NO_EFFECT.get(key, f"{mode.name} takes {', '.join(sorted(allowed - {'mode'}))}")
        raise ConfigError(f"fp16.{key} has no effect with mode=AMP_TYPE.{mode.name}: {hint}")
    dtype = fp16.get("dtype")  # a name, or a torch.dtype: known by its repr, without torch
    if dtype not in (None, "float16", "bfloat16") and repr(dtype) not in ("torch.float16",
                                                                          "torch.bfloat16"):
        raise ConfigError(f"fp16.dtype must be 'float16' or 'bfloat16', got {dtype!r}")
    level = fp16.get("opt_level", "O1")
    if "master_weights" in fp16 and fp16["master_weights"] != (level == "O2"):
        raise ConfigError(f"fp16.master_weights={fp16['master_weights']} with opt_level {level}: "
                          f"here only O2 keeps fp32 master weights; use opt_level 'O2' for "
                          f"masters, 'O1' or 'O3' without, and leave master_weights out")


def check_activation_checkpoint(cfg: Mapping) -> None:
    """ACTIVATION_CHECKPOINT: 'full', 'selective', a positive integer N, or None (off)."""
    mode = cfg.get("ACTIVATION_CHECKPOINT")
    if not (mode in (None, "full", "selective") or is_positive_int(mode)):
        raise ConfigError(f"ACTIVATION_CHECKPOINT={mode!r}: use 'full' (recompute each block), "
                          f"'selective' (recompute attention's softmax(q k^T) v), an integer N "
                          f"(every N-th block in full) or leave it out")


SECTIONS = (check_fp16_config, check_zero, check_ddp_config, check_gradient_handler_config,
            check_pipeline_config, check_activation_checkpoint, check_sequence_config, check_moe)
