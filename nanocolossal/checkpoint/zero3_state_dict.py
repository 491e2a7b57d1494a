"""ZeRO level 3's model.state_dict() and load_state_dict(): the plain model's keys, full tensors.

Between uses each rank holds only its shard of every unit (zero/sharded_params.py), so the model's
own state_dict calls are made whole around torch's:

    state_dict()        gather every unit (collective: every rank calls it), copy the full
                        tensors out, free the units again
    load_state_dict()   gather (when it loads parameters), let torch copy the whole values in,
                        keep my shard of each, free
    keep_vars=True      asks for the Parameters themselves (shapes, marks): nothing is gathered

Checkpoints do not come this way: they save and load each rank's segments (zero.py);
load_plain_state_dict (merge.py) does, each rank keeping its shard.
"""
from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from ..zero.sharded_model import ShardedModel
from ..zero.sharded_model_checks import refuse_part_state_dict
from ..zero.sharded_params import ShardedFlatBuffer


class FullStateDict:
    """Installs the hooks above on the model of `sharded` (initialize does, beside the timeline)."""

    def __init__(self, sharded: ShardedModel) -> None:
        model, optimizer = sharded.model, sharded.optimizer
        self.buffers: list[ShardedFlatBuffer] = optimizer.buffers  # (same order on every rank)
        self.group = optimizer.group
        named = model.named_parameters(remove_duplicate=False)  # (a tied weight: each name)
        self.param_keys = {n for n, p in named if p in optimizer.segments_of}
        self.whole = False  # inside the model's state_dict (a part's alone is refused)
        # (a partial: torch marks the hook with an attribute, which a bound method refuses)
        sharded.handles += [
            model.register_state_dict_pre_hook(self._before_state_dict),
            model.register_state_dict_post_hook(partial(FullStateDict._after_state_dict, self)),
            model.register_load_state_dict_pre_hook(self._before_load),
            model.register_load_state_dict_post_hook(self._after_load)]
        sharded.handles += [part.register_state_dict_pre_hook(
            lambda part, prefix, keep_vars: refuse_part_state_dict(self.whole, keep_vars))
            for part in model.modules() if part is not model]

    def gather_all(self) -> None:
        for b in self.buffers:
            b.gather(self.group)

    def _before_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        self.whole = True
        if not keep_vars:
            self.gather_all()

    def _after_state_dict(self, module: nn.Module, state: dict, prefix: str, meta: Any) -> None:
        ours = {b.data.untyped_storage().data_ptr() for b in self.buffers if b.gathered}
        for key, value in state.items():  # copies: the gathered buffers are freed now
            if torch.is_tensor(value) and value.untyped_storage().data_ptr() in ours:
                state[key] = value.clone()
        for b in self.buffers:
            b.free()
        self.whole = False

    def _before_load(self, module: nn.Module, state: dict, prefix: str, *args: Any) -> None:
        # whole values if it loads parameters (zero.py's segments come through the optimizer)
        if any(k.removeprefix(prefix) in self.param_keys for k in state):
            self.gather_all()

    def _after_load(self, module: nn.Module, incompatible: Any) -> None:
        for b in self.buffers:  # keep my shard of the whole values written
            if b.gathered:  # (a load that brought no parameters gathered nothing)
                b.local.copy_(b.data[b.rank * b.shard: (b.rank + 1) * b.shard])
            b.free()
