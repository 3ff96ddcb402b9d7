"""`run.py export --format gguf`: the GPT-2 block as one GGUF file, the format llama.cpp, ollama and LM Studio read.

The file holds what llama.cpp's own `convert_hf_to_gguf.py` writes for OpenAI's gpt2 (architecture `gpt2`, its
tensor names, Conv1D matrices stored as (out, in), the head tied to the embedding) and the run's tokenizer: its
tokens, merges, end-of-text as bos, eos and unknown, no bos added, and the pre-tokenizer type that names llama.cpp's
regex for the split the tokenizer was learned with. A split llama.cpp has no exact regex for is refused: ids that
differ on a few numbers would be a silent failure. The nanochat block has no llama.cpp architecture, nor has a GELU
other than GPT-2's tanh approximation.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from accel_gpt.bpe import EOT, LEGACY_SPLIT_PATTERN, SPLIT_PATTERN
from accel_gpt.errors import UserError
from accel_gpt.model import GPTConfig
from accel_gpt.tokenizer import Tokenizer

GGUF_FILE = "model.gguf"
MODELFILE = "Modelfile"  # ollama's recipe: `ollama create NAME -f Modelfile`

# llama.cpp's pre-tokenizer type for each split: bailingmoe's regex is accel_gpt's split, digit for digit
PRE_TOKENIZERS = {SPLIT_PATTERN: "bailingmoe"}

# llama.cpp rounds every context up to a multiple of this many positions (llama_context: GGML_PAD(n_ctx, 256))
LLAMA_CPP_CONTEXT_STEP = 256

# accel_gpt's tensor names in transformers' GPT2LMHeadModel -> llama.cpp's, per block and for the rest
BLOCK_TENSORS = {
    "ln_1": "attn_norm",
    "attn.c_attn": "attn_qkv",
    "attn.c_proj": "attn_output",
    "ln_2": "ffn_norm",
    "mlp.c_fc": "ffn_up",
    "mlp.c_proj": "ffn_down",
}
OTHER_TENSORS = {"wte": "token_embd", "wpe": "position_embd", "ln_f": "output_norm"}


def check_exportable(model: GPTConfig, tok: Tokenizer, path: str | Path) -> None:
    """One line on why `path` cannot run in llama.cpp, said before the model is converted."""
    if model.arch != "gpt2":
        raise UserError(
            f"{path} has nanochat's block, and llama.cpp has no architecture for it (no norm weights, QK-norm after "
            "rotary, ReLU², soft-capped logits): --format gguf exports the gpt2 block (train with --arch gpt2); this "
            "model exports to transformers (drop --format gguf)"
        )
    if model.gelu != "tanh":
        raise UserError(
            f"{path} uses the exact (erf) GELU, and llama.cpp's gpt2 computes GPT-2's tanh approximation: its logits "
            "would differ; export it to transformers (drop --format gguf), or train with --gelu tanh"
        )
    pattern = tok.split_pattern
    if pattern is not None and pattern not in PRE_TOKENIZERS:
        why = (
            "it splits numbers into runs of up to two digits, as accel_gpt's tokenizers did before this version"
            if pattern == LEGACY_SPLIT_PATTERN
            else "its split pattern is not one llama.cpp implements"
        )
        raise UserError(
            f"{path}'s tokenizer cannot be given to llama.cpp exactly: {why}; llama.cpp would cut some text into "
            "other ids. Export it to transformers (drop --format gguf), or prepare the data again (the tokenizer "
            "learned now splits single digits, as llama.cpp's bailingmoe does) and train on it"
        )


def write_gguf(path: Path, hf_model: Any, tok: Tokenizer, outtype: str, name: str, license: str) -> None:
    """`hf_model` (a GPT2LMHeadModel with the tokenizer's rows only) and `tok` as a GGUF file at `path`."""
    import gguf

    cfg = hf_model.config
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_type("model")
    writer.add_name(name)
    writer.add_license(license)
    writer.add_block_count(cfg.n_layer)
    writer.add_context_length(cfg.n_positions)
    writer.add_embedding_length(cfg.n_embd)
    writer.add_feed_forward_length(cfg.n_inner or 4 * cfg.n_embd)
    writer.add_head_count(cfg.n_head)
    writer.add_layer_norm_eps(cfg.layer_norm_epsilon)
    writer.add_file_type(FILE_TYPES[outtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_tokenizer(writer, tok)
    for tensor_name, array, raw_dtype in tensors(hf_model, outtype):
        writer.add_tensor(tensor_name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# general.file_type: llama.cpp's LlamaFileType for a file of f32, mostly f16 or mostly bf16 tensors
FILE_TYPES = {"f32": 0, "f16": 1, "bf16": 32}


def add_tokenizer(writer: Any, tok: Tokenizer) -> None:
    """llama.cpp's byte-level BPE ("gpt2" model): tokens in id order, each NORMAL but end-of-text (CONTROL), the
    merges in rank order, and end-of-text as bos, eos and unknown, with nothing added around a prompt (training
    saw no bos)."""
    import gguf

    vocab, merges = tok.vocab_and_merges()
    tokens = sorted(vocab, key=vocab.__getitem__)
    if [vocab[t] for t in tokens] != list(range(len(tokens))):
        raise RuntimeError(f"the {tok.name} tokenizer's ids are not 0..{len(tokens) - 1}")
    eot = vocab[EOT]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2" if tok.name == "gpt2" else PRE_TOKENIZERS[tok.split_pattern or ""])
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i == eot else gguf.TokenType.NORMAL for i in range(len(tokens))])
    writer.add_token_merges([f"{left} {right}" for left, right in merges])
    writer.add_bos_token_id(eot)
    writer.add_eos_token_id(eot)
    writer.add_unk_token_id(eot)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)


def tensors(hf_model: Any, outtype: str) -> Iterator[tuple[str, np.ndarray, Any]]:
    """(llama.cpp's name, data, raw GGML type or None) for each tensor: matrices in `outtype`, vectors in f32 (as
    llama.cpp's converter keeps them); the tied head is the embedding, not written twice."""
    import gguf

    for key, value in hf_model.state_dict().items():
        if key == "lm_head.weight":
            continue
        name = llama_cpp_name(key)
        data = value.detach().to(torch.float32)
        if key.endswith(".weight") and any(f".{conv}." in key for conv in ("c_attn", "c_proj", "c_fc")):
            data = data.t()  # transformers' Conv1D keeps (in, out); llama.cpp reads (out, in) as a Linear's
        array = data.contiguous().numpy()
        if array.ndim == 1 or outtype == "f32":
            yield name, array, None
        elif outtype == "f16":
            yield name, array.astype(np.float16), None
        else:
            bf16 = gguf.GGMLQuantizationType.BF16
            yield name, gguf.quants.quantize(array, bf16), bf16


def llama_cpp_name(key: str) -> str:
    """`transformer.h.3.attn.c_attn.weight` -> `blk.3.attn_qkv.weight`, `transformer.wte.weight` ->
    `token_embd.weight`."""
    parts = key.removeprefix("transformer.").split(".")
    if parts[0] == "h":
        return f"blk.{parts[1]}.{BLOCK_TENSORS['.'.join(parts[2:-1])]}.{parts[-1]}"
    return f"{OTHER_TENSORS[parts[0]]}.{parts[-1]}"


def describe_gguf(path: Path) -> tuple[str, int]:
    """What the file says it is, read back with gguf's reader (architecture, weight type, tokenizer), and its
    positions."""
    import gguf

    reader = gguf.GGUFReader(path)

    def value(key: str) -> Any:
        return reader.fields[key].contents()

    arch = value("general.architecture")
    outtype = next(name for name, code in FILE_TYPES.items() if code == value("general.file_type"))
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    positions = int(value(f"{arch}.context_length"))
    what = f"{arch}, {outtype}, {positions} positions, vocab {vocab:,}, pre-tokenizer {value('tokenizer.ggml.pre')}"
    return what, positions


def context_limit(seq_len: int) -> str:
    """What a user must keep to in llama.cpp, which rounds its context up to a multiple of 256: at a position past
    the model's last it aborts the process (GGML_ASSERT in the position embedding's lookup) instead of stopping."""
    if seq_len % LLAMA_CPP_CONTEXT_STEP == 0:
        return (
            f"In llama.cpp the context defaults to the model's {seq_len} positions, and a prompt plus new tokens "
            f"past them is refused (context full); a larger context (-c) would let it run past position {seq_len}, "
            "where llama.cpp aborts"
        )
    padded = -(-seq_len // LLAMA_CPP_CONTEXT_STEP) * LLAMA_CPP_CONTEXT_STEP
    return (
        f"In llama.cpp keep the prompt plus the new tokens (-n) within {seq_len}: it rounds the context up to "
        f"{padded} positions, but the model has {seq_len}, and at position {seq_len} llama.cpp aborts"
    )


def modelfile(seq_len: int) -> str:
    """ollama's Modelfile: the file beside it, the prompt as it is (a base model, no chat template), and stops at
    end-of-text and at the model's positions."""
    return f'FROM ./{GGUF_FILE}\nTEMPLATE "{{{{ .Prompt }}}}"\nPARAMETER num_ctx {seq_len}\nPARAMETER stop "{EOT}"\n'
