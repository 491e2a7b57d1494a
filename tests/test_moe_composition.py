"""Mixture of experts (parallel.moe) composed with the other features, each against ONE PROCESS
holding every expert on the whole global batch (the same nanocolossal code on world size 1, and
for gradient accumulation a plain-torch loop too): gradient accumulation, AMP (TORCH bf16/fp16,
NAIVE and APEX O2 with master weights, an overflow on one rank), the Trainer's hooks with
evaluation, resuming mid-epoch, checkpoints across expert-parallel sizes, generate(), jitter,
replicated experts without parallel.moe, an expert without tokens, the Engine's five calls in
eval mode, and what must be refused (without a hang).

float64, SGD with momentum (Adam hides gradient-scale bugs), MOE_CAPACITY_FACTOR >= E so that
nothing drops. Refusals are checked on every rank: evaluation shards with different batch
counts (pad=False), a checkpoint loaded into another EP size, nan/inf MOE_AUX_WEIGHT and
MOE_CAPACITY_FACTOR; fp16's loss scale is checked to survive wherever one process's does.
"""
import sys

import pytest
import torch
from dist_helpers import ROOT, run_ranks
from models import my_share
from run_records import compare_runs, one_and_layout, record_steps
from torch import nn
from torch.testing import assert_close

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.config import AMP_TYPE
from nanocolossal.context import gpc
from nanocolossal.moe import moe_aux_loss, moe_layers

sys.path.insert(0, str(ROOT))
from train_gpt import gpt  # noqa: E402

BATCH, SEQ, VOCAB, DIM, CLIP, AUX, E = 4, 8, 32, 16, 0.5, 0.1, 4
EP2 = {"moe": {"size": 2}}


def _moe(config):
    """MoeLayer's arguments. Note: MoeLayer's own evaluation factor is 2.0 whatever the training
    one (moe_model_settings, for train_gpt.py, takes the larger): given by hand here, or
    evaluation would drop tokens per rank that one process keeps."""
    factor = config.get("MOE_CAPACITY_FACTOR", float(E))
    return dict(num_experts=config.get("NUM_EXPERTS", E), top_k=config.get("MOE_TOP_K", 2),
                capacity_factor_train=factor, capacity_factor_eval=max(2.0, factor),
                jitter_eps=config.get("JITTER", 0.0))


def _model(config, dtype=torch.float64):
    torch.manual_seed(0)
    # the explicit attention: with the fused kernel under bf16 autocast the EP-2 run's third
    # gradient norm moved 2% from one process's (measured), far beyond its rounding elsewhere
    # (a discrete change, as a token taking another expert would be); this file is about MoE
    model = gpt(vocab=VOCAB, seq_len=SEQ, dim=DIM, depth=2, heads=2, mlp_ratio=2,
                moe=_moe(config), attention="explicit").to(dtype)
    if config.get("ROUTER_ZERO"):  # uniform probabilities: ties go to expert 0, top-1 all there
        for layer in moe_layers(model):
            nn.init.zeros_(layer.router.gate.weight)
    return model


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


# -- one generic training run: the same code on one process and on a layout ---------------------

def _train(rank, world, port, config, steps=3, dtype=torch.float64, inject=None):
    """`steps` global batches through initialize's engine (execute_schedule); returns losses
    (global mean), norms, steps taken, loss scales and the model's state (experts of this rank)."""
    _launch(rank, world, port, config)
    model = _model(config, dtype)
    engine, loader, *_ = nc.initialize(model, _sgd(model), col_nn.VocabParallelCrossEntropyLoss(),
                                       my_share(_batches(steps)), verbose=False)
    def aux(out):
        out.setdefault("aux", []).append(moe_aux_loss(engine.model).item())
    out = record_steps(engine, loader, inject, aux)
    out["state"] = _state(engine.model)
    out["experts"] = sorted({k.split(".experts.")[1].split(".")[0]
                             for k in out["state"] if ".experts." in k})
    return out


def _compare(ref, runs, **tolerances):
    compare_runs(ref, runs, **tolerances)


def _one_and_layout(config, world, parallel, *args, timeout=30):
    return one_and_layout(_train, config, world, parallel, *args, timeout=timeout)


# (experts x accumulation, x EP 2 / 4, replicated experts x ZeRO 1-3, x the pipeline schedules:
# rows of test_composition.py's TABLE; here top-1 routing and a router that sends every token to
# one expert, which its GPT does not do)
TRAIN_CASES = {  # name: (config, processes, parallel)
    "data 2 x EP 2, accumulation 2, top-1": (dict(gradient_accumulation=2, MOE_TOP_K=1), 4, EP2),
    "EP 2, top-1, router sends every token to expert 0 at first":
        (dict(MOE_TOP_K=1, ROUTER_ZERO=True), 2, EP2),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", TRAIN_CASES)
def test_gloo_moe_top1_routing_x_expert_parallel_equals_one_process(name):
    config, world, parallel = TRAIN_CASES[name]
    ref, runs = _one_and_layout(config, world, parallel, 4)
    if "clip" in name:
        assert max(n for n in ref["norms"] if n) > CLIP, "it really clips"
    _compare(ref, runs)
    if parallel:
        assert runs[0]["experts"] != runs[1]["experts"], "experts are split"
    else:
        assert runs[0]["experts"] == runs[1]["experts"] == ref["experts"]


def _plain_torch_accumulation(rank, world, port, steps, accumulation):
    """The tutorial's maths by hand: each micro-batch adds (CE + AUX x aux) / N, one clipped SGD
    step per N micro-batches."""
    _launch(rank, world, port, {})
    model = _model({})
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


# -- AMP ---------------------------------------------------------------------------------------

AMP_CASES = {  # name: (fp16 config, processes, parallel)
    "TORCH bf16, EP 2": (dict(mode=AMP_TYPE.TORCH, dtype="bfloat16"), 2, EP2),
    "TORCH fp16, EP 2": (dict(mode=AMP_TYPE.TORCH, dtype="float16"), 2, EP2),
    "NAIVE fp16, EP 2": (dict(mode=AMP_TYPE.NAIVE, dtype="float16"), 2, EP2),
    "APEX O2 bf16, data 2 x EP 2": (dict(mode=AMP_TYPE.APEX, opt_level="O2", dtype="bfloat16"),
                                    4, EP2),
    "NAIVE fp16, EP 4 with 2 experts": (dict(mode=AMP_TYPE.NAIVE, dtype="float16"), 4,
                                        {"moe": {"size": 4}}),
    "TORCH fp16, EP 2, accumulation 2": (dict(mode=AMP_TYPE.TORCH, dtype="float16"), 2, EP2),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", AMP_CASES)
def test_deep_moe_x_amp_equals_one_process_to_half_precision(name):
    """float32 model, half compute; the clip (counting each expert once, O2: through the
    masters) really clips. Half precision rounds the all-to-all'd tokens as one process does
    but sums gradients over ranks in another order."""
    fp16, world, parallel = AMP_CASES[name]
    config = dict(fp16=fp16, clip_grad_norm=CLIP)
    if "2 experts" in name:
        config["NUM_EXPERTS"] = 2
    if "accumulation" in name:
        config["gradient_accumulation"] = 2
    ref, runs = _one_and_layout(config, world, parallel, 4 if "accumulation" in name else 3,
                                torch.float32)
    assert max(n for n in ref["norms"] if n) > CLIP, "it really clips"
    # measured: layout vs one process 1e-3 (bf16) / 2.5e-4 (fp16) at most, as far as one
    # process's half run is from its float32 run (1.1e-3 / 1.8e-4)
    tol = 2e-3 if "bf16" in name else 5e-4
    _compare(ref, runs, rtol=tol, atol=tol)


@pytest.mark.timeout(60)
def test_deep_moe_x_fp16_overflow_on_one_rank_skips_everywhere():
    """Dynamic loss scaling: an inf in one rank's gradient (rank 1 of EP 2; one process: its
    only rank) skips that step on every rank and halves the scale, as one process does: in the
    embedding (a replicated parameter) and in one of rank 1's experts."""
    config = dict(fp16=dict(mode=AMP_TYPE.NAIVE, dtype="float16", initial_scale=2.0 ** 10),
                  clip_grad_norm=CLIP)
    ref = run_ranks(_train, 1, config, 4, torch.float32, (1, [0]), timeout=30)[0]
    runs = run_ranks(_train, 2, {**config, "parallel": EP2}, 4, torch.float32, (1, [1]),
                     timeout=30)
    assert ref["took"] == [True, False, True, True] and ref["scales"][1] == 2.0 ** 9
    _compare(ref, runs, rtol=5e-4, atol=5e-4, norms=False)
    # the inf in an expert that only rank 1 holds (no all-reduce spreads it to rank 0)
    mine = runs[1]["experts"][0]
    ref = run_ranks(_train, 1, config, 4, torch.float32, (1, [0], f"experts.{mine}."),
                    timeout=30)[0]
    runs = run_ranks(_train, 2, {**config, "parallel": EP2}, 4, torch.float32,
                     (1, [1], f"experts.{mine}."), timeout=30)
    assert ref["took"] == [True, False, True, True] and ref["scales"][1] == 2.0 ** 9
    _compare(ref, runs, rtol=5e-4, atol=5e-4, norms=False)


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
    model = _model(config)
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
    for a, b in zip(whole, second):
        assert a["state"].keys() == b["state"].keys()
        for key in a["state"]:
            assert torch.equal(a["state"][key], b["state"][key]), key
        assert a["last"] == b["last"]


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
    model = _model(config)
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
    from nanocolossal.checkpoint import merge_checkpoint
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
    model = _model(config)
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


# -- bad configs: refused by key, with what to change ------------------------------------------

@pytest.mark.timeout(10)
def test_moe_bad_config_values_are_refused_by_key():
    from nanocolossal.config import ConfigError, load_config
    from nanocolossal.context import ParallelContext
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
        ParallelContext.parallel_sizes(load_config({"parallel": {"moe": {"size": 4}}}), 2)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("key,value", [("MOE_AUX_WEIGHT", float("nan")),
                                       ("MOE_AUX_WEIGHT", float("inf")),
                                       ("MOE_CAPACITY_FACTOR", float("inf"))])
def test_moe_non_finite_numbers_are_refused_by_key(key, value):
    from nanocolossal.config import ConfigError, load_config
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
    _compare(ref, runs, rtol=5e-4, atol=5e-4, norms=False)


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
