"""What the executor (executor.py) leaves out, each a subclass of its Run or Executor:

    SplitRun    plans that split the backward (zero_bubble, zbv): B computes the input's gradient
                only (split_backward.py) and holds the graph; W, later, the weights'
    OwnLosses   a chunk's own loss (MoE's load balancing, moe_aux.py), backpropagated with its
                output: summed into the last part's loss, a second root elsewhere
    Schedule    the executor that picks among them, times each step for a recorder
                (engine.trace) and counts the activations held at once (`max_in_flight`)
"""
from __future__ import annotations

import time
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch

from ..extensions import Extension, synchronising
from .executor import Executor, Run
from .split_backward import SplitBackward
from .steps import Comm, Compute, step_label


class SplitRun(Run):
    """B: the input's gradient only, the graph held for W; W: the weights' gradients."""

    def backward(self, step: Compute) -> None:
        if step.kind == "B":
            return super().backward(step)
        c, last = step.chunk, step == self.last_backward[step.chunk]
        # extensions: a chunk's gradients are averaged once, in its last W's last backward (DDP)
        self.held.pop((c, step.mb)).weight_grads(
            lambda final: synchronising(self.extensions, c, last=last and final))

    def backprop(self, roots: list, grads: list, x: torch.Tensor, c: int, m: int) -> None:
        weights = [p for p in self.chunks[c].parameters() if p.requires_grad]
        split = SplitBackward(roots, grads, x if x.requires_grad else None, weights)
        split.input_grad()
        self.held[(c, m)] = split  # until W


class OwnLosses(Run):
    """extensions: after each chunk's forward while training, the chunk's own losses for the
    micro-batch (`extra_loss`), added to the reported loss and backpropagated with the output
    (one backward through the shared graph)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.own: dict[tuple, torch.Tensor] = {}  # (chunk, mb) -> its own loss, until B

    def forward(self, step: Compute) -> None:
        super().forward(step)
        c, m = step.chunk, step.mb
        own = self.own_loss(c, m) if self.training else None
        if own is None:
            return
        x, output = self.held[(c, m)]
        if self.is_last[c] and output is not None:  # one backward for both
            self.held[(c, m)] = (x, output + own)
        else:
            self.own[(c, m)] = own

    def own_loss(self, c: int, m: int) -> Optional[torch.Tensor]:
        own = None
        with torch.enable_grad():
            for extension in self.extensions:
                more = extension.extra_loss(self.chunks[c], self.share[m])
                if more is not None:
                    self.total_loss += more.detach()
                    own = more if own is None else own + more
        return own

    def roots(self, output: torch.Tensor, c: int, v: int, m: int) -> tuple[list, list]:
        roots, grads = super().roots(output, c, v, m)
        own = self.own.pop((c, m), None)
        if own is None:
            return roots, grads
        scaled = own * self.loss_scale  # scaled like the loss
        return roots + [scaled], grads + [torch.ones_like(scaled)]


class SplitOwnLosses(OwnLosses, SplitRun):
    pass


def has_own_losses(extensions: Sequence[Extension]) -> bool:
    return any(type(e).extra_loss is not Extension.extra_loss for e in extensions)


class Schedule(Executor):
    """The executor with every feature's Run, a step recorder and the activations counted."""

    def run_type(self, extensions: Sequence[Extension]) -> type:
        split = self.name in ("zero_bubble", "zbv")
        if has_own_losses(extensions):
            return SplitOwnLosses if split else OwnLosses
        return SplitRun if split else Run

    def steps(self, plan: list) -> Iterable:
        self.last_plan = plan  # for max_in_flight
        return plan if self.recorder is None else self.timed(plan)

    def timed(self, plan: list) -> Iterator:
        """The plan's steps in order; each one's wall time to the recorder (Engine.trace)."""
        for step in plan:
            started = time.time()
            yield step
            if self.recorder:
                self.recorder(_label(step, self.num_chunks), started, time.time())

    @property
    def max_in_flight(self) -> int:
        """The most micro-batches whose activations the last call held at once: from a forward
        to its backward (its W where split); none when evaluating."""
        plan = [s for s in getattr(self, "last_plan", []) if isinstance(s, Compute)]
        freed_by = "W" if any(s.kind == "W" for s in plan) else "B"
        if not any(s.kind == freed_by for s in plan):
            return 0
        held = peak = 0
        for s in plan:
            held += (s.kind == "F") - (s.kind == freed_by)
            peak = max(peak, held)
        return peak


def _label(step: Any, V: int) -> str:
    if isinstance(step, Comm):
        return "send/recv " + ", ".join(f"{t.what}{t.mb}" for t in step.sends + step.recvs)
    return step_label(step, V)
