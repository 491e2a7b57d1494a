"""Groups and gradients for expert parallelism: who sums what.

The goal, as everywhere here: after the reduction every rank holds the gradient one process
would compute for the mean loss over the global batch of D data ranks,
J = (1/D) sum_r L_r. Each rank's backward computes, for each parameter it holds, the
gradient of sum_r L_r through *its own use* of that parameter:

    non-expert (router, attention, ...): used on this rank's tokens -> d L_r / d theta
        (plus, through the aux loss's all-reduce, the other ranks' terms: balance.py)
    expert e on holder h: used on the tokens its peers sent it, and the combine all-to-all
        brought back d L_s / d y for every sender s -> sum over the peers of d L_s / d theta_e

The uses of a parameter over all its holders cover every token exactly once, so:

    gradient = (sum over the ranks that hold the parameter) / D

    non-expert: held by all D data ranks     -> all-reduce over the data group, / D (the mean)
    expert:     held by D / peers ranks      -> all-reduce over the expert-data group, / D
                (peers = min(E, EP): the ranks that exchange tokens; D = data-parallel size)

Dividing an expert's sum by its D / peers holders instead (what DDP on the expert-data group
would do) gives `peers` times the gradient. Colossal-AI scales the expert gradient by 1/EP inside
the layer (EPGradScaler) so that a plain average works; here the layer's gradient is the
plain derivative and the division by D says what it means. `allreduce_moe_gradients` does
both reductions, for a loop of your own (one that keeps DDP for the non-expert parameters may
reduce only `expert_parameters(model)` with `allreduce_expert_gradients`); the Engine uses
MoeGradientHandler below.

Groups. Expert parallelism is carved out of the data-parallel ranks (as Colossal-AI): with the
data group's ranks listed in data-rank order, EP groups are runs of EP consecutive data
ranks, and the holders of the same experts are the data ranks with equal data_rank % peers.
D = 4, EP = 2, E = 4 (2 peers): EP groups {0, 1} {2, 3}; experts 0-1 on {0, 2}, 2-3 on {1, 3}.
D = 4, EP = 4, E = 2 (2 peers): one EP group {0..3}, peers {0, 1} {2, 3}; expert 0
on {0, 2}, expert 1 on {1, 3}.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch.distributed as dist
from torch import nn

from ..checks import check_still_frozen
from ..context import gpc
from ..extensions import Extension
from ..gradient_handler import sum_gradients
from .checks import check_expert_sizes, rank_prefix
from .experts import expert_parameters
from .layer import moe_layers
from .placement import Group, group_size


@dataclass
class MoeGroups:
    """This rank's expert-parallel group and the group of ranks holding its experts."""

    ep_group: Group           # EP consecutive data ranks; None when EP = 1
    expert_data_group: Group  # data ranks holding my experts; None when that is me alone


def build_moe_groups(ep_size: int, num_experts: int,
                     data_ranks: Optional[Sequence[Sequence[int]]] = None) -> MoeGroups:
    """Create the groups on every rank (collective: every rank calls it, same arguments).

    data_ranks: every data-parallel group's global ranks, in data-rank order (default: the
    whole world is one data group)."""
    check_expert_sizes(num_experts, ep_size)
    if data_ranks is None:
        data_ranks = [list(range(dist.get_world_size()))]
    peers = min(num_experts, ep_size)
    me, world = dist.get_rank(), dist.get_world_size()
    mine = MoeGroups(None, None)
    for ranks in data_ranks:
        if len(ranks) % ep_size:
            raise ValueError(f"{rank_prefix()} data-parallel size {len(ranks)} is not a multiple "
                             f"of the expert-parallel size {ep_size}; use a moe size dividing "
                             f"{len(ranks)}")
        eps = [list(ranks[i:i + ep_size]) for i in range(0, len(ranks), ep_size)]
        holders = [list(ranks[i::peers]) for i in range(peers)]
        for kind, lists in (("ep_group", eps), ("expert_data_group", holders)):
            for members in lists:
                group = _new_group(members, world)
                if me in members:
                    setattr(mine, kind, group)
    return mine


def _new_group(ranks: list[int], world: int) -> Group:
    """A group of one is None (nothing to exchange); all ranks is the default group."""
    if len(ranks) == 1:
        return None
    return dist.group.WORLD if len(ranks) == world else dist.new_group(ranks)


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(non-expert, expert) trainable parameters of `model`."""
    experts = {id(p) for p in expert_parameters(model)}
    params = [p for p in model.parameters() if p.requires_grad]
    return ([p for p in params if id(p) not in experts], [p for p in params if id(p) in experts])


def allreduce_expert_gradients(model: nn.Module, expert_data_group: Group, data_size: int) -> None:
    """Expert gradients: sum over the ranks holding the same expert, divided by D."""
    sum_gradients(split_parameters(model)[1], expert_data_group, data_size)


def allreduce_moe_gradients(model: nn.Module, data_group: Group, expert_data_group: Group) -> None:
    """After backward: non-expert gradients averaged over `data_group`, expert gradients summed
    over `expert_data_group` and divided by the data-parallel size D. Then every rank holds one
    process's gradient of the mean loss over the global batch."""
    dense, _ = split_parameters(model)
    data_size = group_size(data_group)
    sum_gradients(dense, data_group, data_size)
    allreduce_expert_gradients(model, expert_data_group, data_size)


class MoeGradientHandler(Extension):
    """The Engine's gradient reduction for a model with MoE layers (initialize.apply_moe), after
    a group's last backward (extensions.py: end_group), in place of DDP -- whose one group and
    whose check that every rank holds the same parameters do not fit experts: the module
    docstring's two all-reduces, experts over gpc.expert_data_groups[peers].

    Replicas start equal: initialize broadcasts each parameter from the first rank holding it
    (replicas.py) before building this. `norm` gives clip_grad_norm each expert's weight in the
    expert-parallel group: an expert among `peers` ranks has EP / peers copies there, so it adds
    its squares x peers / EP and the global norm counts every expert once (masters under AMP
    O2 included, by `pairs`)."""

    def __init__(self, model: nn.Module,
                 pairs: Sequence[tuple[nn.Parameter, nn.Parameter]] = ()) -> None:
        self.model = model
        self.dense, _ = split_parameters(model)
        self.frozen = [p for p in model.parameters() if not p.requires_grad]
        self.data_group, self.data_size = gpc.gradient_group, gpc.gradient_size
        self.experts: dict[int, list[nn.Parameter]] = {}  # by their number of peers
        for layer in moe_layers(model):
            mine = [p for p in layer.experts.parameters() if p.requires_grad]
            self.experts.setdefault(layer.placement.peers, []).extend(mine)
        master = {id(p): m for p, m in pairs}
        self.norm = ({id(master.get(id(p), p)): peers / gpc.ep_size
                      for peers, params in self.experts.items() for p in params}, gpc.ep_group)

    def handle_gradient(self) -> None:
        check_still_frozen(self.model, self.frozen, "MoeGradientHandler")
        sum_gradients(self.dense, self.data_group, self.data_size)
        for peers, params in sorted(self.experts.items()):
            # no expert_data_groups[peers]: experts on every data rank (no parallel.moe)
            holders, _ = gpc.expert_data_groups.get(peers, (self.data_group, None))
            sum_gradients(params, holders, self.data_size)

    def end_group(self) -> None:
        self.handle_gradient()

    def clip_options(self) -> dict:
        return {"split_over": self.norm}
