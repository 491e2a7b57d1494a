"""A ZeRO optimizer's checkpoint: each data rank writes its own segments; put together they are
the unsplit model's plain torch optimizer state.

Each rank holds the state of its segments only (zero/optimizer.py): the parts [lo, hi) of
parameters in its shard (and, under O2, their fp32 masters: zero/mixed.py). A checkpoint keeps
it that way -- no rank ever holds the whole optimizer state to save it:

    save   rank r writes its segments, {param index: [(lo, hi, {exp_avg: values, ..., step})]},
           [(index, lo, hi, master values)] and, at level 3, [(index, lo, hi, parameter values)]
           to its own shard file (save_load.py: ckpt-zero{r}.pt); the stage's main file gets the
           skeleton (param groups, shapes, scaler, N, every shard's segments) and the model's
           unsharded entries
    merge  for each parameter its segments side by side into one whole tensor:
           {"state": {index: {exp_avg: whole, ...}}, "param_groups": [...]} -- torch's layout,
           which loads into one process's plain optimizer (`assemble`)
    load   the merged plain state (saved by any data size, or by one process's optimizer) ->
           each rank keeps state[index][k].flatten()[lo:hi] of its segments (`load_state_dict`)

So a checkpoint loads into any data size (2 -> 1, 1 -> 4, 4 -> 2). `state_dict()` (collective)
gathers the segments in memory. Per-parameter scalars (`step`) are the same in every segment:
kept once. Under O2 (zero/mixed.py) it is one process's O2 layout, "masters" one whole fp32
tensor per half parameter in its order, so either resumes from the other's file.

Loading (`read_my_segments`): each rank reads only the shard files that overlap its shard. A
save by N data ranks leaves N shard files beside the stage's file: file q holds the segments of
shard q of every flat buffer, and the stage file lists them -- for each q, its (index, lo, hi): a
parameter's index and a range of its flattened elements. A rank of a job of M data ranks needs
the elements of its own segments, so it reads just the files that meet them:

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
into whole tensors, then cut: merge.py's complete_zero_state) stays for merge_checkpoint, a load
into plain data parallelism or without an optimizer, a level-3 save loaded at level 1-2, or a
save older than the segments list.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..context import gpc
from .files import check_one_save, describe_save, read_file, strip_prefixes, unwrap, zero_path

SCALAR_STATE = ("step",)  # per-parameter scalars; every other state tensor is per element
HALF = (torch.float16, torch.bfloat16)


class ShardedState:
    """The checkpoint half of ShardedOptimizer: what it saves and loads, and the bytes it holds."""

    masters_halves = False  # zero/mixed.py: O2's half parameters are stepped through fp32 masters

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
        them (`mine` of read_my_segments; level 3: my parameter segments too); then O2's masters."""
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


# -- loading: my segments from the files that hold them -----------------------------------------
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
    if not (isinstance(opt, ShardedState) and isinstance(saved, dict)):
        return None
    listed = saved.get("segments", saved.get("pieces"))  # ("pieces": its name in older saves)
    if (listed is None or saved["shapes"] != [list(s) for s in opt.shapes]  # another model
            or (saved["param_names"] and opt.level < 3)):  # or whole parameters
        return None  # (the plain route says what differs)
    mine = _Mine([(s.index, s.lo, s.hi) for b in opt.buffers for s in b.segments])
    files = [zero_path(file, q) for q in files_to_read(listed, mine)]
    parts = [read_file(f, "cpu", trusted) for f in files]
    check_one_save([describe_save(s, f) for s, f in zip([state, *parts], [file, *files])])
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
