"""Point-to-point transfers between pipeline stages.

A plan's communication step is a batch of sends and receives, posted together with
`torch.distributed.batch_isend_irecv`: two neighbours that send to each other at the same
moment both make progress (with blocking send/recv, or NCCL ops queued one after another,
each would wait for the other's receive forever). The receives are waited on before the
next step; the sends complete in the background and are waited on by `flush` at the end of
the batch, so a stage never idles while its output is in transit.

A receiver must allocate a buffer of the right shape and dtype before data arrives. The
first transfer across each stage boundary *for each micro-batch size* is preceded by a
small metadata message [dtype, ndim, *shape]; every stage knows the sizes (it splits the
same batch), so a smaller last batch costs one more handshake, and later micro-batches of
that size must match it: a stage whose output changes shape is stopped with an error
naming both ranks. TENSOR_SHAPE (tensor_shape) skips the handshake for micro-batches of
its leading size. Gradients cross a boundary backwards with the shape of its activation,
which both sides already know.

Within a batch, operations are ordered by (kind, source, destination, micro-batch) on both
sides and tagged, so a message is matched with its own receive on gloo (tags) and on NCCL
(first in, first out per pair of ranks).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..context import gpc
from .steps import Transfer, stage_rank

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.uint8, torch.bool]
_META_LEN = 10  # dtype code, ndim, up to 8 dimensions


def _key(t: Transfer) -> tuple:
    return (t.what, t.src, t.dst, t.mb)


def _tag(t: Transfer, meta: bool = False) -> int:
    """A distinct 31-bit tag: message kind (2 bits), source virtual stage (9), micro-batch (20)."""
    kind = 2 if meta else (1 if t.what == "grad" else 0)
    return (kind << 29) | ((t.src % 512) << 20) | (t.mb % 2**20)


class StageComm:
    """One rank's pipeline messaging: P stages, boundaries between virtual stages v -> v + 1."""

    def __init__(self, tensor_shape: Optional[Sequence[int]] = None,
                 dtype: torch.dtype = torch.float32, v_shape: bool = False) -> None:
        self.P, self.v_shape = gpc.pipeline_size, v_shape  # v_shape: zbv's parts in a V
        self.fixed = (tuple(tensor_shape), dtype) if tensor_shape is not None else None
        # (boundary = source virtual stage, mb size) -> (shape, dtype)
        self.shapes: dict[tuple, tuple] = {}
        self.sizes: list[int] = []            # this batch's micro-batch sizes (set by the schedule)
        self._sending: list[tuple] = []     # (work, tensor) of sends not yet known to be complete

    def _rank(self, virtual_stage: int) -> int:
        return gpc.pipeline_ranks[stage_rank(virtual_stage, self.P, self.v_shape)]

    def _meta_of(self, boundary: int, mb: int) -> Optional[tuple]:
        size = self.sizes[mb] if mb < len(self.sizes) else None
        if self.fixed is not None and (size is None or self.fixed[0][0] == size):
            return self.fixed
        return self.shapes.get((boundary, size))

    def _post(self, ops: list, where: str, wait_sends: bool = True) -> None:
        """Post ops as one batch; wait for the receives (and, unless told otherwise, the sends)."""
        if not ops:
            return
        try:
            works = dist.batch_isend_irecv(ops)
            # coalesced (NCCL): one handle for the whole batch, wait for it
            if len(works) != len(ops):
                for work in works:
                    work.wait()
                return
            for op, work in zip(ops, works):
                if op.op is dist.isend and not wait_sends:
                    self._sending.append((work, op.tensor))  # keeps the tensor alive until sent
                else:
                    work.wait()
        except RuntimeError as e:
            peers = sorted({op.peer for op in ops})
            raise RuntimeError(f"[rank {gpc.rank}] pipeline transfer with "
                               f"rank(s) {peers} failed at {where} "
                               f"({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                               "a peer may have stopped or timed out (timeout "
                               f"{gpc.timeout.total_seconds():.0f} s)") from e

    def flush(self, where: str = "end of batch") -> None:
        """Wait for every send still in flight (sends are not waited for when posted: a rank goes
        on computing while its activations travel, as only receives gate the next step)."""
        try:
            for work, _ in self._sending:
                work.wait()
        except RuntimeError as e:
            raise RuntimeError(f"[rank {gpc.rank}] a pipeline send did not complete at "
                               f"{where}: {e}") from e
        finally:
            self._sending = []

    def _handshake(self, sends: dict, recvs: Sequence[Transfer], where: str) -> None:
        """Announce/learn the shapes of first-time activation transfers."""
        ops, incoming = [], []
        for t in sorted(sends, key=_key):
            if t.what == "act" and self._meta_of(t.src, t.mb) is None:
                x = sends[t]
                self.shapes[(t.src, self.sizes[t.mb])] = (tuple(x.shape), x.dtype)
                meta = torch.zeros(_META_LEN, dtype=torch.int64)
                meta[:2 + x.dim()] = torch.tensor([_DTYPES.index(x.dtype), x.dim(), *x.shape])
                ops.append(dist.P2POp(dist.isend, meta.to(gpc.device), self._rank(t.dst),
                                      tag=_tag(t, True)))
        for t in sorted(recvs, key=_key):
            if t.what == "act" and self._meta_of(t.src, t.mb) is None:
                meta = torch.zeros(_META_LEN, dtype=torch.int64, device=gpc.device)
                incoming.append((t, meta))
                ops.append(dist.P2POp(dist.irecv, meta, self._rank(t.src), tag=_tag(t, True)))
        self._post(ops, f"{where} (shape handshake)")
        for t, meta in incoming:
            code, ndim, *dims = meta.tolist()
            self.shapes[(t.src, self.sizes[t.mb])] = (tuple(dims[:ndim]), _DTYPES[code])

    def exchange(self, sends: dict, recvs: Sequence[Transfer], where: str) -> dict:
        """Post all sends ({Transfer: tensor}) and receives together; returns {Transfer: tensor}."""
        for t, x in sends.items():
            if t.what == "act" and x.dim() + 2 > _META_LEN:
                raise ValueError(f"[rank {gpc.rank}] stage output has {x.dim()} dimensions; at "
                                 f"most {_META_LEN - 2}")
            if t.what == "act" and x.dtype not in _DTYPES:
                raise ValueError(f"[rank {gpc.rank}] stage output dtype {x.dtype} cannot be sent "
                                 f"between stages")
        self._handshake(sends, recvs, where)
        ops, received = [], {}
        for t in sorted(sends, key=_key):
            x = sends[t]
            shape, dtype = self._meta_of(t.src if t.what == "act" else t.dst, t.mb)
            if tuple(x.shape) != shape or x.dtype != dtype:
                peer = self._rank(t.dst)
                if self.fixed is not None and (shape, dtype) == self.fixed and \
                        not x.is_floating_point():
                    raise RuntimeError(
                        f"[rank {gpc.rank}] {where}: the {t.what} of micro-batch {t.mb} for rank "
                        f"{peer} is {x.dtype}, but TENSOR_SHAPE fixes every boundary at "
                        f"{dtype}; remove TENSOR_SHAPE from the config (the stages then agree "
                        f"on each boundary's shape and dtype by themselves)")
                raise RuntimeError(
                    f"[rank {gpc.rank}] {where}: the {t.what} of micro-batch {t.mb} for rank "
                    f"{peer} has shape {tuple(x.shape)} and dtype {x.dtype}, but rank {gpc.rank} "
                    f"and rank {peer} agreed on {shape} {dtype} for micro-batches of this size; a "
                    f"stage must give the same shape for the same number of samples, or set "
                    f"TENSOR_SHAPE correctly")
            ops.append(dist.P2POp(dist.isend, x.contiguous(), self._rank(t.dst), tag=_tag(t)))
        for t in sorted(recvs, key=_key):
            shape, dtype = self._meta_of(t.src if t.what == "act" else t.dst, t.mb)
            buffer = torch.empty(shape, dtype=dtype, device=gpc.device)
            received[t] = buffer
            ops.append(dist.P2POp(dist.irecv, buffer, self._rank(t.src), tag=_tag(t)))
        self._sending = [(w, t) for w, t in self._sending if not w.is_completed()]
        self._post(ops, where, wait_sends=False)
        return received
