"""SUMMA: a matrix product on a q x q grid of processes (Colossal-AI's 2D tensor parallelism).

Y = X W with X [batch, in] and W [in, out] both cut into q x q tiles. Rank (i, j) of the
grid holds X_ij (batch share i, hidden slice j) and W_ij (in slice i, out slice j), and must
end with Y_ij = sum_k X_ik W_kj. No rank holds a whole row of X or column of W, so the sum
is built in q steps; in step k the owners broadcast the k-th panels:

    step k:  X_ik  from rank (i, k) to its row     (row group i)
             W_kj  from rank (k, j) to its column  (column group j)
             Y_ij += X_ik @ W_kj

      q = 2, step k = 0:       W_00 W_01  <- row 0 of W's tiles goes down the columns
                               .    .
                X_00 -> (0,0)  (0,1)      X_00 goes along row 0; X_10 along row 1
                X_10 -> (1,0)  (1,1)

Backward is two more SUMMA products, each a broadcast then a *reduce* to the owner:

    dX_ik = sum_j dY_ij W_kj^T   step k: broadcast W_kj down column j; each (i, j) forms
                                 dY_ij W_kj^T and the row group sums it onto (i, k)
    dW_kj = sum_i X_ik^T dY_ij   step k: broadcast X_ik along row i; each (i, j) forms
                                 X_ik^T dY_ij and the column group sums it onto (k, j)

Per layer and step each rank moves panels of size |X|/q^2 and |W|/q^2, q times: words sent
per rank per matmul ~ (|X| + |W|) / q, against 1d's all-reduce of the whole activation.
Weights are stored in torch's [out, in] layout, so W_kj above is `w.t()` of rank (k, j).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..context import gpc


def panel(mine: torch.Tensor, owner: int, group: dist.ProcessGroup,
           ranks: list[int]) -> torch.Tensor:
    """The owner's tile (position `owner` in the group), received by every member.

    A broadcast moves raw bytes: the owner sends its tile in contiguous order, so receivers
    must receive into a contiguous buffer too. (`empty_like` would copy the strides of a view
    such as `w.t()`, and the bytes would land transposed.)"""
    if dist.get_rank(group) == owner:
        buf = mine.contiguous()
    else:
        buf = torch.empty_like(mine, memory_format=torch.contiguous_format)
    dist.broadcast(buf, src=ranks[owner], group=group)
    return buf


def reduce_to(partial: torch.Tensor, owner: int, group: dist.ProcessGroup,
               ranks: list[int]) -> torch.Tensor:
    """Sum of every member's `partial`, valid on the member at position `owner`."""
    partial = partial.contiguous()
    dist.reduce(partial, dst=ranks[owner], group=group)
    return partial


class _Summa(torch.autograd.Function):
    """Y = X @ W^T on the grid; x [b, in/q], w [out/q, in/q] (this rank's tiles)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        rows, cols = gpc.tensor_row_group, gpc.tensor_col_group
        y = x.new_zeros(x.shape[0], w.shape[0])
        for k in range(gpc.summa_dim):
            x_ik = panel(x, k, rows, gpc.tensor_row_ranks)
            w_kj = panel(w, k, cols, gpc.tensor_col_ranks)
            y += x_ik @ w_kj.t()
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w = ctx.saved_tensors
        rows, cols = gpc.tensor_row_group, gpc.tensor_col_group
        dy = dy.contiguous()
        dx, dw = torch.empty_like(x), torch.empty_like(w)
        for k in range(gpc.summa_dim):
            w_kj = panel(w, k, cols, gpc.tensor_col_ranks)
            total = reduce_to(dy @ w_kj, k, rows, gpc.tensor_row_ranks)      # -> dX_ik on (i, k)
            if gpc.grid_col == k:  # I am (i, k)
                dx = total
            x_ik = panel(x, k, rows, gpc.tensor_row_ranks)
            total = reduce_to(dy.t() @ x_ik, k, cols, gpc.tensor_col_ranks)  # -> dW_kj on (k, j)
            if gpc.grid_row == k:  # I am (k, j)
                dw = total
        return dx, dw


def autocast_operands(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both operands in autocast's dtype when it is on, cast differentiably before a custom
    Function: autocast does not reach inside one, and its backward runs outside autocast."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        return x.to(dtype), w.to(dtype)
    return x, w


def summa_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [..., in/q] @ w[out/q, in/q]^T on the 2d grid -> [..., out/q]."""
    lead = x.shape[:-1]
    x, w = autocast_operands(x, w)
    return _Summa.apply(x.reshape(-1, x.shape[-1]), w).reshape(*lead, w.shape[0])
