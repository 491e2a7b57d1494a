"""p2p.py's refusals and error messages (each called by one line from the core): what cannot be
sent, a stage whose output changed shape, and a transfer (or a send, at `flush`) that failed,
with both ranks named."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Optional

import torch

from ..context import gpc
from .steps import Transfer


def check_sendable(sends: dict, dtypes: list, meta_len: int) -> None:
    """Every activation fits the handshake: at most meta_len - 2 dimensions, a dtype with a code."""
    for t, x in sends.items():
        if t.what == "act" and x.dim() + 2 > meta_len:
            raise ValueError(f"[rank {gpc.rank}] stage output has {x.dim()} dimensions; at "
                             f"most {meta_len - 2}")
        if t.what == "act" and x.dtype not in dtypes:
            raise ValueError(f"[rank {gpc.rank}] stage output dtype {x.dtype} cannot be sent "
                             f"between stages")


def check_agreed(t: Transfer, x: torch.Tensor, agreed: tuple, fixed: Optional[tuple], peer: int,
                 where: str) -> None:
    """The tensor has the shape and dtype both ends agreed on for micro-batches of its size."""
    shape, dtype = agreed
    if tuple(x.shape) == shape and x.dtype == dtype:
        return
    if fixed is not None and agreed == fixed and not x.is_floating_point():
        raise RuntimeError(
            f"[rank {gpc.rank}] {where}: the {t.what} of micro-batch {t.mb} for rank {peer} is "
            f"{x.dtype}, but TENSOR_SHAPE fixes every boundary at {dtype}; remove TENSOR_SHAPE "
            f"from the config (the stages then agree on each boundary's shape and dtype by "
            f"themselves)")
    raise RuntimeError(
        f"[rank {gpc.rank}] {where}: the {t.what} of micro-batch {t.mb} for rank {peer} has "
        f"shape {tuple(x.shape)} and dtype {x.dtype}, but rank {gpc.rank} and rank {peer} agreed "
        f"on {shape} {dtype} for micro-batches of this size; a stage must give the same shape "
        f"for the same number of samples, or set TENSOR_SHAPE correctly")


@contextmanager
def transfer_errors(ops: list, where: str) -> Iterator[None]:
    """A failed batch of sends and receives, said with the peers and where in the plan."""
    try:
        yield
    except RuntimeError as e:
        peers = sorted({op.peer for op in ops})
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise RuntimeError(f"[rank {gpc.rank}] pipeline transfer with rank(s) {peers} failed at "
                           f"{where} ({first}); a peer may have stopped or timed out (timeout "
                           f"{gpc.timeout.total_seconds():.0f} s)") from e

