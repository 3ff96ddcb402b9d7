"""The command line's promise for prepare, eval, sample, export and plot: a failure is exit code 2 and one stderr
line starting `error: `, never a traceback, and nothing written or changed.

Each case is `python run.py ...` in its own process, as a user runs it. Every start-up imports torch (seconds on a
small machine), so one module fixture launches all the cases two at a time and the tests read its results.
Read-only and full disks are real: a tmpfs mounted read-only or tiny where the tests run as root (mounting needs
it), otherwise a folder without write permission, and the disk-full case is skipped.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from conftest import HELLASWAG, REPO, SHAKESPEARE, subprocess_env, write_token_shards
from safetensors.torch import load_file

from accel_gpt.data import shards
from accel_gpt.data.pipeline import STATE_FILE
from accel_gpt.files import LOCK
from accel_gpt.model import GPT, GPTConfig
from accel_gpt.tokenizer import Tokenizer
from accel_gpt.weights import MODEL_CONFIG, ModelCard, read_model_config, save_weights

pytestmark = pytest.mark.slow

TINY = GPTConfig(n_layer=1, n_head=2, n_embd=16, seq_len=32, vocab_size=50304)
CHARS = "".join(map(chr, range(32, 97)))  # 65 characters
NO_NETWORK = {"HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9", "NO_PROXY": ""}

TINY_MODEL = ["--n_layer", "1", "--n_head", "2", "--n_embd", "16", "--seq_len", "32"]  # the shape of the trains here


@dataclass
class Case:
    argv: list[str]
    expect: str  # what the one error line says (a part of it)
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path = REPO
    progress: bool = False  # a progress bar may come before the error line (the failure is mid-work)


def launch(argv: list[str], cwd: Path = REPO, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """run.py by absolute path, so that a case can run in a folder of its own (relative paths, the current dir)."""
    command = [sys.executable, str(REPO / "run.py"), *argv]
    return subprocess.run(command, cwd=cwd, env=subprocess_env(**env), capture_output=True, text=True, timeout=timeout)


def error_line(proc: subprocess.CompletedProcess, progress: bool = False) -> str:
    """The one `error: ` line of a failed command; without a progress bar it is all of stderr."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], proc.stderr[-3000:]
    if not progress:
        assert lines == errors, proc.stderr[-3000:]
    return errors[0]


def snapshot(*folders: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under the folders, with its bytes and modification time: what "nothing changed" compares. A
    prepare's lock file is left out: a refused re-run holds the lock while it checks, which rewrites its holder."""
    files = (p for f in folders for p in sorted(f.rglob("*")) if p.is_file() and p.name != LOCK)
    return {str(p): (p.read_bytes(), p.stat().st_mtime_ns) for p in files}


def _mount(target: Path, options: str) -> bool:
    target.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    return (
        subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)], capture_output=True).returncode
        == 0
    )


def _unmount(target: Path) -> None:
    subprocess.run(["umount", str(target)], capture_output=True)


@pytest.fixture(scope="module")
def read_only(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """An empty folder nothing can be written into: a read-only file system (EROFS) as root, else no permission."""
    folder = tmp_path_factory.mktemp("errors") / "read_only"
    mounted = _mount(folder, "ro,size=1m")
    if not mounted:
        if os.geteuid() == 0:
            pytest.skip("no read-only folder: root ignores permissions and mounting a tmpfs failed")
        folder.chmod(0o555)
    yield folder
    if mounted:
        _unmount(folder)
    else:
        folder.chmod(0o755)


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Inputs the cases only read: GPT-2 and char models, their shards, a text, a run with metrics."""
    root = tmp_path_factory.mktemp("shared")
    torch.manual_seed(0)
    save_weights(GPT(TINY).state_dict(), ModelCard(TINY, Tokenizer("gpt2"), 0), root / "gpt2_model")
    char_cfg = GPTConfig(n_layer=1, n_head=2, n_embd=16, seq_len=16, vocab_size=len(CHARS))
    save_weights(GPT(char_cfg).state_dict(), ModelCard(char_cfg, Tokenizer("char", CHARS), 0), root / "char_model")
    tokens = torch.randint(0, 50257, (20 * TINY.seq_len,), generator=torch.Generator().manual_seed(0)).tolist()
    write_token_shards(root / "gpt2_data", train=tokens, val=tokens)
    write_token_shards(root / "char_data", train=list(range(65)) * 20, val=list(range(65)) * 20, vocab_size=65)
    (root / "small.txt").write_text(SHAKESPEARE.read_text()[:20_000])
    (root / "run").mkdir()
    rows = [{"step": s, "loss": 10.0 - s, "lr": 1e-3, "tokens_per_sec": 100.0} for s in range(1, 4)]
    (root / "run" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {p.name: p for p in root.iterdir()}


class Payload:
    """Pickles as a call to os.mkdir(path): unpickling it with weights_only=False creates the folder."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _unsafe_transformers_folder(folder: Path) -> Path:
    """A transformers GPT-2 folder (as `export` or `save_pretrained` writes it) whose weights are a pickle that would
    create `folder/../payload_ran` when unpickled without weights_only."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=32))
    model.save_pretrained(folder)
    (folder / "model.safetensors").unlink()
    torch.save({**model.state_dict(), "extra": Payload(folder.parent / "payload_ran")}, folder / "pytorch_model.bin")
    return folder


def _overflowing(folder: Path) -> None:
    """Finite weights whose logits are not: every embedding entry +-1e38, so their sums pass fp32's 3.4e38."""
    path = folder / "model.safetensors"
    weights = load_file(str(path))
    wte = weights["transformer.wte.weight"]
    weights["transformer.wte.weight"] = torch.where(wte < 0, -1e38, 1e38)
    card = read_model_config(folder)
    save_weights(weights, card, folder)


def _other_tokenizer_folders(root: Path) -> tuple[Path, Path]:
    """Transformers folders trained with another tokenizer than GPT-2's: one of 1,000 ids and no tokenizer files,
    one with a tokenizer.json of 65,536 tokens (as a NanoChat checkpoint ships)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    few, own = root / "few_ids", root / "own_tokenizer"
    shape = dict(n_layer=1, n_head=2, n_embd=16, n_positions=32, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(GPT2Config(vocab_size=1000, **shape)).save_pretrained(few)
    GPT2LMHeadModel(GPT2Config(vocab_size=65536, **shape)).save_pretrained(own)
    vocab = {f"t{i}": i for i in range(65536)}
    (own / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": vocab, "merges": []}}))
    return few, own


def _prepared(source: Path, out_dir: Path) -> Path:
    """A finished single-part prepare of `source`, made in this process."""
    from accel_gpt.config import PrepareConfig
    from accel_gpt.data.prepare import prepare

    prepare(PrepareConfig(dataset=str(source), out_dir=str(out_dir), shard_size=2000))
    return out_dir


def prepare_cases(root: Path, s: dict[str, Path]) -> dict[str, Case]:
    """prepare refusing a folder it cannot go on with: parts over a single run, a garbled state, a changed input,
    more parts than documents."""
    for name in ("single", "garbled", "changed", "one_row"):
        (root / name).mkdir()
    single = _prepared(s["small.txt"], root / "single" / "data")
    garbled = _prepared(s["small.txt"], root / "garbled" / "data")
    (garbled / shards.MANIFEST).unlink()  # as if killed before the manifest: the state decides, and it is garbled
    (garbled / STATE_FILE).write_text('{"identity": {"dataset": ')
    text = root / "changed" / "text.txt"
    shutil.copy(s["small.txt"], text)
    changed = _prepared(text, root / "changed" / "data")
    with text.open("a") as f:
        f.write("\n\nA paragraph added after the prepare.")
    (one_row := root / "one_row" / "one.txt").write_text("a single paragraph")
    small = ["--dataset", str(s["small.txt"]), "--shard_size", "2000"]
    return {
        "prepare_parts_into_a_single_part_folder": Case(
            ["prepare", *small, "--out_dir", str(single), "--num_shards", "2", "--shard_index", "1"],
            f"out_dir '{single}' holds a single-part prepare; a prepare in 2 parts (--num_shards) needs its own folder",
        ),
        "prepare_garbled_state_file": Case(
            ["prepare", *small, "--out_dir", str(garbled)],
            f"{garbled / STATE_FILE}, the record of an interrupted prepare, is unreadable (JSONDecodeError: ",
        ),
        "prepare_changed_input": Case(
            ["prepare", "--dataset", str(text), "--shard_size", "2000", "--out_dir", str(changed)],
            f"the input changed since the finished prepare in out_dir '{changed}' read it (text.txt: size ",
        ),
        "prepare_more_parts_than_documents": Case(
            [
                "prepare",
                "--dataset",
                str(one_row),
                "--out_dir",
                str(root / "one_row" / "data"),
                "--num_shards",
                "2",
                "--shard_index",
                "1",
            ],
            "--num_shards 2 splits the input into more parts than it has documents (1)",
        ),  # fmt: skip
    }


def build_cases(root: Path, s: dict[str, Path], read_only: Path | None) -> dict[str, Case]:
    """Every case with the files it needs in `root/<name>`; the read-only ones only when there is such a folder."""
    for name in ("no_tiktoken", "out_folder", "not_utf8", "truncated", "mistyped", "unsafe", "plot_folder"):
        (root / name).mkdir()
    (root / "no_tiktoken" / "empty_cache").mkdir()
    no_tiktoken = {"TIKTOKEN_CACHE_DIR": str(root / "no_tiktoken" / "empty_cache"), **NO_NETWORK}
    good = (HELLASWAG.read_text().splitlines()[0] + "\n").encode()
    (root / "not_utf8" / "hs.jsonl").write_bytes(good + good.replace(b"man", b"caf\xe9"))
    shutil.copytree(s["gpt2_model"], root / "truncated" / "model")
    config = root / "truncated" / "model" / MODEL_CONFIG
    config.write_text(config.read_text()[:30])
    shutil.copytree(s["gpt2_model"], root / "mistyped" / "runs" / "tiny-cpu")
    _unsafe_transformers_folder(root / "unsafe" / "export")
    few, own = _other_tokenizer_folders(root / "other_tokenizer")
    (root / "plot_folder" / "runs.png").mkdir()
    shutil.copytree(s["gpt2_model"], root / "mistyped_config" / "model")
    mistyped = root / "mistyped_config" / "model" / MODEL_CONFIG
    mistyped.write_text(mistyped.read_text().replace('"n_layer": 1', '"n_layer": "1"'))
    shutil.copytree(s["gpt2_model"], root / "overflow" / "model")
    _overflowing(root / "overflow" / "model")
    (root / "out_kinds").mkdir()
    shutil.copy(HELLASWAG, root / "out_kinds" / "hs.jsonl")
    (root / "out_kinds" / "notes.txt").write_text("the user's own notes\n")

    gpt2, char, hs = str(s["gpt2_model"]), str(s["char_model"]), str(HELLASWAG)
    cases = prepare_cases(root, s) | {
        "prepare_no_tiktoken_files": Case(
            [
                "prepare",
                "--dataset",
                str(s["small.txt"]),
                "--out_dir",
                str(root / "no_tiktoken" / "out"),
                "--num_proc",
                "2",
            ],
            "TIKTOKEN_CACHE_DIR",
            no_tiktoken,
        ),  # fmt: skip (the BPE files are read before the progress bar starts: nothing comes before the line)
        "sample_no_tiktoken_files": Case(["sample", "--checkpoint", gpt2], "TIKTOKEN_CACHE_DIR", no_tiktoken),
        "eval_gpt2_model_on_char_shards": Case(
            ["eval", "--checkpoint", gpt2, "--data_dir", str(s["char_data"])],
            f"the shards in {s['char_data']} hold 65 characters, but {gpt2} was trained on GPT-2's tokens",
        ),
        "eval_char_model_on_gpt2_shards": Case(
            ["eval", "--checkpoint", char, "--data_dir", str(s["gpt2_data"])],
            f"hold GPT-2's tokens, but {char} was trained on 65 characters",
        ),
        "eval_out_is_a_folder": Case(
            ["eval", "--checkpoint", gpt2, "--hellaswag", hs, "--limit", "2", "--out", "."],
            "--out . is a folder; give a file name",
            cwd=root / "out_folder",
        ),
        "eval_hellaswag_not_utf8": Case(
            ["eval", "--checkpoint", gpt2, "--hellaswag", str(root / "not_utf8" / "hs.jsonl")],
            f"{root / 'not_utf8' / 'hs.jsonl'} line 2: not UTF-8 text (byte 0xe9 at byte ",
        ),
        "eval_hellaswag_missing": Case(
            ["eval", "--checkpoint", gpt2, "--hellaswag", str(root / "nowhere" / "hs.jsonl")],
            f"HellaSwag file '{root / 'nowhere' / 'hs.jsonl'}' does not exist",
        ),
        "sample_truncated_model_config": Case(
            ["sample", "--checkpoint", str(root / "truncated" / "model")],
            f"{config} is not a readable accel_gpt model config (JSONDecodeError: ",
        ),
        "sample_temperature_nan": Case(
            ["sample", "--checkpoint", gpt2, "--temperature", "nan"], "temperature=nan must be a finite number"
        ),
        "sample_mistyped_checkpoint": Case(
            ["sample", "--checkpoint", "runs/tiny_cpu"],
            "'runs/tiny_cpu' is not a local folder (no such path; did you mean runs/tiny-cpu?), and as a hub id: ",
            cwd=root / "mistyped",
        ),
        "sample_unsafe_pickle": Case(
            ["sample", "--checkpoint", str(root / "unsafe" / "export")],
            "refused as unsafe, since unpickling it could run arbitrary code",
        ),
        "sample_model_with_fewer_ids_than_the_prompt": Case(
            ["sample", "--checkpoint", str(few), "--prompt", "Hello there"],
            "the prompt's token 15496 is past the model's 1000 ids: its embedding was not made for this tokenizer",
        ),
        "eval_model_with_fewer_ids_than_the_shards": Case(
            ["eval", "--checkpoint", str(few), "--data_dir", str(s["gpt2_data"])],
            "but the model's vocab_size is 1000; the model has fewer ids than the data's tokenizer: it was trained "
            "with another one, so these shards cannot score it",
        ),
        "sample_folder_with_its_own_tokenizer": Case(
            ["sample", "--checkpoint", str(own)],
            f"'{own}' has a tokenizer of 65,536 tokens, not GPT-2's 50,257 nor a byte-level BPE laid out as "
            "accel_gpt's: accel_gpt reads transformers folders with those only",
        ),
        "sample_model_config_of_another_type": Case(
            ["sample", "--checkpoint", str(root / "mistyped_config" / "model")],
            f"{mistyped} is not a readable accel_gpt model config (ValueError: n_layer='1' must be a positive integer)",
        ),
        "sample_weights_whose_logits_overflow": Case(
            ["sample", "--checkpoint", str(root / "overflow" / "model"), "--max_new_tokens", "2"],
            "the model's logits are not finite (its weights overflow)",
        ),
        "eval_out_is_the_hellaswag_input": Case(
            [
                "eval",
                "--checkpoint",
                gpt2,
                "--hellaswag",
                str(root / "out_kinds" / "hs.jsonl"),
                "--limit",
                "2",
                "--out",
                str(root / "out_kinds" / "hs.jsonl"),
            ],  # fmt: skip
            "is the --hellaswag file being scored; write the predictions to another file",
        ),
        "eval_out_inside_the_model_folder": Case(
            ["eval", "--checkpoint", gpt2, "--hellaswag", hs, "--limit", "2", "--out", f"{gpt2}/model.safetensors"],
            f"is inside the model's folder {gpt2}; write the predictions elsewhere",
        ),
        "eval_out_is_another_file": Case(
            [
                "eval",
                "--checkpoint",
                gpt2,
                "--hellaswag",
                hs,
                "--limit",
                "2",
                "--out",
                str(root / "out_kinds" / "notes.txt"),
            ],  # fmt: skip
            "exists and is not a predictions file of `eval --out`; remove it or write to another file",
        ),
        "train_init_from_a_model_with_fewer_ids": Case(
            [
                "train",
                "--init_from",
                str(few),
                "--data_dir",
                str(shutil.copytree(s["gpt2_data"], root / "other_tokenizer" / "data")),  # its verify cache is written
                "--out_dir",
                str(root / "other_tokenizer" / "run"),
                *TINY_MODEL,
                "--max_steps",
                "1",
                "--log_with",
                "none",
            ],  # fmt: skip
            f"'{few}' has 1,000 token ids, fewer than the data's tokenizer's 50,257: it was trained with another",
            progress=True,  # the start-up says what it loads first
        ),
        "plot_out_is_a_folder": Case(
            ["plot", str(s["run"]), "--out", str(root / "plot_folder" / "runs.png")], "is a folder; give a file name"
        ),
    }
    if not torch.cuda.is_available():
        cases["sample_cuda_without_cuda"] = Case(
            ["sample", "--checkpoint", gpt2, "--device", "cuda"], "--device cuda cannot be used here: "
        )
    if read_only is not None:
        cases |= {
            "prepare_read_only_out_dir": Case(
                ["prepare", "--dataset", str(s["small.txt"]), "--out_dir", str(read_only / "data")],
                f"cannot write to out_dir '{read_only / 'data'}': ",
            ),
            "eval_out_read_only": Case(
                ["eval", "--checkpoint", gpt2, "--hellaswag", hs, "--limit", "2", "--out", str(read_only / "p.jsonl")],
                f"cannot write --out {read_only / 'p.jsonl'}: {read_only} is not a writable folder",
            ),
            "export_read_only": Case(
                ["export", "--checkpoint", gpt2, "--out_dir", str(read_only / "export")],
                f"cannot write the export to {read_only / 'export'}: {read_only} is not writable",
            ),
            "plot_read_only": Case(
                ["plot", str(s["run"]), "--out", str(read_only / "runs.png")],
                f"cannot write --out {read_only / 'runs.png'}: {read_only} is not writable",
            ),
        }
    return cases


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory, shared: dict[str, Path], request: pytest.FixtureRequest):
    """Every case launched (two at a time), with snapshots of the files around it before and after."""
    try:
        read_only = request.getfixturevalue("read_only")
    except pytest.skip.Exception:
        read_only = None
    import datasets

    root = tmp_path_factory.mktemp("cases")
    cache_dir = tmp_path_factory.mktemp("hf_datasets_cache")  # the Arrow caches of the inputs: not the user's
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", cache_dir)
        cases = build_cases(root, shared, read_only)
    watched = [root, *shared.values(), *([read_only] if read_only else [])]
    before = snapshot(*[p for p in watched if p.is_dir()])
    cache = {"HF_DATASETS_CACHE": str(cache_dir)}
    with ThreadPoolExecutor(2) as pool:
        runs = pool.map(lambda c: launch(c.argv, c.cwd, **cache, **c.env), cases.values())
        procs = dict(zip(cases, runs, strict=True))
    after = snapshot(*[p for p in watched if p.is_dir()])
    return {"cases": cases, "procs": procs, "before": before, "after": after, "root": root}


CASE_NAMES = [
    "prepare_parts_into_a_single_part_folder",
    "prepare_garbled_state_file",
    "prepare_changed_input",
    "prepare_more_parts_than_documents",
    "prepare_no_tiktoken_files",
    "sample_no_tiktoken_files",
    "eval_gpt2_model_on_char_shards",
    "eval_char_model_on_gpt2_shards",
    "eval_out_is_a_folder",
    "eval_hellaswag_not_utf8",
    "eval_hellaswag_missing",
    "sample_truncated_model_config",
    "sample_temperature_nan",
    "sample_mistyped_checkpoint",
    "sample_unsafe_pickle",
    "sample_model_with_fewer_ids_than_the_prompt",
    "eval_model_with_fewer_ids_than_the_shards",
    "sample_folder_with_its_own_tokenizer",
    "sample_model_config_of_another_type",
    "sample_weights_whose_logits_overflow",
    "eval_out_is_the_hellaswag_input",
    "eval_out_inside_the_model_folder",
    "eval_out_is_another_file",
    "train_init_from_a_model_with_fewer_ids",
    "plot_out_is_a_folder",
    "sample_cuda_without_cuda",
    "prepare_read_only_out_dir",
    "eval_out_read_only",
    "export_read_only",
    "plot_read_only",
]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_one_line_exit_2_and_nothing_written(name: str, results: dict) -> None:
    if name not in results["cases"]:
        pytest.skip("this machine cannot stage the case (a CUDA device, or no read-only folder)")
    case, proc = results["cases"][name], results["procs"][name]
    line = error_line(proc, case.progress)
    assert case.expect in line, line


def test_the_cases_changed_no_file(results: dict) -> None:
    """Files the cases read, the folders they were told to write, the current folder of those run elsewhere (a data
    folder's cache of verified shards, written when train checks them, is the one file allowed to appear)."""
    before, after = results["before"], {k: v for k, v in results["after"].items() if not k.endswith(".verified.json")}
    assert sorted(after) == sorted(before), set(after) ^ set(before)
    assert [k for k in before if before[k] != after[k]] == []
    root = results["root"]
    assert not (root / "no_tiktoken" / "out").exists()
    assert not (root / "unsafe" / "payload_ran").exists(), "the pickle's code ran"
    assert not any(".tmp-" in p.name for p in root.rglob("*"))


# --- prepare on a disk that fills up ------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs, remountable larger: a real ENOSPC, then room for the resume."""
    folder = tmp_path / "small_disk"
    if not _mount(folder, "size=256k"):
        pytest.skip("mounting a tmpfs needs root")
    yield folder
    _unmount(folder)


def test_prepare_on_a_full_disk_keeps_what_it_finished_and_resumes(tmp_path: Path, small_disk: Path) -> None:
    """The kernel's own ENOSPC, mid-way: one line that says how to go on, finished shards and the state kept, no
    temporary left; after making room the same command resumes to the bytes of an uninterrupted run."""
    src = tmp_path / "big.txt"
    src.write_text(SHAKESPEARE.read_text() * 2)  # about 150k tokens: 300 KB of uint16, more than the disk holds
    argv = ["prepare", "--dataset", str(src), "--shard_size", "20000", "--val_tokens", "5000"]
    out = small_disk / "data"
    line = error_line(launch([*argv, "--out_dir", str(out)]), progress=True)
    state = json.loads((out / STATE_FILE).read_text())
    assert line == (
        f"error: cannot write to out_dir '{out}': no space left on the device; {len(state['shards'])} finished "
        f"shard(s) kept: make room and run the same command again to resume, or delete '{out}'"
    )
    assert len(state["shards"]) >= 2
    names = {p.name for p in out.iterdir()} - {LOCK, STATE_FILE}
    recorded = {e["file"] for e in state["shards"]}
    assert recorded <= names and not [n for n in names if ".tmp-" in n], names
    assert len(names - recorded) <= 1, names  # a shard published just before its record could not be saved
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_disk)], check=True)
    resumed = launch([*argv, "--out_dir", str(out)])
    assert resumed.returncode == 0 and resumed.stdout.startswith("resumed and prepared: "), resumed.stderr[-3000:]
    reference = tmp_path / "reference"
    assert launch([*argv, "--out_dir", str(reference)]).returncode == 0
    for split in ("train", "val"):
        shards.verify_split(out, shards.read_manifest(out), split)
    published = {p.name: p.read_bytes() for p in out.iterdir() if p.suffix in (".bin", ".json")}
    assert published == {p.name: p.read_bytes() for p in reference.iterdir() if p.suffix in (".bin", ".json")}


# --- every output on a full disk ------------------------------------------------------------------------------------
# Each command that writes a file of its own, on a real tmpfs with room for part of it only: one line that says the
# disk is full and how much the write needed, exit 2, no partial file or staging folder left. (prepare's and train's
# writes have tests of their own above and in test_reliability.py: they also keep what they finished and resume.)
FULL_DISK_WRITERS = {
    # name: (argv given the disk folder and the shared inputs, bytes left free on the disk before the command, what
    # the line names, the files a failed command may leave: a training run's own files stay, for the resume)
    "export": (
        lambda disk, s: ["export", "--checkpoint", str(s["gpt2_model"]), "--out_dir", str(disk / "hf")],
        2 << 20,
        "the export to {disk}/hf",
        [],
    ),
    "eval --out": (
        lambda disk, s: [
            "eval",
            "--checkpoint",
            str(s["gpt2_model"]),
            "--hellaswag",
            str(HELLASWAG),
            "--limit",
            "50",
            "--out",
            str(disk / "predictions.jsonl"),
        ],  # fmt: skip
        1 << 10,
        "--out {disk}/predictions.jsonl",
        [],
    ),
    "plot --out": (
        lambda disk, s: ["plot", str(s["run"]), "--out", str(disk / "runs.png")],
        8 << 10,
        "--out {disk}/runs.png",
        [],
    ),
    "train's metrics.jsonl": (
        lambda disk, s: [
            "train",
            "--data_dir",
            str(s["gpt2_data"]),
            "--out_dir",
            str(disk / "run"),
            *TINY_MODEL,
            "--micro_batch_size",
            "1",
            "--total_batch_size",
            "32",
            "--max_steps",
            "200",
            "--save_every",
            "0",
            "--eval_every",
            "0",
            "--sample_tokens",
            "0",
            "--log_with",
            "none",
        ],  # fmt: skip
        16 << 10,  # its config.yaml, accelerate_env.txt and run.json fit, then some 30 rows
        "{disk}/run/metrics.jsonl",
        ["run"],
    ),
}
FULL = r"no space left on the device \(the write needs about [\d.,]+ [kM]B; [\d.,]+ [kM]B were free\)"


@pytest.mark.parametrize("name", FULL_DISK_WRITERS)
def test_every_output_on_a_full_disk_is_one_line(name: str, tmp_path: Path, shared: dict[str, Path]) -> None:
    disk = tmp_path / "disk"
    if not _mount(disk, "size=4m"):
        pytest.skip("mounting a tmpfs needs root")
    try:
        argv, room, names, leftovers = FULL_DISK_WRITERS[name]
        filler = shutil.disk_usage(disk).free - room
        (disk / "filler").write_bytes(b"\0" * filler)  # what else the user keeps there
        proc = launch(argv(disk, shared))
        line = error_line(proc, progress=True)  # progress bars come before: the failure is mid-work or at the end
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert line.startswith(f"error: cannot write {names.format(disk=disk)}: "), line
        assert re.search(FULL, line), line
        assert sorted(p.name for p in disk.iterdir()) == sorted(["filler", *leftovers]), "nothing partial left"
    finally:
        _unmount(disk)
