"""`prepare --tokenizer bpe`: a byte-level BPE learned from the train split, its tokenizer.json beside the shards and in
every model folder, exact bytes per token, and one line for each way its files can be wrong."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import is_utf8, prepare_stopped_after_first_shard, python_cmd, run_cmd

from accel_gpt import bpe
from accel_gpt.cli import main as cli_main
from accel_gpt.config import PrepareConfig
from accel_gpt.data import shards
from accel_gpt.data.encode import CUT_BEFORE, iter_pieces
from accel_gpt.data.prepare import prepare
from accel_gpt.tokenizer import Tokenizer

MARK = "qzxqzx"  # a word only the held-out paragraphs have


pytestmark = pytest.mark.usefixtures("hf_cache")  # a datasets cache of the tests' own (conftest)


def paragraphs(shakespeare_path: Path) -> list[str]:
    """Shakespeare's paragraphs: the first 10 (held out) carry MARK 20 times, every third one multi-byte characters
    (2, 3 and 4 bytes), and the first a character found nowhere else."""
    found = [p for p in shakespeare_path.read_text().split("\n\n") if p.strip()][:400]
    found = [f"{p} {' '.join([MARK] * 20)}." if i < 10 else p for i, p in enumerate(found)]
    found = [f"{p} ñ 中文 🙂" if i % 3 == 0 else p for i, p in enumerate(found)]
    return [f"{found[0]} ꙮ", *found[1:]]


@pytest.fixture(scope="module")
def text_file(tmp_path_factory: pytest.TempPathFactory, shakespeare_path: Path, hf_cache: Path) -> Path:
    path = tmp_path_factory.mktemp("bpe") / "docs.txt"
    path.write_text("\n\n".join(paragraphs(shakespeare_path)))
    return path


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory, text_file: Path) -> Path:
    out = tmp_path_factory.mktemp("bpe_data") / "d"
    prepare(PrepareConfig(dataset=str(text_file), out_dir=str(out), tokenizer="bpe", vocab_size=400, val_tokens=5000))
    return out


def test_the_tokenizer_never_sees_the_held_out_text(prepared: Path, text_file: Path) -> None:
    """MARK is in the first 10 paragraphs only, which lie in the first 5,000 tokens (val): the tokenizer learned no
    piece of it; learned from everything, it does."""
    learned = bpe.parse((prepared / bpe.TOKENIZER_FILE).read_text(), "t").ranks
    assert not any(b"qzx" in token for token in learned)
    everything = bpe.parse(bpe.train(text_file.read_text().split("\n\n"), 400), "t").ranks
    assert any(b"qzx" in token for token in everything)


def test_manifest_records_the_tokenizer_and_the_stream_decodes_to_the_text(prepared: Path, text_file: Path) -> None:
    manifest = shards.read_manifest(prepared)
    text = (prepared / bpe.TOKENIZER_FILE).read_text()
    assert manifest["tokenizer"] == "bpe" and manifest["tokenizer_sha256"] == bpe.fingerprint(bpe.parse(text, "t"))
    assert manifest["vocab_size"] == 400 and manifest["eot_token"] == 399 and manifest["dtype"] == "uint16"
    tok = shards.tokenizer(manifest, prepared)
    ids = np.concatenate([np.asarray(a) for s in ("val", "train") for a in shards.open_split(prepared, manifest, s)])
    assert manifest["tokens"]["val"] == 5000
    docs = text_file.read_text().split("\n\n")
    cuts = [*np.flatnonzero(ids == tok.eot_token).tolist(), ids.size]
    assert [tok.decode(ids[a + 1 : b].tolist()) for a, b in zip(cuts[:-1], cuts[1:], strict=True)] == docs


def test_bytes_are_counted_from_each_tokens_own_bytes(prepared: Path, text_file: Path) -> None:
    """Some tokens hold part of a character (not UTF-8 alone) and some hold one and a half: decoding ids to a string
    would count them wrong; the byte table counts them exactly."""
    manifest = shards.read_manifest(prepared)
    docs = text_file.read_text().split("\n\n")
    assert sum(manifest["bytes"].values()) == sum(len(d.encode()) for d in docs)
    made = bpe.parse((prepared / bpe.TOKENIZER_FILE).read_text(), "t")
    partial = [t for t in made.ranks if not is_utf8(t)]
    assert len(partial) > 128  # the 128 bytes that begin or continue a character, and merges of them
    tok = shards.tokenizer(manifest, prepared)
    ids = tok.encode(docs[0])
    assert any(not is_utf8(made.encoding.decode_single_token_bytes(i)) for i in ids)
    assert int(tok.token_bytes()[ids].sum()) == len(docs[0].encode())


def test_pieces_cut_for_workers_give_the_tokens_of_the_whole(prepared: Path, shakespeare_path: Path) -> None:
    """Punctuation keeps the newlines after it in this pattern, so a bpe text is cut before spaces only."""
    tok = shards.tokenizer(shards.read_manifest(prepared), prepared)
    text = shakespeare_path.read_text()[:20000] + "\nend.\n\nWhat?!\n  x  y\n\n\n-- (a)\n"
    whole = tok.encode(text)
    for max_chars in (7, 50, 333, 4096):
        pieces = list(iter_pieces(text, max_chars, CUT_BEFORE["bpe"]))
        assert "".join(pieces) == text and len(pieces) > 1
        assert [i for p in pieces for i in tok.encode(p)] == whole, max_chars


def test_output_is_the_same_with_workers_and_small_tasks(tmp_path: Path, prepared: Path, text_file: Path) -> None:
    cfg = PrepareConfig(
        dataset=str(text_file), out_dir=str(tmp_path / "w"), tokenizer="bpe", vocab_size=400, val_tokens=5000
    )
    cfg.num_proc, cfg.task_chars, cfg.shard_size = 2, 3000, 100_000_000
    prepare(cfg)
    assert _files(tmp_path / "w") == _files(prepared)


def _files(folder: Path) -> dict[str, bytes]:
    """Every file published, the manifest without num_proc (which it records, and which changes no byte of output)."""
    found = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file() and p.name != ".lock"}
    manifest = json.loads(found.pop(shards.MANIFEST))
    manifest["args"].pop("num_proc")
    return found | {shards.MANIFEST: json.dumps(manifest).encode()}


def test_a_killed_prepare_resumes_with_the_same_tokenizer(tmp_path: Path, text_file: Path, monkeypatch) -> None:
    """Stopped after its first shard, the same command resumes with the tokenizer recorded, not a new one, and
    writes what an uninterrupted prepare writes."""

    def cfg(name: str) -> PrepareConfig:
        return PrepareConfig(
            dataset=str(text_file), out_dir=str(tmp_path / name), tokenizer="bpe", vocab_size=300, shard_size=3000
        )

    prepare(cfg("whole"))
    prepare_stopped_after_first_shard(cfg("killed"), monkeypatch)
    learn_again = lambda *a: pytest.fail("the tokenizer was learned again")  # noqa: E731 - it would be a new one
    monkeypatch.setattr("accel_gpt.data.prepare.train_tokenizer", learn_again)
    prepare(cfg("killed"))
    assert _files(tmp_path / "killed") == _files(tmp_path / "whole")


def test_parts_share_one_tokenizer_file(tmp_path: Path, prepared: Path, text_file: Path) -> None:
    """Two parts given the same --tokenizer_file merge into the stream of one prepare with it; the merged folder has
    the tokenizer.json, and the parts are refused without one."""
    given = str(prepared / bpe.TOKENIZER_FILE)
    base = ["prepare", "--dataset", str(text_file), "--tokenizer", "bpe", "--tokenizer_file", given]
    cli_main([*base, "--out_dir", str(tmp_path / "one")])
    for i in (0, 1):
        cli_main([*base, "--out_dir", str(tmp_path / "two"), "--num_shards", "2", "--shard_index", str(i)])
    one, two = shards.read_manifest(tmp_path / "one"), shards.read_manifest(tmp_path / "two")
    assert (tmp_path / "two" / bpe.TOKENIZER_FILE).read_text() == Path(given).read_text()
    assert one["tokenizer_sha256"] == two["tokenizer_sha256"] == shards.read_manifest(prepared)["tokenizer_sha256"]
    joined = [
        np.concatenate([np.asarray(a) for a in shards.open_split(d, m, "train")])
        for d, m in ((tmp_path / "one", one), (tmp_path / "two", two))
    ]
    assert np.array_equal(*joined)


def test_a_part_given_another_tokenizer_file_is_refused_before_it_writes(
    tmp_path: Path, prepared: Path, text_file: Path, capsys: pytest.CaptureFixture
) -> None:
    """Part 1 given another --tokenizer_file than finished part 0: one line naming the argument, before it tokenizes
    (nothing of part 1 is written, so the corrected command runs and merges)."""
    other = tmp_path / "other"
    prepare(PrepareConfig(dataset=str(text_file), out_dir=str(other), tokenizer="bpe", vocab_size=300))
    base = ["prepare", "--dataset", str(text_file), "--tokenizer", "bpe", "--num_shards", "2"]
    base += ["--out_dir", str(tmp_path / "two")]
    given, wrong = str(prepared / bpe.TOKENIZER_FILE), str(other / bpe.TOKENIZER_FILE)
    cli_main([*base, "--shard_index", "0", "--tokenizer_file", given])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        cli_main([*base, "--shard_index", "1", "--tokenizer_file", wrong])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1 and "tokenizer_file's sha256" in err
    assert "part part-00000-of-00002" in err and "give this part part-00000-of-00002's" in err
    assert sorted(p.name for p in (tmp_path / "two").iterdir()) == ["part-00000-of-00002"]
    cli_main([*base, "--shard_index", "1", "--tokenizer_file", given])
    assert (
        shards.read_manifest(tmp_path / "two")["tokenizer_sha256"] == shards.read_manifest(prepared)["tokenizer_sha256"]
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tokenizer", "bpe", "--vocab_size", "256"], "vocab_size=256 must be in [257, 65536]"),
        (["--vocab_size", "1000"], "--vocab_size is for --tokenizer bpe"),
        (["--tokenizer", "char", "--tokenizer_file", "t.json"], "--tokenizer_file is for --tokenizer bpe"),
        (["--tokenizer", "bpe", "--num_shards", "2", "--shard_index", "0"], "give its tokenizer.json to every part"),
        (["--tokenizer", "bpe", "--tokenizer_file", "nope.json"], "cannot read the tokenizer file nope.json"),
    ],
)
def test_bad_settings_are_one_line(args: list[str], message: str, tmp_path: Path, text_file: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli_main(["prepare", "--dataset", str(text_file), "--out_dir", str(tmp_path / "o"), *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_file_that_is_no_bpe_tokenizer_is_one_line(tmp_path: Path, text_file: Path, capsys) -> None:
    for name, content in {"text": "not json", "wordpiece": json.dumps({"model": {"type": "WordPiece"}})}.items():
        (bad := tmp_path / f"{name}.json").write_text(content)
        with pytest.raises(SystemExit):
            cli_main(
                [
                    "prepare",
                    "--dataset",
                    str(text_file),
                    "--out_dir",
                    str(tmp_path / name),
                    "--tokenizer",
                    "bpe",
                    "--tokenizer_file",
                    str(bad),
                ]
            )
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is not a byte-level BPE tokenizer that accel_gpt reads" in err[0], err
        assert not (tmp_path / name).exists()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, prepared: Path) -> Path:
    out = tmp_path_factory.mktemp("bpe_run") / "run"
    run_cmd(
        python_cmd(
            "train",
            "--config",
            "tiny-cpu",
            "--data_dir",
            str(prepared),
            "--out_dir",
            str(out),
            "--max_steps",
            "6",
            "--eval_every",
            "3",
            "--save_every",
            "3",
            "--sample_tokens",
            "0",
        )
    )
    return out


def test_the_run_carries_its_tokenizer_and_pads_the_vocabulary(run_dir: Path, prepared: Path) -> None:
    card = json.loads((run_dir / "model_config.json").read_text())
    assert card["model"]["vocab_size"] == 512  # the data's 400 ids padded to a multiple of 128
    assert card["tokenizer"] == {
        "name": "bpe",
        "sha256": shards.read_manifest(prepared)["tokenizer_sha256"],
        "vocab_size": 400,
    }
    for folder in (run_dir, run_dir / "checkpoints" / "step_00000003", run_dir / "checkpoints" / "step_00000006"):
        assert (folder / bpe.TOKENIZER_FILE).read_text() == (prepared / bpe.TOKENIZER_FILE).read_text(), folder


def test_sample_and_eval_use_the_runs_tokenizer(run_dir: Path, prepared: Path) -> None:
    out = run_cmd(python_cmd("sample", "--checkpoint", str(run_dir), "--prompt", "ROMEO:", "--max_new_tokens", "8"))
    assert out.stdout.startswith("ROMEO:")
    result = json.loads(run_cmd(python_cmd("eval", "--checkpoint", str(run_dir), "--data_dir", str(prepared))).stdout)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = [m for m in metrics if "val_loss" in m][-1]
    assert result["val_bpb"] == pytest.approx(last["val_bpb"], rel=1e-6)


def test_a_resume_onto_another_tokenizers_data_is_one_line(tmp_path: Path, run_dir: Path, text_file: Path) -> None:
    other = tmp_path / "other"
    prepare(PrepareConfig(dataset=str(text_file), out_dir=str(other), tokenizer="bpe", vocab_size=300, val_tokens=5000))
    proc = run_cmd(
        python_cmd(
            "train",
            "--config",
            "tiny-cpu",
            "--data_dir",
            str(other),
            "--out_dir",
            str(run_dir),
            "--vocab_size",
            "512",
            "--max_steps",
            "9",
            "--resume",
            "auto",
        ),
        check=False,
    )
    assert proc.returncode == 2
    assert re.fullmatch(
        r"error: cannot resume from \S+: it was trained on other data \(tokenizer_sha256 .*\n",
        proc.stderr.splitlines(keepends=True)[-1],
    ), proc.stderr[-2000:]


DAMAGE = {
    "missing": "is missing",
    "another": "is not the tokenizer recorded beside it",
    "garbled": "is not a byte-level BPE tokenizer that accel_gpt reads",
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_tokenizer_file_is_one_line(damage: str, tmp_path: Path, run_dir: Path, prepared: Path) -> None:
    """Beside the shards (train says it) and in the run dir (sample says it): gone, replaced by another tokenizer,
    or edited into no tokenizer."""
    import shutil

    another = bpe.train(["to be or not to be, that is the question"] * 20, 300)
    for folder, command in ((prepared, "train"), (run_dir, "sample")):
        copy = tmp_path / f"{command}-copy"
        shutil.copytree(folder, copy)
        target = copy / bpe.TOKENIZER_FILE
        if damage == "missing":
            target.unlink()
        else:
            target.write_text(another if damage == "another" else target.read_text().replace('"a"', '"b"', 1))
        if command == "train":
            argv = ["train", "--config", "tiny-cpu", "--data_dir", str(copy), "--out_dir", str(tmp_path / "r")]
        else:
            argv = ["sample", "--checkpoint", str(copy), "--prompt", "x", "--max_new_tokens", "2"]
        proc = run_cmd(python_cmd(*argv), check=False)
        last = proc.stderr.strip().splitlines()[-1]
        assert proc.returncode == 2 and last.startswith("error: ") and str(target) in last, proc.stderr[-2000:]
        assert DAMAGE[damage] in last


def test_a_tokenizer_loaded_by_name_checks_its_file(prepared: Path) -> None:
    tok = Tokenizer.bpe_file(prepared / bpe.TOKENIZER_FILE)
    assert tok == shards.tokenizer(shards.read_manifest(prepared), prepared) and tok.vocab_size == 400


@pytest.fixture(scope="module", params=["gpt2", "nanochat"])
def exported(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, prepared: Path, run_dir: Path):
    """An export of a bpe run of each block (the gpt2 one is `run_dir`), and the run it came from."""
    run = run_dir
    if request.param == "nanochat":
        run = tmp_path_factory.mktemp("bpe_nanochat") / "run"
        run_cmd(
            python_cmd(
                "train",
                "--config",
                "tiny-cpu",
                "--arch",
                "nanochat",
                "--data_dir",
                str(prepared),
                "--out_dir",
                str(run),
                "--max_steps",
                "4",
                "--eval_every",
                "4",
                "--save_every",
                "4",
                "--sample_tokens",
                "0",
            )
        )
    out = tmp_path_factory.mktemp(f"bpe_export_{request.param}") / "hf"
    line = run_cmd(python_cmd("export", "--checkpoint", str(run), "--out_dir", str(out))).stdout
    assert "+ its bpe tokenizer, vocab 400, model card" in line
    return out, run


def test_the_export_tokenizes_as_accel_gpt_does(exported, prepared: Path, text_file: Path) -> None:
    """AutoTokenizer from the export gives accel_gpt's ids on the whole text, held-out part included, and ends
    documents with the same end-of-text."""
    from transformers import AutoTokenizer

    out, _ = exported
    theirs = AutoTokenizer.from_pretrained(out)
    ours = shards.tokenizer(shards.read_manifest(prepared), prepared)
    text = text_file.read_text()
    assert theirs(text)["input_ids"] == ours.encode(text)
    literal = "one document, <|endoftext|> written in its text"  # text to prepare, not a boundary
    assert theirs(literal)["input_ids"] == ours.encode(literal) and ours.eot_token not in ours.encode(literal)
    assert theirs.eos_token_id == ours.eot_token == json.loads((out / "config.json").read_text())["eos_token_id"]


def test_a_pipeline_continues_as_sample_does(exported) -> None:
    """transformers' greedy continuation equals `run.py sample --top_k 1`, on the export and on the run."""
    from transformers import pipeline

    out, run = exported
    generate = pipeline("text-generation", model=str(out))
    theirs = generate("ROMEO: What", max_new_tokens=12, do_sample=False)[0]["generated_text"]
    for model in (run, out):
        ours = run_cmd(
            python_cmd(
                "sample",
                "--checkpoint",
                str(model),
                "--prompt",
                "ROMEO: What",
                "--max_new_tokens",
                "12",
                "--top_k",
                "1",
            )
        ).stdout
        assert ours.rstrip("\n") == theirs, model


def test_the_export_is_read_back_with_its_tokenizer(exported, prepared: Path) -> None:
    """Imported, the export is a bpe model again: eval scores it on the bpe shards as it scores its run."""
    out, run = exported
    from accel_gpt.weights import load_model

    _, card = load_model(out)
    assert card.tokenizer == shards.tokenizer(shards.read_manifest(prepared), prepared)
    scores = [
        json.loads(run_cmd(python_cmd("eval", "--checkpoint", str(m), "--data_dir", str(prepared))).stdout)["val_bpb"]
        for m in (run, out)
    ]
    assert scores[0] == pytest.approx(scores[1], rel=1e-5)


def test_hellaswag_is_scored_in_the_runs_tokens(run_dir: Path) -> None:
    """A bpe model is scored on HellaSwag in its own tokens: its rows' scored part is the ending in them."""
    from conftest import HELLASWAG

    from accel_gpt.evaluate.hellaswag import hellaswag_loader, load_hellaswag
    from accel_gpt.weights import load_model

    out = run_cmd(python_cmd("eval", "--checkpoint", str(run_dir), "--hellaswag", str(HELLASWAG), "--limit", "6"))
    result = json.loads(out.stdout)
    assert result["total"] == 6 and 0 <= result["acc_norm"] <= 1
    _, card = load_model(run_dir)
    rows = next(iter(hellaswag_loader(load_hellaswag(str(HELLASWAG), 1), 64, 1, card.tokenizer)))
    ending = load_hellaswag(str(HELLASWAG), 1)[0].endings[0]
    assert card.tokenizer.decode(rows["tokens"][0][rows["mask"][0]].tolist()) == " " + ending


def test_a_corpus_larger_than_the_cap_is_cut_and_said(tmp_path: Path, text_file: Path, capsys) -> None:
    """`--tokenizer_chars` caps the text the tokenizer learns from, and its line says so."""
    cli_main(["prepare", "--dataset", str(text_file), "--out_dir", str(tmp_path / "d"), "--tokenizer", "bpe",
              "--vocab_size", "300", "--tokenizer_chars", "5000"])  # fmt: skip
    line = next(x for x in capsys.readouterr().err.splitlines() if x.startswith("tokenizer: a byte-level BPE"))
    assert "learned from 5,000 characters of the train split" in line
    assert "(capped at --tokenizer_chars 5,000)" in line


def test_an_export_of_a_checkpoint_pruned_while_it_is_exported_writes_its_tokenizer(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run training in the folder prunes the checkpoint being exported after its weights and tokenizer were read
    (simulated: the folder goes just before the transformers model is built): the export writes the tokenizer as
    it was read, where before it read tokenizer.json again and said it was missing."""
    import accel_gpt.export as export_module

    run = Path(shutil.copytree(run_dir, tmp_path / "run"))
    for name in ("model.safetensors", "model_config.json", bpe.TOKENIZER_FILE):  # still training: no final weights
        (run / name).unlink()
    newest = run / "checkpoints" / "step_00000006"
    build = export_module.to_transformers

    def pruned_first(*args, **kwargs):
        shutil.rmtree(newest)
        return build(*args, **kwargs)

    monkeypatch.setattr(export_module, "to_transformers", pruned_first)
    out = export_module.export(run, tmp_path / "hf")
    assert (out / "tokenizer.json").is_file() and not newest.exists()
