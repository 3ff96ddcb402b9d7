"""What a run leaves to auto: mixed precision, compilation and CPU threads, each a pure function of (device class,
model size, settings) checked on a table, then real runs: the choices said at start, recorded in config.yaml and
every checkpoint, kept by a resume, and the same on 2 processes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import accelerate_cmd, python_cmd, run_cmd, write_token_shards
from test_precision import AMX, AVX2, AVX512, AVX512_BF16, H100, MPS, T4  # the device classes

from accel_gpt.limits import cgroup_cpu_quota
from accel_gpt.precision import (
    Capability,
    Choice,
    Workload,
    choose_compile,
    choose_mixed_precision,
    cpu_capability,
)
from accel_gpt.threads import Threads, busy_note, choose_threads, local_processes, usable_cpus

# (class, width) -> what auto picks when nothing else decides: bf16 only on bf16 units, and on a CPU from 128 wide
AUTO_PRECISION = [
    (AMX, 384, "bf16"),
    (AMX, 128, "bf16"),
    (AMX, 64, "no"),
    (AVX512_BF16, 384, "bf16"),
    (AVX512_BF16, 127, "no"),
    (AVX512, 768, "no"),
    (AVX2, 768, "no"),
    (AVX2, 64, "no"),
    (H100, 64, "bf16"),
    (H100, 768, "bf16"),
    (T4, 768, "no"),
    (MPS, 768, "no"),
]


@pytest.mark.parametrize(("capability", "width", "expected"), AUTO_PRECISION)
def test_auto_precision_is_bf16_only_where_units_do_it_fast(capability: Capability, width: int, expected: str) -> None:
    choice = choose_mixed_precision("auto", None, capability, width)
    assert choice.value == expected and choice.why.startswith("auto: ")
    if not capability.bf16_units:
        assert choice.why == f"auto: {capability.name} has no bf16 matrix units"


@pytest.mark.parametrize("capability", [AMX, AVX2, H100, T4])
def test_a_setting_then_the_launch_then_the_checkpoint_decide_before_the_device(capability: Capability) -> None:
    assert choose_mixed_precision("no", "bf16", capability, 768) == Choice("no", "mixed_precision setting")
    assert choose_mixed_precision("bf16", None, capability, 64) == Choice("bf16", "mixed_precision setting")
    assert choose_mixed_precision("auto", "no", capability, 768) == Choice("no", "the launch's")
    assert choose_mixed_precision("auto", "bf16", capability, 64).value == "bf16"
    assert choose_mixed_precision("auto", None, capability, 768, resumed="no") == Choice(
        "no", "auto: as the checkpoint trained"
    )


@pytest.mark.parametrize(
    ("capability", "resumed", "expected"),
    [(AMX, "bf16", "bf16"), (H100, "fp16", "fp16"), (AVX2, "bf16", "no"), (T4, "bf16", "no"), (AVX2, "fp16", "no")],
)
def test_a_resume_keeps_the_checkpoints_precision_where_it_is_still_fast(capability, resumed, expected) -> None:
    choice = choose_mixed_precision("auto", None, capability, 768, resumed=resumed)
    assert choice.value == expected
    if expected != resumed:
        assert choice.why == f"auto: the checkpoint trained in {resumed}, which {capability.name} emulates"


def work(
    steps: int, width: int = 384, n_layer: int = 6, threads: int = 2, budget: float | None = None, tokens: int = 8192
) -> Workload:
    flops_per_token = 6 * 12 * n_layer * width**2  # the blocks alone: enough for the length of a run
    return Workload(steps, tokens * flops_per_token, n_layer, threads, budget)


# (class, precision, workload) -> compile? CPU fp32 never (it gains nothing measured), CPU bf16 and GPU where the
# run is long enough to win back twice the compile's cost
AUTO_COMPILE = [
    (AVX2, "no", work(1_000_000), False),
    (AVX512_BF16, "no", work(1_000_000), False),
    (AVX512_BF16, "bf16", work(10), False),
    (AVX512_BF16, "bf16", work(100_000), True),
    (AVX512_BF16, "bf16", work(100_000, budget=60.0), False),  # a one-minute budget ends it first
    (AVX512_BF16, "bf16", work(100_000, budget=3600.0), True),
    (H100, "bf16", work(50, 768, 12, tokens=2**19), False),  # a smoke run of GPT-2 124M
    (H100, "bf16", work(19_073, 768, 12, tokens=2**19), True),  # its 10B tokens
    (MPS, "no", work(1_000_000), False),
]


@pytest.mark.parametrize(("capability", "precision", "workload", "expected"), AUTO_COMPILE)
def test_auto_compiles_where_it_pays_back_twice(capability, precision, workload, expected) -> None:
    choice = choose_compile("auto", capability, precision, workload)
    assert choice.value is expected and choice.why.startswith("auto: "), choice
    assert choose_compile(True, capability, precision, workload) == Choice(True, "compile setting")
    assert choose_compile(False, capability, precision, workload) == Choice(False, "compile setting")
    assert choose_compile("auto", capability, precision, workload, launch_compiles=True).value is False


def test_a_runs_expected_length_comes_from_its_flops_or_its_budget() -> None:
    long = work(1000)
    seconds = long.seconds(AVX512_BF16, "bf16")
    assert seconds == pytest.approx(1000 * long.step_flops / (2 * 200e9))
    assert work(1000, threads=4).seconds(AVX512_BF16, "bf16") == pytest.approx(seconds / 2)
    assert work(1000, budget=5.0).seconds(AVX512_BF16, "bf16") == 5.0


# ------------------------------------------------------------------------------------------------ threads


@pytest.mark.parametrize(
    ("env", "cpus", "processes", "expected"),
    [
        ({}, 2, 1, (2, "2 usable CPUs")),
        ({}, 16, 2, (8, "16 usable CPUs / 2 processes on this machine")),
        ({}, 2, 2, (1, "2 usable CPUs / 2 processes on this machine")),
        ({}, 3, 4, (1, "3 usable CPUs / 4 processes on this machine")),
        ({}, 1, 1, (1, "1 usable CPU")),
        ({"OMP_NUM_THREADS": "3"}, 16, 2, (3, "OMP_NUM_THREADS")),
        ({"OMP_NUM_THREADS": "0"}, 4, 1, (4, "4 usable CPUs")),  # not a count: ignored
    ],
)
def test_threads_are_the_processs_share_of_its_cpus(env, cpus, processes, expected) -> None:
    threads = choose_threads(env, cpus, processes)
    assert (threads.count, threads.why) == expected
    assert threads.describe().startswith(f"{expected[0]} thread")


def test_local_processes_come_from_the_launcher() -> None:
    assert local_processes({}) == 1
    assert local_processes({"LOCAL_WORLD_SIZE": "4"}) == 4
    assert local_processes({"LOCAL_WORLD_SIZE": "x"}) == 1


def fake_root(tmp_path: Path, cgroup: str, files: dict[str, str]) -> Path:
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup)
    for name, text in files.items():
        path = tmp_path / "sys/fs/cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize(
    ("cgroup", "files", "quota"),
    [
        ("0::/job\n", {"job/cpu.max": "max 100000\n"}, None),  # v2, no limit
        ("0::/job\n", {"job/cpu.max": "250000 100000\n"}, 2.5),  # docker --cpus 2.5
        ("0::/a/b\n", {"a/b/cpu.max": "max 100000", "a/cpu.max": "100000 100000"}, 1.0),  # a parent's limit holds
        ("0::/\n", {"cpu.max": "300000 100000"}, 3.0),  # a container's own root
        (
            "4:cpu,cpuacct:/slurm\n",
            {"cpu,cpuacct/slurm/cpu.cfs_quota_us": "200000", "cpu,cpuacct/slurm/cpu.cfs_period_us": "100000"},
            2.0,
        ),  # noqa: E501
        ("1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),  # v1, no limit
        ("", {}, None),  # no cgroups at all
    ],
)
def test_the_cgroup_quota_is_read_from_v1_and_v2(tmp_path: Path, cgroup: str, files: dict, quota) -> None:
    root = fake_root(tmp_path, cgroup, files)
    assert cgroup_cpu_quota(root) == quota
    assert usable_cpus(root, affinity=8) == (8 if quota is None else max(1, int(quota)))
    assert usable_cpus(root, affinity=1) == 1  # the affinity mask caps too


def test_a_busy_machine_is_said_only_where_threads_would_wait() -> None:
    assert busy_note(2, 2, 0.5) is None
    assert busy_note(1, 2, 8.0) is None  # one thread waits on nobody
    note = busy_note(2, 2, 2.3)
    assert note == "the machine is busy, load 2.3: OMP_NUM_THREADS=1 is faster while it lasts"
    described = Threads(2, "2 usable CPUs", note).describe()
    assert described == f"2 threads (2 usable CPUs; {note})"


# ------------------------------------------------------------------------------------------------ real runs

VOCAB = 256
FLAGS = [
    *("--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--seq_len", "16", "--vocab_size", str(VOCAB)),
    *("--micro_batch_size", "2", "--total_batch_size", "64", "--eval_every", "0", "--sample_tokens", "0"),
    *("--log_with", "none", "--warmup_steps", "2"),
]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, shakespeare_tokens: list[int]) -> Path:
    tokens = [t % VOCAB for t in shakespeare_tokens[:6_000]]
    return write_token_shards(tmp_path_factory.mktemp("choices") / "data", tokens, vocab_size=VOCAB)


def run_config(out: Path) -> dict:
    return yaml.safe_load((out / "config.yaml").read_text())


def test_the_choices_are_said_recorded_and_kept_by_a_resume(data: Path, tmp_path: Path) -> None:
    """Left to auto, a run says what it chose and why, and records the values (not auto) in config.yaml; a run
    that trained in fp32 resumes in fp32 even where auto would now pick bf16, and a bf16 run resumes in bf16 where
    the device does it fast, in fp32 (said) where it does not."""
    flags = [*FLAGS, "--data_dir", str(data), "--max_steps", "2", "--save_every", "1"]
    env = {"OMP_NUM_THREADS": ""}  # the run chooses its own threads
    proc = run_cmd(python_cmd("train", *flags, "--out_dir", str(tmp_path / "auto")), **env)
    own = cpu_capability()
    precision = choose_mixed_precision("auto", None, own, 32)
    assert f"mixed precision {precision.value} ({precision.why}), not compiled (auto: " in proc.stderr, proc.stderr
    assert " thread" in proc.stderr.split("not compiled", 1)[1].split("|")[0]
    recorded = run_config(tmp_path / "auto")
    assert (recorded["mixed_precision"], recorded["compile"]) == (precision.value, False)

    for first in ("no", "bf16"):
        out = tmp_path / first
        run_cmd(python_cmd("train", *flags, "--mixed_precision", first, "--out_dir", str(out)))
        proc = run_cmd(python_cmd("train", *flags, "--max_steps", "3", "--resume", "auto", "--out_dir", str(out)))
        kept = choose_mixed_precision("auto", None, own, 32, resumed=first)
        assert f"mixed precision {kept.value} ({kept.why})" in proc.stderr, proc.stderr[-2000:]
        assert run_config(out)["mixed_precision"] == kept.value
    assert kept.value == ("bf16" if own.bf16_units else "no")


def test_two_processes_choose_alike_and_record_it(data: Path, tmp_path: Path) -> None:
    """Under a 2-process launch that says mixed_precision no, auto takes the launch's, and the threads the launcher
    set (accelerate launch always sets OMP_NUM_THREADS); the run records the resolved values."""
    flags = [*FLAGS, "--data_dir", str(data), "--max_steps", "2", "--save_every", "0", "--out_dir", str(tmp_path)]
    proc = run_cmd(accelerate_cmd(2, "train", *flags))
    assert "| 2 process(es) on cpu" in proc.stderr
    chosen = "mixed precision no (the launch's), not compiled (auto: it gains nothing measurable on a CPU in fp32), "
    assert chosen + "1 thread (OMP_NUM_THREADS)" in proc.stderr, proc.stderr[-3000:]
    assert (run_config(tmp_path)["mixed_precision"], run_config(tmp_path)["compile"]) == ("no", False)
