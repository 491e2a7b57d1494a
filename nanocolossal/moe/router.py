"""The router: which expert(s) each token goes to, and which tokens fit.

A linear layer scores every token against the E experts; softmax turns the scores into
probabilities. Top-1 (Switch Transformer) sends a token to its most probable expert, with
combine weight prob(e). Top-2 (GShard) also sends it to its second choice, the two weights
renormalised to sum to 1: g1 / (g1 + g2), g2 / (g1 + g2).

Capacity (capacity.py). Each expert takes at most C tokens from each rank, so buffers have a
fixed size and the all-to-all (dispatch.py) knows what to send before looking at the data:

    C = max(ceil(capacity_factor * n / E), min_capacity)      n = this rank's tokens

capacity_factor is 1.25 in training and 2.0 in evaluation (`module.training` picks), and
min_capacity 4 -- Colossal-AI's defaults. (Colossal-AI also multiplies by k and rounds C up
to even; here C is the same for k = 1 and 2.) With capacity_factor >= E, C >= n: no expert
can overflow and nothing is ever dropped.

Who gets a slot: position in the batch, as Switch. Tokens queue at their expert in the order
they appear (a running count, cumsum); the first C get slots 0..C-1, the rest are dropped: they
skip the experts, the layer's output for them is 0 and the block's residual carries them on.
For top-2, every first choice queues before any second choice (a second choice must not push
out someone's first). Hand example, E = 2, C = 2, top-1, first choices [0, 0, 1, 0, 0]:

    token           0  1  2  3  4
    expert          0  0  1  0  0
    queue position  0  1  0  2  3
    kept            y  y  y  n  n      -> 2 tokens dropped

Ties: argmax takes the lower expert index, so routing is deterministic.

Jitter (Switch, off by default): in training the router's input is multiplied by uniform
noise in [1 - eps, 1 + eps]; the experts see the input unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .balance import load_balancing_loss
from .capacity import MIN_CAPACITY, expert_capacity
from .checks import check_router_args
from .placement import Group

CAPACITY_FACTOR_TRAIN = 1.25  # Colossal-AI's defaults
CAPACITY_FACTOR_EVAL = 2.0


@dataclass
class Routing:
    """The router's decision for n tokens, k choices each."""

    expert: torch.Tensor    # [n, k] chosen experts (first choice in column 0)
    position: torch.Tensor  # [n, k] place in that expert's queue
    kept: torch.Tensor      # [n, k] position < capacity
    weight: torch.Tensor    # [n, k] combine weights, 0 where dropped (differentiable)
    probs: torch.Tensor     # [n, E] router probabilities
    capacity: int
    aux_loss: torch.Tensor  # the load-balancing loss (balance.py)

    def slots(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(token, slot, weight) of every kept choice; slot = expert * C + position."""
        token = torch.arange(self.expert.shape[0], device=self.expert.device)
        token = token.unsqueeze(1).expand_as(self.expert)
        slot = self.expert * self.capacity + self.position
        return token[self.kept], slot[self.kept], self.weight[self.kept]

    def dispatch_mask(self) -> torch.Tensor:
        """[n, E, C] bool: token t sits in slot c of expert e (GShard's dispatch tensor)."""
        mask = torch.zeros(self.expert.shape[0], self.probs.shape[-1] * self.capacity,
                           dtype=torch.bool, device=self.expert.device)
        token, slot, _ = self.slots()
        mask[token, slot] = True
        return mask.view(-1, self.probs.shape[-1], self.capacity)

    @property
    def dropped_tokens(self) -> int:
        """Tokens none of whose choices got a slot: they skip the layer."""
        return int((~self.kept.any(1)).sum())

    @property
    def dropped_choices(self) -> int:
        """Choices without a slot (top-2: a token may lose only its second)."""
        return int((~self.kept).sum())


def assign_slots(probs: torch.Tensor, top_k: int, capacity: int) -> tuple[torch.Tensor, ...]:
    """(expert, position, kept, weight), each [n, k], for probabilities [n, E]."""
    num_experts = probs.shape[-1]
    choice = probs.argmax(-1)  # the first maximum: ties go to the lower index
    experts = [choice]
    if top_k == 2:
        taken = F.one_hot(choice, num_experts).bool()
        experts.append(probs.masked_fill(taken, float("-inf")).argmax(-1))
    expert = torch.stack(experts, 1)
    queued = torch.zeros(num_experts, dtype=torch.long, device=probs.device)
    positions = []
    for k in range(top_k):  # all first choices queue before any second choice
        onehot = F.one_hot(expert[:, k], num_experts)
        places = onehot.cumsum(0) - 1 + queued  # running count per expert, in batch order
        positions.append(places.gather(1, expert[:, k:k + 1]).squeeze(1))
        queued = queued + onehot.sum(0)
    position = torch.stack(positions, 1)
    kept = position < capacity
    gate = probs.gather(1, expert)
    if top_k == 2:
        gate = gate / gate.sum(1, keepdim=True)
    return expert, position, kept, gate * kept


class Router(nn.Module):
    """Top-1 / top-2 router with capacity and the load-balancing loss; `forward(x, group)`
    routes the [n, d] tokens `x`, the loss's means over `group` (MoeLayer's data_group)."""

    def __init__(self, d_model: int, num_experts: int, top_k: int = 1,
                 capacity_factor_train: float = CAPACITY_FACTOR_TRAIN,
                 capacity_factor_eval: float = CAPACITY_FACTOR_EVAL,
                 min_capacity: int = MIN_CAPACITY, jitter_eps: float = 0.0) -> None:
        super().__init__()
        check_router_args(num_experts, top_k, capacity_factor_train, capacity_factor_eval,
                          min_capacity, jitter_eps)
        self.num_experts = num_experts
        self.top_k = top_k
        self.capacity_factor_train = capacity_factor_train
        self.capacity_factor_eval = capacity_factor_eval
        self.min_capacity = min_capacity
        self.jitter_eps = jitter_eps
        self.gate = nn.Linear(d_model, num_experts, bias=False)

    def capacity(self, num_tokens: int) -> int:
        factor = self.capacity_factor_train if self.training else self.capacity_factor_eval
        return expert_capacity(num_tokens, self.num_experts, factor, self.min_capacity)

    def forward(self, x: torch.Tensor, group: Group = None) -> Routing:
        if self.training and self.jitter_eps > 0:
            x = x * torch.empty_like(x).uniform_(1 - self.jitter_eps, 1 + self.jitter_eps)
        # at least float32, autocast or not: fp16 scores round near-ties into different
        # choices, and the softmax over a few experts is cheap
        dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):
            probs = F.linear(x.to(dtype), self.gate.weight.to(dtype)).softmax(-1)
        capacity = self.capacity(x.shape[0])
        expert, position, kept, weight = assign_slots(probs, self.top_k, capacity)
        aux = load_balancing_loss(probs, expert[:, 0], group)
        return Routing(expert, position, kept, weight, probs, capacity, aux)
