"""Bad input to `train`: one clear line, non-zero exit, no traceback, nothing written."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import python_cmd, run_cmd, write_token_shards

from accel_gpt.cli import main
from accel_gpt.data.shards import tokenizer_fields, write_manifest
from accel_gpt.tokenizer import Tokenizer

VOCAB = 512
TINY = ["--n_layer", "1", "--n_head", "2", "--n_embd", "16", "--seq_len", "16", "--vocab_size", str(VOCAB)]
TINY += ["--micro_batch_size", "2", "--total_batch_size", "32", "--max_steps", "2", "--log_with", "none"]


def small_vocab_shards(data_dir: Path, train: list[int], val: list[int] | None = None) -> Path:
    """Shards of ids below VOCAB whose manifest names a tokenizer of exactly VOCAB ids (a manifest's vocab_size
    must be its tokenizer's): a char vocabulary of VOCAB characters, whatever they are."""
    write_token_shards(data_dir, train, val, vocab_size=VOCAB)
    manifest = json.loads((data_dir / "manifest.json").read_text())
    write_manifest(data_dir, manifest | tokenizer_fields(Tokenizer("char", "".join(map(chr, range(VOCAB))))))
    return data_dir


@pytest.fixture(autouse=True)
def no_process_state_left(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`train` runs in this process and builds its Accelerator before reading the data: drop that state
    afterwards (other tests start from none) and leave glibc's malloc settings, a training-speed tweak, alone."""
    from accelerate.state import AcceleratorState

    monkeypatch.setattr("accel_gpt.runtime.keep_freed_memory", lambda: False)
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_vocab_shards(tmp_path_factory.mktemp("d") / "data", list(range(500)), list(range(100)))


def _fails(capsys: pytest.CaptureFixture, out: Path, *args: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(["train", *args, "--out_dir", str(out)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert not out.exists(), "a failed run must not write its out_dir"
    return err


def test_unknown_key(capsys: pytest.CaptureFixture, tmp_path: Path, data: Path) -> None:
    err = _fails(capsys, tmp_path / "o", *TINY, "--data_dir", str(data), "--warmup_step", "3")
    assert "warmup_step" in err and "warmup_steps" in err


def test_unknown_key_in_yaml(capsys: pytest.CaptureFixture, tmp_path: Path, data: Path) -> None:
    (tmp_path / "c.yaml").write_text("n_embed: 64\n")
    err = _fails(capsys, tmp_path / "o", "--config", str(tmp_path / "c.yaml"), *TINY, "--data_dir", str(data))
    assert "n_embed" in err and "n_embd" in err


def test_heads_must_divide_width(capsys: pytest.CaptureFixture, tmp_path: Path, data: Path) -> None:
    err = _fails(capsys, tmp_path / "o", *TINY, "--data_dir", str(data), "--n_head", "3")
    assert "n_embd=16 must be divisible by n_head=3" in err


def test_indivisible_batch(capsys: pytest.CaptureFixture, tmp_path: Path, data: Path) -> None:
    err = _fails(capsys, tmp_path / "o", *TINY, "--data_dir", str(data), "--total_batch_size", "40")
    assert "total_batch_size=40" in err and "micro_batch_size*seq_len=32" in err


def test_missing_data_dir(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    assert "data_dir is required" in _fails(capsys, tmp_path / "o", *TINY)
    err = _fails(capsys, tmp_path / "o", *TINY, "--data_dir", str(tmp_path / "nope"))
    assert "does not exist" in err and "did you mean" not in err


def test_a_misspelt_data_dir_names_the_prepared_folder_beside_it(
    capsys: pytest.CaptureFixture, tmp_path: Path, data: Path
) -> None:
    shutil.copytree(data, tmp_path / "shakespeare-char")
    (tmp_path / "shakespeare").mkdir()  # close too, but nothing prepared in it
    typo, meant = tmp_path / "shakespeare_char", tmp_path / "shakespeare-char"
    err = _fails(capsys, tmp_path / "o", *TINY, "--data_dir", str(typo))
    assert err.startswith(f"error: data_dir '{typo}' does not exist; did you mean {meant}? If not, write it with"), err


def test_missing_manifest(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    err = _fails(capsys, tmp_path / "o", *TINY, "--data_dir", str(tmp_path / "empty"))
    assert "no manifest.json" in err and "prepare --dataset SRC --out_dir" in err and "prepare --preset NAME" in err


def test_vocab_larger_than_model(capsys: pytest.CaptureFixture, tmp_path: Path, data: Path) -> None:
    err = _fails(capsys, tmp_path / "o", *TINY, "--data_dir", str(data), "--vocab_size", "256")
    assert "vocabulary of 512 tokens" in err and "vocab_size is 256" in err


def test_dtype_mismatch_and_truncated_shard(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    bad = small_vocab_shards(tmp_path / "bad", list(range(500)))
    manifest = json.loads((bad / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps({**manifest, "dtype": "uint32"}))
    assert "dtype uint32 does not fit vocab_size 512" in _fails(capsys, tmp_path / "o", *TINY, "--data_dir", str(bad))
    (bad / "manifest.json").write_text(json.dumps(manifest))
    shard = bad / "train_000000.bin"
    shard.write_bytes(shard.read_bytes()[:-10])
    assert "truncated" in _fails(capsys, tmp_path / "o", *TINY, "--data_dir", str(bad))


@pytest.mark.slow
def test_cli_exit_has_no_traceback(tmp_path: Path) -> None:
    proc = run_cmd(python_cmd("train", *TINY, "--data_dir", str(tmp_path / "nope")), check=False, timeout=120)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: data_dir")


def test_token_id_beyond_the_model_vocabulary(capsys: pytest.CaptureFixture, tmp_path: Path) -> None:
    """Shards that agree with their manifest (sizes, checksums) but hold an id the embedding has no row for."""
    bad = small_vocab_shards(tmp_path / "bad", [*range(500), 700, *range(100)])
    err = _fails(capsys, tmp_path / "o", *TINY, "--data_dir", str(bad))
    assert "hold token id 700" in err and "vocab_size is 512" in err
    manifest = json.loads((bad / "manifest.json").read_text())
    write_manifest(bad, manifest | tokenizer_fields(Tokenizer("char", "".join(map(chr, range(600))))))
    err = _fails(capsys, tmp_path / "o", *TINY, "--vocab_size", "1024", "--data_dir", str(bad))
    assert "hold token id 700, which their tokenizer (char, 600 ids) does not have: prepare the data again" in err


def test_a_run_that_stopped_before_its_first_step_does_not_block_its_own_command(
    capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """Bad data found after the run claimed its folder (an id beyond the manifest's vocabulary, read at step 1)
    leaves config.yaml; once the data is fixed, the same command trains (before: "holds another run")."""
    data, out = tmp_path / "data", tmp_path / "o"
    small_vocab_shards(data, [700 if i % 8 == 5 else i % 500 for i in range(600)])
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["splits"]["train"][0]["max_id"] = 499
    (data / "manifest.json").write_text(json.dumps(manifest))
    command = ["train", *TINY, "--data_dir", str(data), "--out_dir", str(out), "--eval_every", "0"]
    with pytest.raises(SystemExit):
        main(command)
    assert (out / "config.yaml").is_file() and not (out / "model.safetensors").exists()
    shutil.rmtree(data)
    small_vocab_shards(data, [i % 500 for i in range(600)])  # the data fixed
    capsys.readouterr()
    with caplog.at_level("INFO"):
        main(command)
    assert "a run that stopped before its first step: removed the earlier run's config.yaml" in caplog.text
    assert (out / "model.safetensors").is_file()


def test_a_config_yaml_of_the_users_is_not_taken_for_a_run_that_stopped(
    capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    """A folder holding a run's config.yaml and nothing else (a recipe copied there, no launch report) is not a run
    this trainer stopped: it is refused as another run, and the file stays."""
    data, out = small_vocab_shards(tmp_path / "data", [i % 500 for i in range(600)]), tmp_path / "o"
    command = ["train", *TINY, "--data_dir", str(data), "--out_dir", str(out), "--eval_every", "0"]
    main(command)
    recipe = tmp_path / "recipe"
    recipe.mkdir()
    shutil.copy(out / "config.yaml", recipe / "config.yaml")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main([*command[:-4], "--out_dir", str(recipe)])
    assert "holds another run (config.yaml)" in capsys.readouterr().err
    assert (recipe / "config.yaml").read_text() == (out / "config.yaml").read_text()


def test_token_id_beyond_what_the_manifest_says_is_named_with_its_shard(
    capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    """A foreign or hand-made shard whose manifest understates its ids (its max_id record says 499): the start-up
    check trusts the record, so the id is found where the window holding it is read, at step 1: one line naming the
    shard, the id and its position (before: a raw IndexError, a device-side assert on a GPU)."""
    bad = small_vocab_shards(tmp_path / "bad", [700 if i % 8 == 5 else i % 500 for i in range(600)])  # every window
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["splits"]["train"][0]["max_id"] = 499
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SystemExit) as exc:
        main(["train", *TINY, "--data_dir", str(bad), "--out_dir", str(tmp_path / "o"), "--eval_every", "0"])
    assert exc.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    position = re.fullmatch(
        f"error: shard {re.escape(str(bad / 'train_000000.bin'))} holds token id 700 at position (\\d+), but its "
        f"manifest's vocabulary has {VOCAB} ids \\(0..{VOCAB - 1}\\): the shard is not what manifest.json describes; "
        "prepare the data again",
        line,
    )
    assert position is not None and int(position.group(1)) % 8 == 5, line


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--grad_clip", "nan"], "grad_clip=nan must be a finite number"),
        (["--learning_rate", "inf"], "learning_rate=inf must be a finite number"),
        (["--learning_rate", "nan"], "learning_rate=nan must be a finite number"),
        (["--weight_decay", "nan"], "weight_decay=nan must be a finite number"),
        (["--weight_decay", "inf"], "weight_decay=inf must be a finite number"),
        (["--beta1", "1.5"], "beta1=1.5 must be in [0, 1)"),
        (["--seed=-1"], "seed=-1 must be in [0, 2147483647]"),
        (["--eval_windows", "0", "--eval_every", "2"], "eval_windows=0 leaves nothing to evaluate"),
        (["--eval_steps", "0", "--eval_every", "2"], "eval_windows=0 leaves nothing to evaluate"),
        (["--eval_windows", "7", "--eval_steps", "2"], "eval_steps=2 (x batch 2 = 4 windows) and eval_windows=7"),
        (["--keep_best", "true", "--eval_every", "0"], "keep_best=true ranks checkpoints by their validation loss"),
        (["--final_weights", "best", "--eval_every", "0"], "final_weights=best ranks checkpoints by their valid"),
        (["--final_weights", "best", "--save_every", "0"], "final_weights=best takes the best evaluated checkpoint"),
        (["--final_weights", "first"], "final_weights='first' is not one of last, best"),
    ],
)
def test_invalid_optimization_settings(
    capsys: pytest.CaptureFixture, tmp_path: Path, data: Path, flags: list[str], expected: str
) -> None:
    """Values that trained to NaN weights with exit 0, or crashed in torch mid-run, are refused up front."""
    assert expected in _fails(capsys, tmp_path / "o", *TINY, "--data_dir", str(data), *flags)


def test_unencodable_sample_prompt(capsys: pytest.CaptureFixture, tmp_path: Path, data: Path) -> None:
    """Checked at start-up, not at the first evaluation after minutes of training."""
    flags = ["--eval_every", "1", "--eval_steps", "1", "--sample_tokens", "4", "--sample_prompt", "\u20acuro"]
    err = _fails(capsys, tmp_path / "o", *TINY, "--data_dir", str(data), *flags)
    assert "cannot encode the prompt: character '\u20ac' is not in this char vocabulary" in err


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("dtype", "bogus", "dtype must be uint16 or uint32, got 'bogus'"),
        ("vocab_size", "50257", "vocab_size must be a positive integer, got '50257'"),
        ("splits", [], "splits must map split names to lists of shards, got []"),
    ],
)
def test_manifest_fields_of_the_wrong_type(
    capsys: pytest.CaptureFixture, tmp_path: Path, data: Path, field: str, value: object, expected: str
) -> None:
    bad = tmp_path / "bad"
    bad.mkdir()
    manifest = json.loads((data / "manifest.json").read_text())
    (bad / "manifest.json").write_text(json.dumps({**manifest, field: value}))
    err = _fails(capsys, tmp_path / "o", *TINY, "--data_dir", str(bad))
    assert f"{bad / 'manifest.json'}: {expected}; prepare the data again into a new --out_dir" in err


def test_yaml_that_is_not_utf8(capsys: pytest.CaptureFixture, tmp_path: Path, data: Path) -> None:
    (tmp_path / "latin1.yaml").write_bytes("sample_prompt: caf\u00e9\n".encode("latin-1"))
    err = _fails(capsys, tmp_path / "o", "--config", str(tmp_path / "latin1.yaml"), *TINY, "--data_dir", str(data))
    assert f"{tmp_path / 'latin1.yaml'} is not valid UTF-8 YAML: 'utf-8' codec can't decode byte 0xe9" in err


@pytest.mark.parametrize(
    ("log_with", "expected"), [("tb", "did you mean tensorboard?"), ("bogus", "tensorboard, wandb")]
)
def test_unknown_tracker(
    capsys: pytest.CaptureFixture, tmp_path: Path, data: Path, log_with: str, expected: str
) -> None:
    err = _fails(capsys, tmp_path / "o", *TINY, "--data_dir", str(data), "--log_with", log_with)
    assert f"log_with '{log_with}' is not a tracker" in err and expected in err


@pytest.mark.parametrize("tracker", ["tensorboard", "wandb"])
def test_tracker_not_installed(capsys: pytest.CaptureFixture, tmp_path: Path, data: Path, tracker: str) -> None:
    import importlib.util

    if importlib.util.find_spec(tracker):
        pytest.skip(f"{tracker} is installed here")
    err = _fails(capsys, tmp_path / "o", *TINY, "--data_dir", str(data), "--log_with", tracker)
    assert f'{tracker} is not installed; pip install -e ".[{tracker}]"' in err


def test_attention_backend_needs_cuda(capsys: pytest.CaptureFixture, tmp_path: Path, data: Path) -> None:
    err = _fails(capsys, tmp_path / "o", *TINY, "--data_dir", str(data), "--attention_backend", "flash")
    assert "attention_backend flash" in err and "cpu" in err


def test_attention_backend_switches_only_the_chosen_kernel() -> None:
    """On CUDA a forced kernel leaves the others off, so a call it cannot run fails instead of falling back."""
    import torch

    from accel_gpt.runtime import ATTENTION_SWITCHES, use_attention_backend

    enabled = {
        "flash": torch.backends.cuda.flash_sdp_enabled,
        "cudnn": torch.backends.cuda.cudnn_sdp_enabled,
        "efficient": torch.backends.cuda.mem_efficient_sdp_enabled,
        "math": torch.backends.cuda.math_sdp_enabled,
    }
    before = {name: on() for name, on in enabled.items()}
    try:
        for choice in ATTENTION_SWITCHES:
            use_attention_backend(choice, torch.device("cuda"))
            assert {name: on() for name, on in enabled.items()} == {name: name == choice for name in enabled}
    finally:
        for name, on in before.items():
            ATTENTION_SWITCHES[name](on)
