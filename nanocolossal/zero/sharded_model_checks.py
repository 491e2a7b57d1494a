"""ZeRO level 3's rules, installed beside the gather / free / reduce-scatter timeline, which calls
`Rules` at three points, one line each: gathering(unit) before every gather (Rule 2's fingerprint),
backward_ended() (no gradient may arrive late: refuse_late_gradients) and before_step() (Rule 2
checked across the data group). Without a call from the timeline: FirstForwardWatch (Rule 1) and
refuse_unfreezing. Non-finite gradients are refused by the step (optimizer_checks.py).

Rule 1, a unit's parameters are read inside its forward only -- else it joins the root unit.
A freed parameter points at a NaN element (sharded_params.py), so a read elsewhere -- a tied
head F.linear(x, self.wte.weight) in the model's forward, a block reading another block's
weight -- would compute with NaN. OutsideUse (a TorchFunctionMode over the first forward that
completes: a Python call per op) reports each unit whose parameter an op reads, not its shape,
dtype or device, while that unit is not running; join_root gathers it there and then and makes
it part of the root unit, logged. A read that first appears later still reads NaN.

Rule 2, every data rank gathers the same units in the same order. The ranks' shards meet by
order: the k-th all-gather of rank 0 pairs with the k-th of rank 1, so a unit only some ranks
run (a branch on rank 0's data) breaks the pairing: units of different sizes make gloo abort
(or wait out the timeout), units of the same size give every rank a parameter built from two
units' shards -- silently wrong. So (UnitOrder):

    every step     each rank folds the units it gathered since the last step (prefetches too)
                   into a rolling hash h of their indices; before the optimizer steps, one
                   all-reduce of [h, -h] with MAX tells whether every rank has the same h; if
                   not, every rank raises: the wrong values are never applied
    debug=True     the same check before each gather, so the error names the unit at once

A forward after the last step (a final evaluation) is not checked.
"""
from __future__ import annotations

from collections import deque
from functools import partial
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from ..checks import refuse_unfreezing, same_everywhere
from ..context import gpc
from ..logging import get_dist_logger
from ..nest import map_tensors

_PRIME = 2**61 - 1  # the hash stays an int64 (an all-reduce's element)
_METADATA = {"shape", "size", "dim", "ndim", "numel", "nelement", "dtype", "device", "layout",
             "requires_grad", "is_leaf", "grad", "stride", "element_size", "itemsize", "nbytes",
             "data_ptr", "untyped_storage", "is_contiguous", "is_cuda", "__len__"}


class Rules:
    """Every rule of one ShardedModel (`sharded`); its timeline calls the three methods."""

    def __init__(self, sharded: Any) -> None:
        self.sharded = sharded
        self.unit_order = UnitOrder(sharded.group, bool(gpc.config.get("debug")))
        watch = FirstForwardWatch(sharded)  # a unit read outside its forward joins the root unit
        frozen = refuse_unfreezing(sharded.model, sharded.model, lambda: "zero")  # no path
        sharded.handles += [h for h in (*watch.hooks, frozen) if h is not None]

    def gathering(self, unit: Any) -> None:
        """`unit` is about to be gathered (or its prefetch started)."""
        if self.sharded.size > 1 and not all(b.gathered for b in unit.buffers):
            self.unit_order.record_gather(self.sharded.order.index(unit), unit.name)

    def backward_ended(self) -> None:
        refuse_late_gradients(self.sharded.model, self.sharded.optimizer.unit_of)

    def before_step(self) -> None:
        if self.sharded.size > 1:
            self.unit_order.check()


class OutsideUse(TorchFunctionMode):
    """While entered: found(unit, param) for each op that reads the values of a parameter of a
    unit not running. `unit_of`: id(param) -> its unit; `running`: the units whose forward is
    under way (a list the caller keeps)."""

    def __init__(self, unit_of: dict[int, Any], running: list, found: Callable) -> None:
        super().__init__()
        self.unit_of, self.running, self.found = unit_of, running, found

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (),
                           kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in ("__get__", "__set__"):  # a property: p.shape, p.T
            name = getattr(func.__self__, "__name__", "")
        if name not in _METADATA:  # a freed parameter's shape is right; its values are not
            map_tensors(self._check, (args, kwargs))
        return func(*args, **kwargs)

    def _check(self, t: Any) -> None:
        unit = self.unit_of.get(id(t))
        if unit is not None and unit not in self.running:
            self.found(unit, t)


class FirstForwardWatch:
    """Rule 1 over the first forward that completes. Entered after the root unit is gathered, left
    before the units are freed (a free writes every parameter); a unit is running from before its
    gather to after its free."""

    def __init__(self, sharded: Any) -> None:
        self.sharded, self.mode, self.running = sharded, None, []
        model = sharded.model
        self.hooks = [model.register_forward_pre_hook(self._enter),
                      model.register_forward_hook(self._leave, always_call=True, prepend=True)]
        for unit in sharded.children:
            module = model.get_submodule(unit.name)
            self.hooks += [
                module.register_forward_pre_hook(lambda *_, u=unit: self.running.append(u),
                                                 prepend=True),
                module.register_forward_hook(lambda *_, u=unit: self._stopped(u))]

    def _stopped(self, unit: Any) -> None:
        if unit in self.running:
            self.running.remove(unit)

    def _enter(self, module: nn.Module, args: Any) -> None:
        sharded = self.sharded
        unit_of = {id(p): u for u in sharded.children for b in u.buffers for p in b.params}
        self.running.clear()  # (a forward that raised left its units here)
        self.mode = OutsideUse(unit_of, self.running, partial(join_root, sharded))
        self.mode.__enter__()

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.mode is not None:  # a forward that raised (output None) is not the one watched
            self.mode.__exit__(None, None, None)
            self.mode = None
            if output is not None:
                for hook in self.hooks:
                    hook.remove()


def join_root(sharded: Any, unit: Any, param: torch.Tensor) -> None:
    """`unit` joins the root unit: gathered now, then for every whole forward and backward."""
    if unit not in sharded.children:  # (joined already)
        return
    sharded._use(unit, [])
    for hook in unit.hooks:
        hook.remove()
    sharded.children.remove(unit)
    sharded.order.remove(unit)
    sharded.root.buffers += unit.buffers
    unit.buffers = []  # (this forward's hooks on it now do nothing)
    name = next(n for n, p in sharded.model.named_parameters() if p is param)
    get_dist_logger().info(f"zero level 3: {name} is read outside unit {unit.name!r}, which "
                           f"joins the root unit (gathered for the whole forward and backward)")


class UnitOrder:
    """The gathers of one ShardedModel since the last step, checked across its data group."""

    def __init__(self, group: Optional[dist.ProcessGroup], debug: bool) -> None:
        self.group, self.debug = group, debug
        self.fingerprint, self.names = 0, deque(maxlen=8)  # (names: the last few, for errors)

    def record_gather(self, index: int, name: str) -> None:
        if self.debug and not same_everywhere(index, self.group, gpc.device):
            raise RuntimeError(f"[rank {gpc.rank}] zero level 3: this rank gathers unit {name!r} "
                               f"while another data rank gathers another: every data rank must "
                               f"run the same units (branch inside a unit)")
        self.fingerprint = (self.fingerprint * 1_000_003 + index + 1) % _PRIME
        self.names.append(name)

    def check(self) -> None:
        """Before a step (collective over the data group): the same gathers on every rank?"""
        agreed = same_everywhere(self.fingerprint, self.group, gpc.device)
        names, self.fingerprint = list(self.names), 0
        self.names.clear()
        if not agreed:
            raise RuntimeError(
                f"[rank {gpc.rank}] zero level 3: the data ranks gathered different units since "
                f"the last step (this rank, last: {', '.join(names) or 'none'}), so parameters "
                f"were put together from different units' shards; every data rank must run the "
                f"same units in the same order: move a branch inside a unit (a child module), "
                f"or use zero level 2 (debug=True names the first unit that differs)")


def refuse_late_gradients(model: nn.Module, unit_of: dict[int, int]) -> None:
    """A full .grad left after backward arrived after its unit's reduction (a parameter read
    outside the forward, a reentrant checkpoint of a unit called twice): it would be lost."""
    late = [n for n, p in model.named_parameters() if p.grad is not None and id(p) in unit_of]
    if late:
        raise RuntimeError(f"[rank {gpc.rank}] zero level 3: {', '.join(late[:4])} got a "
                           f"gradient after its unit was reduced, so it would be lost: compute "
                           f"anything that reads parameters (a penalty over model.parameters()) "
                           f"inside the model's forward, and checkpoint a unit that runs more "
                           f"than once per forward with use_reentrant=False")


def refuse_part_state_dict(whole: bool, keep_vars: bool) -> None:
    """A submodule's state_dict alone (not inside the model's): its freed parameters are NaN
    placeholders; only the model's state_dict gathers the units (checkpoint/zero3_state_dict.py)."""
    if not whole and not keep_vars:
        raise RuntimeError(
            f"[rank {gpc.rank}] zero level 3: a part of the model's state_dict() holds its freed "
            f"shards' placeholders, not the values; call engine.model.state_dict() (whole, on "
            f"every rank) and take the part's keys from it")

