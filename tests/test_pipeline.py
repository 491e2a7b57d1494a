"""Pipelines on real gloo processes give what one process gives on the whole batch."""
import copy
from types import SimpleNamespace

import pytest
import torch
from amp_probes import (
    MODELS,
    MODES,
    install_probes,
    patch_attention,
    probe_batches,
    probed_criterion,
)
from dist_helpers import run_ranks
from models import my_share
from run_records import record_run
from torch import nn
from torch.testing import assert_close
from torch.utils.data import DataLoader, TensorDataset
from zero_parallel_runs import (
    F64,
    STEPS,
    check_states,
    cloned_state,
    one_process_sgd,
    pipeline_engine,
    train_pipeline,
)

import nanocolossal as nc
from nanocolossal.checkpoint import merge_pipeline_checkpoint, save_checkpoint
from nanocolossal.context import gpc
from nanocolossal.pipeline import build_pipeline_model, compute_order, make_schedule, p2p
from nanocolossal.pipeline.plan import build_plan
from nanocolossal.pipeline.steps import Comm, step_label
from nanocolossal.trainer import Trainer

pytestmark = pytest.mark.timeout(150)
BATCH, M = 16, 4


def _lesson_model(hidden=1):
    torch.manual_seed(0)
    middle = [layer for _ in range(hidden) for layer in (nn.Linear(8, 8), nn.Tanh())]
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), *middle, nn.Linear(8, 3)).double()


def _lesson_worker(rank, world_size, port, xs, ys, schedule="1f1b", chunks=1, hidden=1, M=4):
    nc.launch(dict(parallel=dict(pipeline=world_size), NUM_MICRO_BATCHES=M,
                   PIPELINE_SCHEDULE=schedule, NUM_CHUNKS=chunks), rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    model = _lesson_model(hidden)  # every rank builds the whole model the reference builds
    stage = build_pipeline_model(model, chunks)  # and keeps its stage: the first layers or the last
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.5, momentum=0.9)
    engine, *_ = nc.initialize(stage, optimizer, nn.CrossEntropyLoss(), verbose=False)
    for x, y in zip(xs, ys):
        engine.zero_grad()
        engine.execute_schedule((x, y))  # 1F1B: 4 micro-batches of 2, activations sent on
        engine.step()
    return engine.model.state_dict()  # this stage's layers, under the whole model's keys


def _one_process(hidden=1):
    """3 batches of 8, and the whole model trained on them in one process."""
    model = _lesson_model(hidden)
    xs, ys = torch.randn(3, 8, 4, dtype=torch.float64), torch.randint(0, 3, (3, 8))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for x, y in zip(xs, ys):  # the whole batch of 8 in one process
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return xs, ys, model.state_dict()


def test_gloo_pipeline_1f1b_on_two_stages_equals_one_process():
    """A model cut into 2 stages, each batch run as 4 micro-batches through the 1F1B schedule,
    trains as the whole model does in one process on the whole batch."""
    xs, ys, whole = _one_process()
    first, last = run_ranks(_lesson_worker, 2, xs, ys)
    assert first.keys().isdisjoint(last.keys())  # each layer on one stage only
    assert_close({**first, **last}, whole)


def test_gloo_zero_bubble_splits_each_backward_and_still_equals_one_process():
    """ZB-H1 (zero_bubble.py) runs each backward as two steps: B, the gradient of the stage's input,
    which the previous stage waits for, and later W, the gradient of the weights, which nobody
    waits for and so fills the idle time. Same sums in another order: the same training."""
    stage1 = compute_order("zero_bubble", 2, 4, 1, rank=1)
    assert [step_label(s, 1) for s in stage1] == ["F0", "B0", "F1", "B1", "W0", "F2", "B2",
                                                  "W1", "F3", "B3", "W2", "W3"]
    xs, ys, whole = _one_process()
    first, last = run_ranks(_lesson_worker, 2, xs, ys, "zero_bubble")
    assert_close({**first, **last}, whole)


def test_gloo_zbv_places_two_chunks_in_a_v_and_still_equals_one_process():
    """ZB-V (zero_bubble.py): each rank holds two chunks, in a V -- rank 0 the first and the last
    part, rank 1 the two middle ones, which it hands over in memory, with no message. Each
    backward is split into B and W, and the W's fill the time 1F1B would idle. The same
    training."""
    plan1 = build_plan("zbv", 2, 4, 2, rank=1)
    sent = [t for s in plan1 if isinstance(s, Comm) for t in s.sends + s.recvs]
    assert sent and not [t for t in sent if {t.src, t.dst} == {1, 2}], "parts 1 -> 2: in memory"
    xs, ys, whole = _one_process()
    first, last = run_ranks(_lesson_worker, 2, xs, ys, "zbv", 2)
    assert {k.split(".")[0] for k in first} == {"0", "4"}  # the input's layer and the loss's
    assert_close({**first, **last}, whole)
    xs, ys, whole = _one_process(hidden=3)  # 4 stages: 8 parts of 9 layers, M >= 2P - 1
    states = run_ranks(_lesson_worker, 4, xs, ys, "zbv", 2, 3, 8)
    assert_close({k: v for state in states for k, v in state.items()}, whole)


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
    for name, chunks in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1)]:
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
    for name in ("gpipe", "1f1b", "interleaved", "zero_bubble"):
        assert sum(r[name] for r in reports) == total, "the stages hold the whole model, once"


def _pipe_data_worker(rank, world_size, port, path, ddp=None, schedule="gpipe"):
    nc.launch({"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": M, "clip_grad_norm": 0.5,
               "ddp": ddp or {}},
              rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    stage = build_pipeline_model(_model(), partition="parameters")
    opt = torch.optim.SGD(stage.parameters(), lr=0.1, momentum=0.9)
    engine, *_ = nc.initialize(stage, opt, nn.CrossEntropyLoss(), verbose=False)
    Trainer(engine, schedule=make_schedule(schedule, M))  # Colossal's way to pick a schedule
    assert engine.schedule.name == schedule
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


@pytest.mark.parametrize("ddp, schedule", [
    (None, "gpipe"), ({"gradient_as_bucket_view": True}, "gpipe"), ({"compress": "bf16"}, "gpipe"),
    (None, "zero_bubble"),  # DDP averages during a chunk's last W, not its last B
], ids=["ddp", "bucket-view", "bf16-compress", "ddp-zero-bubble"])
def test_deep_pipeline_times_data_parallel_equals_one_process(tmp_path, ddp, schedule):
    results = run_ranks(_pipe_data_worker, 4, str(tmp_path / "ckpt.pt"), ddp, schedule,
                        timeout=120)
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


def test_deep_pipeline_amp_overflow_on_one_stage_skips_on_both():
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
    for name, chunks in [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zero_bubble", 1)]:
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
def test_deep_pipelines_take_any_batch_of_at_least_m_samples(criterion):
    expected = [(name, n) for name in ("gpipe", "1f1b", "interleaved", "zero_bubble")
                for n in (16, 8, 10, 13, 16)]
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


def test_a_coalesced_batch_of_sends_alone_goes_on_until_flush(monkeypatch):
    """NCCL gives one handle for a whole batch (gloo one per op): a batch that receives waits on
    it; a batch of sends alone does not hold the stage up, and `flush` waits for it."""
    waited = []

    class Handle:
        def __init__(self, batch):
            self.batch = batch

        def wait(self):
            waited.append(self.batch)

        def is_completed(self):
            return False

    batches = iter(["sends", "sends and receives"])
    monkeypatch.setattr(p2p.dist, "batch_isend_irecv", lambda ops: [Handle(next(batches))])
    comm = p2p.StageComm()
    send = SimpleNamespace(op=p2p.dist.isend, tensor=torch.ones(1), peer=1)
    receive = SimpleNamespace(op=p2p.dist.irecv, tensor=torch.ones(1), peer=1)
    comm._post([send, send], "a batch of sends")
    assert waited == []
    comm._post([send, receive], "a batch with a receive")
    assert waited == ["sends and receives"]
    comm.flush()
    assert "sends" in waited


def _unpaired_batch_worker(rank, world_size, port):
    nc.launch({"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2, "timeout": 10}, rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    model = build_pipeline_model(_model())
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               nn.CrossEntropyLoss(), verbose=False)
    try:
        engine.execute_schedule(torch.randn(2, 12))  # two rows: would unpack into (x, y)
    except TypeError as e:
        return str(e)
    return "no error"


def test_gloo_a_batch_that_is_not_inputs_and_labels_is_refused_on_every_stage():
    for rank, text in enumerate(run_ranks(_unpaired_batch_worker, 2, timeout=30)):
        assert f"[rank {rank}] a batch is a pair (inputs, labels), got a tensor" in text, text


def _config_worker(rank, world_size, port, config, whole_model, built_for=None):
    nc.launch({"parallel": {"pipeline": 2}, **config}, rank=rank, world_size=world_size,
              host="127.0.0.1", port=port)
    model = (
        _model()
        if whole_model
        else build_pipeline_model(_model(), num_chunks=config.get("NUM_CHUNKS", 1),
                                  schedule=built_for)
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
def test_deep_pipeline_config_errors(config, whole_model, message):
    for rank, text in enumerate(run_ranks(_config_worker, 2, config, whole_model, timeout=60)):
        assert f"[rank {rank}]" in text and message in text


def test_gloo_zbv_refuses_a_stage_placed_for_another_schedule():
    """zbv's chunks lie in a V; a stage built for interleaved (chunk c = part c * P + r) would run
    the wrong layers in the wrong order: refused, naming the fix."""
    config = {"NUM_MICRO_BATCHES": 4, "NUM_CHUNKS": 2, "PIPELINE_SCHEDULE": "zbv"}
    for rank, text in enumerate(run_ranks(_config_worker, 2, config, False, "interleaved")):
        assert text.startswith(f"[rank {rank}] PIPELINE_SCHEDULE='zbv' but the stage's chunks "
                               f"were placed in a loop"), text
        assert "build_pipeline_model(..., schedule='zbv')" in text


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
def test_deep_pipeline_refuses_a_loader_whose_last_batch_cannot_fill_the_micro_batches(
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


def test_deep_pipeline_syncs_batchnorm_buffers_once_per_batch():
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


def test_deep_a_weight_two_stages_share_starts_and_stays_one_weight():
    """The embedding (stage 0) and the classifier (stage 1) share one table: built under a
    per-rank seed, the last stage's copy starts as the first stage's (replicas.py) and both take
    the same step, so the two copies are one weight."""
    for first, last in run_ranks(_tied_seeded_worker, 2, timeout=60):
        assert torch.equal(first, last)


# -- pipeline x AMP: stage boundaries keep their half dtype --------------------------------------
# Under AMP only the model's real output (last stage, last chunk) is cast to fp32; a boundary
# between stages carries bf16/fp16 activations and gradients (the p2p handshake carries the
# dtype); with TENSOR_SHAPE (fixed shapes, fixed dtype float32) every stage output is cast to
# fp32. Each test runs one process on the whole batch under the same AMP config and the pipeline
# layout, and compares parameter / buffer dtypes, every module's output dtype (probes from
# test_amp.py), the dtypes that actually crossed each boundary (a spy on
# StageComm.exchange), steps taken, loss scales, losses, clipped norms and the parameters after
# 3 steps.
#
# Tolerance (as test_amp.py argues): a pipeline sums micro-batch gradients in
# another order than one process's whole-batch backward (and data parallel all-reduces them), so
# each rounding may differ by one half-ulp: after 3 SGD steps at lr 0.1 we allow 1e-2 in bf16
# (8-bit mantissa, ulp(1) = 7.8e-3) and 2e-3 in fp16 (ulp(1) = 9.8e-4).

CLIP = 0.05
BF16, FP16 = 1e-2, 2e-3


# -- extra models ---------------------------------------------------------------------------------

class Residual(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(dim, dim), nn.GELU())

    def forward(self, x):
        return x + self.body(x)


def _deep_mlp():
    """8 layers (interleaved over 4 stages x 2 chunks), residual streams cross the boundaries."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), *[Residual(16) for _ in range(6)], nn.Linear(16, 5))


class Bucketize(nn.Module):
    """A stage whose output is an integer tensor (token ids for the next stage's embedding)."""

    def forward(self, x):
        return (x.float().sigmoid() * 3.999).long()[:, :4]


def _int_boundary():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 6), Bucketize(), nn.Embedding(4, 8), nn.Flatten(),
                         nn.Linear(32, 5))


class TupleOut(nn.Module):
    def forward(self, x):
        return x, x.sum(-1, keepdim=True)


class TupleIn(nn.Module):
    def forward(self, xs):
        return xs[0] + xs[1]


def _tuple_boundary():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), TupleOut(), TupleIn(), nn.Linear(16, 5))


EXTRA_MODELS = {"deep_mlp": _deep_mlp, "int": _int_boundary, "tuple": _tuple_boundary}


def _amp_model(name):
    return EXTRA_MODELS[name]() if name in EXTRA_MODELS else MODELS[name]()


def _data(name, steps):
    return probe_batches("mlp" if name in EXTRA_MODELS else name, steps)


# -- the worker ------------------------------------------------------------------------------------

def _spy_p2p(crossed):
    """Record the dtype of every activation / gradient actually sent between stages."""
    exchange = p2p.StageComm.exchange

    def spy(self, sends, recvs, where):
        for t, x in sends.items():
            dtype = None if x is None else x.dtype
            crossed.setdefault(f"{t.what} {t.src}->{t.dst}", set()).add(str(dtype))
        return exchange(self, sends, recvs, where)

    p2p.StageComm.exchange = spy
    return lambda: setattr(p2p.StageComm, "exchange", exchange)


def _train(rank, world, port, model_name, config, steps=3, inject=None, partition="uniform",
           evaluate=False):
    nc.launch(dict(config), rank=rank, world_size=world, host="127.0.0.1", port=port, seed=1,
              timeout=60)
    seen, crossed = {}, {}
    undo_attention, undo_p2p = patch_attention(seen), _spy_p2p(crossed)
    try:
        model = _amp_model(model_name)
        install_probes(model, seen)
        if gpc.pipeline_size > 1:
            model = build_pipeline_model(model, num_chunks=config.get("NUM_CHUNKS", 1),
                                         partition=partition)
        crit = probed_criterion("gpt" if model_name.startswith("gpt") else "mlp", seen)
        data = _data(model_name, steps + (1 if evaluate else 0))
        engine, loader, *_ = nc.initialize(
            model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), crit,
            my_share(data[:steps]), verbose=False)
        out = record_run(engine, loader, inject)
        out["state"] = {k: v.detach().double().clone() for k, v in
                        nc.checkpoint.strip_prefixes(engine.model.state_dict()).items()
                        if torch.is_tensor(v) and v.is_floating_point()}
        if evaluate:
            engine.eval()
            with torch.no_grad():
                output, _, loss = engine.execute_schedule(my_share(data[steps:])[0],
                                                          forward_only=True)
            out["eval_loss"] = nc.metrics.all_reduce_mean(loss.item())
            out["eval_output"] = None if output is None else output.detach().double()
            out["eval_dtype"] = None if output is None else str(output.dtype)
        out["seen"] = {k: sorted(v) for k, v in seen.items()}
        out["crossed"] = {k: sorted(v) for k, v in crossed.items()}
        out["is_last"] = gpc.is_last_stage()
        out["data_rank"] = gpc.data_rank
        return out
    finally:
        undo_attention()
        undo_p2p()


_REFS = {}


def _reference(model_name, mode, inject=None, evaluate=False, extra=()):
    key = (model_name, mode, inject, evaluate, extra)
    if key not in _REFS:
        config = dict(fp16=MODES[mode], clip_grad_norm=CLIP, **dict(extra))
        _REFS[key] = run_ranks(_train, 1, model_name, config, 3,
                               None if inject is None else (inject, [0]), "uniform", evaluate,
                               timeout=60)[0]
    return _REFS[key]


def _compare(ref, runs, tol, dtypes=True, skip_seen=()):
    for rank, run in enumerate(runs):
        if dtypes:
            wrong = {k: (run["dtypes"][k], ref["dtypes"][k]) for k in run["dtypes"]
                     if run["dtypes"][k] != ref["dtypes"].get(k)}
            assert not wrong, f"rank {rank}: param dtypes (layout, one process): {wrong}"
            wrong = {k: (run["seen"][k], ref["seen"][k]) for k in run["seen"] if k in ref["seen"]
                     and k not in skip_seen and run["seen"][k] != ref["seen"][k]}
            assert not wrong, f"rank {rank}: activation dtypes (layout, one process): {wrong}"
        assert run["took"] == ref["took"], f"rank {rank}: took {run['took']} vs {ref['took']}"
        assert run["scales"] == ref["scales"], f"rank {rank}: {run['scales']} vs {ref['scales']}"
        assert_close(torch.tensor(run["losses"]), torch.tensor(ref["losses"]), rtol=tol, atol=tol,
                     msg=lambda m: f"rank {rank} losses {run['losses']} vs {ref['losses']}: {m}")
        assert_close(torch.tensor([n or 0.0 for n in run["norms"]]),
                     torch.tensor([n or 0.0 for n in ref["norms"]]), rtol=10 * tol, atol=tol,
                     msg=lambda m: f"rank {rank} norms {run['norms']} vs {ref['norms']}: {m}")
        same = [k for k in run["state"] if k in ref["state"]
                and run["state"][k].shape == ref["state"][k].shape]
        assert same, f"rank {rank}: no parameter in common"
        for key in same:
            assert_close(run["state"][key], ref["state"][key], rtol=0, atol=tol,
                         msg=lambda m, key=key: f"rank {rank} {key}: {m}")


def _half(mode):
    return "torch.float16" if "fp16" in mode else "torch.bfloat16"


def _boundaries(runs):
    crossed = {}
    for run in runs:
        for k, v in run["crossed"].items():
            crossed.setdefault(k, set()).update(v)
    return crossed


# -- layouts x AMP: dtypes, crossings, numbers -------------------------------------------------

# name: (model, world, parallel, extra config, mode)
CASES = {
    "gpt 4 stages 1f1b O2 bf16": ("gpt", 4, {"pipeline": 4}, {"NUM_MICRO_BATCHES": 4}, "O2 bf16"),
    "gpt 4 stages zero_bubble O2 bf16": ("gpt", 4, {"pipeline": 4}, {
        "NUM_MICRO_BATCHES": 4, "PIPELINE_SCHEDULE": "zero_bubble"}, "O2 bf16"),
    "gpt 2 stages zbv O2 bf16": ("gpt", 2, {"pipeline": 2}, {
        "NUM_MICRO_BATCHES": 4, "NUM_CHUNKS": 2, "PIPELINE_SCHEDULE": "zbv"}, "O2 bf16"),
    "gpt pipe2 x tensor 1d zero_bubble O1 bf16": ("gpt", 4, {"pipeline": 2, "tensor": {
        "size": 2, "mode": "1d"}}, {"NUM_MICRO_BATCHES": 2, "PIPELINE_SCHEDULE": "zero_bubble"},
        "O1 bf16"),
    "gpt 2 stages gpipe x dp2 O1 fp16": ("gpt", 4, {"pipeline": 2},
                                         {"NUM_MICRO_BATCHES": 2, "PIPELINE_SCHEDULE": "gpipe"},
                                         "O1 fp16"),
    "gpt 2 stages interleaved x dp2 O3 bf16": ("gpt", 4, {"pipeline": 2},
                                               {"NUM_MICRO_BATCHES": 2, "NUM_CHUNKS": 2},
                                               "O3 bf16"),
    "mlp 4 stages interleaved O2 fp16": ("deep_mlp", 4, {"pipeline": 4},
                                         {"NUM_MICRO_BATCHES": 4, "NUM_CHUNKS": 2}, "O2 fp16"),
    "gpt pipe2 x tensor 1d O1 bf16": ("gpt", 4, {"pipeline": 2, "tensor": {"size": 2,
                                                                            "mode": "1d"}},
                                      {"NUM_MICRO_BATCHES": 2}, "O1 bf16"),
    "gpt pipe2 x sequence O2 bf16": ("gpt", 4, {"pipeline": 2, "tensor": {"size": 2,
                                                                           "mode": "sequence"}},
                                     {"NUM_MICRO_BATCHES": 2}, "O2 bf16"),
    # stage 0 holds no MoE layer (DDP), stage 1 does (the MoE gradient handler); the tied
    # embedding is summed only after both averaged (PipelineEngine.reduce_gradients)
    "gpt_moe pipe2 x dp2 ep2 O2 fp16": ("gpt_moe", 4, {"pipeline": 2, "moe": {"size": 2}},
                                        {"NUM_MICRO_BATCHES": 2, "MOE_AUX_WEIGHT": 0.0},
                                        "O2 fp16"),
    "gpt pipe2 x dp2 zero1 O2 bf16": ("gpt", 4, {"pipeline": 2},
                                      {"NUM_MICRO_BATCHES": 2, "zero": {"level": 1}}, "O2 bf16"),
    "mlp pipe2 x dp2 zero2 O2 fp16": ("deep_mlp", 4, {"pipeline": 2},
                                      {"NUM_MICRO_BATCHES": 2, "zero": {"level": 2}}, "O2 fp16"),
}

RING = ("attention scores", "attention softmax")  # fp32 by design in ring attention


def _case(value):
    return value.values[0] if hasattr(value, "values") else value


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", [pytest.param(k, marks=v.marks) if hasattr(v, "marks") else k
                                  for k, v in CASES.items()])
def test_deep_pipeline_amp_boundaries_keep_half_and_match_one_process(case):
    model_name, world, parallel, extra, mode = _case(CASES[case])
    ref_extra = tuple((k, v) for k, v in extra.items() if k in ("MOE_AUX_WEIGHT",))
    ref = _reference(model_name, mode, extra=ref_extra)
    assert any(n and n > CLIP for n in ref["norms"]), "clipping really clips"
    config = dict(fp16=MODES[mode], clip_grad_norm=CLIP, parallel=parallel, **extra)
    runs = run_ranks(_train, world, model_name, config, 3, timeout=90)
    crossed = _boundaries(runs)
    # every boundary carried a half activation and a half gradient (O2/O3: the half model's
    # stream; O1: the autocast output of the block / embedding-add of one process)
    acts = {k: v for k, v in crossed.items() if k.startswith("act")}
    grads = {k: v for k, v in crossed.items() if k.startswith("grad")}
    assert acts and grads, crossed
    if mode.startswith("O2") or mode.startswith("O3"):
        assert all(v == {_half(mode)} for v in acts.values()), crossed
    for k, v in grads.items():  # a gradient has its activation's dtype
        src, dst = k.split()[1].split("->")
        assert v == acts[f"act {dst}->{src}"], crossed
    _compare(ref, runs, FP16 if "fp16" in mode else BF16,
             skip_seen=RING if parallel.get("tensor", {}).get("mode") == "sequence" else ())


# -- fp16 overflow on ONE stage only --------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode,parallel,extra,ranks", [
    ("O2 fp16", {"pipeline": 2}, {"NUM_MICRO_BATCHES": 2, "NUM_CHUNKS": 2}, [0]),
    ("O1 fp16", {"pipeline": 4}, {"NUM_MICRO_BATCHES": 4}, [1]),
], ids=["interleaved-x-dp2-stage0", "1f1b-4stages-stage1"])
def test_deep_pipeline_fp16_overflow_on_one_stage_matches_one_process_scaler(mode, parallel,
                                                                           extra, ranks):
    ref = _reference("deep_mlp", mode, inject=1)
    assert ref["took"] == [True, False, True] and ref["skipped"] == 1, ref["took"]
    config = dict(fp16=MODES[mode], clip_grad_norm=CLIP, parallel=parallel, **extra)
    runs = run_ranks(_train, 4, "deep_mlp", config, 3, (1, ranks), timeout=90)
    for rank, run in enumerate(runs):
        assert run["took"] == ref["took"], f"rank {rank}: {run['took']} vs {ref['took']}"
        assert run["scales"] == ref["scales"], f"rank {rank}: {run['scales']} vs {ref['scales']}"
        assert run["skipped"] == 1, rank
    # the steps that were taken: as one process's (an inf step changes nothing but the scale)
    _compare(ref, runs, FP16)


# -- TENSOR_SHAPE (fixed shapes: fp32 boundaries) x AMP -----------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("model_name,mode,shape,parallel,extra", [
    ("gpt", "O2 bf16", [2, 8, 16], {"pipeline": 2}, {"NUM_MICRO_BATCHES": 2}),
    ("deep_mlp", "O1 fp16", [1, 16], {"pipeline": 4},
     {"NUM_MICRO_BATCHES": 4, "NUM_CHUNKS": 2}),
    ("gpt", "O3 bf16", [1, 8, 16], {"pipeline": 2},
     {"NUM_MICRO_BATCHES": 2, "PIPELINE_SCHEDULE": "gpipe"}),
], ids=["gpt-1f1b-O2bf16", "mlp-interleaved4-O1fp16", "gpt-gpipe-dp2-O3bf16"])
def test_deep_pipeline_tensor_shape_with_amp_runs_and_matches_one_process(model_name, mode, shape,
                                                                           parallel, extra):
    ref = _reference(model_name, mode)
    config = dict(fp16=MODES[mode], clip_grad_norm=CLIP, parallel=parallel, TENSOR_SHAPE=shape,
                  **extra)
    world = 4 if parallel["pipeline"] == 4 or model_name == "gpt" and mode == "O3 bf16" else 2
    runs = run_ranks(_train, world, model_name, config, 3, timeout=90)
    crossed = _boundaries(runs)
    assert crossed and all(v == {"torch.float32"} for v in crossed.values()), crossed
    # boundary dtypes differ from one process by design (fp32): compare numbers, not dtypes
    tol = FP16 if "fp16" in mode else BF16
    _compare(ref, runs, tol, dtypes=False)
    for run in runs:  # the parameters themselves keep one process's dtypes
        assert run["dtypes"] == {k: ref["dtypes"][k] for k in run["dtypes"]}


# -- evaluation through the pipeline under AMP --------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode,parallel,extra", [
    ("O2 fp16", {"pipeline": 2}, {"NUM_MICRO_BATCHES": 2, "NUM_CHUNKS": 2}),
    ("O1 bf16", {"pipeline": 2}, {"NUM_MICRO_BATCHES": 2}),
], ids=["interleaved-x-dp2-O2fp16", "1f1b-x-dp2-O1bf16"])
def test_deep_pipeline_amp_eval_outputs_match_one_process(mode, parallel, extra):
    ref = _reference("gpt", mode, evaluate=True)
    config = dict(fp16=MODES[mode], clip_grad_norm=CLIP, parallel=parallel, **extra)
    runs = run_ranks(_train, 4, "gpt", config, 3, None, "uniform", True, timeout=90)
    tol = FP16 if "fp16" in mode else BF16
    _compare(ref, runs, tol)
    per = ref["eval_output"].shape[0] // 2
    # O2 casts the model's output to fp32; O1 runs the loss under autocast and leaves the output
    # as autocast made it (amp.autocast_loss)
    dtype = "torch.float32" if mode.startswith("O2") else "torch.bfloat16"
    assert ref["eval_dtype"] == dtype
    for rank, run in enumerate(runs):
        assert abs(run["eval_loss"] - ref["eval_loss"]) < 5 * tol, (run["eval_loss"],
                                                                    ref["eval_loss"])
        if run["is_last"]:
            assert run["eval_dtype"] == dtype, rank
            mine = ref["eval_output"][run["data_rank"] * per:(run["data_rank"] + 1) * per]
            assert_close(run["eval_output"], mine, rtol=0, atol=20 * tol)
        else:
            assert run["eval_output"] is None


# -- odd stage outputs --------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_deep_pipeline_amp_integer_stage_output_trains_as_one_process():
    """Stage 0 ends in a non-differentiable bucketing (int64 ids); stage 1 embeds them. One
    process trains this (stage 0's Linear gets no gradient); the pipeline must too: an integer
    activation has no gradient to send back."""
    mode = "O2 bf16"
    ref = _reference("int", mode)
    config = dict(fp16=MODES[mode], clip_grad_norm=CLIP, parallel={"pipeline": 2},
                  NUM_MICRO_BATCHES=2)
    runs = run_ranks(_train, 2, "int", config, 3, None, [2, 3], timeout=60)
    assert _boundaries(runs)["act 0->1"] == {"torch.int64"}
    _compare(ref, runs, BF16)


@pytest.mark.timeout(120)
def test_deep_pipeline_amp_tuple_stage_output_is_a_clear_error():
    """A stage returning a tuple cannot cross a boundary: under AMP too the error names it."""
    config = dict(fp16=MODES["O1 bf16"], parallel={"pipeline": 2}, NUM_MICRO_BATCHES=2)
    with pytest.raises(Exception, match="stages must return one tensor"):
        run_ranks(_train, 2, "tuple", config, 1, None, [2, 2], timeout=30)


# -- zero-bubble schedules x other features ---------------------------------------------------

def _cut_worker(rank, world_size, port, path, schedule, save):
    chunks = 2 if schedule in ("zbv", "interleaved") else 1
    nc.launch({"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 4, "NUM_CHUNKS": chunks,
               "PIPELINE_SCHEDULE": schedule}, rank=rank, world_size=world_size,
              host="127.0.0.1", port=port, timeout=20)
    stage = build_pipeline_model(_model(3), num_chunks=chunks, partition="uniform")
    if save:
        save_checkpoint(path, 0, stage)
        return None
    try:
        nc.checkpoint.load_checkpoint(path, stage)
    except Exception as e:  # noqa: BLE001 (the message is what the test checks)
        return f"{type(e).__name__}: {e}"
    return "loaded"


@pytest.mark.timeout(60)
def test_zbv_checkpoint_into_another_cut_is_refused_naming_the_way_across(tmp_path):
    """zbv's rank 0 holds parts 0 and 3 (the first layers and the last); 1F1B's and interleaved's
    rank 0 others. Same pipeline size, another cut: the layout error, naming merge_checkpoint."""
    path = str(tmp_path / "ckpt.pt")
    run_ranks(_cut_worker, 2, path, "zbv", True)
    for schedule in ("1f1b", "interleaved"):
        for rank, said in enumerate(run_ranks(_cut_worker, 2, path, schedule, False)):
            assert said.startswith(f"ConfigError: [rank {rank}]"), said
            assert "merge_checkpoint" in said and "layers" in said, said


# -- a tie inside one stage: interleaving puts both uses of W in two chunks of rank 0 -----------

def _tied_worker(rank, world_size, port, extra, partition, chunks):
    """zero_parallel_runs.tied_model cut into `partition`, float64, 3 steps: its state, norms."""
    engine = pipeline_engine(rank, world_size, port, extra, partition, chunks, torch.float64)
    norms = train_pipeline(engine, 0, STEPS)
    return cloned_state(engine.model), norms


@pytest.mark.parametrize("level", [0, 1, 2], ids=["no-zero", "zero1", "zero2"])
def test_deep_zero_x_interleaved_x_weight_shared_by_two_chunks_of_one_stage_equals_one_process(
        level):
    """partition [2, 2, 3, 1]: parts 0 and 2 (both rank 0) use W; one Parameter in two chunks,
    reduced once, by the first chunk's DDP / ShardKeepingDDP, in the stage's last backward
    (were both chunks' wrappers to reduce W, each would drop the other's part)."""
    states, norms = one_process_sgd(clip=CLIP)
    extra = {"clip_grad_norm": CLIP, **({"zero": {"level": level}} if level else {})}
    results = run_ranks(_tied_worker, 4, extra, [2, 2, 3, 1], 2, timeout=60)
    check_states(results, states[-1], F64)
    for rank, (_, our_norms) in enumerate(results):
        assert our_norms == pytest.approx(norms, rel=1e-9), f"rank {rank}"


def _traffic_worker(rank, world_size, port, schedule, chunks):
    """Elements this rank hands to each collective in a training batch (after a first one)."""
    from nanocolossal.traffic import count_collectives
    nc.launch(dict(parallel=dict(pipeline=2, data=2), NUM_MICRO_BATCHES=4,
                   PIPELINE_SCHEDULE=schedule, NUM_CHUNKS=chunks), rank=rank,
              world_size=world_size, host="127.0.0.1", port=port)
    torch.manual_seed(0)
    stage = build_pipeline_model(nn.Sequential(*[nn.Linear(8, 8) for _ in range(8)]), chunks)
    engine, *_ = nc.initialize(stage, torch.optim.SGD(stage.parameters(), lr=0.1),
                               nn.MSELoss(), verbose=False)
    batch = (torch.randn(8, 8), torch.randn(8, 8))
    engine.zero_grad()
    engine.execute_schedule(batch)
    engine.step()
    with count_collectives() as counted:
        engine.zero_grad()
        engine.execute_schedule(batch)
        engine.step()
    return counted["all_reduce"]


def test_gloo_zero_bubble_x_data_parallel_averages_each_gradient_once():
    """A W step is several backwards (split_backward.py); the data-parallel average runs in the
    last one only, so ZB-H1 and ZB-V all-reduce what 1F1B and interleaved do, not once per
    backward call."""
    for split, plain, chunks in [("zero_bubble", "1f1b", 1), ("zbv", "interleaved", 2)]:
        assert run_ranks(_traffic_worker, 4, split, chunks) == \
            run_ranks(_traffic_worker, 4, plain, chunks), split
