"""2d and 2.5d tensor parallelism (SUMMA, Colossal-AI's Linear2D; Tesseract's Linear2p5D).

2d: a q x q grid splits batch *and* hidden.

Rank (row i, col j) of the grid holds, for an activation [B, ..., d], the tile
[B/q rows i, ..., d/q cols j]: the batch is split down a column group, the hidden dimension
along a row group. A Linear's weight is cut into q x q tiles (see summa.py for the product).

                 hidden d ->                        W [in, out]
             +--------+--------+                +--------+--------+
    batch B  | (0, 0) | (0, 1) |   row group 0  | W_00   | W_01   |  in tile 0
       |     +--------+--------+                +--------+--------+
       v     | (1, 0) | (1, 1) |   row group 1  | W_10   | W_11   |  in tile 1
             +--------+--------+                +--------+--------+
              column    column                   out tile 0 out tile 1
              group 0   group 1

Memory per rank: weights 1/q^2 (1d: 1/T = 1/q^2 too) and *every* activation 1/q^2 (1d keeps
the activations around each pair whole); communication per Linear ~ (|X| + |W|)/q words per
rank, less than 1d's all-reduce of |X| once q grows.

Vectors along the hidden dimension (biases, LayerNorm's gamma/beta, patch embeddings) are
split over the row and replicated down the column: every row computes their gradient from
its own batch share, so `copy_to(param, column group)` sums those in backward. LayerNorm's
mean and variance are sums over the row group (`group_sum`). The classifier multiplies its
hidden slice and sums over the row group, so the logits [B/q, classes] are whole within a
row; the loss sums each row's losses down the column group and divides by the batch's count.

2.5d (Tesseract, Wang et al. 2021) stacks `depth` such grids, T = q * q * depth. The batch is
cut into depth * q shares, grid k row i holding share k * q + i; every grid holds the same
weight tiles, so a grid is a data-parallel replica of a 2d layer:

    rank (grid k, row i, col j), q = 2, depth = 2:
        grid 0: batch shares 0, 1      grid 1: batch shares 2, 3
        (0,0,0) (0,0,1)                (1,0,0) (1,0,1)     W_ij on (0, i, j) and (1, i, j)
        (0,1,0) (0,1,1)                (1,1,0) (1,1,1)
    depth group {(0, i, j), (1, i, j)}: one weight tile, two grids' samples
    batch group {(k, i, j) for every k, i}: column j of every grid, grid-major

Each grid runs SUMMA on its own samples (summa.py, unchanged: rows and columns are the grid's).
A weight's gradient is its grids' sum: it enters through `copy_to(depth group)`, which sums in
backward; a vector replicated down the column is summed over the batch group (column x depth),
as is the loss. depth = 1 is 2d exactly. Per rank: weights |W| / q^2, activations
|X| / (q^2 depth), SUMMA's traffic ~ (|X| / depth + |W|) / q per Linear, and the weight
gradient's all-reduce over the depth group, |W| / q^2 elements.

Every layer here but Linear2D only needs to know which group splits the hidden dimension and
which splits the batch (`activation_split()`); 3d's layout A (tensor/cube.py: batch over the cube's
(x, y) plane, hidden over z) is such a layout too, so LayerNorm, Embedding, PatchEmbedding,
Classifier and the loss serve 3d as they are (layers_3d.py names them).

Before a launch, `nanocolossal plan` computes these per-rank shapes (nanocolossal/plan/model.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn
from torch.nn import functional as F

from ..context import gpc
from ..extensions import Extension
from ..loss_weights import counted_targets, mean_over
from .base import PatchEmbedding, add_bias, embed_patches, keep_slice
from .comm import Group, copy_to, group_sum, reduce_from, split
from .layer_checks import check_batch, check_divisible, check_input_split, tied
from .summa import summa_matmul


@dataclass
class ActivationSplit:
    """How an activation [batch, ..., hidden] is cut: hidden in `parts` over `hidden_group`
    (named `hidden_axis` in tensor_splits), batch in `batch_parts` shares over `batch_group`."""
    hidden_axis: str
    hidden_group: Group
    parts: int
    batch_group: Group
    batch_parts: int


def activation_split() -> ActivationSplit:
    """2d / 2.5d: hidden along the row (by column), batch over the batch group (column x depth);
    3d: layout A, hidden over z, batch over the (x, y) plane."""
    if gpc.tensor_mode == "3d":
        q = gpc.cube_dim
        return ActivationSplit("z", gpc.tensor_z_group, q, gpc.tensor_xy_group, q * q)
    q = gpc.summa_dim
    return ActivationSplit("col", gpc.tensor_row_group, q, gpc.tensor_batch_group,
                           q * gpc.tensor_depth)


def tensor_batch_shares() -> int:
    """How many shares the tensor ranks cut a batch into (1 unless 2d, 2.5d or 3d)."""
    return activation_split().batch_parts if gpc.tensor_mode in ("2d", "2.5d", "3d") else 1


def batch_share(x: torch.Tensor) -> torch.Tensor:
    """This rank's share of a batch that every tensor rank holds whole (inputs, labels): the
    grid row's (2.5d: share grid_depth * q + row of depth * q; 3d: share x * q + y)."""
    layout = activation_split()
    check_batch(x, layout.batch_parts)
    return split(x, 0, layout.batch_group)  # backward: the batch group's shares gathered


def grid_batch(x: torch.Tensor) -> torch.Tensor:
    """2.5d: this grid's samples (share grid_depth of depth); 2d: all of them."""
    check_batch(x, gpc.summa_dim * gpc.tensor_depth)
    return split(x, 0, gpc.tensor_depth_group)


def across_grids(w: torch.Tensor) -> torch.Tensor:
    """A weight tile every grid holds (2.5d): each grid's gradient is for its own samples, so
    the depth group sums them in backward, as a data split requires."""
    return copy_to(w, gpc.tensor_depth_group)


class SplitLabels(Extension):
    """The labels of the samples this rank's output holds (execute_schedule returns them, for
    metrics; extensions.py): a grid row holds one share of the batch, so its labels are cut the
    same way -- as the criterion cuts them where it says (`output_targets`: 3d's vocab-parallel
    logits are in another layout)."""

    def __init__(self, criterion=None) -> None:
        self.split = getattr(criterion, "output_targets", batch_share)

    def output_labels(self, label: torch.Tensor) -> torch.Tensor:
        return self.split(label)


def along_row(full: torch.Tensor, dim: int) -> nn.Parameter:
    """Slice `col` of a hidden-dimension vector: split along my row, replicated down my column
    (3d: slice z, replicated over the (x, y) plane)."""
    return keep_slice(full, [(dim, activation_split().hidden_axis)])


def down_column(p: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Replicated down the column (in every grid; 3d: over the plane): sum its batch shares'
    gradients. (None, an absent bias, stays None.)"""
    return None if p is None else copy_to(p, activation_split().batch_group)


class Linear2D(nn.Module):
    """y_ij = sum_k x_ik W_kj + b_j on the grid (input and output both [B/q, ..., d/q])."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        q = gpc.summa_dim
        check_divisible(in_features, q, "Linear in_features")
        check_divisible(out_features, q, "Linear out_features")
        full = nn.Linear(in_features, out_features, bias=bias)
        self.in_features, self.out_features = in_features, out_features
        # torch stores [out, in]: tile (row i, col j) is W's in-slice i, out-slice j
        self.weight = keep_slice(full.weight, [(0, "col"), (1, "row")])
        self.bias = along_row(full.bias, 0) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_bias(self.product(x), self.bias_slice())

    def bias_slice(self) -> Optional[torch.Tensor]:
        """The bias slice of my output columns, its gradient summed over the batch group."""
        return down_column(self.bias)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """The SUMMA product without the bias (Colossal-AI's skip_bias_add)."""
        check_input_split(x, f"2d Linear({self.in_features}, {self.out_features})",
                          self.in_features, gpc.summa_dim, "columns of the grid")
        return summa_matmul(x, across_grids(self.weight))


class LayerNorm2D(nn.Module):
    """LayerNorm over a hidden dimension split along the row: statistics are row-group sums."""

    is_normalization = True  # AMP O2 keeps it in fp32, as it keeps torch's LayerNorm (amp.py)

    def __init__(self, normalized_shape: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        check_divisible(normalized_shape, activation_split().parts, "LayerNorm size")
        full = nn.LayerNorm(normalized_shape, eps=eps, bias=bias)
        self.normalized_shape = normalized_shape
        self.eps = eps
        self.weight = along_row(full.weight, 0)
        self.bias = along_row(full.bias, 0) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = activation_split().hidden_group
        d = self.normalized_shape
        # in float32, as torch's LayerNorm computes: in fp16 the squares of activations near
        # 100 overflow, small variances lose their digits, and the backward's cancellations too
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))  # (float64 stays float64)
        mean = group_sum(x32.sum(-1, keepdim=True), rows) / d
        centred = x32 - mean
        var = group_sum((centred * centred).sum(-1, keepdim=True), rows) / d
        y = centred * torch.rsqrt(var + self.eps) * down_column(self.weight).to(x32.dtype)
        if self.bias is not None:
            y = y + down_column(self.bias).to(x32.dtype)
        return y.to(x.dtype)  # (the backward runs in float32 too, as torch's kernel's)


class PatchEmbedding2D(nn.Module):
    """Patch embedding for the grid: this row's images, this column's embedding channels."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_size: int) -> None:
        super().__init__()
        check_divisible(embed_size, activation_split().parts, "PatchEmbedding embed_size")
        full = PatchEmbedding(img_size, patch_size, in_chans, embed_size)
        self.patch_size = patch_size
        self.proj = nn.Module()  # so the state_dict keys are the plain layer's (proj.weight, ...)
        self.proj.weight = along_row(full.proj.weight, 0)
        self.proj.bias = along_row(full.proj.bias, 0)
        self.cls_token = along_row(full.cls_token, 2)
        self.pos_embed = along_row(full.pos_embed, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = [down_column(p) for p in (self.proj.weight, self.proj.bias, self.cls_token,
                                            self.pos_embed)]
        # every column convolves the same images with its own channels: sum their input gradients
        return embed_patches(copy_to(batch_share(x), activation_split().hidden_group), *params,
                             self.patch_size)


class Embedding2D(nn.Module):
    """Token embedding for the grid: this row's sequences, this column's embedding dims."""

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 padding_idx: Optional[int] = None) -> None:
        super().__init__()
        check_divisible(embedding_dim, activation_split().parts, "Embedding dim")
        full = nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx)
        self.weight = along_row(full.weight, 1)
        self.padding_idx = padding_idx  # every rank holds every row: torch's meaning as is

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(batch_share(ids), down_column(self.weight), padding_idx=self.padding_idx)


class Classifier2D(nn.Module):
    """logits_i = sum_j x_ij W_j^T + b: whole classes for this row's samples (row-group sum)."""

    def __init__(self, in_features: int, num_classes: int, bias: bool = True,
                 weight: Optional[nn.Parameter] = None) -> None:
        super().__init__()
        check_divisible(in_features, activation_split().parts, "Classifier in_features")
        full = nn.Linear(in_features, num_classes, bias=bias)
        own = along_row(full.weight, 1)
        self.weight = tied(own, weight, "by features (nc.nn.Embedding)", in_features, num_classes)
        self.bias = keep_slice(full.bias, []) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from(F.linear(x, down_column(self.weight)), activation_split().hidden_group)
        return add_bias(y, down_column(self.bias))


class CrossEntropyLoss2D(nn.Module):
    """F.cross_entropy of the whole batch, from this row's logits [B/q, classes] and the *whole*
    batch's labels. `reduction`: 'mean' (or True, Colossal-AI's spelling), 'sum', or 'none' (or
    False): the losses of this row's samples [B/q], laid out as the logits.

    A mean is sum / count over the batch, not the mean of the rows' means: rows that count
    differently (ignored targets, class `weight`s) would be weighted wrongly. Every rank holds
    all the labels, so the count -- the number of targets not ignored, or the sum of their
    class weights -- needs no communication; only the sum of the losses travels down the column.
    """

    def __init__(self, reduction: Union[str, bool] = "mean", ignore_index: int = -100,
                 weight: Optional[torch.Tensor] = None, label_smoothing: float = 0.0,
                 **unsupported) -> None:
        super().__init__()
        if unsupported:
            raise TypeError(f"[rank {gpc.rank}] CrossEntropyLoss2D does not take "
                            f"{', '.join(sorted(unsupported))}; it takes reduction ('mean', "
                            f"'sum', 'none'), ignore_index, weight and label_smoothing")
        reduction = {True: "mean", False: "none"}.get(reduction, reduction)
        if reduction not in ("mean", "sum", "none"):
            raise ValueError(f"[rank {gpc.rank}] reduction must be 'mean', 'sum' or 'none', got "
                             f"{reduction!r}")
        self.reduction = reduction
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.register_buffer("weight", weight)  # moves with .to(device), as torch's loss

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        losses = F.cross_entropy(logits, batch_share(target), self.weight,
                                 ignore_index=self.ignore_index, reduction="none",
                                 label_smoothing=self.label_smoothing)
        if self.reduction == "none":
            return losses
        total = reduce_from(losses.sum(), activation_split().batch_group)  # the rows' sums
        if self.reduction == "sum":
            return total
        # the mean's denominator, as F.cross_entropy's, from the whole batch's labels
        return mean_over(total, counted_targets(target, self.ignore_index, self.weight).to(total))
