"""Ulysses (all-to-all) attention equals attention on the whole sequence in one process.

The lesson first: 2 gloo ranks, float64, causal, output and gradients. Then the attention at 2
and 4 ranks, lengths 2N does not divide and padding masks; the GPT trained under
attention='all_to_all' against one process (layouts, ZeRO, AMP, accumulation, checkpoints); the
traffic counted per layer against the formula; what is refused.
"""
import pytest
import torch
from dist_helpers import run_ranks
from run_records import compare_runs
from sequence_runs import (
    CLIP,
    attention_reference,
    compare_states,
    five_calls,
    generate_run,
    gpt_one_and_layout,
)
from torch.testing import assert_close

import nanocolossal as nc
from nanocolossal.config import AMP_TYPE, ConfigError
from nanocolossal.engine.initialize import layout_note
from nanocolossal.nn.transformer import Attention
from nanocolossal.tensor.ulysses import ulysses_attention
from nanocolossal.tensor.zigzag import split_sequence, zigzag_split
from nanocolossal.traffic import count_collectives


def _lesson(rank, world_size, port):
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    torch.manual_seed(0)  # every rank draws the same whole sequence: [batch, heads, 16, 8]
    q, k, v, w = (torch.randn(2, 4, 16, 8, dtype=torch.float64) for _ in range(4))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    # softmax(q k^T / sqrt(d) + mask) v, one process
    expected = attention_reference(*whole, causal=True)
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
def test_deep_ulysses_attention_any_length_and_padding_equals_one_process(name):
    world, length, causal, pad = ATTENTION_CASES[name]
    shares = run_ranks(_attention, world, length, causal, pad, timeout=60)
    assert sum(shares) == length and (max(shares) > min(shares)) == bool(length % (2 * world))


# -- the GPT trained under attention='all_to_all' equals one process ---------------------------

A2A = {"size": 2, "mode": "sequence", "attention": "all_to_all"}
A2A4 = {**A2A, "size": 4}

TRAIN_CASES = {  # name: (config, processes, parallel); float64, SGD with momentum, 3 steps
    "x2, clip": (dict(clip_grad_norm=CLIP), 2, {"tensor": A2A}),
    "x4 (4 heads)": (dict(HEADS=4), 4, {"tensor": A2A4}),
    "data 2 x sequence 2": (dict(clip_grad_norm=CLIP), 4, {"tensor": A2A}),
    "pipeline 2 x sequence 2": (dict(clip_grad_norm=CLIP, NUM_MICRO_BATCHES=2), 4,
                                {"pipeline": 2, "tensor": A2A}),
    "x2, 13 tokens (odd)": (dict(SEQ=13), 2, {"tensor": A2A}),
    "x4, 10 tokens (2N = 8 does not divide)": (dict(SEQ=10, HEADS=4), 4, {"tensor": A2A4}),
    "x2, the last 6 targets padding": (dict(PAD=6), 2, {"tensor": A2A}),
    "ZeRO 1, x2": (dict(zero=dict(level=1)), 2, {"tensor": A2A}),
    "ZeRO 2, data 2 x sequence 2": (dict(zero=dict(level=2)), 4, {"tensor": A2A}),
    "ZeRO 3, x2, clip": (dict(zero=dict(level=3), clip_grad_norm=CLIP), 2, {"tensor": A2A}),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", TRAIN_CASES)
def test_deep_ulysses_training_equals_one_process(name):
    ref, runs = gpt_one_and_layout(*TRAIN_CASES[name])
    assert "clip" not in name or max(ref["norms"]) > CLIP, "it really clips"
    compare_runs(ref, runs)


DEEP_CASES = {
    "gradient accumulation 2, clip": (dict(gradient_accumulation=2, clip_grad_norm=0.2), 2,
                                      {"tensor": A2A}),
    "explicit attention, x2": (dict(ATTENTION="explicit"), 2, {"tensor": A2A}),
    "non-causal, data 2 x sequence 2": (dict(CAUSAL=False), 4, {"tensor": A2A}),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", DEEP_CASES)
def test_deep_ulysses_composed_training_equals_one_process(name):
    compare_runs(*gpt_one_and_layout(*DEEP_CASES[name]))


@pytest.mark.timeout(60)
def test_deep_ulysses_x_amp_bf16_equals_one_process_to_half_precision():
    """Ulysses runs the model's own attention in the autocast dtype, as one process does; the
    two round apart (other batch shapes, other sums): 5e-4 in the weights after 3 steps at lr
    0.5, measured (ring attention: 1e-3; one process in bf16 against fp32: 7e-4)."""
    config = dict(fp16=dict(mode=AMP_TYPE.TORCH, dtype="bfloat16"), clip_grad_norm=CLIP)
    ref, runs = gpt_one_and_layout(config, 2, {"tensor": A2A}, 3, torch.float32)
    compare_runs(ref, runs, rtol=0, atol=2e-3)


@pytest.mark.timeout(60)
def test_deep_ulysses_checkpoint_loads_into_one_process_and_merges(tmp_path):
    """2 steps under all-to-all x2, saved: the file merges to the run's weights and the 3rd step
    taken from it in one process (momentum included) equals 3 steps in one process."""
    cfg, path = dict(clip_grad_norm=CLIP), str(tmp_path / "a2a.pt")
    ref = run_ranks(five_calls, 1, cfg, 0, 3, timeout=60)[0]
    two = run_ranks(five_calls, 2, dict(cfg, parallel={"tensor": A2A}), 0, 2, None, path,
                    timeout=60)
    compare_states([nc.checkpoint.merge_checkpoint(path)], two[0], exact=True)
    compare_states(run_ranks(five_calls, 1, cfg, 2, 3, path, timeout=60), ref)


@pytest.mark.timeout(60)
def test_deep_generate_under_ulysses_gives_one_process_tokens():
    ref = run_ranks(generate_run, 1, {}, timeout=60)[0]
    for world, parallel in [(2, {"tensor": A2A}), (4, {"pipeline": 2, "tensor": A2A})]:
        config = dict(NUM_MICRO_BATCHES=2, parallel=parallel)
        assert run_ranks(generate_run, world, config, timeout=60) == [ref] * world, parallel


# -- traffic: what one layer hands to the all-to-alls, against the formula ---------------------

B, S, WIDTH = 2, 16, 16


def _layer_traffic(rank, world_size, port):
    nc.launch({"parallel": {"tensor": {**A2A, "size": world_size}}}, rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    torch.manual_seed(0)
    layer = Attention(WIDTH, heads=4, causal=True).double()
    x = zigzag_split(torch.randn(B, S, WIDTH, dtype=torch.float64), 1, world_size, rank)
    with count_collectives() as forward:
        out = layer(x.requires_grad_())
    with count_collectives() as backward:
        out.sum().backward()
    return forward, backward


@pytest.mark.parametrize("n", [2, 4])
def test_deep_ulysses_layer_traffic_equals_the_formula(n):
    """Forward: q, k, v and the output, 4 s w / N elements per rank (B sequences), and the
    shares' lengths (N integers); backward: the mirror, 4 s w / N."""
    for forward, backward in run_ranks(_layer_traffic, n, timeout=60):
        assert forward == {"all_to_all_single": 4 * B * S * WIDTH // n, "all_gather": n}
        assert backward == {"all_to_all_single": 4 * B * S * WIDTH // n}


# -- what is refused, and how it is said -------------------------------------------------------

def test_config_refuses_heads_all_to_all_cannot_split_and_unknown_kinds():
    bad = {
        "heads": dict(HEADS=6, parallel=dict(tensor={**A2A, "size": 4})),
        "kind": dict(parallel=dict(tensor={**A2A, "attention": "ulysses"})),
        "beside 1d": dict(parallel=dict(tensor=dict(size=2, mode="1d", attention="ring"))),
    }
    said = {}
    for case, config in bad.items():
        with pytest.raises(ConfigError) as err:
            nc.load_config(config)
        said[case] = str(err.value)
    assert "HEADS = 6 does not divide by 4" in said["heads"] and "attention='ring'" in said["heads"]
    assert "'ulysses'" in said["kind"] and "'all_to_all'" in said["kind"]
    assert "unknown parallel.tensor key(s) ['attention']" in said["beside 1d"]
    assert nc.load_config(dict(HEADS=8, parallel=dict(tensor={**A2A, "size": 4})))


def _refusals(rank, world_size, port):
    nc.launch({"parallel": {"tensor": A2A}}, rank=rank, world_size=world_size,
              host="127.0.0.1", port=port)
    said = {"log": layout_note(None)}
    for case, call, kind in [
        ("heads", lambda: Attention(WIDTH, heads=3), ConfigError),  # when the model is built
        ("heads given", lambda: ulysses_attention(*(torch.zeros(1, 3, 4, 2),) * 3), ConfigError),
        ("shares", lambda: ulysses_attention(*(torch.zeros(1, 2, 4 + 2 * rank, 2),) * 3),
         ValueError),
    ]:
        with pytest.raises(kind) as err:
            call()
        said[case] = str(err.value)
    return said


@pytest.mark.timeout(30)
def test_gloo_ulysses_refusals_name_the_rank_and_what_to_change():
    for rank, said in enumerate(run_ranks(_refusals, 2, timeout=20)):
        assert said["log"] == "sequence parallel x2 (all-to-all attention, Ulysses)"
        # a model's heads are the user's choice: a ConfigError, one line in a script
        assert said["heads"] == (f"[rank {rank}] 3 heads of a {WIDTH}-wide model do not split "
                                 f"over 2 sequence ranks; use a number of heads divisible by 2 "
                                 f"that divides {WIDTH}")
        assert said["heads given"] == (f"[rank {rank}] all-to-all attention gives each of 2 ranks "
                                       f"whole heads, but there are 3; use a number of heads "
                                       f"divisible by 2, or attention='ring'")
        # 4 and 6 tokens: 10 tokens split zig-zag are 5 and 5 -- every rank says so, none waits
        assert said["shares"].startswith(f"[rank {rank}]") and "[4, 6]" in said["shares"] and \
            "[5, 5]" in said["shares"]


def _dropout(rank, world_size, port):
    """Ulysses attends whole rows, so the model's attention dropout runs (ring refuses it)."""
    nc.launch({"parallel": {"tensor": A2A}}, rank=rank, world_size=world_size,
              host="127.0.0.1", port=port)
    torch.manual_seed(0)
    layer = Attention(WIDTH, heads=4, dropout=0.5, causal=True)
    layer.proj_drop.p = 0.0  # only the attention weights' dropout left
    x = zigzag_split(torch.randn(B, S, WIDTH), 1, world_size, rank)
    dropped = layer(x)
    layer.eval()
    return not torch.allclose(dropped, layer(x))


def test_gloo_ulysses_runs_the_attention_dropout():
    assert run_ranks(_dropout, 2) == [True, True]
