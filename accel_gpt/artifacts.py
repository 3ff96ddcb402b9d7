"""Model files that outlive a run: `model.safetensors` + `model_config.json`, and loading them back.

`model_config.json` holds the GPT shape and the tokenizer, so `eval`, `sample` and `export` need
nothing else:

    {"model": {"n_layer": .., "n_head": .., "n_embd": .., "seq_len": .., "vocab_size": .., ...},
     "tokenizer": {"name": "gpt2"} | {"name": "char", "chars": "..."},
     "step": 123}

The same pair sits in the run directory (final weights) and in every checkpoint folder, so any of
them can be pointed at with `--checkpoint`. A transformers GPT-2 folder or hub id is accepted too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from accel_gpt.errors import UserError
from accel_gpt.model import GPT, GPTConfig
from accel_gpt.tokenizer import CharTokenizer, GPT2Tokenizer, Tokenizer

WEIGHTS = "model.safetensors"
MODEL_CONFIG = "model_config.json"


def tokenizer_meta(manifest: dict[str, Any]) -> dict[str, Any]:
    """The part of a shard manifest that decoding needs."""
    if manifest["tokenizer"] == "char":
        return {"name": "char", "chars": manifest["chars"]}
    return {"name": manifest["tokenizer"]}


def tokenizer_from_meta(meta: dict[str, Any]) -> Tokenizer:
    return CharTokenizer(meta["chars"]) if meta["name"] == "char" else GPT2Tokenizer()


def save_model(model: GPT, out_dir: Path, tokenizer: dict[str, Any], step: int) -> None:
    """Weights and the config needed to rebuild them."""
    meta = {"model": model.config.to_dict(), "tokenizer": tokenizer}
    save_state_dict(model.state_dict(), meta, Path(out_dir), step)


def save_state_dict(state_dict: dict[str, torch.Tensor], meta: dict[str, Any], out_dir: Path, step: int) -> None:
    """`model.safetensors` (without lm_head.weight, the tied copy of wte) + `model_config.json`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {
        k.removeprefix("_orig_mod.").removeprefix("module."): v.detach().cpu().contiguous()
        for k, v in state_dict.items()
    }
    state.pop("lm_head.weight", None)
    save_file(state, str(out_dir / WEIGHTS))
    (out_dir / WEIGHTS).chmod(0o666 & ~_umask())  # safetensors creates the file 0600
    (out_dir / MODEL_CONFIG).write_text(json.dumps({**meta, "step": step}, indent=2))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def load_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[GPT, Tokenizer, dict[str, Any]]:
    """A run dir, a checkpoint dir, or a transformers GPT-2 folder / hub id -> (model in eval mode, tokenizer, meta)."""
    p = Path(path)
    if (p / MODEL_CONFIG).is_file():
        meta = json.loads((p / MODEL_CONFIG).read_text())
        model = GPT(GPTConfig(**meta["model"]))
        weights = p / WEIGHTS
        if not weights.is_file():
            raise UserError(f"{p} has {MODEL_CONFIG} but no {WEIGHTS}")
        try:
            state = load_file(str(weights))
        except Exception as e:  # safetensors raises its own error types for corrupt headers/data
            raise UserError(f"{weights} is not a readable safetensors file: {e}") from None
        state = {k.removeprefix("_orig_mod.").removeprefix("module."): v for k, v in state.items()}
        state.pop("lm_head.weight", None)
        missing, unexpected = model.load_state_dict(state, strict=False)
        if set(missing) - {"lm_head.weight"} or unexpected:
            raise UserError(f"{weights} does not match its {MODEL_CONFIG}: missing {missing}, unexpected {unexpected}")
        tokenizer = tokenizer_from_meta(meta["tokenizer"])
    elif (p / "config.json").is_file() or not p.exists():
        from accel_gpt.hf import load_transformers_gpt2

        model = load_transformers_gpt2(str(path))
        meta = {"model": model.config.to_dict(), "tokenizer": {"name": "gpt2"}, "step": None}
        tokenizer = GPT2Tokenizer()
    else:
        raise UserError(
            f"'{path}' is not a run dir or checkpoint ({MODEL_CONFIG} + {WEIGHTS}) nor a transformers GPT-2 folder"
        )
    return model.to(device).eval(), tokenizer, meta
