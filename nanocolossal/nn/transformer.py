"""A transformer block of nc.nn layers, shared by train_tensor.py's ViT and train_gpt.py's GPT.

Written once for every layout. In 1d (Megatron) each pair of Linears is column- then row-parallel --
attention's qkv and output projection, the MLP's two layers -- so a block communicates twice forward
and twice backward; attention splits its heads over the tensor ranks, because the qkv projection's
output is laid out head by head (a contiguous slice of it is whole heads). In 2d every Linear is a
SUMMA product and LayerNorm sums its statistics along the grid row; the same code runs on the local
tiles. Under mode='sequence' every layer sees this rank's share of the tokens and only attention
changes: ring attention over the sequence group (tensor/ring_attention.py, sequence.py), which
applies the causal mask by global position, or with attention='all_to_all' (tensor/ulysses.py) this
very attention on whole sequences for the rank's h/N heads, between two all-to-alls. A Block built
with `moe=...` (MoeLayer's arguments) holds a mixture of experts (moe/) instead of its MLP.

Attention on the whole sequence is written twice, chosen by `attention=`:

    'explicit'  softmax(q k^T / sqrt(d) + mask) v, as the formula reads: the s x s scores and
                their softmax are tensors (held for backward: 2 b h s^2 numbers per layer)
    'fused'     F.scaled_dot_product_attention, the same formula in one kernel (flash /
                memory-efficient on CUDA, a tiled online softmax on CPU): no s x s tensor,
                the default

The ring's tiles follow the same choice (ring_attention's table says where a fused kernel runs).

They agree to rounding (tests/test_attention.py: equal in float64, forward and gradients).
Dropout on the attention weights: the fused kernel draws its mask from torch's default
generator. Where the heads are split over tensor ranks (1d, 2d) each rank's mask must differ
(nn/layers.py's Dropout draws it from a per-rank generator), so a split attention dropout
that is on takes the explicit path; without dropout (the default) every layout runs fused.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from ..activation_checkpoint import block_mode, checkpoint
from ..context import gpc
from ..moe import MoeLayer
from ..sequence import sequence_attention
from ..tensor.ring_attention import ring_attention
from ..tensor.ulysses import ulysses_attention
from .checks import check_attention, check_block
from .layers import Dropout, LayerNorm, Linear


class Attention(nn.Module):
    """Multi-head self-attention; `causal`: a token attends only to itself and earlier ones;
    `recompute`: the core softmax(q k^T) v is recomputed in backward (Block's 'selective')."""
    splits_sequence = True  # knows when the sequence is split: sequence_checks.py
    recompute = False

    def __init__(self, dim: int, heads: int, dropout: float = 0.0, causal: bool = False,
                 attention: str = "fused") -> None:
        super().__init__()
        # Ulysses: each sequence rank attends for whole heads of its own
        self.all_to_all = gpc.sequence_size > 1 and sequence_attention() == "all_to_all"
        check_attention(dim, heads, dropout, attention, self.all_to_all)
        self.head_dim = dim // heads
        self.scale = self.head_dim ** -0.5
        self.causal = causal
        self.attention = attention
        self.qkv = Linear(dim, 3 * dim, parallel="column")  # 1d: heads split over ranks
        self.attn_drop = Dropout(dropout)
        self.proj = Linear(dim, dim, parallel="row")        # 1d: sum over the heads' ranks
        self.proj_drop = Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # [b, s, local heads, (q, k, v), head_dim]: a slice of the output is whole heads
        q, k, v = self.qkv(x).view(b, s, -1, 3, self.head_dim).unbind(3)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if self.all_to_all:  # every rank's tokens, for my heads, by this module's attention
            out = ulysses_attention(q, k, v, gpc.sequence_group, attend=self.attend)
        elif gpc.sequence_size > 1:  # my queries meet every rank's keys around the ring
            out = ring_attention(q, k, v, gpc.sequence_group, self.causal, attention=self.attention)
        elif self.recompute:  # keep q, k, v; the s x s part is recomputed in backward
            out = checkpoint(self.attend, q, k, v)
        else:
            out = self.attend(q, k, v)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(b, s, -1)))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) v on the whole sequence, [b, heads, s, head_dim]."""
        drop = self.attn_drop.p if self.training else 0.0
        if self.attention == "explicit" or drop and self.attn_drop.sharded:
            return self.attend_explicit(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=self.causal,
                                              scale=self.scale)

    def attend_explicit(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The same, as the formula reads: the scores are a [b, heads, s, s] tensor."""
        scores = q @ k.transpose(-2, -1) * self.scale
        if self.causal:  # no looking ahead: mask the scores of later tokens
            s = q.shape[-2]
            ahead = torch.ones(s, s, dtype=torch.bool, device=q.device).triu(1)
            scores = scores.masked_fill(ahead, float("-inf"))
        return self.attn_drop(scores.softmax(dim=-1)) @ v


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc1 = Linear(dim, hidden, parallel="column")
        self.act = nn.GELU()
        self.drop = Dropout(dropout)
        self.fc2 = Linear(hidden, dim, parallel="row")
        self.drop2 = Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.drop(self.act(self.fc1(x)))))


class Block(nn.Module):
    """Pre-LayerNorm: x + attention(norm(x)), then x + MLP(norm(x)). ACTIVATION_CHECKPOINT says
    what it recomputes (activation_checkpoint.py; `index`: its place, for every n-th block)."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 4, dropout: float = 0.0,
                 causal: bool = False, moe: Optional[dict] = None,
                 attention: str = "fused", index: Optional[int] = None) -> None:
        super().__init__()
        self.norm1 = LayerNorm(dim)
        self.attn = Attention(dim, heads, dropout, causal, attention)
        self.norm2 = LayerNorm(dim)
        self.recompute = block_mode(index)  # 'full', 'selective' or None
        check_block(self.recompute, moe)
        if moe:  # experts over the expert-parallel ranks; aux means over the gradient group
            self.mlp = MoeLayer(dim, mlp_ratio * dim, ep_group=gpc.ep_group,
                                data_group=gpc.gradient_group, **moe)
        else:
            self.mlp = MLP(dim, mlp_ratio * dim, dropout)
        self.attn.recompute = self.recompute == "selective"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # recompute "full": keep x; the rest is recomputed in backward
        return checkpoint(self.compute, x) if self.recompute == "full" else self.compute(x)

    def compute(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))
