"""The executor: one rank walks its plan (plan.py) of forwards, backwards and messages.

Each schedule only chooses the order of steps (1F1B's timeline: plan.py); the executor runs them:

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

This file is 1F1B for floating activations (an integer one, token ids, has no gradient to send
back); the split backward, own losses, counted weights and tracing are mixins of Run
(executor_features.py), the misuse errors are in executor_checks.py. A chunk's gradients are
averaged during its last backward (extensions.py's `sync`, DDP). The loss is summed in float64 on
every stage and reported in the last stage's dtype, which rides along with it as a code.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..context import gpc
from ..extensions import Extension, synchronising
from .executor_checks import check_call, check_input_used, check_output
from .p2p import StageComm
from .plan import build_plan
from .steps import Comm, Compute, Transfer, stage_rank, v_shaped, virtual_stage

LOSS_DTYPES = (None, torch.float32, torch.float64, torch.float16, torch.bfloat16)  # codes


class Executor:
    """Runs this rank's plan (its schedule's, by name) for a batch: forward_backward_step."""
    name = ""
    comm: Optional[StageComm] = None  # made at the first batch: the group exists then

    def __init__(self, num_microbatches: int, tensor_shape: Optional[Sequence[int]] = None,
                 num_chunks: int = 1):
        self.num_microbatches = num_microbatches
        self.num_chunks = num_chunks
        self.tensor_shape = tensor_shape

    def forward_backward_step(self, model: Any, batch: Any, criterion: Optional[Callable] = None,
                              forward_only: bool = False, return_loss: bool = True,
                              loss_scale: float = 1.0, extensions: Sequence[Extension] = ()):
        """Run one batch through the pipeline -> (output, label, loss); see the docstring."""
        chunks = list(model) if isinstance(model, (nn.ModuleList, list, tuple)) else [model]
        check_call(self, chunks, batch, criterion, forward_only, return_loss)
        if self.comm is None:
            self.comm = StageComm(self.tensor_shape, v_shape=v_shaped(self.name))
        inputs, labels = (t.to(gpc.device, non_blocking=True) for t in batch)
        run = self.run_type(extensions)(self, chunks, criterion, inputs, labels, not forward_only,
                                        loss_scale, extensions)
        self.last_plan = run.plan  # (max_in_flight)
        for i, step in enumerate(run.plan):
            run.step(step, f"{self.name} step {i} of {len(run.plan)}")
        assert not run.held and not run.outbox and not run.inbox, "plan left work undone"
        self.comm.flush(f"the end of a {self.name} batch")
        loss = run.reported_loss()
        return (torch.cat(run.outputs), labels, loss) if any(run.is_last) else (None, None, loss)

    def run_type(self, extensions: Sequence[Extension]) -> type:
        """What runs a batch: the Run below (with mixins where the plan or a feature needs more)."""
        return Run

    def output_rank(self) -> int:
        """The pipeline rank holding the last part, the outputs and labels (zbv: rank 0)."""
        P = gpc.pipeline_size
        return stage_rank(P * self.num_chunks - 1, P, v_shaped(self.name))


class Run:
    """One batch on this rank: what is held, sent and received."""

    def __init__(self, executor: Executor, chunks: list, criterion: Optional[Callable],
                 inputs: torch.Tensor, labels: torch.Tensor, training: bool, loss_scale: float,
                 extensions: Sequence[Extension]) -> None:
        M = executor.num_microbatches
        P = gpc.pipeline_size
        self.chunks = chunks
        self.criterion = criterion
        self.training = training
        self.loss_scale = loss_scale
        self.extensions = extensions
        self.x_mb = list(inputs.tensor_split(M))  # near-equal: 13 samples, M = 4: 4, 3, 3, 3
        self.y_mb = list(labels.tensor_split(M))
        self.share = [len(y) / len(labels) for y in self.y_mb]
        self.comm = executor.comm
        self.comm.sizes = [len(x) for x in self.x_mb]  # activation shapes follow them
        V = len(chunks)
        self.parts = [virtual_stage(c, gpc.pipeline_rank, P, v_shaped(executor.name))
                      for c in range(V)]  # zbv: chunk 1 of rank r is part 2P - 1 - r
        self.is_last = [v == P * V - 1 for v in self.parts]
        self.plan = build_plan(executor.name, P, M, V, gpc.pipeline_rank, not training)
        # a chunk's gradients are complete after its last backward step
        self.last_backward = {s.chunk: s for s in self.plan
                              if isinstance(s, Compute) and s.kind != "F"}
        self.held: dict[tuple, Any] = {}  # (chunk, mb) -> (input, output or loss)
        self.outbox: dict[Transfer, torch.Tensor] = {}
        self.inbox: dict[Transfer, torch.Tensor] = {}
        self.outputs: list[torch.Tensor] = []
        self.total_loss = torch.zeros((), device=gpc.device, dtype=torch.float64)
        self.loss_dtype: Optional[torch.dtype] = None  # known on the last stage only

    def step(self, step: Any, where: str) -> None:
        if isinstance(step, Comm):
            self.exchange(step, where)
        elif step.kind == "F":
            self.forward(step)
        else:
            self.backward(step)

    def forward(self, step: Compute) -> None:
        c = step.chunk
        m = step.mb
        v = self.parts[c]
        x = self.x_mb[m] if v == 0 else self.receive(v, m)
        with torch.set_grad_enabled(self.training):
            output = self.chunks[c](x)
            if self.is_last[c]:
                self.outputs.append(output.detach())
                output = self.loss(output, m)  # the backward starts from the loss
            else:
                check_output(output, v)
                self.deliver(Transfer("act", v, v + 1, m), output.detach())
        if self.training:  # the graph, until this micro-batch's backward
            self.held[(c, m)] = (x, output)

    def backward(self, step: Compute) -> None:
        c = step.chunk
        m = step.mb
        v = self.parts[c]
        x, output = self.held.pop((c, m))
        if self.is_last[c]:  # from the loss, times the AMP loss scale
            grad = torch.full_like(output, self.loss_scale)
        else:  # from the gradient the next part sent (none for token ids)
            grad = self.inbox.pop(Transfer("grad", v + 1, v, m), None)
        roots = [output] if grad is not None and output.requires_grad else []  # frozen: none
        with synchronising(self.extensions, c, last=step == self.last_backward[c]):
            self.backprop(roots, [grad] * len(roots), x, c, m)
        if v > 0 and x.requires_grad:  # token ids have no gradient to send back
            check_input_used(x, v, m)
            self.deliver(Transfer("grad", v, v - 1, m), x.grad)

    def exchange(self, step: Comm, where: str) -> None:
        sends = {t: self.outbox.pop(t) for t in step.sends if t in self.outbox}
        self.inbox.update(self.comm.exchange(sends, step.recvs, where))

    def backprop(self, roots: list, grads: list, x: torch.Tensor, c: int, m: int) -> None:
        if roots:
            torch.autograd.backward(roots, grads)

    def receive(self, v: int, m: int) -> torch.Tensor:
        """Micro-batch m's activation from part v - 1, needing a gradient (token ids: none)."""
        x = self.inbox.pop(Transfer("act", v - 1, v, m))
        return x.requires_grad_(self.training and x.is_floating_point())

    def deliver(self, t: Transfer, x: torch.Tensor) -> None:
        """To the outbox for the next message batch, or to the inbox: a hand-over (zbv's V)."""
        (self.inbox if t.dst in self.parts else self.outbox)[t] = x

    def loss(self, output: torch.Tensor, m: int) -> Optional[torch.Tensor]:
        """Micro-batch m's part of the batch's mean loss, added to the reported loss."""
        if self.criterion is None:
            return None
        loss = self.weigh(output, m)
        self.loss_dtype = loss.dtype
        self.total_loss += loss.detach()
        return loss

    def weigh(self, output: torch.Tensor, m: int) -> torch.Tensor:
        """The criterion x the micro-batch's share of the samples: they sum to the batch mean."""
        return self.criterion(output, self.y_mb[m]) * self.share[m]

    def reported_loss(self) -> torch.Tensor:
        """The batch's loss on every stage: the stages' sum, in the last stage's dtype."""
        code = self.total_loss.new_tensor(float(LOSS_DTYPES.index(self.loss_dtype)))
        both = torch.stack([self.total_loss, code])
        if gpc.pipeline_size > 1:
            dist.all_reduce(both, group=gpc.pipeline_group)
        return both[0].to(LOSS_DTYPES[int(both[1])] or torch.get_default_dtype())
