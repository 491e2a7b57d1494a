"""3d tensor-parallel layers on the q x q x q cube (tensor/cube.py has the product and layouts).

Activations live in layout A -- batch in q^2 shares over the (x, y) plane, hidden in q over z --
except between a column and a row Linear (layout B: batch over (x, z), hidden over y):

    layer                  weights on rank (x, y, z)                 in -> out
    Linear3D column        W [N/q over y, K/q^2 over z then x]       A -> B
    Linear3D row           W [N/q over z, K/q^2 over y then x]       B -> A
      bias                 its output hidden slice, replicated over the output's batch plane
    LayerNorm3D            gamma, beta slice z; statistics summed over z      A -> A
    Embedding3D            table [V, d/q over z], replicated over (x, y)      ids -> A
    VocabParallelEmbedding3D  E [V/q over y, d/q^2 over z then x]: a column Linear's weight
    VocabParallelClassifier3D logits = h E^T, the column product with E: A -> B, vocabulary over y
    VocabParallelCrossEntropyLoss3D  the 1d vocabulary-parallel loss along y, summed over (x, z)

LayerNorm3D, Embedding3D, PatchEmbedding3D, Classifier3D and CrossEntropyLoss3D are the 2d
layers on layout A (layers_2d.activation_split()); only the weights that meet the cube product
differ.
Linears come in column/row pairs: nc.nn refuses a LayerNorm or classifier built between a column
Linear and its row partner, whose input would be in layout B.

The vocabulary-parallel embedding, with E cut as the classifier's weight (so the two are tied):
rank (x, y, z) gathers E's tile (vocabulary y, hidden z) along x, looks up batch share x of
the ids in it (zeros outside its vocabulary), and the y axis sums and scatters the result by
batch: share (x, y), hidden z -- layout A. Its backward sums E's gradient over x and keeps each
rank's slice (the all-gather's conjugate).

Before a launch, `nanocolossal plan` computes these per-rank shapes (nanocolossal/plan/model.py).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..context import gpc
from . import layers_2d
from .base import add_bias, keep_slice
from .comm import all_gather, copy_to, reduce_scatter, split
from .cube import COLUMN_SPLITS, ROW_SPLITS, column_matmul, row_matmul
from .layer_checks import check_batch, check_divisible, check_ids, check_input_split, tied
from .vocab_parallel import VocabParallelCrossEntropyLoss1D, look_up_slice, vocab_parallel_argmax


class Linear3D(nn.Module):
    """y = x W^T + b on the cube: `parallel` 'column' (layout A -> B) or 'row' (B -> A)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 parallel: str = "column") -> None:
        super().__init__()
        q = gpc.cube_dim
        check_divisible(in_features, q * q, "Linear in_features")
        check_divisible(out_features, q, "Linear out_features")
        full = nn.Linear(in_features, out_features, bias=bias)
        self.in_features, self.out_features = in_features, out_features
        self.parallel = parallel
        column = parallel == "column"
        self.weight = keep_slice(full.weight, COLUMN_SPLITS if column else ROW_SPLITS)
        self.bias = keep_slice(full.bias, [(0, "y" if column else "z")]) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_bias(self.product(x), self.bias_slice())

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """The cube product without the bias (Colossal-AI's skip_bias_add)."""
        axis = "z" if self.parallel == "column" else "y"
        check_input_split(x, f"3d Linear({self.in_features}, {self.out_features})",
                          self.in_features, gpc.cube_dim, f"ranks of the cube's {axis} axis")
        return (column_matmul if self.parallel == "column" else row_matmul)(x, self.weight)

    def bias_slice(self) -> Optional[torch.Tensor]:
        """The bias slice of my output's hidden slice; its gradient summed over the output's
        batch plane ((x, z) after a column Linear, (x, y) after a row one)."""
        if self.bias is None:
            return None
        plane = gpc.tensor_xz_group if self.parallel == "column" else gpc.tensor_xy_group
        return copy_to(self.bias, plane)


class LayerNorm3D(layers_2d.LayerNorm2D):
    """LayerNorm on layout A: statistics summed over z, gamma and beta slice z."""


class Embedding3D(layers_2d.Embedding2D):
    """Token embedding into layout A: the ids' batch share (x, y), the table's hidden slice z."""


class PatchEmbedding3D(layers_2d.PatchEmbedding2D):
    """ViT's patch embedding into layout A: images share (x, y), channels slice z."""


class Classifier3D(layers_2d.Classifier2D):
    """Whole logits per sample of batch share (x, y): hidden slice z's product summed over z."""


class CrossEntropyLoss3D(layers_2d.CrossEntropyLoss2D):
    """F.cross_entropy of the whole batch from layout A's logits and all the labels."""


def split_layout_b(x: torch.Tensor) -> torch.Tensor:
    """This rank's batch share in layout B (share x * q + z of q^2)."""
    check_batch(x, gpc.cube_dim ** 2)
    return split(x, 0, gpc.tensor_xz_group)


class VocabParallelEmbedding3D(nn.Module):
    """Embedding with E cut as a column Linear's weight (vocabulary over y), into layout A."""

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 padding_idx: Optional[int] = None) -> None:
        super().__init__()
        q = gpc.cube_dim
        check_divisible(num_embeddings, q, "vocabulary size")
        check_divisible(embedding_dim, q * q, "Embedding dim")
        full = nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx)
        self.weight = keep_slice(full.weight, COLUMN_SPLITS)
        self.start = gpc.cube_y * num_embeddings // q  # my vocabulary slice: y
        self.end = (gpc.cube_y + 1) * num_embeddings // q
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        check_ids(ids, self.num_embeddings, "token ids")
        check_batch(ids, gpc.cube_dim ** 2)
        ids = split(ids, 0, gpc.tensor_x_group)  # batch share x
        table = all_gather(self.weight, 1, gpc.tensor_x_group)  # E's tile (vocabulary y, hidden z)
        found = look_up_slice(ids, table, self.start, self.end, self.padding_idx,
                              self.num_embeddings)
        return reduce_scatter(found, 0, gpc.tensor_y_group)  # summed over y: batch share (x, y)


class VocabParallelClassifier3D(Linear3D):
    """logits = h E^T (+ b): the column product, E a VocabParallelEmbedding3D's table when tied
    (`weight=`); logits in layout B, vocabulary slice y."""

    def __init__(self, in_features: int, num_classes: int, bias: bool = True,
                 weight: Optional[nn.Parameter] = None) -> None:
        super().__init__(in_features, num_classes, bias, parallel="column")
        self.weight = tied(self.weight, weight, "by vocabulary rows (VocabParallelEmbedding3D)",
                           in_features, num_classes)
        self.in_features, self.num_classes = in_features, num_classes

    def predictions(self, logits: torch.Tensor) -> torch.Tensor:
        """The predicted class of each of this rank's positions (its vocabulary slice: y)."""
        return vocab_parallel_argmax(logits, gpc.tensor_y_group, gpc.cube_y)


class VocabParallelCrossEntropyLoss3D(VocabParallelCrossEntropyLoss1D):
    """The vocab-parallel loss of layout B's batch share (vocabulary over y), summed and counted
    over the (x, z) plane; takes the *whole* batch's targets."""

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._loss(logits, split_layout_b(target), gpc.tensor_y_group, gpc.cube_y,
                          gpc.tensor_xz_group)

    def output_targets(self, target: torch.Tensor) -> torch.Tensor:
        """The targets of the logits this rank holds (engine's labels, for metrics)."""
        return split_layout_b(target)
