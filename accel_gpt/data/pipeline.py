"""The datasets-free machinery of `prepare`: the ordered worker pool, and the shard writer that records after every
shard where a killed run resumes.

A *stream* is one pass over one split of the input: the tokens of its documents back to back (`encode.py` puts EOT
before each gpt2 document). Positions are token offsets in the stream. The writer cuts the stream into fixed-size
shards; the first `val_tokens` tokens go to 'val', the rest to the stream's split.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from accel_gpt.data import shards
from accel_gpt.data.encode import Task
from accel_gpt.errors import DataError
from accel_gpt.files import atomic_write_json
from accel_gpt.tokenizer import Tokenizer

log = logging.getLogger(__name__)

STATE_FILE = ".prepare_state.json"


class Workers:
    """The tokenizer processes: `map` runs `fn(tok, texts, first)` over tasks, results in task order.

    Entered before the input is opened, so the workers' start-up (imports, loading the BPE ranks via `warm`)
    overlaps the main process's `datasets` import and load instead of following it. Spawned, not forked: the parent
    holds pyarrow threads, and the workers need only numpy and tiktoken. With num_proc == 1 the main process encodes.
    """

    def __init__(self, num_proc: int, warm: Callable[[], Any] | None = None) -> None:
        self.num_proc, self.warm = num_proc, warm
        self.pool: Any = None

    def __enter__(self) -> Workers:
        if self.num_proc > 1:
            self.pool = multiprocessing.get_context("spawn").Pool(self.num_proc, initializer=self.warm)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()

    def map(self, fn: Callable, tok: Tokenizer, tasks: Iterable[Task]) -> Iterator[tuple[Task, Any]]:
        """At most 2 * num_proc tasks in flight: `Pool.imap` would read the whole task iterator ahead (its feeder
        thread does not wait), which breaks the memory bound with --streaming."""
        if self.pool is None:
            for task in tasks:
                yield task, fn(tok, task.texts, task.first)
            return
        pending: deque = deque()
        for task in tasks:
            pending.append((task, self.pool.apply_async(fn, (tok, task.texts, task.first))))
            if len(pending) >= 2 * self.num_proc:
                done, result = pending.popleft()
                yield done, result.get()
        while pending:
            done, result = pending.popleft()
            yield done, result.get()


@dataclass
class Resume:
    """Where a stream stands: `position` tokens of stream `stream` are in shards; they end `offset` tokens into
    document `doc` (the document of the last written token, so 0 < offset <= its length, or all zero at the start).
    `nulls` counts the rows without text before that row, in this stream and the finished ones before it.
    """

    stream: int = 0
    doc: int = 0
    offset: int = 0
    position: int = 0
    nulls: int = 0


@dataclass
class State:
    """What `.prepare_state.json` holds: the arguments, the char vocabulary, the finished shards, the resume point,
    and the local input files as they were (`Source.inputs`), so that a resume on changed text is refused."""

    identity: dict[str, Any]
    chars: str | None = None
    # each: split, file, tokens, sha256, bytes, documents, max_id, resume
    shards: list[dict[str, Any]] = field(default_factory=list)
    resume: Resume = field(default_factory=Resume)
    inputs: list[dict[str, Any]] | None = None
    tokenizer_sha256: str | None = None  # bpe: the checksum of the tokenizer.json beside the shards

    def save(self, data_dir: Path) -> None:
        atomic_write_json(data_dir / STATE_FILE, asdict(self), indent=1)

    @classmethod
    def load(cls, data_dir: Path) -> State | None:
        path = data_dir / STATE_FILE
        if not path.is_file():
            return None
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            state = cls(raw["identity"], raw["chars"], raw["shards"], Resume(**raw["resume"]), raw.get("inputs"))
            state.tokenizer_sha256 = raw.get("tokenizer_sha256")
            for entry in state.shards:
                _check_entry(entry)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            raise DataError(
                f"{path}, the record of an interrupted prepare, is unreadable ({type(e).__name__}: {e}): it cannot be "
                f"resumed; delete '{data_dir}' and prepare again"
            ) from None
        return state

    def keep_intact_shards(self, data_dir: Path, tok: Tokenizer) -> None:
        """Check the recorded shards (size, sha256); from the first missing or changed one on, prepare again. A shard
        recorded before byte counts were (an older prepare's state) gets its count from the file."""
        itemsize = tok.dtype.itemsize
        for k, entry in enumerate(self.shards):
            path = data_dir / entry["file"]
            ok = path.is_file() and path.stat().st_size == entry["tokens"] * itemsize
            if ok and shards.sha256_file(path) == entry["sha256"]:
                if "bytes" not in entry:
                    entry["bytes"] = shards.count_bytes(np.memmap(path, dtype=tok.dtype, mode="r"), tok.token_bytes())
                continue
            log.warning("shard %s is missing or changed; preparing again from there", path)
            self.shards = self.shards[:k]
            self.resume = Resume(**self.shards[-1]["resume"]) if self.shards else Resume()
            self.save(data_dir)
            return

    def count(self, split: str) -> int:
        return sum(1 for e in self.shards if e["split"] == split)

    def totals(self, key: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.shards:
            out[e["split"]] = out.get(e["split"], 0) + e[key]
        return out


def _check_entry(entry: Any) -> None:
    """A recorded shard holds what a resume reads from it (KeyError or TypeError otherwise: a garbled state)."""
    missing = {"split", "file", "tokens", "sha256", "documents", "resume"} - set(entry)
    if missing:
        raise KeyError(f"a shard record lacks {', '.join(sorted(missing))}")
    Resume(**entry["resume"])


class StreamWriter:
    """Cuts stream `index` into fixed-size shards ('val' below `val_tokens`, then `split`), and after each finished
    shard saves the state with the point to resume from. A document is counted in the shard holding its first token.
    """

    def __init__(
        self, data_dir: Path, tok: Tokenizer, shard_size: int, split: str, val_tokens: int, index: int, state: State
    ) -> None:
        self.data_dir, self.dtype, self.shard_size = data_dir, tok.dtype, shard_size
        self.token_bytes = tok.token_bytes()  # each shard counts the UTF-8 bytes its tokens stand for
        self.split, self.val_tokens, self.index, self.state = split, val_tokens, index, state
        r = state.resume
        self.pos = r.position - r.offset  # the first token to arrive begins document r.doc
        self.skip_until = r.position  # tokens before this are in shards already
        self.doc_begin = self.pos  # where the document of the next continuation piece began
        self.shard: shards.ShardWriter | None = None
        self.shard_split, self.shard_end, self.shard_docs, self.shard_max = "", 0, 0, -1

    def feed(self, task: Task, tokens: np.ndarray, lengths: np.ndarray) -> int:
        """Write one task's tokens; return how many went to shards (fewer while skipping to the resume point)."""
        base = self.pos
        ends = base + np.cumsum(lengths)
        begins = ends - lengths
        first = np.asarray(task.first, dtype=bool)
        owner = np.where(first, np.arange(first.size), -1)  # index of each piece's document's first piece here
        np.maximum.accumulate(owner, out=owner)
        doc_begin = np.where(owner >= 0, begins[np.maximum(owner, 0)], self.doc_begin)
        starts = begins[first & (lengths > 0)]  # documents that own at least one token
        i = int(min(tokens.size, max(0, self.skip_until - base)))
        written = 0
        while i < tokens.size:
            pos = base + i
            if self.shard is None:
                self._open(pos)
            take = min(tokens.size - i, self.shard_end - pos)
            chunk = tokens[i : i + take]
            self.shard.write(chunk)
            self.shard_max = max(self.shard_max, int(chunk.max()))  # take > 0: the shard ends after pos
            self.shard_docs += int(np.searchsorted(starts, pos + take) - np.searchsorted(starts, pos))
            i += take
            written += take
            if pos + take == self.shard_end:
                j = int(np.searchsorted(ends, pos + take - 1, side="right"))  # piece holding the last written token
                offset = pos + take - int(doc_begin[j])
                self._commit(Resume(self.index, task.docs[j], offset, pos + take, task.nulls[j]))
        self.pos = base + tokens.size
        if first.size:
            self.doc_begin = int(doc_begin[-1])
        return written

    def finish(self, nulls: int) -> None:
        """End of the stream: close the last, shorter shard and point the state at the next stream. `nulls`: the
        rows without text up to the end of this stream (`NullRows.count`)."""
        if self.skip_until > self.pos:
            raise DataError(
                f"the input gives fewer tokens ({self.pos:,}) than an earlier, interrupted run of this prepare already "
                f"wrote ({self.skip_until:,}): it changed since; delete '{self.data_dir}' and prepare again"
            )
        nxt = Resume(self.index + 1, nulls=nulls)
        if self.shard is not None:
            self._commit(nxt)
        else:
            self.state.resume = nxt
            self.state.save(self.data_dir)

    def abort(self) -> None:
        """Drop the unfinished shard's temporary. On a full disk closing it fails too (the buffered tail cannot be
        flushed; the file is closed all the same), and the temporary would stay, holding the space a resume needs."""
        shard, self.shard = self.shard, None
        if shard is not None:
            try:
                shard.abort()
            except OSError:
                shard.tmp.unlink(missing_ok=True)

    def _open(self, pos: int) -> None:
        split = "val" if pos < self.val_tokens else self.split
        self.shard = shards.ShardWriter(self.data_dir, split, self.state.count(split), self.dtype, self.token_bytes)
        self.shard_split, self.shard_docs, self.shard_max = split, 0, -1
        self.shard_end = pos + self.shard_size
        if split == "val" and self.val_tokens:
            self.shard_end = min(self.shard_end, self.val_tokens)

    def _commit(self, resume: Resume) -> None:
        entry = self.shard.close()
        self.shard = None
        self.state.shards.append(
            {
                "split": self.shard_split,
                **entry,
                "documents": self.shard_docs,
                "max_id": self.shard_max,  # lets the trainer refuse ids beyond its vocabulary without reading shards
                "resume": asdict(resume),
            }
        )
        self.state.resume = resume
        self.state.save(self.data_dir)
