"""The on-disk token format: flat little-endian uint16 (or uint32) shards plus `manifest.json`.

A shard is a bare array of token ids with no header, so it can be memory-mapped as is. Everything
about it lives in the manifest:

    {"format": "accel_gpt-shards", "version": 1,
     "tokenizer": "gpt2" | "char", "chars": "<vocabulary, char tokenizer only>",
     "eot_token": 50256 | null, "vocab_size": 50257, "dtype": "uint16",
     "splits": {"train": [{"file": "train_000000.bin", "tokens": N, "sha256": "..."}, ...],
                "val": [...]},
     "documents": {"train": n, "val": m}, "source": {...}, "args": {...}}

A shard's `file` is relative to the manifest's folder (a multi-part prepare lists `part-.../train_000000.bin`).
Shards and the manifest are written under a temporary name and renamed when complete, so a reader
never sees a half-written file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from accel_gpt.errors import DataError
from accel_gpt.files import atomic_write_json, publish, temp_sibling
from accel_gpt.tokenizer import Tokenizer, dtype_for_vocab

FORMAT = "accel_gpt-shards"
VERSION = 1
MANIFEST = "manifest.json"


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

    def __init__(self, data_dir: str | Path, split: str, index: int, dtype: np.dtype) -> None:
        self.path = Path(data_dir) / shard_name(split, index)
        self.tmp = temp_sibling(self.path, "shard")
        self.dtype = np.dtype(dtype)
        self.tokens = 0
        self._hash = hashlib.sha256()
        self._file = open(self.tmp, "wb")

    def write(self, tokens: np.ndarray) -> None:
        data = np.ascontiguousarray(tokens, dtype=self.dtype)
        self._file.write(data.data)
        self._hash.update(data.data)
        self.tokens += int(data.size)

    def close(self) -> dict[str, Any]:
        """fsync, rename to the final name, fsync the folder; return the shard's manifest entry."""
        self._file.flush()
        self._file.close()
        publish(self.tmp, self.path)
        return {"file": self.path.name, "tokens": self.tokens, "sha256": self._hash.hexdigest()}

    def abort(self) -> None:
        self._file.close()
        self.tmp.unlink(missing_ok=True)


def write_manifest(data_dir: str | Path, manifest: dict[str, Any]) -> None:
    atomic_write_json(Path(data_dir) / MANIFEST, {"format": FORMAT, "version": VERSION, **manifest})


def read_manifest(data_dir: str | Path) -> dict[str, Any]:
    """The manifest of a prepared folder, checked for the fields and types every reader relies on."""
    if not str(data_dir):
        raise DataError("data_dir is required: a folder written by `run.py prepare`")
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"data_dir '{data_dir}' does not exist; write it with `run.py prepare --out_dir {data_dir}`")
    path = data_dir / MANIFEST
    if not path.is_file():
        raise DataError(f"no {MANIFEST} in data_dir '{data_dir}'; write it with `run.py prepare`")
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
        return DataError(f"{path}: {what}; re-run `run.py prepare` to rewrite it")

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
    try:
        tokenizer(manifest)
    except (ValueError, TypeError) as e:
        raise bad(str(e)) from None


def _is_entry(entry: Any) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("file"), str)
        and isinstance(entry.get("tokens"), int)
        and entry["tokens"] >= 0
        and isinstance(entry.get("sha256"), str)
    )


def tokenizer(manifest: dict[str, Any]) -> Tokenizer:
    """The tokenizer the shards were written with (its vocabulary must agree with the manifest's)."""
    tok = Tokenizer(manifest["tokenizer"], manifest.get("chars") or "")
    if tok.vocab_size != manifest["vocab_size"]:
        raise ValueError(f"vocab_size {manifest['vocab_size']} is not the {tok.name} tokenizer's {tok.vocab_size}")
    return tok


def tokenizer_fields(tok: Tokenizer) -> dict[str, Any]:
    """The manifest fields that describe `tok`."""
    fields: dict[str, Any] = {"tokenizer": tok.name}
    if tok.name == "char":
        fields["chars"] = tok.chars
    return fields | {"eot_token": tok.eot_token, "vocab_size": tok.vocab_size, "dtype": tok.dtype.name}


def verify_split(data_dir: str | Path, manifest: dict[str, Any], split: str, checksums: bool = True) -> None:
    """Every shard of `split` is there, has the listed length and, with `checksums`, the listed sha256."""
    data_dir = Path(data_dir)
    entries = manifest["splits"].get(split)
    if not entries:
        raise DataError(f"data_dir '{data_dir}' has no '{split}' shards (splits: {', '.join(manifest['splits'])})")
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for entry in entries:
        path = data_dir / entry["file"]
        if not path.is_file():
            raise DataError(f"shard {path} listed in {MANIFEST} is missing")
        size = path.stat().st_size
        if size != entry["tokens"] * itemsize:
            raise DataError(f"shard {path} is truncated or wrong: {size} bytes, expected {entry['tokens'] * itemsize}")
        if checksums and sha256_file(path) != entry["sha256"]:
            raise DataError(f"shard {path} fails its checksum: the file changed since `prepare` wrote it")


def open_split(data_dir: str | Path, manifest: dict[str, Any], split: str) -> list[np.ndarray]:
    """Read-only memory maps of the split's shards, in manifest order."""
    dtype = np.dtype(manifest["dtype"])
    return [
        np.memmap(Path(data_dir) / e["file"], dtype=dtype, mode="r", shape=(e["tokens"],))
        for e in manifest["splits"][split]
    ]


def max_token_id(data_dir: str | Path, manifest: dict[str, Any], split: str) -> int:
    """The largest token id in a split: the manifest's record (`max_id` per shard, written by `prepare`), or,
    for a manifest without it, read once from the shards."""
    entries = manifest["splits"][split]
    if all(isinstance(e.get("max_id"), int) for e in entries):
        return max((e["max_id"] for e in entries), default=-1)
    return max((int(a.max()) for a in open_split(data_dir, manifest, split) if a.size), default=-1)
