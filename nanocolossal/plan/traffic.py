"""Elements one rank hands to each kind of collective per optimizer step (nanocolossal/traffic.py
counts the same thing live): the formulas of the files named beside each term. `B S D` below is
this rank's tokens x the model's width over the whole step (all micro-batches, all micro-steps).

    data parallel   all-reduce   Psi + n            (gradients, a "used" flag each: ddp.py)
    ZeRO 1, 2       all-gather   sum pad(Psi)       (the updated shards: zero/optimizer.py)
    ZeRO 2          all-reduce   Psi + n            (buckets, my shard kept: zero/gradients.py)
    ZeRO 3          all-gather   2 sum_u pad(u)     (each unit for its forward and its backward)
                    reduce-scatter sum_u pad(u)     (an all-reduce on gloo: zero/comm.py)
                    all-reduce   n + 2 + 1          (flags, the units' order, the overflow check)
    tensor 1d       all-reduce   B S D per row-parallel Linear forward and column-parallel one
                                 backward, the embedding's sum (tensor/comm.py's f and g),
                                 3 B S for the vocab-parallel loss (tensor/vocab_parallel.py)
                    all-gather   B S D (the position table's dim-split lookup)
    pipeline        p2p          B S D per part boundary and direction (pipeline/p2p.py)
                    all-reduce   V D/T + 1 for the tied table on the first and last stage
                                 (pipeline/tied.py); 2 for the reported loss
    the loss        all-reduce   1 (targets counted over the data ranks: loss_weights.py)
    clipping        all-reduce   1 (the squares' sum: clip.py)

On a ring (nanocolossal/traffic.py: ring_elements) an all-reduce of n sends 2 n (N-1)/N per rank,
an all-gather or reduce-scatter n (N-1)/N.
"""
from __future__ import annotations

from collections import Counter

from .formulas import COLLECTIVES, Layout, _buffers, pad
from .model import GPT, Tensor


def traffic(m: GPT, lay: Layout, p: int, chunks: list[list[int]], ts: list[Tensor]) -> dict:
    """Elements per optimizer step by collective, on pipeline rank p holding `chunks`."""
    c: Counter = Counter()
    N, T, P = lay.replicas, lay.tensor, lay.pipeline
    psi, n = sum(t.numel for t in ts), len(ts)
    layers = {layer for chunk in chunks for layer in chunk}
    head, tokens = m.layers - 1, lay.batch * m.seq // (T if lay.mode == "sequence" else 1)
    bsd = tokens * m.dim
    blocks = sum(1 for layer in layers if 0 < layer < head)
    # data parallel and ZeRO
    if N > 1 and lay.zero in (0, 1, 2):
        c["all_reduce"] += psi + n
    if N > 1 and lay.zero in (1, 2):
        c["all_gather"] += sum(pad(k, N) for k, _, _ in _buffers(ts, lay))
    if N > 1 and lay.zero == 3:
        units = sum(pad(k, N) for k, _, _ in _buffers(ts, lay))
        c["all_gather"] += 2 * units
        c["all_reduce" if lay.backend == "gloo" else "reduce_scatter"] += units
        c["all_reduce"] += n + 2 + 1
    # tensor 1d: Megatron's f and g
    if lay.mode == "1d" and T > 1:
        again = 2 if lay.checkpoint == "full" else 1     # a checkpointed forward runs twice
        c["all_reduce"] += 2 * bsd * blocks * (1 + again)  # forward: proj, fc2; back: qkv, fc1
        if 0 in layers:
            c["all_reduce"] += bsd                       # the vocab-parallel embedding's sum
            c["all_gather"] += bsd                       # the position table's columns
        if head in layers:
            c["all_reduce"] += bsd + 3 * tokens          # the classifier's input; the loss
    micro = lay.accumulation if P == 1 else 1
    if lay.mode == "sequence" and T > 1:
        if lay.attention == "ring":  # K, V around the ring; back: K, V again, then dK, dV
            c["p2p"] += (2 * (T - 1) * 2 + 2 * T) * bsd * blocks
        else:                        # q, k, v in and the output back, each way (ulysses.py)
            c["all_to_all"] += 8 * bsd * blocks
            c["all_gather"] += micro * T * (blocks + (0 in layers))  # the shares' lengths
        pieces = lay.micro_batches if P > 1 else micro  # per micro-batch: loss_weights.py
        c["all_reduce"] += 2 * pieces * (head in layers)  # the sequence share, the pieces
    if lay.mode in ("2d", "2.5d", "3d") and T > 1:   # an estimate, not proven by a test
        q = T ** 0.5 if lay.mode != "3d" else T ** (1 / 3)
        weights = sum(t.numel for t in ts)
        c["all_gather" if lay.mode == "3d" else "all_reduce"] += round(
            3 * (bsd * 6 / q + weights / 3) * blocks / max(1, blocks))
    if m.experts:  # dispatch and combine, forward and backward (moe/dispatch.py)
        cap = -(-int(m.capacity * tokens * m.top_k) // m.experts)
        moe_layers = sum(1 for layer in layers if 0 < layer < head and m.is_moe(layer - 1))
        c["all_to_all"] += 4 * m.experts * cap * m.dim * moe_layers * (lay.ep > 1)
    # pipeline: activations down, gradients up; the tied table; the reported loss
    if P > 1:
        for v, chunk in enumerate(chunks):
            part = _part(lay, p, v)
            down = part < P * lay.chunks - 1 and not _same_rank(lay, part, part + 1)
            up = part > 0 and not _same_rank(lay, part, part - 1)
            c["p2p"] += bsd * (down + up)
        if _tied_apart(m, lay) and (0 in layers or head in layers):
            tok = next(t.numel for t in ts if t.name == "tok")
            c["all_reduce"] += (tok + 1) * (2 if lay.zero == 2 and N > 1 else 1)
        c["all_reduce"] += 2
        if N > 1 and head in layers:
            c["all_reduce"] += 1                         # the targets, counted over data ranks
    elif N > 1:
        c["all_reduce"] += lay.accumulation              # the targets, counted over data ranks
    if lay.clip:  # the squares summed over the data ranks, then over the model's other ranks
        model_ranks = P * (1 if lay.mode == "sequence" else T)
        c["all_reduce"] += (N > 1 and lay.zero > 0) + (model_ranks > 1)
    if N > 1 and (lay.zero in (1, 2) and lay.amp or lay.amp in ("O2", "O3")):
        c["all_reduce"] += 1                             # any inf / nan, agreed job-wide
    return {k: c.get(k, 0) for k in COLLECTIVES}


def _part(lay: Layout, p: int, chunk: int) -> int:
    from ..pipeline.steps import virtual_stage
    return virtual_stage(chunk, p, lay.pipeline, lay.v_shape)


def _same_rank(lay: Layout, a: int, b: int) -> bool:
    from ..pipeline.steps import stage_rank
    return stage_rank(a, lay.pipeline, lay.v_shape) == stage_rank(b, lay.pipeline, lay.v_shape)


def _tied_apart(m: GPT, lay: Layout) -> bool:
    """Whether the embedding and the head sit on two pipeline ranks (pipeline/tied.py sums the
    table's gradients between them); zbv's V puts both on rank 0."""
    from .model import stage_layers
    holders = {p for p in range(lay.pipeline) for chunk in stage_layers(
        m, lay.pipeline, lay.chunks, p, lay.v_shape) for layer in chunk
        if layer in (0, m.layers - 1)}
    return len(holders) > 1
