"""1d tensor parallelism (Megatron-LM): split each Linear along one dimension over T ranks.

An MLP is a column-parallel Linear followed by a row-parallel one:

    x (replicated) --f--> [ x @ A_j ]  --act-->  [ h_j @ B_j ] --g--> y (replicated)
                          column-parallel        row-parallel
                          A = [A_0 | A_1]        B = [B_0 ; B_1]
                          out features split     in features split

    Y = act(X A) B = sum_j act(X A_j) B_j, so rank j needs only A_j and B_j; the sum over j
    is one all-reduce (g) in forward, and f all-reduces dL/dx in backward (see comm.py).

Communication: one all-reduce of the activation [batch, hidden] per pair in forward and
one in backward; nothing in between (the activation function acts on slices). Parameters,
their gradients and optimizer state are 1/T per rank; activations between the pair too.
Attention splits the same way: heads go to ranks (qkv column-parallel, output row-parallel).

Embedding and PatchEmbedding split the embedding dimension and gather it; the Classifier
splits its input features (row-parallel) so the class count need not divide T; LayerNorm
and the loss act on replicated activations and stay plain (replicated parameters get
identical gradients on every rank, so they stay identical).

Before a launch, `nanocolossal plan` computes these elements sent (nanocolossal/plan/traffic.py).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from ..context import gpc
from .base import PatchEmbedding, add_bias, embed_patches, keep_slice
from .comm import copy_to, gather, reduce_from, split
from .layer_checks import check_column_input, check_divisible, check_row_input, tied


class ColumnLinear1D(nn.Module):
    """y_j = x W_j^T + b_j: output features split; input replicated, output split."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        check_divisible(out_features, gpc.tensor_size, "Linear out_features")
        full = nn.Linear(in_features, out_features, bias=bias)
        self.in_features, self.out_features = in_features, out_features
        self.weight = keep_slice(full.weight, [(0, "tensor")])
        self.bias = keep_slice(full.bias, [(0, "tensor")]) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_bias(self.product(x), self.bias)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x W_j^T without the bias (Colossal-AI's skip_bias_add hands the two back apart)."""
        check_column_input(self, x)
        return F.linear(copy_to(x, gpc.tensor_group), self.weight)


class RowLinear1D(nn.Module):
    """y = sum_j x_j W_j^T + b: input features split; input split, output replicated."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__()
        check_divisible(in_features, gpc.tensor_size, "Linear in_features")
        full = nn.Linear(in_features, out_features, bias=bias)
        self.in_features, self.out_features = in_features, out_features
        self.weight = keep_slice(full.weight, [(1, "tensor")])
        self.bias = keep_slice(full.bias, []) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_bias(self.product(x), self.bias)  # bias once, after the sum

    def product(self, x: torch.Tensor, streams: int = 1) -> torch.Tensor:
        """sum_j x_j W_j^T without the bias. `streams` > 1 computes and reduces it in that many
        parts of the output features (Colossal-AI's stream_chunk_num): same numbers, and on a
        GPU one part's all-reduce can overlap the next part's product."""
        check_row_input(self, x)
        parts = [reduce_from(F.linear(x, w), gpc.tensor_group)
                 for w in self.weight.chunk(streams, dim=0)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


class Embedding1D(nn.Module):
    """Feature-parallel embedding: each rank holds d/T of every vector; the output is gathered."""

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 padding_idx: Optional[int] = None) -> None:
        super().__init__()
        check_divisible(embedding_dim, gpc.tensor_size, "Embedding dim")
        full = nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx)
        self.weight = keep_slice(full.weight, [(1, "tensor")])
        self.padding_idx = padding_idx  # every rank holds every row: torch's meaning as is

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        found = F.embedding(ids, self.weight, padding_idx=self.padding_idx)
        return gather(found, -1, gpc.tensor_group)


class PatchEmbedding1D(nn.Module):
    """Patch embedding with the embedding dimension split (conv output channels, class token and
    positions alike); the replicated [B, N, d] output is gathered."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_size: int) -> None:
        super().__init__()
        check_divisible(embed_size, gpc.tensor_size, "PatchEmbedding embed_size")
        full = PatchEmbedding(img_size, patch_size, in_chans, embed_size)
        self.patch_size = patch_size
        self.proj = nn.Module()  # so the state_dict keys are the plain layer's (proj.weight, ...)
        self.proj.weight = keep_slice(full.proj.weight, [(0, "tensor")])
        self.proj.bias = keep_slice(full.proj.bias, [(0, "tensor")])
        self.cls_token = keep_slice(full.cls_token, [(2, "tensor")])
        self.pos_embed = keep_slice(full.pos_embed, [(2, "tensor")])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to(x, gpc.tensor_group)  # every rank convolves the same images
        mine = embed_patches(x, self.proj.weight, self.proj.bias, self.cls_token, self.pos_embed,
                             self.patch_size)
        return gather(mine, -1, gpc.tensor_group)


class Classifier1D(nn.Module):
    """Row-parallel head: logits = sum_j x_j W_j^T + b on a replicated input (split locally), so the
    number of classes need not divide T; the logits come out replicated."""

    def __init__(self, in_features: int, num_classes: int, bias: bool = True,
                 weight: Optional[nn.Parameter] = None) -> None:
        super().__init__()
        check_divisible(in_features, gpc.tensor_size, "Classifier in_features")
        full = nn.Linear(in_features, num_classes, bias=bias)
        own = keep_slice(full.weight, [(1, "tensor")])
        self.weight = tied(own, weight, "by features (Embedding1D)", in_features, num_classes)
        self.bias = keep_slice(full.bias, []) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from(F.linear(split(x, -1, gpc.tensor_group), self.weight), gpc.tensor_group)
        return add_bias(y, self.bias)
