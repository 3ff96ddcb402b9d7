"""transformers interop: logits equal to GPT2LMHeadModel both ways, vocabulary padding, export round trip."""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import tiktoken
import torch
import torch.nn.functional as F
from conftest import python_cmd, run_cmd
from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, pipeline

from accel_gpt import hf
from accel_gpt.cli import main as cli_main
from accel_gpt.errors import UserError
from accel_gpt.export import export
from accel_gpt.model import GPT, GPTConfig
from accel_gpt.tokenizer import Tokenizer, gpt2_vocab_and_merges
from accel_gpt.weights import WEIGHTS, ModelCard, load_model, save_weights

TINY = dict(n_layer=2, n_head=2, n_embd=32, seq_len=16)
PADDED_VOCAB = 50_304
GPT2 = Tokenizer("gpt2")
TRICKY_TEXTS = [
    "Hello world",
    "  leading spaces,   runs of   spaces and a trailing space ",
    "line one\nline two\n\n\nafter blank lines\r\n\ttabbed",
    "digits 1234567890 3.14159 -42 1,000,000 2024-06-01",
    "unicode: naïve café 日本語 Ελληνικά 🤖🚀 emoji‍joiner ß ﬁ",
    "contractions: don't we'll they've I'M 'quoted'",
    "code: def f(x):\n    return x**2  # comment",
]


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Noise on every parameter: a fresh init has zero biases and unit norms, which would hide a missed key."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def tiny_hf(vocab_size: int = 96, **overrides) -> GPT2LMHeadModel:
    settings = dict(
        vocab_size=vocab_size,
        n_positions=TINY["seq_len"],
        n_embd=TINY["n_embd"],
        n_layer=TINY["n_layer"],
        n_head=TINY["n_head"],
        activation_function="gelu_new",
        layer_norm_epsilon=1e-3,  # not the default: a dropped eps would show in the logits
    )
    cfg = GPT2Config(**(settings | overrides))
    torch.manual_seed(0)
    return randomize(GPT2LMHeadModel(cfg))


def tiny_gpt(vocab_size: int = 96) -> GPT:
    torch.manual_seed(0)
    return randomize(GPT(GPTConfig(**TINY, vocab_size=vocab_size, layer_norm_eps=1e-3)), seed=1)


def ids(vocab_size: int, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, vocab_size, (2, TINY["seq_len"]), generator=torch.Generator().manual_seed(seed))


def save(model: GPT, out_dir: Path, tokenizer: Tokenizer = GPT2, step: int = 0) -> Path:
    """What a run writes beside its final weights (and in every checkpoint)."""
    save_weights(model.state_dict(), ModelCard(model.config, tokenizer, step), out_dir)
    return out_dir


@torch.no_grad()
def ours(model: GPT, x: torch.Tensor) -> torch.Tensor:
    return model(x)[0]


@torch.no_grad()
def theirs(model: GPT2LMHeadModel, x: torch.Tensor) -> torch.Tensor:
    return model(x).logits


# ---------------------------------------------------------------- conversion


def test_from_transformers_matches_gpt2_logits():
    src = tiny_hf()
    model = hf.from_transformers(src)
    assert not model.training
    assert model.config == GPTConfig(**TINY, vocab_size=96, layer_norm_eps=1e-3)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    x = ids(96)
    torch.testing.assert_close(ours(model, x), theirs(src, x), atol=1e-4, rtol=0)


def test_to_transformers_matches_our_logits():
    model = tiny_gpt()
    out = hf.to_transformers(model)
    assert not out.training
    assert out.config.activation_function == "gelu_new" and out.config.layer_norm_epsilon == 1e-3
    assert out.lm_head.weight.data_ptr() == out.transformer.wte.weight.data_ptr()
    x = ids(96)
    torch.testing.assert_close(theirs(out, x), ours(model, x), atol=1e-4, rtol=0)


def test_the_exact_gelu_leaves_and_comes_back_as_gpt2s_gelu():
    """`gelu: exact` (nanoGPT's erf GELU) is GPT2LMHeadModel's activation_function "gelu", both ways."""
    tanh = tiny_gpt()
    exact = GPT(replace(tanh.config, gelu="exact")).eval()
    exact.load_state_dict(tanh.state_dict())
    out = hf.to_transformers(exact)
    assert out.config.activation_function == "gelu"
    x = ids(96)
    torch.testing.assert_close(theirs(out, x), ours(exact, x), atol=1e-6, rtol=0)
    assert (ours(tanh, x) - ours(exact, x)).abs().max() > 2e-5  # the setting reaches the MLP
    back = hf.from_transformers(out)
    assert back.config == exact.config
    assert all(torch.equal(a, b) for a, b in zip(back.state_dict().values(), exact.state_dict().values(), strict=True))
    src = tiny_hf(activation_function="gelu")
    torch.testing.assert_close(ours(hf.from_transformers(src), x), theirs(src, x), atol=1e-6, rtol=0)


def test_round_trip_is_bit_exact():
    model = tiny_gpt()
    back = hf.from_transformers(hf.to_transformers(model))
    a, b = model.state_dict(), back.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_import_pads_vocab_with_mean_rows_and_bounded_loss_change():
    src = tiny_hf(vocab_size=100)
    model = hf.from_transformers(src, vocab_size=128)
    assert model.config.vocab_size == 128
    x = ids(100)
    padded, real = ours(model, x), theirs(src, x)
    torch.testing.assert_close(padded[..., :100], real, atol=1e-4, rtol=0)
    # a padded row is the mean embedding, so with the tied head its logit is the mean real logit
    mean_logit = real.mean(dim=-1, keepdim=True).expand(-1, -1, 28)
    torch.testing.assert_close(padded[..., 100:], mean_logit, atol=1e-5, rtol=0)
    loss_increase = real.log_softmax(-1) - padded.log_softmax(-1)[..., :100]
    assert loss_increase.min() > 0
    assert loss_increase.max() <= math.log(1 + 28 / 100) + 1e-6


def test_import_refuses_smaller_vocab_and_other_variants():
    with pytest.raises(UserError, match="vocab_size=64 is smaller"):
        hf.from_transformers(tiny_hf(vocab_size=96), vocab_size=64)
    with pytest.raises(UserError, match="activation_function='relu'"):
        hf.from_transformers(tiny_hf(activation_function="relu"))
    with pytest.raises(UserError, match="scale_attn_by_inverse_layer_idx"):
        hf.from_transformers(tiny_hf(scale_attn_by_inverse_layer_idx=True))


def test_load_transformers_folder_pads_and_errors_clearly(tmp_path):
    src = tiny_hf(vocab_size=100)
    folder = tmp_path / "gpt2-tiny"
    src.save_pretrained(folder)
    model = hf.load_transformers(str(folder), vocab_size=128)
    x = ids(100)
    torch.testing.assert_close(ours(model, x)[..., :100], theirs(src, x), atol=1e-4, rtol=0)
    via_weights, card = load_model(folder)  # --checkpoint on a transformers folder
    assert card.tokenizer == Tokenizer("gpt2") and card.tokenizer.to_dict() == {"name": "gpt2"}
    assert via_weights.config.vocab_size == 100 and card.model == via_weights.config

    (folder / "model.safetensors").write_bytes(b"\x00not a safetensors file")
    with pytest.raises(UserError, match="cannot load transformers model"):
        hf.load_transformers(str(folder))
    with pytest.raises(UserError, match=r"'no-such-org/no-such-model' is not a local folder \(no such path\), and as"):
        hf.load_transformers("no-such-org/no-such-model")  # HF_HUB_OFFLINE=1: not cached, not fetched
    other = tmp_path / "llama"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(UserError, match="expected a GPT-2 or NanoChat model .* got .llama."):
        hf.load_transformers(str(other))


class Payload:
    """Pickles as a call to os.mkdir(path): unpickling it with weights_only=False creates the folder."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def pickled_gpt2_folder(folder: Path, payload: Path | None = None) -> Path:
    """A transformers GPT-2 folder whose weights are `pytorch_model.bin` (the layout before safetensors); with
    `payload`, the pickle also holds an object whose unpickling would create that folder."""
    model = tiny_hf(vocab_size=100, bos_token_id=None, eos_token_id=None)
    model.save_pretrained(folder)
    (folder / "model.safetensors").unlink()
    state = dict(model.state_dict())
    if payload is not None:
        state["extra"] = Payload(payload)
    torch.save(state, folder / "pytorch_model.bin")
    return folder


def test_a_pickle_that_would_run_code_is_refused_as_unsafe(tmp_path):
    marker = tmp_path / "payload_ran"
    folder = pickled_gpt2_folder(tmp_path / "evil", marker)
    with pytest.raises(UserError) as err:
        load_model(folder)
    assert str(err.value).startswith(f"{folder / 'pytorch_model.bin'} holds something other than tensors (")
    assert str(err.value).endswith("refused as unsafe, since unpickling it could run arbitrary code")
    assert "weights_only=False" not in str(err.value) and not marker.exists()


def test_a_plain_pickled_folder_loads_and_other_pickles_are_not_opened(tmp_path):
    """Only the weights transformers reads are checked: a training_args.bin beside them is never unpickled."""
    folder = pickled_gpt2_folder(tmp_path / "plain")
    torch.save({"args": Payload(tmp_path / "payload_ran")}, folder / "training_args.bin")
    model, card = load_model(folder)
    assert model.config.vocab_size == 100 and card.tokenizer == GPT2 and not (tmp_path / "payload_ran").exists()


def test_a_mistyped_local_path_is_said_to_be_one(tmp_path, monkeypatch):
    (tmp_path / "runs" / "tiny-cpu").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError) as err:
        load_model("runs/tiny_cpu")
    assert str(err.value) == (
        "'runs/tiny_cpu' is not a local folder (no such path; did you mean runs/tiny-cpu?), and as a hub id: not in "
        "the local cache, and offline mode (HF_HUB_OFFLINE) keeps the hub from being asked"
    )  # offline, as every test runs: transformers' "couldn't connect" would say a connection was tried


def test_tokenizer_files_are_gpt2s_own():
    """Merges rebuilt from tiktoken's ranks reproduce GPT-2's published merge list (as far as it is checkable)."""
    vocab, merges = gpt2_vocab_and_merges()
    assert len(vocab) == 50_257 and len(merges) == 50_000
    assert vocab["!"] == 0 and vocab["Ġ"] == 220 and vocab["Ġthe"] == 262 and vocab["<|endoftext|>"] == 50_256
    assert merges[:3] == [("Ġ", "t"), ("Ġ", "a"), ("h", "e")]  # the first lines of GPT-2's vocab.bpe
    inverse = {v: k for k, v in vocab.items()}
    for i, (a, b) in enumerate(merges):
        assert a + b == inverse[256 + i], i  # merge i creates token 256 + i


# ---------------------------------------------------------------- export


def export_cmd(checkpoint: Path, out_dir: Path) -> list[str]:
    return python_cmd("export", "--checkpoint", str(checkpoint), "--out_dir", str(out_dir))


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[GPT, Path, Path]:
    """One export for the module, in this process: a tiny GPT with the padded 50,304 vocabulary."""
    root = tmp_path_factory.mktemp("export")
    model = tiny_gpt(vocab_size=PADDED_VOCAB)
    run_dir = save(model, root / "run", step=7)
    out = root / "hf"
    assert export(run_dir, out) == out
    return model, run_dir, out


@pytest.mark.slow
def test_export_command_writes_the_same_folder(exported, tmp_path):
    """`run.py export` in its own process names what it wrote, and writes what `export` wrote here."""
    _, run_dir, reference = exported
    out = tmp_path / "hf"
    proc = run_cmd(export_cmd(run_dir, out), timeout=120)
    assert str(out) in proc.stdout
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference.iterdir())
    for name in ("model.safetensors", "config.json", "vocab.json", "merges.txt"):
        assert (out / name).read_bytes() == (reference / name).read_bytes(), name


def test_export_command_in_process_names_the_folder(exported, tmp_path, capsys):
    _, run_dir, _ = exported
    out = tmp_path / "hf"
    cli_main(["export", "--checkpoint", str(run_dir), "--out_dir", str(out)])
    assert capsys.readouterr().out.strip() == (
        f"exported {run_dir} -> {out} (GPT2LMHeadModel + GPT-2 tokenizer, vocab 50257, model card)"
    )
    assert (out / "model.safetensors").is_file()


def test_export_writes_a_complete_gpt2_folder(exported):
    _, _, out = exported
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= names
    assert {"tokenizer_config.json", "vocab.json", "merges.txt"} <= names
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == 50_257 and config["n_positions"] == TINY["seq_len"]
    assert config["n_ctx"] == TINY["seq_len"]  # llama.cpp's convert_hf_to_gguf.py reads it, as in OpenAI's gpt2
    assert config["activation_function"] == "gelu_new" and config["layer_norm_epsilon"] == 1e-3
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 50_256
    assert not [p for p in out.parent.iterdir() if ".tmp-" in p.name]  # the staging folder is gone
    umask = os.umask(0)
    os.umask(umask)
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~umask  # readable like any file


def test_export_logits_match_and_padded_rows_are_dropped(exported):
    model, _, out = exported
    loaded = GPT2LMHeadModel.from_pretrained(out).eval()
    assert loaded.get_input_embeddings().weight.shape == (50_257, TINY["n_embd"])
    x = ids(50_257)
    torch.testing.assert_close(theirs(loaded, x), ours(model, x)[..., :50_257], atol=1e-4, rtol=0)


def test_a_run_scores_as_its_export_does(exported):
    """Loaded as `eval` loads it, the run leaves the 47 padded rows out of its loss, as the export has none; with
    them (a model that does not know its tokenizer) the loss is higher."""
    model, run_dir, out = exported
    run, _ = load_model(run_dir)
    loaded = GPT2LMHeadModel.from_pretrained(out).eval()
    x, y = ids(50_257), ids(50_257, seed=3)
    with torch.no_grad():
        theirs_loss = F.cross_entropy(loaded(x).logits.flatten(0, 1), y.flatten()).item()
        (_, ours_loss), (_, with_padding) = run(x, y), model(x, y)
    assert ours_loss.item() == pytest.approx(theirs_loss, abs=1e-6)
    assert with_padding.item() - ours_loss.item() > 1e-4


def test_export_reimports_with_padding(exported):
    """The init_from path on an export: padding back to 50,304 restores the real rows exactly."""
    model, _, out = exported
    back = hf.load_transformers(str(out), vocab_size=PADDED_VOCAB)
    assert back.config == model.config
    wte, orig = back.transformer.wte.weight, model.transformer.wte.weight
    assert torch.equal(wte[:50_257], orig[:50_257])
    torch.testing.assert_close(wte[50_257:], orig[:50_257].mean(0).expand(47, -1))


def test_exported_tokenizer_gives_tiktoken_ids(exported):
    _, _, out = exported
    tok = AutoTokenizer.from_pretrained(out)
    enc = tiktoken.get_encoding("gpt2")
    assert tok.eos_token_id == tok.bos_token_id == 50_256 and tok.model_max_length == TINY["seq_len"]
    for text in TRICKY_TEXTS:
        got = tok(text, add_special_tokens=True)["input_ids"]
        assert got == enc.encode_ordinary(text), text
        assert tok.decode(got) == text
    text = "end of one<|endoftext|>start of the next"
    # the special token's text is split like any other characters, as prepare encodes it (encode_ordinary) ...
    assert tok(text)["input_ids"] == enc.encode_ordinary(text) and 50_256 not in tok(text)["input_ids"]
    # ... and read as the special token only when asked (tiktoken with allowed_special)
    assert tok(text, split_special_tokens=False)["input_ids"] == enc.encode(text, allowed_special="all")


def test_exported_vocab_and_merges_alone_load_the_same_tokenizer(exported, tmp_path):
    """vocab.json + merges.txt are not decoration: without tokenizer.json they rebuild the same tokenizer."""
    _, _, out = exported
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json"):
        shutil.copy(out / name, tmp_path / name)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    enc = tiktoken.get_encoding("gpt2")
    for text in TRICKY_TEXTS:
        assert tok(text)["input_ids"] == enc.encode_ordinary(text), text


def test_exported_pipeline_generates_our_greedy_tokens(exported):
    model, _, out = exported
    prompt = "The quick brown fox"
    generate = pipeline("text-generation", model=str(out), device="cpu")
    result = generate(prompt, max_new_tokens=5, do_sample=False, return_tensors=True)
    got = [int(i) for i in result[0]["generated_token_ids"]]

    enc = tiktoken.get_encoding("gpt2")
    expected = enc.encode_ordinary(prompt)
    for _ in range(5):  # our model, greedy over the real vocabulary rows
        logits = ours(model, torch.tensor([expected]))[0, -1, :50_257]
        expected.append(int(logits.argmax()))
    assert got == expected
    text = generate(prompt, max_new_tokens=5, do_sample=False)[0]["generated_text"]
    assert text.startswith(prompt) and len(text) > len(prompt)


def one_line_error(stderr: str) -> str:
    lines = [line for line in stderr.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


def cli_export_error(checkpoint: Path, out: Path, capsys) -> str:
    """The CLI in-process (no interpreter start): exit code 2 and a one-line message."""
    with pytest.raises(SystemExit) as e:
        cli_main(["export", "--checkpoint", str(checkpoint), "--out_dir", str(out)])
    assert e.value.code == 2
    return one_line_error(capsys.readouterr().err)


def test_export_refuses_char_tokenizer(tmp_path, capsys):
    run_dir = tmp_path / "run"
    save(GPT(GPTConfig(**TINY, vocab_size=65)), run_dir, Tokenizer("char", "abc"), step=1)
    assert "'char' tokenizer" in cli_export_error(run_dir, tmp_path / "hf", capsys)
    assert not (tmp_path / "hf").exists()


def test_export_corrupt_or_missing_weights_error_clearly(tmp_path, capsys):
    run_dir = tmp_path / "run"
    save(tiny_gpt(vocab_size=PADDED_VOCAB), run_dir, step=1)
    weights = run_dir / WEIGHTS
    weights.write_bytes(weights.read_bytes()[:1000])  # truncated, as by a crash mid-copy
    assert "not a readable safetensors file" in cli_export_error(run_dir, tmp_path / "hf", capsys)
    weights.unlink()
    assert f"no {WEIGHTS}" in cli_export_error(run_dir, tmp_path / "hf", capsys)
    assert "not a run dir or checkpoint" in cli_export_error(tmp_path, tmp_path / "hf", capsys)
    assert not (tmp_path / "hf").exists()


def test_export_leaves_a_non_empty_out_dir_alone(exported, tmp_path, capsys):
    _, run_dir, _ = exported
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert "not an empty folder" in cli_export_error(run_dir, out, capsys)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_a_bias_free_dropout_model_exports_with_zero_biases_its_dropout_and_the_same_logits(tmp_path):
    """transformers' GPT-2 always has biases: a model trained without them loads with zero biases and gives the same
    logits; the run's dropout becomes GPT2Config's three pdrops (and both sides drop nothing in eval mode)."""
    torch.manual_seed(0)
    model = randomize(GPT(GPTConfig(**TINY, vocab_size=PADDED_VOCAB, bias=False, dropout=0.1)), seed=3)
    assert not any(name.endswith(".bias") for name, _ in model.named_parameters())
    out = export(save(model, tmp_path / "run", step=3), tmp_path / "hf")
    config = json.loads((out / "config.json").read_text())
    assert config["embd_pdrop"] == config["attn_pdrop"] == config["resid_pdrop"] == 0.1
    loaded = GPT2LMHeadModel.from_pretrained(out).eval()
    biases = {k: v for k, v in loaded.state_dict().items() if k.endswith(".bias")}
    assert len(biases) == 6 * TINY["n_layer"] + 1 and all(not v.any() for v in biases.values())
    x = ids(50_257)
    torch.testing.assert_close(theirs(loaded, x), ours(model, x)[..., :50_257], atol=1e-4, rtol=0)


def test_weights_of_other_shapes_than_the_config_are_one_line_without_a_report_to_look_for(tmp_path):
    """transformers' own error points at a load report that `quiet_transformers` keeps quiet: said in words instead."""
    folder = tmp_path / "tiny"
    tiny_hf().save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["n_embd"], config["n_head"] = 2 * config["n_embd"], 2 * config["n_head"]  # the weights stay the old width
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError) as said:
        hf.load_transformers(str(folder))
    assert str(said.value) == (
        f"cannot load transformers model '{folder}': its weights have other shapes than its config.json describes"
    )
