"""llama.cpp against transformers on one run: its GGUF exports (f32, f16, bf16) run in llama.cpp itself
(llama-cpp-python) and its transformers export, on a text: the ids of its first 6,000 characters, the logits of
their first 64 positions (as llama.cpp comes, and with its two f16 roundings taken out: `compare`), and 32 greedy
ids after the first 16.

    python bench/gguf_check.py --checkpoint runs/code-256 --text held_out.py

Exports go to a scratch folder under runs/bench/; llama.cpp runs with one thread and the context of the
comparison (256 positions, at most the model's own).
"""

# ruff: noqa: E402 (the repo root goes on sys.path before accel_gpt is imported)
from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.benchlib import REPO, RUNS, child_env, header

CHARS, POSITIONS, PROMPT, GREEDY = 6000, 64, 16, 32


@dataclass
class Compared:
    """What llama.cpp and transformers gave on one text."""

    ours: list[int]  # transformers' ids (the export's tokenizer: accel_gpt's)
    theirs: list[int]  # llama.cpp's
    logit_diff: float  # the largest |difference| over the first POSITIONS positions, llama.cpp as it comes
    exact_diff: float  # the same with llama.cpp's two f16 roundings (see `compare`) taken out of the comparison
    hf_greedy: list[int]
    llama_greedy: list[int]

    def row(self, name: str) -> str:
        return (
            f"| {name} | {self.theirs == self.ours} ({len(self.ours):,}) | {self.logit_diff:.2g} | "
            f"{self.exact_diff:.2g} | {self.llama_greedy == self.hf_greedy} |"
        )


def compare(hf_folder: Path, gguf_file: Path, text: str) -> Compared:
    """llama.cpp on `gguf_file` against transformers on `hf_folder`, with `text`'s first CHARS characters.

    llama.cpp as it comes rounds twice to f16 where transformers does not: its key/value cache is f16, and its CPU
    GELU looks the f16-rounded input up in an f16 table. `exact_diff` takes both out (an f32 cache, and transformers'
    GELU rounded as that table is), so what is left is the file's own difference from the export: its weights, graph
    and settings."""
    import torch
    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_folder)
    hf = AutoModelForCausalLM.from_pretrained(hf_folder).eval()
    sample = text[:CHARS]
    ours = tok(sample)["input_ids"]
    ids = ours[:POSITIONS]
    with torch.no_grad():
        hf_logits = hf(torch.tensor([ids])).logits[0].numpy()
        out = hf.generate(torch.tensor([ids[:PROMPT]]), max_new_tokens=GREEDY, do_sample=False, eos_token_id=None)
        for block in hf.transformer.h:
            block.mlp.act = ggml_gelu(block.mlp.act)
        hf_ggml_logits = hf(torch.tensor([ids])).logits[0].numpy()
    llm = Llama(model_path=str(gguf_file), n_ctx=256, logits_all=True, verbose=False, n_threads=1)
    try:
        theirs = llm.tokenize(sample.encode(), add_bos=False, special=False)
        llm.eval(ids)
        diff = float(np.abs(np.array(llm.scores[:POSITIONS]) - hf_logits).max())
        llm.reset()
        llama_greedy: list[int] = []
        for token in llm.generate(ids[:PROMPT], temp=0.0, top_k=1):
            llama_greedy.append(token)
            if len(llama_greedy) == GREEDY:
                break
    finally:
        llm.close()
    f32_cache = {"type_k": 0, "type_v": 0}  # GGML_TYPE_F32
    llm = Llama(model_path=str(gguf_file), n_ctx=256, logits_all=True, verbose=False, n_threads=1, **f32_cache)
    try:
        llm.eval(ids)
        exact = float(np.abs(np.array(llm.scores[:POSITIONS]) - hf_ggml_logits).max())
    finally:
        llm.close()
    return Compared(ours, theirs, diff, exact, out[0, PROMPT:].tolist(), llama_greedy)


def ggml_gelu(gelu: Any) -> Any:
    """`gelu` rounded as ggml's CPU GELU is: the input to f16, the table's value in f16; the identity from 10 up and
    0 from -10 down."""
    import torch

    class GgmlGelu(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = gelu(x.half().float()).half().float()
            return torch.where(x <= -10, torch.zeros_like(x), torch.where(x >= 10, x, y))

    return GgmlGelu()


def export(checkpoint: str, out: Path, *flags: str) -> None:
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "run.py", "export", "--checkpoint", checkpoint, "--out_dir", str(out), *flags]
    subprocess.run(cmd, cwd=REPO, env=child_env(threads=1), check=True, stdout=subprocess.DEVNULL)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a run dir or checkpoint of the gpt2 block")
    parser.add_argument("--text", type=Path, required=True, help="held-out text (its first 6,000 characters)")
    args = parser.parse_args()
    print(header("bench/gguf_check.py"))
    text = args.text.read_text(encoding="utf-8")[:CHARS]
    print(f"text: {args.text} ({len(re.findall(r'[0-9]{2,}', text))} numbers of two or more digits)")
    work = RUNS / "gguf_check"
    export(args.checkpoint, work / "hf")
    print(
        "| GGUF | ids equal (tokens) | max logit difference | without llama.cpp's f16 cache and GELU | greedy equal |"
        "\n| --- | --- | --- | --- | --- |"
    )
    for outtype in ("f32", "f16", "bf16"):
        export(args.checkpoint, work / outtype, "--format", "gguf", "--outtype", outtype)
        print(compare(work / "hf", work / outtype / "model.gguf", text).row(outtype), flush=True)


if __name__ == "__main__":
    main()
