"""SyncBatchNorm: batch statistics over the *global* batch, not each rank's slice.

With data parallelism each rank sees B/R samples; plain BatchNorm normalises with those few,
which is noisy (and wrong for small per-GPU batches). SyncBatchNorm gives every rank the
mean and variance of all B samples, with one all-reduce per direction.

Forward, per channel, over N = sum of all ranks' sample counts (times spatial size):

    all_reduce([sum x, sum x^2, n])  ->  mu = S1 / N,  var = S2 / N - mu^2,
                                         invstd = 1 / sqrt(var + eps)
    y = (x - mu) * invstd * w + b

That is `naive_statistics`. Its S2 / N - mu^2 subtracts two large numbers when the mean is large
next to the spread: in fp32, x ~ 1000 with variance 2.6 came out 4% off. So `statistics`, which
runs, has each rank sum S1 in float64 and send S2 = M2 + m (2 S1 - n m), the same number, from
M2, its sum of squares around its own mean m (centred: accurate in fp32); the sums and the
subtraction are float64 (2C + 1 numbers: one count).

Uneven per-rank batches are weighted correctly because counts, not means, are summed.
running_var uses the unbiased var * N / (N - 1), as BatchNorm does.

Backward. Write xhat = (x - mu) * invstd and g = dL/dy. Since mu and var depend on every
sample of every rank,

    dL/dx_i = w * invstd * ( g_i - (1/N) sum_j g_j - xhat_i * (1/N) sum_j g_j xhat_j )
            = w * invstd * ( g_i - sum_dy / N - (x_i - mu) * invstd^2 * sum_dy_xmu / N )

with sum_dy = sum_j g_j and sum_dy_xmu = sum_j g_j (x_j - mu) taken over *all* ranks: one
all_reduce([sum_dy, sum_dy_xmu]). The parameter gradients stay local,
dL/dw = sum_j g_j xhat_j = invstd * sum_dy_xmu and dL/db = sum_dy (this rank's samples only),
because DDP averages parameter gradients afterwards.

In eval mode running statistics are used and no collective runs. PyTorch's own SyncBatchNorm is
CUDA-only; this one runs on CPU/gloo and CUDA/nccl alike.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .context import gpc


def naive_statistics(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> tuple:
    """The textbook's global mean and variance per channel of x (N, C, ...): the module
    docstring's all-reduce and formula, exact in real numbers (cancelling in fp32)."""
    C = x.shape[1]
    dims = [0, *range(2, x.dim())]  # every dimension but the channels'
    stats = torch.cat([x.sum(dims), x.square().sum(dims), x.new_full((1,), x.numel() // C)])
    dist.all_reduce(stats, group=group)
    total = stats[-1]
    mean = stats[:C] / total
    var = (stats[C:2 * C] / total - mean * mean).clamp(min=0)
    return mean, var, total


def statistics(x: torch.Tensor, group: Optional[dist.ProcessGroup]) -> tuple:
    """naive_statistics, the cancellation removed (S1 and S2 from M2, in float64: the module
    docstring); (mean, var, N) in x's dtype."""
    C = x.shape[1]
    dims = [0, *range(2, x.dim())]
    shape = [1, C] + [1] * (x.dim() - 2)
    n = x.numel() // C
    s1 = x.sum(dims, dtype=torch.float64)
    m = (s1 / max(n, 1)).to(x.dtype)
    m2 = (x - m.view(shape)).square().sum(dims)
    m = m.double()
    stats = torch.cat([s1, m2.double() + m * (2 * s1 - n * m), s1.new_full((1,), float(n))])
    dist.all_reduce(stats, group=group)
    total = stats[-1]
    mean = stats[:C] / total
    var = (stats[C:2 * C] / total - mean * mean).clamp_(min=0)
    return mean.to(x.dtype), var.to(x.dtype), total.to(x.dtype)


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, group):
        shape = [1, x.shape[1]] + [1] * (x.dim() - 2)
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x  # statistics in >= fp32
        mean, var, total = statistics(xf, group)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                unbiased = var * total / (total - 1).clamp(min=1)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        y = (xf - mean.view(shape)) * invstd.view(shape)
        if weight is not None:
            y = y * weight.view(shape) + bias.view(shape)
        ctx.save_for_backward(xf, weight, mean, invstd)
        ctx.total = total
        ctx.group = group
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        xf, weight, mean, invstd = ctx.saved_tensors
        C = xf.shape[1]
        dims = [0] + list(range(2, xf.dim()))
        shape = [1, C] + [1] * (xf.dim() - 2)
        g = grad_y.to(xf.dtype)
        xmu = xf - mean.view(shape)
        sum_dy = g.sum(dims)
        sum_dy_xmu = (g * xmu).sum(dims)
        grad_weight = grad_bias = None
        if weight is not None:  # local: DDP averages parameter gradients over ranks afterwards
            need_weight = ctx.needs_input_grad[1]
            grad_weight = (sum_dy_xmu * invstd).to(weight.dtype) if need_weight else None
            grad_bias = sum_dy.to(weight.dtype) if ctx.needs_input_grad[2] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            sums = torch.cat([sum_dy, sum_dy_xmu])
            dist.all_reduce(sums, group=ctx.group)
            mean_dy, mean_dy_xmu = (sums / ctx.total).split(C)
            scale = invstd if weight is None else invstd * weight.to(xf.dtype)
            centred = g - mean_dy.view(shape) - xmu * (invstd * invstd * mean_dy_xmu).view(shape)
            grad_x = (centred * scale.view(shape)).to(grad_y.dtype)
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """BatchNorm1d/2d/3d whose training statistics span the data-parallel group."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1,
                 affine: bool = True, track_running_stats: bool = True,
                 process_group: Optional[dist.ProcessGroup] = None,
                 device=None, dtype=None) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device,
                         dtype=dtype)
        self.process_group = process_group

    def _check_input_dim(self, x: torch.Tensor) -> None:
        if x.dim() < 2:
            raise ValueError(f"[rank {gpc.rank}] SyncBatchNorm expects (N, C, ...) input, got "
                             f"shape {tuple(x.shape)}")

    def _group(self) -> Optional[dist.ProcessGroup]:
        """The group to synchronise over, or None when alone (then plain batch norm is exact)."""
        if not gpc.is_initialized and self.process_group is None:
            return None
        group = self.process_group if self.process_group is not None else gpc.gradient_group
        return group if dist.get_world_size(group) > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if x.shape[1] != self.num_features:
            raise ValueError(f"[rank {gpc.rank}] SyncBatchNorm({self.num_features}) got "
                             f"{x.shape[1]} channels")
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            cumulative = 1.0 / float(self.num_batches_tracked)  # momentum=None: a plain average
            factor = cumulative if self.momentum is None else self.momentum
        use_batch_stats = self.training or self.running_mean is None
        running_mean = self.running_mean if not self.training or self.track_running_stats else None
        running_var = self.running_var if not self.training or self.track_running_stats else None
        group = self._group() if self.training else None  # eval: no collective, ever
        if group is None:
            return F.batch_norm(x, running_mean, running_var, self.weight, self.bias,
                                use_batch_stats, factor, self.eps)
        return _SyncBatchNormFunction.apply(x, self.weight, self.bias, running_mean, running_var,
                                            self.eps, factor, group)


def convert_sync_batchnorm(module: nn.Module,
                           process_group: Optional[dist.ProcessGroup] = None) -> nn.Module:
    """Each BatchNorm*d in `module` replaced by a SyncBatchNorm with its weights and statistics."""
    converted = module
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        converted = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                                  module.track_running_stats, process_group)
        if module.affine:
            converted.weight = module.weight
            converted.bias = module.bias
        if module.track_running_stats:
            converted.running_mean = module.running_mean
            converted.running_var = module.running_var
            converted.num_batches_tracked = module.num_batches_tracked
        converted.train(module.training)
        if hasattr(module, "qconfig"):
            converted.qconfig = module.qconfig
    for name, child in module.named_children():
        converted.add_module(name, convert_sync_batchnorm(child, process_group))
    return converted
