"""Vocabulary-parallel layers (1d): a language model's largest matrix, split by vocabulary.

A GPT's token embedding E [V, d] is usually also its output classifier (tied weights), and with
a vocabulary of 50k its logits [b, s, V] are the largest activation of the model. Split E by rows
over T tensor ranks: rank j holds the tokens [j*V/T, (j+1)*V/T).

    embedding   ids (the same on every rank) -> rank j looks up the ids in its range and zeros
                the rest -> all-reduce (sum): every id is found on exactly one rank
    classifier  h (replicated) @ E_j^T -> logits_j [b, s, V/T]: the logits stay split
    loss        loss = log(sum_v exp z_v) - z_target, from three reductions over the group,
                never gathering the logits:
                    m   = max over all ranks of max(z_j)          all-reduce MAX (stability)
                    S   = sum over ranks of sum(exp(z_j - m))     all-reduce SUM  } one message
                    z_t = the target's logit, on the rank that has it, 0 elsewhere } of two
                    loss = log S - (z_t - m)
                backward needs no communication: dz_j = softmax_j - onehot_j (times dloss),
                with softmax_j = exp(z_j - m) / S on the rank's own slice.

Per rank the logits take b*s*V/T elements instead of b*s*V, and the loss's traffic is three
numbers per token. The classifier may be given the embedding's weight (`weight=`): both split
the same rows, so the tied matrix is one Parameter on each rank.

Before a launch, `nanocolossal plan` computes these per-rank shapes (nanocolossal/plan/model.py).
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ..context import gpc
from ..loss_weights import mean_over
from .base import keep_slice
from .comm import copy_to, reduce_from
from .layer_checks import check_divisible, check_ids, check_vocab_loss, tied


def look_up_slice(ids: torch.Tensor, table: torch.Tensor, start: int, end: int,
                  padding_idx: Optional[int], vocab_size: int) -> torch.Tensor:
    """The rows of `table` (the vocabulary slice [start, end)) for the ids in it, zeros for the
    others: summed over the ranks holding the other slices, every id is found exactly once."""
    outside = (ids < start) | (ids >= end)
    local = (ids - start).masked_fill(outside, 0)  # any valid row; zeroed below
    local_pad = None  # the padding row's index here, if this slice holds it
    if padding_idx is not None and start <= padding_idx % vocab_size < end:
        local_pad = padding_idx % vocab_size - start  # negative counts from the end, as torch's
    return F.embedding(local, table, padding_idx=local_pad).masked_fill(outside.unsqueeze(-1), 0.0)


def vocab_range(vocab_size: int) -> tuple[int, int]:
    """[start, end) of the token ids this tensor rank holds."""
    per_rank = vocab_size // gpc.tensor_size
    return gpc.tensor_rank * per_rank, (gpc.tensor_rank + 1) * per_rank


class VocabParallelEmbedding1D(nn.Module):
    """Embedding rows split by vocabulary; ids and output replicated."""

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 padding_idx: Optional[int] = None) -> None:
        super().__init__()
        check_divisible(num_embeddings, gpc.tensor_size, "vocabulary size")
        full = nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx)
        self.weight = keep_slice(full.weight, [(0, "tensor")])
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.start, self.end = vocab_range(num_embeddings)
        self.padding_idx = padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        check_ids(ids, self.num_embeddings, "token ids")
        found = look_up_slice(ids, self.weight, self.start, self.end, self.padding_idx,
                              self.num_embeddings)
        return reduce_from(found, gpc.tensor_group)


def vocab_parallel_argmax(logits: torch.Tensor, group, rank: int) -> torch.Tensor:
    """argmax over the whole vocabulary of logits split by it (rank `rank` of `group` holds the
    slice starting at rank x its width): the group's largest value, and of the ranks holding
    it the lowest id -- torch.argmax's first maximum. Two small all-reduces, no gather."""
    value, index = logits.max(dim=-1)
    best = value.clone()
    dist.all_reduce(best, op=dist.ReduceOp.MAX, group=group)
    ids = torch.where(value == best, index + rank * logits.shape[-1], torch.iinfo(index.dtype).max)
    dist.all_reduce(ids, op=dist.ReduceOp.MIN, group=group)
    return ids


class VocabParallelClassifier1D(nn.Module):
    """logits_j = h E_j^T (+ b_j): the vocabulary split, the input replicated. `weight` ties it to
    a VocabParallelEmbedding1D's table."""

    def __init__(self, in_features: int, num_classes: int, bias: bool = True,
                 weight: Optional[nn.Parameter] = None) -> None:
        super().__init__()
        check_divisible(num_classes, gpc.tensor_size, "vocabulary size")
        full = nn.Linear(in_features, num_classes, bias=bias)  # the plain layer's draws
        self.weight = tied(keep_slice(full.weight, [(0, "tensor")]), weight,
                           "by vocabulary rows (VocabParallelEmbedding)", in_features, num_classes)
        self.bias = keep_slice(full.bias, [(0, "tensor")]) if bias else None
        self.in_features, self.num_classes = in_features, num_classes

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to(h, gpc.tensor_group), self.weight, self.bias)

    def predictions(self, logits: torch.Tensor) -> torch.Tensor:
        """The predicted class of each row of this layer's split logits (for metrics)."""
        return vocab_parallel_argmax(logits, gpc.tensor_group, gpc.tensor_rank)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token loss from vocabulary-split logits (see the module docstring)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, start: int, group) -> torch.Tensor:
        z = logits if logits.dtype == torch.float64 else logits.float()  # half: sum in fp32
        m = z.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z = z - m.unsqueeze(-1)
        mine = (target >= start) & (target < start + z.shape[-1])
        local = (target - start).masked_fill(~mine, 0)
        z_target = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        exp = z.exp()
        sums = torch.stack([exp.sum(dim=-1), z_target])  # S and z_t travel in one message
        dist.all_reduce(sums, group=group)
        ctx.save_for_backward(exp.div_(sums[0].unsqueeze(-1)), mine, local)
        ctx.dtype = logits.dtype
        return sums[0].log() - sums[1]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        softmax, mine, local = ctx.saved_tensors
        onehot = torch.zeros_like(softmax).scatter_(-1, local.unsqueeze(-1),
                                                    mine.unsqueeze(-1).to(softmax.dtype))
        return ((softmax - onehot) * grad.unsqueeze(-1)).to(ctx.dtype), None, None, None


def reduce_losses(losses: torch.Tensor, valid: torch.Tensor, reduction: Union[str, bool],
                  weights: Optional[torch.Tensor] = None, batch_group=None) -> torch.Tensor:
    """F.cross_entropy's reductions of per-token losses (ignored tokens excluded; `weights` are
    the targets' class weights, which weight the mean as torch does). With `batch_group` (2d:
    the batch is split over it) sums and counts are totals over the group."""
    w = valid.to(losses.dtype) if weights is None else weights * valid
    losses = losses * w
    if reduction in ("none", False):
        return losses  # this rank's tokens
    total = reduce_from(losses.sum(), batch_group)  # each rank back-propagates its own tokens
    if reduction == "sum":
        return total
    count = reduce_from(w.sum().detach(), batch_group)
    return mean_over(total, count)  # "mean" (Colossal-AI's reduction=True)


class VocabParallelCrossEntropyLoss1D(nn.Module):
    """F.cross_entropy(logits, target) for logits split by vocabulary over the tensor group:
    reduction 'mean' (or True), 'sum', 'none' (or False), ignore_index and class `weight`."""

    def __init__(self, reduction: Union[str, bool] = "mean", ignore_index: int = -100,
                 weight: Optional[torch.Tensor] = None, label_smoothing: float = 0.0) -> None:
        super().__init__()
        check_vocab_loss(reduction, label_smoothing)
        self.reduction = reduction
        self.ignore_index = ignore_index
        self.weight = weight

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._loss(logits, target, gpc.tensor_group, gpc.tensor_rank, None)

    def _loss(self, logits: torch.Tensor, target: torch.Tensor, vocab_group, vocab_rank: int,
              batch_group) -> torch.Tensor:
        shape = target.shape
        logits = logits.reshape(-1, logits.shape[-1])
        target = target.reshape(-1).to(logits.device)
        valid = target != self.ignore_index
        check_ids(target[valid], logits.shape[-1] * dist.get_world_size(vocab_group), "targets")
        start = vocab_rank * logits.shape[-1]
        losses = _VocabParallelCrossEntropy.apply(logits, target.masked_fill(~valid, start),
                                                  start, vocab_group)
        weights = None
        if self.weight is not None:  # each token's class weight (ignored ones: any, zeroed)
            weights = self.weight.to(losses)[target.masked_fill(~valid, 0)]
        reduced = reduce_losses(losses, valid, self.reduction, weights, batch_group)
        return reduced.reshape(shape) if reduced.dim() else reduced
