"""Tokenizers behind one small interface: tiktoken's GPT-2 BPE, or a character vocabulary.

The char tokenizer is the classic tiny-Shakespeare demo: its vocabulary is built from the data by
`prepare` and stored in the shard manifest, so training, sampling and evaluation decode the same way.
"""

from __future__ import annotations

from typing import Any, Protocol

GPT2_EOT = 50256
GPT2_VOCAB = 50257


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eot_token: int | None

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


class GPT2Tokenizer:
    """tiktoken `gpt2`; `encode` is `encode_ordinary`, so '<|endoftext|>' in text stays plain text."""

    name = "gpt2"
    vocab_size = GPT2_VOCAB
    eot_token: int | None = GPT2_EOT

    def __init__(self) -> None:
        import tiktoken

        self.enc = tiktoken.get_encoding("gpt2")

    def encode(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(texts, num_threads=num_threads)

    def decode(self, ids: list[int]) -> str:
        # ids past 50,256 exist only in the padded part of the model's vocabulary: show them, don't crash
        return self.enc.decode([i for i in ids if i < GPT2_VOCAB])


class CharTokenizer:
    """One id per character of `chars`; no end-of-text token (documents are joined with nothing)."""

    name = "char"
    eot_token: int | None = None

    def __init__(self, chars: str) -> None:
        self.chars = chars
        self.vocab_size = len(chars)
        self.stoi = {c: i for i, c in enumerate(chars)}

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as e:
            raise ValueError(f"character {e.args[0]!r} is not in this char vocabulary") from None

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids if i < self.vocab_size)


def tokenizer_from_manifest(manifest: dict[str, Any]) -> Tokenizer:
    if manifest["tokenizer"] == "char":
        return CharTokenizer(manifest["chars"])
    if manifest["tokenizer"] == "gpt2":
        return GPT2Tokenizer()
    raise ValueError(f"unknown tokenizer {manifest['tokenizer']!r} in manifest")
