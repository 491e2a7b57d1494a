"""MultiTimer against wall time, and each learning-rate scheduler against its Colossal-AI
definition; then that a scheduler reaches the optimizer that steps, in every layout."""
import math
import sys
import time

import pytest
import torch
from dist_helpers import ROOT, one_process, run_ranks
from models import my_share
from torch.nn import functional as F
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.testing import assert_close

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.checkpoint import load_checkpoint, save_checkpoint, strip_prefixes
from nanocolossal.config import AMP_TYPE
from nanocolossal.context import gpc
from nanocolossal.nn import lr_scheduler as S
from nanocolossal.nn import lr_scheduler as nc_sched
from nanocolossal.pipeline import build_pipeline_model
from nanocolossal.tensor.base import gather_slices
from nanocolossal.trainer import Trainer, hooks
from nanocolossal.utils import MultiTimer

sys.path.insert(0, str(ROOT))
from train_gpt import gpt  # noqa: E402


def test_multitimer_measures_wall_time_per_phase():
    timer = MultiTimer()
    for _ in range(3):
        timer.start("step")
        time.sleep(0.02)
        timer.stop("step")
    timer.start("other")
    time.sleep(0.01)
    timer.stop("other", keep_in_history=False)
    step = timer.get_timer("step")
    assert len(step.history) == 3 and all(0.02 <= t < 0.2 for t in step.history)
    assert step.elapsed == pytest.approx(step.get_history_sum()) and step.get_history_mean() >= 0.02
    assert timer.get_timer("other").history == [] and timer.get_timer("other").elapsed >= 0.01
    timer.reset("step")
    assert timer.get_timer("step").elapsed == 0.0 and {name for name, _ in timer} == {
        "step",
        "other",
    }
    off = MultiTimer(on=False)
    off.start("x")
    assert off.stop("x") == 0.0 and not off.has("x")


def _lrs(make, steps=8, base=0.1):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    sched = make(opt)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def _cos(t, T, w=0, base=0.1, eta_min=0.0):
    return (
        base * (t + 1) / w
        if t < w
        else eta_min + (base - eta_min) * (1 + math.cos(math.pi * (t - w) / (T - w))) / 2
    )


@pytest.mark.parametrize("name, make, expected", [
    ("cosine", lambda o: S.CosineAnnealingLR(o, total_steps=6),
     [_cos(t, 6) for t in range(6)] + [0.0, 0.0]),
    ("cosine eta_min", lambda o: S.CosineAnnealingLR(o, 4, eta_min=0.01),
     [_cos(t, 4, eta_min=0.01) for t in range(4)] + [0.01] * 4),
    ("cosine warm-up", lambda o: S.CosineAnnealingWarmupLR(o, 6, warmup_steps=2),
     [0.05, 0.1] + [_cos(t, 6, 2) for t in range(2, 6)] + [0.0, 0.0]),
    ("linear warm-up", lambda o: S.LinearWarmupLR(o, 6, warmup_steps=2),
     [0.1 / 3, 0.2 / 3, 0.1, 0.075, 0.05, 0.025, 0.0, 0.0]),  # (t+1)/(w+1), then (T-t)/(T-w)
    ("multi-step", lambda o: S.MultiStepLR(o, 8, milestones=[2, 5], gamma=0.5),
     [0.1] * 2 + [0.05] * 3 + [0.025] * 3),
    ("step", lambda o: S.StepLR(o, 8, step_size=3, gamma=0.1),
     [0.1] * 3 + [0.01] * 3 + [0.001] * 2),
    ("exponential", lambda o: S.ExponentialLR(o, 8, gamma=0.5), [0.1 * 0.5 ** t for t in range(8)]),
    ("polynomial", lambda o: S.PolynomialLR(o, 4, end_lr=0.02, power=2.0),
     [(0.1 - 0.02) * (1 - t / 4) ** 2 + 0.02 for t in range(4)] + [0.02] * 4),
])
def test_scheduler_follows_its_formula(name, make, expected):
    assert _lrs(make) == pytest.approx(expected, abs=1e-12), name


# The edges of the warm-up schedulers, (T, w) = (total_steps, warmup_steps): a run shorter than its
# warm-up (the pipeline tutorial's LinearWarmupLR(opt, NUM_EPOCHS, warmup_steps=5) on a 2-epoch
# trial), as long as it, one step longer, and no warm-up. Base lr 0.1, 8 steps; every step t < T
# is Colossal-AI's value; from t = T on the decay's end is held.
WARMUP_EDGES = {
    "T < w": (2, 5), "T = w": (5, 5), "T = w + 1": (6, 5), "w = 0": (3, 0),
}
COSINE_EDGES = {  # t < w: 0.1 * (t + 1) / w; then 0.1 * (1 + cos(pi * (t - w) / (T - w))) / 2
    "T < w": [0.02, 0.04] + [0.0] * 6,
    "T = w": [0.02, 0.04, 0.06, 0.08, 0.1] + [0.0] * 3,
    "T = w + 1": [0.02, 0.04, 0.06, 0.08, 0.1, 0.1] + [0.0] * 2,
    "w = 0": [0.1, 0.075, 0.025] + [0.0] * 5,
}
LINEAR_EDGES = {  # t < w: 0.1 * (t + 1) / (w + 1); then 0.1 * (T - t) / (T - w)
    "T < w": [0.1 / 6, 0.2 / 6] + [0.0] * 6,
    "T = w": [0.1 * k / 6 for k in range(1, 6)] + [0.0] * 3,
    "T = w + 1": [0.1 * k / 6 for k in range(1, 6)] + [0.1] + [0.0] * 2,
    "w = 0": [0.1, 0.2 / 3, 0.1 / 3] + [0.0] * 5,
}
POLYNOMIAL_EDGES = {  # end_lr 0.01, power 2: then 0.09 * (1 - (t - w) / (T - w)) ** 2 + 0.01
    "T < w": [0.02, 0.04] + [0.01] * 6,
    "T = w": [0.02, 0.04, 0.06, 0.08, 0.1] + [0.01] * 3,
    "T = w + 1": [0.02, 0.04, 0.06, 0.08, 0.1, 0.1] + [0.01] * 2,
    "w = 0": [0.1, 0.05, 0.02] + [0.01] * 5,
}
WARMUP_SCHEDULERS = {
    "cosine": (lambda o, T, w: S.CosineAnnealingLR(o, T, warmup_steps=w), COSINE_EDGES),
    "cosine warm-up": (lambda o, T, w: S.CosineAnnealingWarmupLR(o, T, warmup_steps=w),
                       COSINE_EDGES),
    "linear warm-up": (lambda o, T, w: S.LinearWarmupLR(o, total_steps=T, warmup_steps=w),
                       LINEAR_EDGES),
    "polynomial": (lambda o, T, w: S.PolynomialLR(o, T, end_lr=0.01, power=2.0, warmup_steps=w),
                   POLYNOMIAL_EDGES),
}


@pytest.mark.parametrize("edge", list(WARMUP_EDGES))
@pytest.mark.parametrize("name", list(WARMUP_SCHEDULERS))
def test_warmup_scheduler_formula_at_the_edges(name, edge):
    """A run no longer than its warm-up (T <= w, a short trial of the pipeline tutorial's
    script) follows the formula to its end, as a long one does."""
    total, warmup = WARMUP_EDGES[edge]
    make, expected = WARMUP_SCHEDULERS[name]
    assert _lrs(lambda o: make(o, total, warmup)) == pytest.approx(expected[edge], abs=1e-12)


@pytest.mark.parametrize("name, make, expected", [
    ("multi-step", lambda o: S.MultiStepLR(o, 3, milestones=[1, 2, 5], gamma=0.5),
     [0.1, 0.05] + [0.025] * 6),  # the milestone past T never fires
    ("step", lambda o: S.StepLR(o, 2, step_size=1, gamma=0.5), [0.1, 0.05] + [0.025] * 6),
    ("exponential", lambda o: S.ExponentialLR(o, 1, gamma=0.5), [0.1] + [0.05] * 7),
])
def test_step_scheduler_holds_its_value_at_T_after_a_short_run(name, make, expected):
    assert _lrs(make) == pytest.approx(expected, abs=1e-12), name


def test_scheduler_state_round_trip_and_bad_arguments():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    a = S.LinearWarmupLR(opt, 10, warmup_steps=3)
    for _ in range(4):
        opt.step()
        a.step()
    b = S.LinearWarmupLR(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), 10,
                         warmup_steps=3)
    b.load_state_dict(a.state_dict())
    assert b.get_last_lr() == a.get_last_lr()
    with pytest.raises(ValueError, match=r"\[rank 0\] CosineAnnealingLR needs total_steps >= 0 "
                                         r"and warmup_steps >= 0, got total_steps=5, "
                                         r"warmup_steps=-1"):
        S.CosineAnnealingLR(opt, 5, warmup_steps=-1)
    with pytest.raises(ValueError, match=r"\[rank 0\] StepLR needs total_steps >= 0, got "
                                         r"total_steps=-1$"):
        S.StepLR(opt, -1)


# -- schedulers x layouts: one process each ------------------------------------------------------
# Does an LR scheduler (or a hand-changed lr / weight_decay) really reach the optimizer that
# steps, in every layout and feature? The risk: a wrapper that rebuilds the user's optimizer's
# param groups (as ZeRO does) so that a scheduler built on the user's optimizer before
# `nc.initialize` -- the tutorials' order -- changes a dict nobody reads. Here every layout runs
# the same tiny GPT (float64 unless AMP) for a few steps with the tutorials' order, and is compared
# with ONE process on the whole batch: the learning rates (and momentum, weight decay) the
# stepping optimizer actually used, recorded by RecordingSGD.step, and the final parameters
# (assert_close).
#
# The one-process reference is the same code on one rank without any parallel setting, itself
# checked against a plain torch loop (no nanocolossal at all) in the first of these tests.

BATCH, SEQ, VOCAB, DIM, STEPS = 4, 8, 32, 16, 4
LR, MOMENTUM, WD = 0.5, 0.9, 0.01
USED: list = []  # per optimizer step (per stepping optimizer): [(lr, momentum, wd) per group]


def _note(opt, args, kwargs):
    USED.append([(g["lr"], g["momentum"], g["weight_decay"]) for g in opt.param_groups])


def RecordingSGD(params, **kw):
    """SGD; while a run lasts, every optimizer step -- whichever optimizer object a wrapper made
    steps -- notes the hyper-parameters it actually steps with (a global step pre-hook)."""
    return torch.optim.SGD(params, **kw)


def _record():
    """Start noting every optimizer step (returns the handle to remove)."""
    USED.clear()
    return register_optimizer_step_pre_hook(_note)


def _scheduler(name, opt):
    """A scheduler on the user's optimizer (None: the loop changes param_groups by hand)."""
    if name == "StepLR":
        return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    if name == "LambdaLR":
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (t + 1) ** 2)
    if name == "OneCycleLR":  # also cycles SGD's momentum
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=STEPS + 1)
    if name == "LinearWarmupLR":
        return nc_sched.LinearWarmupLR(opt, total_steps=STEPS, warmup_steps=2)
    if name == "CosineAnnealingWarmupLR":
        return nc_sched.CosineAnnealingWarmupLR(opt, total_steps=STEPS, warmup_steps=1)
    if name == "manual":
        return None
    raise ValueError(name)


def _by_hand(groups, step):
    """The 'manual' schedule: lr and weight_decay changed between steps through param_groups."""
    for g in groups:
        g["lr"] = LR * 0.3 ** (step + 1)
        g["weight_decay"] = WD + 0.2 * (step + 1)


def _model(config, dtype):
    torch.manual_seed(0)
    moe = None
    if config.get("MOE"):
        moe = dict(num_experts=2, top_k=1, capacity_factor_train=4.0, capacity_factor_eval=4.0)
    return gpt(vocab=VOCAB, seq_len=SEQ, dim=DIM, depth=2, heads=2, mlp_ratio=2, moe=moe).to(dtype)


def _batches(steps=STEPS, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, VOCAB, (2, BATCH, SEQ), generator=g).unbind(0))
            for _ in range(steps)]


def _build(config, dtype):
    model = _model(config, dtype)
    if gpc.pipeline_size > 1:
        model = build_pipeline_model(model, num_chunks=config.get("NUM_CHUNKS", 1),
                                     partition="uniform")
    return model


def _full_state(engine):
    """Parameters and buffers as one process names them; a tensor-split one put back together
    from the tensor ranks' slices (a collective of the tensor group)."""
    kept = strip_prefixes(engine.model.state_dict(keep_vars=True))  # (for the splits)
    state = strip_prefixes(engine.model.state_dict())  # (ZeRO 3: gathered)
    splits = {k: list(getattr(kept[k], "tensor_splits", [])) for k in state}
    return {k: gather_slices(v.detach(), splits[k]).double().clone() for k, v in state.items()}


def _train(rank, world, port, config, sched, dtype=torch.float64, save=None, load=None,
           start=0, inject=None, stop=STEPS):
    """Steps start..STEPS-1 of the tutorials' loop; scheduler.step() after each step taken (or
    the 'manual' change). `load`: resume from a checkpoint first; `save`: save at the end."""
    nc.launch(dict(config), rank=rank, world_size=world, host="127.0.0.1", port=port, timeout=30)
    model = _build(config, dtype)
    opt = RecordingSGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)
    scheduler = _scheduler(sched, opt)
    engine, loader, _, scheduler = nc.initialize(
        model, opt, col_nn.VocabParallelCrossEntropyLoss(), my_share(_batches()[start:stop]),
        lr_scheduler=scheduler, verbose=False)
    if load:
        load_checkpoint(load, engine.model, engine.optimizer, scheduler)
    handle = _record()
    took, n = [], config.get("gradient_accumulation", 1)
    step = start
    for i, (x, y) in enumerate(loader):
        engine.zero_grad()
        hook = None
        if inject is not None and step == inject and i % n == n - 1:
            first = next(p for p in engine.model.parameters() if p.requires_grad)
            hook = first.register_hook(lambda g: g.index_fill(0, torch.tensor([0]),
                                                              float("inf")))
        engine.execute_schedule((x, y))
        if hook is not None:
            hook.remove()
        if engine.step() or (i % n == n - 1):  # a group ended: taken, or skipped on overflow
            took.append(not engine.optimizer.last_step_skipped)
            if scheduler is not None:
                scheduler.step()  # torch's recipe: every optimizer step, skipped or not
            else:
                _by_hand(engine.optimizer.param_groups, step)
            step += 1
    handle.remove()
    if save:
        save_checkpoint(save, 1, engine.model, engine.optimizer, lr_scheduler=scheduler)
    return {"state": _full_state(engine), "used": list(USED), "took": took,
            "last_lr": scheduler.get_last_lr() if scheduler is not None else None}


def _plain_torch(sched, dtype=torch.float64, steps=STEPS):
    """No nanocolossal: the whole batch, plain SGD, the scheduler after each step."""
    handle = _record()
    model = _model({}, dtype)
    opt = RecordingSGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)
    scheduler = _scheduler(sched, opt)
    for step, (x, y) in enumerate(_batches()[:steps]):
        opt.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        else:
            _by_hand(opt.param_groups, step)
    handle.remove()
    return {k: v.detach().double().clone() for k, v in model.state_dict().items()}, list(USED)


def _compare(run, ref_state, who, **tol):
    seen = set()
    for name, value in run["state"].items():
        assert name in ref_state, f"{who}: {name} unknown to one process"
        assert_close(value, ref_state[name].to(value.dtype),
                     msg=lambda m: f"{who} {name}: {m}", **tol)
        seen.add(name)
    return seen


def _one_process(config, sched, dtype=torch.float64):
    """One rank on the whole batch, the layout's settings dropped (run once per module and
    config: several layouts share a reference)."""
    config = {k: v for k, v in config.items()
              if k not in ("parallel", "NUM_MICRO_BATCHES", "NUM_CHUNKS", "zero")}
    return one_process(_train, config, sched, dtype)


def _ref_state(run):
    return run["state"]


SCHEDULERS = ["StepLR", "LambdaLR", "OneCycleLR", "LinearWarmupLR", "CosineAnnealingWarmupLR",
              "manual"]


# -- the reference itself ---------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("sched", SCHEDULERS)
def test_gloo_one_rank_reference_is_the_plain_torch_loop_with_its_scheduler(sched):
    """The one-rank run through nc.initialize steps with plain torch's learning rates, momenta and
    weight decays, and ends with plain torch's parameters (so the references below are sound)."""
    plain, used = _plain_torch(sched)
    assert len({u[0][0] for u in used}) > 1, "the schedule really changes the lr"
    run = _one_process({}, sched)
    assert run["used"] == used
    _compare(run, plain, "one rank")


# -- every layout, every scheduler, the tutorials' order ---------------------------------------

SEQ2 = {"tensor": {"size": 2, "mode": "sequence"}}
LAYOUTS = {  # name: (config, processes)
    "ddp x2": ({}, 2),
    "gradient handler x2": ({"gradient_handler": [dict(type="DataParallelGradientHandler")]}, 2),
    "accumulation 2 x ddp 2 x clip": ({"gradient_accumulation": 2, "clip_grad_norm": 0.3}, 2),
    "gpipe x2": ({"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2,
                  "PIPELINE_SCHEDULE": "gpipe"}, 2),
    "1f1b x2 x clip": ({"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2,
                        "clip_grad_norm": 0.3}, 2),
    "interleaved x2 (2 chunks)": ({"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2,
                                   "NUM_CHUNKS": 2}, 2),
    "tensor 1d x2": ({"parallel": {"tensor": {"size": 2, "mode": "1d"}}}, 2),
    "sequence x2": ({"parallel": SEQ2}, 2),
    "moe x2": ({"parallel": {"moe": {"size": 2}}, "MOE": True, "MOE_AUX_WEIGHT": 0.1}, 2),
    "1f1b x2 x data 2 x zero 1": ({"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2,
                                   "zero": {"level": 1}}, 4),
    "zero 3 x2 x accumulation 2": ({"zero": {"level": 3}, "gradient_accumulation": 2}, 2),
    "sequence x2 x 1f1b x2": ({"parallel": {"pipeline": 2, **SEQ2}, "NUM_MICRO_BATCHES": 2}, 4),
}
# every scheduler where the engine steps once a batch (ddp); everywhere else the scheduler that
# changes the most per step (lr and momentum), and under a schedule (1f1b) also the lr and weight
# decay changed by hand in the engine's param_groups. (The other schedulers write the same
# param_groups["lr"] as OneCycleLR: ddp checks each of their values once.)
LAYOUT_CASES = [(layout, sched) for layout in LAYOUTS for sched in
                (SCHEDULERS if layout == "ddp x2" else ["OneCycleLR", "manual"]
                 if layout == "1f1b x2 x clip" else ["OneCycleLR"])]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout, sched", LAYOUT_CASES, ids=[f"{a}-{b}" for a, b in LAYOUT_CASES])
def test_deep_scheduler_built_before_initialize_drives_every_layout_like_one_process(layout,
                                                                                    sched):
    config, world = LAYOUTS[layout]
    if config.get("MOE"):  # MoE layers: the reference has them too (experts replicated)
        ref = _one_process({k: v for k, v in config.items() if k != "parallel"}, sched)
    else:
        ref = _one_process(config, sched)
    runs = run_ranks(_train, world, config, sched, timeout=90)
    seen = set()
    for rank, run in enumerate(runs):
        steps = len(ref["took"])
        assert run["took"] == ref["took"] == [True] * steps
        # each rank's stepping optimizer(s), once per step, with one process's hyper-parameters
        per_step = len(run["used"]) // steps
        assert per_step >= 1 and len(run["used"]) == per_step * steps, f"rank {rank}"
        for k in range(steps):
            for used in run["used"][k * per_step:(k + 1) * per_step]:
                assert used == ref["used"][k], f"rank {rank} step {k}: used {used}"
        seen |= _compare(run, _ref_state(ref), f"rank {rank}", rtol=1e-5, atol=1e-7)
        assert run["last_lr"] == ref["last_lr"]
    assert seen == set(ref["state"]), "the ranks hold the whole model"


# -- mixed precision: O1 / O2 / O3 in bf16, and fp16's skipped step -----------------------------

AMP = {
    "O1": {"mode": AMP_TYPE.TORCH, "dtype": "bfloat16"},
    "O2": {"mode": AMP_TYPE.NAIVE, "dtype": "bfloat16"},
    "O3": {"mode": AMP_TYPE.APEX, "opt_level": "O3", "dtype": "bfloat16"},
}
# OneCycleLR writes lr and momentum, "manual" lr and weight decay by hand (StepLR: lr, a subset)
AMP_CASES = [(level, sched) for level in AMP for sched in ("OneCycleLR", "manual")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("level, sched", AMP_CASES, ids=[f"{a}-{b}" for a, b in AMP_CASES])
def test_deep_amp_bf16_x_ddp_uses_the_schedules_learning_rates(level, sched):
    """The half model (O2: fp32 masters, O3: no masters) steps with the schedule's lr, momentum and
    weight decay, and its parameters track fp32 one-process training to bf16 tolerance (a stuck
    lr of 0.5 is far outside)."""
    config = {"fp16": AMP[level]}
    plain, used = _plain_torch(sched, torch.float32)
    runs = run_ranks(_train, 2, config, sched, torch.float32, timeout=60)
    one = _one_process(config, sched, torch.float32)
    for rank, run in enumerate(runs + [one]):
        assert run["used"] == used, f"rank {rank} (2 = one process under the same AMP)"
        _compare(run, plain, f"rank {rank} vs fp32", rtol=0.1, atol=0.03)
    for rank, run in enumerate(runs):
        _compare(run, _ref_state(one), f"rank {rank} vs one process under AMP", rtol=2e-2,
                 atol=5e-3)


FP16 = {"mode": AMP_TYPE.NAIVE, "dtype": "float16", "initial_scale": 2.0 ** 8}


@pytest.mark.timeout(120)
def test_deep_fp16_skipped_step_consumes_a_scheduler_step_as_torchs_gradscaler_recipe():
    """An overflow (an inf on rank 1 only, step 1) skips the step on both ranks; the loop calls
    scheduler.step() anyway, as torch's GradScaler recipe does. So step 1 steps nothing and the
    later steps use lrs 2 and 3 of the schedule -- the same as one process whose step 1 is skipped
    (one rank, the same inject)."""
    config = {"fp16": FP16}
    runs = run_ranks(_train, 2, config, "StepLR", torch.float32, None, None, 0, 1, timeout=60)
    one = run_ranks(_train, 1, config, "StepLR", torch.float32, None, None, 0, 1, timeout=60)[0]
    assert one["took"] == [True, False, True, True]
    expected = [[(LR * 0.5 ** k, MOMENTUM, WD)] for k in (0, 2, 3)]
    for rank, run in enumerate(runs):
        assert run["took"] == one["took"], f"rank {rank}: skipped together"
        assert run["used"] == expected == one["used"], f"rank {rank}"
        _compare(run, _ref_state(one), f"rank {rank}", rtol=2e-2, atol=5e-3)


# -- checkpoints: the scheduler saved in one layout, resumed in the same or another ------------

RESUME_CASES = {  # name: ((config, processes) saving, (config, processes) resuming)
    "ddp x2 -> ddp x2": (LAYOUTS["ddp x2"], LAYOUTS["ddp x2"]),
    "1f1b x2 -> 1f1b x2": (LAYOUTS["1f1b x2 x clip"], LAYOUTS["1f1b x2 x clip"]),
    "tensor 1d x2 -> tensor 1d x2": (LAYOUTS["tensor 1d x2"], LAYOUTS["tensor 1d x2"]),
    "ddp x2 -> one process": (LAYOUTS["ddp x2"], ({}, 1)),
    "one process -> ddp x2 (zero 2)": (({}, 1), ({"zero": {"level": 2}}, 2)),
    "amp O2 ddp x2 -> amp O2 one process": (({"fp16": AMP["O2"]}, 2), ({"fp16": AMP["O2"]}, 1)),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sched", ["OneCycleLR", "LinearWarmupLR"])
@pytest.mark.parametrize("case", RESUME_CASES)
def test_deep_scheduler_checkpoint_resumes_mid_schedule_like_one_uninterrupted_process(
        tmp_path, case, sched):
    (save_cfg, save_world), (load_cfg, load_world) = RESUME_CASES[case]
    amp = "fp16" in save_cfg
    dtype = torch.float32 if amp else torch.float64
    path = str(tmp_path / "ckpt.pt")
    whole = _one_process(load_cfg, sched, dtype)
    if save_world == 1:  # clip is not in the one-process reference: keep configs alike
        save_cfg = {k: v for k, v in save_cfg.items() if k != "clip_grad_norm"}
    # first half: steps 0, 1 (a loader of 2 batches), saved; second half resumed from it
    first = run_ranks(_train, save_world, save_cfg, sched, dtype, path, None, 0, None, 2,
                      timeout=60)
    assert all(run["used"] == whole["used"][:2] for run in first)
    resumed = run_ranks(_train, load_world, load_cfg, sched, dtype, None, path, 2, timeout=60)
    tol = {"rtol": 2e-2, "atol": 5e-3} if amp else {"rtol": 1e-5, "atol": 1e-7}
    for rank, run in enumerate(resumed):
        assert run["used"] == whole["used"][2:], f"rank {rank}: steps 2, 3's hyper-parameters"
        assert run["last_lr"] == whole["last_lr"]
        _compare(run, _ref_state(whole), f"rank {rank}", **tol)


# -- the Trainer's LRSchedulerHook ---------------------------------------------------------------

def _trainer(rank, world, port, config, sched, by_epoch, epochs, inject=None, path=None,
             max_steps=None, resume=False):
    nc.launch(dict(config), rank=rank, world_size=world, host="127.0.0.1", port=port, timeout=30)
    model = _build(config, torch.float32 if "fp16" in config else torch.float64)
    opt = RecordingSGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WD)
    scheduler = _scheduler(sched, opt)
    batches = _batches(4)  # 2 epochs of 2 batches
    engine, loader, _, scheduler = nc.initialize(
        model, opt, col_nn.VocabParallelCrossEntropyLoss(), my_share(batches[:2]),
        lr_scheduler=scheduler, verbose=False)
    handle = _record()

    class Inject(hooks.BaseHook):
        def __init__(self):
            super().__init__(0)
            self.handle, self.i = None, 0

        def before_train_iter(self, trainer):
            if inject is not None and self.i == inject:
                first = next(p for p in engine.model.parameters() if p.requires_grad)
                self.handle = first.register_hook(
                    lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))

        def after_train_iter(self, trainer, *args):
            if self.handle is not None:
                self.handle.remove()
                self.handle = None
            self.i += 1

    trainer = Trainer(engine)
    if resume:
        assert trainer.resume(path, scheduler)
    saving = [hooks.SaveCheckpointHook(path, lr_scheduler=scheduler)] if path else []
    trainer.fit(loader, epochs=epochs, max_steps=max_steps,
                hooks=[Inject(), hooks.LRSchedulerHook(scheduler, by_epoch=by_epoch), *saving])
    handle.remove()
    return {"state": _full_state(engine), "used": list(USED),
            "last_lr": scheduler.get_last_lr()}


TRAINER_LAYOUTS = {"ddp x2": LAYOUTS["ddp x2"], "1f1b x2": LAYOUTS["1f1b x2 x clip"],
                   "tensor 1d x2": LAYOUTS["tensor 1d x2"]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("by_epoch", [False, True], ids=["per-step", "per-epoch"])
@pytest.mark.parametrize("layout", TRAINER_LAYOUTS)
def test_deep_trainer_lr_scheduler_hook_steps_like_one_process(layout, by_epoch):
    """2 epochs of 2 batches: per step the lrs used are the schedule's 4 first values, per epoch
    its first 2 values twice each."""
    config, world = TRAINER_LAYOUTS[layout]
    ref = one_process(_trainer, {k: v for k, v in config.items()
                                 if k not in ("parallel", "NUM_MICRO_BATCHES")},
                      "StepLR", by_epoch, 2)
    lrs = [LR * 0.5 ** k for k in ((0, 0, 1, 1) if by_epoch else (0, 1, 2, 3))]
    assert [u[0][0] for u in ref["used"]] == lrs
    for rank, run in enumerate(run_ranks(_trainer, world, config, "StepLR", by_epoch, 2,
                                         timeout=60)):
        per = len(run["used"]) // 4
        assert [u[0][0] for u in run["used"][::per]] == lrs, f"rank {rank}"
        assert run["last_lr"] == ref["last_lr"]
        _compare(run, _ref_state(ref), f"rank {rank}", rtol=1e-5, atol=1e-7)


@pytest.mark.timeout(120)
def test_deep_trainer_lr_hook_per_step_and_an_fp16_skipped_step():
    """The hook steps the scheduler per optimizer step *taken* (hooks.py: last_step_taken): a step
    skipped on overflow (iteration 1, an inf on rank 0 only) does not advance the schedule, so the
    2 later steps use the schedule's 2nd and 3rd lrs (Hugging Face's convention; torch's
    GradScaler recipe would use the 3rd and 4th). Both ranks agree, and agree with one process."""
    config = {"fp16": FP16}
    one = run_ranks(_trainer, 1, config, "StepLR", False, 2, 1, timeout=60)[0]
    expected = [[(LR * 0.5 ** k, MOMENTUM, WD)] for k in (0, 1, 2)]
    assert one["used"] == expected
    for rank, run in enumerate(run_ranks(_trainer, 2, config, "StepLR", False, 2, 1,
                                         timeout=60)):
        assert run["used"] == expected, f"rank {rank}"
        assert run["last_lr"] == one["last_lr"] == [LR * 0.5 ** 3]
        _compare(run, _ref_state(one), f"rank {rank}", rtol=2e-2, atol=5e-3)



@pytest.mark.timeout(120)
@pytest.mark.parametrize("sched", ["OneCycleLR", "LinearWarmupLR"])
@pytest.mark.parametrize("layouts", [("ddp x2", "ddp x2"), ("ddp x2", "one process")],
                         ids=["ddp-to-ddp", "ddp-to-one-process"])
def test_deep_trainer_resume_continues_the_schedule_where_max_steps_stopped_it(tmp_path, layouts,
                                                                              sched):
    """max_steps=3 stops in the 2nd epoch (after its 1st batch); Trainer.resume(path, scheduler)
    then trains the last batch with the schedule's 4th lr and momentum and ends as one
    uninterrupted process."""
    path = str(tmp_path / "ckpt.pt")
    whole = one_process(_trainer, {}, sched, False, 2)
    assert len(whole["used"]) == 4
    cfg = {"ddp x2": ({}, 2), "one process": ({}, 1)}
    stopped = run_ranks(_trainer, cfg[layouts[0]][1], {}, sched, False, 2, None, path, 3,
                        timeout=60)
    for rank, run in enumerate(stopped):
        assert run["used"] == whole["used"][:3], f"rank {rank} before the stop"
    resumed = run_ranks(_trainer, cfg[layouts[1]][1], {}, sched, False, 2, None, path, None,
                        True, timeout=60)
    for rank, run in enumerate(resumed):
        assert run["used"] == whole["used"][3:], f"rank {rank} after resuming"
        assert run["last_lr"] == whole["last_lr"]
        _compare(run, _ref_state(whole), f"rank {rank} resumed", rtol=1e-5, atol=1e-7)
