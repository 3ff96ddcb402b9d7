"""`run.py prepare`: text -> token shards + manifest. Local inputs only (a URL is served from 127.0.0.1).

Expected documents are the lists the tests write themselves, so a round trip is checked against the input, not
against another run of the same code.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    REPO,
    SHAKESPEARE,
    is_utf8,
    prepare_stopped_after_first_shard,
    python_cmd,
    run_cmd,
    strip_byte_counts,
    subprocess_env,
    write_token_shards,
)

from accel_gpt.cli import main as cli_main
from accel_gpt.cli import parse
from accel_gpt.config import PrepareConfig
from accel_gpt.data import shards, sources
from accel_gpt.data.encode import encode_pieces, iter_pieces, make_tasks
from accel_gpt.data.merge import merge_parts
from accel_gpt.data.pipeline import STATE_FILE
from accel_gpt.data.prepare import Job, prepare
from accel_gpt.data.sources import BUNDLED_TEXT, load_split, resolve_source
from accel_gpt.errors import ConfigError, DataError
from accel_gpt.files import LOCK
from accel_gpt.tokenizer import GPT2_EOT, Tokenizer

EOT = GPT2_EOT


pytestmark = pytest.mark.usefixtures("hf_cache")  # a datasets cache of the tests' own (conftest)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer("gpt2")


@pytest.fixture(scope="module")
def docs(shakespeare_path: Path) -> list[str]:
    """~300 paragraphs: Shakespeare plus the awkward cases (literal <|endoftext|>, unicode, tabs, spaces)."""
    paragraphs = [p for p in shakespeare_path.read_text().split("\n\n") if p.strip()][:300]
    special = [
        "Before <|endoftext|> after: the literal text must stay text",
        "<|endoftext|>",
        "héllo wörld 中文 🙂 ﬁ\u00a0nbsp\tand a tab",
        "  leading and trailing spaces  ",
        "numbers 1234567 3.14 and 'll 's 've contractions",
    ]
    return paragraphs[:100] + special + paragraphs[100:]


def write_txt(path: Path, documents: list[str]) -> Path:
    """Paragraph documents: none holds a blank line, so joining with one gives the text builder's split back."""
    assert all("\n\n" not in d and d and not d.startswith("\n") and not d.endswith("\n") for d in documents)
    path.write_text("\n\n".join(documents))
    return path


def opts(tmp_path: Path, dataset: Path | str, name: str = "out", **kw) -> PrepareConfig:
    return PrepareConfig(dataset=str(dataset), out_dir=str(tmp_path / name), **kw)


def cli_config(argv: list[str]) -> PrepareConfig:
    """The config `run.py prepare ARGV` runs with: flags over the preset over the defaults (plus an --out_dir,
    which prepare requires, where ARGV gives none)."""
    out_dir = [] if "--out_dir" in argv else ["--out_dir", "data/x"]
    command, cfg = parse(["prepare", *argv, *out_dir])
    assert command == "prepare" and isinstance(cfg, PrepareConfig)
    return cfg


def stream(data_dir: Path) -> np.ndarray:
    """All tokens in stream order: val (the first tokens) then train."""
    manifest = shards.read_manifest(data_dir)
    parts = [
        np.asarray(a)
        for split in ("val", "train")
        if split in manifest["splits"]
        for a in shards.open_split(data_dir, manifest, split)
    ]
    return np.concatenate(parts)


def documents_of(tokens: np.ndarray, tok: Tokenizer) -> list[str]:
    """Split at EOT (which precedes every document) and decode each document."""
    assert tokens[0] == EOT, "the stream must start with the EOT of the first document"
    cuts = [*np.flatnonzero(tokens == EOT).tolist(), tokens.size]
    return [tok.decode(tokens[a + 1 : b].tolist()) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]


def files_of(data_dir: Path) -> dict[str, bytes]:
    """Every file a prepare published (the lock file names the process that held it last, so it is left out)."""
    return {p.name: p.read_bytes() for p in sorted(data_dir.iterdir()) if p.is_file() and p.name != LOCK}


# --- tokenization -------------------------------------------------------------------------------------------------


def test_safe_split_gives_the_tokens_of_the_whole(shakespeare_path: Path, tok: Tokenizer) -> None:
    text = shakespeare_path.read_text()
    whole = tok.encode(text)
    for max_chars in (64, 4096, 100_000):
        pieces = list(iter_pieces(text, max_chars))
        assert "".join(pieces) == text
        assert len(pieces) >= len(text) // max_chars
        assert [t for p in pieces for t in tok.encode(p)] == whole
    # adversarial: whitespace runs of every kind, contractions, unicode spaces, a literal special token
    alphabet = [*"ab  \n\n\t\r'sl1.,!-\u00a0\u3000\u2028\x1c\x85é中", "'ll", "'s", "<|endoftext|>", " \n", "\n "]
    rng = random.Random(0)
    for _ in range(1500):
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 120)))
        for max_chars in (1, 5):
            pieces = list(iter_pieces(s, max_chars))
            assert "".join(pieces) == s
            assert [t for p in pieces for t in tok.encode(p)] == tok.encode(s), (s, pieces)


def test_one_huge_document_is_spread_over_many_tasks(shakespeare_path: Path, tok: Tokenizer) -> None:
    text = shakespeare_path.read_text()
    tasks = list(make_tasks([text], 0, 10_000))
    assert len(tasks) >= 20, "one document must still give work to every worker"
    assert [t.first for t in tasks][0][0] and not any(f for t in tasks[1:] for f in t.first)
    results = [encode_pieces(tok, t.texts, t.first) for t in tasks]
    tokens = np.concatenate([r[0] for r in results])
    assert tokens.tolist() == [EOT, *tok.encode(text)]
    assert sum(int(r[1].sum()) for r in results) == tokens.size


def test_char_pieces_are_code_points_and_an_unknown_one_is_a_data_error() -> None:
    char = Tokenizer("char", "".join(sorted("abc \n")))
    tokens, lengths = encode_pieces(char, ["ab", "c a\n", ""], [True, False, True])
    assert char.decode(tokens.tolist()) == "abc a\n" and lengths.tolist() == [2, 4, 0]
    assert tokens.dtype == np.uint16
    with pytest.raises(DataError, match="'z' is not in this char vocabulary"):
        encode_pieces(char, ["abz"], [True])


# --- output format ------------------------------------------------------------------------------------------------


def test_txt_round_trip_eot_shards_and_manifest(tmp_path: Path, docs: list[str], tok: Tokenizer) -> None:
    src = write_txt(tmp_path / "docs.txt", docs)
    out = tmp_path / "out"
    summary = prepare(opts(tmp_path, src, shard_size=1000))
    tokens = stream(out)
    assert documents_of(tokens, tok) == docs
    assert int((tokens == EOT).sum()) == len(docs), "a literal <|endoftext|> in the text is never token 50256"
    manifest = shards.read_manifest(out)
    entries = manifest["splits"]["train"]
    assert [e["tokens"] for e in entries[:-1]] == [1000] * (len(entries) - 1)
    assert 0 < entries[-1]["tokens"] <= 1000 and sum(e["tokens"] for e in entries) == tokens.size
    assert [e["file"] for e in entries] == [shards.shard_name("train", i) for i in range(len(entries))]
    shards.verify_split(out, manifest, "train")
    assert manifest["tokenizer"] == "gpt2" and manifest["vocab_size"] == 50257 and manifest["dtype"] == "uint16"
    assert manifest["eot_token"] == EOT and manifest["eot_position"] == "before_each_document"
    assert manifest["documents"] == {"train": len(docs)} and sum(e["documents"] for e in entries) == len(docs)
    assert manifest["source"]["kind"] == "files" and manifest["source"]["sample_by"] == "paragraph"
    assert manifest["args"]["shard_size"] == 1000 and "out_dir" not in manifest["args"]
    assert summary.documents == {"train": len(docs)} and summary.tokens == {"train": tokens.size}
    assert not (out / STATE_FILE).exists() and sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == [
        LOCK  # the lock file stays: see prepare._output_folder
    ]
    arrays = shards.open_split(out, manifest, "train")
    assert [e["max_id"] for e in entries] == [int(a.max()) for a in arrays] and entries[0]["max_id"] == EOT
    assert shards.max_token_id(out, manifest, "train") == max(int(a.max()) for a in arrays)
    assert manifest["skipped_null"] == 0 and summary.skipped_null == 0
    stat = src.stat()
    assert manifest["source"]["inputs"] == [{"file": "docs.txt", "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}]


def _save_jsonl(path: Path, documents: list[str | None]) -> Path:
    path.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(documents)))
    return path


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "csv", "save_to_disk", "folder"])
def test_local_sources_give_the_input_documents(kind: str, tmp_path: Path, docs: list[str], tok) -> None:
    import datasets

    documents = [*docs[:150], "", "a document\n\nwith a blank line inside"]
    table = datasets.Dataset.from_dict({"id": list(range(len(documents))), "text": documents})
    if kind == "jsonl":
        src = _save_jsonl(tmp_path / "d.jsonl", documents)
    elif kind == "parquet":
        table.to_parquet(src := tmp_path / "d.parquet")
    elif kind == "csv":
        table.to_csv(src := tmp_path / "d.csv", index=False)
    elif kind == "save_to_disk":
        datasets.DatasetDict({"train": table}).save_to_disk(src := tmp_path / "saved")
    else:
        (src := tmp_path / "folder").mkdir()
        _save_jsonl(src / "a.jsonl", documents[:70])
        _save_jsonl(src / "b.jsonl", documents[70:])
    summary = prepare(opts(tmp_path, src, shard_size=5000))
    if kind == "csv":  # CSV has no empty string apart from a missing value: the "" row reads as null and is skipped
        documents.remove("")
    assert documents_of(stream(tmp_path / "out"), tok) == documents
    assert shards.read_manifest(tmp_path / "out")["skipped_null"] == summary.skipped_null == (kind == "csv")


def test_val_tokens_are_the_first_tokens(tmp_path: Path, docs: list[str]) -> None:
    src = write_txt(tmp_path / "docs.txt", docs)
    prepare(opts(tmp_path, src, "all", shard_size=700))
    prepare(opts(tmp_path, src, "split", shard_size=700, val_tokens=1500))
    whole, manifest = stream(tmp_path / "all"), shards.read_manifest(tmp_path / "split")
    assert [e["tokens"] for e in manifest["splits"]["val"]] == [700, 700, 100]
    assert [e["tokens"] for e in manifest["splits"]["train"]][0] == 700
    assert np.array_equal(stream(tmp_path / "split"), whole), "val + train is the same stream, cut at 1500"
    val = np.concatenate(shards.open_split(tmp_path / "split", manifest, "val"))
    assert manifest["documents"] == {"val": int((val == EOT).sum()), "train": len(docs) - int((val == EOT).sum())}


def test_val_split_of_the_dataset(tmp_path: Path, docs: list[str], tok) -> None:
    import datasets

    splits = {"train": docs[:200], "validation": docs[200:]}
    datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in splits.items()}).save_to_disk(
        tmp_path / "saved"
    )
    prepare(opts(tmp_path, tmp_path / "saved", val_split="validation", shard_size=3000))
    manifest = shards.read_manifest(tmp_path / "out")
    for split, name in (("train", "train"), ("val", "validation")):
        tokens = np.concatenate(shards.open_split(tmp_path / "out", manifest, split))
        assert documents_of(tokens, tok) == splits[name]
    assert manifest["documents"] == {"train": 200, "val": len(docs) - 200}


def test_char_tokenizer_defaults_to_whole_documents(tmp_path: Path, shakespeare_path: Path) -> None:
    text = shakespeare_path.read_text()[:30_000]
    (src := tmp_path / "s.txt").write_text(text)
    argv = ["--dataset", str(src), "--out_dir", str(tmp_path / "out"), "--tokenizer", "char"]
    cfg = cli_config([*argv, "--val_tokens", "3000", "--shard_size", "10000"])
    assert cfg.sample_by == "document"
    prepare(cfg)
    manifest = shards.read_manifest(tmp_path / "out")
    assert manifest["chars"] == "".join(sorted(set(text))) and manifest["vocab_size"] == len(set(text))
    assert manifest["eot_token"] is None and manifest["dtype"] == "uint16"
    assert shards.tokenizer(manifest, tmp_path / "out").decode(stream(tmp_path / "out").tolist()) == text
    assert manifest["splits"]["val"][0]["tokens"] == 3000


def test_char_vocabulary_over_65535_is_uint32(tmp_path: Path) -> None:
    chars = "".join(chr(c) for c in range(0x4E00, 0x4E00 + 70_000) if not 0xD800 <= c < 0xE000)
    text = "".join(random.Random(1).sample(chars, len(chars)))
    (src := tmp_path / "wide.txt").write_text(text)
    prepare(opts(tmp_path, src, tokenizer="char", sample_by="document", shard_size=50_000))
    manifest = shards.read_manifest(tmp_path / "out")
    assert manifest["vocab_size"] == len(chars) > 65_535 and manifest["dtype"] == "uint32"
    assert shards.tokenizer(manifest, tmp_path / "out").decode(stream(tmp_path / "out").tolist()) == text


@pytest.mark.slow
def test_output_does_not_depend_on_workers_streaming_or_task_size(tmp_path: Path, shakespeare_path: Path, tok):
    """Also the huge-document case: the file is one document, cut into ~15 pieces for 2 workers."""
    text = shakespeare_path.read_text()
    (src := tmp_path / "one_doc.txt").write_text(text)
    base = dict(sample_by="document", shard_size=6_000, val_tokens=5_000)
    prepare(opts(tmp_path, src, "serial", **base))
    prepare(opts(tmp_path, src, "parallel", num_proc=2, streaming=True, task_chars=16_000, **base))
    assert len(shards.read_manifest(tmp_path / "serial")["splits"]["train"]) >= 10
    serial, parallel = files_of(tmp_path / "serial"), files_of(tmp_path / "parallel")
    assert {k: v for k, v in serial.items() if k.endswith(".bin")} == {
        k: v for k, v in parallel.items() if k.endswith(".bin")
    }
    assert stream(tmp_path / "parallel").tolist() == [EOT, *tok.encode(text)]


def test_sample_by_line_makes_every_line_a_document(tmp_path: Path, tok) -> None:
    text = "first line\nsecond <|endoftext|> line\n\n  indented after an empty line\nlast"
    (src := tmp_path / "lines.txt").write_text(text)
    prepare(opts(tmp_path, src, sample_by="line"))
    assert documents_of(stream(tmp_path / "out"), tok) == text.split("\n")


def test_limit_reads_the_first_documents(tmp_path: Path, docs: list[str], tok) -> None:
    src = write_txt(tmp_path / "docs.txt", docs)
    prepare(opts(tmp_path, src, limit=7, streaming=True))
    assert documents_of(stream(tmp_path / "out"), tok) == docs[:7]


# --- sources, presets, the command line ----------------------------------------------------------------------------


def test_presets_and_flags_over_them() -> None:
    """A flag overrides only itself: the tinyshakespeare preset with --tokenizer char keeps its val_tokens."""
    fineweb = cli_config(["--preset", "fineweb-edu-10B", "--streaming", "--num_proc", "8"])
    assert (fineweb.dataset, fineweb.dataset_config, fineweb.split) == (
        "HuggingFaceFW/fineweb-edu",
        "sample-10BT",
        "train",
    )
    assert fineweb.val_tokens == 100_000_000 and fineweb.shard_size == 100_000_000 and fineweb.streaming
    assert fineweb.num_proc == 8 and fineweb.sample_by == "paragraph"
    tiny = cli_config(["--preset", "tinyshakespeare"])
    assert tiny.dataset == "" and tiny.sample_by == "document" and tiny.val_tokens == 29_000  # the bundled text
    assert (tiny.tokenizer, tiny.vocab_size, tiny.config) == ("bpe", 8192, "tinyshakespeare")
    tiny_char = cli_config(["--preset", "tinyshakespeare", "--tokenizer", "char"])
    assert (tiny_char.tokenizer, tiny_char.val_tokens, tiny_char.sample_by) == ("char", 29_000, "document")
    assert cli_config(["--preset", "tinyshakespeare", "--tokenizer", "gpt2"]).vocab_size is None
    char = cli_config(["--preset", "shakespeare-char"])
    assert (char.dataset, char.tokenizer, char.val_tokens, char.sample_by) == (
        tiny.dataset,
        "char",
        111_540,
        "document",
    )
    assert cli_config(["--preset", "tinyshakespeare", "--val_tokens", "5"]).val_tokens == 5
    with pytest.raises(ConfigError, match="neither a YAML file nor a prepare preset; did you mean tinyshakespeare"):
        cli_config(["--preset", "tinyshakespear"])


def test_prepare_given_no_text_prepares_the_bundled_tiny_shakespeare() -> None:
    """No --dataset and no preset: the tinyshakespeare preset, whose text (an unset --dataset) ships with accel_gpt;
    a --dataset, a preset or --merge of the user's is never mixed with it."""
    _, cfg = parse(["prepare"])
    assert (cfg.config, cfg.dataset, cfg.out_dir, cfg.val_tokens) == ("tinyshakespeare", "", "data/shakespeare", 29_000)
    assert parse(["prepare", "--val_tokens", "100"])[1].config == "tinyshakespeare"
    assert parse(["prepare", "--dataset", "corpus.txt"])[1].config == ""
    assert parse(["prepare", "--dataset=corpus.txt"])[1].config == ""
    assert parse(["prepare", "--merge", "true", "--out_dir", "data/x"])[1].config == ""
    assert parse(["prepare", "--preset", "fineweb-edu-10B"])[1].dataset == "HuggingFaceFW/fineweb-edu"
    source = resolve_source("")
    assert source.kind == "files" and source.files == (str(BUNDLED_TEXT),) and source.loader == "text"
    assert BUNDLED_TEXT.stat().st_size == 1_115_394 and BUNDLED_TEXT.read_text().startswith("First Citizen:\n")


@pytest.mark.slow
def test_the_char_preset_prepares_the_bundled_text_offline(tmp_path: Path) -> None:
    """nanoGPT's shakespeare_char data with nothing but accel_gpt: 1,115,394 characters, 65 of them distinct, the
    first 111,540 held out."""
    out = tmp_path / "chars"
    prepare(cli_config(["--preset", "shakespeare-char", "--out_dir", str(out)]))
    manifest = shards.read_manifest(out)
    assert manifest["tokens"] == {"train": 1_115_394 - 111_540, "val": 111_540} and manifest["vocab_size"] == 65
    assert shards.tokenizer(manifest, out).decode(stream(out).tolist()) == BUNDLED_TEXT.read_text()


@pytest.mark.parametrize("preset", ["tinyshakespeare", "shakespeare-char"])
def test_presets_on_the_local_file(preset: str, tmp_path: Path, shakespeare_path: Path) -> None:
    """--dataset replaces only the preset's text (the bundled file): one document, its first tokens are val."""
    text = shakespeare_path.read_text()
    out = tmp_path / "out"
    cfg = cli_config(["--preset", preset, "--dataset", str(shakespeare_path), "--out_dir", str(out)])
    summary = prepare(cfg)
    manifest = shards.read_manifest(out)
    learned = shards.tokenizer(manifest, out)
    bpe = preset == "tinyshakespeare"
    total = 1 + len(learned.encode(text)) if bpe else len(text)  # bpe: one document, so one EOT
    val = 29_000 if bpe else 111_540
    assert manifest["tokens"] == {"train": total - val, "val": val} == summary.tokens
    assert manifest["documents"] == {"val": 1, "train": 0} and manifest["source"]["sample_by"] == "document"
    assert manifest["tokenizer"] == ("bpe" if bpe else "char") and manifest["args"]["preset"] == preset
    assert learned.decode(stream(out).tolist()) == ("<|endoftext|>" if bpe else "") + text


def test_url_source_served_locally(tmp_path: Path, docs: list[str], tok, monkeypatch) -> None:
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", False)
    (www := tmp_path / "www").mkdir()
    write_txt(www / "corpus.txt", docs)
    handler = functools.partial(QuietHandler, directory=str(www))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/corpus.txt"
        prepare(opts(tmp_path, url, shard_size=4000))
        assert documents_of(stream(tmp_path / "out"), tok) == docs
        assert shards.read_manifest(tmp_path / "out")["source"]["kind"] == "url"
        with pytest.raises(DataError, match="could not download .*missing.txt"):
            prepare(opts(tmp_path, url.replace("corpus", "missing"), "missing"))
    finally:
        server.shutdown()
    assert not (tmp_path / "missing").exists()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


def _cli_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["prepare", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: ")
    return line


def test_bad_inputs_give_one_line_and_leave_nothing(tmp_path: Path, docs: list[str], capsys) -> None:
    write_txt(tmp_path / "docs.txt", docs)
    _save_jsonl(tmp_path / "d.jsonl", docs[:20])
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "a_file").write_text("x")
    (foreign := tmp_path / "foreign").mkdir()
    (foreign / "notes.txt").write_text("mine")
    cases = {
        "missing": (["--dataset", str(tmp_path / "nope.txt")], "does not exist"),
        "column": (["--dataset", str(tmp_path / "d.jsonl"), "--text_column", "body"], "columns: id, text"),
        "empty": (["--dataset", str(tmp_path / "empty.txt")], "has no documents"),
        "unwritable": (["--dataset", str(tmp_path / "docs.txt")], "cannot write to out_dir"),
        "too_much_val": (["--dataset", str(tmp_path / "docs.txt"), "--val_tokens", "10000000"], "no tokens left"),
        "foreign": (["--dataset", str(tmp_path / "docs.txt")], "holds files (notes.txt"),
        "hub_offline": (["--dataset", "nobody/no-such-dataset"], "could not load 'nobody/no-such-dataset'"),
        "local_split": (["--dataset", str(tmp_path / "docs.txt"), "--split", "test"], "has one split, 'train'"),
    }
    for name, (argv, message) in cases.items():
        out = {"unwritable": tmp_path / "a_file" / "sub", "foreign": foreign}.get(name, tmp_path / f"out_{name}")
        line = _cli_error(capsys, [*argv, "--out_dir", str(out), "--shard_size", "500"])
        assert message in line, (name, line)
        if name == "foreign":
            assert [p.name for p in foreign.iterdir()] == ["notes.txt"], "someone else's folder is left as it was"
        else:
            assert not out.exists(), f"{name}: a failed prepare left {list(out.iterdir())}"


@pytest.mark.slow
def test_cli_process_exits_2_with_one_line(tmp_path: Path) -> None:
    proc = run_cmd(
        python_cmd("prepare", "--dataset", str(tmp_path / "x.jsonl"), "--out_dir", str(tmp_path)), check=False
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: --dataset '{tmp_path / 'x.jsonl'}' does not exist (no such file or folder)"
    ]


# --- re-runs, crashes, resume -------------------------------------------------------------------------------------


def test_rerun_verifies_a_finished_prepare_and_refuses_other_arguments(tmp_path: Path, docs: list[str]) -> None:
    src = write_txt(tmp_path / "docs.txt", docs)
    prepare(opts(tmp_path, src, shard_size=2000))
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir() if p.name != LOCK}
    assert prepare(opts(tmp_path, src, shard_size=2000, num_proc=2)).status == "already prepared"
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "out").iterdir() if p.name != LOCK} == before
    with pytest.raises(DataError, match=r"other arguments \(shard_size: 2000 -> 3000\)"):
        prepare(opts(tmp_path, src, shard_size=3000))
    shard = tmp_path / "out" / shards.shard_name("train", 1)
    shard.write_bytes(shard.read_bytes()[::-1])
    with pytest.raises(DataError, match="fails its checksum"):
        prepare(opts(tmp_path, src, shard_size=2000))


@pytest.mark.slow
def test_killed_prepare_resumes_to_identical_bytes(tmp_path: Path, shakespeare_path: Path, caplog) -> None:
    """SIGKILL the whole process group half-way, damage the last finished shard, re-run the same command."""
    src = tmp_path / "big.txt"
    src.write_text(shakespeare_path.read_text() * 4)  # ~300k tokens: ~60 shards
    argv = ["prepare", "--dataset", str(src), "--shard_size", "5000", "--val_tokens", "12000"]
    cli_main([*argv, "--out_dir", str(tmp_path / "reference")])

    out = tmp_path / "killed"
    proc = subprocess.Popen(  # small tasks, so shards are written while the rest is still being tokenized
        python_cmd(*argv, "--task_chars", "20000", "--out_dir", str(out)),
        cwd=REPO,
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        committed = _wait_for_shards(out, proc, at_least=8)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (out / shards.MANIFEST).exists(), "the run finished before it could be killed"
    last = out / committed[-1]["file"]
    last.write_bytes(b"\0" * last.stat().st_size)  # same size, wrong bytes: only the checksum can tell

    with caplog.at_level("WARNING"):
        cli_main([*argv, "--out_dir", str(out)])
    assert f"shard {last} is missing or changed" in caplog.text
    assert files_of(out) == files_of(tmp_path / "reference")


@pytest.mark.slow
def test_two_prepares_into_one_folder_the_second_is_refused(tmp_path: Path, shakespeare_path: Path) -> None:
    """Two real processes: the first is stopped (SIGSTOP) once it has written shards, so it surely holds the lock
    while the second starts; the second is refused in one line and changes nothing; the first then finishes."""
    src = tmp_path / "big.txt"
    src.write_text(shakespeare_path.read_text() * 4)
    out = tmp_path / "out"
    argv = python_cmd("prepare", "--dataset", str(src), "--shard_size", "5000", "--task_chars", "20000")
    first = subprocess.Popen([*argv, "--out_dir", str(out)], cwd=REPO, env=subprocess_env(),
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    try:
        _wait_for_shards(out, first, at_least=2)
        first.send_signal(signal.SIGSTOP)
        before = files_of(out)
        second = run_cmd([*argv, "--out_dir", str(out)], check=False)
        assert files_of(out) == before
    finally:
        first.send_signal(signal.SIGCONT)
        stdout, _ = first.communicate(timeout=300)
    assert second.returncode == 2 and second.stderr.strip().splitlines() == [
        f"error: {out} is in use by pid {first.pid} on {os.uname().nodename} (prepare refused); "
        "wait for it or use another folder"
    ]
    assert first.returncode == 0 and stdout.startswith("prepared: ")
    shards.verify_split(out, shards.read_manifest(out), "train")
    assert not (out / STATE_FILE).exists()


class Interrupt(Exception):
    """Stands in for a crash: not a UserError, so prepare keeps what it wrote."""


@pytest.mark.parametrize("tokenizer", ["gpt2", "char"])
def test_interrupted_inside_long_documents_resumes_exactly(
    tokenizer: str, tmp_path: Path, shakespeare_path: Path, monkeypatch
) -> None:
    """Shards end inside documents that are cut into many pieces: the resume point (document, offset) must be exact."""
    from accel_gpt.data import pipeline

    text = shakespeare_path.read_text()
    rows = [None, text[:100_000], None, "short", None, text[100_000:], None]  # null rows are counted across a resume
    src = _save_jsonl(tmp_path / "long_docs.jsonl", rows)
    # documents of 10 and 15 pieces; about 20 shards, so every stop below is mid-way
    base = dict(tokenizer=tokenizer, shard_size=4_001, val_tokens=10_000, task_chars=10_000)
    if tokenizer == "char":
        base["shard_size"] = 13_003
    prepare(opts(tmp_path, src, "reference", **base))
    reference = shards.read_manifest(tmp_path / "reference")
    assert sum(map(len, reference["splits"].values())) >= 15 and reference["skipped_null"] == 4
    assert sum(reference["bytes"].values()) == len(text.encode()) + len("short")
    commit = pipeline.StreamWriter._commit
    for stop_after in (1, 4, 11):
        calls = {"n": 0}

        def crashing_commit(self, resume, calls=calls, stop_after=stop_after):
            commit(self, resume)
            calls["n"] += 1
            if calls["n"] == stop_after:
                raise Interrupt

        out = f"stop{stop_after}"
        monkeypatch.setattr(pipeline.StreamWriter, "_commit", crashing_commit)
        with pytest.raises(Interrupt):
            prepare(opts(tmp_path, src, out, **base))
        monkeypatch.setattr(pipeline.StreamWriter, "_commit", commit)
        if stop_after == 4:  # as an older prepare left its state: no byte counts, which the resume counts itself
            state = json.loads((tmp_path / out / STATE_FILE).read_text())
            state["shards"] = [{k: v for k, v in e.items() if k != "bytes"} for e in state["shards"]]
            (tmp_path / out / STATE_FILE).write_text(json.dumps(state))
        assert prepare(opts(tmp_path, src, out, **base)).status == "resumed and prepared"
        assert files_of(tmp_path / out) == files_of(tmp_path / "reference"), stop_after


def _wait_for_shards(out: Path, proc: subprocess.Popen, at_least: int, timeout: float = 120) -> list[dict]:
    """Poll the state file until `at_least` shards are recorded (a real crash point, not a simulated one)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "prepare exited before it could be killed"
        try:
            committed = json.loads((out / STATE_FILE).read_text())["shards"]
        except (FileNotFoundError, json.JSONDecodeError):
            committed = []
        if len(committed) >= at_least:
            return committed
        time.sleep(0.01)
    raise AssertionError(f"no {at_least} shards within {timeout}s")


# --- several machines ---------------------------------------------------------------------------------------------


def test_parts_merge_into_the_single_run_stream(tmp_path: Path, docs: list[str], capsys) -> None:
    src = write_txt(tmp_path / "docs.txt", docs)
    prepare(opts(tmp_path, src, "single", shard_size=3000, val_tokens=2000))
    for index in (2, 0, 1):  # any finishing order; the last one merges
        assert not (tmp_path / "multi" / shards.MANIFEST).exists()
        prepare(opts(tmp_path, src, "multi", shard_size=3000, val_tokens=2000, num_shards=3, shard_index=index))
    merged = shards.read_manifest(tmp_path / "multi")
    for split in ("train", "val"):
        shards.verify_split(tmp_path / "multi", merged, split)
    assert np.array_equal(stream(tmp_path / "multi"), stream(tmp_path / "single"))
    assert merged["documents"] == shards.read_manifest(tmp_path / "single")["documents"]
    assert merged["bytes"] == shards.read_manifest(tmp_path / "single")["bytes"]
    assert sum(merged["bytes"].values()) == sum(len(d.encode()) for d in docs)
    assert [sum(p["bytes"].values()) for p in merged["parts"]] == [
        sum(shards.read_manifest(tmp_path / "multi" / p["dir"])["bytes"].values()) for p in merged["parts"]
    ]
    _byte_counts_add_up(merged)
    assert merged["splits"]["train"][0]["file"] == "part-00000-of-00003/train_000000.bin"
    assert [p["dir"] for p in merged["parts"]] == [f"part-0000{i}-of-00003" for i in range(3)]

    (tmp_path / "multi" / shards.MANIFEST).unlink()
    cli_main(["prepare", "--merge", "--out_dir", str(tmp_path / "multi")])
    assert capsys.readouterr().out.startswith(f"merged: {len(docs):,} documents")
    assert shards.read_manifest(tmp_path / "multi") == merged
    (tmp_path / "multi" / "part-00001-of-00003" / shards.MANIFEST).unlink()
    with pytest.raises(DataError, match="unfinished or missing parts: part-00001-of-00003"):
        merge_parts(tmp_path / "multi")


def test_part_comes_from_the_flags_else_rank_and_world_size() -> None:
    cfg = PrepareConfig(dataset="x.txt", out_dir="data/shards")
    launched = {"RANK": "1", "WORLD_SIZE": "2"}
    assert Job.of(cfg, launched).data_dir == Path("data/shards/part-00001-of-00002")
    assert Job.of(cfg, {}).data_dir == Path("data/shards") == Job.of(cfg, {"RANK": "0", "WORLD_SIZE": "1"}).data_dir
    flags = PrepareConfig(dataset="x.txt", out_dir="data/shards", num_shards=3, shard_index=2)
    assert (Job.of(flags, launched).index, Job.of(flags, launched).count) == (2, 3)
    with pytest.raises(ConfigError, match="char tokenizer"):
        Job.of(PrepareConfig(dataset="x.txt", out_dir="data/shards", tokenizer="char"), launched)
    with pytest.raises(ConfigError, match="go together"):
        PrepareConfig(dataset="x.txt", num_shards=3)
    identity = Job.of(cfg, launched).identity()
    assert identity["num_shards"] == 2 and identity["shard_index"] == 1
    assert identity["limit"] is None and identity["preset"] is None  # all documents, no --preset
    assert not {"out_dir", "num_proc", "task_chars", "merge", "config"} & set(identity)


@pytest.mark.slow
def test_parts_from_accelerate_launch(tmp_path: Path, docs: list[str], tok) -> None:
    """RANK/WORLD_SIZE of a real `accelerate launch` pick the parts; the later process merges them."""
    from conftest import accelerate_cmd

    src = write_txt(tmp_path / "docs.txt", docs)
    out = tmp_path / "launched"
    run_cmd(
        accelerate_cmd(2, "prepare", "--dataset", str(src), "--out_dir", str(out), "--shard_size", "4000"), timeout=180
    )
    assert documents_of(stream(out), tok) == docs
    assert shards.read_manifest(out)["args"]["num_shards"] == 2


@pytest.mark.slow
def test_only_sources_imports_datasets() -> None:
    """Importing the command (and what the spawned workers import) leaves datasets and pyarrow unloaded."""
    code = (
        "import sys, accel_gpt.data.prepare, accel_gpt.data.encode, accel_gpt.data.pipeline, accel_gpt.data.merge;"
        "print(sorted({'datasets', 'pyarrow', 'torch'} & set(sys.modules)))"
    )
    assert run_cmd([sys.executable, "-c", code]).stdout.strip() == "[]"


# --- nothing lost, nothing silently wrong -------------------------------------------------------------------------


def test_a_document_cut_by_val_tokens_is_reported_in_both_splits(tmp_path: Path, capsys) -> None:
    """One document, its first 99 tokens held out: each split reports it (train marks it as begun in val), and the
    total counts it once. Before, train said 0 documents: a document was counted where its end-of-text landed."""
    (src := tmp_path / "one.txt").write_text(SHAKESPEARE.read_text()[:3000])
    out = tmp_path / "out"
    cli_main(["prepare", "--dataset", str(src), "--out_dir", str(out), "--sample_by", "document", "--val_tokens", "99"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    train = shards.read_manifest(out)["tokens"]["train"]
    assert line.startswith(
        f"prepared: 1 document, {train + 99:,} tokens (train {train:,} tokens / 1 document (begun in the val "
        "split) / 1 shard, val 99 tokens / 1 document / 1 shard)"
    ), line


def test_rows_without_text_are_counted_not_made_documents(tmp_path: Path, tok, capsys) -> None:
    """A null text and a row without the column are skipped and reported; an empty string is an empty document."""
    rows = [{"text": "first"}, {"text": None}, {"id": 7}, {"text": ""}, {"text": "last"}]
    (src := tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cli_main(["prepare", "--dataset", str(src), "--out_dir", str(tmp_path / "out")])
    assert documents_of(stream(tmp_path / "out"), tok) == ["first", "", "last"]
    manifest = shards.read_manifest(tmp_path / "out")
    assert manifest["skipped_null"] == 2 and manifest["documents"] == {"train": 3}
    assert "prepared: 3 documents (skipped 2 rows with no text)" in capsys.readouterr().out
    cli_main(["prepare", "--dataset", str(src), "--out_dir", str(tmp_path / "out")])
    assert "already prepared: 3 documents (skipped 2 rows with no text)" in capsys.readouterr().out
    cli_main(["prepare", "--dataset", str(src), "--tokenizer", "char", "--out_dir", str(tmp_path / "chars")])
    assert "prepared: skipped 2 rows with no text, 9 tokens (train 9 tokens / 1 shard)" in capsys.readouterr().out


def _multibyte_text(shakespeare_path: Path) -> str:
    """Shakespeare with 2-, 3- and 4-byte characters on every line, so that any cut falls near one."""
    lines = shakespeare_path.read_text().splitlines()[:600]
    return "\n".join(f"{line} ñ ü 中文 🙂" if i % 2 else line for i, line in enumerate(lines))


def _byte_counts_add_up(manifest: dict) -> None:
    for split, entries in manifest["splits"].items():
        assert sum(e["bytes"] for e in entries) == manifest["bytes"][split], split


@pytest.mark.parametrize("tokenizer", ["gpt2", "char"])
def test_byte_counts_are_the_utf8_bytes_of_the_text(tokenizer: str, tmp_path: Path, shakespeare_path: Path) -> None:
    """The file as one document, the val cut inside a character (gpt2: between two tokens of one emoji's bytes; char:
    just after a 4-byte character): val's bytes are the text's first bytes, train's the rest, whatever the shards."""
    import tiktoken

    text = _multibyte_text(shakespeare_path)
    data = text.encode()
    (src := tmp_path / "t.txt").write_text(text)
    if tokenizer == "gpt2":
        enc = tiktoken.get_encoding("gpt2")
        ids = enc.encode_ordinary(text)
        # a token whose bytes are part of a character: the cut after it splits that character between val and train
        k = next(k for k in range(2000, len(ids)) if not is_utf8(enc.decode_single_token_bytes(ids[k])))
        val_tokens, val_bytes = k + 2, len(enc.decode_bytes(ids[: k + 1]))  # + EOT before the document
        assert data[:val_bytes] == enc.decode_bytes(ids[: k + 1]) and not is_utf8(data[:val_bytes])
    else:
        val_tokens = text.index("🙂", 5000) + 1
        val_bytes = len(text[:val_tokens].encode())
    prepare(opts(tmp_path, src, tokenizer=tokenizer, sample_by="document", shard_size=1500, val_tokens=val_tokens))
    manifest = shards.read_manifest(tmp_path / "out")
    assert manifest["bytes"] == {"train": len(data) - val_bytes, "val": val_bytes}
    assert sum(manifest["tokens"].values()) == (len(ids) + 1 if tokenizer == "gpt2" else len(text))
    assert len(manifest["splits"]["val"]) >= 2 and len(manifest["splits"]["train"]) >= 2
    _byte_counts_add_up(manifest)
    assert shards.tokens_per_byte(manifest, "val") == val_tokens / val_bytes


def test_byte_counts_skip_the_separators_and_sum_over_documents(tmp_path: Path, docs: list[str]) -> None:
    """Paragraph documents: the blank lines between them are no document's text, and EOT stands for no bytes."""
    src = write_txt(tmp_path / "docs.txt", docs)
    prepare(opts(tmp_path, src, shard_size=700, val_tokens=1500))
    manifest = shards.read_manifest(tmp_path / "out")
    assert sum(manifest["bytes"].values()) == sum(len(d.encode()) for d in docs)
    _byte_counts_add_up(manifest)


def test_rerun_adds_the_byte_counts_to_an_older_manifest(tmp_path: Path, docs: list[str], capsys) -> None:
    """A manifest written before byte counts existed: the same command counts them from the shards it verifies."""
    src = write_txt(tmp_path / "docs.txt", docs)
    argv = ["prepare", "--dataset", str(src), "--out_dir", str(tmp_path / "out"), "--val_tokens", "1500"]
    cli_main([*argv, "--shard_size", "700"])
    path = tmp_path / "out" / shards.MANIFEST
    current = json.loads(path.read_text())
    strip_byte_counts(tmp_path / "out")
    assert "bytes" not in path.read_text() and shards.split_bytes(shards.read_manifest(tmp_path / "out"), "val") is None
    capsys.readouterr()
    cli_main([*argv, "--shard_size", "700"])
    assert capsys.readouterr().out.startswith("already prepared (added the byte counts to its manifest): ")
    assert json.loads(path.read_text()) == current
    cli_main([*argv, "--shard_size", "700"])
    assert capsys.readouterr().out.startswith("already prepared: ")


def test_a_manifest_with_garbled_byte_counts_is_refused(tmp_path: Path) -> None:
    write_token_shards(tmp_path / "d", [1, 2, 3], [4, 5])
    path = tmp_path / "d" / shards.MANIFEST
    path.write_text(json.dumps(json.loads(path.read_text()) | {"bytes": {"val": -1}}))
    with pytest.raises(DataError, match="bytes must map split names to byte counts"):
        shards.read_manifest(tmp_path / "d")


def test_char_shards_record_their_largest_id(tmp_path: Path) -> None:
    (src := tmp_path / "s.txt").write_text("abcabc zzz a")
    prepare(opts(tmp_path, src, tokenizer="char", shard_size=4))
    manifest = shards.read_manifest(tmp_path / "out")
    arrays = shards.open_split(tmp_path / "out", manifest, "train")
    # vocabulary " abcz": "abca" "bc z" "zz a"
    assert [e["max_id"] for e in manifest["splits"]["train"]] == [int(a.max()) for a in arrays] == [3, 4, 4]


def test_a_second_prepare_into_a_locked_folder_is_refused(tmp_path: Path, docs: list[str], capsys) -> None:
    """The holder is simulated in this process (the two-process case is a slow test): nothing is written."""
    from accel_gpt.files import locked

    src = write_txt(tmp_path / "docs.txt", docs)
    (out := tmp_path / "out").mkdir()
    with locked(out, "prepare"):
        line = _cli_error(capsys, ["--dataset", str(src), "--out_dir", str(out)])
        assert line == f"error: {out} is in use by pid {os.getpid()} on {os.uname().nodename} (prepare refused); " + (
            "wait for it or use another folder"
        )
        assert [p.name for p in out.iterdir()] == [LOCK]
        line = _cli_error(capsys, ["--merge", "--out_dir", str(out)])
        assert "is in use by pid" in line and "(prepare --merge refused)" in line
    prepare(opts(tmp_path, src))  # free again


def test_parts_into_a_single_part_folder_are_refused(tmp_path: Path, docs: list[str], capsys) -> None:
    """A merge would overwrite the single run's manifest and orphan its shards; parts of another count would never
    merge. Both are refused before anything is written."""
    src = write_txt(tmp_path / "docs.txt", docs)
    prepare(opts(tmp_path, src, "single"))
    before = files_of(tmp_path / "single")
    for index in (0, 1):
        argv = ["--dataset", str(src), "--out_dir", str(tmp_path / "single"), "--num_shards", "2"]
        line = _cli_error(capsys, [*argv, "--shard_index", str(index)])
        assert "holds a single-part prepare; a prepare in 2 parts (--num_shards) needs its own folder" in line
    assert files_of(tmp_path / "single") == before and not list((tmp_path / "single").glob("part-*"))
    prepare(opts(tmp_path, src, "multi", num_shards=3, shard_index=0))
    argv = ["--dataset", str(src), "--out_dir", str(tmp_path / "multi"), "--num_shards", "2", "--shard_index", "0"]
    assert "holds parts of another part count (part-00000-of-00003)" in _cli_error(capsys, argv)
    assert [p.name for p in (tmp_path / "multi").iterdir()] == ["part-00000-of-00003"]


def test_more_parts_than_rows_is_one_line(tmp_path: Path, capsys) -> None:
    (src := tmp_path / "one.txt").write_text("a single paragraph")
    argv = ["--dataset", str(src), "--out_dir", str(tmp_path / "out"), "--num_shards", "2", "--shard_index", "1"]
    assert _cli_error(capsys, argv) == (
        "error: --num_shards 2 splits the input into more parts than it has documents (1): every part needs at least "
        "one; use --num_shards 1 or fewer"
    )
    assert not (tmp_path / "out").exists()


def test_changed_input_is_not_already_prepared(tmp_path: Path, docs: list[str], capsys) -> None:
    src = write_txt(tmp_path / "docs.txt", docs)
    argv = ["--dataset", str(src), "--out_dir", str(tmp_path / "out")]
    cli_main(["prepare", *argv])
    before = files_of(tmp_path / "out")
    with src.open("a") as f:
        f.write("\n\none more paragraph")
    line = _cli_error(capsys, argv)
    out = tmp_path / "out"
    assert f"the input changed since the finished prepare in out_dir '{out}' read it (docs.txt: size " in line
    assert line.endswith(f"delete '{tmp_path / 'out'}' to prepare it again, or use another --out_dir")
    write_txt(src, docs)  # the same bytes again, but written later: the modification time tells
    assert "(docs.txt: modified since)" in _cli_error(capsys, argv)
    assert files_of(tmp_path / "out") == before


def interrupted_prepare(tmp_path: Path, docs: list[str], monkeypatch: pytest.MonkeyPatch) -> Path:
    """A prepare of docs.txt into tmp_path/out that stops right after its first committed shard; returns docs.txt."""
    src = write_txt(tmp_path / "docs.txt", docs)
    prepare_stopped_after_first_shard(opts(tmp_path, src, shard_size=1000), monkeypatch)
    return src


def test_changed_input_is_not_resumed(tmp_path: Path, docs: list[str], monkeypatch, capsys) -> None:
    src = interrupted_prepare(tmp_path, docs, monkeypatch)
    write_txt(src, docs[::-1])
    line = _cli_error(capsys, ["--dataset", str(src), "--out_dir", str(tmp_path / "out"), "--shard_size", "1000"])
    assert "the input changed since the interrupted prepare in out_dir" in line and "(docs.txt: " in line


@pytest.mark.parametrize("garble", ["truncated", "missing_key"])
def test_garbled_state_file_is_one_line(garble: str, tmp_path: Path, docs: list[str], monkeypatch, capsys) -> None:
    src = interrupted_prepare(tmp_path, docs, monkeypatch)
    state = tmp_path / "out" / STATE_FILE
    raw = state.read_text()
    state.write_text(raw[: len(raw) // 2] if garble == "truncated" else json.dumps({"identity": {}}))
    before = files_of(tmp_path / "out")
    line = _cli_error(capsys, ["--dataset", str(src), "--out_dir", str(tmp_path / "out"), "--shard_size", "1000"])
    error = "JSONDecodeError" if garble == "truncated" else "KeyError"
    assert line.startswith(f"error: {state}, the record of an interrupted prepare, is unreadable ({error}")
    assert line.endswith(f"it cannot be resumed; delete '{tmp_path / 'out'}' and prepare again")
    assert files_of(tmp_path / "out") == before


def test_disk_full_keeps_the_finished_shards_for_a_resume(tmp_path: Path, docs: list[str], monkeypatch, capsys):
    """ENOSPC from the shard writer (what a full disk raises): one line, finished shards and state kept, no
    temporaries; the same command then resumes to the bytes of an uninterrupted run."""
    import errno

    src = write_txt(tmp_path / "docs.txt", docs)
    argv = ["--dataset", str(src), "--shard_size", "1000", "--val_tokens", "1500"]
    cli_main(["prepare", *argv, "--out_dir", str(tmp_path / "reference")])
    write, calls = shards.ShardWriter.write, {"n": 0}

    def full_disk(self, tokens):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        write(self, tokens)

    out = tmp_path / "out"
    monkeypatch.setattr(shards.ShardWriter, "write", full_disk)
    line = _cli_error(capsys, [*argv, "--out_dir", str(out)])
    monkeypatch.undo()
    kept = json.loads((out / STATE_FILE).read_text())["shards"]
    assert len(kept) >= 1 and line == (
        f"error: cannot write to out_dir '{out}': no space left on the device; {len(kept)} finished shard(s) kept: "
        f"make room and run the same command again to resume, or delete '{out}'"
    )
    assert sorted(p.name for p in out.iterdir() if p.name != LOCK) == sorted([STATE_FILE, *(e["file"] for e in kept)])
    cli_main(["prepare", *argv, "--out_dir", str(out)])
    assert capsys.readouterr().out.startswith("resumed and prepared: ")
    assert files_of(out) == files_of(tmp_path / "reference")


def test_the_default_out_dir_and_a_missing_val_split_are_said(
    tmp_path: Path, docs: list[str], capsys, monkeypatch
) -> None:
    src = write_txt(tmp_path / "docs.txt", docs[:20])
    monkeypatch.chdir(tmp_path)
    cli_main(["prepare", "--dataset", str(src)])  # the command-line contract: --out_dir is optional
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("-> data/shards") and out[1].startswith("note: no val split in data/shards")
    assert (tmp_path / "data" / "shards" / "manifest.json").is_file()
    assert _cli_error(capsys, ["--dataset", str(src), "--out_dir", ""]).startswith("error: --out_dir is empty")
    cli_main(["prepare", "--dataset", str(src), "--out_dir", str(tmp_path / "no_val")])
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("prepared: ") and out[0].endswith(f"-> {tmp_path / 'no_val'}")
    assert out[1].startswith(f"note: no val split in {tmp_path / 'no_val'} (neither --val_tokens nor --val_split)")
    cli_main(["prepare", "--dataset", str(src), "--out_dir", str(tmp_path / "val"), "--val_tokens", "100"])
    assert len(capsys.readouterr().out.splitlines()) == 1


def test_the_rate_has_a_unit_that_shows_its_digits() -> None:
    from accel_gpt.data.prepare import tokens_per_second

    assert tokens_per_second(830, 1.0) == "830 tokens/s"
    assert tokens_per_second(41_234, 1.0) == "41.2K tokens/s"
    assert tokens_per_second(2_500_000, 2.0) == "1.25M tokens/s"
    assert tokens_per_second(10, 0.0).endswith(" tokens/s")  # an instant prepare divides by no zero


def test_a_folder_without_data_says_how_to_prepare_it(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    for folder, start in ((tmp_path / "empty", "no manifest.json in data_dir"), (tmp_path / "gone", "data_dir")):
        with pytest.raises(DataError) as err:
            shards.read_manifest(folder)
        message = str(err.value)
        assert message.startswith(start)
        assert f"`run.py prepare --dataset SRC --out_dir {folder}`" in message
        assert f"`run.py prepare --preset NAME --out_dir {folder}` (NAME: fineweb-edu-10B, shakespeare-char" in message


def mapped_resident(path: str) -> int:
    """Bytes of `path`'s memory mappings resident in this process (/proc/self/smaps)."""
    resident, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
            inside = len(fields) == 6 and fields[5] == path
        elif inside and fields[0] == "Rss:":
            resident += int(fields[1]) * 1024
    return resident


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/smaps").is_file(), reason="reads Linux's /proc/self/smaps")
def test_a_pass_over_the_datasets_cache_keeps_a_bounded_part_of_it_resident(tmp_path: Path, monkeypatch) -> None:
    """Reading 60 MB of text from its memory-mapped Arrow cache: without releases every page read stays in the RSS
    (so 1 GB of text was 1 GB of RSS); with them, at most the text read between two releases (8 MB here)."""
    text = tmp_path / "big.txt"
    shakespeare = BUNDLED_TEXT.read_text()  # 1.1 MB
    text.write_text("".join(f"{i}\n{shakespeare}" for i in range(55)))
    ds = load_split(resolve_source(str(text)), "train", opts(tmp_path, text))
    (cache,) = (entry["filename"] for entry in ds.cache_files)
    seen = {}
    for release in (1 << 40, 8 << 20):
        monkeypatch.setattr(sources, "RELEASE_BYTES", release)
        sources.release_mapped({cache})
        chars = sum(len(t) for t in sources.Stream(ds, "text", "train").texts())
        seen[release] = mapped_resident(cache)
    assert chars > 59_000_000
    assert seen[1 << 40] > 50_000_000, seen  # the growth the releases prevent is what this measures
    assert seen[8 << 20] < 20_000_000, seen
