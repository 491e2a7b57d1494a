"""Layers that follow the job's tensor-parallel mode, so one model definition runs everywhere.

    tensor mode  nc.nn.Linear            nc.nn.LayerNorm  nc.nn.Classifier  nc.nn.CrossEntropyLoss
    (none)       torch.nn.Linear         torch LayerNorm  torch Linear      torch's
    '1d'         column, row, column...  torch LayerNorm  Classifier1D      torch's
    '2d', '2.5d' Linear2D (SUMMA)        LayerNorm2D      Classifier2D      CrossEntropyLoss2D
    '3d'         Linear3D column, row..  LayerNorm3D      Classifier3D      CrossEntropyLoss3D

    and for language models   nc.nn.VocabParallelEmbedding / Classifier / CrossEntropyLoss
    (none)                    torch Embedding / Linear / CrossEntropyLoss
    '1d', '2d', '2.5d', '3d'  the table split by vocabulary (tensor/vocab_parallel*.py,
                              tensor/layers_3d.py)

In 1d, Linears alternate automatically, as Colossal-AI's Linear1D does: the first is
column-parallel (output split), the next row-parallel (input split, output whole), so a
model written as pairs -- attention's qkv and output projection, the MLP's two layers --
communicates once per pair; `parallel="column"|"row"` says it explicitly instead. 3d alternates
the same way, between the cube's two activation layouts (tensor/cube.py). Dropout
follows the same state: after a column-parallel Linear the activation is split and each rank
draws its own mask; elsewhere masks are shared (2d, 2.5d, 3d: every activation is split).

The alternation follows the order Linears are built in, which is the order data flows through
them only in a chain. Where a Linear's input is not the output of the Linear built before it,
`input_is_split=` says what it is, and the alternation goes on from there. SwiGLU,
w2(silu(w1(x)) * w3(x)), built in the order data flows:

    w1 = nc.nn.Linear(d, h)                        # column: x whole (1d) / layout A (3d)
    w3 = nc.nn.Linear(d, h, input_is_split=False)  # column: its input is x, not w1's output
    w2 = nc.nn.Linear(h, d)                        # row: its input is split like w1's output

`Embedding` and `Classifier` pick the vocabulary-parallel layers, as Colossal-AI does, when the
table has more than `VOCAB_PARALLEL_LIMIT` rows: there the rows, not the features, are worth
splitting. `Classifier(..., weight=embedding.weight)` ties the two in every mode.

Each layer is built from the plain layer's random draws, so under one seed every layout
starts from the same model (see tensor/base.py).

Before a launch, `nanocolossal plan` computes these per-rank shapes (nanocolossal/plan/model.py).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from ..context import gpc, on_destroy
from ..sequence import sequence_share
from ..tensor import layers_1d, layers_2d, layers_3d, vocab_parallel, vocab_parallel_2d
from ..tensor.base import PatchEmbedding as _PlainPatchEmbedding
from ..tensor.base import sharded_dropout
from ..tensor.layer_checks import check_tied_shape
from .checks import check_3d_layout, check_3d_side, check_linear_arguments

GRID = ("2d", "2.5d")  # SUMMA on a grid (2.5d: on each of its stacked grids)
ALTERNATING = ("1d", "3d")  # Linears alternate column, row, column...
# 1d/3d alternation: is the next Linear a row one, its input split (3d: in layout B)?
_state = {"next_is_row": False}


def reset_1d_alternation() -> None:
    """Start the next 1d Linear as column-parallel again (e.g. before building a second model)."""
    _state["next_is_row"] = False


on_destroy(reset_1d_alternation)  # the next job's first 1d Linear is column-parallel


def set_1d_input_is_split(split: bool) -> None:
    """Record whether the activation after the layer just built is split (Colossal-AI's
    set_parallel_input): the next alternating Linear and Dropout follow it."""
    _state["next_is_row"] = split


def alternate(parallel: Optional[str] = None) -> str:
    """'column' or 'row' for the Linear being built (1d, 3d): `parallel` if given, else the
    alternation's next; the next one then follows this one."""
    row = _state["next_is_row"] if parallel is None else parallel == "row"
    _state["next_is_row"] = not row
    return "row" if row else "column"


VOCAB_PARALLEL_LIMIT = 2048  # Colossal-AI's default: larger tables split by vocabulary

_2D = dict(LayerNorm=layers_2d.LayerNorm2D, Embedding=layers_2d.Embedding2D,
           VocabParallelEmbedding=vocab_parallel_2d.VocabParallelEmbedding2D,
           VocabParallelClassifier=vocab_parallel_2d.VocabParallelClassifier2D,
           VocabParallelCrossEntropyLoss=vocab_parallel_2d.VocabParallelCrossEntropyLoss2D,
           PatchEmbedding=layers_2d.PatchEmbedding2D, Classifier=layers_2d.Classifier2D,
           CrossEntropyLoss=layers_2d.CrossEntropyLoss2D)
BY_MODE = {  # what each name builds per tensor mode (the module docstring's table)
    "1d": dict(Embedding=layers_1d.Embedding1D,
               VocabParallelEmbedding=vocab_parallel.VocabParallelEmbedding1D,
               VocabParallelClassifier=vocab_parallel.VocabParallelClassifier1D,
               VocabParallelCrossEntropyLoss=vocab_parallel.VocabParallelCrossEntropyLoss1D,
               PatchEmbedding=layers_1d.PatchEmbedding1D, Classifier=layers_1d.Classifier1D),
    "2d": _2D,
    "2.5d": _2D,
    "3d": dict(LayerNorm=layers_3d.LayerNorm3D, Embedding=layers_3d.Embedding3D,
               VocabParallelEmbedding=layers_3d.VocabParallelEmbedding3D,
               VocabParallelClassifier=layers_3d.VocabParallelClassifier3D,
               VocabParallelCrossEntropyLoss=layers_3d.VocabParallelCrossEntropyLoss3D,
               PatchEmbedding=layers_3d.PatchEmbedding3D, Classifier=layers_3d.Classifier3D,
               CrossEntropyLoss=layers_3d.CrossEntropyLoss3D),
}
LAYOUT_A = ("LayerNorm", "VocabParallelClassifier", "Classifier")  # 3d: refused after a column


def _split(name: str):
    """The tensor-parallel layer `name` builds in this job's mode; None: the plain one."""
    layer = BY_MODE.get(gpc.tensor_mode, {}).get(name)
    if gpc.tensor_mode == "3d" and name in LAYOUT_A:
        check_3d_layout(name, _state["next_is_row"])
    return layer


def Linear(in_features: int, out_features: int, bias: bool = True,
           parallel: Optional[str] = None, input_is_split: Optional[bool] = None) -> nn.Module:
    """`parallel` (1d, 3d): "column", "row" or None (alternate); `input_is_split`: is the input a
    column Linear's output? None: the alternation says (the module docstring: SwiGLU)."""
    check_linear_arguments(parallel, input_is_split)
    if gpc.tensor_mode in GRID:
        return layers_2d.Linear2D(in_features, out_features, bias)
    if gpc.tensor_mode not in ALTERNATING:
        return nn.Linear(in_features, out_features, bias)
    if input_is_split is not None:  # the data flow, as the model says it
        set_1d_input_is_split(input_is_split)
    if gpc.tensor_mode == "3d":
        check_3d_side(parallel, _state["next_is_row"])
        return layers_3d.Linear3D(in_features, out_features, bias, alternate(parallel))
    layer = layers_1d.RowLinear1D if alternate(parallel) == "row" else layers_1d.ColumnLinear1D
    return layer(in_features, out_features, bias)


def LayerNorm(normalized_shape: int, eps: float = 1e-5) -> nn.Module:
    """1d: torch's LayerNorm, on whole (replicated) activations."""
    return (_split("LayerNorm") or nn.LayerNorm)(normalized_shape, eps)


def Embedding(num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
              vocab_parallel: Optional[bool] = None) -> nn.Module:
    """Feature-split (1d/2d) or, for a large table or when asked, vocabulary-split."""
    if vocab_parallel or vocab_parallel is None and num_embeddings > VOCAB_PARALLEL_LIMIT:
        return VocabParallelEmbedding(num_embeddings, embedding_dim, padding_idx)
    return (_split("Embedding") or nn.Embedding)(num_embeddings, embedding_dim, padding_idx)


def VocabParallelEmbedding(num_embeddings: int, embedding_dim: int,
                           padding_idx: Optional[int] = None) -> nn.Module:
    layer = _split("VocabParallelEmbedding") or nn.Embedding
    return layer(num_embeddings, embedding_dim, padding_idx)


class TiedLinear(nn.Module):
    """y = x W^T (+ b) with W another module's parameter (a plain model's tied classifier)."""

    def __init__(self, in_features: int, weight: nn.Parameter, bias: bool = True,
                 num_classes: Optional[int] = None) -> None:
        super().__init__()
        num_classes = weight.shape[0] if num_classes is None else num_classes
        full = nn.Linear(in_features, num_classes, bias)  # the draws every layout makes
        check_tied_shape(weight, full.weight.shape, in_features, num_classes)
        self.weight = weight
        self.bias = full.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def VocabParallelClassifier(in_features: int, num_classes: int, bias: bool = True,
                            weight: Optional[nn.Parameter] = None) -> nn.Module:
    return _classifier("VocabParallelClassifier", in_features, num_classes, bias, weight)


def _classifier(name: str, in_features: int, num_classes: int, bias: bool,
                weight: Optional[nn.Parameter]) -> nn.Module:
    """The mode's classifier `name`; plain: torch's Linear, or one tied to `weight`."""
    layer = _split(name)
    if layer is not None:
        return layer(in_features, num_classes, bias, weight)
    if weight is not None:
        return TiedLinear(in_features, weight, bias, num_classes)
    return nn.Linear(in_features, num_classes, bias)


def VocabParallelCrossEntropyLoss(**kwargs) -> nn.Module:
    """F.cross_entropy's keywords (reduction, ignore_index, weight) on vocabulary-split logits."""
    plain = SequenceCrossEntropyLoss if gpc.sequence_size > 1 else TokenCrossEntropyLoss
    return (_split("VocabParallelCrossEntropyLoss") or plain)(**kwargs)


class TokenCrossEntropyLoss(nn.CrossEntropyLoss):
    """torch's loss on a language model's logits [..., V] and targets [...] (flattened for it,
    per-token losses returned in the targets' shape), as the vocab-parallel losses take them."""

    def __init__(self, reduction="mean", **kwargs) -> None:
        if reduction in (True, False):  # Colossal-AI's spelling
            reduction = "mean" if reduction else "none"
        super().__init__(reduction=reduction, **kwargs)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = super().forward(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        return loss.reshape(target.shape) if self.reduction == "none" else loss


class SequenceCrossEntropyLoss(TokenCrossEntropyLoss):
    """Under sequence parallelism: N x my tokens' share of the sequences' loss (sequence.py)."""

    @property
    def spans_sequence(self) -> bool:
        """Is a mean over the sequence group's targets (loss_weights.py: a piece is the group)?"""
        return self.reduction != "none"

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if not self.spans_sequence:
            return super().forward(logits, target)
        losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                 self.weight, reduction="none", ignore_index=self.ignore_index,
                                 label_smoothing=self.label_smoothing)
        return sequence_share(losses, target.reshape(-1), self.reduction, self.ignore_index,
                              self.weight)


def PatchEmbedding(img_size: int, patch_size: int, in_chans: int, embed_size: int) -> nn.Module:
    layer = _split("PatchEmbedding") or _PlainPatchEmbedding
    return layer(img_size, patch_size, in_chans, embed_size)


def Classifier(in_features: int, num_classes: int, bias: bool = True,
               weight: Optional[nn.Parameter] = None,
               vocab_parallel: Optional[bool] = None) -> nn.Module:
    """Logits whole per sample (1d/2d), or split by vocabulary: when asked, when tied to a
    vocab-parallel embedding's `weight`, or for more than VOCAB_PARALLEL_LIMIT classes."""
    if vocab_parallel is None:
        split_rows = any(dim == 0 for dim, _ in getattr(weight, "tensor_splits", []))
        vocab_parallel = split_rows or num_classes > VOCAB_PARALLEL_LIMIT
    name = "VocabParallelClassifier" if vocab_parallel else "Classifier"
    return _classifier(name, in_features, num_classes, bias, weight)


def CrossEntropyLoss(**kwargs) -> nn.Module:
    # under sequence parallelism: a mean over the tokens of all sequence ranks
    plain = SequenceCrossEntropyLoss if gpc.sequence_size > 1 else nn.CrossEntropyLoss
    return (_split("CrossEntropyLoss") or plain)(**kwargs)


class Dropout(nn.Dropout):
    """torch's Dropout, with a per-tensor-rank mask where the activation is split."""

    def __init__(self, p: float = 0.5, sharded: bool | None = None) -> None:
        super().__init__(p)
        if sharded is None:
            split_1d = gpc.tensor_mode == "1d" and _state["next_is_row"]
            sharded = gpc.tensor_mode in ("2d", "2.5d", "3d", "sequence") or split_1d  # own mask
        self.sharded = sharded

    def forward(self, x):
        if self.sharded and self.p:
            return sharded_dropout(x, self.p, self.training)
        return super().forward(x)
