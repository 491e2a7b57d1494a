"""Sending tokens to their experts and the results back: two all-to-alls.

The naive way to run E experts on many ranks is to give every rank every expert (data
parallelism): no communication in forward, but E expert copies per rank. Expert parallelism
keeps E/EP experts per rank and moves the *tokens* instead. Each rank routes its own T tokens
(router.py) into a fixed-size buffer, C slots per expert (the capacity), in expert order:

    buffer [E, C, d]     rows e*C .. e*C+C-1 hold the tokens sent to expert e (zeros if unused)

Because every rank uses the same E and C, the buffer cuts into EP equal slices, slice j being
the experts of ep rank j -- exactly the layout `all_to_all_single` wants: slice j of rank r goes
to rank j, where it lands as slice r. E = 4 experts, EP = 2 ranks, L = E/EP = 2 per rank:

    dispatch all-to-all                       rank 0 holds experts 0 1, rank 1 experts 2 3
      rank 0 sends [E=4, C, d]:  | e0 e1 | e2 e3 |        rank 0 receives [EP=2, L=2, C, d]:
      rank 1 sends [E=4, C, d]:  | e0 e1 | e2 e3 |          | e0 e1 from rank 0 | e0 e1 from 1 |
                                   to 0    to 1           rank 1 the same for e2 e3
    experts: local expert i runs on its [EP * C, d] tokens (from every rank) at once
    combine all-to-all: the exact reverse -- results [EP, L, C, d] go back to the senders,
      each rank gets its [E, C, d] buffer back with the expert outputs in its tokens' slots

Every rank sends E*C*d elements per all-to-all (C*d*(EP-1)*L of them to other ranks). With
capacity C = ceil(cf * T / E) that is about cf * T * d: a rank's tokens x the model width, the
same as one all-reduce of activations, whatever E is (traffic.py counts it: the tests and
bench/bench_moe.py check it against this formula).

When EP > E (experts replicated), ranks exchange only within their block of E (placement.py):
the split sizes give C*d elements to each rank of the block and none to the others.

Backward. An all-to-all is a permutation of blocks: slice j of rank r <-> slice r of rank j.
It is its own inverse, so the gradient of its output goes back by the same all-to-all
(tensor/comm.py's `exchange`, which Ulysses attention shares), and autograd flows through both
exchanges into the experts, the tokens and (through the combine weights) the router.
"""
from __future__ import annotations

import torch

from ..tensor.comm import exchange
from .placement import Group, Placement, group_size


def all_to_all(x: torch.Tensor, placement: Placement, group: Group) -> torch.Tensor:
    """Exchange the [G, L, C, d] slices of `x` within this rank's block (G = placement.block
    ranks, L experts each): slice j goes to the block's j-th rank, arriving as this rank's slice.
    Differentiable; a group of one returns `x` itself."""
    if group_size(group) == 1:
        return x
    per_rank = x.numel() // placement.block
    splits = placement.split_sizes(per_rank)  # in and out alike: slice j <-> slice r
    return exchange(x, group, splits, splits).view_as(x)


def to_buffer(x: torch.Tensor, token: torch.Tensor, slot: torch.Tensor,
              num_slots: int) -> torch.Tensor:
    """[num_slots, d] buffer with token[i]'s row of x in slot[i], zeros in unused slots."""
    buffer = x.new_zeros(num_slots, x.shape[-1])
    return buffer.index_add(0, slot, x[token])  # out of place: differentiable in x


def from_buffer(y: torch.Tensor, token: torch.Tensor, slot: torch.Tensor, weight: torch.Tensor,
                num_tokens: int) -> torch.Tensor:
    """[num_tokens, d]: each token's sum of weight * y[slot] over its kept slots; a token with
    no kept slot (dropped) gets 0, so a residual around the layer passes it through."""
    out = y.new_zeros(num_tokens, y.shape[-1])
    return out.index_add(0, token, y[slot] * weight.unsqueeze(-1).to(y.dtype))
