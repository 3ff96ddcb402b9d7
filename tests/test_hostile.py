"""Files the product reads, made hostile: each damage found by an adversarial pass that once went through (a traceback
or a silent wrong result) is now one `error:` line, exit 2, through the command line, and nothing is written."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType
from conftest import HELLASWAG, python_cmd, run_cmd, write_token_shards
from safetensors.torch import load_file, save_file

from accel_gpt.cli import main
from accel_gpt.errors import UserError
from accel_gpt.workarounds import forget_previous_precision

VOCAB = 64
TINY = ["--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--seq_len", "16", "--vocab_size", str(VOCAB)]
TINY += ["--micro_batch_size", "2", "--total_batch_size", "32", "--log_with", "none", "--sample_tokens", "0"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, shakespeare_tokens: list[int]) -> Path:
    tokens = [t % VOCAB for t in shakespeare_tokens[:6_000]]
    return write_token_shards(tmp_path_factory.mktemp("hostile") / "data", tokens[:5_000], tokens[5_000:], 2_500, VOCAB)


@pytest.fixture(scope="module")
def run(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 steps, checkpoints at 2 and 4, final weights. Tests copy it before damaging anything."""
    out = tmp_path_factory.mktemp("run") / "run"
    flags = ["--max_steps", "4", "--save_every", "2", "--eval_every", "2", "--eval_windows", "4"]
    run_cmd(python_cmd("train", *TINY, *flags, "--data_dir", str(data), "--out_dir", str(out)))
    return out


def one_error(capsys: pytest.CaptureFixture, *argv: str) -> str:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    assert exc.value.code == 2
    lines = [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def copy(folder: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(folder, tmp_path / folder.name))


def edit_json(path: Path, change) -> None:
    value = json.loads(path.read_text())
    change(value)
    path.write_text(json.dumps(value))


# -------------------------------------------------------------------------------------------- configs and data


def test_a_key_given_twice_in_a_config_file(capsys, tmp_path: Path, data: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("n_layer: 2\nn_head: 2\nn_layer: 3\n")
    err = one_error(capsys, "train", "--config", str(config), "--data_dir", str(data), "--out_dir", str(tmp_path / "o"))
    assert err == f"error: {config} sets n_layer twice: keep one (YAML would silently take the last)"
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda m: m["splits"]["train"].append(m["splits"]["train"][0]), "shard train_000000.bin is listed twice"),
        (lambda m: m.setdefault("tokens", {}).update(train=1), "tokens.train says 1 but the train shards listed"),
        (lambda m: m["splits"].update(val=[]), "split 'val' lists no shards"),
    ],
    ids=["shard-twice", "token-count", "empty-split"],
)
def test_a_manifest_that_contradicts_itself(capsys, tmp_path: Path, data: Path, damage, message: str) -> None:
    bad = copy(data, tmp_path)
    edit_json(bad / "manifest.json", damage)
    err = one_error(capsys, "train", *TINY, "--data_dir", str(bad), "--out_dir", str(tmp_path / "o"))
    assert message in err and str(bad / "manifest.json") in err
    assert not (tmp_path / "o").exists()


def test_the_data_folder_as_out_dir(capsys, tmp_path: Path, data: Path) -> None:
    folder = copy(data, tmp_path)
    before = sorted(p.name for p in folder.iterdir())
    err = one_error(capsys, "train", *TINY, "--data_dir", str(folder), "--out_dir", str(folder))
    assert err == f"error: out_dir {folder} is the data folder {folder}: give the run a folder of its own"
    assert sorted(p.name for p in folder.iterdir()) == before


def test_a_shape_far_too_large_is_refused_before_it_is_built(capsys, tmp_path: Path, data: Path) -> None:
    """1,000 blocks of 4,096: building them alone would take minutes before any memory check could run."""
    shape = ["--n_layer", "1000", "--n_embd", "4096", "--n_head", "32"]
    err = one_error(capsys, "train", *TINY, *shape, "--data_dir", str(data), "--out_dir", str(tmp_path / "o"))
    assert err.startswith("error: this run needs about ") and "--check_memory false" in err


def test_a_second_run_in_one_process_may_train_in_another_precision(tmp_path: Path, data: Path) -> None:
    """Accelerate keeps the first run's mixed precision process-wide; a second run in the same process (a notebook,
    these tests) that trains in another, as `auto` chooses for a wider model on a CPU with bf16 units, still starts."""
    for i, precision in enumerate(("no", "bf16", "no")):
        out = tmp_path / f"run{i}"
        main(["train", *TINY, "--max_steps", "1", "--mixed_precision", precision, "--eval_every", "0", "--data_dir",
              str(data), "--out_dir", str(out), "--resume", "none"])  # fmt: skip
        assert yaml.safe_load((out / "config.yaml").read_text())["mixed_precision"] == precision


@pytest.mark.parametrize(("launch", "cleared"), [("no", True), ("bf16", False)])
def test_the_launch_s_precision_is_what_a_run_without_its_own_is_compared_with(
    monkeypatch: pytest.MonkeyPatch, launch: str, cleared: bool
) -> None:
    """`eval` asks for no precision: after an in-process bf16 run it gets the launch's, as a new process would; under
    FSDP, whose state Accelerate cannot rebuild in one process, a change is refused in one line."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launch)
    state = {"_mixed_precision": "bf16", "distributed_type": DistributedType.NO}
    monkeypatch.setattr(AcceleratorState, "_shared_state", state)
    forget_previous_precision(None)
    assert (state == {}) is cleared
    state.update(_mixed_precision="bf16", distributed_type=DistributedType.FSDP)
    with pytest.raises(UserError, match=r"in a new process$"):
        forget_previous_precision("fp16")


# ------------------------------------------------------------------------------------------------ weights


def test_weights_that_hold_nan_are_refused_by_eval_sample_and_export(
    capsys, tmp_path: Path, run: Path, data: Path
) -> None:
    bad = copy(run, tmp_path)
    weights = load_file(str(bad / "model.safetensors"))
    weights["transformer.h.0.mlp.c_fc.weight"][0, 0] = float("nan")
    save_file(weights, str(bad / "model.safetensors"))
    said = f"error: {bad / 'model.safetensors'} holds NaN or infinite values (transformer.h.0.mlp.c_fc.weight)"
    for argv in (["eval", "--data_dir", str(data)], ["sample", "--max_new_tokens", "4"], ["export"]):
        extra = ["--out_dir", str(tmp_path / "hf")] if argv == ["export"] else []
        err = one_error(capsys, argv[0], "--checkpoint", str(bad), *argv[1:], *extra)
        assert err.startswith(said), err
    assert not (tmp_path / "hf").exists()


def test_a_checkpoint_whose_weights_are_not_those_it_saved(capsys, tmp_path: Path, run: Path, data: Path) -> None:
    """Step 2's weights copied over step 4's: they still load, but eval would report them as step 4's."""
    bad = copy(run, tmp_path)
    step2, step4 = bad / "checkpoints" / "step_00000002", bad / "checkpoints" / "step_00000004"
    shutil.copy(step2 / "model.safetensors", step4 / "model.safetensors")
    err = one_error(capsys, "eval", "--checkpoint", str(step4), "--data_dir", str(data))
    assert err == (
        f"error: checkpoint {step4} is damaged: model.safetensors differs from the file it held when it was saved "
        "(sha256); use another checkpoint"
    )


def test_a_checkpoint_without_its_marker(capsys, tmp_path: Path, run: Path, data: Path) -> None:
    bad = copy(run, tmp_path)
    step4 = bad / "checkpoints" / "step_00000004"
    (step4 / "COMPLETE").unlink()
    err = one_error(capsys, "eval", "--checkpoint", str(step4), "--data_dir", str(data))
    assert err == f"error: checkpoint {step4} is incomplete (no readable COMPLETE marker: its save did not finish)"


def test_a_model_config_of_another_shape(capsys, tmp_path: Path, run: Path, data: Path) -> None:
    bad = copy(run, tmp_path)
    edit_json(bad / "model_config.json", lambda c: c["model"].update(n_embd=64))
    err = one_error(capsys, "eval", "--checkpoint", str(bad), "--data_dir", str(data))
    assert err.startswith(f"error: {bad / 'model.safetensors'} does not match its model_config.json: transformer.")
    assert err.endswith(" is (96,) there, but (192,) in the model it describes"), err


def test_a_transformers_folder_whose_weights_lack_a_block(tmp_path: Path) -> None:
    """transformers would fill the missing block with random weights and only warn (its own process: transformers'
    logging keeps the stream of the first test that imported it)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path / "gpt2-tiny"
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=16, vocab_size=50_257)).save_pretrained(
        folder
    )
    weights = load_file(str(folder / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if ".h.1." not in k}, str(folder / "model.safetensors"))
    proc = run_cmd(python_cmd("sample", "--checkpoint", str(folder), "--max_new_tokens", "2"), check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    (err,) = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert err.startswith(f"error: '{folder}': its weights do not fill the model its config.json describes (lacks ")


# ---------------------------------------------------------------------------------------------- HellaSwag


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda rows: rows + rows[:1], "line 6: example ind=0 again (first at"),
        (lambda rows: [rows[0] | {"endings": ["a", " ", "b", "c"]}, *rows[1:]], "line 1: ending 1 is empty"),
    ],
    ids=["a-row-twice", "an-empty-ending"],
)
def test_hellaswag_rows_that_would_score_wrong(capsys, tmp_path: Path, damage, message: str) -> None:
    rows = [json.loads(line) for line in HELLASWAG.read_text().splitlines()[:5]]
    rows = [row | {"ind": i} for i, row in enumerate(rows)]
    bad = tmp_path / "hs.jsonl"
    bad.write_text("".join(json.dumps(row) + "\n" for row in damage(rows)))
    torch.manual_seed(0)
    err = one_error(capsys, "eval", "--checkpoint", "no-such-org/never", "--hellaswag", str(bad))
    assert message in err and str(bad) in err


# ------------------------------------------------------------------------------------------------ resumes


def test_a_resume_past_max_steps(capsys, tmp_path: Path, run: Path, data: Path) -> None:
    """max_steps below the checkpoint's step: the run would end at once and say "finished at step 4/2"."""
    out = copy(run, tmp_path)
    before = (out / "config.yaml").read_bytes()
    args = [*TINY, "--data_dir", str(data), "--out_dir", str(out), "--max_steps", "2", "--resume", "auto"]
    args += ["--save_every", "2", "--eval_every", "2", "--eval_windows", "4"]
    err = one_error(capsys, "train", *args)
    step4 = out / "checkpoints" / "step_00000004"
    assert err == (
        f"error: cannot resume from {step4}: it is at step 4, past max_steps=2; set --max_steps above 4 to train on, "
        "or use its weights as they are"
    )
    assert (out / "config.yaml").read_bytes() == before


def test_a_damaged_pickle_is_named_as_damage_before_it_is_unpickled(
    capsys, tmp_path: Path, run: Path, data: Path
) -> None:
    """Random bytes in a checkpoint's random state: the checksum says which checkpoint to go back to, before
    torch's unpickler would call them an unsafe file."""
    out = copy(run, tmp_path)
    step2, step4 = out / "checkpoints" / "step_00000002", out / "checkpoints" / "step_00000004"
    (step4 / "random_states_0.pkl").write_bytes(bytes(range(256)) * 4)
    args = [*TINY, "--data_dir", str(data), "--out_dir", str(out), "--max_steps", "6", "--resume", "auto"]
    err = one_error(capsys, "train", *args, "--save_every", "2", "--eval_every", "2", "--eval_windows", "4")
    assert err == (
        f"error: checkpoint {step4} is damaged: random_states_0.pkl differs from the file it held when it was saved "
        f"(sha256); resume from the one before it by path: --resume {step2}"
    )


def test_a_file_given_as_data_dir(capsys, tmp_path: Path, data: Path) -> None:
    file = data / "manifest.json"
    err = one_error(capsys, "train", *TINY, "--data_dir", str(file), "--out_dir", str(tmp_path / "o"))
    assert err == f"error: data_dir '{file}' is a file; give the folder `run.py prepare` wrote"


# ------------------------------------------------------------------------------------------ every file, every damage
# Each file a command reads, damaged each way a disk, a crash or a hand damages one, given to the commands that read
# it: the command works (a file it can do without) or says so in one `error:` line, exit 2; never a traceback. The
# files are listed from the folders as written, so a file the product starts to write is walked as soon as it exists.

DAMAGES = ("missing", "empty", "truncated", "a folder", "another run's")


def damage(path: Path, how: str, other: Path) -> None:
    data = path.read_bytes()
    if how == "another run's":
        if not other.is_file():
            pytest.skip(f"the other run has no {other.name}")
        shutil.copyfile(other, path)
        return
    path.unlink()
    if how == "empty":
        path.write_bytes(b"")
    elif how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "a folder":
        path.mkdir()


def outcome(capsys: pytest.CaptureFixture, argv: list[str]) -> str | None:
    """None when the command worked or said what was wrong in one line (exit 2); otherwise what it did instead."""
    capsys.readouterr()
    try:
        main(argv)
    except SystemExit as e:
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
        return None if e.code == 2 and len(lines) == 1 else f"exit {e.code}, error lines {lines}"
    except Exception as e:  # noqa: BLE001 - what the test looks for
        return f"{type(e).__name__}: {e}"[:300]
    return None


@pytest.fixture(scope="module")
def other_run(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same shape and schedule as `run`, another seed: its files are another run's."""
    out = tmp_path_factory.mktemp("other") / "run"
    flags = ["--max_steps", "4", "--save_every", "2", "--eval_every", "2", "--eval_windows", "4", "--seed", "8"]
    run_cmd(python_cmd("train", *TINY, *flags, "--data_dir", str(data), "--out_dir", str(out)))
    return out


@pytest.fixture(scope="module")
def other_data(tmp_path_factory: pytest.TempPathFactory, shakespeare_tokens: list[int]) -> Path:
    """Shards of other text in the same vocabulary: another prepare's files."""
    tokens = [t % VOCAB for t in shakespeare_tokens[6_000:12_000]]
    return write_token_shards(tmp_path_factory.mktemp("other") / "data", tokens[:5_000], tokens[5_000:], 2_500, VOCAB)


FOLDERS = {  # what is damaged, and the commands that read it (given the copies: run, data, a new folder)
    "run": lambda run, data, new: [["export", "--checkpoint", str(run), "--out_dir", str(new)]],
    "checkpoints/step_00000004": lambda run, data, new: [
        ["export", "--checkpoint", str(run / "checkpoints" / "step_00000004"), "--out_dir", str(new)],
        [
            "train",
            *TINY,
            "--data_dir",
            str(data),
            "--out_dir",
            str(run),
            "--max_steps",
            "5",
            "--save_every",
            "0",
            "--eval_every",
            "0",
            "--resume",
            str(run / "checkpoints" / "step_00000004"),
        ],
    ],  # fmt: skip
    "data": lambda run, data, new: [
        ["eval", "--checkpoint", str(run), "--data_dir", str(data), "--eval_windows", "4"],
        [
            "train",
            *TINY,
            "--data_dir",
            str(data),
            "--out_dir",
            str(new),
            "--max_steps",
            "1",
            "--save_every",
            "0",
            "--eval_every",
            "0",
        ],
    ],  # fmt: skip
}


@pytest.mark.slow
@pytest.mark.parametrize("how", DAMAGES)
@pytest.mark.parametrize("folder", FOLDERS)
def test_every_file_a_command_reads_damaged_every_way(
    capsys, tmp_path: Path, run: Path, other_run: Path, data: Path, other_data: Path, folder: str, how: str
) -> None:
    source = {"run": run, "data": data}.get(folder, run / folder)
    files = sorted(p.relative_to(source) for p in source.iterdir() if p.is_file())
    assert files, source
    failures = []
    for i, name in enumerate(files):
        copies = tmp_path / str(i)
        run_copy, data_copy = copy(run, copies), copy(data, copies)
        target = {"run": run_copy, "data": data_copy}.get(folder, run_copy / folder) / name
        counterpart = {"run": other_run, "data": other_data}.get(folder, other_run / folder) / name
        damage(target, how, counterpart)
        for argv in FOLDERS[folder](run_copy, data_copy, copies / "new"):
            said = outcome(capsys, argv)
            if said is not None:
                failures.append(f"{folder}/{name} {how}, {argv[0]}: {said}")
    assert not failures, "\n".join(failures)


def test_a_metrics_file_that_cannot_take_rows_is_said_before_the_first_step(
    capsys, tmp_path: Path, run: Path, data: Path
) -> None:
    """metrics.jsonl a folder, or a link to nowhere: a resume said so only as a traceback, once a row was due."""
    args = [*TINY, "--data_dir", str(data), "--max_steps", "6", "--resume", "auto"]
    args += ["--save_every", "2", "--eval_every", "2", "--eval_windows", "4"]
    for what in ("a folder", "not a file (a link to nowhere?)"):
        out = copy(run, tmp_path / what.split()[0])
        (out / "metrics.jsonl").unlink()
        if what == "a folder":
            (out / "metrics.jsonl").mkdir()
        else:
            (out / "metrics.jsonl").symlink_to(tmp_path / "nowhere" / "metrics.jsonl")
        err = one_error(capsys, "train", *args, "--out_dir", str(out))
        said = f"{out / 'metrics.jsonl'} is {what}, where the run writes its metrics rows"
        assert err == f"error: {said}: move it aside and run again"


def test_the_advice_for_a_data_folder_without_its_manifest_works(capsys, tmp_path: Path, run: Path, data: Path) -> None:
    """Shards without manifest.json: the line names a prepare command into a new folder (this one holds files, which
    prepare refuses to mix with), and that command, done as it says, makes data that eval then reads."""
    damaged = copy(data, tmp_path)
    (damaged / "manifest.json").unlink()
    err = one_error(capsys, "eval", "--checkpoint", str(run), "--data_dir", str(damaged))
    command = re.search(r"`run\.py (prepare --preset NAME --out_dir \S+)`", err)
    assert command and err.endswith(f", a new folder since {damaged} holds other files"), err
    argv = command.group(1).replace("NAME", "tinyshakespeare").split()
    main([*argv, "--val_tokens", "2000"])
    capsys.readouterr()
    out = argv[-1]
    assert Path(out) == Path(f"{damaged}-prepared") and (Path(out) / "manifest.json").is_file()


# Files and folders the process may not read or write (mode bits: another user's file, a read-only copy): the command
# works where it does not need them, or says so in one `error:` line naming the file, never a traceback. Run by a
# worker that file modes bind even under root (`tests/workers/bound_by_permissions.py`).


def resumed(run: Path, data: Path, *extra: str) -> list[str]:
    """`train --resume auto` of `run` to step 6: a command that reads the whole run and writes into it."""
    where = ["--data_dir", str(data), "--out_dir", str(run)]
    return ["train", *TINY, *where, "--max_steps", "6", "--resume", "auto", *extra]


UNWRITABLE = {  # (what, mode): the commands that write there
    ("run", "555"): lambda run, data, new: [resumed(run, data)],
    ("run/metrics.jsonl", "444"): lambda run, data, new: [resumed(run, data)],
    ("run/checkpoints", "555"): lambda run, data, new: [resumed(run, data, "--save_every", "6")],
    ("new", "555"): lambda run, data, new: [
        ["export", "--checkpoint", str(run), "--out_dir", str(new / "x")],
        ["train", *TINY, "--data_dir", str(data), "--out_dir", str(new / "x"), "--max_steps", "1"],
    ],
}


@pytest.mark.slow
def test_files_the_process_may_not_read_or_write_are_named_in_one_line(
    capsys, tmp_path: Path, run: Path, data: Path
) -> None:
    """A command that refuses even the intact folders (export of this char-token run) may say the same again."""
    cases, where, pristine = [], [], []

    def add(i: int, target: Path, mode: str, argvs: list[list[str]]) -> None:
        for argv in argvs:
            cases.append({"path": str(target), "mode": mode, "argv": argv})
            where.append(f"{target.relative_to(tmp_path / str(i))} {mode}, {argv[0]}")
            pristine.append(outcome_of(argv, tmp_path / str(i)))

    def outcome_of(argv: list[str], root: Path) -> str | None:
        """The error line of `argv` on intact copies (its paths from ROOT), or None where it works."""
        base = tmp_path / "intact"
        shutil.rmtree(base, ignore_errors=True)
        shutil.copytree(root, base, symlinks=True)
        capsys.readouterr()
        try:
            main([a.replace(str(root), str(base)) for a in argv])
        except SystemExit:
            return capsys.readouterr().err.strip().splitlines()[-1].replace(str(base), "ROOT")
        return None

    readers = {
        **FOLDERS,
        "run": lambda r, d, new: [
            *FOLDERS["run"](r, d, new),
            ["eval", "--checkpoint", str(r), "--data_dir", str(d), "--eval_windows", "4"],
            ["sample", "--checkpoint", str(r), "--max_new_tokens", "2"],
            resumed(r, d),
        ],
    }
    i = 0
    for folder, commands in readers.items():
        source = {"run": run, "data": data}.get(folder, run / folder)
        for name in sorted(p.name for p in source.iterdir() if not p.name.startswith(".")):
            i += 1
            run_copy, data_copy = copy(run, tmp_path / str(i)), copy(data, tmp_path / str(i))
            base = {"run": run_copy, "data": data_copy}.get(folder, run_copy / folder)
            add(i, base / name, "000", commands(run_copy, data_copy, tmp_path / str(i) / "new"))
    for (what, mode), commands in UNWRITABLE.items():
        i += 1
        run_copy, data_copy, new = (
            copy(run, tmp_path / str(i)),
            copy(data, tmp_path / str(i)),
            tmp_path / str(i) / "new",
        )
        new.mkdir()
        add(i, tmp_path / str(i) / what, mode, commands(run_copy, data_copy, new))
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    worker = [sys.executable, "tests/workers/bound_by_permissions.py", str(tmp_path / "cases.json")]
    run_cmd([*worker, str(tmp_path / "out.json")], timeout=900)
    failures = []
    results = json.loads((tmp_path / "out.json").read_text())
    for case, said, at, expected in zip(cases, results, where, pristine, strict=True):
        errors = [line for line in said["stderr"] if line.startswith("error: ")]
        named = errors and Path(case["path"]).name in errors[0]
        root = str(tmp_path / Path(case["path"]).relative_to(tmp_path).parts[0])
        as_intact = errors and errors[0].replace(root, "ROOT") == expected
        if said["code"] == 0 or (said["code"] == 2 and len(errors) == 1 and (named or as_intact)):
            continue
        failures.append(f"{at}: exit {said['code']}, {(errors or said['stderr'][-1:])}"[:400])
    assert not failures, "\n".join(failures)
