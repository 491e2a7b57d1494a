"""MoE's load-balancing loss in training: every layer's reaches the backward, pipelined or not.

In one process a batch's training loss is cross-entropy + w x (sum of every MoE layer's aux loss),
w = MOE_AUX_WEIGHT: what engine.criterion returns while training (`MoeAuxLoss.loss`). Cut into
stages, only the last stage applies the criterion, but a layer's aux loss depends only on its
router, so its gradient is local to the stage that holds it. The executor (executor_features.py's
OwnLosses) adds, after F(c, m) of chunk c and micro-batch m (`MoeAuxLoss.extra_loss`):

    aux(c, m) = w x (sum of chunk c's MoE layers' aux loss of micro-batch m) x share(m)

share(m) being m's share of the samples (a counted cross-entropy weighs by targets instead,
loss_weights.py, but the aux loss is a mean over tokens and keeps the sample share). B(c, m)
backpropagates it with what it already did:

    last stage    (criterion(m) x share(m) + aux(c, m)) x loss scale
    other stage   output(m) with the gradient from the next stage, and aux(c, m) x loss scale

Summed over micro-batches and stages, that is the one-process gradient of mean_m(CE_m + w x aux_m)
for the same M micro-batches (a micro-batch's aux is over its tokens on all data ranks, as with
gradient accumulation). The aux's all-reduce over the stage's data ranks runs in every micro-batch's
forward and backward; a stage's data replicas run one plan, so they meet in order. Each stage adds
its aux(c, m) to its reported loss (the last its cross-entropy too); the pipeline's all-reduce gives
every stage the one-process training loss. Evaluation adds none.
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
        self.model = model
        self.weight = weight
        self.forward_module = forward_module  # its training flag says training

    def loss(self, compute: Callable, output: Any, label: Any) -> torch.Tensor:
        loss = compute(output, label)
        if not self.weight or not self.forward_module.training:
            return loss
        # every rank adds it: its backward all-reduces over the data ranks (moe/balance.py)
        return loss + self.weight * moe_aux_loss(self.model).to(loss.dtype)

    def extra_loss(self, module: nn.Module, share: float) -> Optional[torch.Tensor]:
        """aux(c, m) above, of the chunk's last forward; None for a chunk without MoE layers."""
        if not self.weight or not moe_layers(module):
            return None
        return moe_aux_loss(module) * (self.weight * share)
