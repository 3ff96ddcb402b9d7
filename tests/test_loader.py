"""The training window stream: epoch after epoch of seeded permutations, entered at any position; shard checks.

A run longer than one pass over its data goes on into epoch 1, 2, ... without a gap or a repeat of epoch 0's
order, and a resume at position p must yield exactly what an uninterrupted stream yields from p on. Each
permutation is computed one index at a time, so neither memory nor the cost of entering the stream grows with
the number of windows. Start-up checks every shard's size and hashes only shards not verified as they are now.
"""

from __future__ import annotations

import itertools
import json
import os
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from conftest import write_token_shards
from torch.utils.data import DataLoader

from accel_gpt.data import shards
from accel_gpt.data.loader import Permutation, WindowSampler
from accel_gpt.errors import DataError

N, SEED = 5, 3


def take(sampler: WindowSampler, n: int) -> list[int]:
    return list(itertools.islice(iter(sampler), n))


def epoch_order(epoch: int) -> list[int]:
    """Epoch e's order as the sampler defines it: the keyed permutation of (seed, epoch), enumerated."""
    return WindowSampler(N, SEED).permutation(epoch).tolist()


def test_stream_wraps_into_the_next_epochs_permutation() -> None:
    e0, e1, e2 = epoch_order(0), epoch_order(1), epoch_order(2)
    assert sorted(e0) == sorted(e1) == sorted(e2) == list(range(N))
    assert e0 != e1 and e1 != e2, "each epoch is shuffled anew"
    assert take(WindowSampler(N, SEED), 12) == e0 + e1 + e2[:2]


def test_stream_from_any_position_is_the_tail_of_the_stream() -> None:
    """A resume sets `start`; from inside epoch 0, on the boundary, or epochs later, it continues the same stream."""
    whole = take(WindowSampler(N, SEED), 4 * N)
    for start in (0, 3, N - 1, N, N + 2, 2 * N, 3 * N - 1):
        assert take(WindowSampler(N, SEED, start=start), 4 * N - start) == whole[start:], start
    assert take(WindowSampler(N, SEED, start=N + 2), 3) == epoch_order(1)[2:]


def test_a_batch_straddles_the_epoch_boundary() -> None:
    """With 5 windows and batches of 2, the third batch is epoch 0's last window and epoch 1's first: the endless
    stream drops nothing at the boundary, whatever `drop_last` says (it only applies where a stream ends)."""
    loader = DataLoader(list(range(N)), sampler=WindowSampler(N, SEED), batch_size=2, drop_last=True)
    batches = [b.tolist() for b in itertools.islice(iter(loader), 5)]
    e0, e1 = epoch_order(0), epoch_order(1)
    assert batches == [e0[0:2], e0[2:4], [e0[4], e1[0]], e1[1:3], e1[3:5]]


# ------------------------------------------------------------------------------------------ permutations


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 8, 16, 31, 64, 97, 127, 128, 1000, 1024, 4099, 65_536, 65_537])
def test_permutation_is_a_bijection(n: int) -> None:
    """Primes, powers of two and their neighbours (the Feistel domain is the next even power of two): every index
    maps into [0, n), and no two to the same place, for several tweaks (epochs)."""
    perm = Permutation(n, SEED, 0, 0)
    for tweak in (0, 1, 12345):
        image = perm(np.arange(n), tweak)
        assert image.dtype == np.int64 and image.min() >= 0 and image.max() < n
        assert np.array_equal(np.sort(image), np.arange(n)), (n, tweak)


def test_permutation_depends_on_key_and_tweak_and_looks_shuffled() -> None:
    n = 10_000
    a, b, c = Permutation(n, 1, 0, 0)(np.arange(n)), Permutation(n, 2, 0, 0)(np.arange(n)), Permutation(n, 1, 0, 0)
    assert not np.array_equal(a, b) and not np.array_equal(a, c(np.arange(n), 1))
    assert np.array_equal(a, c(np.arange(n))), "the same key and tweak give the same permutation"
    assert abs(np.corrcoef(np.arange(n), a)[0, 1]) < 0.05, "the order is not close to the identity"
    assert (a[1:] == a[:-1] + 1).mean() < 0.01, "few neighbours stay neighbours"


def test_stream_far_into_training_is_valid_and_computed_directly() -> None:
    """3 billion windows (GPT-2-scale data at 1,024 tokens is 10 million): the stream entered at position 10**12
    (epoch 333) yields windows in range, all distinct, equal to `index(j)` computed for each j on its own, and
    entering it costs neither memory nor time that grows with n or the position."""
    n, position, count = 3_000_000_019, 10**12 + 17, 20_000
    tracemalloc.start()
    started = time.perf_counter()
    sampler = WindowSampler(n, SEED, start=position)
    taken = take(sampler, count)
    seconds = time.perf_counter() - started
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert seconds < 5 and peak < 8 * 2**20, (seconds, peak)  # an epoch as a list would be ~100 GB
    assert all(0 <= w < n for w in taken) and len(set(taken)) == count
    assert [sampler.index(position + i) for i in range(0, count, 997)] == taken[::997]
    epoch, offset = divmod(position, n)
    assert taken[:5] == Permutation(n, SEED, 0, 0)(np.arange(offset, offset + 5), epoch).tolist()


# ------------------------------------------------------------------------------------------ shard verification


@pytest.fixture
def counted_hashes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The shard files `verify_split` reads to hash, in order."""
    hashed: list[str] = []
    original = shards.sha256_file

    def sha256_file(path: Path, *args: int) -> str:
        hashed.append(Path(path).name)
        return original(path, *args)

    monkeypatch.setattr(shards, "sha256_file", sha256_file)
    return hashed


def _prepared(tmp_path: Path) -> tuple[Path, dict]:
    data = write_token_shards(tmp_path / "data", list(range(300)) * 10, shard_size=1000, vocab_size=300)
    return data, shards.read_manifest(data)


def _rewrite(path: Path, data: bytes, keep_mtime: bool = False, replace: bool = False) -> None:
    """New bytes of the same length: in place, or a new file renamed over it; optionally with the old mtime."""
    before = path.stat()
    time.sleep(0.05)  # past the file system's timestamp granularity (a few ms with coarse kernel clocks)
    if replace:
        tmp = path.with_name(path.name + ".new")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    else:
        with open(path, "r+b") as f:
            f.write(data)
    if keep_mtime:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def test_start_hashes_each_shard_once_then_only_changed_ones(tmp_path: Path, counted_hashes: list[str]) -> None:
    data, manifest = _prepared(tmp_path)
    shards.verify_split(data, manifest, "train", cache="trust")
    assert counted_hashes == ["train_000000.bin", "train_000001.bin", "train_000002.bin"]
    recorded = json.loads((data / shards.VERIFIED).read_text())["shards"]
    assert set(recorded) == set(counted_hashes) and recorded["train_000001.bin"]["size"] == 2000
    counted_hashes.clear()
    shards.verify_split(data, manifest, "train", cache="trust")
    assert counted_hashes == [], "unchanged shards are not read again"
    path = data / "train_000001.bin"
    _rewrite(path, path.read_bytes())  # the same bytes written again: a new mtime, so hashed again, and it passes
    shards.verify_split(data, manifest, "train", cache="trust")
    assert counted_hashes == ["train_000001.bin"]
    counted_hashes.clear()
    shards.verify_split(data, manifest, "train", cache="trust")
    assert counted_hashes == [], "the re-verified shard was recorded"
    shards.verify_split(data, manifest, "train", cache="refresh")  # --verify_data full
    assert len(counted_hashes) == 3


@pytest.mark.parametrize(
    "how", ["in_place_new_mtime", "in_place_old_mtime", "renamed_over_old_mtime", "cache_says_other_hash"]
)
def test_changed_shard_of_the_same_size_is_refused(tmp_path: Path, how: str) -> None:
    """Corrupted in place (mtime changed, or set back), or replaced by a file renamed over it with the old mtime (a
    copy that keeps timestamps): each is hashed again and refused, though its size is right and it was verified."""
    data, manifest = _prepared(tmp_path)
    shards.verify_split(data, manifest, "train", cache="trust")
    path = data / "train_000002.bin"
    corrupt = bytes(b ^ 0xFF for b in path.read_bytes())
    if how == "cache_says_other_hash":  # a cache entry for other content is no evidence for this manifest
        manifest = json.loads(json.dumps(manifest))
        manifest["splits"]["train"][2]["sha256"] = "0" * 64
    else:
        _rewrite(path, corrupt, keep_mtime=how.endswith("old_mtime"), replace=how.startswith("renamed"))
    with pytest.raises(DataError, match="train_000002.bin fails its checksum"):
        shards.verify_split(data, manifest, "train", cache="trust")


def test_truncated_shard_is_refused_without_hashing(tmp_path: Path, counted_hashes: list[str]) -> None:
    data, manifest = _prepared(tmp_path)
    with open(data / "train_000000.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(DataError, match="truncated or wrong: 100 bytes, expected 2000"):
        shards.verify_split(data, manifest, "train", cache="trust")
    assert counted_hashes == []


def test_verified_cache_goes_to_the_user_cache_for_a_read_only_data_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, counted_hashes: list[str]
) -> None:
    data, manifest = _prepared(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == data else real_access(p, mode))
    shards.verify_split(data, manifest, "train", cache="trust")
    assert not (data / shards.VERIFIED).exists()
    (cached,) = (tmp_path / "cache" / "accel_gpt" / "verified").glob("*.json")
    assert set(json.loads(cached.read_text())["shards"]) == set(counted_hashes)
    counted_hashes.clear()
    shards.verify_split(data, manifest, "train", cache="trust")
    assert counted_hashes == []


def test_unreadable_cache_costs_one_hashing_and_is_rewritten(tmp_path: Path, counted_hashes: list[str]) -> None:
    data, manifest = _prepared(tmp_path)
    (data / shards.VERIFIED).write_text("{not json")
    shards.verify_split(data, manifest, "train", cache="trust")
    assert len(counted_hashes) == 3
    assert json.loads((data / shards.VERIFIED).read_text())["version"] == shards.VERIFIED_VERSION


def test_ignore_hashes_everything_and_writes_no_cache(tmp_path: Path, counted_hashes: list[str]) -> None:
    """What prepare's own checks use: unchanged behaviour, nothing written into the folder."""
    data, manifest = _prepared(tmp_path)
    shards.verify_split(data, manifest, "train")
    shards.verify_split(data, manifest, "train")
    assert len(counted_hashes) == 6 and not (data / shards.VERIFIED).exists()
