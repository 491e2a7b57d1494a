"""MoE's load-balancing loss in training: every layer's reaches the backward, pipelined or not.

In one process the training loss of a batch is cross-entropy + w x (sum of every MoE layer's
aux loss), w = MOE_AUX_WEIGHT. Without a pipeline that is what engine.criterion returns while
training (`MoeAuxLoss.loss`). Cut into stages, the MoE layers of stage 0 never see the loss:
only the last stage applies the criterion. But the aux loss of a layer depends only on that
layer's router, so its gradient is local to the stage that holds it. The executor
(executor_features.py's OwnLosses) therefore, per micro-batch m and chunk c, after F(c, m)
(`MoeAuxLoss.extra_loss`):

    aux(c, m) = w x (sum of chunk c's MoE layers' aux loss of micro-batch m) x share(m)

where share(m) is micro-batch m's share of the samples (1/M for equal micro-batches; a counted
cross-entropy weighs W_m G / W instead, loss_weights.py, but the aux loss is a mean over tokens
and keeps the sample share), and
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

from typing import Any, Callable, Optional

import torch
from torch import nn

from ..extensions import Extension
from ..moe.layer import moe_aux_loss, moe_layers


class MoeAuxLoss(Extension):
    """w x the load-balancing loss, in engine.criterion and per pipeline chunk (extensions.py);
    initialize adds it for a model with MoE layers."""

    def __init__(self, model: nn.Module, weight: float, forward_module: nn.Module) -> None:
        self.model, self.weight = model, weight
        self.forward_module = forward_module  # its training flag says training

    def loss(self, compute: Callable, output: Any, label: Any) -> torch.Tensor:
        loss = compute(output, label)
        if not self.weight or not self.forward_module.training:
            return loss
        # every rank adds it: its backward all-reduces over the data ranks (moe/balance.py)
        return loss + self.weight * moe_aux_loss(self.model).to(loss.dtype)

    def extra_loss(self, module: nn.Module, share: float) -> Optional[torch.Tensor]:
        """w x (the chunk's MoE aux losses of its last forward) x share, or None for a chunk
        without MoE layers (nothing to backpropagate)."""
        if not self.weight or not moe_layers(module):
            return None
        return moe_aux_loss(module) * (self.weight * share)
