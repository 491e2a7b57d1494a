"""The load-balancing loss, with its means over the global batch.

A router left alone sends most tokens to the few experts that happen to win early; they train
faster, win more, and the other experts (and their capacity) go to waste. Switch Transformer's
auxiliary loss pushes towards a uniform load:

    aux = E * sum_e f_e * P_e
    f_e = (tokens whose first choice is e) / n      -- the load; a count, no gradient
    P_e = (sum over tokens of prob(e)) / n           -- the router's wish; differentiable

It is 1 when both are uniform (1/E each) and grows as they concentrate on the same experts.
Only P carries gradient: it lowers the probability of the experts that are overloaded.

Which tokens? Data-parallel ranks each route their own tokens. The naive way -- every rank
computes aux on its tokens and the ranks average -- gives mean_r(E * sum_e f_e^r P_e^r), a mean
of per-rank products, which is not the product of the means one process computes on the whole
batch. So the two means are taken over ALL tokens of the global batch: every rank sums its
probabilities and counts per expert, and one all-reduce of those 2E numbers over the
data-parallel group gives every rank the global sums (n = sum of the counts: the batch's tokens):

    rank r:  [sum_t prob_t(0..E-1) | count(0..E-1)]  --all-reduce-->  global sums  -> aux

Gradient: the all-reduce is `group_sum` (tensor/comm.py), whose backward all-reduces the gradient
too. Each rank's aux is the same number, a term of every rank's loss; backward sums over those
ranks' d aux / d P for this rank's probabilities -- D times the one-process gradient of this rank's
share, as for every other term once the engine averages gradients over the D data ranks (grads.py).

Two more numbers ride along, a rank's token count n_r and n_r^2 summed over the ranks:
capacity is per rank's tokens, so ranks with different n_r would build all-to-all buffers of
different sizes and wait forever. D * sum(n_r^2) == sum(n_r)^2 holds exactly when every n_r is
equal; otherwise every rank raises the same error here, before any all-to-all starts.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..tensor.comm import group_sum
from .checks import check_equal_tokens
from .placement import Group, group_size


def load_balancing_loss(probs: torch.Tensor, first_choice: torch.Tensor,
                        group: Group = None) -> torch.Tensor:
    """E * sum_e f_e * P_e over the tokens of every rank of `group` (None: these tokens only).

    probs: [n_r, E] router probabilities; first_choice: [n_r] each token's top expert."""
    tokens, num_experts = probs.shape
    counts = F.one_hot(first_choice, num_experts).sum(0)
    # float64: counts and n_r^2 stay exact integers well past any batch size
    stats = torch.cat([probs.sum(0).double(), counts.double(),
                       probs.new_tensor([tokens, tokens * tokens], dtype=torch.float64)])
    stats = group_sum(stats, group)
    check_equal_tokens(stats[-2].item(), stats[-1].item(), tokens, group_size(group))
    total = stats[num_experts:2 * num_experts].sum()  # n: every token has one first choice
    load = stats[num_experts:2 * num_experts] / total
    wish = stats[:num_experts] / total
    return (num_experts * (load * wish).sum()).to(probs.dtype)
