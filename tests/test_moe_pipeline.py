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
from moe_runs import (  # the same batches, optimizer and checkpoint round trip
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
from nanocolossal.checkpoint import merge_checkpoint, save_checkpoint, strip_prefixes
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
    opt, norms, losses = moe_optimizer(model), [], []
    for x, y in moe_batches():
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
    for step, (x, y) in enumerate(moe_batches()):
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


# -- stages that reduce differently around a tied weight: mixes of MoE, DDP, handlers, ZeRO -----
# Pipeline stages that differ in how they reduce gradients (MoE / no MoE, DDP / the MoE gradient
# handler / the config's gradient handler / ZeRO) around a weight tied across stages, and stage
# boundaries that carry no gradient back, against one process on the whole batch.
#
# The model is train_gpt.py's GPT (MoE in every other block, the token embedding tied to the
# output head) in float64; layers: 0 embeddings, 1 block, 2 MoE block, 3 block, 4 MoE block,
# 5 head. The one-process reference runs the same M micro-batches (global micro-batch m = micro-
# batch m of every data rank's share) and steps on mean_m(CE_m + AUX x aux_m), SGD with momentum,
# a clip that really clips. SEQ, VOCAB, CLIP, AUX and E are the ones above.

BATCH, STEPS = 4, 3


def _mix_model(depth=4):
    torch.manual_seed(0)
    moe = dict(num_experts=E, top_k=2, capacity_factor_train=float(E))  # nothing dropped
    return gpt(vocab=VOCAB, seq_len=SEQ, dim=16, depth=depth, heads=2, mlp_ratio=2,
               moe=moe).double()


def _mix_batches(batch=BATCH):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (2, batch, SEQ), generator=g).unbind(0) for _ in range(STEPS)]


def _mix_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)


def _mix_micro_batches(t, D, M):
    shares = [part.tensor_split(M) for part in t.tensor_split(D)]
    return [torch.cat([share[m] for share in shares]) for m in range(M)]


def _one_process(depth, D, M, aux=AUX, clip=CLIP, batch=BATCH):
    model = _mix_model(depth)
    opt, norms, losses = _mix_optimizer(model), [], []
    for x, y in _mix_batches(batch):
        opt.zero_grad()
        total = 0.0
        for xm, ym in zip(_mix_micro_batches(x, D, M), _mix_micro_batches(y, D, M)):
            ce = nn.functional.cross_entropy(model(xm).reshape(-1, VOCAB), ym.reshape(-1))
            loss = (ce + aux * moe_aux_loss(model)) / M
            loss.backward()
            total += loss.item()
        losses.append(total)
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
    assert norms[0] > clip, "the clip really clips"
    return model.state_dict(), norms, losses


def _loss(output, label):
    return nn.functional.cross_entropy(output.reshape(-1, VOCAB), label.reshape(-1))


def _mix_worker(rank, world, port, lay, expected, norms, losses, path):
    config = {"parallel": {"pipeline": lay["P"], "moe": {"size": lay["EP"]}},
              "clip_grad_norm": CLIP, "MOE_AUX_WEIGHT": AUX, "NUM_MICRO_BATCHES": lay.get("M", 2),
              "NUM_CHUNKS": lay.get("chunks", 1), **lay.get("config", {})}
    nc.launch(config, rank=rank, world_size=world, host="127.0.0.1", port=port, timeout=40)
    model = build_pipeline_model(_mix_model(lay["depth"]), num_chunks=lay.get("chunks", 1),
                                 partition=lay["partition"])
    has_moe = len(moe_layers(model)) > 0
    engine, *_ = nc.initialize(model, _mix_optimizer(model), _loss, verbose=False)
    D = gpc.data_size
    per = lay.get("batch", BATCH) // D
    mine = slice(gpc.data_rank * per, (gpc.data_rank + 1) * per)
    got_norms, got_losses = [], []
    for x, y in _mix_batches(lay.get("batch", BATCH)):
        engine.zero_grad()
        _, _, loss = engine.execute_schedule((x[mine], y[mine]))
        got_losses.append(all_reduce_mean(loss.item()))
        assert engine.step(), f"rank {rank}: step skipped"
        got_norms.append(engine.last_grad_norm)
    bad = []
    for name, p in engine.model.state_dict().items():
        if not torch.allclose(p, expected[name], rtol=1e-9, atol=1e-10):
            bad.append((name, (p - expected[name]).abs().max().item()))
    save_checkpoint(path, 0, engine.model, engine.optimizer)
    return dict(stage=gpc.pipeline_rank, moe=has_moe,
                handler=type(engine.gradient_handler).__name__, norms=got_norms,
                losses=got_losses, bad=bad)


def _check_mix(lay, tmp_path):
    P, world = lay["P"], lay["world"]
    D = world // P
    expected, norms, losses = _one_process(lay["depth"], D, lay.get("M", 2),
                                           batch=lay.get("batch", BATCH))
    runs = run_ranks(_mix_worker, world, lay, expected, norms, losses, tmp_path / "ck.pt",
                     timeout=90)
    moe_stages = sorted({r["stage"] for r in runs if r["moe"]})
    assert moe_stages == lay["moe_stages"], moe_stages  # the mix really is a mix
    for rank, run in enumerate(runs):
        assert run["bad"] == [], f"rank {rank} (stage {run['stage']}, {run['handler']}): " \
                                 f"differs from one process: {run['bad'][:6]}"
        assert run["norms"] == pytest.approx(norms, rel=1e-9), f"rank {rank} clip norms"
        assert run["losses"] == pytest.approx(losses, rel=1e-6), f"rank {rank} losses"
    merged = merge_checkpoint(tmp_path / "ck.pt")
    assert merged.keys() == expected.keys()
    for key, value in expected.items():
        assert_close(merged[key], value, rtol=1e-9, atol=1e-10, msg=key)


MIXES = {
    # MoE only on stage 0 (5 layers); stage 1 holds only the head (tied): DDP there
    "P2 x EP2, MoE only on the first stage, GPipe": dict(
        world=4, P=2, EP=2, depth=4, partition=[5, 1], moe_stages=[0],
        config={"PIPELINE_SCHEDULE": "gpipe"}),
    # interleaved: rank 0 (chunks [emb, block], [block]) has no MoE: DDP; rank 1 ([MoE],
    # [MoE, head]) the MoE handler; the tied weight is on rank 0 chunk 0 and rank 1 chunk 1
    "P2 x EP2 interleaved, no MoE on rank 0": dict(
        world=4, P=2, EP=2, depth=4, partition=[2, 1, 1, 2], chunks=2, moe_stages=[1]),
    # interleaved: rank 1 ([block], [head]) has no MoE: DDP holds the head
    "P2 x EP2 interleaved, no MoE on rank 1": dict(
        world=4, P=2, EP=2, depth=4, partition=[3, 1, 1, 1], chunks=2, moe_stages=[0]),
    # EP 1 (replicated experts): the config's gradient handler on every stage
    "P2 x data 2 EP1, gradient_handler, MoE only on stage 1": dict(
        world=4, P=2, EP=1, depth=4, partition=[2, 4], moe_stages=[1],
        config={"gradient_handler": [dict(type="DataParallelGradientHandler")]}),
    # EP 2 + the config's gradient handler: stage 0 without MoE runs that handler
    "P2 x EP2, gradient_handler, no MoE on stage 0": dict(
        world=4, P=2, EP=2, depth=4, partition=[2, 4], moe_stages=[1],
        config={"gradient_handler": [dict(type="DataParallelGradientHandler")]}),
    "P2 x data 2 EP1, ZeRO 1, MoE only on stage 0": dict(
        world=4, P=2, EP=1, depth=4, partition=[5, 1], moe_stages=[0],
        config={"zero": dict(level=1)}),
    "P2 x data 2 EP1, ZeRO 2, MoE only on stage 1": dict(
        world=4, P=2, EP=1, depth=4, partition=[2, 4], moe_stages=[1],
        config={"zero": dict(level=2)}),
    # 8 ranks: pipeline 4 x data 2 x EP 2, depth 2 cut one layer per stage: only stage 2 holds
    # an MoE layer; the tied weight is on stages 0 and 3, both DDP
    "P4 x EP2, MoE only on the middle stage 2": dict(
        world=8, P=4, EP=2, depth=2, partition=[1, 1, 1, 1], moe_stages=[2], M=4, batch=8),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", MIXES)
def test_deep_mixed_stage_reductions_equal_one_process(name, tmp_path):
    _check_mix(MIXES[name], tmp_path)


# -- integer stage boundaries (token ids for the next stage's Embedding) x data parallel -------

class Bucketize(nn.Module):
    """Features -> 4 token ids in [0, 4): no gradient flows through."""

    def forward(self, x):
        return (x.sigmoid() * 3.999).long()[:, :4]


def _ids_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), Bucketize(), nn.Embedding(4, 8), nn.Flatten(),
                         nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 5)).double()


IDS_BATCH = 8


def _ids_batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(IDS_BATCH, 6, generator=g, dtype=torch.float64),
             torch.randint(0, 5, (IDS_BATCH,), generator=g)) for _ in range(STEPS + 1)]


def _ids_one_process():
    model = _ids_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    *train, (xe, ye) = _ids_batches()
    norms = []
    for x, y in train:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
    assert norms[0] > CLIP
    with torch.no_grad():
        out = model(xe)
    return ({k: v.detach().clone() for k, v in model.state_dict().items()}, norms, out,
            nn.functional.cross_entropy(out, ye).item())


def _ids_worker(rank, world, port, extra, schedule):
    config = {"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2, "PIPELINE_SCHEDULE": schedule,
              "clip_grad_norm": CLIP, **extra}
    nc.launch(config, rank=rank, world_size=world, host="127.0.0.1", port=port, timeout=30)
    model = build_pipeline_model(_ids_model(), partition=[2, 5])
    per = IDS_BATCH // gpc.data_size
    mine = slice(gpc.data_rank * per, (gpc.data_rank + 1) * per)
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               nn.functional.cross_entropy, verbose=False)
    *train, (xe, ye) = _ids_batches()
    norms = []
    for x, y in train:
        engine.zero_grad()
        engine.execute_schedule((x[mine], y[mine]))
        assert engine.step()
        norms.append(engine.last_grad_norm)
    engine.eval()
    out, _, loss = engine.execute_schedule((xe[mine], ye[mine]), forward_only=True)
    state = {k: v.detach().clone() for k, v in strip_prefixes(model.state_dict()).items()}
    return dict(state=state, norms=norms, out=out, loss=all_reduce_mean(loss.item()),
                data_rank=gpc.data_rank, stage=gpc.pipeline_rank)


IDS_LAYOUTS = {
    "data 2 x ZeRO 1, 1F1B": ({"zero": dict(level=1)}, "1f1b"),
    "data 2 x ZeRO 2, GPipe": ({"zero": dict(level=2)}, "gpipe"),
    "data 2 x gradient_handler, 1F1B": (
        {"gradient_handler": [dict(type="DataParallelGradientHandler")]}, "1f1b"),
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", IDS_LAYOUTS)
def test_deep_integer_boundary_x_data_parallel_trains_and_evaluates_as_one_process(name):
    expected, norms, out, loss = _ids_one_process()
    runs = run_ranks(_ids_worker, 4, *IDS_LAYOUTS[name], timeout=60)
    per = IDS_BATCH // 2
    for rank, run in enumerate(runs):
        assert run["norms"] == pytest.approx(norms, rel=1e-10), f"rank {rank}"
        assert run["state"]
        for key, value in run["state"].items():
            assert_close(value, expected[key], rtol=1e-12, atol=1e-12,
                         msg=lambda m, key=key: f"rank {rank} {key}: {m}")
        assert run["loss"] == pytest.approx(loss, rel=1e-6), f"rank {rank} eval loss"
        if run["stage"] == 1:
            d = run["data_rank"]
            assert_close(run["out"], out[d * per:(d + 1) * per], rtol=1e-12, atol=1e-12)



# -- AMP O2 bf16 x MoE / no-MoE stages: an overflow on one rank of one stage skips everywhere --

BF16 = {"fp16": dict(mode="naive", dtype="bfloat16")}


def _masters(engine):
    name_of = {id(p): n for n, p in strip_prefixes(dict(engine.model.named_parameters())).items()}
    return {name_of[id(p)]: m.detach().clone() for p, m in engine.optimizer.master_pairs()}


def _inf_hook(param):
    return param.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))


def _amp_reference(rank, world, port, skip):
    """One process under the same AMP: 2 accumulated micro-batches = the pipeline's 2."""
    config = {"gradient_accumulation": 2, "clip_grad_norm": CLIP, "MOE_AUX_WEIGHT": AUX, **BF16}
    nc.launch(config, rank=rank, world_size=world, host="127.0.0.1", port=port)
    model = _mix_model()
    engine, *_ = nc.initialize(model, _mix_optimizer(model), _loss, verbose=False)
    took = []
    for step, (x, y) in enumerate(_mix_batches()):
        hook = _inf_hook(model[4].mlp.experts.parameters().__next__()) if step == skip else None
        for xm, ym in zip(_mix_micro_batches(x, 2, 2), _mix_micro_batches(y, 2, 2)):
            engine.zero_grad()
            engine.backward(engine.criterion(engine(xm), ym))
            stepped = engine.step()
        took.append(stepped)
        if hook is not None:
            hook.remove()
    return took, _masters(engine)


def _amp_worker(rank, world, port, partition, inject_rank):
    config = {"parallel": {"pipeline": 2, "moe": {"size": 2}}, "clip_grad_norm": CLIP,
              "MOE_AUX_WEIGHT": AUX, "NUM_MICRO_BATCHES": 2, **BF16}
    nc.launch(config, rank=rank, world_size=world, host="127.0.0.1", port=port, timeout=40)
    model = build_pipeline_model(_mix_model(), partition=partition)
    engine, *_ = nc.initialize(model, _mix_optimizer(model), _loss, verbose=False)
    mine = slice(gpc.data_rank * 2, gpc.data_rank * 2 + 2)
    took, norms = [], []
    for step, (x, y) in enumerate(_mix_batches()):
        engine.zero_grad()
        hook = None
        if step == 1 and rank == inject_rank:  # an expert of this rank only
            hook = _inf_hook(next(moe_layers(model)[0].experts.parameters()))
        engine.execute_schedule((x[mine], y[mine]))
        took.append(engine.step())
        norms.append(engine.last_grad_norm)
        if hook is not None:
            hook.remove()
    return took, norms, _masters(engine), len(moe_layers(model)) > 0


def _distance(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in b)


@pytest.mark.timeout(90)
def test_deep_amp_bf16_overflow_in_one_expert_of_one_stage_skips_on_every_stage():
    """Stage 0 (no MoE: DDP, the tied embedding) and stage 1 (the MoE handler); an inf in one
    expert's gradient on global rank 3 only (stage 1, data rank 1) at step 1: every rank skips
    step 1 and the masters track one process's bf16 run with the same skip, much closer than
    to the run without a skip."""
    took_ref, ref = run_ranks(_amp_reference, 1, 1, timeout=60)[0]
    _, ref_noskip = run_ranks(_amp_reference, 1, -1, timeout=60)[0]
    assert took_ref == [True, False, True]
    runs = run_ranks(_amp_worker, 4, [2, 4], 3, timeout=60)
    assert [r[3] for r in runs] == [False, True, False, True]
    gap = _distance(ref_noskip, ref)
    for rank, (took, norms, masters, _) in enumerate(runs):
        assert took == [True, False, True], f"rank {rank}: {took}"
        assert norms[1] == float("inf")
        # the head's copy of the tied weight is the embedding's in one process
        off = {k: ref[k if k in ref else "0.tok.weight"] for k in masters}
        assert "5.classifier.weight" not in ref
        assert _distance(masters, off) < gap / 10, (rank, _distance(masters, off), gap)


def _error_worker(rank, world, port, config):
    try:
        nc.launch(config, rank=rank, world_size=world, host="127.0.0.1", port=port, timeout=5)
        model = build_pipeline_model(_ids_model(), partition=[2, 5])
        engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   nn.functional.cross_entropy, verbose=False)
        x, y = _ids_batches()[0]
        engine.execute_schedule((x, y))
    except Exception as e:  # noqa: BLE001 -- returned: the peer stops at once
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    return "ok"


@pytest.mark.timeout(60)
def test_gloo_refused_combinations_say_what_and_where():
    """An integer boundary with TENSOR_SHAPE (which fixes float32 activations): the stage that
    sends the ids stops with an error naming its rank, the peer and both dtypes. ZeRO with
    expert parallelism: refused by name at launch."""
    msgs = run_ranks(_error_worker, 2, {"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2,
                                        "TENSOR_SHAPE": [4, 4]}, timeout=30)
    assert msgs[0].startswith("RuntimeError: [rank 0]"), msgs[0]
    for word in ("rank 1", "torch.int64", "torch.float32", "remove TENSOR_SHAPE"):
        assert word in msgs[0], (word, msgs[0])
    assert msgs[1].startswith("RuntimeError: [rank 1]") and "rank(s) [0]" in msgs[1], msgs[1]
    config = {"parallel": {"pipeline": 2, "moe": {"size": 2}}, "zero": dict(level=1),
              "NUM_MICRO_BATCHES": 2}
    for msg in run_ranks(_error_worker, 4, config, timeout=30):
        assert "parallel.moe" in msg and "zero" in msg and "remove one of them" in msg, msg
