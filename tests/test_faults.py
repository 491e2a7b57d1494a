"""Distributed failures end in errors that name the rank, within the timeout -- never in a hang."""
import os
import re
import signal
import time

import pytest
import torch
from dist_helpers import run_ranks
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import nanocolossal as nc
from nanocolossal.pipeline import build_pipeline_model
from nanocolossal.trainer import Trainer, hooks

pytestmark = pytest.mark.timeout(120)
TIMEOUT = 8  # the job's collective timeout in these tests


def _layers():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _engine(config, rank, world_size, port, pipeline=False, criterion=None):
    nc.launch({"timeout": TIMEOUT, **config}, rank=rank, world_size=world_size, host="127.0.0.1",
              port=port)
    model = build_pipeline_model(_layers(), partition="uniform") if pipeline else _layers()
    engine, *_ = nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               criterion or nn.CrossEntropyLoss(), verbose=False)
    return engine


def _plain_cross_entropy(output, label):
    """A criterion the engine does not count targets for (no ignore_index): no collective of its
    own, so DDP's bucket all-reduce is a step's first."""
    return F.cross_entropy(output, label)


def _data(n):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g))


def _fit_error(engine, loader, hook_list=None):
    try:
        Trainer(engine).fit(loader, epochs=1, hooks=hook_list)
    except RuntimeError as e:
        return str(e)
    return "no error"


def _uneven_worker(rank, world_size, port):
    engine = _engine({}, rank, world_size, port)
    # 3 vs 2 batches
    return _fit_error(engine, DataLoader(_data(12 if rank == 0 else 8), batch_size=4))


def test_gloo_uneven_batch_counts_are_reported_before_training():
    for rank, message in enumerate(run_ranks(_uneven_worker, 2, timeout=60)):
        expected = (f"[rank {rank}] ranks disagree on the number of training batches per epoch: "
                    "rank 0: 3, rank 1: 2")
        assert expected in message


class _Shard(IterableDataset):
    """A rank's own stream of `n` rows (no length: nothing to compare before training)."""

    def __init__(self, n):
        self.data = _data(n)

    def __iter__(self):
        return iter(self.data)


def _stream_worker(rank, world_size, port, rows, own_loop):
    engine = _engine({}, rank, world_size, port)
    loader = DataLoader(_Shard(rows[rank]), batch_size=4)
    start = time.monotonic()
    if not own_loop:
        return _fit_error(engine, loader), time.monotonic() - start
    try:
        for x, y in nc.data.agreed_stream(loader):  # a loop of one's own agrees the same way
            engine.zero_grad()
            engine.backward(engine.criterion(engine(x), y))
            engine.step()
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    return "no error", time.monotonic() - start


@pytest.mark.parametrize("own_loop", [False, True], ids=["trainer", "own_loop"])
def test_gloo_streams_of_unequal_lengths_fail_at_once_naming_the_ranks(own_loop):
    """Streams (here DataLoaders over IterableDatasets) have no length to compare up front: the
    ranks agree on every batch instead, so equal streams train to their end and a stream that
    ends on rank 1 first (3 vs 2 batches) is an error on both ranks at once, not a timeout."""
    for rank, (message, _) in enumerate(run_ranks(_stream_worker, 2, (12, 12), own_loop)):
        assert message == "no error", f"rank {rank}: {message}"
    for rank, (message, seconds) in enumerate(run_ranks(_stream_worker, 2, (12, 8), own_loop)):
        assert (f"[rank {rank}] the ranks' data streams have unequal lengths: after 2 batches, "
                f"rank(s) [0] have another and rank(s) [1] have none") in message
        assert "same length (drop the remainder)" in message and "DistributedSampler" in message
        assert seconds < TIMEOUT


def _transform(x):
    return x


def _config_worker(rank, world_size, port, batch_sizes):
    # functions and objects repr with a memory address, different in every process: not a difference
    config = {"BATCH_SIZE": batch_sizes[rank], "transform": _transform,
              "loss": nn.CrossEntropyLoss(), "nested": {"fn": lambda x: x, "sizes": (1, 2)}}
    try:
        engine = _engine(config, rank, world_size, port)
    except RuntimeError as e:  # initialize compares the ranks' configs, for any loop
        return f"initialize: {e}"
    return _fit_error(engine, DataLoader(_data(8), batch_size=4))


def test_gloo_config_that_differs_between_ranks_is_named():
    """Named by initialize, before a step: the Engine's own loop included."""
    for rank, message in enumerate(run_ranks(_config_worker, 2, (32, 64), timeout=60)):
        differs = f"the config differs between rank {rank} and rank {1 - rank} in ['BATCH_SIZE']"
        assert f"[rank {rank}] {differs}" in message
        assert message.startswith("initialize: "), message  # before any step, not at fit


def test_gloo_config_with_functions_and_objects_is_not_a_false_difference():
    assert run_ranks(_config_worker, 2, (32, 32), timeout=60) == ["no error", "no error"]


def _zero3_model_worker(rank, world_size, port):
    nc.launch({"timeout": TIMEOUT, "zero": {"level": 3}}, rank=rank, world_size=world_size,
              host="127.0.0.1", port=port)
    model = nn.Sequential(nn.Linear(4, 4 + rank), nn.Linear(4 + rank, 2))  # rank 1's differs
    try:
        nc.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_gloo_models_that_differ_between_ranks_are_named_under_zero3():
    """ZeRO 3 shards what it is given: different models would make shards of different sizes."""
    for rank, message in enumerate(run_ranks(_zero3_model_worker, 2, timeout=60)):
        assert f"[rank {rank}] the model (stage 0) differs between rank {rank} and rank" in message


def test_comparable_config_values():
    from nanocolossal.checks import comparable
    assert comparable({"a": [1, (2.0, "x")],
                       "f": _transform}) == comparable({"a": [1, (2.0, "x")], "f": _transform})
    assert comparable({"a": [1, 2]}) != comparable({"a": (1, 2)}) != comparable({"a": [1, 3]})
    assert comparable(nn.ReLU()) != comparable(nn.Tanh())
    assert comparable(len) != comparable(_transform)


def _kill_worker(rank, world_size, port, pipeline, criterion=None):
    config = {"parallel": {"pipeline": 2}, "NUM_MICRO_BATCHES": 2} if pipeline else {}
    engine = _engine(config, rank, world_size, port, pipeline, criterion)
    x, y = _data(8).tensors
    start = time.monotonic()
    try:
        for step in range(20):
            if rank == 1 and step == 3:
                os.kill(os.getpid(), signal.SIGKILL)  # dies mid-epoch, without a word
            engine.zero_grad()
            if pipeline:
                engine.execute_schedule((x, y))
            else:
                engine.backward(engine.criterion(engine(x), y))
            engine.step()
    except RuntimeError as e:
        raise RuntimeError(f"{e} [after {time.monotonic() - start:.1f} s]") from e


@pytest.mark.parametrize("case", ["ddp", "ddp-uncounted", "pipeline"])
def test_deep_killed_rank_makes_the_survivor_fail_clearly_and_quickly(case):
    with pytest.raises(AssertionError) as info:  # both ranks fail; the report holds both stories
        run_ranks(_kill_worker, 2, case == "pipeline",
                  _plain_cross_entropy if case == "ddp-uncounted" else None,
                  timeout=60, grace=TIMEOUT + 15)
    report = str(info.value)
    assert "--- rank 1: died with exit code -9" in report
    if case == "pipeline":
        assert "[rank 0] pipeline transfer with rank(s) [1] failed at 1f1b step" in report
    else:  # a step's first collective: the count of the loss's targets (loss_weights.py), or
        assert {"ddp": "[rank 0] the all-reduce of the loss's target count (loss_weights.py) "
                       "failed",  # for a criterion that counts none, DDP's
                "ddp-uncounted": "[rank 0] DDP gradient all-reduce of bucket 1 of 1 failed"
                }[case] in report
        assert "data-parallel group [0, 1]" in report
    seconds = float(re.search(r"\[after ([0-9.]+) s\]", report).group(1))
    assert seconds < TIMEOUT + 10, f"the survivor took {seconds} s to notice"


BARRIER_TIMEOUT = 2  # short: the test waits it out


class Stall(hooks.BaseHook):
    """Rank 1 stays alive but never reaches the end-of-epoch barrier in time."""

    def after_train_epoch(self, trainer):
        if nc.gpc.rank == 1:
            time.sleep(BARRIER_TIMEOUT + 1)  # back well after rank 0 gave up


def _absent_worker(rank, world_size, port):
    engine = _engine({"debug": True, "timeout": BARRIER_TIMEOUT}, rank, world_size, port)
    start = time.monotonic()
    message = _fit_error(engine, DataLoader(_data(8), batch_size=4), [Stall()])
    return message, time.monotonic() - start, os.environ.get("TORCH_DISTRIBUTED_DEBUG")


def test_deep_debug_barrier_names_the_rank_that_did_not_arrive():
    (message, seconds, debug_env), _ = run_ranks(_absent_worker, 2, timeout=90)
    assert "[rank 0] debug barrier at the end of epoch 1 failed" in message
    assert "Ranks 1 failed to pass monitoredBarrier" in message  # torch names the absent rank
    # rank 0 gave up at the timeout, before the stalled rank came back
    assert seconds < BARRIER_TIMEOUT + 2, seconds
    assert debug_env == "DETAIL"
