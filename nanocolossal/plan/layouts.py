"""From a config file (or flags) to the model and its layout, and every other layout of the same
ranks the model allows (`--search`). Bad input is one line saying what to change, as config.py's
checks say it: a world size no layout divides, heads a tensor mode cannot split, an unknown key.
"""
from __future__ import annotations

import difflib
import os
from dataclasses import replace
from typing import Any, Iterator, Mapping, Optional

from ..config import Config, ConfigError, parallel_settings
from ..config_checks import validate_config, zero_settings
from ..pipeline.plan import check_sizes
from ..pipeline.steps import PlanError
from .formulas import Layout, block_checkpoint
from .model import GPT, grid

KNOWN = {  # the config keys the planner reads, or that change nothing it counts
    "BATCH_SIZE", "NUM_EPOCHS", "SEQ_LEN", "NUM_MICRO_BATCHES", "NUM_CHUNKS",
    "PIPELINE_SCHEDULE", "ACTIVATION_CHECKPOINT", "DIM", "DEPTH", "HEADS", "MLP_RATIO",
    "DROPOUT", "VOCAB", "NUM_EXPERTS", "MOE_TOP_K", "MOE_CAPACITY_FACTOR",
    "MOE_EVAL_CAPACITY_FACTOR", "MOE_AUX_WEIGHT", "MOE_MODEL_PARALLEL_SIZE", "TENSOR_SHAPE",
    "ATTENTION", "parallel", "zero", "fp16", "gradient_accumulation", "clip_grad_norm",
    "gradient_handler", "timeout", "debug", "sync_bn", "OPTIMIZER", "PARAM_BYTES",
}


def _check_keys(cfg: Mapping) -> None:
    for key in cfg:
        if key not in KNOWN and key.upper() == key:
            near = difflib.get_close_matches(key, sorted(KNOWN), n=1)
            hint = f"did you mean {near[0]}?" if near else f"known: {', '.join(sorted(KNOWN))}"
            raise ConfigError(f"unknown key {key}; {hint}")


def model_of(cfg: Mapping) -> GPT:
    """train_gpt.py's GPT from the config's capitals (its defaults where absent)."""
    return GPT(vocab=cfg.get("VOCAB", 256), seq=cfg.get("SEQ_LEN", 64), dim=cfg.get("DIM", 128),
               depth=cfg.get("DEPTH", 4), heads=cfg.get("HEADS", 4),
               mlp_ratio=cfg.get("MLP_RATIO", 4), experts=cfg.get("NUM_EXPERTS", 0),
               top_k=cfg.get("MOE_TOP_K", 1), capacity=cfg.get("MOE_CAPACITY_FACTOR", 1.25),
               attention=cfg.get("ATTENTION", "fused"))


def read(config: Any, **overrides: Any) -> Config:
    """The config as load_config reads it, with the scripts' checks (validate_config, no torch);
    check() below refuses what the planner cannot count."""
    cfg = Config.from_file(config) if isinstance(config, (str, os.PathLike)) else Config(config)
    cfg.update({k: v for k, v in overrides.items() if v is not None})
    validate_config(cfg)
    return cfg


def load(config: Any, world: int, **overrides: Any) -> tuple[GPT, Layout]:
    """(model, layout) of a config file / dict on `world` ranks; ConfigError saying what to
    change where it cannot run."""
    cfg = read(config, **overrides)
    _check_keys(cfg)
    P, T, mode, _, depth = parallel_settings(cfg)
    zero = zero_settings(cfg)[0] if cfg.get("zero") else {}  # either spelling, as the scripts
    level = zero.get("level", 0)
    offload = zero.get("offload") == "cpu"
    fp16 = cfg.get("fp16") or {}
    amp = None
    if fp16 and fp16.get("enabled", True):
        mode_name = str(getattr(fp16.get("mode"), "name", fp16.get("mode"))).upper()
        amp = {"TORCH": "O1", "NAIVE": "O2"}.get(mode_name.split(".")[-1],
                                                 fp16.get("opt_level", "O1"))
        amp = None if amp == "O0" else amp  # apex's O0: the fp32 reference
    dtype = str(fp16.get("dtype", "float16"))
    checkpoint = cfg.get("ACTIVATION_CHECKPOINT")
    tensor = (cfg.get("parallel") or {}).get("tensor") or {}
    moe = (cfg.get("parallel") or {}).get("moe", 1)
    lay = Layout(world=world, pipeline=P, tensor=T, mode=mode if T > 1 else None, depth=depth or 1,
                 attention=tensor.get("attention", "ring") if isinstance(tensor, Mapping)
                 else "ring",
                 zero=level, offload=offload, amp=amp,
                 checkpoint=checkpoint,
                 schedule=cfg.get("PIPELINE_SCHEDULE") or (
                     "interleaved" if cfg.get("NUM_CHUNKS", 1) > 1 else "1f1b"),
                 micro_batches=cfg.get("NUM_MICRO_BATCHES", 1) if P > 1 else 1,
                 chunks=cfg.get("NUM_CHUNKS", 1) if P > 1 else 1,
                 accumulation=cfg.get("gradient_accumulation", 1),
                 ep=moe.get("size", 1) if isinstance(moe, Mapping) else moe,
                 batch=cfg.get("BATCH_SIZE", 8), half_bytes=2 if "16" in dtype else 4,
                 param_bytes=cfg.get("PARAM_BYTES", 4), optimizer=cfg.get("OPTIMIZER", "adamw"),
                 clip="clip_grad_norm" in cfg, handler=bool(cfg.get("gradient_handler")))
    m = model_of(cfg)
    _check_unplanned(cfg, lay)
    check(m, lay)
    return m, lay


def _check_unplanned(cfg: Mapping, lay: Layout) -> None:
    """What the planner does not count: one line saying so, never a silent wrong answer."""
    for key in ("BATCH_SIZE", "SEQ_LEN", "DIM", "DEPTH", "HEADS", "MLP_RATIO", "VOCAB"):
        value = cfg.get(key, 1)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    if cfg.get("DROPOUT", 0):
        raise ConfigError(f"DROPOUT={cfg['DROPOUT']}: the planner does not count the dropout "
                          f"masks autograd keeps (a byte per element dropped from); plan with "
                          f"DROPOUT=0 and add them")
    if lay.optimizer not in ("adamw", "sgd"):
        raise ConfigError(f"OPTIMIZER={lay.optimizer!r}: the planner counts 'adamw' (two "
                          f"states) or 'sgd' (momentum)")


def check(m: GPT, lay: Layout) -> None:
    """ConfigError, one line, for a layout the model or the ranks do not allow."""
    P, T, world = lay.pipeline, lay.tensor, lay.world
    if world % (P * T):
        raise ConfigError(f"world size {world} is not a multiple of pipeline {P} x tensor {T}; "
                          f"use --world {max(P * T, world // (P * T) * P * T)} or change "
                          f"parallel")
    if P * lay.chunks > m.layers:
        raise ConfigError(f"the GPT has {m.layers} layers (DEPTH + 2) but pipeline {P} x "
                          f"NUM_CHUNKS {lay.chunks} needs as many parts; use fewer stages")
    if P > 1:
        try:
            check_sizes(lay.schedule, P, lay.micro_batches, lay.chunks)
        except PlanError as e:
            raise ConfigError(str(e)) from None
    q = grid(lay.mode, T, lay.depth)
    split = {"1d": T, "2d": q, "2.5d": q, "3d": q}.get(lay.mode, 1)
    if lay.mode == "sequence" and lay.attention == "all_to_all":
        split = T
    if m.heads % split:
        raise ConfigError(f"HEADS={m.heads} cannot be split over {split} ranks by tensor mode "
                          f"{lay.mode!r}; use HEADS a multiple of {split} or another tensor size")
    if m.dim % m.heads:
        raise ConfigError(f"DIM={m.dim} is not a multiple of HEADS={m.heads}")
    for name, n, by in (("VOCAB", m.vocab, split), ("DIM", m.dim, q * q if lay.mode == "3d"
                                                     else split)):
        if n % by:
            raise ConfigError(f"{name}={n} is not a multiple of {by}, which tensor mode "
                              f"{lay.mode!r} of size {T} splits it by; pad {name} to "
                              f"{-(-n // by) * by}")
    if lay.mode == "sequence" and m.seq % (2 * T):
        raise ConfigError(f"SEQ_LEN={m.seq} must be a multiple of 2 x {T} sequence ranks (the "
                          f"zig-zag split, tensor/zigzag.py); use {-(-m.seq // (2 * T)) * 2 * T}")
    micro = lay.micro_batches if P > 1 else lay.accumulation
    if lay.batch % micro:
        raise ConfigError(f"BATCH_SIZE={lay.batch} per data rank is not a multiple of "
                          f"{micro} micro-batches; use {-(-lay.batch // micro) * micro}")
    if lay.zero == 3 and P > 1:
        raise ConfigError("zero level 3 does not compose with a pipeline; use zero level 1 or 2")
    if lay.checkpoint and lay.schedule in ("zero_bubble", "zbv") and P > 1:
        raise ConfigError(f"activation checkpointing cannot split into {lay.schedule}'s B and "
                          f"W; use PIPELINE_SCHEDULE='1f1b'")
    if lay.offload and not lay.zero:
        raise ConfigError("offload needs zero level 1, 2 or 3")
    if P > 1 and lay.accumulation > 1:
        raise ConfigError("gradient_accumulation with a pipeline: its micro-batches already "
                          "accumulate; use NUM_MICRO_BATCHES")
    if m.experts and lay.mode:
        raise ConfigError(f"an MoE layer holds whole expert MLPs and does not split over tensor "
                          f"mode {lay.mode!r}; use parallel.moe instead of parallel.tensor")
    if m.experts and any(block_checkpoint(lay, b + 1) == "full"
                         for b in range(m.depth) if m.is_moe(b)):
        raise ConfigError("ACTIVATION_CHECKPOINT would recompute an MoE block whole, but its "
                          "load-balancing loss is kept from the forward; use 'selective'")
    if lay.ep > 1 and lay.zero:
        raise ConfigError("zero shards every parameter over the data ranks, experts are not; "
                          "use expert parallelism (parallel.moe) without zero, or zero alone")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tensor_modes(T: int) -> Iterator[tuple[Optional[str], int]]:
    if T == 1:
        yield None, 1
        return
    yield "1d", 1
    yield "sequence", 1
    q = round(T ** 0.5)
    if q * q == T:
        yield "2d", 1
    for d in range(2, T):
        q = round((T / d) ** 0.5)
        if q > 1 and q * q * d == T:
            yield "2.5d", d
    c = round(T ** (1 / 3))
    if c > 1 and c ** 3 == T:
        yield "3d", 1


def search(m: GPT, base: Layout) -> Iterator[Layout]:
    """Every layout of base.world ranks the model allows: data x pipeline x tensor mode x ZeRO
    x offload x activation checkpointing x schedule, the global batch kept."""
    global_batch = base.batch * base.data
    for P in _divisors(base.world):
        if P > m.layers:
            continue
        for T in _divisors(base.world // P):
            D = base.world // (P * T)
            if global_batch % D:
                continue
            for mode, depth in _tensor_modes(T):
                for schedule, V in (_schedules(P)):
                    M = max(base.micro_batches, P) if P > 1 else 1
                    if V == 2 and schedule == "interleaved":
                        M = -(-M // P) * P
                    if schedule == "zbv":
                        M = max(M, 2 * P - 1)
                    for zero in (0, 1, 2, 3):
                        for offload in ((False, True) if zero else (False,)):
                            for ckpt in (None, "full"):
                                lay = replace(base, pipeline=P, tensor=T, mode=mode,
                                              depth=depth, zero=zero if D > 1 else 0,
                                              offload=offload and D > 1, checkpoint=ckpt,
                                              schedule=schedule, chunks=V, micro_batches=M,
                                              batch=global_batch // D,
                                              accumulation=base.accumulation)
                                if (zero or offload) and D == 1:
                                    continue
                                try:
                                    check(m, lay)
                                except ConfigError:
                                    continue
                                yield lay


def _schedules(P: int) -> list[tuple[str, int]]:
    if P == 1:
        return [("1f1b", 1)]
    return [("1f1b", 1), ("gpipe", 1), ("interleaved", 2), ("zero_bubble", 1), ("zbv", 2)]
