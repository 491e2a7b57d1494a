"""What initialize refuses under tensor parallelism, beside plain torch layers (engine/checks.py).

A parameter outside nanocolossal's layers has no one to sum its gradient over the tensor ranks:
whether each rank's gradient is whole or a piece depends on where the parameter is used (a
LayerNorm after a row-parallel Linear sees the whole activation, a scale after a column-parallel
one a slice), which no check can see. Refused, naming it, rather than let its copies drift.

A batch the grid (2d, 2.5d) or the cube (3d) cannot cut into its batch shares fails in the
forward; a loader's last, shorter batch only after an epoch's steps. Checked up front.
"""
from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.data import DataLoader

from ..config import ConfigError
from ..context import gpc
from .layer_checks import batch_split_error
from .layers_2d import tensor_batch_shares


def check_tensor_model(model: nn.Module, loaders: dict[str, Any]) -> None:
    """Every trainable parameter is an nc.nn layer's; every batch splits into the batch shares."""
    check_replicated_parameters(model)
    check_batches_split(loaders)


def check_replicated_parameters(model: nn.Module) -> None:
    """nc.nn's layers mark their parameters (tensor_splits) and reduce their gradients; any other
    trainable parameter would be a copy per tensor rank that nothing keeps equal. Except a torch
    normalisation layer (LayerNorm, GroupNorm, BatchNorm, or a subclass) under 1d, which gives it
    whole activations outside a column/row pair, where such layers sit. Another torch layer with
    a parameter (PReLU, ...) may sit between the two, on a slice: refused like any other."""
    norms = (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)
    for owner_name, owner in model.named_modules():
        for name, p in owner.named_parameters(recurse=False):
            if not p.requires_grad or hasattr(p, "tensor_splits"):
                continue
            if gpc.tensor_mode == "1d" and isinstance(owner, norms):
                continue
            raise ConfigError(
                f"[rank {gpc.rank}] parallel.tensor={gpc.tensor_size} ({gpc.tensor_mode}) but "
                f"{f'{owner_name}.' if owner_name else ''}{name} ({type(owner).__name__}'s) is "
                f"not a parameter of a nanocolossal.nn layer: each tensor rank would compute "
                f"its gradient from the activation it holds and nothing would sum them, so its "
                f"{gpc.tensor_size} copies would drift apart; build it from nc.nn layers "
                f"(e.g. nc.nn.Linear, nc.nn.LayerNorm) or freeze it (requires_grad=False)")


def check_batches_split(loaders: dict[str, Any]) -> None:
    """Every batch of a DataLoader, the full ones and the last, cuts into the batch shares; in
    a pipeline each of its NUM_MICRO_BATCHES micro-batches does (so the batch: a multiple of
    shares x micro-batches)."""
    shares = tensor_batch_shares()
    if shares == 1:  # 1d: every rank takes the whole batch
        return
    m = gpc.config.get("NUM_MICRO_BATCHES", 1) if gpc.pipeline_size > 1 else 1
    multiple = shares * m
    cut = f" ({m} micro-batches)" if m > 1 else ""
    for name, loader in loaders.items():
        # batch_size= makes a BatchSampler too; a batch_sampler= of the user's may say its size
        batches = getattr(loader, "batch_sampler", None)
        size = getattr(batches, "batch_size", None)
        if not isinstance(loader, DataLoader) or size is None:
            continue
        try:
            n = len(batches.sampler)  # this rank's share where a DistributedSampler shards
        except (AttributeError, TypeError):  # an iterable dataset: no length to check
            continue
        full = size if n >= size else 0
        last = 0 if getattr(batches, "drop_last", False) else n % size
        if full % multiple:
            raise ConfigError(f"[rank {gpc.rank}] the {name} dataloader's batches of {full}"
                              f"{cut} {batch_split_error(shares)}; use a batch size that is a "
                              f"multiple of {multiple}")
        if last % multiple:
            raise ConfigError(f"[rank {gpc.rank}] the {name} dataloader's last batch has {last} "
                              f"sample(s){cut}, which {batch_split_error(shares)}, and would fail "
                              f"after {n // size} batches; pass drop_last=True, or "
                              f"pick a batch size that leaves no remainder of {n} or a multiple "
                              f"of {multiple}")
