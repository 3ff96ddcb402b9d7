"""Config: defaults, preset YAML, flag overrides, validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from accel_gpt.config import PRESETS_DIR, TrainConfig, load_config, parse_flags
from accel_gpt.errors import ConfigError


def test_yaml_then_flags(tmp_path: Path) -> None:
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("data_dir: d\nn_layer: 3\nlearning_rate: 1.0e-3\ncompile: true\n")
    cfg = load_config(str(yaml_file), parse_flags(["--n_layer", "5", "--compile=false", "--resume", "auto"]))
    assert (cfg.n_layer, cfg.learning_rate, cfg.compile, cfg.resume) == (5, 1e-3, False, "auto")
    assert cfg.n_head == TrainConfig.n_head  # untouched default


@pytest.mark.parametrize("preset", sorted(p.stem for p in PRESETS_DIR.glob("*.yaml")))
def test_every_preset_loads(preset: str) -> None:
    cfg = load_config(preset)
    assert cfg.data_dir


def test_gpt2_124m_recipe() -> None:
    cfg = load_config("gpt2-124m")
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.seq_len, cfg.vocab_size) == (12, 12, 768, 1024, 50_304)
    assert (cfg.total_batch_size, cfg.max_steps, cfg.warmup_steps) == (524_288, 19_073, 715)
    assert (cfg.learning_rate, cfg.min_lr_ratio, cfg.weight_decay, cfg.grad_clip) == (6e-4, 0.1, 0.1, 1.0)
    assert cfg.grad_accum_steps(8) == 1 and cfg.grad_accum_steps(1) == 8


def test_unknown_key_lists_close_matches() -> None:
    with pytest.raises(ConfigError, match="unknown config key 'learnin_rate'.*did you mean learning_rate"):
        load_config(None, {"data_dir": "d", "learnin_rate": "1"})


def test_types_are_checked() -> None:
    with pytest.raises(ConfigError, match="n_layer='two' must be an integer"):
        load_config(None, {"data_dir": "d", "n_layer": "two"})
    with pytest.raises(ConfigError, match="compile='yes' must be true or false"):
        load_config(None, {"data_dir": "d", "compile": "yes"})
    with pytest.raises(ConfigError, match="compile_mode='fast' is not one of default, reduce-overhead"):
        load_config(None, {"data_dir": "d", "compile_mode": "fast"})


def test_accumulation_is_derived_from_world_size() -> None:
    cfg = TrainConfig(data_dir="d", total_batch_size=3 * 16 * 64, micro_batch_size=16, seq_len=64)
    assert cfg.grad_accum_steps(1) == 3 and cfg.grad_accum_steps(3) == 1
    with pytest.raises(ConfigError, match="world_size=2"):
        cfg.grad_accum_steps(2)


def test_flags_need_values() -> None:
    with pytest.raises(ConfigError, match="--n_layer needs a value"):
        parse_flags(["--n_layer"])
