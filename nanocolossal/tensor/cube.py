"""3d tensor parallelism (Bian et al. 2021, Colossal-AI's Linear3D): a matrix product on a cube.

T = q^3 ranks form a q x q x q cube; rank (x, y, z) has tensor_rank = x q^2 + y q + z. For
Y = X W^T (X [M, K] activations, W [N, K] in torch's layout), the tiled product

    Y_(x, y) = sum_z X_(x, z) W_(y, z)^T        (M in q slices by x, K by z, N by y)

puts the term for (x, y, z) on rank (x, y, z): each rank multiplies one pair of tiles and the
z axis sums them. Nobody stores a whole tile: X_(x, z) is cut in q slices along M over the y
axis, W_(y, z) in q slices along K over the x axis, so every rank holds 1/q^3 of X, W and Y:

    step                           collective            along   elements per rank
    X_(x, z)  from its q slices    all-gather (dim M)    y       M K / q^2
    W_(y, z)  from its q slices    all-gather (dim K)    x       N K / q^2
    P = X_(x, z) W_(y, z)^T        local                         M N K / q^3 flops
    Y_(x, y) slice z = sum_z P     reduce-scatter (dim M) z      M N / q^2

Backward runs the conjugates (tensor/comm.py): dY gathered along z, dX = dY W reduce-scattered
along y, dW = dY^T X reduce-scattered along x: the same three sizes again. Per Linear and rank:
weights N K / q^3, activations (M K + M N) / q^3, 2 (M K + N K + M N) / q^2 elements to
collectives (the paper's O(1 / q^2), against SUMMA's O(1 / q)).

Two layouts of a [batch, ..., hidden] activation follow, each split over two axes:

    layout A  batch in q^2 shares over (x, y) -- share x q + y -- hidden in q over z
    layout B  batch in q^2 shares over (x, z) -- share x q + z -- hidden in q over y

The product above takes A to B (all-gather over y, reduce-scatter over z: a "column" Linear);
with y and z swapped it takes B back to A (a "row" Linear), its weight [N over z, K over (y,
then x)]. A transformer's pairs (qkv and output projection, the MLP's two Linears) therefore
start and end in layout A, where LayerNorm, embeddings and residuals live; attention runs on
layout B, heads split over y.

      q = 2, layout A of X [M, K]:          W [N, K] of a column Linear:
               K slice z=0  z=1                       K slice z=0       z=1
      M  x=0 y=0  (0,0,0)  (0,0,1)            N  y=0  (0,0,0)(1,0,0)  (0,0,1)(1,0,1)
         x=0 y=1  (0,1,0)  (0,1,1)               y=1  (0,1,0)(1,1,0)  (0,1,1)(1,1,1)
         x=1 y=0  (1,0,0)  (1,0,1)            (each K slice of z cut again in two by x)
         x=1 y=1  (1,1,0)  (1,1,1)
"""
from __future__ import annotations

import torch
from torch.nn import functional as F

from ..context import gpc
from .comm import Group, all_gather, reduce_scatter
from .summa import autocast_operands

# How a Linear's weight [N, K] is cut (tensor_splits): a column one's N over y, K over z and
# then x; a row one's N over z, K over y and then x.
COLUMN_SPLITS = [(0, "y"), (1, "z"), (1, "x")]
ROW_SPLITS = [(0, "z"), (1, "y"), (1, "x")]


def cube_matmul(x: torch.Tensor, w: torch.Tensor, gather: Group, scatter: Group) -> torch.Tensor:
    """x [M/q^2, ..., K/q] @ w [N/q, K/q^2]^T on the cube -> [M/q^2, ..., N/q]: the input's
    batch shares gathered over `gather`, the weight's slices over the x axis, the partial
    products summed and scattered by batch over `scatter` (autograd gives the backward above)."""
    x, w = autocast_operands(x, w)
    x_tile = all_gather(x, 0, gather)              # X_(x, z): my batch share x, hidden z
    w_tile = all_gather(w, 1, gpc.tensor_x_group)  # W_(y, z): whole along K's slice
    return reduce_scatter(F.linear(x_tile, w_tile), 0, scatter)


def column_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Layout A -> layout B."""
    return cube_matmul(x, w, gpc.tensor_y_group, gpc.tensor_z_group)


def row_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Layout B -> layout A."""
    return cube_matmul(x, w, gpc.tensor_z_group, gpc.tensor_y_group)
