"""Which rank holds which expert, and which ranks exchange tokens.

E experts, an expert-parallel group of EP ranks. Two cases, as Colossal-AI's MoE context:

    E >= EP (E % EP == 0): every rank holds E/EP experts, all different.
        E = 4, EP = 2:    ep rank 0: experts 0 1      ep rank 1: experts 2 3

    EP > E (EP % E == 0): every rank holds one expert, each expert on EP/E ranks.
        E = 2, EP = 4:    ep rank 0: expert 0   1: expert 1   2: expert 0   3: expert 1

In both, the ranks that exchange tokens are blocks of G = min(E, EP) consecutive ep ranks
holding all E experts between them (the whole group when E >= EP; {0, 1} and {2, 3} above).
A rank sends a token for expert e to the holder of e in its own block -- never to a replica
in another block -- so the blocks are independent all-to-alls inside one EP group (the
all-to-all gives zero elements to ranks outside the block: one collective, no sub-groups).

Consequence for gradients: a replica of expert e sees only its block's tokens, so the
replicas of e (the holders in every block, and in every other EP group of the data-parallel
ranks) must sum their gradients -- see grads.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

Group = Optional[dist.ProcessGroup]


def rank_prefix() -> str:
    """'[rank r]' for messages (rank 0 without torch.distributed)."""
    return f"[rank {dist.get_rank() if dist.is_initialized() else 0}]"


def group_size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def check_expert_sizes(num_experts: int, ep_size: int) -> None:
    """E and EP must nest: one divides the other."""
    if num_experts < 1 or ep_size < 1:
        raise ValueError(f"{rank_prefix()} num_experts={num_experts} and expert-parallel size "
                         f"{ep_size} must be at least 1")
    if num_experts % ep_size and ep_size % num_experts:
        lower = [n for n in range(1, num_experts + 1) if num_experts % n == 0]
        raise ValueError(
            f"{rank_prefix()} num_experts={num_experts} does not fit an expert-parallel size of "
            f"{ep_size}: one must divide the other (E/EP experts per rank, or each expert on EP/E "
            f"ranks); use an expert-parallel size in {lower} or a multiple of {num_experts}, or a "
            f"number of experts that is a multiple or divisor of {ep_size}")


@dataclass(frozen=True)
class Placement:
    """Where the experts of one MoE layer live, seen from one rank of its EP group."""

    num_experts: int  # E
    ep_size: int      # EP
    ep_rank: int

    def __post_init__(self) -> None:
        check_expert_sizes(self.num_experts, self.ep_size)

    @property
    def block(self) -> int:
        """G = min(E, EP): ranks that exchange tokens (and hold all E experts between them)."""
        return min(self.num_experts, self.ep_size)

    @property
    def num_local(self) -> int:
        """Experts on this rank: E / G."""
        return self.num_experts // self.block

    @property
    def local_experts(self) -> list[int]:
        """Global indices of this rank's experts."""
        first = self.ep_rank % self.block * self.num_local
        return list(range(first, first + self.num_local))

    def split_sizes(self, per_rank: int) -> Optional[list[int]]:
        """all_to_all_single split sizes (the same for input and output): `per_rank` elements
        with each rank of my block, none with the others; None when the block is the group."""
        if self.block == self.ep_size:
            return None
        start = self.ep_rank // self.block * self.block
        return [per_rank if start <= r < start + self.block else 0 for r in range(self.ep_size)]


def placement_for(num_experts: int, ep_group: Group) -> Placement:
    """This rank's Placement in `ep_group` (None: no expert parallelism, EP = 1)."""
    if ep_group is None:
        return Placement(num_experts, 1, 0)
    return Placement(num_experts, dist.get_world_size(ep_group), dist.get_rank(ep_group))
