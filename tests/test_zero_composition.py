"""ZeRO composed with other features, each against ONE PROCESS on the whole global batch (under
AMP O2: one process running the same O2): O2 x gradient accumulation with an overflow in the
first micro-step of a group on one rank only; O2 x clipping on 4 ranks (parameters straddling
shards); O2 with a parameter no rank uses and one that only rank 0 uses; O2 with param groups
and a LayerNorm kept fp32; O2 checkpoints saved on 4 ranks with accumulation, loaded into 2 and
1 and continued; the Trainer (LossHook, resuming mid-epoch bit-identically) under ZeRO x O2.
(ZeRO x sequence parallelism x accumulation: rows of test_composition.py's table.)

Exact where it can be: zero_models.py's dyadic grid (inputs on 1/8, coefficients on 1/4,
powers of two for batches, accumulation and the loss scale) makes every half gradient exact
however the batch is split, so the masters, Adam states and half parameters must be equal to
the bit; only clipping's coefficient and LayerNorm's fp32 sums get a tolerance."""
import pytest
import torch
from dist_helpers import run_ranks, run_ranks_cached
from models import tensor_model
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close
from zero_models import LinearLoss, PartNet, dyadic_batch, grouped_adamw
from zero_o2_runs import (
    compare_o2_runs,
    end_of_step,
    inject_overflow,
    micro_step,
    record_o2_state,
    trainer_run,
)
from zero_parallel_runs import (
    AMP_MODES,
    BF16,
    check_states,
    one_process_sgd,
    pipeline_save_worker,
    sgd,
    tied_batch,
    tied_model,
)

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.amp import AMP_TYPE
from nanocolossal.checkpoint import load_checkpoint, save_checkpoint
from nanocolossal.context import gpc

B = 2  # samples per rank per micro-step


def _config(level, accumulation=1, clip=0.0, dtype="float16"):
    config = {"fp16": dict(mode=AMP_TYPE.NAIVE, dtype=dtype, init_scale=2.0**14,
                           growth_interval=2, max_scale=2.0**16),
              "gradient_accumulation": accumulation}
    if clip:
        config["clip_grad_norm"] = clip
    if level:
        config["zero"] = dict(level=level, reduce_bucket_size_mb=2e-4)
    return config


def _engine(rank, world, port, config, side_rows=None, norm=False):
    nc.launch(config, rank=rank, world_size=world, host="127.0.0.1", port=port)
    model = PartNet(side_rows, norm)
    engine, *_ = nc.initialize(model, grouped_adamw(model), LinearLoss(), verbose=False)
    return engine


def _o2_train(rank, world, port, config, n, steps=4, side_rows=None, inject=(1, 0), first=0,
              path=None, norm=False, save=None):
    """`steps` optimizer steps, each `gradient_accumulation` micro-steps of n samples (this
    rank's n / world); at micro-step `inject` (step, micro) the last sample overflows on the last
    rank only. `path`: load it first; `save`: write a checkpoint at the end."""
    engine = _engine(rank, world, port, config, side_rows, norm)
    if path is not None:
        load_checkpoint(path, engine.model, engine.optimizer)
    accumulation, out = engine.gradient_accumulation, dict(took=[], scales=[], norms=[], losses=[])
    losses = []
    for step in range(first, first + steps):
        engine.model.use_side = step % 2 == 0
        for micro in range(accumulation):
            xs, cs = dyadic_batch(step * accumulation + micro, n)
            if (step, micro) == inject:
                inject_overflow(xs, cs)
            loss, took = micro_step(engine, rank, world, xs, cs)
            losses.append(loss)
            assert took is False or micro == accumulation - 1
        end_of_step(engine, out, took)
    out["loss_values"] = losses
    record_o2_state(engine, out)
    if save is not None:
        save_checkpoint(save, first + steps, engine.model, engine.optimizer)
    return out


def _layout(config, world, steps=4, side_rows=None):
    """(one process's O2 record without zero, every rank's record under `config`)."""
    single = {k: v for k, v in config.items() if k != "zero"}
    ref = run_ranks_cached(_o2_train, 1, single, world * B, steps, side_rows)[0]
    return ref, run_ranks(_o2_train, world, config, world * B, steps, side_rows, timeout=60)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("level, world", [(1, 2), (2, 2), (2, 4), (3, 4)])
def test_gloo_zero_o2_gradient_accumulation_with_an_overflow_mid_group(level, world):
    """Scaled half gradients accumulated over 2 micro-steps (no_sync, then one reduction), then
    unscaled: exact; the overflow in micro-step 0 of step 1 on the last rank skips step 1
    everywhere and backs the scale off."""
    ref, runs = _layout(_config(level, accumulation=2), world)
    assert ref["took"] == [True, False, True, True]
    assert ref["scales"] == [2.0**14, 2.0**13, 2.0**13, 2.0**14]
    compare_o2_runs(ref, runs)


@pytest.mark.timeout(60)
def test_deep_zero2_o2_clipping_on_4_ranks_with_straddling_parameters():
    """121 parameters over 4 shards of 31: a.weight, a.bias, b.weight straddle; clipping
    really clips (norm > 0.05) and the norm is one process's."""
    ref, runs = _layout(_config(2, accumulation=2, clip=0.05), 4)
    norms = [n for n in ref["norms"] if n != float("inf")]
    assert len(norms) == 3 and all(n > 0.05 for n in norms)
    ref["norms"] = [None if n == float("inf") else n for n in ref["norms"]]
    for run in runs:
        run["norms"] = [None if n == float("inf") else n for n in run["norms"]]
        run["state"] = {k: v for k, v in run["state"].items() if k.startswith(("master", "exp"))}
    ref["state"] = {k: v for k, v in ref["state"].items() if k.startswith(("master", "exp"))}
    compare_o2_runs(ref, runs, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("level", [1, 2])
def test_deep_zero_o2_parameter_no_rank_uses_and_one_only_rank_0_uses(level):
    """`never`: no gradient anywhere (grad None: no Adam state, no weight decay, as one
    process); `side`: on even steps only, and then only rank 0's samples reach it (the other
    ranks compute no gradient for it). (Not level 3: a unit must run on every data rank or on
    none, sharded_model.py.)"""
    ref, runs = _layout(_config(level, accumulation=2), 2, side_rows=B)
    # optimizer order: weights a, b, side, never (0-3), then biases (4-7); `never` has no state
    assert {k for k in ref["state"] if k.startswith("exp_avg.")} == {
        f"exp_avg.{i}" for i in (0, 1, 2, 4, 5, 6)}
    compare_o2_runs(ref, runs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("level", [1, 2, 3])
def test_deep_zero_o2_param_groups_with_a_layernorm_kept_fp32(level):
    """Two param groups (lr / weight decay) each holding half and fp32 (LayerNorm) parameters:
    two flat buffers per group; LayerNorm's fp32 gradient sums get 1e-5."""
    config = _config(level, accumulation=2)
    ref = run_ranks_cached(_o2_train, 1, {k: v for k, v in config.items() if k != "zero"}, 4,
                           4, None, (1, 0), 0, None, True)[0]
    runs = run_ranks(_o2_train, 2, config, 4, 4, None, (1, 0), 0, None, True, timeout=60)
    assert ref["state"]["param.ln.weight"].dtype == torch.float64  # (recorded as double)
    compare_o2_runs(ref, runs, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(60)
def test_deep_zero_o2_checkpoint_with_accumulation_4_ranks_into_2_and_1_continues(tmp_path):
    """Level 2 on 4 ranks, accumulation 2: 2 steps (the second skipped), saved; loaded into
    level 1 on 2 ranks and into one process (no zero), 2 more steps of the same global batch
    size (micro-steps of 8 samples); against one process's 4 steps straight."""
    path = tmp_path / "ckpt.pt"
    run_ranks(_o2_train, 4, _config(2, accumulation=2), 8, 2, None, (1, 0), 0, None, False, path,
              timeout=60)
    # 8 samples per micro-step on every layout: B = 2 per rank on 4 ranks
    ref = run_ranks(_o2_train, 1, _config(0, accumulation=2), 8, 4, None, (1, 0), 0, None, False,
                    None, timeout=60)[0]
    assert ref["took"] == [True, False, True, True]
    for world, level in ((2, 1), (1, 0)):
        runs = run_ranks(_cont, world, _config(level, accumulation=2), path, timeout=60)
        for run in runs:
            assert run["took"] == ref["took"][2:] and run["scales"] == ref["scales"][2:]
            assert run["scaler"] == ref["scaler"]
            for key, value in run["state"].items():
                assert_close(value, ref["state"][key], rtol=0, atol=0, msg=key)


def _cont(rank, world, port, config, path):
    """Steps 2-3 after the checkpoint, each micro-step 8 samples (8 / world per rank)."""
    engine = _engine(rank, world, port, config)
    load_checkpoint(path, engine.model, engine.optimizer)
    out = dict(took=[], scales=[])
    per = 8 // world
    for step in (2, 3):
        engine.model.use_side = step % 2 == 0
        for micro in range(2):
            xs, cs = dyadic_batch(step * 2 + micro, 8)
            mine = slice(rank * per, (rank + 1) * per)
            engine.zero_grad()
            engine.backward(engine.criterion(engine(xs[mine]), cs[mine]))
            took = engine.step()
        out["took"].append(took)
        out["scales"].append(engine.optimizer.loss_scale)
    return record_o2_state(engine, out)


# -- the Trainer under ZeRO x O2 -------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_deep_trainer_under_zero2_o2_reports_one_process_numbers_and_resumes_bit_identically(
        tmp_path):
    """2 epochs of 8 batches of 4 (accumulation 2: 4 steps an epoch): LossHook and
    LastLossHook are one process's (half forwards: 1e-3), the weights and masters exactly; a
    job stopped after 3 steps (checkpoint at 2, mid-epoch) and resumed ends bit-identical."""
    config = _config(2, accumulation=2)
    ref = run_ranks_cached(trainer_run, 1, _config(0, accumulation=2))[0]
    whole = run_ranks(trainer_run, 2, config, timeout=60)
    for run in whole:
        for split in ("train", "test"):
            for key, value in ref["metrics"][split].items():
                assert run["metrics"][split][key] == pytest.approx(value, rel=1e-3), split
        assert run["last"] == pytest.approx(ref["last"], rel=1e-3)
        assert_close(run["state"], ref["state"], rtol=0, atol=0)
        assert_close(run["opt"]["masters"], ref["opt"]["masters"], rtol=0, atol=0)
    ckpt = str(tmp_path / "ckpt.pt")
    first = run_ranks(trainer_run, 2, config, ckpt, 3, timeout=60)
    assert first[0]["step"] == 3
    second = run_ranks(trainer_run, 2, config, ckpt, None, True, timeout=60)
    for a, b in zip(whole, second):
        for key in a["state"]:
            assert torch.equal(a["state"][key], b["state"][key]), key
        assert_close(a["opt"], b["opt"], rtol=0, atol=0)
        assert a["last"] == b["last"]


# -- ZeRO 1-3 x optimizers, schedulers, freezing, eval mid-group, cross-level checkpoints -------
# ZeRO 1-3 where it meets features no other ZeRO test combines -- SGD with nesterov, RMSprop
# (centered, momentum), Adagrad (lr_decay, initial accumulator), Adam amsgrad, each with two
# param groups of different lr / weight decay; an LR scheduler built on the user's optimizer
# before nc.initialize; a parameter frozen part way through training; an eval forward in the
# middle of gradient accumulation; a checkpoint saved at one ZeRO level and loaded at another;
# level 3 x AMP O2 x tensor 1d x data 2 x accumulation x clip (and 2d's dtypes); pipeline x
# ZeRO 2 x O2 merged into a job without a pipeline.
#
# Every run is compared with ONE process training the same model on the whole batch (float64
# where the feature allows it; under O2 with one process's O2, to half tolerance).

GLOBAL = 8  # samples per optimizer step, split over data ranks and micro-steps
F64 = {"rtol": 1e-9, "atol": 1e-11}


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 7), nn.Tanh(),
                         nn.Linear(7, 4)).double()


def _groups(model, weight_lr, bias_lr, weight_wd, bias_wd):
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return [{"params": weights, "lr": weight_lr, "weight_decay": weight_wd},
            {"params": biases, "lr": bias_lr, "weight_decay": bias_wd}]


OPTIMIZERS = {
    "sgd-nesterov": lambda m: torch.optim.SGD(_groups(m, 0.2, 0.05, 0.1, 0.0), lr=0.1,
                                              momentum=0.9, nesterov=True),
    "rmsprop-centered-momentum": lambda m: torch.optim.RMSprop(
        _groups(m, 0.01, 0.003, 0.01, 0.0), lr=0.01, alpha=0.9, momentum=0.5, centered=True),
    "adagrad": lambda m: torch.optim.Adagrad(_groups(m, 0.1, 0.03, 0.01, 0.0), lr=0.1,
                                             lr_decay=0.05, initial_accumulator_value=0.1),
    "adam-amsgrad": lambda m: torch.optim.Adam(_groups(m, 0.01, 0.02, 0.01, 0.0), lr=0.01,
                                               amsgrad=True),
    "sgd-momentum": lambda m: torch.optim.SGD(_groups(m, 0.1, 0.05, 0.1, 0.05), lr=0.1,
                                              momentum=0.9),
    "adamw": lambda m: torch.optim.AdamW(_groups(m, 0.02, 0.03, 0.1, 0.01), lr=0.02),
}


def _mixed_batch(step, n=GLOBAL):
    g = torch.Generator().manual_seed(700 + step)
    return torch.randn(n, 6, generator=g, dtype=torch.float64), torch.randint(0, 4, (n,),
                                                                              generator=g)


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _freeze(model, step, freeze_at):
    """freeze_at: (step, names): from that step on those parameters get requires_grad=False."""
    if freeze_at is not None and step == freeze_at[0]:
        for name, p in model.named_parameters():
            if name in freeze_at[1]:
                p.requires_grad_(False)


def _one_process(opt_name, steps, scheduler=False, freeze_at=None):
    """The whole batch of every step in one process; the state after each step."""
    model = _model()
    opt = OPTIMIZERS[opt_name](model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if scheduler else None
    states = []
    for step in range(steps):
        _freeze(model, step, freeze_at)
        x, y = _mixed_batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if sched:
            sched.step()
        states.append(_state(model))
    return states


def _worker(rank, world_size, port, config, opt_name, first, last, scheduler=False,
            freeze_at=None, eval_mid=None, load=None, save=None):
    """Steps [first, last) of GLOBAL samples: this data rank's share, in
    gradient_accumulation micro-steps. eval_mid: "nograd" / "grad": an eval-mode forward on a
    separate batch after micro-step 0 of every step (its outputs returned)."""
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port, timeout=30)
    model = _model()
    opt = OPTIMIZERS[opt_name](model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) if scheduler else None
    engine, _, _, sched = nc.initialize(model, opt, nn.CrossEntropyLoss(), lr_scheduler=sched,
                                        verbose=False)
    if load is not None:
        load_checkpoint(load, engine.model, engine.optimizer, sched)
    accum = engine.gradient_accumulation
    n = GLOBAL // gpc.data_size // accum
    evals = []
    for step in range(first, last):
        _freeze(model, step, freeze_at)
        x, y = _mixed_batch(step)
        for m in range(accum):
            lo = (m * gpc.data_size + gpc.data_rank) * n
            engine.train()
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x[lo:lo + n]), y[lo:lo + n]))
            stepped = engine.step()
            assert stepped == (m == accum - 1)
            if eval_mid and m == 0:
                engine.eval()
                xe, _ = _mixed_batch(900 + step, 4)
                if eval_mid == "nograd":
                    with torch.no_grad():
                        evals.append(engine(xe).detach().clone())
                else:
                    evals.append(engine(xe).detach().clone())
        if sched is not None:
            sched.step()
    if save is not None:
        save_checkpoint(save, last, engine.model, engine.optimizer, sched)
    return _state(engine.model), evals


def _check(results, expected, tol=F64):
    for rank, (state, _) in enumerate(results):
        for key, value in expected.items():
            assert_close(state[key], value, **tol, msg=lambda m: f"rank {rank} {key}: {m}")


# -- element-wise optimizers other than SGD/AdamW, two param groups, every level ----------------

# Levels 1 and 2 step the same shards of one flat buffer (they differ in how gradients arrive,
# which no optimizer changes): each optimizer at level 3 and at one of them.
OPT_CASES = [("sgd-nesterov", 1), ("rmsprop-centered-momentum", 2), ("adagrad", 1),
             ("adam-amsgrad", 2)] + [(o, 3) for o in ("sgd-nesterov", "rmsprop-centered-momentum",
                                                      "adagrad", "adam-amsgrad")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("opt_name, level", OPT_CASES, ids=[f"{o}-zero{lv}" for o, lv in OPT_CASES])
def test_deep_zero_levels_x_elementwise_optimizers_x_param_groups_x_accumulation(opt_name, level):
    expected = _one_process(opt_name, 3)[-1]
    config = {"zero": {"level": level, "reduce_bucket_size_mb": 2e-4},
              "gradient_accumulation": 2}
    _check(run_ranks(_worker, 2, config, opt_name, 0, 3, timeout=60), expected)


# -- an LR scheduler built on the user's optimizer before nc.initialize -------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("level", [0, 1, 2, 3], ids=["no-zero", "zero1", "zero2", "zero3"])
def test_deep_zero_x_lr_scheduler_built_before_initialize_equals_one_process(level):
    """The tutorials' order: optimizer, lr_scheduler(optimizer), then initialize(..., lr_scheduler)
    and scheduler.step() after each optimizer step: the learning rate halves every step."""
    expected = _one_process("sgd-momentum", 3, scheduler=True)[-1]
    config = {"zero": {"level": level}} if level else {}
    _check(run_ranks(_worker, 2, config, "sgd-momentum", 0, 3, True, timeout=60), expected)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("saved, resumed", [((2, 2), (4, 3)), ((2, 3), (1, 0)), ((1, 0), (2, 1))],
                         ids=["zero2-data2-to-zero3-data4", "zero3-to-one-process",
                              "one-process-to-zero1"])
def test_deep_zero_x_lr_scheduler_x_checkpoint_resumes_the_learning_rate(tmp_path, saved,
                                                                        resumed):
    """Saved after 2 steps with the scheduler, resumed for 2 more at another level and data
    size: the learning rate goes on halving from where it was (the saved groups' lr reaches the
    user's groups, which the scheduler and each step read)."""
    path = str(tmp_path / "ckpt.pt")
    (size, level), (size2, level2) = saved, resumed
    config = {"zero": {"level": level}} if level else {}
    run_ranks(_worker, size, config, "sgd-momentum", 0, 2, True, None, None, None, path,
              timeout=60)
    config = {"zero": {"level": level2}} if level2 else {}
    expected = _one_process("sgd-momentum", 4, scheduler=True)[-1]
    _check(run_ranks(_worker, size2, config, "sgd-momentum", 2, 4, True, None, None, path,
                     timeout=60), expected)


# -- a parameter frozen part way (requires_grad=False): one process skips it -------------------

FREEZE = {"one-weight": ("2.weight",), "middle-unit": ("2.weight", "2.bias"),
          "first-unit": ("0.weight", "0.bias")}
FREEZE_CASES = [(lv, f) for lv in (1, 2, 3) for f in FREEZE if lv == 3 or f == "one-weight"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("level, frozen", FREEZE_CASES,
                         ids=[f"zero{lv}-{f}" for lv, f in FREEZE_CASES])
def test_deep_zero_x_parameter_frozen_part_way_is_not_moved_by_momentum_or_decay(level, frozen):
    """SGD momentum 0.9, weight decay 0.1: after freezing, one process gives the frozen weight
    no gradient (grad None) and SGD leaves it alone; a zero gradient would still move it.
    Level 3: one weight of a unit, a whole unit, the first unit (whose inputs need no grad)."""
    names = FREEZE[frozen]
    states = _one_process("sgd-momentum", 4, freeze_at=(2, names))
    for name in names:
        assert torch.equal(states[1][name], states[3][name])
    config = {"zero": {"level": level, "reduce_bucket_size_mb": 2e-4}}
    _check(run_ranks(_worker, 2, config, "sgd-momentum", 0, 4, False, (2, names), timeout=60),
           states[-1])


# -- an eval forward in the middle of gradient accumulation -----------------------------------

EVAL_CASES = [(lvl, mode) for lvl in (1, 2, 3) for mode in ("nograd", "grad")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("level, mode", EVAL_CASES, ids=[f"zero{lv}-{m}" for lv, m in EVAL_CASES])
def test_deep_zero_x_eval_forward_between_accumulated_micro_steps(level, mode):
    """accumulation 2: after micro-step 0 an eval forward (under no_grad, or grad mode on):
    the training result is one process's, and the eval outputs are the model's at that time."""
    states = _one_process("adamw", 3)
    config = {"zero": {"level": level, "reduce_bucket_size_mb": 2e-4},
              "gradient_accumulation": 2}
    results = run_ranks(_worker, 2, config, "adamw", 0, 3, False, None, mode, timeout=60)
    _check(results, states[-1])
    model = _model()
    for step in range(3):  # the eval of step s sees the weights after step s-1
        if step:
            model.load_state_dict(states[step - 1])
        else:
            model = _model()
        with torch.no_grad():
            want = model(_mixed_batch(900 + step, 4)[0])
        for rank, (_, evals) in enumerate(results):
            assert_close(evals[step], want, **F64, msg=lambda m: f"rank {rank} step {step}: {m}")


# -- a checkpoint saved at one ZeRO level (and data size), loaded at another -------------------

# (3 -> 1: adagrad below; amsgrad's third state across levels: the three amsgrad rows)
LEVEL_CHANGES = [("adam-amsgrad", 2, 1, 2, 3), ("adam-amsgrad", 2, 2, 4, 3),
                 ("adam-amsgrad", 4, 3, 2, 2), ("rmsprop-centered-momentum", 2, 3, 1, 0),
                 ("adagrad", 2, 3, 4, 1), ("sgd-nesterov", 1, 0, 2, 3)]


def _zero(level):
    return {"zero": {"level": level}} if level else {}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("opt_name, saved_world, saved_level, loaded_world, loaded_level",
                         LEVEL_CHANGES, ids=[f"{o}-data{a}-zero{b}-to-data{c}-zero{d}"
                                             for o, a, b, c, d in LEVEL_CHANGES])
def test_deep_zero_checkpoint_across_levels_resumes_as_one_process(
        tmp_path, opt_name, saved_world, saved_level, loaded_world, loaded_level):
    """Two param groups, per-element states (Adam amsgrad: three; RMSprop centered with momentum:
    three; Adagrad: its sums): 2 steps, save, load at another level / data size (0: no ZeRO),
    2 more steps: one process's 4 steps straight."""
    expected = _one_process(opt_name, 4)[-1]
    path = str(tmp_path / "ckpt.pt")
    run_ranks(_worker, saved_world, _zero(saved_level), opt_name, 0, 2,
              False, None, None, None, path, timeout=60)
    _check(run_ranks(_worker, loaded_world, _zero(loaded_level), opt_name,
                     2, 4, False, None, None, path, timeout=60), expected)


# -- ZeRO 3 x AMP O2 x tensor: 1d x data 2 x accumulation x clip (fp16); 2d's dtypes (bf16) ---

CLIP = 0.05


def _images(step, n=GLOBAL):
    g = torch.Generator().manual_seed(2100 + step)
    return torch.randn(n, 1, 4, 4, generator=g), torch.randint(0, 3, (n,), generator=g)


def _o2_tensor_worker(rank, world_size, port, config, steps, ref=None):
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port, timeout=30)
    model = tensor_model()
    opt = torch.optim.AdamW(_groups(model, 0.02, 0.01, 0.05, 0.0), lr=0.02)
    engine, *_ = nc.initialize(model, opt, col_nn.CrossEntropyLoss(), verbose=False)
    accum = engine.gradient_accumulation
    n = GLOBAL // gpc.data_size // accum
    norms, took = [], []
    for step in range(steps):
        x, y = _images(step)
        for m in range(accum):
            lo = (m * gpc.data_size + gpc.data_rank) * n
            engine.zero_grad()
            engine.execute_schedule((x[lo:lo + n], y[lo:lo + n]))
            stepped = engine.step()
        took.append(stepped)
        norms.append(engine.last_grad_norm)
    state = {k: v.detach().float().clone() for k, v in engine.model.state_dict().items()}
    splits = {k: getattr(p, "tensor_splits", []) for k, p in engine.model.named_parameters()}
    dtypes = {k: v.dtype for k, v in engine.model.state_dict().items()}
    if ref is not None:  # my slice of one process's tensors (shard needs this job's gpc)
        from nanocolossal.tensor.base import slice_of
        ref = {k: slice_of(v, splits.get(k, [])) for k, v in ref.items()}
    return state, ref, norms, took, dtypes


@pytest.mark.timeout(120)
def test_deep_zero3_x_o2_x_tensor_1d_x_data2_x_accumulation_x_clip_tracks_one_process_o2():
    """fp16, the loss scaler's path, on 4 ranks (ZeRO 3 treats a 1d or a 2d shard alike: 2d x
    ZeRO 3 is the dtype test below and the table row "2d x zero3 x accum2, resumed"; bf16 O2 x
    ZeRO 3 trajectories: test_zero_fp16, test_zero3_o2_composition)."""
    from nanocolossal.amp import AMP_TYPE
    dtype = "float16"
    config = {"fp16": dict(mode=AMP_TYPE.NAIVE, dtype=dtype, init_scale=2.0**10),
              "gradient_accumulation": 2, "clip_grad_norm": CLIP}
    ref_state, _, ref_norms, ref_took, ref_dtypes = run_ranks(_o2_tensor_worker, 1, config, 3,
                                                              timeout=60)[0]
    assert ref_took == [True] * 3 and min(ref_norms) > CLIP, "the clip really clips"
    assert getattr(torch, dtype) in ref_dtypes.values(), "the model is half (O2)"
    layout = {**config, "parallel": {"tensor": {"size": 2, "mode": "1d"}},
              "zero": {"level": 3}}
    runs = run_ranks(_o2_tensor_worker, 4, layout, 3, ref_state, timeout=100)
    tol = dict(rtol=5e-3, atol=5e-3)
    for rank, (state, want, norms, took, dtypes) in enumerate(runs):
        assert took == ref_took
        assert norms == pytest.approx(ref_norms, rel=tol["rtol"]), f"rank {rank}"
        assert set(state) == set(ref_state)
        for key, value in state.items():
            assert_close(value, want[key], **tol,
                         msg=lambda m: f"rank {rank} {key}: {m}")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("level", [0, 3], ids=["no-zero", "zero3"])
def test_deep_o2_x_tensor_2d_keeps_layernorm_in_fp32_as_one_process_does(level):
    """The parameters' dtypes under 2d x4 (data 1) O2, with and without ZeRO 3, are one
    process's O2 dtypes (normalisation layers fp32, the rest half)."""
    from nanocolossal.amp import AMP_TYPE
    config = {"fp16": dict(mode=AMP_TYPE.NAIVE, dtype="bfloat16")}
    ref_dtypes = run_ranks_cached(_o2_tensor_worker, 1, config, 1)[0][4]
    assert ref_dtypes["1.weight"] == torch.float32 and ref_dtypes["2.weight"] == torch.bfloat16
    layout = {**config, "parallel": {"tensor": {"size": 4, "mode": "2d"}},
              **({"zero": {"level": level}} if level else {})}
    for rank, run in enumerate(run_ranks(_o2_tensor_worker, 4, layout, 1, timeout=60)):
        assert run[4] == ref_dtypes, f"rank {rank}"


# -- pipeline 2 x data 2 x ZeRO 1/2 x bf16 O2 saved; resumed WITHOUT a pipeline, another level --

# tied_model's parameters in one process -> (stage, index among that stage's parameters) under
# partition [3, 5]; the tied table W is in both stages (same value, same momentum): stage 0's
STAGE_OF = [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (1, 0), (1, 1), (1, 3), (1, 4)]


def _unpipelined_resume_worker(rank, world_size, port, config, path):
    from zero_parallel_runs import GLOBAL as PGLOBAL  # (this file's GLOBAL is its own)

    from nanocolossal.checkpoint import (
        load_optimizer_state,
        load_plain_state_dict,
        merge_checkpoint,
        stage_path,
    )
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port, timeout=30)
    model = tied_model()
    engine, *_ = nc.initialize(model, sgd(model.parameters()), nn.CrossEntropyLoss(),
                               verbose=False)
    load_plain_state_dict(engine.model, merge_checkpoint(path))
    stages = [load_optimizer_state(stage_path(path, s)) for s in (0, 1)]
    params = list(model.parameters())
    state, masters = {}, []
    for i, (s, j) in enumerate(STAGE_OF):
        assert stages[s]["masters"][j].shape == params[i].shape, (i, s, j)
        masters.append(stages[s]["masters"][j])
        if j in stages[s]["optimizer"]["state"]:
            state[i] = stages[s]["optimizer"]["state"][j]
    group = {**stages[0]["optimizer"]["param_groups"][0], "params": list(range(len(params)))}
    engine.optimizer.load_state_dict({"optimizer": {"state": state, "param_groups": [group]},
                                      "masters": masters, "scaler": stages[0]["scaler"]})
    x, y = tied_batch(2, PGLOBAL, torch.float32)
    n = PGLOBAL // gpc.data_size
    mine = slice(gpc.data_rank * n, (gpc.data_rank + 1) * n)
    engine.zero_grad()
    engine.backward(engine.criterion(engine(x[mine]), y[mine]))
    assert engine.step()
    return _state(engine.model), []


UNPIPELINED = [(1, 2, 2), (2, 2, 1), (2, 2, 3), (2, 1, 0)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("saved_level, world, level", UNPIPELINED,
                         ids=[f"zero{a}-to-data{b}-{'zero%d' % c if c else 'plain'}"
                              for a, b, c in UNPIPELINED])
def test_deep_pipeline_x_zero_x_o2_checkpoint_resumes_without_a_pipeline(tmp_path, saved_level,
                                                                         world, level):
    """Saved by pipeline 2 x data 2 (ZeRO saved_level, bf16 O2) after 2 steps; its merged model,
    each stage's plain optimizer state (momentum) and fp32 masters put together, loaded into a
    job with no pipeline (`world` data ranks, ZeRO `level`): its 3rd step is one process's."""
    states, _ = one_process_sgd(opt_level="O2")
    path = str(tmp_path / "ckpt.pt")
    fp16 = {"fp16": AMP_MODES["O2"]}
    run_ranks(pipeline_save_worker, 4, {**fp16, "zero": {"level": saved_level}}, path, 2,
              timeout=60)
    config = {**fp16, **({"zero": {"level": level}} if level else {})}
    results = run_ranks(_unpipelined_resume_worker, world, config, path, timeout=60)
    check_states(results, states[2], BF16)


# -- a branch used in the first micro-step of an accumulation group only ----------------------

class Branch(nn.Module):
    """`side` runs only while use_side is set: on every rank in micro-step 0 of each step,
    never in the last one (the one that reduces)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.side = nn.Linear(6, 7), nn.Linear(7, 4), nn.Linear(7, 4)
        self.double()
        self.use_side = True

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h) + self.side(h) if self.use_side else self.b(h)


ACCUM = 2


def _branch_one_process(steps, opt_name):
    model = Branch()
    opt = OPTIMIZERS[opt_name](model)
    n = GLOBAL // ACCUM
    for step in range(steps):
        x, y = _mixed_batch(step)
        opt.zero_grad()
        for m in range(ACCUM):
            model.use_side = m == 0
            (F.cross_entropy(model(x[m * n:(m + 1) * n]), y[m * n:(m + 1) * n]) / ACCUM).backward()
        opt.step()
    return _state(model)


def _branch_worker(rank, world_size, port, config, opt_name, steps):
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port, timeout=30)
    model = Branch()
    engine, *_ = nc.initialize(model, OPTIMIZERS[opt_name](model), nn.CrossEntropyLoss(),
                               verbose=False)
    n = GLOBAL // gpc.data_size // ACCUM
    for step in range(steps):
        x, y = _mixed_batch(step)
        for m in range(ACCUM):
            model.use_side = m == 0
            lo = (m * gpc.data_size + gpc.data_rank) * n
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x[lo:lo + n]), y[lo:lo + n]))
            assert engine.step() == (m == ACCUM - 1)
    return _state(engine.model), []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("level", [0, 1, 2, 3], ids=["ddp", "zero1", "zero2", "zero3"])
def test_deep_zero_x_accumulation_x_branch_used_only_before_the_reducing_micro_step(level):
    """The side branch's gradient comes from micro-step 0 alone (under no_sync): it must still
    be averaged and stepped, as one process accumulates it."""
    expected = _branch_one_process(3, "adamw")
    config = {"gradient_accumulation": ACCUM,
              **({"zero": {"level": level, "reduce_bucket_size_mb": 2e-4}} if level else {})}
    _check(run_ranks(_branch_worker, 2, config, "adamw", 3, timeout=60), expected)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("level", [2, 3], ids=["zero2", "zero3"])
def test_deep_zero_no_overlap_x_accumulation_x_branch_used_only_before_the_reducing_micro_step(
        level):
    expected = _branch_one_process(3, "sgd-momentum")
    config = {"gradient_accumulation": ACCUM,
              "zero": {"level": level, "reduce_bucket_size_mb": 2e-4,
                       "overlap_communication": False}}
    _check(run_ranks(_branch_worker, 2, config, "sgd-momentum", 3, timeout=60), expected)


# -- level 3: a child module called twice in one forward (a weight-shared recurrent block) -------

class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.block, self.head = nn.Linear(6, 7), nn.Linear(7, 7), nn.Linear(7, 4)
        self.double()

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.block(h))
        h = torch.tanh(self.block(h))  # the same unit again
        return self.head(h)


def _twice_worker(rank, world_size, port, config, steps):
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port, timeout=30)
    model = Twice()
    engine, *_ = nc.initialize(model, OPTIMIZERS["sgd-momentum"](model), nn.CrossEntropyLoss(),
                               verbose=False)
    n = GLOBAL // gpc.data_size
    try:
        for step in range(steps):
            x, y = _mixed_batch(step)
            lo = gpc.data_rank * n
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x[lo:lo + n]), y[lo:lo + n]))
            assert engine.step()
    except Exception as e:  # refusing it, with an error that says so, is acceptable too
        return None, repr(e)
    return _state(engine.model), None


@pytest.mark.timeout(120)
def test_gloo_zero3_unit_called_twice_per_forward_is_one_process_or_refused():
    model = Twice()
    opt = OPTIMIZERS["sgd-momentum"](model)
    for step in range(2):
        x, y = _mixed_batch(step)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    results = run_ranks(_twice_worker, 2, {"zero": {"level": 3}}, 2, timeout=60)
    for rank, (state, error) in enumerate(results):
        if error is not None:
            assert "twice" in error or "once" in error or "more than one" in error, error
            continue
        for key, value in _state(model).items():
            assert_close(state[key], value, **F64, msg=lambda m: f"rank {rank} {key}: {m}")


def _scheduler_warning_worker(rank, world_size, port, level):
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _worker(rank, world_size, port, {"zero": {"level": level}}, "sgd-momentum", 0, 2, True)
    return [str(w.message) for w in caught if "lr_scheduler.step()" in str(w.message)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("level", [1, 3], ids=["zero1", "zero3"])
def test_deep_zero_x_lr_scheduler_gives_no_step_order_warning(level):
    """torch's schedulers warn when they step before the optimizer did, watching the user's
    optimizer.step(); ZeRO steps its own inner optimizer, and says so to them."""
    for said in run_ranks(_scheduler_warning_worker, 2, level, timeout=60):
        assert said == [], said
