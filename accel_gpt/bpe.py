"""A byte-level BPE trained on the data: learned with HF `tokenizers`, stored as its `tokenizer.json`, encoded with
tiktoken.

The ids are laid out as GPT-2's: 0..255 are the bytes in byte order, then one id per merge in the order it was
learned, and `<|endoftext|>` last. Every merged token's id is then its merge's rank, so tiktoken (which joins the
adjacent pair whose joined token has the lowest id) gives the same ids as a transformers tokenizer built from the
same `tokenizer.json` (which applies the merges in list order), and tiktoken is the faster of the two in `prepare`.

Text is first split with a GPT-4-style pattern (as nanochat's tokenizer is): letters with at most one leading
non-letter, single digits, punctuation runs with their trailing newlines, and whitespace. A piece never spans two of
these, so a merge never joins a word to the punctuation or space after it. Single digits spend no merges on numbers,
and the split is exactly llama.cpp's `bailingmoe` pre-tokenizer, so a GGUF export tokenizes as training did (runs
of two digits, the former split, measured within about 2% either way; llama.cpp has no regex for them).
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from accel_gpt.errors import UserError

TOKENIZER_FILE = "tokenizer.json"
EOT = "<|endoftext|>"
SPLIT_PATTERN = (
    r"'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+"
)
# The split of tokenizers learned before single digits: numbers in runs of up to two digits. Such a tokenizer.json
# still loads and trains (a tokenizer splits with the pattern its file holds); only llama.cpp has no regex for it.
LEGACY_SPLIT_PATTERN = SPLIT_PATTERN.replace(r"|\p{N}|", r"|\p{N}{1,2}|")


@dataclass(frozen=True, eq=False)  # one per tokenizer.json (`load` caches them): hashed by identity
class BPE:
    """What encoding, decoding and counting bytes need, read from a `tokenizer.json`."""

    ranks: dict[bytes, int]  # every token but end-of-text: its bytes -> its id
    eot: int
    pattern: str

    @property
    def vocab_size(self) -> int:
        return len(self.ranks) + 1

    @property
    def encoding(self) -> Any:
        return _encoding(self)

    def token_lengths(self) -> list[int]:
        """Each id's byte count (end-of-text: 0)."""
        lengths = [0] * self.vocab_size
        for token, rank in self.ranks.items():
            lengths[rank] = len(token)
        return lengths


def train(texts: Iterable[str], vocab_size: int) -> str:
    """A `tokenizer.json` of at most `vocab_size` ids (fewer where the text has no more pairs to merge)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = _pre_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,  # end-of-text is added after the merges
        min_frequency=2,  # a pair seen once is no pattern
        show_progress=sys.stdout.isatty(),  # piped, its bars still end each stage with a blank line on stdout
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    learner.train_from_iterator(texts, trainer)
    merges = json.loads(learner.to_str())["model"]["merges"]
    alphabet = _byte_alphabet()
    ranks = {bytes([b]): b for b in range(256)}
    for merge in merges:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        ranks.setdefault(_to_bytes(left, alphabet) + _to_bytes(right, alphabet), len(ranks))
    return to_json(BPE(ranks, len(ranks), SPLIT_PATTERN))


def to_json(bpe: BPE) -> str:
    """The `tokenizer.json` (transformers' fast tokenizer file) of `bpe`: its merges derived from the ranks."""
    from tokenizers import Tokenizer, decoders, models

    vocab, merges = vocab_and_merges(bpe.ranks)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = _pre_tokenizer(bpe.pattern)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT])  # id len(vocab): the last
    return tok.to_str(pretty=False)


def vocab_and_merges(ranks: dict[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The tokens (in the byte-to-unicode alphabet, as vocab.json writes them) with their ids, and the merges in
    rank order (merges.txt's lines): how transformers, tokenizers and llama.cpp are given a byte-level BPE."""
    table = bytes_to_unicode()

    def text(b: bytes) -> str:
        return "".join(table[x] for x in b)

    ordered = sorted(ranks.items(), key=lambda kv: kv[1])
    vocab = {text(token): rank for token, rank in ordered}
    merges = [(text(left), text(right)) for left, right in (merge_parts(t, ranks) for t, _ in ordered if len(t) > 1)]
    return vocab, merges


def _pre_tokenizer(pattern: str = SPLIT_PATTERN) -> Any:
    from tokenizers import Regex, pre_tokenizers

    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def parse(text: str, where: str) -> BPE:
    """A byte-level BPE `tokenizer.json` with its ids in merge order and `<|endoftext|>` last, or one line on why
    not (`where` names the file)."""

    def bad(why: str) -> UserError:
        return UserError(f"{where} is not a byte-level BPE tokenizer that accel_gpt reads: {why}")

    try:
        spec = json.loads(text)
        model, added = spec["model"], spec.get("added_tokens") or []
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise bad(f"not a tokenizer.json ({type(e).__name__}: {e})") from None
    if not isinstance(model, dict) or model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise bad("its model is not a BPE with a vocab")
    pattern = _split_pattern(spec.get("pre_tokenizer"))
    if pattern is None:
        raise bad("its pre-tokenizer is not a regex split followed by ByteLevel")
    alphabet = _byte_alphabet()
    try:
        ranks = {_to_bytes(token, alphabet): int(i) for token, i in model["vocab"].items()}
    except (KeyError, TypeError, ValueError):
        raise bad("a token holds characters outside the byte-level alphabet") from None
    eot = next((t.get("id") for t in added if isinstance(t, dict) and t.get("content") == EOT), None)
    if eot != len(ranks) or len(added) != 1:
        raise bad(f"its only added token must be {EOT}, with the last id {len(ranks)}")
    if sorted(ranks.values()) != list(range(len(ranks))) or any(ranks.get(bytes([b])) != b for b in range(256)):
        raise bad("its ids are not the 256 bytes in order followed by one id per merge")
    return BPE(ranks, eot, pattern)


def _split_pattern(pre: Any) -> str | None:
    """The regex of a `Sequence[Split(regex), ByteLevel(use_regex=false)]` pre-tokenizer, else None."""
    if not isinstance(pre, dict) or pre.get("type") != "Sequence" or len(pre.get("pretokenizers") or []) != 2:
        return None
    split, level = pre["pretokenizers"]
    regex = (split.get("pattern") or {}).get("Regex") if isinstance(split, dict) else None
    if split.get("type") != "Split" or not isinstance(regex, str) or split.get("behavior") != "Isolated":
        return None
    if not isinstance(level, dict) or level.get("type") != "ByteLevel" or level.get("use_regex", True):
        return None
    return regex


def _byte_alphabet() -> dict[str, int]:
    return {c: b for b, c in bytes_to_unicode().items()}


def _to_bytes(token: str, alphabet: dict[str, int]) -> bytes:
    return bytes(alphabet[c] for c in token)


def fingerprint(made: BPE) -> str:
    """The sha256 of what a tokenizer does (its split pattern, its tokens in id order, its end-of-text id), not of
    its file: transformers writes the same tokenizer into an export with other formatting."""
    tokens = [token.hex() for token, _ in sorted(made.ranks.items(), key=lambda kv: kv[1])]
    return hashlib.sha256(json.dumps([made.pattern, made.eot, tokens]).encode()).hexdigest()


def read(path: Path, sha256: str | None = None) -> tuple[str, BPE]:
    """The text of a `tokenizer.json` and its tokenizer, whose fingerprint must be `sha256` where one is given (what
    a manifest or model card recorded)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        if sha256 is None:
            raise UserError(f"cannot read the tokenizer file {path}: no such file") from None
        raise UserError(f"{path} is missing: the tokenizer the tokens were made with") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read the tokenizer file {path}: {e}") from None
    made = parse(text, str(path))
    if sha256 is not None and fingerprint(made) != sha256:
        raise UserError(
            f"{path} is not the tokenizer recorded beside it (sha256 {fingerprint(made)[:12]}..., recorded "
            f"{sha256[:12]}...): restore the file, or prepare the data again"
        )
    return text, made


def load(path: str, sha256: str) -> BPE:
    """The tokenizer at `path`, checked against its recorded fingerprint; once per process."""
    return load_with_text(path, sha256)[1]


@lru_cache(maxsize=8)
def load_with_text(path: str, sha256: str) -> tuple[str, BPE]:
    """`load`, and the file's text as read then: a folder may go after it was read (a checkpoint a run prunes while
    export reads it), and the text is what the export writes."""
    return read(Path(path), sha256)


@lru_cache(maxsize=8)
def _encoding(bpe: BPE) -> Any:
    import tiktoken

    return tiktoken.Encoding(
        f"accel_gpt-bpe-{bpe.vocab_size}", pat_str=bpe.pattern, mergeable_ranks=bpe.ranks, special_tokens={EOT: bpe.eot}
    )


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, the alphabet its vocab.json and merges.txt are written in.

    Bytes that are printable Latin-1 (other than space and the soft hyphen) stand for themselves; the
    remaining 68 take the characters 256, 257, ... in byte order, so no token string holds whitespace or
    control characters.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in table]
    table.update({b: chr(256 + i) for i, b in enumerate(others)})
    return table


def merge_parts(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes]:
    """The two pieces BPE joins to make `token`: byte-pair encode it with the ranks below its own.

    tiktoken merges the adjacent pair whose concatenation has the lowest rank, and every rank above 255
    is one merge in order, so stopping just before `token`'s own rank leaves exactly its two halves.
    """
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        pairs = [(ranks.get(parts[i] + parts[i + 1], limit), i) for i in range(len(parts) - 1)]
        rank, i = min(pairs)
        if rank >= limit:
            break
        parts[i : i + 2] = [parts[i] + parts[i + 1]]
    if len(parts) != 2:
        raise RuntimeError(f"tiktoken rank {limit} ({token!r}) is not one merge of two lower-ranked tokens")
    return parts[0], parts[1]
