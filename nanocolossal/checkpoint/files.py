"""A checkpoint's files: their names, reading one safely, and which files make one save.

save_load.py writes one file per (pipeline stage, tensor rank, expert rank), ZeRO's data ranks
one more each (`zero_path`); `save_files` finds the files of the newest save to a path and
`check_one_save` refuses a set mixed from two saves. Keys: the plain model's, whatever wrapped it
(`strip_prefixes`, `unwrap`).

Reading without running code. A .pt file is a pickle, and unpickling may call any function
the file names: `torch.load(weights_only=False)` of a file from a shared disk would run
whatever its author put there. So files are read with `weights_only=True`, whose unpickler
builds only tensors, numbers, strings and containers, plus the few types our files really
hold, allow-listed here: numpy's RNG state is an array of uint32 (`_SAFE_GLOBALS`). Python's
RNG state, torch's generator states (byte tensors), optimizer, scheduler and loss-scaler
state dicts are already plain data. A file that names anything else is refused with an
error naming it; `trusted=True` reads a file you trust (your own objects in **extra) as
before.
"""
from __future__ import annotations

import os
import pickle
import re
from pathlib import Path
from typing import Any, Union

import torch
from torch import nn

from ..context import gpc

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
def _rank_pattern(path: Path) -> re.Pattern:
    stem, suffix = re.escape(path.stem), re.escape(path.suffix)
    return re.compile(rf"{stem}(-stage\d+)?(-tensor\d+)?(-expert\d+)?{suffix}")


def rank_files(path: PathLike) -> list[Path]:
    """Every per-rank file at `path` (`ckpt-stage{p}[-tensor{t}][-expert{e}].pt`), of any save."""
    path = Path(path)
    pattern = _rank_pattern(path)
    return sorted(p for p in path.parent.glob(f"{path.stem}-*{path.suffix}")
                  if pattern.fullmatch(p.name))


def name_kind(path: PathLike, file: Path) -> tuple[bool, ...]:
    """Which of stage / tensor / expert a file of `path` names: alike for all files of one save
    (every rank of a job names the same parts), so files of another kind are another layout's."""
    match = _rank_pattern(Path(path)).fullmatch(file.name)
    return tuple(part is not None for part in match.groups()) if match else (False,) * 3


def save_files(path: PathLike, trusted: bool = False) -> list[Path]:
    """The files of the newest save to `path`: `path` itself (one process) or its rank_files,
    less those an older save of another layout left (their save id differs: a pipeline-4 save's
    stage2/3 beside a newer pipeline-2 save's stage0/1)."""
    path = Path(path)
    ranks = rank_files(path)
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
    """The shard file ZeRO's data rank `rank` writes its segments to, beside its stage's file:
    ckpt.pt -> ckpt-zero1.pt, ckpt-stage0-tensor1.pt -> ckpt-stage0-tensor1-zero1.pt."""
    file = Path(file)
    return file.with_name(f"{file.stem}-zero{rank}{file.suffix}")
