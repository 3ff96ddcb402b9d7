"""The model card of an export (`README.md`): the Hub's metadata, then what the model is and how it was made.

The Hub reads the YAML block on top: `library_name` and `pipeline_tag` choose the loading code and the widget,
`license` is export's `--license`, and `datasets` lists the hub datasets the model was trained on (a local file or
a URL is named in the text only: the field takes hub ids). The text reports what the run's own files say, never
more: the shape from the weights' config; steps and tokens from the weights' step and config.yaml; the losses (and
bits per byte) and HellaSwag from metrics.jsonl at that step; the data from the manifests in the run's data_dir,
named only when its training shards are the ones the run's checkpoints recorded (a folder prepared again since would
name other data); the training command from config.yaml. Weights without their run get the shape and the usage alone.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from accel_gpt.checkpoint import complete_checkpoints, data_identity, saved_state
from accel_gpt.config import TrainConfig, block_defaults, config_values
from accel_gpt.data.shards import read_manifest
from accel_gpt.errors import ConfigError, UserError
from accel_gpt.evaluate.val_loss import run_val_windows
from accel_gpt.metrics import METRICS, read_metrics
from accel_gpt.rundir import ENV_REPORT, read_run_config, run_of
from accel_gpt.to_gguf import GGUF_FILE, MODELFILE, context_limit
from accel_gpt.tokenizer import Tokenizer
from accel_gpt.weights import ModelCard
from accel_gpt.workarounds import check_pickles_are_safe

CARD = "README.md"
# Settings about the run folder rather than the training: left out of the reconstructed command.
_NOT_TRAINING = ("config", "resume", "overwrite")


@dataclass(frozen=True)
class DataSource:
    """One folder of the run's data_dir, as its manifest describes it."""

    folder: str
    manifest: dict[str, Any] | None  # None: the folder or its manifest is gone

    @property
    def hub_id(self) -> str | None:
        source = (self.manifest or {}).get("source", {})
        return source.get("dataset") if source.get("kind") == "hub" else None

    def describe(self) -> str:
        if self.manifest is None:
            return f"`{self.folder}` (its manifest.json was not found at export: the data is not described here)"
        source, args = self.manifest.get("source", {}), self.manifest.get("args", {})
        name = source.get("dataset", "?")
        if source.get("kind") in ("files", "disk"):
            name = Path(name).name  # a local path says nothing to a reader elsewhere, and may say too much
        details = [f"{k} {source[k]}" for k in ("config", "split") if source.get(k) and source.get("kind") == "hub"]
        if args.get("preset"):
            details.insert(0, f"prepare preset {args['preset']}")
        kind = {"hub": "hub dataset", "url": "downloaded from", "files": "local file(s)", "disk": "local dataset"}
        what = f"{kind.get(source.get('kind'), 'source')} `{name}`" + (f" ({'; '.join(details)})" if details else "")
        counts = [f"{n:,} {split} tokens" for split, n in self.manifest.get("tokens", {}).items()]
        tokenizer = self.manifest.get("tokenizer", "?")
        return f"{what}: {', '.join(counts)}; {tokenizer} tokenizer"


@dataclass(frozen=True)
class Training:
    """What a run directory records about the weights of one step."""

    run_dir: Path
    config: dict[str, Any]
    step: int | None
    rows: list[dict[str, Any]]  # metrics rows up to `step`, one per step, in order
    sources: list[DataSource]
    data_checked: bool  # the sources' training shards are those the run's checkpoints recorded
    data_changed: bool  # ... or they are not (the folder holds other data now)
    processes: int | None

    def last(self, key: str) -> dict[str, Any] | None:
        """The latest row (at or before the weights' step) that logged `key`."""
        return next((row for row in reversed(self.rows) if row.get(key) is not None), None)


def read_training(path: str | Path, step: int | None) -> Training | None:
    """The run that the weights at `path` come from, or None for weights without their run."""
    run = run_of(path)
    if run is None:
        return None
    try:
        config = read_run_config(run)
    except UserError:
        return None  # a config.yaml that cannot be read: the card tells only what the weights say
    rows = _rows_up_to(run, step)
    folders = [d.strip() for d in str(config.get("data_dir", "")).split(",") if d.strip()]
    sources = [DataSource(folder, _manifest(folder)) for folder in folders]
    recorded = _recorded_data(run)
    found = _data_identity(sources, config)
    checked = recorded is not None and found is not None and recorded == found
    changed = recorded is not None and found is not None and recorded != found
    return Training(run, config, step, rows, sources, checked, changed, _processes(run))


def _rows_up_to(run: Path, step: int | None) -> list[dict[str, Any]]:
    path = run / METRICS
    if not path.is_file():
        return []
    by_step = {r["step"]: r for r in read_metrics(path) if isinstance(r.get("step"), int)}
    return [by_step[s] for s in sorted(by_step) if step is None or s <= step]


def _manifest(folder: str) -> dict[str, Any] | None:
    try:
        return read_manifest(folder)
    except UserError:
        return None


def _recorded_data(run: Path) -> dict[str, Any] | None:
    """The training data's identity as the run's newest complete checkpoint recorded it (None without one)."""
    done = complete_checkpoints(run)
    if not done:
        return None
    try:
        check_pickles_are_safe(done[-1])
        return saved_state(done[-1]).data or None
    except Exception:  # noqa: BLE001 - a damaged checkpoint only means that the data cannot be checked
        return None


def _data_identity(sources: list[DataSource], config: dict[str, Any]) -> dict[str, Any] | None:
    """The identity `train` records, computed from the manifests found now (None when one is missing)."""
    if not sources or any(s.manifest is None for s in sources):
        return None
    weights = _source_weights(config)
    if weights is None or len(weights) != len(sources):
        return None
    try:
        return data_identity([s.manifest for s in sources if s.manifest is not None], weights)
    except (KeyError, TypeError):
        return None


def _source_weights(config: dict[str, Any]) -> list[float] | None:
    """The mixture's normalised weights as the run computed them (None when config.yaml no longer validates)."""
    known = {f.name for f in fields(TrainConfig)}
    try:
        return TrainConfig(**{k: v for k, v in config.items() if k in known}).source_weights()
    except (UserError, TypeError):
        return None


def _processes(run: Path) -> int | None:
    """How many processes trained (the launch state in accelerate_env.txt), when recorded."""
    try:
        found = re.search(r"^Num processes: (\d+)$", (run / ENV_REPORT).read_text(errors="replace"), re.MULTILINE)
    except OSError:
        return None
    return int(found.group(1)) if found else None


# ------------------------------------------------------------------------------------------------ the card


def model_card(
    weights: str | Path,
    card: ModelCard,
    n_params: int,
    license: str,
    title: str,
    load_as: str,
    fmt: str = "transformers",
) -> str:
    """The README.md of an export of `weights` (`fmt`: transformers or gguf); `load_as` is what `from_pretrained`
    is given in its examples."""
    training = read_training(weights, card.step)
    meta: dict[str, Any] = {
        "license": license,
        "library_name": fmt,
        "pipeline_tag": "text-generation",
        "tags": [card.model.arch, "accel_gpt"],
    }
    hub_ids = [s.hub_id for s in training.sources if s.hub_id] if training and not training.data_changed else []
    if hub_ids:
        meta["datasets"] = hub_ids
    m = card.model
    parts = [
        f"---\n{yaml.safe_dump(meta, sort_keys=False)}---",
        f"# {title}",
        f"{ARCHITECTURES['gguf' if fmt == 'gguf' else m.arch]}, {n_params / 1e6:.1f}M parameters) trained with "
        "accel_gpt: "
        f"{m.n_layer} layers, {m.n_head} attention heads{_kv_heads(m)}, a {m.n_embd}-wide residual stream and a "
        f"{m.seq_len}-token context, with {_tokenizer_words(card.tokenizer)}.",
    ]
    parts += _training_section(training, card) if training else _no_run_section(card)
    parts += _gguf_usage_section(m.seq_len) if fmt == "gguf" else _usage_section(m.seq_len, load_as)
    return "\n\n".join(parts) + "\n"


# What the card's first line calls each block: the architecture and the transformers class that loads it.
ARCHITECTURES = {
    "gpt2": "A GPT-2 language model (`GPT2LMHeadModel`",
    "gguf": "A GPT-2 language model (GGUF, llama.cpp's `gpt2` architecture",
    "nanochat": (
        "A language model with nanochat's block (`NanoChatForCausalLM`: rotary positions, parameter-free RMSNorm, "
        "QK-norm, ReLU² MLP, an untied head with soft-capped logits; transformers >= 5.0"
    ),
}


def _kv_heads(m: Any) -> str:
    return f" sharing {m.n_kv_head} key/value heads" if m.n_kv_head and m.n_kv_head != m.n_head else ""


def _val_windows(c: dict[str, Any]) -> str:
    """The size of the run's val set (see `run_val_windows`), as the card writes it."""
    windows = run_val_windows(c)
    return "?" if windows is None else f"{windows:,}"


def _no_run_section(card: ModelCard) -> list[str]:
    steps = f"after {card.step:,} optimizer steps" if card.step is not None else "at an unrecorded step"
    return [
        "## Training",
        f"Exported {steps} from weights without their run directory: the training data, settings and results "
        "were not recorded with them, so they are not reported here.",
    ]


def _training_section(t: Training, card: ModelCard) -> list[str]:
    c = t.config
    step = card.step
    rows: list[tuple[str, str]] = []
    if step is not None:
        of = f" of {c['max_steps']:,}" if _int(c.get("max_steps")) else ""
        rows.append(("optimizer steps", f"{step:,}{of}"))
        if card.picked:
            rows.append(("weights", _picked_text(card)))
        if _int(c.get("total_batch_size")):
            batch = c["total_batch_size"]
            rows.append(("tokens seen", f"{step * batch:,} ({step:,} steps of {batch:,} tokens)"))
    last = t.last("loss")
    if last is not None:
        rows.append(("final train loss", f"{last['loss']:.4f} (step {last['step']:,})"))
    val = t.last("val_loss")
    if val is not None:
        windows = f"{_val_windows(c)} windows of {card.model.seq_len} tokens"
        rows.append(("validation loss", f"{val['val_loss']:.4f} (step {val['step']:,}; {windows})"))
        if val.get("val_bpb") is not None:  # absent when the data's manifest counted no bytes
            per_byte = "the same evaluation, in bits per UTF-8 byte of text: comparable across tokenizers"
            rows.append(("validation bits per byte", f"{val['val_bpb']:.4f} ({per_byte})"))
    hs = t.last("hellaswag_acc_norm")
    if hs is not None:
        stderr = hs.get("hellaswag_acc_norm_stderr")
        spread = f" ± {stderr:.4f}" if stderr is not None else ""
        limit = f"the first {c['hellaswag_limit']:,} examples of " if _int(c.get("hellaswag_limit")) else ""
        where = f"step {hs['step']:,}; {limit}`{_source_name(str(c.get('hellaswag', '?')))}`"
        rows.append(("HellaSwag acc_norm", f"{hs['hellaswag_acc_norm']:.4f}{spread} ({where}; ± one standard error)"))
    if t.processes:
        rows.append(("processes", str(t.processes)))
    table = ["| | |", "| --- | --- |", *(f"| {name} | {value} |" for name, value in rows)]
    parts = ["## Training", "\n".join(table), "### Data", _data_text(t)]
    if str(c.get("init_from", "none")) != "none":
        parts.append(f"Training started from the weights of `{_source_name(str(c['init_from']))}`.")
    parts += _commands_section(card) if card.history else []
    if not card.history:
        parts += ["### Command", "```bash\n" + training_command(c, t.processes) + "\n```"]
    return parts


def _picked_text(card: ModelCard) -> str:
    picked = card.picked or {}
    text = f"picked among the run's evaluated checkpoints for the lowest validation loss ({picked['val_loss']:.4f})"
    last = picked.get("last_step")
    return text + (f"; the run went on to step {last:,}" if last and last != card.step else "")


def _commands_section(card: ModelCard) -> list[str]:
    """Each command that trained these weights, with the steps it trained: a resumed run's segments in order, up to
    the weights' step (a later segment, or a line abandoned by a resume from an earlier step, did not train them)."""
    segments = [s for s in card.history or [] if card.step is None or s["from_step"] < card.step]
    title = "### Command" if len(segments) == 1 else "### Commands"
    parts = [title]
    for i, segment in enumerate(segments):
        end = segments[i + 1]["from_step"] if i + 1 < len(segments) else card.step
        if len(segments) > 1:
            parts.append(f"Steps {segment['from_step'] + 1:,} to {end:,}:")
        command = training_command(segment["config"], segment.get("processes"))
        if i:  # a resumed segment: the same run folder, continued from its checkpoint
            resume = str(segment["config"].get("resume") or "none")
            command += " --resume " + shlex.quote("auto" if resume == "none" else resume)
        parts.append("```bash\n" + command + "\n```")
    return parts


def _data_text(t: Training) -> str:
    if not t.sources:
        return "The run's config.yaml names no data."
    shares = _source_weights(t.config) or []
    if len(shares) != len(t.sources):
        shares = [1 / len(t.sources)] * len(t.sources)
    lines = []
    for source, share in zip(t.sources, shares, strict=True):
        mix = f" ({share:.0%} of each batch)" if len(t.sources) > 1 else ""
        lines.append(f"- {source.describe()}{mix}")
    if t.data_changed:
        note = (
            "Note: these folders now hold other training shards than the ones the run's checkpoints recorded "
            "(prepared again since?): the description above is of their present content, not of the data trained on."
        )
    elif t.data_checked:
        note = "These are the training shards the run's checkpoints recorded (same tokens, same order)."
    else:
        note = "As found in data_dir at export (the run kept no checkpoint to check them against)."
    return "\n".join(lines) + "\n\n" + note


def _source_name(value: str) -> str:
    """A hub id or URL as is; a local path by its last part (paths on the training machine mean nothing here)."""
    if value.startswith(("http://", "https://")) or not Path(value).expanduser().exists():
        return value
    return Path(value).name


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def training_command(config: dict[str, Any], processes: int | None) -> str:
    """`python run.py train` with the settings that differ from the preset the run named (or from the defaults):
    the command that trains these weights again."""
    base = {f.name: f.default for f in fields(TrainConfig) if f.default is not MISSING}
    preset = str(config.get("config") or "")
    flags = []
    if preset:
        try:
            base |= config_values(TrainConfig, preset)
            flags = ["--config", preset]
        except ConfigError:
            pass  # the preset or file is gone: every setting that differs from the defaults is listed instead
    unset = block_defaults(str(config.get("arch", "gpt2")))  # what the block makes of settings left unset
    base |= {name: unset[name] for name in unset if base.get(name) is None}
    for name, value in config.items():
        if name in _NOT_TRAINING or name not in base or value == base[name]:
            continue
        text = str(value).lower() if isinstance(value, bool) else str(value)
        flags += [f"--{name}", text]
    launch = (
        "python run.py" if not processes or processes == 1 else f"accelerate launch --num_processes {processes} run.py"
    )
    return f"{launch} train " + " ".join(shlex.quote(flag) for flag in flags)


def _usage_section(seq_len: int, load_as: str) -> list[str]:
    new = max(1, min(40, seq_len // 2))
    return [
        "## Use",
        "```python\nfrom transformers import pipeline\n\n"
        f'generate = pipeline("text-generation", model={json.dumps(load_as)})\n'
        f'print(generate("ROMEO:", max_new_tokens={new}, do_sample=True, top_k=50)[0]["generated_text"])\n```',
        f"The model reads at most {seq_len} tokens: its position table has {seq_len} rows (`n_positions`). "
        "Every call stops at `<|endoftext|>` (`eos_token_id`), where a training document ended; a call without a "
        f"length stops at {seq_len} tokens, prompt included (`max_length` in `generation_config.json`; a call that "
        "passes `max_new_tokens` takes that instead, and transformers notes that it takes precedence). "
        f"Keep the prompt's tokens plus `max_new_tokens` within {seq_len}: past it there is no position for the "
        "next token, and transformers, "
        'after warning that the call "exceeded the model\'s predefined maximum length", fails with '
        "`IndexError: index out of range in self`. (accel_gpt's own `run.py sample` slides the window instead: "
        f"each new token is predicted from the last {seq_len}, and it says so.)",
    ]


def _gguf_usage_section(seq_len: int) -> list[str]:
    new = max(1, min(40, seq_len // 2))
    return [
        "## Use",
        f'In llama.cpp: `llama-completion -m {GGUF_FILE} -no-cnv -p "ROMEO:" -n {new}` (older builds call it '
        "`llama-cli`; a plain completion, as the model knows no chat template). In ollama: `ollama create NAME -f "
        f'{MODELFILE}`, then `ollama run NAME "ROMEO:"`. In Python (llama-cpp-python):',
        f'```python\nfrom llama_cpp import Llama\n\nllm = Llama("{GGUF_FILE}", n_ctx={seq_len})\n'
        f'print(llm("ROMEO:", max_tokens={new})["choices"][0]["text"])\n```',
        f"The model reads at most {seq_len} tokens: its position table has {seq_len} rows. "
        f"{context_limit(seq_len)}. Generation stops at `<|endoftext|>`, "
        "where a training document ended; nothing is added before a prompt (training saw no start token).",
    ]


def _tokenizer_words(tok: Tokenizer) -> str:
    if tok.name == "bpe":
        return (
            f"a byte-level BPE tokenizer of {tok.vocab_size:,} tokens learned from its training text "
            f"(`<|endoftext|>`, id {tok.eot_token}, separates documents)"
        )
    return "GPT-2's tokenizer (50,257 tokens; `<|endoftext|>`, id 50256, separates documents)"
