"""Data for data parallelism: each replica sees its own share of every epoch.

DistributedSampler shuffles the whole index list with one seed (seed + epoch) that every
rank shares, then deals it out like cards:

    epoch order  [7 2 9 0 4 1 8 3 6 5]          R = 3 replicas
    rank 0        7     0     8     5           indices[0::3]
    rank 1          2     4     3  (7)          indices[1::3]  + padding
    rank 2            9     1     6  (2)        indices[2::3]  + padding

Training wants equal shares (every rank must run the same number of steps, or the all-reduces stop
matching), so by default the list is padded by repeating its start (`pad=True`, exactly torch's
sampler) or cut (`drop_last=True`). Evaluation wants every sample exactly once, so `pad=False` gives
uneven, non-overlapping shares; counts summed over ranks (metrics.Accuracy) are then exact. Call
`set_epoch(e)` each epoch (the Trainer does) or every epoch repeats the same order.

A stream -- a loader without a length, such as a DataLoader over an IterableDataset -- has no
count to compare before training, and one rank's may end a batch before another's: the rank with the
extra batch would wait in its gradient all-reduce until the timeout. `agreed_stream` lets a stream's
batches through only once every rank has one (one all-reduce of a flag per rank per batch; the
Trainer uses it), so the ranks stop together, or fail together at once, naming the ranks that ran
out. A loader with a length passes through (check_consistency compared the lengths once, up front):
no collective is added to its path.
The dataset builders load the real CIFAR-10/MNIST with torchvision (root from the argument, else
$DATA, else ./data). Where the files are absent and cannot be downloaded, they say so in one line
on rank 0 and return a synthetic dataset of the same shape and classes that a small model can
learn, so every script runs offline.
"""
from __future__ import annotations

import itertools
import math
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, Optional, Sized

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, Sampler

from .checks import check_streams_end_together, loader_length, peer_failed
from .context import gpc, on_destroy
from .logging import get_dist_logger

CIFAR10_MEAN, CIFAR10_STD = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)


class DistributedSampler(Sampler[int]):
    """Share a dataset out over the data-parallel ranks (defaults from gpc)."""

    def __init__(self, dataset: Sized, num_replicas: Optional[int] = None,
                 rank: Optional[int] = None, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = False, pad: bool = True) -> None:
        self.num_replicas = gpc.data_size if num_replicas is None else num_replicas
        self.rank = gpc.data_rank if rank is None else rank
        if self.num_replicas < 1 or not 0 <= self.rank < self.num_replicas:
            raise ValueError(f"[rank {gpc.rank}] sampler rank {self.rank} is not in "
                             f"[0, num_replicas={self.num_replicas})")
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.pad = pad
        self.epoch = 0
        n = len(dataset)
        R = self.num_replicas
        if drop_last:
            self.total_size = (n // R) * R
        elif pad:
            self.total_size = math.ceil(n / R) * R
        else:
            self.total_size = n
        # Uneven only when neither padding nor dropping: the first n % R ranks get one more.
        self.num_samples = len(range(self.rank, self.total_size, R))

    def __iter__(self) -> Iterator[int]:
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            indices = torch.randperm(n, generator=g).tolist()
        else:
            indices = list(range(n))
        # pad by repeating from the start (as often as needed for tiny sets)
        if self.total_size > n:
            indices += (indices * math.ceil((self.total_size - n) / n))[: self.total_size - n]
        return iter(indices[self.rank: self.total_size: self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Use a new order this epoch (same on all ranks, since they share seed + epoch)."""
        self.epoch = epoch


def get_dataloader(dataset: Dataset, shuffle: bool = False, seed: int = 1024,
                   add_sampler: bool = True, drop_last: bool = False, pin_memory: bool = False,
                   pad: bool = True, **kwargs) -> DataLoader:
    """A DataLoader giving this data-parallel rank its share (DistributedSampler, unless not
    `add_sampler`: then shuffled by a generator seeded by `seed`); `batch_size` is per rank."""
    pin_memory = pin_memory and torch.cuda.is_available()  # pinning without a GPU only warns
    # also with one replica: each epoch's order is a function of seed + epoch, so resumable
    if add_sampler:
        sampler = DistributedSampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last,
                                     pad=pad)
        return DataLoader(dataset, sampler=sampler, drop_last=drop_last, pin_memory=pin_memory,
                          **kwargs)
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(dataset, shuffle=shuffle, generator=generator, drop_last=drop_last,
                      pin_memory=pin_memory, **kwargs)


class WrappedLoader:
    """A loader that changes what its batches are (AgreedStream, sequence.py's split,
    loss_weights.py's groups read ahead); everything else (sampler, dataset, set_epoch) is the
    loader's own."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)


class AgreedStream(WrappedLoader):
    """A stream whose batches every rank agrees on (agreed_stream)."""

    def __iter__(self) -> Iterator[Any]:
        batches = iter(self.loader)
        end = object()
        has = torch.zeros(gpc.world_size, dtype=torch.int32, device=gpc.device)
        for read in itertools.count():
            batch = next(batches, end)
            has.zero_()
            has[gpc.rank] = int(batch is not end)  # "I have another batch"
            try:
                dist.all_reduce(has)
            except RuntimeError as e:
                raise peer_failed("the all-reduce of 'has every rank another batch?' (data.py)",
                                  dist.group.WORLD, e) from e
            if not bool(has.all()):  # every stream ended here, or some only: an error
                check_streams_end_together(has.tolist(), read)
                return
            yield batch


def agreed_stream(loader: Iterable) -> Iterable:
    """`loader` with its end agreed where it is a stream on several ranks, else itself. A loop
    of your own over a stream: `for x, y in nc.data.agreed_stream(loader)`."""
    if (loader_length(loader) is not None or isinstance(loader, AgreedStream)
            or not gpc.is_initialized or gpc.world_size == 1):
        return loader
    return AgreedStream(loader)


class SyntheticImages(Dataset):
    """Learnable stand-in for an image dataset (C, H, W): class template + noise, on demand.

    Each class has a fixed smooth random template; sample i is its class's template, shifted by up
    to `max_shift` pixels and scaled in contrast, plus Gaussian noise, all derived from (seed, i),
    so any rank can make any sample and the data costs no memory. Values look like normalised
    images (about zero mean, unit scale). A small CNN learns it in an epoch or two."""

    def __init__(self, size: int, shape: tuple[int, ...] = (3, 32, 32), num_classes: int = 10,
                 seed: int = 0, noise: float = 1.0, max_shift: int = 4) -> None:
        if size < 1 or num_classes < 2:
            raise ValueError(f"synthetic dataset needs size >= 1 and num_classes >= 2, got {size}, "
                             f"{num_classes}")
        self.size = size
        self.shape = tuple(shape)
        self.num_classes = num_classes
        self.seed = seed
        self.noise = noise
        self.max_shift = max_shift
        # templates shared by train and test: a coarse pattern upsampled, smooth like pictures
        g = torch.Generator().manual_seed(1234567 + num_classes)
        C, H, W = self.shape
        coarse = torch.randn(num_classes, C, max(1, H // 4), max(1, W // 4), generator=g)
        self.templates = torch.nn.functional.interpolate(coarse, size=(H, W), mode="bilinear",
                                                         align_corners=False)
        self.targets = torch.randint(num_classes, (size,),
                                     generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if not -self.size <= i < self.size:
            raise IndexError(f"index {i} out of range for synthetic dataset of size {self.size}")
        i %= self.size
        label = int(self.targets[i])
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i + 1)
        x = self.templates[label]
        # shift and contrast vary per sample, so a linear model is not enough
        dy, dx = (int(v) for v in torch.randint(-self.max_shift, self.max_shift + 1, (2,),
                                                generator=g))
        x = torch.roll(x, shifts=(dy, dx), dims=(1, 2)) * (0.5 + torch.rand((), generator=g))
        return x + self.noise * torch.randn(self.shape, generator=g), label


synthetic_images = SyntheticImages  # the function's name the scripts know


def data_root(root: Optional[str] = None) -> str:
    """The data directory: the argument, else $DATA, else ./data."""
    return str(root or os.environ.get("DATA") or "./data")


@contextmanager
def _local_rank0_first() -> Iterator[None]:
    """Let local rank 0 download/unpack first so ranks do not race on the same files."""
    barrier = gpc.is_initialized and gpc.world_size > 1
    if barrier and gpc.local_rank != 0:
        dist.barrier()
    try:
        yield
    finally:
        if barrier and gpc.local_rank == 0:
            dist.barrier()


_announced: set[tuple[str, str]] = set()
on_destroy(_announced.clear)  # "using a synthetic stand-in" is said once per job


def _load_or_synthesize(name: str, folder: str, build: Callable[[], Dataset], root: str,
                        download: bool, size: int, shape: tuple[int, ...], train: bool,
                        synthetic_size: Optional[int]) -> Dataset:
    with _local_rank0_first():
        try:
            # no folder, no download: skip build(), whose torchvision import alone takes seconds
            if not download and not os.path.isdir(os.path.join(root, folder)):
                raise FileNotFoundError(f"{os.path.join(root, folder)} does not exist")
            return build()
        except (RuntimeError, OSError) as e:  # not on disk ("Dataset not found"), or no download
            where = os.path.abspath(root)
            if (name, where) not in _announced:  # one line per dataset, not one per split
                _announced.add((name, where))
                cause = (f"could not be downloaded ({str(e).splitlines()[0]})" if download
                         else "is not on disk")
                get_dist_logger().warning(
                    f"{name} {cause} under {where}: using a synthetic {name}-shaped stand-in "
                    f"({'x'.join(map(str, shape))}, 10 classes); use --data DIR or --download for "
                    f"the real one", ranks=[0])
            return SyntheticImages(synthetic_size or size, shape, 10, seed=0 if train else 1)


def cifar10(root: Optional[str] = None, train: bool = True, download: bool = False,
            transform: Optional[Callable] = None, synthetic_size: Optional[int] = None) -> Dataset:
    """CIFAR-10 with the tutorials' transforms (crop + flip to train), or a synthetic stand-in."""
    root = data_root(root)

    def build() -> Dataset:
        from torchvision import datasets, transforms
        augment = [transforms.RandomCrop(32, padding=4),
                   transforms.RandomHorizontalFlip()] if train else []
        normalize = [transforms.ToTensor(), transforms.Normalize(CIFAR10_MEAN, CIFAR10_STD)]
        return datasets.CIFAR10(root, train=train, download=download,
                                transform=transform or transforms.Compose(augment + normalize))
    return _load_or_synthesize("CIFAR-10", "cifar-10-batches-py", build, root, download,
                               50000 if train else 10000, (3, 32, 32), train, synthetic_size)


def mnist(root: Optional[str] = None, train: bool = True, download: bool = False,
          transform: Optional[Callable] = None, synthetic_size: Optional[int] = None) -> Dataset:
    """MNIST as the DDP tutorial loads it (ToTensor only), or a synthetic stand-in."""
    root = data_root(root)

    def build() -> Dataset:
        from torchvision import datasets, transforms
        return datasets.MNIST(root, train=train, download=download,
                              transform=transform or transforms.ToTensor())
    return _load_or_synthesize("MNIST", "MNIST", build, root, download, 60000 if train else 10000,
                               (1, 28, 28), train, synthetic_size)
