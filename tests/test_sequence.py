"""Sequence parallelism (mode='sequence') trains the GPT exactly as one process does.

float64 and SGD with momentum (not Adam, whose update hides a gradient scaled by any factor),
with a global clip that really clips: after 3 steps every parameter equals one process's on
the whole batch to 1e-10, for sequence x2 and x4, data 2 x sequence 2, pipeline 2 x sequence 2,
Colossal-AI's SequenceParallelGradientHandler instead of DDP, and ZeRO 1-3 sharded over data x
sequence ranks. Then what is refused.
"""
import sys

import pytest
import torch
from dist_helpers import ROOT, run_ranks
from torch import nn
from torch.testing import assert_close

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.config import ConfigError
from nanocolossal.context import gpc
from nanocolossal.nn.transformer import Attention
from nanocolossal.pipeline import build_pipeline_model

sys.path.insert(0, str(ROOT))
from train_gpt import gpt  # noqa: E402
from train_tensor import vit  # noqa: E402

pytestmark = pytest.mark.timeout(120)
BATCH, SEQ, VOCAB, STEPS, CLIP = 4, 16, 32, 3, 0.5


def _lesson_worker(rank, world_size, port, xs, ys):
    nc.launch(dict(parallel=dict(tensor=dict(size=2, mode="sequence"))), rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    torch.manual_seed(0)  # every rank builds the whole model the reference builds
    model = nn.Sequential(nn.Linear(4, 8), Attention(8, heads=2, causal=True),
                          nn.Linear(8, 3)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    engine, loader, *_ = nc.initialize(model, optimizer, col_nn.CrossEntropyLoss(),
                                       list(zip(xs, ys)), verbose=False)
    for x, y in loader:  # my zig-zag share of every sequence: tokens 0-1 and 6-7, or 2-5
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))  # attention: K/V around the ring
        engine.step()
    return engine.model.state_dict()


def test_gloo_sequence_parallel_on_two_ranks_equals_one_process():
    """Each of 2 ranks holds half the tokens of every sequence; ring attention lets its queries
    meet every key, and training equals one process on whole sequences."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), Attention(8, heads=2, causal=True),
                          nn.Linear(8, 3)).double()
    xs = torch.randn(3, 2, 8, 4, dtype=torch.float64)  # 3 batches of 2 sequences of 8 tokens
    ys = torch.randint(0, 3, (3, 2, 8))  # a class per token
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for x, y in zip(xs, ys):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        optimizer.step()
    for rank, state in enumerate(run_ranks(_lesson_worker, 2, xs, ys)):
        assert_close(state, model.state_dict(), msg=lambda m: f"rank {rank}: {m}")


def _model():
    torch.manual_seed(0)
    return gpt(vocab=VOCAB, seq_len=SEQ, dim=16, depth=2, heads=2, mlp_ratio=2).double()


def _batches():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (2, BATCH, SEQ), generator=g).unbind(0) for _ in range(STEPS)]


def _optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _single_process():
    model = _model()
    opt, norms = _optimizer(model), []
    for x, y in _batches():
        opt.zero_grad()
        logits = model(x)
        nn.functional.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1)).backward()
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
    return model.state_dict(), norms


def _worker(rank, world_size, port, parallel, expected, norms):
    parallel = dict(parallel)
    config = {"parallel": parallel, "clip_grad_norm": CLIP, "NUM_MICRO_BATCHES": 2}
    if parallel.pop("handler", False):
        config["gradient_handler"] = [dict(type="SequenceParallelGradientHandler")]
    if "zero" in parallel:  # sharded over data x sequence ranks
        config["zero"] = dict(level=parallel.pop("zero"))
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    model = _model()
    if gpc.pipeline_size > 1:
        model = build_pipeline_model(model, partition="uniform")
    per = BATCH // gpc.data_size
    mine = slice(gpc.data_rank * per, (gpc.data_rank + 1) * per)
    loader = [(x[mine], y[mine]) for x, y in _batches()]
    engine, loader, *_ = nc.initialize(model, _optimizer(model),
                                       col_nn.VocabParallelCrossEntropyLoss(), loader,
                                       verbose=False)
    assert len(loader) == STEPS
    for step, (x, y) in enumerate(loader):
        assert x.shape == (per, SEQ // gpc.sequence_size), "each rank holds its share of tokens"
        engine.zero_grad()
        engine.execute_schedule((x, y))
        assert engine.step()
        assert engine.last_grad_norm == pytest.approx(norms[step], rel=1e-10)
    for name, p in engine.model.state_dict().items():
        assert_close(p, expected[name], rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
    return len(engine.model.state_dict())


LAYOUTS = {
    "sequence x2": (2, {"tensor": {"size": 2, "mode": "sequence"}}),
    "sequence x4": (4, {"tensor": {"size": 4, "mode": "sequence"}}),
    "data 2 x sequence 2": (4, {"tensor": {"size": 2, "mode": "sequence"}}),
    "pipeline 2 x sequence 2": (4, {"pipeline": 2, "tensor": {"size": 2, "mode": "sequence"}}),
    "sequence x2, SequenceParallelGradientHandler":
        (2, {"tensor": {"size": 2, "mode": "sequence"}, "handler": True}),
    "sequence x2, ZeRO 1": (2, {"tensor": {"size": 2, "mode": "sequence"}, "zero": 1}),
    "data 2 x sequence 2, ZeRO 2": (4, {"tensor": {"size": 2, "mode": "sequence"}, "zero": 2}),
    "sequence x2, ZeRO 3": (2, {"tensor": {"size": 2, "mode": "sequence"}, "zero": 3}),
}


@pytest.fixture(scope="module")
def reference():
    return _single_process()


@pytest.mark.parametrize("name", LAYOUTS)
def test_deep_sequence_parallel_training_equals_one_process(reference, name):
    expected, norms = reference
    assert norms[0] > CLIP, "the clip really clips"
    world, parallel = LAYOUTS[name]
    checked = run_ranks(_worker, world, parallel, expected, norms, timeout=90)
    assert sum(checked) >= len(expected)


def _refusals(rank, world_size, port):
    sequence = {"parallel": {"tensor": {"size": 2, "mode": "sequence"}}}
    nc.launch(sequence, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    said = {}
    cases = {
        "vit": lambda: vit(img_size=8, patch_size=4, dim=8, depth=1, heads=2, num_classes=5),
        "no attention": lambda: nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)),
    }
    for case, build in cases.items():
        model = build()
        with pytest.raises(ConfigError) as err:
            nc.initialize(model, _optimizer(model), verbose=False)
        said[case] = str(err.value)
    with pytest.raises(ValueError) as err:
        gpt(vocab=VOCAB, seq_len=SEQ, dim=16, depth=1, heads=2, dropout=0.1)
    said["dropout"] = str(err.value)
    model = _model()
    engine, loader, *_ = nc.initialize(model, _optimizer(model), verbose=False,
                                       train_dataloader=[(torch.zeros(2, 6).long(),) * 2])
    with pytest.raises(ValueError) as err:
        next(iter(loader))
    said["length"] = str(err.value)
    return said


@pytest.mark.timeout(60)
def test_gloo_what_sequence_parallelism_refuses_and_says():
    said = run_ranks(_refusals, 2, timeout=45)[1]
    assert "[rank 1]" in said["vit"] and "Conv2d" in said["vit"], said
    assert "mixes tokens" in said["vit"] and "mode '1d'/'2d'" in said["vit"]
    assert "no attention that knows the sequence is split" in said["no attention"]
    assert "no attention dropout" in said["dropout"] and "dropout=0" in said["dropout"]
    assert "sequence length 6" in said["length"] and "nearest: 4, 8" in said["length"]
