"""Sequence parallelism: N ranks share every sequence; attention is the one layer that notices.

`parallel=dict(pipeline=P, tensor=dict(size=N, mode='sequence'))` (Colossal-AI's spelling): the
N ranks of a tensor group become a *sequence group*. Each holds the whole model (parameters
replicated) and, of every sequence in its data rank's batch, a zig-zag share of the tokens:
stripes r and 2N-1-r of 2N (tensor/zigzag.py draws it).

Who does what, layer by layer:

    data        data ranks split the batch as ever; the N ranks of a sequence group load the
                same samples and keep their tokens (SequenceSplitLoader: dim 1 of every tensor)
    embedding   a token's position is its place in the whole sequence (token_positions)
    LayerNorm,  per token: the local tokens alone, unchanged
    MLP, head
    attention   every query needs every key: ring attention, K/V blocks going round the ring
                (attention='ring', the default), or all-to-all attention (attention='all_to_all',
                tensor/ulysses.py): all tokens meet for h/N heads per rank
    loss        N x this rank's share of the sequences' loss: its tokens' sum divided by the
                targets counted on all N ranks (sequence_share), so the N ranks' mean is the loss
                (padding at the end of sequences falls on some ranks' stripes only: a mean of
                per-rank means would weigh it)
    gradients   averaged over the gradient group: data x sequence ranks (gpc.gradient_group)

Why averaging is exact. The global batch's loss is the mean over its B*s tokens; each rank's
loss is N x its tokens' share of its sequences' mean, so L = 1/(DN) sum_r L_r. Ring attention's
backward sends every dK/dV home, so rank r's gradient collects, from every rank's loss, what
flows through r's tokens; summed over the ranks that is d(sum_r L_r)/dθ, and averaged -- what
DDP over the gradient group does -- it is dL/dθ. To everything but attention a sequence rank
is one more data-parallel rank with fewer tokens, which is why DDP, SyncBN, metrics and the
pipeline need nothing new.

Memory per rank: activations of s/N tokens in every layer, and ring attention's one block of
scores at a time, (s/N) x (s/N)-shaped where one process holds s x s (all-to-all attention: the
model's own attention for h/N heads, s x s scores if it is the explicit formula).

A length that 2N does not divide: ring attention refuses it (its blocks must be equal);
all-to-all attention takes shares a token apart (tensor/zigzag.py).
"""
from __future__ import annotations

from typing import Any, Iterator, Mapping, Optional

import torch
import torch.distributed as dist

from .checks import loader_length
from .context import gpc
from .data import WrappedLoader
from .loss_weights import counted_targets, mean_over
from .nest import map_tensors
from .sequence_checks import check_positions, check_sample_lengths
from .tensor.zigzag import share_lengths, zigzag_split


def sequence_attention(cfg: Optional[Mapping] = None) -> str:
    """'ring' (the default) or 'all_to_all' (Ulysses): parallel.tensor's attention= (gpc's)."""
    tensor = ((gpc.config if cfg is None else cfg).get("parallel") or {}).get("tensor")
    return tensor.get("attention", "ring") if isinstance(tensor, Mapping) else "ring"


def even_shares() -> bool:
    """Must every sequence rank hold as many tokens (2N divides the length)? Ring attention's
    blocks must be equal; all-to-all attention takes any length."""
    return gpc.sequence_size == 1 or sequence_attention() == "ring"


def token_positions(ids: torch.Tensor, max_positions: Optional[int] = None) -> torch.Tensor:
    """The position in the whole sequence of each of this rank's tokens (`ids` [b, local s]);
    a sequence longer than `max_positions` is refused on every rank alike."""
    n = gpc.sequence_size
    even = n == 1 or even_shares()
    lengths = [ids.shape[1]] * n
    if not even:  # all-to-all attention: shares may differ by a token
        lengths = share_lengths(ids.shape[1], gpc.sequence_group, ids.device)
    check_positions(lengths, max_positions, even)
    positions = torch.arange(sum(lengths), device=ids.device)
    if n > 1:  # my zig-zag share of them
        positions = zigzag_split(positions, 0, n, gpc.sequence_rank, even)
    return positions.expand_as(ids)


def sequence_share(losses: torch.Tensor, target: torch.Tensor, reduction: str = "mean",
                   ignore_index: int = -100, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The loss of this rank's tokens (`losses`, per token) as N x its share of the sequences'
    loss; a mean divides by the targets counted on *all* N ranks (the module docstring)."""
    n = gpc.sequence_size
    if reduction == "sum":
        return losses.sum() * n
    count = counted_targets(target, ignore_index, weight).to(losses.dtype)
    dist.all_reduce(count, group=gpc.sequence_group)
    return mean_over(losses.sum() * n, count)


def split_batch(batch: Any, n: int, r: int, even: bool = True) -> Any:
    """Rank r's tokens of every tensor of a batch: its zig-zag share of dim 1 (the sequence).
    n and r are plain numbers, so this also runs in a DataLoader worker, which has no groups.
    `even`: refuse a length 2n does not divide (ring attention; even_shares())."""
    return map_tensors(lambda t: zigzag_split(t, 1, n, r, even) if t.dim() >= 2 else t, batch)


class SequenceSplitLoader(WrappedLoader):
    """Iterates `loader` and yields this rank's share of each batch's sequences."""

    def __init__(self, loader: Any) -> None:
        super().__init__(loader)
        self.n, self.r = gpc.sequence_size, gpc.sequence_rank
        self.even = even_shares()

    def __iter__(self) -> Iterator[Any]:
        return (split_batch(batch, self.n, self.r, self.even) for batch in self.loader)


class SizedSequenceSplitLoader(SequenceSplitLoader):
    def __len__(self) -> int:
        return len(self.loader)


def split_loader(loader: Any) -> Any:
    """`loader` as this rank of the sequence group sees it (itself without sequence parallelism)."""
    if loader is None or gpc.sequence_size == 1:
        return loader
    if even_shares():
        check_sample_lengths(loader)
    sized = loader_length(loader) is not None
    return (SizedSequenceSplitLoader if sized else SequenceSplitLoader)(loader)
