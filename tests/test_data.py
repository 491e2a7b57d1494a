import struct
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.utils.data.distributed as torch_dist_data
from cifar_files import skip_cifar_md5, write_cifar
from dist_helpers import launch_rank, run_ranks

import nanocolossal as nc
from nanocolossal.data import (
    DistributedSampler,
    SyntheticImages,
    agreed_stream,
    cifar10,
    mnist,
    synthetic_images,
)

# ---- DistributedSampler -------------------------------------------------------------------

@pytest.mark.parametrize("n, replicas", [(10, 3), (12, 4), (5, 2), (2, 4)])
def test_sampler_without_padding_covers_dataset_exactly_once(n, replicas):
    shards = [list(DistributedSampler(range(n), replicas, r, shuffle=True, seed=3,
                                      pad=False)) for r in range(replicas)]
    union = [i for shard in shards for i in shard]
    assert sorted(union) == list(range(n)), "every sample exactly once: no duplicates, none missing"
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    lengths = [len(DistributedSampler(range(n), replicas, r, pad=False)) for r in range(replicas)]
    assert lengths == list(map(len, shards))


@pytest.mark.parametrize("n, replicas", [(10, 3), (12, 4), (5, 2), (2, 4), (7, 7)])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_with_padding_equals_torch(n, replicas, shuffle, drop_last):
    for epoch in (0, 1):
        for rank in range(replicas):
            ours = DistributedSampler(range(n), replicas, rank, shuffle=shuffle, seed=5,
                                      drop_last=drop_last)
            theirs = torch_dist_data.DistributedSampler(range(n), replicas, rank, shuffle=shuffle,
                                                        seed=5, drop_last=drop_last)
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)


def test_sampler_set_epoch_changes_the_order_the_same_way_on_every_rank():
    a = DistributedSampler(range(100), 2, 0, seed=0)
    first = list(a)
    a.set_epoch(1)
    second = list(a)
    assert first != second
    b = DistributedSampler(range(100), 2, 1, seed=0)
    b.set_epoch(1)
    assert sorted(second + list(b)) == list(range(100)), (
        "ranks of one epoch still partition the data"
    )


def test_sampler_bad_rank_is_a_clear_error():
    with pytest.raises(ValueError, match=r"sampler rank 2 is not in \[0, num_replicas=2\)"):
        DistributedSampler(range(4), num_replicas=2, rank=2)


def test_get_dataloader_in_one_process_reads_everything_reproducibly():
    data = list(range(20))
    first = torch.cat(list(nc.get_dataloader(data, shuffle=True, seed=7, batch_size=6))).tolist()
    again = torch.cat(list(nc.get_dataloader(data, shuffle=True, seed=7, batch_size=6))).tolist()
    assert sorted(first) == data and first == again and first != data


# ---- agreed_stream ----------------------------------------------------------------------

class _Rows(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(6))


def _agreed_worker(rank, world_size, port):
    launch_rank(rank, world_size, port)
    sized = torch.utils.data.DataLoader(list(range(6)), batch_size=2)
    stream = torch.utils.data.DataLoader(_Rows(), batch_size=2)
    agreed = agreed_stream(stream)
    return (agreed_stream(sized) is sized, type(agreed).__name__, agreed_stream(agreed) is agreed,
            agreed.dataset is stream.dataset, [b.tolist() for b in agreed])


def test_gloo_agreed_stream_adds_nothing_to_a_loader_with_a_length():
    """Only a stream is agreed batch by batch: a loader with a length is returned as it is (its
    length was compared once, up front: no collective per batch), and so is one process's
    stream. The agreed stream is still the loader (its dataset, sampler, set_epoch) and yields
    the same batches."""
    stream = torch.utils.data.DataLoader(_Rows(), batch_size=2)
    assert agreed_stream(stream) is stream  # one process: nobody to agree with
    for sized_kept, kind, kept, same_dataset, batches in run_ranks(_agreed_worker, 2):
        assert sized_kept and kind == "AgreedStream" and kept and same_dataset
        assert batches == [[0, 1], [2, 3], [4, 5]]


# ---- real on-disk formats -------------------------------------------------------------------

@pytest.fixture
def skip_md5():
    """Our tiny files cannot have the real archive's MD5s; everything else is the real loader."""
    with skip_cifar_md5():
        yield


def test_cifar10_loads_real_pickled_batches(tmp_path, skip_md5):
    from torchvision import transforms  # here, not at the top: `pytest -k gloo` skips its import
    written = write_cifar(tmp_path)
    train = cifar10(str(tmp_path), train=True, transform=transforms.PILToTensor())
    test = cifar10(str(tmp_path), train=False, transform=transforms.PILToTensor())
    assert len(train) == 20 and len(test) == 4 and train.classes[0] == "airplane"
    data, labels = written["data_batch_2"]
    image, label = train[4]  # first sample of the second batch
    assert label == labels[0]
    assert torch.equal(image, torch.from_numpy(data[0].reshape(3, 32, 32)))
    image, _ = cifar10(str(tmp_path), train=True)[0]  # default: the tutorial's crop/flip/normalise
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32


def test_cifar10_reads_root_from_DATA(tmp_path, monkeypatch, skip_md5):
    write_cifar(tmp_path)
    monkeypatch.setenv("DATA", str(tmp_path))
    assert len(cifar10(train=False)) == 4


def _write_idx(path, array):
    header = struct.pack(">HBB", 0, 0x08,
                         array.ndim) + b"".join(struct.pack(">I", d) for d in array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


def test_mnist_loads_real_idx_files(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(1)
    images = rng.integers(0, 256, size=(6, 28, 28))
    labels = rng.integers(0, 10, size=6)
    for split in ("train", "t10k"):
        _write_idx(raw / f"{split}-images-idx3-ubyte", images)
        _write_idx(raw / f"{split}-labels-idx1-ubyte", labels)
    train = mnist(str(tmp_path), train=True)
    assert len(train) == 6
    image, label = train[3]
    assert label == labels[3] and image.shape == (1, 28, 28)
    torch.testing.assert_close(image, torch.from_numpy(images[3]).float().div(255).unsqueeze(0))


# ---- offline fallback -------------------------------------------------------------------------

@pytest.mark.parametrize("builder, shape", [(cifar10, (3, 32, 32)), (mnist, (1, 28, 28))])
def test_missing_data_falls_back_to_synthetic_with_one_line(tmp_path, capsys, builder, shape):
    data = builder(str(tmp_path / "empty"), train=True, synthetic_size=64)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1
    assert "synthetic" in lines[0] and "--download" in lines[0] and "[rank 0]" in lines[0]
    assert isinstance(data, SyntheticImages) and len(data) == 64
    image, label = data[5]
    assert image.shape == shape and 0 <= label < 10
    assert torch.equal(data[5][0], image), "samples are deterministic"
    # full-size stand-in by default
    assert len(builder(str(tmp_path / "empty"), train=False)) == 10000


def test_missing_data_does_not_import_torchvision(tmp_path):
    """Its import takes seconds, paid by every rank of every launch that runs on the stand-in."""
    code = ("import sys, nanocolossal as nc\n"
            f"nc.data.cifar10({str(tmp_path)!r}); nc.data.mnist({str(tmp_path)!r})\n"
            "assert 'torchvision' not in sys.modules, 'torchvision was imported'\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_synthetic_images_are_learnable_by_a_small_model():
    torch.manual_seed(0)
    train, test = synthetic_images(2000, seed=0), synthetic_images(500, seed=1)
    x = torch.stack([train[i][0] for i in range(len(train))])
    xt = torch.stack([test[i][0] for i in range(len(test))])
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.MaxPool2d(2),
                                torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                                torch.nn.Linear(32, 10))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(3):
        for i in range(0, len(x), 50):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[i:i + 50]),
                                              train.targets[i:i + 50]).backward()
            opt.step()
    with torch.no_grad():
        accuracy = (model(xt).argmax(1) == test.targets).float().mean().item()
    assert accuracy > 0.5, f"accuracy {accuracy:.2f} on 10 classes (chance 0.1)"
