"""What the tensor-parallel layers refuse, each check called in one line: sizes that do not split,
tied weights cut another way, inputs that do not fit, ids outside the vocabulary, batches the
grid cannot cut, sequence lengths the zig-zag split or ring attention cannot take."""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..config import ConfigError
from ..context import gpc


def check_batch(x: torch.Tensor, parts: int) -> None:
    if x.shape[0] % parts != 0:
        raise ConfigError(f"[rank {gpc.rank}] a batch of {x.shape[0]} {batch_split_error(parts)}; "
                          f"use a batch size that is a multiple of {parts}")


def batch_split_error(parts: int) -> str:
    """What a batch that does not split into `parts` (this mode's batch shares) cannot do."""
    where = {"2d": "rows of the 2d grid",
             "2.5d": f"rows of the 2.5d grids ({gpc.tensor_depth} grids of {gpc.summa_dim})",
             "3d": "batch shares of the 3d cube"}[gpc.tensor_mode]
    return (f"cannot be split over the {parts} {where} (tensor size "
            f"{gpc.tensor_size})")


def check_tied_shape(weight: nn.Parameter, expected: torch.Size, in_features: int,
                     num_classes: int) -> None:
    if weight.shape != expected:
        raise ValueError(f"[rank {gpc.rank}] the tied weight's slice has shape "
                         f"{tuple(weight.shape)}, but a classifier of {in_features} features and "
                         f"{num_classes} classes needs {tuple(expected)} here: tie it to an "
                         f"embedding of {num_classes} rows and {in_features} features")


def check_divisible(size: int, parts: int, what: str) -> None:
    """A size the layer splits must divide: said when the layer is built (a model's size is the
    user's choice, like the config's: a ConfigError, one line)."""
    if size % parts != 0:
        raise ConfigError(f"[rank {gpc.rank}] {what} {size} is not divisible by "
                          f"{parts} (tensor parallel {gpc.tensor_mode}, size "
                          f"{gpc.tensor_size}); choose a multiple of {parts}")


def check_input_split(x: torch.Tensor, layer: str, in_features: int, parts: int, over: str) -> None:
    """A split Linear's input holds in_features / parts of the hidden dimension."""
    if x.shape[-1] * parts != in_features:
        raise ValueError(f"[rank {gpc.rank}] {layer} expects its input's last dimension split "
                         f"over the {parts} {over} ({in_features // parts}), got {x.shape[-1]}")


def tied(own: nn.Parameter, weight: Optional[nn.Parameter], split_by: str, in_features: int,
         num_classes: int) -> nn.Parameter:
    """A classifier's weight: its own slice `own`, or the tied `weight` (another layer's, the
    token embedding's) if it is cut as `own` is (`split_by` says how, and by which embedding) and
    to the same shape: a table cut another way would silently compute wrong logits."""
    if weight is None:
        return own
    got = getattr(weight, "tensor_splits", [])
    if list(got) != list(own.tensor_splits):
        raise ValueError(f"[rank {gpc.rank}] this classifier ties only to a weight split "
                         f"{split_by}: {own.tensor_splits} here ({gpc.tensor_mode}); got one "
                         f"split {got}")
    check_tied_shape(weight, own.shape, in_features, num_classes)
    return weight


def check_ids(ids: torch.Tensor, vocab_size: int, what: str) -> None:
    """Out-of-range ids would find no rank's row (a zero vector, or a meaningless loss) where
    torch raises: raise too. (A sync per call: the price of failing loudly.)"""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise IndexError(f"[rank {gpc.rank}] {what} must be in [0, {vocab_size}), got "
                         f"{int(ids.min())} .. {int(ids.max())}")


def check_column_input(layer: nn.Module, x: torch.Tensor) -> None:
    if x.shape[-1] != layer.in_features:
        raise ValueError(f"[rank {gpc.rank}] column-parallel Linear({layer.in_features}, "
                         f"{layer.out_features}) got an input with {x.shape[-1]} features; 1d "
                         f"Linears alternate column/row, so a model needs its Linears in pairs "
                         f"(or pass a replicated input here)")


def check_row_input(layer: nn.Module, x: torch.Tensor) -> None:
    if x.shape[-1] * gpc.tensor_size != layer.in_features:
        raise ValueError(f"[rank {gpc.rank}] row-parallel Linear({layer.in_features}, "
                         f"{layer.out_features}) expects its input split over {gpc.tensor_size} "
                         f"ranks ({layer.in_features // gpc.tensor_size} features), got "
                         f"{x.shape[-1]}; put a column-parallel Linear before it")


def check_vocab_loss(reduction, label_smoothing: float) -> None:
    """The vocab-parallel losses' options: F.cross_entropy's reductions, no label smoothing."""
    if label_smoothing:
        raise ValueError(f"[rank {gpc.rank}] label_smoothing is not supported by the "
                         f"vocab-parallel loss; use 0")
    if reduction not in ("mean", "sum", "none", True, False):
        raise ValueError(f"[rank {gpc.rank}] reduction must be 'mean', 'sum' or 'none', got "
                         f"{reduction!r}")


def check_slice(size: int, parts: int) -> None:
    """A dimension cut into `parts` slices must divide."""
    if size % parts != 0:
        raise ValueError(f"[rank {gpc.rank}] a dimension of size {size} does not split over "
                         f"{parts} tensor-parallel ranks ({gpc.tensor_mode}); make it a multiple "
                         f"of {parts}")


def check_share_lengths(lengths: list[int], sizes: list[int]) -> None:
    """Every rank's token count is its two stripes of the whole sequence (`sizes`: the 2N)."""
    n = len(lengths)
    want = [sizes[r] + sizes[2 * n - 1 - r] for r in range(n)]
    if lengths != want:
        raise ValueError(f"[rank {dist.get_rank()}] the {n} sequence-parallel ranks hold "
                         f"{lengths} tokens, which is not the zig-zag split of {sum(lengths)} "
                         f"tokens ({want}); give rank r zigzag_split(x, 1, {n}, r, even=False) "
                         f"(the loader initialize returns does)")


def check_ring_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int, causal: bool,
                      attention: str) -> None:
    if attention not in ("fused", "explicit"):
        raise ValueError(f"attention={attention!r}: use 'fused' or 'explicit'")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k, v must have one shape; got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if causal and n > 1 and q.shape[-2] % 2:
        raise ConfigError(f"[rank {dist.get_rank()}] causal ring attention needs the zig-zag "
                          f"layout (2 stripes per rank) but the local sequence has odd length "
                          f"{q.shape[-2]}; split a sequence of a multiple of {2 * n} tokens with "
                          f"split_sequence")
