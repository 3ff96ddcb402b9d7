"""Sampling: seeded reproducibility, greedy decoding, top-k, cropping and the sliding window, the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import python_cmd, run_cmd

from accel_gpt.artifacts import load_model, save_model
from accel_gpt.errors import UserError
from accel_gpt.model import GPT, GPTConfig
from accel_gpt.sample import generate, sample_text, sample_texts
from accel_gpt.tokenizer import GPT2Tokenizer

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=64, vocab_size=50304)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("sample") / "tiny"
    save_model(GPT(TINY), path, {"name": "gpt2"}, step=0)
    return path


@pytest.fixture(scope="module")
def loaded(checkpoint: Path) -> tuple[GPT, GPT2Tokenizer]:
    model, tokenizer, _ = load_model(checkpoint)
    return model, tokenizer


def draw(loaded, seed: int, **kw) -> str:
    model, tokenizer = loaded
    args = {"prompt": "Once upon a time", "max_new_tokens": 12, "temperature": 1.0, "top_k": None, **kw}
    return sample_text(model, tokenizer, seed=seed, device="cpu", **args)


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
    assert torch.equal(generate(model, idx, 6, temperature=0.0), expected)
    assert draw(loaded, seed=1, temperature=0.0) == draw(loaded, seed=2, temperature=0.0)
    # top-k = 1 leaves only the most likely token, whatever the temperature
    assert draw(loaded, seed=3, top_k=1) == draw(loaded, seed=4, temperature=0.0)


def test_long_prompt_is_cropped_from_the_left_and_the_window_slides(loaded) -> None:
    model, _ = loaded
    prompt = torch.randint(0, 50257, (1, 70), generator=torch.Generator().manual_seed(0))
    out = generate(model, prompt, max_new_tokens=10, temperature=0.0)  # 80 tokens: past seq_len=64
    assert out.shape == (1, 80) and torch.equal(out[:, :70], prompt)
    cropped = generate(model, prompt[:, -TINY.seq_len :], max_new_tokens=10, temperature=0.0)
    assert torch.equal(out[:, 70:], cropped[:, TINY.seq_len :])  # only the last seq_len tokens mattered


def test_mode_is_restored_and_bad_arguments_are_user_errors(loaded) -> None:
    model, tokenizer = loaded
    model.train()
    draw(loaded, seed=0, max_new_tokens=1)
    assert model.training
    model.eval()
    assert draw(loaded, seed=0, prompt="", max_new_tokens=0) == "<|endoftext|>"  # where a document starts
    with pytest.raises(UserError, match="temperature must be >= 0"):
        draw(loaded, seed=0, temperature=-1.0)
    with pytest.raises(UserError, match="top_k must be >= 0"):
        draw(loaded, seed=0, top_k=-5)


def test_cli_prints_the_seeded_samples(checkpoint: Path, loaded) -> None:
    """Reproducible across processes: the CLI prints what the same seed gives in this process."""
    args = ["--prompt", "Hello there", "--max_new_tokens", "10", "--seed", "7", "--top_k", "20", "--device", "cpu"]
    proc = run_cmd(python_cmd("sample", "--checkpoint", str(checkpoint), *args, "--num_samples", "2"))
    model, tokenizer = loaded
    texts = sample_texts(model, tokenizer, "Hello there", 10, 1.0, 20, seed=7, device="cpu", num_samples=2)
    assert texts[0] != texts[1]  # two draws from one generator, not one draw twice
    expected = f"{texts[0]}\n{'-' * 40}\n{texts[1]}\n"
    assert proc.stdout == expected.replace("\r\n", "\n").replace("\r", "\n")  # text-mode pipes translate \r
