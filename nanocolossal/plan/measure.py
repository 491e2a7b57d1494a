"""A model the planner cannot describe is measured, not guessed.

    nanocolossal plan --model mymodels:build --input 32x3x224x224 --world 8 --memory 24GiB

`--model MODULE:FUNCTION` names a function returning the nn.Module (imported from the current
folder); `--input` the shape of one micro-batch on one rank (`x` between sizes; `:int64` for
token ids). The model is built on the meta device -- tensors with shapes and no data: no memory,
no compute -- and one forward and backward of that micro-batch run there:

    parameters   each with its elements, its ZeRO-3 unit (zero/sharded_model.py's plan_units on
                 the same model) and whether O2 keeps it fp32 (amp_casts.py's is_norm); the
                 buffers (BatchNorm's statistics) and frozen parameters, whole on every rank,
                 counted with the parameters; one the loss does not reach is refused
    activations  the bytes autograd keeps for backward at the forward's peak (memory.py's
                 SavedBytes, the instrument the tests measure live runs with)
    output       the bytes of what the model returns (the logits, for a classifier)

Then the layout formulas of formulas.py and traffic.py on top: data parallel, ZeRO 1-3, offload,
accumulation, AMP's masters and clipping. How a custom model splits over pipeline or tensor
ranks is its own code, so only data-parallel layouts are planned; activations are measured in
the model's dtype (autocast's casts are not run). The rest of the plan's "not modelled" holds.
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..amp_casts import is_norm
from ..config import ConfigError
from ..memory import SavedBytes
from ..zero.sharded_model import plan_units
from .formulas import COLLECTIVES, Layout, model_states
from .layouts import load
from .model import Tensor
from .ranks import Rank
from .traffic import data_parallel_traffic


@dataclass(frozen=True)
class Measured:
    """What one micro-batch of a custom model holds, measured on the meta device."""
    name: str
    tensors: tuple[Tensor, ...]
    param_bytes: int
    buffers: int  # BatchNorm's statistics, frozen parameters: bytes, whole on every rank
    buffer_elements: int
    activations: int
    output: int
    shape: tuple[int, ...]

    def describe(self) -> str:
        psi = sum(t.numel for t in self.tensors)
        return (f"model: {self.name}, {psi:,} parameters, measured on the meta device with a "
                f"micro-batch of {'x'.join(map(str, self.shape))}")


def import_builder(spec: str) -> Callable[[], nn.Module]:
    """'package.module:function' -> the function (the current folder importable)."""
    module, _, function = spec.partition(":")
    if not module or not function:
        raise ConfigError(f"--model {spec!r}: write MODULE:FUNCTION, e.g. mymodels:build")
    sys.path.insert(0, str(Path.cwd()))
    try:
        return getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"--model {spec!r}: {e}") from None


def parse_input(text: str) -> tuple[tuple[int, ...], torch.dtype]:
    """'32x3x224x224' -> ((32, 3, 224, 224), float32); '8x1024:int64' -> token ids."""
    shape, _, dtype = text.partition(":")
    try:
        sizes = tuple(int(s) for s in shape.lower().split("x"))
        kind = getattr(torch, dtype or "float32")
        assert isinstance(kind, torch.dtype) and all(s > 0 for s in sizes)
    except (ValueError, AttributeError, AssertionError):
        raise ConfigError(f"--input {text!r}: write sizes between x and an optional dtype, e.g. "
                          f"32x3x224x224 or 8x1024:int64") from None
    return sizes, kind


def measure(build: Callable[[], nn.Module], shape: tuple[int, ...], dtype: torch.dtype,
            name: str = "model") -> Measured:
    """Build on the meta device, run one forward and backward of a micro-batch of `shape`."""
    with torch.device("meta"):
        model = build()
    params = list(model.parameters())
    units, unit_of = plan_units(model, params)
    kept_fp32 = {id(p) for m in model.modules() if is_norm(m) for p in m.parameters(False)}
    tensors = tuple(Tensor(n, p.numel(), 0, str(unit_of[id(p)]), False, id(p) in kept_fp32)
                    for n, p in model.named_parameters() if p.requires_grad)
    x = torch.zeros(shape, dtype=dtype, device="meta")
    with SavedBytes(params) as saved:
        out = model(x)
    out = out[0] if isinstance(out, (tuple, list)) else out
    out.float().sum().backward()
    check_all_used(model)
    param_bytes = params[0].element_size() if params else 4
    frozen = [p for p in params if not p.requires_grad]  # whole on every rank, nothing more
    held = [*model.buffers(), *frozen]
    buffers = sum(b.numel() * b.element_size() for b in held)
    buffer_elements = sum(b.numel() for b in model.buffers())
    return Measured(name, tensors, param_bytes, buffers, buffer_elements, saved.peak,
                    out.numel() * out.element_size(), shape)


def check_all_used(model: nn.Module) -> None:
    """A trainable parameter the backward did not reach: its plan would depend on what DDP and
    ZeRO do with it (a bucket's flag, a unit never gathered), which the planner does not count."""
    unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    if unused:
        raise ConfigError(f"--model: {', '.join(unused[:3])} get no gradient in a forward and "
                          f"backward; the planner counts parameters the loss reaches, and frozen "
                          f"ones (requires_grad=False): freeze or remove the unused ones")


def load_measured(spec: str, shape_text: str, config: Any, world: int,
                  **overrides: Any) -> tuple[Measured, Layout]:
    """(measured model, its layout) for `--model SPEC --input SHAPE [--config F]`: the config's
    zero, fp16, gradient_accumulation, clip_grad_norm and OPTIMIZER, on `world` data ranks."""
    _, lay = load(config or {}, world, **overrides)
    if lay.pipeline > 1 or lay.tensor > 1:
        raise ConfigError("a custom model (--model) is planned data-parallel only: how it splits "
                          "over pipeline or tensor ranks is its own code; leave parallel out")
    shape, dtype = parse_input(shape_text)
    m = measure(import_builder(spec), shape, dtype, spec)
    return m, replace(lay, batch=shape[0] * lay.accumulation, param_bytes=m.param_bytes,
                      checkpoint=None)


def search_measured(base: Layout) -> Iterator[Layout]:
    """The data-parallel layouts of the same ranks: ZeRO 0-3, with and without offload."""
    for zero in (0, 1, 2, 3):
        for offload in ((False, True) if zero else (False,)):
            if base.data > 1 or not zero:
                yield replace(base, zero=zero, offload=offload)


def plan_measured(m: Measured, lay: Layout) -> list[Rank]:
    """The one rank kind of a data-parallel layout: bytes, elements per step, no bubble."""
    ts = m.tensors
    b = model_states(ts, lay)
    b["parameters"] += m.buffers
    b["activations"] = m.activations
    b["logits"] = m.output
    b["routing"] = 0
    b["total"] = sum(v for k, v in b.items() if k != "cpu")
    elements = dict.fromkeys(COLLECTIVES, 0)
    elements.update(data_parallel_traffic(ts, lay, buffers=m.buffer_elements))
    return [Rank("every rank", 0, b, elements, 0.0)]
