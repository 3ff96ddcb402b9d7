"""`export`'s model card and generation config, and `--push_to_hub` up to the upload call.

The card is checked against the run's own files (config.yaml, metrics.jsonl, the checkpoints' data record), its
training command by parsing it back into the run's config, and its account of transformers' length limits by
calling transformers. The upload is replaced at the boundary only (`huggingface_hub.create_repo`/`upload_folder`);
the offline, no-token and no-network refusals go through the real command line. The page's offline
lm-evaluation-harness recipe (the task file in lm_eval_tasks/) runs as written on an export of a tiny run.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import HELLASWAG, REPO, front_matter, python_cmd, run_cmd, subprocess_env, table
from transformers import GPT2LMHeadModel, pipeline

from accel_gpt.cli import main as cli_main
from accel_gpt.cli import parse
from accel_gpt.errors import ConfigError, UserError
from accel_gpt.export import export
from accel_gpt.metrics import read_metrics
from accel_gpt.model import GPT, GPTConfig
from accel_gpt.tokenizer import GPT2_EOT, Tokenizer
from accel_gpt.weights import WEIGHTS, ModelCard, save_weights

TINY = GPTConfig(n_layer=1, n_head=2, n_embd=32, seq_len=16, vocab_size=50_304)


@pytest.fixture(scope="module")
def weights_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Final weights without their run: a folder with model.safetensors and model_config.json alone."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("weights") / "tiny"
    save_weights(GPT(TINY).state_dict(), ModelCard(TINY, Tokenizer("gpt2"), step=12), folder)
    return folder


# ------------------------------------------------------------------------------------------- without a run


def test_weights_without_their_run_get_the_short_card_and_the_generation_config(weights_only, tmp_path) -> None:
    out = export(weights_only, tmp_path / "hf", license="apache-2.0")
    meta, body = front_matter((out / "README.md").read_text())
    assert meta == {
        "license": "apache-2.0",
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["gpt2", "accel_gpt"],
    }
    assert body.startswith("\n# hf\n")
    assert "1 layers, 2 attention heads, a 32-wide residual stream and a 16-token context" in body
    assert "after 12 optimizer steps from weights without their run directory" in body
    assert "| tokens seen |" not in body and "### Command" not in body  # nothing the weights do not record
    assert 'pipeline("text-generation", model="' + str(tmp_path / "hf") + '")' in body
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"], generation["pad_token_id"]) == (GPT2_EOT,) * 3
    assert generation["max_length"] == 16  # the positions: a pipeline call without a length stays inside them


def test_what_the_card_says_about_the_window_is_what_transformers_does(weights_only, tmp_path) -> None:
    """No length: the pipeline stops inside the positions (before: its default of 256 new tokens ended in an
    IndexError); max_new_tokens within the window: that many; past it, the IndexError the card names."""
    out = export(weights_only, tmp_path / "hf")
    body = (out / "README.md").read_text()
    assert "Keep the prompt's tokens plus `max_new_tokens` within 16" in body
    assert "IndexError: index out of range in self" in body
    generate = pipeline("text-generation", model=str(out), device="cpu")
    prompt_ids = generate.tokenizer("To be or not")["input_ids"]
    result = generate("To be or not", max_new_tokens=4, do_sample=False, return_tensors=True)
    assert len(result[0]["generated_token_ids"]) <= len(prompt_ids) + 4
    unbounded = generate("To be or not", do_sample=False, return_tensors=True)
    assert len(unbounded[0]["generated_token_ids"]) <= TINY.seq_len
    with pytest.raises(IndexError, match="index out of range in self"):
        generate("To be or not", max_new_tokens=TINY.seq_len, do_sample=False)


def test_a_license_must_be_a_hub_license_id() -> None:
    assert parse(["export", "--checkpoint", "c", "--out_dir", "o", "--license", "cc-by-4.0"])[1].license == "cc-by-4.0"
    for bad in ("MIT License", "mit\nlicense: x"):
        with pytest.raises(ConfigError, match="is not a Hub license id"):
            parse(["export", "--checkpoint", "c", "--out_dir", "o", "--license", bad])
    with pytest.raises(ConfigError, match="is not a repo id"):
        parse(["export", "--checkpoint", "c", "--out_dir", "o", "--push_to_hub", "a/b/c"])
    with pytest.raises(ConfigError, match="private=true is for --push_to_hub"):
        parse(["export", "--checkpoint", "c", "--out_dir", "o", "--private", "true"])


# ------------------------------------------------------------------------------------------- from a run


@pytest.fixture(scope="module")
def run_card(tiny_run: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    out = export(tiny_run, tmp_path_factory.mktemp("card") / "tiny-shakespeare")
    return front_matter((out / "README.md").read_text())


@pytest.mark.slow
def test_the_card_reports_the_runs_own_records(tiny_run: Path, run_card: tuple[dict, str]) -> None:
    meta, body = run_card
    assert meta["license"] == "mit" and meta["library_name"] == "transformers"
    assert "datasets" not in meta  # a local file: named in the text, not a hub id
    rows = {r["step"]: r for r in read_metrics(tiny_run / "metrics.jsonl")}
    got = table(body)
    assert got["optimizer steps"] == "4 of 4"
    assert got["tokens seen"] == "2,048 (4 steps of 512 tokens)"
    assert got["final train loss"] == f"{rows[4]['loss']:.4f} (step 4)"
    assert got["validation loss"] == f"{rows[4]['val_loss']:.4f} (step 4; 6 windows of 64 tokens)"
    assert got["validation bits per byte"] == (
        f"{rows[4]['val_bpb']:.4f} (the same evaluation, in bits per UTF-8 byte of text: comparable across tokenizers)"
    )
    hellaswag = f"{rows[4]['hellaswag_acc_norm']:.4f} ± {rows[4]['hellaswag_acc_norm_stderr']:.4f} (step 4; "
    assert got["HellaSwag acc_norm"].startswith(hellaswag) and "the first 8 examples of `hellaswag_val.jsonl`" in body
    assert got["processes"] == "1"
    assert "local file(s) `shakespeare.txt`" in body and "3,000 val tokens; gpt2 tokenizer" in body
    assert "These are the training shards the run's checkpoints recorded" in body
    assert "# tiny-shakespeare" in body


@pytest.mark.slow
def test_the_training_command_parses_back_into_the_runs_config(tiny_run: Path, run_card: tuple[dict, str]) -> None:
    _, body = run_card
    command = body.split("### Command\n\n```bash\n", 1)[1].split("\n```", 1)[0]
    words = shlex.split(command)
    assert words[:4] == ["python", "run.py", "train", "--config"]
    _, cfg = parse(words[2:])
    saved = yaml.safe_load((tiny_run / "config.yaml").read_text())
    assert {k: v for k, v in cfg.to_dict().items() if k not in ("resume", "overwrite")} == {
        k: v for k, v in saved.items() if k not in ("resume", "overwrite")
    }


@pytest.mark.slow
def test_a_checkpoint_gets_the_values_of_its_own_step(tiny_run: Path, tmp_path: Path) -> None:
    out = export(tiny_run / "checkpoints" / "step_00000002", tmp_path / "hf")
    _, body = front_matter((out / "README.md").read_text())
    rows = {r["step"]: r for r in read_metrics(tiny_run / "metrics.jsonl")}
    got = table(body)
    assert got["optimizer steps"] == "2 of 4" and got["tokens seen"].startswith("1,024 ")
    assert got["final train loss"] == f"{rows[2]['loss']:.4f} (step 2)"
    assert got["validation loss"].startswith(f"{rows[2]['val_loss']:.4f} (step 2;")
    assert got["validation bits per byte"].startswith(f"{rows[2]['val_bpb']:.4f} (")
    assert "HellaSwag acc_norm" not in got  # scored at step 4 only: after these weights


def copy_run(tiny_run: Path, tmp_path: Path, data_dir: Path) -> Path:
    """The run in a new folder, its config.yaml pointing at `data_dir`."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    config = yaml.safe_load((run / "config.yaml").read_text())
    (run / "config.yaml").write_text(yaml.safe_dump(config | {"data_dir": str(data_dir)}, sort_keys=False))
    return run


@pytest.mark.slow
def test_a_hub_dataset_goes_into_the_metadata(tiny_run: Path, tmp_path: Path) -> None:
    """The same shards described as a hub dataset: named in `datasets`, with its config and split."""
    saved = yaml.safe_load((tiny_run / "config.yaml").read_text())
    data = shutil.copytree(saved["data_dir"], tmp_path / "data")
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["source"] = {"dataset": "someone/corpus", "kind": "hub", "config": "small", "split": "train"}
    (data / "manifest.json").write_text(json.dumps(manifest))
    run = copy_run(tiny_run, tmp_path, data)
    # its metrics as a run logged them before val_bpb existed: the card then has no bits per byte row
    rows = [{k: v for k, v in r.items() if k != "val_bpb"} for r in read_metrics(run / "metrics.jsonl")]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = export(run, tmp_path / "hf")
    meta, body = front_matter((out / "README.md").read_text())
    assert meta["datasets"] == ["someone/corpus"]
    assert "hub dataset `someone/corpus` (config small; split train)" in body
    assert "These are the training shards the run's checkpoints recorded" in body
    assert "validation loss" in table(body) and "validation bits per byte" not in table(body)


@pytest.mark.slow
def test_other_data_in_the_folder_is_not_named_as_the_training_data(tiny_run: Path, tmp_path: Path) -> None:
    from conftest import write_token_shards

    data = write_token_shards(tmp_path / "other", list(range(5000)), list(range(500)))
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["source"] = {"dataset": "someone/other", "kind": "hub"}
    (data / "manifest.json").write_text(json.dumps(manifest))
    out = export(copy_run(tiny_run, tmp_path, data), tmp_path / "hf")
    meta, body = front_matter((out / "README.md").read_text())
    assert "datasets" not in meta
    assert "now hold other training shards than the ones the run's checkpoints recorded" in body


# ------------------------------------------------------------------------------------------- --push_to_hub


def one_line_error(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(argv)
    assert exit_info.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.fixture
def online(monkeypatch: pytest.MonkeyPatch) -> None:
    """What a machine with the hub in reach looks like to huggingface_hub (the tests themselves stay offline)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


def test_push_uploads_the_exported_folder(weights_only, tmp_path, monkeypatch, online, capsys) -> None:
    import huggingface_hub

    calls = []

    def create_repo(repo_id, **kw):
        calls.append(("create_repo", repo_id, kw))
        return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}")

    def upload_folder(**kw):
        files = sorted(p.name for p in Path(kw["folder_path"]).iterdir())
        calls.append(("upload_folder", kw, files))

    monkeypatch.setenv("HF_TOKEN", "hf_test")
    monkeypatch.setattr(huggingface_hub, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub, "upload_folder", upload_folder)
    out = tmp_path / "hf"
    argv = ["export", "--checkpoint", str(weights_only), "--out_dir", str(out), "--push_to_hub", "someone/tiny-gpt"]
    cli_main([*argv, "--private", "true"])
    (made, repo_id, create_kw), (uploaded, upload_kw, files) = calls
    assert (made, repo_id) == ("create_repo", "someone/tiny-gpt")
    assert create_kw["private"] is True and create_kw["exist_ok"] is True
    assert uploaded == "upload_folder" and upload_kw["repo_id"] == "someone/tiny-gpt"
    assert Path(upload_kw["folder_path"]) == out and upload_kw.get("repo_type", "model") == "model"
    assert {"README.md", "config.json", "generation_config.json", WEIGHTS, "tokenizer.json"} <= set(files)
    assert capsys.readouterr().out.splitlines()[-1] == f"uploaded {out} -> https://huggingface.co/someone/tiny-gpt"
    _, body = front_matter((out / "README.md").read_text())
    assert body.startswith("\n# tiny-gpt\n") and 'pipeline("text-generation", model="someone/tiny-gpt")' in body


def test_push_offline_is_refused_before_anything_is_written(weights_only, tmp_path, capsys) -> None:
    out = tmp_path / "hf"
    argv = ["export", "--checkpoint", str(weights_only), "--out_dir", str(out), "--push_to_hub", "someone/tiny"]
    assert "HF_HUB_OFFLINE=1 is set, so nothing can be uploaded" in one_line_error(capsys, argv)  # the tests' env
    assert not out.exists()


def test_push_without_a_token_is_refused_before_anything_is_written(
    weights_only, tmp_path, monkeypatch, online, capsys
) -> None:
    import huggingface_hub.constants

    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_TOKEN_PATH", str(tmp_path / "no_token"))
    out = tmp_path / "hf"
    argv = ["export", "--checkpoint", str(weights_only), "--out_dir", str(out), "--push_to_hub", "someone/tiny"]
    assert one_line_error(capsys, argv) == (
        "error: --push_to_hub someone/tiny needs a Hugging Face token with write access: run `hf auth login` or set "
        "HF_TOKEN"
    )
    assert not out.exists()


@pytest.mark.slow
def test_push_errors_from_a_real_process(weights_only, tmp_path) -> None:
    """The environment as a user sets it: HF_HUB_OFFLINE=1, then a hub that cannot be reached (a closed port)."""
    args = ["export", "--checkpoint", str(weights_only), "--push_to_hub", "someone/tiny"]
    offline = run_cmd(python_cmd(*args, "--out_dir", str(tmp_path / "a")), check=False, HF_HUB_OFFLINE="1")
    assert offline.returncode == 2 and offline.stderr.strip().splitlines() == [
        "error: --push_to_hub someone/tiny: HF_HUB_OFFLINE=1 is set, so nothing can be uploaded; unset it to upload, "
        "or export without --push_to_hub"
    ]
    with socket.socket() as s:  # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
    out = tmp_path / "b"
    env = {"HF_HUB_OFFLINE": "0", "HF_TOKEN": "hf_test", "HF_ENDPOINT": endpoint}
    unreachable = run_cmd(python_cmd(*args, "--out_dir", str(out), "--private", "true"), check=False, **env)
    lines = unreachable.stderr.strip().splitlines()
    assert unreachable.returncode == 2 and len(lines) == 1, unreachable.stderr[-3000:]
    assert lines[0].startswith(f"error: exported {out}, but the upload to someone/tiny failed: ")
    assert lines[0].endswith(f"upload the folder alone with `hf upload someone/tiny {out} --private`")
    assert (out / WEIGHTS).is_file() and (out / "README.md").is_file()  # the export stays


def test_exported_weights_still_load(weights_only, tmp_path) -> None:
    """The card and the new generation config leave the model folder loadable as before."""
    out = export(weights_only, tmp_path / "hf")
    model = GPT2LMHeadModel.from_pretrained(out)
    assert model.generation_config.eos_token_id == GPT2_EOT


# ------------------------------------------------------------------------------------------- lm-evaluation-harness

TASKS = REPO / "lm_eval_tasks"


def export_page_commands() -> list[str]:
    """The command lines of docs/export.md's bash blocks."""
    blocks = re.findall(r"^```bash\n(.*?)^```", (REPO / "docs" / "export.md").read_text(), re.M | re.S)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def local_rows_path() -> str:
    """Where the task file reads its rows, relative to the folder lm_eval runs in."""
    task = yaml.safe_load((TASKS / "hellaswag_local.yaml").read_text())
    return task["dataset_kwargs"]["data_files"]["validation"]


@pytest.mark.slow
def test_the_local_task_asks_what_the_harness_hellaswag_asks(tmp_path: Path, monkeypatch) -> None:
    """`hellaswag_local` builds the prompts, endings and answer of the harness's own `hellaswag` task from the same
    rows: the 50 of tests/data, and a WikiHow row with the markers and double spaces the release's file holds."""
    import datasets
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks.hellaswag.utils import process_docs

    wikihow = {
        "activity_label": "Home and Garden",
        "ctx_a": "[header] How to clean a sink. [title] Rinse the basin.  [step] Run warm water.",
        "ctx_b": "then you",
        "endings": ["[substeps] scrub  it [title] well.", "wait.", "leave [step] it.", " dry it. "],
        "label": 1,
    }
    rows = [json.loads(line) for line in HELLASWAG.read_text().splitlines()] + [wikihow]
    path = tmp_path / local_rows_path()
    path.parent.mkdir(parents=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    monkeypatch.chdir(tmp_path)
    task = TaskManager(include_path=str(TASKS)).load(["hellaswag_local"])["tasks"]["hellaswag_local"]
    ours = list(task.validation_docs())
    theirs = process_docs(datasets.Dataset.from_list(rows))
    assert len(ours) == len(theirs) == 51
    for doc, reference in zip(ours, theirs, strict=True):
        assert task.doc_to_text(doc) == reference["query"]
        assert task.doc_to_choice(doc) == reference["choices"]
        assert task.doc_to_target(doc) == reference["gold"]
    assert "[" not in task.doc_to_text(ours[-1]) + "".join(task.doc_to_choice(ours[-1]))  # the markers are gone


@pytest.mark.slow
def test_the_offline_lm_eval_recipe_scores_an_export(tiny_run: Path, tmp_path: Path) -> None:
    """docs/export.md's offline lm-evaluation-harness command, as written, in a folder laid out as the page says (the
    export, the rows where the task file reads them, lm_eval_tasks/): offline, it scores the 50 local rows and
    reports acc and acc_norm."""
    (command,) = [c for c in export_page_commands() if c.startswith("lm_eval") and "--include_path" in c]
    words = shlex.split(command)
    model_args = words[words.index("--model_args") + 1]
    export(tiny_run, tmp_path / model_args.removeprefix("pretrained="))
    rows = tmp_path / local_rows_path()
    rows.parent.mkdir(parents=True)
    shutil.copy(HELLASWAG, rows)
    (tmp_path / words[words.index("--include_path") + 1]).symlink_to(TASKS, target_is_directory=True)
    argv = [sys.executable, "-m", "lm_eval", *words[1:], "--output_path", "results"]
    proc = subprocess.run(argv, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-6000:]
    (saved,) = (tmp_path / "results").rglob("results_*.json")
    report = json.loads(saved.read_text())
    scores = report["results"]["hellaswag_local"]
    assert report["n-samples"]["hellaswag_local"]["effective"] == 50
    assert 0 <= scores["acc_norm,none"] <= 1 and 0 <= scores["acc,none"] <= 1
    assert scores["acc_norm_stderr,none"] > 0
    assert re.search(r"\|\s*acc_norm\s*\|", proc.stdout), proc.stdout[-3000:]


def test_two_exports_into_one_folder_at_once_are_one_line(
    tiny_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other export publishes its folder while this one stages (simulated: it appears just before the rename):
    one line saying so, where before it was the raw "Directory not empty" of the rename; its staging is gone."""
    import accel_gpt.export as export_module

    out = tmp_path / "export"
    shown = export_module.make_shareable

    def the_other_export_lands_first(stage: Path) -> None:
        shown(stage)
        out.mkdir(exist_ok=True)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(export_module, "make_shareable", the_other_export_lands_first)
    with pytest.raises(UserError, match="the folder was filled while this export ran"):
        export(tiny_run, out)
    assert [p.name for p in tmp_path.iterdir()] == ["export"] and [p.name for p in out.iterdir()] == ["config.json"]
