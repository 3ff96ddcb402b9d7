"""What the tokenizer workers run: documents (or pieces of them) -> one flat token array per task.

Kept apart from the `datasets` side so that spawned workers import only numpy and tiktoken.

Two facts shape the hot path (measured in bench/RESULTS.md):
- tiktoken's `encode_ordinary_batch` runs each item through a ThreadPoolExecutor future, which costs more than
  encoding a short paragraph. Calling `encode_ordinary` in a plain loop removes that overhead, so a task is a list
  of about `task_chars` characters of documents, encoded in one loop, returned as one numpy array.
- One huge document must still be spread over the workers, so documents longer than a task are cut into pieces
  at *safe* boundaries (`iter_pieces`), where tokenizing the pieces gives exactly the tokens of the whole.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from accel_gpt.errors import DataError, UserError
from accel_gpt.tokenizer import Tokenizer, char_vocabulary

# The cut goes just before one of these, and only where the character before it is not whitespace. A trained bpe's
# pattern keeps newlines with the punctuation before them (`bpe.SPLIT_PATTERN`), so it is cut before spaces only.
CUT_BEFORE = {"gpt2": ("\n", " "), "char": ("\n", " "), "bpe": (" ",)}


@dataclass
class Task:
    """Pieces of documents for one worker call: `first` marks a document's first piece, `docs` its row index,
    `nulls` how many rows without text came before that row (the count a resume from there starts with)."""

    texts: list[str] = field(default_factory=list)
    first: list[bool] = field(default_factory=list)
    docs: list[int] = field(default_factory=list)
    nulls: list[int] = field(default_factory=list)
    chars: int = 0


@dataclass
class NullRows:
    """Rows without text (null or missing) read so far: skipped, never made into empty documents, and counted so
    that the summary and the manifest report them. Starts from the resume point's count on a resume."""

    count: int = 0


def make_tasks(
    texts: Iterable[str | None],
    first_doc: int,
    task_chars: int,
    nulls: NullRows | None = None,
    cut_before: tuple[str, ...] = CUT_BEFORE["gpt2"],
) -> Iterator[Task]:
    """Group documents into tasks of at most `task_chars` characters; cut longer documents into safe pieces (a
    document without a safe cut stays whole and makes an oversized task). Rows are numbered from `first_doc`; a row
    that is None is skipped and counted in `nulls`, keeping the numbering (a resume point is a row index)."""
    nulls = NullRows() if nulls is None else nulls
    task = Task()
    for doc, text in enumerate(texts, start=first_doc):
        if text is None:
            nulls.count += 1
            continue
        pieces = iter_pieces(text, task_chars, cut_before) if len(text) > task_chars else (text,)
        for k, piece in enumerate(pieces):
            if task.texts and task.chars + len(piece) > task_chars:
                yield task
                task = Task()
            task.texts.append(piece)
            task.first.append(k == 0)
            task.docs.append(doc)
            task.nulls.append(nulls.count)
            task.chars += len(piece)
            if task.chars >= task_chars:
                yield task
                task = Task()
    if task.texts:
        yield task


def iter_pieces(text: str, max_chars: int, cut_before: tuple[str, ...] = CUT_BEFORE["gpt2"]) -> Iterator[str]:
    """Cut `text` into pieces of about `max_chars` whose GPT-2 tokens, concatenated, equal the tokens of `text`.

    Why the cut is safe: GPT-2's pre-tokenizer regex
    (`'s|'t|...| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+`)
    splits the text into pieces that BPE encodes independently. At a position p with text[p] in {'\\n', ' '} and
    text[p-1] not whitespace, the piece holding text[p-1] is a non-whitespace piece, and no such piece can take in
    the whitespace that follows it (only a *leading* space is optional), so a piece ends at p. The regex looks only
    forward (its one lookahead, `(?!\\S)`, applies to whitespace runs, which on the left end before text[p-1]), so
    the pieces of text[:p] and text[p:] on their own are the pieces of the whole. `str.isspace` is a superset of
    the regex's `\\s`, so testing text[p-1] with it only ever rejects a cut, never allows a wrong one.
    A trained bpe's pattern (`bpe.SPLIT_PATTERN`) differs in one way that matters here: punctuation takes the newlines
    after it (`?[^\\s\\p{L}\\p{N}]++[\\r\\n]*`), so its pieces end before a space only (`cut_before`).
    A text without any such position stays whole. `tests/test_prepare.py` checks the equality on real and
    adversarial text. One piece at a time, so a huge document is not held twice (whole and in pieces).
    """
    start = 0
    while len(text) - start > max_chars:
        cut = _safe_cut(text, start, start + max_chars, cut_before)
        if cut is None:
            break
        yield text[start:cut]
        start = cut
    yield text[start:]


def _safe_cut(text: str, lo: int, target: int, cut_before: tuple[str, ...]) -> int | None:
    """The safe cut nearest below `target` (but above `lo`), else the nearest above it, else None."""
    best = None
    for sep in cut_before:
        p = text.rfind(sep, lo + 1, target + 1)
        while p > lo and text[p - 1].isspace():
            p = text.rfind(sep, lo + 1, p)
        if p > lo and (best is None or p > best):
            best = p
    if best is not None:
        return best
    for sep in cut_before:
        p = text.find(sep, target)
        while p != -1 and text[p - 1].isspace():
            p = text.find(sep, p + 1)
        if p != -1 and (best is None or p < best):
            best = p
    return best


def encode_pieces(tok: Tokenizer, texts: list[str], first: list[bool]) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of the pieces back to back, and each piece's token count.

    gpt2 and bpe: a piece that begins a document (`first`) is preceded by the end-of-text token, so the stream reads
    `EOT doc0 EOT doc1 ...`: every document, wherever it lands (another shard, another machine's part), starts
    with EOT, and any concatenation of parts is itself a valid stream. char: no separator at all.
    """
    if tok.name == "char":
        try:
            tokens = tok.encode_array("".join(texts))
        except ValueError as e:  # the vocabulary was built from this input, so the input changed since
            raise DataError(f"{e}, which this prepare built from its input: did the input change?") from None
        return tokens, np.array([len(t) for t in texts], dtype=np.int64)
    eot = tok.eot_token
    out: list[int] = []
    lengths = np.empty(len(texts), dtype=np.int64)
    for i, (text, is_first) in enumerate(zip(texts, first, strict=True)):
        before = len(out)
        if is_first:
            out.append(eot)
        out.extend(tok.encode(text))
        lengths[i] = len(out) - before
    return np.array(out, dtype=tok.dtype), lengths


def unique_chars(tok: Tokenizer, texts: list[str], first: list[bool]) -> str:
    """The vocabulary pass of the char tokenizer: the distinct characters of one task. Same signature as
    `encode_pieces`, so it runs on the same worker pool."""
    return char_vocabulary(texts)


def warm_gpt2() -> None:
    """Worker initializer: load the BPE ranks (about 0.1 s) while the main process is still opening the dataset.

    Only a head start: if the BPE files cannot be loaded, the first task fails with the tokenizer's one-line error,
    which reaches the main process. Raising here instead would kill the worker, and the pool would start a new
    one, forever.
    """
    with contextlib.suppress(UserError):
        Tokenizer("gpt2").encode("")
