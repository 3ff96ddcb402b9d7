"""`run.py prepare`: text -> GPT-2 (or char) token shards + manifest.json. The only module that imports `datasets`.

The choices a reader needs before the code:

- **Sources** go through `datasets`: a hub id (`load_dataset(id, config, split=..., streaming=...)`), local
  .txt/.json/.jsonl/.parquet/.csv files or folders of them (the packaged builders), a `save_to_disk` folder
  (`load_from_disk`), or an http(s) URL to such a file. URLs are fetched once with urllib into the datasets cache and
  then loaded like a local file: datasets' own http support needs `aiohttp`, an optional extra.
- **Document unit** for plain text (`--sample_by`, the text builder's option): `paragraph` (blank-line separated)
  by default with the gpt2 tokenizer. `line` would put an EOT after every line of verse or code and cut every
  multi-line passage; `document` makes a whole file one document, which suits a folder of separate files and the
  tinyshakespeare preset (nanoGPT encodes that file as one text). With `--tokenizer char` the default is `document`:
  char streams have no separator, and paragraphs glued together would lose their blank lines.
- **EOT placement**: the end-of-text token 50256 *precedes every document* (as in build-nanogpt), so the stream is
  `EOT d0 EOT d1 ...`. A document then starts with EOT wherever it lands, the concatenation of any parts is again a
  valid stream, and splitting the tokens at 50256 and decoding gives back the documents exactly (`encode_ordinary`
  keeps a literal "<|endoftext|>" in the text as plain tokens, never 50256).
- **Validation**: `--val_split S` tokenizes the dataset's own split into `val`; otherwise `--val_tokens N` sends the
  *first* N tokens of the stream to `val` (the first, not the last, because a stream's length is unknown until its
  end) and the rest to `train`. The cut is exact and may fall inside a document.
- **Layout**: this module holds the options, the `datasets` side and the command; `pipeline.py` the tasks, the
  worker pool and the resumable shard writer; `encode.py` what the workers run; `shards.py` the file format.
- **Parallelism**: the main process reads documents and groups them into tasks of about `task_chars` characters;
  `--num_proc` spawned workers encode a task with plain `encode_ordinary` calls into one numpy array (see
  `encode.py` for why not `encode_ordinary_batch` or `Dataset.map`). A document longer than a task is cut at safe
  boundaries into pieces, so one huge document still feeds every worker, with the tokens of the whole. At most
  2 * num_proc tasks are in flight, and shards are streamed to disk, so memory does not grow with the data.
- **Crash safety and resume**: a shard is written under a hidden temporary name and renamed when complete. After
  each shard a small state file (`.prepare_state.json`) records the shard (size, sha256, documents) and where the
  stream stands: (document index, tokens of that document already written). Re-running the same command verifies
  the recorded shards (size and sha256; from the first bad one on it prepares again), skips the finished documents
  without tokenizing them, re-tokenizes the document cut by the last shard boundary and drops its written part.
  Output is a function of the data and the arguments only (not of num_proc, the kill, or the task size), so a
  killed-and-resumed run writes the same bytes as an uninterrupted one. `manifest.json` is written last, and only
  then is the state file removed. A bad input (UserError) removes everything this prepare wrote.
- **Several machines**: `--num_shards K --shard_index i`, or `RANK`/`WORLD_SIZE` from `accelerate launch`/torchrun,
  makes this process prepare part i of the input into `out_dir/part-0000i-of-0000K/` (a complete shard folder with
  its own manifest). Non-streaming parts are contiguous row ranges, so the parts in order are the whole input in
  order; streaming parts follow `datasets.distributed.split_dataset_by_node`. Validation (first tokens or own split)
  comes from part 0 only. The part that finishes last and sees all K manifests writes `out_dir/manifest.json`
  listing every part's shards (`part-.../train_000000.bin`); `run.py prepare --merge --out_dir D` does the same by
  hand (and checks every checksum), e.g. after copying parts from machines without a shared filesystem.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import os
import re
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from accel_gpt.data import shards
from accel_gpt.data.encode import EncoderSpec, encode_pieces, unique_chars, warm_gpt2
from accel_gpt.data.pipeline import STATE_FILE, Resume, State, StreamWriter, Workers, make_tasks
from accel_gpt.errors import ConfigError, DataError, UserError

log = logging.getLogger(__name__)

# ~1M characters is ~0.3M GPT-2 tokens, 0.1-0.2 s of encoding: large enough that pickling and queueing a task cost
# ~1% of it, small enough that 2 * num_proc tasks in flight hold only a few MB.
TASK_CHARS = 1 << 20
READ_ROWS = 1024  # rows per Arrow batch read from the dataset

TINYSHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
PRESETS: dict[str, dict[str, Any]] = {
    # The classic 1.1 MB file as one document (nanoGPT's shakespeare and shakespeare_char preps). About 10% is held
    # out: 338,025 gpt2 tokens / 1,115,394 characters in all.
    "tinyshakespeare": {
        "dataset": TINYSHAKESPEARE_URL,
        "sample_by": "document",
        "val_tokens": {"gpt2": 33_800, "char": 111_540},
    },
    # build-nanogpt's FineWeb-Edu sample: 10B gpt2 tokens in 100M-token shards, the first 100M tokens for validation.
    "fineweb-edu-10B": {
        "dataset": "HuggingFaceFW/fineweb-edu",
        "dataset_config": "sample-10BT",
        "split": "train",
        "val_tokens": 100_000_000,
    },
}

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


# --- options -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrepareOptions:
    """Everything one `prepare` run needs; built from the CLI flags and a preset by `options_from_args`."""

    dataset: str
    out_dir: Path
    dataset_config: str | None = None
    split: str = "train"
    val_split: str | None = None
    text_column: str = "text"
    sample_by: str = "paragraph"
    tokenizer: str = "gpt2"
    shard_size: int = 100_000_000
    val_tokens: int = 0
    num_proc: int = 1
    streaming: bool = False
    num_shards: int = 1
    shard_index: int = 0
    limit: int | None = None
    preset: str | None = None
    task_chars: int = TASK_CHARS  # not a flag: it changes speed, never the output (tests shrink it)

    def __post_init__(self) -> None:
        if self.sample_by not in ("line", "paragraph", "document"):
            raise ConfigError(f"--sample_by {self.sample_by!r}: expected line, paragraph or document")
        if self.tokenizer not in ("gpt2", "char"):
            raise ConfigError(f"--tokenizer {self.tokenizer!r}: expected gpt2 or char")
        for name in ("shard_size", "num_proc", "num_shards", "task_chars"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} {getattr(self, name)}: expected a positive integer")
        if self.val_tokens < 0:
            raise ConfigError(f"--val_tokens {self.val_tokens}: expected 0 or more")
        if self.limit is not None and self.limit < 1:
            raise ConfigError(f"--limit {self.limit}: expected a positive number of documents")
        if not 0 <= self.shard_index < self.num_shards:
            raise ConfigError(f"--shard_index {self.shard_index}: expected 0..{self.num_shards - 1} (--num_shards)")
        if self.val_split and self.val_tokens:
            raise ConfigError("--val_split and --val_tokens both set: take validation from one of them")
        if self.tokenizer == "char" and self.num_shards > 1:
            raise ConfigError("--tokenizer char builds its vocabulary from all the data, so it runs as one part only")

    @property
    def data_dir(self) -> Path:
        """Where this process writes: out_dir itself, or its part folder when the input is split over machines."""
        if self.num_shards == 1:
            return self.out_dir
        return self.out_dir / shards.part_dir_name(self.shard_index, self.num_shards)

    def identity(self) -> dict[str, Any]:
        """The arguments that decide the output bytes; a resume or re-run must match them."""
        skip = ("out_dir", "num_proc", "task_chars")
        return {k: v for k, v in asdict(self).items() if k not in skip}

    def args(self) -> dict[str, Any]:
        """What the manifest records as the arguments used (paths are left out: a data dir may move)."""
        return {**self.identity(), "num_proc": self.num_proc}


def options_from_args(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> PrepareOptions:
    """Flags over the preset over the defaults; the part comes from the flags, else from RANK/WORLD_SIZE."""
    preset = _preset(args.preset)
    tokenizer = args.tokenizer or "gpt2"

    def pick(name: str, default: Any) -> Any:
        value = getattr(args, name, None)
        return value if value is not None else preset.get(name, default)

    dataset = pick("dataset", None)
    if not dataset:
        raise ConfigError(
            "prepare needs --dataset (a hub id, local file or folder, or http(s) URL) "
            f"or --preset ({', '.join(PRESETS)})"
        )
    val_tokens = pick("val_tokens", 0)
    if isinstance(val_tokens, dict):
        val_tokens = val_tokens.get(tokenizer, 0)
    num_shards, shard_index = _part(args, env)
    return PrepareOptions(
        dataset=str(dataset),
        out_dir=Path(args.out_dir),
        dataset_config=pick("dataset_config", None),
        split=pick("split", "train"),
        val_split=pick("val_split", None),
        text_column=pick("text_column", "text"),
        sample_by=pick("sample_by", "document" if tokenizer == "char" else "paragraph"),
        tokenizer=tokenizer,
        shard_size=pick("shard_size", 100_000_000),
        val_tokens=val_tokens,
        num_proc=pick("num_proc", 1),
        streaming=bool(getattr(args, "streaming", False)),
        num_shards=num_shards,
        shard_index=shard_index,
        limit=pick("limit", None),
        preset=args.preset,
    )


def _preset(name: str | None) -> dict[str, Any]:
    if name is None:
        return {}
    if name not in PRESETS:
        raise ConfigError(f"--preset {name!r}: expected one of {', '.join(PRESETS)}")
    return PRESETS[name]


def _part(args: argparse.Namespace, env: Mapping[str, str]) -> tuple[int, int]:
    """(K, i): explicit flags win; under `accelerate launch`/torchrun every process prepares part RANK of WORLD_SIZE."""
    count, index = getattr(args, "num_shards", None), getattr(args, "shard_index", None)
    if count is None and index is None:
        world = int(env.get("WORLD_SIZE", "1") or 1)
        return (world, int(env.get("RANK", "0") or 0)) if world > 1 else (1, 0)
    if count is None or index is None:
        raise ConfigError("--num_shards and --shard_index go together: part --shard_index of --num_shards parts")
    return count, index


# --- sources -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Source:
    """Where the text comes from, resolved from --dataset without touching the network."""

    kind: str  # "hub" | "files" | "url" | "disk"
    name: str  # --dataset as given
    loader: str = ""  # datasets builder (text/json/parquet/csv) for files and URLs
    files: tuple[str, ...] = ()

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"dataset": self.name, "kind": self.kind}
        if self.loader:
            info["loader"] = self.loader
        if self.kind == "files":
            info["files"] = len(self.files)
        return info


def resolve_source(dataset: str) -> Source:
    """Classify --dataset: URL, save_to_disk folder, local files, else a hub id (a missing local path is an error)."""
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
    visible = (p for p in path.rglob("*") if not any(part.startswith(".") for part in p.relative_to(path).parts))
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


def _load_split(source: Source, split: str, opts: PrepareOptions) -> Any:
    """One split as a `datasets` Dataset (or IterableDataset with --streaming), checked for the text column."""
    import datasets

    label = f"'{source.name}' split '{split}'"
    local = source.kind in ("files", "disk", "url")
    quiet = local and datasets.is_progress_bar_enabled()
    if quiet:
        datasets.disable_progress_bars()  # a local load takes a second; its bars would bury the one-line errors
    try:
        ds = _load(source, split, opts)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - datasets raises many types for bad input; each becomes one line
        offline = source.kind == "hub" and datasets.config.HF_HUB_OFFLINE
        raise DataError(_load_error(label, e) + (" (HF_HUB_OFFLINE is set)" if offline else "")) from None
    finally:
        if quiet:
            datasets.enable_progress_bars()
    _check_column(ds, opts.text_column, label)
    return ds


def _load(source: Source, split: str, opts: PrepareOptions) -> Any:
    import datasets

    if source.kind == "hub":
        num_proc = opts.num_proc if opts.num_proc > 1 and not opts.streaming else None
        return datasets.load_dataset(
            source.name, opts.dataset_config, split=split, streaming=opts.streaming, num_proc=num_proc
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
    kwargs = {"sample_by": opts.sample_by} if source.loader == "text" else {}
    return datasets.load_dataset(source.loader, data_files=files, split="train", streaming=opts.streaming, **kwargs)


def _load_error(label: str, e: BaseException) -> str:
    """One line from a `datasets` exception chain; an empty file shows up as a schema-inference failure."""
    chain: list[BaseException] = []
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    if any(type(x).__name__ == "SchemaInferenceError" for x in chain):
        return f"{label} has no documents (empty input)"
    last = chain[-1]
    message = str(last).strip().splitlines()[0] if str(last).strip() else type(last).__name__
    return f"could not load {label}: {message}"


def _download(url: str) -> Path:
    """Fetch a URL once into the datasets cache (atomically), honouring HF_DATASETS_OFFLINE."""
    import datasets

    cache = Path(datasets.config.HF_DATASETS_CACHE) / "accel_gpt_downloads"
    base = Path(urllib.parse.urlparse(url).path).name or "download"
    path = cache / f"{hashlib.sha256(url.encode()).hexdigest()[:16]}-{base}"
    if path.is_file():
        return path
    if datasets.config.HF_DATASETS_OFFLINE:
        raise DataError(f"cannot download {url}: HF_DATASETS_OFFLINE is set and it is not in {cache}")
    cache.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(tmp, "wb") as f:
            shutil.copyfileobj(response, f, 1 << 20)
        os.replace(tmp, path)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise DataError(f"could not download {url}: {getattr(e, 'reason', e)}") from None
    finally:
        tmp.unlink(missing_ok=True)
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


def _is_iterable(ds: Any) -> bool:
    import datasets

    return isinstance(ds, datasets.IterableDataset)


# --- streams and tasks -------------------------------------------------------------------------------------------


@dataclass
class Stream:
    """One pass over one split of the source: its first `val_tokens` tokens go to 'val', the rest to `split`."""

    dataset: Any
    split: str
    val_tokens: int = 0


def _open_streams(source: Source, opts: PrepareOptions) -> list[Stream]:
    """The passes this process makes, in output order; validation comes from part 0 only."""
    train = _select_part(_limit(_load_split(source, opts.split, opts), opts.limit), opts)
    streams = []
    if opts.val_split and opts.shard_index == 0:
        streams.append(Stream(_limit(_load_split(source, opts.val_split, opts), opts.limit), "val"))
    streams.append(Stream(train, "train", opts.val_tokens if opts.shard_index == 0 else 0))
    return streams


def _limit(ds: Any, limit: int | None) -> Any:
    if limit is None:
        return ds
    return ds.take(limit) if _is_iterable(ds) else ds.select(range(min(limit, len(ds))))


def _select_part(ds: Any, opts: PrepareOptions) -> Any:
    """Part i of K: contiguous rows (so parts in order are the input in order), or split_dataset_by_node."""
    if opts.num_shards == 1:
        return ds
    if _is_iterable(ds):
        from datasets.distributed import split_dataset_by_node

        return split_dataset_by_node(ds, rank=opts.shard_index, world_size=opts.num_shards)
    return ds.shard(num_shards=opts.num_shards, index=opts.shard_index, contiguous=True)


def _iter_texts(ds: Any, column: str, start: int) -> Iterator[str]:
    """The documents from row `start` on, read as Arrow batches (3x faster than dict rows when streaming)."""
    import datasets
    import pyarrow as pa

    if start:
        ds = ds.skip(start) if _is_iterable(ds) else ds.select(range(start, len(ds)))
    batches = ds.select_columns([column]).with_format("arrow").iter(batch_size=READ_ROWS)
    try:
        for table in batches:
            for text in table.column(0).to_pylist():
                yield "" if text is None else text  # a null text is an empty document
    except (datasets.exceptions.DatasetGenerationError, pa.ArrowInvalid, UnicodeDecodeError) as e:
        raise DataError(_load_error("the dataset", e)) from None


# --- the command -------------------------------------------------------------------------------------------------


@dataclass
class Summary:
    """What the final line reports."""

    status: str  # "prepared" | "resumed and prepared" | "already prepared" | "merged"
    out_dir: Path
    documents: dict[str, int]
    tokens: dict[str, int]
    shards: dict[str, int]
    seconds: float

    def line(self) -> str:
        per_split = ", ".join(
            f"{split} {self.tokens.get(split, 0):,} tokens / {self.documents.get(split, 0):,} documents / "
            f"{self.shards.get(split, 0)} shards"
            for split in sorted(self.tokens, key=lambda s: s != "train")
        )
        total = sum(self.tokens.values())
        tokenized = self.status in ("prepared", "resumed and prepared")
        rate = f", {total / self.seconds / 1e6:.2f}M tokens/s" if tokenized else ""
        return (
            f"{self.status}: {sum(self.documents.values()):,} documents, {total:,} tokens ({per_split}) "
            f"in {self.seconds:.1f}s{rate} -> {self.out_dir}"
        )


def prepare(opts: PrepareOptions) -> Summary:
    """Tokenize the source into `opts.data_dir`; resume an interrupted run there; verify a finished one."""
    start = time.perf_counter()
    source = resolve_source(opts.dataset)  # a missing path fails before anything is created
    with Workers(opts.num_proc, warm_gpt2 if opts.tokenizer == "gpt2" else None) as workers:
        return _prepare(opts, source, workers, start)


def _prepare(opts: PrepareOptions, source: Source, workers: Workers, start: float) -> Summary:
    data_dir = opts.data_dir
    created = _make_dirs(data_dir)
    try:
        if (data_dir / shards.MANIFEST).is_file():
            return _verify_finished(opts, start)
        state = _load_state(data_dir, opts)
        streams = _open_streams(source, opts)
    except UserError:
        _remove_dirs(created)
        raise
    resumed = state is not None
    state = state or State(identity=opts.identity())
    if resumed:
        _verify_state(data_dir, state, EncoderSpec(opts.tokenizer, state.chars or "").dtype)
    shards.remove_temp_files(data_dir)
    try:
        spec = _encoder_spec(opts, streams, state, workers)
        state.save(data_dir)
        _write_streams(opts, streams, spec, state, workers)
        manifest = _manifest(opts, source, spec, state)
        shards.write_manifest(data_dir, manifest)
    except UserError:
        _discard(data_dir)
        _remove_dirs(created)
        raise
    (data_dir / STATE_FILE).unlink()
    if opts.num_shards > 1:
        _merge_if_complete(opts.out_dir, opts.num_shards)
    status = "resumed and prepared" if resumed else "prepared"
    return _summary(status, data_dir, manifest, time.perf_counter() - start)


def _make_dirs(data_dir: Path) -> list[Path]:
    """Create the output folder and prove it writable; return the folders created (deepest first) for cleanup."""
    created = [p for p in (data_dir, *data_dir.parents) if not p.exists()]
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        probe = data_dir / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        _remove_dirs(created)
        raise DataError(f"cannot write to out_dir '{data_dir}': {e.strerror or e}") from None
    return created


def _remove_dirs(created: list[Path]) -> None:
    for path in created:
        with contextlib.suppress(OSError):
            path.rmdir()  # only if empty: never removes anything but what this run made


def _check_identity(found: dict[str, Any], opts: PrepareOptions, data_dir: Path, what: str) -> None:
    want = opts.identity()
    diff = [f"{k}: {found.get(k)!r} -> {want[k]!r}" for k in want if found.get(k) != want[k]]
    if diff:
        raise DataError(
            f"out_dir '{data_dir}' holds {what} made with other arguments ({'; '.join(diff)}); "
            "use another --out_dir or delete it"
        )


def _verify_finished(opts: PrepareOptions, start: float) -> Summary:
    """A finished prepare with the same arguments: check every shard's size and sha256, change nothing."""
    data_dir = opts.data_dir
    manifest = shards.read_manifest(data_dir)
    _check_identity(manifest.get("args", {}), opts, data_dir, "a finished prepare")
    for split in manifest["splits"]:
        try:
            shards.verify_split(data_dir, manifest, split)
        except DataError as e:
            raise DataError(f"{e}; delete '{data_dir}' and prepare again") from None
    (data_dir / STATE_FILE).unlink(missing_ok=True)  # left if a kill came between the manifest and its removal
    if opts.num_shards > 1:
        _merge_if_complete(opts.out_dir, opts.num_shards)
    return _summary("already prepared", data_dir, manifest, time.perf_counter() - start)


def _load_state(data_dir: Path, opts: PrepareOptions) -> State | None:
    """The state of an interrupted run of the same command, or None for a fresh start in an empty folder."""
    state = State.load(data_dir)
    if state is not None:
        _check_identity(state.identity, opts, data_dir, "an interrupted prepare")
        return state
    leftovers = [p.name for p in data_dir.iterdir() if not p.name.endswith(shards.TMP_SUFFIX)]
    if leftovers:
        raise DataError(
            f"out_dir '{data_dir}' is not empty and holds no prepare output ({', '.join(sorted(leftovers)[:3])} ...); "
            "use a new or empty folder"
        )
    return None


def _verify_state(data_dir: Path, state: State, dtype: np.dtype) -> None:
    """Check the shards an interrupted run finished; from the first missing or changed one on, prepare again."""
    itemsize = np.dtype(dtype).itemsize
    for k, entry in enumerate(state.shards):
        path = data_dir / entry["file"]
        ok = path.is_file() and path.stat().st_size == entry["tokens"] * itemsize
        if ok and shards.sha256_file(path) == entry["sha256"]:
            continue
        log.warning("shard %s is missing or changed; preparing again from there", path)
        state.shards = state.shards[:k]
        state.resume = Resume(**state.shards[-1]["resume"]) if state.shards else Resume()
        state.save(data_dir)
        return


def _discard(data_dir: Path) -> None:
    """Remove what this prepare wrote (shards, temporaries, state): bad input must not leave partial output."""
    for path in data_dir.glob("*.bin"):
        if re.fullmatch(r"(train|val)_\d{6}\.bin", path.name):
            path.unlink()
    shards.remove_temp_files(data_dir)
    (data_dir / STATE_FILE).unlink(missing_ok=True)


def _encoder_spec(opts: PrepareOptions, streams: list[Stream], state: State, workers: Workers) -> EncoderSpec:
    """gpt2 needs nothing; char needs its vocabulary: one parallel pass over all the text (kept in the state)."""
    if opts.tokenizer == "gpt2":
        return EncoderSpec("gpt2")
    if state.chars is None:
        seen: set[str] = set()
        for stream in streams:
            tasks = make_tasks(_iter_texts(stream.dataset, opts.text_column, 0), 0, opts.task_chars)
            for _, chars in workers.map(unique_chars, EncoderSpec("char"), tasks):
                seen.update(chars)
        if not seen:
            raise DataError(f"'{opts.dataset}' has no text (every document is empty)")
        state.chars = "".join(sorted(seen))
    return EncoderSpec("char", state.chars)


def _write_streams(
    opts: PrepareOptions, streams: list[Stream], spec: EncoderSpec, state: State, workers: Workers
) -> None:
    """Tokenize every stream from the resume point on, with a progress bar in tokens/s."""
    from tqdm.auto import tqdm

    desc = "prepare" if opts.num_shards == 1 else f"prepare part {opts.shard_index}/{opts.num_shards}"
    with tqdm(desc=desc, unit="tok", unit_scale=True, mininterval=1.0, dynamic_ncols=True) as bar:
        for index in range(state.resume.stream, len(streams)):
            stream = streams[index]
            first_doc = state.resume.doc
            tasks = make_tasks(_iter_texts(stream.dataset, opts.text_column, first_doc), first_doc, opts.task_chars)
            writer = StreamWriter(opts.data_dir, spec, opts.shard_size, stream.split, stream.val_tokens, index, state)
            try:
                for task, (tokens, lengths) in workers.map(encode_pieces, spec, tasks):
                    bar.update(writer.feed(task, tokens, lengths))
                    bar.set_postfix_str(f"{stream.split} doc {task.docs[-1] + 1:,}", refresh=False)
                writer.finish()
            finally:
                writer.abort()


def _manifest(opts: PrepareOptions, source: Source, spec: EncoderSpec, state: State) -> dict[str, Any]:
    """The manifest of a finished prepare; an error if there is nothing to train on."""
    train_first = {"train": 0, "val": 1}
    tokens = dict(sorted(state.totals("tokens").items(), key=lambda kv: train_first.get(kv[0], 2)))
    documents = dict(sorted(state.totals("documents").items(), key=lambda kv: train_first.get(kv[0], 2)))
    text_tokens = sum(tokens.values()) - (sum(documents.values()) if spec.eot_token is not None else 0)
    if text_tokens == 0:
        raise DataError(f"'{opts.dataset}' has no text (every document is empty)")
    if not tokens.get("train"):
        raise DataError(
            f"no tokens left for training: the input gives {sum(tokens.values()):,} tokens and --val_tokens is "
            f"{opts.val_tokens:,}" + (f" (part {opts.shard_index} of {opts.num_shards})" if opts.num_shards > 1 else "")
        )
    splits: dict[str, list[dict[str, Any]]] = {}
    for e in state.shards:
        splits.setdefault(e["split"], []).append({k: e[k] for k in ("file", "tokens", "sha256", "documents")})
    manifest: dict[str, Any] = {"tokenizer": spec.name}
    if spec.name == "char":
        manifest["chars"] = spec.chars
    source_info = source.describe() | {"config": opts.dataset_config, "split": opts.split, "val_split": opts.val_split}
    source_info["text_column"] = opts.text_column
    if source.loader == "text":
        source_info["sample_by"] = opts.sample_by
    manifest.update(
        eot_token=spec.eot_token,
        eot_position="before_each_document" if spec.eot_token is not None else None,
        vocab_size=spec.vocab_size,
        dtype=np.dtype(spec.dtype).name,
        splits=dict(sorted(splits.items(), key=lambda kv: train_first.get(kv[0], 2))),
        tokens=tokens,
        documents=documents,
        source=source_info,
        args=opts.args(),
    )
    if opts.num_shards > 1:
        manifest["part"] = {"index": opts.shard_index, "count": opts.num_shards}
    return manifest


def _summary(status: str, data_dir: Path, manifest: dict[str, Any], seconds: float) -> Summary:
    tokens = {s: sum(e["tokens"] for e in entries) for s, entries in manifest["splits"].items()}
    counts = {s: len(entries) for s, entries in manifest["splits"].items()}
    return Summary(status, data_dir, dict(manifest.get("documents", {})), tokens, counts, seconds)


# --- merging the parts of a multi-node prepare -------------------------------------------------------------------


def merge_parts(out_dir: Path, checksums: bool = True) -> dict[str, Any]:
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
    names = [shards.part_dir_name(i, count) for i in range(count)]
    missing = [n for n in names if not (out_dir / n / shards.MANIFEST).is_file()]
    if missing:
        raise DataError(f"cannot merge '{out_dir}': unfinished or missing parts: {', '.join(missing)}")
    parts = []
    for name in names:
        manifest = shards.read_manifest(out_dir / name)
        for split in manifest["splits"]:
            shards.verify_split(out_dir / name, manifest, split, checksums=checksums)
        parts.append((name, manifest))
    args = [{k: v for k, v in m.get("args", {}).items() if k not in ("shard_index", "num_proc")} for _, m in parts]
    for (name, _), a in zip(parts[1:], args[1:], strict=True):
        if a != args[0]:
            raise DataError(f"part {name} was prepared with other arguments than {names[0]}")
    merged = shards.merge_manifests(parts)
    merged["args"] = args[0]
    shards.write_manifest(out_dir, merged)
    return merged


def _merge_if_complete(out_dir: Path, count: int) -> None:
    """The last part to finish merges (each part verified its own shards, so sizes are checked, not checksums)."""
    names = [shards.part_dir_name(i, count) for i in range(count)]
    if all((out_dir / n / shards.MANIFEST).is_file() for n in names):
        merge_parts(out_dir, checksums=False)


def run_prepare(args: argparse.Namespace) -> None:
    """CLI entry: prepare (or `--merge` parts), then print one summary line."""
    if getattr(args, "merge", False):
        start = time.perf_counter()
        merged = merge_parts(Path(args.out_dir))
        print(_summary("merged", Path(args.out_dir), merged, time.perf_counter() - start).line())
        return
    print(prepare(options_from_args(args)).line())
