"""ZeRO level 3 under AMP O2 (half parameters gathered per unit, fp32 masters of this rank's
shard) equals one process running the same O2 (no ZeRO): with branches some steps skip (prefetch
guesses wrong), a forward order unlike the registration order, root-level and shared parameters,
eval forwards between micro-steps, without prefetch, APEX's spelling with a clip that clips;
its per-rank checkpoints across data sizes, into and out of jobs without ZeRO or without O2, stale
shard files; the Trainer's resume; tensor 2d's dtypes; sequence parallelism; a pipeline's ZeRO 2
files. (ZeRO 3 x O2 x tensor 1d x data 2, fp16 with accumulation and bf16: rows of
test_composition.py's table.)

Exact where it can be (zero_models.py's dyadic grid: Linear layers under a linear loss,
inputs on 1/8, coefficients on 1/4, powers of two for batches and the loss scale, so every half
gradient is exact however the batch is split); tensor / sequence parallel runs (non-linear
models) get a tolerance."""
import contextlib

import pytest
import torch
from dist_helpers import ROOT, run_ranks, run_ranks_cached
from models import tensor_model
from run_records import assert_bit_identical
from torch import nn
from torch.testing import assert_close
from zero_models import LinearLoss, dyadic_batch, grouped_adamw
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
    pipeline_resume_worker,
    pipeline_save_worker,
)

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.amp import AMP_TYPE
from nanocolossal.checkpoint import load_checkpoint, load_optimizer_state, save_checkpoint
from nanocolossal.context import gpc
from nanocolossal.metrics import all_reduce_mean

pytestmark = pytest.mark.timeout(120)
B = 2  # samples per rank per micro-step


class Branchy(nn.Module):
    """Children registered a, b, side, never, a2 but run b, (side), a, a2: the forward order is
    not the registration order; `side` runs on some steps only (on every rank: prefetch guesses
    wrong); `a2` shares a's weight (root unit) and `bias` is a root-level parameter. Every
    gradient is x^T c: exact on the dyadic grid."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(6, 7), nn.Linear(4, 5)
        self.side, self.never = nn.Linear(6, 5), nn.Linear(3, 3)
        self.a2 = nn.Linear(6, 7)
        self.a2.weight = self.a.weight
        self.bias = nn.Parameter(torch.randn(12) / 4)
        self.use_side = True

    def forward(self, x):
        h = self.b(x[:, 6:])
        if self.use_side:
            h = h + self.side(x[:, :6])
        first = self.a(x[:, :6]) + self.a2(x[:, :6] / 2)
        return torch.cat([first, h], dim=1) + self.bias.to(h.dtype)


def _config(level, accumulation=1, clip=0.0, dtype="float16", apex=False):
    fp16 = (dict(mode=AMP_TYPE.APEX, opt_level="O2") if apex else dict(mode=AMP_TYPE.NAIVE))
    fp16.update(dtype=dtype, init_scale=2.0**14, growth_interval=2, max_scale=2.0**16)
    config = {"fp16": fp16, "gradient_accumulation": accumulation}
    if clip:
        config["clip_grad_norm"] = clip
    if level:
        config["zero"] = dict(level=level, reduce_bucket_size_mb=2e-4)
    return config


def _no_zero(config):
    return {k: v for k, v in config.items() if k != "zero"}


def _side_on(step):
    return step % 3 != 1  # steps 0, 2, 3 (5, ...) use it: the guess goes wrong twice


def _branchy_train(rank, world, port, config, n, steps=4, first=0, inject=(1, 0),
                   evals="none", path=None, save=None):
    """`steps` optimizer steps of `gradient_accumulation` micro-steps of n samples; at `inject`
    the last sample overflows (the last rank). evals: after every micro-step a forward on a
    whole eval batch with the other branch ("nograd": under no_grad, "grad": eval mode only,
    "none")."""
    nc.launch(config, rank=rank, world_size=world, host="127.0.0.1", port=port)
    model = Branchy()
    engine, *_ = nc.initialize(model, grouped_adamw(model), LinearLoss(), verbose=False)
    if path is not None:
        load_checkpoint(path, engine.model, engine.optimizer)
    acc = engine.gradient_accumulation
    out = dict(took=[], scales=[], norms=[], evals=[], loss_values=[], losses=[])
    for step in range(first, first + steps):
        for micro in range(acc):
            engine.train()
            engine.model.use_side = _side_on(step)
            xs, cs = dyadic_batch(step * acc + micro, n)
            if (step, micro) == inject:
                inject_overflow(xs, cs)
            loss, took = micro_step(engine, rank, world, xs, cs)
            out["loss_values"].append(loss)
            if evals != "none":
                engine.eval()
                engine.model.use_side = not _side_on(step)
                with torch.no_grad() if evals == "nograd" else contextlib.nullcontext():
                    y = engine(dyadic_batch(500 + step, 4)[0])
                out["evals"].append(y.detach().double().clone())
        end_of_step(engine, out, took)
    record_o2_state(engine, out)
    if save is not None:
        save_checkpoint(save, first + steps, engine.model, engine.optimizer)
    return out


def _check(ref, runs, rtol=0.0, atol=0.0):
    if any(n is not None for n in ref["norms"]):
        for r in (ref, *runs):
            r["norms"] = [None if n == float("inf") else n for n in r["norms"]]
    compare_o2_runs(ref, runs, rtol=rtol, atol=atol)
    for run in runs:
        assert len(run["evals"]) == len(ref["evals"])
        for got, want in zip(run["evals"], ref["evals"]):
            assert_close(got, want, rtol=max(rtol, 1e-3) if rtol else 0, atol=atol)


# -- prefetch x branches x eval x order x root / shared parameters -----------------------------

# fp16 (the scaler's overflow) meets every kind of eval; what bf16 adds is its dtype: one row
BRANCH_CASES = [("float16", "none"), ("float16", "nograd"), ("float16", "grad"),
                ("bfloat16", "grad")]


@pytest.mark.parametrize("dtype, evals", BRANCH_CASES, ids=[f"{d}-{e}" for d, e in BRANCH_CASES])
def test_gloo_zero3_o2_branch_eval_order_root_and_shared_params_equal_one_process(dtype, evals):
    """2 ranks, accumulation 2 with an overflow in micro-step 0 of step 1 (fp16), side on steps
    0, 2, 3 on every rank, an eval forward (other branch) after every micro-step: bit-identical
    to one process's O2."""
    config = _config(3, accumulation=2, dtype=dtype)
    ref = run_ranks(_branchy_train, 1, _no_zero(config), 2 * B, 4, 0, (1, 0), evals,
                    timeout=60)[0]
    if dtype == "float16":
        assert ref["took"] == [True, False, True, True]
    runs = run_ranks(_branchy_train, 2, config, 2 * B, 4, 0, (1, 0), evals, timeout=60)
    _check(ref, runs)


def test_deep_zero3_o2_apex_clip_that_clips_4_ranks_with_eval_and_branches():
    config = _config(3, accumulation=2, clip=0.05, apex=True)
    ref = run_ranks(_branchy_train, 1, _no_zero(config), 4 * B, 4, 0, (1, 0), "nograd",
                    timeout=60)[0]
    norms = [n for n in ref["norms"] if n != float("inf")]
    assert len(norms) == 3 and all(n > 0.05 for n in norms)
    runs = run_ranks(_branchy_train, 4, config, 4 * B, 4, 0, (1, 0), "nograd", timeout=60)
    for r in (ref, *runs):  # the half parameters round the clipped masters: compare the masters
        r["state"] = {k: v for k, v in r["state"].items() if k.startswith(("master", "exp"))}
    _check(ref, runs, rtol=1e-5, atol=1e-6)


def test_deep_zero3_o2_no_prefetch_equals_one_process():
    config = _config(3, accumulation=2)
    config["zero"]["overlap_communication"] = False
    ref = run_ranks(_branchy_train, 1, _no_zero(config), 2 * B, 3, 0, (1, 0), "nograd",
                    timeout=60)[0]
    _check(ref, run_ranks(_branchy_train, 2, config, 2 * B, 3, 0, (1, 0), "nograd", timeout=60))


# -- checkpoints: per-rank shard files, across data sizes, into / out of non-zero ----------------

def test_deep_zero3_o2_checkpoint_4_ranks_into_2_and_1_and_plain_ddp(tmp_path):
    """Level 3 O2 on 4 ranks (accumulation 2, overflow at step 1): 2 steps, saved; loaded into
    level 3 on 2 ranks, one process O2 (no zero), plain DDP O2 on 2 ranks, level 2 on 2 ranks;
    2 more steps each: one process's 4 steps straight, to the bit."""
    path = tmp_path / "ckpt.pt"
    config = _config(3, accumulation=2)
    saved = run_ranks(_branchy_train, 4, config, 8, 2, 0, (1, 0), "none", None, path,
                      timeout=60)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-zero0.pt", "ckpt-zero1.pt", "ckpt-zero2.pt", "ckpt-zero3.pt", "ckpt.pt"]
    ref2 = run_ranks(_branchy_train, 1, _no_zero(config), 8, 2, timeout=60)[0]
    compare_o2_runs(ref2, saved)
    merged = load_optimizer_state(path)
    for i, m in enumerate(merged["masters"]):
        assert_close(m.double(), ref2["state"][f"master.{i}"], rtol=0, atol=0)
    ref = run_ranks_cached(_branchy_train, 1, _no_zero(config), 8, 4)[0]
    for world, level in ((2, 3), (1, 0), (2, 0), (2, 2)):
        cfg = _config(level, accumulation=2)
        runs = run_ranks(_branchy_train, world, cfg, 8, 2, 2, (1, 0), "none", path, timeout=60)
        for run in runs:
            assert run["took"] == ref["took"][2:] and run["scales"] == ref["scales"][2:]
            assert run["scaler"] == ref["scaler"]
            for key, value in run["state"].items():
                assert_close(value, ref["state"][key], rtol=0, atol=0,
                             msg=lambda m: f"{world} ranks level {level} {key}: {m}")


def test_deep_one_process_o2_checkpoint_into_zero3_and_stale_shard_files(tmp_path):
    """One process O2 saves (no zero); 2 ranks of level 3 load it and continue. Then a 4-rank
    save and a 2-rank save to one path: the 4-rank save's zero2/zero3 files stay, and a load on
    4 ranks must use the 2-rank save's segments only."""
    path = tmp_path / "single.pt"
    config = _config(3, accumulation=2)
    run_ranks(_branchy_train, 1, _no_zero(config), 8, 2, 0, (1, 0), "none", None, path,
              timeout=60)
    ref = run_ranks_cached(_branchy_train, 1, _no_zero(config), 8, 4)[0]
    runs = run_ranks(_branchy_train, 2, config, 8, 2, 2, (1, 0), "none", path, timeout=60)
    for run in runs:
        for key, value in run["state"].items():
            assert_close(value, ref["state"][key], rtol=0, atol=0, msg=key)
    both = tmp_path / "both.pt"
    run_ranks(_branchy_train, 4, config, 8, 1, 0, (1, 0), "none", None, both, timeout=60)
    run_ranks(_branchy_train, 2, config, 8, 2, 0, (1, 0), "none", None, both, timeout=60)
    assert (tmp_path / "both-zero3.pt").is_file()  # stale, from the 4-rank save
    for world in (4, 1):
        cfg = config if world > 1 else _no_zero(config)
        runs = run_ranks(_branchy_train, world, cfg, 8, 2, 2, (1, 0), "none", both, timeout=60)
        for run in runs:
            for key, value in run["state"].items():
                assert_close(value, ref["state"][key], rtol=0, atol=0, msg=key)


# -- the Trainer, stopped and resumed, under ZeRO 3 x O2 ----------------------------------------

def test_deep_trainer_under_zero3_o2_resumes_bit_identically(tmp_path):
    config = _config(3, accumulation=2)
    ref = run_ranks_cached(trainer_run, 1, _no_zero(config))[0]
    whole = run_ranks(trainer_run, 2, config, timeout=60)
    for run in whole:
        assert run["last"] == pytest.approx(ref["last"], rel=1e-3)
        assert_close(run["state"], ref["state"], rtol=0, atol=0)
        assert_close(run["opt"]["masters"], ref["opt"]["masters"], rtol=0, atol=0)
    ckpt = str(tmp_path / "ckpt.pt")
    assert run_ranks(trainer_run, 2, config, ckpt, 3, timeout=60)[0]["step"] == 3
    second = run_ranks(trainer_run, 2, config, ckpt, None, True, timeout=60)
    assert_bit_identical(whole, second)


# -- ZeRO 3 x O2 x tensor 2d: the parameters' dtypes are one process's O2 dtypes ---------------

def _dtypes_worker(rank, world_size, port, config):
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    model = tensor_model()
    engine, *_ = nc.initialize(model, torch.optim.AdamW(model.parameters(), lr=0.02),
                               col_nn.CrossEntropyLoss(), verbose=False)
    return {k: v.dtype for k, v in engine.model.state_dict().items()}


@pytest.mark.parametrize("level", [0, 3], ids=["no-zero", "zero3"])
def test_deep_o2_x_tensor_2d_keeps_layernorm_in_fp32_as_one_process_does(level):
    """The parameters' dtypes under 2d x4 (data 1) O2, with and without ZeRO 3, are one
    process's O2 dtypes (normalisation layers fp32, the rest half)."""
    config = {"fp16": dict(mode=AMP_TYPE.NAIVE, dtype="bfloat16")}
    ref_dtypes = run_ranks_cached(_dtypes_worker, 1, config)[0]
    assert ref_dtypes["1.weight"] == torch.float32 and ref_dtypes["2.weight"] == torch.bfloat16
    layout = {**config, "parallel": {"tensor": {"size": 4, "mode": "2d"}},
              **({"zero": {"level": level}} if level else {})}
    for rank, dtypes in enumerate(run_ranks(_dtypes_worker, 4, layout, timeout=60)):
        assert dtypes == ref_dtypes, f"rank {rank}"


# -- ZeRO 3 x O2 x sequence parallelism (the GPT), checkpoint into one process ----------------

SEQ_BATCH, SEQ_LEN, SEQ_VOCAB = 4, 8, 32


def tiny_gpt_and_my_batches(steps, vocab=SEQ_VOCAB):
    """After nc.launch: a 2-layer train_gpt.gpt seeded alike on every rank, and this data rank's
    share of `steps` global batches of (ids, next ids)."""
    import sys
    sys.path.insert(0, str(ROOT))
    from train_gpt import gpt
    torch.manual_seed(0)
    model = gpt(vocab=vocab, seq_len=SEQ_LEN, dim=16, depth=2, heads=2, mlp_ratio=2)
    g = torch.Generator().manual_seed(7)
    batches = [torch.randint(0, vocab, (2, SEQ_BATCH, SEQ_LEN), generator=g).unbind(0)
               for _ in range(steps)]
    per = SEQ_BATCH // gpc.data_size
    mine = slice(gpc.data_rank * per, (gpc.data_rank + 1) * per)
    return model, [(x[mine], y[mine]) for x, y in batches]


def _gpt_worker(rank, world, port, config, save=None, load=None):
    from nanocolossal.checkpoint import strip_prefixes
    nc.launch(config, rank=rank, world_size=world, host="127.0.0.1", port=port)
    model, batches = tiny_gpt_and_my_batches(4)
    engine, loader, *_ = nc.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1),
        col_nn.VocabParallelCrossEntropyLoss(), batches, verbose=False)
    if load is not None:
        load_checkpoint(load, engine.model, engine.optimizer)
    out = dict(losses=[], took=[])
    for x, y in loader:
        engine.zero_grad()
        _, _, loss = engine.execute_schedule((x, y))
        out["losses"].append(all_reduce_mean(loss.float().item()))
        out["took"].append(engine.step())
    if save is not None:
        save_checkpoint(save, 1, engine.model, engine.optimizer)
    out["state"] = {k: v.detach().float().clone()
                    for k, v in strip_prefixes(engine.model.state_dict()).items()}
    return out


def test_deep_zero3_o2_x_sequence_x_accumulation_x_clip_and_its_checkpoint(tmp_path):
    """data 2 x sequence 2, ZeRO 3, bf16 O2, accumulation 2, clip: one process's bf16 O2 to a
    tolerance; its checkpoint (segments of the 4-rank gradient group) loads into one process."""
    config = {"fp16": dict(mode=AMP_TYPE.NAIVE, dtype="bfloat16"), "gradient_accumulation": 2,
              "clip_grad_norm": 0.1}
    ref = run_ranks(_gpt_worker, 1, config, tmp_path / "one.pt", timeout=60)[0]
    layout = {**config, "parallel": {"tensor": {"size": 2, "mode": "sequence"}},
              "zero": dict(level=3)}
    runs = run_ranks(_gpt_worker, 4, layout, tmp_path / "seq.pt", timeout=90)
    for run in runs:
        assert run["took"] == ref["took"]
        assert run["losses"] == pytest.approx(ref["losses"], rel=2e-2)
        for key, value in run["state"].items():
            assert_close(value, ref["state"][key], rtol=3e-2, atol=3e-2, msg=key)
    one = load_optimizer_state(tmp_path / "one.pt")
    seq = load_optimizer_state(tmp_path / "seq.pt")
    assert len(seq["masters"]) == len(one["masters"])
    for a, b in zip(seq["masters"], one["masters"]):
        assert_close(a, b, rtol=3e-2, atol=3e-2)
    for i, s in one["optimizer"]["state"].items():
        for k, v in s.items():
            assert_close(torch.as_tensor(seq["optimizer"]["state"][i][k]).float(),
                         torch.as_tensor(v).float(), rtol=5e-2, atol=5e-3, msg=f"{i} {k}")


# -- checkpoints across precisions: fp32 ZeRO 3 <-> O2 ZeRO 3 / one process ------------------

def _precision_worker(rank, world, port, config, path, save):
    """save: 2 steps, save to `path`; else load `path` and return what the job now holds (its
    fp32 masters under O2, else its parameters) before any step, and after one more step."""
    nc.launch(config, rank=rank, world_size=world, host="127.0.0.1", port=port)
    model = Branchy()
    engine, *_ = nc.initialize(model, grouped_adamw(model), LinearLoss(), verbose=False)
    n, mine = 8, slice(rank * 8 // world, (rank + 1) * 8 // world)

    def one_step(step):
        engine.model.use_side = True
        xs, cs = dyadic_batch(step, n)
        engine.zero_grad()
        engine.backward(engine.criterion(engine(xs[mine]), cs[mine]))
        assert engine.step()

    def held():
        state = engine.optimizer.state_dict()  # (collective under ZeRO)
        params = {k: v.detach().float().clone() for k, v in engine.model.state_dict().items()}
        masters = state.get("masters") if isinstance(state, dict) else None
        return params, [m.float().clone() for m in masters] if masters else None

    if save:
        for step in range(2):
            one_step(step)
        save_checkpoint(path, 2, engine.model, engine.optimizer)
        return held()
    load_checkpoint(path, engine.model, engine.optimizer)
    before = held()
    one_step(2)
    return before, held()


def _half_keys():
    names = [k for k, _ in Branchy().named_parameters()]  # grouped_adamw: weights, then biases
    return [k for k in names if k.endswith("weight")] + [k for k in names if k.endswith("bias")]


@pytest.mark.parametrize("into", ["zero3-o2", "one-process-o2"])
def test_deep_fp32_zero3_checkpoint_into_an_o2_job_resumes_from_the_saved_weights(into, tmp_path):
    """ZeRO 3 fp32 (no AMP) saves after 2 steps; an O2 job loads it: its fp32 masters must be
    the saved weights (to half rounding), and its next step must start from them, not from the
    fresh model's weights the masters were made of (amp.py's and zero/mixed.py's
    load_state_dict alike)."""
    path = tmp_path / "fp32.pt"
    saved_params, _ = run_ranks(_precision_worker, 2, {"zero": dict(level=3)}, path, True,
                                timeout=60)[0]
    world, config = (2, _config(3)) if into == "zero3-o2" else (1, _no_zero(_config(0)))
    (params, masters), (after, _) = run_ranks(_precision_worker, world, config, path, False,
                                              timeout=60)[0]
    for key in saved_params:  # the half model got the saved weights
        assert_close(params[key], saved_params[key], rtol=1e-2, atol=1e-3, msg=key)
    for key, master in zip(_half_keys(), masters):
        assert_close(master, saved_params[key], rtol=1e-3, atol=1e-4,
                     msg=lambda m: f"master of {key}: {m}")
    for key in saved_params:  # one AdamW step (lr <= 0.03) from the saved weights
        assert (after[key] - saved_params[key]).abs().max() <= 0.035, key


@pytest.mark.parametrize("into", ["zero3-fp32", "one-process-fp32"])
def test_deep_o2_zero3_checkpoint_into_an_fp32_job(into, tmp_path):
    """ZeRO 3 O2 saves; an fp32 job (ZeRO 3 on 2 ranks, or one process, no AMP) loads it: its
    parameters are the saved model's (its fp32 masters, or the half parameters)."""
    path = tmp_path / "o2.pt"
    saved_params, saved_masters = run_ranks(_precision_worker, 2, _config(3), path, True,
                                            timeout=60)[0]
    world, config = (2, {"zero": dict(level=3)}) if into == "zero3-fp32" else (1, {})
    (params, _), (after, _) = run_ranks(_precision_worker, world, config, path, False,
                                        timeout=60)[0]
    for key, master in zip(_half_keys(), saved_masters):
        assert_close(params[key], master, rtol=1e-3, atol=1e-3, msg=key)
    for key in params:
        assert (after[key] - params[key]).abs().max() <= 0.035, key


# -- pipeline x ZeRO 2 x bf16 O2: one shard file per (stage, data rank), resumed elsewhere -------

@pytest.mark.parametrize("loaded_world, loaded_level", [(2, 0), (4, 1)],
                         ids=["into-data1-plain", "into-data2-zero1"])
def test_deep_pipeline_x_zero2_x_o2_checkpoint_per_stage_and_data_rank_resumes(
        tmp_path, loaded_world, loaded_level):
    states, _ = one_process_sgd(opt_level="O2")
    path = str(tmp_path / "ckpt.pt")
    fp16 = {"fp16": AMP_MODES["O2"]}
    run_ranks(pipeline_save_worker, 4, {**fp16, "zero": {"level": 2}}, path, 2, timeout=60)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ckpt-stage0-zero0.pt", "ckpt-stage0-zero1.pt", "ckpt-stage0.pt",
        "ckpt-stage1-zero0.pt", "ckpt-stage1-zero1.pt", "ckpt-stage1.pt"]
    for stage in (0, 1):
        merged = load_optimizer_state(tmp_path / f"ckpt-stage{stage}.pt")
        # (stage 0 holds WithUnused.never: a master, no state)
        assert len(merged["masters"]) >= len(merged["optimizer"]["state"]) > 0
    extra = {**fp16, "zero": {"level": loaded_level}} if loaded_level else fp16
    results = run_ranks(pipeline_resume_worker, loaded_world, extra, path, 2, timeout=60)
    check_states(results, states[2], BF16)
