"""A checkpoint's files offline, with no running job: one save's files of any layout merged into
the plain model's state_dict (`merge_checkpoint`), which `load_plain_state_dict` cuts into any
other layout; a ZeRO save's segments are put back first (`complete_zero_state`, with
zero.py's `assemble`).

Tensor-parallel files record how each parameter was cut (`tensor_splits`, keyed by the plain
model's keys) and the plain shape, so the blocks are put back together; expert-parallel files
(MoE) hold their experts under the plain model's keys: a union.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ..context import gpc
from ..tensor.base import POSITION, slice_of
from .files import (
    PathLike,
    check_one_save,
    describe_save,
    read_file,
    save_files,
    strip_prefixes,
    unwrap,
    zero_path,
)
from .zero import assemble, assemble_params


def tensor_splits_of(model: nn.Module) -> dict[str, list]:
    """How each entry of the model's state_dict is cut over tensor ranks (`tensor_splits`), keyed
    exactly as the state_dict is -- the plain model's keys, also for interleaved chunks."""
    entries = strip_prefixes(unwrap(model).state_dict(keep_vars=True))
    return {key: list(getattr(value, "tensor_splits", [])) for key, value in entries.items()}


def complete_zero_state(state: dict, file: PathLike, trusted: bool = False) -> dict:
    """A ZeRO save's stage file holds a skeleton; its data ranks' segments lie beside it
    (zero.py). Put them back: the plain optimizer state, and at level 3 the model's sharded
    parameters (None in the file). Any other file's state is returned as it is."""
    saved = state.get("optimizer")
    if not isinstance(saved, dict) or "zero_files" not in saved:
        return state
    files = [zero_path(file, r) for r in range(saved["zero_files"])]
    parts = [read_file(f, "cpu", trusted) for f in files]
    check_one_save([describe_save(s, f) for s, f in zip([state, *parts], [file, *files])])
    state = {**state, "optimizer": assemble(saved, parts)}
    if saved.get("param_names"):  # level 3: in the model's key order
        params = assemble_params(saved, parts)
        state["model"] = {k: params.get(k, v) for k, v in state["model"].items()}
    return state


def load_optimizer_state(file: PathLike, trusted: bool = False) -> Any:
    """The optimizer state saved in `file` (one stage's file, or `ckpt.pt` of a save without
    stages) -- saved under ZeRO, the plain state merged from its data ranks' segments, which loads
    into one process's torch optimizer (state["optimizer"]) or any data size's ZeRO optimizer."""
    return complete_zero_state(read_file(file, "cpu", trusted), file, trusted).get("optimizer")


def _load_all(paths: list[PathLike], trusted: bool) -> list[dict]:
    """Read a save's files (CPU) and check they all come from that one save."""
    states = [complete_zero_state(read_file(path, "cpu", trusted), path, trusted) for path in paths]
    check_one_save([describe_save(state, path) for state, path in zip(states, paths)])
    return states


# -- merging ------------------------------------------------------------------------------------
def _rebuild(blocks: dict[int, torch.Tensor], splits: list, size: int, q: int) -> torch.Tensor:
    """Undo tensor/base.slice_of offline: concatenate the tensor ranks' blocks of one parameter
    (q: the side of the 2d/2.5d grid or 3d cube)."""
    def build(todo: list, fixed: dict) -> torch.Tensor:
        if not todo:  # a block every rank with these coordinates holds alike
            return next(b for t, b in sorted(blocks.items())
                        if all(POSITION[axis](t, q) == i for axis, i in fixed.items()))
        dim, axis = todo[0]
        parts = {"tensor": size, "depth": size // (q * q)}.get(axis, q)
        return torch.cat([build(todo[1:], {**fixed, axis: i}) for i in range(parts)], dim=dim)
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
        merged[key] = _rebuild({t: m[key] for t, m in models.items()}, splits.get(key, []), size,
                               info[0].get("side", math.isqrt(size)))
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
    state_dict = strip_prefixes(state_dict)
    splits = tensor_splits_of(model)
    own = unwrap(model).state_dict(keep_vars=True)  # (keep_vars: no gather at ZeRO level 3)
    sliced = {}
    for own_key, key in zip(own, strip_prefixes(own)):  # the module's keys, the plain ones
        if key not in state_dict:
            raise KeyError(f"[rank {gpc.rank}] the plain state_dict has no {key!r}")
        sliced[own_key] = slice_of(state_dict[key], splits[key])
    unwrap(model).load_state_dict(sliced)
