"""Vocabulary-parallel layers on the 2d grid: the embedding table E [V, d] in q x q tiles.

Rank (i, j) holds E's tile (vocabulary slice i, hidden slice j) -- the layout an embedding
needs, since the activations it produces are [batch share i, ..., hidden slice j] (layers_2d.py):

    embedding   every rank looks up the *whole* batch's ids in its vocabulary slice (zeros
                elsewhere); the column group j sums them (each id found on one rank), and rank
                (i, j) keeps batch share i. Backward: its batch share's gradient is gathered
                down the column, so each rank updates the rows of its vocabulary slice.
    classifier  logits = x E^T with x and E in the same tile layout (the tied weight), so
                the product is SUMMA's "A B^T" form: for each vocabulary slice m,
                    E_mk goes down column k from rank (m, k);  rank (i, k) forms X_ik E_mk^T;
                    the row group i sums these onto rank (i, m).
                Logits end as [batch share i, ..., vocabulary slice m] on rank (i, m): every
                rank holds b*s*V/q^2 of them.
    loss        the 1d vocab-parallel loss along each grid row (the row holds one batch share's
                whole vocabulary), then sums and counts over the column (the batch shares).

2.5d: each grid does the same on its own samples (the embedding looks up its grid's share of the
batch), and E's tiles enter through the depth group, which sums their gradients (layers_2d.py).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..context import gpc
from .base import add_bias, keep_slice
from .comm import reduce_from, split
from .layer_checks import check_divisible, check_ids, tied
from .layers_2d import across_grids, along_row, batch_share, down_column, grid_batch
from .summa import autocast_operands, panel, reduce_to
from .vocab_parallel import VocabParallelCrossEntropyLoss1D, look_up_slice, vocab_parallel_argmax

VOCAB_TILES = [(0, "row"), (1, "col")]  # E's tile (vocabulary i, hidden j) on rank (i, j)


class _SummaABT(torch.autograd.Function):
    """C = X E^T on the grid: x [b, d/q] tile (i, k), e [V/q, d/q] tile (m, k) on rank (m, k);
    C's tile (i, m) ends on rank (i, m)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, e)
        rows, cols = gpc.tensor_row_group, gpc.tensor_col_group
        c = x.new_empty(x.shape[0], e.shape[0])
        for m in range(gpc.summa_dim):
            e_mk = panel(e, m, cols, gpc.tensor_col_ranks)
            total = reduce_to(x @ e_mk.t(), m, rows, gpc.tensor_row_ranks)
            if gpc.grid_col == m:  # I am (i, m)
                c = total
        return c

    @staticmethod
    def backward(ctx, dc: torch.Tensor):
        x, e = ctx.saved_tensors
        rows, cols = gpc.tensor_row_group, gpc.tensor_col_group
        dx, de = torch.zeros_like(x), torch.empty_like(e)
        dc = dc.contiguous()
        for m in range(gpc.summa_dim):
            dc_im = panel(dc, m, rows, gpc.tensor_row_ranks)   # dC_im along row i
            e_mk = panel(e, m, cols, gpc.tensor_col_ranks)     # E_mk down column k
            dx += dc_im @ e_mk                                  # dX_ik = sum_m dC_im E_mk
            total = reduce_to(dc_im.t() @ x, m, cols, gpc.tensor_col_ranks)
            if gpc.grid_row == m:  # I am (m, k):               dE_mk = sum_i dC_im^T X_ik
                de = total
        return dx, de


class VocabParallelEmbedding2D(nn.Module):
    """Embedding with E split by vocabulary down the column and by hidden along the row."""

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 padding_idx: Optional[int] = None) -> None:
        super().__init__()
        q = gpc.summa_dim
        check_divisible(num_embeddings, q, "vocabulary size")
        check_divisible(embedding_dim, q, "Embedding dim")
        full = nn.Embedding(num_embeddings, embedding_dim, padding_idx=padding_idx)
        self.weight = keep_slice(full.weight, VOCAB_TILES)
        row = gpc.grid_row  # my row of the grid: my vocabulary slice
        self.start = row * num_embeddings // q
        self.end = (row + 1) * num_embeddings // q
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.padding_idx = padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        check_ids(ids, self.num_embeddings, "token ids")
        ids = grid_batch(ids)  # 2.5d: my grid's samples
        found = look_up_slice(ids, across_grids(self.weight), self.start, self.end,
                              self.padding_idx, self.num_embeddings)
        whole = reduce_from(found, gpc.tensor_col_group)
        return split(whole, 0, gpc.tensor_col_group)  # my row's share of my grid's samples


class VocabParallelClassifier2D(nn.Module):
    """logits = x E^T (+ b) with E in the embedding's tile layout (`weight=` ties them)."""

    def __init__(self, in_features: int, num_classes: int, bias: bool = True,
                 weight: Optional[nn.Parameter] = None) -> None:
        super().__init__()
        q = gpc.summa_dim
        check_divisible(num_classes, q, "vocabulary size")
        check_divisible(in_features, q, "Classifier in_features")
        full = nn.Linear(in_features, num_classes, bias=bias)
        self.weight = tied(keep_slice(full.weight, VOCAB_TILES), weight, "by vocabulary rows "
                           "(VocabParallelEmbedding2D)", in_features, num_classes)
        self.bias = along_row(full.bias, 0) if bias else None  # vocabulary slice m, rank (., m)
        self.in_features, self.num_classes = in_features, num_classes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x, weight = autocast_operands(x, across_grids(self.weight))
        logits = _SummaABT.apply(x.reshape(-1, x.shape[-1]), weight)
        logits = logits.reshape(*lead, logits.shape[-1])
        return add_bias(logits, down_column(self.bias))

    def predictions(self, logits: torch.Tensor) -> torch.Tensor:
        """The predicted class of each row of this rank's batch share (the row's vocabulary)."""
        return vocab_parallel_argmax(logits, gpc.tensor_row_group, gpc.tensor_row_rank)


class VocabParallelCrossEntropyLoss2D(VocabParallelCrossEntropyLoss1D):
    """The vocab-parallel loss of this row's batch share (vocabulary split along the row), summed
    and counted over the column group; takes the *whole* batch's targets, as CrossEntropyLoss2D."""

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self._loss(logits, batch_share(target), gpc.tensor_row_group, gpc.tensor_row_rank,
                          gpc.tensor_batch_group)
