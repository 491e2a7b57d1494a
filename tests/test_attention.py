"""Attention two ways (nn/transformer.py): the fused kernel equals softmax(q k^T / sqrt(d)) v.

In float64 the two agree to rounding, forward and backward, causal or not, in one block and in
the whole GPT; the same holds where the heads are split over 1d tensor ranks. Attention dropout:
the fused kernel draws from torch's default generator, and a sharded dropout (heads split) keeps
its own per-rank generator by taking the explicit path. On CUDA, bf16: the flash kernel against
the explicit one, to bf16's precision.
"""
import sys

import pytest
import torch
from dist_helpers import ROOT, run_ranks
from torch.testing import assert_close

import nanocolossal as nc
from nanocolossal.context import gpc
from nanocolossal.nn.transformer import Attention, Block
from nanocolossal.tensor.base import slice_of

sys.path.insert(0, str(ROOT))
from train_gpt import gpt  # noqa: E402

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (CI has none)")


def _pair(kind, *args, seed=0, dtype=torch.float64, device="cpu", **kwargs):
    """The fused and the explicit module, with the same weights."""
    made = []
    for attention in ("fused", "explicit"):
        torch.manual_seed(seed)
        made.append(kind(*args, attention=attention, **kwargs).to(device, dtype))
    return made


def _run(module, x):
    """The output and the gradients of x and of every parameter, for a fixed upstream."""
    x = x.detach().clone().requires_grad_()
    out = module(x)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype,
                                device=out.device).reshape(out.shape))
    grads = {name: p.grad for name, p in module.named_parameters()}
    return out.detach(), x.grad, grads


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_fused_attention_equals_the_explicit_formula_in_float64(causal):
    fused, explicit = _pair(Attention, 16, 4, causal=causal)
    x = torch.randn(3, 10, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got, want = _run(fused, x), _run(explicit, x)
    assert_close(got[0], want[0], msg="output")
    assert_close(got[1], want[1], msg="d input")
    for name in want[2]:
        assert_close(got[2][name], want[2][name], msg=lambda m, n=name: f"d {n}: {m}")
    if causal:  # the mask is really applied: the first token sees only itself
        first = fused.proj(fused.qkv(x).view(3, 10, 4, 3, 4)[:, :1, :, 2].reshape(3, 1, 16))
        assert_close(got[0][:, :1], first)


def test_the_gpt_trains_alike_with_either_attention():
    """Two AdamW steps of train_gpt's model in float64: the same losses and weights."""
    models = _pair(gpt, vocab=32, seq_len=12, dim=16, depth=2, heads=4)
    ids = torch.randint(0, 32, (4, 13), generator=torch.Generator().manual_seed(2))
    losses = []
    for model in models:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        steps = []
        for _ in range(2):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1),
                                                     ids[:, 1:].flatten())
            loss.backward()
            opt.step()
            steps.append(loss.detach())
        losses.append(torch.stack(steps))
    assert_close(losses[0], losses[1])
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert_close(p, q, msg=lambda m, n=name: f"{n}: {m}")


def test_attention_refuses_an_unknown_kind():
    with pytest.raises(ValueError, match="attention='flash'.*'fused', 'explicit'"):
        Attention(16, 4, attention="flash")


def test_fused_dropout_draws_from_torch_default_generator():
    """Training with attention dropout: the fused kernel's mask comes from torch's generator
    (same seed, same output), and evaluation turns it off (the explicit formula's output)."""
    fused, explicit = _pair(Attention, 16, 4, dropout=0.5, causal=True)
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    outs = []
    for _ in range(2):
        torch.manual_seed(5)
        outs.append(fused(x))
    assert torch.equal(outs[0], outs[1])
    fused.eval(), explicit.eval()
    assert not torch.allclose(outs[0], fused(x)), "dropout was on while training"
    assert_close(fused(x), explicit(x))


def test_a_sharded_attention_dropout_takes_the_explicit_path():
    """Heads split over tensor ranks need a different mask on each rank: nn/layers.py's Dropout
    draws it from a per-rank generator (tensor/base.py), which the fused kernel cannot use."""
    outs = []
    for module in _pair(Attention, 16, 4, dropout=0.5, causal=True):
        module.attn_drop.sharded = True  # as after a column-parallel qkv (1d) or in 2d
        gpc.dropout_generators.clear()  # both start from the per-rank generator's seed
        torch.manual_seed(7)
        outs.append(module(torch.ones(2, 8, 16, dtype=torch.float64)))
    gpc.dropout_generators.clear()
    assert torch.equal(outs[0], outs[1])


def _tensor_parallel_block(rank, world_size, port, x, upstream, expected):
    """A 1d block (heads split over the ranks) with fused attention, in float64."""
    nc.launch({"parallel": {"tensor": {"size": world_size, "mode": "1d"}}}, rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    torch.manual_seed(0)  # the slices of the plain block built under the same seed
    block = Block(16, 4, causal=True).double()
    out = block(x)
    out.backward(upstream)
    assert_close(out.detach(), expected["out"], msg="output")
    for name, p in block.named_parameters():
        assert_close(p.grad, slice_of(expected[name], getattr(p, "tensor_splits", [])),
                     msg=lambda m, n=name: f"[rank {rank}] d {n}: {m}")
    return block.attn.attention


def test_gloo_fused_attention_on_1d_heads_equals_one_explicit_block():
    torch.manual_seed(0)
    explicit = Block(16, 4, causal=True, attention="explicit").double()
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    upstream = torch.randn(2, 6, 16, dtype=torch.float64)
    out = explicit(x)
    out.backward(upstream)
    expected = {"out": out.detach(), **{n: p.grad for n, p in explicit.named_parameters()}}
    assert run_ranks(_tensor_parallel_block, 2, x, upstream, expected,
                     timeout=60) == ["fused"] * 2


# -- CUDA ----------------------------------------------------------------------------------------

@CUDA
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_cuda_bf16_fused_attention_equals_the_explicit_one(causal):
    """Under bf16 autocast the flash / memory-efficient kernel and the explicit formula (its
    softmax in float32) are both within bf16's precision of the float64 result."""
    x = torch.randn(4, 256, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    exact = _run(_pair(Attention, 128, 4, causal=causal, device="cuda")[1], x.double())
    for module in _pair(Attention, 128, 4, causal=causal, dtype=torch.float32, device="cuda"):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got = _run(module, x)
        assert got[0].dtype == torch.bfloat16
        assert_close(got[0].double(), exact[0], rtol=2e-2, atol=2e-2,
                     msg=lambda m, a=module.attention: f"{a} output: {m}")
        assert_close(got[1].double(), exact[1], rtol=5e-2, atol=5e-2,
                     msg=lambda m, a=module.attention: f"{a} d input: {m}")
