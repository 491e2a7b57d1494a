"""The zig-zag layout of a sequence over N ranks (why: ring_attention.py's docstring).

The sequence is cut into 2N stripes and rank r holds stripes r and 2N-1-r, in that order:

    N = 2, 8 tokens    t0 t1 | t2 t3 | t4 t5 | t6 t7
    rank 0             t0 t1                   t6 t7
    rank 1                     t2 t3   t4 t5

Causal attention then costs every rank the same. zigzag_split is the pure cut (no
communication, so a DataLoader worker can run it); split_sequence and gather_sequence are the
same over a process group.

A length 2N does not divide is cut into stripes one token apart, the longer ones last (so
stripe 2N-1, rank 0's, always holds the last token): 10 tokens on N = 2 are stripes of 2, 2, 3,
3, and both ranks hold 5. Ring attention refuses such a split (its tiles must be equal: `even`);
all-to-all attention takes it, and learns the other ranks' lengths with `share_lengths`.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..config_checks import check_length
from .layer_checks import check_share_lengths

Group = Optional[dist.ProcessGroup]


def size_and_rank(group: Group) -> tuple[int, int]:
    """(size, my rank) in the group; (1, 0) without torch.distributed."""
    if not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def zigzag_stripes(n: int, r: int) -> tuple[int, int]:
    """The two stripes (of 2n) that rank r of n holds."""
    return r, 2 * n - 1 - r


def zigzag_sizes(length: int, n: int) -> list[int]:
    """The 2n stripe lengths: equal, or the last `length % 2n` stripes one token longer."""
    q, extra = divmod(length, 2 * n)
    return [q + (i >= 2 * n - extra) for i in range(2 * n)]


def zigzag_split(x: torch.Tensor, dim: int, n: int, r: int, even: bool = True) -> torch.Tensor:
    """Rank r's share of n: stripes r and 2n-1-r of 2n along `dim` (no communication). `even`:
    refuse a length that 2n does not divide (ring attention's tiles must be equal)."""
    if n == 1:
        return x
    if even:
        check_length(x.shape[dim], n)
    stripes = x.split(zigzag_sizes(x.shape[dim], n), dim=dim)
    a, b = zigzag_stripes(n, r)
    return torch.cat([stripes[a], stripes[b]], dim=dim)


def zigzag_positions(length: int, n: int, r: int) -> torch.Tensor:
    """Where rank r's tokens sit in a sequence of `length` (any length)."""
    return zigzag_split(torch.arange(length), 0, n, r, even=False)


def share_lengths(mine: int, group: Group, device: torch.device) -> list[int]:
    """Every rank's number of tokens, in group order: an all-gather of N integers. Where 2N
    need not divide the length, no rank can tell the others' shares from its own."""
    n, _ = size_and_rank(group)
    if n == 1:
        return [mine]
    lengths = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(n)]
    dist.all_gather(lengths, torch.tensor([mine], device=device), group=group)
    lengths = [int(t) for t in lengths]
    check_share_lengths(lengths, zigzag_sizes(sum(lengths), n))
    return lengths


def split_sequence(x: torch.Tensor, dim: int, group: Group = None) -> torch.Tensor:
    """This rank's zig-zag share of a whole sequence: stripes r and 2N-1-r of 2N along `dim`."""
    return zigzag_split(x, dim, *size_and_rank(group))


def gather_sequence(x: torch.Tensor, dim: int, group: Group = None) -> torch.Tensor:
    """The whole sequence from every rank's zig-zag share (the inverse of split_sequence)."""
    n, _ = size_and_rank(group)
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    stripes: list = [None] * (2 * n)
    for r, part in enumerate(parts):
        a, b = zigzag_stripes(n, r)
        stripes[a], stripes[b] = part.chunk(2, dim=dim)
    return torch.cat(stripes, dim=dim)
