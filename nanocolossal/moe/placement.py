"""Which rank holds which expert, and which ranks exchange tokens.

E experts, an expert-parallel group of EP ranks. Two cases, as Colossal-AI's MoE context:

    E >= EP (E % EP == 0): every rank holds E/EP experts, all different.
        E = 4, EP = 2:    ep rank 0: experts 0 1      ep rank 1: experts 2 3

    EP > E (EP % E == 0): every rank holds one expert, each expert on EP/E ranks.
        E = 2, EP = 4:    ep rank 0: expert 0   1: expert 1   2: expert 0   3: expert 1

In both, a rank exchanges tokens with its *peers*: the min(E, EP) consecutive ep ranks that
hold all E experts between them (the whole group when E >= EP; {0, 1} and {2, 3} above). A
rank sends a token for expert e to the holder of e among its peers -- never to a replica
elsewhere -- so each set of peers is an independent all-to-all inside one EP group (the
all-to-all gives zero elements to the other ranks: one collective, no sub-groups).

Consequence for gradients: a replica of expert e sees only its peers' tokens, so the
replicas of e (one among every set of peers, and in every other EP group of the data-parallel
ranks) must sum their gradients -- see grads.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from .checks import check_expert_sizes

Group = Optional[dist.ProcessGroup]


def group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


@dataclass(frozen=True)
class Placement:
    """Where the experts of one MoE layer live, seen from one rank of its EP group."""

    num_experts: int  # E
    ep_size: int      # EP
    ep_rank: int

    def __post_init__(self) -> None:
        check_expert_sizes(self.num_experts, self.ep_size)

    @property
    def peers(self) -> int:
        """min(E, EP): the ranks that exchange tokens (and hold all E experts between them)."""
        return min(self.num_experts, self.ep_size)

    @property
    def num_local(self) -> int:
        """Experts on this rank: E / peers."""
        return self.num_experts // self.peers

    @property
    def local_experts(self) -> list[int]:
        """Global indices of this rank's experts."""
        first = self.ep_rank % self.peers * self.num_local
        return list(range(first, first + self.num_local))

    def split_sizes(self, per_rank: int) -> Optional[list[int]]:
        """all_to_all_single split sizes (the same for input and output): `per_rank` elements
        with each of my peers, none with the others; None when my peers are the whole group."""
        if self.peers == self.ep_size:
            return None
        start = self.ep_rank // self.peers * self.peers
        return [per_rank if start <= r < start + self.peers else 0 for r in range(self.ep_size)]


def placement_for(num_experts: int, ep_group: Group) -> Placement:
    """This rank's Placement in `ep_group` (None: no expert parallelism, EP = 1)."""
    if ep_group is None:
        return Placement(num_experts, 1, 0)
    return Placement(num_experts, dist.get_world_size(ep_group), dist.get_rank(ep_group))
