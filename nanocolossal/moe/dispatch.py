"""Sending tokens to their experts and the results back: two all-to-alls.

The naive way to run E experts on many ranks is to give every rank every expert (data
parallelism): no communication in forward, but E expert copies per rank. Expert parallelism
keeps E/EP experts per rank and moves the *tokens* instead. Each rank routes its own n tokens
(router.py) into a fixed-size buffer, C slots per expert (the capacity), in expert order:

    buffer [E, C, d]     rows e*C .. e*C+C-1 hold the tokens sent to expert e (zeros if unused)

Because every rank uses the same E and C, the buffer cuts into EP equal shares, share j being
the experts of ep rank j -- exactly the layout `all_to_all_single` wants: share j of rank r goes
to rank j, where it lands as share r. E = 4 experts, EP = 2 ranks, L = E/EP = 2 per rank:

    dispatch all-to-all                       rank 0 holds experts 0 1, rank 1 experts 2 3
      rank 0 sends [E=4, C, d]:  | e0 e1 | e2 e3 |        rank 0 receives [EP=2, L=2, C, d]:
      rank 1 sends [E=4, C, d]:  | e0 e1 | e2 e3 |          | e0 e1 from rank 0 | e0 e1 from 1 |
                                   to 0    to 1           rank 1 the same for e2 e3
    experts: local expert i runs on its [EP * C, d] tokens (from every rank) at once
    combine all-to-all: the exact reverse -- results [EP, L, C, d] go back to the senders,
      each rank gets its [E, C, d] buffer back with the expert outputs in its tokens' slots

Every rank sends E*C*d elements per all-to-all (C*d*(EP-1)*L of them to other ranks). With
capacity C = ceil(cf * n / E) that is about cf * n * d: a rank's tokens x the model width, the
same as one all-reduce of activations, whatever E is (traffic.py counts it: the tests and
bench/bench_moe.py check it against this formula).

When EP > E (experts replicated), a rank exchanges only with its E peers (placement.py): the
split sizes give C*d elements to each peer and none to the others.

Backward. An all-to-all is a permutation of shares: share j of rank r <-> share r of rank j.
It is its own inverse, so the gradient of its output goes back by the same all-to-all
(tensor/comm.py's `exchange`, which Ulysses attention shares), and autograd flows through both
exchanges into the experts, the tokens and (through the combine weights) the router.
"""
from __future__ import annotations

import torch

from ..tensor.comm import exchange
from .placement import Group, Placement, group_size


def all_to_all(x: torch.Tensor, placement: Placement, group: Group) -> torch.Tensor:
    """Exchange the [peers, L, C, d] shares of `x` with this rank's peers (L experts each): share
    j goes to peer j, arriving there as this rank's share. Differentiable; a group of one: `x`."""
    if group_size(group) == 1:
        return x
    splits = placement.split_sizes(x.numel() // placement.peers)  # in = out: share j <-> share r
    return exchange(x, group, splits, splits).view_as(x)
