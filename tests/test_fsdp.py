"""FSDP2 through Accelerate: the steps of one process, checkpoints that every reader can use, exact resume, the
pickle check over distributed checkpoints, and the refusal of an FSDP launch where FSDP cannot run.

The FSDP runs are real 2-process launches with `accelerate_configs/fsdp.yaml` on a CPU gloo group, through
`tests/workers/fsdp_on_cpu.py` (Accelerate runs FSDP only on GPUs; the worker lifts that, see its docstring), so
preparing, clipping, saving, loading and gathering are Accelerate's FSDP2 code and the rest is the real trainer.
Every launch asserts that its 2 ranks formed one FSDP2 group.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import _free_port, python_cmd, run_cmd
from safetensors.torch import load_file

from accel_gpt.checkpoint import check_same_sharding
from accel_gpt.errors import ConfigError, UserError
from accel_gpt.runtime import fsdp_plugin
from accel_gpt.weights import load_model
from accel_gpt.workarounds import check_pickles_are_safe

CLIP = 0.1  # below every step's gradient norm: each update is clipped, so it depends on the global norm
FLAGS = [
    *("--n_layer", "2", "--n_head", "2", "--n_embd", "32", "--seq_len", "32", "--seed", "7"),
    *("--micro_batch_size", "4", "--total_batch_size", "256", "--learning_rate", "3e-3", "--warmup_steps", "1"),
    *("--grad_clip", str(CLIP), "--eval_every", "0", "--sample_tokens", "0", "--log_every", "1", "--log_with", "none"),
    *("--save_every", "2"),
]


def fsdp_launch(*args: str, mixed_precision: str = "no") -> list[str]:
    """`accelerate launch` with fsdp.yaml, 2 processes (the config's number is for 8 GPUs), fp32 by default."""
    return [
        *(sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/fsdp.yaml"),
        *("--num_processes", "2", "--mixed_precision", mixed_precision, "--main_process_port", str(_free_port())),
        *args,
    ]


class Payload:
    """Pickles as a call to os.mkdir(path): unpickling it with weights_only=False creates the folder."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _fsdp_train(control: Path, *args: str) -> list[dict]:
    control.mkdir(parents=True)
    run_cmd(fsdp_launch("tests/workers/fsdp_on_cpu.py", str(control), "train", *args), timeout=300)
    ranks = [json.loads(p.read_text()) for p in sorted(control.glob("rank_*.json"))]
    assert len(ranks) == 2 and all(r["num_processes"] == 2 and r["is_fsdp2"] for r in ranks), ranks
    assert all(r["dtypes"]["reduce_dtype"] == "torch.float32" for r in ranks), ranks
    return ranks


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, shakespeare_shards: Path) -> dict:
    """One process without FSDP (the reference); FSDP for 4 steps; FSDP with activation checkpointing stopped after
    step 2 of the same 4-step schedule, then resumed to step 4 in the same folder. Checkpoints every 2 steps. Then
    the nanochat block, one process and FSDP, with the modules that FSDP made units."""
    root = tmp_path_factory.mktemp("fsdp")
    common = [*FLAGS, "--data_dir", str(shakespeare_shards)]
    run_cmd(python_cmd("train", *common, "--max_steps", "4", "--out_dir", str(root / "ref")), timeout=300)
    _fsdp_train(root / "ctl-straight", *common, "--max_steps", "4", "--out_dir", str(root / "straight"))
    resumed = [*common, "--activation_checkpointing", "true", "--schedule_steps", "4"]
    resumed += ["--out_dir", str(root / "resumed")]
    _fsdp_train(root / "ctl-first", *resumed, "--max_steps", "2")
    _fsdp_train(root / "ctl-resumed", *resumed, "--max_steps", "4", "--resume", "auto")
    # the embedding and head at learning_rate: at their own rates (0.3, 0.008) Adam's scale-free update would carry
    # the sharded sums' round-off 100x as far, past this comparison's tolerance
    nanochat = [*common, "--max_steps", "4", "--arch", "nanochat", "--embedding_lr", "3e-3", "--head_lr", "3e-3"]
    run_cmd(python_cmd("train", *nanochat, "--out_dir", str(root / "nanochat-ref")), timeout=300)
    units = _fsdp_train(root / "ctl-nanochat", *nanochat, "--out_dir", str(root / "nanochat"))[0]["fsdp_units"]
    return {
        **{name: root / name for name in ("ref", "straight", "resumed", "nanochat-ref", "nanochat")},
        "data": shakespeare_shards,
        "nanochat_units": units,
    }


def _rows(run: Path) -> list[dict]:
    """Each step's metrics row, without the timings."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in ("step", "loss", "lr", "grad_norm")} for r in rows]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    assert all(a[k].shape == b[k].shape for k in a), "a shard, not the whole tensor, was saved"
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _state(path: Path) -> dict[str, torch.Tensor]:
    return load_model(path)[0].state_dict()


@pytest.mark.slow
def test_fsdp_steps_match_one_process(runs: dict[str, Path]) -> None:
    """The logged gradient norm is the global one (a shard's would be ~0.7 of it), and the clipped updates match:
    clipping each shard by its own norm moves the weights by ~5e-3 here, float round-off by ~5e-6."""
    ref, fsdp = _rows(runs["ref"]), _rows(runs["straight"])
    assert [r["step"] for r in fsdp] == [r["step"] for r in ref] == [1, 2, 3, 4]
    assert [r["lr"] for r in fsdp] == [r["lr"] for r in ref]
    assert all(r["grad_norm"] > CLIP for r in ref), "no update was clipped: the test would not see the clipping"
    for r, f in zip(ref, fsdp, strict=True):
        assert abs(r["loss"] - f["loss"]) < 1e-5, (r, f)
        assert abs(r["grad_norm"] - f["grad_norm"]) < 1e-3 * r["grad_norm"], (r, f)
    assert abs(ref[0]["grad_norm"] - fsdp[0]["grad_norm"]) < 2e-5 * ref[0]["grad_norm"]  # the same weights
    diff = _max_diff(
        load_file(str(runs["ref"] / "model.safetensors")), load_file(str(runs["straight"] / "model.safetensors"))
    )
    assert diff < 5e-5, f"final weights differ by {diff}"


@pytest.mark.slow
def test_fsdp_wraps_each_nanochat_block_and_matches_one_process(runs: dict) -> None:
    """The nanochat block under FSDP2: each Block is its own unit (fsdp.yaml wraps the class `Block`, which both
    blocks are), and its steps are one process's, the untied head included."""
    assert runs["nanochat_units"] == ["", "transformer.h.0", "transformer.h.1"]
    ref, fsdp = _rows(runs["nanochat-ref"]), _rows(runs["nanochat"])
    assert [r["step"] for r in fsdp] == [r["step"] for r in ref] == [1, 2, 3, 4]
    for r, f in zip(ref, fsdp, strict=True):
        assert abs(r["loss"] - f["loss"]) < 1e-5, (r, f)
        assert abs(r["grad_norm"] - f["grad_norm"]) < 1e-3 * r["grad_norm"], (r, f)
    ours, theirs = (load_file(str(runs[name] / "model.safetensors")) for name in ("nanochat-ref", "nanochat"))
    assert "lm_head.weight" in theirs and _max_diff(ours, theirs) < 5e-5


@pytest.mark.slow
def test_fsdp_resume_with_activation_checkpointing_is_exact(runs: dict[str, Path]) -> None:
    assert _rows(runs["resumed"]) == _rows(runs["straight"])
    a, b = load_file(str(runs["straight"] / "model.safetensors")), load_file(str(runs["resumed"] / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_fsdp_checkpoint_holds_the_sharded_state_and_the_whole_model(runs: dict[str, Path]) -> None:
    step2, step4 = (runs["straight"] / "checkpoints" / f"step_0000000{n}" for n in (2, 4))
    for name in ("pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata", "model.safetensors", "COMPLETE"):
        assert (step4 / name).is_file(), name
    assert _max_diff(_state(step4), _state(runs["straight"])) == 0.0  # step 4's gathered weights are the final ones
    assert _max_diff(_state(step2), _state(runs["ref"] / "checkpoints" / "step_00000002")) < 5e-5


@pytest.mark.slow
def test_fsdp_checkpoint_is_read_by_eval_and_export(runs: dict[str, Path], tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel

    ckpt = runs["straight"] / "checkpoints" / "step_00000004"
    proc = run_cmd(python_cmd("eval", "--checkpoint", str(ckpt), "--data_dir", str(runs["data"]), "--eval_steps", "2"))
    assert 0 < json.loads(proc.stdout.strip().splitlines()[-1])["val_loss"] < 11
    run_cmd(python_cmd("export", "--checkpoint", str(ckpt), "--out_dir", str(tmp_path / "export")))
    exported = GPT2LMHeadModel.from_pretrained(tmp_path / "export").transformer.wpe.weight
    assert torch.equal(exported, _state(ckpt)["transformer.wpe.weight"])


@pytest.mark.slow
def test_pickle_check_covers_distributed_checkpoints(runs: dict[str, Path], tmp_path: Path) -> None:
    """A crafted index, and a crafted non-tensor item that a sound index points at, are both refused unrun."""
    folder = tmp_path / "ckpt"
    shutil.copytree(runs["straight"] / "checkpoints" / "step_00000002", folder)
    check_pickles_are_safe(folder)  # the real one passes
    ran = tmp_path / "ran"

    index = folder / "pytorch_model_fsdp_0" / ".metadata"
    sound = index.read_bytes()
    index.write_bytes(pickle.dumps(Payload(ran)))
    with pytest.raises(UserError, match=r"\.metadata holds something other than .*GLOBAL posix\.mkdir"):
        check_pickles_are_safe(folder)
    index.write_bytes(sound[: len(sound) // 2])
    with pytest.raises(UserError, match=r"\.metadata is corrupt or truncated"):
        check_pickles_are_safe(folder)
    index.write_bytes(sound)

    optimizer = folder / "optimizer_0"
    metadata = pickle.loads((optimizer / ".metadata").read_bytes())  # written by the run above: trusted here
    key = next(k for k in metadata.storage_data if k.fqn == "optimizer.param_groups.0.lr")
    buffer = io.BytesIO()
    torch.save(Payload(ran), buffer)
    (optimizer / "item.distcp").write_bytes(buffer.getvalue())
    info = metadata.storage_data[key]
    metadata.storage_data[key] = type(info)("item.distcp", 0, len(buffer.getvalue()), info.transform_descriptors)
    (optimizer / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UserError, match=r"item\.distcp \(item optimizer\.param_groups\.0\.lr\) holds something other"):
        check_pickles_are_safe(folder)
    assert not ran.exists()
    torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)  # the payload is live: loading it runs it
    assert ran.is_dir()


def test_resume_across_fsdp_and_not_is_refused(tmp_path: Path) -> None:
    sharded, plain = tmp_path / "sharded", tmp_path / "plain"
    (sharded / "pytorch_model_fsdp_0").mkdir(parents=True)
    plain.mkdir()
    (plain / "model.safetensors").touch()
    check_same_sharding(sharded, fsdp=True)
    check_same_sharding(plain, fsdp=False)
    with pytest.raises(UserError, match="saved with FSDP and this launch runs without it.*--init_from"):
        check_same_sharding(sharded, fsdp=False)
    with pytest.raises(UserError, match="saved without FSDP and this launch runs with it"):
        check_same_sharding(plain, fsdp=True)


def test_fsdp_plugin_reduces_gradients_in_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 compute, fp32 gradient reduction, outputs as computed; Accelerate's own mixed-precision step (what
    `AcceleratorState` calls with the launch's precision) keeps that policy."""
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    assert fsdp_plugin("bf16") is None
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    plugin = fsdp_plugin("bf16")
    plugin.set_mixed_precision("bf16")
    policy = plugin.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype, policy.output_dtype) == (torch.bfloat16, torch.float32, None)
    assert fsdp_plugin("no").mixed_precision_policy.param_dtype is None
    monkeypatch.setenv("FSDP_VERSION", "1")
    with pytest.raises(ConfigError, match="set fsdp_version: 2"):
        fsdp_plugin("bf16")


@pytest.mark.slow
def test_fsdp_launch_without_gpus_is_refused(tmp_path: Path, shakespeare_shards: Path) -> None:
    """fsdp.yaml on this CPU machine (2 processes): one line, a failed launch, nothing written."""
    out = tmp_path / "run"
    args = ["run.py", "train", "--config", "tiny-cpu", "--data_dir", str(shakespeare_shards), "--out_dir", str(out)]
    proc = run_cmd(fsdp_launch(*args, mixed_precision="bf16"), check=False, timeout=180)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0
    assert len(errors) == 1 and "asks for FSDP" in errors[0] and "no GPU" in errors[0], proc.stderr[-3000:]
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gpt2", "nanochat"])
def test_muon_under_fsdp_is_refused(tmp_path: Path, shakespeare_shards: Path, arch: str) -> None:
    """torch.optim.Muon would orthogonalize each rank's shard of a matrix: an FSDP launch with --optimizer muon is
    refused in one line on every rank, before anything is written, whichever the block."""
    out, control = tmp_path / "run", tmp_path / "ctl"
    control.mkdir()
    args = [*FLAGS, "--data_dir", str(shakespeare_shards), "--out_dir", str(out), "--optimizer", "muon"]
    args += ["--arch", arch]
    proc = run_cmd(fsdp_launch("tests/workers/fsdp_on_cpu.py", str(control), "train", *args), check=False)
    errors = {line for line in proc.stderr.splitlines() if line.startswith("error: ")}
    assert proc.returncode != 0 and len(list(control.glob("rank_*.json"))) == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and "optimizer=muon cannot train under FSDP" in errors.pop(), proc.stderr[-3000:]
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("flag", "mixed_precision fp16 on a CPU: Accelerate would train in fp32 while the run records fp16"),
        ("launch", "mixed_precision fp16 on a CPU: Accelerate would train in fp32 while the run records fp16"),
        ("deepspeed", "the launch asks for DeepSpeed (distributed_type: DEEPSPEED), which accel_gpt does not support"),
    ],
)
def test_claims_the_run_could_not_keep_are_refused(
    tmp_path: Path, shakespeare_shards: Path, how: str, message: str
) -> None:
    """fp16 on a CPU (the train flag, or the launch's precision), and a DeepSpeed launch (the variable `accelerate
    launch` sets from `distributed_type: DEEPSPEED`): one line, exit 2, nothing written. Accelerate alone would train
    in fp32 while recording fp16, and without ZeRO."""
    out = tmp_path / "run"
    args = ["train", "--config", "tiny-cpu", "--data_dir", str(shakespeare_shards), "--out_dir", str(out)]
    if how == "flag":
        proc = run_cmd(python_cmd(*args, "--mixed_precision", "fp16"), check=False)
    elif how == "launch":
        proc = run_cmd(python_cmd(*args), check=False, ACCELERATE_MIXED_PRECISION="fp16")
    else:
        proc = run_cmd(python_cmd(*args), check=False, ACCELERATE_USE_DEEPSPEED="true")
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and message in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and not out.exists()
