"""Each rank's own file: saved atomically (`save_checkpoint`), loaded back into the layout that
wrote it (`load_checkpoint`), and the refusals of another layout's files, each naming both
layouts and the way across (through the plain model: merge.py)."""
from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from .. import cpu_half
from ..config import ConfigError
from ..context import gpc
from ..logging import get_dist_logger
from ..pipeline.partition import PipelinePart
from ..tensor.base import axis_position, grid_side
from .files import (
    PathLike,
    check_one_save,
    describe_save,
    name_kind,
    rank_files,
    read_file,
    save_files,
    strip_prefixes,
    unwrap,
    zero_path,
)
from .merge import complete_zero_state, tensor_splits_of
from .zero import ShardedState, load_model_entries, my_segments, read_my_segments, skeleton


def stage_path(path: PathLike, stage: Optional[int] = None,
               tensor_rank: Optional[int] = None) -> Path:
    """This rank's file: ckpt.pt alone, else ckpt-stage{p}-tensor{t}-expert{e}.pt (see __init__)."""
    path = Path(path)
    parts = []
    if gpc.pipeline_size > 1 or stage is not None:
        parts.append(f"stage{gpc.pipeline_rank if stage is None else stage}")
    if _tensor_split() > 1 or tensor_rank is not None:
        parts.append(f"tensor{gpc.tensor_rank if tensor_rank is None else tensor_rank}")
    if gpc.ep_size > 1:  # each rank of an expert-parallel group holds other experts
        parts.append(f"expert{gpc.ep_rank}")
    return path.with_name("-".join([path.stem, *parts]) + path.suffix) if parts else path


def _plain_shapes(model: nn.Module, splits: dict[str, list]) -> dict[str, list[int]]:
    """Each entry's shape in the plain model: the local block's, times the parts of its splits."""
    shapes = {}
    # keep_vars: shapes only, so no gather of ZeRO 3's sharded parameters (not collective)
    for key, value in strip_prefixes(unwrap(model).state_dict(keep_vars=True)).items():
        shape = list(value.shape)
        for dim, axis in splits[key]:
            shape[dim] *= axis_position(axis)[1]
        shapes[key] = shape
    return shapes


def _rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if gpc.dropout_generators:  # tensor-parallel dropout's own generators (tensor/base.py)
        state["dropout"] = {str(d): g.get_state() for d, g in gpc.dropout_generators.items()}
    try:
        import numpy as np
        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
    if "numpy" in state:
        import numpy as np
        np.random.set_state(state["numpy"])
    for device, gen_state in state.get("dropout", {}).items():
        gen = gpc.dropout_generators.setdefault(torch.device(device),
                                                torch.Generator(device=device))
        gen.set_state(gen_state.cpu())


def atomic_save(obj: Any, path: PathLike) -> None:
    """torch.save to a temp file beside `path`, fsync, rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():  # the rename did not happen: leave the old checkpoint as it was
            tmp.unlink()


def save_checkpoint(path: PathLike, epoch: int, model: nn.Module, optimizer: Any = None,
                    lr_scheduler: Any = None, **extra: Any) -> None:
    """Save (collective when launched: every rank must call it)."""
    if getattr(optimizer, "open_group", False):  # the engine's optimizer (amp.py)
        raise ConfigError(
            f"[rank {gpc.rank}] checkpoint requested in the middle of a gradient accumulation "
            f"group (a backward since the last optimizer step); its gradients cannot be saved, "
            f"so the resumed run would differ. Save after the step (engine.accumulating is False)")
    rng = [_rng_state()]  # one per rank holding these parameters: data (x sequence) ranks
    if gpc.is_initialized and gpc.gradient_size > 1:
        rng = [None] * gpc.gradient_size
        dist.all_gather_object(rng, _rng_state(), group=gpc.gradient_group)
    save_id = [f"{os.getpid()}-{time.time_ns()}"]
    if gpc.is_initialized and gpc.world_size > 1:
        dist.broadcast_object_list(save_id, src=0)  # one id for the whole set of stage files
    if isinstance(optimizer, ShardedState):  # ZeRO: every data rank writes its own segments
        atomic_save({"save_id": save_id[0], **my_segments(optimizer)},
                    zero_path(stage_path(path), optimizer.rank))
        optimizer_state = {"zero_files": optimizer.size, **skeleton(optimizer)}
    else:
        optimizer_state = optimizer.state_dict() if optimizer is not None else None
    if isinstance(optimizer, ShardedState) and optimizer.level == 3:  # no gather: my segments
        sharded = {k for names in optimizer.param_names() for k in names}  # are in ckpt-zero{r}
        model_state = {k: None if k in sharded else v.detach() for k, v in
                       strip_prefixes(unwrap(model).state_dict(keep_vars=True)).items()}
    else:
        model_state = strip_prefixes(unwrap(model).state_dict())  # (ZeRO 3 alone: gathers)
    # sequence ranks hold replicas too: one of them writes; with experts (parallel.moe) each
    # rank of the first expert-parallel group, whose ranks hold different experts
    if gpc.gradient_rank < gpc.ep_size:
        splits = tensor_splits_of(model)
        state = {"epoch": epoch, "save_id": save_id[0], "model": model_state,
                 "optimizer": optimizer_state,
                 "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
                 "rng": rng, "extra": extra,
                 "pipeline": {"rank": gpc.pipeline_rank, "size": gpc.pipeline_size,
                              "layers": _stage_layers(model)},
                 "tensor": {"rank": gpc.tensor_rank, "size": _tensor_split(),
                            "mode": _job_layout()[2], "side": grid_side(),
                            "splits": splits, "shapes": _plain_shapes(model, splits)},
                 "moe": {"rank": gpc.ep_rank, "size": gpc.ep_size},
                 "cpu_half": cpu_half.stored_choice()}
        atomic_save(state, stage_path(path))
    if gpc.is_initialized and gpc.world_size > 1:
        dist.barrier()


def load_checkpoint(path: PathLike, model: nn.Module, optimizer: Any = None,
                    lr_scheduler: Any = None, map_location: Any = None, strict: bool = True,
                    restore_rng: bool = True, trusted: bool = False) -> dict:
    """Load into model/optimizer/scheduler; returns {"epoch": ..., **extra}."""
    file = stage_path(path)
    if not file.is_file():
        _refuse_other_layout(path, trusted)
        raise FileNotFoundError(f"[rank {gpc.rank}] checkpoint {str(file)!r} not found")
    _refuse_an_older_save(path, file)
    state = read_file(file, map_location or gpc.device, trusted)
    # ZeRO: my segments from the files that hold them (zero.py), else merged whole and cut
    state = read_my_segments(state, file, optimizer, trusted) or complete_zero_state(state, file,
                                                                                  trusted)
    _check_layout(state, file, path)
    _check_cut(state, file, path, model)
    _check_compute_type(state.get("cpu_half"), file)
    if gpc.is_initialized and gpc.pipeline_size * gpc.tensor_size > 1:
        parts: list[Any] = [None] * (gpc.pipeline_size * gpc.tensor_size)
        dist.all_gather_object(parts, describe_save(state, file), group=gpc.model_group)
        check_one_save(parts)
    load_model_entries(unwrap(model), strip_prefixes(state["model"]), strict)
    if optimizer is not None and state.get("optimizer") is not None:
        optimizer.load_state_dict(state["optimizer"])
    if lr_scheduler is not None and state.get("lr_scheduler") is not None:
        lr_scheduler.load_state_dict(state["lr_scheduler"])
    rng = state.get("rng") or []
    mine = rng[gpc.gradient_rank] if gpc.gradient_rank < len(rng) else None
    if restore_rng and mine is not None:
        set_rng_state(mine)
    info = {"epoch": state["epoch"], **state.get("extra", {})}
    if not restore_rng:
        info["rng"] = mine  # for the caller to restore later (see skip_batches)
    return info


def _check_compute_type(saved: Optional[str], file: Path) -> None:
    """fp16 on a CPU computes in the type its instruction set allows (cpu_half.py): a file saved
    on another kind of CPU was computed in another type than this run will be."""
    now = cpu_half.stored_choice()
    if saved and now and saved != now:
        get_dist_logger().warning(
            f"[rank {gpc.rank}] {file} was computed in {saved} (fp16 on its CPU) and this CPU "
            f"computes in {now}: the resumed run will differ from the straight one; to compute "
            f"as it did, set fp16=dict(..., dtype='bfloat16') (or enabled=False for float32)")


# -- one layout per file ----------------------------------------------------------------------
LayoutSizes = tuple[int, int, Optional[str], int]  # (pipeline, tensor size, tensor mode, experts)


def describe_layout(layout: LayoutSizes) -> str:
    """'pipeline 2, tensor 1d x2' -- how a job (or the job that saved a file) is split."""
    pipeline, tensor, mode, experts = layout
    tensor_part = f"tensor {mode} x{tensor}" if tensor > 1 else "no tensor parallelism"
    return f"pipeline {pipeline}, {tensor_part}" + (f", experts x{experts}" if experts > 1 else "")


def _saved_layout(state: dict) -> LayoutSizes:
    tensor = state.get("tensor") or {}
    size = tensor.get("size", 1)  # files of one process, or of old versions, record none
    pipeline = (state.get("pipeline") or {}).get("size", 1)
    experts = (state.get("moe") or {}).get("size", 1)  # expert files: one per expert rank
    return pipeline, size, tensor.get("mode") if size > 1 else None, experts


def _tensor_split() -> int:
    """Parts each parameter is cut into: sequence ranks hold whole replicas (files as without)."""
    return 1 if gpc.tensor_mode == "sequence" else gpc.tensor_size


def _job_layout() -> LayoutSizes:
    return (gpc.pipeline_size, _tensor_split(), gpc.tensor_mode if _tensor_split() > 1 else None,
            gpc.ep_size)


def _check_layout(state: dict, file: Path, path: PathLike) -> None:
    """A file holds its stage's blocks as that layout cut them: refuse another layout by name."""
    saved, job = _saved_layout(state), _job_layout()
    if saved != job:  # the user's to fix: a ConfigError (a ValueError) ends a script in one line
        raise ConfigError(
            f"[rank {gpc.rank}] {file} was saved under {describe_layout(saved)}, but this job "
            f"runs {describe_layout(job)}: a checkpoint loads only into the layout that saved "
            f"it. Launch {describe_layout(saved)}, or change layout {_through_plain(path)}")


def _stage_layers(model: nn.Module) -> Optional[list[list[int]]]:
    """[start, stop) of the layers each of this rank's pipeline parts holds (zbv's rank 0 of 2:
    [[0, 2], [6, 7]]): how the schedule and partition cut the model; None without a pipeline."""
    parts = [[m.start, m.stop] for m in unwrap(model).modules() if isinstance(m, PipelinePart)]
    return parts or None


def _check_cut(state: dict, file: Path, path: PathLike, model: nn.Module) -> None:
    """Same pipeline size, another cut (zbv's V against 1F1B or interleaved, another partition or
    NUM_CHUNKS): refused by name, as another layout is, not by load_state_dict's missing keys."""
    saved, job = (state.get("pipeline") or {}).get("layers"), _stage_layers(model)
    if saved is None or job is None or saved == job:  # older files record no cut
        return
    def show(parts: list) -> str:
        return ", ".join(f"{a}-{b - 1}" for a, b in parts)
    raise ConfigError(
        f"[rank {gpc.rank}] {file} holds layers {show(saved)} (its stage as the saving job cut "
        f"the model), but this rank's stage holds layers {show(job)}: a checkpoint loads only "
        f"into the same cut (PIPELINE_SCHEDULE, NUM_CHUNKS, partition). Cut the model as it was, "
        f"or change {_through_plain(path)}")


def _through_plain(path: PathLike) -> str:
    return (f"through the plain model: state = merge_checkpoint({str(path)!r}) (offline, any "
            f"layout's files), then load_plain_state_dict(model, state) in this job (the model "
            f"only: optimizer and scheduler start afresh)")


def _refuse_other_layout(path: PathLike, trusted: bool) -> None:
    """This rank's file is missing: if another layout saved to `path`, say so (its files have
    other names), rather than 'not found'."""
    try:
        other = save_files(path, trusted)[0]
    except FileNotFoundError:
        return
    _check_layout(read_file(other, "cpu", trusted), other, path)


def _refuse_an_older_save(path: PathLike, file: Path) -> None:
    """Another layout saved to `path` since this file was written: loading it would resume an
    older run without a word."""
    written = file.stat().st_mtime_ns
    newer = [f for f in (Path(path), *rank_files(path)) if f.is_file()
             and name_kind(path, f) != name_kind(path, file) and f.stat().st_mtime_ns > written]
    if newer:
        raise ConfigError(
            f"[rank {gpc.rank}] {max(newer, key=lambda f: f.stat().st_mtime_ns)} was saved to "
            f"{str(path)!r} by another layout after {file}: the newest save there is not this "
            f"job's layout. Continue from it {_through_plain(path)}, or move its files away to "
            f"resume the older save of this layout")
