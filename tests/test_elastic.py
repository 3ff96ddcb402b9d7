"""Elastic restarts as docs/distributed.md shows them: a launch with `--max_restarts` whose process is SIGKILLed
twice ends like a run never killed; what the trainer reads from torchrun's environment, and the lines it gives.

The real runs use the page's own commands (`accelerate launch --config_file accelerate_configs/cpu_2proc.yaml
--max_restarts 3 ... --resume auto`, and `torchrun --standalone ... --max_restarts 3`), with the training script
swapped for `tests/workers/interrupted_train.py`, which kills one rank per attempt at an exact step (`--die_at`) and,
in a restarted group, starts the last rank late: the other rank then forms the group first and reads whatever the
launcher's store holds for its peer, which before the per-attempt prefix was the dead process's address (the group
hung). The reference is the same accelerate launch of `run.py`, never killed; on CPU fp32 the final weights,
optimizer state and metrics rows must be bit-identical.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import REPO, subprocess_env, write_token_shards
from safetensors.torch import load_file
from test_quickstart import doc_command

from accel_gpt.errors import UserError
from accel_gpt.files import LOCK
from accel_gpt.rundir import check_restartable
from accel_gpt.runtime import ElasticLaunch

VOCAB = 256  # token ids folded into a small vocabulary: these tests check bookkeeping, not language
# 10 steps of 4 sequences (W=2: one micro-step each), checkpoints at 3, 6, 9 and 10.
FLAGS = ["--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--seq_len", "16", "--vocab_size", str(VOCAB)]
FLAGS += ["--micro_batch_size", "2", "--total_batch_size", "64", "--seed", "7", "--learning_rate", "1e-3"]
FLAGS += ["--warmup_steps", "2", "--max_steps", "10", "--save_every", "3", "--log_every", "2"]
FLAGS += ["--eval_every", "0", "--sample_tokens", "0", "--log_with", "none"]
WORKER = "tests/workers/interrupted_train.py"
# Attempt 0: rank 1 dies before step 5 (checkpoint 3 saved). Attempt 1 resumes at 3; rank 0, which holds the run
# directory's lock, dies before its 5th step, step 8 (checkpoint 6 saved). Attempt 2 resumes at 6 and finishes.
DIE_AT = "5:1,5:0"
LATE = "2"  # seconds the restarted group's last rank starts after the others
# The manual's CPU commands for a launch that may restart (one per launcher), in docs/distributed.md.
DOC_LAUNCHES = {
    "accelerate": ("OMP_NUM_THREADS=1 accelerate launch", "--max_restarts"),
    "torchrun": ("OMP_NUM_THREADS=1 torchrun", "--max_restarts"),
}


# ------------------------------------------------------------------------------------------ what torchrun says


def agent_env(**overrides: str) -> dict[str, str]:
    """A worker's environment as torchrun's agent writes it: 2 processes on one machine, static rendezvous."""
    env = {
        "TORCHELASTIC_RUN_ID": "none",
        "TORCHELASTIC_RESTART_COUNT": "1",
        "TORCHELASTIC_MAX_RESTARTS": "3",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "GROUP_WORLD_SIZE": "1",
        "RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }
    return {**env, **overrides}


def test_which_launches_form_their_group_under_a_prefix_per_attempt() -> None:
    """One machine whose processes meet in the launcher's store, with restarts: a prefix per attempt. Not without
    restarts, nor one process, nor c10d with a new store per attempt (USE_AGENT_STORE False), nor several machines
    (whose restart counts differ), which get the warning instead; nor a process torchrun did not start."""
    assert ElasticLaunch.from_env({}) is None
    assert ElasticLaunch.from_env({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}) is None
    one = ElasticLaunch.from_env(agent_env())
    assert one is not None and (one.restart, one.max_restarts, one.rank, one.world_size) == (1, 3, 1, 2)
    assert one.own_namespace and one.restart_warning() is None
    for quiet in (
        {"TORCHELASTIC_MAX_RESTARTS": "0"},
        {"WORLD_SIZE": "1", "RANK": "0"},
        {"TORCHELASTIC_USE_AGENT_STORE": "False"},
        {"GROUP_WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "False"},
    ):
        launch = ElasticLaunch.from_env(agent_env(**quiet))
        assert not launch.own_namespace and launch.group_kwargs() == {} and launch.restart_warning() is None, quiet
    several = ElasticLaunch.from_env(agent_env(GROUP_WORLD_SIZE="2", WORLD_SIZE="16"))
    assert not several.own_namespace and several.group_kwargs() == {}
    line = several.restart_warning()
    assert "max_restarts 3 over 2 machines" in line and "\n" not in line
    assert "--rdzv_backend c10d" in line and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in line
    no_restarts = ElasticLaunch.from_env(agent_env(GROUP_WORLD_SIZE="2", TORCHELASTIC_MAX_RESTARTS="0"))
    assert no_restarts.restart_warning() is None


def test_each_attempt_writes_under_its_own_prefix_in_the_launchers_store() -> None:
    """The store `group_kwargs` hands to init_process_group is a client of the launcher's (here a TCPStore this
    test hosts, as the agent does) whose keys land under `accel_gpt/attempt_K/`: the failed attempt's entries,
    written under another K, are never read."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    stores = {}
    for attempt in (1, 2):
        env = agent_env(TORCHELASTIC_RESTART_COUNT=str(attempt), MASTER_PORT=str(server.port))
        kwargs = ElasticLaunch.from_env(env).group_kwargs()
        assert (kwargs["rank"], kwargs["world_size"]) == (1, 2)
        kwargs["store"].set("rank_1", f"address of attempt {attempt}")
        stores[attempt] = kwargs["store"]
    assert server.get("accel_gpt/attempt_1/rank_1") == b"address of attempt 1"
    assert stores[2].get("rank_1") == b"address of attempt 2"


def test_a_launch_that_may_restart_must_resume_auto() -> None:
    env = {"TORCHELASTIC_MAX_RESTARTS": "3"}
    check_restartable("auto", env)
    check_restartable("none", {"TORCHELASTIC_MAX_RESTARTS": "0"})
    check_restartable("none", {})
    for resume in ("none", "runs/x/checkpoints/step_00000003"):
        with pytest.raises(UserError) as e:
            check_restartable(resume, env)
        assert str(e.value) == (
            "--max_restarts 3 restarts the group with this same command, which then must continue the run: "
            f"pass --resume auto (not --resume {resume})"
        )


# ------------------------------------------------------------------------------------------ real restarts


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, shakespeare_tokens: list[int]) -> Path:
    tokens = [t % VOCAB for t in shakespeare_tokens[:40_000]]
    root = tmp_path_factory.mktemp("elastic")
    return write_token_shards(root / "data", tokens[:36_000], tokens[36_000:], shard_size=9_000, vocab_size=VOCAB)


def page_launcher(name: str) -> list[str]:
    """The page's launch command for `name`, up to the script, as argv for this interpreter; asserts that the
    page trains it with `--resume auto`."""
    words = shlex.split(doc_command("docs/distributed.md", *DOC_LAUNCHES[name]))
    while "=" in words[0]:  # OMP_NUM_THREADS=1: subprocess_env sets it
        words.pop(0)
    script = words.index("run.py")
    assert words[script + 1] == "train" and "--resume auto" in shlex.join(words[script:])
    launch = words[:script]
    if launch[:2] == ["accelerate", "launch"]:  # a free port: other tests may run launches beside this one
        return [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", "0", *launch[2:]]
    assert launch[0] == "torchrun" and "--standalone" in launch  # torchrun picks a free port itself
    return [sys.executable, "-m", "torch.distributed.run", *launch[1:]]


def launch(cmd: list[str], log: Path, control: Path | None = None, timeout: float = 300) -> tuple[int, str]:
    """Run a launcher to its end (a file for its output: a pipe could block a worker); on a timeout, kill it and the
    workers (each in a session of its own under torchrun), so that a hang fails the test instead of lingering."""
    env = subprocess_env()
    env.pop("ACCELERATE_USE_CPU", None)  # the config file decides, as for a user
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            pids = [int(p.read_text()) for p in control.glob("pid_*")] if control else []
            for group in [proc.pid, *pids]:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(group, signal.SIGKILL)
            proc.wait()
    output = log.read_text()
    assert code is not None, f"timed out after {timeout} s: {' '.join(cmd)}\n{output[-6000:]}"
    return code, output


def killed_twice(name: str, data: Path, root: Path) -> dict:
    out, control = root / name / "run", root / name / "control"
    control.mkdir(parents=True)
    script = [WORKER, str(control), "--die_at", DIE_AT, "--late_after_restart", LATE, "--"]
    cmd = [*page_launcher(name), *script, *FLAGS, "--data_dir", str(data), "--out_dir", str(out), "--resume", "auto"]
    start = time.monotonic()
    code, output = launch(cmd, root / name / "output.txt", control)
    died = {p.name: p.read_text() for p in control.glob("died_*")}
    return {"run": out, "code": code, "output": output, "died": died, "seconds": time.monotonic() - start,
            "rank0_pid": int((control / "pid_0").read_text())}  # fmt: skip


def never_killed(data: Path, root: Path) -> Path:
    out = root / "reference" / "run"
    out.parent.mkdir(parents=True)
    cmd = [*page_launcher("accelerate"), "run.py", "train", *FLAGS, "--data_dir", str(data), "--out_dir", str(out)]
    code, output = launch([*cmd, "--resume", "auto"], root / "reference" / "output.txt")
    assert code == 0 and output.count("2 process(es) on cpu") == 1, output[-6000:]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, data: Path) -> dict:
    """The reference and one double-kill run per launcher, two at a time; a failed job is kept as its exception."""
    root = tmp_path_factory.mktemp("elastic_runs")
    jobs = {name: (lambda name=name: killed_twice(name, data, root)) for name in DOC_LAUNCHES}
    jobs["reference"] = lambda: never_killed(data, root)
    with ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        return {name: future.exception() or future.result() for name, future in futures.items()}


def result(runs: dict, name: str):
    if isinstance(runs[name], BaseException):
        raise runs[name]
    return runs[name]


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(DOC_LAUNCHES))
def test_a_process_killed_twice_restarts_and_ends_bit_identical(runs: dict, name: str) -> None:
    ref, run = result(runs, "reference"), result(runs, name)
    output, out = run["output"], run["run"]
    assert run["code"] == 0, output[-6000:]
    assert run["died"] == {"died_0": "rank 1 step call 5", "died_1": "rank 0 step call 5"}
    assert output.count("2 process(es) on cpu") == 3, output[-6000:]  # every attempt formed a group of 2
    assert f"resumed from {out / 'checkpoints' / 'step_00000003'} at step 3" in output
    assert f"resumed from {out / 'checkpoints' / 'step_00000006'} at step 6" in output
    assert "finished at step 10/10" in output and "warning:" not in output
    # The last attempt's rank 0 took over the lock that the SIGKILLed rank 0 held.
    assert (out / LOCK).read_text() == f"pid {run['rank0_pid']} on {os.uname().nodename}"

    final, expected = load_file(str(out / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in final)
    step10 = [r / "checkpoints" / "step_00000010" / "optimizer.bin" for r in (out, ref)]
    states = [torch.load(path, weights_only=True)["state"] for path in step10]
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][i][k], states[1][i][k]) for i in states[0] for k in states[0][i])
    keys = ("step", "loss", "lr", "grad_norm")
    assert [[r[k] for k in keys] for r in rows(out)] == [[r[k] for k in keys] for r in rows(ref)]
