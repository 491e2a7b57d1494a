"""One backward in two steps: B, the gradient of a stage's input, now; W, its weights', later.

Zero-bubble schedules (zero_bubble.py) need them apart: the previous stage waits for B, nobody waits
for W. Autograd's graph of one micro-batch, from the stage's output back to its input x:

    out -- Addmm3 -- Relu -- Addmm2 -- Relu -- Addmm1 -- x     the spine: B walks it (dX only)
             |                 |                 |
           W3, b3            W2, b2            W1, b1          W: one step off the spine each

The naive split is two backwards, `inputs=[x]` then `inputs=weights` (`TwoBackwards`); but the
second walks the spine again to reach W1, so the activations' gradients are computed twice.
`SplitBackward` records in B, with a pre-hook, the gradient arriving at every spine node that
has an edge off the spine, and W starts at those nodes with `inputs=` the weights below them:
each weight gradient is computed once and nothing twice, so B + W cost one ordinary backward.

W's last call starts at the output itself (with the weights nearest to it, a short walk), so what
hooks the output for the end of a backward (DDP's averaging) sees one, as usual -- never with
weights a chunk's own loss reaches (MoE's aux loss, a later root): that walk, and its all-reduce,
would run twice. A weight reached from two places (used twice in the chunk) also takes that call
from the output: summed by autograd, not by us. A root that does not reach x (a chunk's own loss)
is W's alone.
"""
from __future__ import annotations

from collections import Counter
from contextlib import nullcontext
from functools import partial
from typing import Callable, ContextManager, Optional

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from .split_backward_checks import refuse_recomputation

Around = Callable[[bool], ContextManager]  # W's backward calls run inside around(last call?)


class TwoBackwards:
    """The naive split (above), exact: for three Linears 4/3 of one backward's FLOPs (counted in
    test_pipeline_plan.py)."""

    def __init__(self, roots: list, grads: list, x: Optional[torch.Tensor], weights: list) -> None:
        self.roots = roots
        self.grads = grads
        self.x = x
        self.weights = weights

    def input_grad(self) -> None:
        if self.x is not None and self.roots:
            torch.autograd.backward(self.roots, self.grads, inputs=[self.x], retain_graph=True)

    def weight_grads(self, around: Around = lambda last: nullcontext()) -> None:
        with around(True):
            torch.autograd.backward(self.roots, self.grads, inputs=self.weights)


class SplitBackward(TwoBackwards):
    """The same split, each gradient computed once (above); `x` None: no input gradient."""

    def __init__(self, roots: list, grads: list, x: Optional[torch.Tensor], weights: list) -> None:
        super().__init__(roots, grads, x, weights)
        spine = _leads_to(roots, get_gradient_edge(x).node if x is not None else None)
        refuse_recomputation(spine)  # a checkpointed block's weights are not in the graph
        wanted = {id(w): w for w in weights}
        self.off: dict[Node, list] = {}  # spine nodes with edges off it -> the weights below
        for node, on in spine.items():
            below = [c for c, _ in node.next_functions if c is not None and not spine[c]]
            if on and below:
                self.off[node] = _weights_below(below, wanted)
        # the weights of roots off the spine, of shared weights, and of the spine's first
        # node with weights (nearest the output): one call from the output
        from_output = [w for r in roots if not spine[r.grad_fn]
                       for w in _weights_below([r.grad_fn], wanted)]
        seen = Counter(id(w) for w in from_output + [w for ws in self.off.values() for w in ws])
        others = _leads_to(roots[1:], None)
        candidates = [n for n, ws in self.off.items() if ws]
        nearest = (_nearest(roots, [n for n in candidates if n not in others])
                   or _nearest(roots, candidates))
        for node in list(self.off):
            if node is nearest or any(seen[id(w)] > 1 for w in self.off[node]):
                from_output += self.off.pop(node)
        self.from_output = list({id(w): w for w in from_output}.values())
        self.arrived: dict[Node, tuple] = {}

    def input_grad(self) -> None:
        """B: x.grad, recording what arrives at the spine's nodes with weights below them."""
        hooks = [node.register_prehook(lambda grad, node=node: self.arrived.update({node: grad}))
                 for node in self.off]
        try:
            super().input_grad()
        finally:
            for hook in hooks:
                hook.remove()

    def weight_grads(self, around: Around = lambda last: nullcontext()) -> None:
        """W: into the weights' .grad, from where B left each gradient, the output last; of these
        backwards only the last runs inside around(True) (DDP's averaging must run once)."""
        calls = []
        for node, weights in self.off.items():
            grad = self.arrived.get(node)
            if grad is None:  # B never reached it: from the output, then
                self.from_output += weights
                continue
            edges = [GradientEdge(node, i) for i, g in enumerate(grad) if g is not None]
            if edges:
                calls.append(partial(torch.autograd.backward, edges,
                                     [g for g in grad if g is not None], inputs=weights,
                                     retain_graph=True))
        if self.from_output:
            calls.append(partial(torch.autograd.backward, self.roots, self.grads,
                                 inputs=self.from_output))
        for i, call in enumerate(calls):
            with around(i == len(calls) - 1):
                call()


def _leads_to(roots: list, target: Optional[Node]) -> dict:
    """Every node of the roots' graph -> whether its gradient reaches `target` (the spine)."""
    reach: dict[Node, bool] = {}
    stack = [(r.grad_fn, False) for r in roots]
    while stack:
        node, children_done = stack.pop()
        if node in reach:
            continue
        kids = [c for c, _ in node.next_functions if c is not None]
        if children_done:
            reach[node] = node is target or any(reach[c] for c in kids)
        else:
            stack.append((node, True))
            stack += [(c, False) for c in kids if c not in reach]
    return reach


def _nearest(roots: list, nodes: list) -> Optional[Node]:
    """The first of `nodes` a breadth-first walk from the roots meets."""
    targets = set(nodes)
    queue = [r.grad_fn for r in roots]
    seen = set()
    for node in queue:
        if node in targets:
            return node
        if node not in seen:
            seen.add(node)
            queue += [c for c, _ in node.next_functions if c is not None]
    return None


def _weights_below(nodes: list, wanted: dict) -> list:
    """The wanted leaves (weights) whose gradients the nodes' subgraph accumulates."""
    found = []
    stack = list(nodes)
    seen = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        leaf = getattr(node, "variable", None)
        if leaf is not None and id(leaf) in wanted:
            found.append(leaf)
        stack += [c for c, _ in node.next_functions if c is not None]
    return found
