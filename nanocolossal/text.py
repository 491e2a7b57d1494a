"""Text for a byte-level language model: no tokenizer, the vocabulary is the 256 byte values.

    text      b"def f(x):\\n    return x"    a file's bytes are the token ids
    sample i  bytes [i*L, i*L + L + 1)       input: the first L; target: the last L (shifted)

The text comes from `--data FILE`; `--download` fetches nanoGPT's tiny Shakespeare into it.
Offline and without a file, it is real text that every machine has: the source of Python's own
standard library (its top-level modules in name order, up to `max_bytes`), said in one log line.
Train and validation are split by position (the last `val_fraction` of the bytes validates), so
no validation sample overlaps a training one.
"""
from __future__ import annotations

import os
import sysconfig
import urllib.request
from typing import Optional

import torch
from torch.utils.data import Dataset

from .logging import get_dist_logger

SHAKESPEARE_URL = ("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/"
                   "tinyshakespeare/input.txt")
VOCAB_SIZE = 256


class ByteChunks(Dataset):
    """Non-overlapping samples of `seq_len` + 1 bytes: (input ids, next-byte targets)."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        if len(data) < seq_len + 1:
            raise ValueError(f"{len(data)} bytes of text cannot make one sample of SEQ_LEN + 1 = "
                             f"{seq_len + 1} bytes; give more text or a shorter SEQ_LEN")
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.data[i * self.seq_len: (i + 1) * self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


def stdlib_text(max_bytes: int) -> tuple[bytes, str]:
    """Python's standard library source, top-level modules in name order; and what it is."""
    folder = sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(folder) if n.endswith(".py"))
    text, used = b"", []
    for name in names:
        if len(text) >= max_bytes:
            break
        with open(os.path.join(folder, name), "rb") as f:
            text += f.read()
        used.append(name)
    return text[:max_bytes], (f"Python's standard library source ({len(used)} files, "
                              f"{used[0]} .. {used[-1]} in {folder})")


def load_text(path: Optional[str], download: bool = False, max_bytes: int = 1_000_000) -> bytes:
    """The bytes of `path` (fetched first with `download`), else the standard library's source."""
    if path and download and not os.path.exists(path):
        try:  # nanoGPT's tiny Shakespeare; offline, a warning
            urllib.request.urlretrieve(SHAKESPEARE_URL, path)
        except OSError as e:
            get_dist_logger().warning(f"could not download tiny Shakespeare to {path} ({e})",
                                      ranks=[0])
    if path and os.path.exists(path):
        with open(path, "rb") as f:
            return f.read()[:max_bytes]
    text, what = stdlib_text(max_bytes)
    get_dist_logger().info(f"no text file{f' at {path}' if path else ''}: training on {what}, "
                           f"{len(text):,} bytes", ranks=[0])
    return text


def byte_datasets(text: bytes, seq_len: int,
                  val_fraction: float = 0.1) -> tuple[ByteChunks, ByteChunks]:
    """(train, validation) samples, split by position."""
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    cut = int(len(data) * (1 - val_fraction))
    return ByteChunks(data[:cut], seq_len), ByteChunks(data[cut:], seq_len)
