"""The GPT itself, on a tiny CPU model: output shapes, the loss at init, the tied head, FLOPs per token,
and activation checkpointing (which must change memory, never the numbers)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from accel_gpt.model import GPT, GPTConfig

VOCAB = 96
CFG = GPTConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16, vocab_size=VOCAB)


def tiny_model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG)


def batch(seed: int = 1, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (size, CFG.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def test_logits_shape_and_loss_only_with_targets() -> None:
    model = tiny_model()
    x, y = batch()
    logits, loss = model(x)
    assert logits.shape == (4, CFG.seq_len, VOCAB) and loss is None
    logits, loss = model(x[:, :5], y[:, :5])  # shorter than the context is fine
    assert logits.shape == (4, 5, VOCAB) and loss.shape == ()
    no_logits, same_loss = model(x[:, :5], y[:, :5], return_logits=False)  # what training asks for
    assert no_logits is None and torch.equal(same_loss, loss)
    with pytest.raises(ValueError, match="exceeds the model's seq_len=16"):
        model(torch.zeros(1, CFG.seq_len + 1, dtype=torch.long))


def test_loss_at_init_is_about_uniform() -> None:
    """GPT-2's N(0, 0.02) init gives near-zero logits, so the first loss is about ln(vocab): a much higher
    first loss means a broken init (e.g. unscaled residual projections) that training then has to undo."""
    x, y = batch(size=8)
    with torch.no_grad():
        _, loss = tiny_model().eval()(x, y)
    assert loss.item() == pytest.approx(math.log(VOCAB), abs=0.05)


def test_lm_head_is_tied_to_the_token_embedding() -> None:
    """One tensor, not two equal copies: an update to either is an update to both, and it is counted once."""
    model = tiny_model()
    assert model.lm_head.weight is model.transformer.wte.weight
    names = [name for name, _ in model.named_parameters()]
    assert "transformer.wte.weight" in names and "lm_head.weight" not in names  # parameters() dedups shared ones
    with torch.no_grad():
        model.transformer.wte.weight[3].fill_(0.5)
    assert torch.all(model.lm_head.weight[3] == 0.5)


def hand_param_count(cfg: GPTConfig) -> tuple[int, int]:
    """(parameters without position embeddings, position embeddings), from the config by hand."""
    C, V, L, T = cfg.n_embd, cfg.vocab_size, cfg.n_layer, cfg.seq_len
    layer_norm = 2 * C  # weight + bias
    attention = (C * 3 * C + 3 * C) + (C * C + C)  # c_attn, c_proj
    mlp = (C * 4 * C + 4 * C) + (4 * C * C + C)  # c_fc, c_proj
    block = layer_norm + attention + layer_norm + mlp
    token_embedding = V * C  # also the LM head (tied)
    return token_embedding + L * block + layer_norm, T * C


def test_parameter_count_by_hand() -> None:
    model = tiny_model()
    non_embedding, wpe = hand_param_count(CFG)
    assert non_embedding == 96 * 32 + 2 * 12_704 + 64  # the same sum with the numbers put in
    assert model.num_params() == non_embedding
    assert model.num_params(non_embedding=False) == non_embedding + wpe


@pytest.mark.parametrize(
    "cfg", [CFG, GPTConfig(n_layer=3, n_head=4, n_embd=48, seq_len=24, vocab_size=130)], ids=["tiny", "other"]
)
def test_flops_per_token_by_hand(cfg: GPTConfig) -> None:
    """6 FLOPs per parameter per token (forward 2, backward 4) over the non-position-embedding parameters,
    plus attention's 12 * layers * heads * head_dim * seq_len (PaLM's count); MFU is computed from this."""
    non_embedding, _ = hand_param_count(cfg)
    head_dim = cfg.n_embd // cfg.n_head
    expected = 6 * non_embedding + 12 * cfg.n_layer * cfg.n_head * head_dim * cfg.seq_len
    torch.manual_seed(0)
    assert GPT(cfg).flops_per_token() == expected
    if cfg == CFG:
        assert expected == 6 * 28_544 + 12 * 2 * 2 * 16 * 16  # written out for the tiny config: 183,552


def test_activation_checkpointing_gives_the_same_loss_and_gradients() -> None:
    """Recomputing each block in backward is a memory trade only: same loss, same gradients (fp32)."""
    plain = tiny_model().train()
    checkpointed = copy.deepcopy(plain)
    checkpointed.activation_checkpointing = True
    assert checkpointed.lm_head.weight is checkpointed.transformer.wte.weight  # the copy is still tied
    x, y = batch()
    losses = []
    for model in (plain, checkpointed):
        _, loss = model(x, y, return_logits=False)
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=1e-6)
    grads = {name: p.grad for name, p in plain.named_parameters()}
    other = dict(checkpointed.named_parameters())
    assert grads.keys() == other.keys()
    for name, grad in grads.items():
        assert grad is not None and grad.abs().sum() > 0, name
        torch.testing.assert_close(other[name].grad, grad, rtol=0, atol=1e-6, msg=name)


def test_activation_checkpointing_really_recomputes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flag is not inert: in train mode each block runs twice per step (forward, then again in backward),
    in eval mode once (no backward to save memory for). Counted on `forward` itself: the recompute does not
    go through module hooks."""
    model = tiny_model()
    model.activation_checkpointing = True
    calls = []
    for block in model.transformer.h:

        def counted(*args, _forward=block.forward, **kwargs):
            calls.append(1)
            return _forward(*args, **kwargs)

        monkeypatch.setattr(block, "forward", counted)
    x, y = batch()
    _, loss = model.train()(x, y)
    loss.backward()
    assert len(calls) == 2 * CFG.n_layer
    calls.clear()
    with torch.no_grad():
        model.eval()(x)
    assert len(calls) == CFG.n_layer


def loss_and_grads(model: GPT, x: torch.Tensor, y: torch.Tensor, bf16: bool) -> tuple[torch.Tensor, dict]:
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        _, loss = model(x, y, return_logits=False)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])  # one row, uneven, even, more than all 64 rows
def test_chunked_loss_equals_the_full_logits_path_in_fp32(chunk: int) -> None:
    """The chunked LM head + cross-entropy is a memory trade only: the same loss and gradients."""
    model = tiny_model().train()
    x, y = batch()
    loss, grads = loss_and_grads(model, x, y, bf16=False)
    model.loss_chunk = chunk
    chunked_loss, chunked_grads = loss_and_grads(model, x, y, bf16=False)
    torch.testing.assert_close(chunked_loss, loss, rtol=0, atol=1e-6)
    for name, grad in grads.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_chunked_loss_under_bf16_autocast_is_within_bf16_rounding() -> None:
    """Under autocast both paths multiply in bf16 and reduce in fp32, so they differ only by bf16 rounding."""
    model = tiny_model().train()
    x, y = batch()
    loss, grads = loss_and_grads(model, x, y, bf16=True)
    model.loss_chunk = 10
    chunked_loss, chunked_grads = loss_and_grads(model, x, y, bf16=True)
    assert chunked_loss.dtype == torch.float32
    torch.testing.assert_close(chunked_loss, loss, rtol=1e-3, atol=1e-3)
    for name, grad in grads.items():
        scale = grad.abs().max().item()
        assert (chunked_grads[name] - grad).abs().max().item() <= 2e-2 * scale, name


def test_chunked_loss_is_used_only_for_training() -> None:
    """Evaluation and generation ask for logits: they take the plain path whatever loss_chunk is."""
    model = tiny_model().eval()
    model.loss_chunk = 8
    x, y = batch()
    logits, loss = model(x, y)
    assert logits.shape == (4, CFG.seq_len, VOCAB) and loss is not None


class AttentionInputs(TorchDispatchMode):
    """The dtype of the query each attention kernel (forward and backward) is handed, below autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: list[torch.dtype] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        if "scaled_dot_product" in func.overloadpacket.__name__:
            self.dtypes.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("arch", ["gpt2", "nanochat"])
@pytest.mark.parametrize(("seq_len", "kernel_dtype"), [(16, torch.float32), (288, torch.bfloat16)])
def test_a_cpu_under_bf16_attends_in_fp32_up_to_256_positions(
    arch: str, seq_len: int, kernel_dtype: torch.dtype
) -> None:
    """torch's bf16 flash-attention backward on a CPU is 3-4x its fp32 one at nanoGPT's recipe's 64 positions: there
    the kernel gets fp32 inputs (forward and backward), longer sequences keep bf16; the block's output stays bf16."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, seq_len=seq_len, vocab_size=VOCAB, arch=arch)).train()
    x = torch.randint(0, VOCAB, (2, seq_len))
    seen = AttentionInputs()
    with seen, torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(x, x, return_logits=False)
        y = model.transformer.h[0].attn(torch.randn(2, seq_len, 32), model.rope(0, seq_len))
    with seen:
        loss.backward()
    assert len(seen.dtypes) >= 3 and set(seen.dtypes) == {kernel_dtype}  # forward twice, backward once
    assert y.dtype == torch.bfloat16
