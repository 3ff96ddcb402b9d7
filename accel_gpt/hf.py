"""transformers interop: our GPT <-> `GPT2LMHeadModel` (arch gpt2) or `NanoChatForCausalLM` (arch nanochat), either
from a folder or the hub.

GPT-2: both models use GPT-2's parameter names, so converting is a key-for-key copy with one twist: transformers'
GPT-2 keeps its projections in `Conv1D`, whose weight is stored (in, out), while ours are `nn.Linear`,
stored (out, in). Those four weights per block are transposed; everything else is copied as is.

NanoChat: a rename of each weight (`_NANOCHAT_KEYS`: six per block, then the embedding and the untied head); its
norms have no weights. Two settings decide whether the logits are the same: `rms_norm_eps` must be the eps
`F.rms_norm` uses when given none, and the rotary angles must turn the same way (ours follow the class's convention,
so nothing is negated).
"""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from accel_gpt.bpe import TOKENIZER_FILE
from accel_gpt.config import close_paths
from accel_gpt.errors import UserError
from accel_gpt.model import GPT, RMS_EPS, GPTConfig
from accel_gpt.tokenizer import GPT2_EOT, GPT2_VOCAB, Tokenizer

if TYPE_CHECKING:
    from transformers import GenerationConfig, GPT2Config, GPT2LMHeadModel, NanoChatConfig, NanoChatForCausalLM

# Weights that transformers keeps in Conv1D layout (in, out); nn.Linear keeps (out, in).
_CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_WTE = "transformer.wte.weight"
_SAFETENSORS = "model.safetensors"
_PICKLED = "pytorch_model.bin"
_LM_HEAD = "lm_head.weight"  # tied to wte on both sides: copied once, through wte
# GELU with the tanh approximation under its two transformers names, and the exact (erf) one: `gelu` "exact".
_TANH_GELUS = ("gelu_new", "gelu_pytorch_tanh")
_EXACT_GELU = "gelu"

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- weights


def _map_state(src: dict[str, torch.Tensor], keys: list[str]) -> dict[str, torch.Tensor]:
    """`src` under `keys`, Conv1D weights transposed: the same map works in both directions."""
    return {k: src[k].t() if k.endswith(_CONV1D_WEIGHTS) else src[k] for k in keys}


def _fit_vocab(wte: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The first `vocab_size` rows of `wte`; rows it lacks are filled with the mean of the rows it has.

    Padded ids (50,257..50,303 when the vocabulary is padded to a multiple of 64 for fast matmuls) never
    occur in the data, so only their output side matters. The LM head is tied, so a padded row's logit is
    h . mean(w) = the mean of the real logits; by Jensen, exp(mean) <= mean(exp), so the padded rows together
    take at most n_pad/V of the real softmax mass and raise any token's loss by at most log(1 + n_pad/V)
    (< 0.001 nats for 47 rows over 50,257). Zero rows would give logit 0, which is not bounded by the real
    logits at all (GPT-2's sit far below 0) and could take most of the mass. transformers'
    `resize_token_embeddings(mean_resizing=True)` starts new rows from the mean for the same reason.
    Identical rows get identical gradients, which is fine: training only has to push them all down.
    """
    n = wte.shape[0]
    if vocab_size <= n:
        return wte[:vocab_size]
    pad = wte.mean(dim=0, keepdim=True).expand(vocab_size - n, -1)
    return torch.cat([wte, pad], dim=0)


def gpt2_config(cfg: GPTConfig, vocab_size: int | None = None) -> GPT2Config:
    """The transformers config of our architecture: its GELU (tanh or exact), tied head, the model's dropout in all
    three places (ours drops out where GPT-2 does: embeddings, attention weights, residual branches)."""
    from transformers import GPT2Config

    vocab_size = vocab_size or cfg.vocab_size
    eot = GPT2_EOT if vocab_size > GPT2_EOT else None  # GPT-2's <|endoftext|> exists only in a GPT-2 vocabulary
    return GPT2Config(
        vocab_size=vocab_size,
        n_positions=cfg.seq_len,
        n_ctx=cfg.seq_len,  # what llama.cpp's convert_hf_to_gguf.py reads (OpenAI's gpt2 config.json has it)
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_inner=None,  # 4 * n_embd, as in ours
        activation_function=_EXACT_GELU if cfg.gelu == "exact" else "gelu_new",
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout,
        layer_norm_epsilon=cfg.layer_norm_eps,
        bos_token_id=eot,
        eos_token_id=eot,
        tie_word_embeddings=True,
    )


def generation_config(eot: int, positions: int) -> GenerationConfig:
    """The defaults of `generate` and `pipeline` for an export: the end-of-text (GPT-2's, or a trained bpe's) as bos,
    eos and pad (GPT-2 has no pad token), and `max_length` = the model's positions, so that a call with no length
    stays inside them (transformers' pipeline otherwise adds 256 new tokens and indexes past a small model's
    positions: IndexError). A call that passes `max_new_tokens` takes that instead, with transformers' note that it
    takes precedence."""
    from transformers import GenerationConfig

    return GenerationConfig(bos_token_id=eot, eos_token_id=eot, pad_token_id=eot, max_length=positions)


def set_end_of_text(hf_model: Any, eot: int, positions: int) -> None:
    """The tokenizer's end-of-text as the model config's bos and eos (and pad, where the config names one): the
    configs above assume GPT-2's id, which a trained bpe does not have; and the generation defaults that fit."""
    hf_model.config.bos_token_id = hf_model.config.eos_token_id = eot
    if getattr(hf_model.config, "pad_token_id", None) is not None:
        hf_model.config.pad_token_id = eot
    hf_model.generation_config = generation_config(eot, positions)


# An export's config.json keeps, under this key, what `run.py eval` needs to score it as it scores the run it came
# from: {"eval_windows": N}, the size of the run's val set. transformers keeps unknown config keys as attributes and
# writes them back, and nothing in it or in lm-evaluation-harness reads this one.
EVAL_RECORD = "accel_gpt"


def recorded_eval_windows(folder: str | Path) -> int | None:
    """The eval_windows recorded in the config.json of an export of ours; None for any other folder or hub id."""
    try:
        record = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8")).get(EVAL_RECORD)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    windows = record.get("eval_windows") if isinstance(record, dict) else None
    return windows if isinstance(windows, int) and not isinstance(windows, bool) and windows > 0 else None


def to_gpt2(model: GPT, vocab_size: int | None = None) -> GPT2LMHeadModel:
    """A `GPT2LMHeadModel` (CPU, float32, eval mode) with `model`'s weights.

    `vocab_size` smaller than the model's keeps only the first rows: `export` passes 50,257 to drop the
    padded ids, which the tokenizer never produces. Larger pads as `_fit_vocab` explains. transformers' GPT-2
    always has biases: a model trained without them (`bias=False`) gets zero biases, which give the same logits.
    """
    from transformers import GPT2LMHeadModel

    hf_model = GPT2LMHeadModel(gpt2_config(model.config, vocab_size))
    src = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    state = _map_state(src, [k for k in src if k != _LM_HEAD])
    for key, value in hf_model.state_dict().items():
        if key.endswith(".bias") and key not in state and not model.config.bias:
            state[key] = torch.zeros_like(value)
    state[_WTE] = _fit_vocab(state[_WTE], hf_model.config.vocab_size)
    _load_tied(hf_model, state)
    return hf_model.eval()


def from_gpt2(hf_model: GPT2LMHeadModel, vocab_size: int | None = None) -> GPT:
    """Our GPT (CPU, float32, eval mode) with a `GPT2LMHeadModel`'s weights.

    `vocab_size` larger than the checkpoint's pads the embedding (see `_fit_vocab`); smaller would drop
    real tokens and is refused.
    """
    model = GPT(_padded(_gpt2_gpt_config(hf_model.config), vocab_size))
    src = {k: v.detach().to("cpu", torch.float32) for k, v in hf_model.state_dict().items()}
    state = _map_state(src, [k for k in model.state_dict() if k != _LM_HEAD])
    state[_WTE] = _fit_vocab(state[_WTE], model.config.vocab_size)
    _load_tied(model, state)
    return model.eval()


def _load_tied(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load everything but the tied head (it shares wte's storage) and fail loudly on any other gap."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    if set(missing) != {_LM_HEAD} or unexpected:
        raise RuntimeError(f"weight map incomplete: missing {missing}, unexpected {unexpected}")
    if model.lm_head.weight.data_ptr() != model.transformer.wte.weight.data_ptr():
        raise RuntimeError("lm_head is not tied to transformer.wte after loading")


def _gpt2_gpt_config(hf_config: GPT2Config) -> GPTConfig:
    """Our config for a transformers GPT-2 config, refusing the variants our GPT cannot reproduce."""
    checks = {
        "activation_function": (hf_config.activation_function, (*_TANH_GELUS, _EXACT_GELU)),
        "n_inner": (hf_config.n_inner, (None, 4 * hf_config.n_embd)),
        "scale_attn_weights": (hf_config.scale_attn_weights, True),
        "scale_attn_by_inverse_layer_idx": (hf_config.scale_attn_by_inverse_layer_idx, False),
        "add_cross_attention": (getattr(hf_config, "add_cross_attention", False), False),
        "tie_word_embeddings": (getattr(hf_config, "tie_word_embeddings", True), True),
    }
    _refuse_variants("GPT-2", checks)
    return GPTConfig(
        n_layer=hf_config.n_layer,
        n_head=hf_config.n_head,
        n_embd=hf_config.n_embd,
        seq_len=hf_config.n_positions,
        vocab_size=hf_config.vocab_size,
        layer_norm_eps=hf_config.layer_norm_epsilon,
        gelu="exact" if hf_config.activation_function == _EXACT_GELU else "tanh",
    )


def load_transformers(path_or_id: str, vocab_size: int | None = None, tokenizer_ids: int | None = None) -> GPT:
    """Our GPT from a transformers GPT-2 or NanoChat folder or hub id (`gpt2`, `openai-community/gpt2-medium`, an
    export of ours, ...).

    Used by `init_from` (pass the trainer's `vocab_size`, e.g. 50,304, to pad the embedding, and the data tokenizer's
    `tokenizer_ids`: a folder with fewer ids was trained with another tokenizer) and by
    eval/sample on `--checkpoint gpt2`. The hub is reached through `from_pretrained`, so its cache and
    `HF_HUB_OFFLINE` apply. Weights load as float32 whatever the checkpoint stores: this model trains.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        hf_config = AutoConfig.from_pretrained(path_or_id)
        _CONFIGS[_arch(hf_config)](hf_config)  # refuse other architectures and variants before reading weights
        folder_tokenizer(path_or_id)
        if tokenizer_ids is not None and hf_config.vocab_size < tokenizer_ids:
            raise UserError(
                f"'{path_or_id}' has {hf_config.vocab_size:,} token ids, fewer than the data's tokenizer's "
                f"{tokenizer_ids:,}: it was trained with another tokenizer, so its embedding rows would mean other text"
            )
        check_pickled_weights(Path(path_or_id))
        with quiet_transformers():  # its load report would print a table of the gaps refused below in one line
            hf_model, info = AutoModelForCausalLM.from_pretrained(
                path_or_id, config=hf_config, dtype=torch.float32, output_loading_info=True
            )
    except UserError:
        raise
    except Exception as e:  # missing folder/id (OSError), corrupt safetensors, bad config.json (ValueError), ...
        raise UserError(_load_error(path_or_id, e)) from None
    # transformers fills weights its files lack with random ones and only warns: the tied head is the one allowed
    missing = [k for k in info.get("missing_keys", ()) if not (k == "lm_head.weight" and _ties_head(hf_config))]
    if missing or info.get("mismatched_keys"):
        what = f"lacks {', '.join(sorted(missing)[:3])}" if missing else "holds weights of other shapes"
        raise UserError(f"'{path_or_id}': its weights do not fill the model its config.json describes ({what})")
    return from_transformers(hf_model, vocab_size)


def folder_tokenizer(path_or_id: str) -> Tokenizer:
    """The tokenizer of a transformers folder: a byte-level BPE in accel_gpt's layout (an export of a `bpe` run) is
    read as such; otherwise the folder's ids are read as GPT-2's, and one whose tokenizer files hold another
    vocabulary (a NanoChat checkpoint's 32,768 or 65,536 tokens, a Llama-style tokenizer.json) is refused: read as
    GPT-2's it would give meaningless text, a cropped export, or an index error on the first prompt id past its
    embedding. A folder without tokenizer files is taken as GPT-2's (its ids are checked where they are used)."""
    folder = Path(path_or_id)
    if (folder / TOKENIZER_FILE).is_file():
        with contextlib.suppress(UserError):
            return Tokenizer.bpe_file(folder / TOKENIZER_FILE)
    _check_gpt2_tokenizer(path_or_id)
    return Tokenizer("gpt2")


def _check_gpt2_tokenizer(path_or_id: str) -> None:
    folder = Path(path_or_id)
    try:
        if (folder / "tokenizer.json").is_file():
            model = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8")).get("model") or {}
            ids = len(model.get("vocab") or {})
        elif (folder / "vocab.json").is_file():
            ids = len(json.loads((folder / "vocab.json").read_text(encoding="utf-8")))
        else:
            return
    except (OSError, ValueError, TypeError, AttributeError):
        return  # unreadable tokenizer files: transformers' own load says what is wrong with the folder
    if ids != GPT2_VOCAB:
        raise UserError(
            f"'{path_or_id}' has a tokenizer of {ids:,} tokens, not GPT-2's {GPT2_VOCAB:,} nor a byte-level BPE laid "
            "out as accel_gpt's: accel_gpt reads transformers folders with those only, and their ids in another "
            "would mean other text"
        )


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' warnings and its weight-loading progress bar off for a call whose outcome is checked here (the
    bar would come before any error line about the folder)."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _ties_head(hf_config: Any) -> bool:
    return bool(getattr(hf_config, "tie_word_embeddings", False))


def to_transformers(model: GPT, vocab_size: int | None = None) -> GPT2LMHeadModel | NanoChatForCausalLM:
    """The transformers model of `model`'s arch (CPU, float32, eval mode) with its weights; `vocab_size` as
    `to_gpt2` says."""
    return {"gpt2": to_gpt2, "nanochat": to_nanochat}[model.config.arch](model, vocab_size)


def from_transformers(hf_model: torch.nn.Module, vocab_size: int | None = None) -> GPT:
    """Our GPT (CPU, float32, eval mode) with a GPT-2's or NanoChat's weights; `vocab_size` as `from_gpt2` says."""
    return {"gpt2": from_gpt2, "nanochat": from_nanochat}[_arch(hf_model.config)](hf_model, vocab_size)


def _arch(hf_config: object) -> str:
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in ("gpt2", "nanochat"):
        raise UserError(f"expected a GPT-2 or NanoChat model (model_type 'gpt2' or 'nanochat'), got {model_type!r}")
    return model_type


def _padded(cfg: GPTConfig, vocab_size: int | None) -> GPTConfig:
    """`cfg` with the trainer's vocabulary: larger pads (see `_fit_vocab`); smaller would drop real tokens."""
    if vocab_size is not None and vocab_size < cfg.vocab_size:
        raise UserError(
            f"vocab_size={vocab_size} is smaller than the checkpoint's {cfg.vocab_size}: it would drop real tokens; "
            "use a vocab_size >= the checkpoint's"
        )
    return replace(cfg, vocab_size=vocab_size or cfg.vocab_size)


# ---------------------------------------------------------------- NanoChat

# Ours -> NanoChatForCausalLM's, for the parts of block i (the embedding and the head are mapped whole).
_NANOCHAT_KEYS = {
    "attn.c_q.weight": "self_attn.q_proj.weight",
    "attn.c_k.weight": "self_attn.k_proj.weight",
    "attn.c_v.weight": "self_attn.v_proj.weight",
    "attn.c_proj.weight": "self_attn.o_proj.weight",
    "mlp.c_fc.weight": "mlp.fc1.weight",
    "mlp.c_proj.weight": "mlp.fc2.weight",
}
_NANOCHAT_ENDS = {_WTE: "model.embed_tokens.weight", _LM_HEAD: _LM_HEAD}


def nanochat_config(cfg: GPTConfig, vocab_size: int | None = None) -> NanoChatConfig:
    """The transformers config of the nanochat block: parameter-free RMSNorm with torch's default eps, RoPE with our
    base, ReLU² MLP of 4x width, untied head, the soft-cap (None when off), GQA heads, attention dropout."""
    from transformers import NanoChatConfig

    vocab_size = vocab_size or cfg.vocab_size
    eot = GPT2_EOT if vocab_size > GPT2_EOT else None
    return NanoChatConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.n_embd,
        intermediate_size=4 * cfg.n_embd,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.seq_len,
        hidden_act="relu2",
        attention_dropout=cfg.dropout,
        rms_norm_eps=RMS_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        final_logit_softcapping=cfg.logit_softcap or None,
        attention_bias=False,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        tie_word_embeddings=False,
    )


def _nanochat_key_map(n_layer: int) -> dict[str, str]:
    keys = dict(_NANOCHAT_ENDS)
    for i in range(n_layer):
        keys |= {f"transformer.h.{i}.{ours}": f"model.layers.{i}.{theirs}" for ours, theirs in _NANOCHAT_KEYS.items()}
    return keys


def to_nanochat(model: GPT, vocab_size: int | None = None) -> NanoChatForCausalLM:
    """A `NanoChatForCausalLM` (CPU, float32, eval mode) with `model`'s weights; `vocab_size` crops or pads both the
    embedding and the head, as `to_gpt2` does the tied one."""
    from transformers import NanoChatForCausalLM

    hf_model = NanoChatForCausalLM(nanochat_config(model.config, vocab_size))
    src = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    state = {theirs: src[ours] for ours, theirs in _nanochat_key_map(model.config.n_layer).items()}
    for key in _NANOCHAT_ENDS.values():
        state[key] = _fit_vocab(state[key], hf_model.config.vocab_size)
    hf_model.load_state_dict(state, strict=True)
    return hf_model.eval()


def from_nanochat(hf_model: NanoChatForCausalLM, vocab_size: int | None = None) -> GPT:
    """Our GPT (CPU, float32, eval mode) with a `NanoChatForCausalLM`'s weights; `vocab_size` pads as in
    `from_gpt2`."""
    model = GPT(_padded(_nanochat_gpt_config(hf_model.config), vocab_size))
    src = {k: v.detach().to("cpu", torch.float32) for k, v in hf_model.state_dict().items()}
    state = {ours: src[theirs] for ours, theirs in _nanochat_key_map(model.config.n_layer).items()}
    for key in _NANOCHAT_ENDS:
        state[key] = _fit_vocab(state[key], model.config.vocab_size)
    model.load_state_dict(state, strict=True)
    return model.eval()


def _nanochat_gpt_config(hf_config: NanoChatConfig) -> GPTConfig:
    """Our config for a NanoChat config, refusing the variants our block cannot reproduce."""
    rope = hf_config.rope_parameters or {}
    checks = {
        "hidden_act": (hf_config.hidden_act, "relu2"),
        "intermediate_size": (hf_config.intermediate_size, 4 * hf_config.hidden_size),
        "attention_bias": (hf_config.attention_bias, False),
        "tie_word_embeddings": (hf_config.tie_word_embeddings, False),
        "rope_type": (rope.get("rope_type", "default"), "default"),
        "head_dim": (
            getattr(hf_config, "head_dim", None),
            (None, hf_config.hidden_size // hf_config.num_attention_heads),
        ),
    }
    _refuse_variants("NanoChat", checks)
    if abs(hf_config.rms_norm_eps - RMS_EPS) > 1e-12:
        logger.warning(
            f"the NanoChat checkpoint's rms_norm_eps is {hf_config.rms_norm_eps}; accel_gpt's norms use "
            f"{RMS_EPS}, so its logits differ slightly from the checkpoint's own"
        )
    kv = hf_config.num_key_value_heads
    return GPTConfig(
        n_layer=hf_config.num_hidden_layers,
        n_head=hf_config.num_attention_heads,
        n_embd=hf_config.hidden_size,
        seq_len=hf_config.max_position_embeddings,
        vocab_size=hf_config.vocab_size,
        bias=False,
        arch="nanochat",
        n_kv_head=None if kv in (None, hf_config.num_attention_heads) else kv,
        rope_theta=float(rope.get("rope_theta", 10_000.0)),
        logit_softcap=float(hf_config.final_logit_softcapping or 0.0),
    )


_CONFIGS = {"gpt2": _gpt2_gpt_config, "nanochat": _nanochat_gpt_config}


def _refuse_variants(model: str, checks: dict[str, tuple[Any, Any]]) -> None:
    """One line for the first setting (name: (value, allowed value or tuple of them)) our GPT cannot reproduce."""
    for name, (value, allowed) in checks.items():
        if value not in (allowed if isinstance(allowed, tuple) else (allowed,)):
            raise UserError(f"unsupported {model} variant: {name}={value!r}, accel_gpt's GPT needs {allowed!r}")


def check_pickled_weights(folder: Path) -> None:
    """A local folder whose weights are pickles (`pytorch_model.bin` or its shards, no safetensors) is checked before
    transformers reads it: a pickle can name any code to run. transformers loads with `weights_only=True` and so
    refuses too, but its message invites a retry with `weights_only=False`; this says what was refused and why.
    Only the files transformers would load are checked (a `training_args.bin` beside them is never unpickled)."""
    if not folder.is_dir() or any(folder.glob("*.safetensors")) or (folder / f"{_SAFETENSORS}.index.json").is_file():
        return  # transformers prefers safetensors and never opens the pickles then
    index = folder / f"{_PICKLED}.index.json"
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else [_PICKLED]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return  # a broken index: transformers reports it in its own words
    for name in names:
        if (folder / name).is_file():
            _check_pickle(folder / name)


def _check_pickle(path: Path) -> None:
    """Unpickle with `weights_only=True`: tensors and plain values load, anything that names code is refused."""
    try:
        torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        named = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line), lines[0] if lines else "")
        raise UserError(
            f"{path} holds something other than tensors ({named}): refused as unsafe, since unpickling it could run "
            "arbitrary code"
        ) from None
    except Exception:  # noqa: BLE001 - a truncated or foreign file: transformers reports it in its own words
        return


def _load_error(path_or_id: str, e: Exception) -> str:
    """One line for a failed load: a mistyped local path is said to be one before the hub's view of it."""
    reason = _first_line(e)
    if "weights_only" in str(e):  # torch refused a pickle from the hub that holds more than tensors
        reason = "its weights file holds something other than tensors: refused as unsafe (unpickling could run code)"
    elif "ignore_mismatched_sizes" in str(e):  # its "report above" is one `quiet_transformers` keeps quiet
        reason = "its weights have other shapes than its config.json describes"
    elif _offline() and "connect" in reason:  # transformers' "couldn't connect" where nothing was tried
        reason = "not in the local cache, and offline mode (HF_HUB_OFFLINE) keeps the hub from being asked"
    elif reason.endswith(":"):  # a validation error whose reason follows on the next lines
        reason = " ".join(line.strip() for line in str(e).splitlines() if line.strip())[:300]
    if Path(path_or_id).expanduser().exists():
        return f"cannot load transformers model '{path_or_id}': {reason}"
    return f"'{path_or_id}' is not a local folder (no such path{_close_paths(path_or_id)}), and as a hub id: {reason}"


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _close_paths(path: str) -> str:
    """'; did you mean runs/tiny-cpu?' for a near miss among the entries of the path's (existing) parent."""
    close = close_paths(path)
    return f"; did you mean {' or '.join(close)}?" if close else ""


def _first_line(e: Exception) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__
