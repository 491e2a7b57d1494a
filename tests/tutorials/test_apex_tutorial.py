"""Seed 003's apex section (四、混合精度训练(采用apex)) with one word changed, apex -> nanocolossal,
run on 2 gloo ranks: ConvNet, amp.initialize(opt_level='O2'), DDP, amp.scale_loss, step.

    from apex.parallel import DistributedDataParallel as DDP     # the tutorial
    from nanocolossal.parallel import DistributedDataParallel as DDP   # here

The tutorial's loop is copied below as it stands, except for what a CPU test cannot keep: ranks
start with nc.launch instead of mp.spawn + init_process_group(backend='nccl'), `.cuda()` is gone,
MNIST is replaced by MNIST-shaped images whose labels a fixed linear map of the pixels decides
(no download), and lr 1e-4 (for 200 epochs) becomes 0.005 so that 2 epochs of 4 steps show
learning. float16 (apex's O2 type) runs on CPUs too, slowly (a step of 8 images a rank takes most
of a second): so 64 images, in batches of 8 a rank.
"""
import pytest
import torch
import torch.nn as nn
from dist_helpers import run_ranks
from torch.utils.data import TensorDataset

import nanocolossal
from nanocolossal import amp
from nanocolossal.parallel import DistributedDataParallel as DDP

pytestmark = pytest.mark.timeout(120)
EPOCHS, BATCH_SIZE, LR = 2, 8, 0.005  # the tutorial: 200 epochs (--epochs), batch 100, lr 1e-4
IMAGES = 64


class ConvNet(nn.Module):  # the tutorial's, verbatim
    def __init__(self, num_classes=10):
        super(ConvNet, self).__init__()
        self.layer1 = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2))
        self.layer2 = nn.Sequential(
            nn.Conv2d(16, 32, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2))
        self.fc = nn.Linear(7*7*32, num_classes)

    def forward(self, x):
        out = self.layer1(x)
        out = self.layer2(out)
        out = out.reshape(out.size(0), -1)
        out = self.fc(out)
        return out


def mnist_like(n: int = IMAGES) -> TensorDataset:
    """n images of 1 x 28 x 28 in [0, 1], labelled by a fixed linear map of their pixels."""
    g = torch.Generator().manual_seed(0)
    images = torch.rand(n, 1, 28, 28, generator=g)
    teacher = torch.randn(28 * 28, 10, generator=g)
    return TensorDataset(images, (images.flatten(1) @ teacher).argmax(1))


def _apex_tutorial_rank(rank, world_size, port, sync_bn):
    nanocolossal.launch({}, rank=rank, world_size=world_size, host="127.0.0.1", port=port)
    torch.manual_seed(0)
    model = ConvNet()
    if sync_bn:  # apex's BN conversion, before amp.initialize as apex asks
        model = nanocolossal.parallel.convert_syncbn_model(model)
    batch_size = BATCH_SIZE
    # define loss function (criterion) and optimizer
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), LR)
    # Wrap the model
    ##############################################################
    model, optimizer = amp.initialize(model, optimizer,
                                      opt_level='O2')
    model = DDP(model)
    ##############################################################
    # Data loading code
    train_dataset = mnist_like()
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=world_size, rank=rank)
    train_loader = torch.utils.data.DataLoader(
        dataset=train_dataset, batch_size=batch_size, shuffle=False, num_workers=0,
        sampler=train_sampler)
    losses = []
    for epoch in range(EPOCHS):
        train_sampler.set_epoch(epoch)
        for i, (images, labels) in enumerate(train_loader):
            # Forward pass
            outputs = model(images)
            loss = criterion(outputs, labels)

            # Backward and optimize
            optimizer.zero_grad()
    ##############################################################
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
    ##############################################################
            optimizer.step()
            losses.append(loss.item())
    module = model.module
    weights = torch.cat([p.detach().float().flatten() for p in module.parameters()])
    bn = module.layer1[1]
    return (losses, weights, module.layer1[0].weight.dtype, bn.weight.dtype, type(bn).__name__,
            optimizer.skipped_steps)


def test_deep_apex_tutorial_loop_trains_with_one_word_changed():
    """The tutorial's loop with apex's SyncBN conversion (the plain BatchNorm path is the same
    loop less one line; test_syncbn.py checks both BatchNorms against one process)."""
    sync_bn = True
    results = run_ranks(_apex_tutorial_rank, 2, sync_bn, timeout=100)
    (losses, weights, conv_dtype, bn_dtype, bn_type, skipped), other = results[0], results[1]
    steps = IMAGES // (2 * BATCH_SIZE)  # per epoch
    assert len(losses) == EPOCHS * steps
    assert conv_dtype == torch.float16 and bn_dtype == torch.float32, "O2: fp16 model, fp32 BN"
    assert bn_type == ("SyncBatchNorm" if sync_bn else "BatchNorm2d")
    assert skipped <= 2, "the dynamic loss scale soon finds its level"
    both = [(a + b) / 2 for a, b in zip(losses, other[0])]  # the loss of the whole batch
    first, last = sum(both[:steps]) / steps, sum(both[-steps:]) / steps
    assert last < 0.7 * first, ("it trains: epoch means", first, last)
    assert torch.equal(other[1], weights), "DDP: every rank holds the same weights"


def test_parallel_has_apexs_names():
    from nanocolossal import ddp, syncbn
    assert nanocolossal.parallel.DistributedDataParallel is ddp.DistributedDataParallel
    assert nanocolossal.parallel.SyncBatchNorm is syncbn.SyncBatchNorm
    model = nanocolossal.parallel.convert_syncbn_model(ConvNet())
    assert type(model.layer2[1]) is syncbn.SyncBatchNorm
