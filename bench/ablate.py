"""accel_gpt's CLI with parts of the nanochat block taken out: the ablation of `bench/char_recipe.py`.

    python bench/ablate.py --without rotary,qk_norm -- train --config shakespeare-char-cpu --arch nanochat ...

The product's `nanochat` block is exactly what `NanoChatForCausalLM` computes, so its fixed parts are not flags;
this wrapper replaces them in the model module before the trainer builds the model, and changes nothing else (the
trainer, optimizer, data and schedule are the product's). Parts:

- rotary: learned positions (a position table added to the embedding) instead of rotating q and k;
- relu2: GELU-tanh instead of ReLU²;
- qk_norm: q and k are not normalised;
- untied: the head is the token embedding (one matrix, initialised and trained as the head: `head_lr`);
- zero_init: the output projections start at N(0, 1/sqrt(fan_in)) instead of 0.

The soft-cap is a setting already: `--logit_softcap 0`. The rotary base, the init stds and the AdamW rates are
settings too (or, for the stds, `--embedding_std` / `--head_std` here), which the sweep varies.
"""

# ruff: noqa: E402 (the repo root goes on sys.path before accel_gpt is imported)
from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch.nn.functional as F
from torch import nn

from accel_gpt import model, optim

PARTS = ("rotary", "relu2", "qk_norm", "untied", "zero_init")


def without_rotary() -> None:
    family = model.FAMILIES["nanochat"]
    model.FAMILIES["nanochat"] = dataclasses.replace(family, learned_positions=True)
    model.GPT.rope = lambda self, start, T: (None, None)
    model.apply_rotary = lambda x, cos, sin: x


def without_relu2() -> None:
    def gelu_mlp(self: nn.Module, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))

    model.ReluSquaredMLP.forward = gelu_mlp


def without_qk_norm() -> None:
    norm = model.norm
    model.norm = lambda x: x if x.dim() == 4 else norm(x)  # q and k are (B, T, heads, head_dim); the rest 3-D


def without_untied() -> None:
    family = model.FAMILIES["nanochat"]
    model.FAMILIES["nanochat"] = dataclasses.replace(family, tied_head=True)

    def one_group(net: nn.Module, cfg) -> tuple[list[dict], set[int]]:
        shared = net.transformer.wte.weight
        return [{"params": [shared], "lr": cfg.head_lr, "weight_decay": 0.0, "role": "head"}], {id(shared)}

    optim.own_rate_groups = one_group


def without_zero_init() -> None:
    init = model.GPT._init_weights

    def normal_init(self: model.GPT, module: nn.Module) -> None:
        init(self, module)
        if isinstance(module, nn.Linear) and getattr(module, "zero_init", False):
            nn.init.normal_(module.weight, mean=0.0, std=module.in_features**-0.5)

    model.GPT._init_weights = normal_init


def apply(without: str, embedding_std: float | None = None, head_std: float | None = None) -> None:
    """Take the comma-separated parts `without` out of this process's model module, and set the init stds given.
    The trainer's process and the process that loads its checkpoints must both call it (the shapes may differ)."""
    for part in filter(None, without.split(",")):
        if part not in PARTS:
            raise SystemExit(f"--without {part}: not one of {', '.join(PARTS)}")
        globals()[f"without_{part}"]()
    if embedding_std is not None:
        model.EMBEDDING_STD = embedding_std
    if head_std is not None:
        model.HEAD_STD = head_std


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--without", default="", help=f"comma-separated parts: {', '.join(PARTS)}")
    parser.add_argument("--embedding_std", type=float, help="the token embedding's init std (default: the product's)")
    parser.add_argument("--head_std", type=float, help="the untied head's init std (default: the product's)")
    args, rest = parser.parse_known_args()
    apply(args.without, args.embedding_std, args.head_std)
    from accel_gpt.cli import main as cli_main

    cli_main(rest[1:] if rest[:1] == ["--"] else rest)


if __name__ == "__main__":
    main()
