"""Ring attention: exact softmax attention over a sequence split across N ranks.

Sequence parallelism gives every rank 1/N of each sequence. Everything but attention works
on the local tokens alone; attention needs every query to meet every key. The naive way is
to all-gather K and V (allgather_attention below, kept as the baseline: each rank then holds
the whole sequence's keys and an (s/N) x s score matrix; autograd does its backward). Ring
attention instead keeps each rank's queries at home and passes the K/V shares around a ring,
one neighbour per step, so a rank only ever holds one (s/N)^2 tile of scores and two K/V
shares (the one it computes with, the one arriving). A key padding mask rides with its K/V
share, as an additive bias (0 or -inf) on the scores.

The ring (N = 4; rank r sends to r+1, receives from r-1; "K1" is rank 1's K/V share):

    step    rank 0   rank 1   rank 2   rank 3
    0       K0       K1       K2       K3       (own share; send it on meanwhile)
    1       K3       K0       K1       K2
    2       K2       K3       K0       K1
    3       K1       K2       K3       K0       (N-1 = 3 transfers; the last share is not sent)

At step t rank r holds the share of rank (r - t) mod N. The transfer of the next share runs
while this one is computed.

Online softmax. softmax needs a row's maximum and sum over *all* keys, which no rank sees at
once. So each rank keeps, per query row, a running max m, a running sum l = sum exp(s - m)
and an unnormalised output acc = sum exp(s - m) v. A new tile of scores s_b updates them:

    m' = max(m, rowmax(s_b))
    l' = l * exp(m - m') + rowsum(exp(s_b - m'))
    acc' = acc * exp(m - m') + exp(s_b - m') @ v_b

and after the last tile out = acc / l. The rescale by exp(m - m') makes the result exactly
softmax(s) @ v (up to rounding) whatever order the tiles come in. lse = m + log l is kept
for backward. (The code takes a tile's sums relative to its own row max mb and rescales them
by exp(mb - m'): the same numbers, and the form the fused tiles below need.)

Backward (this is a custom autograd.Function, FlashAttention-2's recomputation, not autograd
through the ring): with delta = rowsum(dO * O) and p = exp(s - lse) recomputed per tile,

    dV_b = p^T dO,   dS = p * (dO V_b^T - delta) * scale,   dQ += dS K_b,   dK_b = dS^T Q

dQ stays home. dK_b, dV_b belong to the share's owner: they travel around the ring with the
share, each rank adding its contribution, and one more hop delivers them home (K/V: N-1
transfers, dK/dV: N). Gradients are exact: nothing is averaged or divided by N (Colossal-AI's
ring self-attention divides dq/dk/dv by N; the tests here use a weighted sum loss so a
factor like that would fail them).

Causal load balance. Cut the sequence into N contiguous shares and rank N-1's queries see
all N key shares while rank 0's see one: the ring waits for the last rank, N times the work
of the first. The zig-zag split (Megatron's context parallelism) cuts the sequence into 2N
stripes and gives rank r stripes r and 2N-1-r (N = 2: rank 0 holds stripes 0 and 3, rank 1
stripes 1 and 2). With c the stripe length, rank r facing the share of rank s:

    s == r   both stripes, causal mask inside (local order = global order) -> 2c x 2c, half masked
    s <  r   all queries see the earlier stripe s, none the later 2N-1-s   -> 2c x c, no mask
    s >  r   only the later stripe 2N-1-r sees anything, and sees both      -> c x 2c, no mask

Every off-diagonal step is half a tile on every rank and tiles entirely in the future are
never computed: each rank does the same work, (2c)^2 / 2 + (N - 1) * 2c^2 score elements.
Non-causal attention works on any split; split_sequence uses the zig-zag one always, so a
model has one layout.

Fused tiles (attention='fused'). A fused attention kernel computes a tile's softmax(s_b) v_b
tile by tile, never holding s_b, and returns lse_b = log rowsum exp(s_b) with it. That is all
the online softmax needs: rowsum exp(s_b - m') = exp(lse_b - m') and exp(s_b - m') v_b =
exp(lse_b - m') out_b, so a tile enters the same update with max lse_b, sum 1, output out_b.
Backward calls the kernel's backward op per tile with the *whole* row's out and lse, not the
tile's: it recomputes delta = rowsum(dO * O) and p = exp(s - lse) piecewise, which makes its
dq, dK_b, dV_b exactly the tile's part of the sums above. No (s/N)^2 tensor exists, forward or
backward; the ring around the tiles (transfers, plan, dK/dV going home) is the same code.
torch's context parallelism (torch.distributed.tensor.experimental) does this on CUDA's kernels.

Which path runs (half inputs compute in float32 either way, see ring_attention):

    attention=   device   computed in        each tile by
    'explicit'   any      float32, float64   the formulas above, scores as a tensor
    'fused'      cpu      float32, float64   aten._scaled_dot_product_flash_attention_for_cpu;
                                             padding as its attn_mask, the diagonal is_causal
    'fused'      other    any                the explicit tiles (CUDA's flash / efficient
                                             kernels are not wired in here)

Inputs. q, k, v: [b, heads, s/N, head_dim], this rank's tokens in split_sequence's zig-zag
layout (causal needs it; non-causal accepts any split). key_padding_mask: [b, s/N], True where
a key is padding (split like the tokens); a query that sees only padding gets 0. attention: how
each tile is computed (the table above; a model's Attention passes its own). Half inputs (or
autocast) compute in float32, as FlashAttention keeps its softmax sums: running sums of exp()
over N tiles in a half type lose precision. (One process computes its softmax in fp32 under O1
but in the half type under O2/O3: there the ring is finer.)

Before a launch, `nanocolossal plan` computes these elements sent (nanocolossal/plan/traffic.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .layer_checks import check_ring_inputs
from .zigzag import Group, gather_sequence, size_and_rank, split_sequence, zigzag_stripes

__all__ = ["ring_attention", "allgather_attention", "split_sequence", "gather_sequence",
           "causal_rows", "has_fused_kernel"]
ALL, FIRST, SECOND = "all", "first", "second"


def causal_rows(r: int, s: int, n: int, causal: bool) -> tuple[str, str, bool]:
    """Which of my query rows meet which rows of rank s's K/V share: (queries, keys, masked)."""
    if not causal:
        return ALL, ALL, False
    if s == r:
        return ALL, ALL, True
    return (ALL, FIRST, False) if s < r else (SECOND, ALL, False)


def _rows(x: torch.Tensor, part: str) -> torch.Tensor:
    h = x.shape[-2] // 2
    return x if part == ALL else x[..., :h, :] if part == FIRST else x[..., h:, :]


# ---- the naive version: all-gather K and V --------------------------------------------------

class _GatherSequence(torch.autograd.Function):
    """gather_sequence forward; backward sums every rank's dK (each saw other queries) and
    keeps my share: a reduce-scatter, written as all-reduce + split."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim = dim
        ctx.group = group
        return gather_sequence(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return split_sequence(grad, ctx.dim, ctx.group), None, None


def allgather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group = None,
                        causal: bool = True) -> torch.Tensor:
    """The naive baseline (the module docstring): the whole K and V, (s/N) x s scores at once."""
    n, r = size_and_rank(group)
    if n == 1:
        return _scores(q, k, q.shape[-1] ** -0.5, causal).softmax(-1) @ v
    k_all, v_all = (_GatherSequence.apply(t, -2, group) for t in (k, v))
    s = q @ k_all.transpose(-2, -1) * q.shape[-1] ** -0.5
    if causal:  # my rows are stripes a and b of the whole sequence: mask by global position
        c, (a, b) = q.shape[-2] // 2, zigzag_stripes(n, r)
        q_pos = torch.cat([torch.arange(a * c, (a + 1) * c), torch.arange(b * c, (b + 1) * c)])
        ahead = torch.arange(k_all.shape[-2])[None, :] > q_pos[:, None]
        s = s.masked_fill(ahead.to(s.device), float("-inf"))
    return s.softmax(-1) @ v_all


# ---- the ring ----------------------------------------------------------------------------------

def _ring_shift(tensors: list[torch.Tensor], group: Group, tag: int) -> tuple[list, list]:
    """Start sending `tensors` to the next rank and receiving the previous rank's; (bufs, works).
    (traffic.py counts what it sends: the tests check the ring's hops by it.)"""
    n, r = size_and_rank(group)
    g = group if group is not None else dist.group.WORLD
    nxt, prv = dist.get_global_rank(g, (r + 1) % n), dist.get_global_rank(g, (r - 1) % n)
    # contiguous: q/k/v are often transposed views, and a receive needs one dense buffer
    bufs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group, tag + i)
           for i, t in enumerate(tensors)]
    ops += [dist.P2POp(dist.irecv, b, prv, group, tag + i) for i, b in enumerate(bufs)]
    return bufs, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _mask(kv: list, part: str) -> Optional[torch.Tensor]:
    return _rows(kv[2], part) if len(kv) > 2 else None


def _scores(q, k, scale: float, masked: bool, bias=None) -> torch.Tensor:
    s = q @ k.transpose(-2, -1) * scale
    if bias is not None:  # [B, 1, keys, 1]: -inf for a padding key
        s = s + bias.transpose(-2, -1)
    if masked:  # the diagonal tile: same positions on both sides, plain causal mask
        ahead = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(ahead, float("-inf"))
    return s


def _ring(kv: list, group: Group):
    """Yield (t, kv): at step t the K/V share of rank (r - t) mod N, the next one travelling
    while the caller computes with this one."""
    n, _ = size_and_rank(group)
    for t in range(n):
        if t < n - 1:
            nxt, works = _ring_shift(kv, group, tag=0)
        yield t, kv
        if t < n - 1:
            _wait(works)
            kv = nxt


def _explicit_tile(q, k, v, bias, masked: bool, scale: float):
    """One tile as the formula reads: (row max mb, rowsum exp(s - mb), exp(s - mb) @ v)."""
    s = _scores(q, k, scale, masked, bias)
    mb = s.amax(-1, keepdim=True)
    p = torch.exp(s - mb.nan_to_num(neginf=0.0))  # a row that sees only padding: all 0
    return mb, p.sum(-1, keepdim=True), p @ v


def _explicit_grads(q, k, v, bias, masked: bool, scale: float, out, dout, lse):
    """dq, dk, dv of one tile from the whole row's out and lse (the formulas above)."""
    p = torch.exp(_scores(q, k, scale, masked, bias) - lse)
    ds = p * (dout @ v.transpose(-2, -1) - (dout * out).sum(-1, keepdim=True)) * scale
    return ds @ k, ds.transpose(-2, -1) @ q, p.transpose(-2, -1) @ dout


def _merge(m, l, acc, mb, lb, accb) -> None:  # noqa: E741 -- the paper's names
    """The online softmax (above): fold a tile's (mb, lb, accb) into (m, l, acc), in place."""
    m_new = torch.maximum(m, mb)
    m_safe = m_new.nan_to_num(neginf=0.0)  # a row that saw only padding stays at 0
    alpha, beta = torch.exp(m - m_safe), torch.exp(mb - m_safe)
    l.mul_(alpha).add_(lb * beta)
    acc.mul_(alpha).add_(accb * beta)
    m.copy_(m_new)


class _RingAttention(torch.autograd.Function):
    """The ring, forward and backward, around either kind of tile (`fused`: a fused kernel's
    (out, lse) and its backward op; else _explicit_tile and _explicit_grads)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, group, causal, fused):
        n, r = size_and_rank(group)
        scale = q.shape[-1] ** -0.5
        tile = _fused_tile if fused else _explicit_tile
        m = torch.full(q.shape[:-1] + (1,), float("-inf"), dtype=q.dtype, device=q.device)
        l = torch.zeros_like(m)  # noqa: E741 -- the paper's name
        acc = torch.zeros_like(q)
        kv = [k, v] + ([bias] if bias is not None else [])  # a padding mask travels with keys
        for t, kv in _ring(kv, group):
            qp, kp, masked = causal_rows(r, (r - t) % n, n, causal)
            got = tile(_rows(q, qp), _rows(kv[0], kp), _rows(kv[1], kp), _mask(kv, kp),
                       masked, scale)
            _merge(_rows(m, qp), _rows(l, qp), _rows(acc, qp), *got)  # views: in place
        out = acc / l.clamp_min(torch.finfo(l.dtype).tiny)  # an all-padding row: 0, not 0/0
        ctx.save_for_backward(q, k, v, bias, out, (m + torch.log(l)).nan_to_num(neginf=torch.inf))
        ctx.group = group
        ctx.causal = causal
        ctx.scale = scale
        ctx.fused = fused
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, bias, out, lse = ctx.saved_tensors
        n, r = size_and_rank(ctx.group)
        grads = _fused_grads if ctx.fused else _explicit_grads
        dout = dout.contiguous()
        dq = torch.zeros_like(q)
        dkv, dworks = None, []
        for t, kv in _ring([k, v] + ([bias] if bias is not None else []), ctx.group):
            qp, kp, masked = causal_rows(r, (r - t) % n, n, causal=ctx.causal)
            dqb, dkb, dvb = grads(_rows(q, qp), _rows(kv[0], kp), _rows(kv[1], kp),
                                  _mask(kv, kp), masked, ctx.scale, _rows(out, qp),
                                  _rows(dout, qp), _rows(lse, qp))
            _rows(dq, qp).add_(dqb)
            dk = torch.zeros_like(k)
            dv = torch.zeros_like(v)
            _rows(dk, kp).copy_(dkb)
            _rows(dv, kp).copy_(dvb)
            if dkv is not None:  # the share's gradient so far, from the rank before me
                _wait(dworks)
                dk, dv = dk + dkv[0], dv + dkv[1]
            if n > 1:  # pass it on; after step N-1 this hop delivers it to its owner
                dkv, dworks = _ring_shift([dk, dv], ctx.group, tag=2)
        if n > 1:
            _wait(dworks)
            dk, dv = dkv
        return dq, dk, dv, None, None, None, None


# ---- the optimised version: fused tiles ----------------------------------------------------

_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def has_fused_kernel(device_type: str, dtype: torch.dtype) -> bool:
    """Whether attention='fused' has a kernel for these tiles (the table above)."""
    return device_type == "cpu" and dtype in (torch.float32, torch.float64)


def _fused_tile(q, k, v, bias, masked: bool, scale: float):
    """One tile by the fused kernel (Fused tiles above): (mb, lb, accb) = (lse, 1, out)."""
    mask = None if bias is None else bias.transpose(-2, -1)  # [B, 1, 1, keys]
    out, lse = _CPU_FLASH(q, k, v, 0.0, masked, attn_mask=mask, scale=scale)
    lse = lse.unsqueeze(-1)
    if mask is not None:  # the kernel gives a row that sees only padding lse 0, not -inf
        sees = ~mask.isinf()  # diagonal: row i sees keys 0..i; else all of them
        sees = sees.cumsum(-1) > 0 if masked else sees.any(-1, keepdim=True)
        lse = lse.masked_fill(~sees.transpose(-2, -1), float("-inf"))
    return lse, 1.0, out


def _fused_grads(q, k, v, bias, masked: bool, scale: float, out, dout, lse):
    """dq, dk, dv of one tile by the kernel's backward, from the whole row's out and lse."""
    mask = None if bias is None else bias.transpose(-2, -1)
    return _CPU_FLASH_BACKWARD(dout, q, k, v, out, lse.squeeze(-1).contiguous(), 0.0, masked,
                               attn_mask=mask, scale=scale)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group = None,
                   causal: bool = True, key_padding_mask: Optional[torch.Tensor] = None,
                   attention: str = "explicit") -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v over the whole sequence, [b, heads, s/N, head_dim] per rank
    in split_sequence's layout; key_padding_mask [b, s/N] (the module docstring: Inputs)."""
    check_ring_inputs(q, k, v, size_and_rank(group)[0], causal, attention)
    dtype = torch.promote_types(q.dtype, torch.float32)  # half inputs: float32 (Inputs)
    bias = None
    if key_padding_mask is not None:  # as an additive [B, 1, keys, 1] bias: 0 or -inf
        bias = torch.zeros(q.shape[0], 1, q.shape[-2], 1, dtype=dtype, device=q.device)
        bias.masked_fill_(key_padding_mask[:, None, :, None].to(q.device), float("-inf"))
    with torch.autocast(q.device.type, enabled=False):
        out = _RingAttention.apply(q.to(dtype), k.to(dtype), v.to(dtype), bias, group, causal,
                                   attention == "fused" and has_fused_kernel(q.device.type, dtype))
    return out.to(q.dtype)
