"""How mixed precision changes a model: hooks that cast, registered by amp.initialize.

    O1     autocast entered before the model's forward and left after it (`Autocast`); the
           output upcast to fp32 where it is the model's (the loss is computed in fp32)
    O2/O3  the model cast to half; each module's floating inputs cast to its dtype on the way
           in, the model's output to fp32 on the way out (`cast_io`); under O2 normalisation
           layers stay fp32, their inputs cast up and outputs back down
    loss   under the Engine at O1, the criterion runs under autocast too (`autocast_loss`)

A module can be hooked twice (a criterion two engines share, a model given to amp.initialize
twice): each autocast its hooks enter goes on one stack on the module, left innermost first.
"""
from __future__ import annotations

from functools import wraps
from typing import Any, Callable, Optional

import torch
from torch import nn

from .nest import map_tensors


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor in a (nested) tensor/list/tuple/dict."""
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, obj)


def _upcast_halves(obj: Any) -> Any:
    """fp16/bf16 tensors to fp32 (autocast leaves a float64 model in float64: so do we)."""
    halves = (torch.float16, torch.bfloat16)
    return map_tensors(lambda t: t.float() if t.dtype in halves else t, obj)


def is_norm(module: nn.Module) -> bool:
    """torch's normalisation layers, and ours that say they are one (tensor/layers_2d.py)."""
    return (isinstance(module, (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm))
            or getattr(module, "is_normalization", False))


def cast_io(module: nn.Module, input_dtype: torch.dtype,
             output_dtype: Optional[torch.dtype]) -> None:
    """Hooks that cast a module's floating inputs and outputs (None: outputs as they are)."""
    module.register_forward_pre_hook(lambda m, args: _cast_floats(args, input_dtype))
    if output_dtype is not None:
        module.register_forward_hook(lambda m, args, out: _cast_floats(out, output_dtype))


class Autocast:
    """Enter autocast before the model's forward and leave it after (even if forward raises)."""

    def __init__(self, device_type: str, dtype: torch.dtype, output_fp32: bool = True) -> None:
        self.device_type, self.dtype = device_type, dtype
        self.output_fp32 = output_fp32

    def enter(self, module, args) -> None:
        ctx = torch.autocast(self.device_type, dtype=self.dtype)
        ctx.__enter__()
        _entered(module).append(ctx)

    def exit(self, module, args, output) -> Any:
        # the innermost autocast first, whichever hook entered it: a module hooked twice (a
        # criterion or model passed to two initialize calls) runs its exit hooks in the order of
        # its enter hooks, and leaving the outer autocast first would leave autocast on after
        # the forward (each restores the state it found)
        _entered(module).pop().__exit__(None, None, None)
        return _upcast_halves(output) if self.output_fp32 else output


def _entered(module: nn.Module) -> list:
    """The autocasts that the module's hooks entered and did not leave yet, innermost last."""
    return module.__dict__.setdefault("_amp_autocasts", [])


def autocast_loss(criterion: Callable, device_type: str, dtype: torch.dtype) -> Callable:
    """The criterion run under autocast, its loss returned in fp32 (O1 under the Engine, whose
    model output then stays as autocast made it). A module keeps its identity (hooks, as the
    model's): the features that read its reduction or ignore_index still find them."""
    autocast = Autocast(device_type, dtype, output_fp32=True)
    if isinstance(criterion, nn.Module):
        criterion.register_forward_pre_hook(autocast.enter)
        criterion.register_forward_hook(autocast.exit, always_call=True)
        return criterion

    @wraps(criterion)
    def under_autocast(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            loss = criterion(*args, **kwargs)
        return _upcast_halves(loss)
    return under_autocast
