"""Ring attention equals plain softmax attention on the whole sequence: output and dq, dk, dv.

The loss is a weighted sum with random weights (not a mean), so a gradient scaled by any
factor (Colossal-AI's /N) fails; the queries are scaled up so that every block has a different
row maximum, so a missing online-softmax rescale fails; causal runs check the mask across
blocks (a rank that saw a future chunk, or missed a past one, fails).
"""
from functools import partial

import pytest
import torch
from dist_helpers import run_ranks
from sequence_runs import attention_reference
from torch.testing import assert_close

import nanocolossal as nc
from nanocolossal.config import ConfigError
from nanocolossal.memory import LargestMade, SavedBytes
from nanocolossal.nn.transformer import Attention
from nanocolossal.tensor import ring_attention as ring
from nanocolossal.tensor.ring_attention import (
    allgather_attention,
    causal_rows,
    gather_sequence,
    has_fused_kernel,
    ring_attention,
    split_sequence,
)
from nanocolossal.traffic import count_collectives

pytestmark = pytest.mark.timeout(120)


def _lesson_worker(rank, world_size, port, q, k, v, w):
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    # my tokens of the sequence (dim 2): stripes r and 2N-1-r of 2N, so causal work is equal
    mine = [split_sequence(t, 2).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*mine, causal=True)  # my queries meet each rank's K/V block in turn
    (out * split_sequence(w, 2)).sum().backward()
    return [gather_sequence(t, 2) for t in (out.detach(), *(t.grad for t in mine))]


def test_gloo_ring_attention_on_two_ranks_equals_full_attention():
    """Causal attention with each rank's queries at home and K/V blocks passed around the ring,
    merged by an online softmax, gives full attention's output and dq, dk, dv (float64)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 16, 4, dtype=torch.float64) for _ in range(3))  # [B, H, S, D]
    q = q * 4  # a sharp softmax: the blocks' row maxima differ, so the rescale matters
    w = torch.randn_like(q)  # a weighted sum as the loss: a wrong gradient scale shows
    q_all, k_all, v_all = (t.clone().requires_grad_() for t in (q, k, v))  # one process
    scores = q_all @ k_all.transpose(-2, -1) * 4 ** -0.5  # all 16 x 16 at once
    scores = scores.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
    out = scores.softmax(-1) @ v_all
    (out * w).sum().backward()
    expected = {"out": out.detach(), "dq": q_all.grad, "dk": k_all.grad, "dv": v_all.grad}
    for rank, got in enumerate(run_ranks(_lesson_worker, 2, q, k, v, w)):
        for (name, want), mine in zip(expected.items(), got):
            assert_close(mine, want, rtol=1e-10, atol=1e-10,
                         msg=lambda m: f"rank {rank} {name}: {m}")


KINDS = {"all-gather": allgather_attention, "ring": ring_attention,
         "fused ring": partial(ring_attention, attention="fused")}


def _compare(rank, causal, dtype, tol, group=None):
    torch.manual_seed(0)  # the same whole sequence on every rank
    n = torch.distributed.get_world_size(group)
    B, H, S, D = 2, 3, 8 * n, 4
    q, k, v = (torch.randn(B, H, S, D, dtype=dtype) for _ in range(3))
    q = q * 4  # sharp softmax: block maxima differ, so the rescale matters
    w = torch.randn(B, H, S, D, dtype=dtype)  # loss weights: a wrong gradient scale shows
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = attention_reference(*full, causal)
    (ref * w).sum().backward()

    kw = dict(rtol=tol, atol=tol) if tol else {}
    for label, attention in KINDS.items():
        local = [split_sequence(t, 2, group).requires_grad_() for t in (q, k, v)]
        out = attention(*local, group=group, causal=causal)
        (out * split_sequence(w, 2, group)).sum().backward()
        assert_close(out, split_sequence(ref.detach(), 2, group), **kw)
        assert_close(gather_sequence(out.detach(), 2, group), ref.detach(), **kw)
        for name, mine, theirs in zip("qkv", local, full):
            assert_close(mine.grad, split_sequence(theirs.grad, 2, group), **kw,
                         msg=lambda m, a=label, n=name: f"{a} d{n}, rank {rank}: {m}")
    return True


def _both_precisions(rank, world_size, port, causal):
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    _compare(rank, causal, torch.float32, None)  # assert_close's fp32 default
    return _compare(rank, causal, torch.float64, 1e-10)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_deep_ring_attention_equals_full_attention(world_size, causal):
    assert all(run_ranks(_both_precisions, world_size, causal, timeout=90))


def _in_subgroups(rank, world_size, port):
    """Two rings, {0, 2} and {1, 3}: group ranks are not global ranks."""
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    groups = [torch.distributed.new_group([0, 2]), torch.distributed.new_group([1, 3])]
    return _compare(rank, True, torch.float64, 1e-10, group=groups[rank % 2])


def test_deep_ring_attention_in_subgroups():
    assert all(run_ranks(_in_subgroups, 4, timeout=90))


def _split_layout(rank, world_size, port):
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    x = torch.arange(4 * world_size).view(1, -1)
    mine = split_sequence(x, 1, None)
    c = 2
    want = torch.cat([x[:, rank * c:(rank + 1) * c],
                      x[:, (2 * world_size - 1 - rank) * c:(2 * world_size - rank) * c]], 1)
    assert torch.equal(mine, want), (mine, want)
    assert torch.equal(gather_sequence(mine, 1, None), x)
    # ConfigErrors: a sequence length is the user's to choose, said in one line
    with pytest.raises(ConfigError, match=rf"\[rank {rank}\].*length 10.*multiple of "
                                          rf"{2 * world_size}"):
        split_sequence(torch.zeros(1, 10), 1, None)
    with pytest.raises(ConfigError, match=rf"\[rank {rank}\].*odd length 3"):
        ring_attention(*(torch.zeros(1, 1, 3, 2) for _ in range(3)))
    return True


def test_deep_zigzag_layout_and_bad_lengths():
    assert all(run_ranks(_split_layout, 4))


@pytest.mark.parametrize("n", [2, 4, 8])
def test_causal_work_is_balanced(n):
    """Score elements each rank computes over the N ring steps: equal on every rank."""
    c = 16  # chunk length; a rank holds 2c tokens
    rows = {"all": 2 * c, "first": c, "second": c}
    work = []
    for r in range(n):
        steps = [causal_rows(r, (r - t) % n, n, causal=True) for t in range(n)]
        work.append(sum(rows[qp] * rows[kp] // (2 if masked else 1) for qp, kp, masked in steps))
    assert work == [(2 * c) ** 2 // 2 + (n - 1) * 2 * c * c] * n


B, H, D = 2, 3, 4


def _run_counted(s):
    """Forward and backward of one call on a sequence of s tokens, from transposed
    (non-contiguous) views as a model makes them: the elements each sends (traffic.py), and the
    largest tensor made (a block of scores)."""
    torch.manual_seed(0)
    q, k, v = (split_sequence(torch.randn(B, s, H, D), 1, None).requires_grad_() for _ in "qkv")
    with count_collectives() as forward, LargestMade() as made:
        out = ring_attention(*(t.transpose(1, 2) for t in (q, k, v)))
    with count_collectives() as backward, made:
        out.sum().backward()
    return forward["batch_isend_irecv"], backward["batch_isend_irecv"], made.most


def _counts(rank, world_size, port):
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    return _run_counted(8 * world_size)


@pytest.mark.parametrize("n", [2, 4])
def test_deep_ring_sends_n_minus_1_blocks_and_holds_one_block_of_scores(n):
    s = 8 * n
    # one process: nothing sent, the whole s x s scores at once
    assert _run_counted(s) == (0, 0, B * H * s * s)
    pair = 2 * B * H * (s // n) * D  # a K/V (or dK/dV) block pair
    for counted in run_ranks(_counts, n, timeout=60):
        # forward: N-1 K/V pairs; backward: N-1 again, and N dK/dV pairs (the last one home)
        assert counted == ((n - 1) * pair, (2 * n - 1) * pair, B * H * (s // n) ** 2), counted


def test_fused_blocks_run_where_a_kernel_exists(monkeypatch):
    """attention='fused' takes the CPU kernel in float32 and float64 (bf16 computes in float32)
    and the explicit blocks where there is none; the explicit blocks make their scores, the
    kernel's are never a tensor. One process: the ring's one block is the whole sequence."""
    assert has_fused_kernel("cpu", torch.float64) and has_fused_kernel("cpu", torch.float32)
    assert not has_fused_kernel("cuda", torch.float32)
    s = 8
    q_size, scores = B * H * s * D, B * H * s * s  # s > D: the scores are the larger
    for dtype, attention, kernel, most in [(torch.float64, "fused", True, q_size),
                                           (torch.bfloat16, "fused", True, q_size),
                                           (torch.float64, "explicit", True, scores),
                                           (torch.float64, "fused", False, scores)]:
        monkeypatch.setattr(ring, "has_fused_kernel", lambda *_, k=kernel: k)  # CUDA's answer
        q = torch.randn(B, H, s, D, dtype=dtype)
        with LargestMade() as made:
            ring_attention(q, q, q, attention=attention)
        assert made.most == most, (dtype, attention, kernel)
    with pytest.raises(ValueError, match="attention='flash'"):
        ring_attention(q, q, q, attention="flash")


def _memory(rank, world_size, port, c):
    nc.launch(dict(parallel=dict(tensor=dict(size=world_size, mode="sequence"))), rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    torch.manual_seed(0)
    qkv = [split_sequence(torch.randn(B, H, c * world_size, D, dtype=torch.float64), 2, None)
           for _ in "qkv"]
    got = {}
    for attention in ("explicit", "fused"):
        local = [t.clone().requires_grad_() for t in qkv]
        with SavedBytes([]) as saved, LargestMade() as made:
            ring_attention(*local, attention=attention).sum().backward()
        # a model's Attention hands its choice to the ring: only explicit blocks make scores
        model = Attention(2 * D, heads=2, causal=True, attention=attention).double()
        with LargestMade() as in_model:
            model(torch.randn(B, c, 2 * D, dtype=torch.float64)).sum().backward()
        got[attention] = saved.peak, made.most, in_model.most
    return got


def test_deep_fused_ring_makes_no_block_of_scores():
    """Saved for backward by either kind: q, k, v, out and lse (the explicit ring recomputes
    its blocks in backward too). Made while running forward and backward: the explicit ring's
    largest tensor is one (s/N)^2 block of scores per head, the fused ring's no larger than q."""
    c = 32  # tokens per rank, > D: a block of scores is larger than q
    saved = (4 * D + 1) * B * H * c * 8  # bytes: q, k, v, out (float64) and lse
    for got in run_ranks(_memory, 2, c, timeout=60):
        assert got["explicit"][:2] == (saved, B * H * c * c), got
        assert got["fused"][:2] == (saved, B * H * c * D), got
        assert got["explicit"][2] == B * 2 * c * c > got["fused"][2], got


def _half(rank, world_size, port):
    """bf16 inputs, under autocast as a model runs them: ring attention's error against float64,
    explicit or fused blocks, is no larger than one process's softmax attention in the same
    autocast."""
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, 16 * world_size, D, dtype=torch.float64) for _ in "qkv")
    exact = split_sequence(attention_reference(q, k, v, True), 2, None)
    errors = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = [t.to(torch.bfloat16) for t in (q, k, v)]
        plain = split_sequence(attention_reference(*half, True), 2, None)
        for attention in ("explicit", "fused"):
            ring = ring_attention(*(split_sequence(t, 2, None) for t in half), attention=attention)
            assert ring.dtype == torch.bfloat16
            errors.append((ring.double() - exact).abs().max().item())
    return errors, (plain.double() - exact).abs().max().item()


def test_gloo_ring_attention_in_bf16_is_as_accurate_as_one_process():
    for ring_errors, plain_err in run_ranks(_half, 2, timeout=60):
        assert max(ring_errors) <= plain_err * 1.01, (ring_errors, plain_err)


def _padded(rank, world_size, port, causal, attention):
    """Right padding of a different length per sequence (the third all padding, the fourth all
    but 3 tokens: whole blocks of padding) and every other key padded (a row can see nothing in
    one block and something in another): equal to one process's masked softmax in float64,
    output and dq/dk/dv; all-padding rows give 0."""
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    torch.manual_seed(0)
    S = 8 * world_size
    q, k, v = (torch.randn(5, H, S, D, dtype=torch.float64) for _ in "qkv")
    w = torch.randn(5, H, S, D, dtype=torch.float64)
    pad = torch.arange(S)[None, :] >= torch.tensor([S, S - 5, 0, 3, S])[:, None]  # True: padding
    pad[4] = torch.arange(S) % 2 == 0
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    s = full[0] @ full[1].transpose(-2, -1) * D ** -0.5
    s = s.masked_fill(pad[:, None, None, :], float("-inf"))
    if causal:
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    blind = s.isneginf().all(-1, keepdim=True)  # sees only padding: softmax is NaN, use 0
    ref = s.masked_fill(blind, 0).softmax(-1).masked_fill(blind, 0) @ full[2]
    (ref * w).sum().backward()
    local = [split_sequence(t, 2, None).requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, causal=causal, key_padding_mask=split_sequence(pad, 1, None),
                         attention=attention)
    (out * split_sequence(w, 2, None)).sum().backward()
    assert_close(out, split_sequence(ref.detach(), 2, None), rtol=1e-10, atol=1e-10)
    assert torch.equal(out[2], torch.zeros_like(out[2])), "an all-padding sequence gives 0"
    for name, mine, theirs in zip("qkv", local, full):
        assert_close(mine.grad, split_sequence(theirs.grad, 2, None), rtol=1e-10,
                     atol=1e-10, msg=lambda m, n=name: f"d{n}: {m}")
    return True


@pytest.mark.parametrize("attention", ["explicit", "fused"])
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_deep_ring_attention_with_a_padding_mask_equals_masked_attention(world_size, causal,
                                                                         attention):
    assert all(run_ranks(_padded, world_size, causal, attention, timeout=60))
