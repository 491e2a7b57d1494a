"""Tiny CIFAR-10 files in torchvision's real on-disk format (the pickled python batches).

Tests cannot download the real archive, and tiny files cannot have its MD5 sums, so
within `with skip_cifar_md5():` torchvision's integrity check accepts any existing file;
everything else is torchvision's real loader.
"""
import contextlib
import os
import pickle
from pathlib import Path

import numpy as np

LABEL_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
               "truck"]


def write_cifar(root, per_batch: int = 4, test_size: int | None = None) -> dict:
    """Write data_batch_1..5 (`per_batch` images each), test_batch and batches.meta under root."""
    folder = Path(root) / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    written = {}
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        n = test_size if name == "test_batch" and test_size is not None else per_batch
        data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n).tolist()
        with open(folder / name, "wb") as f:
            pickle.dump({"data": data, "labels": labels, "batch_label": name}, f)
        written[name] = (data, labels)
    with open(folder / "batches.meta", "wb") as f:
        pickle.dump({"label_names": LABEL_NAMES}, f)
    return written


@contextlib.contextmanager
def skip_cifar_md5():
    """Within the block, torchvision accepts CIFAR files whose MD5 is not the real archive's."""
    import torchvision.datasets.cifar as tv_cifar
    check = tv_cifar.check_integrity
    tv_cifar.check_integrity = lambda path, md5=None: os.path.isfile(path)
    try:
        yield
    finally:
        tv_cifar.check_integrity = check
