"""The on-disk token format: flat little-endian uint16 (or uint32) shards plus `manifest.json`.

A shard is a bare array of token ids with no header, so it can be memory-mapped as is. Everything
about it lives in the manifest:

    {"format": "accel_gpt-shards", "version": 1,
     "tokenizer": "gpt2" | "char" | "bpe", "chars": "<vocabulary, char tokenizer only>",
     "tokenizer_sha256": "<bpe only: the fingerprint of tokenizer.json, beside the manifest (`bpe.fingerprint`)>",
     "eot_token": 50256 | null, "vocab_size": 50257, "dtype": "uint16",
     "splits": {"train": [{"file": "train_000000.bin", "tokens": N, "sha256": "...", "bytes": B}, ...],
                "val": [...]},
     "tokens": {"train": N, "val": M}, "bytes": {"train": B, "val": C},
     "documents": {"train": n, "val": m}, "source": {...}, "args": {...}}

A shard's `file` is relative to the manifest's folder (a multi-part prepare lists `part-.../train_000000.bin`).
`bytes` (per split, and per shard) is the number of UTF-8 bytes of text the tokens stand for: the sum over the
tokens of each id's byte length (`Tokenizer.token_bytes`; end-of-text counts 0), exact wherever a `val_tokens` cut
or a document boundary falls. Validation turns its loss per token into bits per byte with it (`val_bpb`), which
compares models across tokenizers. Manifests written before it have no `bytes`; re-running their `prepare`
command adds it (`add_byte_counts`) without tokenizing again.
Shards and the manifest are written under a temporary name and renamed when complete, so a reader
never sees a half-written file.

Verification (`verify_split`) keeps start-up from growing with the data. Every start checks that each shard
exists with its listed size: one stat per shard, which catches a truncated or missing shard. The manifest's
sha256 catches a replaced or corrupted one, but hashing reads every byte (16 s for 20 GB), so a training start
hashes only the shards it has not verified in their present state. The verified cache, `data_dir/.verified.json`
(or a per-user file when data_dir is read-only, see `verified_path`), records for each hashed shard its size,
mtime_ns, ctime_ns, inode and sha256; a shard whose stat still matches and whose manifest sha256 is the one
recorded is trusted without reading it. Any write changes mtime and ctime, and a file renamed or copied over a
shard has another inode and ctime (ctime cannot be set back, even where a copy keeps the mtime), so each of
these is hashed again. What the cache cannot see is bytes changing under unchanged metadata (media errors):
`run.py train --verify_data full` hashes every shard and refreshes the cache, and `prepare` computes each
sha256 as it writes the shard.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
from pathlib import Path
from typing import Any, Literal

import numpy as np

from accel_gpt.config import PrepareConfig, close_paths, preset_names
from accel_gpt.errors import DataError, UserError
from accel_gpt.files import atomic_write_json, lock_holder, publish, temp_sibling
from accel_gpt.tokenizer import Tokenizer, dtype_for_vocab

FORMAT = "accel_gpt-shards"
VERSION = 1
MANIFEST = "manifest.json"

log = logging.getLogger(__name__)


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:06d}.bin"


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class ShardWriter:
    """One shard written as a stream of token arrays into a hidden temporary file, renamed when complete.

    Memory stays bounded by one write however large the shard, and the sha256 is updated as bytes go
    out, which saves reading the file back. The temporary name is fixed (no pid), so a re-run after a
    kill finds and replaces it.
    """

    def __init__(
        self, data_dir: str | Path, split: str, index: int, dtype: np.dtype, token_bytes: np.ndarray | None = None
    ) -> None:
        self.path = Path(data_dir) / shard_name(split, index)
        self.tmp = temp_sibling(self.path, "shard")
        self.dtype = np.dtype(dtype)
        self.token_bytes = token_bytes  # each id's UTF-8 byte length: the shard's byte count is summed as it goes
        self.tokens = 0
        self.bytes = 0
        self._hash = hashlib.sha256()
        self._file = open(self.tmp, "wb")

    def write(self, tokens: np.ndarray) -> None:
        data = np.ascontiguousarray(tokens, dtype=self.dtype)
        self._file.write(data.data)
        self._hash.update(data.data)
        self.tokens += int(data.size)
        if self.token_bytes is not None:
            self.bytes += count_bytes(data, self.token_bytes)

    def close(self) -> dict[str, Any]:
        """fsync, rename to the final name, fsync the folder; return the shard's manifest entry."""
        self._file.flush()
        self._file.close()
        publish(self.tmp, self.path)
        entry = {"file": self.path.name, "tokens": self.tokens, "sha256": self._hash.hexdigest()}
        return entry | ({"bytes": self.bytes} if self.token_bytes is not None else {})

    def abort(self) -> None:
        self._file.close()
        self.tmp.unlink(missing_ok=True)


def count_bytes(tokens: np.ndarray, token_bytes: np.ndarray, chunk: int = 1 << 24) -> int:
    """UTF-8 bytes of text that `tokens` stand for: one table lookup per token (a few ms per million), in chunks so
    that a memory-mapped shard is never copied whole."""
    return sum(int(token_bytes[tokens[i : i + chunk]].sum(dtype=np.int64)) for i in range(0, len(tokens), chunk))


def split_bytes(manifest: dict[str, Any], split: str) -> int | None:
    """The split's byte count (see the module docstring), or None for a manifest written before it was recorded."""
    value = manifest.get("bytes", {}).get(split)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def tokens_per_byte(manifest: dict[str, Any], split: str) -> float | None:
    """The split's tokens over its bytes, the factor from nats per token to bits per byte (times 1/ln 2); None
    without a byte count, or for a split without text (only end-of-text tokens)."""
    nbytes = split_bytes(manifest, split)
    if not nbytes:
        return None
    return sum(e["tokens"] for e in manifest["splits"][split]) / nbytes


def add_byte_counts(data_dir: str | Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """An older manifest with the byte counts it lacks, counted from its shards (which must be verified first)."""
    table = tokenizer(manifest, data_dir).token_bytes()
    splits = {}
    for split, entries in manifest["splits"].items():
        arrays = open_split(data_dir, manifest, split)
        splits[split] = [{**e, "bytes": count_bytes(a, table)} for e, a in zip(entries, arrays, strict=True)]
    counts = {split: sum(e["bytes"] for e in entries) for split, entries in splits.items()}
    return manifest | {"splits": splits, "bytes": counts}


def write_manifest(data_dir: str | Path, manifest: dict[str, Any]) -> None:
    atomic_write_json(Path(data_dir) / MANIFEST, {"format": FORMAT, "version": VERSION, **manifest})


def prepare_hint(data_dir: Path) -> str:
    """How to make `data_dir`: the prepare command with the two ways of naming the text. prepare writes into a new
    or empty folder only, so where `data_dir` holds files already, the command names another."""
    presets = ", ".join(preset_names(PrepareConfig))
    taken = data_dir.is_dir() and any(data_dir.iterdir())
    out = f"{data_dir}-prepared" if taken else str(data_dir)
    said = (
        f"write it with `run.py prepare --dataset SRC --out_dir {out}` (SRC: a text file or folder, a URL or a "
        f"hub id) or `run.py prepare --preset NAME --out_dir {out}` (NAME: {presets})"
    )
    return said + (f", a new folder since {data_dir} holds other files" if taken else "")


def read_manifest(data_dir: str | Path, by_prepare: bool = False) -> dict[str, Any]:
    """The manifest of a prepared folder, checked for the fields and types every reader relies on. A reader other
    than prepare itself (`by_prepare`) is refused while a prepare holds the folder: its manifest is not there yet,
    or not final."""
    if not str(data_dir):
        raise DataError("data_dir is required: a folder written by `run.py prepare`")
    data_dir = Path(data_dir)
    holder = None if by_prepare else lock_holder(data_dir)
    if holder:
        raise DataError(f"data_dir '{data_dir}' is being written by a prepare ({holder}): wait for it to finish")
    if data_dir.is_file():
        raise DataError(f"data_dir '{data_dir}' is a file; give the folder `run.py prepare` wrote")
    parts = [Path(part.strip()) for part in str(data_dir).split(",") if part.strip()]
    if not data_dir.is_dir() and len(parts) > 1 and all(part.is_dir() for part in parts):
        raise DataError(
            f"data_dir '{data_dir}' names {len(parts)} folders (a mixture's): this reads one folder at a time; give "
            f"one of {', '.join(map(str, parts))}"
        )
    if not data_dir.is_dir():
        close, hint = close_paths(data_dir, keep=lambda entry: (entry / MANIFEST).is_file()), prepare_hint(data_dir)
        hint = f"did you mean {' or '.join(close)}? If not, {hint}" if close else hint
        raise DataError(f"data_dir '{data_dir}' does not exist; {hint}")
    path = data_dir / MANIFEST
    if not path.is_file():
        raise DataError(f"no {MANIFEST} in data_dir '{data_dir}'; {prepare_hint(data_dir)}")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{path} is not an accel_gpt shard manifest (no format={FORMAT!r})")
    _check_fields(manifest, path)
    return manifest


def _check_fields(manifest: dict[str, Any], path: Path) -> None:
    def bad(what: str) -> DataError:
        return DataError(f"{path}: {what}; prepare the data again into a new --out_dir (prepare writes only there)")

    for key in ("vocab_size", "dtype", "splits", "tokenizer"):
        if key not in manifest:
            raise bad(f"lacks the field '{key}'")
    vocab = manifest["vocab_size"]
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise bad(f"vocab_size must be a positive integer, got {vocab!r}")
    if manifest["dtype"] not in ("uint16", "uint32"):
        raise bad(f"dtype must be uint16 or uint32, got {manifest['dtype']!r}")
    if np.dtype(manifest["dtype"]) != dtype_for_vocab(vocab):
        raise bad(f"dtype {manifest['dtype']} does not fit vocab_size {vocab} (expected {dtype_for_vocab(vocab)})")
    splits = manifest["splits"]
    if not isinstance(splits, dict) or not splits:
        raise bad(f"splits must map split names to lists of shards, got {splits!r}")
    for split, entries in splits.items():
        if not isinstance(entries, list) or not all(_is_entry(e) for e in entries):
            raise bad(f"split '{split}' must be a list of {{file, tokens, sha256}} entries")
        if not entries:
            raise bad(f"split '{split}' lists no shards (a split without tokens is left out of 'splits')")
        files = [e["file"] for e in entries]
        twice = next((f for i, f in enumerate(files) if f in files[:i] or f in _other_files(splits, split)), None)
        if twice is not None:
            raise bad(f"shard {twice} is listed twice (it would be read twice as often as the others)")
    totals = manifest.get("tokens", {})
    for split, total in totals.items() if isinstance(totals, dict) else ():
        listed = sum(e["tokens"] for e in splits.get(split, []))
        if split in splits and total != listed:
            raise bad(f"tokens.{split} says {total!r} but the {split} shards listed hold {listed}")
    counts = manifest.get("bytes", {})
    if not isinstance(counts, dict) or not all(_is_count(n) for n in counts.values()):
        raise bad(f"bytes must map split names to byte counts, got {counts!r}")
    try:
        tokenizer(manifest, path.parent)
    except (ValueError, TypeError) as e:
        raise bad(str(e)) from None
    except UserError as e:  # the bpe's tokenizer.json missing, changed or unreadable
        raise DataError(str(e)) from None


def _other_files(splits: dict[str, list[dict[str, Any]]], split: str) -> set[str]:
    return {e["file"] for other, entries in splits.items() if other < split for e in entries}


def _is_entry(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("file"), str)
        and isinstance(entry.get("tokens"), int)
        and entry["tokens"] >= 0
        and isinstance(entry.get("sha256"), str)
    )


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def tokenizer(manifest: dict[str, Any], data_dir: str | Path) -> Tokenizer:
    """The tokenizer the shards were written with (its vocabulary must agree with the manifest's); a bpe's
    tokenizer.json is read from `data_dir` and checked against the manifest's fingerprint."""
    if manifest["tokenizer"] == "bpe":
        sha256 = manifest.get("tokenizer_sha256")
        if not isinstance(sha256, str):
            raise ValueError("a bpe manifest needs tokenizer_sha256 (the fingerprint of its tokenizer.json)")
        tok = Tokenizer.from_dict({"name": "bpe", "sha256": sha256}, data_dir).load()
    else:
        tok = Tokenizer(manifest["tokenizer"], manifest.get("chars") or "")
    if tok.vocab_size != manifest["vocab_size"]:
        raise ValueError(f"vocab_size {manifest['vocab_size']} is not the {tok.name} tokenizer's {tok.vocab_size}")
    return tok


def tokenizer_fields(tok: Tokenizer) -> dict[str, Any]:
    """The manifest fields that describe `tok`."""
    fields: dict[str, Any] = {"tokenizer": tok.name}
    if tok.name == "char":
        fields["chars"] = tok.chars
    if tok.name == "bpe":
        fields["tokenizer_sha256"] = tok.sha256
    return fields | {"eot_token": tok.eot_token, "vocab_size": tok.vocab_size, "dtype": tok.dtype.name}


VerifyCache = Literal["ignore", "trust", "refresh"]
VERIFIED = ".verified.json"  # in data_dir, or under the user's cache folder when data_dir is read-only
VERIFIED_VERSION = 1


def verify_split(
    data_dir: str | Path, manifest: dict[str, Any], split: str, checksums: bool = True, cache: VerifyCache = "ignore"
) -> None:
    """Every shard of `split` is there and has the listed length; with `checksums`, also the listed sha256.

    `cache` says what the verified cache (see the module docstring) is used for: `ignore` hashes every shard
    and records nothing; `trust` hashes only the shards it does not vouch for and records them; `refresh`
    hashes every shard and records them all.
    """
    data_dir = Path(data_dir)
    entries = manifest["splits"].get(split)
    if not entries:
        raise DataError(f"data_dir '{data_dir}' has no '{split}' shards (splits: {', '.join(manifest['splits'])})")
    itemsize = np.dtype(manifest["dtype"]).itemsize
    stats = {}
    for entry in entries:
        path = data_dir / entry["file"]
        if not path.is_file():
            raise DataError(f"shard {path} listed in {MANIFEST} is {'a folder' if path.is_dir() else 'missing'}")
        stats[entry["file"]] = st = path.stat()
        if st.st_size != entry["tokens"] * itemsize:
            expected = entry["tokens"] * itemsize
            raise DataError(f"shard {path} is truncated or wrong: {st.st_size} bytes, expected {expected}")
    if not checksums:
        return
    verified = read_verified(data_dir) if cache != "ignore" else {}
    fresh = {}
    for entry in entries:
        name, st = entry["file"], stats[entry["file"]]
        if cache == "trust" and verified.get(name) == _fingerprint(st, entry["sha256"]):
            continue
        if sha256_file(data_dir / name) != entry["sha256"]:
            raise DataError(f"shard {data_dir / name} fails its checksum: the file changed since `prepare` wrote it")
        fresh[name] = _fingerprint(st, entry["sha256"])
    if cache != "ignore" and fresh:
        write_verified(data_dir, verified | fresh)


def _fingerprint(st: os.stat_result, sha256: str) -> dict[str, Any]:
    """What a verified shard looked like: any write changes mtime and ctime; a file renamed over it (a copy with
    its mtime preserved, `rsync -a`) has another inode and ctime, and nothing sets ctime back."""
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "ino": st.st_ino,
        "sha256": sha256,
    }


def verified_path(data_dir: str | Path) -> Path:
    """`data_dir/.verified.json`, or, when data_dir is read-only, a file named after its resolved path under
    `$XDG_CACHE_HOME/accel_gpt/verified` (default ~/.cache)."""
    data_dir = Path(data_dir)
    if os.access(data_dir, os.W_OK):
        return data_dir / VERIFIED
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "accel_gpt" / "verified"
    return root / f"{hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:24]}.json"


def read_verified(data_dir: str | Path) -> dict[str, dict[str, Any]]:
    """The shards verified earlier, by file name; empty when there is no cache or it is unreadable (a cache can
    only save work: a lost one costs one hashing)."""
    try:
        raw = json.loads(verified_path(data_dir).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(raw, dict) or raw.get("version") != VERIFIED_VERSION or not isinstance(raw.get("shards"), dict):
        return {}
    return raw["shards"]


def write_verified(data_dir: str | Path, shards: dict[str, dict[str, Any]]) -> None:
    """Publish the cache atomically; the temporary name carries host and pid, since the local main process of
    every node may write the same file on a shared file system. A failure is only a warning."""
    path = verified_path(data_dir)
    tmp = temp_sibling(path, f"{socket.gethostname()}-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"version": VERIFIED_VERSION, "shards": shards}, indent=1) + "\n")
        publish(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        log.warning("could not record verified shards in %s (%s): the next start hashes them again", path, e)


def open_split(data_dir: str | Path, manifest: dict[str, Any], split: str) -> list[np.ndarray]:
    """Read-only memory maps of the split's shards, in manifest order."""
    dtype = np.dtype(manifest["dtype"])
    return [
        np.memmap(Path(data_dir) / e["file"], dtype=dtype, mode="r", shape=(e["tokens"],))
        for e in manifest["splits"][split]
    ]


def first_token(data_dir: str | Path, manifest: dict[str, Any], split: str) -> int | None:
    """The split's first token id (one read), or None for an empty split."""
    entries = manifest["splits"][split]
    if not entries or not entries[0]["tokens"]:
        return None
    path = Path(data_dir) / entries[0]["file"]
    return int(np.memmap(path, dtype=np.dtype(manifest["dtype"]), mode="r", shape=(1,))[0])


def max_token_id(data_dir: str | Path, manifest: dict[str, Any], split: str) -> int:
    """The largest token id in a split: the manifest's record (`max_id` per shard, written by `prepare`), or,
    for a manifest without it, read once from the shards."""
    entries = manifest["splits"][split]
    if all(isinstance(e.get("max_id"), int) for e in entries):
        return max((e["max_id"] for e in entries), default=-1)
    verify_split(data_dir, manifest, split, checksums=False)  # there and of their length: a damaged one is one line
    return max((int(a.max()) for a in open_split(data_dir, manifest, split) if a.size), default=-1)
