"""Engine: model + optimizer + criterion behind the five calls of a PyTorch training loop.

    for img, label in train_dl:
        engine.zero_grad()
        output = engine(img)                 # forward (DDP, autocast, device placement)
        loss = engine.criterion(output, label)
        engine.backward(loss)                # loss scaling, accumulation
        engine.step()                        # unscale, clip, overflow check, optimizer step

The Engine adds nothing to the maths: `initialize` (initialize.py) has already wrapped the model
(SyncBN, AMP, DDP) and the optimizer (fp32: plain_optimizer.py; AMP adds loss scaling and fp32
masters, amp.py; ZeRO shards either); the Engine runs them in the right order and owns the two
things a loop gets wrong most often:

Gradient accumulation (gradient_accumulation=N): each backward adds loss / N, and only the last of
the N may average gradients over the data ranks, so communication happens once; zero_grad acts only
on a group's first call and step only on its N-th: one step on N times the batch.
`engine.accumulating` says a group is half done (its gradients live only in memory: checkpoints
are taken between groups), and `engine.close_group()` makes the next backward the last of its
group: called before an epoch's last batch, every epoch ends with a step (a shorter last group
still divides by N, as Hugging Face Accelerate does). zero_grad after a whole group that took no
step drops it, as torch's does; a step after a `loss.backward()` past the engine is an error.

Clipping (clip_grad_norm): the global norm of the unscaled gradients -- each gradient element
counted once: after the data-parallel average the data ranks hold the same gradients (or, under
ZeRO 2/3, each its own segment of them), and ranks holding *other* parameters (pipeline stages,
tensor slices, MoE experts) add their squares once (clip.py).

Everything else a feature needs from the loop comes through its extensions (extensions.py),
called at the places marked `# extensions:` below.

A pipeline stage has no forward of its own: PipelineEngine runs whole batches as micro-batches
through its schedule (`execute_schedule`), one optimizer step per batch.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from ..context import gpc
from ..extensions import Extension, synchronising, with_extensions
from ..nest import map_tensors
from .engine_checks import check_batch, check_criterion, check_outside_backward

if TYPE_CHECKING:  # only named: fp32's plain_optimizer.py, or what AMP and ZeRO make of it
    from ..plain_optimizer import PlainOptimizer


def _to_device(obj: Any) -> Any:
    return map_tensors(lambda t: t.to(gpc.device, non_blocking=True), obj)


class Engine:
    """One process's model (maybe DDP-wrapped), optimizer and criterion: the loop's five calls."""

    def __init__(self, model: nn.Module, optimizer: PlainOptimizer,
                 criterion: Optional[Callable] = None,
                 forward_module: Optional[nn.Module] = None, gradient_accumulation: int = 1,
                 clip_grad_norm: float = 0.0, extensions: Sequence[Extension] = ()) -> None:
        self.model = model  # the user's model: prefix-free state_dict
        self.optimizer = optimizer
        self._criterion = criterion
        self.forward_module = forward_module or model  # what forward runs through (DDP wrapper)
        self.gradient_accumulation = gradient_accumulation
        self.clip_grad_norm = clip_grad_norm
        self.extensions = list(extensions)  # the features' parts, in initialize's order
        self._grad_norm: Optional[torch.Tensor] = None  # the last clip's, on the device
        self._micro = 0  # backward calls since the last real step
        self._closing = False  # close_group(): the current group ends at the next backward
        self._ended = False    # the last backward ended its group (its step is due)

    @property
    def gradient_handler(self) -> Any:
        """The extension that averages gradients after backward in DDP's place, or None."""
        return next((e for e in self.extensions if hasattr(e, "handle_gradient")), None)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_module(*_to_device(args), **_to_device(kwargs))

    def criterion(self, output: Any, label: Any) -> torch.Tensor:
        check_criterion(self._criterion)
        # extensions: the loss, weighed (counted targets) and added to (MoE's aux loss)
        return with_extensions(self.extensions, self._criterion)(output, _to_device(label))

    def train(self) -> None:
        self.forward_module.train()

    def eval(self) -> None:
        self._sync_buffers()  # every replica evaluates with data rank 0's BatchNorm statistics
        self.forward_module.eval()

    def _sync_buffers(self) -> None:
        for extension in self.extensions:  # extensions: DDP's own, or a broadcast (ddp.py)
            extension.sync_buffers()

    @property
    def accumulating(self) -> bool:
        """True between the backward passes of one accumulation group, before its step."""
        return self._micro != 0

    def set_schedule(self, schedule: Any) -> None:
        raise ValueError(f"[rank {gpc.rank}] Trainer(schedule=...) needs a pipeline engine: set "
                         f"parallel=dict(pipeline=P) and pass build_pipeline_model(model) to "
                         f"initialize")

    def close_group(self) -> None:
        """End the current accumulation group at the next backward (it synchronises) and step."""
        self._closing = True

    def zero_grad(self) -> None:
        """Clear the gradients before a group (mid-group a no-op). A whole group that took no step
        is dropped, with its close; a close asked for before the group's first backward stays."""
        if self._micro > 0 and not self._ended:
            return
        if self._micro > 0:  # a whole group that took no step: its close goes with it
            self._closing = False
        self._micro, self._ended = 0, False
        self.optimizer.drop_gradients()

    def _group_ends(self) -> bool:
        return self._micro > 0 and (self._micro >= self.gradient_accumulation or self._closing)

    def backward(self, loss: torch.Tensor) -> None:
        self._micro += 1
        self._ended = self._group_ends()
        # extensions: gradients are averaged once, on the last of the accumulated backwards
        with synchronising(self.extensions, 0, last=self._ended):
            self.optimizer.backward(loss / self.gradient_accumulation)

    def step(self) -> Union[bool, torch.Tensor]:
        """Take the optimizer step at the end of each accumulation group; True if a step was
        taken (a 0-d bool tensor where the optimizer decided on the device: amp.py)."""
        if not self._group_ends():
            if self._micro == 0:
                check_outside_backward(self)
            return False
        self._micro, self._closing, self._ended = 0, False, False
        for extension in self.extensions:  # extensions: handlers' averages, then tied sums
            extension.end_group()
        if self.clip_grad_norm:
            self._clip()
        return self.optimizer.step()

    def _clip(self) -> None:
        others = gpc.other_parts_group  # ranks holding other parameters add their squares
        options = {}
        for extension in self.extensions:  # extensions: MoE experts' copies (moe/grads.py)
            options.update(extension.clip_options())
        self._grad_norm = self.optimizer.clip_grad_norm_(self.clip_grad_norm, others, **options)

    @property
    def last_grad_norm(self) -> Optional[float]:
        """The gradients' global norm at the last clipped step (read from the device now, not
        at the step: a step never waits for it); None before clipping."""
        return None if self._grad_norm is None else self._grad_norm.item()

    def _output_labels(self, label: Any) -> Any:
        for extension in self.extensions:  # extensions: a 2d grid row's share (layers_2d.py)
            label = extension.output_labels(label)
        return label

    def execute_schedule(self, batch: Any, forward_only: bool = False, return_loss: bool = True):
        """One iteration on `batch` = (inputs, label): forward, loss and, to train, backward."""
        check_batch(batch, return_loss)
        inputs, label = batch
        output = self(inputs)
        loss = self.criterion(output, label) if return_loss else None
        if not forward_only:
            self.backward(loss)
        return output, self._output_labels(_to_device(label)), loss


class PipelineEngine(Engine):
    """A pipeline stage's engine: `engine(x)` and `engine.backward(loss)` are errors (the stage
    holds only some of the layers); `execute_schedule(batch)` returns (output, label, loss):
    output/label on the stage holding the last part, the batch's mean loss on every stage."""

    def __init__(self, model: nn.Module, optimizer: PlainOptimizer,
                 criterion: Optional[Callable], schedule: Any, chunks: list,
                 clip_grad_norm: float = 0.0, extensions: Sequence[Extension] = ()) -> None:
        super().__init__(model, optimizer, criterion, clip_grad_norm=clip_grad_norm,
                         extensions=extensions)
        self.schedule = schedule  # GPipe / 1F1B / interleaved / ZB-H1 / ZB-V
        self.chunks = chunks      # what the schedule runs (DDP-wrapped per chunk)

    def set_schedule(self, schedule: Any) -> None:
        """Run batches with another schedule (e.g. GPipe instead of the config's 1F1B)."""
        self.schedule = schedule

    def trace(self, recorder: Optional[Callable[[str, float, float], None]]) -> None:
        """Call recorder(step label, start, end) for every schedule step (None: stop)."""
        self.schedule.recorder = recorder

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"[rank {gpc.rank}] a pipeline stage has no forward of its own; run "
                           f"whole batches with engine.execute_schedule(batch) (the Trainer does)")

    def backward(self, loss: torch.Tensor) -> None:
        raise RuntimeError(f"[rank {gpc.rank}] engine.backward does not apply to a pipeline stage: "
                           f"engine.execute_schedule(batch) runs the backward passes")

    def execute_schedule(self, batch: Any, forward_only: bool = False, return_loss: bool = True):
        check_batch(batch, return_loss)
        if not forward_only:  # (not when evaluating: ranks may run unequal numbers of batches)
            self._sync_buffers()  # replicas start the batch with the same BatchNorm statistics
        output, label, loss = self.schedule.forward_backward_step(
            self.chunks, batch, self._criterion, forward_only, return_loss,
            loss_scale=self.optimizer.backward_scale, extensions=self.extensions)
        if not forward_only:  # one batch, one group: its gradients in no file until step()
            self._micro += 1
            self._ended = True
            self.optimizer.open_group = True
        if label is not None:  # the labels of each micro-batch's output, in order
            per_micro_batch = label.tensor_split(self.schedule.num_microbatches)
            label = torch.cat([self._output_labels(mb) for mb in per_micro_batch])
        return output, label, loss
