"""What Colossal-AI's layer classes take beyond our layers' own arguments, done once for all.

Colossal-AI's layers (colossal_1d.py, colossal_2d.py) are our tensor-parallel layers under
Colossal-AI's names and constructor arguments. Most of those arguments mean the same thing in
every class, so they are honoured here:

    weight_initializer, bias_initializer   Colossal-AI's nn.init callables,
        init(tensor, fan_in=..., fan_out=...). Applied to the *whole* plain tensor, then sliced
        (tensor/base.py `reinitialize`), so a shard is still exactly the slice of the plain
        layer initialised the same way under the same seed. Not given: the plain torch layer's
        own initialisation, as every nanocolossal layer (Colossal-AI's defaults differ).
    dtype                                  the parameters' dtype, cast after initialisation (the
        plain layer's float32 draws, then `.to(dtype)`, as `plain.to(dtype)` would).
    F.embedding's *args/**kwargs           accepted at their defaults; max_norm renormalises a
        row whose norm spans tensor ranks, and the others change the gradient's form or scale
        per rank, so a non-default value is an error naming it.

Colossal-AI also keeps one piece of global state, "is the next layer's input split?" (its
`set_parallel_input`): a column-parallel Linear sets it, the layers that produce a whole
activation clear it, and Dropout1D reads it. That is the same state nc.nn.Linear alternates on
(nn/layers.py set_1d_input_is_split), so the two kinds of layer can be mixed in one model.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from ..context import gpc
from ..nn import layers
from ..tensor.base import reinitialize

Initializer = Callable[..., Any]  # Colossal-AI's: init(tensor, fan_in=None, fan_out=None)


def require_mode(name: str, mode: str, layout_a: bool = False) -> None:
    """A 1d class under mode '2d' (or the reverse) would cut activations the other mode's way.
    `layout_a`: the layer takes 3d's layout A (LayerNorm, classifiers), which it must not be
    built to take after a column Linear (nn/layers.py check_3d_layout)."""
    if gpc.tensor_mode not in (None, mode):
        raise ValueError(f"[rank {gpc.rank}] {name} is a {mode} layer, but parallel.tensor.mode "
                         f"is {gpc.tensor_mode!r}; use the {gpc.tensor_mode} class, or nc.nn's "
                         f"layer of the same meaning, which follows the mode")
    if layout_a:
        layers.check_3d_layout(name, layers._state["next_is_row"])


def in_mode(base: type, name: str, mode: str, doc: str) -> type:
    """Colossal-AI's class `name`: the class `base` (its arguments handled alike) under `mode`,
    belonging to the module that calls this (as collections.namedtuple's classes do)."""
    module = sys._getframe(1).f_globals.get("__name__", base.__module__)
    return type(name, (base,), {"MODE": mode, "__doc__": doc, "__module__": module})


def check_skip_bias_add(name: str, skip_bias_add: bool, bias: bool) -> None:
    if skip_bias_add and not bias:
        raise ValueError(f"[rank {gpc.rank}] {name}(skip_bias_add=True) needs a bias to hand "
                         f"back; pass bias=True or skip_bias_add=False")


def initialise(layer: nn.Module, inits: Iterable[tuple],
               dtype: Optional[torch.dtype] = None) -> None:
    """Refill each (parameter, initializer, fans) whose both are given, then cast to dtype.
    Fans are Colossal-AI's: the plain layer's (in_features, out_features), never a shard's."""
    for param, init, fans in inits:
        if param is not None and init is not None:
            reinitialize(param, init, **fans)
    if dtype is not None:
        layer.to(dtype)  # keeps each Parameter object (and its tensor_splits), new data


def with_padding_zeroed(init: Optional[Initializer],
                        padding_idx: Optional[int]) -> Optional[Initializer]:
    """An embedding's initializer followed by zeroing the padding row (of the whole table), as
    torch's and Colossal-AI's embeddings do after initialising."""
    if init is None or padding_idx is None:
        return init

    def fill(tensor: torch.Tensor, **fans) -> None:
        init(tensor, **fans)
        tensor[padding_idx].zero_()
    return fill


_EMBEDDING_DEFAULTS = {"max_norm": None, "norm_type": 2.0, "scale_grad_by_freq": False,
                       "sparse": False}


def check_embedding_extras(name: str, args: tuple, kwargs: dict) -> None:
    """Colossal-AI passes these on to F.embedding; we take them only at their defaults."""
    if len(args) > len(_EMBEDDING_DEFAULTS):
        raise TypeError(f"[rank {gpc.rank}] {name} got {len(args)} extra positional arguments; "
                        f"F.embedding takes at most {len(_EMBEDDING_DEFAULTS)}")
    given = dict(zip(_EMBEDDING_DEFAULTS, args)) | kwargs
    for key, value in given.items():
        if key not in _EMBEDDING_DEFAULTS:
            raise TypeError(f"[rank {gpc.rank}] {name} got an unexpected argument {key!r}")
        if value != _EMBEDDING_DEFAULTS[key]:
            raise ValueError(f"[rank {gpc.rank}] {name}({key}={value!r}) is not supported: the "
                             f"table is split over tensor ranks, so a row's norm or an id's "
                             f"count is not one rank's to take; leave {key} at "
                             f"{_EMBEDDING_DEFAULTS[key]!r}")

