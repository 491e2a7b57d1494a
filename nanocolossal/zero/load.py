"""Loading a ZeRO checkpoint: each rank reads only the shard files that overlap its shard.

A save by N data ranks leaves N shard files beside the stage's file (state.py): file q holds
the segments of shard q of every flat buffer, and the stage file lists them -- for each q, its
(index, lo, hi): a parameter's index and a range of its flattened elements. A rank of a job of
M data ranks needs the elements of its own segments, so it reads just the files that meet them:

    saved by   loaded by   rank r reads
    N          M = N       file r                      (a resume: one file, its own)
    N = 4      M = 2       files 2r and 2r+1, and a neighbour where padding moves a cut
    N = 2      M = 4       file r // 2, or two where a cut falls inside my shard
    N          M = 1       every file

and, for each of its segments and each saved segment of the same parameter, copies the overlap:

    my segment       [lo ........................ hi)       of parameter i
    a saved segment       [slo ........ shi)                 of parameter i, from file q
    copied                [max(lo, slo), min(hi, shi))      to mine at max(lo, slo) - lo

So no rank holds a tensor it does not own, even while loading. The plain route (every file merged
into whole tensors, then cut: complete_zero_state) stays for merge_checkpoint, a load into plain
data parallelism or without an optimizer, a level-3 save loaded at level 1-2, or a save older than
the segments list.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from ..checkpoint_files import check_one_save, describe_save, read_file, zero_path
from ..context import gpc
from .optimizer import ShardedOptimizer
from .state import per_element

Key = tuple[int, int, int]  # (parameter index, lo, hi): one segment


class _Mine:
    """My segments' tensors, filled from the saved segments, counting the elements received."""

    def __init__(self, mine: list[Key]) -> None:
        self.at: dict[int, list[Key]] = {}  # parameter index -> my segments of it
        for key in mine:
            self.at.setdefault(key[0], []).append(key)
        self.filled: dict[tuple, int] = {}

    def place(self, into: dict, name: str, index: int, slo: int, shi: int,
              value: torch.Tensor) -> None:
        """Copy saved segment [slo, shi) of parameter `index` into my segments' into[key][name]."""
        for key in self.at.get(index, []):
            lo, hi = key[1], key[2]
            a, b = max(lo, slo), min(hi, shi)
            if a < b:
                slot = into.setdefault(key, {})
                if name not in slot:
                    slot[name] = torch.zeros(hi - lo, dtype=value.dtype)
                slot[name][a - lo: b - lo] = value[a - slo: b - slo]
                count = (id(into), key, name)
                self.filled[count] = self.filled.get(count, 0) + b - a

    def check(self, files: list[Path]) -> None:
        """Every tensor begun got all its elements: else a file lacks segments."""
        for (_, (index, lo, hi), name), n in self.filled.items():
            if n != hi - lo:
                raise RuntimeError(
                    f"[rank {gpc.rank}] the ZeRO shard files {[f.name for f in files]} hold "
                    f"{n} of the {hi - lo} elements [{lo}, {hi}) of parameter {index}'s {name}; "
                    f"a file is incomplete: resume from an older checkpoint")


def files_to_read(saved: list[list], mine: _Mine) -> list[int]:
    """The saving ranks whose files hold any element of my segments."""
    return [q for q, segments in enumerate(saved)
            if any(lo < shi and slo < hi
                   for index, slo, shi in segments for _, lo, hi in mine.at.get(index, []))]


def my_state(mine: _Mine, saved: dict, parts: list[dict], files: list[Path]) -> dict:
    """From the files read: the state of my segments, as the optimizer's load_state_dict takes
    it -- {"optimizer": {"mine": {key: {exp_avg: values, ..., step}}, ...}, "masters": {key:
    values}, "params": {key: values}}, each key one of my segments (index, lo, hi)."""
    state: dict[Key, dict] = {}
    extra: dict[Key, dict] = {}  # {"master": values, "param": values}
    for part in parts:
        for index, segments in part["state"].items():
            for slo, shi, values in segments:
                for k, v in values.items():
                    if per_element(k, v):
                        mine.place(state, k, index, slo, shi, v)
                for key in mine.at.get(index, []):  # per-parameter scalars (step): as they are
                    if key in state:
                        state[key].update({k: v for k, v in values.items()
                                           if not per_element(k, v)})
        for name in ("master", "param"):
            for index, slo, shi, value in part[name + "s"]:
                mine.place(extra, name, index, slo, shi, value)
    mine.check(files)
    return {"optimizer": {"mine": state, "param_groups": saved["param_groups"]},
            "scaler": saved["scaler"], "zero": saved["zero"],
            "masters": {k: v["master"] for k, v in extra.items() if "master" in v},
            "params": {k: v["param"] for k, v in extra.items() if "param" in v}}


def read_my_segments(state: dict, file: Path, opt: Any, trusted: bool = False) -> Optional[dict]:
    """`state` (a stage file) with my segments, read from their files; None: the plain route."""
    saved = state.get("optimizer")
    if not (isinstance(opt, ShardedOptimizer) and isinstance(saved, dict)):
        return None
    listed = saved.get("segments", saved.get("pieces"))  # ("pieces": its name in older saves)
    if (listed is None or saved["shapes"] != [list(s) for s in opt.shapes]  # another model
            or (saved["param_names"] and opt.level < 3)):  # or whole parameters
        return None  # (the plain route says what differs)
    mine = _Mine([(s.index, s.lo, s.hi) for b in opt.buffers for s in b.segments])
    files = [zero_path(file, q) for q in files_to_read(listed, mine)]
    parts = [read_file(f, "cpu", trusted) for f in files]
    check_one_save([describe_save(state, file)] + [describe_save(p, f)
                                                  for p, f in zip(parts, files)])
    return {**state, "optimizer": my_state(mine, saved, parts, files)}


def load_model_entries(model: nn.Module, entries: dict, strict: bool) -> None:
    """model.load_state_dict(entries), where a level-3 save's parameters are None: those come
    as segments with the optimizer's state; strict still refuses any other missing key."""
    sharded = {k for k, v in entries.items() if v is None}
    if not sharded:  # (any model: an interleaved pipeline's chunk list returns nothing)
        model.load_state_dict(entries, strict=strict)
        return
    result = model.load_state_dict({k: v for k, v in entries.items() if v is not None},
                                   strict=False)
    missing = set(result.missing_keys) - sharded
    if strict and (missing or result.unexpected_keys):
        raise RuntimeError(f"[rank {gpc.rank}] loading the model: missing keys {sorted(missing)},"
                           f" unexpected keys {sorted(result.unexpected_keys)}")
