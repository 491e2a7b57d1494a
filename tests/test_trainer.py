import sys

import pytest
import torch
from dist_helpers import ROOT, run_ranks
from run_records import half_update_mismatches, record_steps
from torch import nn
from torch.nn import functional as F
from torch.testing import assert_close
from torch.utils.data import TensorDataset

import nanocolossal as nc
import nanocolossal.nn as col_nn
from nanocolossal.checkpoint import strip_prefixes, tensor_splits_of
from nanocolossal.checks import loader_length
from nanocolossal.config import AMP_TYPE
from nanocolossal.context import gpc
from nanocolossal.data import DistributedSampler
from nanocolossal.metrics import Accuracy
from nanocolossal.pipeline import build_pipeline_model
from nanocolossal.tensor.base import slice_of
from nanocolossal.trainer import Trainer, hooks

sys.path.insert(0, str(ROOT))
from train_gpt import gpt  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _lesson_worker(rank, world_size, port, x, y):
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    torch.manual_seed(0)  # every rank builds the model the reference builds
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    engine, *_ = nc.initialize(model, optimizer, nn.CrossEntropyLoss(), verbose=False)
    # my shard, samples rank, rank + 2, ...: batch k of both ranks is samples 8k to 8k + 7
    train = nc.get_dataloader(TensorDataset(x, y), shuffle=False, batch_size=4)
    Trainer(engine).fit(train, epochs=2)  # each batch: zero_grad, forward, backward, step
    return engine.model.state_dict()


def test_gloo_trainer_on_two_ranks_equals_one_process():
    """Trainer.fit on 2 ranks, each loading its shard of the data set in batches of 4, trains as
    one process stepping through the data set in batches of 8."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = torch.randn(24, 4, dtype=torch.float64), torch.randint(0, 3, (24,))  # the data set
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for epoch in range(2):
        for i in range(0, 24, 8):  # 3 global batches of 8 an epoch
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x[i:i + 8]), y[i:i + 8]).backward()
            optimizer.step()
    for rank, state in enumerate(run_ranks(_lesson_worker, 2, x, y)):
        assert_close(state, model.state_dict(), msg=lambda m: f"rank {rank}: {m}")


def _data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def _engine(config=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    engine, *_ = nc.initialize(model, opt, nn.CrossEntropyLoss(), verbose=False)
    return engine, opt


class Recorder(hooks.BaseHook):
    POINTS = ["before_train", "after_train", "before_train_epoch", "after_train_epoch",
              "before_train_iter",
              "after_train_iter", "before_test_epoch", "after_test_epoch", "before_test_iter",
              "after_test_iter"]

    def __init__(self, name, log, priority):
        super().__init__(priority)
        for point in self.POINTS:
            setattr(self, point, lambda trainer, *args, _p=point: log.append((_p, name)))


class EpochSampler(torch.utils.data.SequentialSampler):
    def __init__(self, data, log):
        super().__init__(data)
        self.log = log

    def set_epoch(self, epoch):
        self.log.append(epoch)


def test_trainer_calls_hooks_in_order_and_by_priority_and_sets_epochs():
    engine, _ = _engine()
    log, epochs = [], []
    train = torch.utils.data.DataLoader(_data(6), batch_size=3,
                                        sampler=EpochSampler(_data(6), epochs))
    test = torch.utils.data.DataLoader(_data(2, seed=1), batch_size=2)
    Trainer(engine).fit(train, epochs=2, test_dataloader=test,
                        hooks=[Recorder("late", log, priority=5),
                               Recorder("early", log, priority=1)])
    assert epochs == [0, 1]
    names = [name for _, name in log]
    assert names == ["early", "late"] * (len(log) // 2), "lower priority first at every point"
    points = [point for point, name in log if name == "early"]
    one_epoch = (["before_train_epoch"] + ["before_train_iter",
                                           "after_train_iter"] * 2 + ["after_train_epoch"]
                 + ["before_test_epoch", "before_test_iter", "after_test_iter", "after_test_epoch"])
    assert points == ["before_train"] + one_epoch * 2 + ["after_train"]


def test_trainer_schedule_needs_a_pipeline_engine():
    from nanocolossal.pipeline import GPipeSchedule
    engine, _ = _engine()
    with pytest.raises(ValueError,
                       match=r"\[rank 0\] Trainer\(schedule=...\) needs a pipeline engine"):
        Trainer(engine, schedule=GPipeSchedule(4))


def test_trainer_max_steps_stops_early_and_still_finishes():
    engine, _ = _engine()
    log = []
    trainer = Trainer(engine)
    trainer.fit(torch.utils.data.DataLoader(_data(20), batch_size=2), epochs=5, max_steps=3,
                hooks=[Recorder("r", log, 0)])
    # 3 of 10 batches: the epoch is not finished, so it is not counted as one
    assert trainer.cur_step == 3 and trainer.cur_epoch == 0 and trainer.batch_in_epoch == 3
    assert [p for p, _ in log].count("after_train_iter") == 3 and log[-1][0] == "after_train"


@pytest.mark.parametrize("batch", ["unlabelled", "a tensor of two rows"])
def test_trainer_refuses_a_batch_that_is_not_inputs_and_labels_under_accumulation(batch):
    """The read-ahead counts each group's labels before the engine sees a batch: a batch without
    them reaches the engine's refusal, not a TypeError of len(None) (or a silent unpacking)."""
    nc.gpc.config = nc.Config({"gradient_accumulation": 2})
    try:
        engine, _ = _engine()
    finally:
        nc.gpc.config = nc.Config()
    x = _data(4).tensors[0]
    loader = [(x, None)] * 3 if batch == "unlabelled" else [x[:2]] * 3
    with pytest.raises(TypeError, match=r"\[rank 0\] .*(labels are None|got a tensor)"):
        Trainer(engine).fit(loader, epochs=1)


def test_trainer_lr_hook_steps_per_optimizer_step_under_accumulation():
    nc.gpc.config = nc.Config({"gradient_accumulation": 2})
    try:
        engine, opt = _engine()
    finally:
        nc.gpc.config = nc.Config()
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    trainer = Trainer(engine)
    trainer.fit(torch.utils.data.DataLoader(_data(8), batch_size=2), epochs=1,
                hooks=[hooks.LRSchedulerHook(scheduler, by_epoch=False)])
    # 4 batches are 2 optimizer steps: cur_step counts steps, the scheduler stepped twice
    assert (
        trainer.cur_step == 2 and trainer.cur_epoch == 1 and scheduler.last_epoch == 2
        and opt.param_groups[0]["lr"] == 0.125
    )


def _accumulation_worker(rank, world_size, port, path, max_steps, resume):
    """Trainer, gradient_accumulation=2, 5 batches per rank per epoch (odd: each epoch's last
    group is one batch), 3 epochs, a checkpoint every 3 optimizer steps and at every epoch end."""
    nc.launch({"gradient_accumulation": 2}, rank=rank, world_size=world_size, host="127.0.0.1",
              port=port)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9, weight_decay=1e-2)
    engine, *_ = nc.initialize(model, opt, nn.CrossEntropyLoss(), verbose=False)
    train = nc.get_dataloader(_data(40), shuffle=True, batch_size=4)
    trainer = Trainer(engine)
    if resume:
        assert trainer.resume(path)
    trainer.fit(train, epochs=3, max_steps=max_steps,
                hooks=[hooks.SaveCheckpointHook(path, every_steps=3)])
    params = {k: v.detach().clone() for k, v in engine.model.state_dict().items()}
    return params, trainer.cur_step, trainer.cur_epoch, trainer.batch_in_epoch


@pytest.mark.parametrize("max_steps", [1, 3, 5])
def test_gloo_trainer_stopped_by_max_steps_under_accumulation_resumes_bit_identically(tmp_path,
                                                                                     max_steps):
    """max_steps counts optimizer steps, so a stop (and its checkpoint) never falls inside an
    accumulation group; every epoch ends with a step, so epoch-end checkpoints do not either.
    Stopping after `max_steps` steps and resuming equals the straight run bit for bit."""
    straight = run_ranks(_accumulation_worker, 2, str(tmp_path / "a.pt"), None, False)
    stopped = run_ranks(_accumulation_worker, 2, str(tmp_path / "b.pt"), max_steps, False)
    # 5 batches per epoch = groups of 2, 2, 1: 3 steps per epoch
    assert stopped[0][1] == max_steps
    assert stopped[0][2:] == {1: (0, 2), 3: (1, 0), 5: (1, 4)}[max_steps]  # (epoch, batch)
    resumed = run_ranks(_accumulation_worker, 2, str(tmp_path / "b.pt"), None, True)
    assert straight[0][1:] == resumed[0][1:] == (9, 3, 0)
    for (a, *_), (b, *_) in zip(straight, resumed):
        for key in a:
            assert torch.equal(a[key], b[key]), key


def _fit_worker(rank, world_size, port):
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    engine, _ = _engine()
    train = nc.get_dataloader(_data(16), shuffle=True, batch_size=4)
    test = nc.get_dataloader(_data(7, seed=1), pad=False, batch_size=2)  # uneven shards: 4 and 3
    trainer = Trainer(engine)
    trainer.fit(train, epochs=2, test_dataloader=test,
                hooks=[hooks.LossHook(), hooks.AccuracyHook(Accuracy()), hooks.ThroughputHook(),
                       hooks.LogMetricByEpochHook(nc.get_dist_logger())])
    # what one process computes on the whole test set with the trained model
    x, y = _data(7, seed=1).tensors
    with torch.no_grad():
        logits = engine.model(x)
    single_accuracy = int((logits.argmax(1) == y).sum()) / len(y)
    single_loss = nn.functional.cross_entropy(logits, y).item()
    return trainer.states["metrics"], single_accuracy, single_loss


def test_deep_trainer_metrics_are_exact_over_ranks():
    # Test shards are uneven (4 and 3 samples, one batch of 1): summed counts and sample-weighted
    # losses still give exactly what one process computes on all 7.
    for metrics, single_accuracy, single_loss in run_ranks(_fit_worker, 2):
        assert metrics["test"]["accuracy"] == pytest.approx(single_accuracy, abs=1e-12)
        assert metrics["test"]["loss"] == pytest.approx(single_loss, rel=1e-5)
        assert metrics["train"]["throughput"] > 0 and metrics["train"]["loss"] > 0


def test_log_memory_hook_reports_peak_rss_on_cpu(capsys):
    engine, _ = _engine()
    Trainer(engine).fit(torch.utils.data.DataLoader(_data(4), batch_size=2), epochs=1,
                        hooks=[hooks.LogMemoryByEpochHook(nc.get_dist_logger())])
    line = next(text for text in capsys.readouterr().out.splitlines() if "memory" in text)
    assert "[rank 0]" in line and "epoch 1 memory: peak RSS" in line
    assert int(line.split("peak RSS ")[1].split(" MiB")[0]) > 50  # a process with torch loaded


# -- the read-ahead of accumulation groups x counted targets x the Trainer's features -----------
# The read-ahead of accumulation groups (loss_weights.GroupsAhead, which the counted targets
# install on initialize's loader and the Trainer on any other; Trainer._read_groups_ahead closes
# each epoch's short last group) and the counted-target weights (loss_weights.py) where they meet
# max_steps, SaveCheckpointHook, Trainer.resume, epochs whose batch count the group size does not
# divide (with and without __len__: each epoch ends with a step), DataLoader workers, the LR hook by
# iteration, sequence parallelism's SequenceSplitLoader, 2d tensor parallelism x data with class
# weights, a pipeline with TENSOR_SHAPE, and fp16 dynamic loss scaling with an injected overflow
# under a pipeline whose micro-batches hold uneven padding.
#
# Always against ONE process on the whole batch, written here in plain torch (no Engine, no
# Trainer) where the layout is float64: the parameters, the LR, the LossHook's per-epoch train
# loss (the mean of each micro-step's whole-batch mean) to 1e-12; and a resumed run against the
# uninterrupted one, bit for bit. Each float64 case also checks that weighing the micro-steps by
# their samples (the naive way) would be visibly off, so the check has teeth. Under fp16, a rank
# holding most of the counted targets must not overflow where one process and plain DDP do not:
# backward scales by loss_scale / G (amp.py: backward_scale), so its half-precision gradients
# stay about one process's, not up to G x.

CLASSES, LR, CLIP, REL = 5, 0.3, 0.4, 1e-12
CW = torch.linspace(0.5, 2.0, CLASSES, dtype=torch.float64)  # class weights


def _max_rel(got, want):
    want = want.double()
    return (got.double() - want).abs().max().item() / (1 + want.abs().max().item())


def _state(module):
    return {k: v.detach().clone() for k, v in strip_prefixes(module.state_dict()).items()}


def _sched(opt):
    """By iteration: a different LR every optimizer step (LRSchedulerHook(by_epoch=False))."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + 0.25 * s))


class EpochLosses(hooks.BaseHook):
    """The LossHook's published train loss of every epoch (runs after LossHook publishes)."""

    def __init__(self):
        super().__init__(priority=5)
        self.values, self.lrs, self.tests = [], [], []

    def after_train_epoch(self, trainer):
        self.values.append(trainer.states["metrics"]["train"]["loss"])

    def after_test_epoch(self, trainer):
        self.tests.append(trainer.states["metrics"]["test"]["loss"])

    def after_train_iter(self, trainer, output, label, loss):
        if trainer.last_step_taken:
            self.lrs.append(trainer.engine.optimizer.param_groups[0]["lr"])


# -- a classifier with padding (ignore_index) and class weights ----------------------------------

def _mlp(dtype=torch.float64):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, CLASSES)).to(dtype)


def _criterion(dtype=torch.float64):
    return nn.CrossEntropyLoss(ignore_index=-1, weight=CW.to(dtype))


ROWS = 20  # 5 batches of 4 (global) an epoch: with N = 2 or 3 its last group is short


def _rows():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(ROWS, 6, generator=g, dtype=torch.float64)
    y = torch.randint(0, CLASSES, (ROWS,), generator=g)
    y[torch.tensor([0, 1, 2, 3, 4, 9, 13, 15, 16, 18])] = -1  # 10 of 20 are padding
    return x, y


def _test_rows():
    g = torch.Generator().manual_seed(8)
    return torch.randn(8, 6, generator=g, dtype=torch.float64), \
        torch.randint(0, CLASSES, (8,), generator=g)


def _test_loss(model, crit, ranks=2):
    """LossHook's test loss: each rank's batches of 2 rows (rows r::ranks), each batch's
    (class-weighted) mean weighed by its 2 rows."""
    x, y = _test_rows()
    with torch.no_grad():
        means = [crit(model(x[r::ranks][i:i + 2]), y[r::ranks][i:i + 2]).item()
                 for r in range(ranks) for i in range(0, 8 // ranks, 2)]
    return sum(means) / len(means)


def _epoch_order(epoch, shuffle=True):
    """The rows of the global batches of `epoch`, as nanocolossal's sampler deals them (one
    replica: the order; data rank r of D takes every D-th of it)."""
    s = DistributedSampler(range(ROWS), num_replicas=1, rank=0, shuffle=shuffle, seed=5)
    s.set_epoch(epoch)
    return list(s)


def _global_batches(epoch, batch=4):
    x, y = _rows()
    order = _epoch_order(epoch)
    return [(x[order[i:i + batch]], y[order[i:i + batch]]) for i in range(0, ROWS, batch)]


class Stream:
    """A generator-like loader: no __len__; each epoch a new order (a `sampler` with set_epoch,
    as Progress looks for one), this data rank's rows of each global batch."""

    def __init__(self, rank, size):
        self.rank, self.size, self.epoch = rank, size, 0
        self.sampler = self

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        for x, y in _global_batches(self.epoch):
            yield x[self.rank::self.size], y[self.rank::self.size]


class StreamDataset(torch.utils.data.IterableDataset):
    """The same stream as torch users write it: an IterableDataset with set_epoch, read by a
    DataLoader (which has `__len__`, raising TypeError: no length either)."""

    def __init__(self, rank, size):
        self.stream = Stream(rank, size)

    def set_epoch(self, epoch):
        self.stream.set_epoch(epoch)

    def __iter__(self):
        return iter(self.stream)


def _reference(epochs, N, naive=False, model=None, crit=None, batches=_global_batches, lr=LR,
               clip=CLIP, test=False):
    """One process on the whole batch, in plain torch, following the Trainer's documented
    grouping: groups of N batches from each epoch's start, and every epoch ends with a step (its
    short last group of k weighs k / N of its counted mean), with or without a loader length.
    `naive`: each micro-step weighs its own mean / N (what the counts fix)."""
    model = _mlp() if model is None else model
    crit = _criterion() if crit is None else crit
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    sched = _sched(opt)
    steps, epoch_losses, lrs, tests = 0, [], [], []
    for epoch in range(epochs):
        todo, losses = list(batches(epoch)), []
        while todo:
            group, todo = todo[:N], todo[N:]
            with torch.no_grad():
                losses += [(crit(model(x), y).item(), len(y)) for x, y in group]
            if naive:
                for b in group:
                    (crit(model(b[0]), b[1]) / N).backward()
            else:
                x, y = (torch.cat(t) for t in zip(*group))
                loss = crit(model(x), y)
                assert torch.isfinite(loss)
                (loss * len(group) / N).backward()
            if clip:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            sched.step()
            opt.zero_grad()
            steps += 1
            lrs.append(opt.param_groups[0]["lr"])
        epoch_losses.append(sum(v * n for v, n in losses) / sum(n for _, n in losses))
        tests.append(_test_loss(model, crit) if test else None)
    return (_state(model), epoch_losses, lrs, steps) + ((tests,) if test else ())


def _cls_worker(rank, world, port, config, how):
    """how: loader ('sized', 'stream' or 'iterable'), num_workers, max_steps, resume, path,
    epochs."""
    nc.launch(config, rank=rank, world_size=world, host="127.0.0.1", port=port, timeout=30)
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sched = _sched(opt)
    if how["loader"] == "sized":
        x, y = _rows()
        train = nc.get_dataloader(torch.utils.data.TensorDataset(x, y), shuffle=True, seed=5,
                                  batch_size=4 // gpc.data_size,
                                  num_workers=how.get("num_workers", 0),
                                  multiprocessing_context="fork" if how.get("num_workers") else
                                  None)
    elif how["loader"] == "iterable":
        train = torch.utils.data.DataLoader(StreamDataset(gpc.data_rank, gpc.data_size),
                                            batch_size=None)
    else:
        train = Stream(gpc.data_rank, gpc.data_size)
    test = None
    if how.get("test"):  # evaluated after every epoch
        tx, ty = _test_rows()
        test = nc.get_dataloader(torch.utils.data.TensorDataset(tx, ty), batch_size=2, pad=False)
    engine, train, test, _ = nc.initialize(model, opt, _criterion(), train, test, verbose=False)
    trainer = Trainer(engine)
    if how.get("resume"):
        assert trainer.resume(how["path"], sched)
    record = EpochLosses()
    # saved at every epoch's end (each ends with a step, with or without a loader length) and
    # every 2 steps
    save = hooks.SaveCheckpointHook(how["path"], interval=1, lr_scheduler=sched,
                                    every_steps=how.get("every_steps"))
    # the pooled ranks are daemonic processes, which may not start DataLoader workers: lift that
    # for this job (the workers end with each epoch's iterator), as test_sequence.py does
    import multiprocessing
    mp_config = multiprocessing.current_process()._config
    daemon = mp_config.get("daemon")
    mp_config["daemon"] = False
    try:
        trainer.fit(train, how["epochs"], test, max_steps=how.get("max_steps"),
                    hooks=[hooks.LossHook(), hooks.LRSchedulerHook(sched, by_epoch=False), record,
                           save])
    finally:
        mp_config["daemon"] = daemon
    return dict(state=_state(engine.model), losses=record.values, lrs=record.lrs,
                step=trainer.cur_step, epoch=trainer.cur_epoch, tests=record.tests,
                accumulating=engine.accumulating)


def _check_against(run, ref_state, what):
    bad = {k: _max_rel(v, ref_state[k]) for k, v in run["state"].items()
           if not _max_rel(v, ref_state[k]) < REL}
    assert not bad, f"{what}: parameters differ from one process: {bad}"


ZERO2 = {"zero": {"level": 2}}
CLS_CASES = {  # name: (world, config, N, loader, num_workers, epochs, stop at)
    "data2 N=3 sized": (2, {}, 3, "sized", 0, 3, 3),
    "data2 N=2 sized num_workers=1": (2, {}, 2, "sized", 1, 2, 2),
    "handler data2 N=3 sized": (2, {"gradient_handler": [{"type": "DataParallelGradientHandler"}]},
                                3, "sized", 0, 2, 1),
    "data2 N=2 stream": (2, {}, 2, "stream", 0, 3, 4),
    "data2 N=3 stream": (2, {}, 3, "stream", 0, 3, 3),
    "data2 N=3 DataLoader(IterableDataset)": (2, {}, 3, "iterable", 0, 3, 3),
    # stopped by the step that closes epoch 1's short last group (its 5th batch alone)
    "data2 N=2 stream, stop at a short last group": (2, {}, 2, "stream", 0, 3, 3),
    # stopped by the step that ends epoch 2 exactly: resumed, epoch 2 has nothing left
    "data2 N=3 stream, stop at an epoch's end": (2, {}, 3, "stream", 0, 4, 4),
    # evaluated after every epoch, right after the step that closes its short last group
    "data2 N=2 stream, test set": (2, {}, 2, "stream", 0, 3, 4),
    "zero2 data2 N=2 stream, test set": (2, ZERO2, 2, "stream", 0, 3, 4),
    "zero3 data2 N=3 stream, test set": (2, {"zero": {"level": 3}}, 3, "stream", 0, 3, 3),
    "zero1 data2 N=3 sized, test set": (2, {"zero": {"level": 1}}, 3, "sized", 0, 2, 1),
}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", CLS_CASES)
def test_deep_readahead_x_max_steps_x_checkpoint_x_resume_equals_one_process(name, tmp_path):
    """20 rows (11 padded), 5 global batches of 4 an epoch, accumulation N: the run stopped by
    max_steps mid-epoch, checkpointed and resumed, ends bit-identical to the uninterrupted run,
    and both are one process's (parameters, the LR hook's LRs, LossHook's epoch losses)."""
    world, extra, N, loader, workers, epochs, stop = CLS_CASES[name]
    config = dict(extra, gradient_accumulation=N, clip_grad_norm=CLIP)
    test = "test set" in name
    ref_state, ref_losses, ref_lrs, ref_steps, *ref_tests = _reference(epochs, N, test=test)
    naive_state = _reference(epochs, N, naive=True)[0]
    assert max(_max_rel(v, ref_state[k]) for k, v in naive_state.items()) > 1e-4, "no teeth"
    how = dict(loader=loader, num_workers=workers, epochs=epochs, every_steps=2, test=test)
    whole = run_ranks(_cls_worker, world, config, dict(how, path=str(tmp_path / "a")),
                      timeout=90)
    first = run_ranks(_cls_worker, world, config,
                      dict(how, path=str(tmp_path / "b"), max_steps=stop), timeout=90)
    rest = run_ranks(_cls_worker, world, config, dict(how, path=str(tmp_path / "b"),
                                                      resume=True), timeout=90)
    for rank in range(world):
        w, f, r = whole[rank], first[rank], rest[rank]
        assert w["step"] == r["step"] == ref_steps and f["step"] == stop, (w["step"], r["step"])
        _check_against(w, ref_state, f"{name} uninterrupted rank {rank}")
        for key, value in w["state"].items():  # bit for bit
            assert torch.equal(value, r["state"][key]), (name, rank, key)
        assert w["lrs"] == pytest.approx(ref_lrs, rel=REL)
        assert f["lrs"] + r["lrs"] == w["lrs"], (f["lrs"], r["lrs"], w["lrs"])
        assert w["losses"] == pytest.approx(ref_losses, rel=REL), (w["losses"], ref_losses)
        # the resumed run's last epoch is whole: its loss is the uninterrupted run's
        assert r["losses"][-1] == w["losses"][-1], (r["losses"], w["losses"])
        assert w["accumulating"] == r["accumulating"]
        if test:
            assert w["tests"] == pytest.approx(ref_tests[0], rel=REL), (w["tests"], ref_tests)
            assert r["tests"][-1] == w["tests"][-1]


# -- a GPT: sequence parallelism's SequenceSplitLoader, 2d with class weights -------------------

VOCAB, SEQ = 16, 8
TW = torch.linspace(0.5, 2.0, VOCAB, dtype=torch.float64)  # class (token) weights, where asked


def _gpt():
    torch.manual_seed(0)
    return gpt(vocab=VOCAB, seq_len=SEQ, dim=8, depth=2, heads=2, mlp_ratio=2).double()


KEEP = torch.tensor([0, 1, 1, 2, 3, 8])


def _token_batches(epoch, batch=4, per_epoch=5):
    """Global batches of `batch` rows; row i keeps its first k targets (k in KEEP: uneven over
    rows, micro-steps and the sequence's zig-zag chunks), the rest is -100."""
    g = torch.Generator().manual_seed(300 + epoch)
    out = []
    for _ in range(per_epoch):
        t = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
        x, y = t[:, :-1], t[:, 1:].clone()
        keep = KEEP[torch.randint(0, len(KEEP), (batch,), generator=g)]
        keep[torch.randint(0, batch, (1,), generator=g)] = 8  # no micro-step of only padding
        for i, k in enumerate(keep.tolist()):
            y[i, k:] = -100
        out.append((x, y))
    return out


class TokenStream(Stream):
    def __iter__(self):
        for x, y in _token_batches(self.epoch):
            n = len(x) // self.size
            yield x[self.rank * n:][:n], y[self.rank * n:][:n]


def _lm_criterion(weighted):
    def crit(logits, y):
        return F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1),
                               weight=TW if weighted else None)
    return crit


def _gpt_worker(rank, world, port, config, how, expected):
    nc.launch(config, rank=rank, world_size=world, host="127.0.0.1", port=port, timeout=60)
    model = _gpt()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sched = _sched(opt)
    if how["sized"]:
        x, y = (torch.cat(t) for t in zip(*_token_batches(0)))
        # no shuffle: data rank r's batch i is rows r::D of global batch i (the sampler deals
        # every D-th row)
        train = nc.get_dataloader(torch.utils.data.TensorDataset(x, y), shuffle=False,
                                  batch_size=4 // gpc.data_size)
    else:
        train = TokenStream(gpc.data_rank, gpc.data_size)
    crit = col_nn.VocabParallelCrossEntropyLoss(weight=TW if how["weighted"] else None)
    engine, train, *_ = nc.initialize(model, opt, crit, train, verbose=False)
    assert (loader_length(train) is not None) == how["sized"]
    # the group read-ahead of counted targets outside the split: it counts this rank's tokens
    assert type(train).__name__ == "GroupsAhead", type(train)
    if gpc.sequence_size > 1:
        assert type(train.loader).__name__ == "SequenceSplitLoader", type(train.loader)
    trainer = Trainer(engine)
    if how.get("resume"):
        assert trainer.resume(how["path"], sched)
    record = EpochLosses()
    trainer.fit(train, how["epochs"], max_steps=how.get("max_steps"),
                hooks=[hooks.LossHook(), hooks.LRSchedulerHook(sched, by_epoch=False), record,
                       hooks.SaveCheckpointHook(how["path"], interval=1000, lr_scheduler=sched)])
    layout = tensor_splits_of(engine.model)
    state = strip_prefixes(engine.model.state_dict())
    diffs = {k: _max_rel(v, slice_of(expected[k], layout[k])) for k, v in state.items()}
    return dict(diffs=diffs, state=_state(engine.model), losses=record.values, lrs=record.lrs,
                step=trainer.cur_step)


def _sized_token_batches(epoch):
    """What a sized, unshuffled loader over epoch 0's rows deals every epoch, by data rank r of
    D: rows r::D of each global batch (the same rows, in another order: the mean is the same)."""
    return _token_batches(0)


def _check_gpt(runs, ref, what, whole=None):
    ref_state, ref_losses, ref_lrs, ref_steps = ref
    for rank, run in enumerate(runs):
        bad = {k: d for k, d in run["diffs"].items() if not d < REL}
        assert not bad, f"{what} rank {rank}: parameters differ from one process: {bad}"
        assert run["step"] == ref_steps, (what, rank, run["step"], ref_steps)
        assert run["lrs"] == pytest.approx(ref_lrs[-len(run["lrs"]):], rel=REL), what
        if whole is None:
            assert run["losses"] == pytest.approx(ref_losses, rel=REL), \
                (what, rank, run["losses"], ref_losses)
        else:  # resumed: bit for bit the uninterrupted run
            for key, value in run["state"].items():
                assert torch.equal(value, whole[rank]["state"][key]), (what, rank, key)
            assert run["losses"][-1] == whole[rank]["losses"][-1]


@pytest.mark.timeout(150)
def test_deep_sequence_split_loader_x_stream_x_readahead_x_resume_equals_one_process(tmp_path):
    """sequence 2 x data 2, a loader without __len__ (initialize wraps it in a
    SequenceSplitLoader), trailing padding uneven over rows, ranks, zig-zag chunks and
    micro-steps; N = 2 over 5 batches an epoch, 3 epochs (each ending with a group of one);
    stopped by max_steps at 4, resumed."""
    config = dict(parallel=dict(tensor=dict(size=2, mode="sequence")), gradient_accumulation=2,
                  clip_grad_norm=CLIP)
    ref = _reference(3, 2, model=_gpt(), crit=_lm_criterion(False), batches=_token_batches)
    naive = _reference(3, 2, model=_gpt(), crit=_lm_criterion(False),
                       batches=_token_batches, naive=True)[0]
    assert max(_max_rel(v, ref[0][k]) for k, v in naive.items()) > 1e-4, "no teeth"
    how = dict(sized=False, weighted=False, epochs=3)
    whole = run_ranks(_gpt_worker, 4, config, dict(how, path=str(tmp_path / "a")), ref[0],
                      timeout=120)
    _check_gpt(whole, ref, "sequence 2 x data 2")
    run_ranks(_gpt_worker, 4, config, dict(how, path=str(tmp_path / "b"), max_steps=4), ref[0],
              timeout=120)
    rest = run_ranks(_gpt_worker, 4, config, dict(how, path=str(tmp_path / "b"), resume=True),
                     ref[0], timeout=120)
    _check_gpt(rest, ref, "sequence 2 x data 2, resumed", whole)


@pytest.mark.timeout(150)
def test_deep_2d_class_weights_x_readahead_equals_one_process(tmp_path):
    """2d on 4 ranks (its grid splits the batch, as data ranks would), the vocab-parallel loss
    with class weights and padding, a sized loader of 5 batches an epoch, N = 2 (an epoch's last
    group of one), 1 epoch."""
    config = dict(parallel=dict(tensor=dict(size=4, mode="2d")), gradient_accumulation=2,
                  clip_grad_norm=CLIP)
    ref = _reference(1, 2, model=_gpt(), crit=_lm_criterion(True),
                     batches=_sized_token_batches)
    naive = _reference(1, 2, model=_gpt(), crit=_lm_criterion(True),
                       batches=_sized_token_batches, naive=True)[0]
    assert max(_max_rel(v, ref[0][k]) for k, v in naive.items()) > 1e-4, "no teeth"
    runs = run_ranks(_gpt_worker, 4, config, dict(sized=True, weighted=True, epochs=1,
                                                  path=str(tmp_path / "a")), ref[0], timeout=120)
    _check_gpt(runs, ref, "2d x4")


# -- a pipeline: TENSOR_SHAPE x the Trainer's resume; fp16 with an overflow -----------------------

def _float32_engine(model, global_batch):
    """The float32 MLP's engine, shuffled loader of _rows (global_batch rows a step) and
    scheduler."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sched = _sched(opt)
    x, y = _rows()
    train = nc.get_dataloader(torch.utils.data.TensorDataset(x.float(), y), shuffle=True, seed=5,
                              batch_size=global_batch // gpc.data_size)
    engine, train, *_ = nc.initialize(model, opt, _criterion(torch.float32), train,
                                      verbose=False)
    return engine, train, sched


def _pipe_worker(rank, world, port, config, how):
    nc.launch(config, rank=rank, world_size=world, host="127.0.0.1", port=port, timeout=60)
    model = _mlp(torch.float32)
    if gpc.pipeline_size > 1:
        model = build_pipeline_model(model, partition="uniform")
    engine, train, sched = _float32_engine(model, 8)
    trainer = Trainer(engine)
    if how.get("resume"):
        assert trainer.resume(how["path"], sched)
    record, last = EpochLosses(), hooks.LastLossHook()
    trainer.fit(train, how["epochs"], max_steps=how.get("max_steps"),
                hooks=[hooks.LossHook(), last, hooks.LRSchedulerHook(sched, by_epoch=False),
                       record, hooks.SaveCheckpointHook(how["path"], lr_scheduler=sched)])
    return dict(state=_state(engine.model), losses=record.values, lrs=record.lrs,
                step=trainer.cur_step, last=last.value)


@pytest.mark.timeout(150)
def test_deep_pipeline_x_tensor_shape_x_trainer_resume_with_padding_equals_one_process(tmp_path):
    """pipeline 2 x data 2, 1F1B, 2 micro-batches of 2 rows (TENSOR_SHAPE [2, 16]; the epoch's
    last batch of 2 rows a rank has micro-batches of 1, which TENSOR_SHAPE does not fix), float32;
    padding uneven over micro-batches and ranks; 3 batches an epoch, 2 epochs, stopped at step 2
    and resumed: one process's parameters, LRs and losses (float32), the resumed run bit for bit
    the uninterrupted one."""
    config = dict(parallel=dict(pipeline=2), NUM_MICRO_BATCHES=2, TENSOR_SHAPE=[2, 16],
                  clip_grad_norm=CLIP)
    ref_state, ref_losses, ref_lrs, ref_steps = _reference(
        2, 1, model=_mlp(torch.float32), crit=_criterion(torch.float32),
        batches=lambda e: [(x.float(), y) for x, y in _global_batches(e, 8)])
    whole = run_ranks(_pipe_worker, 4, config, dict(epochs=2, path=str(tmp_path / "a")),
                      timeout=90)
    run_ranks(_pipe_worker, 4, config, dict(epochs=2, path=str(tmp_path / "b"), max_steps=2),
              timeout=90)
    rest = run_ranks(_pipe_worker, 4, config, dict(epochs=2, path=str(tmp_path / "b"),
                                                   resume=True), timeout=90)
    for rank in range(4):
        w, r = whole[rank], rest[rank]
        assert w["step"] == r["step"] == ref_steps
        for key, value in w["state"].items():
            assert _max_rel(value, ref_state[key]) < 1e-5, (rank, key)
            assert torch.equal(value, r["state"][key]), (rank, key)
        assert w["lrs"] == pytest.approx(ref_lrs, rel=1e-6)
        assert w["losses"] == pytest.approx(ref_losses, rel=1e-5), (w["losses"], ref_losses)
        assert r["losses"][-1] == w["losses"][-1] and r["last"] == w["last"]


AMP_MODES = {
    "NAIVE fp16": (dict(mode=AMP_TYPE.NAIVE, dtype="float16", initial_scale=2.0 ** 8,
                        growth_interval=2), 5e-3),
    "APEX O2 fp16": (dict(mode=AMP_TYPE.APEX, opt_level="O2", dtype="float16",
                          loss_scale="dynamic"), 5e-3),
}


def _amp_pipe_worker(rank, world, port, config, inject):
    nc.launch(config, rank=rank, world_size=world, host="127.0.0.1", port=port, timeout=60)
    model = _mlp(torch.float32)
    before = {k: v.detach().double().clone() for k, v in model.state_dict().items()}
    if gpc.pipeline_size > 1:
        model = build_pipeline_model(model, partition="uniform")
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                               _criterion(torch.float32), verbose=False)
    n = 8 // gpc.data_size
    batches = [(x[gpc.data_rank * n:][:n].float(), y[gpc.data_rank * n:][:n])
               for e in range(2) for x, y in _global_batches(e, 8)[:2]]
    # the overflow: an inf in a gradient of the last stage at step `inject`
    last = gpc.pipeline_rank == gpc.pipeline_size - 1
    out = record_steps(engine, batches, (inject, [gpc.rank] if last else []))
    after = strip_prefixes(engine.model.state_dict())
    out["delta"] = {k: v.detach().double() - before[k] for k, v in after.items()}
    out["ulp"] = {k: torch.finfo(v.dtype).eps * v.detach().double().abs().max().item()
                  for k, v in after.items()}
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", AMP_MODES)
def test_deep_fp16_overflow_under_a_pipeline_with_uneven_padding_equals_one_process(mode):
    """pipeline 2 x data 2, 4 micro-batches of 1 row a rank (padding spread unevenly over them:
    some count nothing), fp16 dynamic loss scaling, an inf injected into the last stage's
    gradient at step 1: skipped steps, loss scales, reported losses and every parameter's update
    are one process's under the same AMP settings, to half precision."""
    fp16, tol = AMP_MODES[mode]
    config = dict(fp16=fp16, clip_grad_norm=1.0)
    ref = run_ranks(_amp_pipe_worker, 1, config, 1, timeout=60)[0]
    assert ref["took"] == [True, False, True, True], ref["took"]
    runs = run_ranks(_amp_pipe_worker, 4, dict(config, parallel=dict(pipeline=2),
                                               NUM_MICRO_BATCHES=4), 1, timeout=90)
    for rank, run in enumerate(runs):
        assert run["took"] == ref["took"], (rank, run["took"], ref["took"])
        assert run["scales"] == ref["scales"], (rank, run["scales"], ref["scales"])
        assert run["losses"] == pytest.approx(ref["losses"], rel=tol), (rank, run["losses"],
                                                                       ref["losses"])
        bad = half_update_mismatches(run, ref, tol)
        assert not bad, (mode, rank, bad)



# -- fp16 x accumulation under the Trainer: an overflow in the middle of a counted group ----------

class Overflow(hooks.BaseHook):
    """An inf in the first layer's gradient at training iteration `at`, on the ranks `ranks`."""

    def __init__(self, at, ranks):
        super().__init__(priority=0)
        self.at, self.ranks, self.i, self.handle = at, ranks, 0, None

    def before_train_iter(self, trainer):
        if self.i == self.at and gpc.rank in self.ranks:
            first = next(p for p in trainer.engine.model.parameters() if p.requires_grad)
            self.handle = first.register_hook(
                lambda g: g.index_fill(0, torch.tensor([0]), float("inf")))

    def after_train_iter(self, trainer, output, label, loss):
        self.i += 1
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def _amp_trainer_worker(rank, world, port, config, at):
    nc.launch(config, rank=rank, world_size=world, host="127.0.0.1", port=port, timeout=60)
    model = _mlp(torch.float32)
    before = {k: v.detach().double().clone() for k, v in model.state_dict().items()}
    engine, train, sched = _float32_engine(model, 4)
    trainer, record = Trainer(engine), EpochLosses()
    scales, took = [], []

    class Scales(hooks.BaseHook):
        def after_train_iter(self, trainer, output, label, loss):
            if trainer.step_ended:
                scales.append(engine.optimizer.loss_scale)
                took.append(trainer.last_step_taken)

    trainer.fit(train, 2, hooks=[hooks.LossHook(), hooks.LRSchedulerHook(sched, by_epoch=False),
                                 record, Scales(), Overflow(at, [world - 1])])
    after = strip_prefixes(engine.model.state_dict())
    return dict(losses=record.values, scales=scales, took=took, lrs=record.lrs,
                delta={k: v.detach().double() - before[k] for k, v in after.items()},
                ulp={k: torch.finfo(v.dtype).eps * v.detach().double().abs().max().item()
                     for k, v in after.items()})


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", AMP_MODES)
def test_deep_fp16_overflow_inside_a_counted_group_under_the_trainer_equals_one_process(mode):
    """data 2, gradient_accumulation=2 over 5 batches an epoch (groups 2, 2, 1), 2 epochs, an inf
    on rank 1 in the second micro-step of the 2nd group: that group's step is skipped, the next
    group is counted afresh; steps taken, scales, LRs, LossHook's losses and every update are one
    process's (the same Trainer on the whole batch) under the same AMP settings."""
    fp16, tol = AMP_MODES[mode]
    config = dict(fp16=fp16, clip_grad_norm=1.0, gradient_accumulation=2)
    ref = run_ranks(_amp_trainer_worker, 1, config, 3, timeout=60)[0]
    assert ref["took"] == [True, False, True, True, True, True], ref["took"]
    for rank, run in enumerate(run_ranks(_amp_trainer_worker, 2, config, 3, timeout=60)):
        assert (run["took"], run["scales"]) == (ref["took"], ref["scales"]), (rank, run, ref)
        assert run["lrs"] == ref["lrs"]
        assert run["losses"] == pytest.approx(ref["losses"], rel=tol), (rank, run["losses"])
        bad = half_update_mismatches(run, ref, tol)
        assert not bad, (mode, rank, bad)


# -- fp16: the counted weights' factor G makes a lopsided rank's gradient G x one process's -------

class PlainMean:
    """torch's loss without `reduction` / `ignore_index` attributes: not weighed (plain DDP, each
    rank its own mean)."""

    def __call__(self, out, y):
        return F.cross_entropy(out, y, weight=CW.to(out.dtype), ignore_index=-1)


def _lopsided_fp16_worker(rank, world, port, config, plain):
    nc.launch(config, rank=rank, world_size=world, host="127.0.0.1", port=port, timeout=60)
    model = _mlp(torch.float32)
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               PlainMean() if plain else _criterion(torch.float32), verbose=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 6, generator=g) * 30
    y = torch.randint(0, CLASSES, (8,), generator=g)
    y[:3] = -1  # on 2 data ranks rank 0 (rows 0-3) counts 1 target, rank 1 (rows 4-7) 4
    n = 8 // gpc.data_size
    return record_steps(engine, [(x[gpc.data_rank * n:][:n], y[gpc.data_rank * n:][:n])] * 2)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", AMP_MODES)
def test_deep_fp16_lopsided_padding_overflows_where_one_process_does_not(mode):
    """data 2, rank 0 counting 1 target and rank 1 four (class-weighted): rank 1's weight is
    2 x W_1 / W (about 1.7); multiplied into the loss before backward, its half-precision
    gradients would be that much larger than one process's. At loss scale 2^16 (one process's
    largest that does not overflow here) one process and plain DDP take both steps, and so must
    the counted layout (backward scales by loss_scale / G, amp.py: backward_scale), with the
    same scales: not took [False, True], scales [32768, 32768] vs [True, True], [65536, 65536]."""
    fp16 = dict(AMP_MODES[mode][0])
    if mode.startswith("NAIVE"):
        fp16.update(initial_scale=2.0 ** 16, growth_interval=1000)
    else:
        fp16.update(init_scale=2.0 ** 16)
    config = dict(fp16=fp16)
    ref = run_ranks(_lopsided_fp16_worker, 1, config, False, timeout=60)[0]
    plain = run_ranks(_lopsided_fp16_worker, 2, config, True, timeout=60)[0]
    if ref["took"] != [True, True] or plain["took"] != ref["took"]:  # the premise
        pytest.skip(f"one process or plain DDP overflows at 2^16 here: {ref}, {plain}")
    for run in run_ranks(_lopsided_fp16_worker, 2, config, False, timeout=60):
        assert (run["took"], run["scales"]) == (ref["took"], ref["scales"]), (run, ref)
