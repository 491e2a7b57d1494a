"""A small ViT of nc.nn layers trained 3 steps (SGD + momentum, global clipping that really clips)
under every layout equals one process on the whole batch: each rank's parameters are exactly
the slices of the single-process model's (and replicated ones identical everywhere)."""
import sys

import pytest
import torch
from dist_helpers import ROOT, run_ranks
from torch.testing import assert_close

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.checkpoint import load_plain_state_dict, merge_checkpoint, save_checkpoint
from nanocolossal.context import gpc
from nanocolossal.pipeline import build_pipeline_model
from nanocolossal.tensor.base import shard

sys.path.insert(0, str(ROOT))
from train_tensor import vit  # noqa: E402

pytestmark = pytest.mark.timeout(180)
BATCH, STEPS, CLIP = 8, 3, 0.05


def _model(seed=0):
    torch.manual_seed(seed)
    return vit(img_size=8, patch_size=4, dim=8, depth=2, heads=2, mlp_ratio=2, num_classes=5)


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 3, 8, 8, generator=g), torch.randint(0, 5, (BATCH,), generator=g)


def _single_process():
    """The reference: one process, whole batch, torch's own clipping."""
    model = _model()
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    norms = []
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms, initial


def _layout_worker(rank, world_size, port, parallel, expected, norms, initial, path):
    parallel = dict(parallel)
    config = {"clip_grad_norm": CLIP}
    if parallel.pop("gradient_handler", False):
        config["gradient_handler"] = [dict(type="DataParallelGradientHandler")]
    config["parallel"] = parallel
    if parallel.get("pipeline", 1) > 1:
        config["NUM_MICRO_BATCHES"] = 2
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    model = _model()
    if gpc.pipeline_size > 1:
        model = build_pipeline_model(model, partition="uniform")
    # other weights, then the plain initial state_dict loaded into this layout
    other = _model(seed=123)
    if gpc.pipeline_size > 1:
        other = build_pipeline_model(other, partition="uniform")
    load_plain_state_dict(other, initial)
    for (name, p), q in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(p, q), (
            f"load_plain_state_dict gave {name} other values than the seeded shard"
        )
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
                               col_nn.CrossEntropyLoss(), verbose=False)
    per_replica = BATCH // gpc.data_size
    for step in range(STEPS):
        x, y = _batch(step)
        mine = slice(gpc.data_rank * per_replica, (gpc.data_rank + 1) * per_replica)
        engine.zero_grad()
        engine.execute_schedule((x[mine], y[mine]))
        assert engine.step()
        assert engine.last_grad_norm == pytest.approx(norms[step], rel=1e-4), (
            "the global norm counts each element once"
        )
    checked = []
    for name, p in engine.model.named_parameters():
        assert_close(p.detach(), shard(expected[name], getattr(p, "tensor_splits", [])),
                     msg=lambda m: f"[rank {rank}] {name}: {m}")
        checked.append(name)
    save_checkpoint(path, 0, engine.model, step=STEPS)  # one file per (stage, tensor rank)
    return checked


LAYOUTS = [
    ("1d x2", 2, {"tensor": {"size": 2, "mode": "1d"}}),
    ("2d x4", 4, {"tensor": {"size": 4, "mode": "2d"}}),
    ("pipeline 2 x 1d 2", 4, {"pipeline": 2, "tensor": {"size": 2, "mode": "1d"}}),
    ("data 2 x 1d 2", 4, {"tensor": {"size": 2, "mode": "1d"}}),
    ("data 2 x pipeline 2, gradient handler", 4, {"pipeline": 2, "gradient_handler": True}),
    ("pipeline 2 x 2d 4 (the tutorial's config)", 8,
     {"pipeline": 2, "tensor": {"size": 4, "mode": "2d"}}),
]


@pytest.fixture(scope="module")
def reference():
    return _single_process()


@pytest.mark.parametrize("name, world, parallel", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_gloo_tensor_parallel_training_equals_one_process(reference, name, world, parallel,
                                                          tmp_path):
    expected, norms, initial = reference
    assert norms[0] > CLIP, "the clip really clips"
    path = tmp_path / "ckpt.pt"
    checked = run_ranks(_layout_worker, world, parallel, expected, norms, initial, str(path),
                        timeout=150)
    covered = {key for names in checked for key in names}
    assert covered == set(expected), "every parameter of the model is checked on some rank"
    files = sorted(p.name for p in tmp_path.iterdir())
    tensor = parallel.get("tensor", {}).get("size", 1)
    # data rank 0 of each part writes
    assert len(files) == parallel.get("pipeline", 1) * tensor, files
    # the per-(stage, tensor rank) files -> the plain model's state_dict
    merged = merge_checkpoint(path)
    assert set(merged) == set(expected)
    for key, value in expected.items():
        assert_close(merged[key], value, msg=lambda m: f"merged {key}: {m}")
