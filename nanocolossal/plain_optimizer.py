"""The optimizer of an fp32 run: the user's, and the little every run adds around it.

    engine.backward(loss)   loss.backward(), and a note that a group of gradients is open
    engine.step()           clip to the global norm (if clip_grad_norm), optimizer.step()

Nothing is scaled, checked or copied: fp32 has the range to need no loss scale. Mixed precision
(amp.py) is this class plus fp32 master weights, the loss scale and the overflow check; ZeRO
(zero/) shards either. What the rest of the library reads of any run's optimizer (checkpoint
layout, loss scale, masters) reads here as an fp32 run has it: scale 1, no scaler, no masters.
"""
from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from .clip import SplitOver, clip_grad_norm_, model_holders


class PlainOptimizer:
    """A torch optimizer with the global-norm clip and the Engine's bookkeeping."""

    scaler = None         # amp.py: the loss scaler (ZeRO reads it, and check_finite, of any run)
    check_finite = False  # amp.py: skip a step whose gradients hold an inf/nan
    loss_scale = 1.0      # what backward multiplies the loss by (amp.py: S)
    backward_scale = 1.0  # (amp.py: S / weighed_ranks)
    skipped_steps = 0
    last_step_skipped = False
    weighed_ranks = 1     # the counted-target divisor: only a loss scale divides by it
    open_group = False    # a backward since the last step: gradients no file holds

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def params(self) -> Iterator[nn.Parameter]:
        """The parameters the optimizer updates."""
        for group in self.optimizer.param_groups:
            yield from group["params"]

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def drop_gradients(self) -> None:
        """Forget what backwards since the last step left (the engine's zero_grad)."""
        self.zero_grad()
        self.open_group = False

    def backward(self, loss: torch.Tensor) -> None:
        self.open_group = True
        loss.backward()

    def step(self) -> bool:
        self.open_group = False
        self.optimizer.step()
        return True

    def clip_grad_norm_(self, max_norm: float, group: Optional[dist.ProcessGroup] = None,
                        split_over: Optional[SplitOver] = None) -> torch.Tensor:
        """Clip to the global norm of the whole model (clip.py); returns it, a 0-d tensor."""
        return clip_grad_norm_(list(self.params()), max_norm, self.holders, group, split_over)

    def holders(self, param: nn.Parameter) -> int:
        """Ranks of the model group holding this exact parameter (clip.py)."""
        return model_holders(param)

    def clip_grad_norm(self, max_norm: float, group: Optional[dist.ProcessGroup] = None,
                       **kwargs: Any) -> float:
        """clip_grad_norm_, its norm read as a float (the host waits for the device)."""
        return self.clip_grad_norm_(max_norm, group, **kwargs).item()

    def state_dict(self) -> dict:
        """AMP's layout (checkpoint/amp.py), so that either run resumes from the other's file."""
        return {"optimizer": self.optimizer.state_dict(), "scaler": None, "masters": []}

    def load_state_dict(self, state: dict) -> None:
        """Ours, or a plain torch optimizer's state (an O2 file's masters: the model's state)."""
        self.optimizer.load_state_dict(state.get("optimizer", state))

    def master_pairs(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """O2's (half parameter, fp32 master) pairs (amp.py): none."""
        return []

    def drop_masters(self) -> None:
        """ZeRO makes masters of its shards only (zero/mixed.py): here there are none to drop."""
