"""Training configuration: dataclass defaults, then a preset YAML, then `--field value` flags.

The dataclass is the schema for all three layers: YAML keys and flags are the field names, values are
checked against the annotations, and cross-field rules live in `__post_init__` so that every way of
building a config is validated the same way.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import yaml

from accel_gpt.errors import ConfigError

PRESETS_DIR = Path(__file__).parent / "presets"


@dataclass
class TrainConfig:
    # data and outputs
    data_dir: str = ""  # token shards + manifest.json written by `run.py prepare`
    out_dir: str = "runs/gpt2"
    # model (defaults: GPT-2 124M)
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    seq_len: int = 1024
    vocab_size: int = 50_304  # 50,257 padded up to a multiple of 128 for faster matmuls
    # optimization
    total_batch_size: int = 524_288  # tokens per optimizer step, all ranks together (2**19)
    micro_batch_size: int = 16  # sequences per rank per forward pass
    max_steps: int = 19_073  # 10B tokens / 524,288 tokens per step
    learning_rate: float = 6e-4
    min_lr_ratio: float = 0.1  # cosine decays to min_lr_ratio * learning_rate
    warmup_steps: int = 715
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping
    beta1: float = 0.9
    beta2: float = 0.95
    seed: int = 1337
    # evaluation and sampling (0 turns a periodic action off)
    eval_every: int = 250
    eval_steps: int = 20  # validation batches per rank per evaluation
    hellaswag_every: int = 0
    hellaswag: str = ""  # HellaSwag source for in-training eval: jsonl path/URL or hub id
    hellaswag_limit: int = 0  # score only the first N examples (0 = all)
    sample_tokens: int = 32  # tokens sampled at each evaluation (0 = no samples)
    sample_prompt: str = "\n"
    # checkpoints
    save_every: int = 1000
    keep_checkpoints: int = 2
    keep_best: bool = False
    resume: str = "none"  # none | auto | a checkpoint path
    init_from: str = "none"  # none | a transformers GPT-2 folder or hub id
    # runtime
    compile: bool = False
    compile_mode: str = "default"  # torch.compile mode: default | max-autotune-no-cudagraphs | max-autotune | ...
    activation_checkpointing: bool = False
    num_workers: int = 0  # DataLoader worker processes per rank
    log_every: int = 1  # steps between host syncs for logging; every step still gets a metrics row
    log_with: str = "auto"  # auto (TensorBoard if installed) | none | tensorboard | wandb | ...

    def __post_init__(self) -> None:
        _check_types(self)
        positive = (
            "n_layer",
            "n_head",
            "n_embd",
            "seq_len",
            "vocab_size",
            "total_batch_size",
            "micro_batch_size",
            "max_steps",
            "log_every",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be > 0")
        non_negative = (
            "warmup_steps",
            "eval_every",
            "eval_steps",
            "hellaswag_every",
            "hellaswag_limit",
            "sample_tokens",
            "save_every",
            "keep_checkpoints",
            "num_workers",
            "weight_decay",
            "grad_clip",
        )
        for name in non_negative:
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0")
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        if not self.data_dir:
            raise ConfigError("data_dir is required: pass --data_dir DIR (a folder written by `run.py prepare`)")
        if self.learning_rate <= 0:
            raise ConfigError(f"learning_rate={self.learning_rate} must be > 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if self.total_batch_size % (self.micro_batch_size * self.seq_len):
            raise ConfigError(
                f"total_batch_size={self.total_batch_size} is not a multiple of "
                f"micro_batch_size*seq_len={self.micro_batch_size * self.seq_len}"
            )
        if self.compile_mode not in COMPILE_MODES:
            raise ConfigError(f"compile_mode={self.compile_mode!r} is not one of {', '.join(COMPILE_MODES)}")
        if self.hellaswag_every and not self.hellaswag:
            raise ConfigError("hellaswag_every > 0 needs --hellaswag SRC (a jsonl path/URL or hub id)")

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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# torch.compile's modes; the CUDA-graph ones ("reduce-overhead", "max-autotune") replay whole steps, which pays
# off where kernel launches, not the GPU, bound a step.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")

# Fields that define the model's shape: a resume or init that changes one of these cannot load weights.
MODEL_FIELDS = ("n_layer", "n_head", "n_embd", "seq_len", "vocab_size")


def _check_types(cfg: TrainConfig) -> None:
    hints = typing.get_type_hints(type(cfg))
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        setattr(cfg, f.name, _coerce(f.name, value, hints[f.name]))


def _coerce(name: str, value: Any, annotation: Any) -> Any:
    """Check one value against its annotation; strings from the command line are parsed here."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    if annotation is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{name}={value!r} must be true or false")
    if annotation is int:
        if isinstance(value, bool):
            raise ConfigError(f"{name}={value!r} must be an integer")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                try:
                    as_float = float(value)
                except ValueError:
                    as_float = None
                if as_float is not None and as_float.is_integer():
                    return int(as_float)
        raise ConfigError(f"{name}={value!r} must be an integer")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{name}={value!r} must be a number")
    if annotation is str:
        if value is None:
            return "none"
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{name}={value!r} must be a string")
    return value


def field_names() -> list[str]:
    return [f.name for f in fields(TrainConfig)]


def check_keys(keys: typing.Iterable[str], where: str) -> None:
    """Reject unknown keys, naming the closest real ones (typos are the usual cause)."""
    known = field_names()
    for key in keys:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; known keys: {', '.join(known)}"
            raise ConfigError(f"unknown config key '{key}' in {where}{hint}")


def resolve_preset(name_or_path: str) -> Path:
    """A YAML path, or the name of a preset shipped in accel_gpt/presets (`tiny-cpu`)."""
    path = Path(name_or_path)
    if path.is_file():
        return path
    preset = PRESETS_DIR / f"{name_or_path.removesuffix('.yaml')}.yaml"
    if preset.is_file():
        return preset
    names = sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))
    raise ConfigError(f"config '{name_or_path}' is neither a YAML file nor a preset ({', '.join(names)})")


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of config keys, got {type(data).__name__}")
    return data


def parse_flags(argv: list[str]) -> dict[str, str]:
    """`--field value` / `--field=value` pairs; values stay strings and are typed by the dataclass."""
    out: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise ConfigError(f"expected --field value, got '{arg}'")
        key, eq, value = arg[2:].partition("=")
        if not eq:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ConfigError(f"flag --{key} needs a value")
            value = argv[i + 1]
            i += 1
        out[key] = value
        i += 1
    return out


def load_config(config: str | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Defaults, then the YAML file or preset `config`, then `overrides` (flags win)."""
    values: dict[str, Any] = {}
    if config:
        path = resolve_preset(config)
        data = read_yaml(path)
        check_keys(data, str(path))
        values.update(data)
    overrides = overrides or {}
    check_keys(overrides, "the command line")
    values.update(overrides)
    return TrainConfig(**values)


def save_config(cfg: TrainConfig, path: Path) -> None:
    path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
