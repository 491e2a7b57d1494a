"""How mixed precision changes a model: hooks that cast, registered by amp.initialize.

    O1     autocast entered before the model's forward and left after it (`hook_autocast`); the
           output upcast to fp32 where it is the model's (the loss is computed in fp32)
    O2/O3  the model cast to half; each module's floating inputs cast to its dtype on the way
           in, the model's output to fp32 on the way out (`cast_io`); under O2 normalisation
           layers stay fp32, their inputs cast up and outputs back down
    loss   under the Engine at O1, the criterion runs under autocast too (`autocast_loss`)

A module can be hooked twice (a criterion two engines share, a model given to amp.initialize
twice): each autocast its hooks enter goes on one stack on the module, left innermost first --
its exit hooks run in the order of its enter hooks, and leaving the outer autocast first would
leave autocast on after the forward (each restores the state it found).
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


def cast_io(module: nn.Module, inputs: torch.dtype, outputs: Optional[torch.dtype]) -> None:
    """Hooks that cast a module's floating inputs and outputs (None: outputs as they are)."""
    module.register_forward_pre_hook(lambda m, args: _cast_floats(args, inputs))
    if outputs is not None:
        module.register_forward_hook(lambda m, args, out: _cast_floats(out, outputs))


def cast_to_half(model: nn.Module, dtype: torch.dtype, keep_norms: bool, output_fp32: bool) -> None:
    """O2/O3: the model in `dtype`, its inputs cast down, its output up (if it is the model's);
    `keep_norms`: normalisation statistics need fp32's precision."""
    model.to(dtype)
    if keep_norms:
        for module in model.modules():
            if is_norm(module):
                module.float()
                cast_io(module, torch.float32, dtype)
    cast_io(model, dtype, torch.float32 if output_fp32 else None)


def hook_autocast(module: nn.Module, device_type: str, dtype: torch.dtype,
                  output_fp32: bool) -> None:
    """O1: the forward runs under autocast (left even if it raises), its output upcast if asked."""
    entered = module.__dict__.setdefault("_amp_autocasts", [])  # one stack per module

    def enter(module: nn.Module, args: Any) -> None:
        autocast = torch.autocast(device_type, dtype=dtype)
        autocast.__enter__()
        entered.append(autocast)

    def leave(module: nn.Module, args: Any, output: Any) -> Any:
        entered.pop().__exit__(None, None, None)  # the innermost first (the module docstring)
        return _upcast_halves(output) if output_fp32 else output
    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)


def autocast_loss(criterion: Callable, device_type: str, dtype: torch.dtype) -> Callable:
    """The criterion run under autocast, its loss returned in fp32 (O1 under the Engine)."""
    if not isinstance(criterion, nn.Module):
        return _autocast_function(criterion, device_type, dtype)
    # hooks: a module keeps its identity (features read its reduction or ignore_index)
    hook_autocast(criterion, device_type, dtype, output_fp32=True)
    return criterion


def _autocast_function(criterion: Callable, device_type: str, dtype: torch.dtype) -> Callable:
    """autocast_loss for a criterion that is a plain function: a wrapper."""

    @wraps(criterion)
    def under_autocast(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            loss = criterion(*args, **kwargs)
        return _upcast_halves(loss)
    return under_autocast
