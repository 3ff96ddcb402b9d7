"""`export --format gguf` read back with gguf's own reader and run in llama.cpp itself (llama-cpp-python), against
the transformers export of the same run (`bench/gguf_check.py`'s comparison): the same ids on text with numbers,
logits within 1e-3, the same greedy continuation; and each refusal in one line.

The runs are real and small: tiny-cpu with 256 positions on a BPE learned from Python's own standard library (code:
digits in runs of every length) and on GPT-2's tokens of tiny Shakespeare. The held-out text is a stdlib module the
tokenizer never saw, chosen for its numbers.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import sysconfig
import unicodedata
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SHAKESPEARE, python_cmd, run_cmd, subprocess_env
from gguf import GGUFReader, TokenType
from gguf.quants import dequantize
from llama_cpp import Llama
from transformers import AutoModelForCausalLM, AutoTokenizer

from accel_gpt import bpe
from accel_gpt.cli import main as cli_main
from accel_gpt.errors import ConfigError
from accel_gpt.model import GPT, GPTConfig
from accel_gpt.to_gguf import GGUF_FILE, MODELFILE, llama_cpp_name
from accel_gpt.tokenizer import Tokenizer
from accel_gpt.weights import ModelCard, save_weights
from bench.gguf_check import compare

STDLIB = Path(sysconfig.get_paths()["stdlib"])
TRAIN_FLAGS = [
    "--config", "tiny-cpu", "--seq_len", "256", "--total_batch_size", "1024", "--micro_batch_size", "4",
    "--eval_every", "0", "--sample_tokens", "0", "--save_every", "0", "--log_with", "none",
]  # fmt: skip


def held_out() -> str:
    """6,000 characters of code with numbers (90 runs of two or more digits) that no training text here holds."""
    return (STDLIB / "uuid.py").read_text(encoding="utf-8")[:6000]


def code_text(chars: int = 400_000) -> str:
    """The standard library's first modules in name order, up to `chars` (uuid.py is far past them)."""
    parts, total = [], 0
    for path in sorted(STDLIB.glob("*.py")):
        parts.append(path.read_text(encoding="utf-8", errors="replace"))
        total += len(parts[-1])
        if total >= chars:
            break
    text = "".join(parts)
    assert "uuid" not in [p.stem for p in sorted(STDLIB.glob("*.py"))[: len(parts)]]
    return text


def trained(root: Path, prepare_flags: list[str], text: str, steps: int) -> Path:
    (root / "text.txt").write_text(text, encoding="utf-8")
    data, run = root / "data", root / "run"
    run_cmd(python_cmd("prepare", "--dataset", str(root / "text.txt"), *prepare_flags, "--out_dir", str(data)))
    flags = [*TRAIN_FLAGS, "--max_steps", str(steps), "--data_dir", str(data), "--out_dir", str(run)]
    run_cmd(python_cmd("train", *flags), timeout=600)
    return run


def exported(run: Path, out: Path, *flags: str) -> Path:
    run_cmd(python_cmd("export", "--checkpoint", str(run), "--out_dir", str(out), *flags))
    return out


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    flags = ["--tokenizer", "bpe", "--vocab_size", "1024", "--val_tokens", "4000"]
    return trained(tmp_path_factory.mktemp("gguf_bpe"), flags, code_text(), steps=150)


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    flags = ["--tokenizer", "gpt2", "--val_tokens", "4000"]
    return trained(tmp_path_factory.mktemp("gguf_gpt2"), flags, SHAKESPEARE.read_text()[:200_000], steps=60)


@pytest.fixture(scope="module")
def bpe_exports(bpe_run: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf_bpe_exports")
    outs = {t: exported(bpe_run, root / t, "--format", "gguf", "--outtype", t) for t in ("f32", "f16", "bf16")}
    return {**outs, "transformers": exported(bpe_run, root / "hf")}


def test_the_learned_bpe_runs_in_llama_cpp_as_in_transformers(bpe_exports: dict[str, Path]) -> None:
    text = held_out()
    assert len(re.findall(r"\d{2,}", text)) >= 80  # the point: numbers of many digits
    got = compare(bpe_exports["transformers"], bpe_exports["f32"] / GGUF_FILE, text)
    assert got.theirs == got.ours and len(got.ours) > 2000
    assert got.logit_diff < 1e-3
    assert got.exact_diff < 1e-4  # the file itself is exact: what is left is llama.cpp's own f16 cache and GELU
    assert got.llama_greedy == got.hf_greedy


def test_gpt2_tokens_run_in_llama_cpp_as_in_transformers(gpt2_run: Path, tmp_path: Path) -> None:
    out = exported(gpt2_run, tmp_path / "gguf", "--format", "gguf")
    hf = exported(gpt2_run, tmp_path / "hf")
    text = SHAKESPEARE.read_text()[-6000:] + " 1599, 12 pence, 365 days and 3.14159"  # past the training text
    got = compare(hf, out / GGUF_FILE, text)
    assert got.theirs == got.ours
    assert got.logit_diff < 1e-3 and got.exact_diff < 1e-4
    assert got.llama_greedy == got.hf_greedy
    meta = GGUFReader(out / GGUF_FILE).fields
    assert meta["tokenizer.ggml.pre"].contents() == "gpt-2"
    assert len(meta["tokenizer.ggml.tokens"].data) == 50257


def many_scripts(words: int = 6000) -> str:
    """Words of random letters, numbers, punctuation, symbols and spaces from every script below U+3000, between
    spaces, newlines, numbers and contractions: what llama.cpp's split must read as the tokenizer's regex does."""
    rng = random.Random(0)
    chars = [chr(c) for c in range(0x20, 0x3000) if unicodedata.category(chr(c))[0] in "LNPSZ"]
    glue = [" ", "  ", "\n", "\n\n", " 12 ", " 3.14159 ", "'s ", "'LL ", "\t", " \n ", "2026-11-29"]
    return "".join("".join(rng.choices(chars, k=rng.randint(1, 6))) + rng.choice(glue) for _ in range(words))


def test_llama_cpp_splits_text_of_every_script_as_the_tokenizer_does(bpe_run: Path, bpe_exports: dict[str, Path]):
    tok = Tokenizer.bpe_file(bpe_run / "tokenizer.json")
    llm = Llama(model_path=str(bpe_exports["f32"] / GGUF_FILE), vocab_only=True, verbose=False)
    try:
        for text in (many_scripts(), code_text(100_000)):
            assert llm.tokenize(text.encode(), add_bos=False, special=False) == tok.encode(text)
    finally:
        llm.close()


@pytest.mark.parametrize("outtype, within", [("f16", 1e-2), ("bf16", 5e-2)])
def test_half_precision_files_run_close_to_float32(bpe_exports: dict[str, Path], outtype: str, within: float) -> None:
    got = compare(bpe_exports["transformers"], bpe_exports[outtype] / GGUF_FILE, held_out())
    assert got.theirs == got.ours
    assert got.logit_diff < within


def test_the_file_read_back_holds_the_model_and_its_tokenizer(bpe_run: Path, bpe_exports: dict[str, Path]) -> None:
    """Every tensor is the transformers export's (f32 exactly; f16 and bf16 within their rounding, vectors in f32),
    and the metadata and tokenizer are the run's."""
    hf = AutoModelForCausalLM.from_pretrained(bpe_exports["transformers"]).state_dict()
    cfg = json.loads((bpe_exports["transformers"] / "config.json").read_text())
    vocab, merges = Tokenizer.bpe_file(bpe_run / "tokenizer.json").vocab_and_merges()
    # (relative rounding, absolute near zero: f16's subnormal spacing; bf16 has f32's range)
    for outtype, rtol, atol in (("f32", 0.0, 0.0), ("f16", 2**-11, 2**-24), ("bf16", 2**-8, 0.0)):
        reader = GGUFReader(bpe_exports[outtype] / GGUF_FILE)
        tensors = {t.name: t for t in reader.tensors}
        assert len(tensors) == 12 * cfg["n_layer"] + 4  # 12 per block, embeddings and final norm, no separate head
        for key, value in hf.items():
            if key == "lm_head.weight":
                continue
            t = tensors.pop(llama_cpp_name(key))
            expected = value.t() if value.ndim == 2 and "wte" not in key and "wpe" not in key else value
            data = dequantize(t.data, t.tensor_type).reshape(expected.shape)
            assert t.tensor_type.name == ("F32" if value.ndim == 1 else outtype.upper())
            assert np.allclose(data, expected.numpy(), rtol=rtol, atol=atol), key
        assert not tensors

        def value(key: str, reader: GGUFReader = reader) -> object:
            return reader.fields[key].contents()

        assert value("general.architecture") == "gpt2"
        assert value("general.file_type") == {"f32": 0, "f16": 1, "bf16": 32}[outtype]
        assert (value("gpt2.context_length"), value("gpt2.block_count")) == (256, cfg["n_layer"])
        assert (value("gpt2.embedding_length"), value("gpt2.attention.head_count")) == (cfg["n_embd"], cfg["n_head"])
        assert value("gpt2.feed_forward_length") == 4 * cfg["n_embd"]
        assert value("tokenizer.ggml.model") == "gpt2" and value("tokenizer.ggml.pre") == "bailingmoe"
        tokens = value("tokenizer.ggml.tokens")
        assert tokens == sorted(vocab, key=vocab.__getitem__) and tokens[-1] == bpe.EOT
        assert value("tokenizer.ggml.merges") == [f"{a} {b}" for a, b in merges]
        types = value("tokenizer.ggml.token_type")
        assert types[-1] == TokenType.CONTROL and set(types[:-1]) == {TokenType.NORMAL}
        eot = len(tokens) - 1
        for key in ("bos", "eos", "unknown"):
            assert value(f"tokenizer.ggml.{key}_token_id") == eot
        assert value("tokenizer.ggml.add_bos_token") is False


def test_the_folder_holds_an_ollama_modelfile_and_a_card_for_llama_cpp(bpe_exports: dict[str, Path]) -> None:
    folder = bpe_exports["f32"]
    assert sorted(p.name for p in folder.iterdir()) == sorted([GGUF_FILE, MODELFILE, "README.md"])
    lines = (folder / MODELFILE).read_text().splitlines()
    assert lines[0] == f"FROM ./{GGUF_FILE}" and "PARAMETER num_ctx 256" in lines
    assert f'PARAMETER stop "{bpe.EOT}"' in lines
    card = (folder / "README.md").read_text()
    assert "library_name: gguf" in card and "llama-completion -m model.gguf" in card
    assert "GPT2LMHeadModel" not in card


# ---------------------------------------------------------------------------------------------- fewer positions


ABORTS = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=0, verbose=False, n_threads=1)  # 0: the model's own, llama.cpp's default
print("context", llm.n_ctx(), flush=True)
llm.eval(list(range(int(sys.argv[2]))))
print("evaluated", flush=True)
"""


def test_a_64_position_model_says_where_llama_cpp_stops_and_it_does(bpe_run: Path, tmp_path: Path) -> None:
    """What the export prints is what llama.cpp does: it rounds the context up to 256, runs 64 positions, and
    aborts the process at the 65th."""
    run = tmp_path / "run64"
    flags = [*TRAIN_FLAGS, "--seq_len", "64", "--max_steps", "4"]
    run_cmd(python_cmd("train", *flags, "--data_dir", str(bpe_run.parent / "data"), "--out_dir", str(run)))
    proc = run_cmd(python_cmd("export", "--checkpoint", str(run), "--out_dir", str(tmp_path / "g"), "--format", "gguf"))
    assert "keep the prompt plus the new tokens (-n) within 64" in proc.stdout
    assert "rounds the context up to 256 positions" in proc.stdout
    assert "within 64" in (tmp_path / "g" / "README.md").read_text()
    model = str(tmp_path / "g" / GGUF_FILE)

    within, past = evaluated(model, 64), evaluated(model, 65)
    assert within.returncode == 0 and "context 256" in within.stdout and "evaluated" in within.stdout
    assert past.returncode != 0 and "evaluated" not in past.stdout and "GGML_ASSERT" in past.stderr


def test_a_256_position_model_is_refused_past_its_context_without_an_abort(bpe_exports: dict[str, Path]) -> None:
    model = str(bpe_exports["f32"] / GGUF_FILE)
    assert "context full" in (bpe_exports["f32"] / "README.md").read_text()
    full, past = evaluated(model, 256), evaluated(model, 257)
    assert full.returncode == 0 and "context 256" in full.stdout and "evaluated" in full.stdout
    assert past.returncode == 1 and "llama_decode returned 1" in past.stderr and "GGML_ASSERT" not in past.stderr


def evaluated(model: str, n: int) -> subprocess.CompletedProcess:
    """llama.cpp in a process of its own (an abort ends the process): ids 0..n-1 at the model's own context."""
    args = [sys.executable, "-c", ABORTS, model, str(n)]
    return subprocess.run(args, env=subprocess_env(), capture_output=True, text=True, timeout=120)


# ---------------------------------------------------------------------------------------------- refusals


def weights(folder: Path, cfg: GPTConfig, tok: Tokenizer) -> Path:
    torch.manual_seed(0)
    save_weights(GPT(cfg).state_dict(), ModelCard(cfg, tok, step=1), folder)
    return folder


def export_error(capsys: pytest.CaptureFixture, checkpoint: Path, out: Path) -> str:
    with pytest.raises(SystemExit) as e:
        cli_main(["export", "--checkpoint", str(checkpoint), "--out_dir", str(out), "--format", "gguf"])
    assert e.value.code != 0 and not out.exists()
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


SMALL = dict(n_layer=1, n_head=2, n_embd=32, seq_len=256, vocab_size=50_304)


def test_the_nanochat_block_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = weights(tmp_path / "w", GPTConfig(**SMALL, arch="nanochat"), Tokenizer("gpt2"))
    err = export_error(capsys, folder, tmp_path / "out")
    assert "llama.cpp has no architecture for it" in err and "--arch gpt2" in err and "transformers" in err


def test_the_exact_gelu_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = weights(tmp_path / "w", GPTConfig(**SMALL, gelu="exact"), Tokenizer("gpt2"))
    err = export_error(capsys, folder, tmp_path / "out")
    assert "tanh approximation" in err and "--gelu tanh" in err


def test_a_tokenizer_learned_with_runs_of_two_digits_still_trains_and_exports_to_transformers_only(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """A tokenizer.json of the former split (numbers in runs of up to two digits) prepares, trains, encodes with its
    own split and exports to transformers; its GGUF export is refused in one line."""
    learned = bpe.parse(bpe.train([code_text(60_000)], 512), "learned")
    legacy = tmp_path / "tokenizer.json"
    legacy.write_text(bpe.to_json(bpe.BPE(learned.ranks, learned.eot, bpe.LEGACY_SPLIT_PATTERN)))
    (tmp_path / "text.txt").write_text(code_text(60_000))
    data, run = tmp_path / "data", tmp_path / "run"
    prepare = ["--dataset", str(tmp_path / "text.txt"), "--tokenizer", "bpe", "--tokenizer_file", str(legacy)]
    run_cmd(python_cmd("prepare", *prepare, "--val_tokens", "2000", "--out_dir", str(data)))
    run_cmd(python_cmd("train", *TRAIN_FLAGS, "--max_steps", "2", "--data_dir", str(data), "--out_dir", str(run)))
    tok = Tokenizer.bpe_file(run / "tokenizer.json")
    assert tok.split_pattern == bpe.LEGACY_SPLIT_PATTERN
    hf = exported(run, tmp_path / "hf")
    assert AutoTokenizer.from_pretrained(hf)(held_out())["input_ids"] == tok.encode(held_out())
    err = export_error(capsys, run, tmp_path / "gguf")
    assert "runs of up to two digits" in err and "prepare the data again" in err and "transformers" in err


def test_outtype_is_for_gguf_only() -> None:
    from accel_gpt.config import ExportConfig

    with pytest.raises(ConfigError, match="outtype=f16 is for --format gguf"):
        ExportConfig(checkpoint="r", out_dir="o", outtype="f16").validate()
