"""A small ViT of nc.nn layers trained 3 steps (SGD + momentum, global clipping that really clips)
under every layout equals one process on the whole batch: each rank's parameters are exactly
the slices of the single-process model's (and replicated ones identical everywhere)."""
import sys

import pytest
import torch
from dist_helpers import ROOT, run_ranks
from torch import nn
from torch.testing import assert_close

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.amp import AMP_TYPE
from nanocolossal.checkpoint import load_plain_state_dict, merge_checkpoint, save_checkpoint
from nanocolossal.context import gpc
from nanocolossal.pipeline import build_pipeline_model
from nanocolossal.tensor.base import gather_slices, slice_of

sys.path.insert(0, str(ROOT))
from train_tensor import vit  # noqa: E402

pytestmark = pytest.mark.timeout(180)
BATCH, STEPS, CLIP = 8, 3, 0.05


def _lesson_model():
    torch.manual_seed(0)  # the reference's definition: nc.nn picks the layout's layers after launch
    return nn.Sequential(col_nn.Embedding(10, 8), col_nn.Linear(8, 8), nn.Tanh(),
                         col_nn.LayerNorm(8), col_nn.Classifier(8, 3)).double()


def _trained(rank, world_size, port, config, build, xs, ys):
    """build() trained by the engine (SGD + momentum) on the whole batches xs, ys (one process
    without `config`); its parameters gathered whole."""
    if config:
        nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    model = build()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    engine, *_ = nc.initialize(model, optimizer, col_nn.CrossEntropyLoss(), verbose=False)
    for x, y in zip(xs, ys):  # every rank the whole batch: a grid row keeps its block of it
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()
    # each rank holds a block of every weight (2d: on the 2 x 2 grid): gather the whole tensors
    return {name: gather_slices(p.detach(), getattr(p, "tensor_splits", []))
            for name, p in engine.model.named_parameters()}


def test_gloo_a_model_of_nc_nn_layers_on_a_2d_grid_equals_one_process():
    """One model definition of nc.nn layers: plain torch layers in one process, SUMMA's 2d
    layers on a 2 x 2 grid of ranks (activations and weights in blocks); both train alike."""
    model = _lesson_model()
    xs, ys = torch.randint(0, 10, (3, 8)), torch.randint(0, 3, (3, 8))  # 3 batches of 8 ids
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for x, y in zip(xs, ys):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    grid = dict(parallel=dict(tensor=dict(size=4, mode="2d")))
    for rank, params in enumerate(run_ranks(_trained, 4, grid, _lesson_model, xs, ys)):
        assert_close(params, model.state_dict(), msg=lambda m: f"rank {rank}: {m}")


class SwiGLU(nn.Module):
    """x + w2(silu(w1(n)) * w3(n)), n = norm(x): w3's input is n, not w1's output (the Linear
    built before it), so it says so; w2 takes w1's and w3's product, split as w1's output."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = col_nn.LayerNorm(dim)
        self.w1 = col_nn.Linear(dim, hidden)                        # column
        self.w3 = col_nn.Linear(dim, hidden, input_is_split=False)  # column: its input is n
        self.w2 = col_nn.Linear(hidden, dim)                        # row

    def forward(self, x):
        n = self.norm(x)
        return x + self.w2(nn.functional.silu(self.w1(n)) * self.w3(n))


def _swiglu_model():
    col_nn.reset_1d_alternation()
    torch.manual_seed(0)
    return nn.Sequential(col_nn.Embedding(10, 8), SwiGLU(8, 8), col_nn.LayerNorm(8),
                         col_nn.Classifier(8, 3)).double()


@pytest.mark.parametrize("world, mode", [(2, "1d"), (8, "3d")], ids=["1d x2", "3d 2x2x2"])
def test_gloo_a_swiglu_mlp_built_in_data_flow_order_equals_one_process(world, mode):
    """1d and 3d Linears alternate column, row in the order they are built; SwiGLU's second
    column Linear (w3) takes the block's input, which `input_is_split=False` says. The next
    LayerNorm then sees layout A (3d) and the whole model trains as one process."""
    xs, ys = torch.randint(0, 10, (2, 8)), torch.randint(0, 3, (2, 8))  # 2 batches of 8 ids
    one_process = _trained(0, 1, None, None, _swiglu_model, xs, ys)
    layout = dict(parallel=dict(tensor=dict(size=world, mode=mode)))
    for rank, params in enumerate(run_ranks(_trained, world, layout, _swiglu_model, xs, ys)):
        assert_close(params, one_process, msg=lambda m: f"rank {rank}: {m}")


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


def _stage(model, chunks=1):
    """This rank's part of `model`: its pipeline stage (or chunks), or all of it."""
    if gpc.pipeline_size == 1:
        return model
    return build_pipeline_model(model, num_chunks=chunks, partition="uniform")


def _layout_worker(rank, world_size, port, parallel, expected, norms, initial, path):
    parallel = dict(parallel)
    config = {"clip_grad_norm": CLIP}
    if parallel.pop("gradient_handler", False):
        config["gradient_handler"] = [dict(type="DataParallelGradientHandler")]
    chunks = parallel.pop("chunks", 1)
    config["parallel"] = parallel
    if parallel.get("pipeline", 1) > 1:
        config.update(NUM_MICRO_BATCHES=2, NUM_CHUNKS=chunks)
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    model = _stage(_model(), chunks)
    # other weights, then the plain initial state_dict loaded into this layout
    other = _stage(_model(seed=123), chunks)
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
    for name, p in engine.model.state_dict(keep_vars=True).items():  # the plain model's keys
        assert_close(p.detach(), slice_of(expected[name], getattr(p, "tensor_splits", [])),
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
    ("interleaved pipeline 2 x 1d 2", 4,
     {"pipeline": 2, "chunks": 2, "tensor": {"size": 2, "mode": "1d"}}),
    ("pipeline 2 x 2d 4 (the tutorial's config)", 8,
     {"pipeline": 2, "tensor": {"size": 4, "mode": "2d"}}),
]


@pytest.fixture(scope="module")
def reference():
    return _single_process()


@pytest.mark.parametrize("name, world, parallel", LAYOUTS, ids=[layout[0] for layout in LAYOUTS])
def test_deep_tensor_parallel_training_equals_one_process(reference, name, world, parallel,
                                                          tmp_path):
    expected, norms, initial = reference
    assert norms[0] > CLIP, "the clip really clips"
    path = tmp_path / "ckpt.pt"
    checked = run_ranks(_layout_worker, world, parallel, expected, norms, initial, str(path),
                        timeout=150)
    covered = {key for names in checked for key in names}
    assert covered == set(expected), "every parameter of the model is checked on some rank"
    files = sorted(p.name for p in tmp_path.iterdir())
    parallel = {k: v for k, v in parallel.items() if k != "chunks"}
    tensor = parallel.get("tensor", {}).get("size", 1)
    # data rank 0 of each part writes
    assert len(files) == parallel.get("pipeline", 1) * tensor, files
    # the per-(stage, tensor rank) files -> the plain model's state_dict
    merged = merge_checkpoint(path)
    assert set(merged) == set(expected)
    for key, value in expected.items():
        assert_close(merged[key], value, msg=lambda m: f"merged {key}: {m}")


def _phase_worker(rank, world_size, port, parallel, chunks, plain, first_step, path):
    """One phase of a run that changes layout: load the last phase's merged state_dict, train,
    save this layout's files."""
    config = {"clip_grad_norm": CLIP, "parallel": parallel, "NUM_MICRO_BATCHES": 2,
              "NUM_CHUNKS": chunks}
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    model = _stage(_model(seed=123), chunks)
    load_plain_state_dict(model, plain)
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
                               col_nn.CrossEntropyLoss(), verbose=False)
    per_replica = BATCH // gpc.data_size
    for step in range(first_step, first_step + 2):
        x, y = _batch(step)
        mine = slice(gpc.data_rank * per_replica, (gpc.data_rank + 1) * per_replica)
        engine.zero_grad()
        engine.execute_schedule((x[mine], y[mine]))
        assert engine.step()
    save_checkpoint(path, 0, engine.model, step=first_step + 2)


PHASES = [  # (name, parallel, chunks), 4 ranks each
    ("pipeline 2 x data 2", {"pipeline": 2}, 1),
    ("1d 2 x data 2", {"tensor": {"size": 2, "mode": "1d"}}, 1),
    ("2d 4", {"tensor": {"size": 4, "mode": "2d"}}, 1),
    ("interleaved pipeline 2 x 1d 2", {"pipeline": 2, "tensor": {"size": 2, "mode": "1d"}}, 2),
]


def test_deep_a_run_that_changes_layout_through_merged_checkpoints_equals_one_process(tmp_path):
    """Train 2 steps in each layout, merge its files into the plain state_dict, load that into
    the next layout: after every phase the merged model is the one-process model (a fresh
    optimizer per phase, as a layout change starts one)."""
    single = _model()
    plain = {k: v.detach().clone() for k, v in single.state_dict().items()}
    for phase, (name, parallel, chunks) in enumerate(PHASES):
        path = tmp_path / f"phase{phase}.pt"
        run_ranks(_phase_worker, 4, parallel, chunks, plain, 2 * phase, str(path), timeout=120)
        plain = merge_checkpoint(path)
        opt = torch.optim.SGD(single.parameters(), lr=0.5, momentum=0.9)
        for step in range(2 * phase, 2 * phase + 2):
            x, y = _batch(step)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(single(x), y).backward()
            torch.nn.utils.clip_grad_norm_(single.parameters(), CLIP)
            opt.step()
        assert set(plain) == set(single.state_dict())
        for key, value in single.state_dict().items():
            assert_close(plain[key], value, msg=lambda m: f"after {name}: {key}: {m}")
    # files whose split records do not match their model keys are refused, never half-merged
    files = sorted(tmp_path.glob("phase3-*.pt"))
    state = torch.load(files[0], weights_only=False)
    key = next(k for k, v in state["tensor"]["splits"].items() if v)
    state["tensor"]["shapes"][key][0] += 1
    torch.save(state, files[0])
    with pytest.raises(ValueError, match=f"{key!r} rebuilt with shape"):
        merge_checkpoint(tmp_path / "phase3.pt")
    del state["tensor"]["splits"][key]
    torch.save(state, files[0])
    with pytest.raises(ValueError, match=f"the files record no split for {key!r}"):
        merge_checkpoint(tmp_path / "phase3.pt")


def _amp_worker(rank, world_size, port, parallel, opt_level, dtype, reference=None):
    """Train the ViT under AMP in `parallel`'s layout. Returns (loss, step taken, grad norm) per
    step, the parameter dtypes, and the whole parameters (one process) or, against `reference`,
    per parameter the largest difference from its slice and how far that slice moved."""
    fp16 = {"mode": AMP_TYPE.APEX, "opt_level": opt_level, "dtype": dtype, "init_scale": 2.0**8}
    # a threshold never reached: the global norm is measured (replicas counted once), not applied
    nc.launch({"fp16": fp16, "parallel": parallel, "clip_grad_norm": 1e9}, rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    model = _model()  # this rank's slices of the seeded plain model (the fp32 test checks it)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
                               col_nn.CrossEntropyLoss(), verbose=False)
    losses = []
    for step in range(STEPS):
        engine.zero_grad()
        loss = engine.execute_schedule(_batch(step))[2].item()
        losses.append((loss, engine.step(), engine.last_grad_norm))
    dtypes = {name: p.dtype for name, p in engine.model.named_parameters()}
    if reference is None:
        return losses, dtypes, {name: p.detach().float() for name, p in model.named_parameters()}
    compared = {}
    for name, p in engine.model.named_parameters():
        splits = getattr(p, "tensor_splits", [])
        want = slice_of(reference[name], splits)
        compared[name] = (float((p.float() - want).abs().max()),
                          float((p.float() - initial[name].float()).abs().max()))
    return losses, dtypes, compared


AMP_LAYOUTS = [  # the tensor layouts under each AMP level, in both half types
    ("O2", "bfloat16", "1d x2", 2, {"tensor": {"size": 2, "mode": "1d"}}),
    ("O3", "float16", "2d x4", 4, {"tensor": {"size": 4, "mode": "2d"}}),
]


@pytest.mark.parametrize("opt_level, dtype, name, world, parallel", AMP_LAYOUTS,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in AMP_LAYOUTS])
def test_deep_tensor_parallel_mixed_precision_tracks_one_process(opt_level, dtype, name, world,
                                                                 parallel):
    """The same AMP run on one process and split over tensor ranks: only the order of half-
    precision sums differs, so losses and parameters agree to a few half-precision steps."""
    [(ref_losses, ref_dtypes, ref)] = run_ranks(_amp_worker, 1, {}, opt_level, dtype, timeout=60)
    assert ref_dtypes["1.mlp.fc1.weight"] == getattr(torch, dtype), "O2/O3: Linears in half"
    assert all(taken for _, taken, _ in ref_losses), "every step is taken (no overflow here)"
    for rank, (losses, dtypes, compared) in enumerate(
            run_ranks(_amp_worker, world, parallel, opt_level, dtype, ref, timeout=120)):
        assert dtypes == ref_dtypes, "each layer keeps the dtype it has in one process"
        for (loss, taken, norm), (ref_loss, ref_taken, ref_norm) in zip(losses, ref_losses):
            assert taken == ref_taken and loss == pytest.approx(ref_loss, rel=2e-2)
            assert norm == pytest.approx(ref_norm, rel=2e-2), "the global norm counts each once"
        for key, (diff, moved) in compared.items():  # every slice trained, and stayed close
            assert 0 < moved and diff <= 0.05 * moved + 4e-3, f"[{rank}] {key}: {diff=}, {moved=}"
