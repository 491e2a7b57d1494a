"""Pipelines on real gloo processes give what one process gives on the whole batch."""
import copy

import pytest
import torch
from dist_helpers import run_ranks
from torch import nn
from torch.testing import assert_close
from torch.utils.data import DataLoader, TensorDataset

import nanocolossal as nc
from nanocolossal.checkpoint import merge_pipeline_checkpoint, save_checkpoint
from nanocolossal.context import gpc
from nanocolossal.pipeline import build_pipeline_model, make_schedule
from nanocolossal.trainer import Trainer

pytestmark = pytest.mark.timeout(150)
BATCH, M = 16, 4


def _model(n_linear=8):
    """BatchNorm-free, so micro-batching changes nothing mathematically."""
    torch.manual_seed(0)
    layers = []
    for i in range(n_linear):
        layers += [nn.Linear(12, 12), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(12, 5))


def _batch(seed=0, n=BATCH):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 12, generator=g), torch.randint(0, 5, (n,), generator=g)


def _chunks(stage):
    return list(stage) if isinstance(stage, nn.ModuleList) else [stage]


def _equivalence_worker(rank, world_size, port):
    nc.launch({"parallel": {"pipeline": world_size}}, rank=rank, world_size=world_size,
              host="127.0.0.1", port=port)
    x, y = _batch()
    reference = _model()
    ref_out = reference(x)
    ref_loss = nn.functional.cross_entropy(ref_out, y)
    ref_loss.backward()
    ref_grads = {k: p.grad for k, p in reference.named_parameters()}
    report = {}
    for name, chunks in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)]:
        stage = build_pipeline_model(_model(), num_chunks=chunks, partition="uniform")
        schedule = make_schedule(name, M, chunks)
        out, label, loss = schedule.forward_backward_step(stage, (x, y), nn.CrossEntropyLoss())
        assert_close(loss, ref_loss.detach(), msg=lambda m: f"{name} loss: {m}")
        for chunk in _chunks(stage):
            for key, p in chunk.named_parameters():
                assert_close(p.grad, ref_grads[key], rtol=1e-6, atol=1e-6,
                             msg=lambda m: f"{name} grad {key}: {m}")
        if gpc.is_last_stage():
            assert_close(out, ref_out.detach())
            assert torch.equal(label, y)
        else:
            assert out is None and label is None
        # evaluation: forward only, no activations kept, same outputs
        with torch.no_grad():
            out, _, eval_loss = schedule.forward_backward_step(stage, (x, y),
                                                               nn.CrossEntropyLoss(),
                                                               forward_only=True)
        assert schedule.max_in_flight == 0
        assert_close(eval_loss, ref_loss.detach())
        if gpc.is_last_stage():
            assert_close(out, ref_out.detach())
        report[name] = sum(p.numel() for c in _chunks(stage) for p in c.parameters())
    return report


@pytest.mark.parametrize("world_size", [2, 4])
def test_gloo_pipeline_schedules_equal_one_process(world_size):
    reports = run_ranks(_equivalence_worker, world_size, timeout=120)
    total = sum(p.numel() for p in _model().parameters())
    for name in ("gpipe", "1f1b", "interleaved"):
        assert sum(r[name] for r in reports) == total, "the stages hold the whole model, once"


def _pipe_data_worker(rank, world_size, port, path, ddp=None):
    nc.launch({"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": M, "clip_grad_norm": 0.5,
               "ddp": ddp or {}},
              rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    stage = build_pipeline_model(_model(), partition="parameters")
    opt = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)
    engine, *_ = nc.initialize(stage, opt, nn.CrossEntropyLoss(), verbose=False)
    Trainer(engine, schedule=make_schedule("gpipe", M))  # Colossal's way to pick another schedule
    assert engine.schedule.name == "gpipe"
    single = _model()
    single_opt = torch.optim.SGD(single.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(3):
        x, y = _batch(seed=step, n=2 * BATCH)           # the global batch; data rank d takes half d
        mine = slice(gpc.data_rank * BATCH, (gpc.data_rank + 1) * BATCH)
        engine.zero_grad()
        _, _, loss = engine.execute_schedule((x[mine], y[mine]))
        grads = [p.grad for p in engine.model.parameters()]
        storages = len({g.untyped_storage().data_ptr() for g in grads})
        bf16_sums = all(torch.equal(g, g.bfloat16().float()) for g in grads)
        assert engine.step()
        losses.append(loss.item())
        single_opt.zero_grad()
        nn.functional.cross_entropy(single(x), y).backward()
        torch.nn.utils.clip_grad_norm_(single.parameters(), 0.5)
        single_opt.step()
    expected = dict(single.named_parameters())
    # averaged in bf16, the gradients are off by bf16 rounding: close, no longer equal
    tol = {"rtol": 2e-2, "atol": 2e-3} if (ddp or {}).get("compress") else {}
    for key, p in engine.model.named_parameters():
        assert_close(p, expected[key], msg=lambda m: f"{key}: {m}", **tol)
    save_checkpoint(path, 1, engine.model, engine.optimizer)
    if rank == 0:  # the stage files merge into the unsplit model
        plain = _model()
        plain.load_state_dict(
            merge_pipeline_checkpoint([path.replace(".pt", f"-stage{s}.pt") for s in (0, 1)])
        )
        for key, p in plain.named_parameters():
            assert_close(p, expected[key], **tol)
    return losses, storages, bf16_sums


@pytest.mark.parametrize("ddp", [None, {"gradient_as_bucket_view": True}, {"compress": "bf16"}],
                         ids=["ddp", "bucket-view", "bf16-compress"])
def test_gloo_pipeline_times_data_parallel_equals_one_process(tmp_path, ddp):
    results = run_ranks(_pipe_data_worker, 4, str(tmp_path / "ckpt.pt"), ddp, timeout=120)
    losses = [r[0] for r in results]
    assert losses[0] == losses[1] and losses[2] == losses[3], (
        "the loss reaches every stage of a pipeline"
    )
    # the config's ddp options reach each stage's DDP: with bucket views a stage's grads share
    # one bucket; compressed, they are sums taken in bf16
    view, compress = (bool((ddp or {}).get(k)) for k in ("gradient_as_bucket_view", "compress"))
    assert all((storages == 1) == view for _, storages, _ in results), results
    assert all(bf16_sums == compress for _, _, bf16_sums in results), results


def _amp_worker(rank, world_size, port):
    nc.launch({"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": M,
               "fp16": {"mode": nc.AMP_TYPE.TORCH, "dtype": "float16", "init_scale": 256.0}},
              rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    stage = build_pipeline_model(_model(2), partition="uniform")
    engine, *_ = nc.initialize(stage, torch.optim.SGD(stage.parameters(), lr=0.1),
                               nn.CrossEntropyLoss(), verbose=False)
    before = copy.deepcopy(engine.model.state_dict())
    results = []
    for poison in (True, False):
        engine.zero_grad()
        engine.execute_schedule(_batch())
        if poison and rank == 0:  # the first stage alone overflows
            next(engine.model.parameters()).grad.view(-1)[0] = float("inf")
        results.append((engine.step(), engine.optimizer.loss_scale))
        if poison:
            results.append(
                all(torch.equal(v, before[k]) for k, v in engine.model.state_dict().items())
            )
    return results


def test_gloo_pipeline_amp_overflow_on_one_stage_skips_on_both():
    for result in run_ranks(_amp_worker, 2, timeout=90):
        assert result == [(False, 128.0), True, (True, 128.0)], result


def _bad_batch_worker(rank, world_size, port):
    nc.launch({"parallel": {"pipeline": 2}}, rank=rank, world_size=world_size, host="127.0.0.1",
              port=port)
    stage = build_pipeline_model(_model(), partition="uniform")
    try:
        make_schedule("1f1b", M).forward_backward_step(stage, _batch(n=3), nn.CrossEntropyLoss())
    except ValueError as e:
        return str(e)


def test_gloo_batch_smaller_than_micro_batches():
    for rank, message in enumerate(run_ranks(_bad_batch_worker, 2, timeout=60)):
        assert f"[rank {rank}] batch size 3 is smaller than NUM_MICRO_BATCHES=4" in message


# a mean over counted targets (loss_weights.py) and a plain mean over samples (no ignore_index:
# there each micro-batch weighs its share of the samples, 4/13 or 3/13, not 1/M)
CRITERIA = {"cross_entropy": nn.CrossEntropyLoss, "sample_mean": nn.MultiMarginLoss}


def _any_batch_worker(rank, world_size, port, criterion_name):
    """One schedule object, batches of 16, 8, 10 and 13 in turn (a test loader's last batch):
    near-equal micro-batches weighted by their share give the whole batch's loss and gradients."""
    criterion = CRITERIA[criterion_name]()
    nc.launch({"parallel": {"pipeline": world_size}}, rank=rank, world_size=world_size,
              host="127.0.0.1", port=port)
    checked = []
    for name, chunks in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)]:
        stage = build_pipeline_model(_model(), num_chunks=chunks, partition="uniform")
        schedule = make_schedule(name, M, chunks)
        for n in (16, 8, 10, 13, 16):
            x, y = _batch(seed=n, n=n)
            reference = _model()
            ref_out = reference(x)
            ref_loss = criterion(ref_out, y)
            ref_loss.backward()
            ref_grads = {k: p.grad for k, p in reference.named_parameters()}
            for chunk in _chunks(stage):
                chunk.zero_grad()
            out, label, loss = schedule.forward_backward_step(stage, (x, y), criterion)
            assert_close(loss, ref_loss.detach(), msg=lambda m: f"{name} n={n} loss: {m}")
            for chunk in _chunks(stage):
                for key, p in chunk.named_parameters():
                    assert_close(p.grad, ref_grads[key], rtol=1e-6, atol=1e-6,
                                 msg=lambda m: f"{name} n={n} grad {key}: {m}")
            with torch.no_grad():
                out, label, eval_loss = schedule.forward_backward_step(
                    stage, (x, y), criterion, forward_only=True
                )
            assert_close(eval_loss, ref_loss.detach())
            if gpc.is_last_stage():
                assert_close(out, ref_out.detach())
                assert torch.equal(label, y)
            checked.append((name, n))
    return checked


@pytest.mark.parametrize("criterion", list(CRITERIA))
def test_gloo_pipelines_take_any_batch_of_at_least_m_samples(criterion):
    expected = [(name, n) for name in ("gpipe", "1f1b", "interleaved") for n in (16, 8, 10, 13, 16)]
    assert run_ranks(_any_batch_worker, 2, criterion, timeout=120) == [expected, expected]


class ShapeShifter(nn.Module):
    """Returns a different width from its third call on: an unannounced shape change."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x if self.calls < 3 else torch.cat([x, x], dim=1)


def _shape_worker(rank, world_size, port):
    nc.launch({"parallel": {"pipeline": 2}, "timeout": 20}, rank=rank, world_size=world_size,
              host="127.0.0.1", port=port)
    stage = build_pipeline_model(nn.Sequential(nn.Linear(12, 12), ShapeShifter(),
                                               nn.Linear(12, 5)), partition=[2, 1])
    try:
        make_schedule("gpipe", M).forward_backward_step(stage, _batch(), nn.CrossEntropyLoss())
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_gloo_stage_changing_its_output_shape_is_an_error_on_both_ranks():
    sender, receiver = run_ranks(_shape_worker, 2, timeout=60)
    assert "[rank 0] gpipe step" in sender and "(4, 24)" in sender and "agreed on (4, 12)" in sender
    assert "rank 0 and rank 1" in sender
    assert "[rank 1] pipeline transfer with rank(s) [0] failed" in receiver


def _config_worker(rank, world_size, port, config, whole_model):
    nc.launch({"parallel": {"pipeline": 2}, **config}, rank=rank, world_size=world_size,
              host="127.0.0.1", port=port)
    model = (
        _model()
        if whole_model
        else build_pipeline_model(_model(), num_chunks=config.get("NUM_CHUNKS", 1))
    )
    try:
        nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                      verbose=False)
    except nc.ConfigError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("config, whole_model, message", [
    ({"NUM_MICRO_BATCHES": 4}, True,
     "the model is a whole Sequential; pass build_pipeline_model(model)"),
    ({}, False, "needs NUM_MICRO_BATCHES in the config"),
    ({"NUM_MICRO_BATCHES": 1}, False, "NUM_MICRO_BATCHES=1 is smaller than the pipeline size 2"),
    ({"NUM_MICRO_BATCHES": 3, "NUM_CHUNKS": 2}, False,
     "multiple of the pipeline size: M=3, P=2; use M=4"),
    ({"NUM_MICRO_BATCHES": 4, "gradient_accumulation": 2}, False, "raise NUM_MICRO_BATCHES"),
])
def test_gloo_pipeline_config_errors(config, whole_model, message):
    for rank, text in enumerate(run_ranks(_config_worker, 2, config, whole_model, timeout=60)):
        assert f"[rank {rank}]" in text and message in text


def _loader_worker(rank, world_size, port, size, batch_size, drop_last, which):
    nc.launch({"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": M}, rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    stage = build_pipeline_model(_model())
    loader = DataLoader(TensorDataset(*_batch(n=size)), batch_size=batch_size, drop_last=drop_last)
    loaders = {"train_dataloader": loader} if which == "train" else {"test_dataloader": loader}
    try:
        nc.initialize(stage, torch.optim.SGD(stage.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                      verbose=False, **loaders)
    except nc.ConfigError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("size, batch_size, drop_last, which, message", [
    (18, 8, False, "train", "the train dataloader's last batch has 2 sample(s), fewer than "
                            "NUM_MICRO_BATCHES=4"),
    (3, 8, False, "test", "the test dataloader's last batch has 3 sample(s)"),
    (18, 8, True, "train", "no error"),  # the short batch is dropped
    (13, 8, False, "test", "no error"),  # a last batch of 5: micro-batches of 2, 1, 1, 1
    (16, 8, False, "test", "no error"),
], ids=["train-last-2", "test-only-3", "train-dropped", "test-last-5", "test-even"])
def test_gloo_pipeline_refuses_a_loader_whose_last_batch_cannot_fill_the_micro_batches(
        size, batch_size, drop_last, which, message):
    """At initialize, not after an epoch of training: every batch needs one sample per
    micro-batch."""
    for rank, text in enumerate(run_ranks(_loader_worker, 2, size, batch_size, drop_last, which,
                                          timeout=60)):
        assert message in text
        if message != "no error":
            assert text.startswith(f"[rank {rank}]") and "drop_last=True" in text


def _sharded_loader_worker(rank, world_size, port):
    nc.launch({"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": M}, rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    stage = build_pipeline_model(_model())
    # 36 samples over 2 data-parallel replicas: 18 each, so batches of 8, 8 and 2
    test_loader = nc.get_dataloader(TensorDataset(*_batch(n=36)), batch_size=8, pad=False)
    try:
        nc.initialize(stage, torch.optim.SGD(stage.parameters(), lr=0.1), nn.CrossEntropyLoss(),
                      test_dataloader=test_loader, verbose=False)
    except nc.ConfigError as e:
        return str(e)
    return "no error"


def test_gloo_pipeline_times_data_checks_each_replicas_own_last_batch():
    """36 % 8 = 4 would pass; each replica's shard of 18 ends in a batch of 2, which does not."""
    for rank, text in enumerate(run_ranks(_sharded_loader_worker, 4, timeout=60)):
        assert text.startswith(f"[rank {rank}] the test dataloader's last batch has 2 sample(s)")


def _bn_broadcast_worker(rank, world_size, port):
    """Pipeline x data with BatchNorm: the replicas' statistics are synced once per batch, not once
    per micro-batch forward (M = 4 micro-batches here)."""
    nc.launch({"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": M}, rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(12, 12), nn.BatchNorm1d(12), nn.Tanh(), nn.Linear(12, 5))
    stage = build_pipeline_model(layers, partition=[2, 2])
    engine, *_ = nc.initialize(stage, torch.optim.SGD(stage.parameters(), lr=0.1),
                               nn.CrossEntropyLoss(), verbose=False)
    data_group_broadcasts = []
    original = torch.distributed.broadcast

    def counting(tensor, src=None, group=None, *args, **kwargs):
        if group is gpc.data_group:
            data_group_broadcasts.append(tensor.numel())
        return original(tensor, src, group, *args, **kwargs)
    torch.distributed.broadcast = counting
    try:
        for step in range(2):
            engine.zero_grad()
            engine.execute_schedule(_batch(seed=step, n=BATCH))
            engine.step()
    finally:
        torch.distributed.broadcast = original
    return len(data_group_broadcasts)


def test_gloo_pipeline_syncs_batchnorm_buffers_once_per_batch():
    # stage 0 holds the BatchNorm: per batch one float message (running
    # mean and var) and one int64 (batches tracked), so 4 over 2
    # batches -- on every micro-batch it would be 16; stage 1 has none
    assert run_ranks(_bn_broadcast_worker, 4, timeout=90) == [4, 0, 4, 0]


def _tied_seeded_worker(rank, world_size, port):
    """A GPT whose classifier shares the embedding's table, built under a per-rank seed."""
    import sys

    from dist_helpers import ROOT
    sys.path.insert(0, str(ROOT))
    from train_gpt import gpt
    nc.launch({"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2}, rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    torch.manual_seed(1337 + rank)
    stage = build_pipeline_model(gpt(vocab=16, seq_len=8, dim=8, depth=2, heads=2))
    engine, *_ = nc.initialize(stage, torch.optim.SGD(stage.parameters(), lr=0.1),
                               nc.nn.VocabParallelCrossEntropyLoss(), verbose=False)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 16, (4, 9), generator=g)
    engine.zero_grad()
    engine.execute_schedule((tokens[:, :-1], tokens[:, 1:]))
    engine.step()
    [(table, group)] = stage.tied
    copies = [torch.empty_like(table) for _ in range(2)]
    torch.distributed.all_gather(copies, table.detach(), group=group)
    return copies


def test_gloo_a_weight_two_stages_share_starts_and_stays_one_weight():
    """The embedding (stage 0) and the classifier (stage 1) share one table: built under a
    per-rank seed, the last stage's copy starts as the first stage's (replicas.py) and both take
    the same step, so the two copies are one weight."""
    for first, last in run_ranks(_tied_seeded_worker, 2, timeout=60):
        assert torch.equal(first, last)
