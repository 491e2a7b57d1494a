"""What nc.nn refuses when a layer is built (each called in one line): Linear arguments that
contradict each other; under 3d a layer placed where its input would be in the wrong layout;
attention sizes and options the layout cannot split or compute; MoE where it cannot go."""
from __future__ import annotations

from typing import Optional

from ..config import ConfigError
from ..context import gpc

ATTENTION = ("fused", "explicit")  # how the core softmax(q k^T / sqrt(d)) v is computed


def check_attention(dim: int, heads: int, dropout: float, attention: str, all_to_all: bool) -> None:
    if attention not in ATTENTION:
        raise ValueError(f"[rank {gpc.rank}] attention={attention!r}: use one of "
                         f"{', '.join(map(repr, ATTENTION))}")
    parts = {"2d": gpc.summa_dim, "2.5d": gpc.summa_dim, "3d": gpc.cube_dim,
             "1d": gpc.tensor_size,
             "sequence": gpc.tensor_size if all_to_all else 1}.get(gpc.tensor_mode, 1)
    if gpc.sequence_size > 1 and dropout > 0 and not all_to_all:
        raise ConfigError(f"[rank {gpc.rank}] ring attention (mode='sequence') computes "
                          f"the softmax tile by tile and has no attention dropout; build "
                          f"the model with dropout=0 (got {dropout}), or use "
                          f"attention='all_to_all'")
    if heads % parts or dim % heads:
        raise ConfigError(f"[rank {gpc.rank}] {heads} heads of a {dim}-wide model do not "
                          f"split over {parts} "
                          f"{'sequence' if all_to_all else 'tensor'} ranks; use a "
                          f"number of heads divisible by {parts} that divides {dim}")


def check_block(recompute, moe) -> None:
    """An MoE block holds whole expert MLPs, with no tensor or sequence split around them, and is
    not recomputed whole: its aux loss is kept from the forward."""
    if moe and gpc.tensor_size > 1:
        split = ("is not combined with sequence parallelism" if gpc.tensor_mode == "sequence"
                 else f"does not split over {gpc.tensor_mode} tensor ranks")
        raise ValueError(f"[rank {gpc.rank}] an MoE layer holds whole expert MLPs and {split} "
                         f"(parallel.tensor mode={gpc.tensor_mode!r}): build the model without "
                         f"moe, or use parallel.moe instead of parallel.tensor")
    if recompute == "full" and moe:
        raise ValueError(f"[rank {gpc.rank}] ACTIVATION_CHECKPOINT would recompute an MoE "
                         f"block whole, but its load-balancing loss is kept from the forward "
                         f"(moe/layer.py aux_loss), which runs without autograd there; use "
                         f"ACTIVATION_CHECKPOINT='selective' (attention only)")


def check_3d_layout(layer: str, next_is_row: bool) -> None:
    """Under 3d only a row Linear takes a column Linear's output (layout B, tensor/cube.py): a
    LayerNorm, embedding or classifier built there would compute on the wrong slices, silently."""
    if gpc.tensor_mode == "3d" and next_is_row:
        raise ConfigError(f"[rank {gpc.rank}] {layer} built after a column Linear under 3d "
                          f"tensor parallelism: its input would be the column Linear's output "
                          f"(layout B), where only a row Linear fits; build Linears in the order "
                          f"data flows, in column/row pairs (nc.nn.Linear alternates), and pass "
                          f"input_is_split=False to a column Linear whose input is not the "
                          f"previous Linear's output (as SwiGLU's second)")


def check_3d_side(parallel: Optional[str], next_is_row: bool) -> None:
    """Under 3d layouts A and B have slices of the same shapes: a Linear(parallel=) against the
    alternation would compute on the wrong ones, silently (1d's shapes differ and fail)."""
    if parallel is None or (parallel == "row") == next_is_row:
        return
    if parallel == "column":
        where = ("after a column Linear: its input would be that Linear's output (layout B), "
                 "where only a row Linear fits")
    else:
        where = ("with no column Linear before it: its input would be in layout A, where only a "
                 "column Linear fits")
    raise ConfigError(f"[rank {gpc.rank}] Linear(parallel={parallel!r}) built {where} under 3d "
                      f"tensor parallelism; build Linears in column/row pairs (parallel=None "
                      f"alternates), or say where its input comes from with input_is_split=")


def check_linear_arguments(parallel: Optional[str], input_is_split: Optional[bool]) -> None:
    """`parallel` is a side, and `input_is_split`, which also picks one, does not contradict it."""
    if parallel not in (None, "column", "row"):
        raise ConfigError(f"[rank {gpc.rank}] Linear(parallel=...) must be 'column', 'row' or "
                          f"None, got {parallel!r}")
    if input_is_split is not None and parallel is not None \
            and input_is_split != (parallel == "row"):
        raise ConfigError(f"[rank {gpc.rank}] Linear(parallel={parallel!r}, input_is_split="
                          f"{input_is_split}) contradict each other: a column Linear takes a "
                          f"whole input (3d: layout A), a row Linear a split one (layout B); "
                          f"pass one of them")
