"""Extension points: how a feature changes the training loop without the loop knowing it.

The Engine (engine/engine.py) and the pipeline executor (pipeline/executor.py) are the textbook
loops -- forward, criterion, backward, step; a plan's forwards and backwards -- and import no
feature. A feature that must act inside them is an `Extension` written in its own module;
`initialize` (engine/initialize.py) builds the list from the config, one named step per feature,
and the loops call every extension, in list order, at these marked places:

    point               called (when)                       plugged in by
    train_loader        initialize, Trainer.fit: the loader CountedTargets (reads each accumulation
                        of training batches                 group ahead: loss_weights.GroupsAhead)
    loss                engine.criterion                    loss_weights.CountedTargets (weighs the
                                                            mean by counted targets), then
                                                            pipeline/moe_aux.MoeAuxLoss (+ w x aux)
    sync                every backward: may it average      ddp.DdpSync (no_sync but on the last
                        gradients now?                      backward of a group / of a chunk)
    end_group           step: after the group's last        the gradient handlers' average
                        backward, before clipping           (gradient_handler.py, moe/grads.py),
                                                            then tied weights' sums (pipeline/
                                                            tied.py); CountedTargets forgets
    clip_options        step: clip_grad_norm's arguments    MoeGradientHandler (experts' copies)
    sync_buffers        eval(); a pipeline's training batch ddp.DdpSync, ddp.BroadcastBuffers
    output_labels       execute_schedule's labels           tensor/layers_2d.SplitLabels
    weigh_micro_batches the executor, once per batch, on    CountedTargets
                        the last stage
    extra_loss          the executor, after each chunk's    MoeAuxLoss (the chunk's own aux)
                        forward while training

Every point does nothing here: a feature overrides the few it needs. Order matters in two places,
and `initialize` keeps it: `loss` wraps in list order (the first extension's is innermost), and
`end_group` reduces in list order (a data-parallel average before a sum across stages).
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager, nullcontext
from functools import partial
from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence

import torch
from torch import nn

Loss = Callable[[Any, Any], torch.Tensor]  # (output, label) -> loss
MicroBatchLoss = Callable[[Any, int], torch.Tensor]  # (output of micro-batch m, m) -> its loss


class Extension:
    """A feature's part in the Engine and the pipeline executor (see the module docstring)."""

    def train_loader(self, loader: Any) -> Any:
        """The loader of training batches as the loop reads it (a wrapper, or itself)."""
        return loader

    def loss(self, compute: Loss, output: Any, label: Any) -> torch.Tensor:
        return compute(output, label)

    def sync(self, chunk: int, last: bool) -> ContextManager:
        """Around a backward of chunk `chunk` (the Engine: 0); `last`: the chunk's last one."""
        return nullcontext()

    def end_group(self) -> None:
        """After a group's last backward (a pipeline: a batch's), before clipping and step."""

    def clip_options(self) -> dict:
        return {}

    def sync_buffers(self) -> None:
        """Replicas take the same buffers (BatchNorm statistics)."""

    def output_labels(self, label: Any) -> Any:
        """The labels of the samples this rank's output holds (for metrics)."""
        return label

    def weigh_micro_batches(self, criterion: Callable, labels: list,
                            training: bool) -> Optional[MicroBatchLoss]:
        """How micro-batch m's loss is computed and weighed (None: by its share of samples)."""
        return None

    def extra_loss(self, module: nn.Module, share: float) -> Optional[torch.Tensor]:
        """A loss of the chunk's own, for a micro-batch whose share of the batch is `share`."""
        return None


def training_loader(extensions: Sequence[Extension], loader: Any) -> Any:
    """`loader` as every extension's `train_loader` wraps it, in list order."""
    for extension in extensions:
        loader = extension.train_loader(loader)
    return loader


def with_extensions(extensions: Sequence[Extension], criterion: Loss) -> Loss:
    """The criterion wrapped by every extension's `loss`, the first one innermost."""
    compute = criterion
    for extension in extensions:
        compute = partial(extension.loss, compute)
    return compute


@contextmanager
def synchronising(extensions: Sequence[Extension], chunk: int, last: bool) -> Iterator[None]:
    """Every extension's `sync` around one backward."""
    with ExitStack() as stack:
        for extension in extensions:
            stack.enter_context(extension.sync(chunk, last))
        yield
