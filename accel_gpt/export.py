"""`run.py export`: a run's or checkpoint's model as a transformers folder, tokenizer included: `GPT2LMHeadModel`
for the gpt2 block, `NanoChatForCausalLM` for the nanochat block.

The folder holds model.safetensors + config.json + generation_config.json and the tokenizer files
(tokenizer.json, and for GPT-2's its original vocab.json + merges.txt for readers without `tokenizers`; a trained
bpe's is its own tokenizer.json, read by `PreTrainedTokenizerFast`), so
`AutoModelForCausalLM.from_pretrained`, `AutoTokenizer.from_pretrained` and `pipeline` load it offline, and a model
card, README.md (see `modelcard`), so that it can be shared as it is.
config.json also records the size of the run's val set (`hf.EVAL_RECORD`), so that `run.py eval` of the folder
scores the windows `eval` of the run scores, and gives the same val_loss.
Only the tokenizer's real vocabulary rows are written (GPT-2's 50,257), not the padding. Everything is staged in a
temporary sibling folder and renamed into place, so a failure leaves no half-written export and `out_dir` is never
merged into.

`--format gguf` writes the folder with one GGUF file instead (llama.cpp, ollama; see `to_gguf`), an ollama Modelfile
and the card.

`--push_to_hub REPO_ID` then uploads the folder (`huggingface_hub`: create the repo, upload the folder). Offline
mode and a missing token are refused before anything is exported; a failed upload leaves the export in place and
says how to retry the upload alone.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

from accel_gpt.bpe import EOT
from accel_gpt.config import ExportConfig
from accel_gpt.errors import UserError
from accel_gpt.evaluate.val_loss import run_val_windows
from accel_gpt.files import make_shareable, replacing, tensor_bytes, write_or_refuse
from accel_gpt.hf import EVAL_RECORD, set_end_of_text, to_transformers
from accel_gpt.modelcard import CARD, model_card
from accel_gpt.rundir import read_run_config, run_of
from accel_gpt.to_gguf import (
    GGUF_FILE,
    MODELFILE,
    check_exportable,
    context_limit,
    describe_gguf,
    modelfile,
    write_gguf,
)
from accel_gpt.tokenizer import Tokenizer, gpt2_vocab_and_merges
from accel_gpt.weights import load_model

# GPT-2's tokenizer files in an export (vocab.json and merges.txt, then tokenizer.json): about 4 MB
TOKENIZER_BYTES = 4 << 20


def export(
    path: str | Path,
    out_dir: str | Path,
    license: str = "mit",
    title: str | None = None,
    load_as: str | None = None,
    fmt: str = "transformers",
    outtype: str = "f32",
) -> Path:
    """Write the model at `path` (run dir or checkpoint) as a transformers folder, or with `fmt="gguf"` as a folder
    holding its GGUF file (`outtype` weights) and an ollama Modelfile; returns that folder.

    The model card is headed `title` (default: the folder's name) and its examples load `load_as` (default:
    `out_dir` as given; the repo id when the folder goes to the Hub)."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out_dir {out} already exists and is not an empty folder; choose a new or empty one")
    check_writable(out)
    model, card = load_model(path)
    tok = card.tokenizer
    if tok.name == "char":
        raise UserError(
            f"{path} was trained with the 'char' tokenizer, which transformers has no tokenizer class for; export "
            "writes models trained on gpt2 or bpe tokens"
        )
    if card.model.vocab_size < tok.vocab_size:
        raise UserError(f"{path} has vocab_size={card.model.vocab_size}, fewer than its tokenizer's {tok.vocab_size}")
    if fmt == "gguf":
        check_exportable(card.model, tok, path)
    hf_model = to_transformers(model, vocab_size=tok.vocab_size)
    set_end_of_text(hf_model, tok.eot_token, card.model.seq_len)
    windows = val_windows_of_run(path)
    if windows is not None:
        setattr(hf_model.config, EVAL_RECORD, {"eval_windows": windows})
    title = title or out.name
    readme = model_card(path, card, hf_model.num_parameters(), license, title, load_as or str(out_dir), fmt)
    seq_len = card.model.seq_len
    if fmt == "gguf":
        files = {MODELFILE: modelfile(seq_len)}

        def save(stage: Path) -> None:
            write_gguf(stage / GGUF_FILE, hf_model, tok, outtype, title, license)
    else:
        tokenizer, files = transformers_tokenizer(tok, seq_len)

        def save(stage: Path) -> None:
            hf_model.save_pretrained(stage)
            tokenizer.save_pretrained(stage)

    def write() -> None:  # on a failure the staging folder is already gone (see `replacing`)
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            with replacing(out) as stage:
                stage.mkdir()
                save(stage)
                for name, text in files.items():
                    (stage / name).write_text(text, encoding="utf-8")
                (stage / CARD).write_text(readme, encoding="utf-8")
                make_shareable(stage)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            raise UserError(
                f"cannot write the export to {out}: the folder was filled while this export ran (another export "
                "into it at the same time?); nothing of this one is left there: choose another --out_dir, or empty it"
            ) from None

    write_or_refuse(f"the export to {out}", out, write, tensor_bytes(hf_model.state_dict().values()) + TOKENIZER_BYTES)
    return out


def transformers_tokenizer(tok: Tokenizer, seq_len: int) -> tuple[Any, dict[str, str]]:
    """The transformers tokenizer that gives `tok`'s ids (the training data's, a literal end-of-text included), with
    end-of-text as bos, eos and unk (as GPT-2's own), and
    the files to write beside what its `save_pretrained` writes (GPT-2's vocab.json and merges.txt, for readers
    without `tokenizers`)."""
    if tok.name == "gpt2":
        from transformers import GPT2Tokenizer

        vocab, merges = gpt2_vocab_and_merges()
        lines = ["#version: 0.2", *(f"{a} {b}" for a, b in merges)]
        files = {"vocab.json": json.dumps(vocab, ensure_ascii=False), "merges.txt": "\n".join(lines) + "\n"}
        return GPT2Tokenizer(vocab=vocab, merges=merges, model_max_length=seq_len, **AS_TRAINED), files
    from tokenizers import Tokenizer as Backend
    from transformers import PreTrainedTokenizerFast

    backend = Backend.from_str(tok.definition())
    special = {"bos_token": EOT, "eos_token": EOT, "unk_token": EOT}
    return PreTrainedTokenizerFast(tokenizer_object=backend, model_max_length=seq_len, **special, **AS_TRAINED), {}


# prepare reads a literal "<|endoftext|>" in a document as text (tiktoken's encode_ordinary): only the boundary it
# writes between documents is the end-of-text id, so the export's tokenizer splits that literal the same way
AS_TRAINED = {"split_special_tokens": True}


def val_windows_of_run(path: str | Path) -> int | None:
    """The size of the val set of the run the weights at `path` come from; None for weights without their run (or
    with a config.yaml that no longer reads, which the card leaves out too)."""
    run = run_of(path)
    if run is None:
        return None
    try:
        return run_val_windows(read_run_config(run))
    except UserError:
        return None


def check_writable(out: Path) -> None:
    """The export is staged beside `out` and renamed into place, so the nearest existing folder above it must be
    writable: said before the model is loaded and converted, and before any folder is made."""
    folder = next(p for p in out.absolute().parents if p.exists())
    if not folder.is_dir() or not os.access(folder, os.W_OK | os.X_OK):
        reason = "not a folder" if not folder.is_dir() else "not writable (read-only or no permission)"
        raise UserError(f"cannot write the export to {out}: {folder} is {reason}")


def check_can_push(repo_id: str) -> None:
    """Offline mode or no token: said before minutes of exporting, and before anything is written."""
    import huggingface_hub

    if huggingface_hub.is_offline_mode():
        raise UserError(
            f"--push_to_hub {repo_id}: HF_HUB_OFFLINE=1 is set, so nothing can be uploaded; unset it to upload, or "
            "export without --push_to_hub"
        )
    if huggingface_hub.get_token() is None:
        raise UserError(
            f"--push_to_hub {repo_id} needs a Hugging Face token with write access: run `hf auth login` or set HF_TOKEN"
        )


def push(out: Path, repo_id: str, private: bool) -> str:
    """Create the model repo (an existing one is kept) and upload the folder in one commit; returns the repo's URL."""
    import huggingface_hub

    try:
        repo = huggingface_hub.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        huggingface_hub.upload_folder(
            repo_id=repo.repo_id, folder_path=out, repo_type="model", commit_message="Upload accel_gpt export"
        )
    except Exception as e:  # noqa: BLE001 - HTTP, network (httpx) and offline errors come as each library's types
        reason = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        private_flag = " --private" if private else ""
        raise UserError(
            f"exported {out}, but the upload to {repo_id} failed: {reason}; once that is fixed, upload the folder "
            f"alone with `hf upload {repo_id} {out}{private_flag}`"
        ) from None
    return str(repo)


def run_export(cfg: ExportConfig) -> None:
    """`run.py export`: one line naming what was written, and one naming where it went with --push_to_hub."""
    from transformers.utils import logging as hf_logging

    if cfg.push_to_hub:
        check_can_push(cfg.push_to_hub)
    hf_logging.disable_progress_bar()  # save_pretrained's bar for one shard is noise in a one-line command
    title = cfg.push_to_hub.split("/")[-1] if cfg.push_to_hub else None
    out = export(cfg.checkpoint, cfg.out_dir, cfg.license, title, cfg.push_to_hub or None, cfg.format, cfg.outtype)
    if cfg.format == "gguf":
        what, positions = describe_gguf(out / GGUF_FILE)
        print(f"exported {cfg.checkpoint} -> {out / GGUF_FILE} ({what}; {MODELFILE}, model card)")
        print(context_limit(positions))
    else:
        model_class = json.loads((out / "config.json").read_text())["architectures"][0]
        vocab = json.loads((out / "config.json").read_text())["vocab_size"]
        what = "GPT-2 tokenizer" if (out / "merges.txt").is_file() else "its bpe tokenizer"
        print(f"exported {cfg.checkpoint} -> {out} ({model_class} + {what}, vocab {vocab}, model card)")
    if cfg.push_to_hub:
        print(f"uploaded {out} -> {push(out, cfg.push_to_hub, cfg.private)}")
