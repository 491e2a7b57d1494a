"""ZeRO level 3: parameters live as shards between uses; each unit is gathered just for its
forward and again for its backward, and its gradients are reduce-scattered when its backward ends.

Units (the wrapping policy, plan_units below): the modules that run -- the model's
children with nn.ModuleList, nn.ModuleDict and nn.Sequential opened, so a stack of blocks is one
unit per block. The model's own parameters and any two units share (a tied embedding) form the
root unit, gathered for the whole forward and backward; parameters not stepped are kept whole.

Who holds what when, one step, units L0 -> L1 -> L2 (N ranks, `g` = all-gather, `rs` =
reduce-scatter of the unit's gradients, which keeps only my shard of them):

    forward     L0: g | compute | free
                L1:             g | compute | free
                L2:                         g | compute | free
    backward    L2:                                  g | grads | free | rs
                L1:                                          g | grads | free | rs
                L0:                                                    g | grads | free | rs
    step        each rank steps its shards; nothing is gathered after: the next forward does

How the hooks know: a forward pre-hook gathers the unit and passes its inputs through an
identity autograd function whose backward runs when the unit's backward has ended
("post-backward"). A forward hook frees the unit and hooks its outputs, which fires when their
gradients arrive, just before the unit's backward ("pre-backward": gather). Reductions start in
a fixed order (last unit first), as DDP's buckets do, so every rank issues the same collectives.

Calls: a unit may run several times before a backward (a block called twice, a siamese loss).
Each call gathers and frees on its own, forward and backward; the unit counts its calls with
grad, each post-backward counts one off, and the last one reduces it -- autograd has then summed
every call's gradient into .grad. A block B called twice:

    forward     B: g | call 1 | free | g | call 2 | free                    calls: 2
    backward    B:                          g | call 2 | free | g | call 1 | free | rs  calls: 1, 0

A call whose inputs need no gradient (the first layer) never counts off: that unit, and one not
used, are reduced by a callback at the end of backward (counts that no backward took back, a
forward whose loss was dropped, are forgotten at the step). Activation checkpointing inside a
unit recomputes while the unit is gathered for its backward. A whole unit checkpointed
recomputes in backward: gathered if it is not, neither counted nor freed there (its forward's
call frees it); under use_reentrant=True its forward ran without grad and counted nothing, so
the recomputation's post-backward reduces it: such a unit may run once per forward only.

The optimisation, after the naive path (overlap_communication=True): as a unit starts, so does
the gather of the unit that followed it last forward (backward: this forward's order reversed;
a changed order wastes one), and a unit's reduction runs while autograd computes the next
unit's, at most one in flight. False: each collective is waited for at once.

The rules (sharded_model_checks.py says why): the same units in the same order on every data
rank; a unit read outside its forward joins the root unit; a late gradient is refused.

Memory per rank (fp32 parameters, Adam, Psi = elements the optimizer steps, N ranks; each
unit's buffers padded to a multiple of N):
    between steps   4 Psi/N parameters + 4 Psi/N gradients + 8 Psi/N Adam = 16 Psi/N
                    (the ZeRO paper's mixed-precision (2+2+12) Psi/N is the same 16 Psi/N)
    peak forward    shards + the root unit + the largest two consecutive child units gathered
                    (+ 4 bytes: the NaN element freed parameters share); in backward also a
                    unit's full gradients until reduced

Traffic per step, per rank: gathers in forward and backward, a reduce-scatter, Psi (N-1)/N each:
3 Psi (N-1)/N, 1.5x DDP's (gloo: 4, zero/comm.py; tests/test_zero_traffic.py). Accumulation: each
backward adds into my gradient shard. (`nanocolossal plan` computes these.)
"""
from __future__ import annotations

import weakref
from functools import partial
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from ..nest import map_tensors
from ..weak import weakly
from .comm import reduce_scatter_shard
from .sharded_model_checks import Rules
from .sharded_params import ParamShardedOptimizer, ShardedFlatBuffer

__all__ = ["HELD", "ShardedModel", "plan_units", "release"]

# each model level 3 holds -> its ShardedModel, weakly (the model keeps it through its hooks,
# never the other way round): a second nc.initialize of the model releases it first (release)
HELD: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward is the signal that the unit's backward ended."""

    @staticmethod
    def forward(ctx: Any, fire: Callable[[], None], *tensors: torch.Tensor) -> Any:
        ctx.fire = fire
        return tensors

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.fire()
        return (None, *grads)


class _Unit:
    def __init__(self, name: str, buffers: list[ShardedFlatBuffer]) -> None:
        self.name, self.buffers = name, buffers
        self.calls = 0      # forwards with grad whose backward has not ended
        self.active = 0     # calls whose backward began and has not ended
        self.ready = False  # its backward is over in this pass (or it took no part)
        self.hooks: list = []

    def gather(self, group: Optional[dist.ProcessGroup], async_op: bool = False) -> None:
        for b in self.buffers:
            b.gather(group, async_op)

    def wait(self) -> None:
        for b in self.buffers:
            b.wait()

    def free(self) -> None:
        for b in self.buffers:
            b.free()


class ShardedModel:
    """Installs level 3's hooks on `model`, cut into shards by the optimizer (units: plan_units)."""

    def __init__(self, model: nn.Module, optimizer: ParamShardedOptimizer,
                 units: list[nn.Module], overlap_communication: bool = True) -> None:
        self.model, self.optimizer, self.group = model, optimizer, optimizer.group
        self.size, self.overlap = optimizer.size, overlap_communication
        names = {id(m): n for n, m in model.named_modules()}
        self.children: list[_Unit] = []
        for i, module in enumerate(units):
            if optimizer.buffers_of(i):
                unit = _Unit(names[id(module)], optimizer.buffers_of(i))
                self.children.append(unit)
                unit.hooks = [module.register_forward_pre_hook(partial(self._pre_forward, unit),
                                                               with_kwargs=True),
                              module.register_forward_hook(partial(self._post_forward, unit))]
        self.root = _Unit("(root)", optimizer.buffers_of(len(units)))
        # backward reaches the last child first; the root unit ends with the whole backward
        self.order = [*reversed(self.children), self.root]
        self._next, self._pending, self._queued = 0, [], False  # (_queued: in a backward)
        self.seen: list[_Unit] = []  # prefetch: this forward's units in order, the last one's
        self.previous: list[_Unit] = []
        # level 3's hooks on the model, with the rules' and zero3_state_dict.py's: release drops all
        self.handles = [model.register_forward_pre_hook(self._root_pre_forward),
                        model.register_forward_hook(self._root_post_forward, always_call=True)]
        optimizer.before_step = self._before_step  # (called first in its step: sharded_params)
        self.rules = Rules(self)  # unit order, reads outside a unit...: sharded_model_checks.py
        HELD[model] = weakref.ref(self)

    # -- forward: gather a unit before it runs, free it after -------------------------------
    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        self.previous, self.seen = self.seen or self.previous, []  # this forward repeats that one
        self._use(self.root, [])

    def _pre_forward(self, unit: _Unit, module: nn.Module, args: Any, kwargs: dict) -> Any:
        if self._queued:  # recomputed in backward (a checkpointed unit): no count, no prefetch
            self._use(unit, [])
        else:
            self.seen.append(unit)
            self._use(unit, self.previous)
            unit.calls += torch.is_grad_enabled()
        if not torch.is_grad_enabled():
            return None
        found: list[torch.Tensor] = []
        map_tensors(lambda t: found.append(t) if t.requires_grad else None, (args, kwargs))
        if not found:  # the first layer: reduced by the end-of-backward callback
            return None
        wrapped = iter(_PostBackward.apply(weakly(self._post_backward, unit), *found))
        return map_tensors(lambda t: next(wrapped) if t.requires_grad else t, (args, kwargs))

    def _post_forward(self, unit: _Unit, module: nn.Module, args: Any, output: Any) -> None:
        self._on_grad_of(output, weakly(self._pre_backward, unit))
        if not self._queued:  # (a recomputation's saved tensors are read after it)
            unit.free()

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self._on_grad_of(output, weakly(self._root_pre_backward))
        for unit in (self.root, *self.children):  # (children: a prefetch this forward skipped)
            unit.free()

    # -- backward: gather again before a unit's backward, free and reduce-scatter after -----
    def _root_pre_backward(self) -> None:
        if not self._queued:  # once per backward: the end-of-backward callback
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        self._use(self.root, [])

    def _pre_backward(self, unit: _Unit) -> None:
        self._root_pre_backward()
        unit.active += 1
        self._use(unit, self.seen[::-1])  # backward meets the units in reverse forward order

    def _post_backward(self, unit: _Unit) -> None:
        unit.active = max(unit.active - 1, 0)
        unit.calls = max(unit.calls - 1, 0)  # (0: a recomputation's, or a call since forgotten)
        if unit.calls == 0 and not unit.ready:
            self._done(unit)
        elif unit.active == 0:  # another call's backward is still to come: it gathers again
            unit.free()

    def _done(self, unit: _Unit) -> None:
        unit.free()
        unit.ready = True
        while self._next < len(self.order) and self.order[self._next].ready:
            self._launch(self.order[self._next])  # in the fixed order, as far as ready
            self._next += 1

    def _launch(self, unit: _Unit) -> None:
        """Reduce the unit's gradients: each buffer's / N reduce-scattered (my shard of the sum);
        a "used" flag per parameter all-reduced (one no rank used keeps grad=None)."""
        self._finish_pending()  # at most one reduction in flight
        for b in unit.buffers:
            grads = torch.zeros(b.data.numel(), dtype=b.data.dtype, device=b.local.device)
            # built on the host and sent in one copy: no launch per parameter
            used = torch.tensor([p.grad is not None for p in b.params], dtype=b.data.dtype)
            used = used.to(b.local.device, non_blocking=True)
            for p, offset in zip(b.params, b.offsets):
                if p.grad is not None:
                    grads[offset: offset + p.numel()].copy_(p.grad.reshape(-1)).div_(self.size)
                    p.grad = None  # the full gradient is not kept
            works, mine = [], grads
            if self.size > 1:
                work, mine = reduce_scatter_shard(grads, self.group, async_op=True)
                works = [work, dist.all_reduce(used, group=self.group, async_op=True)]
            self._pending.append((b, mine, used, works))
        if not self.overlap:
            self._finish_pending()

    def _finish_pending(self) -> None:
        """Wait; add my shard of the averaged gradients to the optimizer's segments."""
        for b, mine, used, works in self._pending:
            for work in works:
                work.wait()
            where = {index: i for i, index in enumerate(b.indices)}
            used = used.tolist()  # one read per buffer, not per parameter
            for s in b.segments:
                i = where[s.index]
                if used[i] > 0:  # (my shard begins at rank x shard in the unit's buffer)
                    at = b.offsets[i] + s.lo - b.rank * b.shard
                    reduced = mine[at: at + s.hi - s.lo]
                    target = self.optimizer.grad_target(s)  # (O2: the half view)
                    if target.grad is None:
                        target.grad = reduced.clone()
                    else:  # accumulation: earlier backwards of this step left theirs
                        target.grad.add_(reduced)
        self._pending = []

    def _end_backward(self) -> None:
        for unit in self.order:  # not used, or a call's end unseen (a first layer): reduce now
            if not unit.ready:
                self._done(unit)
        self._finish_pending()
        for unit in self.order:
            unit.ready, unit.active = False, 0
        self._next, self._queued = 0, False
        self.rules.backward_ended()

    def _before_step(self) -> None:
        self.rules.before_step()
        for unit in self.children:  # calls no backward reached (a forward whose loss was
            unit.calls = 0          # dropped) would keep their unit from an early reduction

    # -- the plumbing: gather and wait; a hook on the gradients of a unit's outputs ---------
    def _use(self, unit: _Unit, then: list[_Unit]) -> None:
        """Gather `unit` (or wait for its prefetch) before it computes."""
        self._gather(unit)
        unit.wait()
        if self.overlap:
            self._prefetch(unit, then)

    def _gather(self, unit: _Unit, async_op: bool = False) -> None:
        self.rules.gathering(unit)  # every rank gathers the same units in the same order
        unit.gather(self.group, async_op)

    @staticmethod
    def _on_grad_of(output: Any, hook: Callable[[], None]) -> None:
        """hook() once, when the first gradient of a tensor of `output` arrives."""
        if torch.is_grad_enabled():
            once = [hook]

            def fire(grad: torch.Tensor) -> None:
                if once:
                    once.pop()()
            map_tensors(lambda t: t.register_hook(fire) if t.requires_grad else None, output)

    # -- the optimisation: prefetch (overlap_communication=True) ----------------------------
    def _prefetch(self, unit: _Unit, then: list[_Unit]) -> None:
        """Start gathering the unit after `unit` in `then`, to arrive while `unit` computes."""
        if unit in then[:-1] and not then[then.index(unit) + 1].ready:
            self._gather(then[then.index(unit) + 1], async_op=True)


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def plan_units(model: nn.Module, params: list[nn.Parameter]) -> tuple[list[nn.Module], dict]:
    """The units (above) and {id(param): unit index} of stepped parameters (root: len(units))."""
    def running(module: nn.Module) -> Iterator[nn.Module]:
        for child in module.children():
            yield from running(child) if isinstance(child, _CONTAINERS) else (child,)

    units = list(dict.fromkeys(running(model)))  # (a module registered twice: one unit)
    owners: dict[int, set[int]] = {}
    for i, unit in enumerate(units):
        for p in unit.parameters():
            owners.setdefault(id(p), set()).add(i)
    root = len(units)
    unit_of = {id(p): min(owners[id(p)]) if len(owners.get(id(p), ())) == 1 else root
               for p in params}
    return units, unit_of


def release(model: nn.Module) -> None:
    """A second nc.initialize of a model level 3 holds: its parameters whole again, the hooks
    level 3 installed (the timeline's, its rules', checkpoint/zero3_state_dict.py's) taken off."""
    sharded = HELD.pop(model)()
    for b in sharded.optimizer.buffers:
        b.gather(sharded.group)
        b.wait()  # (a prefetch's transfer)
        for p in b.params:
            p.data = p.detach().clone()  # its own storage, no longer the buffer's
        b.data.untyped_storage().resize_(0)
    for handle in sharded.handles + [h for unit in sharded.children for h in unit.hooks]:
        handle.remove()
