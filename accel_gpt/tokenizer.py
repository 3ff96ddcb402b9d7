"""The one description of a tokenizer: GPT-2's BPE (tiktoken), a byte-level BPE trained on the data (`bpe.py`), or
a character vocabulary built from the data.

A `Tokenizer` is a few strings (its name; for `char` the vocabulary; for `bpe` the fingerprint of its `tokenizer.json`
and where that file is), so the same small object is written into the shard manifest and `model_config.json`, sent
to the prepare workers, and used to encode prompts and decode samples. Two `bpe` tokenizers are equal when they
tokenize alike (the fingerprint), wherever their files lie. The char tokenizer is the classic tiny-Shakespeare start:
its vocabulary is every character of the data, in code-point order, and it has no end-of-text token.

An export's vocab.json and merges.txt (transformers' GPT-2 tokenizer files) are derived from tiktoken's mergeable
ranks, the same source that `prepare` tokenizes with, so a transformers tokenizer built from them gives its ids.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from accel_gpt import bpe
from accel_gpt.errors import UserError
from accel_gpt.files import atomic_write

GPT2_EOT = 50256  # <|endoftext|>
GPT2_VOCAB = 50257
NAMES = ("gpt2", "char", "bpe")


@dataclass(frozen=True)
class Tokenizer:
    name: str  # gpt2 | char | bpe
    chars: str = ""  # char only: the vocabulary, id i is chars[i] (sorted by code point)
    sha256: str = ""  # bpe only: the fingerprint of its tokenizer.json (`bpe.fingerprint`)
    file: str = field(default="", compare=False)  # bpe only: where that tokenizer.json is

    def __post_init__(self) -> None:
        if self.name not in NAMES:
            raise ValueError(f"unknown tokenizer {self.name!r}; expected one of {', '.join(NAMES)}")
        if self.name == "bpe" and not (self.sha256 and self.file):
            raise ValueError("a bpe tokenizer needs the sha256 of its tokenizer.json and the file")

    @classmethod
    def bpe_file(cls, path: str | Path) -> Tokenizer:
        """The bpe tokenizer of a `tokenizer.json` as it is now; a file that is no tokenizer of ours is one line."""
        return cls("bpe", sha256=bpe.fingerprint(bpe.read(Path(path))[1]), file=str(path))

    @property
    def _bpe(self) -> bpe.BPE:
        return bpe.load(self.file, self.sha256)

    @property
    def vocab_size(self) -> int:
        if self.name == "bpe":
            return self._bpe.vocab_size
        return GPT2_VOCAB if self.name == "gpt2" else len(self.chars)

    @property
    def eot_token(self) -> int | None:
        """GPT-2 and bpe put end-of-text before every document; a char stream has no separator."""
        if self.name == "bpe":
            return self._bpe.eot
        return GPT2_EOT if self.name == "gpt2" else None

    @property
    def dtype(self) -> np.dtype:
        return dtype_for_vocab(self.vocab_size)

    def encode(self, text: str) -> list[int]:
        """GPT-2: tiktoken's `encode_ordinary`, so '<|endoftext|>' in the text stays text. Char: ValueError on a
        character outside the vocabulary."""
        if self.name != "char":
            return self._tiktoken().encode_ordinary(text)
        return self.encode_array(text).tolist()

    def _tiktoken(self) -> Any:
        return _tiktoken_gpt2() if self.name == "gpt2" else self._bpe.encoding

    def encode_array(self, text: str) -> np.ndarray:
        if self.name != "char":
            return np.asarray(self.encode(text), dtype=self.dtype)
        vocab, points = _codepoints(self.chars), _codepoints(text)
        ids = np.searchsorted(vocab, points)  # no Python loop per character
        bad = ids >= vocab.size
        bad[~bad] = vocab[ids[~bad]] != points[~bad]
        if bad.any():
            raise ValueError(f"character {chr(points[bad][0])!r} is not in this char vocabulary")
        return ids.astype(self.dtype)

    def decode(self, ids: list[int]) -> str:
        """Ids outside the vocabulary (the padded rows of a model's embedding) are skipped, not an error."""
        ids = [i for i in ids if 0 <= i < self.vocab_size]
        if self.name != "char":
            return self._tiktoken().decode(ids)
        return "".join(self.chars[i] for i in ids)

    def token_bytes(self) -> np.ndarray:
        """The UTF-8 bytes of text each id stands for (0 for end-of-text, which stands for none): summed over a
        split's tokens, its byte count, which turns a loss per token into bits per byte."""
        return _token_bytes(self)

    def vocab_and_merges(self) -> tuple[dict[str, int], list[tuple[str, str]]]:
        """A BPE's tokens with their ids, end-of-text included, and its merges in rank order (see
        `bpe.vocab_and_merges`)."""
        if self.name == "gpt2":
            return gpt2_vocab_and_merges()
        if self.name != "bpe":
            raise ValueError(f"the {self.name} tokenizer has no merges")
        vocab, merges = bpe.vocab_and_merges(self._bpe.ranks)
        return {**vocab, bpe.EOT: self._bpe.eot}, merges

    @property
    def split_pattern(self) -> str | None:
        """The regex a bpe splits text with before merging (what its tokenizer.json says); None for the others."""
        return self._bpe.pattern if self.name == "bpe" else None

    def load(self) -> Tokenizer:
        """Read what encoding needs now (GPT-2's BPE files, or the bpe's tokenizer.json checked against its
        fingerprint), so that a missing or changed file is said before work begins."""
        if self.name != "char":
            self._tiktoken()
        return self

    def to_dict(self) -> dict[str, Any]:
        if self.name == "bpe":
            return {"name": "bpe", "sha256": self.sha256, "vocab_size": self.vocab_size}
        return {"name": self.name, "chars": self.chars} if self.name == "char" else {"name": self.name}

    @classmethod
    def from_dict(cls, d: dict[str, Any], folder: str | Path = "") -> Tokenizer:
        """`folder` holds the bpe's tokenizer.json (a model's folder, a data folder)."""
        if d["name"] == "bpe":
            return cls("bpe", sha256=d["sha256"], file=str(Path(folder) / bpe.TOKENIZER_FILE))
        return cls(d["name"], d.get("chars") or "")

    def definition(self) -> str:
        """A bpe's tokenizer.json text, checked against its fingerprint (as first read: `bpe.load_with_text`)."""
        return bpe.load_with_text(self.file, self.sha256)[0]

    def copy_to(self, folder: Path) -> None:
        """A bpe's tokenizer.json into `folder` (written whole or not at all), unless it is there already."""
        target = Path(folder) / bpe.TOKENIZER_FILE
        if self.name != "bpe" or target.resolve() == Path(self.file).resolve():
            return
        atomic_write(target, self.definition())


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """Token storage: uint16 holds GPT-2's 50,257 ids in half the bytes of uint32; larger vocabularies need uint32."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def char_vocabulary(texts: list[str]) -> str:
    """The distinct characters of `texts` in code-point order: a char tokenizer's vocabulary."""
    seen: set[str] = set()
    for text in texts:
        seen.update(text)
    return "".join(sorted(seen))


def _codepoints(text: str) -> np.ndarray:
    # surrogatepass: a lone surrogate is one character of the text like any other
    return np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype="<u4")


@lru_cache(maxsize=4)
def _token_bytes(tok: Tokenizer) -> np.ndarray:
    """uint8 per id (the longest GPT-2 token is 128 bytes, a character at most 4; uint16 for a trained bpe with a longer
    one): built once per tokenizer."""
    if tok.name == "bpe":
        lengths = tok._bpe.token_lengths()
        return np.array(lengths, dtype=np.uint8 if max(lengths) < 256 else np.uint16)
    if tok.name == "gpt2":
        enc = _tiktoken_gpt2()
        lengths = np.array([len(enc.decode_single_token_bytes(i)) for i in range(GPT2_VOCAB)], dtype=np.uint8)
        lengths[GPT2_EOT] = 0
        return lengths
    # UTF-8 takes 1 byte below U+0080, 2 below U+0800, 3 below U+10000 (a lone surrogate too), 4 above
    points = _codepoints(tok.chars)
    return (np.searchsorted(np.array([0x80, 0x800, 0x10000]), points, side="right") + 1).astype(np.uint8)


@lru_cache(maxsize=1)
def _tiktoken_gpt2() -> Any:
    """One tiktoken encoding per process (loading the BPE ranks takes about 0.1 s)."""
    import tiktoken

    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # offline without the files: requests/urllib errors chained several deep
        where = os.environ.get("TIKTOKEN_CACHE_DIR") or "tiktoken's cache in the temp folder"
        raise UserError(
            f"cannot load the GPT-2 BPE files ({type(e).__name__}); tiktoken looks in TIKTOKEN_CACHE_DIR "
            f"({where}) and downloads them when online: run once with internet, or copy that cache folder "
            "from a machine where tiktoken has run and point TIKTOKEN_CACHE_DIR at it"
        ) from None


def gpt2_vocab_and_merges() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """vocab.json and merges.txt content of GPT-2's tokenizer, rebuilt from tiktoken's `gpt2` ranks.

    A token's id is its tiktoken rank, written in the byte-to-unicode alphabet; merges are listed in rank
    order, which is the priority transformers' BPE applies. `<|endoftext|>` is id 50,256.
    """
    import tiktoken

    enc = tiktoken.get_encoding("gpt2")
    vocab, merges = bpe.vocab_and_merges(enc._mergeable_ranks)  # the public API has no accessor for the raw ranks
    vocab.update(enc._special_tokens)
    if vocab.get("<|endoftext|>") != GPT2_EOT or len(vocab) != GPT2_VOCAB:
        raise RuntimeError(f"tiktoken's gpt2 encoding is not GPT-2's 50,257-token vocabulary ({len(vocab)})")
    return vocab, merges
