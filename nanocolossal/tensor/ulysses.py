"""Ulysses attention: sequence parallelism by all-to-all, each rank attending for some heads.

Sequence parallelism gives each of N ranks s/N tokens of every sequence (sequence.py). Ring
attention keeps each rank's queries home and sends K/V shares round a ring. DeepSpeed-Ulysses
(Jacobs et al., 2023) moves the heads instead: heads are independent, so one all-to-all turns
"my tokens, every head" into "every token, my heads"; each rank runs plain attention on whole
sequences for h/N heads, and a second all-to-all turns the output back. N = 2, heads 0-3, a
sequence of 8 tokens (zig-zag: rank 0 holds t0 t1 t6 t7, rank 1 t2 t3 t4 t5):

    before       rank 0: t0 t1 t6 t7 x heads 0-3         rank 1: t2 t3 t4 t5 x heads 0-3
    all-to-all   rank 0 sends heads 2-3 of its tokens to rank 1, gets heads 0-1 of rank 1's
    gathered     rank 0: t0 t1 t6 t7 t2 t3 t4 t5 x heads 0-1,  rank 1: the same x heads 2-3
    reordered    t0 t1 t2 t3 t4 t5 t6 t7: the causal mask is by position in the sequence
    attention    softmax(q k^T / sqrt(d) + mask) v: the model's own attention (its fused
                 kernel, or the explicit formula), unchanged -- whole sequences, fewer heads
    back         the reverse reorder and all-to-all: rank 0 holds t0 t1 t6 t7 x heads 0-3

Who holds what, per layer and rank: outside attention [B, s/N tokens, width w] as every layer
under sequence parallelism; inside, q, k, v and the output as [B, h/N, s, w/h]. The scores are
the attention's own: none kept with the fused kernel, (h/N) s^2 with the explicit formula
(1/N of one process's; ring attention holds h (s/N)^2, 1/N^2, one tile at a time).

Traffic per layer and rank, in elements (B = 1, width w): what a rank hands to collectives
(of an all-to-all's, its own share, 1/N, stays home) and what leaves it:

                        handed over        leaves the rank
    Ulysses  forward    4 s w / N          4 s w (N-1) / N^2    q, k, v (one all-to-all), output
             backward   4 s w / N          4 s w (N-1) / N^2    the mirror: dq, dk, dv, d output
    ring     forward    2 s w (N-1) / N    the same             K, V to the next rank, N-1 times
             backward   2 s w (2N-1) / N   the same             K, V N-1 times, dK, dV N times

At N = 2 as much leaves a rank forward, s w; Ulysses' falls as 1/N where ring's approaches
2 s w (N = 8: a quarter). Ring overlaps each hop with a tile's compute; an all-to-all is
waited for. Ulysses needs h % N == 0 (whole heads per rank), ring does not.

Uneven lengths. Where 2N does not divide s, the zig-zag stripes and the shares differ by a
token (zigzag.py); a rank cannot tell the others' lengths from its own, so the ranks
all-gather them first (N integers) and size the all-to-all by them. An all-to-all that assumes
equal shares silently mixes tokens up: DeepSpeed's issue #7384.

Padding. key_padding_mask [B, s/N] (True: a padding key) is gathered whole to every rank (each
attends over all keys); a query that sees no key gets 0, as ring attention gives it.

Backward is autograd's: the all-to-all's gradient is the reverse all-to-all (tensor/comm.py's
`exchange`), the reorder's an index_add, the attention's its own.

Before a launch, `nanocolossal plan` computes these elements sent (nanocolossal/plan/traffic.py).
"""
from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..config import ConfigError
from .comm import exchange
from .zigzag import Group, share_lengths, size_and_rank, zigzag_positions

__all__ = ["ulysses_attention", "softmax_attention"]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group = None,
                      causal: bool = True, key_padding_mask: Optional[torch.Tensor] = None,
                      attend: Optional[Attend] = None) -> torch.Tensor:
    """Attention over the whole sequence, each rank holding its zig-zag share of the tokens.

    q, k, v: [B, heads, my tokens, head_dim] (zigzag.py's share; any length). attend(q, k, v):
    the attention on whole sequences (the model's, nn/transformer.py's Attention.attend); by
    default softmax_attention with `causal` and `key_padding_mask` ([B, my tokens], True for a
    padding key). Returns my tokens' output, [B, heads, my tokens, head_dim]."""
    n, _ = size_and_rank(group)
    keep = None if key_padding_mask is None else ~key_padding_mask
    if n == 1:
        return (attend or partial(softmax_attention, causal=causal, keep=keep))(q, k, v)
    _check(q, k, v, n, key_padding_mask, attend)
    group = group if group is not None else dist.group.WORLD
    lengths = share_lengths(q.shape[-2], group, q.device)
    # the position of each gathered token (rank 0's share, rank 1's, ...), and its inverse
    at = torch.cat([zigzag_positions(sum(lengths), n, j) for j in range(n)]).to(q.device)
    order = at.argsort()
    whole = _every_token(torch.cat([q, k, v]), lengths, group).index_select(2, order)
    if keep is not None:  # the whole mask to every rank: N copies of it, one "head" per rank
        copies = keep.to(torch.uint8)[:, None, :, None].expand(-1, n, -1, 1)
        keep = _every_token(copies, lengths, group)[:, 0, :, 0].index_select(1, order).bool()
    out = (attend or partial(softmax_attention, causal=causal, keep=keep))(*whole.chunk(3))
    return _my_tokens(out.index_select(2, at), lengths, group)


def _every_token(x: torch.Tensor, lengths: list[int], group: Group) -> torch.Tensor:
    """[B, h, my tokens, d] -> [B, h/N, s, d] in rank order: rank j gets heads j*h/N.. of mine."""
    b, h, mine, d = x.shape
    n = len(lengths)
    hn = h // n  # heads per rank
    shares = x.reshape(b, n, hn, mine, d).transpose(0, 1)  # share j: the heads rank j attends
    sizes = [b * hn * m * d for m in lengths]
    got = exchange(shares, group, [b * hn * mine * d] * n, sizes)
    return torch.cat([p.view(b, hn, m, d) for p, m in zip(got.split(sizes), lengths)], dim=2)


def _my_tokens(y: torch.Tensor, lengths: list[int], group: Group) -> torch.Tensor:
    """The inverse: [B, h/N, s, d] in rank order -> [B, h, my tokens, d]."""
    b, hn, _, d = y.shape
    n = len(lengths)
    mine = lengths[dist.get_rank(group)]
    parts = y.split(lengths, dim=2)  # rank j's tokens, for my heads
    got = exchange(torch.cat([p.reshape(-1) for p in parts]), group,
                   [p.numel() for p in parts], [b * hn * mine * d] * n)
    return got.view(n, b, hn, mine, d).transpose(0, 1).reshape(b, n * hn, mine, d)


def softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
                      keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v by torch's fused kernel; keep [B, keys]: False for padding.
    A query that sees no key gets 0 (the kernel's softmax over nothing would be NaN)."""
    if keep is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    sees = keep[:, None, None, :]
    if causal:
        sees = sees & torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    some = sees.any(-1, keepdim=True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=sees | ~some).masked_fill(~some, 0.0)


def _check(q, k, v, n: int, key_padding_mask, attend) -> None:
    """What a caller can get wrong."""
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"[rank {dist.get_rank()}] q, k, v must have one shape; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[1] % n:
        raise ConfigError(f"[rank {dist.get_rank()}] all-to-all attention gives each of {n} "
                          f"ranks whole heads, but there are {q.shape[1]}; use a number of heads "
                          f"divisible by {n}, or attention='ring'")
    if key_padding_mask is not None and attend is not None:
        raise ValueError(f"[rank {dist.get_rank()}] pass key_padding_mask or attend, not both: "
                         f"an attend of your own applies its own mask")
