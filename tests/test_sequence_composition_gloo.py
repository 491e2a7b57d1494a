"""Sequence parallelism (tensor mode='sequence') composed with the other features, each against
ONE PROCESS on the whole global batch (the same nanocolossal code on world size 1, whose
equality with plain torch other tests show): AMP, gradient accumulation, clipping x pipeline,
data x pipeline x sequence on 8 ranks, the interleaved schedule, the Trainer's hooks,
checkpoints across layouts, generate(), the Engine's five calls, non-causal attention,
DataLoaders with workers or without __len__, and the errors bad configs must give.

float64 and SGD with momentum wherever the feature allows (Adam hides gradient-scale bugs).
"""
import sys

import pytest
import torch
from dist_helpers import ROOT, run_ranks
from torch.testing import assert_close

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.config import AMP_TYPE
from nanocolossal.context import gpc
from nanocolossal.pipeline import build_pipeline_model

sys.path.insert(0, str(ROOT))
from train_gpt import gpt  # noqa: E402

BATCH, SEQ, VOCAB, DIM, CLIP = 4, 16, 32, 16, 0.5
SEQ2 = {"tensor": {"size": 2, "mode": "sequence"}}


def _model(dtype=torch.float64, depth=2, causal=True, seq=SEQ):
    torch.manual_seed(0)
    model = gpt(vocab=VOCAB, seq_len=seq, dim=DIM, depth=depth, heads=2, mlp_ratio=2)
    if not causal:
        for block in model[1:-1]:
            block.attn.causal = False
    return model.to(dtype)


def _batches(steps, batch=BATCH, seq=SEQ, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, VOCAB, (2, batch, seq), generator=g).unbind(0))
            for _ in range(steps)]


def _shard(batches):
    """This data rank's rows of each global batch (sequence ranks get the same rows; the loader
    initialize returns cuts their tokens)."""
    per = batches[0][0].shape[0] // gpc.data_size
    mine = slice(gpc.data_rank * per, (gpc.data_rank + 1) * per)
    return [(x[mine], y[mine]) for x, y in batches]


def _launch(rank, world, port, config):
    nc.launch(dict(config), rank=rank, world_size=world, host="127.0.0.1", port=port)


def _build(config, dtype=torch.float64, **model_kw):
    model = _model(dtype, **model_kw)
    if gpc.pipeline_size > 1:
        model = build_pipeline_model(model, num_chunks=config.get("NUM_CHUNKS", 1),
                                     partition="uniform")
    return model


# -- one generic training run: the same code on one process and on a layout --------------------

def _train(rank, world, port, config, steps=3, dtype=torch.float64, inject=None):
    """`steps` batches through initialize's engine; returns (state, losses, norms, steps taken,
    loss scales) where losses are the global batch's mean (all ranks agree)."""
    _launch(rank, world, port, config)
    model = _build(config, dtype)
    engine, loader, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5,
                                                              momentum=0.9),
                                       col_nn.VocabParallelCrossEntropyLoss(),
                                       _shard(_batches(steps)), verbose=False)
    out = dict(losses=[], norms=[], took=[], scales=[])
    for i, (x, y) in enumerate(loader):
        engine.zero_grad()
        hook = None
        if inject is not None and i == inject[0] and gpc.rank in inject[1]:
            # an overflow on some ranks only: inf in one row of the embedding's gradient
            first = next(p for p in engine.model.parameters() if p.requires_grad)
            hook = first.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))
        _, _, loss = engine.execute_schedule((x, y))
        if hook is not None:
            hook.remove()
        out["took"].append(engine.step())
        out["norms"].append(engine.last_grad_norm)
        out["scales"].append(engine.optimizer.loss_scale)
        out["losses"].append(nc.metrics.all_reduce_mean(loss.item()))
    out["state"] = {k: v.detach().double().clone()
                    for k, v in nc.checkpoint.strip_prefixes(engine.model.state_dict()).items()}
    return out


def _compare(ref, runs, rtol=1e-10, atol=1e-10, norms=True):
    for run in runs:
        assert run["took"] == ref["took"]
        assert run["scales"] == ref["scales"]
        assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=rtol,
                     atol=atol)
        if norms:
            assert [n is None for n in run["norms"]] == [n is None for n in ref["norms"]]
            assert_close(torch.tensor([n or 0.0 for n in run["norms"]]),
                         torch.tensor([n or 0.0 for n in ref["norms"]]), rtol=rtol, atol=atol)
        for key, value in run["state"].items():
            assert_close(value, ref["state"][key], rtol=rtol, atol=atol,
                         msg=lambda m, key=key: f"{key}: {m}")


def _one_and_layout(config, world, parallel, *args, timeout=60):
    ref = run_ranks(_train, 1, config, *args, timeout=timeout)[0]
    runs = run_ranks(_train, world, {**config, "parallel": parallel}, *args, timeout=timeout)
    return ref, runs


TRAIN_CASES = {  # name: (config, processes, parallel)
    "gradient accumulation 2 x sequence 2, clip":
        (dict(gradient_accumulation=2, clip_grad_norm=0.2), 2, SEQ2),
    "pipeline 2 x sequence 2, clip": (dict(clip_grad_norm=CLIP, NUM_MICRO_BATCHES=2), 4,
                                      {"pipeline": 2, **SEQ2}),
    "interleaved pipeline 2 x 2 chunks x sequence 2, clip":
        (dict(clip_grad_norm=CLIP, NUM_MICRO_BATCHES=2, NUM_CHUNKS=2), 4,
         {"pipeline": 2, **SEQ2}),
    "data 2 x pipeline 2 x sequence 2, clip": (dict(clip_grad_norm=CLIP, NUM_MICRO_BATCHES=2),
                                               8, {"pipeline": 2, **SEQ2}),
    "gradient handler x pipeline 2 x sequence 2":
        (dict(clip_grad_norm=CLIP, NUM_MICRO_BATCHES=2,
              gradient_handler=[dict(type="SequenceParallelGradientHandler")]), 4,
         {"pipeline": 2, **SEQ2}),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", TRAIN_CASES)
def test_gloo_sequence_composed_training_equals_one_process(name):
    config, world, parallel = TRAIN_CASES[name]
    ref, runs = _one_and_layout(config, world, parallel)
    if "clip" in name:
        assert max(n for n in ref["norms"] if n) > config["clip_grad_norm"], "it really clips"
    _compare(ref, runs)


AMP_CASES = {  # name: fp16 config
    "TORCH bf16": dict(mode=AMP_TYPE.TORCH, dtype="bfloat16"),
    "TORCH fp16": dict(mode=AMP_TYPE.TORCH, dtype="float16"),
    "NAIVE fp16": dict(mode=AMP_TYPE.NAIVE, dtype="float16"),
    "APEX O3 bf16": dict(mode=AMP_TYPE.APEX, opt_level="O3", dtype="bfloat16"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", AMP_CASES)
def test_gloo_sequence_x_amp_equals_one_process_to_half_precision(name):
    """Ring attention's blockwise softmax rounds otherwise than one process's: the two agree
    to half precision (and each is as far from the float32 run as the other)."""
    config = dict(fp16=AMP_CASES[name], clip_grad_norm=CLIP)
    ref, (run, other) = _one_and_layout(config, 2, SEQ2, 3, torch.float32)
    assert run["state"].keys() == ref["state"].keys()
    for key in ref["state"]:
        assert torch.equal(run["state"][key], other["state"][key]), "replicas drifted apart"
    _compare(ref, [run], rtol=0, atol=1e-2 if "bf16" in name else 2e-3)


@pytest.mark.timeout(60)
def test_gloo_sequence_x_fp16_overflow_on_one_rank_skips_everywhere():
    """Dynamic loss scaling: an inf in one rank's gradient (rank 1 of 2; one process: its
    only rank) skips that step on every rank and halves the scale, as one process does."""
    config = dict(fp16=dict(mode=AMP_TYPE.NAIVE, dtype="float16", initial_scale=2.0 ** 10),
                  clip_grad_norm=CLIP)
    ref = run_ranks(_train, 1, config, 4, torch.float32, (1, [0]), timeout=60)[0]
    runs = run_ranks(_train, 2, {**config, "parallel": SEQ2}, 4, torch.float32, (1, [1]),
                     timeout=60)
    assert ref["took"] == [True, False, True, True] and ref["scales"][1] == 2.0 ** 9
    _compare(ref, runs, rtol=0, atol=2e-3, norms=False)
