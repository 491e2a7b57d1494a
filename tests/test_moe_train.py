"""Mixture of experts as a framework feature: parallel=dict(moe=dict(size=EP)) trains exactly as
one process holding every expert on the same global batch.

Engine level: float64, SGD with momentum (Adam would hide a gradient scaled by a constant, e.g.
experts averaged over the wrong ranks), a clip that really clips (the norm must count each
expert once), the load-balancing loss added by the Engine: parameters after 3 steps equal one
process's to 1e-10 for EP 2, data 2 x EP 2 and EP 4 with 2 experts (replicas); the checkpoint
of each merges into the plain model's state_dict and loads back (model and momenta) on every
rank. Script level: train_gpt.py's `final train
loss` for EP 2 on 2 ranks, EP 2 and EP 4 on 4 ranks, pipeline 2 x EP 2 on 4 ranks equals one
process's (MoE x pipeline is tested exactly in test_moe_pipeline.py). Then what is refused.
"""
import re
import sys

import pytest
import torch
from dist_helpers import ROOT, run_ranks, run_script
from moe_runs import (
    BATCH,
    SEQ,
    VOCAB,
    engine_and_share,
    moe_batches,
    moe_optimizer,
    save_and_load_back,
)
from torch import nn
from torch.testing import assert_close

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.checkpoint import merge_checkpoint
from nanocolossal.config import ConfigError, load_config
from nanocolossal.context import ParallelContext, gpc
from nanocolossal.moe import moe_aux_loss

sys.path.insert(0, str(ROOT))
from train_gpt import gpt  # noqa: E402

CLIP, AUX = 0.5, 0.1


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


@pytest.mark.timeout(30)
def test_gloo_moe_bad_configs_say_what_to_change():
    moe2 = {"parallel": {"moe": {"size": 2}}}
    with pytest.raises(ConfigError, match=r"parallel.moe size 2 does not divide the data-parallel "
                                          r"size 3 \(world size 3\).*launch a multiple of 2"):
        ParallelContext.parallel_sizes(load_config(moe2), 3)
    with pytest.raises(ConfigError, match=r"data-parallel size 3 \(world size 6\).*launch a "
                                          r"multiple of 4 processes \(e.g. 8\)"):
        ParallelContext.parallel_sizes(load_config({**moe2, "parallel": {"moe": 2,
                                                                         "pipeline": 2}}), 6)
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
def test_moe_groups_are_carved_out_of_the_data_ranks():
    """context.layout's moe groups (a pure function): EP groups of consecutive data ranks, and
    per exchange block G the data ranks holding the same experts (data_rank % G)."""
    from nanocolossal.layout import layout
    groups = layout(8, ep=4)
    assert groups.ep == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert groups.expert_data == {1: [list(range(8))], 2: [[0, 2, 4, 6], [1, 3, 5, 7]],
                                  4: [[0, 4], [1, 5], [2, 6], [3, 7]]}
    assert layout(4).ep == [] and layout(4).expert_data == {}
