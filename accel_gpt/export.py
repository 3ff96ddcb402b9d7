"""`run.py export`: a run's or checkpoint's model as a transformers GPT-2 folder, tokenizer included.

The folder holds model.safetensors + config.json + generation_config.json and the tokenizer files
(tokenizer.json, and GPT-2's original vocab.json + merges.txt for readers without `tokenizers`), so
`GPT2LMHeadModel.from_pretrained`, `AutoTokenizer.from_pretrained` and `pipeline` load it offline.
Only the 50,257 real vocabulary rows are written. Everything is staged in a temporary sibling folder
and renamed into place, so a failure leaves no half-written export and `out_dir` is never merged into.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from accel_gpt.config import ExportConfig
from accel_gpt.errors import UserError
from accel_gpt.files import make_shareable, replacing
from accel_gpt.hf import gpt2_vocab_and_merges, to_transformers
from accel_gpt.tokenizer import GPT2_EOT, GPT2_VOCAB
from accel_gpt.weights import load_model


def export(path: str | Path, out_dir: str | Path) -> Path:
    """Write the model at `path` (run dir or checkpoint) as a transformers GPT-2 folder; returns that folder."""
    from transformers import GenerationConfig, GPT2Tokenizer

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out_dir {out} already exists and is not an empty folder; choose a new or empty one")
    check_writable(out)
    model, card = load_model(path)
    if card.tokenizer.name != "gpt2":
        raise UserError(
            f"{path} was trained with the '{card.tokenizer.name}' tokenizer; export writes GPT-2 BPE tokenizer files "
            "and supports only models trained on gpt2 tokens"
        )
    if card.model.vocab_size < GPT2_VOCAB:
        raise UserError(f"{path} has vocab_size={card.model.vocab_size}, fewer than GPT-2's {GPT2_VOCAB} tokens")
    hf_model = to_transformers(model, vocab_size=GPT2_VOCAB)
    hf_model.generation_config = GenerationConfig(
        bos_token_id=GPT2_EOT,
        eos_token_id=GPT2_EOT,
        pad_token_id=GPT2_EOT,  # GPT-2 has no pad token
    )
    vocab, merges = gpt2_vocab_and_merges()
    # byte-level BPE with <|endoftext|> as bos/eos/unk, as GPT-2's own tokenizer
    tokenizer = GPT2Tokenizer(vocab=vocab, merges=merges, model_max_length=card.model.seq_len)

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with replacing(out) as stage:
            stage.mkdir()
            hf_model.save_pretrained(stage)
            tokenizer.save_pretrained(stage)
            (stage / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
            lines = ["#version: 0.2", *(f"{a} {b}" for a, b in merges)]
            (stage / "merges.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
            make_shareable(stage)
    except OSError as e:  # a full or read-only disk; the staging folder is already gone (see `replacing`)
        raise UserError(f"cannot write the export to {out}: {e.strerror or e}") from None
    return out


def check_writable(out: Path) -> None:
    """The export is staged beside `out` and renamed into place, so the nearest existing folder above it must be
    writable: said before the model is loaded and converted, and before any folder is made."""
    folder = next(p for p in out.absolute().parents if p.exists())
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        reason = "not a folder" if not folder.is_dir() else "not writable (read-only or no permission)"
        raise UserError(f"cannot write the export to {out}: {folder} is {reason}")


def run_export(cfg: ExportConfig) -> None:
    """`run.py export`: one line naming what was written."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save_pretrained's bar for one shard is noise in a one-line command
    out = export(cfg.checkpoint, cfg.out_dir)
    print(f"exported {cfg.checkpoint} -> {out} (GPT2LMHeadModel + GPT-2 tokenizer, vocab {GPT2_VOCAB})")
