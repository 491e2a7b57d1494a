"""Vocabulary-parallel embedding, classifier and cross-entropy (1d and 2d) equal the plain layers
on the whole vocabulary: outputs, every reduction of the loss, the gradients of a tied table, and
the predicted classes (AccuracyHook's) of split logits."""
import pytest
import torch
from dist_helpers import run_ranks
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.tensor.base import gather_slices, slice_of
from nanocolossal.tensor.vocab_parallel import (
    VocabParallelClassifier1D,
    VocabParallelCrossEntropyLoss1D,
    VocabParallelEmbedding1D,
)
from nanocolossal.tensor.vocab_parallel_2d import (
    VocabParallelClassifier2D,
    VocabParallelCrossEntropyLoss2D,
    VocabParallelEmbedding2D,
)

# per mode: the layers, and how each tensor is cut (weights; activations [B, S, .]; logits;
# per-token losses [B, S]; the classifier's bias)
LAYOUTS = {
    "1d": ((VocabParallelEmbedding1D, VocabParallelClassifier1D, VocabParallelCrossEntropyLoss1D),
           [(0, "tensor")], [], [(-1, "tensor")], [], [(0, "tensor")]),
    "2d": ((VocabParallelEmbedding2D, VocabParallelClassifier2D, VocabParallelCrossEntropyLoss2D),
           [(0, "row"), (1, "col")], [(0, "row"), (2, "col")], [(0, "row"), (2, "col")],
           [(0, "row")], [(0, "col")]),
}

pytestmark = pytest.mark.timeout(120)
V, D, B, S = 16, 8, 4, 5


def _lesson_worker(rank, world_size, port, xs, ys):
    nc.launch(dict(parallel=dict(tensor=dict(size=2, mode="1d"))), rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    torch.manual_seed(0)  # the reference's definition: each rank keeps 8 of the 16 table rows
    table = col_nn.Embedding(16, 8, vocab_parallel=True)
    model = nn.Sequential(table, col_nn.LayerNorm(8),
                          col_nn.Classifier(8, 16, bias=False, weight=table.weight)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    engine, *_ = nc.initialize(model, optimizer, col_nn.VocabParallelCrossEntropyLoss(),
                               verbose=False)
    for x, y in zip(xs, ys):  # the loss from the split logits, never gathered
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))
        engine.step()
    return {name: gather_slices(p.detach(), getattr(p, "tensor_splits", []))  # gather my rows
            for name, p in engine.model.named_parameters()}


def test_gloo_a_vocab_parallel_tied_table_on_two_ranks_equals_one_process():
    """An embedding table split by vocabulary, tied to the classifier, with the loss computed on
    split logits: 2 tensor ranks train as one process with the whole table."""
    torch.manual_seed(0)
    table = col_nn.Embedding(16, 8, vocab_parallel=True)
    model = nn.Sequential(table, col_nn.LayerNorm(8),
                          col_nn.Classifier(8, 16, bias=False, weight=table.weight)).double()
    xs, ys = torch.randint(0, 16, (3, 2, 5)), torch.randint(0, 16, (3, 2, 5))  # 3 batches of ids
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for x, y in zip(xs, ys):
        optimizer.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        optimizer.step()
    expected = {name: p.detach() for name, p in model.named_parameters()}
    for rank, params in enumerate(run_ranks(_lesson_worker, 2, xs, ys)):
        assert_close(params, expected, msg=lambda m: f"rank {rank}: {m}")

LOSSES = [  # keyword arguments of F.cross_entropy / the vocab-parallel loss
    {}, {"reduction": "sum"}, {"reduction": "none"}, {"ignore_index": 3},
    {"weight": torch.linspace(0.5, 2.0, V)}, {"weight": torch.linspace(0.5, 2.0, V),
                                               "ignore_index": 3, "reduction": "sum"},
]


def _data():
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, V, (B, S), generator=g)
    target = torch.randint(0, V, (B, S), generator=g)
    target[0, :3] = 3  # several ignored tokens where ignore_index=3
    return ids, target


def _worker(rank, world_size, port, mode):
    nc.launch({"parallel": {"tensor": {"size": world_size, "mode": mode}}}, rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    (Embedding, Classifier, Loss), weights, hidden, logit_cut, loss_cut, bias = LAYOUTS[mode]
    ids, target = _data()
    torch.manual_seed(0)
    plain_emb, plain_cls = nn.Embedding(V, D), nn.Linear(D, V)
    torch.manual_seed(0)
    emb, cls = Embedding(V, D), Classifier(D, V)
    tied = Classifier(D, V, bias=False, weight=emb.weight)
    assert torch.equal(emb.weight, slice_of(plain_emb.weight.detach(), weights))
    assert torch.equal(cls.weight, slice_of(plain_cls.weight.detach(), weights))
    for kwargs in LOSSES:
        for layer in (emb, cls, tied, plain_emb, plain_cls):
            layer.zero_grad()
        h, plain_h = emb(ids), plain_emb(ids)
        assert_close(h, slice_of(plain_h, hidden))
        logits = cls(h) + tied(h)  # an untied and a tied head, as a model could have both
        plain_logits = plain_cls(plain_h) + F.linear(plain_h, plain_emb.weight)
        assert_close(logits, slice_of(plain_logits, logit_cut))
        loss = Loss(**kwargs)(logits, target)
        plain_loss = F.cross_entropy(plain_logits.reshape(-1, V), target.reshape(-1), **kwargs)
        if kwargs.get("reduction") == "none":  # per token, [B, S] as the target: this rank's
            plain_loss = slice_of(plain_loss.reshape(target.shape), loss_cut)
        assert_close(loss, plain_loss, msg=lambda m: f"{kwargs}: {m}")
        upstream = torch.arange(1.0, loss.numel() + 1).reshape(loss.shape)  # 'none': any dloss
        (loss * upstream).sum().backward()
        if kwargs.get("reduction") == "none":  # the other ranks' tokens' upstream gradients too
            upstream = torch.arange(1.0, target.numel() + 1).reshape(target.shape)
            plain_loss = F.cross_entropy(plain_logits.reshape(-1, V), target.reshape(-1),
                                         **kwargs).reshape(target.shape)
            upstream = upstream if mode == "1d" else _all_upstreams(upstream)
        (plain_loss * upstream).sum().backward()
        for mine, plain, splits in ((emb.weight, plain_emb.weight, weights),
                                    (cls.weight, plain_cls.weight, weights),
                                    (cls.bias, plain_cls.bias, bias)):
            assert_close(mine.grad, slice_of(plain.grad, splits), msg=lambda m: f"{kwargs}: {m}")
    # predictions from split logits: the whole vocabulary's argmax, ties to the lowest id (the
    # first maximum, as torch.argmax) even across ranks; float64 logits are not rounded
    ties = plain_logits.detach().double().round(decimals=0)
    ties[0, 0] = 1e-12 * torch.arange(V, dtype=torch.float64)  # the last id wins by a hair
    rows = slice_of(ties.argmax(-1), loss_cut)  # this rank's rows: [B, S], or its batch block
    assert_close(cls.predictions(slice_of(ties, logit_cut)), rows, rtol=0, atol=0)
    assert (ties.max(-1, keepdim=True).values == ties).sum(-1).max() > 1, "some rows tie"
    return (logits.numel(), plain_logits.numel())


def _all_upstreams(upstream):
    """Each grid row's block numbered 1.. as that row's ranks number their own tokens."""
    blocks = upstream.chunk(nc.gpc.summa_dim)
    return torch.cat([torch.arange(1.0, b.numel() + 1).reshape(b.shape) for b in blocks])


@pytest.mark.parametrize("mode, world_size", [("1d", 2), ("1d", 4), ("2d", 4)])
def test_deep_vocab_parallel_layers_equal_the_plain_layers(mode, world_size):
    for mine, whole in run_ranks(_worker, world_size, mode):
        assert mine * world_size == whole, "each rank holds 1/T of the logits"


def _errors_worker(rank, world_size, port):
    nc.launch({"parallel": {"tensor": {"size": world_size, "mode": "1d"}}}, rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    errors = []
    for build in (lambda: VocabParallelEmbedding1D(15, D),
                  lambda: VocabParallelCrossEntropyLoss1D(label_smoothing=0.1),
                  lambda: VocabParallelClassifier1D(D, V, weight=nn.Parameter(torch.ones(V, D)))):
        try:
            build()
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_deep_vocab_parallel_bad_inputs_are_clear_errors():
    for rank, (size, smoothing, tie) in enumerate(run_ranks(_errors_worker, 2)):
        assert size.startswith(f"[rank {rank}] vocabulary size 15 is not divisible by 2")
        assert "label_smoothing is not supported" in smoothing
        assert "ties only to a weight split by vocabulary rows" in tie


def _tied_worker(rank, world_size, port, mode, vocab_parallel):
    """nc.nn.Classifier(weight=embedding.weight): one table, used twice, in every mode."""
    config = {"parallel": {"tensor": {"size": world_size, "mode": mode}}} if mode else {}
    nc.launch(config, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    ids, target = _data()
    torch.manual_seed(0)
    emb = col_nn.Embedding(V, D, vocab_parallel=vocab_parallel)
    head = col_nn.Classifier(D, V, weight=emb.weight)
    logits = head(emb(ids))
    if vocab_parallel:  # logits split by vocabulary: [B, S, V/T] and the whole [B, S] targets
        loss = col_nn.VocabParallelCrossEntropyLoss()(logits, target)
    else:  # whole logits on every rank
        loss = col_nn.CrossEntropyLoss()(logits.reshape(-1, V), target.reshape(-1))
    loss.backward()
    torch.manual_seed(0)
    plain_emb, plain_head = nn.Embedding(V, D), nn.Linear(D, V)  # the draws every layout makes
    plain_loss = F.cross_entropy(F.linear(plain_emb(ids), plain_emb.weight, plain_head.bias)
                                 .reshape(-1, V), target.reshape(-1))
    plain_loss.backward()
    assert head.weight is emb.weight
    assert_close(loss, plain_loss)
    splits = getattr(emb.weight, "tensor_splits", [])
    assert_close(emb.weight.grad, slice_of(plain_emb.weight.grad, splits))
    return type(emb).__name__, type(head).__name__


@pytest.mark.parametrize("mode, world_size, vocab_parallel, names", [
    (None, 1, False, ("Embedding", "TiedLinear")),
    ("1d", 2, False, ("Embedding1D", "Classifier1D")),
    ("1d", 2, True, ("VocabParallelEmbedding1D", "VocabParallelClassifier1D")),
    ("2d", 4, True, ("VocabParallelEmbedding2D", "VocabParallelClassifier2D")),
])
def test_deep_a_classifier_tied_to_the_embedding_trains_as_one_table(mode, world_size,
                                                                     vocab_parallel, names):
    assert run_ranks(_tied_worker, world_size, mode, vocab_parallel)[0] == names


def _edges_worker(rank, world_size, port, mode):
    """Edges a new user reaches: torch's answers for padding_idx=-1, a batch whose every token is
    ignored (NaN loss, zero gradients), ids and targets out of range, a tied table of the wrong
    shape."""
    nc.launch({"parallel": {"tensor": {"size": world_size, "mode": mode}}}, rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    (Embedding, Classifier, Loss), weights, *_ = LAYOUTS[mode]
    ids, target = _data()
    torch.manual_seed(0)
    plain = nn.Embedding(V, D, padding_idx=-1)
    torch.manual_seed(0)
    emb = Embedding(V, D, padding_idx=-1)
    ids[1, :2] = V - 1  # the padding row is looked up
    emb(ids).square().sum().backward()
    plain(ids).square().sum().backward()
    assert_close(emb.weight.grad, slice_of(plain.weight.grad, weights))
    head = Classifier(D, V)
    logits = head(emb(ids))
    loss = Loss(ignore_index=-100)(logits, torch.full_like(target, -100))
    head.zero_grad()
    loss.backward()
    assert loss.isnan() and not head.weight.grad.isnan().any() and not head.weight.grad.any()
    errors = []
    for bad in (lambda: emb(ids + V), lambda: Loss()(head(emb(ids)), target + V),
                lambda: Classifier(D, 2 * V, weight=emb.weight)):
        try:
            bad()
            errors.append("no error")
        except (IndexError, ValueError) as e:
            errors.append(type(e).__name__ + ": " + str(e))
    return errors


@pytest.mark.parametrize("mode, world_size", [("1d", 2), ("2d", 4)])
def test_deep_vocab_parallel_edges_behave_as_torch(mode, world_size):
    for rank, (ids, targets, tied) in enumerate(run_ranks(_edges_worker, world_size, mode)):
        assert ids.startswith(f"IndexError: [rank {rank}] token ids must be in [0, {V})"), ids
        assert targets.startswith(f"IndexError: [rank {rank}] targets must be in [0, {V})")
        assert "the tied weight's slice has shape" in tied, tied


def test_a_tied_classifier_of_the_wrong_shape_is_refused_without_tensor_parallelism():
    table = nn.Embedding(V, D).weight
    with pytest.raises(ValueError, match=r"the tied weight's slice has shape \(16, 8\), but a "
                                         r"classifier of 8 features and 32 classes needs"):
        col_nn.Classifier(D, 2 * V, weight=table)
    assert col_nn.Classifier(D, V, weight=table).weight is table
