"""The zig-zag layout of a sequence over N ranks (why: ring_attention.py's docstring).

The sequence is cut into 2N chunks and rank r holds chunks r and 2N-1-r, in that order:

    N = 2, 8 tokens    t0 t1 | t2 t3 | t4 t5 | t6 t7
    rank 0             t0 t1                   t6 t7
    rank 1                     t2 t3   t4 t5

Causal attention then costs every rank the same. zigzag_split is the pure cut (no
communication, so a DataLoader worker can run it); split_sequence and gather_sequence are the
same over a process group.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

Group = Optional[dist.ProcessGroup]


def _world(group: Group) -> tuple[int, int]:
    """(size, my rank) in the group; (1, 0) without torch.distributed."""
    if not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _zigzag_chunks(n: int, r: int) -> tuple[int, int]:
    return r, 2 * n - 1 - r


def _check_length(length: int, n: int) -> None:
    if length % (2 * n):
        lo, hi = length // (2 * n) * 2 * n, (length // (2 * n) + 1) * 2 * n
        raise ValueError(f"[rank {dist.get_rank() if dist.is_initialized() else 0}] sequence "
                         f"length {length} does not split into 2 x {n} zig-zag chunks for {n} "
                         f"sequence-parallel ranks; use a multiple of {2 * n} (nearest: "
                         f"{', '.join(str(x) for x in (lo, hi) if x > 0)})")


def zigzag_split(x: torch.Tensor, dim: int, n: int, r: int) -> torch.Tensor:
    """Rank r's share of n: chunks r and 2n-1-r of 2n along `dim` (no communication)."""
    if n == 1:
        return x
    _check_length(x.shape[dim], n)
    chunks = x.chunk(2 * n, dim=dim)
    a, b = _zigzag_chunks(n, r)
    return torch.cat([chunks[a], chunks[b]], dim=dim)


def split_sequence(x: torch.Tensor, dim: int, group: Group = None) -> torch.Tensor:
    """This rank's zig-zag share of a whole sequence: chunks r and 2N-1-r of 2N along `dim`."""
    return zigzag_split(x, dim, *_world(group))


def gather_sequence(x: torch.Tensor, dim: int, group: Group = None) -> torch.Tensor:
    """The whole sequence from every rank's zig-zag share (the inverse of split_sequence)."""
    n, _ = _world(group)
    if n == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x.contiguous(), group=group)
    chunks: list = [None] * (2 * n)
    for r, part in enumerate(parts):
        a, b = _zigzag_chunks(n, r)
        chunks[a], chunks[b] = part.chunk(2, dim=dim)
    return torch.cat(chunks, dim=dim)
