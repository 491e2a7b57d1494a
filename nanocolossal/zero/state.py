"""A ZeRO optimizer's checkpoint is the unsplit model's plain torch optimizer state.

Each rank holds the state of its segments only (optimizer.py): pieces [lo, hi) of parameters.
Saving puts the pieces back together; loading cuts out mine again:

    save   rank r: {param index: [(lo, hi, {exp_avg: piece, ..., step})]}   all_gather_object
           -> for each parameter, its pieces written side by side into one whole tensor
           -> {"state": {index: {exp_avg: whole, ...}}, "param_groups": [...]}: torch's layout
    load   a plain state (saved by this job, by another data size, or by one process's
           torch optimizer) -> each rank keeps state[index][k].flatten()[lo:hi] of its segments

So a checkpoint loads into any data size (2 -> 1, 1 -> 4, 4 -> 2) and into one process's plain
optimizer. The price: the gather goes through one rank, which writes the file (one per pipeline
stage and tensor rank, as without ZeRO). Per-element states are cut; per-parameter scalars
(`step`) are the same on every piece and are kept once.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..context import gpc

if TYPE_CHECKING:
    from .optimizer import Segment, ShardedOptimizer

SCALAR_STATE = ("step",)  # per-parameter scalars; every other state tensor is per element


def _per_element(key: str, value: Any) -> bool:
    return key not in SCALAR_STATE and torch.is_tensor(value)


def _segments_in(opt: ShardedOptimizer, group: dict) -> list[Segment]:
    """The segments an inner param group steps, in its order."""
    where = {id(s.param): s for b in opt.buffers for s in b.segments}
    return [where[id(p)] for p in group["params"]]


def gather_plain_state(opt: ShardedOptimizer) -> dict:
    """Every rank's pieces put together (collective over the data group)."""
    mine: dict[int, list] = {}
    for group in opt.optimizer.param_groups:
        for s in _segments_in(opt, group):
            state = opt.optimizer.state.get(s.param)
            if state:
                mine.setdefault(s.index, []).append(
                    (s.lo, s.hi, {k: v.detach().cpu() if torch.is_tensor(v) else v
                                  for k, v in state.items()}))
    everyone: list[Any] = [mine]
    if opt.size > 1:
        everyone = [None] * opt.size
        dist.all_gather_object(everyone, mine, group=opt.group)
    full: dict[int, dict] = {}
    for pieces in everyone:
        for index, parts in pieces.items():
            entry = full.setdefault(index, {})
            for lo, hi, state in parts:
                for k, v in state.items():
                    if _per_element(k, v):
                        numel = opt.shapes[index].numel()
                        entry.setdefault(k, torch.zeros(numel, dtype=v.dtype))[lo:hi] = v
                    else:
                        entry[k] = v
    for index, entry in full.items():  # flat pieces back into the parameter's shape
        for k, v in entry.items():
            if _per_element(k, v):
                entry[k] = v.view(opt.shapes[index])
    groups, start = [], 0
    for user, inner in zip(opt.user_groups, opt.optimizer.param_groups):
        groups.append({**{k: v for k, v in inner.items() if k != "params"},
                       "params": list(range(start, start + len(user["params"])))})
        start += len(user["params"])
    return {"optimizer": {"state": full, "param_groups": groups},
            "scaler": opt.scaler.state_dict() if opt.scaler is not None else None,
            "masters": [], "zero": {"level": opt.level, "data_size": opt.size}}


def keep_my_pieces(opt: ShardedOptimizer, state: dict) -> None:
    """Load a plain (unsplit) optimizer state: this rank keeps the pieces of its segments."""
    plain = state["optimizer"] if "optimizer" in state else state
    if len(plain["param_groups"]) != len(opt.user_groups):
        raise ValueError(f"[rank {gpc.rank}] the saved optimizer has "
                         f"{len(plain['param_groups'])} param groups, this one "
                         f"{len(opt.user_groups)}")
    saved = {int(k): v for k, v in plain["state"].items()}
    pieces: dict[int, Any] = {}
    groups = []
    for saved_group, group in zip(plain["param_groups"], opt.optimizer.param_groups):
        ids = []
        for s in _segments_in(opt, group):
            ids.append(len(pieces))
            whole = saved.get(s.index)
            pieces[len(pieces)] = None if not whole else {
                k: v.reshape(-1)[s.lo:s.hi].clone() if _per_element(k, v) else v
                for k, v in whole.items()}
        groups.append({**saved_group, "params": ids})
    opt.optimizer.load_state_dict(
        {"state": {i: v for i, v in pieces.items() if v is not None}, "param_groups": groups})
    if opt.scaler is not None and state.get("scaler"):
        opt.scaler.load_state_dict(state["scaler"])
