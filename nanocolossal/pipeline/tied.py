"""Parameters shared by two pipeline stages: a GPT's token embedding and its output classifier.

In one process a tied weight is one tensor that both layers use, and its gradient is the sum of
both uses. Cut into stages, the embedding lives on the first stage and the classifier on the
last, so each holds a copy (initialize gives the last stage's copy the first stage's values:
replicas.py). They stay equal if both step with the one-process gradient, the sum of the two:

    stage 0      E.grad = dL/dE through the embedding lookup  --+  all-reduce (sum) between
    stage P-1    E.grad = dL/dE through the classifier        --+  the stages holding E
    both         the same gradient, the same optimizer step: identical copies

(Megatron's "embedding group".) One group per (data rank, tensor rank), so each tensor slice is
summed with its own counterpart. Clipping counts such a parameter once: each copy adds its
squares divided by its number of copies (`pipeline_copies`). build_pipeline_model ties only a
model where two layers hold one weight.

`TiedGradients` sums them after a batch's last backward (extensions.py: end_group), after the
data-parallel mean (initialize.py orders it so): stages may reduce differently -- with MoE only
in later blocks, stage 0 averages in backward (DDP), the last stage at end_group; summing first
would hand stage 0 the other's un-averaged gradient, a different one on each data rank.

Before a launch, `nanocolossal plan` computes these elements sent (nanocolossal/plan/traffic.py).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..context import gpc
from ..extensions import Extension
from .steps import stage_rank

Tied = list[tuple[nn.Parameter, Optional[dist.ProcessGroup]]]


def tie_across_stages(layers: nn.Sequential, starts: Sequence[int], sizes: Sequence[int],
                      v_shape: bool = False) -> Tied:
    """The parameters this rank shares with other stages, each with the group to sum over (zbv's
    first and last parts are both on rank 0: autograd sums there). Collective: every rank makes
    every group, in the order the parameters first appear in the model, built alike."""
    P = gpc.pipeline_size
    T = gpc.tensor_size
    holders: dict[int, tuple[nn.Parameter, set[int]]] = {}
    for part, (start, size) in enumerate(zip(starts, sizes)):
        for layer in layers[start:start + size]:
            for p in layer.parameters():
                holders.setdefault(id(p), (p, set()))[1].add(stage_rank(part, P, v_shape))
    mine: Tied = []
    for param, stages in holders.values():
        if len(stages) < 2 or not param.requires_grad:
            continue
        param.pipeline_copies = len(stages)
        group = None
        for d in range(gpc.data_size):
            for t in range(T):
                ranks = [d * P * T + s * T + t for s in sorted(stages)]
                created = dist.new_group(ranks)
                if gpc.rank in ranks:
                    group = created
        if gpc.pipeline_rank in stages:
            mine.append((param, group))
    return mine


def sum_tied_gradients(tied: Tied) -> None:
    """Each copy's gradient becomes the sum over the stages holding one; a weight no stage used
    keeps none, as in one process (a flag first: zeros would let momentum and decay move it)."""
    for param, group in tied:
        anyone = torch.tensor([param.grad is not None], dtype=torch.float32, device=param.device)
        dist.all_reduce(anyone, group=group)
        if not anyone.item():
            continue
        if param.grad is None:  # unused on this stage: its share is zero
            param.grad = param.detach().new_zeros(param.shape)
        dist.all_reduce(param.grad, group=group)


class TiedGradients(Extension):
    """The sum above, after a batch's last backward; `summing`: ZeRO 2-3's (zero/tied.py)."""

    def __init__(self, tied: Tied, summing: Optional[Callable[[Tied], None]] = None) -> None:
        self.tied = tied
        self.summing = summing or sum_tied_gradients

    def end_group(self) -> None:
        self.summing(self.tied)
