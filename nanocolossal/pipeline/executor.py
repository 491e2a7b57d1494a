"""The executor: one rank walks its plan (plan.py) of forwards, backwards and messages.

Each schedule only chooses the order of steps; the executor runs them. 1F1B on P = 4 stages,
M = 8 micro-batches (a forward one unit, a backward two):

    rank 0 |F0F1F2F3............B0B0F4B1B1F5B2B2F6B3B3F7B4B4..B5B5..B6B6..B7B7|
    rank 1 |..F0F1F2........B0B0F3B1B1F4B2B2F5B3B3F6B4B4F7B5B5..B6B6..B7B7....|
    rank 2 |....F0F1....B0B0F2B1B1F3B2B2F4B3B3F5B4B4F6B5B5F7B6B6..B7B7........|
    rank 3 |......F0B0B0F1B1B1F2B2B2F3B3B3F4B4B4F5B5B5F6B6B6F7B7B7............|

    F(c, m)  input = micro-batch m (first stage) or the activation received; run chunk c. The
             last part applies the criterion, weighed by the micro-batch's share of the batch
             (1/M when M divides it), so the M backwards sum to the gradient of the batch mean.
    B(c, m)  backward from the loss (times the AMP loss scale) or from the gradient the next
             stage sent back; the input's gradient goes back to the previous stage.
    Comm     sends and receives posted together (p2p.py); between two parts on one rank (zbv's
             bottom of the V) a tensor is handed over in memory.

Who holds what: rank r keeps a micro-batch's graph (input, output or loss) from its F to its B,
at most as many as its plan has in flight (P - r for 1F1B, M for GPipe). The last stage adds
up the loss; summed over the stages it reaches every rank, which can log it. Outputs and labels
come back on the rank that holds the last part (`output_rank`: the last, or 0 under zbv).

What this file leaves to others: a split backward's W (SplitRun), a chunk's own loss (MoE's
load balancing, OwnLosses), the trace recorder and the activations counted
(executor_features.py); misuse errors (executor_checks.py). Features reach the loop through
extensions.py's points: a chunk's gradients are averaged during its last backward (`sync`, DDP),
and the last stage may weigh micro-batches by counted targets (`weigh_micro_batches`).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..context import gpc
from ..extensions import Extension, synchronising
from .executor_checks import check_call, check_criterion, check_input_used, check_output
from .p2p import StageComm
from .plan import build_plan
from .steps import Comm, Compute, Transfer, handed_over, stage_rank, v_shaped, virtual_stage


class Executor:
    """Runs this rank's plan for a batch: forward_backward_step (the schedule's name picks the
    plan)."""
    name = ""

    def __init__(self, num_microbatches: int, tensor_shape: Optional[Sequence[int]] = None,
                 num_chunks: int = 1):
        self.num_microbatches = num_microbatches
        self.num_chunks = num_chunks
        self.tensor_shape = tensor_shape
        self.comm: Optional[StageComm] = None  # made at the first batch: the group exists then
        self.recorder: Optional[Callable[[str, float, float], None]] = None  # (engine.trace)

    def forward_backward_step(self, model: Any, batch: Any, criterion: Optional[Callable] = None,
                              forward_only: bool = False, return_loss: bool = True,
                              loss_scale: float = 1.0, extensions: Sequence[Extension] = ()):
        """Run one batch through the pipeline -> (output, label, loss); see the docstring."""
        chunks = list(model) if isinstance(model, (nn.ModuleList, list, tuple)) else [model]
        check_call(self, chunks, batch)
        inputs, labels = (t.to(gpc.device, non_blocking=True) for t in batch)
        run = self.run_type(extensions)(self, chunks, criterion, inputs, labels, not forward_only,
                                        loss_scale, extensions)
        check_criterion(run, criterion, forward_only, return_loss)
        for i, step in enumerate(self.steps(run.plan)):
            if isinstance(step, Comm):
                run.exchange(step, f"{self.name} step {i} of {len(run.plan)}")
            elif step.kind == "F":
                run.forward(step)
            else:
                run.backward(step)
        assert not run.held and not run.outbox and not run.inbox, "plan left work undone"
        self.comm.flush(f"the end of a {self.name} batch")
        loss = run.reported_loss()
        if not any(run.is_last):
            return None, None, loss
        return torch.cat(run.outputs), labels, loss

    def run_type(self, extensions: Sequence[Extension]) -> type:
        """What runs a batch: the Run below (a subclass where the plan or a feature needs more)."""
        return Run

    def steps(self, plan: list) -> Iterable:
        """The plan's steps, in order (a subclass may time them)."""
        return plan

    def messenger(self, sizes: list) -> StageComm:
        if self.comm is None:
            self.comm = StageComm(self.tensor_shape, v_shape=v_shaped(self.name))
        self.comm.sizes = sizes  # a new micro-batch size: new activation shapes
        return self.comm

    def plan(self, rank: Optional[int] = None, stages: Optional[int] = None,
             forward_only: bool = False) -> list:
        """This schedule's steps for `rank` of `stages` (default: this process), as plain data."""
        stages = gpc.pipeline_size if stages is None else stages
        rank = gpc.pipeline_rank if rank is None else rank
        return build_plan(self.name, stages, self.num_microbatches, self.num_chunks, rank,
                          forward_only)

    def output_rank(self) -> int:
        """The pipeline rank that holds the model's last part, so the outputs and labels: the
        last rank, or rank 0 when the parts run down and back up a V (zbv)."""
        P = gpc.pipeline_size
        return stage_rank(P * self.num_chunks - 1, P, v_shaped(self.name))


class Run:
    """One batch on this rank: what is held, sent and received."""

    def __init__(self, executor: Executor, chunks: list, criterion: Optional[Callable],
                 inputs: torch.Tensor, labels: torch.Tensor, training: bool, loss_scale: float,
                 extensions: Sequence[Extension]) -> None:
        M, V = executor.num_microbatches, executor.num_chunks
        self.P = gpc.pipeline_size
        self.v_shape = v_shaped(executor.name)  # zbv: chunk 1 of rank r is part 2P - 1 - r
        self.chunks = chunks
        self.criterion = criterion
        self.training = training
        self.loss_scale = loss_scale
        self.extensions = extensions
        # M near-equal micro-batches (13 samples, M = 4: 4, 3, 3, 3)
        self.x_mb = list(inputs.tensor_split(M))
        self.y_mb = list(labels.tensor_split(M))
        self.comm = executor.messenger([len(x) for x in self.x_mb])
        n = sum(len(y) for y in self.y_mb)
        self.share = [len(y) / n for y in self.y_mb]
        self.is_last = [self.part(c) == self.P * V - 1 for c in range(V)]
        self.weigh = self.by_samples
        for extension in extensions if any(self.is_last) and criterion is not None else ():
            # extensions: by counted targets (loss_weights.py)
            self.weigh = extension.weigh_micro_batches(criterion, self.y_mb, training) or self.weigh
        self.plan = executor.plan(forward_only=not training)
        # a chunk's gradients are complete after its last backward step
        self.last_backward = {s.chunk: s for s in self.plan
                              if isinstance(s, Compute) and s.kind != "F"}
        self.held: dict[tuple, Any] = {}  # (chunk, mb) -> (input, output or loss)
        self.outbox: dict[Transfer, torch.Tensor] = {}
        self.inbox: dict[Transfer, torch.Tensor] = {}
        self.outputs: list[torch.Tensor] = []
        # summed in float64 (every stage adds in the same dtype), reported in the loss's dtype
        self.total_loss = torch.zeros((), device=gpc.device, dtype=torch.float64)
        self.loss_dtype: Optional[torch.dtype] = None  # known on the last stage only

    def forward(self, step: Compute) -> None:
        c, m, v = step.chunk, step.mb, self.part(step.chunk)
        x = self.x_mb[m] if v == 0 else self.receive(v, m)
        with torch.set_grad_enabled(self.training):
            output = self.chunks[c](x)
            if self.is_last[c]:
                self.outputs.append(output.detach())
                output = self.loss(output, m)  # the backward starts from the loss
            else:
                self.send(output, v, m)
        if self.training:  # the graph, until this micro-batch's backward
            self.held[(c, m)] = (x, output)

    def backward(self, step: Compute) -> None:
        c, m, v = step.chunk, step.mb, self.part(step.chunk)
        x, output = self.held.pop((c, m))
        roots, grads = self.roots(output, c, v, m)
        # extensions: a chunk's gradients are averaged once, during its last backward (DDP)
        with synchronising(self.extensions, c, last=step == self.last_backward[c]):
            self.backprop(roots, grads, x, c, m)
        if v > 0 and x.requires_grad:  # token ids have no gradient to send back
            check_input_used(x, v, m)
            self.deliver(Transfer("grad", v, v - 1, m), x.grad)

    def exchange(self, step: Comm, where: str) -> None:
        """Post this step's sends and receives together (p2p.py)."""
        sends = {t: self.outbox.pop(t) for t in step.sends if t in self.outbox}
        self.inbox.update(self.comm.exchange(sends, step.recvs, where))

    def roots(self, output: torch.Tensor, c: int, v: int, m: int) -> tuple[list, list]:
        """Where the backward starts: the loss times the AMP loss scale on the last part, else
        the output with the gradient the next part sent back (none for token ids, and none
        needed by a frozen stage)."""
        if self.is_last[c]:
            grad = torch.full_like(output, self.loss_scale)
        else:
            grad = self.inbox.pop(Transfer("grad", v + 1, v, m), None)
        if grad is None or not output.requires_grad:
            return [], []
        return [output], [grad]

    def backprop(self, roots: list, grads: list, x: torch.Tensor, c: int, m: int) -> None:
        if roots:
            torch.autograd.backward(roots, grads)

    def part(self, chunk: int) -> int:
        return virtual_stage(chunk, gpc.pipeline_rank, self.P, self.v_shape)

    def receive(self, v: int, m: int) -> torch.Tensor:
        """Micro-batch m's activation from part v - 1; while training it needs a gradient
        (token ids have none)."""
        x = self.inbox.pop(Transfer("act", v - 1, v, m))
        return x.requires_grad_(self.training and x.is_floating_point())

    def send(self, output: torch.Tensor, v: int, m: int) -> None:
        check_output(output, v)
        self.deliver(Transfer("act", v, v + 1, m), output.detach())

    def deliver(self, t: Transfer, x: torch.Tensor) -> None:
        """To the outbox for the next communication step, or, where both parts are on this rank
        (zbv's bottom of the V), straight to the inbox: a hand-over, no message."""
        box = self.inbox if handed_over(t, self.P, self.v_shape) else self.outbox
        box[t] = x

    def loss(self, output: torch.Tensor, m: int) -> Optional[torch.Tensor]:
        """Micro-batch m's part of the batch's mean loss, added to the reported loss."""
        if self.criterion is None:
            return None
        loss = self.weigh(output, m)
        self.loss_dtype = loss.dtype
        self.total_loss += loss.detach()
        return loss

    def by_samples(self, output: torch.Tensor, m: int) -> torch.Tensor:
        """The criterion x the micro-batch's share of the samples: they sum to the batch mean."""
        return self.criterion(output, self.y_mb[m]) * self.share[m]

    def reported_loss(self) -> torch.Tensor:
        """The batch's loss on every stage: the stages' sum (the others add 0, or their own
        losses), the last stage's dtype riding along as a code."""
        dtypes = (None, torch.float32, torch.float64, torch.float16, torch.bfloat16)
        code = self.total_loss.new_tensor(float(dtypes.index(self.loss_dtype)))
        both = torch.stack([self.total_loss, code])
        if self.P > 1:
            dist.all_reduce(both, group=gpc.pipeline_group)
        return both[0].to(dtypes[int(both[1])] or torch.get_default_dtype())
