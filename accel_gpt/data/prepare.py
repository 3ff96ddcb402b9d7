"""`run.py prepare`: text -> GPT-2 (or char, or a BPE trained on the text) token shards + manifest.json.

The choices a reader needs before the code:

- **Sources** go through `datasets` (`sources.py`): a hub id, local .txt/.json/.jsonl/.parquet/.csv files or
  folders of them, a `save_to_disk` folder, or an http(s) URL to such a file, fetched once into the datasets cache.
- **Document unit** for plain text (`--sample_by`, the text builder's option): `paragraph` (blank-line separated)
  by default with the gpt2 tokenizer. `line` would put an EOT after every line of verse or code and cut every
  multi-line passage; `document` makes a whole file one document, which suits a folder of separate files and the
  tinyshakespeare presets (nanoGPT encodes that file as one text). With `--tokenizer char` the default is
  `document`: char streams have no separator, and paragraphs glued together would lose their blank lines.
- **A trained tokenizer** (`--tokenizer bpe --vocab_size N`, `train_bpe.py`): a byte-level BPE learned from the
  train split only, before any shard is written, and stored as `tokenizer.json` beside the manifest (its fingerprint
  in `tokenizer_sha256`). The state records the fingerprint, so a resume encodes with the same tokenizer.
  `--tokenizer_file F` takes an earlier prepare's instead: how the parts of a prepare on several machines share one.
- **EOT placement**: the end-of-text token (GPT-2's 50256, a bpe's last id) *precedes every document*, so the stream
  is `EOT d0 EOT d1 ...`.
  A document then starts with EOT wherever it lands, the concatenation of any parts is again a valid stream, and
  splitting the tokens at 50256 and decoding gives back the documents exactly (`encode_ordinary` keeps a literal
  "<|endoftext|>" in the text as plain tokens, never 50256).
- **Validation**: `--val_split S` tokenizes the dataset's own split into `val`; otherwise `--val_tokens N` sends the
  *first* N tokens of the stream to `val` (the first, not the last, because a stream's length is unknown until its
  end) and the rest to `train`. The cut is exact and may fall inside a document.
- **Parallelism**: the main process reads documents and groups them into tasks of about `task_chars` characters;
  `--num_proc` spawned workers encode a task into one numpy array (`encode.py`). A document longer than a task is
  cut at safe boundaries into pieces, so one huge document still feeds every worker, with the tokens of the whole.
  At most 2 * num_proc tasks are in flight and shards are streamed to disk, so memory does not grow with the data.
- **Crash safety and resume** (`pipeline.py`): a shard is written under a hidden temporary name and renamed when
  complete. After each shard a small state file (`.prepare_state.json`) records the shard (size, sha256, documents)
  and where the stream stands: (document index, tokens of that document already written). Re-running the same
  command verifies the recorded shards (from the first missing or changed one on it prepares again), skips the
  finished documents without tokenizing them, re-tokenizes the document cut by the last shard boundary and drops
  its written part. Output is a function of the data and the arguments only (not of num_proc, the kill, or the
  task size), so a killed-and-resumed run writes the same bytes as an uninterrupted one. `manifest.json` is written
  last, and only then is the state file removed. A re-run with other arguments is refused, naming the differences;
  so is a re-run whose local input files changed (their sizes and modification times are in the manifest's
  `source.inputs` and in the state). A bad input (UserError) removes everything this prepare wrote; a full or
  read-only disk stops with one line and keeps the finished shards for the resume.
- **One writer per folder**: a prepare holds `files.locked` on its folder (the part folder, and out_dir while
  merging), so a second prepare into it is refused in one line instead of writing the same shards.
- **What the manifest records beyond the format**: each shard's largest token id (`max_id`, so the trainer can
  refuse ids beyond its vocabulary without reading shards), `bytes`: the UTF-8 bytes of text per shard and per split,
  summed from a per-id length table as the tokens are written (validation's bits per byte), and `skipped_null`: rows
  whose text is null or missing are no documents (not even empty ones); they are counted and reported in the summary
  line. Re-running the command of a finished prepare whose manifest predates `bytes` counts them from the shards.
- **Several machines** (`merge.py`): `--num_shards K --shard_index i`, or `RANK`/`WORLD_SIZE` from
  `accelerate launch`/torchrun, makes this process prepare part i of the input into `out_dir/part-0000i-of-0000K/`.
  Non-streaming parts are contiguous row ranges, so the parts in order are the whole input in order; streaming
  parts follow `datasets.distributed.split_dataset_by_node`. Validation (first tokens or own split) comes from
  part 0 only. The part that finishes last writes `out_dir/manifest.json` over every part's shards;
  `--merge` does the same by hand (checking every checksum), e.g. after copying parts between machines.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from accel_gpt import bpe
from accel_gpt.config import BPE_PARTS, PrepareConfig
from accel_gpt.data import shards
from accel_gpt.data.encode import CUT_BEFORE, NullRows, encode_pieces, make_tasks, unique_chars, warm_gpt2
from accel_gpt.data.merge import (
    all_parts_finished,
    merge_if_complete,
    merge_parts,
    other_args,
    part_dir_name,
    shared_args,
)
from accel_gpt.data.pipeline import STATE_FILE, State, StreamWriter, Workers
from accel_gpt.data.sources import Source, Stream, open_streams, resolve_source
from accel_gpt.data.train_bpe import train_tokenizer
from accel_gpt.errors import ConfigError, DataError, UserError
from accel_gpt.files import LOCK, TMP_MARK, atomic_write, locked, remove_temporaries
from accel_gpt.limits import file_size_limit, file_size_reason
from accel_gpt.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Errors of a full or read-only disk: one line, and what was written stays for a resume.
_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)
# Settings that change speed or where the output goes, never its bytes: a re-run may change them.
_NOT_IDENTITY = ("out_dir", "num_proc", "task_chars", "merge", "config", "tokenizer_file")
_BPE_ONLY = ("vocab_size", "tokenizer_chars")  # recorded for a bpe only, so that older records still match
_SPLIT_ORDER = {"train": 0, "val": 1}


@dataclass(frozen=True)
class Job:
    """What this process prepares: the settings and its part (`index` of `count`) of the input."""

    cfg: PrepareConfig
    index: int = 0
    count: int = 1

    @classmethod
    def of(cls, cfg: PrepareConfig, env: Mapping[str, str] = os.environ) -> Job:
        """The part comes from --num_shards/--shard_index, else from RANK/WORLD_SIZE (`accelerate launch`/torchrun
        start every process with the same flags, so each prepares part RANK of WORLD_SIZE)."""
        index, count = cfg.shard_index, cfg.num_shards
        if count is None or index is None:
            world = int(env.get("WORLD_SIZE", "1") or 1)
            index, count = (int(env.get("RANK", "0") or 0), world) if world > 1 else (0, 1)
        if not 0 <= index < count:
            raise ConfigError(f"shard_index={index} must be in 0..{count - 1} (num_shards)")
        if cfg.tokenizer == "char" and count > 1:
            raise ConfigError("the char tokenizer builds its vocabulary from all the data, so it runs as one part")
        if cfg.tokenizer == "bpe" and count > 1 and not cfg.tokenizer_file:
            raise ConfigError(BPE_PARTS)
        return cls(cfg, index, count)

    @property
    def data_dir(self) -> Path:
        """Where this process writes: out_dir itself, or its part folder when the input is split over machines."""
        out_dir = Path(self.cfg.out_dir)
        return out_dir if self.count == 1 else out_dir / part_dir_name(self.index, self.count)

    def identity(self) -> dict[str, Any]:
        """The arguments that decide the output bytes; a resume or re-run must match them."""
        found = {k: v for k, v in self.cfg.to_dict().items() if k not in _NOT_IDENTITY}
        # limit 0 (every document) is recorded as null; preset is the --preset (or --config file) used
        found.update(limit=self.cfg.limit or None, num_shards=self.count, shard_index=self.index)
        if self.cfg.tokenizer != "bpe":
            found = {k: v for k, v in found.items() if k not in _BPE_ONLY}
        elif self.cfg.tokenizer_file:  # the file's content, not its path, decides the tokens
            given = Tokenizer.bpe_file(self.cfg.tokenizer_file)
            found = {k: v for k, v in found.items() if k not in _BPE_ONLY} | {"tokenizer_sha256": given.sha256}
        return found | {"preset": self.cfg.config or None}

    def args(self) -> dict[str, Any]:
        """What the manifest records as the arguments used (paths are left out: a data dir may move)."""
        return {**self.identity(), "num_proc": self.cfg.num_proc}


@dataclass
class Summary:
    """What the final line reports."""

    status: str  # "prepared" | "resumed and prepared" | "already prepared" | "merged"
    out_dir: Path
    documents: dict[str, int]
    tokens: dict[str, int]
    shards: dict[str, int]
    seconds: float
    skipped_null: int = 0  # rows whose text was null or missing
    continued: frozenset[str] = frozenset()  # splits whose first token is inside a document begun before them

    @classmethod
    def of(cls, status: str, data_dir: Path, manifest: dict[str, Any], seconds: float) -> Summary:
        tokens = {s: sum(e["tokens"] for e in entries) for s, entries in manifest["splits"].items()}
        counts = {s: len(entries) for s, entries in manifest["splits"].items()}
        documents = dict(manifest.get("documents", {})) if manifest["tokenizer"] != "char" else {}  # none marked
        nulls = int(manifest.get("skipped_null") or 0)
        return cls(status, data_dir, documents, tokens, counts, seconds, nulls, continued_splits(data_dir, manifest))

    def _documents(self, split: str) -> str:
        if not self.documents:
            return ""
        n = self.documents.get(split, 0)
        if split not in self.continued:
            return f" / {_count(n, 'document')}"
        # --val_tokens sends the stream's first tokens to val, so a split that starts inside a document is train,
        # continuing val's last one
        return f" / {_count(n + 1, 'document')} ({'the first ' if n else ''}begun in the val split)"

    def line(self) -> str:
        """`documents` counts each document once, in the split it begins in (where its end-of-text token is); a
        split that begins inside a document (`--val_tokens` cut it) shows that document too, marked so."""
        per_split = ", ".join(
            f"{split} {self.tokens.get(split, 0):,} tokens{self._documents(split)} / "
            f"{_count(self.shards.get(split, 0), 'shard')}"
            for split in sorted(self.tokens, key=lambda s: s != "train")
        )
        total = sum(self.tokens.values())
        tokenized = self.status in ("prepared", "resumed and prepared")
        rate = f", {tokens_per_second(total, self.seconds)}" if tokenized else ""
        skipped = f"skipped {_count(self.skipped_null, 'row')} with no text" if self.skipped_null else ""
        documents = _count(sum(self.documents.values()), "document") if self.documents else ""
        if documents and skipped:
            documents += f" ({skipped})"
        documents = f"{documents or skipped}, " if documents or skipped else ""
        return (
            f"{self.status}: {documents}{total:,} tokens ({per_split}) in {self.seconds:.1f}s{rate} -> {self.out_dir}"
        )


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def continued_splits(data_dir: Path, manifest: dict[str, Any]) -> frozenset[str]:
    """The splits whose first shard starts inside a document: its first token is not the end-of-text that begins
    every GPT-2 document (one token read; char data has no such marker, so it is never said)."""
    if manifest.get("eot_position") != "before_each_document":
        return frozenset()
    eot = shards.tokenizer(manifest, data_dir).eot_token
    starts = {split: shards.first_token(data_dir, manifest, split) for split in manifest["splits"]}
    return frozenset(split for split, first in starts.items() if first is not None and first != eot)


def tokens_per_second(tokens: int, seconds: float) -> str:
    """A rate in the unit that shows its digits: 830 tokens/s, 41.2K tokens/s, 1.25M tokens/s."""
    rate = tokens / max(seconds, 1e-9)
    if rate >= 1e6:
        return f"{rate / 1e6:.2f}M tokens/s"
    return f"{rate / 1e3:.1f}K tokens/s" if rate >= 1e3 else f"{rate:.0f} tokens/s"


def run_prepare(cfg: PrepareConfig) -> None:
    """CLI entry: prepare (or, with --merge, only merge the finished parts), then print one summary line, and a
    second one when no validation split was asked for (train evaluates on it by default)."""
    if cfg.merge:
        start = time.perf_counter()
        merged = _merge_by_hand(Path(cfg.out_dir))
        print(Summary.of("merged", Path(cfg.out_dir), merged, time.perf_counter() - start).line())
        return
    print(prepare(cfg).line())
    if not cfg.val_tokens and not cfg.val_split:
        print(
            f"note: no val split in {cfg.out_dir} (neither --val_tokens nor --val_split): train on it with "
            "--eval_every 0, or prepare again into a new --out_dir with --val_tokens N to hold N tokens out"
        )


def prepare(cfg: PrepareConfig) -> Summary:
    """Tokenize the source into this process's data dir; resume an interrupted run there; verify a finished one."""
    start = time.perf_counter()
    job = Job.of(cfg)
    source = resolve_source(cfg.dataset)  # a missing path fails before anything is created
    _refuse_other_layout(job)
    with _output_folder(job.data_dir):
        with Workers(cfg.num_proc, warm_gpt2 if cfg.tokenizer == "gpt2" else None) as workers:
            return _prepare(job, source, workers, start)


@contextlib.contextmanager
def _output_folder(data_dir: Path) -> Iterator[None]:
    """Create `data_dir` (proved writable) and hold its lock while this prepare works in it: a second prepare into
    the same folder would resume from the same state and write the same shards. On a UserError the lock file (when
    this run made it; removed while still held) and the folders this run created are removed again, so bad input
    leaves nothing behind. After a prepare the lock file stays: removing a lock file others may have opened would
    let two writers lock two different files."""
    created = _make_dirs(data_dir)
    fresh_lock = not (data_dir / LOCK).exists()
    try:
        with locked(data_dir, "prepare"):
            try:
                yield
            except UserError:
                if fresh_lock:
                    (data_dir / LOCK).unlink(missing_ok=True)
                raise
    except UserError:
        _remove_dirs(created)
        raise


def _prepare(job: Job, source: Source, workers: Workers, start: float) -> Summary:
    data_dir = job.data_dir
    if (data_dir / shards.MANIFEST).is_file():
        return _verify_finished(job, source, start)
    state = _load_state(job, source)
    streams = open_streams(source, job.cfg, job.index, job.count)
    resumed = state is not None
    state = state or State(identity=job.identity(), inputs=source.inputs())
    if resumed and state.shards:
        state.keep_intact_shards(data_dir, _recorded_tokenizer(job, state))
    remove_temporaries(data_dir)
    try:
        tok = _tokenizer(job, streams, state, workers)
        state.save(data_dir)
        _write_streams(job, streams, tok, state, workers)
        manifest = _manifest(job, source, tok, state)
        shards.write_manifest(data_dir, manifest)
    except UserError:
        _discard(data_dir)
        raise
    except OSError as e:
        if e.errno not in _WRITE_ERRNOS:
            raise
        raise _write_error(e, data_dir, len(state.shards)) from None
    (data_dir / STATE_FILE).unlink()
    _merge_if_complete(job)
    status = "resumed and prepared" if resumed else "prepared"
    return Summary.of(status, data_dir, manifest, time.perf_counter() - start)


def _write_error(e: OSError, data_dir: Path, kept: int) -> DataError:
    """A full or read-only disk while writing: one line. What is written stays: the same command resumes from the
    shards already finished (a half-written shard is only ever a temporary, removed on the way out)."""
    what = "no space left on the device" if e.errno in (errno.ENOSPC, errno.EDQUOT) else (e.strerror or str(e))
    fix = "make room"
    if e.errno == errno.EFBIG and (limit := file_size_limit()) is not None:
        what, fix = file_size_reason(limit).split("; ")[0], "raise it (or give a smaller --shard_size)"
    return DataError(
        f"cannot write to out_dir '{data_dir}': {what}; {kept} finished shard(s) kept: {fix} and run the same "
        f"command again to resume, or delete '{data_dir}'"
    )


def _refuse_other_layout(job: Job) -> None:
    """Parts and a single-part prepare cannot share out_dir: a merge would overwrite the single run's manifest and
    orphan its shards (the single-part path refuses parts through its own checks). Parts of another count cannot be
    merged either. Checked before anything is created."""
    out_dir = Path(job.cfg.out_dir)
    if job.count == 1 or not out_dir.is_dir():
        return
    manifest = out_dir / shards.MANIFEST
    single = (out_dir / STATE_FILE).is_file() or any(_is_shard(p.name) for p in out_dir.glob("*.bin"))
    if manifest.is_file() and not single:
        single = "parts" not in shards.read_manifest(out_dir, by_prepare=True)
    if single:
        raise DataError(
            f"out_dir '{out_dir}' holds a single-part prepare; a prepare in {job.count} parts (--num_shards) needs "
            "its own folder: use another --out_dir or delete it"
        )
    others = sorted(p.name for p in out_dir.glob("part-*-of-*") if not p.name.endswith(f"-of-{job.count:05d}"))
    if others:
        raise DataError(
            f"out_dir '{out_dir}' holds parts of another part count ({', '.join(others[:3])}); a prepare in "
            f"{job.count} parts needs its own folder: use another --out_dir or delete it"
        )
    _refuse_other_args(job, out_dir)


def _refuse_other_args(job: Job, out_dir: Path) -> None:
    """A part whose arguments differ from a finished part's (another --tokenizer_file, vocabulary, split) could never
    be merged with it: said before this part tokenizes anything, naming the arguments."""
    mine = shared_args(job.args())
    for index in range(job.count):
        folder = out_dir / part_dir_name(index, job.count)
        if index == job.index or not (folder / shards.MANIFEST).is_file():
            continue
        theirs = shared_args(shards.read_manifest(folder, by_prepare=True).get("args", {}))
        if theirs != mine:
            raise DataError(
                f"part {folder.name} in '{out_dir}' was prepared with other arguments than this part "
                f"({other_args(theirs, mine)}): every part needs the same ones; give this part {folder.name}'s"
            )


def _merge_if_complete(job: Job) -> None:
    """The part that finishes last merges, under out_dir's lock. If another process holds it, that one is merging
    (two parts finished together) or writing there: this part's work is done either way, so it only says so."""
    out_dir = Path(job.cfg.out_dir)
    if job.count == 1 or not all_parts_finished(out_dir, job.count):
        return
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(locked(out_dir, "the merge of the parts"))
        except UserError as busy:
            log.warning("%s; if the parts are not merged then, run `prepare --merge --out_dir %s`", busy, out_dir)
            return
        try:
            merge_if_complete(out_dir, job.count)
        except OSError as e:
            raise DataError(f"cannot write the merged manifest in '{out_dir}': {e.strerror or e}") from None


def _merge_by_hand(out_dir: Path) -> dict[str, Any]:
    """`--merge`: merge_parts under out_dir's lock, so that it never runs beside a prepare writing there."""
    if not out_dir.is_dir():
        raise DataError(f"no part-*-of-* folders in '{out_dir}' to merge (no such folder)")
    try:
        with locked(out_dir, "prepare --merge"):
            return merge_parts(out_dir)
    except OSError as e:
        raise DataError(f"cannot write the merged manifest in '{out_dir}': {e.strerror or e}") from None


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


def _check_identity(found: dict[str, Any], job: Job, what: str) -> None:
    want = job.identity()
    diff = [f"{k}: {found.get(k)!r} -> {want[k]!r}" for k in want if found.get(k) != want[k]]
    if diff:
        raise DataError(
            f"out_dir '{job.data_dir}' holds {what} made with other arguments ({'; '.join(diff)}); "
            "use another --out_dir or delete it"
        )


def _check_inputs(recorded: list[dict[str, Any]] | None, source: Source, what: str, data_dir: Path) -> None:
    """The local input files are those `what` read (same names, sizes and modification times): a prepare of text
    that has changed since must not pass for the output of today's text."""
    current = source.inputs()
    if recorded is None or current is None or recorded == current:
        return  # a hub id or URL, or a record from before inputs were recorded: nothing to compare
    was, now = {r["file"]: r for r in recorded}, {r["file"]: r for r in current}
    changed = sorted(n for n in was.keys() & now.keys() if was[n] != now[n])
    if changed:
        name = changed[0]
        size = f"size {was[name]['size']:,} -> {now[name]['size']:,} bytes"
        detail = f"{name}: " + (size if was[name]["size"] != now[name]["size"] else "modified since")
    else:
        added, removed = sorted(now.keys() - was.keys()), sorted(was.keys() - now.keys())
        detail = f"new file {added[0]}" if added else f"file {removed[0]} is gone"
    raise DataError(
        f"the input changed since {what} in out_dir '{data_dir}' read it ({detail}); delete '{data_dir}' to "
        "prepare it again, or use another --out_dir"
    )


def _verify_finished(job: Job, source: Source, start: float) -> Summary:
    """A finished prepare with the same arguments and input: check every shard's size and sha256, change nothing."""
    data_dir = job.data_dir
    manifest = shards.read_manifest(data_dir, by_prepare=True)
    _check_identity(manifest.get("args", {}), job, "a finished prepare")
    _check_inputs(manifest.get("source", {}).get("inputs"), source, "the finished prepare", data_dir)
    for split in manifest["splits"]:
        try:
            shards.verify_split(data_dir, manifest, split)
        except DataError as e:
            raise DataError(f"{e}; delete '{data_dir}' and prepare again") from None
    status = "already prepared"
    if any(shards.split_bytes(manifest, split) is None for split in manifest["splits"]):
        manifest = shards.add_byte_counts(data_dir, manifest)  # a manifest from before byte counts: add them
        shards.write_manifest(data_dir, manifest)
        status = "already prepared (added the byte counts to its manifest)"
    (data_dir / STATE_FILE).unlink(missing_ok=True)  # left if a kill came between the manifest and its removal
    _merge_if_complete(job)
    return Summary.of(status, data_dir, manifest, time.perf_counter() - start)


def _load_state(job: Job, source: Source) -> State | None:
    """The state of an interrupted run of the same command on the same input, or None for a fresh start in an
    empty folder."""
    data_dir = job.data_dir
    state = State.load(data_dir)
    if state is not None:
        _check_identity(state.identity, job, "an interrupted prepare")
        _check_inputs(state.inputs, source, "the interrupted prepare", data_dir)
        return state
    leftovers = [
        p.name for p in data_dir.iterdir() if p.name != LOCK and not (p.name.startswith(".") and TMP_MARK in p.name)
    ]
    if leftovers:
        raise DataError(
            f"out_dir '{data_dir}' holds files ({', '.join(sorted(leftovers)[:3])} ...) but neither a finished prepare "
            "(manifest.json) nor the record of an interrupted one; prepare into a new or empty folder"
        )
    return None


def _discard(data_dir: Path) -> None:
    """Remove what this prepare wrote (shards, temporaries, state): bad input must not leave partial output."""
    for path in data_dir.glob("*.bin"):
        if _is_shard(path.name):
            path.unlink()
    (data_dir / bpe.TOKENIZER_FILE).unlink(missing_ok=True)
    remove_temporaries(data_dir)
    (data_dir / STATE_FILE).unlink(missing_ok=True)


def _is_shard(name: str) -> bool:
    return re.fullmatch(r"(train|val)_\d{6}\.bin", name) is not None


def _recorded_tokenizer(job: Job, state: State) -> Tokenizer:
    """The tokenizer an interrupted prepare wrote its shards with."""
    if job.cfg.tokenizer == "bpe":
        file = job.data_dir / bpe.TOKENIZER_FILE
        return Tokenizer("bpe", sha256=state.tokenizer_sha256 or "none recorded", file=str(file)).load()
    return Tokenizer(job.cfg.tokenizer, state.chars or "")


def _tokenizer(job: Job, streams: list[Stream], state: State, workers: Workers) -> Tokenizer:
    """gpt2 needs nothing; char needs its vocabulary: one parallel pass over all the text (kept in the state); bpe
    is learned from the train split, or read from --tokenizer_file (its fingerprint kept in the state)."""
    if job.cfg.tokenizer == "gpt2":
        return Tokenizer("gpt2").load()  # BPE files missing offline: said before the progress bar starts
    if job.cfg.tokenizer == "bpe":
        return _bpe_tokenizer(job, streams, state)
    if state.chars is None:
        seen: set[str] = set()
        for stream in streams:
            tasks = make_tasks(stream.texts(), 0, job.cfg.task_chars)
            for _, chars in workers.map(unique_chars, Tokenizer("char"), tasks):
                seen.update(chars)
        if not seen:
            raise DataError(f"'{job.cfg.dataset}' has no text (every document is empty)")
        state.chars = "".join(sorted(seen))
    return Tokenizer("char", state.chars)


def _bpe_tokenizer(job: Job, streams: list[Stream], state: State) -> Tokenizer:
    """The state's checksum is saved before the file is written: a kill between the two leaves a state whose file is
    missing, which (no shard written yet) is made again here."""
    target = job.data_dir / bpe.TOKENIZER_FILE
    if state.tokenizer_sha256 is None or not (target.is_file() or state.shards):
        if job.cfg.tokenizer_file:
            text, made = bpe.read(Path(job.cfg.tokenizer_file))
        else:
            text = train_tokenizer(job.cfg, streams[-1])  # the train stream: it comes after any val split
            made = bpe.parse(text, "the trained tokenizer")
        state.tokenizer_sha256 = bpe.fingerprint(made)
        state.save(job.data_dir)
        atomic_write(target, text)
    return _recorded_tokenizer(job, state)


def _write_streams(job: Job, streams: list[Stream], tok: Tokenizer, state: State, workers: Workers) -> None:
    """Tokenize every stream from the resume point on, with a progress bar in tokens/s."""
    from tqdm.auto import tqdm

    cfg = job.cfg
    desc = "prepare" if job.count == 1 else f"prepare part {job.index}/{job.count}"
    with tqdm(desc=desc, unit="tok", unit_scale=True, mininterval=1.0, dynamic_ncols=True) as bar:
        for index in range(state.resume.stream, len(streams)):
            stream = streams[index]
            first_doc = state.resume.doc
            nulls = NullRows(state.resume.nulls)
            tasks = make_tasks(stream.texts(first_doc), first_doc, cfg.task_chars, nulls, CUT_BEFORE[tok.name])
            writer = StreamWriter(job.data_dir, tok, cfg.shard_size, stream.split, stream.val_tokens, index, state)
            try:
                for task, (tokens, lengths) in workers.map(encode_pieces, tok, tasks):
                    bar.update(writer.feed(task, tokens, lengths))
                    bar.set_postfix_str(f"{stream.split} doc {task.docs[-1] + 1:,}", refresh=False)
                writer.finish(nulls.count)
            finally:
                writer.abort()


def _manifest(job: Job, source: Source, tok: Tokenizer, state: State) -> dict[str, Any]:
    """The manifest of a finished prepare; an error if there is nothing to train on."""
    cfg = job.cfg
    tokens = _train_first(state.totals("tokens"))
    documents = _train_first(state.totals("documents"))
    text_tokens = sum(tokens.values()) - (sum(documents.values()) if tok.eot_token is not None else 0)
    if text_tokens == 0:
        raise DataError(f"'{cfg.dataset}' has no text (every document is empty)")
    if not tokens.get("train"):
        raise DataError(
            f"no tokens left for training: the input gives {sum(tokens.values()):,} tokens and --val_tokens is "
            f"{cfg.val_tokens:,}" + (f" (part {job.index} of {job.count})" if job.count > 1 else "")
        )
    splits: dict[str, list[dict[str, Any]]] = {}
    for e in state.shards:
        keys = ("file", "tokens", "sha256", "bytes", "documents", "max_id")  # max_id: absent from older states
        splits.setdefault(e["split"], []).append({k: e[k] for k in keys if k in e})
    source_info = source.describe() | {"config": cfg.dataset_config, "split": cfg.split, "val_split": cfg.val_split}
    source_info["text_column"] = cfg.text_column
    if state.inputs is not None:  # as they were when this prepare began: a change during it shows at the next run
        source_info["inputs"] = state.inputs
    if source.loader == "text":
        source_info["sample_by"] = cfg.sample_by
    manifest = {
        **shards.tokenizer_fields(tok),
        "eot_position": "before_each_document" if tok.eot_token is not None else None,
        "splits": _train_first(splits),
        "tokens": tokens,
        "bytes": _train_first(state.totals("bytes")),  # UTF-8 bytes of text per split: val_bpb needs it
        "documents": documents,
        "skipped_null": state.resume.nulls,  # rows without text: not documents, but the input had them
        "source": source_info,
        "args": job.args(),
    }
    if job.count > 1:
        manifest["part"] = {"index": job.index, "count": job.count}
    return manifest


def _train_first(per_split: dict[str, Any]) -> dict[str, Any]:
    return dict(sorted(per_split.items(), key=lambda kv: _SPLIT_ORDER.get(kv[0], 2)))
