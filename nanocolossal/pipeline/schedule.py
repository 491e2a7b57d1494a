"""Running a pipeline plan: one executor for GPipe, 1F1B and interleaved 1F1B.

Each schedule only chooses the order of steps (plan.py); `forward_backward_step` walks this
rank's plan:

    F(c, m)  input = micro-batch m (first stage) or the received activation; run chunk c.
             The last stage applies the criterion and divides by M, so the summed
             gradients of the M micro-batches are those of the mean loss over the batch.
    B(c, m)  backward from the loss (last stage, times the AMP loss scale) or from the
             gradient received from the next stage; the input's gradient is sent back.
    Comm     sends and receives posted together (p2p.py).

Activations are kept only from a micro-batch's forward to its backward, so rank r holds at
most as many as its plan has in flight (P - r for 1F1B, M for GPipe). With data parallelism
each chunk is wrapped in DDP; its gradients are averaged over the data group during the
chunk's last backward, overlapping the remaining pipeline steps. The mean loss is broadcast
from the last stage, so every stage can log it; outputs and labels come back on the last.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..context import gpc
from ..ddp import DistributedDataParallel
from .p2p import StageComm
from .plan import SCHEDULES, Comm, Compute, PlanError, Transfer, build_plan, check_sizes


def _check(name: str, M: int, V: int) -> None:
    try:
        check_sizes(name, gpc.pipeline_size, M, V)
    except PlanError as e:
        raise PlanError(f"[rank {gpc.rank}] {e}") from None


class _Schedule:
    name = ""

    def __init__(self, num_microbatches: int, tensor_shape: Optional[Sequence[int]] = None, num_chunks: int = 1):
        self.num_microbatches, self.num_chunks, self.tensor_shape = num_microbatches, num_chunks, tensor_shape
        self._comm: Optional[StageComm] = None
        self.max_in_flight = 0  # most micro-batches whose activations were held at once (last call)

    def plan(self, rank: Optional[int] = None, stages: Optional[int] = None, forward_only: bool = False) -> list:
        """This schedule's steps for `rank` of `stages` (default: this process), as plain data."""
        stages = gpc.pipeline_size if stages is None else stages
        rank = gpc.pipeline_rank if rank is None else rank
        return build_plan(self.name, stages, self.num_microbatches, self.num_chunks, rank, forward_only)

    def _split(self, batch: Any) -> tuple[list, list, torch.Tensor, torch.Tensor]:
        inputs, labels = batch
        n, M = len(inputs), self.num_microbatches
        if n % M != 0:
            raise ValueError(f"[rank {gpc.rank}] batch size {n} is not divisible by NUM_MICRO_BATCHES={M}; use a "
                             f"batch size that is a multiple of {M} (and drop_last=True in the dataloader)")
        inputs, labels = inputs.to(gpc.device, non_blocking=True), labels.to(gpc.device, non_blocking=True)
        return list(inputs.split(n // M)), list(labels.split(n // M)), inputs, labels

    def forward_backward_step(self, model: Any, batch: Any, criterion: Optional[Callable] = None,
                              forward_only: bool = False, return_loss: bool = True, loss_scale: float = 1.0):
        """Run one batch through the pipeline -> (output, label, loss); see the module docstring."""
        P, M, V = gpc.pipeline_size, self.num_microbatches, self.num_chunks
        _check(self.name, M, V)
        chunks = list(model) if isinstance(model, (nn.ModuleList, list, tuple)) else [model]
        if len(chunks) != V:
            raise ValueError(f"[rank {gpc.rank}] {self.name} schedule expects {V} model chunk(s), got {len(chunks)}; "
                             f"build the model with build_pipeline_model(..., num_chunks={V})")
        last = P * V - 1
        is_last = [c * P + gpc.pipeline_rank == last for c in range(V)]
        if any(is_last) and criterion is None and (return_loss or not forward_only):
            raise ValueError(f"[rank {gpc.rank}] the last pipeline stage needs a criterion to compute the loss")
        if self._comm is None:
            self._comm = StageComm(self.tensor_shape)
        x_mb, y_mb, _, labels = self._split(batch)
        plan = self.plan(forward_only=forward_only)
        last_backward = {step.chunk: i for i, step in enumerate(plan) if isinstance(step, Compute) and step.kind == "B"}
        held: dict[tuple, tuple] = {}            # (chunk, mb) -> (input, output or scaled loss)
        outbox: dict[Transfer, torch.Tensor] = {}
        inbox: dict[Transfer, torch.Tensor] = {}
        outputs, total_loss, self.max_in_flight = [], torch.zeros((), device=gpc.device), 0

        for i, step in enumerate(plan):
            if isinstance(step, Comm):
                sends = {t: outbox.pop(t) for t in step.sends}
                inbox.update(self._comm.exchange(sends, step.recvs, f"{self.name} step {i} of {len(plan)}"))
                continue
            c, m, v = step.chunk, step.mb, step.chunk * P + gpc.pipeline_rank
            if step.kind == "F":
                x = x_mb[m] if v == 0 else inbox.pop(Transfer("act", v - 1, v, m))
                if v > 0 and not forward_only and x.is_floating_point():
                    x.requires_grad_()
                with torch.set_grad_enabled(not forward_only):
                    out = chunks[c](x)
                    if is_last[c]:
                        outputs.append(out.detach())
                        loss = criterion(out, y_mb[m]) / M if criterion is not None else None
                        if loss is not None:
                            total_loss += loss.detach()
                        out = loss
                    elif not isinstance(out, torch.Tensor):
                        raise TypeError(f"[rank {gpc.rank}] pipeline part {v} returned {type(out).__name__}; "
                                        f"stages must return one tensor")
                    else:
                        outbox[Transfer("act", v, v + 1, m)] = out.detach()
                if not forward_only:
                    held[(c, m)] = (x, out)
                    self.max_in_flight = max(self.max_in_flight, len(held))
            else:
                x, out = held.pop((c, m))
                # DDP averages a chunk's gradients once, during its last backward
                defer = isinstance(chunks[c], DistributedDataParallel) and i != last_backward[c]
                with chunks[c].no_sync() if defer else nullcontext():
                    if is_last[c]:
                        (out * loss_scale).backward()
                    else:
                        torch.autograd.backward(out, inbox.pop(Transfer("grad", v + 1, v, m)))
                if v > 0:
                    outbox[Transfer("grad", v, v - 1, m)] = x.grad
        assert not held and not outbox and not inbox, "plan left work undone"

        if P > 1:  # every stage learns the loss (for logging and LossHook)
            dist.broadcast(total_loss, src=gpc.pipeline_ranks[-1], group=gpc.pipeline_group)
        if not any(is_last):
            return None, None, total_loss
        return torch.cat(outputs), labels, total_loss


class GPipeSchedule(_Schedule):
    """All forwards, then all backwards (GPipe): the memory baseline."""
    name = "gpipe"

    def __init__(self, num_microbatches: int, tensor_shape: Optional[Sequence[int]] = None):
        super().__init__(num_microbatches, tensor_shape)


class PipelineSchedule(_Schedule):
    """Non-interleaved 1F1B: warm-up forwards, one-forward-one-backward, cool-down backwards."""
    name = "1f1b"

    def __init__(self, num_microbatches: int, tensor_shape: Optional[Sequence[int]] = None):
        super().__init__(num_microbatches, tensor_shape)


class InterleavedPipelineSchedule(_Schedule):
    """Interleaved 1F1B over `num_chunks` model chunks per rank (Megatron's virtual pipeline)."""
    name = "interleaved"

    def __init__(self, num_microbatches: int, num_chunks: int, tensor_shape: Optional[Sequence[int]] = None):
        super().__init__(num_microbatches, tensor_shape, num_chunks)


def make_schedule(name: str, num_microbatches: int, num_chunks: int = 1,
                  tensor_shape: Optional[Sequence[int]] = None) -> _Schedule:
    """A schedule by name: 'gpipe', '1f1b' or 'interleaved'."""
    if gpc.pipeline_size > 1:  # launched: check against the real pipeline now, not at the first batch
        _check(name, num_microbatches, num_chunks)
    elif name not in SCHEDULES:
        raise PlanError(f"unknown schedule {name!r}; use one of {', '.join(SCHEDULES)}")
    if name == "interleaved":
        return InterleavedPipelineSchedule(num_microbatches, num_chunks, tensor_shape)
    return {"gpipe": GPipeSchedule, "1f1b": PipelineSchedule}[name](num_microbatches, tensor_shape)
