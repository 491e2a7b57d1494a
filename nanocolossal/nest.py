"""Walk nested batches: apply a function to every tensor in a tensor/list/tuple/dict structure.

Batches and model outputs come as tensors, (inputs, label) tuples or dicts of tensors;
moving them to a device (engine) and casting their floats (amp) are the same walk.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """`obj` with each tensor t replaced by fn(t); containers keep their type, other leaves stay."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a namedtuple takes its fields
        return type(obj)(*(map_tensors(fn, o) for o in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, o) for o in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    return obj
