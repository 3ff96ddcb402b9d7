"""Sampling: seeded reproducibility, greedy decoding, top-k, cropping and the sliding window, the KV cache,
wrapped models, prompt encoding, the CLI."""

from __future__ import annotations

import math
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import REPO, accelerate_cmd, python_cmd, run_cmd, subprocess_env

from accel_gpt.cli import main as cli_main
from accel_gpt.cli import parse
from accel_gpt.errors import ConfigError, UserError
from accel_gpt.generate import context_warning, encode_prompt, generate, sample_ids, sample_texts, usable_device
from accel_gpt.generate import draw as gen_draw
from accel_gpt.model import GPT, GPTConfig, KVCache
from accel_gpt.tokenizer import Tokenizer
from accel_gpt.weights import MODEL_CONFIG, ModelCard, load_model, save_weights

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=64, vocab_size=50304)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("sample") / "tiny"
    save_weights(GPT(TINY).state_dict(), ModelCard(TINY, Tokenizer("gpt2"), step=0), path)
    return path


@pytest.fixture(scope="module")
def loaded(checkpoint: Path) -> tuple[GPT, Tokenizer]:
    model, card = load_model(checkpoint)
    assert card.model == TINY and card.tokenizer == Tokenizer("gpt2") and card.step == 0
    return model, card.tokenizer


def draw(loaded, seed: int, **kw) -> str:
    model, tokenizer = loaded
    args = {"prompt": "Once upon a time", "max_new_tokens": 12, "temperature": 1.0, "top_k": None, **kw}
    return sample_texts(model, TINY, tokenizer, seed=seed, device="cpu", **args)[0]


def test_same_seed_same_text_other_seed_differs(loaded) -> None:
    first = draw(loaded, seed=1)
    assert first.startswith("Once upon a time") and len(first) > len("Once upon a time")
    assert draw(loaded, seed=1) == first
    assert draw(loaded, seed=2) != first


def test_greedy_is_the_argmax_chain_and_ignores_the_seed(loaded) -> None:
    model, tokenizer = loaded
    idx = torch.tensor([tokenizer.encode("The king")])
    expected = idx
    with torch.no_grad():
        for _ in range(6):
            expected = torch.cat([expected, model(expected)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(generate(model, TINY, idx, 6, temperature=0.0), expected)
    assert draw(loaded, seed=1, temperature=0.0) == draw(loaded, seed=2, temperature=0.0)
    # top-k = 1 leaves only the most likely token, whatever the temperature
    assert draw(loaded, seed=3, top_k=1) == draw(loaded, seed=4, temperature=0.0)


def test_a_draw_follows_the_softmax_of_the_top_k_and_never_leaves_them() -> None:
    """20,000 rows drawn at once: with top_k 3 each id of the 3 largest logits comes up as often as their renormalised
    softmax says (within 0.015) and no other id ever does; with top_k 0, or one past the vocabulary, all 6 do."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0, 1.5, -3.0]]).expand(20_000, 6)
    for top_k, kept in ((3, [1, 3, 4]), (0, list(range(6))), (7, list(range(6)))):
        ids = gen_draw(logits, top_k, torch.Generator().manual_seed(0))
        assert ids.shape == (20_000, 1)
        freq = torch.bincount(ids[:, 0], minlength=6).double() / 20_000
        expected = torch.zeros(6, dtype=torch.float64)
        expected[kept] = torch.softmax(logits[0, kept].double(), dim=0)
        torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)
        assert all(freq[i] == 0 for i in range(6) if i not in kept)


def test_a_temperature_too_small_for_fp32_is_greedy(loaded) -> None:
    """1e-300 is 0 in fp32: dividing by it made NaN probabilities and a traceback; now it draws the greedy chain."""
    greedy = draw(loaded, seed=1, temperature=0.0)
    assert draw(loaded, seed=5, temperature=1e-300) == draw(loaded, seed=6, temperature=5e-324) == greedy


def test_long_prompt_is_cropped_from_the_left_and_the_window_slides(loaded) -> None:
    model, _ = loaded
    prompt = torch.randint(0, 50257, (1, 70), generator=torch.Generator().manual_seed(0))
    out = generate(model, TINY, prompt, max_new_tokens=10, temperature=0.0)  # 80 tokens: past seq_len=64
    assert out.shape == (1, 80) and torch.equal(out[:, :70], prompt)
    cropped = generate(model, TINY, prompt[:, -TINY.seq_len :], max_new_tokens=10, temperature=0.0)
    assert torch.equal(out[:, 70:], cropped[:, TINY.seq_len :])  # only the last seq_len tokens mattered


def test_cached_forward_gives_the_full_forward_logits(loaded) -> None:
    """Prefill, a 3-token chunk after it (the causal mask over cached + new), then one token at a time."""
    model, _ = loaded
    idx = torch.randint(0, 50257, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full, _ = model(idx)
        cache = KVCache(TINY.n_layer, TINY.seq_len)
        parts = [model(idx[:, :10], cache=cache)[0], model(idx[:, 10:13], cache=cache)[0]]
        parts += [model(idx[:, t : t + 1], cache=cache)[0] for t in range(13, 20)]
    assert cache.length == 20
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="exceeds the model's seq_len"):
        model(torch.zeros(2, TINY.seq_len - 19, dtype=torch.long), cache=cache)


def test_generation_with_and_without_cache_agree(loaded) -> None:
    """Greedy tokens are the same, also once the sequence outgrows the context and the window slides."""
    model, _ = loaded
    prompt = torch.randint(0, 50257, (2, 50), generator=torch.Generator().manual_seed(2))
    cached = generate(model, TINY, prompt, max_new_tokens=24, temperature=0.0)  # 74 tokens: past seq_len=64
    assert torch.equal(cached, generate(model, TINY, prompt, max_new_tokens=24, temperature=0.0, use_cache=False))
    seeded = [
        generate(model, TINY, prompt, 8, generator=torch.Generator().manual_seed(3), use_cache=c) for c in (True, False)
    ]
    assert torch.equal(*seeded)


def test_cache_takes_the_autocast_dtype(loaded) -> None:
    model, _ = loaded
    cache = KVCache(TINY.n_layer, TINY.seq_len)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = model(torch.zeros(1, 4, dtype=torch.long), cache=cache)
        logits, _ = model(torch.zeros(1, 1, dtype=torch.long), cache=cache)
    assert logits.dtype == torch.bfloat16 and cache.length == 5
    assert all(k.dtype == torch.bfloat16 and k.shape == (1, TINY.n_head, TINY.seq_len, 16) for k, _ in cache._layers)


def test_mode_is_restored_and_bad_arguments_are_user_errors(loaded) -> None:
    model, tokenizer = loaded
    model.train()
    draw(loaded, seed=0, max_new_tokens=1)
    assert model.training
    model.eval()
    assert draw(loaded, seed=0, prompt="", max_new_tokens=0) == ""  # it starts at end-of-text, which is no text
    with pytest.raises(UserError, match="temperature must be >= 0"):
        draw(loaded, seed=0, temperature=-1.0)
    with pytest.raises(UserError, match="top_k must be >= 0"):
        draw(loaded, seed=0, top_k=-5)


class Wrapped(torch.nn.Module):
    """Stands in for DDP / FSDP / torch.compile: forwards calls, and has no `.config` of its own."""

    def __init__(self, module: GPT) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def test_a_wrapped_model_samples_the_same_text(loaded) -> None:
    """The config is passed in, so a prepared (wrapped) model needs no unwrapping by the caller."""
    model, tokenizer = loaded
    wrapped = Wrapped(model)
    assert not hasattr(wrapped, "config")
    args = ("Once upon a time", 12, 1.0, 50)
    assert sample_texts(wrapped, TINY, tokenizer, *args, seed=5, device="cpu") == sample_texts(
        model, TINY, tokenizer, *args, seed=5, device="cpu"
    )


def test_prompt_encoding_errors_are_user_errors() -> None:
    chars = Tokenizer("char", "\n !abcdefghijklmnopqrstuvwxyz")
    assert encode_prompt(chars, "hi!") == [10, 11, 2]
    assert encode_prompt(Tokenizer("gpt2"), "") == [50256]
    with pytest.raises(UserError, match="cannot encode the prompt: character 'H' is not in this char vocabulary"):
        encode_prompt(chars, "Hi")
    with pytest.raises(UserError, match="the prompt is empty and this tokenizer has no end-of-text token"):
        encode_prompt(chars, "")


def test_an_empty_prompts_start_token_is_not_printed(checkpoint: Path, loaded) -> None:
    """An empty prompt starts from end-of-text, where a document begins: the sample is what follows it, with no
    literal `<|endoftext|>` in front."""
    args = ["--prompt", "", "--max_new_tokens", "6", "--seed", "3", "--device", "cpu", "--stop_at_eot", "false"]
    proc = run_cmd(python_cmd("sample", "--checkpoint", str(checkpoint), *args))
    model, tokenizer = loaded
    (ids,) = sample_ids(model, TINY, tokenizer, "", 6, 1.0, 50, 3, "cpu", stop_at_eot=False)
    assert ids[0] == 50256 and proc.stdout == tokenizer.decode(ids[1:]) + "\n"
    assert not proc.stdout.startswith("<|endoftext|>")


@pytest.mark.slow
def test_ctrl_c_while_sampling_is_one_line(checkpoint: Path) -> None:
    """Ctrl-C where no stop handler runs (sampling here; start-up, eval and compare alike): one line and exit code
    130, no traceback. The sample is long enough to be running whenever the signal comes (and one that came during
    start-up would end the same way)."""
    args = ["--max_new_tokens", "1000000", "--device", "cpu"]
    proc = subprocess.Popen(
        python_cmd("sample", "--checkpoint", str(checkpoint), *args),
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a terminal's command takes Ctrl-C, where
    )  # fmt: skip (a test runner started in the background has it ignored, and a child inherits that)
    time.sleep(3)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and out == "" and err.strip().splitlines() == ["interrupted (Ctrl-C)"], err


def test_device_is_checked_before_the_model_loads() -> None:
    assert usable_device("cpu") == torch.device("cpu")
    with pytest.raises(UserError, match="^--device 'gpu0' is not a device name"):
        usable_device("gpu0")
    with pytest.raises(UserError, match="^--device meta holds no weights"):
        usable_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="^--device cuda cannot be used here: "):
            usable_device("cuda")


def test_truncated_model_config_is_one_line(checkpoint: Path, tmp_path: Path) -> None:
    shutil.copytree(checkpoint, tmp_path / "ckpt")
    config = tmp_path / "ckpt" / MODEL_CONFIG
    config.write_text(config.read_text()[:40])
    with pytest.raises(UserError) as err:
        load_model(tmp_path / "ckpt")
    assert str(err.value).startswith(f"{config} is not a readable accel_gpt model config (JSONDecodeError: ")
    assert "\n" not in str(err.value)


def test_non_finite_temperature_is_refused_by_the_config() -> None:
    for value in ("nan", "inf", "-inf"):  # `=` keeps argparse from taking -inf for a flag
        with pytest.raises(ConfigError, match=f"^temperature={value} must be a finite number$"):
            parse(["sample", "--checkpoint", "x", f"--temperature={value}"])


@pytest.mark.slow
def test_cli_prints_the_seeded_samples(checkpoint: Path, loaded) -> None:
    """Reproducible across processes: the CLI prints what the same seed gives in this process; under a launch of 2
    processes, rank 0 alone samples."""
    args = ["--prompt", "Hello there", "--max_new_tokens", "10", "--seed", "7", "--top_k", "20", "--device", "cpu"]
    proc = run_cmd(python_cmd("sample", "--checkpoint", str(checkpoint), *args, "--num_samples", "2"))
    model, tokenizer = loaded
    texts = sample_texts(model, TINY, tokenizer, "Hello there", 10, 1.0, 20, seed=7, device="cpu", num_samples=2)
    assert texts[0] != texts[1]  # two draws from one generator, not one draw twice
    expected = f"{texts[0]}\n{'-' * 40}\n{texts[1]}\n"
    assert proc.stdout == expected.replace("\r\n", "\n").replace("\r", "\n")  # text-mode pipes translate \r
    launched = run_cmd(accelerate_cmd(2, "sample", "--checkpoint", str(checkpoint), *args, "--num_samples", "2"))
    assert launched.stdout == proc.stdout  # once, not once per rank run together
    assert "note: sample runs on rank 0 only; the other process exits" in launched.stderr


# ------------------------------------------------------------------------------ end-of-text and the window

EOT = 50256


def eot_model(eot_logit: float) -> GPT:
    """A model whose next-token logits are the same at every position: 0 for every token but end-of-text, which gets
    `eot_logit` (ln_f's weight is 0, so its output is its bias, e_0; the head's column 0 is the only one it reads)."""
    torch.manual_seed(0)
    model = GPT(TINY).eval()
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.zero_()
        model.transformer.ln_f.bias[0] = 1.0
        model.transformer.wte.weight[:, 0] = 0.0
        model.transformer.wte.weight[EOT, 0] = eot_logit
    return model


def test_samples_stop_at_end_of_text_and_are_the_unstopped_text_cut_there() -> None:
    """End-of-text with probability 0.2 per token: each stopped sample is the sample drawn without stopping, up to
    its first end-of-text (the finished rows keep drawing, so the others' draws do not change)."""
    model, tok = eot_model(math.log(0.25 * (TINY.vocab_size - 1))), Tokenizer("gpt2")
    args = (model, TINY, tok, "Once", 30, 1.0, None, 11, "cpu", 6)
    full = sample_ids(*args, stop_at_eot=False)
    stopped = sample_ids(*args)
    assert sum(EOT in row[1:] for row in full) >= 4  # the test has rows that meet end-of-text to stop at
    prompt = tok.encode("Once")
    for whole, cut in zip(full, stopped, strict=True):
        new = whole[len(prompt) :]
        assert cut == (whole[: len(prompt) + new.index(EOT) + 1] if EOT in new else whole)
    texts = sample_texts(*args)
    assert texts == [tok.decode(row[:-1] if row[-1] == EOT and len(row) > len(prompt) else row) for row in stopped]
    assert all("<|endoftext|>" not in text for text in texts)
    assert any("<|endoftext|>" in text for text in sample_texts(*args, stop_at_eot=False))
    # all rows done: the loop ends early; run to the end, the same texts
    assert sample_texts(*args, stop_early=False) == texts
    assert len(generate(model, TINY, torch.tensor([prompt] * 6), 30, 1.0, None,
                        torch.Generator().manual_seed(11), stop_token=EOT).tolist()[0]) < len(prompt) + 30  # fmt: skip


def test_sample_command_stops_at_end_of_text_unless_told_to_go_on(tmp_path: Path, capsys) -> None:
    path = tmp_path / "eot"
    model = eot_model(30.0)  # end-of-text is the greedy choice at every step
    save_weights(model.state_dict(), ModelCard(TINY, Tokenizer("gpt2"), step=0), path)
    argv = ["sample", "--checkpoint", str(path), "--prompt", "Hello", "--temperature", "0", "--device", "cpu"]
    cli_main([*argv, "--max_new_tokens", "5"])
    out, err = capsys.readouterr()
    assert out == "Hello\n"
    assert err.splitlines() == [
        "note: sample stopped at end-of-text (a document's end) after 0 of 5 new tokens; --stop_at_eot false writes on "
        "past it"
    ]
    cli_main([*argv, "--max_new_tokens", "5", "--stop_at_eot", "false"])
    out, err = capsys.readouterr()
    assert out == "Hello" + "<|endoftext|>" * 5 + "\n" and err == ""


def test_sample_piped_into_a_reader_that_stops_ends_quietly(checkpoint: Path) -> None:
    """`run.py sample ... | head -3`: the reader goes away after 3 lines; the sample ends without a BrokenPipeError
    traceback, as a process that SIGPIPE ended (141)."""
    args = ["--max_new_tokens", "60", "--num_samples", "400", "--device", "cpu", "--stop_at_eot", "false"]
    proc = subprocess.Popen(
        python_cmd("sample", "--checkpoint", str(checkpoint), *args),
        cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    head = [proc.stdout.readline() for _ in range(3)]
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.wait(timeout=120)
    assert all(head) and proc.returncode == 141 and "Traceback" not in err and "Error" not in err, err


def test_sample_command_warns_once_when_it_outgrows_the_window(checkpoint: Path, capsys) -> None:
    argv = ["sample", "--checkpoint", str(checkpoint), "--prompt", "Hello there", "--device", "cpu"]
    cli_main([*argv, "--max_new_tokens", "63", "--stop_at_eot", "false"])  # 2 + 63 tokens: the last read 64
    assert capsys.readouterr().err == ""
    cli_main([*argv, "--max_new_tokens", "70", "--stop_at_eot", "false", "--num_samples", "2"])
    assert capsys.readouterr().err.splitlines() == [
        "warning: the samples outgrew the model's 64-token context (prompt 2 tokens + 70 new): past it, each new "
        "token was predicted from the 64 tokens before it"
    ]
    assert context_warning([[1] * 80], 70, 64).startswith("warning: the prompt has 70 tokens, more than the model's")
    assert context_warning([[1] * 70], 70, 64) is None  # nothing generated: the model read nothing


def test_training_samples_stop_at_end_of_text(monkeypatch) -> None:
    """The Evaluator's sample (every rank, all sample_tokens forward passes) is cut where the model wrote it."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from accel_gpt.config import TrainConfig
    from accel_gpt.evaluate.evaluator import Evaluator

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    cfg = TrainConfig(data_dir="unused", eval_every=0, sample_tokens=6, sample_prompt="Hello", seed=3)
    try:
        evaluator = Evaluator(cfg, Accelerator(cpu=True), eot_model(30.0), ModelCard(TINY, Tokenizer("gpt2")), [])
        assert evaluator._sample(1) == "Hello"
        overflowing = Evaluator(cfg, Accelerator(cpu=True), eot_model(float("inf")), evaluator.card, [])
        with pytest.raises(UserError) as said:  # weights whose logits overflow stop the run as a divergence does
            overflowing._sample(3)
        assert str(said.value).startswith(
            "training diverged by step 3: its weights give non-finite logits (the sample at step 3), so it stopped "
            "without saving them; no checkpoint was saved before it: train again with a lower --learning_rate"
        )
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def test_sample_command_shows_a_progress_bar_in_a_terminal_only(checkpoint: Path) -> None:
    """A long sample on a CPU takes minutes: in a terminal, stderr shows the tokens drawn so far (tqdm, cleared at
    the end); into a pipe or file, nothing (tests and scripts read a clean stderr)."""
    import fcntl
    import os
    import pty
    import struct
    import termios

    argv = ["sample", "--checkpoint", str(checkpoint), "--prompt", "Hello", "--device", "cpu"]
    argv += ["--max_new_tokens", "40", "--stop_at_eot", "false"]
    main, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty is 0 columns wide
    shown = bytearray()

    def read_terminal() -> None:  # while the sample runs: Linux drops what is unread once the terminal closes
        while True:
            try:
                chunk = os.read(main, 4096)
            except OSError:  # EIO: the terminal's other end is closed
                return
            if not chunk:
                return
            shown.extend(chunk)

    reader = threading.Thread(target=read_terminal)
    reader.start()
    proc = subprocess.run(python_cmd(*argv), cwd=REPO, env=subprocess_env(), stdout=subprocess.PIPE, stderr=terminal)
    os.close(terminal)
    reader.join(timeout=30)
    os.close(main)
    assert proc.returncode == 0 and proc.stdout.startswith(b"Hello")
    assert b"sample:" in shown and b"/40" in shown, shown
    piped = run_cmd(python_cmd(*argv))
    assert piped.stderr == "" and piped.stdout.encode() == proc.stdout
