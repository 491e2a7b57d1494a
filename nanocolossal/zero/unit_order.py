"""Level 3's units: which modules they are, and the two rules they follow, checked.

Which (plan_units): the modules that run. The model's children, with the containers opened,
recursively: an nn.ModuleList or nn.ModuleDict is never called, and an nn.Sequential only calls
its layers in turn, so the elements are the units. `self.blocks = nn.ModuleList(...)` (or a
Sequential of blocks; nanoGPT's ModuleDict(wte=..., h=ModuleList(...), ln_f=...)) gives one unit
per block, FSDP's usual per-block wrapping: a block is gathered alone, not the whole stack. A
unit is not opened further. The model's own parameters and those two units share (a tied
embedding) are the root unit, gathered for the whole forward and backward.

Rule 1, a unit's parameters are read inside its forward only -- else it joins the root unit.
A freed parameter points at a NaN element (sharded_params.py), so a read elsewhere -- a tied
head F.linear(x, self.wte.weight) in the model's forward, a block reading another block's
weight -- would compute with NaN. OutsideUse watches the ops of the first forward (a
TorchFunctionMode) and reports each unit whose parameter an op reads while that unit is not
running (its shape, dtype or device do not count); sharded_model.py gathers that unit there and
then and makes it part of the root unit, logged: the same code works, that unit stays whole
through forward and backward. Only the first forward that completes is watched (its cost is a
Python call per op): a read elsewhere that first appears later still reads NaN.

Rule 2, every data rank gathers the same units in the same order. The ranks' shards meet by
order: the k-th all-gather of rank 0 pairs with the k-th of rank 1. A unit that only some ranks
run (a branch taken on rank 0's data alone) breaks the pairing. Units of different sizes make
gloo abort; units of the same size give every rank a parameter built from two units' shards --
a silently wrong forward, and a wrong step after it. So:

    every step     each rank folds the units it gathered since the last step (prefetches too)
                   into one number, a rolling hash of their indices; before the optimizer steps,
                   one all-reduce of [h, -h] with MAX tells whether every rank has the same h. If
                   not, every rank raises: the wrong values are never applied
    debug=True     the same check before each gather, so the error names the unit at once

A mismatch in a training forward often breaks the pairing of later collectives first (the
backward's gathers and reductions, a prefetch): gloo then aborts on a size difference or waits
out the job's timeout -- loud, not silent. What pairs up by chance is caught at the step, and a
forward after the last step (a final evaluation) is not checked. Cost: one all-reduce of two
integers per step (debug=True: one per gather).
"""
from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterator, Optional

import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode

from ..checks import same_everywhere
from ..context import gpc
from ..nest import map_tensors

_PRIME = 2**61 - 1  # the hash stays an int64 (an all-reduce's element)
_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
_METADATA = {"shape", "size", "dim", "ndim", "numel", "nelement", "dtype", "device", "layout",
             "requires_grad", "is_leaf", "grad", "stride", "element_size", "itemsize", "nbytes",
             "data_ptr", "untyped_storage", "is_contiguous", "is_cuda", "__len__"}


def plan_units(model: nn.Module, params: list[nn.Parameter]) -> tuple[list[nn.Module], dict]:
    """The units: the modules that run, containers opened; the root's own parameters and those
    shared by two units are the root unit (index len(units)). Returns the units and
    {id(param): unit index} for the parameters the optimizer steps."""
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
    """Rule 1 on a ShardedModel: its first forward that completes runs under OutsideUse, and a
    unit whose parameter an op reads while the unit is not running joins the root unit
    (`sharded.join_root`). Its hooks wrap the ShardedModel's: entered after the root unit is
    gathered, left before the units are freed (a free writes every parameter)."""

    def __init__(self, model: nn.Module, sharded: Any) -> None:
        self.sharded, self.mode, self.done = sharded, None, False
        model.register_forward_pre_hook(self._enter)
        model.register_forward_hook(self._leave, always_call=True, prepend=True)

    def _enter(self, module: nn.Module, args: Any) -> None:
        if not self.done:
            sharded = self.sharded
            unit_of = {id(p): u for u in sharded.children for b in u.buffers for p in b.params}
            self.mode = OutsideUse(unit_of, sharded.running, sharded.join_root)
            self.mode.__enter__()

    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.mode is not None:  # a forward that raised (output None) is not the one watched
            self.mode.__exit__(None, None, None)
            self.mode, self.done = None, output is not None


class UnitOrder:
    """The gathers of one ShardedModel since the last step, checked across its data group."""

    def __init__(self, group: Optional[dist.ProcessGroup], debug: bool) -> None:
        self.group, self.debug = group, debug
        self.fingerprint, self.names = 0, deque(maxlen=8)  # (names: the last few, for errors)

    def record_gather(self, index: int, name: str) -> None:
        """Unit number `index` (named `name`) is about to be gathered."""
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
    """After backward every gradient of a sharded parameter has been reduced into my shard, so
    a full .grad left over arrived after its unit's reduction (a parameter read outside the
    forward, a reentrant checkpoint of a unit called twice): it would be lost, so refuse."""
    late = [n for n, p in model.named_parameters() if p.grad is not None and id(p) in unit_of]
    if late:
        raise RuntimeError(f"[rank {gpc.rank}] zero level 3: {', '.join(late[:4])} got a "
                           f"gradient after its unit was reduced, so it would be lost: compute "
                           f"anything that reads parameters (a penalty over model.parameters()) "
                           f"inside the model's forward, and checkpoint a unit that runs more "
                           f"than once per forward with use_reentrant=False")
