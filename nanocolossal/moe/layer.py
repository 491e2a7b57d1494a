"""A mixture-of-experts layer: a drop-in for a transformer block's MLP.

A dense MLP spends the same weights on every token. An MoE layer holds E MLPs (experts) and a
router that sends each token to one or two of them, so parameters grow E-fold while the work
per token stays that of one or two MLPs. One forward, on every rank:

    x [..., d] -> tokens [T, d]
      1. route (router.py)        expert + queue position per token, capacity C; the aux loss's
                                  all-reduce of 2E (+2) numbers over the data-parallel group
      2. pack                     [E, C, d] buffer, tokens in their experts' slots (dispatch.py)
      3. dispatch all-to-all      -> [G, L, C, d]: the slots of my L experts from my G peers
                                  (the exchange block G = min(E, EP): placement.py)
      4. experts (experts.py)     each local expert on its G*C tokens
      5. combine all-to-all       -> [E, C, d] back on the tokens' own rank
      6. unpack                   out[t] = sum of weight * expert output over t's kept slots;
                                  0 for a dropped token (the block's residual passes it)

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

from .dispatch import all_to_all, from_buffer, to_buffer
from .experts import LocalExperts
from .placement import Group, placement_for
from .router import CAPACITY_FACTOR_EVAL, CAPACITY_FACTOR_TRAIN, MIN_CAPACITY, Router, Routing


class MoeLayer(nn.Module):
    """E expert MLPs (d -> d_hidden -> d) behind a top-1 / top-2 router.

    ep_group: the expert-parallel group (EP ranks); None is EP = 1. E % EP == 0 gives E/EP
        experts per rank; EP % E == 0 puts one expert per rank, each on EP/E ranks, and a rank
        sends its tokens to the replicas in its own block of E consecutive ep ranks
        (placement.py).
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
        self.ep_group, self.data_group = ep_group, data_group
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
        token, slot, weight = routing.slots()
        p, c, d = self.placement, routing.capacity, tokens.shape[-1]
        buffer = to_buffer(tokens, token, slot, p.num_experts * c)
        # [E, C, d] is [G, L, C, d]: slice j holds the slots of ep rank j's experts
        received = all_to_all(buffer.view(p.block, p.num_local, c, d), p, self.ep_group)
        results = all_to_all(self.experts(received), p, self.ep_group)
        out = from_buffer(results.view(-1, d), token, slot, weight, tokens.shape[0])
        self.aux_loss, self.routing = routing.aux_loss, routing
        return out.view_as(x)


def moe_layers(model: nn.Module) -> list[MoeLayer]:
    return [m for m in model.modules() if isinstance(m, MoeLayer)]


def moe_aux_loss(model: nn.Module) -> torch.Tensor:
    """Sum of the load-balancing losses of `model`'s MoE layers from their last forward (0 for
    a model, or a pipeline stage, without MoE layers)."""
    layers = moe_layers(model)
    if any(m.aux_loss is None for m in layers):
        raise ValueError("moe_aux_loss: an MoE layer of the model has not run a forward yet")
    if not layers:
        return torch.zeros(())
    return torch.stack([m.aux_loss for m in layers]).sum()
