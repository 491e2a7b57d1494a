"""A mixture-of-experts layer: a drop-in for a transformer block's MLP.

A dense MLP spends the same weights on every token. An MoE layer holds E MLPs (experts) and a
router that sends each token to one or two of them, so parameters grow E-fold while the work
per token stays that of one or two MLPs. One forward, on every rank:

    x [..., d] -> tokens [n, d]
      1. route (router.py)        expert + queue position per token, capacity C; the aux loss's
                                  all-reduce of 2E (+2) numbers over the data-parallel group
      2. pack                     [E, C, d] buffer, tokens in their experts' slots (below)
      3. dispatch all-to-all      -> [peers, L, C, d]: the slots of my L experts from each of
                                  my min(E, EP) peers (placement.py; dispatch.py)
      4. experts (experts.py)     each local expert on its peers x C tokens
      5. combine all-to-all       -> [E, C, d] back on the tokens' own rank
      6. unpack                   out[t] = sum of weight * expert output over t's kept slots;
                                  0 for a dropped token (the block's residual passes it)

Pack and unpack are two index_adds (out of place, so autograd flows through both): slot
e*C + q of the buffer holds the q-th token queued at expert e, zeros where none did.

With one rank (or ep_group=None) 3 and 5 are skipped and all E experts are local: the same
code is the one-process reference. Without an ep_group on several data ranks, every rank holds
all E experts (replicated, plain data parallelism); their gradients then average over the data
ranks like any other parameter's.

The load-balancing loss of the last forward is `layer.aux_loss`; `moe_aux_loss(model)` sums it
over a model's MoE layers, for the training loop to add with its weight. The last routing is
`layer.routing` (drops, dispatch mask); traffic.py's `count_collectives()` counts the elements
each all-to-all sends.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from .checks import check_forward_ran
from .dispatch import all_to_all
from .experts import LocalExperts
from .placement import Group, placement_for
from .router import CAPACITY_FACTOR_EVAL, CAPACITY_FACTOR_TRAIN, MIN_CAPACITY, Router, Routing


class MoeLayer(nn.Module):
    """E expert MLPs (d -> d_hidden -> d) behind a top-1 / top-2 router.

    ep_group: the expert-parallel group (EP ranks); None is EP = 1. placement.py says which
        rank holds which expert.
    data_group: the ranks whose tokens form the global batch (data-parallel; with sequence
        parallelism data x sequence), over which the load-balancing loss takes its means.
        None: this process's tokens are the whole batch.
    Bad sizes or factors raise ValueError naming the rank and what to change.
    """

    def __init__(self, d_model: int, d_hidden: int, num_experts: int, top_k: int = 1,
                 capacity_factor_train: float = CAPACITY_FACTOR_TRAIN,
                 capacity_factor_eval: float = CAPACITY_FACTOR_EVAL,
                 min_capacity: int = MIN_CAPACITY, jitter_eps: float = 0.0,
                 ep_group: Group = None, data_group: Group = None) -> None:
        super().__init__()
        self.placement = placement_for(num_experts, ep_group)  # checks E against EP first
        self.ep_group = ep_group
        self.data_group = data_group
        self.router = Router(d_model, num_experts, top_k, capacity_factor_train,
                             capacity_factor_eval, min_capacity, jitter_eps)
        self.experts = LocalExperts(d_model, d_hidden, self.placement)
        self.aux_loss: Optional[torch.Tensor] = None
        self.routing: Optional[Routing] = None

    @property
    def num_experts(self) -> int:
        return self.placement.num_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        routing = self.router(tokens, self.data_group)
        token, slot, weight = routing.slots()  # every kept choice; slot = expert * C + position
        p = self.placement
        c = routing.capacity
        d = tokens.shape[-1]
        # pack: token[i]'s row in slot[i] of the [E * C, d] buffer, zeros in unused slots
        buffer = tokens.new_zeros(p.num_experts * c, d).index_add(0, slot, tokens[token])
        # [E, C, d] is [peers, L, C, d]: share j holds the slots of peer j's experts
        received = all_to_all(buffer.view(p.peers, p.num_local, c, d), p, self.ep_group)
        results = all_to_all(self.experts(received), p, self.ep_group).view(-1, d)
        # unpack: each token's sum of weight * result over its kept slots (dropped: 0)
        weighted = results[slot] * weight.unsqueeze(-1).to(results.dtype)
        out = results.new_zeros(tokens.shape[0], d).index_add(0, token, weighted)
        self.aux_loss = routing.aux_loss
        self.routing = routing
        return out.view_as(x)


def moe_layers(model: nn.Module) -> list[MoeLayer]:
    return [m for m in model.modules() if isinstance(m, MoeLayer)]


def moe_aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum of the load-balancing losses of `model`'s MoE layers from their last forward (0 for
    a model, or a pipeline stage, without MoE layers)."""
    layers = moe_layers(model)
    check_forward_ran(layers)
    return torch.stack([m.aux_loss for m in layers]).sum() if layers else torch.zeros(())
