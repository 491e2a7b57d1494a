"""SyncBatchNorm on R ranks with slices of a batch == BatchNorm on the whole batch."""
import copy

import pytest
import torch
import torch.distributed as dist
from dist_helpers import run_ranks
from torch import nn
from torch.testing import assert_close

import nanocolossal as nc
from nanocolossal.syncbn import (
    SyncBatchNorm,
    convert_sync_batchnorm,
    naive_statistics,
    statistics,
)

pytestmark = pytest.mark.timeout(120)
BN = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}


def _lesson_worker(rank, world_size, port, xs, ys):
    nc.launch(dict(sync_bn=True), rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    torch.manual_seed(0)  # every rank builds the model the reference builds
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)).double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    engine, *_ = nc.initialize(model, optimizer, nn.CrossEntropyLoss(), verbose=False)
    for x, y in zip(xs, ys):
        x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]  # my half of the batch
        engine.zero_grad()
        engine.backward(engine.criterion(engine(x), y))  # mean and var over both halves
        engine.step()
    return engine.model.state_dict()  # weights, and BatchNorm's running statistics


def test_gloo_syncbn_on_two_ranks_equals_batchnorm_on_the_whole_batch():
    """With sync_bn=True, BatchNorm on 2 ranks, each holding half of every batch, normalises by
    the whole batch's statistics: training and running statistics equal one process's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 3)).double()
    xs, ys = torch.randn(3, 8, 4, dtype=torch.float64), torch.randint(0, 3, (3, 8))  # 3 batches
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for x, y in zip(xs, ys):  # the whole batch of 8 in one process
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    for rank, state in enumerate(run_ranks(_lesson_worker, 2, xs, ys)):
        assert_close(state, model.state_dict(), msg=lambda m: f"rank {rank}: {m}")


def _statistics_worker(rank, world_size, port, x):
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    mine = x.chunk(world_size)[rank]
    bn = SyncBatchNorm(x.shape[1], momentum=1.0)  # running_var = this batch's (unbiased)
    bn(mine)
    return naive_statistics(mine, None)[1], statistics(mine, None)[1], bn.running_var


def test_gloo_the_naive_sums_lose_a_large_means_variance_and_the_centred_ones_keep_it():
    """sum x^2 / N - mu^2 in fp32 cancels when the mean is large next to the spread (x ~ 1000,
    variance 2.6); each rank's squares around its own mean, summed in float64, do not: SyncBN's
    statistics in fp32 are those of float64."""
    torch.manual_seed(0)
    x = 1000 + 1.6 * torch.randn(64, 3)
    exact = x.double().var(0, unbiased=False).float()
    naive, centred, running_var = run_ranks(_statistics_worker, 2, x)[0]
    assert ((naive - exact).abs() / exact).max() > 0.01  # a percent or more off
    assert_close(centred, exact, rtol=1e-5, atol=0)
    assert_close(running_var, x.double().var(0).float(), rtol=1e-5, atol=0)


def _inputs(sizes, spatial):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(sum(sizes), 3, *spatial, generator=g) * 2 + 0.5
    upstream = torch.randn(x.shape, generator=g)  # a fixed dL/dy, so the loss is sum(y * upstream)
    return x, upstream


def _bn_worker(rank, world_size, port, sizes, spatial, momentum):
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    x, upstream = _inputs(sizes, spatial)
    start = sum(sizes[:rank])
    mine = slice(start, start + sizes[rank])
    bn = BN[max(1, len(spatial))](3, momentum=momentum)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    sync = convert_sync_batchnorm(copy.deepcopy(bn))
    reference = copy.deepcopy(bn)
    for _ in range(2):  # twice, so running statistics compound
        for m in (sync, reference):
            m.zero_grad()
        xs = x[mine].clone().requires_grad_()
        ys = sync(xs)
        (ys * upstream[mine]).sum().backward()
        xr = x.clone().requires_grad_()
        yr = reference(xr)
        (yr * upstream).sum().backward()
        assert_close(ys, yr[mine])
        assert_close(xs.grad, xr.grad[mine])
    grads = torch.cat([sync.weight.grad, sync.bias.grad])
    dist.all_reduce(grads)  # parameter grads are local sums: over ranks they make the whole batch's
    assert_close(grads, torch.cat([reference.weight.grad, reference.bias.grad]))
    assert_close(sync.running_mean, reference.running_mean)
    assert_close(sync.running_var, reference.running_var)
    assert sync.num_batches_tracked == reference.num_batches_tracked == 2


@pytest.mark.parametrize("spatial", [(), (5,), (4, 4), (2, 3, 3)],
                         ids=["1d-NC", "1d-NCL", "2d", "3d"])
def test_deep_syncbn_halves_equal_batchnorm_on_full_batch(spatial):
    run_ranks(_bn_worker, 2, (4, 4), spatial, 0.1)


def test_deep_syncbn_uneven_batches_and_cumulative_momentum():
    run_ranks(_bn_worker, 2, (3, 5), (4, 4), None)


def _eval_worker(rank, world_size, port):
    nc.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    calls = []
    real = dist.all_reduce
    dist.all_reduce = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        bn = SyncBatchNorm(3).eval()
        bn.running_mean.fill_(1.0)
        out = bn(torch.ones(2, 3, 4))
        train_calls = len(calls)
        bn.train()(torch.randn(2 + rank, 3, 4))  # training does synchronise
    finally:
        dist.all_reduce = real
    return train_calls, len(calls), out.abs().max().item()


def test_gloo_syncbn_eval_mode_runs_no_collective():
    for eval_calls, total_calls, out in run_ranks(_eval_worker, 2):
        assert eval_calls == 0 and total_calls == 1 and out < 1e-3


def test_syncbn_without_launch_is_plain_batchnorm():
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(4)
    sync = convert_sync_batchnorm(copy.deepcopy(bn))
    x = torch.randn(6, 4, 3, 3)
    assert_close(sync(x), bn(x))
    assert_close(sync.running_var, bn.running_var)


def test_convert_sync_batchnorm_keeps_a_resnets_state_and_flags():
    from torchvision.models import resnet18
    model = resnet18(num_classes=10)
    model.bn1.weight.requires_grad_(False)
    before = copy.deepcopy(model.state_dict())
    converted = convert_sync_batchnorm(model)
    assert not any(isinstance(m, nn.BatchNorm2d) and not isinstance(m, SyncBatchNorm)
                   for m in converted.modules())
    assert sum(isinstance(m, SyncBatchNorm) for m in converted.modules()) == 20
    after = converted.state_dict()
    assert list(after) == list(before)
    for key in before:
        assert torch.equal(after[key], before[key]), key
    assert not converted.bn1.weight.requires_grad and converted.bn1.bias.requires_grad


def test_syncbn_bad_input_is_a_clear_error():
    with pytest.raises(ValueError, match=r"\[rank 0\] SyncBatchNorm expects \(N, C, ...\) input"):
        SyncBatchNorm(3)(torch.randn(3))
    with pytest.raises(ValueError, match=r"SyncBatchNorm\(3\) got 4 channels"):
        SyncBatchNorm(3)(torch.randn(2, 4))
