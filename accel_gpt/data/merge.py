"""Multi-part outputs: K machines each prepare part i of the input into `out_dir/part-0000i-of-0000K/` (a complete
shard folder with its own manifest), and one manifest in `out_dir` lists every part's shards in part order.

Parts in order are the input in order, so the merged stream is the stream a single run would have written.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from accel_gpt.data import shards
from accel_gpt.errors import DataError

# Manifest fields every part must share: the shards of all parts are read as one stream of one vocabulary.
_SHARED = ("tokenizer", "chars", "tokenizer_sha256", "vocab_size", "dtype", "eot_token")
# Arguments that differ between the parts of one prepare by design.
_PER_PART = ("shard_index", "num_proc")


def shared_args(args: dict[str, Any]) -> dict[str, Any]:
    """The recorded prepare arguments that every part of one prepare must share."""
    return {k: v for k, v in args.items() if k not in _PER_PART}


def other_args(first: dict[str, Any], other: dict[str, Any]) -> str:
    """Where `other` differs from `first`, in words: `name first -> other; ...` (a tokenizer file by its sha256)."""
    names = [k for k in {**first, **other} if first.get(k) != other.get(k)]

    def value(key: str, args: dict[str, Any]) -> str:
        v = args.get(key)
        return repr(v[:12] + "...") if key == "tokenizer_sha256" and isinstance(v, str) else repr(v)

    shown = {"tokenizer_sha256": "tokenizer_file's sha256"}
    return "; ".join(f"{shown.get(k, k)} {value(k, first)} -> {value(k, other)}" for k in names)


def part_dir_name(index: int, count: int) -> str:
    """Folder of one part of a multi-machine `prepare`, inside the common out_dir."""
    return f"part-{index:05d}-of-{count:05d}"


def merge_manifests(parts: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One manifest over the parts' shards: file paths become `<part dir>/<file>`, splits concatenate in part order.

    `parts` is [(part dir name, that part's manifest)] in part order. Tokenizer, vocabulary and dtype must agree.
    """
    if not parts:
        raise DataError("no parts to merge")
    first_name, first = parts[0]
    for name, manifest in parts[1:]:
        for key in _SHARED:
            if manifest.get(key) != first.get(key):
                raise DataError(
                    f"part {name} has {key}={manifest.get(key)!r} but part {first_name} has {first.get(key)!r}"
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
    merged = {k: v for k, v in first.items() if k not in ("format", "version", "part", "bytes")}
    merged.update(splits=splits, tokens=tokens, documents=documents)
    if all(_has_bytes(m) for _, m in parts):  # a part from before byte counts leaves the sums unknown
        merged["bytes"] = {s: sum(m["bytes"].get(s, 0) for _, m in parts) for s in splits}
    if any("skipped_null" in m for _, m in parts):  # rows without text, summed like the documents
        merged["skipped_null"] = sum(m.get("skipped_null", 0) for _, m in parts)
    merged["parts"] = [
        {"dir": name, "tokens": m.get("tokens", {}), "documents": m.get("documents", {})}
        | ({"bytes": m["bytes"]} if _has_bytes(m) else {})
        for name, m in parts
    ]
    return merged


def _has_bytes(manifest: dict[str, Any]) -> bool:
    """The part counts the bytes of every split it has (`shards.split_bytes`)."""
    return all(shards.split_bytes(manifest, split) is not None for split in manifest["splits"])


def merge_parts(out_dir: str | Path, checksums: bool = True) -> dict[str, Any]:
    """Write `out_dir/manifest.json` over all `part-*-of-K` folders; every part must be finished and consistent."""
    out_dir = Path(out_dir)
    found = {}
    for path in out_dir.glob("part-*-of-*"):
        if m := re.fullmatch(r"part-(\d+)-of-(\d+)", path.name):
            found[path.name] = (int(m.group(1)), int(m.group(2)))
    if not found:
        raise DataError(f"no part-*-of-* folders in '{out_dir}' to merge")
    counts = {k for _, k in found.values()}
    if len(counts) > 1:
        raise DataError(f"'{out_dir}' holds parts of different part counts ({', '.join(sorted(found))}); keep one set")
    (count,) = counts
    names = [part_dir_name(i, count) for i in range(count)]
    missing = [n for n in names if not (out_dir / n / shards.MANIFEST).is_file()]
    if missing:
        raise DataError(f"cannot merge '{out_dir}': unfinished or missing parts: {', '.join(missing)}")
    parts = []
    for name in names:
        manifest = shards.read_manifest(out_dir / name, by_prepare=True)
        for split in manifest["splits"]:
            shards.verify_split(out_dir / name, manifest, split, checksums=checksums)
        parts.append((name, manifest))
    args = [shared_args(m.get("args", {})) for _, m in parts]
    for (name, _), a in zip(parts[1:], args[1:], strict=True):
        if a != args[0]:
            raise DataError(
                f"part {name} was prepared with other arguments than {names[0]} ({other_args(args[0], a)}): "
                f"prepare it again with {names[0]}'s arguments (delete '{out_dir / name}' first)"
            )
    merged = merge_manifests(parts)
    merged["args"] = args[0]
    shards.tokenizer(parts[0][1], out_dir / names[0]).copy_to(out_dir)  # a bpe's tokenizer.json beside the manifest
    shards.write_manifest(out_dir, merged)
    return merged


def all_parts_finished(out_dir: Path, count: int) -> bool:
    return all((out_dir / part_dir_name(i, count) / shards.MANIFEST).is_file() for i in range(count))


def merge_if_complete(out_dir: Path, count: int) -> None:
    """The last part to finish merges (each part verified its own shards, so sizes are checked, not checksums)."""
    if all_parts_finished(out_dir, count):
        merge_parts(out_dir, checksums=False)
