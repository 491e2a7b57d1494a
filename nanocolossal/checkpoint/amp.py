"""What amp.py's MixedPrecisionOptimizer saves and loads, and a model loaded after initialize.

    state_dict()   {"optimizer": the torch optimizer's, "scaler": the loss scaler's (or None),
                    "masters": O2's fp32 masters, one per half parameter, in order}
    load_state_dict(state)   that, or a plain torch optimizer's state; an fp32 run's file (no
                    masters) gives the half model's weights as masters
    follow_loads(model)      model.load_state_dict after initialize: the masters take the loaded
                    weights at the next step, else the step would write the old ones over them
                    (read then: ZeRO 3 keeps its slice after the load's hooks); an optimizer
                    state loaded after the model brings its own masters (load_state_dict)

An fp32 run saves the same layout (plain_optimizer.py), so either resumes from the other's
file. ZeRO saves one process's layout too, gathered from the shards (zero.py).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


class AmpState:
    """The checkpoint half of MixedPrecisionOptimizer: reads its optimizer, scaler and masters."""

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "masters": [master.detach().clone() for _, master in self._master_pairs]}

    def load_state_dict(self, state: dict) -> None:
        self._loaded = False  # the masters come from `state` (or stay), not from the model
        plain = "optimizer" not in state  # a plain torch optimizer's state
        self.optimizer.load_state_dict(state if plain else state["optimizer"])
        if not plain and self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        masters = [] if plain else state.get("masters") or []
        with torch.no_grad():
            for (model_param, master), saved in zip(self._master_pairs, masters):
                master.copy_(saved)
                model_param.copy_(saved)
        if not masters:  # saved without O2 (an fp32 run): masters of the loaded half model
            self._masters_from_model()

    def follow_loads(self, model: nn.Module) -> None:
        model.register_load_state_dict_post_hook(self._model_loaded)

    def _model_loaded(self, module: nn.Module, incompatible: Any) -> None:
        self._loaded = True

    def _masters_from_model(self) -> None:
        with torch.no_grad():
            for model_param, master in self._master_pairs:
                master.copy_(model_param.detach())
        self._loaded = False
