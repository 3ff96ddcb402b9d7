"""The on-disk token format: flat little-endian uint16 (or uint32) shards plus `manifest.json`.

A shard is a bare array of token ids with no header, so it can be memory-mapped as is. Everything
about it lives in the manifest:

    {"format": "accel_gpt-shards", "version": 1,
     "tokenizer": "gpt2" | "char", "chars": "<vocabulary, char tokenizer only>",
     "eot_token": 50256 | null, "vocab_size": 50257, "dtype": "uint16",
     "splits": {"train": [{"file": "train_000000.bin", "tokens": N, "sha256": "..."}, ...],
                "val": [...]},
     "documents": {"train": n, "val": m}, "source": {...}, "args": {...}}

Writers go through `write_shard`/`write_manifest`, which write a temporary name and rename it, so a
reader never sees a half-written file.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from accel_gpt.errors import DataError

FORMAT = "accel_gpt-shards"
VERSION = 1
MANIFEST = "manifest.json"


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 holds GPT-2's 50,257 ids in half the bytes of uint32; larger vocabularies need uint32."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:06d}.bin"


def sha256_file(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _atomic_write(path: Path, write) -> None:
    """Write through `write(file)` into a temporary sibling, fsync, then rename over `path`."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_shard(data_dir: Path, split: str, index: int, tokens: np.ndarray) -> dict[str, Any]:
    """Write one complete shard atomically; return its manifest entry."""
    path = Path(data_dir) / shard_name(split, index)
    _atomic_write(path, lambda f: f.write(np.ascontiguousarray(tokens).tobytes()))
    return {"file": path.name, "tokens": int(tokens.size), "sha256": sha256_file(path)}


def write_manifest(data_dir: Path, manifest: dict[str, Any]) -> None:
    manifest = {"format": FORMAT, "version": VERSION, **manifest}
    text = json.dumps(manifest, indent=2).encode()
    _atomic_write(Path(data_dir) / MANIFEST, lambda f: f.write(text))


def read_manifest(data_dir: str | Path) -> dict[str, Any]:
    if not str(data_dir):
        raise DataError("data_dir is required: a folder written by `run.py prepare`")
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"data_dir '{data_dir}' does not exist; write it with `run.py prepare --out_dir {data_dir}`")
    path = data_dir / MANIFEST
    if not path.is_file():
        raise DataError(f"no {MANIFEST} in data_dir '{data_dir}'; write it with `run.py prepare`")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON: {e}") from None
    if manifest.get("format") != FORMAT:
        raise DataError(f"{path} is not an accel_gpt shard manifest (format={manifest.get('format')!r})")
    for key in ("vocab_size", "dtype", "splits", "tokenizer"):
        if key not in manifest:
            raise DataError(f"{path} lacks the field '{key}'")
    if np.dtype(manifest["dtype"]) != dtype_for_vocab(manifest["vocab_size"]):
        raise DataError(
            f"{path}: dtype {manifest['dtype']} does not fit vocab_size {manifest['vocab_size']} "
            f"(expected {dtype_for_vocab(manifest['vocab_size'])})"
        )
    return manifest


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


# --- Streaming writes and multi-part outputs (used by `prepare`) ---------------------------------------------------

TMP_SUFFIX = ".tmp"


class ShardFile:
    """One shard written as a stream of token arrays into a hidden temporary file, renamed when complete.

    `write_shard` needs the whole shard in memory; with 100M-token shards that is 200 MB per split, so `prepare
    --streaming` appends here instead and memory stays bounded by one write. The sha256 is updated as bytes go out,
    which saves reading the file back. The temporary name has no pid, so a re-run after a kill finds and replaces it.
    """

    def __init__(self, data_dir: str | Path, split: str, index: int, dtype: np.dtype) -> None:
        self.path = Path(data_dir) / shard_name(split, index)
        self.tmp = self.path.with_name(f".{self.path.name}{TMP_SUFFIX}")
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
        os.fsync(self._file.fileno())
        self._file.close()
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)
        return {"file": self.path.name, "tokens": self.tokens, "sha256": self._hash.hexdigest()}

    def abort(self) -> None:
        self._file.close()
        self.tmp.unlink(missing_ok=True)


def fsync_dir(path: Path) -> None:
    """Make a rename durable: without it a power cut can forget a rename the state file already records."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_temp_files(data_dir: str | Path) -> list[Path]:
    """Delete the hidden temporaries a killed writer left behind (`ShardFile` and `_atomic_write` names)."""
    removed = []
    for path in Path(data_dir).glob(".*.tmp*"):
        if path.is_file() and (path.name.endswith(TMP_SUFFIX) or ".tmp-" in path.name):
            path.unlink()
            removed.append(path)
    return removed


def write_json(path: str | Path, obj: Any) -> None:
    """Atomically replace a small JSON file (e.g. `prepare`'s resume state)."""
    text = json.dumps(obj, indent=1).encode()
    _atomic_write(Path(path), lambda f: f.write(text))


def part_dir_name(index: int, count: int) -> str:
    """Folder of one part of a multi-node `prepare`, inside the common out_dir."""
    return f"part-{index:05d}-of-{count:05d}"


def merge_manifests(parts: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One manifest over the parts' shards: file paths become `<part dir>/<file>`, splits concatenate in part order.

    `parts` is [(part dir name, that part's manifest)] in part order. Tokenizer, vocabulary and dtype must agree.
    """
    if not parts:
        raise DataError("no parts to merge")
    first = parts[0][1]
    same = ("tokenizer", "chars", "vocab_size", "dtype", "eot_token")
    for name, manifest in parts[1:]:
        for key in same:
            if manifest.get(key) != first.get(key):
                raise DataError(
                    f"part {name} has {key}={manifest.get(key)!r} but part {parts[0][0]} has {first.get(key)!r}"
                )
    splits: dict[str, list[dict[str, Any]]] = {}
    documents: dict[str, int] = {}
    tokens: dict[str, int] = {}
    for name, manifest in parts:
        for split, entries in manifest["splits"].items():
            splits.setdefault(split, []).extend({**e, "file": f"{name}/{e['file']}"} for e in entries)
            tokens[split] = tokens.get(split, 0) + sum(e["tokens"] for e in entries)
        for split, n in manifest.get("documents", {}).items():
            documents[split] = documents.get(split, 0) + n
    merged = {k: v for k, v in first.items() if k not in ("format", "version", "part")}
    merged.update(splits=splits, tokens=tokens, documents=documents)
    merged["parts"] = [
        {"dir": name, "tokens": m.get("tokens", {}), "documents": m.get("documents", {})} for name, m in parts
    ]
    return merged
