"""An independent tester's hunt: pipeline stage boundaries under AMP keep their half dtype.

What changed: under AMP only the model's real output (last stage, last chunk) is cast to fp32;
a boundary between stages now carries bf16/fp16 activations and gradients (the p2p handshake
carries the dtype); with TENSOR_SHAPE (fixed shapes, fixed dtype float32) every stage output is
still cast to fp32. Each test runs one process on the whole batch under the same AMP config and
the pipeline layout, and compares parameter / buffer dtypes, every module's output dtype (probes
from test_tester_amp_layouts_gloo.py), the dtypes that actually crossed each boundary (a spy on
StageComm.exchange), steps taken, loss scales, losses, clipped norms and the parameters after
3 steps.

Tolerance (as test_tester_amp_layouts_gloo.py argues): a pipeline sums micro-batch gradients in
another order than one process's whole-batch backward (and data parallel all-reduces them), so
each rounding may differ by one half-ulp: after 3 SGD steps at lr 0.1 we allow 1e-2 in bf16
(8-bit mantissa, ulp(1) = 7.8e-3) and 2e-3 in fp16 (ulp(1) = 9.8e-4).
"""
import pytest
import torch
from dist_helpers import run_ranks
from run_records import record_steps
from test_tester_amp_layouts_gloo import (
    MODELS,
    MODES,
    _batches,
    _criterion,
    _install_probes,
    _patch_attention,
    _shard,
)
from torch import nn
from torch.testing import assert_close

import nanocolossal as nc
from nanocolossal.context import gpc
from nanocolossal.pipeline import build_pipeline_model, p2p

pytestmark = pytest.mark.timeout(120)

CLIP = 0.05
BF16, FP16 = 1e-2, 2e-3


# -- extra models ---------------------------------------------------------------------------------

class Residual(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(dim, dim), nn.GELU())

    def forward(self, x):
        return x + self.body(x)


def _deep_mlp():
    """8 layers (interleaved over 4 stages x 2 chunks), residual streams cross the boundaries."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), *[Residual(16) for _ in range(6)], nn.Linear(16, 5))


class Bucketize(nn.Module):
    """A stage whose output is an integer tensor (token ids for the next stage's embedding)."""

    def forward(self, x):
        return (x.float().sigmoid() * 3.999).long()[:, :4]


def _int_boundary():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), Bucketize(), nn.Embedding(4, 8), nn.Flatten(),
                         nn.Linear(32, 5))


class TupleOut(nn.Module):
    def forward(self, x):
        return x, x.sum(-1, keepdim=True)


class TupleIn(nn.Module):
    def forward(self, xs):
        return xs[0] + xs[1]


def _tuple_boundary():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), TupleOut(), TupleIn(), nn.Linear(16, 5))


EXTRA_MODELS = {"deep_mlp": _deep_mlp, "int": _int_boundary, "tuple": _tuple_boundary}


def _model(name):
    return EXTRA_MODELS[name]() if name in EXTRA_MODELS else MODELS[name]()


def _data(name, steps):
    return _batches("mlp" if name in EXTRA_MODELS else name, steps)


# -- the worker ------------------------------------------------------------------------------------

def _spy_p2p(crossed):
    """Record the dtype of every activation / gradient actually sent between stages."""
    exchange = p2p.StageComm.exchange

    def spy(self, sends, recvs, where):
        for t, x in sends.items():
            dtype = None if x is None else x.dtype
            crossed.setdefault(f"{t.what} {t.src}->{t.dst}", set()).add(str(dtype))
        return exchange(self, sends, recvs, where)

    p2p.StageComm.exchange = spy
    return lambda: setattr(p2p.StageComm, "exchange", exchange)


def _train(rank, world, port, model_name, config, steps=3, inject=None, partition="uniform",
           evaluate=False):
    nc.launch(dict(config), rank=rank, world_size=world, host="127.0.0.1", port=port, seed=1,
              timeout=60)
    seen, crossed = {}, {}
    undo_attention, undo_p2p = _patch_attention(seen), _spy_p2p(crossed)
    try:
        model = _model(model_name)
        _install_probes(model, seen)
        if gpc.pipeline_size > 1:
            model = build_pipeline_model(model, num_chunks=config.get("NUM_CHUNKS", 1),
                                         partition=partition)
        crit = _criterion("gpt" if model_name.startswith("gpt") else "mlp", seen)
        data = _data(model_name, steps + (1 if evaluate else 0))
        engine, loader, *_ = nc.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), crit,
            _shard(data[:steps]), verbose=False)
        dtypes = {k: str(v.dtype) for k, v in
                  nc.checkpoint.strip_prefixes(engine.model.state_dict()).items()
                  if torch.is_tensor(v) and v.is_floating_point()}
        out = record_steps(engine, loader, inject)
        out["skipped"] = getattr(engine.optimizer, "skipped_steps", None)
        out["dtypes"] = dtypes
        out["state"] = {k: v.detach().double().clone() for k, v in
                        nc.checkpoint.strip_prefixes(engine.model.state_dict()).items()
                        if torch.is_tensor(v) and v.is_floating_point()}
        if evaluate:
            engine.eval()
            with torch.no_grad():
                output, _, loss = engine.execute_schedule(_shard(data[steps:])[0],
                                                          forward_only=True)
            out["eval_loss"] = nc.metrics.all_reduce_mean(loss.item())
            out["eval_output"] = None if output is None else output.detach().double()
            out["eval_dtype"] = None if output is None else str(output.dtype)
        out["seen"] = {k: sorted(v) for k, v in seen.items()}
        out["crossed"] = {k: sorted(v) for k, v in crossed.items()}
        out["is_last"] = gpc.is_last_stage()
        out["data_rank"] = gpc.data_rank
        return out
    finally:
        undo_attention()
        undo_p2p()


_REFS = {}


def _reference(model_name, mode, inject=None, evaluate=False, extra=()):
    key = (model_name, mode, inject, evaluate, extra)
    if key not in _REFS:
        config = dict(fp16=MODES[mode], clip_grad_norm=CLIP, **dict(extra))
        _REFS[key] = run_ranks(_train, 1, model_name, config, 3,
                               None if inject is None else (inject, [0]), "uniform", evaluate,
                               timeout=60)[0]
    return _REFS[key]


def _compare(ref, runs, tol, dtypes=True, skip_seen=()):
    for rank, run in enumerate(runs):
        if dtypes:
            wrong = {k: (run["dtypes"][k], ref["dtypes"][k]) for k in run["dtypes"]
                     if run["dtypes"][k] != ref["dtypes"].get(k)}
            assert not wrong, f"rank {rank}: param dtypes (layout, one process): {wrong}"
            wrong = {k: (run["seen"][k], ref["seen"][k]) for k in run["seen"] if k in ref["seen"]
                     and k not in skip_seen and run["seen"][k] != ref["seen"][k]}
            assert not wrong, f"rank {rank}: activation dtypes (layout, one process): {wrong}"
        assert run["took"] == ref["took"], f"rank {rank}: took {run['took']} vs {ref['took']}"
        assert run["scales"] == ref["scales"], f"rank {rank}: {run['scales']} vs {ref['scales']}"
        assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=tol, atol=tol,
                     msg=lambda m: f"rank {rank} losses {run['losses']} vs {ref['losses']}: {m}")
        assert_close(torch.tensor([n or 0.0 for n in run["norms"]]),
                     torch.tensor([n or 0.0 for n in ref["norms"]]), rtol=10 * tol, atol=tol,
                     msg=lambda m: f"rank {rank} norms {run['norms']} vs {ref['norms']}: {m}")
        same = [k for k in run["state"] if k in ref["state"]
                and run["state"][k].shape == ref["state"][k].shape]
        assert same, f"rank {rank}: no parameter in common"
        for key in same:
            assert_close(run["state"][key], ref["state"][key], rtol=0, atol=tol,
                         msg=lambda m, key=key: f"rank {rank} {key}: {m}")


def _half(mode):
    return "torch.float16" if "fp16" in mode else "torch.bfloat16"


def _boundaries(runs):
    crossed = {}
    for run in runs:
        for k, v in run["crossed"].items():
            crossed.setdefault(k, set()).update(v)
    return crossed


# -- layouts x AMP: dtypes, crossings, numbers -------------------------------------------------

# name: (model, world, parallel, extra config, mode)
CASES = {
    "gpt 4 stages 1f1b O2 bf16": ("gpt", 4, {"pipeline": 4}, {"NUM_MICRO_BATCHES": 4}, "O2 bf16"),
    "gpt 2 stages gpipe x dp2 O1 fp16": ("gpt", 4, {"pipeline": 2},
                                         {"NUM_MICRO_BATCHES": 2, "PIPELINE_SCHEDULE": "gpipe"},
                                         "O1 fp16"),
    "gpt 2 stages interleaved x dp2 O3 bf16": ("gpt", 4, {"pipeline": 2},
                                               {"NUM_MICRO_BATCHES": 2, "NUM_CHUNKS": 2},
                                               "O3 bf16"),
    "mlp 4 stages interleaved O2 fp16": ("deep_mlp", 4, {"pipeline": 4},
                                         {"NUM_MICRO_BATCHES": 4, "NUM_CHUNKS": 2}, "O2 fp16"),
    "gpt pipe2 x tensor 1d O1 bf16": ("gpt", 4, {"pipeline": 2, "tensor": {"size": 2,
                                                                            "mode": "1d"}},
                                      {"NUM_MICRO_BATCHES": 2}, "O1 bf16"),
    "gpt pipe2 x sequence O2 bf16": ("gpt", 4, {"pipeline": 2, "tensor": {"size": 2,
                                                                           "mode": "sequence"}},
                                     {"NUM_MICRO_BATCHES": 2}, "O2 bf16"),
    # stage 0 holds no MoE layer (DDP), stage 1 does (the MoE gradient handler); the tied
    # embedding is summed only after both averaged (PipelineEngine.reduce_gradients)
    "gpt_moe pipe2 x dp2 ep2 O2 fp16": ("gpt_moe", 4, {"pipeline": 2, "moe": {"size": 2}},
                                        {"NUM_MICRO_BATCHES": 2, "MOE_AUX_WEIGHT": 0.0},
                                        "O2 fp16"),
    "gpt pipe2 x dp2 zero1 O2 bf16": ("gpt", 4, {"pipeline": 2},
                                      {"NUM_MICRO_BATCHES": 2, "zero": {"level": 1}}, "O2 bf16"),
    "mlp pipe2 x dp2 zero2 O2 fp16": ("deep_mlp", 4, {"pipeline": 2},
                                      {"NUM_MICRO_BATCHES": 2, "zero": {"level": 2}}, "O2 fp16"),
}

RING = ("attention scores", "attention softmax")  # fp32 by design in ring attention


def _case(value):
    return value.values[0] if hasattr(value, "values") else value


@pytest.mark.parametrize("case", [pytest.param(k, marks=v.marks) if hasattr(v, "marks") else k
                                  for k, v in CASES.items()])
def test_gloo_pipeline_amp_boundaries_keep_half_and_match_one_process(case):
    model_name, world, parallel, extra, mode = _case(CASES[case])
    ref_extra = tuple((k, v) for k, v in extra.items() if k in ("MOE_AUX_WEIGHT",))
    ref = _reference(model_name, mode, extra=ref_extra)
    assert any(n and n > CLIP for n in ref["norms"]), "clipping really clips"
    config = dict(fp16=MODES[mode], clip_grad_norm=CLIP, parallel=parallel, **extra)
    runs = run_ranks(_train, world, model_name, config, 3, timeout=90)
    crossed = _boundaries(runs)
    # every boundary carried a half activation and a half gradient (O2/O3: the half model's
    # stream; O1: the autocast output of the block / embedding-add of one process)
    acts = {k: v for k, v in crossed.items() if k.startswith("act")}
    grads = {k: v for k, v in crossed.items() if k.startswith("grad")}
    assert acts and grads, crossed
    if mode.startswith("O2") or mode.startswith("O3"):
        assert all(v == {_half(mode)} for v in acts.values()), crossed
    for k, v in grads.items():  # a gradient has its activation's dtype
        src, dst = k.split()[1].split("->")
        assert v == acts[f"act {dst}->{src}"], crossed
    _compare(ref, runs, FP16 if "fp16" in mode else BF16,
             skip_seen=RING if parallel.get("tensor", {}).get("mode") == "sequence" else ())


# -- fp16 overflow on ONE stage only --------------------------------------------------------------

@pytest.mark.parametrize("mode,parallel,extra,ranks", [
    ("O2 fp16", {"pipeline": 2}, {"NUM_MICRO_BATCHES": 2, "NUM_CHUNKS": 2}, [0]),
    ("O1 fp16", {"pipeline": 4}, {"NUM_MICRO_BATCHES": 4}, [1]),
], ids=["interleaved-x-dp2-stage0", "1f1b-4stages-stage1"])
def test_gloo_pipeline_fp16_overflow_on_one_stage_matches_one_process_scaler(mode, parallel,
                                                                           extra, ranks):
    ref = _reference("deep_mlp", mode, inject=1)
    assert ref["took"] == [True, False, True] and ref["skipped"] == 1, ref["took"]
    config = dict(fp16=MODES[mode], clip_grad_norm=CLIP, parallel=parallel, **extra)
    runs = run_ranks(_train, 4, "deep_mlp", config, 3, (1, ranks), timeout=90)
    for rank, run in enumerate(runs):
        assert run["took"] == ref["took"], f"rank {rank}: {run['took']} vs {ref['took']}"
        assert run["scales"] == ref["scales"], f"rank {rank}: {run['scales']} vs {ref['scales']}"
        assert run["skipped"] == 1, rank
    # the steps that were taken: as one process's (an inf step changes nothing but the scale)
    _compare(ref, runs, FP16)


# -- TENSOR_SHAPE (fixed shapes: fp32 boundaries) x AMP -----------------------------------------

@pytest.mark.parametrize("model_name,mode,shape,parallel,extra", [
    ("gpt", "O2 bf16", [2, 8, 16], {"pipeline": 2}, {"NUM_MICRO_BATCHES": 2}),
    ("deep_mlp", "O1 fp16", [1, 16], {"pipeline": 4},
     {"NUM_MICRO_BATCHES": 4, "NUM_CHUNKS": 2}),
    ("gpt", "O3 bf16", [1, 8, 16], {"pipeline": 2},
     {"NUM_MICRO_BATCHES": 2, "PIPELINE_SCHEDULE": "gpipe"}),
], ids=["gpt-1f1b-O2bf16", "mlp-interleaved4-O1fp16", "gpt-gpipe-dp2-O3bf16"])
def test_gloo_pipeline_tensor_shape_with_amp_runs_and_matches_one_process(model_name, mode, shape,
                                                                           parallel, extra):
    ref = _reference(model_name, mode)
    config = dict(fp16=MODES[mode], clip_grad_norm=CLIP, parallel=parallel, TENSOR_SHAPE=shape,
                  **extra)
    world = 4 if parallel["pipeline"] == 4 or model_name == "gpt" and mode == "O3 bf16" else 2
    runs = run_ranks(_train, world, model_name, config, 3, timeout=90)
    crossed = _boundaries(runs)
    assert crossed and all(v == {"torch.float32"} for v in crossed.values()), crossed
    # boundary dtypes differ from one process by design (fp32): compare numbers, not dtypes
    tol = FP16 if "fp16" in mode else BF16
    _compare(ref, runs, tol, dtypes=False)
    for run in runs:  # the parameters themselves keep one process's dtypes
        assert run["dtypes"] == {k: ref["dtypes"][k] for k in run["dtypes"]}


# -- evaluation through the pipeline under AMP --------------------------------------------------

@pytest.mark.parametrize("mode,parallel,extra", [
    ("O2 fp16", {"pipeline": 2}, {"NUM_MICRO_BATCHES": 2, "NUM_CHUNKS": 2}),
    ("O1 bf16", {"pipeline": 2}, {"NUM_MICRO_BATCHES": 2}),
], ids=["interleaved-x-dp2-O2fp16", "1f1b-x-dp2-O1bf16"])
def test_gloo_pipeline_amp_eval_outputs_fp32_and_match_one_process(mode, parallel, extra):
    ref = _reference("gpt", mode, evaluate=True)
    config = dict(fp16=MODES[mode], clip_grad_norm=CLIP, parallel=parallel, **extra)
    runs = run_ranks(_train, 4, "gpt", config, 3, None, "uniform", True, timeout=90)
    tol = FP16 if "fp16" in mode else BF16
    _compare(ref, runs, tol)
    per = ref["eval_output"].shape[0] // 2
    assert ref["eval_dtype"] == "torch.float32"
    for rank, run in enumerate(runs):
        assert abs(run["eval_loss"] - ref["eval_loss"]) < 5 * tol, (run["eval_loss"],
                                                                    ref["eval_loss"])
        if run["is_last"]:
            assert run["eval_dtype"] == "torch.float32", rank
            mine = ref["eval_output"][run["data_rank"] * per:(run["data_rank"] + 1) * per]
            assert_close(run["eval_output"], mine, rtol=0, atol=20 * tol)
        else:
            assert run["eval_output"] is None


# -- odd stage outputs --------------------------------------------------------------------------

def test_gloo_pipeline_amp_integer_stage_output_trains_as_one_process():
    """Stage 0 ends in a non-differentiable bucketing (int64 ids); stage 1 embeds them. One
    process trains this (stage 0's Linear gets no gradient); the pipeline must too: an integer
    activation has no gradient to send back."""
    mode = "O2 bf16"
    ref = _reference("int", mode)
    config = dict(fp16=MODES[mode], clip_grad_norm=CLIP, parallel={"pipeline": 2},
                  NUM_MICRO_BATCHES=2)
    runs = run_ranks(_train, 2, "int", config, 3, None, [2, 3], timeout=60)
    assert _boundaries(runs)["act 0->1"] == {"torch.int64"}
    _compare(ref, runs, BF16)


def test_gloo_pipeline_amp_tuple_stage_output_is_a_clear_error():
    """A stage returning a tuple cannot cross a boundary: under AMP too the error names it."""
    config = dict(fp16=MODES["O1 bf16"], parallel={"pipeline": 2}, NUM_MICRO_BATCHES=2)
    with pytest.raises(Exception, match="stages must return one tensor"):
        run_ranks(_train, 2, "tuple", config, 1, None, [2, 2], timeout=30)
