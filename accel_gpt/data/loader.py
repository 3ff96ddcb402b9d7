"""Token windows read straight from memory-mapped shards, the order they are trained in, and mixtures of sources.

A window is `seq_len + 1` consecutive tokens inside one shard: x = its first `seq_len`, y = its last
`seq_len` (shifted by one). Consecutive windows share one token and never cross a shard boundary, so a
shard of n tokens holds (n - 1) // seq_len windows.

Training order is an endless stream. With one source, epoch e is a permutation of all windows drawn from
(seed, e), and stream position j is window `order(j mod n, epoch j div n)`. `Permutation` computes one index
at a time (a keyed Feistel network), so no epoch is ever materialised: memory per rank is the same for 10
thousand or 10 billion windows, and resuming at optimizer step k only sets `start = k * windows_per_step`;
nothing before it is read or replayed. The sampler is the same on every rank; `accelerator.prepare` wraps the
DataLoader's batch sampler so rank r keeps batches r, r+W, r+2W, ... of the stream. The global batch of a step
is then the same windows for any W.

A mixture (several prepared folders, `data_dir` comma-separated, `data_weights`) keeps all of that: each global
batch of `windows_per_step` windows takes from source k the count an exact apportionment of the stream gives
it (`Apportionment`: after n windows, source k has had n * w_k of them, to within one window per source), the
positions those windows take inside the batch are shuffled by a seeded permutation per step, and each source
goes through its own seeded epochs. The source and window of any position follow from (seed, position) in
O(number of sources) arithmetic, without replaying the stream.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from accel_gpt.data.shards import VerifyCache, open_split, read_manifest, verify_split
from accel_gpt.errors import DataError, WindowError

# `verify_data` (config) -> what verify_split does with the verified cache.
VERIFY_CACHE: dict[str, VerifyCache] = {"auto": "trust", "full": "refresh", "ignore": "ignore"}


class TokenWindows(Dataset):
    """Map-style dataset of (x, y) windows of one split, indexed in storage order.

    Every window's ids are checked against the manifest's vocabulary as it is read (a max over seq_len + 1 ids,
    nothing beside a forward pass): a shard whose manifest understates its ids would otherwise index past the
    embedding, an IndexError on a CPU and a device-side assert on a GPU, naming neither shard nor id."""

    def __init__(self, data_dir: str | Path, split: str, seq_len: int, manifest: dict[str, Any] | None = None):
        self.manifest = manifest if manifest is not None else read_manifest(data_dir)
        self.shards = open_split(data_dir, self.manifest, split)
        self.files = [Path(data_dir) / e["file"] for e in self.manifest["splits"][split]]
        self.vocab_size = int(self.manifest["vocab_size"])
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
        ids = self.shards[k][start : start + self.seq_len + 1]
        if int(ids.max()) >= self.vocab_size:
            at = int(np.flatnonzero(ids >= self.vocab_size)[0])
            raise WindowError(
                f"shard {self.files[k]} holds token id {ids[at]} at position {start + at:,}, but its manifest's "
                "vocabulary has "
                f"{self.vocab_size} ids (0..{self.vocab_size - 1}): the shard is not what manifest.json describes; "
                "prepare the data again"
            )
        window = torch.from_numpy(ids.astype(np.int64))
        return window[:-1], window[1:]


class MixedWindows(Dataset):
    """Several sources' training windows as one index space: source k owns [offsets[k], offsets[k+1]).

    With one source, index i is that source's window i, so everything written for `TokenWindows` indices holds.
    """

    def __init__(self, sources: Sequence[TokenWindows], names: Sequence[str]) -> None:
        self.sources, self.names = list(sources), list(names)
        self.sizes = [len(s) for s in self.sources]
        self.offsets = np.cumsum([0, *self.sizes])
        self.manifest = self.sources[0].manifest  # tokenizer and vocabulary: the same in all (checked)

    @property
    def splits(self) -> list[str]:
        """The splits any source has (a mixture evaluates the sources that have 'val')."""
        return list(dict.fromkeys(split for source in self.sources for split in source.manifest["splits"]))

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = int(np.searchsorted(self.offsets, i, side="right")) - 1
        return self.sources[k][int(i) - int(self.offsets[k])]


# ------------------------------------------------------------------------------------------ the window stream

_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays (multiplication wraps mod 2**64): every output bit depends on
    every input bit, which is all a Feistel round function needs."""
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


class Permutation:
    """A seeded bijection of [0, n), one index at a time: memory O(1) in n, unlike torch.randperm's O(n).

    A balanced Feistel network on 2h bits (2**2h >= n, at most 4n) is a bijection of [0, 2**2h) whatever its
    round function; cycle-walking (apply it again while the value is >= n) restricts it to a bijection of
    [0, n), at under 4 applications on average. Six rounds keyed from (key, tweak): the tweak (an epoch, a
    step) gives a different permutation from the same key. The round keys come from numpy's SeedSequence, whose
    output is fixed across numpy versions, so a stream is the same on every machine.
    """

    ROUNDS = 6

    def __init__(self, n: int, *key: int) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = np.uint64((bits + 1) // 2)
        self.mask = np.uint64((1 << int(self.half)) - 1)
        self.keys = np.random.SeedSequence(list(key)).generate_state(self.ROUNDS, dtype=np.uint64)

    def __call__(self, i: np.ndarray | int, tweak: np.ndarray | int = 0) -> np.ndarray:
        """The images of the indices `i` (each in [0, n)) under the permutation of `tweak` (one, or one each)."""
        x = np.atleast_1d(np.asarray(i, dtype=np.uint64))
        tweaks = np.broadcast_to(np.asarray(tweak, dtype=np.uint64), x.shape)
        out = self._feistel(x, tweaks)
        walk = np.flatnonzero(out >= self.n)
        while walk.size:
            out[walk] = self._feistel(out[walk], tweaks[walk])
            walk = walk[out[walk] >= self.n]
        return out.astype(np.int64)

    def _feistel(self, x: np.ndarray, tweaks: np.ndarray) -> np.ndarray:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ _mix(tweaks ^ key)) & self.mask)
        return (left << self.half) | right


class Apportionment:
    """Which source each position of a mixed stream comes from, and the how-many-th window of that source it is.

    Stick-breaking with floors: among the first p positions, source 0 has floor(p * a_0 / S) (a_k the weights in
    integer units, S their sum), and the rest, in order, are split the same way between source 1 and those after
    it. Every count is non-decreasing in p and grows by at most 1 per position, so each position belongs to
    exactly one source; source k's count after p positions is p * w_k to within one window per source before it.
    Integer arithmetic keeps it exact and the same everywhere.
    """

    UNITS = 1 << 20  # weight resolution 1e-6; positions up to 2**43 keep p * units within int64

    def __init__(self, weights: Sequence[float]) -> None:
        total = float(sum(weights))
        units = [max(1, round(w / total * self.UNITS)) for w in weights]
        self.shares = [(units[k], sum(units[k:])) for k in range(len(units))]

    def __call__(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, rank within that source) of each position."""
        if positions.size and int(positions.max()) >= 1 << 43:
            raise DataError("stream position beyond 2**43 windows: the mixture's arithmetic would overflow")
        pos = positions.astype(np.int64)  # the position within the positions not taken by the sources before
        source, rank = np.zeros_like(pos), np.zeros_like(pos)
        open_ = np.ones(pos.shape, dtype=bool)
        for k, (a, rest) in enumerate(self.shares):
            before = pos * a // rest
            hit = open_ & ((pos + 1) * a // rest > before)
            source[hit], rank[hit] = k, before[hit]
            pos = pos - before
            open_ &= ~hit
        return source, rank


class WindowSampler(Sampler[int]):
    """Endless stream of window indices from `start`: one source's seeded epochs, or a mixture of sources.

    `num_windows`: the window count of the one source, or of each source (`MixedWindows` indices: source k's
    window i is offsets[k] + i). `weights`: each source's share of the stream (default equal). `windows_per_step`:
    the global batch, the unit inside which a mixture's windows are shuffled (irrelevant for one source).
    """

    CHUNK = 4096  # indices computed at a time: a few ms of numpy, 32 KB

    def __init__(
        self,
        num_windows: int | Sequence[int],
        seed: int,
        start: int = 0,
        weights: Sequence[float] | None = None,
        windows_per_step: int = 1,
    ) -> None:
        self.sizes = [num_windows] if isinstance(num_windows, int) else [int(n) for n in num_windows]
        self.num_windows = sum(self.sizes)
        self.offsets = np.cumsum([0, *self.sizes])
        self.seed, self.start = seed, start
        self.orders = [Permutation(n, seed, 0, k) for k, n in enumerate(self.sizes)]
        self.mixed = len(self.sizes) > 1
        self.apportion = Apportionment([1.0] * len(self.sizes) if weights is None else weights)
        self.windows_per_step = windows_per_step
        self.slots = Permutation(windows_per_step, seed, 1)

    def permutation(self, epoch: int, source: int = 0) -> torch.Tensor:
        """Epoch `epoch` of one source's order, as that source's window indices (O(n): for tests and tools).
        With one source it is stream positions epoch*n .. epoch*n + n-1."""
        n = self.sizes[source]
        return torch.from_numpy(self.orders[source](np.arange(n), epoch))

    def index(self, j: int) -> int:
        """The window at stream position `j`, computed directly."""
        return int(self.indices(j, 1)[0])

    def indices(self, start: int, count: int) -> np.ndarray:
        """The windows at stream positions start .. start+count-1, each computed on its own."""
        positions = np.arange(start, start + count, dtype=np.int64)
        if self.mixed:  # shuffle the positions inside each global batch, then apportion them to the sources
            step, slot = np.divmod(positions, self.windows_per_step)
            positions = step * self.windows_per_step + self.slots(slot, step)
        source, rank = self.apportion(positions)
        out = np.empty_like(positions)
        for k, n in enumerate(self.sizes):
            mine = source == k
            epoch, offset = np.divmod(rank[mine], n)
            out[mine] = self.offsets[k] + self.orders[k](offset, epoch)
        return out

    def __iter__(self) -> Iterator[int]:
        position = self.start
        while True:
            yield from self.indices(position, self.CHUNK).tolist()
            position += self.CHUNK


# ------------------------------------------------------------------------------------------ opening the data


def check_vocab(manifest: dict[str, Any], model_vocab_size: int, data_dir: str | Path, fix: str = "") -> None:
    """Token ids must index the model's embedding; a larger data vocabulary would crash mid-run. `fix`: what to do,
    where the model's size is not a setting (train's default: set vocab_size)."""
    size = manifest["vocab_size"]
    if size > model_vocab_size:
        raise DataError(
            f"the shards in {data_dir} use a {manifest['tokenizer']} vocabulary of {size} tokens "
            f"but the model's vocab_size is {model_vocab_size}; {fix or f'set vocab_size >= {size}'}"
        )


def source_names(data_dirs: Sequence[str | Path]) -> list[str]:
    """Each folder's name (`val_loss/<name>`), with more of its path where two share a name (a/data, b/data)."""
    resolved = [Path(d).resolve() for d in data_dirs]
    for depth in range(1, max(len(p.parts) for p in resolved) + 1):
        names = ["/".join(p.parts[-depth:]) for p in resolved]
        if len(set(names)) == len(names):
            return names
    return [str(d) for d in data_dirs]


def _folders(data_dirs: str | Path | Sequence[str | Path]) -> list[Path]:
    if isinstance(data_dirs, str | Path):
        data_dirs = [d for d in str(data_dirs).split(",") if d.strip()]
    return [Path(str(d).strip()) for d in data_dirs]


def check_same_tokenizer(manifests: Sequence[dict[str, Any]], folders: Sequence[Path]) -> None:
    """A mixture's windows go through one embedding: every source must use the same tokenizer and vocabulary."""

    def describe(m: dict[str, Any]) -> tuple:
        return m["tokenizer"], m["vocab_size"], m.get("chars") or "", m.get("tokenizer_sha256"), m.get("eot_token")

    for manifest, folder in zip(manifests[1:], folders[1:], strict=True):
        if describe(manifest) != describe(manifests[0]):
            raise DataError(
                f"the sources of a mixture must share one tokenizer: {folders[0]} has {manifests[0]['tokenizer']} "
                f"({manifests[0]['vocab_size']} tokens) but {folder} has {manifest['tokenizer']} "
                f"({manifest['vocab_size']} tokens, or another vocabulary); prepare them with the same tokenizer"
            )


def train_windows(
    data_dirs: str | Path | Sequence[str | Path], seq_len: int, checksums: bool = True, verify: str = "auto"
) -> MixedWindows:
    """The training split of one folder or of each folder of a mixture (a comma-separated string or a list),
    after checking the shards against each manifest (`verify`: the config's `verify_data`)."""
    folders = _folders(data_dirs)
    manifests = [read_manifest(d) for d in folders]
    check_same_tokenizer(manifests, folders)
    for folder, manifest in zip(folders, manifests, strict=True):
        verify_split(folder, manifest, "train", checksums=checksums, cache=VERIFY_CACHE[verify])
    sources = [TokenWindows(d, "train", seq_len, m) for d, m in zip(folders, manifests, strict=True)]
    return MixedWindows(sources, source_names(folders))


def has_val(data_dir: str | Path) -> bool:
    return bool(read_manifest(data_dir)["splits"].get("val"))


def val_windows(
    data_dir: str | Path, seq_len: int, limit: int, checksums: bool = True, verify: str = "ignore"
) -> torch.utils.data.Subset:
    """The first `limit` windows of the validation split: the same ones at every evaluation and for any W."""
    manifest = read_manifest(data_dir)
    verify_split(data_dir, manifest, "val", checksums=checksums, cache=VERIFY_CACHE[verify])
    windows = TokenWindows(data_dir, "val", seq_len, manifest)
    return torch.utils.data.Subset(windows, range(min(limit, len(windows))))
