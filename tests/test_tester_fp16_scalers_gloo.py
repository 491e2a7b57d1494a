"""An independent tester's hunt for silent differences in the fp16 DYNAMIC LOSS SCALER between a
layout and ONE process running the same AMP config on the whole batch.

The scaler (amp_scaler.DynamicLossScaler) is the same code on every rank; what a layout can get
wrong is the *input* of its update (did some rank overflow? amp.MixedPrecisionOptimizer.unscale_
all-reduces the flag), the loss scale each stage / micro-step multiplies by, the gradient
reduction (a SUM of loss-scaled fp16 gradients may overflow where the mean does not), and the
scaler's state across a checkpoint. So each run here uses a small growth_interval (the scale
GROWS during the test), an inf injected into one gradient on the LAST rank only at a chosen step
(one process: on its only rank), hysteresis where noted, and a clip threshold that really clips,
and compares step by step:

    steps taken / skipped, the loss scale after every step, the losses, the clipped gradient
    norms (inf exactly where a step overflowed), and the final parameters.

Tolerance: the layouts sum partial products and gradients in another order (split matmuls,
all-reduced gradients), each fp16 rounding may differ by half an ulp; after <= 5 SGD steps at
lr 0.1 with weights ~0.1-1 that stays ~1e-4..1e-3 (test_tester_amp_layouts_gloo measured ~2e-4);
we allow 2e-3 (= 2 ulp(1) of fp16) on parameters and losses, 2e-2 relative on norms (a norm of
clipped, rounded gradients). The scaler's own numbers (scale, steps taken) are compared EXACTLY:
they are powers of two and booleans, no rounding can excuse a difference there.

Found, and fixed: the gradient handler summed loss-scaled half gradients before dividing, so it
overflowed (skipped, backed off) where one process and DDP do not; apex's min_loss_scale /
max_loss_scale / keep_batchnorm_fp32 keys crashed nc.initialize with a TypeError, and
enabled=False left AMP on (amp_settings.py now maps each backend's keys or names the ones with
no effect).
"""
import sys

import pytest
import torch
from dist_helpers import ROOT, run_ranks
from run_records import record_steps
from torch import nn
from torch.testing import assert_close

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.config import AMP_TYPE
from nanocolossal.context import gpc
from nanocolossal.pipeline import build_pipeline_model

sys.path.insert(0, str(ROOT))
from train_gpt import gpt  # noqa: E402

pytestmark = pytest.mark.timeout(240)

BATCH, SEQ, VOCAB, DIM, CLIP, TOL = 4, 8, 32, 16, 0.05, 2e-3

# growth_interval=2: over 5 steps the scale grows (x2 every 2 clean steps) and backs off once
SCALER = dict(initial_scale=2.0 ** 8, growth_interval=2, growth_factor=2.0, backoff_factor=0.5)
MODES = {
    "O1": dict(mode=AMP_TYPE.TORCH, dtype="float16", **SCALER),
    "O2": dict(mode=AMP_TYPE.NAIVE, dtype="float16", **SCALER),
    "apex O1": dict(mode=AMP_TYPE.APEX, opt_level="O1", dtype="float16", **SCALER),
    "apex O2": dict(mode=AMP_TYPE.APEX, opt_level="O2", dtype="float16", **SCALER),
    "apex O3": dict(mode=AMP_TYPE.APEX, opt_level="O3", dtype="float16", **SCALER),
    "O2 hyst2": dict(mode=AMP_TYPE.NAIVE, dtype="float16", hysteresis=2, **SCALER),
    "O1 hyst2": dict(mode=AMP_TYPE.TORCH, dtype="float16", hysteresis=2, **SCALER),
}


# -- models --------------------------------------------------------------------------------------

def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(),
                         nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 5))


def _gpt(moe=False):
    torch.manual_seed(0)
    return gpt(vocab=VOCAB, seq_len=SEQ, dim=DIM, depth=2, heads=2, mlp_ratio=2,
               moe=dict(num_experts=2, top_k=2, capacity_factor_train=2.0,
                        capacity_factor_eval=2.0) if moe else None)


MODELS = {"cnn": _cnn, "mlp": _mlp, "gpt": _gpt, "gpt_moe": lambda: _gpt(True)}


def _batches(model, steps, seed=7):
    g = torch.Generator().manual_seed(seed)
    if model == "cnn":
        return [(torch.randn(BATCH, 3, 5, 5, generator=g),
                 torch.randint(0, 5, (BATCH,), generator=g)) for _ in range(steps)]
    if model == "mlp":
        return [(torch.randn(BATCH, 6, generator=g), torch.randint(0, 5, (BATCH,), generator=g))
                for _ in range(steps)]
    return [tuple(torch.randint(0, VOCAB, (2, BATCH, SEQ), generator=g).unbind(0))
            for _ in range(steps)]


def _shard(batches):
    per = batches[0][0].shape[0] // gpc.data_size
    mine = slice(gpc.data_rank * per, (gpc.data_rank + 1) * per)
    return [(x[mine], y[mine]) for x, y in batches]


def _build(model_name, config, batches):
    model = MODELS[model_name]()
    if gpc.pipeline_size > 1:
        model = build_pipeline_model(model, num_chunks=config.get("NUM_CHUNKS", 1),
                                     partition="uniform")
    crit = nn.CrossEntropyLoss() if model_name in ("cnn", "mlp") else \
        col_nn.VocabParallelCrossEntropyLoss()
    engine, loader, *_ = nc.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), crit,
        _shard(batches), verbose=False)
    return engine, loader


def _state(engine):
    return {k: v.detach().double().clone() for k, v in
            nc.checkpoint.strip_prefixes(engine.model.state_dict()).items()
            if torch.is_tensor(v) and v.is_floating_point()}


def _train(rank, world, port, model_name, config, steps, inject):
    nc.launch(dict(config), rank=rank, world_size=world, host="127.0.0.1", port=port, seed=1,
              timeout=60)
    engine, loader = _build(model_name, config, _batches(model_name, steps))
    out = record_steps(engine, loader, inject)
    out["skipped"] = engine.optimizer.skipped_steps
    out["scaler"] = engine.optimizer.scaler.state_dict()
    out["state"] = _state(engine)
    return out


def _compare(ref, runs, need_state=True):
    for rank, run in enumerate(runs):
        assert run["took"] == ref["took"], f"rank {rank}: took {run['took']} vs {ref['took']}"
        assert run["scales"] == ref["scales"], \
            f"rank {rank}: scales {run['scales']} vs {ref['scales']}"
        assert run["skipped"] == ref["skipped"], f"rank {rank}"
        assert run["scaler"] == ref["scaler"], f"rank {rank}: {run['scaler']} vs {ref['scaler']}"
        assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=TOL,
                     atol=TOL, msg=lambda m: f"rank {rank} losses {run['losses']} vs "
                                             f"{ref['losses']}: {m}")
        assert [n is None for n in run["norms"]] == [n is None for n in ref["norms"]]
        assert [n == float("inf") for n in run["norms"]] == \
            [n == float("inf") for n in ref["norms"]], (run["norms"], ref["norms"])
        fin = [(a, b) for a, b in zip(run["norms"], ref["norms"])
               if b is not None and b != float("inf")]
        assert_close(torch.tensor([a for a, _ in fin]), torch.tensor([b for _, b in fin]),
                     rtol=10 * TOL, atol=TOL, msg=lambda m: f"rank {rank} norms "
                                                         f"{run['norms']} vs {ref['norms']}: {m}")
        same = [k for k in set(ref["state"]) & set(run["state"])
                if run["state"][k].shape == ref["state"][k].shape]
        assert same or not need_state, "nothing to compare"
        for key in same:
            assert_close(run["state"][key], ref["state"][key], rtol=0, atol=TOL,
                         msg=lambda m, key=key: f"rank {rank} {key}: {m}")


HANDLER = [dict(type="DataParallelGradientHandler")]
# name: (model, world, mode, parallel, extra config, steps, inject step)
CASES = {
    "ddp2 SyncBN O1 inf@2": ("cnn", 2, "O1", {}, dict(sync_bn=True), 5, 2),
    "handler2 SyncBN apexO1 inf@3": ("cnn", 2, "apex O1", {},
                                     dict(sync_bn=True, gradient_handler=HANDLER), 5, 3),
    # 6 micro-steps = 3 optimizer steps: overflow in the first / the second micro-step
    "accum2 ddp O2 inf@micro0": ("cnn", 2, "O2", {}, dict(sync_bn=True, gradient_accumulation=2),
                                 8, 4),
    "accum2 handler O2 inf@micro1": ("mlp", 2, "O2", {}, dict(gradient_accumulation=2,
                                                              gradient_handler=HANDLER), 8, 5),
    "pipe 1f1b O2 hyst2 inf@1": ("mlp", 2, "O2 hyst2", {"pipeline": 2},
                                 dict(NUM_MICRO_BATCHES=2), 5, 1),
    "pipe interleaved apexO2 inf@2": ("gpt", 2, "apex O2", {"pipeline": 2},
                                      dict(NUM_MICRO_BATCHES=2, NUM_CHUNKS=2), 5, 2),
    "tensor1d O1 inf@2": ("gpt", 2, "O1", {"tensor": {"size": 2, "mode": "1d"}}, {}, 5, 2),
    "tensor2d x4 O2 inf@3": ("gpt", 4, "O2", {"tensor": {"size": 4, "mode": "2d"}}, {}, 5, 3),
    "sequence2 O1 hyst2 inf@0": ("gpt", 2, "O1 hyst2", {"tensor": {"size": 2, "mode": "sequence"}},
                                 {}, 5, 0),
    "moe2 O2 inf@2": ("gpt_moe", 2, "O2", {"moe": {"size": 2}}, dict(MOE_AUX_WEIGHT=0.1), 5, 2),
    "zero1 O2 inf@2": ("mlp", 2, "O2", {}, dict(zero=dict(level=1)), 5, 2),
    "zero2 O1 hyst2 inf@1": ("mlp", 2, "O1 hyst2", {}, dict(zero=dict(level=2)), 5, 1),
    "zero3 O2 inf@3": ("mlp", 2, "O2", {}, dict(zero=dict(level=3)), 5, 3),
    "zero3 O1 inf@2": ("mlp", 2, "O1", {}, dict(zero=dict(level=3)), 5, 2),
    "ddp2 apexO3 inf@2": ("mlp", 2, "apex O3", {}, {}, 5, 2),
    "zero1 accum2 O2 inf@micro0": ("mlp", 2, "O2", {}, dict(zero=dict(level=1),
                                                            gradient_accumulation=2), 8, 4),
    "zero2 accum2 O2 hyst2 inf@micro0": ("mlp", 2, "O2 hyst2", {}, dict(
        zero=dict(level=2), gradient_accumulation=2), 8, 4),
    "zero3 accum2 O1 inf@micro1": ("mlp", 2, "O1", {}, dict(zero=dict(level=3),
                                                            gradient_accumulation=2), 8, 5),
    "pipe gpipe O1 inf@3": ("gpt", 2, "O1", {"pipeline": 2},
                            dict(NUM_MICRO_BATCHES=2, PIPELINE_SCHEDULE="gpipe"), 5, 3),
    "pipe2 x ddp2 handler apexO1 inf@2": ("mlp", 4, "apex O1", {"pipeline": 2},
                                          dict(NUM_MICRO_BATCHES=2,
                                               gradient_handler=HANDLER), 5, 2),
    "pipe2 x zero2 x2 gpt O2 inf@2": ("gpt", 4, "O2", {"pipeline": 2},
                                      dict(NUM_MICRO_BATCHES=2, zero=dict(level=2)), 5, 2),
    "sequence2 x zero2 O2 inf@2": ("gpt", 2, "O2", {"tensor": {"size": 2, "mode": "sequence"}},
                                   dict(zero=dict(level=2)), 5, 2),
    # the inf in an expert's gradient: on the last rank, an expert the other rank does not hold
    "moe2 O1 inf@3 in an expert": ("gpt_moe", 2, "O1", {"moe": {"size": 2}},
                                   dict(MOE_AUX_WEIGHT=0.1), 5, (3, "experts")),
    "tensor2d x4 apexO2 inf@2 in a norm": ("gpt", 4, "apex O2", {"tensor": {"size": 4,
                                                                            "mode": "2d"}},
                                           {}, 5, (2, "norm")),
    "pipe 1f1b TENSOR_SHAPE O2 inf@2": ("mlp", 2, "O2", {"pipeline": 2},
                                        dict(NUM_MICRO_BATCHES=2, TENSOR_SHAPE=(2, 16)), 5, 2),
    "pipe2 x tensor1d2 O2 hyst2 inf@1": ("gpt", 4, "O2 hyst2",
                                         {"pipeline": 2, "tensor": {"size": 2, "mode": "1d"}},
                                         dict(NUM_MICRO_BATCHES=2), 5, 1),
    "pipe2 x moe2 O1 inf@2": ("gpt_moe", 4, "O1", {"pipeline": 2, "moe": {"size": 2}},
                              dict(MOE_AUX_WEIGHT=0.1, NUM_MICRO_BATCHES=2), 5, 2),
    "tensor1d2 x zero2 x2 O2 inf@2": ("gpt", 4, "O2", {"tensor": {"size": 2, "mode": "1d"}},
                                      dict(zero=dict(level=2)), 5, 2),
    "pipe2 x zero1 x2 O2 inf@2": ("mlp", 4, "O2", {"pipeline": 2},
                                  dict(NUM_MICRO_BATCHES=2, zero=dict(level=1)), 5, 2),
}
# keys one process keeps (the others name a layout); a reference is shared by the cases that can
_REF_KEYS = ("gradient_accumulation", "MOE_AUX_WEIGHT")
_REFS = {}


def _where(inject, ranks):
    """record_steps' inject: CASES give a step, or (step, name of the parameter to hit)."""
    step, *name = inject if isinstance(inject, tuple) else (inject,)
    return (step, ranks, *name)


def _reference(model_name, mode, extra, steps, inject):
    kept = tuple(sorted((k, v) for k, v in extra.items() if k in _REF_KEYS))
    key = (model_name, mode, kept, steps, inject)
    if key not in _REFS:
        config = dict(fp16=MODES[mode], clip_grad_norm=CLIP, **dict(kept))
        _REFS[key] = run_ranks(_train, 1, model_name, config, steps, _where(inject, [0]),
                               timeout=90)[0]
    return _REFS[key]


@pytest.mark.parametrize("case", CASES)
def test_gloo_fp16_scaler_growth_and_one_rank_overflow_match_one_process(case):
    model_name, world, mode, parallel, extra, steps, inject = CASES[case]
    ref = _reference(model_name, mode, extra, steps, inject)
    # the test means something: one process skipped the injected step, and the scale grew
    assert ref["skipped"] == 1 and float("inf") in ref["norms"], ref
    assert max(ref["scales"]) > MODES[mode]["initial_scale"], ref["scales"]
    config = dict(fp16=MODES[mode], clip_grad_norm=CLIP, parallel=parallel, **extra)
    runs = run_ranks(_train, world, model_name, config, steps, _where(inject, [world - 1]),
                     timeout=90)
    _compare(ref, runs, need_state="tensor" not in parallel)  # tensor shards: other shapes


# -- a SUM of loss-scaled half gradients overflows where their mean does not --------------------

def _edge_train(rank, world, port, config):
    """Linear(4, 1) from zero weights, MSE to -0.3 on all-ones inputs: d loss / d w = 0.6 per
    element on the whole batch AND on each half of it; x 2^16 = 39322, which fp16 holds (max
    65504) -- but 2 x 39322 it does not. One process steps; a reduction that sums the ranks'
    scaled half gradients before dividing by the ranks would see inf and skip."""
    nc.launch(dict(config), rank=rank, world_size=world, host="127.0.0.1", port=port, seed=1,
              timeout=60)
    model = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    batches = [(torch.ones(BATCH, 4), torch.full((BATCH, 1), -0.3)) for _ in range(2)]
    engine, loader, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                       nn.MSELoss(), _shard(batches), verbose=False)
    out = record_steps(engine, loader)
    out["state"] = _state(engine)
    return out


EDGE = dict(init_scale=2.0 ** 16, growth_interval=1000)
EDGE_CASES = {
    "ddp O2": ({}, "O2"),
    "zero2 O2": (dict(zero=dict(level=2)), "O2"),
    "zero3 O2": (dict(zero=dict(level=3)), "O2"),
    "handler O1": (dict(gradient_handler=HANDLER), "O1"),  # fp32 gradients: no overflow
    "handler O2": (dict(gradient_handler=HANDLER), "O2"),
    "handler apex O3": (dict(gradient_handler=HANDLER), "apex O3"),
}
# the handler divides before its all-reduce, as DDP does (it summed first and overflowed here)
@pytest.mark.parametrize("case", EDGE_CASES)
def test_gloo_fp16_data_parallel_reduction_does_not_overflow_where_one_process_does_not(case):
    extra, mode = EDGE_CASES[case]
    fp16 = {k: v for k, v in MODES[mode].items() if k not in SCALER} | EDGE
    ref = run_ranks(_edge_train, 1, dict(fp16=fp16), timeout=60)[0]
    assert ref["took"] == [True, True] and ref["scales"] == [2.0 ** 16] * 2, ref
    runs = run_ranks(_edge_train, 2, dict(fp16=fp16, **extra), timeout=60)
    for rank, run in enumerate(runs):
        assert (run["took"], run["scales"]) == (ref["took"], ref["scales"]), \
            f"rank {rank}: took {run['took']} scales {run['scales']} vs one process " \
            f"{ref['took']} {ref['scales']}"
        assert_close(run["state"]["weight"], ref["state"]["weight"], rtol=0, atol=TOL)


# -- the scaler's state survives a checkpoint: resumed == uninterrupted, step for step -----------

def _segments(engine, loader, injects):
    """record_steps over loader[0:3] then loader[3:5], each with its own injected overflow."""
    first = record_steps(engine, loader[:3], injects[0])
    second = record_steps(engine, loader[3:], injects[1])
    return {k: first[k] + second[k] for k in first}, first


def _resume_train(rank, world, port, model_name, config, path):
    """Steps 0-4 with an overflow on the last rank at steps 1 and 3, three ways in one job:
    uninterrupted; steps 0-2 then save; a fresh model/optimizer that loads and runs steps 3-4."""
    nc.launch(dict(config), rank=rank, world_size=world, host="127.0.0.1", port=port, seed=1,
              timeout=60)
    batches, last = _batches(model_name, 5), [gpc.world_size - 1]
    injects = ((1, last), (0, last))
    engine, loader = _build(model_name, config, batches)
    whole, _ = _segments(engine, list(loader), injects)
    whole["state"], whole["scaler"] = _state(engine), engine.optimizer.scaler.state_dict()

    engine, loader = _build(model_name, config, batches)
    first = record_steps(engine, list(loader)[:3], injects[0])
    saved_scaler = engine.optimizer.scaler.state_dict()
    nc.checkpoint.save_checkpoint(path, 0, engine.model, engine.optimizer)
    del engine
    engine, loader = _build(model_name, config, batches)
    nc.checkpoint.load_checkpoint(path, engine.model, engine.optimizer)
    loaded_scaler = engine.optimizer.scaler.state_dict()
    second = record_steps(engine, list(loader)[3:], injects[1])
    resumed = {k: first[k] + second[k] for k in first}
    resumed["state"], resumed["scaler"] = _state(engine), engine.optimizer.scaler.state_dict()
    return whole, resumed, saved_scaler, loaded_scaler


RESUME_CASES = {
    "pipe 1f1b O2 hyst2": ("mlp", "O2 hyst2", {"pipeline": 2}, dict(NUM_MICRO_BATCHES=2)),
    "zero2 O1 hyst2": ("mlp", "O1 hyst2", {}, dict(zero=dict(level=2))),
    "zero3 O2 hyst2": ("mlp", "O2 hyst2", {}, dict(zero=dict(level=3))),
    "tensor1d O1 hyst2": ("gpt", "O1 hyst2", {"tensor": {"size": 2, "mode": "1d"}}, {}),
    "ddp SyncBN apexO2": ("cnn", "apex O2", {}, dict(sync_bn=True)),
}


@pytest.mark.parametrize("case", RESUME_CASES)
def test_gloo_fp16_scaler_state_survives_checkpoint_resume_exactly(case, tmp_path):
    model_name, mode, parallel, extra = RESUME_CASES[case]
    config = dict(fp16=MODES[mode], clip_grad_norm=CLIP, parallel=parallel, **extra)
    runs = run_ranks(_resume_train, 2, model_name, config, str(tmp_path / "ckpt.pt"), timeout=90)
    for rank, (whole, resumed, saved, loaded) in enumerate(runs):
        # the test means something: the save lands mid-count (a growth tracker, and with
        # hysteresis=2 a spent hysteresis credit, that a reset would lose)
        assert whole["took"] == [True, False, True, False, True], whole["took"]
        assert saved["growth_tracker"] == 1, saved
        if "hysteresis" in MODES[mode]:
            assert saved["hysteresis_tracker"] == 1, saved
        assert loaded == saved, f"rank {rank}: loaded {loaded} vs saved {saved}"
        for key in ("took", "scales", "norms", "losses", "scaler"):
            assert resumed[key] == whole[key], f"rank {rank} {key}: {resumed[key]} vs {whole[key]}"
        for key, value in whole["state"].items():
            assert_close(resumed["state"][key], value, rtol=0, atol=0,
                         msg=lambda m, key=key: f"rank {rank} {key}: {m}")


# -- the Trainer under fp16: skipped steps, the LR hook, max_steps + resume ----------------------

class _Record(nc.hooks.BaseHook):
    def __init__(self, lr_scheduler):
        super().__init__(priority=50)  # after the LR hook
        self.lr_scheduler = lr_scheduler
        self.out = dict(took=[], scales=[], lrs=[], losses=[])

    def after_train_iter(self, trainer, output, label, loss):
        self.out["took"].append(trainer.last_step_taken)
        self.out["scales"].append(trainer.engine.optimizer.loss_scale)
        self.out["lrs"].append(self.lr_scheduler.get_last_lr()[0])
        self.out["losses"].append(nc.metrics.all_reduce_mean(loss.item()))


def _inject_on_backward(engine, call, ranks, per=1):
    """An inf in the first parameter's gradient on `ranks`, at its `call`-th backward (counted
    from 0; returns the counter, to move it on after a resume)."""
    first = next(p for p in engine.model.parameters() if p.requires_grad)
    seen = [0]

    def hook(g):
        seen[0] += 1  # (a pipeline stage: `per` micro-batch backwards a batch, all hit)
        if (seen[0] - 1) // per == call and gpc.rank in ranks:
            return g.index_fill(0, torch.tensor([0]), float("inf"))
        return g
    first.register_hook(hook)
    return seen


def _trainer_train(rank, world, port, config, path, batches_n, inject_at, stop_at,
                   model_name="cnn"):
    """Trainer.fit over `batches_n` batches (one epoch), LRSchedulerHook per step taken; with
    `stop_at`: fit(max_steps=stop_at) with SaveCheckpointHook, then a fresh Trainer that resumes."""
    nc.launch(dict(config), rank=rank, world_size=world, host="127.0.0.1", port=port, seed=1,
              timeout=60)
    batches = _batches(model_name, batches_n)

    def build():
        model = MODELS[model_name]()
        if gpc.pipeline_size > 1:
            model = build_pipeline_model(model, partition="uniform")
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
        engine, loader, *_ = nc.initialize(model, opt, nn.CrossEntropyLoss(), _shard(batches),
                                           verbose=False)
        seen = _inject_on_backward(engine, inject_at, [gpc.world_size - 1],
                                   config.get("NUM_MICRO_BATCHES", 1))
        return nc.trainer.Trainer(engine), loader, sched, seen

    trainer, loader, sched, _ = build()
    record = _Record(sched)
    hooks = [nc.hooks.LRSchedulerHook(sched, by_epoch=False), record]
    if stop_at is None:
        trainer.fit(loader, epochs=1, hooks=hooks)
        out = record.out
    else:
        trainer.fit(loader, epochs=1, max_steps=stop_at,
                    hooks=hooks + [nc.hooks.SaveCheckpointHook(path, lr_scheduler=sched)])
        out = record.out
        trainer, loader, sched, seen = build()
        assert trainer.resume(path, sched)
        # the same global batch (backwards: one per batch, a stage's one per micro-batch)
        seen[0] = trainer.batch_in_epoch * config.get("NUM_MICRO_BATCHES", 1)
        record = _Record(sched)
        trainer.fit(loader, epochs=1, hooks=[nc.hooks.LRSchedulerHook(sched, by_epoch=False),
                                             record])
        out = {k: out[k] + record.out[k] for k in out}
    out["state"] = _state(trainer.engine)
    out["scaler"] = trainer.engine.optimizer.scaler.state_dict()
    return out


TRAINER_LAYOUTS = {"ddp": {}, "zero2": dict(zero=dict(level=2)), "zero3": dict(zero=dict(level=3)),
                   # (the mlp: the cnn's BatchNorm would normalise each micro-batch alone)
                   "pipe2": dict(parallel=dict(pipeline=2), NUM_MICRO_BATCHES=2)}


@pytest.mark.parametrize("accumulation,layout", [(1, "ddp"), (2, "ddp"), (2, "zero2"),
                                                 (1, "zero3"), (1, "pipe2")])
def test_gloo_fp16_trainer_skips_lr_hook_and_resume_match_one_process(accumulation, layout,
                                                                     tmp_path):
    """8 batches; an overflow on the last rank at backward 3 (with accumulation 2: the second
    micro-step of step 1). One process vs DDP x2 SyncBN O2 (or ZeRO) vs the same stopped by
    max_steps after step 2 and resumed from the Trainer's checkpoint."""
    config = dict(fp16=MODES["O2 hyst2"], clip_grad_norm=CLIP,
                  gradient_accumulation=accumulation)
    model_name = "mlp" if layout == "pipe2" else "cnn"
    ref = run_ranks(_trainer_train, 1, config, None, 8, 3, None, model_name, timeout=90)[0]
    assert ref["took"].count(True) == 8 // accumulation - 1, ref["took"]
    assert max(ref["scales"]) > SCALER["initial_scale"] and min(ref["lrs"]) < 0.1 * 0.8, ref
    layout = dict(config, sync_bn=True, **TRAINER_LAYOUTS[layout])
    for stop in (None, 2):
        path = str(tmp_path / f"ckpt{stop}.pt")
        runs = run_ranks(_trainer_train, 2, layout, path, 8, 3, stop, model_name, timeout=90)
        for rank, run in enumerate(runs):
            for key in ("took", "scales", "lrs", "scaler"):
                assert run[key] == ref[key], f"stop {stop} rank {rank} {key}: {run[key]} vs " \
                                             f"{ref[key]}"
            assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=TOL,
                         atol=TOL)
            common = set(ref["state"]) & set(run["state"])  # (a pipeline stage: its layers)
            assert common
            for key in common:
                assert_close(run["state"][key], ref["state"][key], rtol=0, atol=TOL,
                             msg=lambda m, key=key: f"stop {stop} rank {rank} {key}: {m}")


def test_gloo_fp16_zero_v01_optimizer_config_scaler_keys_match_one_process_fp16_keys():
    """Colossal-AI v0.1's spelling puts the scaler in zero.optimizer_config (zero/settings.py):
    it must act exactly as the same keys in fp16=dict(...) act on one process (here with
    hysteresis=2 and an overflow at step 1, then a second one at step 3)."""
    fp16 = MODES["O1 hyst2"]
    ref = _reference("mlp", "O1 hyst2", {}, 5, 1)
    plain = {k: v for k, v in fp16.items() if k in ("mode", "dtype")}
    optimizer_config = {k: v for k, v in fp16.items() if k not in ("mode", "dtype")}
    config = dict(fp16=plain, clip_grad_norm=CLIP,
                  zero=dict(model_config=dict(), optimizer_config=optimizer_config))
    runs = run_ranks(_train, 2, "mlp", config, 5, (1, [1]), timeout=90)
    _compare(ref, runs)


# -- a checkpoint saved by one layout, resumed by another: the scaler's counters travel ----------

def _phases(rank, world, port, model_name, config, path, load, save, lo, hi, overflow_at):
    """Steps lo..hi-1 (an overflow on the last rank at each step in `overflow_at`), after
    loading `path` if `load`, saving it after if `save`."""
    nc.launch(dict(config), rank=rank, world_size=world, host="127.0.0.1", port=port, seed=1,
              timeout=60)
    engine, loader = _build(model_name, config, _batches(model_name, 5))
    if load:
        nc.checkpoint.load_checkpoint(path, engine.model, engine.optimizer)
    out = dict(losses=[], norms=[], took=[], scales=[])
    for step, batch in list(enumerate(loader))[lo:hi]:
        inject = (0, [gpc.world_size - 1]) if step in overflow_at else None
        for k, v in record_steps(engine, [batch], inject).items():
            out[k] += v
    if save:
        nc.checkpoint.save_checkpoint(path, 0, engine.model, engine.optimizer)
    out["scaler"], out["state"] = engine.optimizer.scaler.state_dict(), _state(engine)
    out["skipped"] = None
    return out


XRESUME = {  # name: (model, mode, (world, extra) that saves, (world, extra) that loads)
    "zero2 x2 -> one process": ("mlp", "O2 hyst2", (2, dict(zero=dict(level=2))), (1, {})),
    "one process -> zero3 x2": ("mlp", "O2 hyst2", (1, {}), (2, dict(zero=dict(level=3)))),
    "zero1 x2 O1 -> ddp x2": ("mlp", "O1 hyst2", (2, dict(zero=dict(level=1))), (2, {})),
    "ddp x2 SyncBN -> zero2 x2 SyncBN": ("cnn", "O2 hyst2", (2, dict(sync_bn=True)),
                                          (2, dict(sync_bn=True, zero=dict(level=2)))),
}


@pytest.mark.parametrize("case", XRESUME)
def test_gloo_fp16_scaler_state_crosses_layouts_in_a_checkpoint(case, tmp_path):
    """Overflows at steps 1 and 3 with hysteresis=2, saved after step 2 (growth tracker 1,
    hysteresis credit 1): the loading layout must back off at step 3 and grow where one process
    does."""
    model_name, mode, (w1, e1), (w2, e2) = XRESUME[case]
    base = dict(fp16=MODES[mode], clip_grad_norm=CLIP)
    path, overflow_at = str(tmp_path / "ckpt.pt"), (1, 3)
    ref = run_ranks(_phases, 1, model_name, base, path + "-ref", False, False, 0, 5, overflow_at,
                    timeout=90)[0]
    assert ref["took"] == [True, False, True, False, True], ref["took"]
    first = run_ranks(_phases, w1, model_name, {**base, **e1}, path, False, True, 0, 3,
                      overflow_at, timeout=90)
    second = run_ranks(_phases, w2, model_name, {**base, **e2}, path, True, False, 3, 5,
                       overflow_at, timeout=90)
    for rank, run in enumerate(second):
        joined = {k: first[0][k] + run[k] for k in ("losses", "norms", "took", "scales")}
        _compare(ref, [{**run, **joined}])


def _apex_options(rank, world, port, config):
    nc.launch(dict(config), rank=rank, world_size=world, host="127.0.0.1", port=port, seed=1,
              timeout=60)
    engine, loader = _build("cnn", config, _batches("cnn", 4))
    dtypes = {str(p.dtype) for p in engine.model.parameters() if p.dim() == 1}  # biases, BN
    return record_steps(engine, loader)["scales"], dtypes, engine.optimizer.scaler is None


APEX = dict(mode=AMP_TYPE.APEX, dtype="float16", loss_scale="dynamic", initial_scale=2.0 ** 8,
            growth_interval=1)
APEX_OPTIONS = {  # name: (fp16, scales after each step, dtypes of the 1-d parameters, no scaler)
    # apex's own scaler bounds (min_loss_scale / max_loss_scale) cap the growing scale at 512
    "O2 min/max_loss_scale": (dict(APEX, opt_level="O2", min_loss_scale=2.0 ** 7,
                                   max_loss_scale=2.0 ** 9), [2.0 ** 9] * 4,
                              {"torch.float16", "torch.float32"}, False),
    # keep_batchnorm_fp32 overrides the level: O3 keeps BatchNorm fp32, O2 casts it
    "O3 keep_batchnorm_fp32": (dict(APEX, opt_level="O3", keep_batchnorm_fp32=True),
                               [2.0 ** 9, 2.0 ** 10, 2.0 ** 11, 2.0 ** 12],
                               {"torch.float16", "torch.float32"}, False),
    "O2 keep_batchnorm_fp32=False": (dict(APEX, opt_level="O2", keep_batchnorm_fp32=False),
                                     [2.0 ** 9, 2.0 ** 10, 2.0 ** 11, 2.0 ** 12],
                                     {"torch.float16"}, False),
    # enabled=False: no AMP at all (fp32, no scaler), as Colossal-AI's TORCH mode
    "TORCH enabled=False": (dict(mode=AMP_TYPE.TORCH, dtype="float16", enabled=False),
                            [1.0] * 4, {"torch.float32"}, True),
}


@pytest.mark.parametrize("name", APEX_OPTIONS)
def test_gloo_fp16_backend_options_do_what_they_say(name):
    fp16, scales, dtypes, no_scaler = APEX_OPTIONS[name]
    assert run_ranks(_apex_options, 1, dict(fp16=fp16), timeout=60)[0] == \
        (scales, dtypes, no_scaler)
