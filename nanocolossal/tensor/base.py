"""What every tensor-parallel layer shares: how a slice is made, and how it is marked.

Initialisation contract: a tensor-parallel layer first builds the *plain* layer, drawing
exactly the random numbers the plain layer draws, then keeps its slice (`slice_of`). Under the
same torch seed a rank's parameters are therefore exactly slices of the unsplit model, so a
checkpoint or a test can compare them, and one process and any layout start from the same weights.

Each parameter records how it was cut (`tensor_splits`, which also lets checkpoints merge
and re-split it) and how many tensor ranks hold an identical copy (`tensor_replicas`): 1 for
a true slice, T for a replicated parameter (1d LayerNorm, a row-parallel bias), q for a 2d
parameter split along the row but replicated down the column. A global gradient norm then
counts each element once: sum of (local squares / tensor_replicas) over the tensor group.

Dropout on split activations (`sharded_dropout`) needs a mask per tensor rank. Every rank is
seeded alike at launch (replicated activations must drop the same units), so split ones draw
from a second generator, seeded with this rank's place in its model replica (pipeline stage and
tensor rank): stages hold different layers, so their masks must differ too, not repeat stage
0's. The seed is fixed by the launch seed (same seed, same masks) and the generator's state is
saved with every checkpoint.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from ..context import gpc
from .layer_checks import check_slice

# How a parameter is cut: a list of (dim, axis), outermost first. Axis "tensor" splits over all
# T ranks by tensor rank (1d); on the 2d (and 2.5d) grid "col" splits over a row group by my
# column index and "row" over a column group by my row index; in the 3d cube "x", "y", "z"
# split along the cube's axes. No entry: replicated (2.5d: every grid holds the same slices).
Splits = list[tuple[int, str]]

# where tensor rank t sits along an axis, for a grid or cube of side q (t = k q^2 + row q + col
# on 2.5d's grids, k its "depth"; t = x q^2 + y q + z in the cube)
POSITION = {"tensor": lambda t, q: t, "col": lambda t, q: t % q, "row": lambda t, q: t // q % q,
            "depth": lambda t, q: t // (q * q), "x": lambda t, q: t // (q * q),
            "y": lambda t, q: t // q % q, "z": lambda t, q: t % q}


def grid_side() -> int:
    """q: the side of this job's grid (2d, 2.5d) or cube (3d); 1 otherwise."""
    return gpc.cube_dim if gpc.tensor_mode == "3d" else gpc.summa_dim


def axis_position(axis: str) -> tuple[int, int]:
    """(my position, number of parts) along an axis of the layout."""
    q = grid_side()
    parts = {"tensor": gpc.tensor_size, "depth": gpc.tensor_depth}.get(axis, q)
    return POSITION[axis](gpc.tensor_rank, q), parts


def axis_group(axis: str):
    """The group whose members hold the other parts along `axis`: along the "col" axis (my
    column index) lie the ranks of my grid row, so it is tensor_row_group, and vice versa."""
    return {"tensor": gpc.tensor_group, "col": gpc.tensor_row_group,
            "row": gpc.tensor_col_group, "depth": gpc.tensor_depth_group,
            "x": gpc.tensor_x_group, "y": gpc.tensor_y_group, "z": gpc.tensor_z_group}[axis]


def slice_of(full: torch.Tensor, splits: Splits) -> torch.Tensor:
    """This rank's slice of `full` (a plain tensor) for the given splits."""
    for dim, axis in splits:
        index, parts = axis_position(axis)
        check_slice(full.shape[dim], parts)
        full = full.chunk(parts, dim=dim)[index]
    return full


def gather_slices(local: torch.Tensor, splits: Splits) -> torch.Tensor:
    """The whole tensor from every rank's slice: slice_of's inverse (a tensor-group collective)."""
    for dim, axis in reversed(splits):
        if axis_position(axis)[1] == 1:  # (2.5d's depth 1: no group)
            continue
        group = axis_group(axis)
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        local = torch.cat(parts, dim=dim)
    return local


def keep_slice(full: torch.Tensor, splits: Splits) -> nn.Parameter:
    """A Parameter holding this rank's slice of `full`, marked with how it was cut."""
    param = nn.Parameter(slice_of(full.detach(), splits).clone())
    param.tensor_splits = list(splits)
    parts = math.prod(axis_position(axis)[1] for _, axis in splits)
    param.tensor_replicas = gpc.tensor_size // parts
    return param


def reinitialize(param: nn.Parameter, fill, **fans) -> None:
    """Refill a slice as `fill` (a Colossal-AI initializer, `fill(tensor, fan_in=, fan_out=)`)
    would fill the plain layer's whole tensor: draw the whole tensor -- every rank the same
    random numbers, as one process -- and keep this rank's slice. Filling the slice alone would
    draw other numbers and break the contract above."""
    shape = list(param.shape)
    for dim, axis in getattr(param, "tensor_splits", []):
        shape[dim] *= axis_position(axis)[1]
    full = torch.empty(shape, dtype=param.dtype, device=param.device)
    with torch.no_grad():
        fill(full, **fans)
        param.copy_(slice_of(full, getattr(param, "tensor_splits", [])))


def add_bias(y: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """y + bias in y's dtype: under autocast F.linear casts its bias with its weight, so a split
    Linear adding its bias apart must too (a half y plus an fp32 bias would be fp32)."""
    return y if bias is None else y + bias.to(y.dtype)


class PatchEmbedding(nn.Module):
    """ViT's input: cut the image into patches, project each to d dims, prepend a class token, add
    learned positions. [B, C, H, W] -> [B, 1 + (img / patch)^2, d] (the plain, unsplit layer)."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_size: int) -> None:
        super().__init__()
        if img_size % patch_size != 0:
            raise ValueError(f"image size {img_size} is not a multiple of patch size {patch_size}")
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_chans, embed_size, patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.randn(1, 1, embed_size) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, 1 + (img_size // patch_size) ** 2,
                                                  embed_size) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return embed_patches(x, self.proj.weight, self.proj.bias, self.cls_token, self.pos_embed,
                             self.patch_size)


def embed_patches(x, weight, bias, cls_token, pos_embed, patch: int) -> torch.Tensor:
    """The patch embedding's math on whatever slice of the embedding dimension the weights hold."""
    x = nn.functional.conv2d(x, weight, bias, stride=patch).flatten(2).transpose(1, 2)  # [B, N, d]
    return torch.cat([cls_token.expand(x.shape[0], -1, -1), x], dim=1) + pos_embed


def sharded_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Dropout whose mask differs between tensor ranks (the module docstring: its generator)."""
    if not training or p == 0.0:
        return x
    gen = gpc.dropout_generators.get(x.device)
    if gen is None:
        gen = torch.Generator(device=x.device)
        place = gpc.pipeline_rank * gpc.tensor_size + gpc.tensor_rank  # unique per stage x rank
        gen.manual_seed(torch.initial_seed() + 1 + place)
        gpc.dropout_generators[x.device] = gen
    return x * torch.empty_like(x).bernoulli_(1 - p, generator=gen) / (1 - p)

