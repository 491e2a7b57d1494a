"""A checkpoint's files offline: read them safely, merge them into the plain model, cut it again.

checkpoint.py writes one file per (pipeline stage, tensor rank). This module needs no running
job: it finds the files of one save (`save_files`), reads them without trusting them
(`read_file`), and turns any layout's files into the plain model's state_dict
(`merge_checkpoint`), which `load_plain_state_dict` cuts into any other layout.

Reading without running code. A .pt file is a pickle, and unpickling may call any function
the file names: `torch.load(weights_only=False)` of a file from a shared disk would run
whatever its author put there. So files are read with `weights_only=True`, whose unpickler
builds only tensors, numbers, strings and containers, plus the few types our files really
hold, allow-listed here: numpy's RNG state is an array of uint32 (`_SAFE_GLOBALS`). Python's
RNG state, torch's generator states (byte tensors), optimizer, scheduler and loss-scaler
state dicts are already plain data. A file that names anything else is refused with an
error naming it; `trusted=True` reads a file you trust (your own objects in **extra) as
before.

Merging. Tensor-parallel files record how each parameter was cut (`tensor_splits`, keyed by
the plain model's keys) and the plain shape, so the blocks are put back together offline.
Expert-parallel files (MoE) hold their experts under the plain model's keys: a union.
"""
from __future__ import annotations

import math
import os
import pickle
import re
from pathlib import Path
from typing import Any, Union

import torch
from torch import nn

from .context import gpc

PREFIXES = ("module.", "model.", "_orig_mod.")
PathLike = Union[str, os.PathLike]


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file names a type that a weights-only load refuses."""


def strip_prefixes(state_dict: dict) -> dict:
    """Remove wrapper prefixes shared by *every* key (a submodule really called 'model' is kept)."""
    changed = True
    while changed and state_dict:
        changed = False
        for prefix in PREFIXES:
            if all(k.startswith(prefix) for k in state_dict):
                state_dict = {k[len(prefix):]: v for k, v in state_dict.items()}
                changed = True
    return state_dict


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP / torch.compile wrappers."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if not isinstance(inner, nn.Module):
            return model
        model = inner


def tensor_layout(model: nn.Module) -> dict[str, list]:
    """How each entry of the model's state_dict is cut over tensor ranks (`tensor_splits`), keyed
    exactly as the state_dict is -- the plain model's keys, also for interleaved chunks."""
    entries = strip_prefixes(unwrap(model).state_dict(keep_vars=True))
    return {key: list(getattr(value, "tensor_splits", [])) for key, value in entries.items()}


# -- reading a file ---------------------------------------------------------------------------
def _safe_globals() -> list:
    """What our files hold beyond weights_only's defaults: numpy's RNG state (an array)."""
    try:
        import numpy as np
    except ImportError:
        return []
    core = getattr(np, "_core", None) or np.core  # numpy 2 renamed numpy.core to numpy._core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def _refused(path: PathLike, message: str) -> str:
    """The names of what `path` holds that a weights-only load refuses (read without running
    it: the pickle's opcodes are scanned, not executed)."""
    allowed = {f"{g.__module__}.{g.__name__}" for g in _safe_globals()}
    try:
        names = [n for n in torch.serialization.get_unsafe_globals_in_checkpoint(path)
                 if n not in allowed]
    except Exception:  # not a zip file: fall back on what the unpickler said
        names = []
    found = re.findall(r"GLOBAL (\S+) was not an allowed|but got <class '([^']+)'>", message)
    return ", ".join(names or [a or b for a, b in found] or ["a type it does not allow"])


def read_file(path: PathLike, map_location: Any = "cpu", trusted: bool = False) -> Any:
    """torch.load a checkpoint file without letting it run code, unless `trusted`."""
    if trusted:
        return torch.load(path, map_location=map_location, weights_only=False)
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        if "Weights only load failed" not in str(e):
            raise
        raise UnsafeCheckpointError(
            f"[rank {gpc.rank}] {path} holds {_refused(path, str(e))}, which nanocolossal's "
            f"checkpoints never hold; loading it could run code from the file, so it was not "
            f"loaded. If you trust the file (you wrote it, e.g. with your own objects in "
            f"**extra), pass trusted=True: load_checkpoint(..., trusted=True) or "
            f"merge_checkpoint(path, trusted=True)") from None


# -- the files of one save ----------------------------------------------------------------------
def save_files(path: PathLike, trusted: bool = False) -> list[Path]:
    """The files of the newest save to `path`: `path` itself (one process) or its per-rank files
    (`ckpt-stage{p}[-tensor{t}].pt`). Files of other names that share the prefix are not this
    save's, and neither are files an older save of another layout left (their save id differs:
    a pipeline-4 save's stage2/3 beside a newer pipeline-2 save's stage0/1)."""
    path = Path(path)
    stem, suffix = re.escape(path.stem), re.escape(path.suffix)
    pattern = re.compile(rf"{stem}(-stage\d+)?(-tensor\d+)?(-expert\d+)?{suffix}")
    ranks = sorted(p for p in path.parent.glob(f"{path.stem}-*{path.suffix}")
                   if pattern.fullmatch(p.name))
    single = [path] if path.is_file() else []
    if not ranks and not single:
        raise FileNotFoundError(f"no checkpoint files for {str(path)!r} (looked for {path.name} "
                                f"and {path.stem}-stage*/-tensor*{path.suffix})")
    if not ranks:
        return single
    saves: dict[object, list[Path]] = {}
    for file in ranks:
        saves.setdefault(read_file(file, "cpu", trusted).get("save_id"), []).append(file)

    def written(files: list[Path]) -> int:
        return max(f.stat().st_mtime_ns for f in files)
    newest = max(saves.values(), key=written)
    return single if single and path.stat().st_mtime_ns > written(newest) else newest


def describe_save(state: dict, file: PathLike) -> dict:
    return {"id": state.get("save_id"), "file": str(file), "epoch": state.get("epoch"),
            "step": state.get("extra", {}).get("step")}


def check_one_save(stages: list[dict]) -> None:
    """All stage files must come from the same save (a crash can leave a mixed set)."""
    if len({s["id"] for s in stages}) > 1:
        listed = "; ".join(f"{s['file']}: epoch {s['epoch']}, step {s['step']}" for s in stages)
        raise RuntimeError(f"[rank {gpc.rank}] the checkpoint's files come from different saves "
                           f"({listed}); a save was interrupted between files. Resume from an "
                           f"older complete checkpoint, or delete these files and start again")


def zero_path(file: PathLike, rank: int) -> Path:
    """The file ZeRO's data rank `rank` writes its optimizer pieces to, beside its stage's file:
    ckpt.pt -> ckpt-zero1.pt, ckpt-stage0-tensor1.pt -> ckpt-stage0-tensor1-zero1.pt."""
    file = Path(file)
    return file.with_name(f"{file.stem}-zero{rank}{file.suffix}")


def complete_zero_state(state: dict, file: PathLike, trusted: bool = False) -> dict:
    """A ZeRO save's stage file holds a skeleton; its data ranks' pieces lie beside it (zero/
    state.py). Put them back: the plain optimizer state, and at level 3 the model's sharded
    parameters (None in the file). Any other file's state is returned as it is."""
    from .zero.state import assemble, assemble_params  # (zero/ imports modules importing this)
    saved = state.get("optimizer")
    if not isinstance(saved, dict) or "zero_files" not in saved:
        return state
    files = [zero_path(file, r) for r in range(saved["zero_files"])]
    parts = [read_file(f, "cpu", trusted) for f in files]
    check_one_save([describe_save(state, file)] +
                   [describe_save(part, f) for part, f in zip(parts, files)])
    state = {**state, "optimizer": assemble(saved, parts)}
    if saved.get("param_names"):  # level 3: in the model's key order
        params = assemble_params(saved, parts)
        state["model"] = {k: params.get(k, v) for k, v in state["model"].items()}
    return state


def load_optimizer_state(file: PathLike, trusted: bool = False) -> Any:
    """The optimizer state saved in `file` (one stage's file, or `ckpt.pt` of a save without
    stages) -- saved under ZeRO, the plain state merged from its data ranks' pieces, which loads
    into one process's torch optimizer (state["optimizer"]) or any data size's ZeRO optimizer."""
    return complete_zero_state(read_file(file, "cpu", trusted), file, trusted).get("optimizer")


def _load_all(paths: list[PathLike], trusted: bool) -> list[dict]:
    """Read a save's files (CPU) and check they all come from that one save."""
    states = [complete_zero_state(read_file(path, "cpu", trusted), path, trusted)
              for path in paths]
    check_one_save([describe_save(state, path) for state, path in zip(states, paths)])
    return states


# -- merging ------------------------------------------------------------------------------------
def _rebuild(blocks: dict[int, torch.Tensor], splits: list, size: int) -> torch.Tensor:
    """Undo tensor/base.shard offline: concatenate the tensor ranks' blocks of one parameter."""
    q = math.isqrt(size)
    position = {"tensor": lambda t: t, "col": lambda t: t % q, "row": lambda t: t // q}
    parts = {"tensor": size, "col": q, "row": q}

    def build(todo: list, fixed: dict) -> torch.Tensor:
        if not todo:  # a block every rank with these coordinates holds alike
            return next(b for t, b in sorted(blocks.items())
                        if all(position[axis](t) == i for axis, i in fixed.items()))
        dim, axis = todo[0]
        return torch.cat([build(todo[1:], {**fixed, axis: i}) for i in range(parts[axis])], dim=dim)
    return build(list(splits), {})


def _merge_tensor_states(states: list[dict]) -> dict:
    """One pipeline stage's plain state_dict from its tensor ranks' states."""
    info = [state.get("tensor", {"rank": 0, "size": 1, "splits": {}}) for state in states]
    size = info[0]["size"]
    if sorted(i["rank"] for i in info) != list(range(size)):
        raise ValueError(f"merging needs the files of all {size} tensor ranks of a stage, got "
                         f"ranks {sorted(i['rank'] for i in info)}")
    models = {i["rank"]: strip_prefixes(state["model"]) for i, state in zip(info, states)}
    splits, shapes = info[0]["splits"], info[0].get("shapes", {})
    merged = {}
    for key in models[0]:
        if size > 1 and key not in splits:  # never guess: a block is not the whole tensor
            raise ValueError(f"merging: the files record no split for {key!r}; they were written "
                             f"by a version that keyed splits differently from the model; "
                             f"re-save them with this version")
        merged[key] = _rebuild({t: m[key] for t, m in models.items()}, splits.get(key, []), size)
        if key in shapes and list(merged[key].shape) != shapes[key]:
            raise ValueError(f"merging: {key!r} rebuilt with shape {list(merged[key].shape)}, "
                             f"but the plain model's is {shapes[key]}")
    return merged


def _union(parts: list[tuple[PathLike, dict]]) -> dict:
    """The stages' state_dicts side by side: their keys never overlap."""
    merged: dict = {}
    for path, part in parts:
        overlap = sorted(set(part) & set(merged))
        if overlap:
            raise ValueError(f"{path} repeats keys of an earlier stage ({overlap[:3]}...): pass "
                             f"each stage once")
        merged.update(part)
    return merged


def _merge_experts(states: list[dict]) -> list[dict]:
    """Expert-parallel files (`-expert{e}`, parallel.moe) of one stage and tensor rank hold the
    same non-expert entries and each their own experts, keyed by global expert index: one
    state whose model is their union (a key two files share must be equal in both)."""
    merged: dict[tuple, dict] = {}
    for state in states:
        where = (state.get("pipeline", {}).get("rank", 0), state.get("tensor", {}).get("rank", 0))
        if where not in merged:
            merged[where] = {**state, "model": dict(strip_prefixes(state["model"]))}
            continue
        model = merged[where]["model"]
        for key, value in strip_prefixes(state["model"]).items():
            if key in model and not torch.equal(model[key], value):
                raise ValueError(f"merging expert-parallel files: {key!r} differs between "
                                 f"them; they are not one save's replicas")
            model[key] = value
    return list(merged.values())


def merge_checkpoint(path: PathLike, trusted: bool = False) -> dict:
    """The plain model's state_dict from all files one save wrote for `path` (stages x tensor
    x experts)."""
    by_stage: dict[int, list[dict]] = {}
    for state in _merge_experts(_load_all(save_files(path, trusted), trusted)):
        by_stage.setdefault(state.get("pipeline", {}).get("rank", 0), []).append(state)
    return _union([(f"stage {stage}", _merge_tensor_states(by_stage[stage]))
                   for stage in sorted(by_stage)])


def merge_tensor_parallel(paths: list[PathLike], trusted: bool = False) -> dict:
    """One pipeline stage's plain state_dict from its tensor ranks' files (in any order)."""
    return _merge_tensor_states(_load_all(paths, trusted))


def merge_pipeline_checkpoint(paths: list[PathLike], trusted: bool = False) -> dict:
    """The plain model's state_dict from the per-stage files given (their keys never overlap)."""
    return _union([(path, strip_prefixes(state["model"]))
                   for path, state in zip(paths, _load_all(paths, trusted))])


@torch.no_grad()
def load_plain_state_dict(model: nn.Module, state_dict: dict) -> None:
    """Load a plain (unsplit) state_dict into a model of any layout: each parameter its slice,
    through the model's own load_state_dict (ZeRO level 3's hooks gather, then keep my shard)."""
    from .tensor.base import shard
    state_dict = strip_prefixes(state_dict)
    layout = tensor_layout(model)
    own = unwrap(model).state_dict(keep_vars=True)  # (keep_vars: no gather at ZeRO level 3)
    sliced = {}
    for own_key, key in zip(own, strip_prefixes(own)):  # the module's keys, the plain ones
        if key not in state_dict:
            raise KeyError(f"[rank {gpc.rank}] the plain state_dict has no {key!r}")
        sliced[own_key] = shard(state_dict[key], layout[key])
    unwrap(model).load_state_dict(sliced)
