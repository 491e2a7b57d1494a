"""Level 3's units: which modules they are, and the two rules they follow.

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
weight -- would compute with NaN. OutsideUse (sharded_model_checks.py) watches the ops of the
first forward (a TorchFunctionMode) and reports each unit whose parameter an op reads while that
unit is not running (its shape, dtype or device do not count); join_root gathers that unit there
and then and makes it part of the root unit, logged: the same code works, that unit stays whole
through forward and backward. Only the first forward that completes is watched (its cost is a
Python call per op): a read elsewhere that first appears later still reads NaN.

Rule 2, every data rank gathers the same units in the same order. The ranks' shards meet by
order: the k-th all-gather of rank 0 pairs with the k-th of rank 1. A unit that only some ranks
run (a branch taken on rank 0's data alone) breaks the pairing. Units of different sizes make
gloo abort; units of the same size give every rank a parameter built from two units' shards --
a silently wrong forward, and a wrong step after it. So (UnitOrder, sharded_model_checks.py):

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

from typing import Iterator

from torch import nn

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


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
