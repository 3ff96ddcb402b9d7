"""Token windows read straight from memory-mapped shards, and the order they are trained in.

A window is `seq_len + 1` consecutive tokens inside one shard: x = its first `seq_len`, y = its last
`seq_len` (shifted by one). Consecutive windows share one token and never cross a shard boundary, so a
shard of n tokens holds (n - 1) // seq_len windows.

Training order is an endless stream: epoch e is a permutation of all windows drawn from (seed, e).
`WindowSampler` yields that stream from any position in O(1), so resuming at optimizer step k only
sets `start = k * windows_per_step`; nothing before it is read or replayed. The sampler is the same
on every rank; `accelerator.prepare` wraps the DataLoader's batch sampler so rank r keeps batches
r, r+W, r+2W, ... of the stream. The global batch of a step is then the same windows for any W.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from accel_gpt.data.shards import open_split, read_manifest, verify_split
from accel_gpt.errors import DataError


class TokenWindows(Dataset):
    """Map-style dataset of (x, y) windows of one split, indexed in storage order."""

    def __init__(self, data_dir: str | Path, split: str, seq_len: int, manifest: dict[str, Any] | None = None):
        self.manifest = manifest if manifest is not None else read_manifest(data_dir)
        self.shards = open_split(data_dir, self.manifest, split)
        self.seq_len = seq_len
        counts = [max(0, (len(s) - 1) // seq_len) for s in self.shards]
        self.offsets = np.cumsum([0, *counts])  # window i lives in shard k where offsets[k] <= i < offsets[k+1]
        if self.offsets[-1] == 0:
            raise DataError(
                f"split '{split}' of {data_dir} has no window of seq_len+1={seq_len + 1} tokens "
                f"(shards hold {[len(s) for s in self.shards]} tokens)"
            )

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = int(np.searchsorted(self.offsets, i, side="right")) - 1
        start = (int(i) - int(self.offsets[k])) * self.seq_len
        window = torch.from_numpy(self.shards[k][start : start + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]


class WindowSampler(Sampler[int]):
    """Endless stream of window indices: permutation(seed, epoch) for epoch 0, 1, 2, ... from `start`."""

    def __init__(self, num_windows: int, seed: int, start: int = 0) -> None:
        self.num_windows = num_windows
        self.seed = seed
        self.start = start

    def permutation(self, epoch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
        return torch.randperm(self.num_windows, generator=gen)

    def __iter__(self) -> Iterator[int]:
        epoch, offset = divmod(self.start, self.num_windows)
        while True:
            yield from self.permutation(epoch)[offset:].tolist()
            epoch, offset = epoch + 1, 0


def check_vocab(manifest: dict[str, Any], model_vocab_size: int, data_dir: str | Path) -> None:
    """Token ids must index the model's embedding; a larger data vocabulary would crash mid-run."""
    if manifest["vocab_size"] > model_vocab_size:
        raise DataError(
            f"the shards in {data_dir} use a {manifest['tokenizer']} vocabulary of {manifest['vocab_size']} tokens "
            f"but the model's vocab_size is {model_vocab_size}; set vocab_size >= {manifest['vocab_size']}"
        )


def train_windows(data_dir: str | Path, seq_len: int, checksums: bool = True) -> TokenWindows:
    """The training split, after checking the shards against the manifest."""
    manifest = read_manifest(data_dir)
    verify_split(data_dir, manifest, "train", checksums=checksums)
    return TokenWindows(data_dir, "train", seq_len, manifest)


def val_windows(data_dir: str | Path, seq_len: int, limit: int, checksums: bool = True) -> torch.utils.data.Subset:
    """The first `limit` windows of the validation split: the same ones at every evaluation and for any W."""
    manifest = read_manifest(data_dir)
    verify_split(data_dir, manifest, "val", checksums=checksums)
    windows = TokenWindows(data_dir, "val", seq_len, manifest)
    return torch.utils.data.Subset(windows, range(min(limit, len(windows))))
