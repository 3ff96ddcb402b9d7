"""The nanochat block (`arch: nanochat`) in-process: what it computes, against transformers' NanoChatForCausalLM and
by hand; its settings and their refusals; its optimizer groups and Muon's momentum warm-up; then one real run,
exported (transformers, lm-evaluation-harness, `run.py sample`). Its other real-process runs (invariance, resume,
spike guard, FSDP, evaluation) sit beside the GPT-2 block's in the other test files."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import SHAKESPEARE, python_cmd, run_cmd
from transformers import AutoModelForCausalLM, AutoTokenizer, NanoChatForCausalLM

from accel_gpt import hf
from accel_gpt import model as M
from accel_gpt.checkpoint import check_resume_config
from accel_gpt.config import NANOCHAT_DEFAULTS, TrainConfig
from accel_gpt.errors import ConfigError
from accel_gpt.generate import generate
from accel_gpt.model import GPT, GPTConfig, KVCache, apply_rotary, rotary_tables
from accel_gpt.optim import make_optimizer, make_scheduler, muon_momentum
from accel_gpt.weights import load_model

VOCAB = 96
CFG = GPTConfig(
    n_layer=2, n_head=4, n_embd=32, seq_len=16, vocab_size=VOCAB, bias=False, arch="nanochat", rope_theta=500.0,
    logit_softcap=4.0,
)  # fmt: skip
GQA = GPTConfig(**{**CFG.to_dict(), "n_kv_head": 2})


def randomized(cfg: GPTConfig = CFG, seed: int = 0) -> GPT:
    """Noise on every weight: the output projections start at zero, which would hide a missed key or a wrong sign."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def tokens(size: int = 3, length: int = CFG.seq_len, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (size, length), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------ the block


def test_the_block_has_no_biases_no_norm_weights_no_position_table_and_an_untied_head() -> None:
    model = GPT(CFG)
    names = [name for name, _ in model.named_parameters()]
    assert not [n for n in names if n.endswith(".bias") or "ln_" in n or "wpe" in n]
    assert model.lm_head.weight is not model.transformer.wte.weight and "lm_head.weight" in names
    block = {n.removeprefix("transformer.h.0.") for n in names if n.startswith("transformer.h.0.")}
    assert block == {f"attn.c_{m}.weight" for m in ("q", "k", "v", "proj")} | {"mlp.c_fc.weight", "mlp.c_proj.weight"}
    assert not any("rope" in key for key in model.state_dict()), "the rotary tables are rebuilt, never saved"


def test_initialisation_zero_output_projections_and_the_loss_at_init_is_about_uniform() -> None:
    """Output projections start at 0, so each block starts as the identity; the head's tiny std gives near-zero
    logits, so the first loss is about ln(vocab)."""
    torch.manual_seed(0)
    model = GPT(CFG)
    for block in model.transformer.h:
        assert not block.attn.c_proj.weight.any() and not block.mlp.c_proj.weight.any()
        assert block.attn.c_q.weight.std().item() == pytest.approx(CFG.n_embd**-0.5, rel=0.15)
    x = tokens(8)
    with torch.no_grad():
        _, loss = model.eval()(x, x.roll(1, dims=1))
    assert loss.item() == pytest.approx(math.log(VOCAB), abs=0.02)


def hand_param_count(cfg: GPTConfig) -> tuple[int, int]:
    """(multiplied parameters: the blocks and the head; the token embedding, which is looked up)."""
    C, V, L, kv = cfg.n_embd, cfg.vocab_size, cfg.n_layer, cfg.kv_heads * cfg.head_dim
    attention = C * C + 2 * C * kv + C * C  # c_q, c_k, c_v, c_proj
    mlp = 2 * 4 * C * C
    return L * (attention + mlp) + V * C, V * C


@pytest.mark.parametrize("cfg", [CFG, GQA], ids=["mha", "gqa"])
def test_parameter_count_and_flops_per_token_by_hand(cfg: GPTConfig) -> None:
    """MFU's count: 6 FLOPs per multiplied parameter per token (the untied head included, the embedding lookup not,
    and no position table) plus attention's 12 * layers * heads * head_dim * seq_len."""
    multiplied, embedding = hand_param_count(cfg)
    model = GPT(cfg)
    assert model.num_params() == multiplied and model.num_params(non_embedding=False) == multiplied + embedding
    assert model.flops_per_token() == 6 * multiplied + 12 * cfg.n_layer * cfg.n_head * cfg.head_dim * cfg.seq_len
    if cfg is CFG:
        assert multiplied == 2 * (2 * 32 * 32 + 2 * 32 * 32 + 8 * 32 * 32) + 96 * 32  # 27,648


def test_forward_by_hand() -> None:
    """One block written out from the equations: norm(embedding), then x + attn(norm(x)) with RoPE then QK-norm and
    causal softmax(q k^T / sqrt(head_dim)), x + fc2(relu(fc1(norm(x)))^2), then the capped head."""
    model = randomized(GPTConfig(**{**CFG.to_dict(), "n_layer": 1}))
    x = tokens(2)
    B, T, H, D = 2, CFG.seq_len, CFG.n_head, CFG.head_dim
    w = {k: v for k, v in model.state_dict().items()}
    rms = lambda t: t / t.pow(2).mean(-1, keepdim=True).add(torch.finfo(torch.float32).eps).sqrt()  # noqa: E731
    h = rms(w["transformer.wte.weight"][x])
    a = rms(h)
    angles = torch.arange(T)[:, None] / 500.0 ** (torch.arange(D // 2) / (D // 2))
    cos, sin = angles.cos()[None, :, None], angles.sin()[None, :, None]

    def rotate(t: torch.Tensor) -> torch.Tensor:
        t1, t2 = t[..., : D // 2], t[..., D // 2 :]
        return torch.cat([t1 * cos + t2 * sin, t2 * cos - t1 * sin], dim=-1)

    q, k, v = (a @ w[f"transformer.h.0.attn.c_{n}.weight"].T for n in ("q", "k", "v"))
    q, k = (rms(rotate(t.view(B, T, H, D))).transpose(1, 2) for t in (q, k))
    v = v.view(B, T, H, D).transpose(1, 2)
    scores = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(torch.ones(T, T).triu(1).bool(), -math.inf)
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, T, -1)
    h = h + y @ w["transformer.h.0.attn.c_proj.weight"].T
    m = F.relu(rms(h) @ w["transformer.h.0.mlp.c_fc.weight"].T).square()
    h = h + m @ w["transformer.h.0.mlp.c_proj.weight"].T
    logits = 4.0 * torch.tanh((rms(h) @ w["lm_head.weight"].T) / 4.0)
    with torch.no_grad():
        torch.testing.assert_close(model(x)[0], logits, atol=2e-5, rtol=1e-5)


def test_rotary_tables_are_built_once_and_rotate_by_the_position() -> None:
    """A rotation: norms are kept, and q.k depends only on the distance between the two positions."""
    cos, sin = rotary_tables(CFG)
    assert cos.shape == (CFG.seq_len, CFG.head_dim // 2) and cos.dtype == torch.float32
    model = GPT(CFG)
    assert model.rope(3, 5)[0].data_ptr() == model.rope_cos[3:8].data_ptr(), "a view of the one table"
    q, k = torch.randn(1, 1, 1, CFG.head_dim), torch.randn(1, 1, 1, CFG.head_dim)

    def at(t: torch.Tensor, pos: int) -> torch.Tensor:
        return apply_rotary(t, cos[pos : pos + 1], sin[pos : pos + 1])

    torch.testing.assert_close(at(q, 7).norm(), q.norm())
    torch.testing.assert_close((at(q, 9) * at(k, 4)).sum(), (at(q, 5) * at(k, 0)).sum(), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ transformers


@pytest.mark.parametrize(
    "cfg", [CFG, GQA, GPTConfig(**{**CFG.to_dict(), "logit_softcap": 0.0})], ids=["mha", "gqa", "nocap"]
)
def test_logits_equal_nanochat_for_causal_lm_both_ways(cfg: GPTConfig) -> None:
    model = randomized(cfg)
    theirs = hf.to_transformers(model)
    assert isinstance(theirs, NanoChatForCausalLM) and theirs.config.rms_norm_eps == torch.finfo(torch.float32).eps
    assert theirs.config.num_key_value_heads == cfg.kv_heads
    assert theirs.config.final_logit_softcapping == (cfg.logit_softcap or None)
    x = tokens()
    with torch.no_grad():
        ours = model(x)[0]
        assert (theirs(x).logits - ours).abs().max().item() <= 1e-5
        back = hf.from_transformers(theirs)
        assert back.config == model.config and torch.equal(back(x)[0], ours)
        eager = hf.to_transformers(model)
        eager.config._attn_implementation = "eager"  # transformers' other attention path: the same to round-off
        assert (eager(x).logits - ours).abs().max().item() <= 1e-5


def test_the_rotation_direction_and_the_norm_eps_decide_the_export() -> None:
    """The two facts the export rests on, shown to matter: with the rotation turned the other way, or transformers'
    default eps, the logits are no longer equal."""
    model = randomized()
    x = tokens()
    with torch.no_grad():
        ours = model(x)[0]
        other_eps = hf.to_transformers(model)
        for layer in other_eps.model.layers:
            layer.self_attn.q_norm.eps = layer.self_attn.k_norm.eps = 1e-6
        assert (other_eps(x).logits - ours).abs().max().item() > 1e-6
        flipped = copy.deepcopy(model)
        flipped.rope_sin.neg_()  # Llama's direction
        assert (hf.to_transformers(model)(x).logits - flipped(x)[0]).abs().max().item() > 1e-2


def test_a_nanochat_variant_the_block_cannot_compute_is_refused() -> None:
    theirs = hf.to_transformers(randomized())
    theirs.config.hidden_act = "silu"
    with pytest.raises(Exception, match="unsupported NanoChat variant: hidden_act='silu'"):
        hf.from_transformers(theirs)


# ------------------------------------------------------------------------------------------ generation


def test_cached_positions_rotate_as_in_a_full_forward_and_greedy_text_matches() -> None:
    """With the KV cache each new token is fed alone at position `cache.length`: its logits equal a full forward's at
    that position, so greedy text is the same with and without the cache (GQA too: the cache holds the k/v heads)."""
    for cfg in (CFG, GQA):
        model = randomized(cfg)
        x = tokens(2, 12)
        with torch.no_grad():
            full = model(x)[0]
            cache = KVCache(cfg.n_layer, cfg.seq_len)
            prefix = model(x[:, :5], cache=cache)[0]
            steps = [model(x[:, t : t + 1], cache=cache)[0] for t in range(5, 12)]
        assert cache._layers[0][0].shape[1] == cfg.kv_heads
        torch.testing.assert_close(torch.cat([prefix, *steps], dim=1), full, atol=1e-5, rtol=1e-5)
        prompt = tokens(2, 3, seed=5)
        cached = generate(model, cfg, prompt, 20, temperature=0)  # past the window: the cache starts over
        plain = generate(model, cfg, prompt, 20, temperature=0, use_cache=False)
        assert torch.equal(cached, plain)


# ------------------------------------------------------------------------------------------ training paths


def test_whole_model_compiles_to_one_graph_without_breaks() -> None:
    model = GPT(CFG).train()
    x = tokens()
    explanation = torch._dynamo.explain(model)(x, x.roll(1, dims=1), return_logits=False)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons


@pytest.mark.parametrize("chunk", [5, 1000])
def test_chunked_loss_with_the_soft_cap_equals_the_full_logits_path(chunk: int) -> None:
    model = randomized().train()
    x = tokens()
    results = []
    for loss_chunk in (0, chunk):
        model.zero_grad(set_to_none=True)
        model.loss_chunk = loss_chunk
        _, loss = model(x, x.roll(1, dims=1), return_logits=False)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (loss, grads), (chunked_loss, chunked_grads) = results
    torch.testing.assert_close(chunked_loss, loss, rtol=0, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    plain = randomized().train()
    checkpointed = copy.deepcopy(plain)
    checkpointed.activation_checkpointing = True
    x = tokens()
    for model in (plain, checkpointed):
        model(x, x.roll(1, dims=1), return_logits=False)[1].backward()
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-6, msg=name)


# ------------------------------------------------------------------------------------------ settings


def nanochat_cfg(**overrides: object) -> TrainConfig:
    settings = {"data_dir": "x", "arch": "nanochat", "n_layer": 2, "n_head": 4, "n_embd": 32, "seq_len": 16}
    return TrainConfig(**(settings | overrides))


def test_unset_settings_take_the_blocks_defaults() -> None:
    cfg = nanochat_cfg()
    assert {name: getattr(cfg, name) for name in NANOCHAT_DEFAULTS} == NANOCHAT_DEFAULTS
    assert cfg.bias is False and cfg.n_kv_head is None and cfg.gelu is None
    gpt2 = TrainConfig(data_dir="x")
    assert gpt2.gelu == "tanh"  # GPT-2's, as before the setting existed
    assert (gpt2.bias, gpt2.rope_theta, gpt2.logit_softcap, gpt2.muon_momentum_warmup) == (True, None, None, 0)
    assert gpt2.muon_ns_steps == 5  # torch's, as before the setting existed
    with pytest.raises(ConfigError, match="muon_ns_steps=0 must be in \\[1, 99\\]"):
        TrainConfig(data_dir="x", muon_ns_steps=0)
    model = GPT(GPTConfig(**cfg.model_settings()))
    assert model.config.rope_theta == NANOCHAT_DEFAULTS["rope_theta"] and model.config.arch == "nanochat"
    assert GPT(GPTConfig(**gpt2.model_settings())).config == GPTConfig(n_layer=12)  # GPT-2's block, as ever
    erf = TrainConfig(data_dir="x", gelu="exact", n_layer=1, n_head=2, n_embd=16, seq_len=8, vocab_size=32)
    assert GPT(GPTConfig(**erf.model_settings())).transformer.h[0].mlp.approximate == "none"


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"arch": "gpt2", "rope_theta": 1e4}, "rope_theta=10000.0 is a setting of arch nanochat; GPT-2's block has "
         "learned positions, not rotary ones: drop --rope_theta or set --arch nanochat"),
        ({"arch": "gpt2", "head_lr": 0.01}, "head_lr=0.01 is a setting of arch nanochat; GPT-2's block has a head "),
        ({"arch": "gpt2", "n_kv_head": 2}, "n_kv_head=2 is a setting of arch nanochat"),
        ({"bias": True}, "bias=true: nanochat's block has no biases; drop --bias or set --arch gpt2"),
        ({"gelu": "exact"}, "gelu=exact: nanochat's MLP is ReLU², not GELU; drop --gelu or set --arch gpt2"),
        ({"n_kv_head": 0}, "n_kv_head=0 must be in \\[1, 1024\\]"),
        ({"n_kv_head": 3}, "n_kv_head=3 must divide n_head=4"),
        ({"n_head": 32, "n_kv_head": 1}, "n_embd/n_head=1: rotary positions turn pairs of dimensions"),
        ({"rope_theta": 0.5}, "rope_theta=0.5 must be > 1"),
        ({"embedding_lr": -1}, "embedding_lr=-1.0 must be in \\(0, 1e6\\]"),
        ({"head_lr": 0}, "head_lr=0.0 must be in \\(0, 1e6\\]"),
        ({"logit_softcap": -1}, "logit_softcap=-1.0 must be >= 0"),
        ({"muon_momentum_warmup": -1}, "muon_momentum_warmup=-1 must be in \\[0, 1e12\\]"),
        ({"muon_momentum_start": 1.0}, r"muon_momentum_start=1.0 must be in \[0, 1\)"),
        ({"muon_ns_steps": 0}, "muon_ns_steps=0 must be in \\[1, 99\\]"),
        ({"arch": "llama"}, "arch='llama' is not one of gpt2, nanochat"),
    ],
)  # fmt: skip
def test_bad_settings_are_refused_in_one_line(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        nanochat_cfg(**overrides)
    assert "\n" not in str(e.value)


def test_every_adamw_group_has_its_rate_and_the_schedule_scales_them_all() -> None:
    """AdamW alone: the block matrices at learning_rate with weight decay, the embedding and the head at their own
    rates without; Muon: the block matrices, AdamW the embedding and the head. Every parameter in one group."""
    model = GPT(GPTConfig(**nanochat_cfg().model_settings()))
    cfg = nanochat_cfg(learning_rate=1e-3, embedding_lr=0.2, head_lr=0.01, weight_decay=0.1, max_steps=10)
    adamw = make_optimizer(model, cfg, "cpu")
    roles = {g["role"]: (g["lr"], g["weight_decay"], len(g["params"])) for g in adamw.param_groups}
    assert roles == {"decay": (1e-3, 0.1, 12), "embedding": (0.2, 0.0, 1), "head": (0.01, 0.0, 1)}
    muon = make_optimizer(model, replace_cfg(cfg, optimizer="muon"), "cpu")
    assert [g["role"] for g in muon.adamw.param_groups] == ["embedding", "head"]
    assert sum(len(g["params"]) for g in muon.muon.param_groups) == 12
    listed = [p for g in muon.param_groups for p in g["params"]]
    assert len(listed) == len({id(p) for p in listed}) == len(list(model.parameters()))
    scheduler = make_scheduler(muon, replace_cfg(cfg, optimizer="muon", warmup_steps=4))
    assert [g["lr"] for g in muon.param_groups] == pytest.approx([0.05, 0.0025, cfg.muon_lr / 4], rel=1e-12)
    muon.step()
    scheduler.step()
    assert [g["lr"] for g in muon.param_groups] == pytest.approx([0.1, 0.005, cfg.muon_lr / 2], rel=1e-12)


def replace_cfg(cfg: TrainConfig, **changes: object) -> TrainConfig:
    return TrainConfig(**{**cfg.to_dict(), **changes})


def test_muon_momentum_warms_up_by_the_step_and_a_restored_schedule_sets_it_again() -> None:
    cfg = nanochat_cfg(optimizer="muon", muon_momentum=0.95, muon_momentum_start=0.85, muon_momentum_warmup=4)
    assert [muon_momentum(k, cfg) for k in range(6)] == pytest.approx([0.85, 0.875, 0.9, 0.925, 0.95, 0.95])
    model = GPT(GPTConfig(**cfg.model_settings()))
    optimizer = make_optimizer(model, cfg, "cpu")
    scheduler = make_scheduler(optimizer, cfg)
    (group,) = optimizer.muon.param_groups
    seen = [group["momentum"]]
    for _ in range(5):
        optimizer.step()
        scheduler.step()
        seen.append(group["momentum"])
    assert seen == pytest.approx([0.85, 0.875, 0.9, 0.925, 0.95, 0.95])
    saved = scheduler.state_dict()
    assert "cfg" not in saved
    fresh = make_optimizer(model, cfg, "cpu")
    restored = make_scheduler(fresh, cfg)
    restored.load_state_dict({**saved, "last_epoch": 2})
    assert fresh.muon.param_groups[0]["momentum"] == pytest.approx(0.9)


# ------------------------------------------------------------------------------------------ a real run, exported

PROMPT = "First Citizen:\nBefore we proceed"


@pytest.fixture(scope="module")
def nanochat_run(tmp_path_factory: pytest.TempPathFactory, shakespeare_shards: Path) -> dict:
    """12 steps of a tiny nanochat model (GQA, GPT-2's padded vocabulary) trained by `run.py train`, then exported
    by `run.py export`."""
    root = tmp_path_factory.mktemp("nanochat_run")
    run, out = root / "run", root / "export"
    args = ["--arch", "nanochat", "--n_layer", "2", "--n_head", "4", "--n_kv_head", "2", "--n_embd", "64"]
    args += ["--seq_len", "64", "--micro_batch_size", "4", "--total_batch_size", "256", "--max_steps", "12"]
    args += ["--warmup_steps", "2", "--learning_rate", "3e-3", "--eval_every", "12", "--eval_windows", "4"]
    args += ["--save_every", "0", "--sample_tokens", "0", "--log_with", "none"]
    train = run_cmd(python_cmd("train", *args, "--data_dir", str(shakespeare_shards), "--out_dir", str(run)))
    export = run_cmd(python_cmd("export", "--checkpoint", str(run), "--out_dir", str(out)))
    return {"run": run, "export": out, "train": train.stderr, "export_out": export.stdout, "data": shakespeare_shards}


@pytest.mark.slow
def test_the_run_says_its_block_and_records_it(nanochat_run: dict) -> None:
    assert "nanochat block | AdamW" in nanochat_run["train"]
    card = json.loads((nanochat_run["run"] / "model_config.json").read_text())["model"]
    assert (card["arch"], card["n_kv_head"], card["bias"]) == ("nanochat", 2, False)
    assert card["rope_theta"] == NANOCHAT_DEFAULTS["rope_theta"]
    assert card["logit_softcap"] == NANOCHAT_DEFAULTS["logit_softcap"]


@pytest.mark.slow
def test_the_export_loads_as_nanochat_for_causal_lm_with_our_logits(nanochat_run: dict) -> None:
    out = nanochat_run["export"]
    assert "(NanoChatForCausalLM + GPT-2 tokenizer, vocab 50257, model card)" in nanochat_run["export_out"]
    theirs = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(theirs).__name__ == "NanoChatForCausalLM" and theirs.config.vocab_size == 50_257
    assert {"tokenizer.json", "vocab.json", "merges.txt", "generation_config.json"} <= {p.name for p in out.iterdir()}
    model, _ = load_model(nanochat_run["run"])
    x = torch.randint(0, 50_257, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (theirs(x).logits - model(x)[0][..., :50_257]).abs().max().item() <= 1e-5
    card = (out / "README.md").read_text()
    assert "tags:\n- nanochat\n" in card and "`NanoChatForCausalLM`: rotary positions" in card
    assert "sharing 2 key/value heads" in card


@pytest.mark.slow
def test_transformers_greedy_text_is_run_sample_top_k_1(nanochat_run: dict) -> None:
    """`generate` on the export (its KV cache, its rotary positions) writes what `run.py sample --top_k 1` writes."""
    out = nanochat_run["export"]
    sample = run_cmd(python_cmd("sample", "--checkpoint", str(nanochat_run["run"]), "--prompt", PROMPT, "--top_k", "1",
                                "--max_new_tokens", "20", "--stop_at_eot", "false", "--device", "cpu"))  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(out)
    theirs = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    generated = theirs.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None)
    assert generated.shape[1] == ids.shape[1] + 20
    assert sample.stdout.removesuffix("\n") == tokenizer.decode(generated[0])


@pytest.mark.slow
def test_lm_evaluation_harness_scores_the_export_as_our_model_does(nanochat_run: dict) -> None:
    """lm-evaluation-harness's transformers model (what `lm_eval --model hf` builds) on the export: its
    log-likelihood of each continuation is our model's, over the tokenizer's 50,257 ids."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    pairs = [("The king said", " that we shall"), (PROMPT, " any further, hear me speak.")]
    harness = HFLM(pretrained=str(nanochat_run["export"]), device="cpu", batch_size=2)
    assert type(harness.model).__name__ == "NanoChatForCausalLM"
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=i) for i, pair in enumerate(pairs)]
    scores = [score for score, _ in harness.loglikelihood(requests)]
    model, card = load_model(nanochat_run["run"])
    for (context, continuation), score in zip(pairs, scores, strict=True):
        a, b = card.tokenizer.encode(context), card.tokenizer.encode(continuation)
        with torch.no_grad():
            logits = model(torch.tensor([a + b]))[0][0]
        assert logits.size(-1) == 50_257  # the padded rows are left out, as the export has none
        logp = logits.log_softmax(-1)
        ours = sum(logp[len(a) - 1 + i, token].item() for i, token in enumerate(b))
        assert score == pytest.approx(ours, abs=1e-4)


@pytest.mark.slow
def test_eval_of_the_run_and_of_its_export_agree(nanochat_run: dict) -> None:
    """`run.py eval` scores the run (50,304 head rows) and its export (50,257) alike, and as the run's own last
    evaluation did: the loss leaves the rows no token has out, everywhere (they moved it by up to 9.3e-4 nats)."""

    def val_loss(checkpoint: Path) -> float:
        cmd = python_cmd("eval", "--checkpoint", str(checkpoint), "--data_dir", str(nanochat_run["data"]))
        return json.loads(run_cmd([*cmd, "--eval_windows", "4"]).stdout.splitlines()[-1])["val_loss"]

    run, export = val_loss(nanochat_run["run"]), val_loss(nanochat_run["export"])
    assert run == pytest.approx(export, abs=2e-6)
    rows = (nanochat_run["run"] / "metrics.jsonl").read_text().splitlines()
    assert run == pytest.approx(json.loads(rows[-1])["val_loss"], abs=2e-6)


@pytest.mark.slow
def test_the_char_recipe_preset_takes_the_block_as_a_flag(tmp_path: Path) -> None:
    """`--config shakespeare-char-cpu --arch nanochat`: the preset's shape and schedule with the modern block (its own
    settings filled in), which learns characters; shortened to 60 steps."""
    data, run = tmp_path / "data", tmp_path / "run"
    run_cmd(python_cmd("prepare", "--preset", "shakespeare-char", "--dataset", str(SHAKESPEARE), "--out_dir",
                       str(data), "--val_tokens", "20000"))  # fmt: skip
    flags = ["--max_steps", "60", "--warmup_steps", "10", "--eval_every", "60", "--eval_windows", "24"]
    flags += ["--save_every", "0", "--sample_tokens", "0", "--log_with", "none", "--optimizer", "muon"]
    proc = run_cmd(python_cmd("train", "--config", "shakespeare-char-cpu", "--arch", "nanochat", "--data_dir",
                              str(data), "--out_dir", str(run), *flags))  # fmt: skip
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert (config["arch"], config["n_layer"], config["n_embd"], config["bias"]) == ("nanochat", 4, 128, False)
    assert config["muon_momentum_warmup"] == NANOCHAT_DEFAULTS["muon_momentum_warmup"]
    assert (config["muon_ns_coefficients"], config["muon_ns_steps"]) == ("polar_express", 4)
    assert "Muon + AdamW, Newton-Schulz in " in proc.stderr and "), 4 polar_express iterations" in proc.stderr
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["loss"] == pytest.approx(math.log(65), abs=0.1) and rows[-1]["val_loss"] < 2.7


@pytest.mark.slow
def test_the_export_reads_back_as_the_runs_weights(nanochat_run: dict) -> None:
    """What `--init_from`, `eval` and `sample` do with a NanoChat folder: the trainer's weights come back (the padded
    vocabulary rows refilled, see `hf._fit_vocab`), the same block and settings."""
    model, card = load_model(nanochat_run["run"])
    back = hf.load_transformers(str(nanochat_run["export"]), vocab_size=card.model.vocab_size)
    assert back.config == card.model
    ours, theirs = model.state_dict(), back.state_dict()
    for key, value in ours.items():
        rows = slice(0, 50_257) if key in ("transformer.wte.weight", "lm_head.weight") else slice(None)
        assert torch.equal(theirs[key][rows], value[rows]), key


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_norm_is_torchs_rms_norm_with_its_gradient(dtype: torch.dtype) -> None:
    """The CPU norm's own backward: the same values as `F.rms_norm` bit for bit (what the export rests on), and the
    gradient autograd gives through torch's op, to round-off; a q/k-shaped input too; without a gradient, the same."""
    for shape in [(3, 16, 32), (3, 16, 4, 8)]:
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_()
        g = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)
        ours, theirs = M.norm(x), F.rms_norm(x, (shape[-1],))
        assert ours.dtype == dtype and torch.equal(ours, theirs)
        (grad_ours,), (grad_theirs,) = torch.autograd.grad(ours, x, g), torch.autograd.grad(theirs, x, g)
        tolerance = 1e-6 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(grad_ours, grad_theirs, atol=tolerance, rtol=tolerance)
        with torch.no_grad():  # evaluation and sampling: torch's op itself
            assert M.norm(x).grad_fn is None and torch.equal(M.norm(x), theirs)


@pytest.mark.slow
def test_n_kv_head_equal_to_n_head_is_the_model_without_it(tmp_path: Path, shakespeare_shards: Path) -> None:
    """One key/value head per query head is what an unset n_kv_head means: a run trained without it resumes with
    `--n_kv_head` = n_head and the other way round (it was refused as a change of shape), and the config takes it
    as unset. A checkpoint that recorded n_kv_head = n_head resumes unset too."""
    assert TrainConfig(data_dir="x", arch="nanochat", n_head=4, n_embd=64, n_kv_head=4).n_kv_head is None
    assert GPTConfig(arch="nanochat", n_head=4, n_embd=64, n_kv_head=4).n_kv_head is None
    saved = {**TrainConfig(data_dir="x", arch="nanochat", n_head=4, n_embd=64).to_dict(), "n_kv_head": 4}
    check_resume_config(saved, TrainConfig(data_dir="x", arch="nanochat", n_head=4, n_embd=64).to_dict(), Path("c"))
    run = tmp_path / "run"
    args = ["--arch", "nanochat", "--n_layer", "1", "--n_head", "4", "--n_embd", "64", "--seq_len", "32"]
    args += ["--micro_batch_size", "2", "--total_batch_size", "64", "--eval_every", "0", "--save_every", "1"]
    args += ["--sample_tokens", "0", "--log_with", "none", "--data_dir", str(shakespeare_shards), "--out_dir", str(run)]
    run_cmd(python_cmd("train", *args, "--max_steps", "2"))
    proc = run_cmd(python_cmd("train", *args, "--max_steps", "3", "--n_kv_head", "4", "--resume", "auto"))
    assert "resumed from" in proc.stderr and "finished at step 3/3" in proc.stderr
    run_cmd(python_cmd("train", *args, "--max_steps", "4", "--resume", "auto"))
