"""The manual, executed: the README's quick start end to end, and every other command of the README and docs/.

Commands are read out of the pages, so the manual cannot drift from the code. Those that run on a CPU without
internet run here as written (only the input paths substituted, fewer training steps, and a free port for
`accelerate launch`), each read from the page that now holds it. Those that need internet or GPUs are checked as far
as a CPU allows: each one parses with the real parsers (ours, Accelerate's launcher, torchrun's), its config files
load and its training config resolves. A new kind of command added to a page fails
`test_every_command_of_the_manual_is_checked` until it is handled here.

The quick start runs once per module (the fixture) in a scratch folder; the other tests reuse its data
and run directory. `make quickstart` runs it too, on a fresh copy of the repository, offline and without tiktoken's
GPT-2 files (the quick start's tokenizer is learned from the text).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import shlex
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from accel_gpt.errors import UserError
from tests.conftest import HELLASWAG, REPO, SHAKESPEARE, subprocess_env

README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
SUBSTITUTE = {"path/to/input.txt": str(SHAKESPEARE), "path/to/hellaswag_val.jsonl": str(HELLASWAG)}
# The preset's 100 steps take a minute; 3 steps and a short last evaluation show every part working.
FEW_STEPS = ["--max_steps", "3", "--log_every", "1", "--eval_steps", "2"]
# Commands without a process group of their own run inside pytest (the same argv through the same main()),
# which saves a torch import per command; training and evaluation build an Accelerator and run as processes.
IN_PROCESS = ("sample", "plot", "export")
# Shell variables the SLURM script uses, with plausible values for parsing.
SHELL_VARS = {"SLURM_NNODES": "2", "SLURM_NODEID": "1", "MAIN_ADDR": "10.0.0.1"}
# Commands that are not ours to parse, each with where it is exercised.
OTHER_COMMANDS = {
    "accelerate config": "interactive wizard; its non-interactive twin runs in test_accelerate_config_default",
    "accelerate config default": "test_accelerate_config_default",
    "accelerate env": "test_accelerate_config_default (the trainer saves its report as accelerate_env.txt)",
    "tensorboard --logdir runs/tiny-cpu/logs": "TensorBoard's own CLI (the tensorboard extra)",
    "python -m pytest -q": "what `make test` runs (test_the_two_commands_are_the_readmes_first_and_ci_calls_...)",
    'python -m pytest -q -m "not slow"': "the fast subset (test_the_two_commands_are_the_readmes_first_and_ci_...)",
    "python3 -m venv .venv": "the standard library's venv",
    "source .venv/bin/activate": "the shell's source of the venv",
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu": "torch's CPU build (pytorch.org)",
    'export MAIN_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)': "SLURM: the first node's name",
    "lm_eval --model hf --model_args pretrained=exports/tiny-cpu-128 --tasks hellaswag": (
        "lm-evaluation-harness's CLI (reads the hub); run offline against `run.py eval` in bench/RESULTS.md"
    ),
    "lm_eval --model hf --model_args pretrained=exports/tiny-cpu-128 --tasks hellaswag_local --include_path "
    "lm_eval_tasks": "its offline twin: test_export_card.py::test_the_offline_lm_eval_recipe_scores_an_export",
    'llama-completion -m exports/tiny-cpu-gguf/model.gguf -no-cnv -p "ROMEO:" -n 40': (
        "llama.cpp's CLI; llama.cpp itself runs the file in test_the_gguf_export_runs_in_llama_cpp, test_gguf.py"
    ),
    'ollama create tiny-cpu -f exports/tiny-cpu-gguf/Modelfile && ollama run tiny-cpu "ROMEO:"': (
        "ollama's CLI (not on a CI machine); the Modelfile's lines: test_gguf.py"
    ),
}


# ------------------------------------------------------------------------------------------ reading the pages


def code_blocks(text: str, language: str) -> list[tuple[int, str]]:
    """(offset, body) of every fenced block in `language`."""
    return [(m.start(), m.group(1)) for m in re.finditer(rf"^```{language}\n(.*?)^```", text, re.M | re.S)]


def block_commands(body: str) -> list[str]:
    """Command lines of a bash block: continuation lines joined, comments, blanks and SBATCH headers dropped."""
    joined = re.sub(r"\\\n\s*", " ", body)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def page_commands(page: Path) -> list[str]:
    return [cmd for _, body in code_blocks(page.read_text(), "bash") for cmd in block_commands(body)]


def quickstart_commands() -> list[str]:
    text = README.read_text()
    marker = text.index("<!-- quickstart")
    offset, body = next((o, b) for o, b in code_blocks(text, "bash") if o > marker)
    assert text[marker:offset].count("\n") == 1, "the quickstart marker must sit right above its bash block"
    return block_commands(body)


def doc_command(page: str, prefix: str, contains: str = "") -> str:
    """The one command of `page` (relative to the repository) starting with `prefix` (and holding `contains`), or
    `prefix` itself when it is a whole command there: the test runs what users read where they read it."""
    commands = page_commands(REPO / page)
    if prefix in commands and not contains:
        return prefix
    found = [c for c in commands if c.startswith(prefix) and contains in c]
    assert len(found) == 1, f"expected one command '{prefix} ... {contains}' in {page}, found {found}"
    return found[0]


def python_snippet(page: str, contains: str) -> str:
    (snippet,) = [body for _, body in code_blocks((REPO / page).read_text(), "python") if contains in body]
    return snippet


# ------------------------------------------------------------------------------------------ running

QuickStart = tuple[Path, dict[str, str]]


def to_argv(command: str, extra: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """A command of the manual as argv for this interpreter (+ leading VAR=value assignments as env)."""
    for placeholder, real in SUBSTITUTE.items():
        command = command.replace(placeholder, real)
    words = shlex.split(command)
    env = {}
    while re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    if words[0] == "python":
        words[0] = sys.executable
    elif words[0] == "accelerate":
        words[:1] = [sys.executable, "-m", "accelerate.commands.accelerate_cli"]
    words = [str(REPO / w) if w == "run.py" or w.startswith("accelerate_configs/") else w for w in words]
    if "launch" in words:  # a free port: other test runs on this machine may hold accelerate's default one
        at = words.index("launch") + 1
        words[at:at] = ["--main_process_port", str(_free_port())]
    return words + (extra or []), env


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_documented(
    command: str, cwd: Path, extra: list[str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess:
    """Run a command of the manual in `cwd`, failing with its output shown. Accelerate's default config is looked up in
    `cwd/hf_home`, never the user's, and ACCELERATE_USE_CPU is unset so the configs work as they would for a user."""
    argv, env_vars = to_argv(command, extra)
    env = subprocess_env(HF_HOME=str(cwd / "hf_home"), **env_vars)
    env.pop("ACCELERATE_USE_CPU", None)
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(
            f"command of the manual failed ({proc.returncode}): {command}\n--- stdout\n{proc.stdout[-3000:]}"
            f"\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def run_in_process(command: str, cwd: Path) -> str:
    """A `python run.py ...` command of the manual through accel_gpt.cli.main in `cwd`; returns what it printed.

    One torch thread, like the launched processes (OMP_NUM_THREADS=1): on a shared 2-core machine two
    threads spin against other tests' processes and made token-by-token sampling 3x slower."""
    import torch

    from accel_gpt.cli import main

    words = to_argv(command)[0]
    assert words[:2] == [sys.executable, str(REPO / "run.py")], command
    stdout = io.StringIO()
    previous, threads = os.getcwd(), torch.get_num_threads()
    os.chdir(cwd)
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stdout(stdout):
            main(words[2:])
    finally:
        os.chdir(previous)
        torch.set_num_threads(threads)
    return stdout.getvalue()


def run_any(command: str, cwd: Path, extra: list[str] | None = None) -> str:
    """stdout of a command of the manual, run in-process where it can be (IN_PROCESS), else as its own process."""
    if shlex.split(command)[2] in IN_PROCESS and not extra:
        return run_in_process(command, cwd)
    return run_documented(command, cwd, extra).stdout


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory: pytest.TempPathFactory) -> QuickStart:
    """The README's quick start, run in a scratch folder; what each command printed (train: its stderr)."""
    work = tmp_path_factory.mktemp("quickstart")
    outputs = {}
    for command in quickstart_commands():
        subcommand = shlex.split(command)[2]
        if subcommand == "train":
            outputs[subcommand] = run_documented(command, work, FEW_STEPS).stderr  # progress and summary
        else:
            outputs[subcommand] = run_any(command, work)
    return work, outputs


# ------------------------------------------------------------------------------------------ quick start


@pytest.mark.slow
def test_quickstart_runs_end_to_end(quickstart: QuickStart) -> None:
    work, outputs = quickstart
    assert [shlex.split(c)[2] for c in quickstart_commands()] == ["prepare", "train", "sample", "plot"]
    manifest = json.loads((work / "data" / "shakespeare" / "manifest.json").read_text())
    assert manifest["tokenizer"] == "bpe" and manifest["vocab_size"] == 8192
    assert manifest["tokens"] == {"train": 255_405, "val": 29_000}  # the README's counts
    assert manifest["source"]["dataset"].endswith("tinyshakespeare.txt")  # the bundled text: no --dataset given

    run = work / "runs" / "tiny-cpu"
    files = ("config.yaml", "metrics.jsonl", "accelerate_env.txt", "model.safetensors", "model_config.json")
    for name in (*files, "tokenizer.json"):
        assert (run / name).is_file(), name
    assert (run / "checkpoints" / "step_00000003" / "COMPLETE").is_file()
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert abs(rows[0]["loss"] - math.log(8192)) < 0.5  # an untrained model guesses about uniformly
    assert "val_loss" in rows[-1]  # evaluation fires on the last step
    assert "finished at step 3/3" in outputs["train"] and "run dir runs/tiny-cpu" in outputs["train"]
    peak, estimated = re.search(r"peak memory (\d+) MB \(estimated (\d+) MB\)", outputs["train"]).groups()
    # Identical runs peak at 61-106 MB against 114 estimated (the allocator's kept buffers vary run to run; AVX2
    # EPYC, 19 runs; CI saw 67): the bound catches an estimate twice the need, or one the run outgrows.
    assert 0.5 < int(peak) / int(estimated) < 1.25, (peak, estimated)  # before the runtime's 40 MB: 1.46

    sample = outputs["sample"]
    assert sample.startswith("ROMEO:") and len(sample) > len("ROMEO:") + 20
    assert outputs["plot"] == "wrote runs/tiny-cpu.png (1 run, up to step 3)\n"
    assert (run.parent / "tiny-cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_eval_on_local_hellaswag(quickstart: QuickStart) -> None:
    work, _ = quickstart
    command = doc_command("docs/evaluation.md", "python run.py eval", "path/to/hellaswag_val.jsonl")
    out = run_documented(command, work).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["total"] == 50 and result["num_processes"] == 1
    assert 0 <= result["acc_norm"] <= 1 and result["correct_norm"] == round(result["acc_norm"] * 50)
    assert math.isfinite(result["val_loss"])


@pytest.mark.slow
def test_sample_with_seed(quickstart: QuickStart) -> None:
    work, _ = quickstart
    out = run_any(doc_command("docs/evaluation.md", "python run.py sample", "--num_samples 2"), work)
    samples = out.split("\n" + "-" * 40 + "\n")
    assert len(samples) == 2 and all(s.startswith("First Citizen:") for s in samples)


@pytest.mark.slow
def test_export_loads_in_transformers(
    quickstart: QuickStart, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    work, _ = quickstart
    command = "python run.py export --checkpoint runs/tiny-cpu --out_dir exports/tiny-cpu"
    out = run_any(doc_command("docs/export.md", command), work)
    assert "exports/tiny-cpu" in out
    monkeypatch.chdir(work)
    exec(compile(python_snippet("docs/export.md", "from_pretrained"), "docs/export.md (python block)", "exec"), {})
    assert capsys.readouterr().out.startswith("ROMEO:")


@pytest.mark.slow
def test_the_gguf_export_runs_in_llama_cpp(
    quickstart: QuickStart, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The page's GGUF export of the quick start's run, then its Python block in llama.cpp (llama-cpp-python)."""
    work, _ = quickstart
    out = run_any(doc_command("docs/export.md", "python run.py export", "--format gguf"), work)
    assert "exports/tiny-cpu-gguf/model.gguf (gpt2, f32, 64 positions, vocab 8,192, pre-tokenizer bailingmoe" in out
    assert "within 64" in out
    monkeypatch.chdir(work)
    exec(compile(python_snippet("docs/export.md", "from llama_cpp"), "docs/export.md (python block)", "exec"), {})
    assert capsys.readouterr().out.endswith("\n")  # the completion, printed


@pytest.mark.slow
def test_resume_continues_the_run(quickstart: QuickStart, tmp_path: Path) -> None:
    """The resume command on a copy of the quick-start run: it picks up at step 3 and logs each step once."""
    work, _ = quickstart
    (tmp_path / "data").symlink_to(work / "data", target_is_directory=True)
    shutil.copytree(work / "runs" / "tiny-cpu", tmp_path / "runs" / "tiny-cpu")
    resume = doc_command("docs/checkpoints.md", "python run.py train --config tiny-cpu --resume")
    out = run_documented(resume, tmp_path, ["--max_steps", "4"]).stderr
    assert "finished at step 4/4" in out
    assert [r["step"] for r in metrics(tmp_path / "runs" / "tiny-cpu")] == [1, 2, 3, 4]


@pytest.mark.slow
def test_two_cpu_processes_train_like_one(quickstart: QuickStart) -> None:
    """The page's one-process run and 2-process CPU launch (cpu_2proc.yaml), one thread each, then the plot comparing
    them."""
    work, _ = quickstart
    single = doc_command("docs/distributed.md", "OMP_NUM_THREADS=1 python run.py train", "--config tiny-cpu")
    run_documented(single, work, FEW_STEPS)
    launch = "OMP_NUM_THREADS=1 accelerate launch --config_file accelerate_configs/cpu_2proc.yaml run.py"
    out = run_documented(doc_command("docs/distributed.md", launch, "--config tiny-cpu"), work, FEW_STEPS).stderr
    assert "2 process(es)" in out and "finished at step 3/3" in out
    one, two = metrics(work / "runs" / "tiny-cpu-1proc"), metrics(work / "runs" / "tiny-cpu-2proc")
    assert [r["lr"] for r in two] == [r["lr"] for r in one]
    assert [r["loss"] for r in two] == pytest.approx([r["loss"] for r in one], abs=1e-4)

    out = run_any(doc_command("docs/evaluation.md", "python run.py plot", "compare.png"), work)
    assert out == "wrote compare.png (2 runs, up to step 3)\n"
    assert (work / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_accelerate_config_default(tmp_path: Path, quickstart: QuickStart) -> None:
    """`accelerate config default` writes a config; a plain `accelerate launch` reads it and the trainer runs.

    The run directory's accelerate_env.txt is `accelerate env`'s report, so it shows the config that was read."""
    work, _ = quickstart
    (tmp_path / "data").symlink_to(work / "data", target_is_directory=True)
    run_documented(doc_command("docs/distributed.md", "accelerate config default"), tmp_path)
    assert (tmp_path / "hf_home" / "accelerate" / "default_config.yaml").is_file()
    # The page launches gpt2-124m (GPUs, FineWeb); the same launch on CPU trains the tiny preset.
    launch = doc_command("docs/distributed.md", "accelerate launch run.py train").replace("gpt2-124m", "tiny-cpu")
    out = run_documented(launch, tmp_path, ["--max_steps", "1", "--eval_every", "0"]).stderr
    assert "finished at step 1/1" in out and "1 process(es) on cpu" in out
    report = (tmp_path / "runs" / "tiny-cpu" / "accelerate_env.txt").read_text()
    assert "- `Accelerate` default config:" in report and "use_cpu: True" in report


# ------------------------------------------------------------------------------------------ every command


def check_run_py(argv: list[str]) -> None:
    """Parse and resolve like `run.py` does (presets, YAML, flag types, validation), without running."""
    from accel_gpt.cli import parse

    parse(argv)


def check_accelerate_launch(argv: list[str]) -> None:
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import launch_command_parser

    args = launch_command_parser().parse_args(argv)
    if args.config_file:
        assert (REPO / args.config_file).is_file(), f"no launch config {args.config_file}"
        load_config_from_file(str(REPO / args.config_file))
    assert args.training_script == "run.py"
    check_run_py(args.training_script_args)


def check_torchrun(argv: list[str]) -> None:
    """A plain torchrun launch of run.py: torchrun's own parser, then ours on the training arguments."""
    from torch.distributed.run import get_args_parser

    args = get_args_parser().parse_args(argv)
    assert args.training_script == "run.py"
    check_run_py(args.training_script_args)


def check_pip_install(words: list[str]) -> None:
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for word in words[2:]:
        if m := re.fullmatch(r"\.\[([\w,]+)\]", word):
            missing = set(m.group(1).split(",")) - set(extras)
            assert not missing, f"pip install {word}: no such extra {missing}"


def expand_shell_vars(command: str) -> str:
    command = re.sub(
        r"\$\(\(\s*(\w+)\s*\*\s*(\d+)\s*\)\)", lambda m: str(int(SHELL_VARS[m.group(1)]) * int(m[2])), command
    )
    return re.sub(r"\$(\w+)", lambda m: SHELL_VARS[m.group(1)], command)


def check_bench_script(script: str, args: list[str]) -> None:
    """A benchmark script exists and its own parser takes every flag the page passes it."""
    assert (REPO / script).is_file(), f"no {script}"
    proc = subprocess.run(
        [sys.executable, script, "--help"], cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for flag in (a for a in args if a.startswith("--")):
        assert re.search(rf"{re.escape(flag)}\b", proc.stdout), f"{script} has no {flag}"


def make_recipe(target: str) -> list[str]:
    """The command lines of a Makefile target, without make's `@` (do not echo)."""
    text = (REPO / "Makefile").read_text()
    m = re.search(rf"^{re.escape(target)}:.*\n((?:\t.*\n)+)", text, re.M)
    assert m, f"no make target '{target}'"
    return [line.strip().removeprefix("@") for line in m.group(1).splitlines()]


def check_command(command: str) -> None:
    """Raise AssertionError if `command` would not work as the manual shows it (as far as a CPU offline can tell)."""
    if command in OTHER_COMMANDS:
        return
    words = shlex.split(expand_shell_vars(command))
    while re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words.pop(0)
    try:
        if words[:2] == ["python", "run.py"] or words[0] == "accel-gpt":
            check_run_py(words[2:] if words[0] == "python" else words[1:])
        elif words[:2] == ["accelerate", "launch"]:
            check_accelerate_launch(words[2:])
        elif words[0] == "torchrun":
            check_torchrun(words[1:])
        elif words[:2] == ["srun", "bash"]:
            assert words[2] == "-c" and len(words) == 4
            check_command(words[3])
        elif words[:3] == ["pip", "install", "-e"]:
            check_pip_install(words)
        elif words[0] == "python" and words[1].startswith("bench/"):
            check_bench_script(words[1], words[2:])
        elif words[0] == "export":
            assert re.fullmatch(r"\w+=\S+", words[1])
        elif words[0] == "make":  # what each target runs is tested below (the quick start, the test command)
            assert len(words) == 2 and make_recipe(words[1])
        else:
            raise AssertionError(f"command not checked by any test: {command}")
    except SystemExit as e:  # argparse's way of rejecting arguments
        raise AssertionError(f"command does not parse: {command}") from e
    except UserError as e:  # an unknown key, preset or value
        raise AssertionError(f"command is stale: {command}: {e}") from e


def test_every_command_of_the_manual_is_checked() -> None:
    commands = {page.name: page_commands(page) for page in PAGES}
    assert sum(map(len, commands.values())) > 40  # the parser found the pages' blocks
    assert {"README.md", "distributed.md", "checkpoints.md", "data.md"} <= {n for n, c in commands.items() if c}
    for page, found in commands.items():
        for command in found:
            try:
                check_command(command)
            except AssertionError as e:
                raise AssertionError(f"{page}: {e}") from e


@pytest.mark.parametrize(
    ("command", "problem"),
    [
        ("python run.py train --config tiny-cpu --max_step 10", "unknown train flag '--max_step'"),
        ("python run.py train --config tiny-gpu", "did you mean tiny-cpu"),
        ("python run.py prepare --preset tinyshakespear --out_dir data/x", "did you mean tinyshakespeare"),
        ("python run.py sample --ckpt runs/tiny-cpu", "unknown sample flag '--ckpt'"),
        ("python run.py train --config tiny-cpu --n_layer two", "n_layer='two' must be an integer"),
        (
            "accelerate launch --config_file accelerate_configs/eight_gpus.yaml run.py train --config gpt2-124m",
            "eight_gpus.yaml",
        ),
        ("accelerate launch --restarts 3 run.py train --config gpt2-124m", "does not parse"),
        ("torchrun --standalone --nproc-per-node 2 run.py train --config tiny-gpu", "did you mean tiny-cpu"),
        ("torchrun --restarts 3 run.py train --config tiny-cpu", "does not parse"),
        ('pip install -e ".[plots]"', "no such extra"),
        ("python run.py new-command", "does not parse"),
        ("python bench/train_throughput.py --find_max_batches 124m", "has no --find_max_batches"),
        ("python bench/benchmark.py", "no bench/benchmark.py"),
        ("make demo", "no make target 'demo'"),
        ("cmake ..", "not checked by any test"),
    ],
)
def test_command_checker_catches_stale_commands(command: str, problem: str) -> None:
    """The checker itself: each kind of stale command fails, for the reason it is stale."""
    with pytest.raises(AssertionError, match=re.escape(problem)):
        check_command(command)


def section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else len(text)]


def make_prerequisites(target: str) -> list[str]:
    m = re.search(rf"^{re.escape(target)}:(.*)$", (REPO / "Makefile").read_text(), re.M)
    assert m, f"no make target '{target}'"
    return m.group(1).split()


def installed_extras(recipe: list[str]) -> str:
    """The `pip install -e ".[...]"` of a setting-up recipe, as the README writes it."""
    (line,) = [line for line in recipe if " -m pip install --quiet -e " in line]
    return "pip install -e " + line.split(" -e ", 1)[1]


def test_the_two_commands_are_the_readmes_first_and_ci_calls_the_second() -> None:
    """`make quickstart` runs the README's quick start as written, after a setting up with the plot extra alone (it
    needs no GPT-2 files: no tiktoken check); `make test` checks for them, then sets up with the dev extra as the
    README's test block does and runs its test command, and `.ci/run` calls `make test` itself. What to do offline
    and how to pick torch's build come before the first command, where a user reads them in time."""
    text = README.read_text()
    two = section(text, "Two commands")
    ((offset, first),) = [(o, block_commands(b)) for o, b in code_blocks(two, "bash") if "make quickstart" in b]
    assert first == ["make quickstart", "make test"]
    assert "TIKTOKEN_CACHE_DIR" in two[:offset] and 'TORCH="torch --index-url https://download' in two[:offset]
    quickstart = [line.replace('"$(BIN)/python" ', "python ") for line in make_recipe("quickstart")]
    assert [line.replace(" $(TRAIN_ARGS)", "") for line in quickstart] == quickstart_commands()
    assert "$(TRAIN_ARGS)" in quickstart[1]  # the tests' fewer steps go to train alone

    # The check comes first, with the interpreter that makes the venv: nothing is installed before it.
    assert make_recipe("tiktoken") == ["$(PYTHON) -m accel_gpt.tiktoken_files"]
    assert make_prerequisites("quickstart") == ["setup"]
    assert make_prerequisites("test") == ["tiktoken", "setup-dev"]
    assert make_prerequisites("lint") == ["setup-dev"]
    assert make_prerequisites("setup") == make_prerequisites("setup-dev") == ["venv"]
    by_hand = [block_commands(b) for _, b in code_blocks(section(text, "The same by hand"), "bash")][0]
    assert by_hand[-1] == installed_extras(make_recipe("setup")) == 'pip install -e ".[plot]"'
    blocks = [block_commands(body) for _, body in code_blocks(section(text, "Tests"), "bash")]
    assert blocks[0] == [installed_extras(make_recipe("setup-dev")), "python -m pytest -q"]  # what `make test` runs
    assert blocks[0][0] == 'pip install -e ".[dev,plot]"'
    assert blocks[1] == ['python -m pytest -q -m "not slow"']  # the fast subset, named beside the full suite
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^TORCH \?= torch==2\.13\.0$", makefile, re.M)
    assert re.search(r"^\.NOTPARALLEL:", makefile, re.M)  # prerequisites in their order, even under -j
    assert any(line.endswith("-m pip install --quiet $(TORCH)") for line in make_recipe("venv"))
    assert make_recipe("test") == ['"$(BIN)/python" -m pytest -q']
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^make lint$", ci, re.M) and re.search(r"^make test$", ci, re.M)
    assert "TIKTOKEN_CACHE_DIR" in ci and "TIKTOKEN_CACHE_DIR" in text
    assert os.access(REPO / ".ci" / "run", os.X_OK)


@pytest.mark.slow
def test_make_quickstart_on_a_fresh_copy(tmp_path: Path) -> None:
    """`make quickstart` in a copy of the repository's files, as a fresh clone has them (run dirs, data and venvs
    left out): it sets up a virtual environment and runs the quick start (3 steps). The environment is a new one
    that sees this one's packages through a .pth file, so setting up installs accel_gpt there (editable, from the
    copy) without downloading torch, and leaves this environment's own install alone. tiktoken's cache is an empty
    folder: the quick start needs no GPT-2 files."""
    if not (REPO / ".git").exists() or shutil.which("make") is None:
        pytest.skip("needs a git checkout and make")
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode()
    copy = tmp_path / "my clöne" / "accel_gpt"  # a space and a non-ASCII letter in every path make touches
    for name in filter(None, files.split("\0")):
        if (REPO / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, copy / name)
    venv = tmp_path / "my vénv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site_packages,) = venv.glob("lib/python*/site-packages")
    (site_packages / "outer.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    env = {k: v for k, v in subprocess_env().items() if k not in ("VIRTUAL_ENV", "ACCELERATE_USE_CPU")}
    (empty := tmp_path / "no_tiktoken_files").mkdir()
    env["TIKTOKEN_CACHE_DIR"] = str(empty)
    proc = subprocess.run(
        ["make", "quickstart", f"VENV={venv}", "TRAIN_ARGS=" + " ".join(FEW_STEPS)],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}"
    assert "finished at step 3/3" in proc.stderr
    assert "\nROMEO:" in proc.stdout and "wrote runs/tiny-cpu.png (1 run, up to step 3)" in proc.stdout
    assert (copy / "data" / "shakespeare" / "manifest.json").is_file()
    assert (copy / "runs" / "tiny-cpu" / "model.safetensors").is_file()
    assert (copy / "runs" / "tiny-cpu.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(site_packages.glob("__editable__*accel_gpt*")), "setting up did not install accel_gpt into the venv"
