"""Elements one rank hands to each kind of collective per optimizer step (nanocolossal/traffic.py
counts the same thing live): the formulas of the files named beside each term. `B S D` below is
this rank's tokens x the model's width over the whole step (all micro-batches, all micro-steps).

    data parallel   all-reduce   Psi + n            (gradients, a "used" flag each: ddp.py)
    ZeRO 1, 2       all-gather   sum pad(Psi)       (the updated shards: zero/optimizer.py)
    ZeRO 2          all-reduce   Psi + n            (buckets, my shard kept: zero/gradients.py;
                                                 even on one data rank)
    ZeRO 3          all-gather   2 k sum_u pad(u)   (each unit for its forward and its backward,
                                                 in each of k micro-steps: sharded_params.py)
                    reduce-scatter k sum_u pad(u)   (an all-reduce on gloo: zero/comm.py)
                    all-reduce   k n + 2            (flags, the units' order)
    tensor 1d       all-reduce   B S D per row-parallel Linear forward and column-parallel one
                                 backward, the embedding's sum (tensor/comm.py's f and g),
                                 3 B S for the vocab-parallel loss (tensor/vocab_parallel.py)
                    all-gather   B S D (the position table's dim-split lookup)
    tensor 2d, 2.5d, 3d          SUMMA's broadcasts and reduces, the cube's gathers and
                                 scatters, per Linear (grid_traffic: summa.py, cube.py)
    MoE             all-to-all   4 E C D per MoE layer and forward, C = max(ceil(cf T / E), 4)
                                 (dispatch and combine each way: moe/dispatch.py, router.py)
                    all-reduce   2 (2 E + 2) per MoE layer and forward (moe/balance.py); the
                                 handler's dense Psi + n over the data ranks and the experts'
                                 over an expert's data ranks, no DDP (moe/grads.py)
    pipeline        p2p          B S D per part boundary and direction (pipeline/p2p.py); a
                                 grid rank's block of it: / q^2 (2d), / q^2 depth (2.5d), / q^3
                                 (3d); a checkpointed block's forward collectives run twice
                    all-reduce   V D/T + 1 for the tied table on the first and last stage
                                 (pipeline/tied.py); 2 for the reported loss
    the loss        all-reduce   1 (targets counted over the data ranks: loss_weights.py)
    clipping        all-reduce   1 (the squares' sum: clip.py)
    AMP, ZeRO 3     all-reduce   1 (any inf / nan, agreed over the job: amp.py, ZeRO 3's refusal)

On a ring (nanocolossal/traffic.py: ring_elements) an all-reduce of n sends 2 n (N-1)/N per rank,
an all-gather or reduce-scatter n (N-1)/N.
"""
from __future__ import annotations

from collections import Counter

from ..pipeline.steps import stage_rank, virtual_stage
from .formulas import COLLECTIVES, Layout, _buffers, block_checkpoint, pad
from .model import GPT, Tensor, grid, stage_layers


def traffic(m: GPT, lay: Layout, p: int, chunks: list[list[int]], ts: list[Tensor]) -> dict:
    """Elements per optimizer step by collective, on pipeline rank p holding `chunks`."""
    c: Counter = Counter()
    N, T, P = lay.replicas, lay.tensor, lay.pipeline
    layers = {layer for chunk in chunks for layer in chunk}
    head, tokens = m.layers - 1, lay.batch * m.seq // (T if lay.mode == "sequence" else 1)
    bsd = tokens * m.dim
    blocks = sum(1 for layer in layers if 0 < layer < head)
    recomputed = sum(1 for layer in layers if 0 < layer < head  # forwards that run twice
                     and block_checkpoint(lay, layer) == "full")
    # data parallel and ZeRO; clipping's sum and AMP's overflow flag
    model_ranks = P * (1 if lay.mode == "sequence" else T)
    handled = bool(m.experts) and not lay.handler
    if handled and lay.zero == 0:  # moe/grads.py's handler, no DDP
        dense = [t.numel for t in ts if not t.expert]
        experts = [t.numel for t in ts if t.expert]
        c["all_reduce"] += (sum(dense) + len(dense)) * (N > 1)
        holders = N // lay.ep * max(1, lay.ep // m.experts)  # an expert's data ranks
        c["all_reduce"] += (sum(experts) + len(experts)) * (holders > 1)
    split = lay.ep > 1 and any(t.expert for t in ts)  # experts here, split over ranks
    c.update(data_parallel_traffic([] if handled and lay.zero == 0 else ts, lay, model_ranks,
                                   split))
    micro = lay.accumulation if P == 1 else 1
    # tensor 1d: Megatron's f and g
    if lay.mode == "1d" and T > 1:
        # forward: proj, fc2 (again where recomputed); backward: qkv, fc1
        c["all_reduce"] += 2 * bsd * (2 * blocks + recomputed)
        if 0 in layers:
            c["all_reduce"] += bsd                       # the vocab-parallel embedding's sum
            c["all_gather"] += bsd                       # the position table's columns
        if head in layers:
            c["all_reduce"] += bsd + 3 * tokens          # the classifier's input; the loss
    if lay.mode == "sequence" and T > 1:
        if lay.attention == "ring":  # K, V around the ring; back: K, V again, then dK, dV
            c["p2p"] += (2 * (T - 1) * 2 + 2 * T) * bsd * blocks
            c["p2p"] += 2 * (T - 1) * bsd * recomputed
        else:                        # q, k, v in and the output back, each way (ulysses.py)
            c["all_to_all"] += 8 * bsd * blocks + 4 * bsd * recomputed
            forwards = lay.micro_batches if P > 1 else micro
            # the shares' lengths
            c["all_gather"] += forwards * T * (blocks + recomputed + (0 in layers))
        pieces = lay.micro_batches if P > 1 else micro  # per micro-batch: loss_weights.py
        c["all_reduce"] += 2 * pieces * (head in layers)  # the sequence share, the pieces
    if lay.mode in ("2d", "2.5d", "3d") and T > 1:
        passes = lay.accumulation if P == 1 else lay.micro_batches  # forwards per step
        c.update(grid_traffic(m, lay, layers, passes))
    if m.experts:  # dispatch and combine, forward and backward (moe/dispatch.py), per forward
        from ..moe.capacity import expert_capacity
        passes = lay.accumulation if P == 1 else lay.micro_batches
        cap = expert_capacity(tokens // passes, m.experts, m.capacity)  # moe/capacity.py
        moe_layers = sum(1 for layer in layers if 0 < layer < head and m.is_moe(layer - 1))
        c["all_to_all"] += 4 * m.experts * cap * m.dim * moe_layers * (lay.ep > 1) * passes
        # the balance loss's 2 E + 2 sums, forward and backward (moe/balance.py)
        c["all_reduce"] += 2 * (2 * m.experts + 2) * passes * moe_layers * (N > 1)
    # pipeline: activations down, gradients up; the tied table; the reported loss
    if P > 1:
        q = grid(lay.mode, T, lay.depth)  # 2d, 2.5d, 3d: a rank sends its block of the activation
        block = {"2d": q * q, "2.5d": q * q * lay.depth, "3d": q ** 3}.get(lay.mode, 1)
        for v, chunk in enumerate(chunks):
            part = _part(lay, p, v)
            down = part < P * lay.chunks - 1 and not _same_rank(lay, part, part + 1)
            up = part > 0 and not _same_rank(lay, part, part - 1)
            c["p2p"] += bsd // block * (down + up)
        if _tied_apart(m, lay) and (0 in layers or head in layers):
            tok = next(t.numel for t in ts if t.name == "tok")
            c["all_reduce"] += (tok + 1) * (2 if lay.zero == 2 and N > 1 else 1)
        c["all_reduce"] += 2
        if N > 1 and head in layers:
            c["all_reduce"] += 1                         # the targets, counted over data ranks
    elif N > 1:
        c["all_reduce"] += lay.accumulation              # the targets, counted over data ranks
    return {k: c.get(k, 0) for k in COLLECTIVES}


def data_parallel_traffic(ts: list[Tensor], lay: Layout, model_ranks: int = 1,
                          experts_split: bool = False, buffers: int = 0) -> Counter:
    """DDP's or ZeRO's elements per step for the parameters `ts` (the table's first rows), and
    the step's: clipping's sum (over the data ranks where ZeRO splits the gradients, over the
    expert group where `experts_split`, then over `model_ranks`), AMP's overflow flag.
    DDP (levels 0-2) also broadcasts the model's `buffers` elements (BatchNorm's statistics) at
    every forward (ddp.py), counted with the all-gathers as gloo's broadcasts are."""
    c: Counter = Counter()
    N = lay.replicas
    psi, n = sum(t.numel for t in ts), len(ts)
    if N > 1 and lay.zero in (0, 1) or lay.zero == 2:  # level 2 reduces even on 1 data rank
        c["all_reduce"] += psi + n
    if N > 1 and lay.zero < 3 and not lay.handler:
        c["all_gather"] += buffers * lay.accumulation
    if N > 1 and lay.zero in (1, 2):
        c["all_gather"] += sum(pad(k, N) for k, _, _ in _buffers(ts, lay))
    if N > 1 and lay.zero == 3:
        units = sum(pad(k, N) for k, _, _ in _buffers(ts, lay))
        k = lay.accumulation  # every micro-step gathers, reduces and flags again
        c["all_gather"] += 2 * units * k
        c["all_reduce" if lay.backend == "gloo" else "reduce_scatter"] += units * k
        c["all_reduce"] += n * k + 2
    if lay.clip:
        c["all_reduce"] += (N > 1 and lay.zero > 0) + experts_split + (model_ranks > 1)
    if lay.world > 1 and (lay.amp or lay.zero == 3):  # ZeRO 3 without AMP refuses a bad step
        c["all_reduce"] += 1                             # any inf / nan, agreed job-wide
    return c


def grid_traffic(m: GPT, lay: Layout, layers: set, k: int) -> Counter:
    """2d / 2.5d / 3d on a grid of side q (2.5d: `depth` grids; gloo counts SUMMA's broadcasts
    as all-gathers and its reduces as all-reduces), k forward passes a step, t = the rows (tokens)
    of an activation block: B S / (q depth) on the grid, B S / q^2 on the cube. A Linear i -> o
    with X = t i / q, W = o i / q^2 (2d) or X = B S i / q^2, W = o i / q^2, Y = B S o / q^2 (3d):

        SUMMA (tensor/summa.py)     forward   broadcast q (X + k W)
                                    backward  broadcast q (X + k W), reduce q (X + k W)
        2.5d (layers_2d.py)         backward  all-reduce k W over the depth group (across_grids)
        cube (tensor/cube.py)       forward   all-gather X + k W, reduce-scatter Y
                                    backward  all-gather Y, reduce-scatter X + k W

    The vocabulary-parallel classifier is the tied table's product: SUMMA's A B^T form (C = t V / q,
    E = V D / q^2: broadcast q k E + q C + q k E, reduce q C + q k E: vocab_parallel_2d.py), the
    cube's column product (layers_3d.py). The embedding: 2d sums the grid's lookups down the
    column (all-reduce B S D / (q depth), gathered back in backward); 3d gathers E along x and
    reduce-scatters the lookups over y (B S D / q^2 each way). Every layout (layers_2d.py):
    a vector along the hidden split (biases, LayerNorms, the position table) has its gradient
    summed over the batch group, k o / q; a LayerNorm's mean and variance are row sums, 2 t
    forward and 2 t backward; the loss is the 1d vocabulary-parallel one along a row (3 t) and
    two sums over the batch (vocab_parallel.py)."""
    c: Counter = Counter()
    T, cube = lay.tensor, lay.mode == "3d"
    q = grid(lay.mode, T, lay.depth)
    d = lay.depth if lay.mode == "2.5d" else 1
    B, S, D, V, r, head = lay.batch, m.seq, m.dim, m.vocab, m.mlp_ratio, m.layers - 1
    t = B * S // (q * q if cube else q * d)

    def linear(i: int, o: int, passes: int = 1) -> None:
        w = k * o * i // (q * q)
        if cube:
            x, y = B * S * i // (q * q), B * S * o // (q * q)
            c["all_gather"] += passes * (x + w) + y
            c["reduce_scatter"] += passes * y + x + w
        else:
            x = t * i // q
            c["all_gather"] += (passes + 1) * q * (x + w)
            c["all_reduce"] += q * (x + w) + (w if d > 1 else 0)
        c["all_reduce"] += k * o // q                 # the bias, summed over the batch group

    def layer_norm(passes: int = 1) -> None:
        c["all_reduce"] += 2 * t * (passes + 1) + 2 * k * D // q

    for layer in layers:
        if 0 < layer < head:
            again = 2 if block_checkpoint(lay, layer) == "full" else 1
            layer_norm(again)
            layer_norm(again)
            for i, o in ((D, 3 * D), (D, D), (D, r * D), (r * D, D)):
                linear(i, o, again)
        elif layer == 0:
            c["all_reduce"] += k * S * D // q         # the position table's gradient
            if cube:
                e, found = k * V * D // (q * q), B * S * D // (q * q)
                c["all_gather"] += e + found
                c["reduce_scatter"] += found + e
            else:
                found = B * S * D // (q * d)
                c["all_reduce"] += found + (k * V * D // (q * q) if d > 1 else 0)
                c["all_gather"] += found
    if head in layers:
        layer_norm()
        e = k * V * D // (q * q)
        if cube:
            x, y = B * S * D // (q * q), B * S * V // (q * q)
            c["all_gather"] += x + e + y
            c["reduce_scatter"] += y + x + e
        else:
            logits = t * V // q
            c["all_gather"] += 2 * q * e + q * logits
            c["all_reduce"] += q * logits + q * e + (e if d > 1 else 0)
        c["all_reduce"] += 3 * t + 2 * k
    return c


def _part(lay: Layout, p: int, chunk: int) -> int:
    return virtual_stage(chunk, p, lay.pipeline, lay.v_shape)


def _same_rank(lay: Layout, a: int, b: int) -> bool:
    return stage_rank(a, lay.pipeline, lay.v_shape) == stage_rank(b, lay.pipeline, lay.v_shape)


def _tied_apart(m: GPT, lay: Layout) -> bool:
    """Whether the embedding and the head sit on two pipeline ranks (pipeline/tied.py sums the
    table's gradients between them); zbv's V puts both on rank 0."""
    holders = {p for p in range(lay.pipeline) for chunk in stage_layers(
        m, lay.pipeline, lay.chunks, p, lay.v_shape) for layer in chunk
        if layer in (0, m.layers - 1)}
    return len(holders) > 1
