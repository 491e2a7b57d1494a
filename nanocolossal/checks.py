"""Checks that turn distributed hangs into errors before they happen.

Most distributed hangs are not bugs in communication but disagreements between ranks:
one rank has 11 batches and another 12, so the second waits forever in its 12th
all-reduce; a config file edited on one node only; a model built with a different width.
Nothing fails -- everyone waits. `check_consistency` compares these on all ranks with one
all-gather at the start of training and fails with the full picture:

    [rank 0] ranks disagree on the number of training batches per epoch: rank 0: 12, rank 1: 11.
    Every rank must run the same number of steps ...

`debug=True` in the config adds TORCH_DISTRIBUTED_DEBUG=DETAIL (torch checks that every collective
matches across ranks) and a barrier after each epoch; on gloo a monitored one, which names the ranks
that did not arrive instead of waiting silently (nccl has none: a plain barrier).
"""
from __future__ import annotations

import hashlib
from enum import Enum
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn

from .config import ConfigError
from .context import gpc


def describe_parameters(model: nn.Module) -> list[tuple]:
    """(name, shape, dtype) of every parameter: what must agree for ranks to hold the same model."""
    return [(name, tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters()]


def check_same_model(model: nn.Module, group: Optional[dist.ProcessGroup], who: str) -> None:
    """Different models on different ranks would reduce garbage or hang: refuse early, naming
    the first parameter that differs."""
    mine = describe_parameters(model)
    everyone: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    for rank, theirs in zip(dist.get_process_group_ranks(group or dist.group.WORLD), everyone):
        if theirs == mine:
            continue
        diff = next(((a, b) for a, b in zip(mine, theirs) if a != b), None)
        detail = (f"first difference: {diff[0]} here vs {diff[1]} on rank {rank}" if diff
                  else f"{len(mine)} parameters here vs {len(theirs)} on rank {rank}")
        raise RuntimeError(f"[rank {gpc.rank}] {who}: the model on rank {gpc.rank} differs from "
                           f"the model on rank {rank} ({detail}); build the same model on every "
                           f"rank")


def comparable(value: Any) -> Any:
    """A form of a config value that means the same on every rank: plain data by value; a
    function, class or other object by what it *is*, its qualified name (its repr carries a
    memory address, different in every process)."""
    if isinstance(value, (type(None), bool, int, float, complex, str, bytes)):
        return repr(value)
    if isinstance(value, Enum):
        return f"{type(value).__qualname__}.{value.name}"
    if isinstance(value, (list, tuple)):
        return [type(value).__name__, [comparable(v) for v in value]]
    if isinstance(value, dict):
        return {str(k): comparable(v) for k, v in value.items()}
    kind = value if callable(value) and hasattr(value, "__qualname__") else type(value)
    return f"<{getattr(kind, '__module__', '?')}.{getattr(kind, '__qualname__', kind.__name__)}>"


def loader_length(loader: object) -> Optional[int]:
    """How many batches `loader` yields an epoch, or None for a stream: a loader without
    `__len__`, or torch's DataLoader over an IterableDataset (it has `__len__`, which raises)."""
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None


def check_consistency(model: nn.Module, train_dataloader: Iterable,
                      test_dataloader: Iterable = None) -> None:
    """Collective: raise on every rank if ranks disagree on batches per epoch, config or model."""
    if not gpc.is_initialized or gpc.world_size == 1:
        return
    mine = {"batches": loader_length(train_dataloader),
            "test batches": loader_length(test_dataloader),
            "config": comparable(dict(gpc.config)),
            "model": hashlib.sha1(repr(describe_parameters(model)).encode()).hexdigest(),
            "stage": gpc.pipeline_rank,
            "experts": gpc.ep_rank}  # parallel.moe: ranks of an EP group hold other experts
    everyone: list[Any] = [None] * gpc.world_size
    dist.all_gather_object(everyone, mine)
    counts = [e["batches"] for e in everyone]
    if len(set(counts)) > 1:
        listed = ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts))
        raise RuntimeError(
            f"[rank {gpc.rank}] ranks disagree on the number of training batches per epoch: "
            f"{listed}. Every rank must run the same number of steps, or the collectives of the "
            f"extra steps wait forever; shard the same dataset with DistributedSampler (pad=True "
            f"or drop_last=True) on every rank")
    _check_evaluation_batches([e["test batches"] for e in everyone], model)
    for r, other in enumerate(everyone):
        if other["config"] != mine["config"]:
            keys = sorted(k for k in set(mine["config"]) | set(other["config"])
                          if mine["config"].get(k) != other["config"].get(k))
            raise RuntimeError(f"[rank {gpc.rank}] the config differs between rank {gpc.rank} and "
                               f"rank {r} in {keys}; start every rank with the same config file")
        holds_the_same = (other["stage"], other["experts"]) == (mine["stage"], mine["experts"])
        if holds_the_same and other["model"] != mine["model"]:
            raise RuntimeError(f"[rank {gpc.rank}] the model (stage {gpc.pipeline_rank}) differs "
                               f"between rank {gpc.rank} and rank {r}: parameter names, shapes or "
                               f"dtypes do not match; build the same model with the same arguments "
                               f"on every rank")


def check_streams_end_together(has: list[int], read: int) -> None:
    """After `read` batches each rank said whether it has another (data.AgreedStream): all none
    is the end of every stream; some only is streams of unequal lengths."""
    ahead = [r for r, h in enumerate(has) if h]
    if ahead:
        ended = [r for r, h in enumerate(has) if not h]
        raise RuntimeError(
            f"[rank {gpc.rank}] the ranks' data streams have unequal lengths: after {read} "
            f"batches, rank(s) {ahead} have another and rank(s) {ended} have none. Every rank "
            f"must run the same number of steps: give every rank a shard of the same length "
            f"(drop the remainder), or use a dataset with a length and DistributedSampler "
            f"(nc.get_dataloader)")


def check_evaluation(model: nn.Module, test_dataloader: Iterable) -> None:
    """Collective: `_check_evaluation_batches` alone, before an evaluation outside `fit`."""
    if gpc.is_initialized and gpc.world_size > 1:
        everyone: list[Any] = [None] * gpc.world_size
        dist.all_gather_object(everyone, loader_length(test_dataloader))
        _check_evaluation_batches(everyone, model)


_FORWARD_TALKS: list[Callable[[nn.Module], Optional[str]]] = []


def forward_talks(why: Callable[[nn.Module], Optional[str]]) -> None:
    """Register `why(model)`: how this feature's forward communicates between data ranks, or
    None where the model does not use it (moe/settings.py, zero/optimizer_checks.py)."""
    _FORWARD_TALKS.append(why)


def _check_evaluation_batches(counts: list, model: nn.Module) -> None:
    """Evaluation may be uneven (pad=False, for exact metrics) -- unless the forward itself
    talks between data ranks (MoE layers exchange tokens, ZeRO level 3 gathers each unit's
    parameters): a rank with an extra batch would meet the others' metric all-reduce instead."""
    talks = next((why for why in (f(model) for f in _FORWARD_TALKS) if why), None)
    if len(set(counts)) > 1 and gpc.data_size > 1 and talks:
        listed = ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts))
        raise ConfigError(
            f"[rank {gpc.rank}] ranks disagree on the number of evaluation batches ({listed}) "
            f"and {talks} between data ranks in every forward; "
            f"give the test loader the same number of batches on every rank: "
            f"DistributedSampler(pad=True) or drop_last=True")


def peer_failed(what: str, group: Any, error: Exception) -> RuntimeError:
    """The error for a collective of a data-parallel group that failed: which one, and where to
    look (the peer that stopped has the first error)."""
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    return RuntimeError(
        f"[rank {gpc.rank}] {what} failed ({first}): another rank of data-parallel group "
        f"{dist.get_process_group_ranks(group)} stopped, crashed or fell more than "
        f"{gpc.timeout.total_seconds():.0f} s behind; look for the first error on the other ranks")


def _name(model: nn.Module, param: nn.Parameter) -> str:
    return next((n for n, p in model.named_parameters() if p is param), "a parameter")


def check_still_frozen(model: nn.Module, frozen: list, who: str) -> None:
    """DDP and the gradient handlers list the parameters needing a gradient when built: one
    unfrozen since would never be averaged, the replicas drifting apart silently (torch's too)."""
    thawed = [_name(model, p) for p in frozen if p.requires_grad]
    if thawed:
        raise RuntimeError(f"[rank {gpc.rank}] {who}: {', '.join(thawed[:4])} did not require "
                           f"grad when {who} was built and now does: its gradient would never be "
                           f"averaged. Unfreeze before nanocolossal.initialize (or wrapping in "
                           f"DDP), or keep it trainable and freeze it with lr=0")


def refuse_unfreezing(hooked: nn.Module, model: nn.Module, who: Callable[[], str]) -> Any:
    """Before every training forward of `hooked`, check_still_frozen on the parameters of
    `model` frozen now (DDP's wrapper and ZeRO 3's model install it when they are built; `who`
    is read when it fires: ZeRO 1 renames its DDP after building it)."""
    frozen = [p for p in model.parameters() if not p.requires_grad]
    if frozen:  # (returns the hook's handle, else None)
        return hooked.register_forward_pre_hook(
            lambda *_: check_still_frozen(model, frozen, who()) if torch.is_grad_enabled()
            else None)


def ready_twice(model: nn.Module, param: nn.Parameter, who: str, other: str = "") -> RuntimeError:
    """A parameter's gradient hook fired twice in one backward, its first gradient already being
    averaged. `who` reduces the buckets; `other`: another way out it offers."""
    return RuntimeError(f"[rank {gpc.rank}] {who}: {_name(model, param)} got a second gradient "
                        f"in one backward after its first was handed to the reduction (a layer "
                        f"used twice, each use checkpointed by nc.utils.checkpoint or by "
                        f"torch.utils.checkpoint with use_reentrant=True?): checkpoint the uses "
                        f"together in one call, or use torch.utils.checkpoint with "
                        f"use_reentrant=False{other}")


def debug_barrier(where: str) -> None:
    """With config debug=True: a barrier that names the ranks that did not arrive (gloo)."""
    if not (gpc.is_initialized and gpc.world_size > 1 and gpc.config.get("debug")):
        return
    try:
        if gpc.backend == "gloo":
            dist.monitored_barrier(timeout=gpc.timeout, wait_all_ranks=True)
        else:
            dist.barrier()
    except RuntimeError as e:
        raise RuntimeError(f"[rank {gpc.rank}] debug barrier at {where} failed: {e}") from e


def same_everywhere(value: int, group: Optional[dist.ProcessGroup],
                    device: Optional[torch.device] = None) -> bool:
    """Whether every rank of `group` passed the same integer (one all-reduce of [v, -v], MAX;
    `device`: where the group's backend reduces, a GPU for NCCL)."""
    both = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    return int(both[0]) == -int(both[1])
