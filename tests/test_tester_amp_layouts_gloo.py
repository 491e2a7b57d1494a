"""An independent tester's hunt for silent AMP differences between a layout and ONE process.

The bug this file generalises: under AMP O2 one process keeps torch's normalisation layers in
fp32, but the 2d LayerNorm2D was cast to half, so a 2d O2 job was not one process's O2. Here,
for every layout a user can reach (DDP with SyncBN / plain BatchNorm, tensor 1d / 2d,
sequence (ring attention), pipeline GPipe / 1F1B / interleaved, experts, the vocab-parallel
GPT), the same plain model is run on one process and on the layout under the same AMP settings,
and compared on

    (a) the dtype of every parameter and buffer after initialize (by plain-model name),
    (b) the dtype of the activations that matter: every module's output (by plain-model name),
        the logits and the loss, the attention scores and softmax, the router's probabilities,
    (c) the parameters, losses and (clipped) gradient norms after 3 steps, to half precision,
    (d) the loss scaler (scale per step, steps taken) when one rank's gradients overflow.

Tolerance for (c): the layouts sum partial products in another order (split matmuls, ring
attention blocks, all-reduced gradients), so each rounding may differ by one half-ulp of the
half type. After 3 SGD steps at lr 0.1 with weights of size ~0.1-1, existing measurements
(test_sequence_composition_gloo.py) put layout-vs-one-process at ~1e-3 (bf16) and ~2e-4 (fp16);
we allow 1e-2 (bf16: 8-bit mantissa, ulp(1)=7.8e-3) and 2e-3 (fp16: ulp(1)=9.8e-4). A dtype
mismatch of a whole layer (e.g. fp32 vs bf16 LayerNorm) shows up exactly in (a)/(b).

Every fp16 config names its dtype: an unnamed one would let the CPU probe pick.
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

pytestmark = pytest.mark.timeout(120)

BATCH, SEQ, VOCAB, DIM, CLIP = 4, 8, 32, 16, 0.05

MODES = {
    "O1 bf16": dict(mode=AMP_TYPE.TORCH, dtype="bfloat16"),
    "O2 bf16": dict(mode=AMP_TYPE.NAIVE, dtype="bfloat16"),
    "O3 bf16": dict(mode=AMP_TYPE.APEX, opt_level="O3", dtype="bfloat16"),
    "O2 fp16": dict(mode=AMP_TYPE.NAIVE, dtype="float16", initial_scale=2.0 ** 8),
    "O1 fp16": dict(mode=AMP_TYPE.TORCH, dtype="float16", initial_scale=2.0 ** 8),
    "APEX O2 fp16": dict(mode=AMP_TYPE.APEX, opt_level="O2", dtype="float16",
                         initial_scale=2.0 ** 8),
}


# -- models --------------------------------------------------------------------------------------

class Scale(nn.Module):
    """A user's module holding its own nn.Parameter (no torch layer inside)."""

    def __init__(self, channels):
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, channels).view(1, channels, 1, 1))

    def forward(self, x):
        return x * self.gain


class Residual(nn.Module):
    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x):
        return x + self.body(x)


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1), nn.GroupNorm(2, 8), Scale(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5))


def _mlp():
    """Pipeline-cuttable, with a residual whose stream is half under O1 autocast."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16),
                         Residual(nn.Sequential(nn.Linear(16, 16), nn.GELU())),
                         Residual(nn.Sequential(nn.Linear(16, 16), nn.GELU())),
                         nn.Linear(16, 5))


def _moe_args():
    return dict(num_experts=2, top_k=2, capacity_factor_train=2.0, capacity_factor_eval=2.0)


def _gpt(moe=False):
    torch.manual_seed(0)
    return gpt(vocab=VOCAB, seq_len=SEQ, dim=DIM, depth=2, heads=2, mlp_ratio=2,
               moe=_moe_args() if moe else None)


MODELS = {"cnn": _cnn, "mlp": _mlp, "gpt": _gpt, "gpt_moe": lambda: _gpt(True)}


def _batches(model, steps=3, seed=7):
    g = torch.Generator().manual_seed(seed)
    if model == "cnn":
        return [(torch.randn(BATCH, 3, 6, 6, generator=g),
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


# -- probes: what dtype each activation had --------------------------------------------------------

def _first_float(out):
    from nanocolossal.moe.router import Routing
    if isinstance(out, Routing):
        return out.probs
    if torch.is_tensor(out):
        return out if out.is_floating_point() else None
    if isinstance(out, (tuple, list)):
        for o in out:
            f = _first_float(o)
            if f is not None:
                return f
    return None


def _install_probes(model, seen):
    """Forward hooks on every module of the plain model (before any wrapping): name -> dtypes of
    its output; attention's scores / softmax dtypes, whichever path computes them."""
    handles = []
    for name, module in model.named_modules():
        def hook(m, args, out, name=name or "<model>"):
            f = _first_float(out)
            if f is not None:
                seen.setdefault(f"out {name}", set()).add(str(f.dtype))
        handles.append(module.register_forward_hook(hook))
    return handles


def _patch_attention(seen):
    """Record the dtype attention's scores and softmax are computed in: one process's
    Attention.attend (q k^T under the current autocast) or the ring's _RingAttention.apply."""
    from nanocolossal.nn import transformer
    from nanocolossal.tensor import ring_attention as ring

    attend, apply = transformer.Attention.attend, ring._RingAttention.apply

    def spy_attend(self, q, k, v):
        scores = q[..., :2, :] @ k[..., :2, :].transpose(-2, -1)
        seen.setdefault("attention scores", set()).add(str(scores.dtype))
        seen.setdefault("attention softmax", set()).add(str(scores.softmax(-1).dtype))
        return attend(self, q, k, v)

    def spy_apply(q, k, v, *rest):
        # inside, scores and the online softmax are computed in q's dtype (autocast is off)
        seen.setdefault("attention scores", set()).add(str(q.dtype))
        seen.setdefault("attention softmax", set()).add(str(q.dtype))
        return apply(q, k, v, *rest)

    transformer.Attention.attend = spy_attend
    ring._RingAttention.apply = spy_apply

    def undo():
        transformer.Attention.attend = attend
        ring._RingAttention.apply = apply
    return undo


def _criterion(model_name, seen):
    crit = nn.CrossEntropyLoss() if model_name in ("cnn", "mlp") else \
        col_nn.VocabParallelCrossEntropyLoss()

    def hook(m, args, out):
        seen.setdefault("criterion logits", set()).add(str(args[0].dtype))
        seen.setdefault("loss", set()).add(str(out.dtype))
    crit.register_forward_hook(hook)
    return crit


# -- one generic run: the same code on one process and on a layout ------------------------------

def _train(rank, world, port, model_name, config, steps=3, inject=None):
    nc.launch(dict(config), rank=rank, world_size=world, host="127.0.0.1", port=port, seed=1)
    seen = {}
    undo = _patch_attention(seen)
    try:
        model = MODELS[model_name]()
        _install_probes(model, seen)
        if gpc.pipeline_size > 1:
            model = build_pipeline_model(model, num_chunks=config.get("NUM_CHUNKS", 1),
                                         partition="uniform")
        crit = _criterion(model_name, seen)
        engine, loader, *_ = nc.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), crit,
            _shard(_batches(model_name, steps)), verbose=False)
        dtypes = {k: str(v.dtype) for k, v in
                  nc.checkpoint.strip_prefixes(engine.model.state_dict()).items()
                  if torch.is_tensor(v) and v.is_floating_point()}
        out = record_steps(engine, loader, inject)
        out["skipped"] = getattr(engine.optimizer, "skipped_steps", None)
        out["dtypes"] = dtypes
        out["seen"] = {k: sorted(v) for k, v in seen.items()}
        out["state"] = {k: v.detach().double().clone() for k, v in
                        nc.checkpoint.strip_prefixes(engine.model.state_dict()).items()
                        if torch.is_tensor(v) and v.is_floating_point()}
        return out
    finally:
        undo()


_REFS = {}


def _reference(model_name, mode, extra=(), inject=None):
    key = (model_name, mode, tuple(sorted(dict(extra).items())), inject)
    if key not in _REFS:
        config = dict(fp16=MODES[mode], clip_grad_norm=CLIP, **dict(extra))
        _REFS[key] = run_ranks(_train, 1, model_name, config, 3,
                               None if inject is None else (inject, [0]), timeout=60)[0]
    return _REFS[key]


def _compare_dtypes(ref, run, rank):
    common = set(ref["dtypes"]) & set(run["dtypes"])
    assert common, "no parameter in common?"
    wrong = {k: (run["dtypes"][k], ref["dtypes"][k]) for k in sorted(common)
             if run["dtypes"][k] != ref["dtypes"][k]}
    assert not wrong, f"rank {rank}: (layout, one process) dtypes differ: {wrong}"
    seen_common = set(ref["seen"]) & set(run["seen"])
    wrong = {k: (run["seen"][k], ref["seen"][k]) for k in sorted(seen_common)
             if run["seen"][k] != ref["seen"][k]}
    assert not wrong, f"rank {rank}: (layout, one process) activation dtypes differ: {wrong}"


def _compare_numbers(ref, run, rank, tol):
    assert run["took"] == ref["took"], f"rank {rank}: steps taken {run['took']} vs {ref['took']}"
    assert run["scales"] == ref["scales"], f"rank {rank}: scales {run['scales']} vs {ref['scales']}"
    assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=tol, atol=tol)
    assert_close(torch.tensor([n or 0.0 for n in run["norms"]]),
                 torch.tensor([n or 0.0 for n in ref["norms"]]), rtol=10 * tol, atol=tol)
    # (a tensor-parallel shard has another shape: the losses and norms above cover it)
    same = [k for k in set(ref["state"]) & set(run["state"])
            if run["state"][k].shape == ref["state"][k].shape]
    for key in same:
        assert_close(run["state"][key], ref["state"][key], rtol=0, atol=tol,
                     msg=lambda m, key=key: f"rank {rank} {key}: {m}")


HANDLER = [dict(type="DataParallelGradientHandler")]

# layout name: (model, processes, parallel, extra config)
LAYOUTS = {
    "ddp2 SyncBN": ("cnn", 2, {}, (("sync_bn", True),)),
    "ddp2 BatchNorm": ("cnn", 2, {}, ()),
    "handler2 SyncBN": ("cnn", 2, {}, (("sync_bn", True), ("gradient_handler", HANDLER))),
    "tensor 1d x2 gpt": ("gpt", 2, {"tensor": {"size": 2, "mode": "1d"}}, ()),
    "tensor 2d x4 gpt": ("gpt", 4, {"tensor": {"size": 4, "mode": "2d"}}, ()),
    "sequence x2 gpt": ("gpt", 2, {"tensor": {"size": 2, "mode": "sequence"}}, ()),
    "pipeline 1f1b gpt": ("gpt", 2, {"pipeline": 2}, (("NUM_MICRO_BATCHES", 2),)),
    "pipeline gpipe gpt": ("gpt", 2, {"pipeline": 2}, (("NUM_MICRO_BATCHES", 2),
                                                       ("PIPELINE_SCHEDULE", "gpipe"))),
    "pipeline interleaved gpt": ("gpt", 2, {"pipeline": 2}, (("NUM_MICRO_BATCHES", 2),
                                                             ("NUM_CHUNKS", 2))),
    "pipeline 1f1b mlp": ("mlp", 2, {"pipeline": 2}, (("NUM_MICRO_BATCHES", 2),)),
    "moe ep2 gpt": ("gpt_moe", 2, {"moe": {"size": 2}}, (("MOE_AUX_WEIGHT", 0.1),)),
}

CASES = [(layout, "O2 bf16") for layout in LAYOUTS] + [
    (layout, mode) for mode in ("O1 bf16", "O3 bf16", "O2 fp16")
    for layout in ("ddp2 SyncBN", "tensor 2d x4 gpt", "sequence x2 gpt", "pipeline 1f1b mlp",
                   "moe ep2 gpt", "tensor 1d x2 gpt")]

# plain BatchNorm under DDP normalises each rank's half batch: by design not one process's numbers
DTYPES_ONLY = {"ddp2 BatchNorm"}

# Ring attention keeps its scores and online softmax in float32 whatever the input dtype, as
# FlashAttention keeps its softmax statistics: N blocks' running sums of exp() in a half type
# would lose precision one process's single softmax does not (tensor/ring_attention.py). That
# is the one dtype a sequence layout is expected to differ in; everything else must match.
RING_ATTENTION = {"attention scores": ["torch.float32"], "attention softmax": ["torch.float32"]}
# Found by this file and fixed since (each case failed before its fix): under O1 the 1d
# Column/RowLinear1D added their fp32 bias after the autocast matmul, so every 1d Linear output
# float32 (tensor/base.add_bias); each pipeline stage's output was cast to float32, so a later
# stage's residual stream was float32 (amp.initialize's `outputs`); 2d x O1 crashed in backward,
# _SummaABT multiplying a bfloat16 by a float32 (tensor/summa.autocast_operands).


def _ref_extra(extra):
    """One process has no pipeline: the schedule keys do not apply there."""
    return tuple((k, v) for k, v in extra if k in ("MOE_AUX_WEIGHT",))


@pytest.mark.parametrize("layout,mode", CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_gloo_amp_layout_dtypes_and_steps_match_one_process(layout, mode):
    model_name, world, parallel, extra = LAYOUTS[layout]
    ref = _reference(model_name, mode, _ref_extra(extra))
    if layout.startswith("sequence"):
        ref = {**ref, "seen": {**ref["seen"], **RING_ATTENTION}}
    config = dict(fp16=MODES[mode], clip_grad_norm=CLIP, parallel=parallel, **dict(extra))
    runs = run_ranks(_train, world, model_name, config, 3, None, timeout=90)
    assert any(n and n > CLIP for n in ref["norms"]), "clipping really clips"
    tol = 2e-3 if "fp16" in mode else 1e-2
    for rank, run in enumerate(runs):
        _compare_dtypes(ref, run, rank)
        if layout not in DTYPES_ONLY:
            _compare_numbers(ref, run, rank, tol)


OVERFLOW = {  # layout: fp16 mode
    "ddp2 SyncBN": "O2 fp16",
    "ddp2 BatchNorm": "APEX O2 fp16",
    "tensor 1d x2 gpt": "O2 fp16",
    "tensor 2d x4 gpt": "O2 fp16",
    "pipeline 1f1b gpt": "O2 fp16",
    "pipeline interleaved gpt": "O1 fp16",
    "moe ep2 gpt": "O2 fp16",
    "sequence x2 gpt": "O1 fp16",
}


@pytest.mark.parametrize("layout", OVERFLOW)
def test_gloo_fp16_overflow_on_one_rank_gives_one_process_scaler_state(layout):
    """An inf in the 2nd step's gradient on the LAST rank only (one process: its only rank):
    every rank skips that step, the scale halves and regrows as one process's does."""
    mode = OVERFLOW[layout]
    model_name, world, parallel, extra = LAYOUTS[layout]
    ref = _reference(model_name, mode, _ref_extra(extra), inject=1)
    assert ref["took"] == [True, False, True] and ref["skipped"] == 1, ref["took"]
    assert ref["scales"][1] == ref["scales"][0] / 2, ref["scales"]
    config = dict(fp16=MODES[mode], clip_grad_norm=CLIP, parallel=parallel, **dict(extra))
    runs = run_ranks(_train, world, model_name, config, 3, (1, [world - 1]), timeout=90)
    for rank, run in enumerate(runs):
        assert run["took"] == ref["took"], f"rank {rank}: {run['took']} vs {ref['took']}"
        assert run["scales"] == ref["scales"], f"rank {rank}: {run['scales']} vs {ref['scales']}"
        assert run["skipped"] == ref["skipped"], f"rank {rank}"
        assert [n is None or n == float("inf") for n in run["norms"]] == \
            [n is None or n == float("inf") for n in ref["norms"]], (run["norms"], ref["norms"])
