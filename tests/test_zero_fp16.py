"""ZeRO levels 1-2 under AMP O2 (half parameters, fp32 masters of this rank's shard only) on gloo
ranks track one process running the same O2 on the whole batch: steps taken and skipped, the
loss scale, parameters and masters; memory per rank is zero/mixed.py's formula; checkpoints are
one process's O2 state and load into any data size. Then ZeRO 1-3 x O2 where it meets the loop:
gradient accumulation with an overflow mid-group on one rank, a clip on 4 ranks with parameters
straddling shards, a parameter no rank uses and one only rank 0 uses, param groups with a
LayerNorm kept fp32, a checkpoint of 4 ranks continued on 2 and 1, the Trainer's hooks and
resume. (ZeRO 3 x O2: test_zero3_o2.py.)

Exact on purpose: parallel Linear layers under a linear loss have gradients x^T c that do not
depend on the weights; with inputs on a 1/8 grid, c on a 1/4 grid and powers of two for the
batch and the loss scale, every half-precision gradient is exact however the batch is split,
so any difference is ZeRO's, not rounding's."""
import pytest
import torch
from dist_helpers import run_ranks, run_ranks_cached
from run_records import assert_bit_identical
from torch import nn
from torch.testing import assert_close
from zero_models import DyadicNet, LinearLoss, PartNet, dyadic_batch, grouped_adamw
from zero_o2_runs import (
    compare_o2_runs,
    end_of_step,
    inject_overflow,
    micro_step,
    record_o2_state,
    trainer_run,
)

import nanocolossal as nc
from nanocolossal.amp import AMP_TYPE
from nanocolossal.checkpoint import (
    load_checkpoint,
    load_optimizer_state,
    save_checkpoint,
)
from nanocolossal.config import ConfigError, load_config

pytestmark = pytest.mark.timeout(120)
B = 2  # samples per rank
STEPS, INF_STEP = 5, 2


def _config(dtype, level, mode="naive"):
    fp16 = (dict(mode=AMP_TYPE.NAIVE) if mode == "naive"
            else dict(mode=AMP_TYPE.APEX, opt_level="O2"))
    fp16.update(dtype=dtype, init_scale=2.0**14, growth_interval=2, max_scale=2.0**16)
    config = {"fp16": fp16}
    if level:
        config["zero"] = dict(level=level, reduce_bucket_size_mb=2e-4)
    return config


def _launch(rank, world_size, port, config):
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    model = DyadicNet()
    engine, *_ = nc.initialize(model, grouped_adamw(model), LinearLoss(), verbose=False)
    return engine


def _train(engine, rank, world_size, steps, n, first=0, inf_step=INF_STEP):
    """Each step a global batch of n samples, this rank's slice; at `inf_step` the last
    sample overflows (on the last rank only)."""
    log, per = [], n // world_size
    for step in range(first, first + steps):
        engine.model.use_side = step % 2 == 0
        xs, cs = dyadic_batch(step, n)
        if step == inf_step and next(engine.model.parameters()).dtype == torch.float16:
            # one gradient element overflows (b.weight[0, 3]: in one rank's shard only)
            xs[-1, 9], cs[-1] = 60000.0, 0.0
            cs[-1, 7] = 0.25
        elif step == inf_step:  # bf16's range: an inf input (a column of inf/nan gradients)
            xs[-1, 0] = float("inf")
        lo = rank * per
        engine.zero_grad()
        engine.backward(engine.criterion(engine(xs[lo:lo + per]), cs[lo:lo + per]))
        stepped = engine.step()
        log.append((stepped, engine.optimizer.loss_scale, engine.last_grad_norm
                    if engine.clip_grad_norm else None))
    return log


def _result(engine, log):
    state = engine.optimizer.state_dict()  # a collective under ZeRO
    return log, {k: v.clone() for k, v in engine.model.state_dict().items()}, state


def _worker(rank, world_size, port, config, n):
    engine = _launch(rank, world_size, port, config)
    log = _train(engine, rank, world_size, STEPS, n)
    if "zero" in config:
        assert type(engine.optimizer).__name__ == ("MixedParamShardedOptimizer"
                                                   if config["zero"]["level"] == 3
                                                   else "MixedShardedOptimizer")
        assert all(p.dtype != torch.float32 for p in engine.model.parameters())
    return _result(engine, log)


def _assert_same(got, want, clip=False):
    (log, params, state), (wlog, wparams, wstate) = got, want
    assert [s for s, _, _ in log] == [s for s, _, _ in wlog]  # the same steps skipped
    assert [s for _, s, _ in log] == [s for _, s, _ in wlog]  # the same loss scales
    if clip:
        assert [n for *_, n in log if n != float("inf")] == pytest.approx(
            [n for *_, n in wlog if n != float("inf")], rel=1e-5)
    tol = dict(rtol=1e-5, atol=1e-6) if clip else dict(rtol=0, atol=0)
    assert_close(state["masters"], wstate["masters"], **tol)
    assert_close(state["optimizer"], wstate["optimizer"], **tol)
    assert state["scaler"] == wstate["scaler"]
    assert_close(params, wparams, **(dict(rtol=1e-3, atol=1e-6) if clip else tol))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("level", [1, 2, 3])
def test_gloo_zero_o2_equals_one_process_o2(level, dtype):
    # shards of 2 and 4 ranks cut the parameters in different places; bf16 cuts them as fp16
    for world_size in (2, 4) if dtype == "float16" else (2,):
        want = run_ranks_cached(_worker, 1, _config(dtype, 0), world_size * B)[0]
        log = want[0]
        assert [s for s, _, _ in log].count(False) == 1 and not log[INF_STEP][0]
        if dtype == "float16":  # grows after 2 clean steps, backs off at the overflow
            assert [s for _, s, _ in log] == [2.0**14, 2.0**15, 2.0**14, 2.0**14, 2.0**15]
        for got in run_ranks(_worker, world_size, _config(dtype, level), world_size * B,
                             timeout=60):
            _assert_same(got, want)


def test_deep_zero_o2_apex_spelling_and_clipping_that_clips():
    single = {**_config("float16", 0, "apex"), "clip_grad_norm": 0.05}
    want = run_ranks(_worker, 1, single, 2 * B, timeout=60)[0]
    norms = [n for _, _, n in want[0] if n != float("inf")]
    assert len(norms) == STEPS - 1 and all(n > 0.05 for n in norms)  # it really clips
    for level in (1, 2, 3):
        config = {**_config("float16", level, "apex"), "clip_grad_norm": 0.05}
        for got in run_ranks(_worker, 2, config, 2 * B, timeout=60):
            _assert_same(got, want, clip=True)


def _memory_worker(rank, world_size, port, level):
    nc.launch(_config("float16", level), rank=rank, world_size=world_size, host="127.0.0.1",
              port=port)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 9), nn.Tanh(), nn.Linear(9, 5))  # Psi = 149
    engine, *_ = nc.initialize(model, torch.optim.AdamW(model.parameters()), LinearLoss(),
                               verbose=False)
    xs, cs = dyadic_batch(0, world_size * B)  # (no overflow: both steps are taken)
    xs, cs = xs[rank * B:(rank + 1) * B], cs[rank * B:(rank + 1) * B, :5]
    for step in range(2):  # after the second backward: states exist, gradients are fresh
        engine.zero_grad()
        engine.backward(engine.criterion(engine(xs), cs))
        if step == 0:
            assert engine.step()
    opt, nbytes = engine.optimizer, lambda t: t.numel() * t.element_size()
    params = list(engine.model.parameters())
    grads = sum(nbytes(p.grad) for p in params if p.grad is not None)  # level 1: all
    grads += sum(nbytes(h.grad) for h, _ in opt.master_pairs() if h.grad is not None)  # level 2
    # the masters' storages (a view of a whole-model fp32 copy would count whole)
    masters = {q.untyped_storage().data_ptr(): q.untyped_storage().nbytes()
               for g in opt.optimizer.param_groups for q in g["params"]
               if q.dtype == torch.float32}
    # level 3 keeps only its half shard of each unit (the parameters point at a placeholder)
    held = opt.shard_bytes() if level == 3 else sum(nbytes(p) for p in params)
    return held, grads, sum(masters.values()), opt.state_bytes()


@pytest.mark.parametrize("level", [1, 2, 3])
def test_deep_zero_o2_bytes_per_rank_equal_the_formula(level):
    """Level 1: 2 Psi + 2 Psi + 12 Psi/N; level 2: 2 Psi + 2 Psi/N + 12 Psi/N, with Psi/N the
    elements of the rank's shard: ceil(Psi/N), the last ones less; level 3: (2 + 2 + 12) Psi/N,
    each unit (the two Linear layers) cut into N padded shards."""
    units = (10 * 9 + 9, 9 * 5 + 5)
    psi = sum(units)
    for n in (1, 2, 4):
        measured = run_ranks(_memory_worker, n, level, timeout=60)
        if level == 3:
            shards = [-(-u // n) for u in units]
            mine = [sum(min(s, max(0, u - r * s)) for u, s in zip(units, shards))
                    for r in range(n)]
            expected = [(2 * sum(shards), 2 * m, 4 * m, 8 * m) for m in mine]
        else:
            shard = -(-psi // n)
            mine = [min(shard, psi - r * shard) for r in range(n)]
            expected = [(2 * psi, 2 * psi if level == 1 else 2 * m, 4 * m, 8 * m) for m in mine]
        assert measured == expected, (n, measured, expected)


def _save_worker(rank, world_size, port, path, level):
    engine = _launch(rank, world_size, port, _config("float16", level))
    log = _train(engine, rank, world_size, 3, 2 * B)
    save_checkpoint(path, 3, engine.model, engine.optimizer)
    return _result(engine, log)


def _resume_worker(rank, world_size, port, path, level, n):
    """Steps 3-4 on n samples each (step 3 overflows), after the checkpoint or (path None, one
    process) after the same 3 steps of 2 x B samples."""
    engine = _launch(rank, world_size, port, _config("float16", level))
    if path is not None:
        assert load_checkpoint(path, engine.model, engine.optimizer)["epoch"] == 3
    else:
        _train(engine, rank, 1, 3, 2 * B)
    return _result(engine, _train(engine, rank, world_size, 2, n, first=3, inf_step=3))


@pytest.mark.parametrize("level", [1, 2, 3])
def test_deep_zero_o2_checkpoint_is_one_process_o2_and_loads_into_any_size(level, tmp_path):
    path = tmp_path / "ckpt.pt"
    saved = run_ranks(_save_worker, 2, path, level, timeout=60)[0]
    single = run_ranks(_save_worker, 1, tmp_path / "single.pt", 0, timeout=60)[0]
    _assert_same(saved, single)  # the file holds one process's O2 state
    on_disk = load_optimizer_state(path)
    assert_close(on_disk["masters"], single[2]["masters"], rtol=0, atol=0)
    for world_size in (1, 2, 4):  # the straight run, then from the file on 1 (no zero), 2, 4
        want = run_ranks_cached(_resume_worker, 1, None, 0, world_size * B)[0]
        assert [s for s, _, _ in want[0]] == [False, True]  # step 3's overflow, then a step
        for got in run_ranks(_resume_worker, world_size, path, level if world_size > 1 else 0,
                             world_size * B, timeout=60):
            _assert_same(got, want)


# -- ZeRO x O2 x accumulation (an overflow mid-group), clip on 4 ranks, unused parameters,
#    checkpoints, the Trainer ---------------------------------------------------------------------

def _accum_config(level, accumulation=1, clip=0.0, dtype="float16"):
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
    ref, runs = _layout(_accum_config(level, accumulation=2), world)
    assert ref["took"] == [True, False, True, True]
    assert ref["scales"] == [2.0**14, 2.0**13, 2.0**13, 2.0**14]
    compare_o2_runs(ref, runs)


@pytest.mark.timeout(60)
def test_deep_zero2_o2_clipping_on_4_ranks_with_straddling_parameters():
    """121 parameters over 4 shards of 31: a.weight, a.bias, b.weight straddle; clipping
    really clips (norm > 0.05) and the norm is one process's."""
    ref, runs = _layout(_accum_config(2, accumulation=2, clip=0.05), 4)
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
    ref, runs = _layout(_accum_config(level, accumulation=2), 2, side_rows=B)
    # optimizer order: weights a, b, side, never (0-3), then biases (4-7); `never` has no state
    assert {k for k in ref["state"] if k.startswith("exp_avg.")} == {
        f"exp_avg.{i}" for i in (0, 1, 2, 4, 5, 6)}
    compare_o2_runs(ref, runs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("level", [1, 2, 3])
def test_deep_zero_o2_param_groups_with_a_layernorm_kept_fp32(level):
    """Two param groups (lr / weight decay) each holding half and fp32 (LayerNorm) parameters:
    two flat buffers per group; LayerNorm's fp32 gradient sums get 1e-5."""
    config = _accum_config(level, accumulation=2)
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
    run_ranks(_o2_train, 4, _accum_config(2, accumulation=2), 8, 2, None, (1, 0), 0, None, False,
              path, timeout=60)
    # 8 samples per micro-step on every layout: B = 2 per rank on 4 ranks
    ref = run_ranks(_o2_train, 1, _accum_config(0, accumulation=2), 8, 4, None, (1, 0), 0, None,
                    False, None, timeout=60)[0]
    assert ref["took"] == [True, False, True, True]
    for world, level in ((2, 1), (1, 0)):
        runs = run_ranks(_cont, world, _accum_config(level, accumulation=2), path, timeout=60)
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
    config = _accum_config(2, accumulation=2)
    ref = run_ranks_cached(trainer_run, 1, _accum_config(0, accumulation=2))[0]
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
    assert_bit_identical(whole, second)


@pytest.mark.parametrize("config, message", [
    ({"zero": dict(level=1), "fp16": dict(mode=AMP_TYPE.APEX, opt_level="O3")},
     "O3 (half parameters, no fp32 master weights) is not supported; use O2"),
])
def test_zero_o2_refusals_say_what_to_use(config, message):
    with pytest.raises(ConfigError) as e:
        load_config(config)
    assert message in str(e.value)
