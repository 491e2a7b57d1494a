"""Mixture of experts as a framework feature: parallel=dict(moe=dict(size=EP)) trains exactly as
one process holding every expert on the same global batch.

Engine level: float64, SGD with momentum (Adam would hide a gradient scaled by a constant, e.g.
experts averaged over the wrong ranks), a clip that really clips (the norm must count each
expert once), the load-balancing loss added by the Engine: parameters after 3 steps equal one
process's to 1e-10 for EP 2, data 2 x EP 2 and EP 4 with 2 experts (replicas); the checkpoint
of each merges into the plain model's state_dict and loads back (model and momenta) on every
rank. Script level: train_gpt.py's `final train
loss` for EP 2 on 2 ranks, EP 2 and EP 4 on 4 ranks, pipeline 2 x EP 2 on 4 ranks equals one
process's (MoE x pipeline is tested exactly in test_moe_pipeline.py). Then MoE in the training
loop, against one process holding every expert (the same code on world size 1; for gradient
accumulation a plain-torch loop too): the Trainer's hooks with evaluation and its resume,
checkpoints across expert-parallel sizes, generate(), jitter, the Engine's five calls in eval
mode, uneven evaluation refused without a hang. Then what is refused. (Its pairs with other
features -- accumulation, ZeRO, the pipeline schedules, AMP, an overflow on one rank, top-2
routing, a router sending every token to one expert -- are rows of test_composition.py's
table.)
"""
import re
import sys

import pytest
import torch
from dist_helpers import ROOT, run_ranks, run_script
from models import my_share
from moe_runs import (
    BATCH,
    SEQ,
    VOCAB,
    engine_and_share,
    moe_batches,
    moe_optimizer,
    save_and_load_back,
)
from run_records import assert_bit_identical, compare_runs, record_steps
from torch import nn
from torch.testing import assert_close

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.checkpoint import merge_checkpoint
from nanocolossal.config import AMP_TYPE, ConfigError, load_config
from nanocolossal.config_checks import check_world
from nanocolossal.context import gpc
from nanocolossal.moe import moe_aux_loss

sys.path.insert(0, str(ROOT))
from train_gpt import gpt  # noqa: E402

CLIP, AUX, DIM, E = 0.5, 0.1, 16, 4
EP2 = {"moe": {"size": 2}}


def _model(num_experts):
    torch.manual_seed(0)
    moe = dict(num_experts=num_experts, top_k=2, capacity_factor_train=float(num_experts))
    return gpt(vocab=VOCAB, seq_len=SEQ, dim=16, depth=2, heads=2, mlp_ratio=2, moe=moe).double()


def _single_process(num_experts):
    model = _model(num_experts)
    opt, norms = moe_optimizer(model), []
    for x, y in moe_batches():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        (loss + AUX * moe_aux_loss(model)).backward()
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
    return model.state_dict(), norms


def _worker(rank, world_size, port, ep, num_experts, expected, norms, path):
    config = {"parallel": {"moe": {"size": ep}}, "clip_grad_norm": CLIP, "MOE_AUX_WEIGHT": AUX}
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    model = _model(num_experts)
    engine, mine = engine_and_share(model)
    for step, (x, y) in enumerate(moe_batches()):
        engine.zero_grad()
        engine.execute_schedule((x[mine], y[mine]))
        assert engine.step()
        assert engine.last_grad_norm == pytest.approx(norms[step], rel=1e-10)
    state = engine.model.state_dict()
    for name, p in state.items():
        assert_close(p, expected[name], rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
    save_and_load_back(path, engine, _model(num_experts))
    return sorted(k for k in state if ".experts." in k)


LAYOUTS = {  # name: (world, EP, experts)
    "EP 2": (2, 2, 4),
    "data 2 x EP 2": (4, 2, 4),
    "EP 4, 2 experts on 2 ranks each": (4, 4, 2),
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", LAYOUTS)
def test_gloo_moe_engine_training_equals_one_process(name, tmp_path):
    world, ep, experts = LAYOUTS[name]
    expected, norms = _single_process(experts)
    assert norms[0] > CLIP, "the clip really clips"
    held = run_ranks(_worker, world, ep, experts, expected, norms, tmp_path / "ck.pt",
                     timeout=60)
    assert held[0] != held[1], "the experts are split between the ranks"
    merged = merge_checkpoint(tmp_path / "ck.pt")
    assert merged.keys() == expected.keys()
    for key, value in expected.items():
        assert_close(merged[key], value, rtol=1e-10, atol=1e-10, msg=key)


MODEL = ("NUM_EPOCHS = 1\nSEQ_LEN = 16\nDIM = 32\nDEPTH = 2\nHEADS = 4\nNUM_EXPERTS = 4\n"
         "MOE_TOP_K = 2\nMOE_CAPACITY_FACTOR = 4.0\n")
SCRIPT_LAYOUTS = {  # name: (processes, BATCH_SIZE per data rank (global 8), parallel, aux weight)
    "one process": (1, 8, "", 0.01),
    "EP 2 on 2 ranks": (2, 4, "parallel = dict(moe=dict(size=2))", 0.01),
    "EP 2 on 4 ranks": (4, 2, "parallel = dict(moe=dict(size=2))", 0.01),
    "EP 4 on 4 ranks": (4, 2, "parallel = dict(moe=dict(size=4))", 0.01),
    # a pipeline's aux loss is the mean over its micro-batches (each a product of means over its
    # tokens): one process on the whole batch differs by ~1e-4, so compare without it. DEPTH 2:
    # stage 0 holds no MoE layer (DDP), stage 1 does (the MoE handler), the embedding is tied
    "one process, no aux": (1, 8, "", 0.0),
    "pipeline 2 x EP 2 on 4 ranks, no aux": (4, 4, "parallel = dict(pipeline=2, moe=dict(size=2))"
                                                   "\nNUM_MICRO_BATCHES = 2", 0.0),
}


def _decaying(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.1)


def _frozen_model(how):
    model = _model(2)
    model[1].unused = nn.Linear(3, 3).double()  # (a block: it calls only its own layers)
    model[1].attn.requires_grad_(how != "unfreeze")
    return model


def _frozen_train(model, how, step_fn):
    """Three steps; block 1's attention frozen after the first ('freeze'), or frozen before
    initialize and unfrozen after it ('unfreeze')."""
    for step, batch in enumerate(moe_batches()):
        if step == 1:
            model[1].attn.requires_grad_(how == "unfreeze")
        step_fn(*batch)


def _frozen_single(how):
    """One process (every expert here), SGD with momentum and weight decay."""
    model = _frozen_model(how)
    opt = _decaying(model)

    def step(x, y):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        (loss + 0.01 * moe_aux_loss(model)).backward()  # (MOE_AUX_WEIGHT's default)
        opt.step()
    _frozen_train(model, how, step)
    return model.state_dict()


def _frozen_worker(rank, world_size, port, config, how, expected):
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    model = _frozen_model(how)
    engine, *_ = nc.initialize(model, _decaying(model), col_nn.VocabParallelCrossEntropyLoss(),
                               verbose=False)
    per = BATCH // gpc.data_size
    share = slice(gpc.data_rank * per, (gpc.data_rank + 1) * per)

    def step(x, y):
        engine.zero_grad()
        engine.execute_schedule((x[share], y[share]))
        engine.step()
    try:
        _frozen_train(model, how, step)
    except RuntimeError as e:
        return str(e)
    for name, value in model.state_dict().items():  # (each rank: its own experts' keys)
        assert_close(value, expected[name], msg=lambda m: f"{name}: {m}")
    return None


HANDLERS = {"moe": {"parallel": {"moe": {"size": 2}}},
            "data-parallel": {"gradient_handler": [{"type": "DataParallelGradientHandler"}]}}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("handler", HANDLERS)
def test_deep_gradient_handlers_leave_unused_and_frozen_parameters_as_one_process(handler):
    """A parameter no rank computed a gradient for keeps grad=None, so weight decay and momentum
    leave it alone, as in one process (zeros would move it)."""
    expected = _frozen_single("freeze")
    assert run_ranks(_frozen_worker, 2, HANDLERS[handler], "freeze", expected) == [None, None]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("handler", HANDLERS)
def test_deep_a_parameter_unfrozen_after_initialize_is_a_clear_error(handler):
    """The handlers list the trainable parameters when they are built: one unfrozen since would
    never be averaged and the replicas would drift apart."""
    for rank, message in enumerate(run_ranks(_frozen_worker, 2, HANDLERS[handler], "unfreeze",
                                             None)):
        assert message.startswith(f"[rank {rank}] ") and "1.attn.qkv.weight" in message and \
            "did not require grad when" in message and "Unfreeze before" in message, message


def _train_gpt(tmp_path, name):
    nproc, batch, parallel, aux = SCRIPT_LAYOUTS[name]
    config = tmp_path / f"{name.replace(' ', '_').replace(',', '')}.py"
    config.write_text(f"BATCH_SIZE = {batch}\n{MODEL}MOE_AUX_WEIGHT = {aux}\n{parallel}\n")
    out = run_script(ROOT / "train_gpt.py",
                     ["--config", str(config), "--max-steps", "3", "--seed", "5",
                      "--max-bytes", "3000", "--sample", "0"], nproc=nproc, cwd=tmp_path)
    return float(re.search(rf"final train loss ([0-9.e+-]+) \(with {aux:g} x aux", out).group(1))


@pytest.mark.timeout(120)
def test_deep_train_gpt_moe_final_loss_equals_one_process(tmp_path):
    losses = {name: _train_gpt(tmp_path, name) for name in SCRIPT_LAYOUTS}
    for name, loss in losses.items():  # (the script prints 6 digits)
        reference = losses["one process" + (", no aux" if SCRIPT_LAYOUTS[name][3] == 0 else "")]
        assert loss == pytest.approx(reference, rel=2e-5), losses


# -- MoE in the training loop: the Trainer, checkpoints, generate(), five calls -------------------

def _moe(config):
    """MoeLayer's arguments. Note: MoeLayer's own evaluation factor is 2.0 whatever the training
    one (moe_model_settings, for train_gpt.py, takes the larger): given by hand here, or
    evaluation would drop tokens per rank that one process keeps."""
    factor = config.get("MOE_CAPACITY_FACTOR", float(E))
    return dict(num_experts=config.get("NUM_EXPERTS", E), top_k=config.get("MOE_TOP_K", 2),
                capacity_factor_train=factor, capacity_factor_eval=max(2.0, factor),
                jitter_eps=config.get("JITTER", 0.0))


def _config_model(config, dtype=torch.float64):
    """The MoE GPT (E experts, top-2) as the config asks; the explicit attention: the fused
    kernel under half precision can round a token onto another expert."""
    torch.manual_seed(0)
    return gpt(vocab=VOCAB, seq_len=SEQ, dim=DIM, depth=2, heads=2, mlp_ratio=2,
               moe=_moe(config), attention="explicit").to(dtype)


def _batches(steps, batch=BATCH, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, VOCAB, (2, batch, SEQ), generator=g).unbind(0))
            for _ in range(steps)]


def _launch(rank, world, port, config):
    config = {"MOE_AUX_WEIGHT": AUX, **config}
    nc.launch(config, rank=rank, world_size=world, host="127.0.0.1", port=port)


def _state(model):
    return {k: v.detach().double().clone()
            for k, v in nc.checkpoint.strip_prefixes(model.state_dict()).items()}


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _train(rank, world, port, config, steps=3, dtype=torch.float64):
    """`steps` global batches through initialize's engine (execute_schedule); returns losses
    (global mean), norms, steps taken, loss scales and the model's state (experts of this rank)."""
    _launch(rank, world, port, config)
    model = _config_model(config, dtype)
    engine, loader, *_ = nc.initialize(model, _sgd(model), col_nn.VocabParallelCrossEntropyLoss(),
                                       my_share(_batches(steps)), verbose=False)
    def aux(out):
        out.setdefault("aux", []).append(moe_aux_loss(engine.model).item())
    out = record_steps(engine, loader, None, aux)
    out["state"] = _state(engine.model)
    out["experts"] = sorted({k.split(".experts.")[1].split(".")[0]
                             for k in out["state"] if ".experts." in k})
    return out


def _plain_torch_accumulation(rank, world, port, steps, accumulation):
    """The tutorial's maths by hand: each micro-batch adds (CE + AUX x aux) / N, one clipped SGD
    step per N micro-batches."""
    _launch(rank, world, port, {})
    model = _config_model({})
    opt = _sgd(model)
    batches = _batches(steps)
    for i, (x, y) in enumerate(batches):
        if i % accumulation == 0:
            opt.zero_grad()
        ce = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        ((ce + AUX * moe_aux_loss(model)) / accumulation).backward()
        if i % accumulation == accumulation - 1:
            nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
    return _state(model)


@pytest.mark.timeout(30)
def test_gloo_moe_accumulation_one_process_is_the_plain_torch_loop():
    """The reference above is itself right: the Engine on one process with accumulation 2
    equals (CE + AUX x aux) / 2 per micro-batch by hand (the aux loss counted on each
    micro-batch, scaled like its CE)."""
    config = dict(gradient_accumulation=2, clip_grad_norm=CLIP)
    ref = run_ranks(_train, 1, config, 4, timeout=30)[0]
    plain = run_ranks(_plain_torch_accumulation, 1, 4, 2, timeout=30)[0]
    for key, value in plain.items():
        assert_close(ref["state"][key], value, rtol=1e-10, atol=1e-10, msg=key)


# -- the Trainer: train/test loss and last loss are one process's; resuming is bit-identical -----

def _datasets(n_train=16, n_test=8):
    from torch.utils.data import TensorDataset
    g = torch.Generator().manual_seed(3)
    make = lambda n: TensorDataset(*torch.randint(0, VOCAB, (2, n, SEQ), generator=g))  # noqa
    return make(n_train), make(n_test)


def _trainer_run(rank, world, port, config, epochs=2, ckpt=None, max_steps=None, resume=False,
                 test_pad=True, n_test=8):
    from nanocolossal.trainer import Trainer, hooks
    _launch(rank, world, port, config)
    model = _config_model(config)
    train_set, test_set = _datasets(n_test=n_test)
    train = nc.get_dataloader(train_set, shuffle=True, seed=5, drop_last=True,
                              batch_size=BATCH // gpc.data_size)
    test = nc.get_dataloader(test_set, batch_size=BATCH // gpc.data_size, pad=test_pad)
    engine, train, test, _ = nc.initialize(model, _sgd(model),
                                           col_nn.VocabParallelCrossEntropyLoss(), train, test,
                                           verbose=False)
    trainer = Trainer(engine)
    last = hooks.LastLossHook()
    hook_list = [hooks.LossHook(), last]
    if ckpt is not None:
        hook_list.append(hooks.SaveCheckpointHook(ckpt, every_steps=2))
        if resume:
            assert trainer.resume(ckpt)
    trainer.fit(train, epochs, test, hooks=hook_list, max_steps=max_steps)
    return dict(metrics=trainer.states["metrics"], last=last.value, state=_state(engine.model),
                step=trainer.cur_step, training=engine.model.training)


TRAINER_LAYOUTS = {  # name: (processes, parallel, gradient accumulation)
    "EP 2": (2, EP2, 1),
    "data 2 x EP 2": (4, EP2, 1),
    "EP 2, gradient accumulation 3 (4 batches an epoch: groups of 3 and 1)": (2, EP2, 3),
}


@pytest.fixture(scope="module")
def trainer_reference():
    return {n: run_ranks(_trainer_run, 1, dict(clip_grad_norm=CLIP, gradient_accumulation=n),
                         timeout=30)[0] for n in (1, 3)}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", TRAINER_LAYOUTS)
def test_deep_trainer_hooks_under_moe_report_one_process_numbers(trainer_reference, name):
    """LossHook (train: CE + AUX x aux; test: CE alone, eval capacity), LastLossHook: one
    process's numbers; the weights after 2 epochs are one process's."""
    world, parallel, accumulation = TRAINER_LAYOUTS[name]
    ref = trainer_reference[accumulation]
    config = dict(clip_grad_norm=CLIP, parallel=parallel, gradient_accumulation=accumulation)
    for run in run_ranks(_trainer_run, world, config, timeout=30):
        for split in ("train", "test"):
            for key, value in ref["metrics"][split].items():
                assert run["metrics"][split][key] == pytest.approx(value, rel=1e-10), \
                    (split, key, run["metrics"], ref["metrics"])
        assert run["last"] == pytest.approx(ref["last"], rel=1e-10)
        for key, value in run["state"].items():
            assert_close(value, ref["state"][key], rtol=1e-10, atol=1e-10)


@pytest.mark.timeout(60)
def test_deep_trainer_resume_under_moe_is_bit_identical(tmp_path):
    """data 2 x EP 2: stop after 3 of 8 steps (mid-epoch; the checkpoint of step 2 is one file
    per rank of the first EP group), resume in a new job, end bit-identical to a run that never
    stopped."""
    config = dict(clip_grad_norm=CLIP, parallel=EP2)
    whole = run_ranks(_trainer_run, 4, config, 2, None, timeout=30)
    ckpt = str(tmp_path / "ckpt.pt")
    first = run_ranks(_trainer_run, 4, config, 2, ckpt, 3, timeout=30)
    assert first[0]["step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-expert0.pt", "ckpt-expert1.pt"]
    second = run_ranks(_trainer_run, 4, config, 2, ckpt, None, True, timeout=30)
    assert_bit_identical(whole, second)


def _uneven_eval(rank, world, port, n_test):
    import time
    start = time.monotonic()
    try:
        _trainer_run(rank, world, port, dict(parallel=EP2, timeout=5), 1, None, None, False,
                     False, n_test)
    except Exception as e:  # noqa: BLE001 -- the message is what is tested
        return f"{type(e).__name__}: {e}", time.monotonic() - start
    return "accepted", time.monotonic() - start


@pytest.mark.timeout(30)
def test_deep_moe_uneven_last_eval_batch_is_refused_on_every_rank():
    """pad=False, 7 test samples on 2 ranks, 2 per batch: shards 4 / 3, the last batches 2 / 1
    sample: every rank says so at once (balance.py's token-count check), no hang."""
    for rank, (text, seconds) in enumerate(run_ranks(_uneven_eval, 2, 7, timeout=20)):
        assert text.startswith(f"ValueError: [rank {rank}] MoE layer: the data-parallel ranks "
                               f"route different numbers of tokens"), text
        assert "same batch size" in text and seconds < 5, (text, seconds)


@pytest.mark.timeout(30)
def test_gloo_moe_uneven_eval_batch_counts_are_refused_on_every_rank():
    said = run_ranks(_uneven_eval, 2, 9, timeout=20)
    for rank, (text, seconds) in enumerate(said):
        assert text.startswith(f"ValueError: [rank {rank}]") or \
            text.startswith(f"ConfigError: [rank {rank}]"), said
        assert "pad" in text and seconds < 5, said


# -- the tutorial's five calls, in train and in eval mode -----------------------------------------

def _five_calls(rank, world, port, config, start, stop, load=None, save=None, plain=None):
    """Batches start..stop-1 of one stream with engine(x), engine.criterion, engine.backward,
    engine.step; before that, the eval-mode loss of the first batch (CE alone). Optionally load a
    checkpoint (load_checkpoint) or a plain state_dict (load_plain_state_dict) first, save after.
    """
    _launch(rank, world, port, config)
    model = _config_model(config)
    engine, loader, *_ = nc.initialize(model, _sgd(model), col_nn.VocabParallelCrossEntropyLoss(),
                                       my_share(_batches(stop)[start:]), verbose=False)
    if load is not None:
        nc.checkpoint.load_checkpoint(load, engine.model, engine.optimizer)
    if plain is not None:
        nc.checkpoint.load_plain_state_dict(engine.model, plain)
    x, y = next(iter(loader))
    engine.eval()
    with torch.no_grad():
        eval_loss = engine.criterion(engine(x), y)
        ce = nn.functional.cross_entropy(engine(x).reshape(-1, VOCAB), y.reshape(-1))
    engine.train()
    train_losses = []
    for x, y in loader:
        engine.zero_grad()
        out = engine(x)
        loss = engine.criterion(out, y)
        train_losses.append(nc.metrics.all_reduce_mean(loss.item()))
        engine.backward(loss)
        assert engine.step()
    if save is not None:
        nc.checkpoint.save_checkpoint(save, stop, engine.model, engine.optimizer)
    return dict(state=_state(engine.model), train=train_losses,
                eval=nc.metrics.all_reduce_mean(eval_loss.item()),
                eval_ce=nc.metrics.all_reduce_mean(ce.item()))


@pytest.mark.timeout(60)
def test_deep_moe_five_calls_eval_mode_adds_no_aux_and_train_mode_does():
    """engine.eval(): engine.criterion is the cross-entropy alone (the aux loss is a training
    loss); engine.train(): CE + AUX x aux; both the global batch's, as one process."""
    ref = run_ranks(_five_calls, 1, {}, 0, 3, timeout=30)[0]
    assert ref["eval"] == pytest.approx(ref["eval_ce"], rel=1e-12)
    for run in run_ranks(_five_calls, 2, dict(parallel=EP2), 0, 3, timeout=30):
        assert run["eval"] == pytest.approx(ref["eval"], rel=1e-10)
        assert run["eval_ce"] == pytest.approx(run["eval"], rel=1e-12)
        assert_close(torch.tensor(run["train"]), torch.tensor(ref["train"]), rtol=1e-10, atol=0)
        for key, value in run["state"].items():
            assert_close(value, ref["state"][key], rtol=1e-10, atol=1e-10, msg=key)


@pytest.mark.timeout(60)
def test_deep_moe_checkpoint_merges_and_loads_into_other_expert_parallel_sizes(tmp_path):
    """2 steps under EP 2 with the five calls, saved (one file per EP rank); merge_checkpoint
    equals one process's weights after the same 2 steps; load_plain_state_dict of it into one
    process and into EP 4 (1 expert per rank): the 3rd step (fresh momenta in both) agrees."""
    ref2 = run_ranks(_five_calls, 1, {}, 0, 2, timeout=30)[0]
    run_ranks(_five_calls, 2, dict(parallel=EP2), 0, 2, None, str(tmp_path / "ep2.pt"),
              timeout=30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ep2-expert0.pt", "ep2-expert1.pt"]
    merged = merge_checkpoint(tmp_path / "ep2.pt")
    assert merged.keys() == ref2["state"].keys()
    for key, value in ref2["state"].items():
        assert_close(merged[key].double(), value, rtol=1e-10, atol=1e-10, msg=key)
    one = run_ranks(_five_calls, 1, {}, 2, 3, None, None, merged, timeout=30)[0]
    ep4 = run_ranks(_five_calls, 4, dict(parallel={"moe": {"size": 4}}), 2, 3, None, None,
                    merged, timeout=30)
    assert [r["state"].keys() != one["state"].keys() for r in ep4] == [True] * 4
    for run in ep4:
        assert run["train"] == pytest.approx(one["train"], rel=1e-10)
        for key, value in run["state"].items():
            assert_close(value, one["state"][key], rtol=1e-10, atol=1e-10, msg=key)


def _load_other_layout(rank, world, port, config, path):
    try:
        _five_calls(rank, world, port, config, 0, 1, path)
    except Exception as e:  # noqa: BLE001 -- the message is what is tested
        return f"{type(e).__name__}: {e}"
    return "accepted"


@pytest.mark.timeout(60)
def test_deep_moe_checkpoint_into_another_ep_size_says_how(tmp_path):
    run_ranks(_five_calls, 2, dict(parallel=EP2), 0, 1, None, str(tmp_path / "ep2.pt"),
              timeout=30)
    said = run_ranks(_load_other_layout, 1, {}, str(tmp_path / "ep2.pt"), timeout=30)
    said += run_ranks(_load_other_layout, 4, dict(parallel={"moe": {"size": 4}}),
                      str(tmp_path / "ep2.pt"), timeout=30)
    for text in said:
        assert text.startswith("ConfigError:"), said
        assert "merge_checkpoint" in text and "expert" in text, said


# -- generate(), jitter ------------------------------------------------------------------------

def _generate(rank, world, port, config, new=6):
    from nanocolossal.generate import generate
    _launch(rank, world, port, config)
    model = _config_model(config)
    engine, *_ = nc.initialize(model, _sgd(model), col_nn.VocabParallelCrossEntropyLoss(),
                               verbose=False)
    with torch.no_grad():  # a model that has learned something: sharper logits than at init
        for p in engine.model.parameters():
            p.mul_(8.0)
    prompt = _batches(1)[0][0][0].tolist()
    return generate(engine, prompt, new, seed=11), engine.model.training


@pytest.mark.timeout(60)
def test_deep_generate_under_moe_gives_one_process_tokens():
    ref = run_ranks(_generate, 1, {}, timeout=30)[0]
    assert len(set(ref[0])) > 1
    for world, parallel in [(2, EP2), (4, EP2)]:
        assert run_ranks(_generate, world, dict(parallel=parallel), timeout=30) == [ref] * world


@pytest.mark.timeout(60)
def test_deep_moe_jitter_keeps_replicas_equal():
    """Jitter noise (eps 0.1) draws from each rank's RNG: not one process's numbers, but the
    replicas must stay equal: non-expert parameters on all 4 ranks of data 2 x EP 2, each
    expert on its two holders (ranks 0 and 2, 1 and 3)."""
    runs = run_ranks(_train, 4, dict(JITTER=0.1, parallel=EP2, clip_grad_norm=CLIP), 3,
                     timeout=30)
    calm = run_ranks(_train, 4, dict(parallel=EP2, clip_grad_norm=CLIP), 3, timeout=30)
    assert runs[0]["experts"] == runs[2]["experts"] != runs[1]["experts"] == runs[3]["experts"]
    for r, run in enumerate(runs):
        peer = runs[r % 2]
        for key, value in run["state"].items():
            assert torch.equal(value, (peer if ".experts." in key else runs[0])["state"][key]), key
    assert any(not torch.equal(runs[0]["state"][k], calm[0]["state"][k])
               for k in runs[0]["state"]), "the noise changed something"


# -- bad configs: refused by key, with what to change ----------------------------------------------

@pytest.mark.timeout(30)
def test_gloo_moe_bad_configs_say_what_to_change():
    moe2 = {"parallel": {"moe": {"size": 2}}}
    with pytest.raises(ConfigError, match=r"parallel.moe size 2 does not divide the data-parallel "
                                          r"size 3 \(world size 3\).*launch a multiple of 2"):
        check_world(load_config(moe2), 3)
    with pytest.raises(ConfigError, match=r"data-parallel size 3 \(world size 6\).*launch a "
                                          r"multiple of 4 processes \(e.g. 8\)"):
        check_world(load_config({**moe2, "parallel": {"moe": 2, "pipeline": 2}}), 6)
    cases = {
        "NUM_EXPERTS=3 does not fit parallel.moe size 2": {**moe2, "NUM_EXPERTS": 3},
        r"MOE_CAPACITY_FACTOR must be a number > 0, got 0": {"NUM_EXPERTS": 4,
                                                             "MOE_CAPACITY_FACTOR": 0},
        r"MOE_TOP_K must be 1 \(Switch\) or 2": {"NUM_EXPERTS": 4, "MOE_TOP_K": 3},
        r"MOE_AUX_WEIGHT must be a number >= 0": {"MOE_AUX_WEIGHT": -1},
        r"does not combine with parallel.tensor \(tensor\)": {
            "parallel": {"moe": 2, "tensor": {"size": 2, "mode": "1d"}}},
        r"does not combine with parallel.tensor \(sequence\)": {
            "parallel": {"moe": 2, "tensor": {"size": 2, "mode": "sequence"}}},
        r"does not combine with zero": {**moe2, "zero": {"level": 1}},
        r"parallel.moe takes only size": {"parallel": {"moe": {"size": 2, "ep": 2}}},
    }
    for message, config in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(config)


@pytest.mark.timeout(10)
def test_moe_bad_config_values_are_refused_by_key():
    cases = {
        r"parallel.moe size must be a positive integer \(moe=dict\(size=EP\)\), got 0":
            {"parallel": {"moe": 0}},
        r"parallel.moe size must be a positive integer .*got '2'": {"parallel": {"moe": "2"}},
        r"parallel.moe size must be a positive integer .*got 2.0":
            {"parallel": {"moe": {"size": 2.0}}},
        r"NUM_EXPERTS must be a positive integer, got 2.0": {"NUM_EXPERTS": 2.0},
        r"NUM_EXPERTS must be a positive integer, got True": {"NUM_EXPERTS": True},
        r"MOE_TOP_K must be 1 \(Switch\) or 2 .*got True": {"NUM_EXPERTS": 4, "MOE_TOP_K": True},
        r"MOE_TOP_K .* at most NUM_EXPERTS=1, got 2": {"NUM_EXPERTS": 1, "MOE_TOP_K": 2},
        r"MOE_CAPACITY_FACTOR must be a number > 0, got '4'":
            {"NUM_EXPERTS": 4, "MOE_CAPACITY_FACTOR": "4"},
        r"MOE_EVAL_CAPACITY_FACTOR must be a number > 0, got 0":
            {"NUM_EXPERTS": 4, "MOE_EVAL_CAPACITY_FACTOR": 0},
        r"NUM_EXPERTS=8 does not fit parallel.moe size 3": {"NUM_EXPERTS": 8,
                                                            "parallel": {"moe": 3}},
    }
    for message, config in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(config)
    with pytest.raises(ConfigError, match=r"parallel.moe size 4 does not divide the "
                                          r"data-parallel size 2 \(world size 2\)"):
        check_world(load_config({"parallel": {"moe": {"size": 4}}}), 2)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("key,value", [("MOE_AUX_WEIGHT", float("nan")),
                                       ("MOE_AUX_WEIGHT", float("inf")),
                                       ("MOE_CAPACITY_FACTOR", float("inf"))])
def test_moe_non_finite_numbers_are_refused_by_key(key, value):
    with pytest.raises(ConfigError, match=key):
        load_config({"NUM_EXPERTS": 4, key: value})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("parallel", [EP2, {}], ids=["EP 2", "replicated experts"])
def test_deep_moe_fp16_gradient_sum_does_not_overflow_where_one_process_does_not(parallel):
    config = dict(fp16=dict(mode=AMP_TYPE.NAIVE, dtype="float16", initial_scale=81920.0))
    ref = run_ranks(_train, 1, config, 2, torch.float32, timeout=30)[0]
    assert ref["took"] == [True, True]
    runs = run_ranks(_train, 2, {**config, "parallel": parallel}, 2, torch.float32, timeout=30)
    assert [run["took"] for run in runs] == [ref["took"]] * 2
    compare_runs(ref, runs, rtol=5e-4, atol=5e-4, norms=False)


def _build_under(rank, world, port, tensor):
    nc.launch({"parallel": {"tensor": tensor}}, rank=rank, world_size=world, host="127.0.0.1",
              port=port)
    try:
        gpt(vocab=VOCAB, seq_len=SEQ, dim=DIM, depth=2, heads=2, mlp_ratio=2, moe=_moe({}))
    except ValueError as e:
        return str(e)
    return "built"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("tensor, says", [
    (dict(size=2, mode="1d"), "use parallel.moe instead of parallel.tensor"),
    (dict(size=2, mode="sequence"), "not combined with sequence parallelism"),
], ids=["1d", "sequence"])
def test_gloo_an_moe_gpt_under_tensor_or_sequence_ranks_is_refused_saying_what_to_do(tensor, says):
    for rank, message in enumerate(run_ranks(_build_under, 2, tensor)):
        assert message.startswith(f"[rank {rank}]") and says in message, message


@pytest.mark.timeout(10)
def test_moe_groups_are_carved_out_of_the_data_ranks():
    """context.layout's moe groups (a pure function): EP groups of consecutive data ranks, and
    per exchange block G the data ranks holding the same experts (data_rank % G)."""
    from nanocolossal.layout import layout
    groups = layout(8, ep=4)
    assert groups.ep == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups.expert_data == {1: [list(range(8))], 2: [[0, 2, 4, 6], [1, 3, 5, 7]],
                                  4: [[0, 4], [1, 5], [2, 6], [3, 7]]}
    assert layout(4).ep == [] and layout(4).expert_data == {}
