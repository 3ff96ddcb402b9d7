"""Every command's settings as one dataclass: the schema for its flags, YAML files and presets.

Settings resolve in three layers: the dataclass defaults, then `--config` (a YAML file, or the name of
a preset shipped in accel_gpt/presets), then `--field value` flags. Values are typed by the annotations
(strings from the command line are parsed here), checked in `validate`, and an unknown key is an error
naming the close matches, wherever it comes from. Every field carries the one-line help that `--help`
shows. This module imports nothing heavy: `--help` must answer at once.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

import yaml

from accel_gpt.errors import ConfigError
from accel_gpt.files import atomic_write, lock_holder

PRESETS_DIR = Path(__file__).parent / "presets"


def option(default: Any, help: str, *, required: bool = False, positional: bool = False, bounds: str = "") -> Any:
    """A config field with its `--help` line. `required`: the command line must give it unless `--config` does.
    `bounds`: a number's range as an interval ("[1, inf)", "(0, 1]"), checked wherever the value comes from."""
    meta = {"help": help, "required": required, "positional": positional, "bounds": Bounds.parse(bounds)}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Bounds:
    """A numeric setting's range, written as an interval: `[1, inf)`, `(0, 1]`, `[0, 99]`.

    Every number a command takes has one (a test walks them all), so a value that could only fail later, as a
    traceback mid-run or a hang (a seed numpy refuses, a timeout timedelta cannot hold, a window of 10^12 slots),
    is refused in one line before anything starts."""

    text: str
    low: float
    high: float
    low_open: bool
    high_open: bool

    @classmethod
    def parse(cls, text: str) -> Bounds | None:
        if not text:
            return None
        match = re.fullmatch(r"([\[(])\s*([^,\s]+)\s*,\s*([^\s\])]+)\s*([\])])", text)
        if match is None:
            raise ValueError(f"bounds {text!r} is not an interval like [1, inf) or (0, 1]")
        opening, low, high, closing = match.groups()
        return cls(text, float(low), float(high), opening == "(", closing == ")")

    def holds(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def describe(self) -> str:
        if math.isinf(self.high):
            return f"{'>' if self.low_open else '>='} {self.text[1:].split(',')[0].strip()}"
        return f"in {self.text}"


@dataclass
class Config:
    """Base of every command's settings: typing of values, validation, loading from YAML/presets/flags."""

    command: ClassVar[str]
    # Pairs of fields that set the same thing (a new name, then the former one): a layer that gives one of them
    # replaces what an earlier layer gave for either.
    same_setting: ClassVar[tuple[tuple[str, str], ...]] = ()
    config: str = option("", "a YAML file of these settings (train and prepare: or the name of a preset)")

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in fields(self):
            value = coerce(f.name, getattr(self, f.name), hints[f.name])
            bounds = f.metadata.get("bounds")
            if bounds is not None and value is not None and not bounds.holds(value):
                raise ConfigError(f"{f.name}={value} must be {bounds.describe()}")
            setattr(self, f.name, value)
        self.validate()

    def validate(self) -> None:
        """Cross-field rules; raise ConfigError with the offending value and what is expected."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def load(cls: type[C], config: str = "", overrides: dict[str, Any] | None = None) -> C:
        """Defaults, then each YAML file or preset of `config` in turn (several: `config_layers`), then `overrides`
        (flags win)."""
        overrides = dict(overrides or {})
        check_keys(cls, overrides, "the command line")
        values = cls.layered([*(preset_values(cls, layer) for layer in config_layers(cls, config)), overrides])
        return cls(**{**values, "config": config})

    @classmethod
    def layered(cls, layers: list[dict[str, Any]]) -> dict[str, Any]:
        """Later layers win; a layer that gives one name of a `same_setting` pair replaces either from before."""
        values: dict[str, Any] = {}
        for layer in layers:
            for pair in cls.same_setting:
                if any(name in layer for name in pair):
                    values = {k: v for k, v in values.items() if k not in pair}
            values |= layer
        return values


C = TypeVar("C", bound=Config)


def presets_dir(cls: type[Config]) -> Path:
    return PRESETS_DIR if cls.command == "train" else PRESETS_DIR / cls.command


def preset_names(cls: type[Config]) -> list[str]:
    return sorted(p.stem for p in presets_dir(cls).glob("*.yaml"))


def config_layers(cls: type[Config], config: str) -> list[str]:
    """The files and presets of `config`: one, or several joined by commas (`--config` given more than once), read
    in that order. A file whose own name holds a comma is one layer."""
    if not config:
        return []
    whole = Path(config).is_file() or (presets_dir(cls) / f"{config.removesuffix('.yaml')}.yaml").is_file()
    return [config] if whole or "," not in config else [part for part in config.split(",") if part]


def config_values(cls: type[Config], config: str) -> dict[str, Any]:
    """What the layers of `config` set together, later ones winning: the defaults `--config ... --help` shows."""
    return cls.layered([preset_values(cls, layer) for layer in config_layers(cls, config)])


def preset_values(cls: type[Config], name_or_path: str, within: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The keys of a YAML file, or of the preset called `name_or_path`, checked against `cls`; over those of the
    `config:` it names as its base, if any (a recipe that builds on a preset). `within`: the files that led here."""
    path = Path(name_or_path)
    if not path.is_file():
        path = presets_dir(cls) / f"{name_or_path.removesuffix('.yaml')}.yaml"
    if not path.is_file():
        names = preset_names(cls)
        close = difflib.get_close_matches(name_or_path, names, n=3, cutoff=0.6)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; presets: {', '.join(names) or 'none'}"
        raise ConfigError(f"config '{name_or_path}' is neither a YAML file nor a {cls.command} preset{hint}")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid UTF-8 YAML: {str(e).splitlines()[0]}") from None
    except _DuplicateKey as e:
        raise ConfigError(f"{path} sets {e} twice: keep one (YAML would silently take the last)") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of {cls.command} settings, got {type(data).__name__}")
    base = data.pop("config", None)
    if is_run_config(path):
        data.pop("resume", None)  # how that run started, not its recipe: taken back, it starts a new run
    check_keys(cls, data, str(path))
    if not base or is_run_config(path) or {f.name for f in fields(cls)} - {"config", "resume"} <= set(data):
        return data  # a resolved config (a run's config.yaml) records where it came from: not a layer to follow
    if path.resolve() in within:
        raise ConfigError(f"{path} names itself among its bases (config: {base}): a recipe cannot build on itself")
    beside = path.parent / str(base)  # a base file named relative to the recipe that names it
    base = str(beside) if beside.is_file() else str(base)
    layers = [preset_values(cls, layer, (*within, path.resolve())) for layer in config_layers(cls, base)]
    return cls.layered([*layers, data])


def is_run_config(path: Path) -> bool:
    """Whether `path` is the config.yaml a run wrote into its run directory."""
    return path.name == "config.yaml" and any((path.parent / f).exists() for f in ("metrics.jsonl", "checkpoints"))


class _DuplicateKey(Exception):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader that refuses a key given twice in one mapping (a merge or an edit's slip)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
        twice = next((key for i, key in enumerate(keys) if key in keys[:i]), None)
        if twice is not None:
            raise _DuplicateKey(twice)
        return super().construct_mapping(node, deep=deep)


# Booleans are true and false only, as on the command line (YAML 1.2): YAML 1.1's yes/no/on/off stay words, so that
# `compile: yes` is refused as `--compile yes` is, and `mixed_precision: no` means the setting's "no".
_BOOL = "tag:yaml.org,2002:bool"
_UniqueKeyLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != _BOOL]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_UniqueKeyLoader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))


def check_keys(cls: type[Config], keys: typing.Iterable[str], where: str) -> None:
    """Reject unknown keys, naming the closest real ones (typos are the usual cause)."""
    known = [f.name for f in fields(cls)]
    for key in keys:
        if key not in known:
            raise ConfigError(f"unknown {cls.command} setting '{key}' in {where}{did_you_mean(key, known)}")


def did_you_mean(word: str, choices: typing.Sequence[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(word, choices, n=3, cutoff=0.6)
    if close:
        return f"; did you mean {', '.join(prefix + c for c in close)}?"
    return f"; known: {', '.join(prefix + c for c in choices)}"


def close_paths(path: str | Path, keep: typing.Callable[[Path], bool] = lambda entry: True) -> list[str]:
    """At most two entries beside `path` whose names are close to its own (a typo's likely meaning), of those that
    `keep` accepts (asked of the few close names only: a large or network folder is listed, not walked)."""
    p = Path(path).expanduser()
    try:
        names = [q.name for q in p.parent.iterdir() if not q.name.startswith(".")] if p.parent != p else []
    except OSError:
        return []
    close = difflib.get_close_matches(p.name, names, n=5, cutoff=0.7)
    return [str(Path(path).parent / name) for name in close if keep(p.parent / name)][:2]


def split_folders(data_dir: str) -> list[str]:
    """The folders of a `data_dir` setting: one, or several (comma-separated) for a mixture."""
    return [d.strip() for d in data_dir.split(",") if d.strip()]


def normalised_weights(data_weights: str, n: int) -> list[float]:
    """A `data_weights` setting as numbers that sum to 1, one per folder of `n` (equal when unset)."""
    if not data_weights.strip():
        return [1.0 / n] * n
    try:
        weights = [float(w) for w in data_weights.split(",")]
    except ValueError:
        raise ConfigError(f"data_weights={data_weights!r} must be comma-separated numbers") from None
    if len(weights) != n:
        raise ConfigError(f"data_weights has {len(weights)} weight(s) but data_dir names {n} folder(s)")
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise ConfigError(f"data_weights={data_weights!r} must all be > 0 (leave a folder out instead of 0)")
    return [w / sum(weights) for w in weights]


def coerce(name: str, value: Any, annotation: Any) -> Any:
    """Check one value against its annotation; strings (from the command line) are parsed."""
    optional = False
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional, annotation = True, args[0]
    if optional and (value is None or (isinstance(value, str) and value.lower() in ("none", ""))):
        return None
    if typing.get_origin(annotation) is Literal:
        choices = typing.get_args(annotation)
        if True in choices and isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"  # a switch with more states than on and off (compile: auto)
        if not any(type(value) is type(c) and value == c for c in choices):  # 1 is not True here
            words = [str(c).lower() if isinstance(c, bool) else c for c in choices]
            raise ConfigError(f"{name}={value!r} is not one of {', '.join(words)}{_close(value, words)}")
        return value
    if typing.get_origin(annotation) is list:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{name}={value!r} must be a list")
        return [coerce(name, v, typing.get_args(annotation)[0]) for v in value]
    parse = _PARSERS.get(annotation)
    return value if parse is None else parse(name, value)


def _close(value: Any, choices: tuple) -> str:
    close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ConfigError(f"{name}={value!r} must be true or false")


def _int(name: str, value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            as_float = float(value.replace("_", ""))
        except ValueError:
            as_float = math.nan
        if as_float.is_integer():
            return int(as_float) if "e" in value.lower() or "." in value else int(value.replace("_", ""))
    raise ConfigError(f"{name}={value!r} must be an integer")


def _float(name: str, value: Any) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            pass
    if isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ConfigError(f"{name}={value!r} must be a finite number")
        return float(value)
    raise ConfigError(f"{name}={value!r} must be a number")


def _str(name: str, value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, str | int | float) and not isinstance(value, bool):
        return str(value)
    raise ConfigError(f"{name}={value!r} must be a string")


_PARSERS = {bool: _bool, int: _int, float: _float, str: _str}


# ------------------------------------------------------------------------------------------------ train

# Fields that define the model's shape: a resume or init that changes one of these cannot load weights.
MODEL_FIELDS = ("arch", "n_layer", "n_head", "n_embd", "seq_len", "vocab_size", "bias", "n_kv_head", "rope_theta")
MODEL_FIELDS += ("logit_softcap", "gelu")
Arch = Literal["gpt2", "nanochat"]
# The nanochat block's own settings where a config leaves them unset. Each was chosen by the sweep of
# bench/char_recipe.py on nanoGPT's CPU recipe (bench/RESULTS.md, "The modern block").
NANOCHAT_DEFAULTS: dict[str, Any] = {
    "rope_theta": 10_000.0,
    "logit_softcap": 15.0,
    "embedding_lr": 0.3,
    "head_lr": 0.008,
    "muon_momentum_warmup": 300,
    "muon_ns_steps": 4,
    "muon_ns_coefficients": "polar_express",
}
GPT2_DEFAULTS: dict[str, Any] = {
    "bias": True,
    "gelu": "tanh",
    "muon_momentum_warmup": 0,
    "muon_ns_steps": 5,
    "muon_ns_coefficients": "quintic",
}


def block_defaults(arch: str) -> dict[str, Any]:
    """What the settings a config leaves unset (None) become under the block `arch`."""
    return {"bias": False, **NANOCHAT_DEFAULTS} if arch == "nanochat" else GPT2_DEFAULTS


# What GPT-2's block has instead of each nanochat-only setting: said when one is given with arch gpt2.
NANOCHAT_ONLY = {
    "n_kv_head": "one key/value head per query head",
    "rope_theta": "learned positions, not rotary ones",
    "logit_softcap": "no soft-cap on its logits",
    "head_lr": "a head tied to the token embedding",
    "embedding_lr": "one AdamW rate for the embedding (learning_rate)",
}
MUON_FIELDS = ("muon_lr", "muon_momentum", "muon_weight_decay", "muon_adjust_lr_fn", "muon_momentum_warmup")
MUON_FIELDS += ("muon_momentum_start", "muon_ns_steps", "muon_ns_coefficients", "muon_ns_dtype")
# torch.compile's modes; the CUDA-graph ones replay whole steps, which pays off where launches bound a step.
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
LRSchedule = Literal["cosine", "wsd", "linear", "constant"]
# The warm-up where a config sets none and no time budget makes it a fraction: GPT-2's (375M tokens at 2**19 a step).
WARMUP_STEPS = 715
# Applied steps the spike guard must have seen before it judges one: fewer make too rough a mean and deviation.
SPIKE_MIN_HISTORY = 16
AttentionBackend = Literal["auto", "flash", "cudnn", "efficient", "math"]
OptimizerName = Literal["adamw", "muon"]
MuonLRAdjust = Literal["original", "match_rms_adamw"]
NSCoefficients = Literal["quintic", "polar_express"]  # Newton-Schulz's: torch's one quintic, or one per iteration


@dataclass
class TrainConfig(Config):
    command: ClassVar[str] = "train"
    same_setting: ClassVar[tuple[tuple[str, str], ...]] = (("eval_windows", "eval_steps"),)
    # data and outputs
    data_dir: str = option("", "folder(s) written by `run.py prepare`; several, comma-separated, make a mixture")
    out_dir: str = option("runs/gpt2", "run directory: config.yaml, metrics.jsonl, checkpoints/, final weights")
    data_weights: str = option("", "mixture: comma-separated sampling weights, one per data_dir folder (default equal)")
    verify_data: Literal["auto", "full"] = option(
        "auto", "shard checks at start: auto (sizes; sha256 of new or changed shards only) | full (sha256 of all)"
    )
    # model (defaults: GPT-2 124M)
    n_layer: int = option(12, "transformer blocks", bounds="[1, 1024]")
    n_head: int = option(12, "attention heads per block", bounds="[1, 1024]")
    n_embd: int = option(768, "width of the residual stream", bounds="[1, 65536]")
    seq_len: int = option(
        1024, "tokens per training sequence; also the model's context (position table)", bounds="[1, 1048576]"
    )
    vocab_size: int | None = option(
        None,
        "embedding rows (unset: the data's vocabulary padded up to a multiple of 128 for fast matmuls, e.g. GPT-2's "
        "50,257 -> 50,304)",
        bounds="[1, 16777216]",
    )
    arch: Arch = option(
        "gpt2", "the block: gpt2 (GPT2LMHeadModel's) | nanochat (NanoChatForCausalLM's: rotary, RMSNorm, ReLU², untied)"
    )
    bias: bool | None = option(
        None, "gpt2: Linear and LayerNorm biases (unset: true, GPT-2's; false as nanoGPT's CPU recipe); nanochat: none"
    )
    gelu: Literal["tanh", "exact"] | None = option(
        None, "gpt2: the MLP's GELU, tanh (GPT-2's, unset) | exact (erf, as nanoGPT's model; cheaper on CPUs)"
    )
    n_kv_head: int | None = option(
        None, "nanochat: key/value heads, dividing n_head (grouped-query; unset: n_head)", bounds="[1, 1024]"
    )
    rope_theta: float | None = option(None, "nanochat: the rotary base (unset: 10,000)", bounds="(1, inf)")
    logit_softcap: float | None = option(
        None, "nanochat: logits become c*tanh(logits/c) (0 = off; unset: 15)", bounds="[0, inf)"
    )
    dropout: float = option(
        0.0, "dropout on embeddings, attention weights and residual branches; training only", bounds="[0, 1)"
    )
    # optimization
    total_batch_size: int = option(
        524_288, "tokens per optimizer step, all processes together (2**19)", bounds="[1, 1e12]"
    )
    micro_batch_size: int = option(16, "sequences per process per forward pass", bounds="[1, 1048576]")
    max_steps: int = option(
        19_073, "optimizer steps to train (the default: 10B tokens at 524,288 per step)", bounds="[1, 1e12]"
    )
    time_budget: str = option(
        "",
        "stop when the steps' own time reaches this: seconds (300) or 300s, 5m, 1.5h; the decay follows it, every "
        "rank stops at the same step, and max_steps still caps (unset: train by steps)",
    )
    learning_rate: float = option(6e-4, "peak learning rate, reached after warmup_steps", bounds="(0, 1e6]")
    min_lr_ratio: float = option(
        0.1, "the floor: the schedule reaches min_lr_ratio * learning_rate at its horizon", bounds="[0, 1]"
    )
    warmup_steps: int | None = option(
        None,
        f"steps of linear warm-up from 0 (unset: {WARMUP_STEPS}; under a time_budget, warmup_fraction of its horizon)",
        bounds="[0, 1e12]",
    )
    warmup_fraction: float = option(
        0.05, "time_budget with warmup_steps unset: the warm-up's share of the budget's expected steps", bounds="[0, 1)"
    )
    lr_schedule: LRSchedule = option("cosine", "cosine | wsd (stable, then linear decay) | linear | constant")
    schedule_steps: int = option(
        0, "the schedule's horizon (0 = max_steps); past it the rate stays at the floor", bounds="[0, 1e12]"
    )
    decay_fraction: float = option(
        0.2, "wsd: the last decay_fraction of the horizon decays linearly to the floor", bounds="(0, 1]"
    )
    weight_decay: float = option(0.1, "AdamW decoupled weight decay on matrices and embeddings", bounds="[0, 100]")
    grad_clip: float = option(1.0, "clip the global gradient norm to this (0 = no clipping)", bounds="[0, inf)")
    beta1: float = option(0.9, "AdamW beta1", bounds="[0, 1)")
    beta2: float = option(0.95, "AdamW beta2", bounds="[0, 1)")
    optimizer: OptimizerName = option("adamw", "adamw | muon (Muon on the blocks' weight matrices, AdamW on the rest)")
    muon_lr: float = option(
        0.04, "muon: peak learning rate of the block matrices; the schedule scales it too", bounds="(0, 1e6]"
    )
    muon_momentum: float = option(0.95, "muon: Nesterov momentum", bounds="[0, 1)")
    muon_weight_decay: float = option(0.0, "muon: decoupled weight decay of the block matrices", bounds="[0, 100]")
    muon_adjust_lr_fn: MuonLRAdjust = option(
        "original", "muon: per-matrix lr scale: original (sqrt(max(1, rows/cols))) | match_rms_adamw (0.2*sqrt(max))"
    )
    muon_momentum_warmup: int | None = option(
        None,
        "muon: steps over which momentum rises from muon_momentum_start (0 = none; unset: nanochat 300, gpt2 0)",
        bounds="[0, 1e12]",
    )
    muon_momentum_start: float = option(
        0.85, "muon: the momentum of the first step when muon_momentum_warmup > 0", bounds="[0, 1)"
    )
    muon_ns_steps: int | None = option(
        None,
        "muon: Newton-Schulz iterations per update (torch's ns_steps; unset: nanochat 4, gpt2 5, torch's)",
        bounds="[1, 99]",
    )
    muon_ns_coefficients: NSCoefficients | None = option(
        None,
        "muon: Newton-Schulz's quintics: quintic (torch's, one for all iterations) | polar_express (one per "
        "iteration; unset: nanochat polar_express, gpt2 quintic)",
    )
    muon_ns_dtype: Literal["auto", "bfloat16", "float32"] = option(
        "auto", "muon: Newton-Schulz dtype (auto: bfloat16 on bf16 matrix units, else float32; said at start)"
    )
    embedding_lr: float | None = option(
        None, "nanochat: AdamW peak rate of the token embedding (unset: 0.3)", bounds="(0, 1e6]"
    )
    head_lr: float | None = option(
        None, "nanochat: AdamW peak rate of the untied LM head (unset: 0.008)", bounds="(0, 1e6]"
    )
    seed: int = option(1337, "initial weights and data order", bounds="[0, 2147483647]")
    # loss-spike guard: an outlier step is not applied (the schedule and data still advance)
    spike_loss_zscore: float = option(
        0.0, "skip a step whose loss is over this many std above its mean (0 = off)", bounds="[0, inf)"
    )
    spike_grad_zscore: float = option(
        0.0, "skip a step whose grad norm is over this many std above its mean (0 = off)", bounds="[0, inf)"
    )
    spike_window: int = option(
        128,
        "applied steps the spike guard's mean and std cover (it judges once it holds 16)",
        bounds=f"[{SPIKE_MIN_HISTORY}, 1000000]",
    )
    # evaluation and sampling (0 turns a periodic action off)
    eval_every: int = option(
        250, "steps between validation-loss evaluations (0 = never; also on the last step)", bounds="[0, inf)"
    )
    eval_windows: int | None = option(
        None,
        "validation windows of seq_len tokens: one fixed set for any batch shape or world size (unset: 160)",
        bounds="[0, inf)",
    )
    eval_steps: int | None = option(
        None, "the val set's former size: eval_windows = eval_steps x micro_batch_size", bounds="[0, inf)"
    )
    hellaswag_every: int = option(0, "steps between HellaSwag evaluations (0 = never)", bounds="[0, inf)")
    hellaswag: str = option("", "HellaSwag source for in-training evaluation: a jsonl path/URL or hub id")
    hellaswag_limit: int = option(0, "score only the first N HellaSwag examples (0 = all)", bounds="[0, inf)")
    sample_tokens: int = option(32, "tokens sampled at each evaluation (0 = no samples)", bounds="[0, 10000]")
    sample_prompt: str = option("\n", "the prompt of those samples")
    # checkpoints
    save_every: int = option(
        1000, "steps between checkpoints (0 = none); also at the end and on SIGTERM/SIGINT/SIGHUP", bounds="[0, inf)"
    )
    keep_checkpoints: int = option(2, "keep the newest N checkpoints (0 = all)", bounds="[0, inf)")
    keep_best: bool = option(False, "also keep the checkpoint with the lowest validation loss (needs eval_every)")
    final_weights: Literal["last", "best"] = option(
        "last", "the run dir's model.safetensors: the last step's weights, or the best evaluated checkpoint's"
    )
    resume: str = option("none", "none | auto (the newest complete checkpoint in out_dir) | a checkpoint folder")
    init_from: str = option(
        "none", "none | weights to start a new run from: an accel_gpt run dir or checkpoint, or a transformers GPT-2"
    )
    overwrite: bool = option(False, "start a new run in an out_dir that holds another run's files (they are replaced)")
    # runtime
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = option(
        "auto",
        "no | bf16 | fp16: this one; auto: the launch's (accelerate config or flag), else what this device and model "
        "do fastest (bf16 on bf16 matrix units, fp32 elsewhere; said at start)",
    )
    dist_timeout: int = option(
        0,
        "seconds a collective waits for every process before the run fails (0: torch's, 10 min NCCL, 30 Gloo)",
        bounds="[0, 31536000]",
    )
    compile: Literal["auto", True, False] = option(
        "auto", "torch.compile the model: true | false | auto (where it pays back within the run; said at start)"
    )
    compile_mode: CompileMode = option("default", "torch.compile mode")
    activation_checkpointing: bool = option(False, "recompute each block in backward: less memory, ~30% more compute")
    loss_chunk: int = option(
        0, "rows of LM-head logits per chunk of the training loss (0 = all at once): less memory", bounds="[0, inf)"
    )
    check_memory: bool = option(
        True, "refuse a run whose estimated memory per process is over what the device has free (false: try anyway)"
    )
    attention_backend: AttentionBackend = option("auto", "CUDA attention kernel to force (auto: PyTorch picks)")
    num_workers: int = option(0, "DataLoader worker processes per process", bounds="[0, 64]")
    log_every: int = option(
        1, "steps between host syncs for logging; every step still gets a metrics row", bounds="[1, inf)"
    )
    log_with: str = option("auto", "trackers: auto (TensorBoard if installed) | none | tensorboard | wandb | ...")

    def validate(self) -> None:
        windows, steps, batch = self.eval_windows, self.eval_steps, self.micro_batch_size
        self.eval_windows, self.eval_steps = resolve_eval_windows(windows, steps, batch)
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        self.resolve_arch()
        if not self.data_dir:
            raise ConfigError("data_dir is required: pass --data_dir DIR (a folder written by `run.py prepare`)")
        if self.vocab_size is None:
            self.vocab_size = padded_vocab(self.data_dirs[0])
        self.budget_seconds()  # a duration, positive and finite
        if self.warmup_steps is None and not self.time_budget:
            self.warmup_steps = WARMUP_STEPS  # a budget's is warmup_fraction of its horizon: `optim.warmup_length`
        if len(set(self.data_dirs)) != len(self.data_dirs):
            raise ConfigError(f"data_dir={self.data_dir!r} names a folder twice; weigh it with data_weights instead")
        self.source_weights()  # one positive weight per data_dir folder
        for rate, decay in (("learning_rate", "weight_decay"), ("muon_lr", "muon_weight_decay")):
            if getattr(self, rate) * getattr(self, decay) >= 1:  # each step scales the weights by 1 - rate * decay
                raise ConfigError(
                    f"{rate}={getattr(self, rate)} x {decay}={getattr(self, decay)} must be below 1: decoupled weight "
                    "decay multiplies the weights by 1 - rate x decay each step; lower one of them"
                )
        if self.total_batch_size % (self.micro_batch_size * self.seq_len):
            raise ConfigError(
                f"total_batch_size={self.total_batch_size} is not a multiple of "
                f"micro_batch_size*seq_len={self.micro_batch_size * self.seq_len}"
            )
        if self.eval_every and not self.eval_windows:
            raise ConfigError("eval_windows=0 leaves nothing to evaluate; set eval_windows >= 1 or eval_every 0")
        if not self.eval_every and (self.keep_best or self.final_weights == "best"):
            what = "keep_best=true" if self.keep_best else "final_weights=best"
            raise ConfigError(
                f"{what} ranks checkpoints by their validation loss, but eval_every=0 never evaluates; "
                "set --eval_every N (a multiple of save_every scores every checkpoint)"
            )
        if self.final_weights == "best" and not self.save_every:
            raise ConfigError(
                "final_weights=best takes the best evaluated checkpoint, but save_every=0 writes none; "
                "set --save_every N"
            )
        if self.overwrite and self.resume != "none":
            raise ConfigError(f"overwrite=true starts a new run; it cannot resume ({self.resume}): drop one of them")
        if self.hellaswag_every and not self.hellaswag:
            raise ConfigError("hellaswag_every > 0 needs --hellaswag SRC (a jsonl path/URL or hub id)")

    def resolve_arch(self) -> None:
        """Fill the unset settings of the chosen block with its defaults; refuse nanochat's settings under gpt2."""
        if self.arch == "gpt2":
            given = next((name for name in NANOCHAT_ONLY if getattr(self, name) is not None), None)
            if given:
                raise ConfigError(
                    f"{given}={getattr(self, given)} is a setting of arch nanochat; GPT-2's block has "
                    f"{NANOCHAT_ONLY[given]}: drop --{given} or set --arch nanochat"
                )
            for name, default in GPT2_DEFAULTS.items():
                if getattr(self, name) is None:
                    setattr(self, name, default)
            return
        if self.bias:
            raise ConfigError("bias=true: nanochat's block has no biases; drop --bias or set --arch gpt2")
        self.bias = False
        if self.gelu:
            raise ConfigError(f"gelu={self.gelu}: nanochat's MLP is ReLU², not GELU; drop --gelu or set --arch gpt2")
        for name, default in NANOCHAT_DEFAULTS.items():
            if getattr(self, name) is None:
                setattr(self, name, default)
        head_dim = self.n_embd // self.n_head
        if head_dim % 2:
            raise ConfigError(
                f"n_embd/n_head={head_dim}: rotary positions turn pairs of dimensions, so it must be even"
            )
        kv = self.n_kv_head
        if kv is not None and self.n_head % kv:
            raise ConfigError(f"n_kv_head={kv} must divide n_head={self.n_head} (each key/value head serves a group)")
        if kv == self.n_head:  # one key/value head per query head is the model without the setting
            self.n_kv_head = None

    def notes(self) -> list[str]:
        """Settings that are valid but do less than a reader of the config may think: said once at start-up."""
        notes = []
        if self.optimizer == "adamw":
            given = [name for name in MUON_FIELDS if getattr(self, name) != self._muon_default(name)]
            if given:
                notes.append(f"{', '.join(given)}: Muon's setting(s), unused with --optimizer adamw")
        embedding = (self.vocab_size or 0) * self.n_embd * (2 if self.arch == "nanochat" else 1)  # + untied head
        blocks = 12 * self.n_layer * self.n_embd**2
        if embedding > 9 * blocks:  # over 90% of the parameters
            smaller = "a vocabulary learned from the text (prepare --tokenizer bpe, 8,192 ids)"
            if (self.vocab_size or 0) <= 8192:
                smaller = "a smaller vocabulary (prepare --tokenizer bpe --vocab_size N) or more layers"
            notes.append(
                f"the embedding ({self.vocab_size:,} ids x {self.n_embd}) holds {embedding / (embedding + blocks):.0%} "
                f"of the model's parameters and much of its step: for a model this small, {smaller} leaves more to "
                "the blocks"
            )
        for source in map(Path, config_layers(type(self), self.config)):
            if is_run_config(source) and source.parent.resolve() != Path(self.out_dir).resolve():
                notes.append(
                    f"{source} is another folder's run config: this run writes to its out_dir {self.out_dir}, not to "
                    f"{source.parent} (a copied run? pass --out_dir {source.parent})"
                )
        if (self.keep_best or self.final_weights == "best") and self.eval_every and self.save_every % self.eval_every:
            what = "keep_best" if self.keep_best else "final_weights best"
            every = math.lcm(self.save_every, self.eval_every)
            notes.append(
                f"{what} ranks only checkpoints saved at evaluated steps: with save_every {self.save_every} and "
                f"eval_every {self.eval_every}, those of steps {every}, {2 * every}, ... and the last step's"
            )
        return notes

    def _muon_default(self, name: str) -> Any:
        """What a Muon field is when the config leaves it unset, under this config's block."""
        per_block = block_defaults(self.arch)
        return per_block[name] if name in per_block else TrainConfig.__dataclass_fields__[name].default

    @property
    def data_dirs(self) -> list[str]:
        """The folders of `data_dir`: one, or several for a mixture."""
        return split_folders(self.data_dir)

    def source_weights(self) -> list[float]:
        """`data_weights` as numbers normalised to sum 1, one per folder of `data_dir` (equal when unset)."""
        return normalised_weights(self.data_weights, len(self.data_dirs))

    def budget_seconds(self) -> float | None:
        from accel_gpt.budget import parse_duration

        return parse_duration(self.time_budget) if self.time_budget else None

    def model_settings(self) -> dict[str, Any]:
        """The model's shape as `GPTConfig` takes it: the settings the chosen block has (GPT-2 has no rotary base)."""
        values = {name: getattr(self, name) for name in MODEL_FIELDS}
        return {name: value for name, value in values.items() if value is not None} | {"dropout": self.dropout}

    @property
    def windows_per_step(self) -> int:
        """Sequences in one global batch: the data position advances by this much per optimizer step."""
        return self.total_batch_size // self.seq_len

    def grad_accum_steps(self, world_size: int) -> int:
        """Derived, never stored: it depends on how the run was launched."""
        per_micro = self.micro_batch_size * self.seq_len * world_size
        if self.total_batch_size % per_micro:
            raise ConfigError(
                f"total_batch_size={self.total_batch_size} is not a multiple of "
                f"micro_batch_size*seq_len*world_size={per_micro} (world_size={world_size}); "
                "change micro_batch_size or total_batch_size"
            )
        return self.total_batch_size // per_micro


def padded_vocab(data_dir: str) -> int | None:
    """The vocabulary of a prepared folder, padded (`pad_vocab`). None where the manifest cannot be read (not there
    yet, a prepare still writing the folder, damaged): train then reads the folder itself and says what is wrong,
    instead of a guessed size that every resume would keep."""
    if lock_holder(data_dir):
        return None  # a prepare writes here: its manifest may appear or change before train opens the data
    try:
        size = json.loads((Path(data_dir) / "manifest.json").read_text(encoding="utf-8"))["vocab_size"]
    except Exception:  # noqa: BLE001 - any unreadable manifest is train's to report, with its own checks
        return None
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        return None
    return pad_vocab(size)


def pad_vocab(size: int, multiple: int = 128) -> int:
    """`size` ids rounded up to `multiple` rows: faster matmuls; the logits stop at the real ids."""
    return -(-size // multiple) * multiple


# ---------------------------------------------------------------------------------------------- prepare


BPE_PARTS = (
    "--tokenizer bpe learns its tokenizer once, before the parts: prepare (some of) the text on one machine first, "
    "then give its tokenizer.json to every part with --tokenizer_file"
)


@dataclass
class PrepareConfig(Config):
    command: ClassVar[str] = "prepare"
    dataset: str = option(
        "",
        "the text: a hub id, local txt/json/jsonl/parquet/csv files or folder, or http(s) URL "
        "(unset: tiny Shakespeare, 1.1 MB, bundled with accel_gpt)",
    )
    dataset_config: str | None = option(None, "hub dataset config name, e.g. sample-10BT")
    split: str = option("train", "split to read")
    val_split: str | None = option(None, "the dataset's own validation split, if it has one")
    text_column: str = option("text", "column holding the text")
    sample_by: Literal["", "line", "paragraph", "document"] = option(
        "", "plain text only: what one document is (unset: paragraph; document with --tokenizer char)"
    )
    tokenizer: Literal["gpt2", "char", "bpe"] = option(
        "gpt2",
        "gpt2 (tiktoken BPE, EOT before every document), char, or bpe (a byte-level BPE of --vocab_size tokens trained "
        "on the train split, EOT before every document)",
    )
    vocab_size: int | None = option(
        None, "bpe: the tokenizer's ids, the 256 bytes and end-of-text included (unset: 8192)", bounds="[257, 65536]"
    )
    tokenizer_file: str = option(
        "", "bpe: use this tokenizer.json (an earlier prepare's) instead of training one; every part of one prepare"
    )
    tokenizer_chars: int = option(
        200_000_000,
        "bpe: learn the tokenizer from at most the first N characters of train (more: a few tenths of a percent "
        "better compression for far more time)",
        bounds="[1, inf)",
    )
    out_dir: str = option("data/shards", "where shards and manifest.json go: train's data_dir (presets set their own)")
    shard_size: int = option(100_000_000, "tokens per shard", bounds="[1, inf)")
    val_tokens: int = option(
        0, "the first N tokens go to the val split (when there is no --val_split)", bounds="[0, inf)"
    )
    num_proc: int = option(1, "tokenizer worker processes", bounds="[1, 256]")
    streaming: bool = option(False, "stream the dataset: bounded memory, any size")
    limit: int = option(0, "read only the first N documents of each split (0 = all)", bounds="[0, inf)")
    num_shards: int | None = option(
        None, "split the input into K parts, one per machine (unset: WORLD_SIZE)", bounds="[1, 100000]"
    )
    shard_index: int | None = option(
        None, "which part (0..K-1) this process prepares (unset: RANK)", bounds="[0, 99999]"
    )
    merge: bool = option(False, "only merge the finished part-*-of-K folders of --out_dir into one manifest")
    task_chars: int = option(1 << 20, "characters per worker task: changes speed, never the output", bounds="[1, inf)")

    def validate(self) -> None:
        if not self.sample_by:
            self.sample_by = "document" if self.tokenizer == "char" else "paragraph"
        if self.val_split and self.val_tokens:
            raise ConfigError("val_split and val_tokens both set: take validation from one of them")
        if (self.num_shards is None) != (self.shard_index is None):
            raise ConfigError("num_shards and shard_index go together: part shard_index of num_shards parts")
        if self.num_shards is not None and not self.shard_index < self.num_shards:
            raise ConfigError(f"shard_index={self.shard_index} must be in 0..{self.num_shards - 1} (num_shards)")
        if self.tokenizer == "char" and (self.num_shards or 1) > 1:
            raise ConfigError("the char tokenizer builds its vocabulary from all the data, so it runs as one part")
        if self.tokenizer != "bpe" and (self.vocab_size is not None or self.tokenizer_file):
            flag = "--vocab_size" if self.vocab_size is not None else "--tokenizer_file"
            raise ConfigError(f"{flag} is for --tokenizer bpe (the {self.tokenizer} tokenizer's vocabulary is fixed)")
        if self.tokenizer_file and self.vocab_size is not None:
            raise ConfigError("--tokenizer_file gives the vocabulary: leave --vocab_size out")
        if self.tokenizer == "bpe" and not self.tokenizer_file and (self.num_shards or 1) > 1:
            raise ConfigError(BPE_PARTS)
        if self.tokenizer == "bpe" and self.vocab_size is None and not self.tokenizer_file:
            self.vocab_size = 8192
        if not self.out_dir:
            raise ConfigError("--out_dir is empty: name the folder for the shards and manifest.json (train's data_dir)")


# ------------------------------------------------------------------------------- eval, sample, export, plot


@dataclass
class EvalConfig(Config):
    command: ClassVar[str] = "eval"
    checkpoint: str = option("", "run dir, checkpoint dir, or transformers GPT-2 folder/hub id", required=True)
    hellaswag: str = option("", "HellaSwag source: jsonl path/URL or hub id (Rowan/hellaswag)")
    limit: int = option(0, "score only the first N HellaSwag examples (0 = all)", bounds="[0, inf)")
    data_dir: str = option("", "token shards whose 'val' split gives the validation loss")
    eval_windows: int | None = option(
        None,
        "validation windows, shared over the processes (unset: the run's eval_windows, or its export's; else 160)",
        bounds="[1, inf)",
    )
    eval_steps: int | None = option(
        None, "the former size of the val set: eval_windows = eval_steps x batch_size", bounds="[1, inf)"
    )
    batch_size: int | None = option(
        None,
        "sequences (or HellaSwag examples) per forward pass (unset: the run's micro_batch_size, else 8)",
        bounds="[1, 1048576]",
    )
    out: str = option("", "write one jsonl line per HellaSwag example here")

    def validate(self) -> None:
        if not self.hellaswag and not self.data_dir:
            raise ConfigError("nothing to evaluate: pass --hellaswag SRC and/or --data_dir D")
        if self.out and not self.hellaswag:
            raise ConfigError("--out writes HellaSwag predictions; it needs --hellaswag")


@dataclass
class SampleConfig(Config):
    command: ClassVar[str] = "sample"
    checkpoint: str = option("", "run dir, checkpoint dir, or transformers GPT-2 folder/hub id", required=True)
    prompt: str = option("\n", "text to continue")
    max_new_tokens: int = option(100, "tokens to generate", bounds="[0, inf)")
    temperature: float = option(1.0, "divides the logits: below 1 is more conservative, 0 is greedy", bounds="[0, inf)")
    top_k: int = option(50, "keep the k most likely tokens (0 = all)", bounds="[0, inf)")
    num_samples: int = option(1, "independent continuations to print, drawn as one batch", bounds="[1, 1024]")
    seed: int = option(1337, "random seed: the same seed gives the same text", bounds="[0, 2147483647]")
    stop_at_eot: bool = option(True, "end a sample where the model writes end-of-text (false: write on past it)")
    device: str = option("", "cpu, cuda, ... (default: cuda if available)")


@dataclass
class ExportConfig(Config):
    command: ClassVar[str] = "export"
    checkpoint: str = option("", "run dir or checkpoint dir", required=True)
    out_dir: str = option(
        "", "a new or empty folder for from_pretrained (or for the .gguf with --format gguf)", required=True
    )
    format: Literal["transformers", "gguf"] = option(
        "transformers",
        "transformers (a from_pretrained folder) or gguf (one file for llama.cpp and ollama: gpt2 block)",
    )
    outtype: Literal["f32", "f16", "bf16"] = option(
        "f32", "gguf: the weight matrices' type (norms and biases stay f32)"
    )
    license: str = option("mit", "the model card's license: a Hub license id (mit, apache-2.0, cc-by-4.0, other, ...)")
    push_to_hub: str = option("", "then upload the folder to this Hub model repo (NAME or OWNER/NAME; needs a token)")
    private: bool = option(False, "push_to_hub: create the repo private (an existing repo keeps its visibility)")

    def validate(self) -> None:
        if not re.fullmatch(r"[a-z0-9][a-z0-9.+-]*", self.license):
            raise ConfigError(f"license={self.license!r} is not a Hub license id (e.g. mit, apache-2.0, other)")
        if self.push_to_hub and not re.fullmatch(r"([\w.-]+/)?[\w.-]+", self.push_to_hub):
            raise ConfigError(f"push_to_hub={self.push_to_hub!r} is not a repo id: NAME or OWNER/NAME")
        if self.private and not self.push_to_hub:
            raise ConfigError("private=true is for --push_to_hub REPO_ID: nothing is uploaded without it")
        if self.outtype != "f32" and self.format != "gguf":
            raise ConfigError(f"outtype={self.outtype} is for --format gguf; the transformers export is float32")


@dataclass
class PlotConfig(Config):
    command: ClassVar[str] = "plot"
    run_dirs: list[str] = option([], "run directories holding metrics.jsonl", positional=True)
    out: str = option("runs.png", "output file; .png, .pdf or .svg picks the format")

    def validate(self) -> None:
        if not self.run_dirs:
            raise ConfigError("plot needs a run directory: give RUN_DIR ... (or run_dirs in the --config file)")


@dataclass
class CompareConfig(Config):
    command: ClassVar[str] = "compare"
    run_dirs: list[str] = option([], "run directories to set side by side", positional=True)
    plot: str = option("", "also draw their curves into this file (.png, .pdf or .svg), as `plot` does")
    log: str = option("", "append each run not yet listed to this tab-separated experiment log (made if missing)")

    def validate(self) -> None:
        if not self.run_dirs:
            raise ConfigError("compare needs run directories: give RUN_DIR ... (or run_dirs in the --config file)")


# The val set's size when nothing sets it: a GPT-2 124M run's former 20 batches of 8 windows.
DEFAULT_EVAL_WINDOWS = 160


def resolve_eval_windows(windows: int | None, steps: int | None, batch: int) -> tuple[int, None]:
    """(eval_windows, eval_steps=None): the val set in windows. `eval_steps` (batches of `batch`) is its former
    size, which tied it to the batch shape; older config.yaml files and flags that give it still mean what they did."""
    if steps is None:
        return (DEFAULT_EVAL_WINDOWS if windows is None else windows), None
    if windows is not None and windows != steps * batch:
        raise ConfigError(
            f"eval_steps={steps} (x batch {batch} = {steps * batch} windows) and eval_windows={windows} disagree: "
            "eval_steps is the former name of the val set's size; drop it and keep eval_windows"
        )
    return steps * batch, None


def yaml_text(cfg: Config) -> str:
    """A config as its config.yaml holds it."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False)


def save_yaml(cfg: Config, path: Path) -> None:
    atomic_write(path, yaml_text(cfg))
