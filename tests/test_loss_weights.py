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
from run_records import half_update_mismatches, record_steps
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.checkpoint import strip_prefixes, tensor_splits_of
from nanocolossal.config import AMP_TYPE
from nanocolossal.context import gpc
from nanocolossal.moe import moe_aux_loss
from nanocolossal.pipeline import build_pipeline_model
from nanocolossal.sequence import split_batch
from nanocolossal.tensor.base import slice_of
from nanocolossal.trainer import hooks

sys.path.insert(0, str(ROOT))
from train_gpt import gpt  # noqa: E402

pytestmark = pytest.mark.timeout(240)

VOCAB, SEQ, GLOBAL, STEPS, CLIP, REL = 16, 8, 8, 2, 0.05, 1e-9
WEIGHT = torch.linspace(0.5, 2.0, VOCAB, dtype=torch.float64)  # class weights, where asked


def _lesson_worker(rank, world_size, port, xs, ys):
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    torch.manual_seed(0)  # every rank builds the model the reference builds
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    engine, *_ = nc.initialize(model, optimizer, nn.CrossEntropyLoss(), verbose=False)
    for x, y in zip(xs, ys):
        x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]  # 1 or 4 counted targets
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))  # my mean x my share of the targets
        engine.step()
    return engine.model.state_dict()


def test_gloo_a_mean_over_unevenly_padded_ranks_equals_one_process():
    """Padding (ignore_index) falls unevenly on 2 ranks, 1 and 4 counted targets: each rank's
    mean, weighed by its share of the counted targets, trains as one process's mean over all 5."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    xs, ys = torch.randn(3, 8, 4, dtype=torch.float64), torch.randint(0, 3, (3, 8))  # 3 batches
    ys[:, 1:4] = -100  # padding: samples 1-3 (on rank 0) count for nothing
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for x, y in zip(xs, ys):  # the whole batch in one process: the mean over 5 targets
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    for rank, state in enumerate(run_ranks(_lesson_worker, 2, xs, ys)):
        assert_close(state, model.state_dict(), msg=lambda m: f"rank {rank}: {m}")


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
    layout, diffs = tensor_splits_of(engine.model), {}
    for key, value in strip_prefixes(engine.model.state_dict()).items():
        want = slice_of(expected[key], layout[key])
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
    "2d4": {"parallel": {"tensor": {"size": 4, "mode": "2d"}}},
}
WORLD = {"data2": 2, "data2-handler": 2, "data2-zero2": 2, "data2-zero3": 2, "pipe2-1f1b": 2}


@pytest.mark.parametrize("case", LAYOUTS, ids=LAYOUTS)
def test_deep_padding_spread_unevenly_trains_as_one_process(case):
    _check(case, "uneven", weighted=False)


@pytest.mark.parametrize("case", ["data2-zero2", "pipe2-data2-gpipe", "seq2-data2"])
def test_deep_class_weights_spread_unevenly_train_as_one_process(case):
    _check(case, "uneven", weighted=True)


@pytest.mark.parametrize("case", ["data2", "data2-zero3", "pipe2-1f1b", "seq2-pipe2"])
def test_deep_a_piece_that_counts_nothing_adds_nothing_and_no_nan(case):
    """'empty': on 2 data ranks rank 1 holds only padding (its own mean is NaN); a micro-batch or
    a sequence chunk of nothing but padding likewise."""
    _check(case, "empty", weighted=False)


@pytest.mark.parametrize("case", ["data2", "data2-zero2", "pipe2-1f1b", "seq2-data2"])
def test_deep_a_piece_whose_targets_all_weigh_0_adds_nothing_and_no_nan(case):
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
    """`how`: 'trainer' (Trainer.fit over this rank's batches, a loader initialize never saw: the
    Trainer has the extension read it a group ahead), 'loop' (a loop of one's own over the loader
    nc.initialize returned, closing the epoch's short last group), 'ahead' (such a loop reading
    the loader one batch ahead, as a prefetcher would), 'group-ahead' (a whole group ahead, two
    epochs), 'relabel' (labels ignored after the loader) or 'open' (one that leaves the short last
    group open and begins a second epoch)."""
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port, timeout=60)
    model = _gpt()
    n = GLOBAL // gpc.data_size
    batches = []
    for b in ACCUM:
        x, y = _tokens(*b)
        batches.append((x[gpc.data_rank * n:][:n], y[gpc.data_rank * n:][:n]))
    engine, loader, *_ = nc.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        col_nn.VocabParallelCrossEntropyLoss(), batches, verbose=False)  # (split: mode='sequence')
    if how == "trainer":
        trainer = nc.trainer.Trainer(engine)
        trainer.fit([split_batch(b, gpc.sequence_size, gpc.sequence_rank) for b in batches]
                    if gpc.sequence_size > 1 else batches, epochs=1, hooks=[hooks.LossHook()])
        return _diffs(engine, expected), [trainer.states["metrics"]["train"]["loss"]]
    losses = []
    try:
        for epoch in range(2 if how in ("open", "group-ahead") else 1):
            read = iter(loader)
            ahead = next(read) if how == "ahead" else None
            if how == "group-ahead":  # the epoch read first: the next group before this one trains
                read = iter([*read])
            for i in range(len(loader)):
                batch = ahead if how == "ahead" else next(read)
                if how == "ahead" and i + 1 < len(loader):
                    ahead = next(read)  # the next batch read before this one is trained
                if how == "relabel":
                    batch = (batch[0], batch[1].clone().index_fill_(-1, torch.tensor([0]), -100))
                if i == len(loader) - 1 and how != "open":
                    engine.close_group()  # every epoch ends with a step
                engine.zero_grad()
                _, _, loss = engine.execute_schedule(batch)
                losses.append(nc.metrics.all_reduce_mean(loss.item()))  # each micro-step's mean
                engine.step()
    except RuntimeError as e:
        return str(e)
    return _diffs(engine, expected), losses


ACCUM_LAYOUTS = {"one-process": ({}, 1), "data2": ({}, 2),
                 "data2-zero2": ({"zero": {"level": 2}}, 2),
                 "seq2-data2": ({"parallel": {"tensor": {"size": 2, "mode": "sequence"}}}, 4)}


@pytest.mark.parametrize("how", ["trainer", "loop"])
@pytest.mark.parametrize("case", ACCUM_LAYOUTS, ids=ACCUM_LAYOUTS)
def test_deep_accumulation_with_padding_spread_unevenly_over_micro_steps_as_one_process(case, how):
    """The loader nc.initialize returns reads each group ahead (loss_weights.GroupsAhead), so
    its targets are counted before the group's first backward: a micro-step of 1 real token per
    row weighs as little as it is, in a loop of one's own over that loader as under the Trainer
    (which has any other loader read the same way). Under sequence parallelism the group is read
    from the split loader (this rank's tokens). The loss reported for each micro-step (LossHook:
    their mean) stays that micro-step's mean."""
    expected, _, micro_losses = _one_process(None, False, groups=GROUPS)
    config, world = ACCUM_LAYOUTS[case]
    config = dict(config, gradient_accumulation=ACCUMULATION)
    for rank, (diffs, losses) in enumerate(run_ranks(_accum_worker, world, config, how,
                                                     expected, timeout=120)):
        bad = {k: d for k, d in diffs.items() if not d < REL}
        assert not bad, f"{case} {how} rank {rank}: parameters differ from one process: {bad}"
        want = [sum(micro_losses) / len(ACCUM)] if how == "trainer" else micro_losses
        assert losses == pytest.approx(want, rel=REL), (case, how, rank, losses, want)


@pytest.mark.parametrize("how", ["ahead", "open"])
def test_deep_a_loader_read_into_the_next_group_while_one_is_open_is_a_clear_error(how):
    """The loader hands a group's labels over when it reads the group: read while the engine's
    group is open -- one batch ahead, or after an epoch whose short last group was not closed --
    they would replace the open group's, and its last batches would weigh by another count."""
    for message in run_ranks(_accum_worker, 2, {"gradient_accumulation": 2}, how, None,
                             timeout=60):
        assert "[rank " in message and "engine's group was still open" in message and \
            "engine.close_group() before its last batch" in message, message


@pytest.mark.parametrize("how", ["group-ahead", "relabel"])
def test_deep_a_group_trained_on_other_targets_than_were_read_is_a_clear_error(how):
    """Read a whole group ahead (before the open one's first loss), or labels changed after the
    loader: the group's losses count other targets than were read for it, and it weighed by the
    wrong count -- refused when the next group is read (the counts compared on the device)."""
    for message in run_ranks(_accum_worker, 2, {"gradient_accumulation": 2}, how, None,
                             timeout=60):
        assert "[rank " in message and "weighed by the targets read ahead" in message, message


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
def test_deep_pipeline_evaluation_reports_each_batchs_mean_over_counted_targets(case):
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


# -- counted targets x other features: torch's losses, MoE, AMP, accumulation, evaluation --------
# A mean over counted targets (ignore_index padding, class weights, label smoothing) spread
# unevenly over data ranks, micro-batches, sequence chunks and accumulation steps, always against
# ONE process on the whole batch:
#   * torch's own nn.CrossEntropyLoss (ignore_index + label_smoothing + weight) and nn.NLLLoss on
#     a classifier whose labels hold ignore_index: DDP x SyncBN, the handler, ZeRO 1-3, 4 ranks
#     with a rank of nothing but ignored labels, a pipeline x data (float64, 1e-9);
#   * a plain CrossEntropyLoss subclass (no sequence awareness) under sequence parallelism, and a
#     pipeline whose batch the micro-batch count does not divide (GPT, float64);
#   * gradient accumulation: padding even over micro-steps is exact; uneven is what the docs say
#     (each micro-step's global mean weighs 1 / N), not worse;
#   * MoE (EP 2) with MOE_AUX_WEIGHT 0 and 0.1;
#   * AMP (TORCH bf16, NAIVE fp16 with an overflow on one rank, APEX O2 fp16), against one process
#     under the same AMP settings, to half precision;
#   * evaluation: no all-reduce (uneven batch counts, a short launch timeout) and the unweighted
#     mean, also after the user's own `model.eval()` (engine.model, not engine.eval()), which
#     engine.criterion must see past the DDP wrapper's training flag; the Trainer's LossHook /
#     LastLossHook with max_steps; the Trainer's accumulation, which counts each group's targets
#     ahead (loss_weights.GroupsAhead): exact.

CLASSES = 5
CW = torch.linspace(0.5, 2.0, CLASSES, dtype=torch.float64)  # class weights


def _max_rel(got, want):
    return (got - want).abs().max().item() / (1 + want.abs().max().item())


def _state_diffs(state, expected):
    return {k: _max_rel(v.double(), expected[k].double()) for k, v in state.items()
            if torch.is_tensor(v) and v.is_floating_point()}


# -- a classifier with torch's own losses --------------------------------------------------------

def _mlp(bn=False, log_softmax=False):
    torch.manual_seed(0)
    layers = [nn.Linear(6, 16)] + ([nn.BatchNorm1d(16)] if bn else []) + \
        [nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, CLASSES)]
    if log_softmax:
        layers.append(nn.LogSoftmax(-1))
    return nn.Sequential(*layers).double()


def _cls_criterion(name):
    if name == "ce":  # every keyword at once: padding, smoothing, class weights
        return nn.CrossEntropyLoss(ignore_index=-1, label_smoothing=0.1, weight=CW)
    if name == "smooth":  # no class weights: what a micro-step counts is its number of labels
        return nn.CrossEntropyLoss(ignore_index=-1, label_smoothing=0.1)
    if name == "nll":
        return nn.NLLLoss(ignore_index=-1, weight=CW)
    raise ValueError(name)


# rows whose label is ignored, per micro-step of 8 rows (2 ranks: rows 0-3 | 4-7;
# 4 ranks: 0-1 | 2-3 | 4-5 | 6-7)
IGNORED = {
    "uneven": [[0, 1, 2, 5], [1, 2, 3, 6]],       # 2 ranks: 1 | 3 counted; 4 ranks: 0 | 1 | 1 | 2
    "even-over-steps": [[0, 1, 2, 5], [4, 5, 6, 3]],   # each micro-step counts 4 (1|3, then 3|1)
    "uneven-over-steps": [[0, 1, 2, 4, 5, 6], [3]],    # 2 then 7 counted
}


def _cls_batches(pattern, steps, accum=1):
    """steps x accum micro-steps of 8 rows each."""
    g = torch.Generator().manual_seed(11)
    out = []
    for s in range(steps):
        micro = []
        for k in range(accum):
            x = torch.randn(8, 6, generator=g, dtype=torch.float64)
            y = torch.randint(0, CLASSES, (8,), generator=g)
            y[IGNORED[pattern][(s * accum + k) % 2]] = -1
            micro.append((x, y))
        out.append(micro)
    return out


def _cls_one_process(model_kw, crit, pattern, steps, accum, clip, per_step_mean):
    """One process. per_step_mean=False: the whole accum x 8 rows in one mean (the exact
    answer); True: the mean of each micro-step's own global mean (what the docs promise when
    padding is uneven over micro-steps)."""
    model = _mlp(**model_kw)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    criterion = _cls_criterion(crit)
    losses, norms = [], []
    for micro in _cls_batches(pattern, steps, accum):
        opt.zero_grad()
        if per_step_mean:
            for x, y in micro:
                loss = criterion(model(x), y)
                (loss / accum).backward()
        else:
            x, y = (torch.cat(t) for t in zip(*micro))
            loss = criterion(model(x), y)
            loss.backward()
        losses.append(loss.item())
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), clip).item() if clip else 0)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms, losses


def _cls_worker(rank, world, port, config, model_kw, crit, pattern, steps, accum):
    nc.launch(config, rank=rank, world_size=world, host="127.0.0.1", port=port, timeout=30)
    model = _mlp(**model_kw)
    if gpc.pipeline_size > 1:
        model = build_pipeline_model(model, partition="uniform")
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
                               _cls_criterion(crit), verbose=False)
    n, r = 8 // gpc.data_size, gpc.data_rank
    losses, norms = [], []
    for micro in _cls_batches(pattern, steps, accum):
        took = []
        for x, y in micro:
            engine.zero_grad()
            _, _, loss = engine.execute_schedule((x[r * n:(r + 1) * n], y[r * n:(r + 1) * n]))
            took.append(engine.step())
        assert took == [False] * (accum - 1) + [True]
        norms.append(engine.last_grad_norm or 0)
        losses.append(nc.metrics.all_reduce_mean(loss.item()))
    state = {k: v.detach().clone() for k, v in strip_prefixes(engine.model.state_dict()).items()}
    return state, norms, losses


CLS_LAYOUTS = {  # name: (world, config, model keywords, criterion)
    "ddp2 SyncBN ce": (2, {"sync_bn": True}, {"bn": True}, "ce"),
    "ddp2 SyncBN nll": (2, {"sync_bn": True}, {"bn": True, "log_softmax": True}, "nll"),
    "handler2 SyncBN ce": (2, {"sync_bn": True, "gradient_handler":
                               [{"type": "DataParallelGradientHandler"}]}, {"bn": True}, "ce"),
    "zero1 ce": (2, {"zero": {"level": 1}}, {}, "ce"),
    "zero2 nll": (2, {"zero": {"level": 2}}, {"log_softmax": True}, "nll"),
    "zero3 SyncBN ce": (2, {"zero": {"level": 3}, "sync_bn": True}, {"bn": True}, "ce"),
    "ddp4 (a rank of only ignored labels) ce": (4, {}, {}, "ce"),
    "pipe2 x data2 1f1b nll": (4, {"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2},
                               {"log_softmax": True}, "nll"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", CLS_LAYOUTS)
def test_deep_torch_losses_on_a_classifier_with_ignored_labels_train_as_one_process(name):
    world, extra, model_kw, crit = CLS_LAYOUTS[name]
    clip = 0.05
    expected, norms, losses = _cls_one_process(model_kw, crit, "uneven", 2, 1, clip, False)
    assert min(norms) > clip
    config = dict(extra, clip_grad_norm=clip)
    for rank, (state, got_norms, got_losses) in enumerate(
            run_ranks(_cls_worker, world, config, model_kw, crit, "uneven", 2, 1, timeout=60)):
        bad = {k: d for k, d in _state_diffs(state, expected).items() if not d < REL}
        assert not bad, (name, rank, bad)
        assert got_norms == pytest.approx(norms, rel=REL), (name, rank)
        assert got_losses == pytest.approx(losses, rel=REL), (name, rank, got_losses, losses)


MIX_ACCUM_LAYOUTS = {
    "ddp2": {},
    "handler2": {"gradient_handler": [{"type": "DataParallelGradientHandler"}]},
    "zero2": {"zero": {"level": 2}},
    "zero3": {"zero": {"level": 3}},
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", MIX_ACCUM_LAYOUTS)
@pytest.mark.parametrize("pattern", ["even-over-steps", "uneven-over-steps"])
def test_deep_accumulation_with_padding_is_as_documented(layout, pattern):
    """gradient_accumulation=2 over 2 ranks, padding uneven over the ranks in every micro-step.
    Each micro-step counting the same number of targets: exactly one process on the whole
    16 rows. Micro-steps counting 2 and 7: the documented approximation, each micro-step's
    global mean weighing 1/2 (one process computing exactly that), not anything worse."""
    per_step = pattern == "uneven-over-steps"
    expected, _, _ = _cls_one_process({}, "smooth", pattern, 2, 2, 0, per_step)
    other, _, _ = _cls_one_process({}, "smooth", pattern, 2, 2, 0, not per_step)
    if per_step:  # the approximation really differs from the exact answer here
        assert max(_state_diffs(other, expected).values()) > 1e-3
    config = dict(MIX_ACCUM_LAYOUTS[layout], gradient_accumulation=2)
    for rank, (state, _, _) in enumerate(
            run_ranks(_cls_worker, 2, config, {}, "smooth", pattern, 2, 2, timeout=60)):
        bad = {k: d for k, d in _state_diffs(state, expected).items() if not d < REL}
        assert not bad, (layout, pattern, rank, bad)


# -- a GPT: plain torch losses, sequence, odd micro-batches, MoE ----------------------------------

class FlatCrossEntropy(nn.CrossEntropyLoss):
    """A user's criterion: torch's loss on [..., V] logits, knowing nothing of sequences."""

    def forward(self, logits, target):
        return super().forward(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _mix_gpt(moe=None, dtype=torch.float64):
    torch.manual_seed(0)
    return gpt(vocab=VOCAB, seq_len=SEQ, dim=8, depth=2, heads=2, mlp_ratio=2,
               moe=moe).to(dtype)


MIX_KEEP = {  # tokens kept (counted) per row; the rest of the row is -100
    "uneven": [1, 8, 3, 8, 2, 6, 8, 1],
    "lopsided": [1, 1, 2, 1, 8, 8, 8, 8],   # 2 ranks: 5 | 32 counted
    "odd": [0, 0, 1, 8, 8, 2, 7, 5, 0, 3],  # 10 rows, micro-batches of 4 / 3 / 3
}


def _gpt_batches(pattern, steps):
    out = []
    for step in range(steps):
        rows = len(MIX_KEEP[pattern])
        g = torch.Generator().manual_seed(200 + step)
        t = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
        x, y = t[:, :-1], t[:, 1:].clone()
        for i, k in enumerate(MIX_KEEP[pattern]):
            y[i, k:] = -100
        out.append((x, y))
    return out


def _gpt_criterion(name):
    if name == "flat":
        return FlatCrossEntropy(label_smoothing=0.05)
    return col_nn.VocabParallelCrossEntropyLoss()


MOE = dict(num_experts=2, top_k=2, capacity_factor_train=2.0, capacity_factor_eval=2.0)


def _gpt_one_process(pattern, steps, crit, moe=False, aux=0.0, clip=0.05, groups=None):
    """One process on the whole batch. `groups`: the rows of each micro-batch over all data
    ranks, whose load-balancing losses a pipeline averages (pipeline/moe_aux.py: one process
    running the same micro-batches); the cross entropy stays the whole batch's mean."""
    model = _mix_gpt(MOE if moe else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    smoothing = 0.05 if crit == "flat" else 0.0
    losses, norms = [], []
    for x, y in _gpt_batches(pattern, steps):
        opt.zero_grad()
        parts = [list(range(len(x)))] if groups is None else groups
        logits, balance = [], []
        for rows in parts:
            logits.append(model(x[rows]))
            balance.append(moe_aux_loss(model) * len(rows) / len(x) if aux else 0)
        rows = [r for part in parts for r in part]
        loss = F.cross_entropy(torch.cat(logits).reshape(-1, VOCAB), y[rows].reshape(-1),
                               label_smoothing=smoothing)
        losses.append(loss.item())
        (loss + aux * sum(balance) if aux else loss).backward()
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
    return strip_prefixes(model.state_dict()), norms, losses


def _gpt_worker(rank, world, port, config, pattern, steps, crit, moe=False):
    nc.launch(config, rank=rank, world_size=world, host="127.0.0.1", port=port, timeout=30)
    model = _mix_gpt(MOE if moe else None)
    if gpc.pipeline_size > 1:
        model = build_pipeline_model(model, num_chunks=config.get("NUM_CHUNKS", 1),
                                     partition="uniform")
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               _gpt_criterion(crit), verbose=False)
    losses, norms = [], []
    for x, y in _gpt_batches(pattern, steps):
        n = len(x) // gpc.data_size
        batch = (x[gpc.data_rank * n:][:n], y[gpc.data_rank * n:][:n])
        if gpc.sequence_size > 1:
            batch = split_batch(batch, gpc.sequence_size, gpc.sequence_rank)
        engine.zero_grad()
        _, _, loss = engine.execute_schedule(batch)
        assert engine.step()
        norms.append(engine.last_grad_norm)
        losses.append(nc.metrics.all_reduce_mean(loss.item()))
    state = {k: v.detach().clone() for k, v in strip_prefixes(engine.model.state_dict()).items()}
    return state, norms, losses


GPT_LAYOUTS = {  # name: (world, config, pattern, criterion, moe)
    "flat CE x sequence 2": (2, {"parallel": {"tensor": {"size": 2, "mode": "sequence"}}},
                             "uneven", "flat", False),
    "flat CE x data 2 x sequence 2": (4, {"parallel": {"tensor": {"size": 2,
                                                                   "mode": "sequence"}}},
                                      "uneven", "flat", False),
    "flat CE x 1f1b 3 micro-batches of 10 rows": (2, {"parallel": {"pipeline": 2},
                                                      "NUM_MICRO_BATCHES": 3},
                                                  "odd", "flat", False),
    "vocab CE x interleaved 4 micro-batches of 10 rows": (
        2, {"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 4, "NUM_CHUNKS": 2},
        "odd", "vocab", False),
    "moe ep2, aux 0": (2, {"parallel": {"moe": {"size": 2}}, "MOE_AUX_WEIGHT": 0.0},
                       "lopsided", "vocab", True),
    "moe ep2, aux 0.1": (2, {"parallel": {"moe": {"size": 2}}, "MOE_AUX_WEIGHT": 0.1},
                         "lopsided", "vocab", True),
    "moe ep2 x pipeline 2, aux 0": (4, {"parallel": {"moe": {"size": 2}, "pipeline": 2},
                                        "MOE_AUX_WEIGHT": 0.0, "NUM_MICRO_BATCHES": 2},
                                    "uneven", "vocab", True),
    "moe ep2 x pipeline 2, aux 0.1": (4, {"parallel": {"moe": {"size": 2}, "pipeline": 2},
                                          "MOE_AUX_WEIGHT": 0.1, "NUM_MICRO_BATCHES": 2},
                                      "uneven", "vocab", True),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", GPT_LAYOUTS)
def test_deep_gpt_padding_with_other_features_trains_as_one_process(name):
    world, extra, pattern, crit, moe = GPT_LAYOUTS[name]
    aux = extra.get("MOE_AUX_WEIGHT", 0.0)
    groups = None
    if "pipeline" in name and aux:  # data 2 x 2 micro-batches of 2 rows: rows of micro-batch m
        groups = [[0, 1, 4, 5], [2, 3, 6, 7]]
    expected, norms, losses = _gpt_one_process(pattern, 2, crit, moe, aux, groups=groups)
    config = dict(extra, clip_grad_norm=0.05)
    for rank, (state, got_norms, got_losses) in enumerate(
            run_ranks(_gpt_worker, world, config, pattern, 2, crit, moe, timeout=90)):
        diffs = _state_diffs(state, {k: v for k, v in expected.items()})
        bad = {k: d for k, d in diffs.items() if not d < REL}
        assert not bad, (name, rank, bad)
        assert got_norms == pytest.approx(norms, rel=REL), (name, rank, got_norms, norms)
        if not aux:  # the reported loss is the criterion's (the aux loss rides along)
            assert got_losses == pytest.approx(losses, rel=REL), (name, rank, got_losses, losses)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["1d2-data2", "interleaved-pipe2-data2-zero1"])
def test_deep_class_weights_in_more_layouts(case):
    """test_loss_weights.py's check, class weights in two layouts it leaves out."""
    _check(case, "uneven", weighted=True)


@pytest.mark.timeout(120)
def test_deep_a_micro_batch_of_only_padding_under_interleaving():
    _check("interleaved-pipe2-data2-zero1", "empty", weighted=False)


# -- AMP: the layout against one process under the same settings ---------------------------------

AMP_MODES = {
    "TORCH bf16": (dict(mode=AMP_TYPE.TORCH, dtype="bfloat16"), 2e-2, None),
    "NAIVE fp16, an overflow on rank 1": (dict(mode=AMP_TYPE.NAIVE, dtype="float16",
                                               initial_scale=2.0 ** 8), 5e-3, 1),
    "APEX O2 fp16": (dict(mode=AMP_TYPE.APEX, opt_level="O2", dtype="float16",
                          loss_scale="dynamic"), 5e-3, None),
}


def _amp_worker(rank, world, port, config, inject):
    nc.launch(config, rank=rank, world_size=world, host="127.0.0.1", port=port, timeout=30)
    model = _mix_gpt(dtype=torch.float32)
    before = {k: v.detach().double().clone() for k, v in model.state_dict().items()}
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                               col_nn.VocabParallelCrossEntropyLoss(), verbose=False)
    n = 8 // gpc.data_size
    batches = [(x[gpc.data_rank * n:][:n], y[gpc.data_rank * n:][:n])
               for x, y in _gpt_batches("lopsided", 3)]
    out = record_steps(engine, batches, None if inject is None else (inject, [world - 1]))
    after = strip_prefixes(engine.model.state_dict())
    out["delta"] = {k: v.detach().double() - before[k] for k, v in after.items() if k in before}
    # the model's weights are half under O2: one ulp of them is as close as two runs can be
    out["ulp"] = {k: torch.finfo(v.dtype).eps * v.detach().double().abs().max().item()
                  for k, v in after.items() if k in before}
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", AMP_MODES)
def test_deep_amp_with_padding_spread_unevenly_equals_one_process(mode):
    """Data 2, rank 0 counting 5 tokens and rank 1 32: every parameter's update after 3 steps
    (one skipped for an overflow where injected) is one process's under the same AMP settings,
    to half precision, where the samples' weights (1/2 each instead of 5/37, 32/37) would be
    far off; losses, loss scales and skipped steps too."""
    fp16, tol, inject = AMP_MODES[mode]
    config = dict(fp16=fp16, clip_grad_norm=1.0)
    ref = run_ranks(_amp_worker, 1, config, inject, timeout=60)[0]
    for rank, run in enumerate(run_ranks(_amp_worker, 2, config, inject, timeout=60)):
        assert run["took"] == ref["took"], (rank, run["took"], ref["took"])
        assert run["scales"] == ref["scales"], (rank, run["scales"], ref["scales"])
        assert run["losses"] == pytest.approx(ref["losses"], rel=tol), (rank, run["losses"])
        bad = half_update_mismatches(run, ref, tol)
        assert not bad, (mode, rank, bad)


# -- evaluation: nothing all-reduced, the plain mean ---------------------------------------------

def _mix_eval_worker(rank, world, port, how):
    nc.launch({}, rank=rank, world_size=world, host="127.0.0.1", port=port, timeout=5)
    model = _mlp()
    crit = nn.CrossEntropyLoss(ignore_index=-1)
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), crit,
                               verbose=False)
    # a training step first (it all-reduces counts)
    (x, y), = _cls_batches("uneven", 1)[0]
    engine.zero_grad()
    engine.execute_schedule((x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]))
    engine.step()
    if how == "engine.eval":
        engine.eval()
    elif how == "model.eval":  # the user's own model object (what initialize returned inside)
        engine.model.eval()
    got, want = [], []
    g = torch.Generator().manual_seed(rank)
    for _ in range(3 if rank == 0 else 1):  # uneven: rank 0 has 3 batches, rank 1 one
        x = torch.randn(4, 6, generator=g, dtype=torch.float64)
        y = torch.tensor([0, -1, 2, -1]) if rank else torch.tensor([1, 2, 3, -1])
        with torch.no_grad() if how == "no_grad" else torch.enable_grad():
            output, _, loss = engine.execute_schedule((x, y), forward_only=True)
            got.append(loss.item())
            want.append(crit(engine.model(x), y).item())
    return got, want


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["engine.eval", "no_grad"])
def test_deep_evaluation_on_uneven_batch_counts_all_reduces_nothing(how):
    """Rank 0 evaluates 3 batches, rank 1 one, under a 5 s collective timeout: no rank waits for
    a count, and each loss is its own batch's plain mean."""
    for got, want in run_ranks(_mix_eval_worker, 2, how, timeout=30):
        assert got == pytest.approx(want, rel=1e-12)


def _eval_train_loader_worker(rank, world, port):
    """gradient_accumulation=2: rank 0 evaluates on the training loader initialize returned (it
    reads each group ahead), rank 1 does not, under a 5 s collective timeout."""
    nc.launch({"gradient_accumulation": 2}, rank=rank, world_size=world, host="127.0.0.1",
              port=port, timeout=5)
    model = _mlp()
    crit = nn.CrossEntropyLoss(ignore_index=-1)
    (x, y), = _cls_batches("uneven", 1)[0]
    shares = [(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4])] * 3
    engine, loader, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), crit,
                                       shares, verbose=False)
    engine.eval()
    got, want = [], []
    with torch.no_grad():
        for xs, ys in loader if rank == 0 else []:
            got.append(engine.criterion(engine(xs), ys).item())
            want.append(crit(engine.model(xs), ys).item())
    return got, want


@pytest.mark.timeout(60)
def test_gloo_evaluation_on_the_loader_that_reads_groups_ahead_all_reduces_nothing():
    """A group's targets are counted at its first weighed loss, not when the loader reads it:
    reading initialize's training loader to evaluate (on one rank only) waits for no partner,
    and each loss is its batch's plain mean."""
    got, want = run_ranks(_eval_train_loader_worker, 2, timeout=30)[0]
    assert len(got) == 3 and got == pytest.approx(want, rel=1e-12)


@pytest.mark.timeout(60)
def test_gloo_evaluation_after_the_users_model_eval_all_reduces_nothing():
    """As above, the user switching their own model to eval (engine.model.eval(), the object
    they passed to initialize) and not disabling grad: before loss_weights nothing in this loop
    communicated (DDP syncs buffers, and this MLP has none)."""
    for got, want in run_ranks(_mix_eval_worker, 2, "model.eval", timeout=30):
        assert got == pytest.approx(want, rel=1e-12)


# -- the Trainer: LossHook and LastLossHook report one process's numbers -------------------------

def _token_sets():
    from torch.utils.data import TensorDataset
    g = torch.Generator().manual_seed(3)
    t = torch.randint(0, VOCAB, (16, SEQ + 1), generator=g)
    x, y = t[:, :-1], t[:, 1:].clone()
    keep = [1, 8, 2, 8, 1, 1, 8, 7, 3, 8, 8, 1, 0, 5, 8, 2]
    for i, k in enumerate(keep):
        y[i, k:] = -100
    test = torch.randint(0, VOCAB, (2, 8, SEQ), generator=g)
    return TensorDataset(x, y), TensorDataset(*test)


def _trainer_worker(rank, world, port, config, batch=4, epochs=3, max_steps=7):
    from nanocolossal.trainer import Trainer, hooks
    nc.launch(config, rank=rank, world_size=world, host="127.0.0.1", port=port, timeout=30)
    model = _mix_gpt()
    if gpc.pipeline_size > 1:
        model = build_pipeline_model(model, partition="uniform")
    train_set, test_set = _token_sets()
    train = nc.get_dataloader(train_set, shuffle=True, seed=5, drop_last=True,
                              batch_size=batch // gpc.data_size)
    test = nc.get_dataloader(test_set, batch_size=2, pad=False)
    engine, train, test, _ = nc.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9),
        col_nn.VocabParallelCrossEntropyLoss(), train, test, verbose=False)
    trainer = Trainer(engine)
    last = hooks.LastLossHook()
    trainer.fit(train, epochs, test, hooks=[hooks.LossHook(), last], max_steps=max_steps)
    state = {k: v.detach().clone() for k, v in strip_prefixes(engine.model.state_dict()).items()}
    return dict(metrics=trainer.states["metrics"], last=last.value, state=state,
                step=trainer.cur_step)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world, config", [
    (2, {}),
    (4, {"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2}),
], ids=["data 2", "pipeline 2 x data 2"])
def test_deep_trainer_loss_hooks_with_padding_report_one_process_numbers(world, config):
    """16 padded rows, 4 a step, max_steps=7 (stops in the 2nd epoch): the train loss LossHook
    publishes, LastLossHook's value and the weights are one process's; the test set has no
    padding (evaluation-mode losses are documented as weighed by samples)."""
    config = dict(config, clip_grad_norm=0.5)
    ref = run_ranks(_trainer_worker, 1, dict(config, parallel={}), timeout=60)[0]
    assert ref["step"] == 7
    for run in run_ranks(_trainer_worker, world, config, timeout=60):
        assert run["step"] == 7
        for split in ("train", "test"):
            for key, value in ref["metrics"][split].items():
                assert run["metrics"][split][key] == pytest.approx(value, rel=REL), \
                    (split, key, run["metrics"], ref["metrics"])
        assert run["last"] == pytest.approx(ref["last"], rel=REL)
        bad = {k: d for k, d in _state_diffs(run["state"], ref["state"]).items() if not d < REL}
        assert not bad, bad


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world, config", [
    (2, {}),
    (2, {"zero": {"level": 2}}),
], ids=["data 2", "data 2 x zero 2"])
def test_deep_trainer_accumulation_counts_each_group_ahead(world, config):
    """gradient_accumulation=2 under the Trainer, which reads each group's batches ahead and
    counts their targets (loss_weights.GroupsAhead): padding spread unevenly over micro-steps AND
    ranks trains as one process taking each group's 8 rows as one batch (16 padded rows, 5
    optimizer steps over 3 epochs). The reported loss stays each micro-step's mean (engine.py,
    _weigh), so LossHook's train loss is one process's under the same accumulation -- not the
    group's token mean (here 2.5845 vs 2.5889 for the last epoch)."""
    whole = run_ranks(_trainer_worker, 1, {}, 8, 3, 5, timeout=60)[0]
    accum = {"gradient_accumulation": 2}
    same = run_ranks(_trainer_worker, 1, accum, 4, 3, 5, timeout=60)[0]
    assert whole["step"] == same["step"] == 5
    bad = {k: d for k, d in _state_diffs(same["state"], whole["state"]).items() if not d < REL}
    assert not bad, bad
    for run in run_ranks(_trainer_worker, world, dict(config, **accum), 4, 3, 5, timeout=60):
        assert run["step"] == 5
        bad = {k: d for k, d in _state_diffs(run["state"], whole["state"]).items()
               if not d < REL}
        assert not bad, bad
        assert run["metrics"]["train"]["loss"] == pytest.approx(
            same["metrics"]["train"]["loss"], rel=REL), (run["metrics"], same["metrics"])
