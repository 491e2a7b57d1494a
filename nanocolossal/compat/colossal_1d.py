"""Colossal-AI's 1d layer classes, by name and constructor arguments, over our 1d layers.

A model written for Colossal-AI's `colossalai.nn` (Linear1D_Col, Linear1D_Row, ...) runs here
after `colossalai` -> `nanocolossal`. Each class *is* one of our layers (tensor/layers_1d.py,
tensor/vocab_parallel.py; same parameters, same layout: torch's [out, in] slices recorded in
`tensor_splits`, same state_dict keys), plus what its extra arguments ask for:

    gather_output     (Linear1D_Col, VocabParallelClassifier1D) all-gather the split output, so
                      it leaves whole (the next Linear1D_Row then needs parallel_input=False)
    skip_bias_add     return (output, bias) and let the caller add the bias (to fuse it with
                      what follows); with gather_output the bias is gathered as well
    parallel_input    (Linear1D_Row) True: the input comes split (after Linear1D_Col); False: it
                      comes whole and each rank keeps its slice of the features
    stream_chunk_num  (Linear1D_Row) inference only: the product and its all-reduce in that many
                      slices of the output features, concatenated (the same numbers); training
                      with it is an error, as in Colossal-AI
    reduction         (VocabParallelCrossEntropyLoss1D) True: the mean; False: per token

Arguments shared by all (initializers, dtype, F.embedding's extras) are in colossal_args.py.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from ..context import gpc
from ..nn import layers
from ..tensor import layers_1d, vocab_parallel
from ..tensor.base import add_bias
from ..tensor.comm import gather, split
from .colossal_2d import ColossalClassifier, ColossalEmbedding, ColossalLinear, ColossalLoss
from .colossal_args import Initializer, require_mode


class Linear1D_Col(ColossalLinear, layers_1d.ColumnLinear1D):
    """Column-parallel Linear: output features split over the tensor ranks."""
    MODE = "1d"

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 dtype: Optional[torch.dtype] = None, gather_output: bool = False,
                 skip_bias_add: bool = False, weight_initializer: Optional[Initializer] = None,
                 bias_initializer: Optional[Initializer] = None) -> None:
        super().__init__(in_features, out_features, bias, dtype, skip_bias_add,
                         weight_initializer, bias_initializer)
        self.gather_output = gather_output
        layers.set_1d_input_is_split(not gather_output)

    def forward(self, x: torch.Tensor) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        group = gpc.tensor_group
        if not self.skip_bias_add:
            y = super().forward(x)
            return gather(y, -1, group) if self.gather_output else y
        y, bias = self.product(x), self.bias
        if self.gather_output:  # the bias leaves whole too, so that output + bias still adds up
            y, bias = gather(y, -1, group), gather(bias, -1, group)
        return y, bias


class Linear1D_Row(ColossalLinear, layers_1d.RowLinear1D):
    """Row-parallel Linear: input features split, output summed over the tensor ranks."""
    MODE = "1d"

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 dtype: Optional[torch.dtype] = None, parallel_input: bool = True,
                 skip_bias_add: bool = False, weight_initializer: Optional[Initializer] = None,
                 bias_initializer: Optional[Initializer] = None,
                 stream_chunk_num: int = 1) -> None:
        if stream_chunk_num < 1:
            raise ValueError(f"[rank {gpc.rank}] Linear1D_Row(stream_chunk_num="
                             f"{stream_chunk_num}): give 1 (no chunks) or more")
        super().__init__(in_features, out_features, bias, dtype, skip_bias_add,
                         weight_initializer, bias_initializer)
        self.parallel_input = parallel_input
        self.stream_chunk_num = stream_chunk_num
        layers.set_1d_input_is_split(False)

    def forward(self, x: torch.Tensor) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        if not self.parallel_input:
            x = split(x, -1, gpc.tensor_group)  # a whole input: keep my features
        if self.stream_chunk_num == 1:
            y = self.product(x)
        elif self.training:
            raise RuntimeError(f"[rank {gpc.rank}] Linear1D_Row(stream_chunk_num="
                               f"{self.stream_chunk_num}) is for inference: call model.eval(), "
                               f"or use stream_chunk_num=1 to train")
        else:
            with torch.no_grad():
                y = self.product(x, streams=self.stream_chunk_num)
        if self.skip_bias_add:
            return y, self.bias
        return add_bias(y, self.bias)


class Embedding1D(ColossalEmbedding, layers_1d.Embedding1D):
    """Embedding with each vector's dimensions split; the output is gathered whole."""
    MODE = "1d"


class VocabParallelEmbedding1D(ColossalEmbedding, vocab_parallel.VocabParallelEmbedding1D):
    """Embedding with the table's rows (the vocabulary) split; the output is summed whole."""
    MODE = "1d"


class Classifier1D(ColossalClassifier, layers_1d.Classifier1D):
    """Row-parallel head on a whole input; whole logits. `weight=`: an Embedding1D's table."""
    MODE = "1d"


class VocabParallelClassifier1D(ColossalClassifier, vocab_parallel.VocabParallelClassifier1D):
    """Logits split by vocabulary (gather_output: gathered whole). `weight=`: a
    VocabParallelEmbedding1D's table."""
    MODE = "1d"

    def __init__(self, in_features: int, num_classes: int, weight: Optional[nn.Parameter] = None,
                 bias: bool = True, dtype: Optional[torch.dtype] = None,
                 gather_output: bool = False, weight_initializer: Optional[Initializer] = None,
                 bias_initializer: Optional[Initializer] = None) -> None:
        super().__init__(in_features, num_classes, weight, bias, dtype, weight_initializer,
                         bias_initializer)
        self.gather_output = gather_output

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        logits = super().forward(h)
        return gather(logits, -1, gpc.tensor_group) if self.gather_output else logits


class VocabParallelCrossEntropyLoss1D(ColossalLoss,
                                      vocab_parallel.VocabParallelCrossEntropyLoss1D):
    """Cross-entropy of vocabulary-split logits. reduction: True (mean, Colossal-AI's default) or
    False (per token, shaped as the targets); also torch's 'mean'/'sum'/'none', ignore_index
    and weight."""
    MODE = "1d"

    def forward(self, logits: torch.Tensor, targets: torch.Tensor,
                process_group=None) -> torch.Tensor:
        if process_group is not None and process_group is not gpc.tensor_group:
            raise ValueError(f"[rank {gpc.rank}] VocabParallelCrossEntropyLoss1D reduces over "
                             f"the tensor group only; pass process_group=None")
        return super().forward(logits, targets)


class Dropout1D(layers.Dropout):
    """Dropout whose mask is per tensor rank where the activation is split (after a
    Linear1D_Col that does not gather its output), shared where it is whole. `inplace` as
    torch's where the mask is shared; a per-rank mask gives a new tensor (same values)."""

    def __init__(self, p: float = 0.5, inplace: bool = False) -> None:
        require_mode("Dropout1D", "1d")
        super().__init__(p)  # reads the "is the input split?" state the Linears above set
        self.inplace = inplace
