"""What the executor (executor.py) leaves out: mixins of its Run, and the Schedule that adds them
to a batch's Run only where the plan or an extension asks for them.

    SplitRun    plans that split the backward (zero_bubble, zbv): B computes the input's gradient
                only (split_backward.py) and holds the graph; W, later, the weights'
    OwnLosses   extensions' `extra_loss`: after each chunk's forward while training, its own
                loss for the micro-batch (MoE's load balancing, moe_aux.py), added to the
                reported loss and backpropagated with the output, one backward through the
                shared graph: summed into the last part's loss, a second root elsewhere
    Weighed     extensions' `weigh_micro_batches`: the last stage weighs micro-batches by
                counted targets (loss_weights.py), not by their share of the samples
    Timed       each step's wall time to a recorder (Engine.trace): (label, start, end)
    Schedule    the executor that composes them, only on the ranks and batches that need them,
                and counts the activations held at once (`max_in_flight`)
"""
from __future__ import annotations

import time
from functools import lru_cache
from itertools import accumulate
from typing import Any, Optional, Sequence

import torch

from ..context import gpc
from ..extensions import Extension, synchronising
from .executor import Executor, Run
from .split_backward import SplitBackward
from .steps import Comm, Compute, step_label


class SplitRun(Run):
    def backward(self, step: Compute) -> None:
        if step.kind == "B":
            return super().backward(step)
        c = step.chunk
        last = step == self.last_backward[c]
        # extensions: a chunk's gradients are averaged once, in its last W's last backward (DDP)
        self.held.pop((c, step.mb)).weight_grads(
            lambda final: synchronising(self.extensions, c, last=last and final))

    def backprop(self, roots: list, grads: list, x: torch.Tensor, c: int, m: int) -> None:
        weights = [p for p in self.chunks[c].parameters() if p.requires_grad]
        split = SplitBackward(roots, grads, x if x.requires_grad else None, weights)
        split.input_grad()
        self.held[(c, m)] = split  # until W


class OwnLosses(Run):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.own: dict[tuple, torch.Tensor] = {}  # (chunk, mb) -> its own loss, until B

    def forward(self, step: Compute) -> None:
        super().forward(step)
        c = step.chunk
        m = step.mb
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

    def backprop(self, roots: list, grads: list, x: torch.Tensor, c: int, m: int) -> None:
        own = self.own.pop((c, m), None)
        if own is not None:  # scaled like the loss
            roots = roots + [own * self.loss_scale]
            grads = grads + [torch.ones_like(own)]
        super().backprop(roots, grads, x, c, m)


class Weighed(Run):
    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        if self.criterion is not None:
            for extension in self.extensions:
                weigh = extension.weigh_micro_batches(self.criterion, self.y_mb, self.training)
                self.weigh = weigh or self.weigh


class Timed(Run):
    def __init__(self, executor: Executor, *args: Any) -> None:
        super().__init__(executor, *args)
        self.recorder = executor.recorder

    def step(self, step: Any, where: str) -> None:
        started = time.time()
        super().step(step, where)
        label = (step_label(step, len(self.chunks)) if not isinstance(step, Comm) else
                 "send/recv " + ", ".join(f"{t.what}{t.mb}" for t in step.sends + step.recvs))
        self.recorder(label, started, time.time())


def overrides(extensions: Sequence[Extension], point: str) -> bool:
    return any(getattr(type(e), point) is not getattr(Extension, point) for e in extensions)


@lru_cache
def composed(mixins: tuple) -> type:
    """One Run class with these mixins, in this order."""
    return type("".join(m.__name__ for m in mixins), mixins, {})


class Schedule(Executor):
    """The executor with the mixins each batch needs and the activations counted."""
    recorder = None  # Engine.trace sets it

    def run_type(self, extensions: Sequence[Extension]) -> type:
        holds_loss = self.output_rank() == gpc.pipeline_rank
        wanted = {OwnLosses: overrides(extensions, "extra_loss"),
                  Weighed: holds_loss and overrides(extensions, "weigh_micro_batches"),
                  SplitRun: self.name in ("zero_bubble", "zbv"), Timed: self.recorder is not None}
        mixins = tuple(mixin for mixin, needed in wanted.items() if needed)
        return composed(mixins) if mixins else Run

    @property
    def max_in_flight(self) -> int:
        """The most micro-batches whose activations the last call held at once: from a forward
        to its backward (its W where split); none when evaluating."""
        plan = [s for s in getattr(self, "last_plan", []) if isinstance(s, Compute)]
        freed_by = "W" if any(s.kind == "W" for s in plan) else "B"
        if not any(s.kind == freed_by for s in plan):
            return 0
        return max(accumulate((s.kind == "F") - (s.kind == freed_by) for s in plan))
