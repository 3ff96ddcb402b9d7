"""HellaSwag and validation loss: hand-worked scoring, exactness under W = 1, 2, 3, input errors.

The launched runs are made once per module (`launches`) and shared by several tests, because each
`accelerate launch` spends seconds on imports; those tests are `slow`. The same evaluation also runs in
this process (one rank), so the fast subset still checks the numbers against hand-made references.
"""

from __future__ import annotations

import http.server
import json
import math
import re
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tiktoken
import torch
import torch.nn.functional as F
import yaml
from conftest import HELLASWAG, REPO, SHAKESPEARE, accelerate_cmd, run_cmd, strip_byte_counts, write_token_shards

from accel_gpt.cli import main
from accel_gpt.data import shards
from accel_gpt.data.loader import val_windows
from accel_gpt.errors import UserError
from accel_gpt.evaluate.hellaswag import (
    HellaSwagTokens,
    candidate_losses,
    check_vocabulary,
    choose,
    collate,
    load_hellaswag,
)
from accel_gpt.metrics import read_metrics
from accel_gpt.model import GPT, GPTConfig
from accel_gpt.tokenizer import GPT2_EOT, Tokenizer
from accel_gpt.weights import ModelCard, load_model, save_weights

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=64, vocab_size=50304)
WORLD_SIZES = (1, 2, 3)
BATCH = 2  # examples (HellaSwag) or windows (val loss) per forward pass: 7 examples leave uneven shards
EVAL_WINDOWS = 9  # validation windows: a last batch of one, and uneven shards for W = 2 and 3
GPT2 = Tokenizer("gpt2")


def hs_row(ind: int, ctx: str, endings: list[str], label: int) -> dict:
    """A row in the original release layout."""
    return {
        "ind": ind,
        "activity_label": "Testing",
        "ctx_a": ctx,
        "ctx_b": "",
        "ctx": ctx,
        "split": "val",
        "split_type": "indomain",
        "label": label,
        "endings": endings,
        "source_id": f"test~{ind}",
    }


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def save(model: GPT, out_dir: Path, tokenizer: Tokenizer = GPT2) -> Path:
    save_weights(model.state_dict(), ModelCard(model.config, tokenizer, step=0), out_dir)
    return out_dir


SEVEN = [
    hs_row(100, "A man is sitting on a roof. he", ["is using wrap.", "rips tiles off.", "holds a cube.", "starts."], 3),
    hs_row(
        101, "A lady walks to a barbell. She", ["swings.", "pulls the barbell forward slowly.", "sits.", "lifts it."], 1
    ),
    # longer than seq_len=64 tokens: the rightmost tokens are kept
    hs_row(102, "word " * 90 + "and then", ["they stop.", "it rains all day long.", "a dog barks.", "nothing."], 0),
    hs_row(103, "The chef slices onions.", ["He cries.", "She cooks them in a pan.", "They fly.", "It ends."], 1),
    hs_row(104, "Kids play in the snow.", ["They build a snowman.", "It melts.", "A car.", "Yes."], 0),
    hs_row(105, "A dog runs on the beach.", ["It swims.", "The dog catches a frisbee.", "Sand.", "He sleeps."], 2),
    hs_row(106, "Someone paints a wall.", ["The wall turns blue.", "Paint drips.", "Done.", "They leave the room."], 3),
]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("evaluate")


# The same shape with nanochat's block: every evaluation below must hold for both blocks.
NANOCHAT = GPTConfig(**{**TINY.to_dict(), "arch": "nanochat", "bias": False, "n_kv_head": 1, "logit_softcap": 15.0})


@pytest.fixture(scope="module", params=[TINY, NANOCHAT], ids=["gpt2", "nanochat"])
def tiny_checkpoint(workdir: Path, request: pytest.FixtureRequest) -> Path:
    torch.manual_seed(0)
    model = GPT(request.param)
    if request.param.arch == "nanochat":  # zero-init output projections and a tiny head would score all alike
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    return save(model, workdir / f"tiny-{request.param.arch}")


@pytest.fixture(scope="module")
def seven_path(workdir: Path) -> Path:
    return write_jsonl(workdir / "seven.jsonl", SEVEN)


@pytest.fixture(scope="module")
def val_data(workdir: Path) -> Path:
    tokens = np.random.default_rng(0).integers(0, 50257, size=12 * TINY.seq_len + 1).tolist()
    return write_token_shards(workdir / "data", train=tokens, val=tokens)


WORKER = '''
"""Trainer-style use on every rank: a DDP-wrapped model through the public evaluation functions, and through
the Evaluator that the training loop runs."""
import json, sys
sys.modules["datasets"] = None  # as if `datasets` were not installed: training must not need it
from pathlib import Path
from torch.utils.data import DataLoader
from accel_gpt.config import TrainConfig
from accel_gpt.data.loader import val_windows
from accel_gpt.evaluate.evaluator import Evaluator
from accel_gpt.evaluate.hellaswag import hellaswag_loader, hellaswag_metrics, load_hellaswag, score_hellaswag
from accel_gpt.evaluate.val_loss import evaluate_loss
from accel_gpt.generate import sample_texts
from accel_gpt.runtime import make_accelerator
from accel_gpt.weights import load_model

checkpoint, hellaswag, data_dir, out, batch, eval_windows = sys.argv[1:]
batch, eval_windows = int(batch), int(eval_windows)
accelerator = make_accelerator()
model, card = load_model(checkpoint)
model.train()
seq_len = card.model.seq_len
val_dl = DataLoader(val_windows(data_dir, seq_len, eval_windows), batch_size=batch)
model, val_dl = accelerator.prepare(model, val_dl)
hellaswag_dl = accelerator.prepare_data_loader(hellaswag_loader(load_hellaswag(hellaswag), seq_len, batch))
row = hellaswag_metrics(score_hellaswag(model, accelerator, hellaswag_dl))
row["val_loss"] = evaluate_loss(model, val_dl, accelerator)
row["text"] = sample_texts(model, card.model, card.tokenizer, "Hello", 8, 1.0, 50, 3, accelerator.device)[0]
shape = {k: v for k, v in card.model.to_dict().items() if k != "layer_norm_eps"}
cfg = TrainConfig(data_dir=data_dir, **shape, micro_batch_size=batch, total_batch_size=batch * seq_len,
                  eval_every=1, eval_windows=eval_windows, hellaswag_every=1, hellaswag=hellaswag, sample_tokens=0)
row["evaluator"] = Evaluator(cfg, accelerator, model, card, ["train", "val"]).run(step=1, last=True)
row.update(num_processes=accelerator.num_processes, wrapper=type(model).__name__, training=model.training)
Path(out, f"rank{accelerator.process_index}.json").write_text(json.dumps(row))
'''


@pytest.fixture(scope="module")
def launches(workdir: Path, tiny_checkpoint: Path, seven_path: Path, val_data: Path) -> dict:
    """`run.py eval` under W = 1, 2, 3 plus the DDP worker under W = 2, launched side by side."""
    common = ["--checkpoint", str(tiny_checkpoint), "--hellaswag", str(seven_path), "--batch_size", str(BATCH)]
    common += ["--data_dir", str(val_data), "--eval_windows", str(EVAL_WINDOWS)]
    workdir = workdir / f"launches-{tiny_checkpoint.name}"
    workdir.mkdir()
    jobs = {W: accelerate_cmd(W, "eval", *common, "--out", str(workdir / f"preds_w{W}.jsonl")) for W in WORLD_SIZES}
    worker, worker_out = workdir / "worker.py", workdir / "worker_out"
    worker.write_text(WORKER)
    worker_out.mkdir()
    cmd = accelerate_cmd(2)
    cmd[cmd.index("run.py")] = str(worker)
    jobs["ddp"] = [*cmd, str(tiny_checkpoint), str(seven_path), str(val_data), str(worker_out), str(BATCH),
                   str(EVAL_WINDOWS)]  # fmt: skip
    with ThreadPoolExecutor(len(jobs)) as pool:
        procs = dict(zip(jobs, pool.map(lambda c: run_cmd(c, PYTHONPATH=str(REPO)), jobs.values()), strict=True))
    results = {}
    for W in WORLD_SIZES:
        printed = [line for line in procs[W].stdout.splitlines() if line.startswith("{")]
        assert len(printed) == 1, f"W={W} printed {len(printed)} JSON objects:\n{procs[W].stdout}"
        preds = [json.loads(line) for line in (workdir / f"preds_w{W}.jsonl").read_text().splitlines()]
        results[W] = (json.loads(printed[0]), preds)
    results["ddp"] = [json.loads((worker_out / f"rank{r}.json").read_text()) for r in range(2)]
    return results


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`run.py eval` in this process, as a 1-process group; the Accelerate state is dropped afterwards so
    that other tests start from none, and glibc's malloc settings (a training-speed tweak) are left alone."""
    from accelerate.state import AcceleratorState

    monkeypatch.setattr("accel_gpt.runtime.keep_freed_memory", lambda: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def eval_here(capsys: pytest.CaptureFixture, *args: str) -> dict:
    """The JSON object that `run.py eval ARGS` prints, run in this process (needs `one_rank`)."""
    main(["eval", *args])
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(printed) == 1, printed
    return json.loads(printed[0])


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path, val_data: Path) -> dict:
    """What evaluation must give, computed here the plain way: each HellaSwag candidate scored alone (no
    padding, no batch, truncation written out here), and the validation loss one window at a time."""
    model, _ = load_model(tiny_checkpoint)
    enc = GPT2
    predictions = []
    for row in SEVEN:
        ctx = enc.encode(row["ctx"])
        sums, means = [], []
        for ending in row["endings"]:
            end = enc.encode(" " + ending)
            ids = torch.tensor((ctx + end)[-TINY.seq_len :])
            n = len(end)
            with torch.no_grad():
                logits = model(ids[None])[0][0, len(ids) - n - 1 : -1]  # the positions predicting the ending
            losses = (-F.log_softmax(logits.double(), dim=-1)[torch.arange(n), ids[-n:]]).tolist()
            sums.append(sum(losses))
            means.append(sum(losses) / n)
        predictions.append((int(np.argmin(means)), int(np.argmin(sums))))
    windows = val_windows(val_data, TINY.seq_len, EVAL_WINDOWS)
    with torch.no_grad():
        val_loss = np.mean([model(x[None], y[None])[1].item() for x, y in windows])
    return {"predictions": predictions, "val_loss": val_loss, "per_byte": val_tokens_per_byte(val_data)}


def val_tokens_per_byte(data_dir: Path) -> float:
    """Tokens per UTF-8 byte of the val split, from its tokens and tiktoken alone (not from the manifest's count)."""
    manifest = shards.read_manifest(data_dir)
    tokens = np.concatenate(shards.open_split(data_dir, manifest, "val")).tolist()
    enc = tiktoken.get_encoding("gpt2")
    return len(tokens) / len(enc.decode_bytes([t for t in tokens if t != GPT2_EOT]))


# ------------------------------------------------------------------------------ hand-built scoring case


def hand_model(L_target: float = 12.0) -> tuple[GPT, float]:
    """A GPT whose next-token logits are set by hand: a bigram table over two tokens, " dog" and " cat".

    Every block's output projection is zero and the position embeddings are zero, so the residual
    stream is just wte[token] and logits = ln_f(wte[a]) @ wte.T. " dog" and " cat" get s * (two
    orthogonal zero-mean +-1 Hadamard rows); every other row is zero. Hence after " dog" the logit of
    " dog" is L = 32 s^2 / sqrt(s^2 + eps) and every other logit 0 (likewise for " cat"), and after any
    other token all logits are 0 (LayerNorm of a zero vector is zero).
    """
    model = GPT(TINY)
    hadamard = torch.ones(1, 1)
    while hadamard.size(0) < TINY.n_embd:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)])
    s = math.sqrt(L_target / TINY.n_embd)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.transformer.ln_f.weight.fill_(1.0)
        model.transformer.wte.weight[DOG] = s * hadamard[1]
        model.transformer.wte.weight[CAT] = s * hadamard[2]
    L = TINY.n_embd * s * s / math.sqrt(s * s + TINY.layer_norm_eps)
    return model.eval(), L


DOG, CAT = 3290, 3797  # " dog", " cat" in tiktoken gpt2 (asserted below)
HAND = [
    # the context ends in a token with zero logits; ending 1 is long but cheap after its first token
    hs_row(7, "A man walks", ["cat", "dog dog dog", "cat dog", "dog cat"], 1),
    # the context ends in " dog": ending 0 repeats it and wins on both measures
    hs_row(8, "A boy pets the dog", ["dog", "cat", "the cat", "cat cat"], 0),
]


def hand_expected(L: float) -> list[tuple[list[float], list[float]]]:
    """Per example: (summed, mean) ending losses of the four candidates, worked out from L alone."""
    V = TINY.vocab_size
    u = math.log(V)  # after a token with all-zero logits: uniform
    h = math.log(1 + (V - 1) * math.exp(-L))  # " dog" after " dog" (or " cat" after " cat")
    m = math.log(math.exp(L) + V - 1)  # any other token after " dog" / " cat"
    token_losses = [
        [[u], [u, h, h], [u, m], [u, m]],
        [[h], [m], [m, u], [m, h]],
    ]
    return [([sum(c) for c in ex], [sum(c) / len(c) for c in ex]) for ex in token_losses]


def test_hand_built_losses_and_choices_match_worked_values(tmp_path: Path) -> None:
    enc = GPT2
    assert enc.encode(" dog dog dog") == [DOG] * 3 and enc.encode(" cat dog") == [CAT, DOG]
    assert enc.encode("A boy pets the dog")[-1] == DOG and enc.encode("A man walks")[-1] not in (DOG, CAT)
    model, L = hand_model()
    examples = load_hellaswag(str(write_jsonl(tmp_path / "hand.jsonl", HAND)))
    batch = collate([HellaSwagTokens(examples, enc, TINY.seq_len)[i] for i in range(2)], TINY.seq_len)
    total, mean = candidate_losses(model, batch["tokens"], batch["mask"])
    for k, (sums, means) in enumerate(hand_expected(L)):
        assert total[4 * k : 4 * k + 4].tolist() == pytest.approx(sums, abs=2e-4)
        assert mean[4 * k : 4 * k + 4].tolist() == pytest.approx(means, abs=2e-4)
    pred_norm, pred_sum = choose(total, mean)
    assert pred_norm.tolist() == [1, 0] and pred_sum.tolist() == [0, 0]
    (sums0, means0), (sums1, means1) = hand_expected(L)
    # worked out: example 0's shortest ending has the lowest sum (u < u + 2h) but ending 1 the lowest
    # mean ((u + 2h) / 3 < u); in example 1 ending 0 (loss h) wins both.
    assert (int(np.argmin(sums0)), int(np.argmin(means0))) == (0, 1)
    assert (int(np.argmin(sums1)), int(np.argmin(means1))) == (0, 0)


def test_hand_built_case_through_run_eval(workdir: Path, one_rank: None, capsys: pytest.CaptureFixture) -> None:
    """The 2-example case end to end: labels (1, 0); acc_norm gets both, acc only the second."""
    model, _ = hand_model()
    checkpoint = save(model, workdir / "hand")
    src = write_jsonl(workdir / "hand.jsonl", HAND)
    out = workdir / "hand_preds.jsonl"
    result = eval_here(capsys, "--checkpoint", str(checkpoint), "--hellaswag", str(src), "--out", str(out))
    # standard errors sqrt(p (1 - p) / (n - 1)): 0 for 2 of 2, sqrt(0.25 / 1) = 0.5 for 1 of 2
    assert result == {
        "acc_norm": 1.0, "acc": 0.5, "acc_norm_stderr": 0.0, "acc_stderr": 0.5, "correct_norm": 2, "correct": 1,
        "total": 2, "num_processes": 1,
    }  # fmt: skip
    preds = [json.loads(line) for line in out.read_text().splitlines()]
    assert preds == [
        {"ind": 7, "label": 1, "pred_norm": 1, "pred_sum": 0},
        {"ind": 8, "label": 0, "pred_norm": 0, "pred_sum": 0},
    ]


# ------------------------------------------------------------------------------ against the plain reference


def test_one_rank_matches_the_unbatched_unpadded_reference(
    reference: dict, tiny_checkpoint: Path, seven_path: Path, val_data: Path, one_rank: None, capsys, tmp_path: Path
) -> None:
    """Batched, right-padded, rounded to PAD_MULTIPLE, 7 examples in batches of 2: the same choices and loss."""
    out = tmp_path / "preds.jsonl"
    result = eval_here(
        capsys, "--checkpoint", str(tiny_checkpoint), "--hellaswag", str(seven_path), "--out", str(out),
        "--batch_size", str(BATCH), "--data_dir", str(val_data), "--eval_windows", str(EVAL_WINDOWS),
    )  # fmt: skip
    preds = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(p["pred_norm"], p["pred_sum"]) for p in preds] == reference["predictions"]
    assert [p["ind"] for p in preds] == [r["ind"] for r in SEVEN]
    assert result["total"] == len(SEVEN) and result["num_processes"] == 1
    assert result["correct_norm"] == sum(p["pred_norm"] == r["label"] for p, r in zip(preds, SEVEN, strict=True))
    assert result["val_loss"] == pytest.approx(reference["val_loss"], abs=1e-5)


def test_eval_says_how_many_hellaswag_examples_and_about_how_long_before_scoring(
    tiny_checkpoint: Path, seven_path: Path, one_rank: None, capsys
) -> None:
    """`--limit 0` means all of them (10,042 in the real file: minutes on a CPU): the count first, then, after the
    first batch, the time all batches should take at its pace; the JSON on stdout stays the only line there."""
    main(["eval", "--checkpoint", str(tiny_checkpoint), "--hellaswag", str(seven_path), "--batch_size", "2"])
    out, err = capsys.readouterr()
    lines = err.splitlines()
    first = lines.index("HellaSwag: scoring all 7 examples (4 endings each; --limit N scores fewer)")
    (pace,) = [i for i, line in enumerate(lines) if re.fullmatch(r"HellaSwag: about \d+ s for 4 batches at the "
                                                                   r"first one's pace", line)]  # fmt: skip
    assert first < pace
    assert len(out.splitlines()) == 1 and json.loads(out)["total"] == 7


@pytest.mark.parametrize(
    ("limit", "line"),
    [
        ("3", "HellaSwag: scoring the first 3 examples (4 endings each)"),
        ("50", "HellaSwag: scoring all 7 examples (4 endings each; fewer than --limit 50)"),
    ],
    ids=["limit-3", "limit-past-the-end"],
)
def test_a_given_limit_is_not_suggested_again(
    tiny_checkpoint: Path, seven_path: Path, one_rank: None, capsys, limit: str, line: str
) -> None:
    """With `--limit N` on the command line, the count line says what N did instead of offering it."""
    main(["eval", "--checkpoint", str(tiny_checkpoint), "--hellaswag", str(seven_path), "--limit", limit])
    lines = capsys.readouterr().err.splitlines()
    assert line in lines, lines
    assert not any("--limit N" in text for text in lines)


def test_evaluation_and_sampling_ignore_the_dropout_a_model_trained_with(
    tiny_checkpoint: Path, seven_path: Path, val_data: Path, workdir: Path, one_rank: None, capsys
) -> None:
    """The same weights saved as trained with dropout 0.5: HellaSwag, the val loss and a seeded sample are
    identical, since eval and generation put the model in eval mode, where dropout is off."""
    model, card = load_model(tiny_checkpoint)
    dropped = GPT(GPTConfig(**{**card.model.to_dict(), "dropout": 0.5}))
    dropped.load_state_dict(model.state_dict())
    other = save(dropped, workdir / "dropout")
    assert load_model(other)[1].model.dropout == 0.5
    args = ["--hellaswag", str(seven_path), "--data_dir", str(val_data), "--eval_steps", "3", "--batch_size", "2"]
    results = [eval_here(capsys, "--checkpoint", str(folder), *args) for folder in (tiny_checkpoint, other)]
    assert results[0] == results[1] and "val_loss" in results[0]
    texts = []
    for folder in (tiny_checkpoint, other):
        main(["sample", "--checkpoint", str(folder), "--prompt", "Hi", "--max_new_tokens", "8", "--device", "cpu"])
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].strip()


# ------------------------------------------------------------------------------ bits per byte


def test_equal_logits_give_log2_vocab_bits_per_token(
    workdir: Path, val_data: Path, one_rank: None, capsys: pytest.CaptureFixture
) -> None:
    """Every weight zero: every logit is 0, so each token costs ln V nats = log2 V bits, V the tokenizer's 50,257
    ids (the padded rows of the head are left out), and bits per byte is log2(V) * tokens / bytes of the val split."""
    model = GPT(TINY)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    checkpoint = save(model, workdir / "uniform")
    result = eval_here(capsys, "--checkpoint", str(checkpoint), "--data_dir", str(val_data), "--eval_steps", "3")
    assert TINY.vocab_size > 50_257
    assert result["val_loss"] == pytest.approx(math.log(50_257), rel=1e-6)
    assert result["val_bpb"] == pytest.approx(math.log2(50_257) * val_tokens_per_byte(val_data), rel=1e-6)


def evaluator_rows(cfg_data: str, checkpoint: Path, weights: str = "", micro_batch_size: int = BATCH) -> list[dict]:
    """Two evaluations by the training loop's Evaluator, in this process (needs `one_rank`)."""
    from accel_gpt.config import TrainConfig
    from accel_gpt.evaluate.evaluator import Evaluator
    from accel_gpt.runtime import make_accelerator

    accelerator = make_accelerator()
    model, card = load_model(checkpoint)
    shape = {k: v for k, v in card.model.to_dict().items() if k != "layer_norm_eps"}
    cfg = TrainConfig(data_dir=cfg_data, data_weights=weights, **shape, micro_batch_size=micro_batch_size,
                      total_batch_size=6 * TINY.seq_len, eval_every=1, eval_windows=5, sample_tokens=0)  # fmt: skip
    evaluator = Evaluator(cfg, accelerator, model, card, ["train", "val"])
    return [evaluator.run(step, last=False) for step in (1, 2)]


def test_the_training_val_set_is_the_same_for_any_micro_batch(
    tiny_checkpoint: Path, val_data: Path, one_rank: None, capsys
) -> None:
    """eval_windows 5 in micro-batches of 1, 2 and 3 (a last batch of 1 or 2): the same val loss, to round-off, and
    the same as `run.py eval` on those 5 windows."""
    losses = [evaluator_rows(str(val_data), tiny_checkpoint, micro_batch_size=b)[0]["val_loss"] for b in (1, 2, 3)]
    result = eval_here(capsys, "--checkpoint", str(tiny_checkpoint), "--data_dir", str(val_data), "--eval_windows", "5")
    assert losses == pytest.approx([result["val_loss"]] * 3, abs=1e-6)


@pytest.fixture(scope="module")
def prose_data(workdir: Path) -> Path:
    """GPT-2 tokens of English (about 4 bytes per token; the random ids of `val_data` stand for more)."""
    tokens = tiktoken.get_encoding("gpt2").encode_ordinary(SHAKESPEARE.read_text())
    return write_token_shards(workdir / "prose", train=tokens[:2000], val=tokens[2000:3000])


def test_a_mixture_has_each_sources_bpb_and_the_mixtures(
    tiny_checkpoint: Path, val_data: Path, prose_data: Path, one_rank: None, caplog: pytest.LogCaptureFixture
) -> None:
    """val_bpb/<source> with that source's own tokens per byte; val_bpb is val_loss over the mixture's bytes per
    token (each source's, weighted 3:1 like the losses)."""
    with caplog.at_level("INFO"):
        rows = evaluator_rows(f"{val_data},{prose_data}", tiny_checkpoint, "3,1")
    per_byte = {"data": val_tokens_per_byte(val_data), "prose": val_tokens_per_byte(prose_data)}
    assert per_byte["prose"] > 1.5 * per_byte["data"]  # far apart, so that a weighting mistake would show
    for row in rows:
        assert set(row) == {"val_loss", "val_bpb", "val_loss/data", "val_loss/prose", "val_bpb/data", "val_bpb/prose"}
        for name in per_byte:
            assert row[f"val_bpb/{name}"] == pytest.approx(row[f"val_loss/{name}"] / math.log(2) * per_byte[name])
        bytes_per_token = (3 / per_byte["data"] + 1 / per_byte["prose"]) / 4
        assert row["val_bpb"] == pytest.approx(row["val_loss"] / math.log(2) / bytes_per_token)
    assert rows[0] == rows[1]
    assert "unavailable" not in caplog.text


def test_data_without_byte_counts_gives_no_bpb_and_says_so_once(
    tiny_checkpoint: Path, val_data: Path, tmp_path: Path, one_rank: None, capsys, caplog
) -> None:
    """A manifest from before byte counts: eval and the training loop's evaluation work as before, without val_bpb,
    and say why in one line (a source of a mixture that has the count keeps its own val_bpb)."""
    import shutil

    from accel_gpt.evaluate.val_loss import no_bpb_note

    old = strip_byte_counts(Path(shutil.copytree(val_data, tmp_path / "old")))
    main(["eval", "--checkpoint", str(tiny_checkpoint), "--data_dir", str(old), "--eval_windows", "4"])
    out, err = capsys.readouterr()
    (result,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert "val_bpb" not in result and math.isfinite(result["val_loss"])
    assert err.splitlines() == [
        f"val_loss: scoring 4 windows of {TINY.seq_len} tokens (--eval_windows)",
        f"note: {no_bpb_note([str(old)])}",
    ]
    assert "prepare command that wrote it again" in err

    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    with caplog.at_level("INFO"):
        rows = evaluator_rows(f"{val_data},{old}", tiny_checkpoint)
    assert [set(row) for row in rows] == [{"val_loss", "val_loss/data", "val_loss/old", "val_bpb/data"}] * 2
    notes = [r.getMessage() for r in caplog.records if "val_bpb" in r.getMessage()]
    assert len(notes) == 1 and notes[0].endswith(no_bpb_note([str(old)])), notes  # Accelerate may prefix [RANK 0]


# ------------------------------------------------------------------------------ world-size invariance


@pytest.mark.slow
def test_hellaswag_counts_and_predictions_identical_for_w_1_2_3(launches: dict) -> None:
    for W in WORLD_SIZES:
        assert launches[W][0]["num_processes"] == W, f"W={W} did not form one {W}-process group"
        assert launches[W][0]["total"] == len(SEVEN)
    keys = ("acc_norm", "acc", "correct_norm", "correct", "total")
    assert {W: tuple(launches[W][0][k] for k in keys) for W in WORLD_SIZES} == {
        W: tuple(launches[1][0][k] for k in keys) for W in WORLD_SIZES
    }
    assert launches[2][1] == launches[1][1] and launches[3][1] == launches[1][1]
    assert [p["ind"] for p in launches[1][1]] == [r["ind"] for r in SEVEN]
    assert [p["label"] for p in launches[1][1]] == [r["label"] for r in SEVEN]


@pytest.mark.slow
def test_predictions_match_unbatched_unpadded_reference(launches: dict, reference: dict) -> None:
    """Each candidate scored alone (no padding, no batch, truncation written out) picks the same."""
    assert [(p["pred_norm"], p["pred_sum"]) for p in launches[1][1]] == reference["predictions"]


@pytest.mark.slow
def test_val_loss_identical_for_w_1_2_3_and_correct(launches: dict, reference: dict) -> None:
    for W in WORLD_SIZES:
        assert launches[W][0]["val_loss"] == pytest.approx(launches[1][0]["val_loss"], abs=1e-6)
        assert launches[W][0]["val_bpb"] == pytest.approx(launches[1][0]["val_bpb"], abs=1e-6)
    assert launches[1][0]["val_loss"] == pytest.approx(reference["val_loss"], abs=1e-5)
    assert launches[1][0]["val_bpb"] == pytest.approx(reference["val_loss"] / math.log(2) * reference["per_byte"])


@pytest.mark.slow
def test_trainer_style_ddp_model_on_every_rank(launches: dict) -> None:
    """Prepared (DDP) model, evaluated on both ranks: same metrics as the CLI, same sample, mode kept,
    all without `datasets` importable (only the hub branch of the loader needs it). The training loop's
    Evaluator gives the same numbers."""
    ranks = launches["ddp"]
    cli = launches[1][0]
    for row in ranks:
        assert row["num_processes"] == 2
        assert row["wrapper"] == "DistributedDataParallel" and row["training"] is True
        for key in ("acc_norm", "acc", "correct_norm", "correct", "total"):
            assert row[key] == cli[key]
        assert row["val_loss"] == pytest.approx(cli["val_loss"], abs=1e-6)
        evaluator = row["evaluator"]
        hellaswag = ("acc_norm", "acc", "acc_norm_stderr", "acc_stderr")
        assert set(evaluator) == {"val_loss", "val_bpb", *(f"hellaswag_{key}" for key in hellaswag)}
        assert [evaluator[f"hellaswag_{key}"] for key in hellaswag] == [cli[key] for key in hellaswag]
        assert evaluator["val_loss"] == pytest.approx(cli["val_loss"], abs=1e-6)
        assert evaluator["val_bpb"] == pytest.approx(cli["val_bpb"], abs=1e-6)  # 2 processes, the same bits per byte
    assert ranks[0]["text"] == ranks[1]["text"]
    assert ranks[0]["text"].startswith("Hello") and len(ranks[0]["text"]) > len("Hello")


# ------------------------------------------------------------------------------ loading and input errors


def test_loads_original_format_with_limit_blank_lines_and_hub_style_labels(tmp_path: Path) -> None:
    rows = [hs_row(5, "c0", ["a", "b", "c", "d"], 2), hs_row(6, "c1", ["a", "b", "c", "d"], 0)]
    rows[1]["label"] = "3"  # the hub dataset stores labels as strings
    path = tmp_path / "hs.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")
    examples = load_hellaswag(str(path))
    assert [(e.ind, e.ctx, e.label) for e in examples] == [(5, "c0", 2), (6, "c1", 3)]
    assert examples[0].endings == ("a", "b", "c", "d")
    assert len(load_hellaswag(str(path), limit=1)) == 1
    shipped = load_hellaswag(str(HELLASWAG))  # the 50 real rows in tests/data
    assert [e.ind for e in shipped] == list(range(50)) and all(len(e.endings) == 4 for e in shipped)
    assert shipped[0].ctx == "A man is sitting on a roof. he" and shipped[0].label == 3


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "line 2: not valid JSON"),
        (json.dumps([1, 2]), "line 2: expected a JSON object"),
        (json.dumps({"ctx": "x", "label": 0, "ending": ["a", "b", "c", "d"]}), "line 2: missing field(s) endings"),
        (json.dumps(hs_row(1, "x", ["a", "b", "c"], 0)), "line 2: 'endings' must be a list of 4 strings, got 3 items"),
        (json.dumps(hs_row(1, "x", ["a", "b", "c", 4], 0)), "line 2: 'endings' must be a list of 4 strings"),
        (json.dumps(hs_row(1, "x", ["a", "b", "c", "d"], 4)), "line 2: 'label' must be an integer 0-3, got 4"),
        (json.dumps(hs_row(1, "x", ["a", "b", "c", "d"], "")), "line 2: 'label' must be an integer 0-3, got ''"),
        (json.dumps({**hs_row(1, "x", ["a", "b", "c", "d"], 0), "ctx": 7}), "line 2: 'ctx' must be a non-empty string"),
        (json.dumps(hs_row(1, "", ["a", "b", "c", "d"], 0)), "line 2: 'ctx' must be a non-empty string, got ''"),
    ],
)
def test_malformed_rows_name_the_line_and_the_problem(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(hs_row(0, "ok", ["a", "b", "c", "d"], 0)) + "\n" + line + "\n")
    with pytest.raises(UserError) as err:
        load_hellaswag(str(path))
    assert f"{path} {message}" in str(err.value)


def test_bad_file_through_the_cli_is_one_line_and_exit_2(
    tmp_path: Path, tiny_checkpoint: Path, one_rank: None, capsys: pytest.CaptureFixture
) -> None:
    bad = write_jsonl(tmp_path / "bad.jsonl", [hs_row(0, "ok", ["a", "b", "c", "d"], 0), {"ctx": "x"}])
    out = tmp_path / "preds.jsonl"
    earlier = json.dumps({"ind": 0, "label": 1, "pred_norm": 1}) + "\n"  # an earlier `eval --out`
    out.write_text(earlier)
    with pytest.raises(SystemExit) as exc:
        main(["eval", "--checkpoint", str(tiny_checkpoint), "--hellaswag", str(bad), "--out", str(out)])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {bad} line 2: missing field(s) endings, label (expected ctx, endings, label)"
    ]
    assert out.read_text() == earlier


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "nothing to evaluate: pass --hellaswag SRC and/or --data_dir D"),
        (["--data_dir", "d", "--out", "p.jsonl"], "--out writes HellaSwag predictions; it needs --hellaswag"),
        (["--hellaswag", "h", "--batch_size", "0"], "batch_size=0 must be in [1, 1048576]"),
    ],
)
def test_eval_settings_are_checked_before_anything_loads(args: list[str], message: str, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["eval", "--checkpoint", "nowhere", *args])
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"


def test_hellaswag_needs_a_model_of_gpt2_or_bpe_tokens(
    tmp_path: Path, seven_path: Path, one_rank: None, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(UserError, match="HellaSwag needs a GPT-2 vocabulary \\(>= 50257 ids\\); this model has 50000"):
        check_vocabulary(50_000)
    chars = "".join(sorted(set("abcdefghijklmnopqrstuvwxyz .")))
    checkpoint = save(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, seq_len=16, vocab_size=64)), tmp_path / "char",
                      Tokenizer("char", chars))  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        main(["eval", "--checkpoint", str(checkpoint), "--hellaswag", str(seven_path)])
    assert exc.value.code == 2
    assert "HellaSwag is scored in the model's tokens, and a char model's vocabulary lacks" in capsys.readouterr().err


def test_url_source_and_unreachable_url(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "hs.jsonl", SEVEN[:3])

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(tmp_path), **kwargs)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        assert [e.ind for e in load_hellaswag(f"{base}/hs.jsonl")] == [100, 101, 102]
        with pytest.raises(UserError, match="cannot read HellaSwag from .*missing.jsonl"):
            load_hellaswag(f"{base}/missing.jsonl")
    finally:
        server.shutdown()
        server.server_close()


def test_missing_file_and_offline_hub_are_user_errors(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=f"^HellaSwag file '{tmp_path / 'nope.jsonl'}' does not exist$"):
        load_hellaswag(str(tmp_path / "nope.jsonl"))
    with pytest.raises(UserError, match="^HellaSwag file 'data/hellaswag_val.jsonl' does not exist$"):
        load_hellaswag("data/hellaswag_val.jsonl")  # relative, and shaped like a hub id but for its suffix
    with pytest.raises(UserError, match="is a folder; give its jsonl file"):
        load_hellaswag(str(tmp_path))
    with pytest.raises(UserError, match="cannot load the validation split of hub dataset 'Rowan/hellaswag'"):
        load_hellaswag("Rowan/hellaswag")  # HF_DATASETS_OFFLINE=1 and nothing cached


def test_a_row_that_is_not_utf8_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    good = json.dumps(hs_row(0, "ok", ["a", "b", "c", "d"], 0)).encode()
    latin1 = json.dumps(hs_row(1, "caf\u00e9", ["a", "b", "c", "d"], 0), ensure_ascii=False).encode("latin-1")
    path.write_bytes(good + b"\n" + latin1 + b"\n")  # "é" as the single byte 0xe9
    with pytest.raises(UserError, match=f"^{path} line 2: not UTF-8 text \\(byte 0xe9 at byte "):
        load_hellaswag(str(path))
    path.write_bytes(b"\xef\xbb\xbf" + good + b"\n")  # a byte-order mark is not an error
    assert [e.ind for e in load_hellaswag(str(path))] == [0]


def eval_error(capsys: pytest.CaptureFixture, *args: str) -> str:
    """The one stderr line of `run.py eval ARGS` in this process, which must exit 2."""
    with pytest.raises(SystemExit) as exc:
        main(["eval", *args])
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_shards_of_another_tokenizer_are_refused(
    tmp_path: Path, tiny_checkpoint: Path, val_data: Path, one_rank: None, capsys: pytest.CaptureFixture
) -> None:
    """A GPT-2 model on char shards (ids below 65 index real rows) and a char model on GPT-2 shards."""
    chars = "".join(map(chr, range(65)))
    char_data = write_token_shards(tmp_path / "char_data", train=list(range(64)) * 3, val=list(range(64)) * 3,
                                   vocab_size=65)  # fmt: skip
    line = eval_error(capsys, "--checkpoint", str(tiny_checkpoint), "--data_dir", str(char_data))
    assert line == (
        f"error: the shards in {char_data} hold 65 characters, but {tiny_checkpoint} was trained on "
        "GPT-2's tokens: its val_loss on them would mean nothing; prepare the data with the model's tokenizer"
    )
    char_model = save(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, seq_len=16, vocab_size=65)), tmp_path / "char",
                      Tokenizer("char", chars))  # fmt: skip
    line = eval_error(capsys, "--checkpoint", str(char_model), "--data_dir", str(val_data))
    assert "hold GPT-2's tokens, but" in line and "trained on 65 characters:" in line
    other = save(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, seq_len=16, vocab_size=65)), tmp_path / "other",
                 Tokenizer("char", "".join(map(chr, range(1, 66)))))  # fmt: skip
    line = eval_error(capsys, "--checkpoint", str(other), "--data_dir", str(char_data))
    assert "hold 65 characters (another one of that size), but" in line


def test_out_must_be_a_writable_file_and_is_checked_first(
    tmp_path: Path, tiny_checkpoint: Path, seven_path: Path, one_rank: None, capsys, monkeypatch
) -> None:
    """Refused before anything is scored; no temporary file is left, in the folder or in the current directory."""
    monkeypatch.chdir(tmp_path)
    (folder := tmp_path / "preds").mkdir()
    (tmp_path / "a_file").write_text("x")
    args = ["--checkpoint", str(tiny_checkpoint), "--hellaswag", str(seven_path), "--out"]
    assert eval_error(capsys, *args, str(folder)) == (
        f"error: --out {folder} is a folder; give a file name, e.g. --out {folder / 'predictions.jsonl'}"
    )
    assert eval_error(capsys, *args, ".").startswith("error: --out . is a folder; give a file name")
    assert eval_error(capsys, *args, "a_file/preds.jsonl") == (
        f"error: cannot write --out a_file/preds.jsonl: {tmp_path / 'a_file'} is not a writable folder"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file", "preds"] and not list(folder.iterdir())


# ------------------------------------------------------------------------------ a run's own settings


@pytest.mark.slow
def test_eval_of_a_run_reports_the_val_loss_it_logged(tiny_run: Path, one_rank: None, capsys) -> None:
    """Its final weights and its step-4 checkpoint, scored with the run's val set (eval_windows 6; not eval's
    default of 160 windows) give the val_loss the run logged at step 4; flags still win."""
    logged = {row["step"]: row for row in read_metrics(tiny_run / "metrics.jsonl")}
    data_dir = yaml.safe_load((tiny_run / "config.yaml").read_text())["data_dir"]
    for weights in (tiny_run, tiny_run / "checkpoints" / "step_00000004"):
        result = eval_here(capsys, "--checkpoint", str(weights), "--data_dir", data_dir)
        assert (result["eval_windows"], result["batch_size"]) == (6, 2)
        assert result["val_loss"] == pytest.approx(logged[4]["val_loss"], abs=1e-4)
        assert result["val_bpb"] == pytest.approx(logged[4]["val_bpb"], abs=1e-4)
    checkpoint = tiny_run / "checkpoints" / "step_00000002"
    assert eval_here(capsys, "--checkpoint", str(checkpoint), "--data_dir", data_dir)["val_loss"] == pytest.approx(
        logged[2]["val_loss"], abs=1e-4
    )
    flags = eval_here(capsys, "--checkpoint", str(tiny_run), "--data_dir", data_dir, "--eval_windows", "40")
    assert (flags["eval_windows"], flags["batch_size"]) == (40, 2)
    assert abs(flags["val_loss"] - logged[4]["val_loss"]) > 1e-4  # 40 windows are not the run's 6
    # the same 6 windows in batches of 4 and of 1: the same loss, to float round-off
    for batch in ("4", "1"):
        other = eval_here(capsys, "--checkpoint", str(tiny_run), "--data_dir", data_dir, "--batch_size", batch)
        assert other["eval_windows"] == 6 and other["val_loss"] == pytest.approx(logged[4]["val_loss"], abs=1e-5)


@pytest.mark.slow
def test_eval_of_a_run_from_before_eval_windows_uses_its_eval_steps(tiny_run: Path, tmp_path: Path, capsys) -> None:
    """A run dir whose config.yaml sized the val set as eval_steps batches of micro_batch_size (3 x 2) is scored on
    those 6 windows, and that config.yaml still loads for training, as eval_windows 6."""
    import shutil

    from accel_gpt.config import TrainConfig

    old = Path(shutil.copytree(tiny_run, tmp_path / "old"))
    saved = yaml.safe_load((old / "config.yaml").read_text())
    saved.pop("eval_windows")
    saved["eval_steps"] = 3
    (old / "config.yaml").write_text(yaml.safe_dump(saved))
    logged = {row["step"]: row for row in read_metrics(old / "metrics.jsonl")}
    result = eval_here(capsys, "--checkpoint", str(old), "--data_dir", saved["data_dir"])
    assert result["eval_windows"] == 6 and result["val_loss"] == pytest.approx(logged[4]["val_loss"], abs=1e-4)
    cfg = TrainConfig.load(str(old / "config.yaml"))
    assert (cfg.eval_windows, cfg.eval_steps) == (6, None)
    assert TrainConfig.load(str(old / "config.yaml"), {"micro_batch_size": 1}).eval_windows == 3  # as it always was
    assert TrainConfig.load(str(old / "config.yaml"), {"eval_windows": 8}).eval_windows == 8  # a flag replaces it


@pytest.mark.slow
def test_an_export_scores_as_its_run_does_by_default(tiny_run: Path, tmp_path: Path, one_rank: None, capsys) -> None:
    """`eval` of a run's export, with no flags, scores the run's val set (eval_windows 6, recorded in the export's
    config.json; not eval's default of 160): the val_loss of `eval` of the run, and the one it logged; each says on
    stderr how many windows it scored and why, and in its JSON."""
    from accel_gpt.export import export
    from accel_gpt.hf import EVAL_RECORD

    out = export(tiny_run, tmp_path / "export")
    assert json.loads((out / "config.json").read_text())[EVAL_RECORD] == {"eval_windows": 6}
    data_dir = yaml.safe_load((tiny_run / "config.yaml").read_text())["data_dir"]
    results, said = [], []
    for weights in (tiny_run, out):
        main(["eval", "--checkpoint", str(weights), "--data_dir", data_dir])
        printed, err = capsys.readouterr()
        results += [json.loads(line) for line in printed.splitlines() if line.startswith("{")]
        said += [line for line in err.splitlines() if line.startswith("val_loss: scoring")]
    assert said == [
        "val_loss: scoring 6 windows of 64 tokens (the run's eval_windows, from its config.yaml)",
        "val_loss: scoring 6 windows of 64 tokens (the eval_windows of the run it was exported from, recorded in its "
        "config.json)",
    ]
    run, exported = results
    assert run["eval_windows"] == exported["eval_windows"] == 6
    assert exported["val_loss"] == pytest.approx(run["val_loss"], abs=1e-5)  # batches of 8 against the run's 2
    logged = {row["step"]: row for row in read_metrics(tiny_run / "metrics.jsonl")}
    assert exported["val_loss"] == pytest.approx(logged[4]["val_loss"], abs=1e-4)
    flags = eval_here(capsys, "--checkpoint", str(out), "--data_dir", data_dir, "--eval_windows", "40")
    assert flags["eval_windows"] == 40 and abs(flags["val_loss"] - exported["val_loss"]) > 1e-4  # a flag still wins


@pytest.mark.slow
def test_a_run_logs_and_sums_up_its_val_bpb(tiny_run: Path) -> None:
    """Each evaluation row of metrics.jsonl has val_bpb = val_loss / ln 2 * tokens / bytes of the prepared val split
    (3,000 tokens of Shakespeare), and the summary line ends the run with the last one."""
    rows = [row for row in read_metrics(tiny_run / "metrics.jsonl") if "val_loss" in row]
    data_dir = Path(yaml.safe_load((tiny_run / "config.yaml").read_text())["data_dir"])
    per_byte = val_tokens_per_byte(data_dir)
    assert 0.2 < per_byte < 0.35  # English in GPT-2 tokens: about 3 to 5 bytes per token
    assert [row["step"] for row in rows] == [2, 4]
    for row in rows:
        assert row["val_bpb"] == pytest.approx(row["val_loss"] / math.log(2) * per_byte, rel=1e-12)
    printed = (tiny_run.parent / "train_output.txt").read_text()
    assert f"last val_loss {rows[-1]['val_loss']:.4f}, val_bpb {rows[-1]['val_bpb']:.4f}; run dir" in printed
    assert "unavailable" not in printed


def test_weights_without_their_run_take_the_default_settings(
    tiny_checkpoint: Path, val_data: Path, one_rank: None, capsys
) -> None:
    """160 windows in batches of 8; the val split holds only 12, so eval says so once and uses them all."""
    main(["eval", "--checkpoint", str(tiny_checkpoint), "--data_dir", str(val_data)])
    out, err = capsys.readouterr()
    (result,) = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert (result["eval_windows"], result["batch_size"]) == (12, 8)
    note = f"the val split of {val_data} holds 12 windows of {TINY.seq_len} tokens, fewer than eval_windows=160: "
    assert err.count(note + "validation uses all 12") == 1, err
    assert f"val_loss: scoring 12 windows of {TINY.seq_len} tokens (the default eval_windows; --eval_windows N" in err
    same = ("--checkpoint", str(tiny_checkpoint), "--data_dir", str(val_data), "--eval_windows", "12")
    assert result["val_loss"] == pytest.approx(eval_here(capsys, *same, "--batch_size", "5")["val_loss"], abs=1e-6)


def test_hellaswag_standard_error_is_lm_eval_harness_s() -> None:
    """The sample standard deviation of the 0/1 outcomes over sqrt(n), as lm-evaluation-harness reports it."""
    from accel_gpt.evaluate.hellaswag import Prediction, describe, hellaswag_metrics

    outcomes = [1, 0, 0, 1, 0, 0, 0]
    predictions = [Prediction(i, i, 0, 0 if hit else 1, 0) for i, hit in enumerate(outcomes)]
    metrics = hellaswag_metrics(predictions)
    expected = float(np.std(outcomes, ddof=1) / math.sqrt(len(outcomes)))
    assert metrics["acc_norm_stderr"] == pytest.approx(expected, rel=1e-12)
    assert metrics["acc_stderr"] == 0.0 and metrics["acc"] == 1.0  # every pred_sum is right
    assert describe(metrics) == f"acc_norm {2 / 7:.4f} ± {expected:.4f} on 7"
    single = hellaswag_metrics(predictions[:1])
    assert single["acc_norm_stderr"] is None and describe(single) == "acc_norm 1.0000 on 1"
