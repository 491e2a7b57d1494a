"""Colossal-AI's 2d layer classes, by name and constructor arguments, over our 2d layers.

As colossal_1d.py for the q x q grid: each class is one of our layers (tensor/layers_2d.py,
tensor/vocab_parallel_2d.py; our layout, torch's [out, in] tiles recorded in `tensor_splits`,
which differs from Colossal-AI's transposed tiles but not in any result), plus its arguments:
skip_bias_add returns (output, bias), the bias as this rank's output needs it; LayerNorm2D's
bias=False is scale only; PatchEmbedding2D's flatten=False is an error (with a class token
prepended there is no [B, C, H, W] output; Colossal-AI's would fail at the concatenation too);
CrossEntropyLoss2D takes F.cross_entropy's positional order, its size_average and reduce
(torch's deprecated spellings of reduction) an error, since they would contradict `reduction`.
reduction=True is the whole batch's mean, False this grid row's per-sample (per-token) losses.

Each class's arguments are handled once, in a mixin (ColossalLinear, ColossalEmbedding,
ColossalClassifier, ColossalLoss) that the 1d, 2.5d and 3d classes share; a class says its mode
in MODE, and refuses to be built under another.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from ..context import gpc
from ..nn.layers import set_1d_input_is_split
from ..tensor import layers_2d, vocab_parallel_2d
from .colossal_args import (
    Initializer,
    check_embedding_extras,
    check_skip_bias_add,
    initialise,
    require_mode,
    with_padding_zeroed,
)

Size = Union[int, tuple[int, int]]


class ColossalLinear:
    """Linear{2D,2p5D,3D}(in, out, bias, dtype, skip_bias_add, weight_initializer,
    bias_initializer) over a layer with product() and bias_slice(); Linear1D_* add their own."""
    MODE = "2d"

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 dtype: Optional[torch.dtype] = None, skip_bias_add: bool = False,
                 weight_initializer: Optional[Initializer] = None,
                 bias_initializer: Optional[Initializer] = None) -> None:
        name = type(self).__name__
        require_mode(name, self.MODE)
        check_skip_bias_add(name, skip_bias_add, bias)
        super().__init__(in_features, out_features, bias, *self.layer_args())
        self.skip_bias_add = skip_bias_add
        initialise(self, [(self.weight, weight_initializer,
                           {"fan_in": in_features, "fan_out": out_features}),
                          (self.bias, bias_initializer, {"fan_in": in_features})], dtype)

    def layer_args(self) -> tuple:
        return ()

    def forward(self, x: torch.Tensor) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if not self.skip_bias_add:
            return super().forward(x)
        return self.product(x), self.bias_slice()


class ColossalEmbedding:
    """Embedding{1D,2D,...}, VocabParallelEmbedding{1D,2D,...}(num, dim, padding_idx, dtype,
    weight_initializer, *F.embedding's args)."""
    MODE = "2d"

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None,
                 weight_initializer: Optional[Initializer] = None, *args, **kwargs) -> None:
        name = type(self).__name__
        require_mode(name, self.MODE)
        check_embedding_extras(name, args, kwargs)
        super().__init__(num_embeddings, embedding_dim, padding_idx)
        initialise(self, [(self.weight, with_padding_zeroed(weight_initializer, padding_idx),
                           {"fan_in": num_embeddings, "fan_out": embedding_dim})], dtype)
        if self.MODE == "1d":
            set_1d_input_is_split(False)  # the output is whole: the next Linear is a column one


class ColossalClassifier:
    """Classifier{1D,2D,...}, VocabParallelClassifier{1D,2D,...}(in, num_classes, weight, bias,
    dtype, weight_initializer, bias_initializer); `weight=` ties the embedding's table."""
    MODE = "2d"

    def __init__(self, in_features: int, num_classes: int, weight: Optional[nn.Parameter] = None,
                 bias: bool = True, dtype: Optional[torch.dtype] = None,
                 weight_initializer: Optional[Initializer] = None,
                 bias_initializer: Optional[Initializer] = None) -> None:
        require_mode(type(self).__name__, self.MODE, layout_a=True)
        super().__init__(in_features, num_classes, bias, weight)
        own = self.weight if weight is None else None  # a tied table is its owner's to initialise
        initialise(self, [(own, weight_initializer,
                           {"fan_in": in_features, "fan_out": num_classes}),
                          (self.bias, bias_initializer, {"fan_in": in_features})], dtype)
        if self.MODE == "1d":
            set_1d_input_is_split(False)


class Linear2D(ColossalLinear, layers_2d.Linear2D):
    """SUMMA Linear: input and output [B/q, ..., d/q] tiles of the grid."""


class LayerNorm2D(layers_2d.LayerNorm2D):
    """LayerNorm over a hidden dimension split along the grid row."""
    MODE = "2d"

    def __init__(self, normalized_shape: int, eps: float = 1e-05, bias: bool = True,
                 dtype: Optional[torch.dtype] = None) -> None:
        require_mode(type(self).__name__, self.MODE, layout_a=True)
        super().__init__(normalized_shape, eps, bias)
        initialise(self, [], dtype)


class Embedding2D(ColossalEmbedding, layers_2d.Embedding2D):
    """Token embedding: this grid row's sequences, this column's embedding dimensions."""


class VocabParallelEmbedding2D(ColossalEmbedding, vocab_parallel_2d.VocabParallelEmbedding2D):
    """Embedding with the table in q x q tiles (vocabulary down the column, hidden along the
    row)."""


def _square(size: Size, name: str) -> int:
    """Our patch embedding is square: an int, or a pair of equal ints as Colossal-AI accepts."""
    if isinstance(size, int):
        return size
    if len(size) == 2 and size[0] == size[1]:
        return int(size[0])
    raise ValueError(f"[rank {gpc.rank}] PatchEmbedding2D({name}={size!r}): only square images "
                     f"and patches are supported; give an int")


class PatchEmbedding2D(layers_2d.PatchEmbedding2D):
    """ViT's patch embedding: this grid row's images, this column's embedding channels."""
    MODE = "2d"

    def __init__(self, img_size: Size, patch_size: Size, in_chans: int, embed_size: int,
                 flatten: bool = True, dtype: Optional[torch.dtype] = None,
                 weight_initializer: Optional[Initializer] = None,
                 bias_initializer: Optional[Initializer] = None,
                 position_embed_initializer: Optional[Initializer] = None) -> None:
        name = type(self).__name__
        require_mode(name, self.MODE)
        if not flatten:
            raise ValueError(f"[rank {gpc.rank}] {name}(flatten=False) is not "
                             f"supported: the class token is prepended to the flattened patches "
                             f"[B, N, d], so there is no [B, d, H, W] output; use flatten=True")
        patch = _square(patch_size, "patch_size")
        super().__init__(_square(img_size, "img_size"), patch, in_chans, embed_size)
        fan_in = in_chans * patch * patch  # the convolution's, as Colossal-AI computes it
        initialise(self, [(self.proj.weight, weight_initializer,
                           {"fan_in": fan_in, "fan_out": embed_size}),
                          (self.proj.bias, bias_initializer, {"fan_in": fan_in}),
                          (self.pos_embed, position_embed_initializer, {})], dtype)


class Classifier2D(ColossalClassifier, layers_2d.Classifier2D):
    """Whole logits per sample of this grid row. `weight=`: an Embedding2D's table."""


class VocabParallelClassifier2D(ColossalClassifier, vocab_parallel_2d.VocabParallelClassifier2D):
    """Logits in [batch share, vocabulary slice] on the grid. `weight=`: a
    VocabParallelEmbedding2D's table."""


class CrossEntropyLoss2D(layers_2d.CrossEntropyLoss2D):
    """F.cross_entropy of the whole batch from this grid row's logits and all the labels."""
    MODE = "2d"

    def __init__(self, reduction: Union[bool, str] = True, weight: Optional[torch.Tensor] = None,
                 size_average: Optional[bool] = None, ignore_index: int = -100,
                 reduce: Optional[bool] = None, label_smoothing: float = 0.0) -> None:
        name = type(self).__name__
        require_mode(name, self.MODE)
        for key, value in (("size_average", size_average), ("reduce", reduce)):
            if value is not None:
                raise ValueError(f"[rank {gpc.rank}] {name}({key}={value!r}): "
                                 f"torch's deprecated spelling of reduction, which it would "
                                 f"contradict; say reduction=True (mean), False (per sample) "
                                 f"or 'sum' instead")
        super().__init__(reduction=reduction, ignore_index=ignore_index, weight=weight,
                         label_smoothing=label_smoothing)


class ColossalLoss:
    """VocabParallelCrossEntropyLoss{2D,...}(reduction=True, ignore_index, weight)."""
    MODE = "2d"

    def __init__(self, reduction: Union[bool, str] = True, **kwargs) -> None:
        require_mode(type(self).__name__, self.MODE)
        super().__init__(reduction=reduction, **kwargs)


class VocabParallelCrossEntropyLoss2D(ColossalLoss,
                                      vocab_parallel_2d.VocabParallelCrossEntropyLoss2D):
    """Cross-entropy of vocabulary-split logits on the grid: reduction True (the whole batch's
    mean) or False (this row's per-token losses); also 'sum', ignore_index and weight."""
