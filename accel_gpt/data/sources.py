"""Where `prepare`'s text comes from, read through `datasets`: the only module of accel_gpt.data that imports it.

`datasets` (and pyarrow) are imported inside the functions that use them, so importing this module stays cheap
and the tokenizer workers never load them.
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import re
import shutil
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accel_gpt.config import PrepareConfig
from accel_gpt.errors import DataError, UserError
from accel_gpt.files import replacing
from accel_gpt.limits import file_size_limit, file_size_reason

READ_ROWS = 1024  # rows per Arrow batch read from the dataset
# Tiny Shakespeare (char-rnn's 1.1 MB corpus, public domain), shipped so that a first run needs no download and no
# file of the user's: the text of an unset --dataset.
BUNDLED_TEXT = Path(__file__).with_name("tinyshakespeare.txt")

_LOADERS = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".json": "json",
    ".jsonl": "json",
    ".ndjson": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}
_COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".lz4")


@dataclass(frozen=True)
class Source:
    """Where the text comes from, resolved from --dataset without touching the network."""

    kind: str  # "hub" | "files" | "url" | "disk"
    name: str  # --dataset as given
    loader: str = ""  # datasets builder (text/json/parquet/csv) for files and URLs
    files: tuple[str, ...] = ()

    def describe(self) -> dict[str, Any]:
        """The manifest's record of the source."""
        info: dict[str, Any] = {"dataset": self.name, "kind": self.kind}
        if self.loader:
            info["loader"] = self.loader
        if self.kind == "files":
            info["files"] = len(self.files)
        return info

    def inputs(self) -> list[dict[str, Any]] | None:
        """Name, size and modification time of every local input file: a re-run compares them, so that a finished
        prepare of text that has changed since is not reported as done. None for hub ids and URLs (nothing local)."""
        base = Path(self.name).expanduser()
        if self.kind == "files":
            paths = [Path(f) for f in self.files]
        elif self.kind == "disk":
            paths = sorted(p for p in base.rglob("*") if p.is_file() and not _hidden(p.relative_to(base)))
        else:
            return None
        return [_file_record(p, base) for p in paths]


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def _file_record(path: Path, base: Path) -> dict[str, Any]:
    stat = path.stat()
    name = path.relative_to(base).as_posix() if base.is_dir() else path.name
    return {"file": name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def resolve_source(dataset: str) -> Source:
    """Classify --dataset: URL, save_to_disk folder, local files, else a hub id (a missing local path is an error);
    unset, the bundled tiny Shakespeare."""
    if not dataset:
        return Source("files", str(BUNDLED_TEXT), "text", (str(BUNDLED_TEXT),))
    if re.match(r"https?://", dataset):
        return Source("url", dataset, _loader_for(urllib.parse.urlparse(dataset).path) or "text", (dataset,))
    path = Path(dataset).expanduser()
    if path.is_dir():
        if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
            return Source("disk", dataset)
        return _folder_source(dataset, path)
    if path.is_file():
        loader = _loader_for(path.name)
        if loader is None:
            raise DataError(f"--dataset '{dataset}': unsupported file type (expected {', '.join(_LOADERS)})")
        return Source("files", dataset, loader, (str(path),))
    if dataset.startswith(("/", ".", "~")) or dataset.count("/") > 1 or _loader_for(dataset):
        raise DataError(f"--dataset '{dataset}' does not exist (no such file or folder)")
    return Source("hub", dataset)


def _folder_source(dataset: str, path: Path) -> Source:
    """All data files under a folder (hidden ones skipped), which must share one format."""
    visible = (p for p in path.rglob("*") if not _hidden(p.relative_to(path)))
    files = sorted(p for p in visible if p.is_file())
    by_loader: dict[str, list[str]] = {}
    for p in files:
        if loader := _loader_for(p.name):
            by_loader.setdefault(loader, []).append(str(p))
    if not by_loader:
        raise DataError(f"--dataset '{dataset}': the folder has no data files ({', '.join(_LOADERS)})")
    if len(by_loader) > 1:
        kinds = ", ".join(f"{len(v)} {k}" for k, v in by_loader.items())
        raise DataError(f"--dataset '{dataset}': the folder mixes file types ({kinds}); point at one kind")
    ((loader, names),) = by_loader.items()
    return Source("files", dataset, loader, tuple(names))


def _loader_for(name: str) -> str | None:
    name = name.lower()
    for ext in _COMPRESSIONS:
        name = name.removesuffix(ext)
    return _LOADERS.get(Path(name).suffix)


@dataclass
class Stream:
    """One pass over one split of the source: its first `val_tokens` tokens go to 'val', the rest to `split`."""

    dataset: Any  # a datasets Dataset or IterableDataset
    column: str
    split: str
    val_tokens: int = 0

    def texts(self, start: int = 0) -> Iterator[str | None]:
        """The documents from row `start` on, read as Arrow batches (3x faster than dict rows when streaming).

        A row without text (null, or the column missing from that row) is yielded as None, not as "": it is no
        document, and `make_tasks` counts it so that the summary and the manifest can say how many were skipped.
        """
        import datasets
        import pyarrow as pa

        ds = self.dataset
        mapped = {entry["filename"] for entry in getattr(ds, "cache_files", None) or []}
        if start:
            ds = ds.skip(start) if _is_iterable(ds) else ds.select(range(start, len(ds)))
        batches = ds.select_columns([self.column]).with_format("arrow").iter(batch_size=READ_ROWS)
        unreleased = 0
        try:
            for table in batches:
                yield from table.column(0).to_pylist()
                unreleased += table.nbytes
                if mapped and unreleased >= RELEASE_BYTES:
                    release_mapped(mapped)
                    unreleased = 0
        except (datasets.exceptions.DatasetGenerationError, pa.ArrowInvalid, UnicodeDecodeError) as e:
            raise DataError(_load_error("the dataset", e)) from None


# Text read from a memory-mapped Arrow cache between two `release_mapped` calls.
RELEASE_BYTES = 64 << 20
MADV_DONTNEED = 4  # Linux's <sys/mman.h>


def release_mapped(paths: set[str]) -> None:
    """Drop this process's resident pages of its memory mappings of the files `paths`, which it only reads: a later
    read maps them again from the page cache. Without it a pass over a `datasets` cache keeps every page it read
    resident, and the process's RSS grows by the whole cache (1 GB of text: 1 GB of RSS), which a scheduler that
    polices RSS counts against the job although the kernel could reclaim it. Linux only; elsewhere nothing."""
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] in paths and "w" not in fields[1]:
            start, end = (int(bound, 16) for bound in fields[0].split("-"))
            madvise(start, end - start, MADV_DONTNEED)


def open_streams(source: Source, cfg: PrepareConfig, index: int = 0, count: int = 1) -> list[Stream]:
    """The passes part `index` of `count` makes, in output order; validation comes from part 0 only."""
    train = _select_part(_limit(load_split(source, cfg.split, cfg), cfg.limit), index, count)
    streams = []
    if cfg.val_split and index == 0:
        streams.append(Stream(_limit(load_split(source, cfg.val_split, cfg), cfg.limit), cfg.text_column, "val"))
    streams.append(Stream(train, cfg.text_column, "train", cfg.val_tokens if index == 0 else 0))
    return streams


def load_split(source: Source, split: str, cfg: PrepareConfig) -> Any:
    """One split as a `datasets` Dataset (or IterableDataset with --streaming), checked for the text column."""
    import datasets

    label = f"'{source.name}' split '{split}'"
    quiet = source.kind != "hub" and datasets.is_progress_bar_enabled()
    if quiet:
        datasets.disable_progress_bars()  # a local load takes a second; its bars would bury the one-line errors
    try:
        ds = _load(source, split, cfg)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets raises many types for bad input; each becomes one line
        offline = source.kind == "hub" and datasets.config.HF_HUB_OFFLINE
        raise DataError(_load_error(label, e) + (" (HF_HUB_OFFLINE is set)" if offline else "")) from None
    finally:
        if quiet:
            datasets.enable_progress_bars()
    _check_column(ds, cfg.text_column, label)
    return ds


def _load(source: Source, split: str, cfg: PrepareConfig) -> Any:
    import datasets

    if source.kind == "hub":
        num_proc = cfg.num_proc if cfg.num_proc > 1 and not cfg.streaming else None
        return datasets.load_dataset(
            source.name, cfg.dataset_config, split=split, streaming=cfg.streaming, num_proc=num_proc
        )
    if source.kind == "disk":
        loaded = datasets.load_from_disk(source.name)  # memory-mapped Arrow: bounded memory with or without streaming
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise DataError(f"'{source.name}' has no split '{split}' (splits: {', '.join(loaded)})")
            return loaded[split]
        if split != "train":
            raise DataError(f"'{source.name}' is a single saved Dataset, with no split '{split}'")
        return loaded
    if split != "train":
        raise DataError(
            f"--dataset '{source.name}' has one split, 'train' (asked for '{split}'); "
            "hold out validation with --val_tokens"
        )
    files = [str(_download(source.name))] if source.kind == "url" else list(source.files)
    kwargs = {"sample_by": cfg.sample_by} if source.loader == "text" else {}
    return datasets.load_dataset(source.loader, data_files=files, split="train", streaming=cfg.streaming, **kwargs)


def _load_error(label: str, e: BaseException) -> str:
    """One line from a `datasets` exception chain; an empty file shows up as a schema-inference failure."""
    chain: list[BaseException] = []
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    if any(type(x).__name__ == "SchemaInferenceError" for x in chain):
        return f"{label} has no documents (empty input)"
    if any(isinstance(x, OSError) and x.errno == errno.EFBIG for x in chain) and (limit := file_size_limit()):
        return f"could not load {label}: writing the datasets cache, {file_size_reason(limit)}"
    last = chain[-1]
    message = str(last).strip().splitlines()[0] if str(last).strip() else type(last).__name__
    return f"could not load {label}: {message}"


def _download(url: str) -> Path:
    """Fetch a URL once into the datasets cache, honouring HF_DATASETS_OFFLINE. urllib, not datasets' own http
    support, which needs the optional `aiohttp`."""
    import datasets

    cache = Path(datasets.config.HF_DATASETS_CACHE) / "accel_gpt_downloads"
    base = Path(urllib.parse.urlparse(url).path).name or "download"
    path = cache / f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{base}"
    if path.is_file():
        return path
    if datasets.config.HF_DATASETS_OFFLINE:
        raise DataError(f"cannot download {url}: HF_DATASETS_OFFLINE is set and it is not in {cache}")
    cache.mkdir(parents=True, exist_ok=True)
    try:
        with replacing(path) as tmp, urllib.request.urlopen(url, timeout=60) as response, open(tmp, "wb") as f:
            shutil.copyfileobj(response, f, 1 << 20)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise DataError(f"could not download {url}: {getattr(e, 'reason', e)}") from None
    return path


def _check_column(ds: Any, column: str, label: str) -> None:
    """The text column exists and holds strings; the split is not empty (a streaming one is peeked at)."""
    import pyarrow as pa

    if _is_iterable(ds):
        first = next(iter(ds.with_format("arrow").iter(batch_size=1)), None)
        if first is None:
            raise DataError(f"{label} has no documents (empty input)")
        schema = first.schema
    else:
        if len(ds) == 0:
            raise DataError(f"{label} has no documents (empty input)")
        schema = ds.features.arrow_schema
    if column not in schema.names:
        raise DataError(
            f"column '{column}' is not in {label} (columns: {', '.join(schema.names)}); choose one with --text_column"
        )
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise DataError(f"column '{column}' of {label} holds {kind}, not text; choose one with --text_column")


def _limit(ds: Any, limit: int) -> Any:
    """The first `limit` documents (0: all)."""
    if not limit:
        return ds
    return ds.take(limit) if _is_iterable(ds) else ds.select(range(min(limit, len(ds))))


def _select_part(ds: Any, index: int, count: int) -> Any:
    """Part `index` of `count`: contiguous rows (so parts in order are the input in order), or, streaming,
    `split_dataset_by_node`."""
    if count == 1:
        return ds
    if not _is_iterable(ds) and len(ds) < count:  # datasets raises IndexError for a part with no rows
        raise DataError(
            f"--num_shards {count} splits the input into more parts than it has documents ({len(ds):,}): every part "
            f"needs at least one; use --num_shards {len(ds)} or fewer"
        )
    if _is_iterable(ds):
        from datasets.distributed import split_dataset_by_node

        return split_dataset_by_node(ds, rank=index, world_size=count)
    return ds.shard(num_shards=count, index=index, contiguous=True)


def _is_iterable(ds: Any) -> bool:
    import datasets

    return isinstance(ds, datasets.IterableDataset)
