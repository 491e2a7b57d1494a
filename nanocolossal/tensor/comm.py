"""The collectives of tensor parallelism, as autograd functions.

A tensor-parallel layer is ordinary math on slices plus a collective wherever a full value
is needed. Each collective's backward is its *conjugate*: what the gradients need so that
every rank ends with the gradient one process would compute for its slice.

    op           forward            backward           used where
    copy_to      identity           all-reduce (sum)   a replicated input enters split math
    reduce_from  all-reduce (sum)   identity           split partial sums become replicated
    gather       all-gather (dim)   keep my slice      split -> replicated (output)
    split        keep my slice      all-gather (dim)   replicated -> split (input)
    group_sum    all-reduce (sum)   all-reduce (sum)   a replicated statistic of split values
                                                       feeds split math (LayerNorm2D)
    exchange     all-to-all         the reverse        shares change owners: tokens to their
                                    all-to-all         experts (moe/dispatch.py), heads to
                                                       their ranks (tensor/ulysses.py)
    all_gather   all-gather (dim)   reduce-scatter     a slice enters math that differs per
                                    (dim)              rank (3d: each rank its own product)
    reduce_scatter  reduce-scatter  all-gather (dim)   partial sums end as slices (3d)
                 (dim)

copy_to / reduce_from are Megatron's `f` and `g`. Why the backwards: after `copy_to`, each
rank's split math yields only its part of dL/dx, so the parts are summed. After
`reduce_from` every rank computes the same thing from the replicated sum, so each already
holds the whole dL/dy. `group_sum` feeds *split* math again, hence sums in both directions.
`exchange` moves each share to one new owner and nothing is summed: the gradient of a share
goes back to where the share came from, the same all-to-all with the split sizes swapped.
`all_gather` differs from `gather` in what follows it: after `gather` every rank computes the
same thing (its gradient is whole on each, keep my slice); after `all_gather` each rank uses the
gathered tensor in a different product, so the gradients are partial sums -- summed, then
scattered. `reduce_scatter` is its mirror.

Every op is a no-op in a group of one, so the same layer code runs unsplit.

Before a launch, `nanocolossal plan` computes these elements sent (nanocolossal/plan/traffic.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .layer_checks import check_slice

Group = Optional[dist.ProcessGroup]


def _size(group: Group) -> int:
    return 1 if group is None else dist.get_world_size(group)


# The raw collectives: called only where the group has more than one rank (the ops below check).

def _all_reduce(x: torch.Tensor, group: Group) -> torch.Tensor:
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _all_gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    parts = [part.contiguous() for part in x.chunk(_size(group), dim=dim)]
    out = torch.empty_like(parts[0])
    dist.reduce_scatter(out, parts, group=group)
    return out


def _my_slice(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    n = _size(group)
    check_slice(x.shape[dim], n)
    return x.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


def _exchange(x: torch.Tensor, group: Group, send: Optional[list[int]],
              receive: Optional[list[int]]) -> torch.Tensor:
    flat = x.contiguous().view(-1)  # split sizes count elements of this flat view
    out = flat.new_empty(flat.numel() if receive is None else sum(receive))
    dist.all_to_all_single(out, flat, receive, send, group=group)
    return out


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Conjugate(torch.autograd.Function):
    """`forward_op` along `dim` of the group forward, `backward_op` on the gradient: gather /
    split, all_gather / reduce_scatter (the table above)."""

    @staticmethod
    def forward(ctx, x, dim, group, forward_op, backward_op):
        ctx.dim = dim
        ctx.group = group
        ctx.backward_op = backward_op
        return forward_op(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return ctx.backward_op(grad, ctx.dim, ctx.group), None, None, None, None


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, send, receive):
        ctx.shape = x.shape
        ctx.group = group
        ctx.send = send
        ctx.receive = receive
        return _exchange(x, group, send, receive)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group, ctx.receive, ctx.send).view(ctx.shape), None, None, None


def copy_to(x: torch.Tensor, group: Group) -> torch.Tensor:
    """Identity forward, all-reduce backward (Megatron's f)."""
    return _CopyTo.apply(x, group) if _size(group) > 1 else x


def reduce_from(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-reduce forward, identity backward (Megatron's g)."""
    return _ReduceFrom.apply(x, group) if _size(group) > 1 else x


def group_sum(x: torch.Tensor, group: Group) -> torch.Tensor:
    """All-reduce forward and backward: a sum over slices that feeds split math again (g's
    forward, f's backward)."""
    return reduce_from(copy_to(x, group), group)


def gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """All-gather along `dim` forward; backward keeps this rank's slice of the gradient."""
    return _Conjugate.apply(x, dim, group, _all_gather, _my_slice) if _size(group) > 1 else x


def split(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """Keep this rank's slice along `dim` forward; backward all-gathers the gradient."""
    return _Conjugate.apply(x, dim, group, _my_slice, _all_gather) if _size(group) > 1 else x


def all_gather(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """All-gather along `dim` forward; backward sums the gradients and keeps my slice."""
    return _Conjugate.apply(x, dim, group, _all_gather, _reduce_scatter) if _size(group) > 1 else x


def reduce_scatter(x: torch.Tensor, dim: int, group: Group) -> torch.Tensor:
    """My slice along `dim` of the group's sum forward; backward all-gathers the gradient."""
    return _Conjugate.apply(x, dim, group, _reduce_scatter, _all_gather) if _size(group) > 1 else x


def exchange(x: torch.Tensor, group: Group, send: Optional[list[int]] = None,
             receive: Optional[list[int]] = None) -> torch.Tensor:
    """All-to-all of `x`'s elements, flattened: send[j] of them (in order) to rank j, receive[i]
    from rank i, returned flat in rank order (None: equal shares). Backward: the reverse."""
    return _Exchange.apply(x, group, send, receive) if _size(group) > 1 else x.reshape(-1)
