"""One process's attention and the GPT's runs that sequence parallelism is compared with:
test_sequence.py's, which test_ulysses.py runs again under attention='all_to_all';
test_ring_attention.py and test_ulysses.py compare with attention_reference.

    attention_reference()  softmax(q k^T / sqrt(d) + causal mask) v on the whole sequence
    BATCH, SEQ, VOCAB      the GPT's batch, sequence length and vocabulary
    CLIP                   a clip that really clips
    build_gpt()            train_gpt.gpt as a config asks (CAUSAL, HEADS, ATTENTION), cut into
                           stages under a pipeline
    gpt_run()              a worker: the GPT trained on a few batches (config SEQ: their length,
                           PAD: padded targets), its record_steps record
    gpt_one_and_layout()   one_and_layout with gpt_run: one process's record and a layout's
    five_calls()           a worker: the Engine's five calls, loading and saving checkpoints
    compare_states()       states against one process's (to 1e-10, or bit-identical)
    generate_run()         a worker: generate()'s tokens from a prompt
"""
import sys

import torch
from dist_helpers import ROOT, launch_rank
from models import my_share
from run_records import one_and_layout, record_steps
from torch.testing import assert_close

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.context import gpc
from nanocolossal.pipeline import build_pipeline_model

sys.path.insert(0, str(ROOT))
from train_gpt import gpt  # noqa: E402

BATCH, SEQ, VOCAB, DIM, CLIP = 4, 16, 32, 16, 0.5


def attention_reference(q, k, v, causal):
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v


def _model(dtype=torch.float64, depth=2, causal=True, seq=SEQ, heads=2, attention="fused"):
    torch.manual_seed(0)
    model = gpt(vocab=VOCAB, seq_len=seq, dim=DIM, depth=depth, heads=heads, mlp_ratio=2,
                attention=attention)
    if not causal:
        for block in model[1:-1]:
            block.attn.causal = False
    return model.to(dtype)


def _batches(steps, batch=BATCH, seq=SEQ, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, VOCAB, (2, batch, seq), generator=g).unbind(0))
            for _ in range(steps)]


def build_gpt(config, dtype=torch.float64):
    model = _model(dtype, causal=config.get("CAUSAL", True), heads=config.get("HEADS", 2),
                   attention=config.get("ATTENTION", "fused"))
    if gpc.pipeline_size > 1:
        model = build_pipeline_model(model, num_chunks=config.get("NUM_CHUNKS", 1),
                                     partition="uniform")
    return model


# -- one generic training run: the same code on one process and on a layout --------------------

def gpt_run(rank, world, port, config, steps=3, dtype=torch.float64):
    """`steps` batches through initialize's engine; returns (state, losses, norms, steps taken,
    loss scales) where losses are the global batch's mean (all ranks agree)."""
    launch_rank(rank, world, port, config)
    model = build_gpt(config, dtype)
    engine, loader, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5,
                                                              momentum=0.9),
                                       col_nn.VocabParallelCrossEntropyLoss(),
                                       my_share(_padded(_batches(steps, seq=config.get("SEQ", SEQ)),
                                                      config)), verbose=False)
    out = record_steps(engine, loader)
    out["state"] = {k: v.detach().double().clone()
                    for k, v in nc.checkpoint.strip_prefixes(engine.model.state_dict()).items()}
    return out


def _padded(batches, config):
    """config PAD=k: the last k targets of every sequence are padding (ignore_index -100)."""
    if not config.get("PAD"):
        return batches
    s = batches[0][1].shape[1]
    return [(x, y.index_fill(1, torch.arange(s - config["PAD"], s), -100)) for x, y in batches]


def gpt_one_and_layout(config, world, parallel, *args, timeout=60):
    return one_and_layout(gpt_run, config, world, parallel, *args, timeout=timeout)


# -- checkpoints across layouts, through the tutorial's five-call loop -------------------------

def five_calls(rank, world, port, config, start, stop, load=None, save=None):
    """Batches start..stop-1 of one stream with the Engine's five calls (engine(x) directly);
    load a checkpoint first / save one after, with optimizer state."""
    launch_rank(rank, world, port, config)
    model = build_gpt(config)
    engine, loader, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5,
                                                              momentum=0.9),
                                       col_nn.VocabParallelCrossEntropyLoss(),
                                       my_share(_batches(stop)[start:]), verbose=False)
    if load is not None:
        nc.checkpoint.load_checkpoint(load, engine.model, engine.optimizer)
    engine.train()
    for x, y in loader:
        engine.zero_grad()
        out = engine(x)
        loss = engine.criterion(out, y)
        engine.backward(loss)
        assert engine.step()
    if save is not None:
        nc.checkpoint.save_checkpoint(save, stop, engine.model, engine.optimizer)
    return {k: v.detach().clone() for k, v in
            nc.checkpoint.strip_prefixes(engine.model.state_dict()).items()}


def compare_states(states, ref, exact=False):
    for state in states:
        assert state.keys() == ref.keys()
        for key in ref:
            if exact:
                assert torch.equal(state[key], ref[key]), key
            else:
                assert_close(state[key], ref[key], rtol=1e-10, atol=1e-10, msg=key)


# -- generate(): the same tokens as one process ------------------------------------------------

def generate_run(rank, world, port, config, new=6):
    from nanocolossal.generate import generate
    launch_rank(rank, world, port, config)
    model = build_gpt(config)
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               col_nn.VocabParallelCrossEntropyLoss(), verbose=False)
    with torch.no_grad():  # a model that has learned something: sharper logits than at init
        for p in engine.model.parameters():
            p.mul_(8.0)
    prompt = _batches(1)[0][0][0].tolist()
    copies = config.get("NUM_MICRO_BATCHES", 1) if gpc.pipeline_size > 1 else 1
    return generate(engine, prompt, new, copies, seed=11)
