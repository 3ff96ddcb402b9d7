"""Nothing lost, nothing silently wrong: the trainer's answers to rollbacks, changed settings, other data, a
diverging loss, signals, lost launchers, busy folders and launches that started fewer processes than asked.

Every run is a real `run.py train` process (or `accelerate launch` for 2 processes) on real files. Interruptions
land at exact points: `tests/workers/interrupted_train.py` pauses the trainer before a given step, the test signals
whom it means to, then lets the step go on.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import yaml
from conftest import (
    REPO,
    accelerate_cmd,
    front_matter,
    python_cmd,
    run_cmd,
    subprocess_env,
    table,
    write_token_shards,
)
from safetensors.torch import load_file, save_file

from accel_gpt.config import TrainConfig
from accel_gpt.files import LOCK
from accel_gpt.modelcard import model_card
from accel_gpt.optim import lr_multiplier
from accel_gpt.weights import RUN_FILE as RUN
from accel_gpt.weights import load_model, read_model_config

pytestmark = pytest.mark.slow

VOCAB = 256  # token ids folded into a small vocabulary: these tests check bookkeeping, not language
FLAGS = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--seq_len", "16", "--vocab_size", str(VOCAB)]
FLAGS += ["--micro_batch_size", "2", "--total_batch_size", "64", "--seed", "7", "--learning_rate", "1e-3"]
FLAGS += ["--warmup_steps", "2", "--eval_every", "0", "--sample_tokens", "0", "--log_with", "none"]
WORKER = "tests/workers/interrupted_train.py"


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, shakespeare_tokens: list[int]) -> Path:
    tokens = [t % VOCAB for t in shakespeare_tokens[:40_000]]
    return write_token_shards(
        tmp_path_factory.mktemp("rel") / "data", tokens[:36_000], tokens[36_000:], shard_size=9_000, vocab_size=VOCAB
    )


@pytest.fixture(scope="module")
def other_data(tmp_path_factory: pytest.TempPathFactory, shakespeare_tokens: list[int]) -> Path:
    """Other text with the same tokenizer and vocabulary."""
    tokens = [t % VOCAB for t in shakespeare_tokens[-40_000:]]
    return write_token_shards(
        tmp_path_factory.mktemp("other") / "data", tokens[:36_000], tokens[36_000:], shard_size=9_000, vocab_size=VOCAB
    )


def flags(data: Path, out: Path, *extra: str) -> list[str]:
    return [*FLAGS, "--data_dir", str(data), "--out_dir", str(out), *extra]


def train(data: Path, out: Path, *extra: str, processes: int = 1, check: bool = True) -> subprocess.CompletedProcess:
    args = flags(data, out, *extra)
    cmd = python_cmd("train", *args) if processes == 1 else accelerate_cmd(processes, "train", *args)
    return run_cmd(cmd, timeout=300, check=check)


def launcher(processes: int) -> list[str]:
    """The command prefix that runs a script as `processes` processes (python itself for one)."""
    return [sys.executable] if processes == 1 else accelerate_cmd(processes, "x")[:-2]


def errors(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error: ")]


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


def checkpoints(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def snapshot(folder: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None for p in sorted(folder.rglob("*"))}


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"weight {k} differs"


# ------------------------------------------------------------------------------------------ paused runs


@dataclass
class Paused:
    """A trainer launched under the test worker and paused before a step; the test signals, then releases."""

    proc: subprocess.Popen
    ctl: Path
    workers: list[int] = field(default_factory=list)

    @property
    def output(self) -> str:
        return (self.ctl / "output.txt").read_text()

    def signal(self, sig: signal.Signals, *, launcher_only: bool = False) -> None:
        """To the launcher's process group and (unless `launcher_only`) every worker's: torchrun gives each worker
        its own session, so a Ctrl-C in a terminal reaches the launcher alone."""
        for group in [self.proc.pid] if launcher_only else [self.proc.pid, *self.workers]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, sig)

    def wait_for(self, condition: Callable[[], bool], what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{self.output[-6000:]}"
            time.sleep(0.02)

    def release(self) -> None:
        (self.ctl / "release").touch()

    def finish(self) -> int:
        """Release the paused rank, wait for the launcher and every worker; the launcher's exit code."""
        self.release()
        code = self.proc.wait(timeout=180)
        self.wait_for(lambda: not any(_alive(pid) for pid in self.workers), "the workers to exit", timeout=90)
        return code


def _alive(pid: int) -> bool:
    """Running, not a zombie (workers are the launcher's children, not ours)."""
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


@contextlib.contextmanager
def paused(processes: int, control: str, args: list[str], root: Path) -> Iterator[Paused]:
    """Start `args` under the worker with `control` (e.g. `--pause_at 4`), yield once rank 0 has paused; whatever
    the test did, nothing of it is left running afterwards."""
    ctl = root / f"ctl-{time.monotonic_ns()}"
    ctl.mkdir(parents=True)
    cmd = [*launcher(processes), WORKER, str(ctl), *control.split(), "--", *args]
    with open(ctl / "output.txt", "w") as log:  # a file, not a pipe: a paused process must never block on it
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        run = Paused(proc, ctl)
        try:
            run.wait_for(lambda: (ctl / "paused").exists() or proc.poll() is not None, "the pause")
            assert proc.poll() is None, f"exited ({proc.returncode}) before pausing:\n{run.output[-6000:]}"
            run.workers = [int(p.read_text()) for p in sorted(ctl.glob("pid_*"))]
            assert len(run.workers) == processes
            yield run
        finally:
            run.release()
            for pid in [proc.pid, *run.workers]:
                with contextlib.suppress(ProcessLookupError, subprocess.TimeoutExpired):
                    if pid == proc.pid:
                        proc.wait(timeout=5)
                    elif _alive(pid):
                        time.sleep(5)
                with contextlib.suppress(ProcessLookupError):
                    if proc.poll() is None or _alive(pid):
                        os.killpg(pid, signal.SIGKILL)
            proc.wait()


# ------------------------------------------------------------------------------------------ 1. rollback


@pytest.fixture(scope="module")
def run_a(tmp_path_factory: pytest.TempPathFactory, data: Path) -> Path:
    """20 steps, checkpoints at 10 and 20, final weights. Tests copy it before changing anything."""
    out = tmp_path_factory.mktemp("a") / "run"
    train(data, out, "--max_steps", "20", "--save_every", "10", "--keep_checkpoints", "2")
    assert checkpoints(out) == ["step_00000010", "step_00000020"]
    return out


NEW_LINE = ("--max_steps", "30", "--save_every", "3", "--keep_checkpoints", "2")


def test_rollback_by_path_then_auto_continues_the_new_line(data: Path, run_a: Path, tmp_path: Path) -> None:
    """Resumed from step 10 by path (a new line to 30), SIGKILLed after saving step 15, then `--resume auto`: it
    must continue from 15, not go back to the abandoned line's step 20, and end where the new line run without
    interruption ends. The abandoned line's step 20 and final weights are moved aside, not deleted."""
    run, ref = tmp_path / "run", tmp_path / "ref"
    shutil.copytree(run_a, run)
    shutil.copytree(ckpt(run_a, 10), ckpt(ref, 10))
    train(data, ref, *NEW_LINE, "--resume", str(ckpt(ref, 10)))  # the new line, never interrupted

    with paused(1, "--pause_at 6", flags(data, run, *NEW_LINE, "--resume", str(ckpt(run, 10))), tmp_path) as p:
        p.signal(signal.SIGKILL)  # during step 16: steps 12 and 15 are saved
        assert p.finish() == -signal.SIGKILL
    assert "moved the later step_00000020, final weights (step 20) of the abandoned line" in p.output
    names = checkpoints(run)
    assert names[0].startswith("retired-") and names[1:] == ["step_00000012", "step_00000015"], names
    retired = run / "checkpoints" / names[0]
    assert sorted(p.name for p in retired.iterdir()) == [
        "metrics.jsonl",
        "model.safetensors",
        "model_config.json",
        "step_00000020",
    ]
    assert [r["step"] for r in rows(retired)] == list(range(1, 21)), "the abandoned line's rows are kept there"
    assert not (run / "model.safetensors").exists()
    assert (run / LOCK).read_text() == f"pid {p.workers[0]} on {os.uname().nodename}"  # the dead holder's: taken over

    final = train(data, run, *NEW_LINE, "--resume", "auto").stderr
    assert f"resumed from {ckpt(run, 15)} at step 15" in final
    assert_same_weights(load_file(str(run / "model.safetensors")), load_file(str(ref / "model.safetensors")))
    assert [r["step"] for r in rows(run)] == list(range(1, 31))
    new_line = {r["step"]: r for r in rows(ref)}
    for r in rows(run)[10:]:
        assert (r["loss"], r["lr"]) == (new_line[r["step"]]["loss"], new_line[r["step"]]["lr"]), r


# ------------------------------------------------------------------------------------------ 1b. changed settings


def test_changed_optimizer_settings_are_applied_at_resume(data: Path, run_a: Path, tmp_path: Path) -> None:
    """A resume with another learning rate, weight decay and beta1 uses them from the first resumed update (the
    checkpoint's optimizer and scheduler would restore the old ones), logs each change, and config.yaml records
    what was used. An unchanged resume staying bit-identical is test_checkpoint's exact-resume tests."""
    out = tmp_path / "run"
    shutil.copytree(ckpt(run_a, 10), ckpt(out, 10))
    changed = ("--learning_rate", "1e-4", "--weight_decay", "0.05", "--beta1", "0.8")
    stderr = train(data, out, "--resume", "auto", "--max_steps", "12", "--save_every", "12", *changed).stderr
    for line in ("learning_rate 0.001 -> 0.0001", "weight_decay 0.1 -> 0.05", "beta1 0.9 -> 0.8", "max_steps 20 -> 12"):
        assert f"resume: {line}" in stderr, stderr[-3000:]
    cfg = TrainConfig.load(str(out / "config.yaml"))
    assert (cfg.learning_rate, cfg.weight_decay, cfg.beta1) == (1e-4, 0.05, 0.8)
    first = rows(out)[0]
    assert first["step"] == 11 and first["lr"] == 1e-4 * lr_multiplier(10, cfg)
    groups = torch.load(ckpt(out, 12) / "optimizer.bin", weights_only=True)["param_groups"]
    decayed, plain = groups
    assert decayed["weight_decay"] == 0.05 and plain["weight_decay"] == 0.0
    assert all(tuple(g["betas"]) == (0.8, 0.95) and g["initial_lr"] == 1e-4 for g in groups)
    assert decayed["lr"] == 1e-4 * lr_multiplier(12, cfg)  # the rate of the next update


# ------------------------------------------------------------------------------------------ 5. the data


def test_resume_on_other_data_is_refused_naming_init_from(
    data: Path, other_data: Path, run_a: Path, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    shutil.copytree(run_a, out)
    before = snapshot(out)
    proc = train(other_data, out, "--resume", "auto", "--max_steps", "22", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = errors(proc.stderr)
    assert "was trained on other data (train_shards_sha256" in line and f"--init_from {ckpt(out, 20)}" in line
    assert snapshot(out) == before


def test_resume_with_another_char_vocabulary_is_refused(data: Path, run_a: Path, tmp_path: Path) -> None:
    """The same shards (so the same fingerprint) declared in another character set: the checkpoint's
    model_config.json would otherwise get the new tokenizer written over its own at the next save."""
    relabelled = tmp_path / "data"
    shutil.copytree(data, relabelled)
    manifest = json.loads((relabelled / "manifest.json").read_text())
    manifest["chars"] = "".join(map(chr, range(256, 512)))
    (relabelled / "manifest.json").write_text(json.dumps(manifest))
    out = tmp_path / "run"
    shutil.copytree(run_a, out)
    proc = train(relabelled, out, "--resume", str(ckpt(out, 10)), check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = errors(proc.stderr)
    assert "its char vocabulary (256 ids) is not the data's" in line and "--init_from" in line
    assert "char" in json.loads((ckpt(out, 20) / "model_config.json").read_text())["tokenizer"]["name"]
    proc = train(relabelled, tmp_path / "new", "--init_from", str(out), "--max_steps", "1", check=False)
    assert proc.returncode == 2 and "char vocabulary" in errors(proc.stderr)[0], proc.stderr[-3000:]


@pytest.mark.parametrize("source", ["run_dir", "checkpoint", "run_dir_without_final_weights"])
def test_init_from_a_run_or_checkpoint_continues_on_new_data(
    other_data: Path, run_a: Path, tmp_path: Path, source: str
) -> None:
    """init_from takes our run dirs and checkpoints. With a learning rate of 1e-30 an update changes no float32
    weight, so the new run's final weights are exactly the weights it started from."""
    paths = {"run_dir": run_a, "checkpoint": ckpt(run_a, 10)}
    if source == "run_dir_without_final_weights":  # a run killed before the end: its newest checkpoint
        shutil.copytree(run_a / "checkpoints", tmp_path / "killed" / "checkpoints")
        paths[source] = tmp_path / "killed"
    expected = {"run_dir": run_a, "checkpoint": ckpt(run_a, 10), "run_dir_without_final_weights": ckpt(run_a, 20)}
    out = tmp_path / "new"
    args = ("--init_from", str(paths[source]), "--max_steps", "1", "--save_every", "0", "--warmup_steps", "0")
    proc = train(other_data, out, *args, "--learning_rate", "1e-30", "--weight_decay", "0", "--muon_lr", "0.05")
    step = 10 if source == "checkpoint" else 20
    assert f"init_from: the weights of {paths[source]}, step {step}" in proc.stderr
    assert "muon_lr: Muon's setting(s), unused with --optimizer adamw" in proc.stderr
    start, _ = load_model(expected[source])
    final = load_file(str(out / "model.safetensors"))
    assert_same_weights(final, {k: v for k, v in start.state_dict().items() if k in final})


# ------------------------------------------------------------------------------------------ 6. stray files


def test_resume_survives_stray_metrics_lines_and_an_unreadable_marker(data: Path, tmp_path: Path) -> None:
    """metrics.jsonl lines that are not step rows are dropped at resume; a checkpoint whose COMPLETE marker was
    truncated counts as incomplete for `auto`, pruning and keep_best, which say so instead of failing."""
    out = tmp_path / "run"
    scored = ("--eval_every", "2", "--eval_steps", "1", "--keep_checkpoints", "1", "--keep_best", "true")
    train(data, out, "--max_steps", "4", "--save_every", "2", "--keep_checkpoints", "0", *scored[:4])
    with open(out / "metrics.jsonl", "a") as f:
        f.write('[1, 2]\n{"step": null}\n{"step": "3"}\n"text"\nnot json\n{"step": 2.5, "loss": 1}\n')
    marker = ckpt(out, 2) / "COMPLETE"
    marker.write_bytes(marker.read_bytes()[:7])
    proc = train(data, out, "--resume", "auto", "--max_steps", "6", "--save_every", "2", *scored)
    assert f"skipping checkpoint {ckpt(out, 2)}: its COMPLETE marker is unreadable" in proc.stderr
    assert f"resumed from {ckpt(out, 4)} at step 4" in proc.stderr
    assert [r["step"] for r in rows(out)] == [1, 2, 3, 4, 5, 6]
    names = checkpoints(out)  # pruning (keep 1 + the best scored) passed over step 2, leaving it as it was
    assert names[0] == "step_00000002" and names[-1] == "step_00000006" and len(names) <= 3, names


def test_final_weights_best_are_the_checkpoint_with_the_lowest_logged_val_loss(data: Path, tmp_path: Path) -> None:
    """A rate that warms up to far too high a peak: the val loss falls, then rises. `--final_weights best` makes
    model.safetensors that checkpoint's weights (kept by pruning, like keep_best), the summary names its step, and
    `run.py eval` of the run dir gives back that step's logged val loss; `last` keeps the last step's."""
    common = ("--max_steps", "12", "--eval_every", "2", "--eval_windows", "8", "--save_every", "2")
    common += ("--keep_checkpoints", "1", "--learning_rate", "1", "--warmup_steps", "12", "--lr_schedule", "constant")
    best, last = tmp_path / "best", tmp_path / "last"
    proc = train(data, best, *common, "--final_weights", "best")
    train(data, last, *common)
    logged = {r["step"]: r["val_loss"] for r in rows(best) if "val_loss" in r}
    assert logged == {r["step"]: r["val_loss"] for r in rows(last) if "val_loss" in r}  # the same run
    step = min(logged, key=logged.get)
    assert step < 12, logged  # the case the setting is for: the last step is not the best
    assert checkpoints(best) == [f"step_{step:08d}", "step_00000012"]
    final = load_file(str(best / "model.safetensors"))
    assert_same_weights(final, load_file(str(ckpt(best, step) / "model.safetensors")))
    assert json.loads((best / "model_config.json").read_text())["step"] == step
    assert (
        f"model.safetensors holds the weights of step {step}, whose val_loss ({logged[step]:.4f}) is the lowest of the "
        "run's evaluated checkpoints"
    ) in proc.stderr
    final = load_file(str(last / "model.safetensors"))
    assert_same_weights(final, load_file(str(ckpt(last, 12) / "model.safetensors")))
    assert json.loads((last / "model_config.json").read_text())["step"] == 12
    cmd = python_cmd("eval", "--checkpoint", str(best), "--data_dir", str(data))
    result = json.loads(run_cmd(cmd, timeout=120).stdout.splitlines()[-1])
    assert result["val_loss"] == pytest.approx(logged[step], abs=1e-5)


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 640 KiB tmpfs: room for one checkpoint of these models (about 400 KB), not two; remountable larger."""
    folder = tmp_path / "disk"
    folder.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=640k", "tmpfs", str(folder)]
    if os.geteuid() != 0 or subprocess.run(mount, capture_output=True).returncode != 0:
        pytest.skip("mounting a tmpfs needs root")
    yield folder
    subprocess.run(["umount", str(folder)], capture_output=True)


@pytest.mark.parametrize("processes", [1, 2])
def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(
    data: Path, small_disk: Path, processes: int
) -> None:
    """The kernel's own ENOSPC while step 2 is saved (torch reports it as `basic_ios::clear: iostream error`): one
    line on every rank, printed once, that names the intact step 1; no temporary left; after making room,
    `--resume auto` goes on from step 1."""
    out = small_disk / "run"
    args = ("--max_steps", "4", "--save_every", "1", "--keep_checkpoints", "2")
    proc = train(data, out, *args, processes=processes, check=False)
    assert proc.returncode != 0 and f'File "{REPO / "accel_gpt"}' not in proc.stderr, proc.stderr[-3000:]
    assert processes == 2 or "Traceback" not in proc.stderr  # torchrun's own page: docs/troubleshooting.md
    (line,) = errors(proc.stderr)
    assert re.fullmatch(
        rf"error: cannot save checkpoint {ckpt(out, 2)}: {NO_SPACE}; the run stopped after step 2 and the previous "
        rf"checkpoint, {ckpt(out, 1)}, is intact: make room \(or fix the folder\), then continue with --resume auto",
        line,
    ), line
    assert checkpoints(out) == ["step_00000001"] and not (out / "model.safetensors").exists()
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_disk)], check=True)
    resumed = train(data, out, *args, "--resume", "auto", processes=processes).stderr
    assert f"resumed from {ckpt(out, 1)} at step 1" in resumed and "finished at step 4/4" in resumed
    assert re.search(
        r"finished at step 4/4 in [\d.]+ (?:s|min) \(this attempt, from step 1\), 256 tokens seen", resumed
    )
    assert [r["step"] for r in rows(out)] == [1, 2, 3, 4]


def test_a_full_disk_for_the_weights_file_or_the_final_weights_is_one_line(data: Path, small_disk: Path) -> None:
    """96 KiB: not even the first checkpoint's weights file fits (the first big file, written by safetensors, whose
    error is its own type), nor the final weights of a run with save_every 0. One line each, no temporary left."""
    subprocess.run(["mount", "-o", "remount,size=96k", str(small_disk)], check=True)

    def the_error(out: Path, save_every: str) -> str:
        proc = train(data, out, "--max_steps", "2", "--save_every", save_every, check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        (line,) = errors(proc.stderr)
        return line

    out, final = small_disk / "run", small_disk / "final"
    assert re.fullmatch(
        rf"error: cannot save checkpoint {ckpt(out, 1)}: {NO_SPACE}; the run stopped after step 1 and no earlier "
        r"checkpoint of this run exists: make room \(or fix the folder\), then continue with --resume auto",
        the_error(out, "1"),
    )
    assert checkpoints(out) == []
    assert re.fullmatch(
        rf"error: cannot write the final weights {final / 'model.safetensors'}: {NO_SPACE}; no checkpoint holds them "
        r"\(save_every 0\), so they are lost: make room, then train again",
        the_error(final, "0"),
    )
    assert sorted(p.name for p in final.iterdir()) == [
        ".lock",
        "accelerate_env.txt",
        "config.yaml",
        "metrics.jsonl",
        RUN,
    ]


def test_the_card_of_best_weights_tells_how_they_were_picked_and_the_command_that_trained_them(
    data: Path, tmp_path: Path
) -> None:
    """6 steps at a small rate, then resumed to 12 at a rate far too high (`--final_weights best`): the best weights
    are step 6's, whose model card says they were picked and quotes the first command, not the resumed one that
    did not train them; a checkpoint of the second segment quotes both, each with its steps."""
    out = tmp_path / "run"
    common = ("--eval_every", "2", "--eval_windows", "8", "--save_every", "2", "--keep_checkpoints", "0")
    train(data, out, *common, "--max_steps", "6")
    train(
        data, out, *common, "--max_steps", "12", "--resume", "auto", "--learning_rate", "1", "--final_weights", "best"
    )
    card = read_model_config(out)
    assert card.step == 6 and card.picked is not None and card.picked["last_step"] == 12
    _, body = front_matter(model_card(out, card, 1, "mit", "t", "t"))
    assert table(body)["weights"] == (
        f"picked among the run's evaluated checkpoints for the lowest validation loss ({card.picked['val_loss']:.4f}); "
        "the run went on to step 12"
    )
    commands = body.split("### Command\n\n", 1)[1].split("\n## ", 1)[0]
    assert (
        commands.count("```bash") == 1 and "--learning_rate 0.001" in commands and "--learning_rate 1.0" not in commands
    )
    later = read_model_config(ckpt(out, 10))
    _, body = front_matter(model_card(ckpt(out, 10), later, 1, "mit", "t", "t"))
    both = body.split("### Commands\n\n", 1)[1].split("\n## ", 1)[0]
    assert "--gelu" not in both and "--bias" not in both  # settings left unset are not spelled out
    assert "Steps 1 to 6:" in both and "Steps 7 to 10:" in both and "--learning_rate 1.0" in both.split("Steps 7")[1]
    first, resumed = both.split("Steps 7")
    assert "--resume" not in first and "--resume auto" in resumed, "the resumed command continues the run"


# What a save on a full disk says: what the write needed, and what was free before it.
NO_SPACE = r"no space left on the device \(the write needs about ([\d.,]+) [kM]B; ([\d.,]+) [kM]B were free\)"
TINY_CPU = ["--config", "tiny-cpu", "--eval_every", "0", "--sample_tokens", "0", "--log_with", "none"]


@pytest.fixture(scope="module")
def gpt2_data(tmp_path_factory: pytest.TempPathFactory, shakespeare_tokens: list[int]) -> Path:
    """GPT-2 token ids for the `tiny-cpu` preset, whose 50,304-row embedding makes checkpoints of about 40 MB."""
    tokens = shakespeare_tokens[:60_000]
    return write_token_shards(tmp_path_factory.mktemp("gpt2") / "data", tokens[:54_000], tokens[54_000:])


def on_a_small_disk(disk: Path, size: str, data: Path, out: Path, *flags: str) -> str:
    """`tiny-cpu` trained into `out` on `disk` remounted at `size`: its one `error:` line (exit 2, no traceback)."""
    subprocess.run(["mount", "-o", f"remount,size={size}", str(disk)], check=True)
    cmd = python_cmd("train", *TINY_CPU, "--data_dir", str(data), "--out_dir", str(out), *flags)
    proc = run_cmd(cmd, timeout=300, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (line,) = errors(proc.stderr)
    return line


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


@pytest.mark.parametrize(
    "disk, fails_in",
    [("48m", "model.safetensors"), ("60m", "optimizer.bin")],
    ids=["weights-first", "optimizer-state-first"],
)
def test_a_checkpoint_much_larger_than_the_space_left_is_one_line(
    gpt2_data: Path, small_disk: Path, disk: str, fails_in: str
) -> None:
    """`tiny-cpu`'s 40 MB checkpoints: step 2's fits, step 4's finds about 10 MB free (its 13 MB weights file fails,
    in safetensors' own error) or 23 MB (the weights fit, the 27 MB optimizer state fails, in torch's writer,
    whose message names no cause). One line with what the save needed, exit 2, step 2 intact, no temporary left."""
    out = small_disk / "run"
    line = on_a_small_disk(
        small_disk, disk, gpt2_data, out, "--max_steps", "6", "--save_every", "2", "--keep_checkpoints", "1"
    )
    match = re.fullmatch(
        rf"error: cannot save checkpoint {ckpt(out, 4)}: {NO_SPACE}; the run stopped after step 4 and the previous "
        rf"checkpoint, {ckpt(out, 2)}, is intact: make room \(or fix the folder\), then continue with --resume auto",
        line,
    )
    assert match, line
    needed, free = (float(v.replace(",", "")) * 1e6 for v in match.groups())
    saved = folder_bytes(ckpt(out, 2))
    assert 0.95 * saved < needed < saved and free < needed  # what a save writes: weights and AdamW's moments
    assert (ckpt(out, 2) / fails_in).stat().st_size > free  # the file that could not be written
    assert checkpoints(out) == ["step_00000002"]
    assert load_model(ckpt(out, 2))[0].config.n_embd == 64  # intact: it loads (its checksums are checked on resume)


def test_final_weights_much_larger_than_the_space_left_are_one_line(gpt2_data: Path, small_disk: Path) -> None:
    """`tiny-cpu`'s 13 MB final weights on a 3 MB disk, without checkpoints: one line, exit 2, no temporary left."""
    out = small_disk / "run"
    line = on_a_small_disk(small_disk, "3m", gpt2_data, out, "--max_steps", "2", "--save_every", "0")
    match = re.fullmatch(
        rf"error: cannot write the final weights {out / 'model.safetensors'}: {NO_SPACE}; no checkpoint holds them "
        r"\(save_every 0\), so they are lost: make room, then train again",
        line,
    )
    assert match, line
    assert 13.0 < float(match.group(1)) < 13.6 and float(match.group(2)) < 3.2
    assert sorted(p.name for p in out.iterdir()) == [".lock", "accelerate_env.txt", "config.yaml", "metrics.jsonl", RUN]


def test_a_folder_turned_read_only_during_a_run_is_one_line(data: Path, small_disk: Path) -> None:
    """`checkpoints/` made read-only (a bind mount remounted ro) while the run is paused before step 3: the save of
    step 4 fails in one line naming the intact step 2, and the cleanup, which fails on a read-only folder too, adds
    no traceback."""
    subprocess.run(["mount", "-o", "remount,size=8m", str(small_disk)], check=True)  # room: only read-only fails
    out = small_disk / "run"
    args = flags(data, out, "--max_steps", "6", "--save_every", "2")
    folder = out / "checkpoints"
    try:
        with paused(1, "--pause_at 3", args, small_disk.parent) as p:
            subprocess.run(["mount", "--bind", str(folder), str(folder)], check=True)
            subprocess.run(["mount", "-o", "remount,bind,ro", str(folder)], check=True)
            assert p.finish() == 2, p.output[-3000:]
            output = p.output
    finally:
        subprocess.run(["umount", str(folder)], capture_output=True)
    assert "Traceback" not in output, output[-3000:]
    (line,) = errors(output)
    assert line == (
        f"error: cannot save checkpoint {ckpt(out, 4)}: {folder} has become read-only; the run stopped after step 4 "
        f"and the previous checkpoint, {ckpt(out, 2)}, is intact: make room (or fix the folder), then continue with "
        "--resume auto"
    )
    assert checkpoints(out) == ["step_00000002"]


@pytest.fixture(scope="module")
def saved_twice(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run with checkpoints at steps 2 and 4 (both kept)."""
    out = tmp_path_factory.mktemp("twice") / "run"
    train(data, out, "--max_steps", "4", "--save_every", "2", "--keep_checkpoints", "0")
    return out


def test_a_checkpoint_damaged_but_readable_is_refused_naming_the_one_before(saved_twice: Path, tmp_path: Path) -> None:
    """Bytes of step 4's weights changed in place (the file still loads): its marker's checksums catch it before
    anything is restored; one line names step 2, and resuming from step 2 by path works."""
    out = Path(shutil.copytree(saved_twice, tmp_path / "run"))
    weights = ckpt(out, 4) / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-8:] = bytes(8)  # the last float32 values of the last tensor: still a valid file
    weights.write_bytes(raw)
    assert load_file(str(weights))  # readable
    proc = train(data_of(out), out, "--max_steps", "6", "--save_every", "2", "--resume", "auto", check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert errors(proc.stderr) == [
        f"error: checkpoint {ckpt(out, 4)} is damaged: model.safetensors differs from the file it held when it was "
        f"saved (sha256); resume from the one before it by path: --resume {ckpt(out, 2)}"
    ]
    resumed = train(data_of(out), out, "--max_steps", "6", "--save_every", "2", "--resume", str(ckpt(out, 2)))
    assert f"resumed from {ckpt(out, 2)} at step 2" in resumed.stderr


def test_non_finite_weights_in_a_checkpoint_without_checksums_are_refused(saved_twice: Path, tmp_path: Path) -> None:
    """A checkpoint from before checksums were recorded, whose weights hold a NaN: refused after loading, before the
    first step, naming the one before it (a resume from it would diverge at once, and the divergence message would
    send the user back to it)."""
    out = Path(shutil.copytree(saved_twice, tmp_path / "run"))
    marker = ckpt(out, 4) / "COMPLETE"
    marker.write_text(json.dumps({k: v for k, v in json.loads(marker.read_text()).items() if k != "sha256"}))
    weights = ckpt(out, 4) / "model.safetensors"
    tensors = load_file(str(weights))
    name = sorted(tensors)[0]
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, str(weights))
    proc = train(data_of(out), out, "--max_steps", "6", "--save_every", "2", "--resume", "auto", check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert errors(proc.stderr) == [
        f"error: checkpoint {ckpt(out, 4)} is damaged: its weights hold NaN or infinite values; resume from the one "
        f"before it by path: --resume {ckpt(out, 2)}"
    ]


def data_of(run: Path) -> Path:
    return Path(yaml.safe_load((run / "config.yaml").read_text())["data_dir"])


def test_dist_timeout_turns_a_rank_that_never_comes_into_an_error(data: Path, tmp_path: Path) -> None:
    """Rank 0 paused before step 3 and never released: rank 1 waits in step 3's collectives, and with
    `--dist_timeout 5` its Gloo wait fails after 5 s, so the launcher tears the group down (exit non-zero) instead of
    both waiting for torch's 30 minutes."""
    out = tmp_path / "run"
    args = flags(data, out, "--max_steps", "6", "--save_every", "0", "--dist_timeout", "5")
    with paused(2, "--pause_at 3", args, tmp_path) as p:
        started = time.monotonic()
        code = p.proc.wait(timeout=120)
        waited = time.monotonic() - started
        output = p.output
    assert code != 0 and waited < 100, (code, waited, output[-3000:])
    assert "2 process(es) on cpu" in output
    assert "Timed out" in output or "timed out" in output or "Timeout" in output, output[-3000:]


# ------------------------------------------------------------------------------------------ 7. divergence


@pytest.mark.parametrize("processes", [1, 2])
def test_a_non_finite_loss_stops_the_run_and_names_what_then_trains(data: Path, tmp_path: Path, processes: int) -> None:
    """A learning rate of 1e6 without clipping or decay: step 1's update breaks the weights, so step 2's loss and
    gradient norm are NaN. The run stops there in one line on every rank (2 processes: no hang, one message), saves
    nothing of step 2 and no final weights. Step 1's checkpoint holds the broken weights, so the line does not send
    the user back to it: it says to train again, and doing so trains."""
    out = tmp_path / "run"
    diverge = ("--learning_rate", "1e6", "--weight_decay", "0", "--grad_clip", "0", "--warmup_steps", "0")
    diverge += ("--max_steps", "6")
    proc = train(data, out, *diverge, "--save_every", "1", "--log_every", "3", processes=processes, check=False)
    assert proc.returncode != 0, proc.stderr[-3000:]
    (line,) = errors(proc.stderr)
    assert line.startswith("error: training diverged at step 2 (loss nan"), line
    assert line.endswith(
        "no checkpoint was saved before it: train again with a lower --learning_rate and --overwrite true"
    )
    assert checkpoints(out) == ["step_00000001"]
    assert not (out / "model.safetensors").exists()
    assert [r["step"] for r in rows(out)] == [1, 2]
    if processes == 1:  # what the line says, done
        train(data, out, *diverge, "--learning_rate", "1e-3", "--overwrite", "true", "--save_every", "0")
        assert [r["step"] for r in rows(out)] == list(range(1, 7)) and (out / "model.safetensors").is_file()


def test_a_loss_above_a_uniform_guess_after_warm_up_is_warned_of_once(data: Path, tmp_path: Path) -> None:
    """A rate of 9 without clipping: the loss climbs far above ln 256 but stays finite, so the run goes on; on 2
    processes rank 0 warns once, at the first logged step past warm-up over ln V + 1, naming the remedy. The run at
    1e-3 says nothing of it."""
    too_high = ("--learning_rate", "9", "--grad_clip", "0", "--max_steps", "12", "--log_every", "1")
    proc = train(data, tmp_path / "run", *too_high, "--save_every", "0", processes=2)
    assert "| 2 process(es) on cpu" in proc.stderr
    said = r"WARNING .*step (\d+): loss ([\d.e+]+) is above a uniform guess's \(ln 256 = 5.545\): the updates are "
    said += r"breaking the weights; train again with a lower --learning_rate; --grad_clip 1 bounds each update"
    warned = re.findall(said, proc.stderr)
    assert len(warned) == 1, proc.stderr[-3000:]
    step, loss = int(warned[0][0]), float(warned[0][1])
    first = next(r for r in rows(tmp_path / "run") if r["step"] > 2 and r["loss"] > math.log(256) + 1)
    assert step == first["step"] and loss == pytest.approx(first["loss"], rel=1e-3)
    healthy = train(data, tmp_path / "healthy", "--max_steps", "12", "--save_every", "0")
    assert "uniform guess" not in healthy.stderr


def test_a_run_that_diverges_after_a_resume_names_the_checkpoint_that_trains_on(data: Path, tmp_path: Path) -> None:
    """3 good steps with a checkpoint each, then a resume at 1e6 saving every step until the loss of some step k is
    NaN: checkpoint k - 1 holds the weights that gave it, so the line names an earlier one, and resuming from it by
    path with a lower rate, as it says, trains to the end."""
    out = tmp_path / "run"
    train(data, out, "--max_steps", "3", "--save_every", "1", "--keep_checkpoints", "0")
    diverge = ("--learning_rate", "1e6", "--weight_decay", "0", "--grad_clip", "0", "--warmup_steps", "0")
    proc = train(data, out, *diverge, "--max_steps", "8", "--save_every", "1", "--keep_checkpoints", "0",
                 "--resume", "auto", check=False)  # fmt: skip
    (line,) = errors(proc.stderr)
    said = re.fullmatch(
        r"error: training diverged at step (\d+) \(loss nan, grad_norm nan\): stopped without saving its weights; the "
        r"newest checkpoint before it, (\S+), gave finite values: resume from it by path with a lower --learning_rate",
        line,
    )
    assert said is not None, line
    bad, named = int(said[1]), Path(said[2])
    assert named == ckpt(out, bad - 2) and ckpt(out, bad - 1).is_dir(), "the checkpoint just before holds the NaN"
    train(data, out, "--learning_rate", "1e-3", "--max_steps", "8", "--resume", str(named))
    assert [r["step"] for r in rows(out)] == list(range(1, 9)) and (out / "model.safetensors").is_file()


def test_a_diverged_muon_run_without_checkpoints_says_so_and_names_muons_rate(data: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    diverge = ("--learning_rate", "1e6", "--muon_lr", "1e6", "--weight_decay", "0", "--grad_clip", "0")
    diverge += ("--warmup_steps", "0")
    proc = train(data, out, *diverge, "--optimizer", "muon", "--max_steps", "6", "--save_every", "0", check=False)
    (line,) = errors(proc.stderr)
    assert line.startswith("error: training diverged at step "), proc.stderr[-3000:]
    assert line.endswith(
        "stopped without saving its weights; no checkpoint was saved before it: train again with a lower --muon_lr or "
        "--learning_rate and --overwrite true"
    )
    lower = ("--learning_rate", "1e-3", "--muon_lr", "0.02", "--overwrite", "true")  # what the line says, done
    train(data, out, *diverge, "--optimizer", "muon", "--max_steps", "6", "--save_every", "0", *lower)
    assert [r["step"] for r in rows(out)] == list(range(1, 7)) and (out / "model.safetensors").is_file()


# ------------------------------------------------------------------------------------------ 8. signals


def test_a_second_ctrl_c_aborts_without_saving(data: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    with paused(1, "--pause_at 4", flags(data, out, "--max_steps", "8", "--save_every", "3"), tmp_path) as p:
        p.signal(signal.SIGINT)
        p.wait_for(lambda: "SIGINT: finishing the current step" in p.output, "the first Ctrl-C to be taken")
        p.signal(signal.SIGINT)
        assert p.finish() == -signal.SIGINT
    assert checkpoints(out) == ["step_00000003"]
    assert "stop requested" not in p.output and not (out / "model.safetensors").exists()


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_under_accelerate_launch(data: Path, tmp_path: Path, presses: int) -> None:
    """What docs/checkpoints.md says a user sees: Ctrl-C reaches the launcher alone; it forwards SIGINT, the workers
    finish the step, save and exit 0, and torchrun still exits 1 with a SignalException traceback. A second Ctrl-C makes
    torchrun send SIGTERM, which after a SIGINT aborts: nothing more is saved. With log_every 5 the stop after step 4
    shows that a SIGINT, like a SIGTERM, does not wait for the next log step."""
    out = tmp_path / "run"
    args = flags(data, out, "--max_steps", "8", "--save_every", "3", "--log_every", "5")
    with paused(2, "--pause_at 4", args, tmp_path) as p:
        p.signal(signal.SIGINT, launcher_only=True)
        p.wait_for(lambda: "SIGINT: finishing the current step" in p.output, "the forwarded SIGINT")
        if presses == 2:
            p.signal(signal.SIGINT, launcher_only=True)
            p.wait_for(lambda: "closing signal SIGTERM" in p.output, "the launcher's SIGTERM")
        assert p.finish() == 1
    assert "SignalException: Process" in p.output and "got signal: 2" in p.output
    if presses == 1:
        assert "stop requested: stopped after step 4" in p.output, p.output[-4000:]
        assert checkpoints(out) == ["step_00000003", "step_00000004"]
    else:
        assert "stop requested" not in p.output and checkpoints(out) == ["step_00000003"]


# ------------------------------------------------------------------------------------------ 3. one run, one folder


def test_two_trainings_cannot_share_a_folder(data: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    with paused(1, "--pause_at 2", flags(data, out, "--max_steps", "4", "--save_every", "0"), tmp_path) as p:
        before = snapshot(out)
        for resume in ("auto", "none"):
            proc = train(data, out, "--resume", resume, "--max_steps", "4", check=False)
            assert proc.returncode == 2, proc.stderr[-3000:]
            (line,) = errors(proc.stderr)
            assert f"{out} is in use by pid {p.workers[0]} on " in line and "train refused" in line
        assert snapshot(out) == before
        assert p.finish() == 0
    assert [r["step"] for r in rows(out)] == [1, 2, 3, 4]


def test_workers_stop_and_save_when_their_launcher_is_killed(data: Path, tmp_path: Path) -> None:
    """SIGKILL of the launcher's process group alone: the workers (in their own sessions) would train on as
    orphans. They notice after the step they are in, save it and exit."""
    out = tmp_path / "run"
    with paused(2, "--pause_at 4", flags(data, out, "--max_steps", "30", "--save_every", "3"), tmp_path) as p:
        p.signal(signal.SIGKILL, launcher_only=True)
        assert p.proc.wait(timeout=60) == -signal.SIGKILL  # gone (its workers re-parented) before step 4 runs
        p.finish()  # waits for both workers to exit
    assert "is gone: finishing the current step, then saving and exiting" in p.output
    assert "stop requested: stopped after step 4" in p.output, p.output[-4000:]
    assert checkpoints(out) == ["step_00000003", "step_00000004"]


# ------------------------------------------------------------------------------------------ 9. launches


MULTI_CPU_WIZARD = """compute_environment: LOCAL_MACHINE
debug: false
distributed_type: MULTI_CPU
downcast_bf16: 'no'
machine_rank: 0
main_training_function: main
mixed_precision: 'no'
mpirun_config: {}
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
"""


@pytest.mark.parametrize("how", ["num_processes_without_multi_gpu", "multi_cpu_config"])
def test_a_launch_that_starts_one_of_several_processes_is_refused(data: Path, tmp_path: Path, how: str) -> None:
    """On a machine without GPUs both launches start ONE process, which would train alone."""
    if how == "multi_cpu_config":
        (tmp_path / "multi_cpu.yaml").write_text(MULTI_CPU_WIZARD)
        launch = ["--config_file", str(tmp_path / "multi_cpu.yaml")]
    else:
        launch = ["--num_machines", "1", "--mixed_precision", "no", "--num_processes", "2"]
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *launch, "run.py", "train", *flags(data, out)]
    proc = run_cmd(cmd, check=False, timeout=180)
    assert proc.returncode != 0
    (line,) = errors(proc.stderr)
    assert "asked for several processes but started one" in line
    assert "--config_file accelerate_configs/cpu_2proc.yaml" in line
    assert not out.exists()


def test_an_error_of_a_two_process_launch_is_printed_once(data: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = train(data, out, "--total_batch_size", "96", processes=2, check=False)
    assert proc.returncode != 0
    (line,) = errors(proc.stderr)
    assert "total_batch_size=96 is not a multiple of micro_batch_size*seq_len*world_size=64" in line
    assert not out.exists()
