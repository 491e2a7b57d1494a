"""What sequence parallelism refuses: a model whose layers would mix the split tokens, samples
ring attention cannot cut, sequences longer than the position table (sequence.py and initialize
call each in one line)."""
from __future__ import annotations

from collections.abc import Sized
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, default_collate

from .config import ConfigError
from .config_checks import check_length
from .context import gpc
from .nest import map_tensors


def check_positions(lengths: list[int], max_positions: Optional[int], even: bool) -> None:
    """A sequence of sum(lengths) tokens fits a table of `max_positions` (None: no table); refused
    on every rank alike: only some ranks' stripes would reach past it, the others would wait."""
    n = len(lengths)
    if max_positions is not None and sum(lengths) > max_positions:
        raise ValueError(f"[rank {gpc.rank}] a sequence of {sum(lengths)} tokens"
                         f"{f' ({n} x {lengths[0]})' if n > 1 and even else ''} is longer "
                         f"than the model's {max_positions} positions; use sequences of at most "
                         f"{max_positions} tokens (SEQ_LEN) or a model with more positions")


def check_sample_lengths(loader: Any) -> None:
    """Ring attention at initialize: the first sample of a loader's dataset (where batches are
    its samples stacked) has the sequences' length; refused now, not at the first batch."""
    dataset = getattr(loader, "dataset", None)
    if not (isinstance(loader, DataLoader) and loader.collate_fn is default_collate
            and isinstance(dataset, Sized) and not isinstance(dataset, IterableDataset)
            and len(dataset) > 0):
        return
    # a sample's tensors of 1 or more dims are the batch's of 2 or more: split along dim 1
    map_tensors(lambda t: check_length(len(t), gpc.sequence_size) if t.dim() else None, dataset[0])


def check_sequence_model(model: nn.Module) -> None:
    """Sequence parallelism is right only if every layer but attention works per token, and
    attention knows the sequence is split. A model without such attention (a CNN, a ViT of
    torch.nn.MultiheadAttention) would train on pieces of sequences as if they were whole.
    A pipeline stage may hold no attention (zbv's rank 0: the embedding and the head): the
    stages ask each other (collective over the pipeline group) whether any of them has one."""
    aware = [n for n, m in model.named_modules() if getattr(m, "splits_sequence", False)]
    unaware = [n for n, m in model.named_modules()
               if isinstance(m, (nn.MultiheadAttention, nn.Conv1d, nn.Conv2d))]
    if gpc.pipeline_size > 1:
        anyone = torch.tensor([float(bool(aware))], device=gpc.device)
        dist.all_reduce(anyone, op=dist.ReduceOp.MAX, group=gpc.pipeline_group)
        aware = aware or (["another stage's"] if anyone.item() else [])
    if not aware or unaware:
        kind = type(model.get_submodule(unaware[0])).__name__ if unaware else ""
        found = (f"it has {', '.join(unaware[:3])} ({kind}), which mixes tokens the split "
                 f"keeps apart" if unaware else "it has no attention that knows the sequence is "
                 "split")
        raise ConfigError(
            f"[rank {gpc.rank}] parallel.tensor mode='sequence' splits every sequence over "
            f"{gpc.sequence_size} ranks, but {found}; build attention with "
            f"nanocolossal.nn.transformer.Attention (ring attention) and per-token layers, or "
            f"use tensor mode '1d'/'2d' or data parallelism")
