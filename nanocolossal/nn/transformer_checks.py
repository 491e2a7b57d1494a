"""What a transformer block's attention refuses when it is built: the sizes and options the
layout cannot split or compute (nn/transformer.py calls `check_attention` in one line)."""
from __future__ import annotations

from ..config import ConfigError
from ..context import gpc

ATTENTION = ("fused", "explicit")  # how the core softmax(q k^T / sqrt(d)) v is computed


def check_attention(dim: int, heads: int, dropout: float, attention: str,
                    all_to_all: bool) -> None:
    if attention not in ATTENTION:
        raise ValueError(f"[rank {gpc.rank}] attention={attention!r}: use one of "
                         f"{', '.join(map(repr, ATTENTION))}")
    parts = {"2d": gpc.summa_dim, "2.5d": gpc.summa_dim, "3d": gpc.cube_dim,
             "1d": gpc.tensor_size,
             "sequence": gpc.tensor_size if all_to_all else 1}.get(gpc.tensor_mode, 1)
    if gpc.sequence_size > 1 and dropout > 0 and not all_to_all:
        raise ConfigError(f"[rank {gpc.rank}] ring attention (mode='sequence') computes "
                          f"the softmax block by block and has no attention dropout; build "
                          f"the model with dropout=0 (got {dropout}), or use "
                          f"attention='all_to_all'")
    if heads % parts or dim % heads:
        raise ConfigError(f"[rank {gpc.rank}] {heads} heads of a {dim}-wide model do not "
                          f"split over {parts} "
                          f"{'sequence' if all_to_all else 'tensor'} ranks; use a "
                          f"number of heads divisible by {parts} that divides {dim}")
