"""Activations at the schedule's peak: micro-batches in flight x one micro-batch's saved tensors
(what memory.py's SavedBytes counts), by layer kind and tensor mode.

One block, b sequences of s tokens (s = S / N under sequence parallelism), width D, h heads, MLP
ratio r, a bytes per activation element (nn/transformer.py's Block; T the 1d tensor ranks):

    LayerNorm inputs and outputs        4 b s D a      (whole on every 1d rank)
    q, k, v and attention's output      4 b s D a / T
    fc1's output and GELU's             2 b s r D a / T
    fused attention's log-sum-exp         b h s a / T  ('explicit': b h s^2 a / T, + s^2 mask bytes)
    LayerNorms' mean and rstd           4 b s a

The embeddings keep the token ids and positions (2 b s int64); the head its LayerNorm's input and
output (2 b s D a), statistics and targets, and the logits b s V a / T (vocab-parallel, never
gathered: tensor/vocab_parallel.py). With ACTIVATION_CHECKPOINT = 'full' a block keeps only its
input, b s D a, and one block's tensors are back during its backward (activation_checkpoint.py);
'selective' recomputes attention's core only. A pipeline rank holds the micro-batches its plan
has in flight (pipeline/simulate.py: GPipe M, 1F1B P - rank, ZB-H1 P, ...). 2d, 2.5d and 3d
split every activation over q x q (or q x q x q / q) ranks: there the formula is an estimate.
Each MoE layer also keeps its last routing between steps (moe/layer.py's `layer.routing`, read
for its drops), for the n = b s tokens of a micro-batch, E experts, k choices each, in at least
fp32 (moe/router.py: r = max(4, a) bytes): probs n E r, combine weights n k r, chosen experts and
their places n k 8 each, kept n k 1, and the aux loss, r.
Not modelled: the allocator's fragmentation, CUDA workspaces, NCCL buffers, transient tensors
(a backward's gradients in flight: memory.py's LargestMade).
"""
from __future__ import annotations

from functools import lru_cache

from .formulas import Layout
from .model import GPT, grid


def act_bytes(lay: Layout) -> int:
    """Bytes of a saved activation: the half type under autocast (O1) and O2/O3."""
    return lay.half_bytes if lay.amp else lay.param_bytes


def block_bytes(m: GPT, lay: Layout, b: int, keep: str = "all") -> int:
    """One block's saved bytes for b sequences; keep='input' (checkpointed: its input only)."""
    s, D, a = m.seq, m.dim, act_bytes(lay)
    T, split = lay.tensor, 1
    if lay.mode == "sequence":
        s //= T
    elif lay.mode == "1d":
        split = T
    elif lay.mode in ("2d", "2.5d", "3d"):
        q = grid(lay.mode, T, lay.depth)
        b, D = b / (q * (lay.depth if lay.mode == "2.5d" else 1)), D / q
    if keep == "input":
        return round(b * s * D * a)
    attention = (b * m.heads * s * a / split if m.attention == "fused"
                 else b * m.heads * s * s * a / split + s * s)
    core = 4 * b * s * D * a / split + attention
    whole = 4 * b * s * D * a + core + 2 * b * s * m.mlp_ratio * D * a / split + 4 * b * s * a
    return round(whole - core if keep == "selective" else whole)


def activation_bytes(m: GPT, lay: Layout, p: int, chunks: list[list[int]]) -> tuple[int, int]:
    """(activations, logits) at the peak on pipeline rank p."""
    micro = lay.micro_batches if lay.pipeline > 1 else lay.accumulation
    b = lay.batch // micro
    s = m.seq // lay.tensor if lay.mode == "sequence" else m.seq
    head, a = m.layers - 1, act_bytes(lay)
    split = lay.tensor if lay.mode in ("1d", "2d", "2.5d", "3d") else 1
    per_chunk, logits = [], 0
    for chunk in chunks:
        total, recompute = 0, 0
        for layer in chunk:
            if layer == 0:
                total += 2 * b * s * 8
            elif layer == head:
                total += 2 * b * s * m.dim * a // max(1, split if lay.mode != "1d" else 1)
                total += 3 * b * s * a + a
                logits = b * s * m.vocab * a // split
            elif lay.checkpoint == "full":
                total += block_bytes(m, lay, b, "input")
                recompute = max(recompute, block_bytes(m, lay, b))
            else:
                total += block_bytes(m, lay, b, lay.checkpoint or "all")
        per_chunk.append((total + (logits if head in chunk else 0) + recompute, recompute))
    flight = in_flight(lay, p) if lay.pipeline > 1 else 1
    kept = [c - recompute for c, recompute in per_chunk]
    peak = flight * sum(kept) // len(kept) + max(r for _, r in per_chunk)
    return peak - logits * flight, logits * flight


def routing_bytes(m: GPT, lay: Layout, layers: tuple[int, ...]) -> int:
    """The last routing the MoE layers among `layers` keep (moe/layer.py)."""
    micro = lay.micro_batches if lay.pipeline > 1 else lay.accumulation
    n = lay.batch // micro * m.seq
    r = max(4, act_bytes(lay))
    one = n * m.experts * r + n * m.top_k * (r + 8 + 8 + 1) + r
    return one * sum(1 for layer in layers if 0 < layer < m.layers - 1 and m.is_moe(layer - 1))


@lru_cache(maxsize=256)
def _flights(schedule: str, P: int, M: int, V: int) -> tuple[int, ...]:
    from ..pipeline.plan import all_plans
    from ..pipeline.simulate import simulate
    return tuple(simulate(all_plans(schedule, P, M, V), P, V, schedule == "zbv")["max_in_flight"])


def in_flight(lay: Layout, p: int) -> int:
    """The most micro-batches (x chunks) pipeline rank p holds at once, by simulate.py."""
    return _flights(lay.schedule, lay.pipeline, lay.micro_batches, lay.chunks)[p]
