"""Activations at the schedule's peak: what autograd keeps for backward (memory.py's SavedBytes),
layer by layer, walked through the rank's pipeline plan.

One micro-batch of b sequences of s tokens (s / N on a sequence rank), width D, h heads, MLP
ratio r, vocabulary V; T 1d tensor ranks (heads, MLP and vocabulary split; LayerNorm whole).
Bytes per element (AMP: amp.py):

    a  activations: the half type under AMP, else the model's dtype
    n  LayerNorm's input and statistics: fp32 under O1 (autocast) and O2 (norms kept fp32: the
       input is cast up), a under O3
    f  softmax sums, log-softmax, router: at least fp32 (max(4, a))

One block (nn/transformer.py), the tensors each op saves:

    LayerNorms' inputs and statistics   2 b s D n + 4 b s n
    their outputs (the next Linear's)   2 b s D a                (O1: autocast's half casts)
    q, k, v and attention's output      4 b s D a / T
    log-sum-exp of the fused kernel       b h s f / T
    fc1's output and GELU's             2 b s r D a / T
    O1 only: the Linears' half weights  (4 D^2 + 2 r D^2) a / T  (autocast's casts, each forward)

'explicit' attention keeps copies of q, k, v, the softmax b h s^2 a / T and the causal mask
s^2 (bool) instead of the log-sum-exp, and the output projection's input, a copy. Ring attention
(sequence, tensor/ring_attention.py) computes q, k, v, the output and log-sum-exp in at least
fp32 (f), the projection's input a cast back (b s D a under AMP). All-to-all (Ulysses,
tensor/ulysses.py): q, k, v and the output for h / N heads of whole sequences (b s D a / N
each, s the whole sequence), the projection's input a copy after the second all-to-all.
An MoE block (moe/layer.py) keeps, for n = b s tokens, K = n k kept choices (no drops), E
experts of capacity C (moe/capacity.py): the router's input n D f and probabilities n E f, the
gates K f (top-2: + n k f + n f), the choices and slots 3 K int64 and kept n k bool, the
tokens it packs K D (LayerNorm's output dtype), the experts' input E C D a, fc1's and GELU's
outputs 2 E C r D a, the results it unpacks and their weighted sum 2 K D a, the balance loss'
sums 4 E fp64 -- in place of the MLP's tensors and its LayerNorm's output.

2d / 2.5d (tensor/layers_2d.py, summa.py): every activation is a tile of b s D / q^2 (2.5d:
/ (q^2 d)); SUMMA keeps its local input; LayerNorm2D keeps x - mean, the normalised x and its
output (3 tiles) and one statistic b s / q. 3d (layers_3d.py, cube.py): tiles of b s D / q^3;
each Linear keeps its input gathered over q ranks (q tiles) and its weight gathered (q x its
shard); LayerNorm3D keeps 2 tiles and one statistic b s / q^2.

The embeddings keep the token ids and positions, 2 b s int64; the head its LayerNorm's (as a
block's; O1: the classifier's half weight V D a / T), the targets b s int64 (1d: also those in
my rows and which are mine, b s (8 + 1)) and the log-softmax b s V f / T (vocab-parallel, never
gathered: tensor/vocab_parallel.py), reported as `logits`.

ACTIVATION_CHECKPOINT = 'full' (activation_checkpoint.py): a block keeps only its input; in its
backward its tensors are back, while the layers after it in the stage have let go of theirs.
'selective' recomputes attention's core: q, k, v (the checkpoint's inputs) and the output stay,
the log-sum-exp (explicit: the softmax) goes (not under sequence parallelism, whose attention
is never recomputed). A pipeline rank's peak is found by walking its plan (pipeline/plan.py):
each F adds its chunk's micro-batch, each B (W where the backward is split) lets it go;
GPipe holds M, 1F1B P - rank, ZB-H1 P, ZB-V its two chunks' own counts.
Each MoE layer also keeps its last routing between steps (`layer.routing`: routing_bytes).

Estimates, not counted: the loss' few scalars, ids' small copies of the vocab-parallel
embeddings, the allocator's fragmentation, CUDA workspaces, NCCL buffers, transient tensors (a
backward's gradients in flight: memory.py's LargestMade). ZeRO 3's gathered weights that a
Linear saves are freed with their unit (storage resized to 0: zero/sharded_params.py): no
activation. On CUDA autocast computes the explicit softmax in fp32 (here: a).
"""
from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

from .formulas import Layout, block_checkpoint
from .model import GPT, grid, tensors

INT = 8  # int64 ids, targets, slots


class Widths(NamedTuple):
    """Bytes per element: a (activations), n (LayerNorm's input and statistics), f (at least
    fp32), res (the residual stream between blocks), out (LayerNorm's output)."""
    a: int
    n: int
    f: int
    res: int
    out: int


def widths(lay: Layout) -> Widths:
    a = lay.half_bytes if lay.amp else lay.param_bytes
    n = 4 if lay.amp in ("O1", "O2") else a
    res = lay.param_bytes if lay.amp in (None, "O1") else a
    return Widths(a, n, max(4, a), res, 4 if lay.amp == "O1" else a)


def _local(m: GPT, lay: Layout, b: int) -> tuple[float, int, float, int, int]:
    """(sequences, tokens per sequence, width, heads, q) of one tensor rank's activation tile;
    q the side of the 2d / 2.5d grid or 3d cube (1 otherwise; 1d splits inside the layers)."""
    s, D, h, q = m.seq, m.dim, m.heads, grid(lay.mode, lay.tensor, lay.depth)
    if lay.mode == "sequence":
        return b, s // lay.tensor, D, h, 1
    if lay.mode in ("2d", "2.5d"):
        return b / (q * (lay.depth if lay.mode == "2.5d" else 1)), s, D / q, h // q, q
    if lay.mode == "3d":
        return b / (q * q), s, D / q, h // q, q
    return b, s, D, h, 1


def _norm(m: GPT, lay: Layout, b: int) -> tuple[float, float]:
    """(saved bytes but the output, the output) of one LayerNorm on the rank's tile."""
    w = widths(lay)
    b, s, D, _, q = _local(m, lay, b)
    if lay.mode in ("2d", "2.5d"):  # x - mean, normalised (fp32+), rstd; output
        return 2 * b * s * D * w.f + b * s * w.f + D * w.f, b * s * D * w.a
    if lay.mode == "3d":  # the next Linear keeps its own gathered copy
        return 2 * b * s * D * w.f + b * s * w.f + D * w.f, 0
    return b * s * D * w.n + 2 * b * s * w.n, b * s * D * w.a


def _linear_weights(m: GPT, lay: Layout, layer: int) -> int:
    """Elements of the Linear weights of `layer` on this rank (the classifier: tok)."""
    ts = tensors(m, lay.mode, lay.tensor, lay.depth, lay.ep)
    if layer == m.layers - 1:
        return next(t.numel for t in ts if t.name == "tok")
    return sum(t.numel for t in ts if t.layer == layer and t.name.endswith(".weight")
               and "norm" not in t.name)


def _attention(m: GPT, lay: Layout, b: int, keep: str) -> float:
    """Attention's saved bytes on the rank, after its input projection."""
    w = widths(lay)
    b, s, D, h, _ = _local(m, lay, b)
    T = lay.tensor if lay.mode == "1d" else 1
    if lay.mode == "sequence" and lay.attention == "all_to_all":  # h / N heads, N s tokens
        return 5 * b * s * D * w.a + b * h * s * w.f
    if lay.mode == "sequence":  # ring: fp32+ inside, the output cast back
        return 4 * b * s * D * w.f + b * h * s * w.f + (b * s * D * w.a if w.a < w.f else 0)
    if m.attention == "explicit":
        core = b * h * s * s * w.a / T + s * s
        kept = 4 * b * s * D * w.a / T
    else:
        core = b * h * s * w.f / T
        kept = 4 * b * s * D * w.a / T
    return kept + (0 if keep == "selective" else core)


def _mlp(m: GPT, lay: Layout, b: int, block: int) -> float:
    """The MLP's (or MoE layer's) saved bytes, after its LayerNorm."""
    w = widths(lay)
    if m.is_moe(block):
        return _moe(m, lay, b)
    b, s, D, _, q = _local(m, lay, b)
    T = lay.tensor if lay.mode == "1d" else 1
    hidden = b * s * m.mlp_ratio * D * w.a / T
    if lay.mode == "3d":  # fc1's output; fc2's input gathered over q
        return hidden + q * hidden
    return 2 * hidden


def _moe(m: GPT, lay: Layout, b: int) -> float:
    from ..moe.capacity import expert_capacity
    w = widths(lay)
    n = b * m.seq
    K, E, D = n * m.top_k, m.experts, m.dim
    C = expert_capacity(n, E, m.capacity)
    router = n * D * w.f + n * E * w.f + K * w.f + (n * m.top_k + n) * w.f * (m.top_k == 2)
    routes = 3 * K * INT + n * m.top_k + (K * w.a if w.a < w.f else 0) + 4 * E * 8 + 8
    experts = E * C * D * w.a * (1 + 2 * m.mlp_ratio)
    return router + routes + K * D * w.out + experts + 2 * K * D * w.a


def block_bytes(m: GPT, lay: Layout, b: int, layer: int, keep: str = "all") -> float:
    """One block's saved bytes for b sequences; keep 'selective': without attention's core."""
    w = widths(lay)
    stats, out = _norm(m, lay, b)
    lb, s, D, _, q = _local(m, lay, b)
    moe = m.is_moe(layer - 1)
    total = 2 * stats + out * (1 if moe else 2) + _attention(m, lay, b, keep)
    total += _mlp(m, lay, b, layer - 1)
    if lay.mode == "3d":  # the Linears' gathered inputs (fc2's: in _mlp) and weights
        total += 3 * q * lb * s * D * w.a + q * _linear_weights(m, lay, layer) * w.a
    if lay.amp == "O1":  # autocast's half copies of the weights, each forward
        total += _linear_weights(m, lay, layer) * w.a
    return total


def layer_bytes(m: GPT, lay: Layout, b: int, layer: int) -> tuple[int, int, int]:
    """(kept, more while its backward runs, logits) of one layer for one micro-batch."""
    w = widths(lay)
    lb, s, D, _, q = _local(m, lay, b)
    if layer == 0:  # token ids and positions (2d, 2.5d, 3d: of the rank's tile)
        return round(2 * lb * s * INT), 0, 0
    if layer == m.layers - 1:
        stats, out = _norm(m, lay, b)
        if lay.mode == "3d":
            out = q * lb * s * D * w.a + q * _linear_weights(m, lay, layer) * w.a
        if lay.amp == "O1":
            out += _linear_weights(m, lay, layer) * w.a
        V = m.vocab / (lay.tensor if lay.mode == "1d" else q)  # vocab-parallel: my rows
        logits = lb * s * V * w.f
        targets = lb * s * INT
        if lay.mode == "1d":  # vocab_parallel.py: the targets in my rows, and which are mine
            targets += lb * s * (INT + 1)
        return round(stats + out + targets), 0, round(logits)
    if block_checkpoint(lay, layer) == "full":
        kept = lb * s * D * w.res
        full = block_bytes(m, lay, b, layer)
        torch_norm = lay.mode not in ("2d", "2.5d", "3d")  # keeps the very input
        return round(kept), round(full - (kept if torch_norm and w.res == w.n else 0)), 0
    sequence = lay.mode == "sequence"
    keep = "selective" if block_checkpoint(lay, layer) == "selective" and not sequence else "all"
    return round(block_bytes(m, lay, b, layer, keep)), 0, 0


def chunk_bytes(m: GPT, lay: Layout, b: int, chunk: list[int]) -> tuple[int, int, int]:
    """(kept, peak while its backward runs, logits) of one chunk's micro-batch: in backward the
    layers let go from the last one, a checkpointed block's recompute on top of those before it."""
    layers = [layer_bytes(m, lay, b, layer) for layer in chunk]
    kept = sum(k + g for k, _, g in layers)
    peak, before = kept, kept
    for k, more, g in reversed(layers):
        peak = max(peak, before + more)
        before -= k + g
    return kept, peak, sum(g for _, _, g in layers)


def activation_bytes(m: GPT, lay: Layout, p: int, chunks: list[list[int]]) -> tuple[int, int]:
    """(activations, logits) at the peak on pipeline rank p."""
    micro = lay.micro_batches if lay.pipeline > 1 else lay.accumulation
    b = lay.batch // micro
    per = [chunk_bytes(m, lay, b, chunk) for chunk in chunks]
    if lay.pipeline == 1:
        kept, peak, logits = per[0]
        return max(kept, peak) - logits, logits
    held = logits = 0
    best = (0, 0)
    for kind, c in _flights(lay.schedule, lay.pipeline, lay.micro_batches, lay.chunks)[p]:
        kept, peak, g = per[c]
        if kind == "F":
            held, logits = held + kept, logits + g
            best = max(best, (held, logits))
        elif kind == "B":
            best = max(best, (held - kept + peak, logits))
        if kind == "W" or kind == "B" and not _split(lay):
            held, logits = held - kept, logits - g
    return best[0] - best[1], best[1]


def _split(lay: Layout) -> bool:
    return lay.schedule in ("zero_bubble", "zbv")


@lru_cache(maxsize=256)
def _flights(schedule: str, P: int, M: int, V: int) -> tuple[tuple[tuple[str, int], ...], ...]:
    """Each rank's compute steps, in its order: (kind 'F' / 'B' / 'W', chunk)."""
    from ..pipeline.plan import all_plans
    from ..pipeline.steps import Compute
    return tuple(tuple((s.kind, s.chunk) for s in plan if isinstance(s, Compute))
                 for plan in all_plans(schedule, P, M, V))


def routing_bytes(m: GPT, lay: Layout, layers: tuple[int, ...]) -> int:
    """The last routing the MoE layers among `layers` keep (moe/layer.py)."""
    micro = lay.micro_batches if lay.pipeline > 1 else lay.accumulation
    n = lay.batch // micro * m.seq
    r = max(4, widths(lay).a)
    one = n * m.experts * r + n * m.top_k * (r + 8 + 8 + 1) + r
    return one * sum(1 for layer in layers if 0 < layer < m.layers - 1 and m.is_moe(layer - 1))
