"""`prepare --tokenizer bpe`: the text a byte-level BPE learns from, and the training.

The tokenizer must never see the held-out text, or val loss and bits per byte would flatter it. With `--val_split`
the held-out text is another split, and the tokenizer reads the train split only. With `--val_tokens N` the
held-out text is the stream's first N tokens, whose length in characters is known only once there is a tokenizer:
so the tokenizer skips a first stretch of the stream (4 characters per held-out token: a small BPE packs fewer,
GPT-2's about 3.3 in English) and, if the N tokens it makes of the stream reach past that stretch, learns again
past a longer one (longer by what it fell short, and a tenth more). A stretch much longer than the held-out text
would keep training text from the tokenizer: at 6 characters per token, the quick start's tokenizer compressed its
held-out text 7% less.

A stretch ends at a safe cut (`encode.iter_pieces`), so the tokens of the skipped text are those of the stream.
A corpus larger than a tokenizer needs is capped at `--tokenizer_chars` characters (nanochat caps at 2B), said
on screen.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from accel_gpt import bpe
from accel_gpt.config import PrepareConfig
from accel_gpt.data.encode import CUT_BEFORE, _safe_cut
from accel_gpt.data.sources import Stream
from accel_gpt.errors import DataError

CHARS_PER_HELD_OUT_TOKEN = 4  # the first guess of the skipped stretch


def train_tokenizer(cfg: PrepareConfig, stream: Stream) -> str:
    """The `tokenizer.json` text of a BPE trained on `stream` (the train stream) past its held-out tokens."""
    assert cfg.vocab_size is not None
    held_out = stream.val_tokens
    skip = held_out * CHARS_PER_HELD_OUT_TOKEN
    while True:
        start = time.perf_counter()
        seen = Seen()
        text = bpe.train(_learned_text(stream, skip, cfg.tokenizer_chars, seen), cfg.vocab_size)
        if not seen.chars:
            where = f"after the first {skip:,} characters held out for --val_tokens" if skip else "in the train split"
            raise DataError(f"'{cfg.dataset}' has no text to train the tokenizer on {where}")
        made = bpe.parse(text, "the trained tokenizer")
        say(
            f"tokenizer: a byte-level BPE of {made.vocab_size:,} ids learned from {seen.chars:,} characters "
            f"of the train split in {time.perf_counter() - start:.1f}s"
            + (f" (capped at --tokenizer_chars {cfg.tokenizer_chars:,})" if seen.capped else "")
            + (f", past the first {skip:,} held out" if skip else "")
        )
        if made.vocab_size < cfg.vocab_size:
            say(f"tokenizer: the text has no more pairs to merge: {made.vocab_size:,} ids, not {cfg.vocab_size:,}")
        inside = _tokens_in(stream, skip, made)
        if not held_out or inside >= held_out:
            return text
        skip = math.ceil(skip * held_out / max(inside, 1) * 1.1)
        say(f"tokenizer: the {held_out:,} held-out tokens reach past that stretch; learning again past {skip:,}")


@dataclass
class Seen:
    """How much text the tokenizer read, and whether the cap stopped it."""

    chars: int = 0
    capped: bool = False


def _learned_text(stream: Stream, skip: int, cap: int, seen: Seen) -> Iterator[str]:
    """The stream's documents after its first `skip` characters, until `cap` characters."""
    for held, text in _cut(stream, skip):
        if held:
            continue
        if seen.chars + len(text) >= cap:
            seen.capped = seen.chars + len(text) > cap
            text = text[: cap - seen.chars]
        seen.chars += len(text)
        yield text
        if seen.chars >= cap:
            return


def _tokens_in(stream: Stream, skip: int, made: bpe.BPE) -> int:
    """The tokens of the skipped stretch as `prepare` writes them: end-of-text before each document."""
    count = 0
    for held, text in _cut(stream, skip):
        if not held:
            break
        count += 1 + len(made.encoding.encode_ordinary(text))  # every held piece begins a document
    return count


def _cut(stream: Stream, skip: int) -> Iterator[tuple[bool, str]]:
    """(held, text) for each document of the stream: held while it lies in the first `skip` characters; the document
    the cut falls in comes as its two sides, cut safely, so their tokens are the document's."""
    done = 0
    for text in stream.texts():
        if text is None:
            continue
        if done >= skip:
            yield False, text
            continue
        if done + len(text) <= skip:
            done += len(text)
            yield True, text
            continue
        cut = _safe_cut(text, 0, skip - done, CUT_BEFORE["bpe"]) or len(text)
        done = skip
        yield True, text[:cut]
        if cut < len(text):
            yield False, text[cut:]


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
