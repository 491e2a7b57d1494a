"""Point-to-point transfers between pipeline stages.

A plan's communication step is a batch of sends and receives, posted together with
`torch.distributed.batch_isend_irecv`: two neighbours that send to each other at the same
moment both make progress (with blocking send/recv, or NCCL ops queued one after another,
each would wait for the other's receive forever). The receives are waited on before the
next step; the sends complete in the background and are waited on by `flush` at the end of
the batch, so a stage never idles while its output is in transit. (NCCL gives one handle for a
whole batch: waiting for its receives waits for its sends too, on the GPU's stream, not the
host; a batch of sends alone is not waited on until `flush`.)

A receiver must allocate a buffer of the right shape and dtype before data arrives. The first
transfer across each stage boundary *for each micro-batch size* is preceded by a small metadata
message [dtype, ndim, *shape]; every stage knows the sizes (it splits the same batch), so a smaller
last batch costs one more handshake, and later micro-batches of that size must match it
(p2p_checks.py names both ranks where a stage's output changed). TENSOR_SHAPE (tensor_shape) skips
the handshake for micro-batches of its leading size (their dtype is then float32: a half-precision
activation needs the handshake). Gradients cross a boundary backwards with the shape and dtype of
its activation, which both sides already know; an integer activation (token ids) has none.

Within a batch, operations are ordered by (kind, source, destination, micro-batch) on both
sides and tagged, so a message is matched with its own receive on gloo (tags) and on NCCL
(first in, first out per pair of ranks).

Before a launch, `nanocolossal plan` computes these elements sent (nanocolossal/plan/traffic.py).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..context import gpc
from .p2p_checks import check_agreed, check_sendable, transfer_errors
from .steps import Transfer, stage_rank

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.uint8, torch.bool]
_META_LEN = 10  # dtype code, ndim, up to 8 dimensions


def _tag(t: Transfer, meta: bool = False) -> int:
    """A distinct 31-bit tag: message kind (2 bits), source virtual stage (9), micro-batch (20)."""
    kind = 2 if meta else (1 if t.what == "grad" else 0)
    return (kind << 29) | ((t.src % 512) << 20) | (t.mb % 2**20)


class StageComm:
    """One rank's pipeline messaging: P stages, boundaries between virtual stages v -> v + 1."""

    def __init__(self, tensor_shape: Optional[Sequence[int]] = None,
                 dtype: torch.dtype = torch.float32, v_shape: bool = False) -> None:
        self.P = gpc.pipeline_size
        self.v_shape = v_shape  # zbv's parts in a V
        self.fixed = (tuple(tensor_shape), dtype) if tensor_shape is not None else None
        self.shapes: dict[tuple, tuple] = {}  # (source virtual stage, mb size) -> (shape, dtype)
        self.sizes: list[int] = []  # this batch's micro-batch sizes (set by the executor)
        self._sending: list[tuple] = []  # (work, op) of sends not yet known to be complete

    def exchange(self, sends: dict, recvs: Sequence[Transfer], where: str) -> dict:
        """Post all sends ({Transfer: tensor}) and receives together; returns {Transfer: tensor}."""
        check_sendable(sends, _DTYPES, _META_LEN)
        self._handshake(sends, recvs, where)
        ops = []
        received = {}
        for t, x in sorted(sends.items()):
            agreed = self._meta_of(t.src if t.what == "act" else t.dst, t.mb)
            check_agreed(t, x, agreed, self.fixed, self._rank(t.dst), where)
            ops.append(dist.P2POp(dist.isend, x.contiguous(), self._rank(t.dst), tag=_tag(t)))
        for t in sorted(recvs):
            shape, dtype = self._meta_of(t.src if t.what == "act" else t.dst, t.mb)
            if t.what == "act" or dtype.is_floating_point:
                received[t] = torch.empty(shape, dtype=dtype, device=gpc.device)
                ops.append(dist.P2POp(dist.irecv, received[t], self._rank(t.src), tag=_tag(t)))
        self._post(ops, where)
        return received

    def _post(self, ops: list, where: str) -> None:
        """Post ops as one batch and wait for its receives; its sends finish in the background."""
        if not ops:
            return
        with transfer_errors(ops, where):
            works = dist.batch_isend_irecv(ops)
            if len(works) < len(ops):  # NCCL: one handle for the whole batch
                works = works * len(ops)
            self._sending = [(w, x) for w, x in self._sending if not w.is_completed()]
            for op, work in zip(ops, works):
                if op.op is dist.irecv:
                    work.wait()
                else:
                    self._sending.append((work, op))  # keeps the tensor alive until sent

    def flush(self, where: str = "end of batch") -> None:
        """Wait for every send still in flight (only receives gate the next step)."""
        sending = self._sending
        self._sending = []
        with transfer_errors([op for _, op in sending], where):
            for work, _ in sending:
                work.wait()

    def _handshake(self, sends: dict, recvs: Sequence[Transfer], where: str) -> None:
        """Announce/learn the shapes of first-time activation transfers: [dtype, ndim, *shape]."""
        ops = []
        incoming = {}
        for t, x in sorted(sends.items()):
            if t.what == "act" and self._meta_of(t.src, t.mb) is None:
                self.shapes[(t.src, self.sizes[t.mb])] = (tuple(x.shape), x.dtype)
                meta = [_DTYPES.index(x.dtype), x.dim(), *x.shape]
                meta = torch.tensor(meta + [0] * (_META_LEN - len(meta)), device=gpc.device)
                ops.append(dist.P2POp(dist.isend, meta, self._rank(t.dst), tag=_tag(t, True)))
        for t in sorted(recvs):
            if t.what == "act" and self._meta_of(t.src, t.mb) is None:
                incoming[t] = torch.zeros(_META_LEN, dtype=torch.int64, device=gpc.device)
                ops.append(dist.P2POp(dist.irecv, incoming[t], self._rank(t.src),
                                      tag=_tag(t, True)))
        self._post(ops, f"{where} (shape handshake)")
        for t, meta in incoming.items():
            code, ndim, *dims = meta.tolist()
            self.shapes[(t.src, self.sizes[t.mb])] = (tuple(dims[:ndim]), _DTYPES[code])

    def _meta_of(self, boundary: int, mb: int) -> Optional[tuple]:
        size = self.sizes[mb] if mb < len(self.sizes) else None
        if self.fixed is not None and (size is None or self.fixed[0][0] == size):
            return self.fixed
        return self.shapes.get((boundary, size))

    def _rank(self, virtual_stage: int) -> int:
        return gpc.pipeline_ranks[stage_rank(virtual_stage, self.P, self.v_shape)]
