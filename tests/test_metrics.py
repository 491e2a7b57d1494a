import pytest
import torch
from dist_helpers import run_ranks
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.context import gpc
from nanocolossal.metrics import Accuracy, all_reduce_mean
from nanocolossal.pipeline import build_pipeline_model
from nanocolossal.trainer import Trainer, hooks

pytestmark = pytest.mark.timeout(120)

# 5 samples whose per-rank accuracies (pad=False shards [0, 2, 4] and [1, 3]) are 3/3 and 1/2:
# the exact answer is 4/5 = 0.8, while averaging the two ratios would give 0.75.
LOGITS = torch.tensor([[2.0, 0.0], [0.0, 2.0], [0.0, 2.0], [0.0, 2.0], [2.0, 0.0]])
TARGETS = torch.tensor([0, 0, 1, 1, 0])


def _accuracy_worker(rank, world_size, port):
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    sampler = nc.DistributedSampler(range(5), shuffle=False, pad=False)
    shard = list(sampler)
    accuracy = Accuracy()
    for i in shard:  # one sample at a time, as a loader with batch_size=1 would
        accuracy.update(LOGITS[i:i + 1], TARGETS[i:i + 1])
    return shard, accuracy.compute()


def test_gloo_accuracy_is_exact_over_uneven_shards():
    """Accuracy counts correct samples and samples over the ranks, not an average of per-rank
    ratios: over uneven pad=False shards it equals one process's on the whole set."""
    single = Accuracy()
    single.update(LOGITS, TARGETS)
    expected = single.compute()
    assert expected == 0.8
    out = run_ranks(_accuracy_worker, 2)
    assert [shard for shard, _ in out] == [[0, 2, 4], [1, 3]]
    assert [acc for _, acc in out] == [expected, expected]


def _mean_worker(rank, world_size, port):
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    plain = all_reduce_mean({"loss": float(rank + 1), "acc": torch.tensor(rank * 0.5)})
    scalar = all_reduce_mean(10.0 * (rank + 1))
    # rank 0 averaged 3 samples to 2.0, rank 1 averaged
    # 1 sample to 6.0: whole mean (6 + 6) / 4 = 3.0
    weighted = all_reduce_mean({"loss": [2.0, 6.0][rank]}, weight=[3, 1][rank])
    return plain, scalar, weighted


def test_gloo_all_reduce_mean_plain_and_weighted():
    for plain, scalar, weighted in run_ranks(_mean_worker, 2):
        assert plain == {"loss": 1.5, "acc": 0.25}
        assert scalar == 15.0
        assert weighted == {"loss": 3.0}


def test_metrics_work_in_one_process_without_launch():
    accuracy = Accuracy()
    accuracy.update(torch.tensor([1, 0, 1]), torch.tensor([1, 1, 1]))  # labels instead of logits
    assert accuracy.compute() == pytest.approx(2 / 3)
    accuracy.reset()
    with pytest.raises(ValueError, match="no samples"):
        accuracy.compute()
    assert all_reduce_mean({"a": 2.0}) == {"a": 2.0}


def test_accuracy_shape_mismatch_is_a_clear_error():
    with pytest.raises(ValueError,
                       match=r"\[rank 0\] .*shape \(4,\) do not match targets of shape \(3,\)"):
        Accuracy().update(torch.zeros(4, 10), torch.zeros(3, dtype=torch.long))


# -- evaluation and metrics x layouts: one process each ----------------------------------------
# Each layout runs the same worker as one process (world size 1, the same nanocolossal code): one
# SGD-momentum step on the whole global batch of 8 samples (each data rank its share), then
# `Trainer.evaluate` with LossHook + AccuracyHook over a test set whose size does not divide the
# ranks x batch (`pad=False`: uneven shards and a short last batch). The model has Dropout(0.5),
# so a rank left in training mode would show. Compared with one process:
#     (a) the test loss (float64, 1e-12) and accuracy (exact), on every rank;
#     (b) evaluation moved nothing: parameters, gradients, optimizer state and buffers are
#         bit-identical before and after it, on every rank;
#     (c) the mode the model is left in (as one process: eval).
# And where a layout could differ:
#   * ZeRO 3 with pad=False test shards whose batch counts differ (9 samples, batch 4, 2 ranks:
#     rank 0 runs batches of 4 and 1, rank 1 one of 4) is refused clearly: ZeRO 3 gathers in
#     every forward, so rank 0's parameter all-gather of its extra batch would meet rank 1's
#     metric all-reduce (Trainer.evaluate checks the batch counts first);
#   * Accuracy on vocabulary-parallel logits (nc.nn.Classifier(vocab_parallel=True), or any
#     Classifier over more than VOCAB_PARALLEL_LIMIT classes, under 1d) takes the argmax over all
#     classes, not this rank's slice (that would give accuracy 0.4 where one process has 0.2);
#   * the vocab-parallel cross entropy keeps float64 logits in float64 (a float32 loss is off in
#     the 8th digit);
#   * a pipeline reports (and LossHook logs) the loss of a float64 model in float64, not rounded
#     to float32 by a default-dtype total.

TRAIN = 8  # one global batch of 8: each data rank loads 8 / D


def _data(n, seed, classes=3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    return TensorDataset(x, torch.randint(0, classes, (n,), generator=g))


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Dropout(0.5), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 3)).double()


def _tp_mlp(vocab_parallel=False):
    torch.manual_seed(0)
    col_nn.reset_1d_alternation()
    return nn.Sequential(col_nn.Linear(6, 8), nn.Tanh(), col_nn.Dropout(0.5), col_nn.Linear(8, 8),
                         nn.Tanh(),
                         col_nn.Classifier(8, 4 if vocab_parallel else 3,
                                           vocab_parallel=vocab_parallel)).double()


def _snapshot(engine):
    """Parameters, gradients, optimizer state and buffers of this rank (ZeRO 3: its shards)."""
    out = {}
    for i, p in enumerate(engine.optimizer.param_groups[0]["params"]
                          if hasattr(engine.optimizer, "param_groups") else []):
        out[f"p{i}"] = p.detach().clone()
        out[f"g{i}"] = None if p.grad is None else p.grad.detach().clone()
    modules = engine.model if isinstance(engine.model, nn.ModuleList) else [engine.model]
    for j, module in enumerate(modules):
        for name, p in module.named_parameters():
            out[f"{j}.{name}"] = p.detach().clone()
            out[f"{j}.{name}.grad"] = None if p.grad is None else p.grad.detach().clone()
        for name, b in module.named_buffers():
            out[f"{j}.{name}"] = b.detach().clone()
    _tensors(engine.optimizer.state_dict(), "opt", out)
    assert any(k.startswith("opt") for k in out), "the optimizer has state (momentum)"
    return out


def _tensors(obj, prefix, out):
    if torch.is_tensor(obj):
        out[prefix] = obj.detach().clone()
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _tensors(v, f"{prefix}.{k}", out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _tensors(v, f"{prefix}.{i}", out)


def _same(before, after):
    assert before.keys() == after.keys()
    for k, v in before.items():
        if v is None:
            assert after[k] is None, k
        else:
            # (ZeRO 3's freed parameters share one NaN element)
            assert v.shape == after[k].shape and v.dtype == after[k].dtype, k
            assert torch.equal(v.isnan(), after[k].isnan()), f"evaluation changed {k}"
            assert torch.equal(v.nan_to_num(), after[k].nan_to_num()), f"evaluation changed {k}"


def _eval_worker(rank, world, port, config, model_kind, n_test, batch, launch_timeout=20):
    nc.launch(config, rank=rank, world_size=world, host="127.0.0.1", port=port,
              timeout=launch_timeout)
    vocab_parallel = model_kind == "vocab-parallel"
    model = _mlp() if model_kind == "plain" else _tp_mlp(vocab_parallel)
    if gpc.pipeline_size > 1:
        model = build_pipeline_model(model)
    if vocab_parallel:
        criterion = col_nn.VocabParallelCrossEntropyLoss()
    else:
        criterion = col_nn.CrossEntropyLoss() if model_kind == "tensor" else nn.CrossEntropyLoss()
    classes = 4 if vocab_parallel else 3
    train = nc.get_dataloader(_data(TRAIN, 1, classes), batch_size=TRAIN // gpc.data_size)
    test = nc.get_dataloader(_data(n_test, 2, classes), batch_size=batch, pad=False)
    engine, train, test, _ = nc.initialize(
        model, torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9), criterion, train, test,
        verbose=False)
    engine.train()
    dropouts = [m for m in engine.model.modules() if isinstance(m, nn.Dropout)]
    for m in dropouts:  # the step without dropout (its draws differ by layout), ...
        m.eval()
    for x, y in train:  # one step on the global batch
        engine.zero_grad()
        engine.execute_schedule((x, y))
        engine.step()
    engine.train()  # ... then dropout on again: evaluation must switch it off on every rank
    assert all(m.training for m in dropouts)
    before = _snapshot(engine)
    metrics = Trainer(engine).evaluate(test, hooks=[hooks.LossHook(), hooks.AccuracyHook()])
    _same(before, _snapshot(engine))
    modules = engine.model if isinstance(engine.model, nn.ModuleList) else [engine.model]
    modes = {m.training for module in modules for m in module.modules()}
    return metrics, modes, len(test), len(dropouts)


def _check(results, ref, loss_rtol=1e-12):
    ref_metrics, ref_modes, *_ = ref
    assert ref_modes == {False}
    assert sum(r[3] for r in results) > 0, "some rank holds the dropout"
    for rank, (metrics, modes, *_) in enumerate(results):
        assert metrics["accuracy"] == ref_metrics["accuracy"], (rank, metrics, ref_metrics)
        assert metrics["loss"] == pytest.approx(ref_metrics["loss"], rel=loss_rtol, abs=0), \
            (rank, metrics, ref_metrics)
        assert modes == ref_modes, f"rank {rank}: left in training mode"


# name: (config, world, model kind, test samples, per-rank batch, #batches per rank)
CASES = {
    # 9 over 2: shards 5 / 4, batches 4 + 1 / 4 (uneven counts)
    "ddp x2": ({}, 2, "plain", 9, 4, [2, 1]),
    # 9 over 4: shards 3 / 2 / 2 / 2, batches 2 + 1 / 2 / 2 / 2
    "ddp x4": ({}, 4, "plain", 9, 2, [2, 1, 1, 1]),
    "handler x2": ({"gradient_handler": [dict(type="DataParallelGradientHandler")]}, 2, "plain",
                   9, 4, [2, 1]),
    "zero1 x2": ({"zero": {"level": 1}}, 2, "plain", 9, 4, [2, 1]),
    "zero2 x2": ({"zero": {"level": 2}}, 2, "plain", 9, 4, [2, 1]),
    # ZeRO 3 gathers in every forward: equal counts, the last batches 2 / 1
    "zero3 x2": ({"zero": {"level": 3}}, 2, "plain", 7, 2, [2, 2]),
    # 1F1B, 2 micro-batches: batches 4, 4, 2 (micro-batches 2 + 2, 2 + 2, 1 + 1)
    "pipeline 2": ({"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2}, 2, "plain", 10, 4,
                   [3, 3]),
    # 13 over 2 data ranks: 7 / 6, batches 4 + 3 / 4 + 2 (3 = micro-batches 2 + 1)
    "pipeline 2 x data 2": ({"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2}, 4, "plain",
                            13, 4, [2, 2, 2, 2]),
    "gpipe 2 x data 2": ({"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2,
                          "PIPELINE_SCHEDULE": "gpipe"}, 4, "plain", 13, 4, [2, 2, 2, 2]),
    "1d x2": ({"parallel": {"tensor": {"size": 2, "mode": "1d"}}}, 2, "tensor", 9, 4, [3, 3]),
    # data 2 x 1d 2: shards 5 / 4 -> batches 4 + 1 / 4
    "data 2 x 1d 2": ({"parallel": {"tensor": {"size": 2, "mode": "1d"}}}, 4, "tensor", 9, 4,
                      [2, 2, 1, 1]),
}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", list(CASES))
def test_deep_evaluation_on_uneven_shards_equals_one_process_and_moves_nothing(case):
    config, world, kind, n_test, batch, counts = CASES[case]
    ref = run_ranks(_eval_worker, 1, {}, kind, n_test, batch * (world // _model_ranks(config)),
                    timeout=60)[0]
    results = run_ranks(_eval_worker, world, config, kind, n_test, batch, timeout=90)
    assert [r[2] for r in results] == counts, "the shards are as uneven as intended"
    _check(results, ref, 1e-12)


def _model_ranks(config):
    parallel = config.get("parallel", {})
    return parallel.get("pipeline", 1) * parallel.get("tensor", {}).get("size", 1)


@pytest.mark.timeout(150)
def test_gloo_the_one_process_run_is_plain_torchs_evaluation():
    """The world-1 run the layouts are compared with evaluates (pad=False, batches 4, 4, 1) as
    plain torch does on the whole test set, dropout off (so a bug common to every layout shows)."""
    model = _mlp().eval()
    x, y = _data(9, 2).tensors
    with torch.no_grad():
        logits = model(x)
    ref = run_ranks(_untrained_worker, 1, 9, 4, timeout=60)[0]
    assert ref["loss"] == pytest.approx(F.cross_entropy(logits, y).item(), rel=1e-14, abs=0)
    assert ref["accuracy"] == int((logits.argmax(1) == y).sum()) / 9


def _untrained_worker(rank, world, port, n_test, batch):
    nc.launch({}, rank=rank, world_size=world, host="127.0.0.1", port=port, timeout=20)
    model = _mlp()
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.2),
                               nn.CrossEntropyLoss(), verbose=False)
    test = nc.get_dataloader(_data(n_test, 2), batch_size=batch, pad=False)
    return Trainer(engine).evaluate(test, hooks=[hooks.LossHook(), hooks.AccuracyHook()])


# -- metrics where they meet other features: ZeRO 3, vocab-parallel logits -------------------------

@pytest.mark.timeout(60)
def test_deep_zero3_evaluation_with_uneven_batch_counts_is_exact_or_refused_clearly():
    """Trainer.evaluate checks the batch counts first: otherwise rank 0's parameter all-gather
    for its extra batch would meet rank 1's metric all-reduce in a raw gloo timeout."""
    with pytest.raises(AssertionError, match=r"ranks disagree on the number of evaluation batches "
                                             r"\(rank 0: 2, rank 1: 1\) and ZeRO level 3 gathers"):
        run_ranks(_eval_worker, 2, {"zero": {"level": 3}}, "plain", 9, 4, 5, timeout=30)


@pytest.mark.timeout(150)
def test_deep_accuracy_of_vocab_parallel_logits_equals_one_process():
    ref = run_ranks(_eval_worker, 1, {}, "vocab-parallel", 10, 4, timeout=60)[0]
    results = run_ranks(_eval_worker, 2, {"parallel": {"tensor": {"size": 2, "mode": "1d"}}},
                        "vocab-parallel", 10, 4, timeout=60)
    for rank, (metrics, *_) in enumerate(results):
        assert metrics["accuracy"] == ref[0]["accuracy"], (rank, metrics, ref[0])


@pytest.mark.timeout(150)
def test_deep_vocab_parallel_loss_of_a_float64_model_is_float64():
    ref = run_ranks(_eval_worker, 1, {}, "vocab-parallel", 10, 4, timeout=60)[0]
    results = run_ranks(_eval_worker, 2, {"parallel": {"tensor": {"size": 2, "mode": "1d"}}},
                        "vocab-parallel", 10, 4, timeout=60)
    for rank, (metrics, *_) in enumerate(results):
        assert metrics["loss"] == pytest.approx(ref[0]["loss"], rel=1e-12, abs=0), \
            (rank, metrics, ref[0])


@pytest.mark.timeout(150)
def test_deep_pipeline_reported_loss_of_a_float64_model_is_float64():
    config = {"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2}
    ref = run_ranks(_eval_worker, 1, {}, "plain", 10, 4, timeout=60)[0]
    results = run_ranks(_eval_worker, 2, config, "plain", 10, 4, timeout=60)
    _check(results, ref)
