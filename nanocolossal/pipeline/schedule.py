"""Running a pipeline plan: one executor for GPipe, 1F1B, interleaved 1F1B, ZB-H1 and ZB-V.

Each schedule only chooses the order of steps (plan.py); `forward_backward_step` walks this
rank's plan:

    F(c, m)  input = micro-batch m (first stage) or the received activation; run chunk c.
             The stage holding the last part (output_rank) applies the criterion and weighs
             it by the micro-batch's share of the batch (1/M when M divides the batch), so the
             summed gradients of the M micro-batches are those of the mean loss over the batch.
    B(c, m)  backward from the loss (the last part, times the AMP loss scale) or from the
             gradient received from the next stage; the input's gradient is sent back.
             An integer activation (token ids for the next stage's embedding) has no
             gradient: both sides know its dtype, so both drop that transfer. A floating
             output that needs none (a frozen first stage) still gets one, unused.
             Where the plan splits the backward (zero_bubble, zbv), B computes the input's
             gradient only and keeps the graph for W (split_backward.py).
    W(c, m)  the weights' gradients, from where B left off (split plans).
    Comm     sends and receives posted together (p2p.py). Between two parts on one rank
             (zbv's chunks at the bottom of the V) the tensor is handed over in memory.

Activations are kept only from a micro-batch's forward to its backward (its W where split), so
rank r holds at most as many as its plan has in flight (P - r for 1F1B, M for GPipe, P for
ZB-H1). The last stage computes the loss; summed over the stages (the others add zero, or a
chunk's own loss), it reaches every stage, which can log it. Outputs and labels come back on the
rank that holds the last part (`output_rank`: the last, or 0 under zbv).

Features reach the executor through its extensions (extensions.py), at the places marked
`# extensions:` -- with data parallelism each chunk's gradients are averaged during its last
backward, its last W where split (ddp.py), overlapping the remaining pipeline steps; the last
stage may weigh its micro-batches by counted targets instead of samples (loss_weights.py); and a
chunk may add a loss of its own, backpropagated with its output (MoE's load balancing:
moe_aux.py).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..context import gpc
from ..extensions import Extension, synchronising
from .p2p import StageComm
from .plan import build_plan, check_sizes
from .split_backward import SplitBackward
from .steps import (
    Comm,
    Compute,
    PlanError,
    Transfer,
    handed_over,
    stage_rank,
    step_label,
    v_shaped,
    virtual_stage,
)


class Schedule:
    """A pipeline schedule: its name picks the plan (plan.py), forward_backward_step runs it."""
    name = ""

    def __init__(self, num_microbatches: int, tensor_shape: Optional[Sequence[int]] = None,
                 num_chunks: int = 1):
        self.num_microbatches, self.num_chunks = num_microbatches, num_chunks
        self.tensor_shape = tensor_shape
        self._comm: Optional[StageComm] = None
        self.max_in_flight = 0  # most micro-batches whose activations were held at once (last call)
        # (step, start, end) wall times
        self.recorder: Optional[Callable[[str, float, float], None]] = None

    def forward_backward_step(self, model: Any, batch: Any, criterion: Optional[Callable] = None,
                              forward_only: bool = False, return_loss: bool = True,
                              loss_scale: float = 1.0, extensions: Sequence[Extension] = ()):
        """Run one batch through the pipeline -> (output, label, loss); see the module docstring."""
        chunks = list(model) if isinstance(model, (nn.ModuleList, list, tuple)) else [model]
        self._check_call(chunks)
        x_mb, y_mb, labels = self._split(batch)
        run = _Run(self, chunks, criterion, not forward_only, loss_scale, x_mb, y_mb, extensions)
        self._check_criterion(run, criterion, forward_only, return_loss)
        for i, step in self._steps(run.plan):  # (each step's wall time to the recorder)
            if isinstance(step, Comm):
                run.exchange(self._comm, step, f"{self.name} step {i} of {len(run.plan)}")
            elif step.kind == "F":
                run.forward(step)
            else:
                run.backward(step, i)
        self._end(run)
        loss = run.reported_loss()
        if not any(run.is_last):
            return None, None, loss
        return torch.cat(run.outputs), labels, loss

    def _split(self, batch: Any) -> tuple[list, list, torch.Tensor]:
        """M near-equal micro-batches (sizes differ by at most one: a last batch of 13 with M = 4
        gives 4, 3, 3, 3), so any batch of at least M samples can run."""
        inputs, labels = batch
        M = self.num_microbatches
        self._check_batch_size(len(inputs))
        inputs = inputs.to(gpc.device, non_blocking=True)
        labels = labels.to(gpc.device, non_blocking=True)
        x_mb, y_mb = list(inputs.tensor_split(M)), list(labels.tensor_split(M))
        if self._comm is None:  # made at the first batch, when the pipeline group exists
            self._comm = StageComm(self.tensor_shape, v_shape=v_shaped(self.name))
        self._comm.sizes = [len(x) for x in x_mb]  # a new micro-batch size: new activation shapes
        return x_mb, y_mb, labels

    def _end(self, run: "_Run") -> None:
        """The plan is done: nothing left held or undelivered, the last sends waited for; the
        most activations held at once kept for `max_in_flight`."""
        assert not run.held and not run.outbox and not run.inbox, "plan left work undone"
        self._comm.flush(f"the end of a {self.name} batch")
        self.max_in_flight = run.max_in_flight

    def _steps(self, plan: list) -> Iterator[tuple[int, Any]]:
        """The plan's steps in order; each one's wall time to the recorder (Engine.trace)."""
        for i, step in enumerate(plan):
            started = time.time()
            yield i, step
            if self.recorder:
                self.recorder(_label(step, self.num_chunks), started, time.time())

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

    # -- misuse, said before anything is sent --------------------------------------------------
    def _check_call(self, chunks: list) -> None:
        M, V = self.num_microbatches, self.num_chunks
        check_on_this_pipeline(self.name, M, V)
        if len(chunks) != V:
            raise ValueError(f"[rank {gpc.rank}] {self.name} schedule expects {V} model chunk(s), "
                             f"got {len(chunks)}; build the model with build_pipeline_model(..., "
                             f"num_chunks={V})")

    def _check_criterion(self, run: "_Run", criterion: Optional[Callable], forward_only: bool,
                         return_loss: bool) -> None:
        if any(run.is_last) and criterion is None and (return_loss or not forward_only):
            raise ValueError(f"[rank {gpc.rank}] the last pipeline stage needs a criterion to "
                             f"compute the loss")

    def _check_batch_size(self, n: int) -> None:
        M = self.num_microbatches
        if n < M:
            raise ValueError(f"[rank {gpc.rank}] batch size {n} is smaller than "
                             f"NUM_MICRO_BATCHES={M}; use batches of at least {M} samples (or "
                             f"drop_last=True in the dataloader)")


class _Run:
    """The state of one forward_backward_step: what is held, sent and received."""

    def __init__(self, schedule: Schedule, chunks: list, criterion: Optional[Callable],
                 training: bool, loss_scale: float, x_mb: list, y_mb: list,
                 extensions: Sequence[Extension]) -> None:
        P, V = gpc.pipeline_size, schedule.num_chunks
        self.M, self.P, self.chunks = schedule.num_microbatches, P, chunks
        self.v_shape = v_shaped(schedule.name)  # zbv: chunk 1 of rank r is part 2P - 1 - r
        self.criterion, self.training, self.loss_scale = criterion, training, loss_scale
        self.x_mb, self.y_mb, self.extensions = x_mb, y_mb, extensions
        n = sum(len(y) for y in y_mb)
        self.share = [len(y) / n for y in y_mb]
        self.is_last = [self._part(c) == P * V - 1 for c in range(V)]
        self.weigh = self._by_samples
        if any(self.is_last) and criterion is not None:
            for extension in extensions:  # extensions: by counted targets (loss_weights.py)
                weigh = extension.weigh_micro_batches(criterion, y_mb, training)
                if weigh is not None:
                    self.weigh = weigh
                    break
        self.plan = schedule.plan(forward_only=not training)
        # a chunk's gradients are complete after its last B, or last W where the backward is split
        self.last_backward = {s.chunk: i for i, s in enumerate(self.plan)
                              if isinstance(s, Compute) and s.kind in ("B", "W")}
        self.split = any(isinstance(s, Compute) and s.kind == "W" for s in self.plan)
        # (chunk, mb) -> (input, output or loss, the chunk's own loss if not in the loss); from B
        # to W where split, the SplitBackward
        self.held: dict[tuple, tuple] = {}
        self.outbox: dict[Transfer, torch.Tensor] = {}
        self.inbox: dict[Transfer, torch.Tensor] = {}
        self.no_grad: set[Transfer] = set()  # gradients of integer activations: never sent
        self.outputs: list[torch.Tensor] = []
        # summed in float64 (a float64 model's loss keeps its digits; every stage adds in the
        # same dtype), reported in the criterion's dtype, as one process reports it
        self.total_loss = torch.zeros((), device=gpc.device, dtype=torch.float64)
        self.loss_dtype: Optional[torch.dtype] = None  # known on the last stage only
        self.max_in_flight = 0

    def forward(self, step: Compute) -> None:
        c, m, v = step.chunk, step.mb, self._part(step.chunk)
        x = self.x_mb[m] if v == 0 else self._receive(v, m)
        with torch.set_grad_enabled(self.training):
            output = self.chunks[c](x)
            extra = self._extra_loss(self.chunks[c], m)  # extensions: MoE's aux loss
            if self.is_last[c]:
                self.outputs.append(output.detach())
                backward_from = self._loss(output, m)
                if backward_from is not None and extra is not None:  # one backward for both
                    backward_from, extra = backward_from + extra, None
            else:
                backward_from = self._send(output, v, m)
        # keep the graph (input, loss or output) until this micro-batch's backward
        if self.training:
            self.held[(c, m)] = (x, backward_from, extra)
            self.max_in_flight = max(self.max_in_flight, len(self.held))

    def backward(self, step: Compute, index: int) -> None:
        """B: the whole backward, or where the plan splits it (zero_bubble, zbv) the input's
        gradient only (split_backward.py), held for W; W: then the weights' gradients."""
        c, m, v = step.chunk, step.mb, self._part(step.chunk)
        # extensions: a chunk's gradients are averaged once, during its last backward (DDP)
        with synchronising(self.extensions, c, last=index == self.last_backward[c]):
            if step.kind == "W":
                self.held.pop((c, m)).weight_grads()
                return
            x, backward_from, extra = self.held.pop((c, m))
            roots, grads = _roots(backward_from, self._output_grad(backward_from, v, m, c),
                                  extra, self.loss_scale)
            if self.split:  # the graph stays held until W
                weights = [p for p in self.chunks[c].parameters() if p.requires_grad]
                split = SplitBackward(roots, grads, x if x.requires_grad else None, weights)
                split.input_grad()
                self.held[(c, m)] = split
            elif roots:
                torch.autograd.backward(roots, grads)
        sent = Transfer("grad", v, v - 1, m)
        if v > 0 and sent not in self.no_grad:
            self._deliver(sent, input_gradient(x, v, m))

    def exchange(self, comm: StageComm, step: Comm, where: str) -> None:
        """Post this step's sends and receives together (p2p.py); integer activations' gradients
        are never sent."""
        sends = {t: self.outbox.pop(t) for t in step.sends if t not in self.no_grad}
        recvs = [t for t in step.recvs if t not in self.no_grad]
        self.inbox.update(comm.exchange(sends, recvs, where))

    def _part(self, chunk: int) -> int:
        return virtual_stage(chunk, gpc.pipeline_rank, self.P, self.v_shape)

    def _deliver(self, t: Transfer, x: torch.Tensor) -> None:
        """To the outbox for the next communication step, or, where both parts are on this rank
        (zbv's bottom of the V), straight to the inbox: a hand-over, no message."""
        (self.inbox if handed_over(t, self.P, self.v_shape) else self.outbox)[t] = x

    def _receive(self, v: int, m: int) -> torch.Tensor:
        """Micro-batch m's activation from part v - 1; while training it needs a gradient, unless
        it is integer (token ids): then no gradient goes back."""
        x = self.inbox.pop(Transfer("act", v - 1, v, m))
        if self.training:
            if x.is_floating_point():
                x.requires_grad_()
            else:
                self.no_grad.add(Transfer("grad", v, v - 1, m))
        return x

    def _send(self, output: Any, v: int, m: int) -> torch.Tensor:
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"[rank {gpc.rank}] pipeline part {v} returned "
                            f"{type(output).__name__}; stages must return one tensor")
        self._deliver(Transfer("act", v, v + 1, m), output.detach())
        if not output.is_floating_point():
            self.no_grad.add(Transfer("grad", v + 1, v, m))
        return output

    def _output_grad(self, backward_from: torch.Tensor, v: int, m: int,
                     c: int) -> Optional[torch.Tensor]:
        """The last stage starts from its loss times the AMP loss scale; the others from the
        gradient the next stage sent back (none for an integer output)."""
        if self.is_last[c]:
            return torch.full_like(backward_from, self.loss_scale)
        back = Transfer("grad", v + 1, v, m)
        return None if back in self.no_grad else self.inbox.pop(back)

    def _loss(self, output: torch.Tensor, m: int) -> Optional[torch.Tensor]:
        """Micro-batch m's part of the batch's mean loss, added to the reported loss."""
        if self.criterion is None:
            return None
        loss = self.weigh(output, m)
        self.loss_dtype = loss.dtype
        self.total_loss += loss.detach()
        return loss

    def _by_samples(self, output: torch.Tensor, m: int) -> torch.Tensor:
        """The criterion x the micro-batch's share of the batch (1/M for equal micro-batches):
        the sum over micro-batches is the batch mean."""
        return self.criterion(output, self.y_mb[m]) * self.share[m]

    def _extra_loss(self, chunk: nn.Module, m: int) -> Optional[torch.Tensor]:
        """extensions: the chunk's own losses for micro-batch m while training (MoE's
        load-balancing loss: moe_aux.py), added to the reported loss."""
        extra = None
        for extension in self.extensions if self.training else ():
            more = extension.extra_loss(chunk, self.share[m])
            if more is not None:
                self.total_loss += more.detach()
                extra = more if extra is None else extra + more
        return extra

    def reported_loss(self) -> torch.Tensor:
        """The batch's loss on every stage (for logging and LossHook): the stages' sum (the
        others add 0, or their own losses), with the last stage's dtype riding along as a
        code."""
        dtypes = (None, torch.float32, torch.float64, torch.float16, torch.bfloat16)
        both = torch.stack([self.total_loss, self.total_loss.new_tensor(
            float(dtypes.index(self.loss_dtype)))])
        if self.P > 1:
            dist.all_reduce(both, group=gpc.pipeline_group)
        return both[0].to(dtypes[int(both[1])] or torch.get_default_dtype())


def _roots(output: torch.Tensor, grad: Optional[torch.Tensor], extra: Optional[torch.Tensor],
           loss_scale: float) -> tuple[list, list]:
    """Where a chunk's backward starts: its output with `grad`, and its own loss (scaled like the
    loss) -- one backward through the shared graph. An integer output has no gradient (`grad`
    None), and the output of a frozen stage needs none: only the chunk's own loss, if any."""
    roots, grads = [], []
    if grad is not None and output.requires_grad:
        roots, grads = [output], [grad]
    if extra is not None:
        scaled = extra * loss_scale
        roots, grads = roots + [scaled], grads + [torch.ones_like(scaled)]
    return roots, grads


def input_gradient(x: torch.Tensor, v: int, m: int) -> torch.Tensor:
    """The gradient of part v's input, to send back. A floating input no gradient reached is an
    error: zeros sent back would give the earlier stage's parameters zero gradients where one
    process leaves them None, and momentum or weight decay would still move them -- a silent
    difference."""
    if x.grad is not None:
        return x.grad
    raise RuntimeError(
        f"[rank {gpc.rank}] pipeline part {v} did not use its input in micro-batch {m}: no "
        f"gradient flows back to part {v - 1}, whose parameters one process would leave without "
        f"a gradient; make part {v} use its input, or end part {v - 1} with an output that "
        f"needs no gradient (integer ids, or .detach())")


def _label(step, V: int) -> str:
    if isinstance(step, Comm):
        return "send/recv " + ", ".join(f"{t.what}{t.mb}" for t in step.sends + step.recvs)
    return step_label(step, V)


def check_on_this_pipeline(name: str, M: int, V: int) -> None:
    """The plan's sizes against the launched pipeline, the error naming this rank."""
    try:
        check_sizes(name, gpc.pipeline_size, M, V)
    except PlanError as e:
        raise PlanError(f"[rank {gpc.rank}] {e}") from None
