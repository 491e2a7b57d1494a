"""ZeRO composed with other features, each against ONE PROCESS on the whole global batch (under
AMP O2: one process running the same O2): O2 x gradient accumulation with an overflow in the
first micro-step of a group on one rank only; O2 x clipping on 4 ranks (parameters straddling
shards); O2 with a parameter no rank uses and one that only rank 0 uses; O2 with param groups
and a LayerNorm kept fp32; O2 checkpoints saved on 4 ranks with accumulation, loaded into 2 and
1 and continued; the Trainer (LossHook, resuming mid-epoch bit-identically) under ZeRO x O2;
ZeRO 1-3 x sequence parallelism x gradient accumulation (float64).

Exact where it can be: test_zero_fp16_gloo.py's dyadic grid (inputs on 1/8, coefficients on 1/4,
powers of two for batches, accumulation and the loss scale) makes every half gradient exact
however the batch is split, so the masters, Adam states and half parameters must be equal to
the bit; only clipping's coefficient and LayerNorm's fp32 sums get a tolerance."""
import pytest
import torch
from dist_helpers import ROOT, run_ranks
from run_records import compare_runs
from test_zero_fp16_gloo import LinearLoss, Net, _adamw, _batch
from torch import nn
from torch.testing import assert_close

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.amp import AMP_TYPE
from nanocolossal.checkpoint import load_checkpoint, save_checkpoint
from nanocolossal.context import gpc
from nanocolossal.metrics import all_reduce_mean

B = 2  # samples per rank per micro-step


class PartNet(Net):
    """Net whose `side` layer sees only the first `side_rows` samples of the global batch (rank
    0's under B samples per rank): on the other ranks it gets no gradient at all; `ln` (fp32
    under O2) adds to some outputs when present."""

    def __init__(self, side_rows=None, norm=False) -> None:
        super().__init__()
        self.side_rows = side_rows
        self.ln = nn.LayerNorm(4) if norm else None

    def forward(self, x):
        if self.side_rows is None:
            out = super().forward(x)
        else:
            h = self.b(x[:, 6:])
            k = max(0, min(x.shape[0], self.side_rows - gpc.data_rank * x.shape[0]))
            if k:
                h = torch.cat([h[:k] + self.side(x[:k, :6]), h[k:]])
            out = torch.cat([self.a(x[:, :6]), h], dim=1)
        if self.ln is not None:
            out = torch.cat([out[:, :8], out[:, 8:] + self.ln(x[:, 6:]).to(out.dtype)], dim=1)
        return out


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
    engine, *_ = nc.initialize(model, _adamw(model), LinearLoss(), verbose=False)
    return engine


def _record(engine, out):
    state = engine.optimizer.state_dict()  # a collective under ZeRO: one process's O2 state
    out["state"] = {f"param.{k}": v.detach().double().clone()
                    for k, v in engine.model.state_dict().items()}
    out["state"].update({f"master.{i}": m.double() for i, m in enumerate(state["masters"])})
    for i, s in state["optimizer"]["state"].items():
        out["state"].update({f"{k}.{i}": torch.as_tensor(v).double() for k, v in s.items()})
    out["scaler"] = state["scaler"]
    return out


def inject_overflow(xs, cs):
    """The last sample overflows fp16 in b.weight[0, 3]'s gradient: one rank's shard only."""
    xs[-1, 9], cs[-1] = 60000.0, 0.0
    cs[-1, 7] = 0.25


def micro_step(engine, rank, world, xs, cs):
    """This rank's share of xs: backward, then step; (the loss averaged over ranks, stepped)."""
    n = len(xs)
    mine = slice(rank * n // world, (rank + 1) * n // world)
    engine.zero_grad()
    loss = engine.criterion(engine(xs[mine]), cs[mine])
    engine.backward(loss)
    return all_reduce_mean(loss.item()), engine.step()


def end_of_step(engine, out, took):
    out["took"].append(took)
    out["scales"].append(engine.optimizer.loss_scale)
    out["norms"].append(engine.last_grad_norm if engine.clip_grad_norm else None)


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
            xs, cs = _batch(step * accumulation + micro, n)
            if (step, micro) == inject:
                inject_overflow(xs, cs)
            loss, took = micro_step(engine, rank, world, xs, cs)
            losses.append(loss)
            assert took is False or micro == accumulation - 1
        end_of_step(engine, out, took)
    out["loss_values"] = losses
    _record(engine, out)
    if save is not None:
        save_checkpoint(save, first + steps, engine.model, engine.optimizer)
    return out


def _same(ref, runs, rtol=0.0, atol=0.0, loss_rtol=1e-3):
    """compare_runs on steps, scales, norms and state (exact by default); the losses (half
    forwards summed in another order) to `loss_rtol`; the scaler's state exactly."""
    compare_runs(ref, runs, rtol=rtol, atol=atol, norms=any(n is not None for n in ref["norms"]))
    for run in runs:
        assert run["loss_values"] == pytest.approx(ref["loss_values"], rel=loss_rtol)
        assert run["scaler"] == ref["scaler"]


def _layout(config, world, steps=4, side_rows=None):
    """(one process's O2 record without zero, every rank's record under `config`)."""
    single = {k: v for k, v in config.items() if k != "zero"}
    ref = run_ranks(_o2_train, 1, single, world * B, steps, side_rows, timeout=60)[0]
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
    _same(ref, runs)


@pytest.mark.timeout(60)
def test_gloo_zero2_o2_clipping_on_4_ranks_with_straddling_parameters():
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
    _same(ref, runs, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("level", [1, 2])
def test_gloo_zero_o2_parameter_no_rank_uses_and_one_only_rank_0_uses(level):
    """`never`: no gradient anywhere (grad None: no Adam state, no weight decay, as one
    process); `side`: on even steps only, and then only rank 0's samples reach it (the other
    ranks compute no gradient for it). (Not level 3: a unit must run on every data rank or on
    none, sharded_model.py.)"""
    ref, runs = _layout(_config(level, accumulation=2), 2, side_rows=B)
    # optimizer order: weights a, b, side, never (0-3), then biases (4-7); `never` has no state
    assert {k for k in ref["state"] if k.startswith("exp_avg.")} == {
        f"exp_avg.{i}" for i in (0, 1, 2, 4, 5, 6)}
    _same(ref, runs)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("level", [1, 2, 3])
def test_gloo_zero_o2_param_groups_with_a_layernorm_kept_fp32(level):
    """Two param groups (lr / weight decay) each holding half and fp32 (LayerNorm) parameters:
    two flat buffers per group; LayerNorm's fp32 gradient sums get 1e-5."""
    config = _config(level, accumulation=2)
    ref = run_ranks(_o2_train, 1, {k: v for k, v in config.items() if k != "zero"}, 4, 4, None,
                    (1, 0), 0, None, True, timeout=60)[0]
    runs = run_ranks(_o2_train, 2, config, 4, 4, None, (1, 0), 0, None, True, timeout=60)
    assert ref["state"]["param.ln.weight"].dtype == torch.float64  # (recorded as double)
    _same(ref, runs, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(60)
def test_gloo_zero_o2_checkpoint_with_accumulation_4_ranks_into_2_and_1_continues(tmp_path):
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
            xs, cs = _batch(step * 2 + micro, 8)
            mine = slice(rank * per, (rank + 1) * per)
            engine.zero_grad()
            engine.backward(engine.criterion(engine(xs[mine]), cs[mine]))
            took = engine.step()
        out["took"].append(took)
        out["scales"].append(engine.optimizer.loss_scale)
    return _record(engine, out)


# -- the Trainer under ZeRO x O2 -------------------------------------------------------------------

def _trainer_run(rank, world, port, config, ckpt=None, max_steps=None, resume=False):
    from torch.utils.data import TensorDataset

    from nanocolossal.trainer import Trainer, hooks
    engine_config = dict(config)
    nc.launch(engine_config, rank=rank, world_size=world, host="127.0.0.1", port=port)
    model = PartNet()
    g = torch.Generator().manual_seed(11)
    train_set = TensorDataset(torch.randint(-8, 9, (32, 10), generator=g) / 8,
                              torch.randint(-2, 3, (32, 12), generator=g) / 4)
    test_set = TensorDataset(torch.randint(-8, 9, (8, 10), generator=g) / 8,
                             torch.randint(-2, 3, (8, 12), generator=g) / 4)
    per = 4 // gpc.data_size  # 4 samples a batch
    engine, train, test, _ = nc.initialize(
        model, _adamw(model), LinearLoss(),
        nc.get_dataloader(train_set, shuffle=True, seed=5, drop_last=True, batch_size=per),
        nc.get_dataloader(test_set, batch_size=per), verbose=False)
    trainer, last = Trainer(engine), hooks.LastLossHook()
    saving = [] if ckpt is None else [hooks.SaveCheckpointHook(ckpt, every_steps=2)]
    assert not resume or trainer.resume(ckpt)
    trainer.fit(train, 2, test, hooks=[hooks.LossHook(), last, *saving], max_steps=max_steps)
    return dict(metrics=trainer.states["metrics"], last=last.value, step=trainer.cur_step,
                state={k: v.detach().clone() for k, v in engine.model.state_dict().items()},
                opt=engine.optimizer.state_dict())


@pytest.mark.timeout(60)
def test_gloo_trainer_under_zero2_o2_reports_one_process_numbers_and_resumes_bit_identically(
        tmp_path):
    """2 epochs of 8 batches of 4 (accumulation 2: 4 steps an epoch): LossHook and
    LastLossHook are one process's (half forwards: 1e-3), the weights and masters exactly; a
    job stopped after 3 steps (checkpoint at 2, mid-epoch) and resumed ends bit-identical."""
    config = _config(2, accumulation=2)
    ref = run_ranks(_trainer_run, 1, _config(0, accumulation=2), timeout=60)[0]
    whole = run_ranks(_trainer_run, 2, config, timeout=60)
    for run in whole:
        for split in ("train", "test"):
            for key, value in ref["metrics"][split].items():
                assert run["metrics"][split][key] == pytest.approx(value, rel=1e-3), split
        assert run["last"] == pytest.approx(ref["last"], rel=1e-3)
        assert_close(run["state"], ref["state"], rtol=0, atol=0)
        assert_close(run["opt"]["masters"], ref["opt"]["masters"], rtol=0, atol=0)
    ckpt = str(tmp_path / "ckpt.pt")
    first = run_ranks(_trainer_run, 2, config, ckpt, 3, timeout=60)
    assert first[0]["step"] == 3
    second = run_ranks(_trainer_run, 2, config, ckpt, None, True, timeout=60)
    for a, b in zip(whole, second):
        for key in a["state"]:
            assert torch.equal(a["state"][key], b["state"][key]), key
        assert_close(a["opt"], b["opt"], rtol=0, atol=0)
        assert a["last"] == b["last"]


# -- ZeRO 1-3 x sequence parallelism x gradient accumulation (float64) ---------------------------

SEQ_BATCH, SEQ_LEN, VOCAB = 4, 8, 32


def tiny_gpt_and_my_batches(steps, vocab=VOCAB):
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


def _seq_train(rank, world, port, config):
    nc.launch(config, rank=rank, world_size=world, host="127.0.0.1", port=port)
    model, batches = tiny_gpt_and_my_batches(6)
    model = model.double()
    engine, loader, *_ = nc.initialize(
        model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1),
        col_nn.VocabParallelCrossEntropyLoss(), batches, verbose=False)
    out = dict(took=[], scales=[], norms=[], losses=[])
    for x, y in loader:
        engine.zero_grad()
        _, _, loss = engine.execute_schedule((x, y))
        out["losses"].append(all_reduce_mean(loss.item()))
        if engine.step():
            out["took"].append(True)
            out["norms"].append(engine.last_grad_norm)
            out["scales"].append(engine.optimizer.loss_scale)
    out["state"] = {k: v.detach().clone()
                    for k, v in nc.checkpoint.strip_prefixes(engine.model.state_dict()).items()}
    return out


SEQ_LAYOUTS = {
    "sequence x2, ZeRO 1": (2, {"tensor": {"size": 2, "mode": "sequence"}}, 1),
    "data 2 x sequence 2, ZeRO 2": (4, {"tensor": {"size": 2, "mode": "sequence"}}, 2),
    "sequence x2, ZeRO 3": (2, {"tensor": {"size": 2, "mode": "sequence"}}, 3),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", SEQ_LAYOUTS)
def test_gloo_zero_x_sequence_x_gradient_accumulation(name):
    """6 batches, accumulation 3, clipping that clips: 2 AdamW steps, one process's to 1e-10."""
    world, parallel, level = SEQ_LAYOUTS[name]
    config = {"gradient_accumulation": 3, "clip_grad_norm": 0.1, "zero": dict(level=level)}
    ref = run_ranks(_seq_train, 1, {k: v for k, v in config.items() if k != "zero"},
                    timeout=60)[0]
    runs = run_ranks(_seq_train, world, {**config, "parallel": parallel}, timeout=60)
    assert len(ref["took"]) == 2 and all(n > 0.1 for n in ref["norms"])
    compare_runs(ref, runs)
