"""A ZeRO optimizer's checkpoint: each data rank writes its own segments; put together they are
the unsplit model's plain torch optimizer state.

Each rank holds the state of its segments only (optimizer.py): the parts [lo, hi) of parameters
in its shard (and, under O2, their fp32 masters: mixed.py). A checkpoint keeps it that way -- no
rank ever holds the whole optimizer state to save it:

    save   rank r writes its segments, {param index: [(lo, hi, {exp_avg: values, ..., step})]},
           [(index, lo, hi, master values)] and, at level 3, [(index, lo, hi, parameter values)]
           to its own shard file (checkpoint.py: ckpt-zero{r}.pt); the stage's main file gets the
           skeleton (param groups, shapes, scaler, N, every shard's segments) and the model's
           unsharded entries
    merge  for each parameter its segments side by side into one whole tensor:
           {"state": {index: {exp_avg: whole, ...}}, "param_groups": [...]} -- torch's layout,
           which loads into one process's plain optimizer (`assemble`)
    load   the merged plain state (saved by any data size, or by one process's optimizer) ->
           each rank keeps state[index][k].flatten()[lo:hi] of its segments (`keep_my_segments`)

So a checkpoint loads into any data size (2 -> 1, 1 -> 4, 4 -> 2). Loading merges the whole
state once on each rank before keeping its segments -- simple, and the one moment a rank holds
it all (the plain route; load.py reads only the files that overlap my shard). `state_dict()`
(collective) gathers the segments in memory for a caller that wants the plain state at once.
Per-element states are cut; per-parameter scalars (`step`) are the same in every segment and are
kept once.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ..context import gpc

if TYPE_CHECKING:
    from .optimizer import Segment, ShardedOptimizer

SCALAR_STATE = ("step",)  # per-parameter scalars; every other state tensor is per element


def per_element(key: str, value: Any) -> bool:
    return key not in SCALAR_STATE and torch.is_tensor(value)


def _segments_in(opt: ShardedOptimizer, group: dict) -> list[Segment]:
    """The segments an inner param group steps, in its order."""
    where = {id(s.param): s for b in opt.buffers for s in b.segments}
    return [where[id(p)] for p in group["params"]]


def my_segments(opt: ShardedOptimizer) -> dict:
    """What this rank holds: its segments' optimizer state and fp32 masters (CPU)."""
    state: dict[int, list] = {}
    for group in opt.optimizer.param_groups:
        for s in _segments_in(opt, group):
            if opt.optimizer.state.get(s.param):
                state.setdefault(s.index, []).append(
                    (s.lo, s.hi, {k: v.detach().cpu() if torch.is_tensor(v) else v
                                  for k, v in opt.optimizer.state[s.param].items()}))
    return {"state": state, "masters": opt.master_segments(), "params": opt.param_segments()}


def skeleton(opt: ShardedOptimizer) -> dict:
    """What every rank shares: param groups (hyper-parameters), shapes, the loss scaler."""
    groups, start = [], 0
    for user in opt.user_groups:  # (their hyper-parameters: what a scheduler set last)
        groups.append({**{k: v for k, v in user.items() if k != "params"},
                       "params": list(range(start, start + len(user["params"])))})
        start += len(user["params"])
    return {"param_groups": groups, "shapes": [list(s) for s in opt.shapes],
            "masters_of": opt.half_indices(),
            "scaler": opt.scaler.state_dict() if opt.scaler is not None else None,
            "zero": {"level": opt.level, "data_size": opt.size},
            "segments": [[s for b in opt.buffers for s in b.shard_segments(r)]
                         for r in range(opt.size)],
            "param_names": opt.param_names() if opt.level == 3 else [],
            "param_dtypes": [str(p.dtype).removeprefix("torch.") for p in opt.model_params]}


def assemble_params(skeleton: dict, everyone: list[dict]) -> dict:
    """Level 3: the model's sharded parameters, whole, under every state_dict key they have."""
    whole = {i: torch.zeros(torch.Size(shape).numel(), dtype=getattr(torch, dtype))
             for i, (shape, dtype) in enumerate(zip(skeleton["shapes"], skeleton["param_dtypes"]))}
    for held in everyone:  # (a zero-size parameter has no segment anywhere: it stays empty)
        for index, lo, hi, value in held["params"]:
            whole[index][lo:hi] = value
    return {name: whole[index].view(skeleton["shapes"][index])
            for index, names in enumerate(skeleton["param_names"]) for name in names}


def assemble(skeleton: dict, everyone: list[dict]) -> dict:
    """The plain optimizer state (and O2's whole masters) from every rank's segments."""
    shapes = [torch.Size(s) for s in skeleton["shapes"]]
    full: dict[int, dict] = {}
    masters = {i: torch.zeros(shapes[i].numel()) for i in skeleton["masters_of"]}
    for held in everyone:
        for index, parts in held["state"].items():
            entry = full.setdefault(index, {})
            for lo, hi, state in parts:
                for k, v in state.items():
                    if per_element(k, v):
                        whole = entry.setdefault(k, torch.zeros(shapes[index].numel(),
                                                                dtype=v.dtype))
                        whole[lo:hi] = v
                    else:
                        entry[k] = v
        for index, lo, hi, master in held["masters"]:
            masters[index][lo:hi] = master
    for index, entry in full.items():  # flat tensors back into the parameter's shape
        for k, v in entry.items():
            if per_element(k, v):
                entry[k] = v.view(shapes[index])
    return {"optimizer": {"state": full, "param_groups": skeleton["param_groups"]},
            "scaler": skeleton["scaler"], "zero": skeleton["zero"],
            "masters": [masters[i].view(shapes[i]) for i in skeleton["masters_of"]]}


def gather_plain_state(opt: ShardedOptimizer) -> dict:
    """Every rank's segments put together in memory (collective over the data group)."""
    mine = my_segments(opt)
    everyone: list[Any] = [mine]
    if opt.size > 1:
        everyone = [None] * opt.size
        dist.all_gather_object(everyone, mine, group=opt.group)
    return assemble(skeleton(opt), everyone)


def keep_my_segments(opt: ShardedOptimizer, state: dict) -> None:
    """Load an optimizer state: this rank keeps the state of its segments. `state` is plain
    (unsplit, any data size: cut here) or already cut to my segments (load.py: `mine`)."""
    plain = state["optimizer"] if "optimizer" in state else state
    if len(plain["param_groups"]) != len(opt.user_groups):
        raise ValueError(f"[rank {gpc.rank}] the saved optimizer has "
                         f"{len(plain['param_groups'])} param groups, this one "
                         f"{len(opt.user_groups)}")
    if "mine" in plain:
        def state_of(s: Segment) -> Any:
            return plain["mine"].get((s.index, s.lo, s.hi))
    else:
        saved = {int(k): v for k, v in plain["state"].items()}

        def state_of(s: Segment) -> Any:
            whole = saved.get(s.index)
            return None if not whole else {
                k: v.reshape(-1)[s.lo:s.hi].clone() if per_element(k, v) else v
                for k, v in whole.items()}
    states: dict[int, Any] = {}
    groups = []
    for saved_group, group, user in zip(plain["param_groups"], opt.optimizer.param_groups,
                                        opt.user_groups):
        user.update({k: v for k, v in saved_group.items() if k != "params"})
        ids = []
        for s in _segments_in(opt, group):
            ids.append(len(states))
            states[len(states)] = state_of(s)
        groups.append({**saved_group, "params": ids})
    opt.optimizer.load_state_dict(
        {"state": {i: v for i, v in states.items() if v is not None}, "param_groups": groups})
    if opt.scaler is not None and state.get("scaler"):
        opt.scaler.load_state_dict(state["scaler"])


def saved_master(state: dict, opt: ShardedOptimizer, s: Segment) -> Any:
    """The saved fp32 master of segment `s` (O2), or None when the save had no masters."""
    if "optimizer" not in state:  # a bare optimizer state: no masters beside it
        return None
    if "mine" in state["optimizer"]:
        return state["masters"].get((s.index, s.lo, s.hi)) if state["masters"] else None
    master = dict(zip(opt.half_indices(), state.get("masters") or [])).get(s.index)
    return None if master is None else master.reshape(-1)[s.lo:s.hi]
