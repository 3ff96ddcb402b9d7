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
