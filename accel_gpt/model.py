"""The GPT in plain PyTorch, with either of two block families, chosen once at construction (`arch`):

- `gpt2`: GPT-2's block. Learned positions, pre-LayerNorm, causal attention, GELU-tanh MLP, a head tied to the
  token embedding; optionally no biases, dropout where GPT-2 puts it, and the exact (erf) GELU (nanoGPT's options).
- `nanochat`: the modern block that nanochat trains and transformers' `NanoChatForCausalLM` computes. A
  parameter-free RMSNorm after the embedding and before each branch; rotary positions, then RMSNorm of q and k per
  head; ReLU² MLP; no biases; output projections that start at zero; an untied head whose logits are soft-capped.

`Block` is one class for both (FSDP wraps it by name); its norms, attention and MLP come from the family's table,
`FAMILIES`. Module names follow GPT-2's checkpoint (`wte`, `wpe`, `h`, `ln_f`, `c_attn`, `c_proj`, `c_fc`) and
nanochat's (`c_q`, `c_k`, `c_v`), so that `hf.py` is a plain key map. This file knows nothing about Accelerate,
devices or ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

Arch = str  # "gpt2" | "nanochat"
ARCHS = ("gpt2", "nanochat")
GELUS = ("tanh", "exact")  # GPT-2's MLP: torch's `approximate="tanh"` (transformers' gelu_new) | "none" (erf)


@dataclass
class GPTConfig:
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    seq_len: int = 1024
    vocab_size: int = 50_304
    layer_norm_eps: float = 1e-5
    bias: bool = True  # GPT-2's; False drops every Linear and LayerNorm bias (nanochat has none)
    dropout: float = 0.0  # training only: model.eval() turns it off
    arch: Arch = "gpt2"
    # nanochat's own settings (None under gpt2, whose block has none of them)
    n_kv_head: int | None = None  # key/value heads (grouped-query attention); None = n_head
    rope_theta: float | None = None  # the rotary base (nanochat: 10,000 when None)
    logit_softcap: float | None = None  # logits become c*tanh(logits/c); None or 0 = off
    # gpt2's own: the MLP's GELU, "tanh" (GPT-2's gelu_new, the default) or "exact" (erf, nanoGPT's); nanochat: None
    gelu: str | None = None

    def __post_init__(self) -> None:
        if self.arch not in ARCHS:
            raise ValueError(f"arch={self.arch!r} is not one of {', '.join(ARCHS)}")
        self._check_shape()
        if self.arch == "nanochat":  # no biases in this block; the rotary base its own default; ReLU², no GELU
            self.bias, self.gelu = False, None
            self.rope_theta = 10_000.0 if self.rope_theta is None else self.rope_theta
            if self.n_kv_head == self.n_head:  # one key/value head per query head: the model without the setting
                self.n_kv_head = None
        elif self.gelu is None:
            self.gelu = "tanh"
        elif self.gelu not in GELUS:
            raise ValueError(f"gelu={self.gelu!r} is not one of {', '.join(GELUS)}")

    def _check_shape(self) -> None:
        """Sizes and rates a model can be built with: a config read from a file (model_config.json) may hold anything,
        and a wrong type or value would fail later as a traceback deep in torch."""
        for name in ("n_layer", "n_head", "n_embd", "seq_len", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
        kv = self.n_kv_head
        if kv is not None and (not isinstance(kv, int) or isinstance(kv, bool) or kv < 1 or self.n_head % kv):
            raise ValueError(f"n_kv_head={kv!r} must be a positive integer dividing n_head={self.n_head}")
        ranges = {"dropout": "[0, 1)", "layer_norm_eps": "(0, 1)", "rope_theta": "> 0", "logit_softcap": ">= 0"}
        holds = {"[0, 1)": lambda v: 0 <= v < 1, "(0, 1)": lambda v: 0 < v < 1, "> 0": lambda v: v > 0}
        holds[">= 0"] = lambda v: v >= 0
        for name, wanted in ranges.items():
            value = getattr(self, name)
            if value is None and name in ("rope_theta", "logit_softcap"):  # unset: the block's own
                continue
            number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
            if not number or not holds[wanted](value):
                raise ValueError(f"{name}={value!r} must be a number {wanted}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    def to_dict(self) -> dict:
        return asdict(self)


class KVCache:
    """Keys and values of the tokens a sequence has seen, so that generation feeds the model only the new token:
    each step then costs O(T) instead of a full forward pass over the window.

    One (B, n_head, seq_len, head_dim) buffer pair per layer, allocated on the first write in the dtype the
    attention produced (bf16 under autocast). `length` tokens are cached; the next token takes that position.
    A plain class on purpose: FSDP's mixed-precision input casting rebuilds dataclasses passed to forward, and
    the layers would then write into a copy.
    """

    def __init__(self, n_layer: int, seq_len: int) -> None:
        self.seq_len = seq_len
        self.length = 0
        self._layers: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * n_layer

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store `layer`'s keys/values (B, n_head, T, head_dim) after the cached ones; return all of them."""
        if self._layers[layer] is None:
            shape = (k.size(0), k.size(1), self.seq_len, k.size(3))
            self._layers[layer] = (k.new_empty(shape), v.new_empty(shape))
        keys, values = self._layers[layer]
        end = self.length + k.size(2)
        keys[:, :, self.length : end] = k
        values[:, :, self.length : end] = v
        return keys[:, :, :end], values[:, :, :end]


# ---------------------------------------------------------------------------------------------------- GPT-2


class CausalSelfAttention(nn.Module):
    """GPT-2's attention: one c_attn for q, k and v; positions come from the embedding, not from here."""

    def __init__(self, cfg: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.layer_idx = layer_idx  # where this layer's keys/values live in a KVCache
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.residual_scale = True  # scaled at init: it adds into the residual stream
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, rope: Rope | None, cache: KVCache | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = attend(q, k, v, cache, self.layer_idx, self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, n_head, T, head_dim) -> (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.residual_scale = True
        self.dropout = nn.Dropout(cfg.dropout)
        self.approximate = "none" if cfg.gelu == "exact" else "tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate)))


def layer_norm(cfg: GPTConfig) -> nn.Module:
    return nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps, bias=cfg.bias)


# -------------------------------------------------------------------------------------------------- nanochat

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each (T, head_dim / 2): the rotation of positions start..


def norm(x: torch.Tensor) -> torch.Tensor:
    """RMSNorm without a gain over the last dimension. No eps given: torch uses finfo(float32).eps, which is the
    `rms_norm_eps` an export must write for transformers to give the same logits. On a CPU, torch differentiates
    `rms_norm` op by op (pow, mean, rsqrt, mul and their backwards): `_CpuRMSNorm` gives the same values with a
    backward of three passes, about 3% of nanochat's forward + backward there (bench/RESULTS.md). Elsewhere, and
    where nothing is differentiated (evaluation, sampling: twice as fast as the Function), torch's own op."""
    if x.device.type == "cpu" and x.requires_grad and torch.is_grad_enabled():
        return _CpuRMSNorm.apply(x)
    return F.rms_norm(x, (x.size(-1),))


# What `F.rms_norm` uses when given no eps, whatever the input's dtype: an export's `rms_norm_eps` must be this.
RMS_EPS = torch.finfo(torch.float32).eps


class _CpuRMSNorm(torch.autograd.Function):
    """y = x / sqrt(mean(x^2) + eps) in fp32 (as `F.rms_norm` computes it, bit for bit); dx = r (g - y mean(g y))."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + RMS_EPS)
        y = xf * rstd
        ctx.save_for_backward(y, rstd)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        y, rstd = ctx.saved_tensors
        g = grad.float()
        return (rstd * (g - y * (g * y).mean(-1, keepdim=True))).to(grad.dtype)


class RMSNorm(nn.Module):
    """`norm` as a module, where the block takes a norm layer; it has no parameters."""

    def __init__(self, cfg: GPTConfig | None = None) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return norm(x)


def rotary_tables(cfg: GPTConfig) -> Rope:
    """cos and sin of every position's angles, (seq_len, head_dim / 2), in fp32: built once, sliced per call."""
    half = cfg.head_dim // 2
    inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, half, dtype=torch.float32) / half)
    angles = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (x1[i], x2[i]) pair of the two halves of each head, x (B, T, H, head_dim), by its position's
    angle, in the direction `NanoChatForCausalLM` uses (Llama's rotate_half turns the other way)."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)  # (1, T, 1, head_dim / 2)
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)


class RotaryAttention(nn.Module):
    """nanochat's attention: q, k, v projections (k and v may have fewer heads), rotary positions, then QK-norm."""

    def __init__(self, cfg: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.layer_idx = layer_idx
        self.dropout = cfg.dropout
        self.c_q = nn.Linear(cfg.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(cfg.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(cfg.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.c_proj.zero_init = True
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, rope: Rope, cache: KVCache | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        q, k = norm(apply_rotary(q, *rope)), norm(apply_rotary(k, *rope))  # RoPE first, then QK-norm
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, heads, T, head_dim)
        y = attend(q, k, v, cache, self.layer_idx, self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class ReluSquaredMLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)
        self.c_proj.zero_init = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.relu(self.c_fc(x)).square()))


# ------------------------------------------------------------------------------------------------ both


# On a CPU, torch's bf16 flash-attention kernel is slow on short sequences, its backward most: forward + backward of
# 12 x 4 heads x 64 x 32 (nanoGPT's CPU recipe) took 7.4 ms in bf16 against 2.0 in fp32 (the inputs cast), and at
# 256 positions 64.1 against 53.7 ms, on an AVX512-BF16 EPYC (one thread); from 1,024 on bf16 was the faster (413
# against 482 ms). So up to this many positions a CPU computes attention in fp32 under bf16. Measured by
# bench/attention_precision.py, to be run again on each CPU class (bench/RESULTS.md).
CPU_FP32_ATTENTION_MAX_T = 256


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache | None, layer: int, dropout: float
) -> torch.Tensor:
    """Causal attention of q (B, n_head, T, head_dim) over k, v (B, kv_heads, T, head_dim), after any cached ones."""
    start = 0
    if cache is not None:
        start = cache.length
        k, v = cache.extend(layer, k, v)
    gqa = {"enable_gqa": True} if k.size(1) != q.size(1) else {}  # k/v heads shared by groups of q heads
    if start == 0:  # flash/memory-efficient kernel on GPU; dropout on the attention weights, inside the kernel
        if q.device.type == "cpu" and q.size(2) <= CPU_FP32_ATTENTION_MAX_T and _bf16_on_cpu(q):
            with torch.autocast("cpu", enabled=False):  # autocast would cast the inputs back to bf16
                q, k, v = q.float(), k.float(), v.float()
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, **gqa)
            return y.to(torch.bfloat16)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, **gqa)
    T = q.size(2)  # the new tokens attend to all cached ones and, causally, to each other
    mask = None if T == 1 else torch.ones(T, start + T, dtype=torch.bool, device=q.device).tril(start)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **gqa)


def _bf16_on_cpu(x: torch.Tensor) -> bool:
    """x is bf16, or becomes bf16 in the next matmul: CPU autocast to bf16 is on."""
    autocast = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    return x.dtype == torch.bfloat16 or autocast


@dataclass(frozen=True)
class Family:
    """What a block family puts where: the norm layers, the attention and the MLP, and the model's ends."""

    norm: Callable[[GPTConfig], nn.Module]
    attention: type[nn.Module]
    mlp: type[nn.Module]
    learned_positions: bool  # a position table added to the embedding (else rotary positions in attention)
    embedding_norm: bool  # the embedding is normalised before the first block
    tied_head: bool  # the LM head is the token embedding


FAMILIES = {
    "gpt2": Family(layer_norm, CausalSelfAttention, MLP, learned_positions=True, embedding_norm=False, tied_head=True),
    "nanochat": Family(
        RMSNorm, RotaryAttention, ReluSquaredMLP, learned_positions=False, embedding_norm=True, tied_head=False
    ),
}
# nanochat's initialisation: std of the token embedding and of the untied head (the block's input matrices take
# 1/sqrt(n_embd), its output projections 0). bench/char_recipe.py's sweep chose them; bench/RESULTS.md has it.
EMBEDDING_STD = 1.0
HEAD_STD = 0.001


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        family = FAMILIES[cfg.arch]
        self.ln_1 = family.norm(cfg)
        self.attn = family.attention(cfg, layer_idx)
        self.ln_2 = family.norm(cfg)
        self.mlp = family.mlp(cfg)

    def forward(self, x: torch.Tensor, rope: Rope | None, cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), rope, cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.family = family = FAMILIES[cfg.arch]
        self.activation_checkpointing = False
        self.loss_chunk = 0  # > 0: training loss through chunked_lm_loss, this many rows of logits at a time
        # The tokenizer's ids: the rows of the head past them (vocab_size pads GPT-2's 50,257 to 50,304 for fast
        # matmuls) are left out of the logits, so that no loss, probability or sample counts ids no text has, and
        # a run scores as its export (which drops those rows) does. Who knows the tokenizer sets it.
        self.vocab_in_use = cfg.vocab_size
        layers = {"wte": nn.Embedding(cfg.vocab_size, cfg.n_embd)}
        if family.learned_positions:
            layers["wpe"] = nn.Embedding(cfg.seq_len, cfg.n_embd)
        layers |= {"drop": nn.Dropout(cfg.dropout), "h": nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))}
        self.transformer = nn.ModuleDict(layers | {"ln_f": family.norm(cfg)})
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if family.tied_head:
            self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2
        if not family.learned_positions:  # non-persistent: rebuilt from the config, never saved; moved by `to()`
            cos, sin = rotary_tables(cfg)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2: N(0, 0.02), residual projections scaled by 1/sqrt(2*n_layer), two per block. nanochat: its
        matrices N(0, 1/sqrt(n_embd)), output projections 0, the embedding and the head their own std."""
        gpt2 = self.config.arch == "gpt2"
        if isinstance(module, nn.Linear):
            std = 0.02 if gpt2 else module.in_features**-0.5
            if getattr(module, "residual_scale", False):
                std /= math.sqrt(2 * self.config.n_layer)
            if module is self.lm_head and not gpt2:
                std = HEAD_STD
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if getattr(module, "zero_init", False):
                nn.init.zeros_(module.weight)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02 if gpt2 else EMBEDDING_STD)

    def rope(self, start: int, T: int) -> Rope | None:
        """The rotation of positions start..start+T (nanochat); None where positions are learned (GPT-2)."""
        if self.family.learned_positions:
            return None
        return self.rope_cos[start : start + T], self.rope_sin[start : start + T]

    def embed(self, idx: torch.Tensor, start: int) -> torch.Tensor:
        """Token embedding, plus GPT-2's position embedding; nanochat normalises it."""
        x = self.transformer.wte(idx)  # (B, T, C)
        if self.family.learned_positions:
            x = x + self.transformer.wpe(torch.arange(start, start + idx.size(1), device=idx.device))
        if self.family.embedding_norm:
            x = norm(x)
        return self.transformer.drop(x)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        return_logits: bool = True,
        cache: KVCache | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """idx (B, T) token ids -> logits (B, T, vocab_in_use), and the mean cross-entropy if targets given.

        Training passes `return_logits=False`: under bf16, Accelerate casts every returned tensor to fp32, which
        for (B, T, 50,304) logits is a large copy kept alive through backward. Generation passes a `cache`:
        `idx` then continues the cached tokens (positions start at `cache.length`) and is added to the cache.
        """
        B, T = idx.shape
        start = 0 if cache is None else cache.length
        if start + T > self.config.seq_len:
            raise ValueError(f"sequence length {start + T} exceeds the model's seq_len={self.config.seq_len}")
        x, rope = self.embed(idx, start), self.rope(start, T)
        for block in self.transformer.h:
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, rope, use_reentrant=False)
            else:
                x = block(x, rope, cache)
        if cache is not None:
            cache.length += T
        h = self.transformer.ln_f(x)
        cap, head = self.config.logit_softcap, self.lm_head.weight[: self.vocab_in_use]  # a view: no copy
        if targets is not None and not return_logits and self.loss_chunk:
            return None, chunked_lm_loss(h.view(B * T, -1), head, targets.reshape(-1), self.loss_chunk, cap or 0.0)
        logits = self.lm_head(h)  # (B, T, vocab_size): the padded width keeps the matmul's shapes aligned
        logits = logits[..., : self.vocab_in_use]  # a view; the fp32 copy below is made once, of these columns
        if cap:  # in fp32: tanh's slope near +-cap needs more than bf16's 8 bits
            logits = cap * torch.tanh(logits.float() / cap)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))
        return (logits if return_logits else None), loss

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters, without those that are looked up rather than multiplied by default: the position table,
        and the token embedding where the head is not tied to it (a tied one still does the head's work)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            lookups = [self.transformer.wpe] if self.family.learned_positions else []
            if not self.family.tied_head:
                lookups.append(self.transformer.wte)
            n -= sum(m.weight.numel() for m in lookups)
        return n

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6N for the multiplied weights (the head included, lookups not) plus
        12*L*H*Q*T for attention (PaLM, appendix B)."""
        cfg = self.config
        return 6 * self.num_params() + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * cfg.seq_len


def chunked_lm_loss(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, softcap: float = 0.0
) -> torch.Tensor:
    """Mean cross-entropy of the LM head `h @ weight.T` (h: (N, C), weight: (V, C)) against `targets` (N,),
    computed `chunk` rows at a time, so the (N, V) logits and their fp32 copy never exist whole. `softcap` > 0
    caps the logits as the model does, c*tanh(x/c).

    For GPT-2's 50,304-row head the full logits of one 64 x 1,024 micro-batch are 6.6 GB in bf16 plus 13 GB
    in fp32 for the loss; here at most one chunk of them is alive. The gradients of `h` and `weight` are
    computed in the forward pass, while each chunk's logits are at hand, so backward does no matmul.
    """
    return _ChunkedLMLoss.apply(h, weight, targets, chunk, softcap)


class _ChunkedLMLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int, softcap: float
    ) -> torch.Tensor:
        N = h.size(0)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, N, chunk):
            hc, tc = h[start : start + chunk], targets[start : start + chunk]
            raw = hc @ weight.t()  # (n, V), in the dtype autocast picks for lm_head (bf16), else the weights'
            logits = raw.float()
            if softcap:
                tanh = torch.tanh(logits / softcap)
                logits = tanh * softcap
            lse = torch.logsumexp(logits, dim=-1)
            loss += (lse - logits.gather(1, tc[:, None]).squeeze(1)).sum()
            grad = logits.sub_(lse[:, None]).exp_()  # d(loss)/d(logits) = softmax - one_hot, over N rows
            grad[torch.arange(tc.numel(), device=tc.device), tc] -= 1.0
            grad = grad.div_(N)
            if softcap:  # through the cap: d(c*tanh(x/c))/dx = 1 - tanh^2
                grad = grad.mul_(1.0 - tanh.square())
            grad = grad.to(raw.dtype)
            grad_h[start : start + chunk] = grad @ weight
            grad_w += (grad.t() @ hc).float()
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        return loss / N

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out, grad_w * grad_out, None, None, None
