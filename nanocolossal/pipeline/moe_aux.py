"""Mixture of experts under a pipeline: every stage's load-balancing loss reaches the backward.

In one process the training loss of a batch is cross-entropy + w x (sum of every MoE layer's
aux loss), w = MOE_AUX_WEIGHT. Cut into stages, the MoE layers of stage 0 never see the loss:
only the last stage applies the criterion. But the aux loss of a layer depends only on that
layer's router, so its gradient is local to the stage that holds it. The executor
(schedule.py) therefore, per micro-batch m and chunk c, after F(c, m):

    aux(c, m) = w x (sum of chunk c's MoE layers' aux loss of micro-batch m) x share(m)

where share(m) is the weight the cross-entropy of m gets (1/M for equal micro-batches), and
B(c, m) backpropagates it together with what it already did:

    last stage    (criterion(m) x share(m) + aux(c, m)) x loss scale
    other stage   output(m) with the gradient from the next stage, and aux(c, m) x loss scale

The sum over micro-batches and stages of those gradients is the one-process gradient of
mean_m(CE_m + w x aux_m) -- one process running the same M micro-batches (the aux loss is a
product of two means over the tokens, so a micro-batch's aux is over that micro-batch's tokens
on all data ranks, as with gradient accumulation). The aux's all-reduce over the stage's data
ranks runs in the forward and again in the backward of every micro-batch; the data replicas of
a stage run the same plan, so they meet in the same order.

The reported loss: each stage adds its aux(c, m) to its running total, the last stage its
cross-entropy too; one all-reduce (sum) over the pipeline group gives every stage the
one-process training loss. Only when training: forward_only (evaluation) adds no aux loss.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..moe.layer import moe_aux_loss, moe_layers


def chunk_aux_loss(chunk: nn.Module, weight: float, share: float) -> Optional[torch.Tensor]:
    """weight x (chunk's MoE aux losses of its last forward) x share, or None for a chunk
    without MoE layers (nothing to backpropagate)."""
    if not weight or not moe_layers(chunk):
        return None
    return moe_aux_loss(chunk) * (weight * share)


def backward_output_and_aux(output: torch.Tensor, grad: Optional[torch.Tensor],
                            aux: Optional[torch.Tensor], loss_scale: float) -> None:
    """A non-last stage's backward: the output with the gradient the next stage sent, and the
    chunk's own aux loss (scaled like the loss) -- one backward through the shared graph. An
    integer output has no gradient (`grad` None), and the output of a frozen stage needs none:
    only the aux loss, if any, goes backward."""
    if grad is None or not output.requires_grad:
        if aux is not None:
            (aux * loss_scale).backward()
        return
    if aux is None:
        torch.autograd.backward(output, grad)
        return
    scaled = aux * loss_scale
    torch.autograd.backward((output, scaled), (grad, torch.ones_like(scaled)))
