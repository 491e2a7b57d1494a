"""Engine: model + optimizer + criterion behind the five calls of a PyTorch training loop.

    for img, label in train_dl:
        engine.zero_grad()
        output = engine(img)                 # forward (DDP, autocast, device placement)
        loss = engine.criterion(output, label)
        engine.backward(loss)                # loss scaling, accumulation, no_sync
        engine.step()                        # unscale, clip, overflow check, optimizer step

The Engine adds nothing to the maths: `initialize` (initialize.py) has already wrapped the model
(SyncBN, AMP, DDP) and the optimizer (loss scaling, fp32 masters); the Engine runs them in the
right order and owns the two things a loop gets wrong most often:

Gradient accumulation (gradient_accumulation=N): each backward adds loss / N; the first
N - 1 run under DDP's no_sync, so communication happens once; zero_grad and step only act
on the N-th call (the Trainer's per-iteration LR hook steps only then too). The result is
one step on N times the batch. `engine.accumulating` says a group is half done (its gradients
live only in memory: the Trainer stops and checkpoints only between groups), and
`engine.close_group()` makes the next backward the last of its group -- the Trainer calls it
before an epoch's last batch, so every epoch ends with a step, whatever its length (a shorter
last group still divides by N, as Hugging Face Accelerate does).

Mean losses over counted targets (padding, class weights; loss_weights.py): `engine.criterion`
weighs this rank's mean by its share of the targets counted on all data ranks, so ranks with
more padding do not weigh more per token; `engine.count_targets(labels)` before a group does
the same over its micro-steps (the Trainer calls it before each group).

Clipping (clip_grad_norm): the global norm of the unscaled gradients -- after DDP's average every
data-parallel rank holds the same gradients, and ranks holding *other* parameters (pipeline
stages, tensor shards, MoE experts) add their squares once.

Mixture of experts: with MoE layers in the model, `engine.criterion` adds MOE_AUX_WEIGHT x
their load-balancing loss while training (moe/), and the gradient handler reduces the experts'
gradients over the ranks that hold them (moe/grads.py).

A pipeline stage has no forward of its own: PipelineEngine runs whole batches as micro-batches
through its schedule (`execute_schedule`), one optimizer step per batch.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from ..amp import MixedPrecisionOptimizer
from ..context import gpc
from ..ddp import DistributedDataParallel, broadcast_buffers
from ..gradient_handler import DataParallelGradientHandler
from ..loss_weights import (
    counts_targets,
    gradient_if_counted,
    piece_weights,
    target_counts,
    total_count,
    weigh,
    weighed_ranks,
)
from ..moe import moe_aux_loss
from ..nest import map_tensors
from ..pipeline.tied import sum_tied_gradients
from ..tensor.layers_2d import labels_of_output
from ..zero import ShardedOptimizer


def _to_device(obj: Any) -> Any:
    return map_tensors(lambda t: t.to(gpc.device, non_blocking=True), obj)


class Engine:
    """One process's model (maybe DDP-wrapped), optimizer and criterion: the loop's five calls."""

    def __init__(self, model: nn.Module, optimizer: MixedPrecisionOptimizer,
                 criterion: Optional[Callable] = None,
                 forward_module: Optional[nn.Module] = None, gradient_accumulation: int = 1,
                 clip_grad_norm: float = 0.0,
                 gradient_handler: Optional[DataParallelGradientHandler] = None,
                 moe_aux_weight: float = 0.0) -> None:
        self.model = model  # the user's model: prefix-free state_dict
        self.optimizer = optimizer
        self._criterion = criterion
        self.forward_module = forward_module or model  # what forward runs through (DDP wrapper)
        self.gradient_accumulation = gradient_accumulation
        self.clip_grad_norm = clip_grad_norm
        self.gradient_handler = gradient_handler  # all-reduce after backward (instead of DDP)
        self.moe_aux_weight = moe_aux_weight  # MoE: the training loss adds the balancing loss
        self.last_grad_norm: Optional[float] = None
        self._micro = 0  # backward calls since the last real step
        self._closing = False  # close_group(): the current group ends at the next backward
        self._group_count = None  # W of the running group, from count_targets (loss_weights.py)
        self._group_len = 0  # and its number of micro-steps
        if counts_targets(criterion):  # fp16: the weights' G moves into the backward's scale
            optimizer.loss_shares = weighed_ranks(criterion)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_module(*_to_device(args), **_to_device(kwargs))

    def criterion(self, output: Any, label: Any) -> torch.Tensor:
        if self._criterion is None:
            raise RuntimeError(f"[rank {gpc.rank}] no criterion: "
                               "pass one to nanocolossal.initialize")
        label = _to_device(label)
        if self._weighs_pieces():  # the ranks' means weighted by their counted targets
            count = target_counts(self._criterion, [label])
            loss = self._weigh(self._criterion(gradient_if_counted(output, count[0]), label), count)
        else:
            loss = self._criterion(output, label)
        if self.moe_aux_weight and self.forward_module.training:
            # every rank adds it: its backward all-reduces over the data ranks (moe/balance.py)
            loss = loss + self.moe_aux_weight * moe_aux_loss(self.model).to(loss.dtype)
        return loss

    def _weighs_pieces(self) -> bool:
        """Training with a mean over counted targets (loss_weights.py) and more than one rank
        averaging gradients. Not in evaluation: ranks may run different numbers of batches there,
        and an all-reduce would wait for a partner."""
        return ((gpc.gradient_size > 1 or self._group_count is not None)
                and counts_targets(self._criterion)
                and self.forward_module.training and self.model.training  # either may say eval
                and torch.is_grad_enabled())

    def _weigh(self, loss: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
        """This rank's mean x W_p G / W (loss_weights.py), W this micro-step's count on all data
        ranks: their average is the micro-step's mean. In a counted group the gradient is the
        share of the group's count instead, k / N of it for a group of k (backward divides by N):
        the value stays the micro-step's, for logging (x + (y - y.detach()) is x, with y's
        gradient)."""
        spans = getattr(self._criterion, "spans_sequence", False)
        step = weigh(loss, piece_weights(count, spans)[0], count[0])
        if self._group_count is None:
            return step
        group = weigh(loss, piece_weights(count, spans, self._group_count)[0] * self._group_len,
                      count[0])
        return step.detach() + (group - group.detach())

    def count_targets(self, labels: Sequence[Any]) -> None:
        """The labels of the accumulation group about to run, one per micro-step (the Trainer
        passes them, reading the group's batches ahead): their targets counted over the group and
        the data ranks (one all-reduce) make each micro-step's mean weigh its share of them --
        exact with padding spread unevenly over micro-steps. Call it between groups."""
        if self.accumulating or len(labels) > self.gradient_accumulation:
            raise RuntimeError(f"[rank {gpc.rank}] engine.count_targets takes the labels of one "
                               f"whole group (at most gradient_accumulation="
                               f"{self.gradient_accumulation}, got {len(labels)}): call it "
                               f"before the group's first backward")
        if self.gradient_accumulation > 1 and counts_targets(self._criterion):
            counts = target_counts(self._criterion, [_to_device(y) for y in labels])
            self._group_count, self._group_len = total_count(counts), len(labels)

    def train(self) -> None:
        self.forward_module.train()

    def eval(self) -> None:
        self._sync_buffers()  # every replica evaluates with data rank 0's BatchNorm statistics
        self.forward_module.eval()

    def _sync_buffers(self) -> None:
        """Give every data-parallel replica rank 0's buffers: DDP does it itself on eval()
        (ddp.py); the gradient handler and ZeRO level 3 have no forward of their own to do it."""
        if isinstance(self.forward_module, DistributedDataParallel) or gpc.gradient_size == 1:
            return
        broadcast_buffers(self.model)

    @property
    def accumulating(self) -> bool:
        """True between the backward passes of one accumulation group, before its step."""
        return self._micro != 0

    def close_group(self) -> None:
        """End the current accumulation group at the next backward (it synchronises) and step."""
        self._closing = True

    def zero_grad(self) -> None:
        if self._micro == 0:  # mid-accumulation gradients must survive
            self.optimizer.zero_grad()

    def _group_ends(self) -> bool:
        return self._micro > 0 and (self._micro >= self.gradient_accumulation or self._closing)

    def backward(self, loss: torch.Tensor) -> None:
        self._micro += 1
        loss = loss / self.gradient_accumulation
        # all-reduce once, on the last of the accumulated backwards
        ddp = isinstance(self.forward_module, DistributedDataParallel)
        defer = ddp and not self._group_ends()
        with self.forward_module.no_sync() if defer else nullcontext():
            self.optimizer.backward(loss)

    def step(self) -> bool:
        """Take the optimizer step at the end of each accumulation group; True if a step was
        taken."""
        if not self._group_ends():
            return False
        self._micro, self._closing, self._group_count = 0, False, None
        self.reduce_gradients()
        if self.clip_grad_norm:
            # ranks holding *other* parameters (pipeline stages, tensor shards) add their squares
            # MoE: experts live on other ranks than the model group's (moe/grads.py)
            # sequence ranks hold replicas, like data ranks: only the stages are other parts
            parts = gpc.pipeline_group if gpc.sequence_size > 1 else gpc.model_group
            spread = getattr(self.gradient_handler, "norm", None)
            self.last_grad_norm = self.optimizer.clip_grad_norm(
                self.clip_grad_norm, parts, **({"sharded": spread} if spread else {}))
        return self.optimizer.step()

    def reduce_gradients(self) -> None:
        """After the last backward of a group: the gradient handler's data-parallel mean, where
        one replaces DDP (which has already averaged during backward)."""
        if self.gradient_handler is not None:
            self.gradient_handler.handle_gradient()

    def execute_schedule(self, batch: Any, forward_only: bool = False, return_loss: bool = True):
        """One iteration on `batch` = (inputs, label): forward, loss and (unless forward_only)
        backward."""
        inputs, label = batch
        output = self(inputs)
        loss = self.criterion(output, label) if return_loss else None
        if not forward_only:
            self.backward(loss)
        return output, labels_of_output(_to_device(label)), loss


class PipelineEngine(Engine):
    """A pipeline stage's engine: whole batches only, run by a schedule as micro-batches.

    There is no per-sample forward here -- the stage holds only some of the layers -- so
    `engine(x)` and `engine.backward(loss)` are errors; `execute_schedule(batch)` runs the
    schedule's forwards and backwards and returns (output, label, loss) (output/label on the
    last stage, the mean loss on every stage). With MoE layers every stage backpropagates its
    own MOE_AUX_WEIGHT x load-balancing loss per micro-batch (pipeline/moe_aux.py)."""

    def __init__(self, model: nn.Module, optimizer: MixedPrecisionOptimizer,
                 criterion: Optional[Callable],
                 schedule: Any, chunks: list, clip_grad_norm: float = 0.0,
                 gradient_handler: Optional[DataParallelGradientHandler] = None,
                 moe_aux_weight: float = 0.0) -> None:
        super().__init__(model, optimizer, criterion, clip_grad_norm=clip_grad_norm,
                         gradient_handler=gradient_handler, moe_aux_weight=moe_aux_weight)
        self.schedule = schedule  # GPipe / 1F1B / interleaved
        self.chunks = chunks      # what the schedule runs (DDP-wrapped per chunk)

    def reduce_gradients(self) -> None:
        """The data-parallel mean first, then a weight two stages share gets the sum of their
        gradients. In this order because stages may reduce differently: with MoE only in later
        blocks, stage 0 runs DDP (averaged in backward) and the last stage a gradient handler
        (averaged here); summing first would hand stage 0 the other stage's un-averaged
        gradient, a different one on each data rank."""
        super().reduce_gradients()
        tied = getattr(self.model, "tied", [])
        if isinstance(self.optimizer, ShardedOptimizer):  # ZeRO 2: pieces of gradients
            self.optimizer.sum_tied_gradients(tied)
        else:
            sum_tied_gradients(tied)

    def _sync_buffers(self) -> None:
        if gpc.gradient_size == 1:
            return
        for chunk in self.chunks:
            if isinstance(chunk, DistributedDataParallel):
                chunk.sync_buffers()
            else:  # the gradient handler: no DDP around the chunk
                broadcast_buffers(chunk)

    def set_schedule(self, schedule: Any) -> None:
        """Run batches with another schedule (e.g. GPipe instead of the config's 1F1B)."""
        self.schedule = schedule

    def trace(self, recorder: Optional[Callable[[str, float, float], None]]) -> None:
        """Call recorder(step label, start, end) for every schedule step from now on (None:
        stop)."""
        self.schedule.recorder = recorder

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"[rank {gpc.rank}] a pipeline stage has no forward of its own; run "
                           f"whole batches with engine.execute_schedule(batch) (the Trainer does)")

    def backward(self, loss: torch.Tensor) -> None:
        raise RuntimeError(f"[rank {gpc.rank}] engine.backward does not apply to a pipeline stage: "
                           f"engine.execute_schedule(batch) runs the backward passes")

    def execute_schedule(self, batch: Any, forward_only: bool = False, return_loss: bool = True):
        if not forward_only:
            # one more batch of gradients (gradient_accumulation is 1 here: each batch is a group;
            # its micro-batches accumulate inside the schedule)
            self._micro += 1
            # replicas start the batch with the same BatchNorm statistics. Not when evaluating:
            # ranks may run different numbers of batches (uneven shards), see eval()
            self._sync_buffers()
        output, label, loss = self.schedule.forward_backward_step(
            self.chunks, batch, self._criterion, forward_only, return_loss,
            loss_scale=self.optimizer.backward_scale, moe_aux_weight=self.moe_aux_weight)
        if label is not None:  # the labels of each micro-batch's output, in order
            parts = label.tensor_split(self.schedule.num_microbatches)
            label = torch.cat([labels_of_output(part) for part in parts])
        return output, label, loss
