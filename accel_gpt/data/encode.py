"""Worker side of `prepare`: documents (or pieces of them) -> one flat token array per task.

Kept apart from `prepare.py` so that spawned tokenizer workers import only numpy and tiktoken, never `datasets`.

Two facts shape the hot path (measured, see ../../bench/RESULTS.md):
- tiktoken's `encode_ordinary_batch` runs each item through a ThreadPoolExecutor future, which costs more than
  encoding a short paragraph. Calling `encode_ordinary` in a plain loop removes that overhead, so a task is a list
  of about 1M characters of documents, encoded in one loop, returned as one numpy array.
- One huge document must still be spread over the workers, so documents longer than a task are cut into pieces
  at *safe* boundaries (`split_document`), where tokenizing the pieces gives exactly the tokens of the whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from accel_gpt.data.shards import dtype_for_vocab
from accel_gpt.errors import DataError
from accel_gpt.tokenizer import GPT2_EOT, GPT2_VOCAB, GPT2Tokenizer

# The cut goes just before one of these, and only where the character before it is not whitespace.
_CUT_BEFORE = ("\n", " ")


def split_document(text: str, max_chars: int) -> list[str]:
    """Cut `text` into pieces of about `max_chars` whose GPT-2 tokens, concatenated, equal the tokens of `text`.

    Why the cut is safe: GPT-2's pre-tokenizer regex
    (`'s|'t|...| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+`)
    splits the text into pieces that BPE encodes independently. At a position p with text[p] in {'\\n', ' '} and
    text[p-1] not whitespace, the piece holding text[p-1] is a non-whitespace piece, and no such piece can take in
    the whitespace that follows it (only a *leading* space is optional), so a piece ends at p. The regex looks only
    forward (its one lookahead, `(?!\\S)`, applies to whitespace runs, which on the left end before text[p-1]), so
    the pieces of text[:p] and text[p:] on their own are the pieces of the whole. `str.isspace` is a superset of
    the regex's `\\s`, so testing text[p-1] with it only ever rejects a cut, never allows a wrong one.
    A text without any such position stays whole. `tests/test_prepare.py` checks the equality on real and
    adversarial text.
    """
    return list(iter_pieces(text, max_chars))


def iter_pieces(text: str, max_chars: int) -> Iterator[str]:
    """`split_document` one piece at a time, so a huge document is not held twice (whole and in pieces)."""
    start = 0
    while len(text) - start > max_chars:
        cut = _safe_cut(text, start, start + max_chars)
        if cut is None:
            break
        yield text[start:cut]
        start = cut
    yield text[start:]


def _safe_cut(text: str, lo: int, target: int) -> int | None:
    """The safe cut nearest below `target` (but above `lo`), else the nearest above it, else None."""
    best = None
    for sep in _CUT_BEFORE:
        p = text.rfind(sep, lo + 1, target + 1)
        while p > lo and text[p - 1].isspace():
            p = text.rfind(sep, lo + 1, p)
        if p > lo and (best is None or p > best):
            best = p
    if best is not None:
        return best
    for sep in _CUT_BEFORE:
        p = text.find(sep, target)
        while p != -1 and text[p - 1].isspace():
            p = text.find(sep, p + 1)
        if p != -1 and (best is None or p < best):
            best = p
    return best


@dataclass(frozen=True)
class EncoderSpec:
    """What a worker needs to build its tokenizer; small enough to send along with every task."""

    name: str  # "gpt2" | "char"
    chars: str = ""  # the char vocabulary, in id order (sorted by code point)

    @property
    def vocab_size(self) -> int:
        return GPT2_VOCAB if self.name == "gpt2" else len(self.chars)

    @property
    def eot_token(self) -> int | None:
        return GPT2_EOT if self.name == "gpt2" else None

    @property
    def dtype(self) -> np.dtype:
        return dtype_for_vocab(self.vocab_size)


def encode_pieces(spec: EncoderSpec, texts: list[str], first: list[bool]) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of the pieces back to back, and each piece's token count.

    gpt2: a piece that begins a document (`first`) is preceded by the end-of-text token, so the stream reads
    `EOT doc0 EOT doc1 ...`: every document, wherever it lands (another shard, another node's part), starts with
    EOT, and any concatenation of parts is itself a valid stream. char: no separator at all.
    """
    if spec.name == "char":
        return _encode_chars(spec.chars, texts)
    enc = _gpt2()
    out: list[int] = []
    lengths = np.empty(len(texts), dtype=np.int64)
    for i, (text, is_first) in enumerate(zip(texts, first, strict=True)):
        before = len(out)
        if is_first:
            out.append(GPT2_EOT)
        out.extend(enc.encode(text))
        lengths[i] = len(out) - before
    return np.array(out, dtype=spec.dtype), lengths


@lru_cache(maxsize=1)
def _gpt2() -> GPT2Tokenizer:
    """One tokenizer per process: loading the BPE ranks takes about 0.1 s."""
    return GPT2Tokenizer()


def warm_gpt2() -> None:
    """Worker initializer: load the BPE ranks while the main process is still opening the dataset."""
    _gpt2()


def _encode_chars(chars: str, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Characters -> ids with numpy: code points looked up in the sorted vocabulary, no Python loop per character."""
    vocab = _codepoints(chars)
    points = _codepoints("".join(texts))
    ids = np.searchsorted(vocab, points)
    bad = ids >= vocab.size
    bad[~bad] = vocab[ids[~bad]] != points[~bad]
    if bad.any():
        raise DataError(f"character {chr(points[bad][0])!r} is not in the char vocabulary of this prepare")
    lengths = np.array([len(t) for t in texts], dtype=np.int64)
    return ids.astype(dtype_for_vocab(len(chars))), lengths


def _codepoints(text: str) -> np.ndarray:
    # surrogatepass: a lone surrogate is one character of the text like any other
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")


def unique_chars(spec: EncoderSpec, texts: list[str], first: list[bool]) -> str:
    """The distinct characters of the texts, sorted by code point (the char vocabulary's id order). Same signature as
    `encode_pieces`, so the vocabulary pass runs on the same worker pool."""
    seen: set[str] = set()
    for text in texts:
        seen.update(text)
    return "".join(sorted(seen))
