"""Colossal-AI's 2d layer classes, by name and constructor arguments, over our 2d layers.

As colossal_1d.py for the q x q grid: each class is one of our layers (tensor/layers_2d.py,
tensor/vocab_parallel_2d.py; our layout, torch's [out, in] blocks recorded in `tensor_splits`,
which differs from Colossal-AI's transposed blocks but not in any result), plus its arguments:

    Linear2D(in, out, bias, dtype, skip_bias_add, weight_initializer, bias_initializer)
        skip_bias_add   return (output, bias), the bias as this rank's output block needs it
    LayerNorm2D(normalized_shape, eps, bias, dtype)          bias=False: scale only
    Embedding2D, VocabParallelEmbedding2D(num, dim, padding_idx, dtype, weight_initializer)
    PatchEmbedding2D(img_size, patch_size, in_chans, embed_size, flatten, dtype,
                     weight_initializer, bias_initializer, position_embed_initializer)
        flatten=False is an error: with a class token prepended there is no [B, C, H, W] output
        (Colossal-AI's would fail at the concatenation too)
    Classifier2D, VocabParallelClassifier2D(in, num_classes, weight, bias, dtype,
                     weight_initializer, bias_initializer); `weight=` ties the embedding's table
    CrossEntropyLoss2D(reduction=True, weight, size_average, ignore_index, reduce,
                       label_smoothing)   the positional order Colossal-AI passes to
        F.cross_entropy; size_average and reduce (torch's deprecated spellings of reduction) are
        an error, since they would contradict `reduction`
    VocabParallelCrossEntropyLoss2D(reduction=True)

reduction=True is the whole batch's mean, False this grid row's per-sample (per-token) losses.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from ..context import gpc
from ..tensor import layers_2d, vocab_parallel_2d
from ..tensor.layers_2d import _down_column
from .colossal_args import (
    Initializer,
    check_embedding_extras,
    check_skip_bias_add,
    initialise,
    require_mode,
    with_padding_zeroed,
)

Size = Union[int, tuple[int, int]]


class Linear2D(layers_2d.Linear2D):
    """SUMMA Linear: input and output [B/q, ..., d/q] blocks of the grid."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 dtype: Optional[torch.dtype] = None, skip_bias_add: bool = False,
                 weight_initializer: Optional[Initializer] = None,
                 bias_initializer: Optional[Initializer] = None) -> None:
        require_mode("Linear2D", "2d")
        check_skip_bias_add("Linear2D", skip_bias_add, bias)
        super().__init__(in_features, out_features, bias)
        self.skip_bias_add = skip_bias_add
        initialise(self, [(self.weight, weight_initializer,
                           {"fan_in": in_features, "fan_out": out_features}),
                          (self.bias, bias_initializer, {"fan_in": in_features})], dtype)

    def forward(self, x: torch.Tensor) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if not self.skip_bias_add:
            return super().forward(x)
        # the bias block of my output columns, its gradient summed down my column when used
        return self.product(x), _down_column(self.bias)


class LayerNorm2D(layers_2d.LayerNorm2D):
    """LayerNorm over a hidden dimension split along the grid row."""

    def __init__(self, normalized_shape: int, eps: float = 1e-05, bias: bool = True,
                 dtype: Optional[torch.dtype] = None) -> None:
        require_mode("LayerNorm2D", "2d")
        super().__init__(normalized_shape, eps, bias)
        initialise(self, [], dtype)


class Embedding2D(layers_2d.Embedding2D):
    """Token embedding: this grid row's sequences, this column's embedding dimensions."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None,
                 weight_initializer: Optional[Initializer] = None, *args, **kwargs) -> None:
        require_mode("Embedding2D", "2d")
        check_embedding_extras("Embedding2D", args, kwargs)
        super().__init__(num_embeddings, embedding_dim, padding_idx)
        initialise(self, [(self.weight, with_padding_zeroed(weight_initializer, padding_idx),
                           {"fan_in": num_embeddings, "fan_out": embedding_dim})], dtype)


class VocabParallelEmbedding2D(vocab_parallel_2d.VocabParallelEmbedding2D):
    """Embedding with the table in q x q blocks (vocabulary down the column, hidden along the
    row)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: Optional[int] = None,
                 dtype: Optional[torch.dtype] = None,
                 weight_initializer: Optional[Initializer] = None, *args, **kwargs) -> None:
        require_mode("VocabParallelEmbedding2D", "2d")
        check_embedding_extras("VocabParallelEmbedding2D", args, kwargs)
        super().__init__(num_embeddings, embedding_dim, padding_idx)
        initialise(self, [(self.weight, with_padding_zeroed(weight_initializer, padding_idx),
                           {"fan_in": num_embeddings, "fan_out": embedding_dim})], dtype)


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

    def __init__(self, img_size: Size, patch_size: Size, in_chans: int, embed_size: int,
                 flatten: bool = True, dtype: Optional[torch.dtype] = None,
                 weight_initializer: Optional[Initializer] = None,
                 bias_initializer: Optional[Initializer] = None,
                 position_embed_initializer: Optional[Initializer] = None) -> None:
        require_mode("PatchEmbedding2D", "2d")
        if not flatten:
            raise ValueError(f"[rank {gpc.rank}] PatchEmbedding2D(flatten=False) is not "
                             f"supported: the class token is prepended to the flattened patches "
                             f"[B, N, d], so there is no [B, d, H, W] output; use flatten=True")
        patch = _square(patch_size, "patch_size")
        super().__init__(_square(img_size, "img_size"), patch, in_chans, embed_size)
        fan_in = in_chans * patch * patch  # the convolution's, as Colossal-AI computes it
        initialise(self, [(self.proj.weight, weight_initializer,
                           {"fan_in": fan_in, "fan_out": embed_size}),
                          (self.proj.bias, bias_initializer, {"fan_in": fan_in}),
                          (self.pos_embed, position_embed_initializer, {})], dtype)


class Classifier2D(layers_2d.Classifier2D):
    """Whole logits per sample of this grid row. `weight=`: an Embedding2D's table."""

    def __init__(self, in_features: int, num_classes: int, weight: Optional[nn.Parameter] = None,
                 bias: bool = True, dtype: Optional[torch.dtype] = None,
                 weight_initializer: Optional[Initializer] = None,
                 bias_initializer: Optional[Initializer] = None) -> None:
        require_mode("Classifier2D", "2d")
        super().__init__(in_features, num_classes, bias, weight)
        own = self.weight if weight is None else None  # a tied table is its owner's to initialise
        initialise(self, [(own, weight_initializer,
                           {"fan_in": in_features, "fan_out": num_classes}),
                          (self.bias, bias_initializer, {"fan_in": in_features})], dtype)


class VocabParallelClassifier2D(vocab_parallel_2d.VocabParallelClassifier2D):
    """Logits in [batch block, vocabulary block] on the grid. `weight=`: a
    VocabParallelEmbedding2D's table."""

    def __init__(self, in_features: int, num_classes: int, weight: Optional[nn.Parameter] = None,
                 bias: bool = True, dtype: Optional[torch.dtype] = None,
                 weight_initializer: Optional[Initializer] = None,
                 bias_initializer: Optional[Initializer] = None) -> None:
        require_mode("VocabParallelClassifier2D", "2d")
        super().__init__(in_features, num_classes, bias, weight)
        own = self.weight if weight is None else None
        initialise(self, [(own, weight_initializer,
                           {"fan_in": in_features, "fan_out": num_classes}),
                          (self.bias, bias_initializer, {"fan_in": in_features})], dtype)


class CrossEntropyLoss2D(layers_2d.CrossEntropyLoss2D):
    """F.cross_entropy of the whole batch from this grid row's logits and all the labels."""

    def __init__(self, reduction: Union[bool, str] = True, weight: Optional[torch.Tensor] = None,
                 size_average: Optional[bool] = None, ignore_index: int = -100,
                 reduce: Optional[bool] = None, label_smoothing: float = 0.0) -> None:
        require_mode("CrossEntropyLoss2D", "2d")
        for name, value in (("size_average", size_average), ("reduce", reduce)):
            if value is not None:
                raise ValueError(f"[rank {gpc.rank}] CrossEntropyLoss2D({name}={value!r}): "
                                 f"torch's deprecated spelling of reduction, which it would "
                                 f"contradict; say reduction=True (mean), False (per sample) "
                                 f"or 'sum' instead")
        super().__init__(reduction=reduction, ignore_index=ignore_index, weight=weight,
                         label_smoothing=label_smoothing)


class VocabParallelCrossEntropyLoss2D(vocab_parallel_2d.VocabParallelCrossEntropyLoss2D):
    """Cross-entropy of vocabulary-split logits on the grid: reduction True (the whole batch's
    mean) or False (this row's per-token losses); also 'sum', ignore_index and weight."""

    def __init__(self, reduction: Union[bool, str] = True, **kwargs) -> None:
        require_mode("VocabParallelCrossEntropyLoss2D", "2d")
        super().__init__(reduction=reduction, **kwargs)
