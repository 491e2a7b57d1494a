"""A mean over counted targets (padding = ignore_index, class weights) spread unevenly over the
pieces of a step -- data ranks, pipeline micro-batches, sequence chunks -- trains as ONE process
on the whole batch does (loss_weights.py). Without the weights every layout here is off: each
piece weighed by its samples, a rank of 3 real tokens counted as much as one of 60.

A GPT with a tied, vocab-parallel table, float64, SGD + momentum + clip: parameters, clipped
norms and the reported loss (the mean over data ranks of each rank's loss) to 1e-9.
"""
import sys

import pytest
import torch
from dist_helpers import ROOT, run_ranks
from torch.nn import functional as F

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.checkpoint_merge import strip_prefixes, tensor_layout
from nanocolossal.context import gpc
from nanocolossal.pipeline import build_pipeline_model
from nanocolossal.sequence import split_batch
from nanocolossal.tensor.base import shard
from nanocolossal.trainer import hooks

sys.path.insert(0, str(ROOT))
from train_gpt import gpt  # noqa: E402

pytestmark = pytest.mark.timeout(240)

VOCAB, SEQ, GLOBAL, STEPS, CLIP, REL = 16, 8, 8, 2, 0.05, 1e-9
WEIGHT = torch.linspace(0.5, 2.0, VOCAB, dtype=torch.float64)  # class weights, where asked


def _gpt():
    torch.manual_seed(0)
    return gpt(vocab=VOCAB, seq_len=SEQ, dim=8, depth=2, heads=2, mlp_ratio=2).double()


KEEP = {"uneven": [1, 8, 3, 8, 2, 6, 8, 1], "empty": [8, 5, 2, 7, 0, 0, 0, 0],
        "weightless": [8, 5, 2, 7, 0, 0, 0, 0],
        "sparse": [1, 1, 0, 2, 1, 1, 1, 1], "full": [8, 8, 8, 7, 8, 8, 8, 8]}


def _tokens(step, pattern):
    """Targets of row i ignored (-100) from position KEEP[pattern][i] on: padding spread
    unevenly over rows, so over data ranks, micro-batches and sequence chunks. 'empty': the
    second half of the rows is all padding (a data rank, on 2, counts nothing). 'weightless':
    class 0 (weight 0, see _weight) instead of padding."""
    g = torch.Generator().manual_seed(100 + step)
    t = torch.randint(0, VOCAB, (GLOBAL, SEQ + 1), generator=g)
    x, y = t[:, :-1], t[:, 1:].clone()
    for i, k in enumerate(KEEP[pattern]):
        y[i, k:] = 0 if pattern == "weightless" else -100
    return x, y


def _weight(pattern, weighted):
    """The class weights, if `weighted`; 'weightless' gives class 0 a weight of 0."""
    if not weighted:
        return None
    return WEIGHT * (torch.arange(VOCAB) > 0) if pattern == "weightless" else WEIGHT


def _one_process(pattern, weighted, groups=None):
    """`groups`: the batches (step, pattern) of each step, concatenated (accumulation, its
    short last group weighing k / N of its mean, as the engine does for any criterion)."""
    model = _gpt()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    norms, losses = [], []
    for step in range(STEPS if groups is None else len(groups)):
        parts = [_tokens(step, pattern)] if groups is None else [_tokens(*b) for b in groups[step]]
        x, y = (torch.cat(t) for t in zip(*parts))
        opt.zero_grad()
        logits = model(x)
        loss = _lm_loss(logits, y, _weight(pattern, weighted))
        losses.append(loss.item())
        if groups is None:
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        else:  # no clip: the gradient's size is checked too; a short group weighs k / N
            (loss * len(parts) / ACCUMULATION).backward()
            losses[-1:] = [_lm_loss(model(xp), yp).item() for xp, yp in parts]  # each micro-step's
        opt.step()
    return strip_prefixes(model.state_dict()), norms, losses


def _lm_loss(logits, y, weight=None):
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), weight=weight)


def _worker(rank, world_size, port, config, pattern, weighted, expected):
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port, timeout=60)
    model = _gpt()
    if gpc.pipeline_size > 1:
        model = build_pipeline_model(model, num_chunks=config.get("NUM_CHUNKS", 1),
                                     partition="uniform")
    criterion = col_nn.VocabParallelCrossEntropyLoss(weight=_weight(pattern, weighted))
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               criterion, verbose=False)
    norms, losses = [], []
    n = GLOBAL // gpc.data_size
    for step in range(STEPS):
        x, y = _tokens(step, pattern)
        batch = (x[gpc.data_rank * n:][:n], y[gpc.data_rank * n:][:n])
        if gpc.sequence_size > 1:
            batch = split_batch(batch, gpc.sequence_size, gpc.sequence_rank)
        engine.zero_grad()
        _, _, loss = engine.execute_schedule(batch)
        engine.step()
        norms.append(engine.last_grad_norm)
        losses.append(nc.metrics.all_reduce_mean(loss.item()))
    return _diffs(engine, expected), norms, losses


def _diffs(engine, expected):
    """This rank's parameters against its slice of one process's, relative."""
    layout, diffs = tensor_layout(engine.model), {}
    for key, value in strip_prefixes(engine.model.state_dict()).items():
        want = shard(expected[key], layout[key])
        diffs[key] = (value - want).abs().max().item() / (1 + want.abs().max().item())
    return diffs


LAYOUTS = {
    "data2": {},
    "data4": {},
    "data2-handler": {"gradient_handler": [{"type": "DataParallelGradientHandler"}]},
    "data2-zero2": {"zero": {"level": 2}},
    "data2-zero3": {"zero": {"level": 3}},
    "pipe2-1f1b": {"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 4},
    "pipe2-data2-gpipe": {"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2,
                          "PIPELINE_SCHEDULE": "gpipe"},
    "interleaved-pipe2-data2-zero1": {"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2,
                                      "NUM_CHUNKS": 2, "zero": {"level": 1}},
    "seq2-data2": {"parallel": {"tensor": {"size": 2, "mode": "sequence"}}},
    "seq2-pipe2": {"parallel": {"pipeline": 2, "tensor": {"size": 2, "mode": "sequence"}},
                   "NUM_MICRO_BATCHES": 2},
    "1d2-data2": {"parallel": {"tensor": {"size": 2, "mode": "1d"}}},
    "2d4-data2-zero1": {"parallel": {"tensor": {"size": 4, "mode": "2d"}}, "zero": {"level": 1}},
}
WORLD = {"data2": 2, "data2-handler": 2, "data2-zero2": 2, "data2-zero3": 2, "pipe2-1f1b": 2,
         "2d4-data2-zero1": 8}


@pytest.mark.parametrize("case", LAYOUTS, ids=LAYOUTS)
def test_gloo_padding_spread_unevenly_trains_as_one_process(case):
    _check(case, "uneven", weighted=False)


@pytest.mark.parametrize("case", ["data2-zero2", "pipe2-data2-gpipe", "seq2-data2"])
def test_gloo_class_weights_spread_unevenly_train_as_one_process(case):
    _check(case, "uneven", weighted=True)


@pytest.mark.parametrize("case", ["data2", "data2-zero3", "pipe2-1f1b", "seq2-pipe2"])
def test_gloo_a_piece_that_counts_nothing_adds_nothing_and_no_nan(case):
    """'empty': on 2 data ranks rank 1 holds only padding (its own mean is NaN); a micro-batch or
    a sequence chunk of nothing but padding likewise."""
    _check(case, "empty", weighted=False)


@pytest.mark.parametrize("case", ["data2", "data2-zero2", "pipe2-1f1b", "seq2-data2"])
def test_gloo_a_piece_whose_targets_all_weigh_0_adds_nothing_and_no_nan(case):
    """Every target of rank 1 (of a micro-batch, of a sequence group) has class weight 0: its
    mean is 0 / 0 and so is the backward of torch's mean, NaN in every gradient, which the
    average over ranks would spread to every replica. One process stays finite."""
    _check(case, "weightless", weighted=True)


def _check(case, pattern, weighted):
    expected, norms, losses = _one_process(pattern, weighted)
    assert min(norms) > CLIP, "the clip really clips"
    config = dict(LAYOUTS[case], clip_grad_norm=CLIP)
    for rank, (diffs, got_norms, got_losses) in enumerate(
            run_ranks(_worker, WORLD.get(case, 4), config, pattern, weighted, expected,
                      timeout=180)):
        bad = {k: d for k, d in diffs.items() if not d < REL}
        assert not bad, f"{case} rank {rank}: parameters differ from one process: {bad}"
        assert got_norms == pytest.approx(norms, rel=REL), (case, rank, got_norms, norms)
        assert got_losses == pytest.approx(losses, rel=REL), (case, rank, got_losses, losses)


# -- gradient accumulation: the groups' labels counted ahead -------------------------------------

ACCUMULATION = 2
ACCUM = [(0, "uneven"), (1, "sparse"), (2, "full")]  # 3 batches a rank per epoch, N = 2: a group
GROUPS = [ACCUM[:2], ACCUM[2:]]  # of two, then the epoch's last group, of one (closed early)


def _accum_worker(rank, world_size, port, config, how, expected):
    """`how`: 'trainer' (Trainer.fit reads each group ahead), 'count' (a loop of one's own that
    calls engine.count_targets before each group), 'mid-group' (calls it inside a group) or
    'too-many' (with 3 labels for a group of 2)."""
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port, timeout=60)
    model = _gpt()
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               col_nn.VocabParallelCrossEntropyLoss(), verbose=False)
    n = GLOBAL // gpc.data_size
    loader = []
    for b in ACCUM:
        x, y = _tokens(*b)
        batch = (x[gpc.data_rank * n:][:n], y[gpc.data_rank * n:][:n])
        loader.append(split_batch(batch, gpc.sequence_size, gpc.sequence_rank)
                      if gpc.sequence_size > 1 else batch)
    if how == "trainer":
        trainer = nc.trainer.Trainer(engine)
        trainer.fit(loader, epochs=1, hooks=[hooks.LossHook()])
        losses = [trainer.states["metrics"]["train"]["loss"]]
    else:
        losses = []
        for i, batch in enumerate(loader):
            if i in (0, 2) or how != "count":
                try:
                    engine.count_targets([b[1] for b in (loader if how == "too-many" else
                                                         loader[i:i + 2 - i // 2])])
                except RuntimeError as e:
                    return str(e)
            if i == 2:
                engine.close_group()
            engine.zero_grad()
            _, _, loss = engine.execute_schedule(batch)
            losses.append(nc.metrics.all_reduce_mean(loss.item()))  # each micro-step's mean
            engine.step()
    return _diffs(engine, expected), losses


ACCUM_LAYOUTS = {"one-process": ({}, 1), "data2": ({}, 2),
                 "data2-zero2": ({"zero": {"level": 2}}, 2),
                 "seq2-data2": ({"parallel": {"tensor": {"size": 2, "mode": "sequence"}}}, 4)}


@pytest.mark.parametrize("how", ["trainer", "count"])
@pytest.mark.parametrize("case", ACCUM_LAYOUTS, ids=ACCUM_LAYOUTS)
def test_gloo_accumulation_with_padding_spread_unevenly_over_micro_steps_as_one_process(case, how):
    """The Trainer (or engine.count_targets) counts a group's targets before its first backward:
    a micro-step of 1 real token per row weighs as little as it is. The loss reported for each
    micro-step (LossHook: their mean) stays that micro-step's mean."""
    expected, _, micro_losses = _one_process(None, False, groups=GROUPS)
    config, world = ACCUM_LAYOUTS[case]
    config = dict(config, gradient_accumulation=ACCUMULATION)
    for rank, (diffs, losses) in enumerate(run_ranks(_accum_worker, world, config, how,
                                                     expected, timeout=120)):
        bad = {k: d for k, d in diffs.items() if not d < REL}
        assert not bad, f"{case} {how} rank {rank}: parameters differ from one process: {bad}"
        want = [sum(micro_losses) / len(ACCUM)] if how == "trainer" else micro_losses
        assert losses == pytest.approx(want, rel=REL), (case, how, rank, losses, want)


@pytest.mark.parametrize("how", ["mid-group", "too-many"])
def test_gloo_count_targets_inside_a_group_or_for_more_than_one_is_a_clear_error(how):
    for message in run_ranks(_accum_worker, 2, {"gradient_accumulation": 2}, how, None,
                             timeout=60):
        assert "[rank " in message and "one whole group" in message and \
            "before the group's first backward" in message, message


# -- evaluating a pipeline: each batch's loss is its mean over counted targets -------------------

def _eval_worker(rank, world_size, port, config):
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port, timeout=60)
    model = build_pipeline_model(_gpt(), num_chunks=config.get("NUM_CHUNKS", 1),
                                 partition="uniform")
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               col_nn.VocabParallelCrossEntropyLoss(), verbose=False)
    engine.eval()
    n = GLOBAL // gpc.data_size
    x, y = _tokens(0, "uneven")
    batch = (x[gpc.data_rank * n:][:n], y[gpc.data_rank * n:][:n])
    if gpc.sequence_size > 1:
        batch = split_batch(batch, gpc.sequence_size, gpc.sequence_rank)
    with torch.no_grad():
        _, _, loss = engine.execute_schedule(batch, forward_only=True)
    return nc.metrics.all_reduce_mean(loss.item())  # (a sequence rank's is its share x N)


@pytest.mark.parametrize("case", ["pipe2-1f1b", "pipe2-data2-gpipe", "seq2-pipe2"])
def test_gloo_pipeline_evaluation_reports_each_batchs_mean_over_counted_targets(case):
    """forward_only: micro-batch m weighs W_m / W of this rank's batch (no collective over data
    ranks, which may run different numbers of batches when evaluating): the loss is one
    process's on that batch, not a mean of micro-batch means."""
    x, y = _tokens(0, "uneven")
    model, replicas = _gpt(), 2 if "data2" in case else 1
    n = GLOBAL // replicas
    with torch.no_grad():
        want = [_lm_loss(model(x[lo:lo + n]), y[lo:lo + n]).item() for lo in range(0, GLOBAL, n)]
    for rank, loss in enumerate(run_ranks(_eval_worker, WORLD.get(case, 4), LAYOUTS[case],
                                          timeout=120)):
        assert loss == pytest.approx(sum(want) / len(want), rel=REL), (case, rank, loss, want)
