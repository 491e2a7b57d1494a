"""Ulysses (all-to-all) attention equals attention on the whole sequence in one process.

The lesson first: 2 gloo ranks, float64, causal, output and gradients. Then the attention at 2
and 4 ranks, lengths 2N does not divide and padding masks.
"""
import pytest
import torch
from dist_helpers import run_ranks
from test_ring_attention import _reference
from torch.testing import assert_close

import nanocolossal as nc
from nanocolossal.tensor.ulysses import ulysses_attention
from nanocolossal.tensor.zigzag import split_sequence, zigzag_split


def _lesson(rank, world_size, port):
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    torch.manual_seed(0)  # every rank draws the same whole sequence: [batch, heads, 16, 8]
    q, k, v, w = (torch.randn(2, 4, 16, 8, dtype=torch.float64) for _ in range(4))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = _reference(*whole, causal=True)  # softmax(q k^T / sqrt(d) + mask) v, one process
    (expected * w).sum().backward()  # weights w: a gradient off by any factor shows
    mine = [split_sequence(t, 2).requires_grad_() for t in (q, k, v)]  # my zig-zag tokens
    out = ulysses_attention(*mine, causal=True)
    (out * split_sequence(w, 2)).sum().backward()
    assert_close(out, split_sequence(expected.detach(), 2), rtol=1e-12, atol=1e-12)
    for name, t, one in zip("qkv", mine, whole):
        assert_close(t.grad, split_sequence(one.grad, 2), rtol=1e-12, atol=1e-12, msg=name)
    return True


def test_gloo_ulysses_attention_equals_one_process_forward_and_gradients():
    assert run_ranks(_lesson, 2) == [True, True]


# -- the attention alone: more ranks, any length, padding --------------------------------------

def _masked_reference(q, k, v, causal, padding):
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    s = s.masked_fill(padding[:, None, None, :], float("-inf"))
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return (s.softmax(-1) @ v).nan_to_num(0.0)  # torch: NaN where a row saw only padding


def _attention(rank, world_size, port, length, causal, pad):
    """[3, 4 heads, length, 2] in float64, queries sharpened (a wrong reorder shows); with `pad`
    right padding of a different length per sequence, the last all padding."""
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    torch.manual_seed(0)
    q, k, v, w = (torch.randn(3, 4, length, 2, dtype=torch.float64) for _ in range(4))
    q = q * 4
    ends = torch.tensor([length, length - 5, 0] if pad else [length] * 3)
    padding = torch.arange(length)[None, :] >= ends[:, None]
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = _masked_reference(*whole, causal, padding)
    (expected * w).sum().backward()
    mine_of = lambda t, dim: zigzag_split(t, dim, world_size, rank, even=False)  # noqa: E731
    mine = [mine_of(t, 2).requires_grad_() for t in (q, k, v)]
    out = ulysses_attention(*mine, causal=causal,
                            key_padding_mask=mine_of(padding, 1) if pad else None)
    (out * mine_of(w, 2)).sum().backward()
    assert_close(out, mine_of(expected.detach(), 2), rtol=1e-10, atol=1e-10)
    if pad and rank == 0:
        assert torch.equal(out[2], torch.zeros_like(out[2])), "an all-padding sequence gives 0"
    for name, t, one in zip("qkv", mine, whole):
        assert_close(t.grad, mine_of(one.grad.nan_to_num(0.0), 2), rtol=1e-10, atol=1e-10,
                     msg=lambda m, n=name: f"d{n}, rank {rank}: {m}")
    return len(mine[0][0, 0])  # my share's length


ATTENTION_CASES = {  # name: (ranks, length, causal, padding)
    "x2 causal": (2, 16, True, False),
    "x4 causal": (4, 32, True, False),
    "x2 full": (2, 16, False, False),
    "x2, 13 tokens (odd) causal": (2, 13, True, False),
    "x4, 10 tokens (2N = 8 does not divide) causal": (4, 10, True, False),
    "x4, 6 tokens (fewer than 2N chunks) full": (4, 6, False, False),
    "x2 causal, padding": (2, 16, True, True),
    "x4, 10 tokens full, padding": (4, 10, False, True),
}


@pytest.mark.parametrize("name", ATTENTION_CASES)
def test_gloo_ulysses_attention_any_length_and_padding_equals_one_process(name):
    world, length, causal, pad = ATTENTION_CASES[name]
    shares = run_ranks(_attention, world, length, causal, pad, timeout=60)
    assert sum(shares) == length and (max(shares) > min(shares)) == bool(length % (2 * world))
