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
           each rank keeps state[index][k].flatten()[lo:hi] of its segments (`load_state_dict`)

So a checkpoint loads into any data size (2 -> 1, 1 -> 4, 4 -> 2); load.py reads only the files that
overlap my shard, the plain route merges them all. `state_dict()` (collective) gathers the segments
in memory. Per-parameter scalars (`step`) are the same in every segment: kept once. Under O2
(mixed.py) it is one process's O2 layout, "masters" one whole fp32 tensor per half parameter in its
order, so either resumes from the other's file.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..checkpoint_files import strip_prefixes, unwrap
from ..context import gpc

SCALAR_STATE = ("step",)  # per-parameter scalars; every other state tensor is per element
HALF = (torch.float16, torch.bfloat16)


class ShardedState:
    """The checkpoint half of ShardedOptimizer: what it saves and loads, and the bytes it holds."""

    masters_halves = False  # mixed.py: O2's half parameters are stepped through fp32 masters

    def state_dict(self) -> dict:
        """The plain optimizer state, every rank's segments put together (collective)."""
        mine = my_segments(self)
        everyone: list[Any] = [mine]
        if self.size > 1:
            everyone = [None] * self.size
            dist.all_gather_object(everyone, mine, group=self.group)
        return assemble(skeleton(self), everyone)

    def load_state_dict(self, state: dict) -> None:
        """Keep my segments of a plain optimizer state (any data size: cut here) or of one cut to
        them (load.py's `mine`, at level 3 with my parameter segments); then O2's masters."""
        plain = state["optimizer"] if "optimizer" in state else state
        if len(plain["param_groups"]) != len(self.user_groups):
            raise ValueError(f"[rank {gpc.rank}] the saved optimizer has "
                             f"{len(plain['param_groups'])} param groups, this one "
                             f"{len(self.user_groups)}")
        if "mine" in plain:
            def state_of(s: Any) -> Any:
                return plain["mine"].get((s.index, s.lo, s.hi))
        else:
            saved = {int(k): v for k, v in plain["state"].items()}

            def state_of(s: Any) -> Any:
                whole = saved.get(s.index)
                return None if not whole else {
                    k: v.reshape(-1)[s.lo:s.hi].clone() if per_element(k, v) else v
                    for k, v in whole.items()}
        states: dict[int, Any] = {}
        groups = []
        for saved_group, group, user in zip(plain["param_groups"], self.optimizer.param_groups,
                                            self.user_groups):
            user.update({k: v for k, v in saved_group.items() if k != "params"})
            ids = []
            for s in _segments_in(self, group):
                ids.append(len(states))
                states[len(states)] = state_of(s)
            groups.append({**saved_group, "params": ids})
        self.optimizer.load_state_dict(
            {"state": {i: v for i, v in states.items() if v is not None}, "param_groups": groups})
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        segments = [s for b in self.buffers for s in b.segments]
        params = state.get("params") or {}
        self._loaded = False  # the masters come from `state`, below
        with torch.no_grad():
            for s in segments:
                values = params.get((s.index, s.lo, s.hi))
                if values is not None:
                    self.grad_target(s).copy_(values)
            for s in [s for s in segments if s.view is not None]:
                master = saved_master(state, self, s)
                if master is not None:
                    s.param.copy_(master)
                    s.view.copy_(s.param)
                else:  # saved without O2, or an fp32 segment: masters of the loaded model
                    s.param.copy_(s.view)

    def param_names(self) -> list[list[str]]:
        """The model's state_dict keys of each parameter the optimizer steps (a tied one: all)."""
        keys = strip_prefixes(unwrap(self.model).state_dict(keep_vars=True))  # (no gather)
        index = {id(p): i for i, p in enumerate(self.model_params)}
        names: list[list[str]] = [[] for _ in self.model_params]
        for name, p in keys.items():
            if id(p) in index:
                names[index[id(p)]].append(name)
        return names

    def half_indices(self) -> list[int]:
        """Indices of the parameters one process's O2 keeps masters for, in its order."""
        halves = [i for i, p in enumerate(self.model_params) if p.dtype in HALF]
        return halves if self.masters_halves else []

    # -- the bytes this rank holds (live tensors) ----------------------------------------------
    def state_bytes(self) -> int:
        """Per-element optimizer state (the per-segment `step` scalars left out)."""
        return sum(t.numel() * t.element_size() for state in self.optimizer.state.values()
                   for k, t in state.items() if per_element(k, t))

    def master_bytes(self) -> int:
        return sum(m.numel() * m.element_size() for _, m in self._master_pairs)

    def shard_bytes(self) -> int:
        """Level 3: parameters kept between uses, my shard of every buffer."""
        return sum(b.local.numel() * b.local.element_size() for b in self.buffers)


def per_element(key: str, value: Any) -> bool:
    return key not in SCALAR_STATE and torch.is_tensor(value)


def _segments_in(opt: Any, group: dict) -> list:
    """The segments an inner param group steps, in its order."""
    where = {id(s.param): s for b in opt.buffers for s in b.segments}
    return [where[id(p)] for p in group["params"]]


def my_segments(opt: Any) -> dict:
    """What this rank holds: its segments' optimizer state and fp32 masters (CPU)."""
    state: dict[int, list] = {}
    for group in opt.optimizer.param_groups:
        for s in _segments_in(opt, group):
            if opt.optimizer.state.get(s.param):
                state.setdefault(s.index, []).append(
                    (s.lo, s.hi, {k: v.detach().cpu() if torch.is_tensor(v) else v
                                  for k, v in opt.optimizer.state[s.param].items()}))
    segments = [s for b in opt.buffers for s in b.segments]
    masters = [(s.index, s.lo, s.hi, s.param.detach().cpu()) for s in segments
               if s.view is not None and s.view.dtype != s.param.dtype]  # O2's, not offload's
    params = [(s.index, s.lo, s.hi, opt.grad_target(s).detach().cpu().clone())
              for s in segments] if opt.level == 3 else []  # my shard, in the model's dtype
    return {"state": state, "masters": masters, "params": params}


def skeleton(opt: Any) -> dict:
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
                        whole = entry.setdefault(k, torch.zeros(shapes[index], dtype=v.dtype))
                        whole.view(-1)[lo:hi] = v  # (in the parameter's shape)
                    else:
                        entry[k] = v
        for index, lo, hi, master in held["masters"]:
            masters[index][lo:hi] = master
    return {"optimizer": {"state": full, "param_groups": skeleton["param_groups"]},
            "scaler": skeleton["scaler"], "zero": skeleton["zero"],
            "masters": [masters[i].view(shapes[i]) for i in skeleton["masters_of"]]}


def saved_master(state: dict, opt: Any, s: Any) -> Any:
    """The saved fp32 master of segment `s` (O2), or None when the save had no masters."""
    if "optimizer" not in state:  # a bare optimizer state: no masters beside it
        return None
    if "mine" in state["optimizer"]:
        return state["masters"].get((s.index, s.lo, s.hi)) if state["masters"] else None
    master = dict(zip(opt.half_indices(), state.get("masters") or [])).get(s.index)
    return None if master is None else master.reshape(-1)[s.lo:s.hi]
