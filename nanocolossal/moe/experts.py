"""The experts: E small MLPs, of which each rank keeps its own (placement.py).

    expert e:  x -> Linear(d, h) -> GELU -> Linear(h, d)

Initialisation matches one process: every rank creates all E experts in order 0..E-1 from the
torch RNG, as a single process holding all of them would, and keeps only its own (one expert
is alive at a time while the rest are made and dropped). So under the same seed expert 3 has
the same weights on whichever rank holds it, replicas are identical, and the router and every
layer after the experts draw the same random numbers on every layout.

Keys. Local experts sit in a ModuleDict under their *global* index: rank 1 of E = 4, EP = 2
has `experts.2.*` and `experts.3.*`, exactly those keys of the one-process model, so the
union of the ranks' state_dicts is the plain model's.

Expert parameters are those of LocalExperts modules (`expert_parameters`): their gradients
are summed over the ranks that hold the same expert only, not over all data ranks (grads.py).
They are found by module, not by a flag on the tensor: copy.deepcopy of a Parameter drops any
attribute set on it, and a lost flag would silently average experts over the wrong ranks.
"""
from __future__ import annotations

import torch
from torch import nn

from .placement import Placement


class ExpertMLP(nn.Sequential):
    """Linear(d, h) -> GELU -> Linear(h, d): one expert, the transformer's MLP."""

    def __init__(self, d_model: int, d_hidden: int) -> None:
        super().__init__(nn.Linear(d_model, d_hidden), nn.GELU(), nn.Linear(d_hidden, d_model))


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of every LocalExperts module of `model` (each once)."""
    found: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, LocalExperts):
            found.update((id(p), p) for p in module.parameters())
    return list(found.values())


class LocalExperts(nn.ModuleDict):
    """This rank's experts by global index; forward runs each on the tokens it was sent."""

    def __init__(self, d_model: int, d_hidden: int, placement: Placement) -> None:
        mine = set(placement.local_experts)
        experts = {}
        for e in range(placement.num_experts):  # every expert drawn, to keep the RNG in step
            expert = ExpertMLP(d_model, d_hidden)
            if e in mine:
                experts[str(e)] = expert
        super().__init__(experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [peers, L, C, d] (L local experts, C slots from each peer) -> the same shape."""
        outputs = []
        for i, expert in enumerate(self.values()):
            tokens = x[:, i]  # every peer's slots for this expert at once: [peers, C, d]
            outputs.append(expert(tokens.reshape(-1, x.shape[-1])).view_as(tokens))
        return torch.stack(outputs, 1)
