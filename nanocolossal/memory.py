"""Memory, counted from live tensors: the instruments the tests and benchmarks measure with.

    with SavedBytes(model.parameters()) as saved:    # what autograd keeps for backward
        loss = model(x).sum()
    saved.peak                                        # bytes, each storage once
    with LargestMade() as made:                       # the largest tensor any op returns
        loss.backward()
    made.most                                         # elements

SavedBytes sees activations (activation_checkpoint.py's formula, pipeline schedules' in-flight
micro-batches); LargestMade sees transient tensors no one saves, such as a block of attention
scores (ring_attention.py: the explicit blocks make one, a fused kernel's tiles are its own
memory, never a tensor).

Before a launch, `nanocolossal plan` computes these activation bytes and bubbles
(nanocolossal/plan/activations.py).
"""
from __future__ import annotations

import weakref
from typing import Any, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class SavedBytes:
    """While entered: the bytes of the tensors autograd keeps for backward (activations), live
    (`now`) and at most (`peak`). Parameters are not counted: nothing in a parameter's storage
    when it is saved (ZeRO 3's gathered unit, which it frees after the forward and gathers again
    for the backward); a tensor saved twice counts once (by its storage and offset: the
    micro-batches of one batch are views of one storage, each its own; meta tensors, which
    `nanocolossal plan` measures, have no addresses)."""

    def __init__(self, params: Iterable[torch.Tensor]) -> None:
        self.params = list(params)
        self.live: dict[tuple, list[int]] = {}  # place -> [bytes, times saved]
        self.now = self.peak = 0

    def _pack(self, t: torch.Tensor) -> Any:
        ptr = _where(t)
        if ptr[0] in {p.untyped_storage()._cdata for p in self.params}:  # (ZeRO 3 moves them)
            return t
        if ptr not in self.live:
            self.live[ptr] = [t.numel() * t.element_size(), 0]
            self.now += self.live[ptr][0]
            self.peak = max(self.peak, self.now)
        self.live[ptr][1] += 1
        holder = _Holder(t)
        weakref.finalize(holder, self._release, ptr)  # autograd let go of this saved tensor
        return holder

    def _release(self, ptr: tuple) -> None:
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[ptr]

    def __enter__(self) -> "SavedBytes":
        unpack = lambda h: h.t if isinstance(h, _Holder) else h  # noqa: E731
        self.ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, unpack)
        self.ctx.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.ctx.__exit__(*exc)


def _where(t: torch.Tensor) -> tuple[int, int]:
    """A tensor's place: its storage (the C++ object, real or meta) and its offset there."""
    return t.untyped_storage()._cdata, t.storage_offset()


class _Holder:
    def __init__(self, t: torch.Tensor) -> None:
        # the data without the graph: a saved output holding its own grad_fn would be a cycle
        # that only a backward breaks, not dropping the graph (zero-bubble's W runs part of it)
        self.t = t.detach()


class LargestMade(TorchDispatchMode):
    """While entered: the most elements of any tensor an op returns (`most`)."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.most = max([self.most, *sizes])
        return out
