"""Config: defaults, preset YAML, flag overrides, typing and validation, for every command's dataclass."""

from __future__ import annotations

import re
import typing
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from accel_gpt.cli import COMMANDS, parse
from accel_gpt.config import (
    PRESETS_DIR,
    Config,
    PrepareConfig,
    TrainConfig,
    check_keys,
    coerce,
    preset_names,
    preset_values,
    presets_dir,
    save_yaml,
)
from accel_gpt.errors import ConfigError

CONFIGS = {name: command.config for name, command in COMMANDS.items()}


def test_yaml_then_flags(tmp_path: Path) -> None:
    """Three layers, flags winning: the same through the command line and through `load`."""
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("data_dir: d\nn_layer: 3\nlearning_rate: 1.0e-3\ncompile: true\n")
    flags = ["--n_layer", "5", "--compile=false", "--resume", "auto"]
    name, cfg = parse(["train", "--config", str(yaml_file), *flags])
    assert name == "train" and cfg.config == str(yaml_file)
    assert (cfg.n_layer, cfg.learning_rate, cfg.compile, cfg.resume) == (5, 1e-3, False, "auto")
    assert cfg.n_head == TrainConfig.n_head  # untouched default
    loaded = TrainConfig.load(str(yaml_file), {"n_layer": "5", "compile": "false", "resume": "auto"})
    assert loaded == cfg


BOOLEAN_FLAGS = [([], False), (["--keep_best"], True), (["--keep_best", "true"], True)]
BOOLEAN_FLAGS += [(["--keep_best", "false"], False), (["--keep_best=true"], True), (["--keep_best=false"], False)]
# compile is a switch with a third state, auto (the default): a bare flag and true/false still work as for a boolean
SWITCH_FLAGS = [([], "auto"), (["--compile"], True), (["--compile", "true"], True), (["--compile", "false"], False)]
SWITCH_FLAGS += [(["--compile=TRUE"], True), (["--compile=false"], False), (["--compile", "auto"], "auto")]


@pytest.mark.parametrize(("flags", "expected"), BOOLEAN_FLAGS)
def test_booleans_take_a_bare_flag_or_true_false(flags: list[str], expected: bool) -> None:
    _, cfg = parse(["train", "--data_dir", "d", "--eval_every", "1", *flags])
    assert cfg.keep_best is expected


@pytest.mark.parametrize(("flags", "expected"), SWITCH_FLAGS)
def test_compile_takes_auto_as_well_as_a_boolean(flags: list[str], expected: bool | str) -> None:
    _, cfg = parse(["train", "--data_dir", "d", *flags])
    assert cfg.compile is expected if isinstance(expected, bool) else cfg.compile == expected


@pytest.mark.parametrize("value", ["1", "yes", "on", 1, 0, "Auto "])
def test_compile_refuses_what_is_not_auto_true_or_false(value: object) -> None:
    with pytest.raises(ConfigError, match=r"^compile=.* is not one of auto, true, false"):
        TrainConfig(data_dir="d", compile=value)


def test_a_bare_boolean_overrides_the_preset() -> None:
    assert parse(["train", "--config", "gpt2-124m"])[1].compile is True
    assert parse(["train", "--config", "gpt2-124m", "--compile", "false"])[1].compile is False
    assert parse(["train", "--config", "tiny-cpu", "--compile"])[1].compile is True


PRESETS = [(cls, name) for cls in CONFIGS.values() for name in preset_names(cls)]


@pytest.mark.parametrize(("cls", "preset"), PRESETS, ids=[f"{c.command}-{p}" for c, p in PRESETS])
def test_every_preset_loads(cls: type[Config], preset: str) -> None:
    """Every shipped preset is complete for its command (it validates) and names only real settings."""
    cfg = cls.load(preset)
    assert cfg.config == preset
    assert cfg.data_dir if cls is TrainConfig else cfg.out_dir  # prepare's: an unset dataset is the bundled text
    raw = yaml.safe_load((presets_dir(cls) / f"{preset}.yaml").read_text())
    assert raw and set(raw) <= {f.name for f in fields(cls)}


def test_presets_are_found_per_command() -> None:
    assert preset_names(TrainConfig) == [
        "gpt2-124m", "gpt2-124m-muon", "gpt2-124m-nanochat", "gpt2-large", "gpt2-medium",
        "shakespeare-char", "shakespeare-char-cpu", "tiny-cpu",
    ]  # fmt: skip
    assert preset_names(PrepareConfig) == ["fineweb-edu-10B", "shakespeare-char", "tinyshakespeare"]
    assert presets_dir(TrainConfig) == PRESETS_DIR and presets_dir(PrepareConfig) == PRESETS_DIR / "prepare"
    for name in ("eval", "sample", "export", "plot"):
        assert preset_names(CONFIGS[name]) == [], name


# GPT-2 124M as build-nanogpt / llm.c train it, written out here so that neither the preset nor a
# dataclass default can drift from it unnoticed.
GPT2_124M = {
    "n_layer": 12,
    "n_head": 12,
    "n_embd": 768,
    "seq_len": 1024,
    "vocab_size": 50_304,
    "total_batch_size": 524_288,
    "max_steps": 19_073,
    "warmup_steps": 715,
    "learning_rate": 6e-4,
    "min_lr_ratio": 0.1,
    "weight_decay": 0.1,
    "grad_clip": 1.0,
    "micro_batch_size": 64,
    "compile": True,
}
# Keys the preset file itself must set: the training recipe and what a real run needs beyond it (data,
# output, HellaSwag). Only the model shape may come from the dataclass defaults, which are documented as
# GPT-2 124M; the loaded values are checked against the literals above either way.
# warmup_steps is left to its default (715), so that under a time budget the warm-up is a fraction of the horizon
GPT2_124M_FILE_KEYS = {k for k in GPT2_124M if k not in ("n_layer", "n_head", "n_embd", "seq_len", "warmup_steps")}
GPT2_124M_FILE_KEYS |= {"data_dir", "out_dir", "hellaswag", "hellaswag_every"}


def test_gpt2_124m_recipe() -> None:
    raw = yaml.safe_load((PRESETS_DIR / "gpt2-124m.yaml").read_text())
    assert not GPT2_124M_FILE_KEYS - set(raw), f"gpt2-124m.yaml does not set {GPT2_124M_FILE_KEYS - set(raw)}"
    # the file's own values are the recipe ...
    assert {key: raw[key] for key in GPT2_124M if key in raw} == {
        key: GPT2_124M[key] for key in GPT2_124M if key in raw
    }
    # ... and so is what loading it gives, the defaults it relies on included
    cfg = TrainConfig.load("gpt2-124m")
    assert {key: getattr(cfg, key) for key in GPT2_124M} == GPT2_124M
    assert cfg.hellaswag_every > 0 and cfg.hellaswag == raw["hellaswag"] == "Rowan/hellaswag"
    assert cfg.grad_accum_steps(8) == 1 and cfg.grad_accum_steps(1) == 8


@pytest.mark.parametrize(
    ("preset", "shape", "micro_batch_size"),
    [("gpt2-medium", (24, 16, 1024), 32), ("gpt2-large", (36, 20, 1280), 16)],
)
def test_larger_gpt2_presets_are_the_124m_recipe_at_their_size(
    preset: str, shape: tuple[int, int, int], micro_batch_size: int
) -> None:
    """GPT-2 350M and 774M: only the shape, the micro-batch and out_dir differ from gpt2-124m."""
    cfg, small = TrainConfig.load(preset), TrainConfig.load("gpt2-124m")
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.micro_batch_size) == (*shape, micro_batch_size)
    assert cfg.out_dir == f"runs/{preset}"
    differ = {"n_layer", "n_head", "n_embd", "micro_batch_size", "out_dir", "config"}
    assert {k: v for k, v in cfg.to_dict().items() if k not in differ} == {
        k: v for k, v in small.to_dict().items() if k not in differ
    }
    assert cfg.grad_accum_steps(8) == 64 // micro_batch_size


def test_unknown_key_lists_close_matches(tmp_path: Path) -> None:
    message = "unknown train setting 'learnin_rate' in the command line; did you mean learning_rate?"
    with pytest.raises(ConfigError, match=re.escape(message)):
        TrainConfig.load("", {"data_dir": "d", "learnin_rate": "1"})
    bad = tmp_path / "bad.yaml"
    bad.write_text("data_dir: d\nn_embed: 64\n")
    with pytest.raises(ConfigError, match=re.escape(f"unknown train setting 'n_embed' in {bad}; did you mean n_embd")):
        TrainConfig.load(str(bad))
    with pytest.raises(ConfigError, match="unknown prepare setting 'shard_sise' in here; did you mean shard_size"):
        check_keys(PrepareConfig, ["dataset", "shard_sise"], "here")
    with pytest.raises(ConfigError, match="unknown train setting 'zzz' in here; known: config, data_dir, out_dir"):
        check_keys(TrainConfig, ["zzz"], "here")  # nothing close: the known names instead


def test_misspelt_preset_names_the_close_ones() -> None:
    with pytest.raises(
        ConfigError, match="'tiny-cpuu' is neither a YAML file nor a train preset; did you mean tiny-cpu"
    ):
        preset_values(TrainConfig, "tiny-cpuu")
    with pytest.raises(ConfigError, match="nor a prepare preset; did you mean tinyshakespeare"):
        preset_values(PrepareConfig, "tinyshakespear")
    with pytest.raises(ConfigError, match="presets: gpt2-124m, gpt2-124m-muon, gpt2-124m-nanochat, .*, tiny-cpu$"):
        preset_values(TrainConfig, "nothing-like-it")


def test_a_recipe_builds_on_the_config_it_names(tmp_path: Path) -> None:
    """A user's YAML with `config: tiny-cpu` (before: the key was dropped, and the run took the 124M defaults): its
    base's values first, then its own; a base file is found beside the recipe; a recipe naming itself is refused.
    A run's config.yaml, which records its --config, is not followed: it holds every value already."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "mine.yaml").write_text("config: tiny-cpu\nmax_steps: 3\n")
    (tmp_path / "sub" / "over.yaml").write_text("config: mine.yaml\nlearning_rate: 0.5\n")
    cfg = TrainConfig.load(str(tmp_path / "sub" / "over.yaml"))
    preset = TrainConfig.load("tiny-cpu")
    assert (cfg.n_layer, cfg.n_embd, cfg.max_steps, cfg.learning_rate) == (preset.n_layer, preset.n_embd, 3, 0.5)
    _, flagged = parse(["train", "--config", str(tmp_path / "sub" / "mine.yaml"), "--max_steps", "9"])
    assert (flagged.n_embd, flagged.max_steps) == (preset.n_embd, 9)
    (tmp_path / "loop.yaml").write_text(f"config: {tmp_path / 'loop.yaml'}\n")
    with pytest.raises(ConfigError, match="names itself among its bases"):
        TrainConfig.load(str(tmp_path / "loop.yaml"))
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    save_yaml(TrainConfig.load("tiny-cpu", {"config": "gone.yaml", "max_steps": "7"}), run / "config.yaml")
    assert TrainConfig.load(str(run / "config.yaml")).max_steps == 7


@pytest.mark.parametrize(("text", "expected"), [("compile: yes", "compile='yes'"), ("overwrite: on", "overwrite")])
def test_yaml_booleans_are_true_and_false_as_on_the_command_line(tmp_path: Path, text: str, expected: str) -> None:
    """YAML 1.1 read yes/on as true, where `--compile yes` is refused; now a YAML refuses them too, and
    `mixed_precision: no` is the setting's word "no", not false."""
    (tmp_path / "c.yaml").write_text(text + "\n")
    with pytest.raises(ConfigError, match=re.escape(expected)):
        TrainConfig.load(str(tmp_path / "c.yaml"))
    (tmp_path / "ok.yaml").write_text("data_dir: d\ncompile: FALSE\nmixed_precision: no\noverwrite: True\n")
    cfg = TrainConfig.load(str(tmp_path / "ok.yaml"))
    assert (cfg.compile, cfg.mixed_precision, cfg.overwrite) == (False, "no", True)


def test_yaml_must_be_a_mapping(tmp_path: Path) -> None:
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping of train settings, got list"):
        TrainConfig.load(str(tmp_path / "list.yaml"))
    (tmp_path / "broken.yaml").write_text("data_dir: [unclosed\n")
    with pytest.raises(ConfigError, match="is not valid UTF-8 YAML"):
        TrainConfig.load(str(tmp_path / "broken.yaml"))


def test_types_are_checked() -> None:
    with pytest.raises(ConfigError, match="n_layer='two' must be an integer"):
        TrainConfig.load("", {"data_dir": "d", "n_layer": "two"})
    with pytest.raises(ConfigError, match="compile='yes' is not one of auto, true, false"):
        TrainConfig.load("", {"data_dir": "d", "compile": "yes"})
    with pytest.raises(ConfigError, match="compile_mode='fast' is not one of default, reduce-overhead"):
        TrainConfig.load("", {"data_dir": "d", "compile_mode": "fast"})


def test_strings_are_parsed_by_the_annotation() -> None:
    """Flags arrive as strings; YAML gives typed values. Both must end up the same."""
    assert coerce("n", "2e3", int) == 2000 and coerce("n", "1_000", int) == 1000 and coerce("n", 3.0, int) == 3
    assert coerce("x", "1e-3", float) == 1e-3 and coerce("x", 2, float) == 2.0
    assert coerce("o", "none", int | None) is None and coerce("o", "4", int | None) == 4
    assert coerce("r", "a", list[str]) == ["a"]
    with pytest.raises(ConfigError, match="n=2.5 must be an integer"):
        coerce("n", 2.5, int)
    with pytest.raises(ConfigError, match="x=inf must be a finite number"):
        coerce("x", "inf", float)
    with pytest.raises(ConfigError, match="b=1 must be true or false"):
        coerce("b", 1, bool)


def test_accumulation_is_derived_from_world_size() -> None:
    cfg = TrainConfig(data_dir="d", total_batch_size=3 * 16 * 64, micro_batch_size=16, seq_len=64)
    assert cfg.grad_accum_steps(1) == 3 and cfg.grad_accum_steps(3) == 1
    with pytest.raises(ConfigError, match="world_size=2"):
        cfg.grad_accum_steps(2)


def test_flags_need_values(capsys: pytest.CaptureFixture) -> None:
    for argv in (["train", "--n_layer"], ["train", "--n_layer", "--compile"]):
        with pytest.raises(SystemExit) as exc:
            parse(argv)
        assert exc.value.code == 2
        assert capsys.readouterr().err == (
            "error: argument --n_layer: expected one argument (see `accel-gpt train --help`)\n"
        )  # one line, as every error of the product: argparse's usage line is left out


def test_saved_config_loads_back_the_same(tmp_path: Path) -> None:
    """A run's config.yaml is itself a valid --config: it records `config` but is not followed through it."""
    cfg = TrainConfig.load("tiny-cpu", {"n_layer": 3})
    save_yaml(cfg, tmp_path / "config.yaml")
    again = TrainConfig.load(str(tmp_path / "config.yaml"))
    assert {**again.to_dict(), "config": "tiny-cpu"} == cfg.to_dict()


@pytest.mark.parametrize("resume", ["auto", "runs/old/checkpoints/step_00000700"])
def test_a_runs_config_taken_back_starts_a_new_run(tmp_path: Path, resume: str) -> None:
    """A run's config.yaml gives back its recipe, not how it started: taken back for a new folder, a rolled-back
    run's config would start from the old run's checkpoint, a resumed one's would continue the old run. A recipe
    file of the user's own keeps its `resume` (a requeued job's `resume: auto`)."""
    run, recipe = tmp_path / "run", tmp_path / "recipe"
    run.mkdir(), recipe.mkdir()
    (run / "metrics.jsonl").write_text("")
    for folder in (run, recipe):
        save_yaml(TrainConfig.load("tiny-cpu", {"resume": resume, "learning_rate": 1e-4}), folder / "config.yaml")
    again = TrainConfig.load(str(run / "config.yaml"), {"out_dir": str(tmp_path / "new")})
    assert again.resume == "none" and again.learning_rate == 1e-4
    assert TrainConfig.load(str(recipe / "config.yaml")).resume == resume


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_field_has_a_one_line_help(name: str) -> None:
    hints = typing.get_type_hints(CONFIGS[name])
    for f in fields(CONFIGS[name]):
        text = f.metadata.get("help", "")
        assert text.strip() and "\n" not in text, f"{name}.{f.name} needs a one-line help"
        assert f.name in hints


def test_settings_that_do_less_than_they_seem_are_noted() -> None:
    """Muon's fields with AdamW (each block's own defaults are not "given"), and best-weights candidates that only
    some checkpoints can be."""
    assert TrainConfig(data_dir="x").notes() == [] and TrainConfig(data_dir="x", arch="nanochat").notes() == []
    assert TrainConfig(data_dir="x", muon_lr=0.05, muon_ns_steps=3).notes() == [
        "muon_lr, muon_ns_steps: Muon's setting(s), unused with --optimizer adamw"
    ]
    assert TrainConfig(data_dir="x", optimizer="muon", muon_lr=0.05).notes() == []
    gpt2_tokens = TrainConfig.load("tiny-cpu", {"vocab_size": 50304}).notes()
    assert gpt2_tokens == [
        "the embedding (50,304 ids x 64) holds 97% of the model's parameters and much of its step: for a model this "
        "small, a vocabulary learned from the text (prepare --tokenizer bpe, 8,192 ids) leaves more to the blocks"
    ]
    assert TrainConfig.load("tiny-cpu", {"vocab_size": 8192}).notes() == []  # the quick start's: 84%
    (narrow,) = TrainConfig.load("tiny-cpu", {"vocab_size": 8192, "n_layer": 1}).notes()  # 91%: BPE already
    assert "a smaller vocabulary (prepare --tokenizer bpe --vocab_size N) or more layers leaves more" in narrow
    best = TrainConfig(data_dir="x", final_weights="best", save_every=4, eval_every=6)
    assert best.notes() == [
        "final_weights best ranks only checkpoints saved at evaluated steps: with save_every 4 and eval_every 6, "
        "those of steps 12, 24, ... and the last step's"
    ]
    assert TrainConfig(data_dir="x", keep_best=True, save_every=4, eval_every=2).notes() == []


def test_a_copied_runs_config_names_the_folder_it_writes_to(tmp_path: Path) -> None:
    """A run folder copied elsewhere keeps the original's out_dir in its config.yaml: resumed through it, the run would
    train into the original folder. Said at start; --out_dir fixes it."""
    copied = tmp_path / "copy"
    copied.mkdir()
    (copied / "config.yaml").write_text(f"data_dir: x\nout_dir: {tmp_path / 'original'}\n")
    (copied / "metrics.jsonl").write_text("")
    cfg = TrainConfig.load(str(copied / "config.yaml"), {})
    assert cfg.notes() == [
        f"{copied / 'config.yaml'} is another folder's run config: this run writes to its out_dir "
        f"{tmp_path / 'original'}, not to {copied} (a copied run? pass --out_dir {copied})"
    ]
    assert TrainConfig.load(str(copied / "config.yaml"), {"out_dir": str(copied)}).notes() == []


# ------------------------------------------------------------------------------------------ every number's range

# What each command needs besides the number under test, so that only that number can be wrong.
REQUIRED = {
    "train": {"data_dir": "d"},
    "eval": {"checkpoint": "c", "data_dir": "d"},
    "sample": {"checkpoint": "c"},
    "export": {"checkpoint": "c", "out_dir": "o"},
    "prepare": {},
    "plot": {},
}
NEEDS = {("prepare", "shard_index"): {"num_shards": 100_000}, ("prepare", "num_shards"): {"shard_index": 0}}


def numeric_settings() -> list[tuple[str, str]]:
    """(command, setting) of every int or float setting of every command."""
    found = []
    for command, cls in CONFIGS.items():
        hints = typing.get_type_hints(cls)
        for f in fields(cls):
            hint = hints[f.name]
            types_ = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_args(hint) else [hint]
            if types_ and types_[0] in (int, float):
                found.append((command, f.name))
    return found


def outside(bounds, integer: bool) -> list[float]:
    """Values just outside an interval: an open end itself, else one step past it."""
    step = 1 if integer else max(1e-9, abs(bounds.low) * 1e-9)
    values = [bounds.low if bounds.low_open else bounds.low - step]
    if bounds.high != float("inf"):
        high_step = 1 if integer else max(1e-9, abs(bounds.high) * 1e-9)
        values.append(bounds.high if bounds.high_open else bounds.high + high_step)
    return [int(v) if integer else v for v in values]


@pytest.mark.parametrize(("command", "name"), numeric_settings(), ids=lambda v: v)
def test_every_number_a_command_takes_has_a_range_checked_when_it_is_read(command: str, name: str) -> None:
    """Walks every int and float setting of every command: each has bounds (a new one without fails here), and a
    value just outside them, NaN or infinity is refused in one line naming the setting, from a flag (a string)
    as from YAML (a number); the ends inside are not refused for their range."""
    cls = CONFIGS[command]
    f = next(f for f in fields(cls) if f.name == name)
    bounds = f.metadata.get("bounds")
    assert bounds is not None, f"{command} --{name}: give its option() a bounds= interval"
    integer = typing.get_type_hints(cls)[name] in (int, int | None)
    base = {**REQUIRED[command], **NEEDS.get((command, name), {})}
    for bad in [*outside(bounds, integer), "nan", "inf", "-inf"]:
        for given in (str(bad), bad):
            with pytest.raises(ConfigError) as refused:
                cls(**base, **{name: given})
            message = str(refused.value)
            assert message.startswith(f"{name}=") and "\n" not in message, message
    inside = [bounds.low] if not bounds.low_open else []
    inside += [bounds.high] if bounds.high != float("inf") and not bounds.high_open else []
    for good in inside:
        value = int(good) if integer else good
        try:
            cls(**base, **{name: str(value)})
        except ConfigError as e:
            assert f"must be {bounds.describe()}" not in str(e), str(e)


def test_bounds_read_as_intervals() -> None:
    from accel_gpt.config import Bounds

    assert Bounds.parse("[1, inf)").describe() == ">= 1" and Bounds.parse("(0, inf)").describe() == "> 0"
    assert Bounds.parse("(0, 1]").describe() == "in (0, 1]"
    half_open = Bounds.parse("[0, 1)")
    assert half_open.holds(0.0) and not half_open.holds(1.0) and not Bounds.parse("(0, 1]").holds(0.0)
    with pytest.raises(ValueError, match="is not an interval"):
        Bounds.parse("1..2")
