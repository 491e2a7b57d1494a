"""Layers that follow the job's tensor-parallel mode, so one model definition runs everywhere.

    tensor mode  nc.nn.Linear            nc.nn.LayerNorm  nc.nn.Classifier  nc.nn.CrossEntropyLoss
    (none)       torch.nn.Linear         torch LayerNorm  torch Linear      torch's
    '1d'         column, row, column...  torch LayerNorm  Classifier1D      torch's
    '2d'         Linear2D (SUMMA)        LayerNorm2D      Classifier2D      CrossEntropyLoss2D

In 1d, Linears alternate automatically, as Colossal-AI's Linear1D does: the first is
column-parallel (output split), the next row-parallel (input split, output whole), so a
model written as pairs -- attention's qkv and output projection, the MLP's two layers --
communicates once per pair. Dropout follows the same state: after a column-parallel Linear
the activation is sharded and each rank draws its own mask; elsewhere masks are shared.

Each layer is built from the plain layer's random draws, so under one seed every layout
starts from the same model (see tensor/base.py).
"""
from __future__ import annotations

from torch import nn

from ..context import gpc
from ..tensor import layers_1d, layers_2d
from ..tensor.base import PatchEmbedding as _PlainPatchEmbedding
from ..tensor.base import sharded_dropout

_state = {"1d_input_is_split": False}  # 1d alternation: does the next Linear get a split input?


def reset_1d_alternation() -> None:
    """Start the next 1d Linear as column-parallel again (e.g. before building a second model)."""
    _state["1d_input_is_split"] = False


def Linear(in_features: int, out_features: int, bias: bool = True) -> nn.Module:
    if gpc.tensor_mode == "2d":
        return layers_2d.Linear2D(in_features, out_features, bias)
    if gpc.tensor_mode == "1d":
        row = _state["1d_input_is_split"]
        _state["1d_input_is_split"] = not row
        layer = layers_1d.RowLinear1D if row else layers_1d.ColumnLinear1D
        return layer(in_features, out_features, bias)
    return nn.Linear(in_features, out_features, bias)


def LayerNorm(normalized_shape: int, eps: float = 1e-5) -> nn.Module:
    if gpc.tensor_mode == "2d":
        return layers_2d.LayerNorm2D(normalized_shape, eps)
    return nn.LayerNorm(normalized_shape, eps=eps)  # 1d: acts on whole (replicated) activations


def Embedding(num_embeddings: int, embedding_dim: int) -> nn.Module:
    if gpc.tensor_mode == "2d":
        return layers_2d.Embedding2D(num_embeddings, embedding_dim)
    if gpc.tensor_mode == "1d":
        return layers_1d.Embedding1D(num_embeddings, embedding_dim)
    return nn.Embedding(num_embeddings, embedding_dim)


def PatchEmbedding(img_size: int, patch_size: int, in_chans: int, embed_size: int) -> nn.Module:
    if gpc.tensor_mode == "2d":
        return layers_2d.PatchEmbedding2D(img_size, patch_size, in_chans, embed_size)
    if gpc.tensor_mode == "1d":
        return layers_1d.PatchEmbedding1D(img_size, patch_size, in_chans, embed_size)
    return _PlainPatchEmbedding(img_size, patch_size, in_chans, embed_size)


def Classifier(in_features: int, num_classes: int, bias: bool = True) -> nn.Module:
    if gpc.tensor_mode == "2d":
        return layers_2d.Classifier2D(in_features, num_classes, bias)
    if gpc.tensor_mode == "1d":
        return layers_1d.Classifier1D(in_features, num_classes, bias)
    return nn.Linear(in_features, num_classes, bias)


def CrossEntropyLoss(**kwargs) -> nn.Module:
    if gpc.tensor_mode == "2d":
        return layers_2d.CrossEntropyLoss2D(**kwargs)
    return nn.CrossEntropyLoss(**kwargs)


class Dropout(nn.Dropout):
    """torch's Dropout, with a per-tensor-rank mask where the activation is sharded."""

    def __init__(self, p: float = 0.5, sharded: bool | None = None) -> None:
        super().__init__(p)
        if sharded is None:
            split_1d = gpc.tensor_mode == "1d" and _state["1d_input_is_split"]
            sharded = gpc.tensor_mode == "2d" or split_1d
        self.sharded = sharded

    def forward(self, x):
        return sharded_dropout(x, self.p, self.training) if self.sharded else super().forward(x)
