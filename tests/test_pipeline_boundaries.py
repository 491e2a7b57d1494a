"""Stage boundaries whose gradient nobody needs: an integer activation, a frozen first stage,
and an input the next stage ignores.

A stage may end in something with no derivative -- token ids bucketed from features, for the
next stage's Embedding -- and one process simply trains the rest (the layers before the ids get
no gradient). Both sides of such a boundary know the activation is an integer (the receiver
learned its dtype in the handshake), so neither posts the gradient transfer; the earlier stage
runs no backward for that micro-batch. A frozen first stage's float output needs no gradient
either: it is still sent (the receiver cannot tell), and the frozen stage runs no backward.

float64, SGD with momentum, clipping that clips: after 3 steps every stage's parameters equal
one process's on the whole batch (1e-12), for GPipe, 1F1B and interleaved 1F1B, alone and
with data parallel 2 (DDP, ZeRO, or the gradient handler around a stage whose parameters never
get a gradient). An input the next stage ignores is an error naming the part and what to change:
zeros sent back would move the earlier stage's parameters by momentum or weight decay, where one
process leaves them alone.
"""
import pytest
import torch
from dist_helpers import run_ranks
from run_records import record_steps
from torch import nn
from torch.testing import assert_close

import nanocolossal as nc
from nanocolossal.checkpoint import strip_prefixes
from nanocolossal.context import gpc
from nanocolossal.pipeline import build_pipeline_model

pytestmark = pytest.mark.timeout(60)

BATCH, STEPS, CLIP = 8, 3, 0.5


class Bucketize(nn.Module):
    """Features -> 4 token ids in [0, 4): no gradient flows through."""

    def forward(self, x):
        return (x.sigmoid() * 3.999).long()[:, :4]


class IgnoreInput(nn.Module):
    """Returns a learned row per sample, whatever came in."""

    def __init__(self, dim):
        super().__init__()
        self.row = nn.Parameter(torch.randn(dim))

    def forward(self, x):
        return self.row.expand(len(x), -1)


def _ids_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), Bucketize(), nn.Embedding(4, 8), nn.Flatten(),
                         nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 5)).double()


def _ignore_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), IgnoreInput(8), nn.Linear(8, 5)).double()


def _frozen_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                          nn.Linear(8, 5)).double()
    model[0].requires_grad_(False)
    return model


MODELS = {  # name: (model, partition for 2 stages, for 2 stages x 2 chunks)
    "integer ids": (_ids_model, [2, 5], [2, 2, 2, 1]),
    "frozen first stage": (_frozen_model, [2, 3], [2, 1, 1, 1]),
}
DATA = {  # the data-parallel reduction around the stages, x2 (4 ranks)
    "DDP": {}, "ZeRO 1": {"zero": {"level": 1}}, "ZeRO 2": {"zero": {"level": 2}},
    "handler": {"gradient_handler": [{"type": "DataParallelGradientHandler"}]},
}


def _batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(BATCH, 6, generator=g, dtype=torch.float64),
             torch.randint(0, 5, (BATCH,), generator=g)) for _ in range(STEPS)]


def _one_process(name):
    model = MODELS[name][0]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in _batches():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        losses.append(loss.item())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def _worker(rank, world, port, name, schedule, chunks, data=None):
    config = {"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2, "PIPELINE_SCHEDULE": schedule,
              "NUM_CHUNKS": chunks, "clip_grad_norm": CLIP, **DATA.get(data, {})}
    nc.launch(config, rank=rank, world_size=world, host="127.0.0.1", port=port, seed=1,
              timeout=30)
    build, two, four = {**MODELS, "ignored input": (_ignore_model, [2, 2], None)}[name]
    model = build_pipeline_model(build(), num_chunks=chunks, partition=two if chunks == 1 else four)
    per = BATCH // gpc.data_size
    mine = slice(gpc.data_rank * per, (gpc.data_rank + 1) * per)
    engine, loader, *_ = nc.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        nn.functional.cross_entropy, [(x[mine], y[mine]) for x, y in _batches()], verbose=False)
    out = record_steps(engine, loader)
    out["state"] = {k: v.detach().clone() for k, v in strip_prefixes(model.state_dict()).items()}
    return out


@pytest.mark.parametrize("world", [2, 4], ids=["pipeline 2", "pipeline 2 x data 2"])
@pytest.mark.parametrize("schedule, chunks", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
@pytest.mark.parametrize("name", MODELS)
def test_gloo_boundary_without_gradient_trains_as_one_process(name, schedule, chunks, world):
    expected, losses = _one_process(name)
    runs = run_ranks(_worker, world, name, schedule, chunks, timeout=50)
    for rank, run in enumerate(runs):
        assert all(run["took"]), f"rank {rank}: a step was skipped"
        # (the logged loss is averaged over the data ranks in float32)
        assert_close(torch.tensor(run["losses"]), torch.tensor(losses), rtol=1e-6, atol=1e-6)
        assert run["state"], f"rank {rank} holds no parameter"
        for key, value in run["state"].items():
            assert_close(value, expected[key], rtol=1e-12, atol=1e-12,
                         msg=lambda m, key=key: f"rank {rank} {key}: {m}")


@pytest.mark.parametrize("data", DATA)
def test_deep_frozen_first_stage_x_data_parallel_trains_as_one_process(data):
    expected, _ = _one_process("frozen first stage")
    for rank, run in enumerate(run_ranks(_worker, 4, "frozen first stage", "1f1b", 1, data,
                                         timeout=50)):
        for key, value in run["state"].items():
            assert_close(value, expected[key], rtol=1e-12, atol=1e-12,
                         msg=lambda m, key=key: f"rank {rank} {key}: {m}")


def _ignored_worker(rank, world, port):
    try:
        _worker(rank, world, port, "ignored input", "1f1b", 1)
    except RuntimeError as e:  # returned: the peer then stops at once
        return str(e).splitlines()[0]
    return "trained"


def test_gloo_an_ignored_stage_input_is_an_error_naming_the_part():
    stage1 = run_ranks(_ignored_worker, 2, timeout=40)[1]
    assert stage1.startswith("[rank 1] pipeline part 1 did not use its input in micro-batch"), \
        stage1
    assert "make part 1 use its input" in stage1, stage1
