"""Mixture of experts x pipeline parallelism: parallel=dict(pipeline=2, moe=dict(size=EP)) trains
exactly as one process holding every expert.

The GPT of train_gpt.py with 4 blocks, MoE in every other one, cut uniformly into 2 stages: each
stage holds one MoE layer, so stage 0's load-balancing loss must reach its own backward. Cut
[2, 4] instead, stage 0 holds none: it runs DDP, stage 1 the MoE gradient handler, and the tied
embedding must be summed over the stages only after each stage's data mean. The
one-process reference runs the same M = 2 micro-batches (micro-batch m of the global batch is
micro-batch m of every data rank) and steps on mean_m(CE_m + AUX x aux_m): the aux loss is a
product of two means over a micro-batch's tokens, so that is what a pipeline can equal.

float64, SGD with momentum, a clip that really clips (the norm counts each expert once and each
stage once), AUX = 0.1: after 3 steps every parameter equals one process's to 1e-10, the clip
norm matches at every step, the reported loss (cross-entropy + AUX x every stage's aux) matches;
the checkpoint (one file per stage and rank of the first EP group) merges into the one-process
state_dict and loads back.
"""
import sys

import pytest
import torch
from dist_helpers import ROOT, run_ranks
from test_moe_train_gloo import (  # the same batches, optimizer and checkpoint round trip
    SEQ,
    VOCAB,
    _batches,
    _optimizer,
    engine_and_share,
    save_and_load_back,
)
from torch import nn
from torch.testing import assert_close

import nanocolossal as nc
from nanocolossal.checkpoint import merge_checkpoint
from nanocolossal.context import gpc, layout
from nanocolossal.metrics import all_reduce_mean
from nanocolossal.moe import moe_aux_loss, moe_layers
from nanocolossal.pipeline import build_pipeline_model

sys.path.insert(0, str(ROOT))
from train_gpt import gpt  # noqa: E402

CLIP, AUX, M, E, D = 0.5, 0.1, 2, 4, 2


def _model():
    torch.manual_seed(0)
    moe = dict(num_experts=E, top_k=2, capacity_factor_train=float(E))  # nothing dropped
    return gpt(vocab=VOCAB, seq_len=SEQ, dim=16, depth=4, heads=2, mlp_ratio=2, moe=moe).double()


def _micro_batches(t):
    """Global micro-batch m: micro-batch m of each of the D data ranks' shares."""
    shares = [part.tensor_split(M) for part in t.tensor_split(D)]
    return [torch.cat([share[m] for share in shares]) for m in range(M)]


@pytest.fixture(scope="module")
def reference():
    model = _model()
    assert len(moe_layers(model)) == 2
    opt, norms, losses = _optimizer(model), [], []
    for x, y in _batches():
        opt.zero_grad()
        total = 0.0
        for xm, ym in zip(_micro_batches(x), _micro_batches(y)):
            ce = nn.functional.cross_entropy(model(xm).reshape(-1, VOCAB), ym.reshape(-1))
            loss = (ce + AUX * moe_aux_loss(model)) / M
            loss.backward()
            total += loss.item()
        losses.append(total)
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
    assert norms[0] > CLIP, "the clip really clips"
    return model.state_dict(), norms, losses


def _stage_model(partition="uniform"):
    return build_pipeline_model(_model(), partition=partition)


def _worker(rank, world_size, port, ep, partition, expected, norms, losses, path):
    config = {"parallel": {"pipeline": 2, "moe": {"size": ep}}, "clip_grad_norm": CLIP,
              "MOE_AUX_WEIGHT": AUX, "NUM_MICRO_BATCHES": M}
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    model = _stage_model(partition)
    layers = len(moe_layers(model))
    assert layers == (1 if partition == "uniform" else 2 * gpc.pipeline_rank), layers
    engine, mine = engine_and_share(model)
    for step, (x, y) in enumerate(_batches()):
        engine.zero_grad()
        _, _, loss = engine.execute_schedule((x[mine], y[mine]))
        reported = all_reduce_mean(loss.item())  # over the data ranks, as the LossHook does
        assert reported == pytest.approx(losses[step], rel=1e-6), "every stage's aux included"
        assert engine.step()
        assert engine.last_grad_norm == pytest.approx(norms[step], rel=1e-10)
    state = engine.model.state_dict()
    for name, p in state.items():
        assert_close(p, expected[name], rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}")
    save_and_load_back(path, engine, _stage_model(partition))  # its stage's file of its experts
    return gpc.pipeline_rank, sorted(k for k in state if ".experts." in k)


LAYOUTS = {  # name: (EP, partition) (4 ranks: pipeline 2 x data 2 each)
    "pipeline 2 x EP 2": (2, "uniform"),
    "pipeline 2 x data 2, EP 1 (replicated experts)": (1, "uniform"),
    # stage 0 (embeddings, block 0) holds no MoE layer: it runs DDP while stage 1 runs the MoE
    # gradient handler, and the tied embedding is summed across the two only after both averaged
    "pipeline 2 x EP 2, no MoE on stage 0": (2, [2, 4]),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", LAYOUTS)
def test_gloo_moe_pipeline_training_equals_one_process(reference, name, tmp_path):
    expected, norms, losses = reference
    held = run_ranks(_worker, 4, *LAYOUTS[name], expected, norms, losses, tmp_path / "ck.pt",
                     timeout=50)
    stages = {rank: held[rank][0] for rank in range(4)}
    assert stages == {0: 0, 1: 1, 2: 0, 3: 1}
    if LAYOUTS[name] == (2, "uniform"):  # data ranks 0, 1 of stage 0 are global ranks 0, 2
        assert held[0][1] != held[2][1], "the experts are split between a stage's data ranks"
    merged = merge_checkpoint(tmp_path / "ck.pt")
    assert merged.keys() == expected.keys()
    for key, value in expected.items():
        assert_close(merged[key], value, rtol=1e-10, atol=1e-10, msg=key)


@pytest.mark.timeout(10)
def test_moe_groups_are_per_pipeline_stage():
    """context.layout's expert groups are carved out of each stage's data ranks (a pure
    function): rank = data_rank x P + pipeline_rank, so stage 0's data ranks are 0 2 4 6."""
    groups = layout(8, P=2, ep=2)
    assert groups.data == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert groups.ep == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert groups.expert_data == {1: [[0, 2, 4, 6], [1, 3, 5, 7]],
                                  2: [[0, 4], [2, 6], [1, 5], [3, 7]]}
