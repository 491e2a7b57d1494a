"""What the Engine refuses: no criterion, a batch that is not (inputs, labels), a step after a
backward that went past it."""
from __future__ import annotations

from typing import Any

import torch

from ..context import gpc


def check_criterion(criterion: Any) -> None:
    if criterion is None:
        raise RuntimeError(f"[rank {gpc.rank}] no criterion: pass one to nanocolossal.initialize")


def check_outside_backward(engine: Any) -> None:
    """engine.step() with gradients but no engine.backward since the last step does nothing."""
    if any(p.grad is not None for p in [*engine.model.parameters(), *engine.optimizer.params()]):
        raise RuntimeError(f"[rank {gpc.rank}] engine.step() found gradients but no "
                           f"engine.backward(loss) since the last step: a second step() for one "
                           f"backward, or a loss.backward() past the engine (call "
                           f"engine.backward(loss): it scales the loss, accumulates and averages "
                           f"the gradients over data ranks)")


def check_batch(batch: Any, return_loss: bool = True) -> None:
    """A batch is a pair (inputs, labels). A tensor of two rows would unpack into its two rows
    without a word (row 0 the inputs, row 1 the labels): refuse anything but a pair."""
    if isinstance(batch, (list, tuple)) and len(batch) == 2:
        if batch[1] is None and return_loss:
            raise TypeError(f"[rank {gpc.rank}] the batch's labels are None, and the loss needs "
                            f"them: have the loader yield (inputs, labels)")
        return
    if isinstance(batch, torch.Tensor):
        got = f"a tensor of shape {tuple(batch.shape)}"
    elif isinstance(batch, (list, tuple)):
        got = f"a {type(batch).__name__} of {len(batch)}"
    else:
        got = f"a {type(batch).__name__}"
    raise TypeError(f"[rank {gpc.rank}] a batch is a pair (inputs, labels), got {got}: have the "
                    f"loader yield (inputs, labels), as a DataLoader over TensorDataset(x, y) does")
