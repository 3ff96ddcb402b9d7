"""GPT-2 in plain PyTorch: pre-LayerNorm blocks, causal SDPA attention, GELU-tanh MLP, tied embeddings.

Optional, as in nanoGPT: no biases (`bias=False`: Linear and LayerNorm layers without them) and dropout where
GPT-2 puts it (after the embeddings, on the attention weights, on each residual branch), active in training only.

Module names follow GPT-2's checkpoint (`wte`, `wpe`, `h`, `ln_f`, `c_attn`, `c_proj`, `c_fc`) so that
`hf.py` is a plain key map. This file knows nothing about Accelerate, devices or ranks.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    seq_len: int = 1024
    vocab_size: int = 50_304
    layer_norm_eps: float = 1e-5
    bias: bool = True  # GPT-2's; False drops every Linear and LayerNorm bias
    dropout: float = 0.0  # training only: model.eval() turns it off

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


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.layer_idx = layer_idx  # where this layer's keys/values live in a KVCache
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.residual_scale = True  # scaled at init: it adds into the residual stream
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        start = 0
        if cache is not None:
            start = cache.length
            k, v = cache.extend(self.layer_idx, k, v)
        if start == 0:  # flash/memory-efficient kernel on GPU; dropout on the attention weights, inside the kernel
            dropout = self.dropout if self.training else 0.0
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        else:  # the new tokens attend to all cached ones and, causally, to each other
            mask = None if T == 1 else torch.ones(T, start + T, dtype=torch.bool, device=x.device).tril(start)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, n_head, T, head_dim) -> (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.c_proj.residual_scale = True
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg, layer_idx)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.activation_checkpointing = False
        self.loss_chunk = 0  # > 0: training loss through chunked_lm_loss, this many rows of logits at a time
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.seq_len, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer)),
                ln_f=nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tied, as in GPT-2
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        """GPT-2 init: N(0, 0.02); residual projections scaled by 1/sqrt(2*n_layer), two per block."""
        if isinstance(module, nn.Linear):
            std = 0.02
            if getattr(module, "residual_scale", False):
                std /= math.sqrt(2 * self.config.n_layer)
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        return_logits: bool = True,
        cache: KVCache | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """idx (B, T) token ids -> logits (B, T, vocab_size), and the mean cross-entropy if targets given.

        Training passes `return_logits=False`: under bf16, Accelerate casts every returned tensor to fp32, which
        for (B, T, 50,304) logits is a large copy kept alive through backward. Generation passes a `cache`:
        `idx` then continues the cached tokens (positions start at `cache.length`) and is added to the cache.
        """
        B, T = idx.shape
        start = 0 if cache is None else cache.length
        if start + T > self.config.seq_len:
            raise ValueError(f"sequence length {start + T} exceeds the model's seq_len={self.config.seq_len}")
        pos = torch.arange(start, start + T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            if self.activation_checkpointing and self.training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x, cache)
        if cache is not None:
            cache.length += T
        h = self.transformer.ln_f(x)
        if targets is not None and not return_logits and self.loss_chunk:
            return None, chunked_lm_loss(h.view(B * T, -1), self.lm_head.weight, targets.reshape(-1), self.loss_chunk)
        logits = self.lm_head(h)  # (B, T, vocab_size)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))
        return (logits if return_logits else None), loss

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters; without position embeddings by default (the tied wte still does lm_head's work)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6N for the weights plus 12*L*H*Q*T for attention (PaLM, appendix B)."""
        cfg = self.config
        head_dim = cfg.n_embd // cfg.n_head
        return 6 * self.num_params() + 12 * cfg.n_layer * cfg.n_head * head_dim * cfg.seq_len


def chunked_lm_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """Mean cross-entropy of the LM head `h @ weight.T` (h: (N, C), weight: (V, C)) against `targets` (N,),
    computed `chunk` rows at a time, so the (N, V) logits and their fp32 copy never exist whole.

    For GPT-2's 50,304-row head the full logits of one 64 x 1,024 micro-batch are 6.6 GB in bf16 plus 13 GB
    in fp32 for the loss; here at most one chunk of them is alive. The gradients of `h` and `weight` are
    computed in the forward pass, while each chunk's logits are at hand, so backward does no matmul.
    """
    return _ChunkedLMLoss.apply(h, weight, targets, chunk)


class _ChunkedLMLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        N = h.size(0)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        for start in range(0, N, chunk):
            hc, tc = h[start : start + chunk], targets[start : start + chunk]
            raw = hc @ weight.t()  # (n, V), in the dtype autocast picks for lm_head (bf16), else the weights'
            logits = raw.float()
            lse = torch.logsumexp(logits, dim=-1)
            loss += (lse - logits.gather(1, tc[:, None]).squeeze(1)).sum()
            grad = logits.sub_(lse[:, None]).exp_()  # d(loss)/d(logits) = softmax - one_hot, over N rows
            grad[torch.arange(tc.numel(), device=tc.device), tc] -= 1.0
            grad = grad.div_(N).to(raw.dtype)
            grad_h[start : start + chunk] = grad @ weight
            grad_w += (grad.t() @ hc).float()
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        return loss / N

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_out, grad_w * grad_out, None, None
