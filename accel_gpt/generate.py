"""Text generation: temperature / top-k sampling (temperature 0 = greedy), reproducible from a seed.

With a KV cache (the default) the prompt is run once and each new token is one forward pass over that token
alone. The context is the model's `seq_len`: a prompt longer than that is cropped from the left, and once a
sequence outgrows it the window slides, which with absolute positions means a full forward pass over the last
`seq_len` tokens per new token, as without a cache; `run.py sample` says so in one warning line when it happens.

A sample ends where the model writes end-of-text (the end of a document in its training data), unless asked to
write on past it. During training every rank calls `sample_texts` with the same seed on its prepared model (DDP-
or FSDP-wrapped, autocast, compiled), and only the main process prints the result: there every rank runs all
`max_new_tokens` forward passes whatever the text (FSDP's gathers need the same count on every rank), and the
text is cut at end-of-text afterwards.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from tqdm.auto import tqdm

from accel_gpt.config import SampleConfig
from accel_gpt.errors import UserError
from accel_gpt.model import GPTConfig, KVCache
from accel_gpt.tokenizer import Tokenizer


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    cfg: GPTConfig,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    use_cache: bool = True,
    stop_token: int | None = None,
    stop_early: bool = True,
    progress: bool = False,
) -> torch.Tensor:
    """(B, T) prompt ids -> (B, T + max_new_tokens): the prompt followed by the generated tokens.

    `generator` (on the same device as `idx`) makes the draws reproducible; `top_k` None or 0 keeps
    the whole vocabulary. `model` may be wrapped (DDP, FSDP, compiled); `cfg` is its GPTConfig. The caller
    sets eval mode (`sample_texts` does).

    `stop_token`: a row that draws it is finished, and its later positions repeat it. The finished rows still take
    part in every draw, so each row's tokens are those of a run without `stop_token` up to its first one. With
    `stop_early` the loop ends once every row is finished (fewer than `max_new_tokens` columns then).
    `progress`: a bar of the tokens drawn on stderr, in a terminal only, cleared at the end.
    """
    cache = KVCache(cfg.n_layer, cfg.seq_len) if use_cache else None
    finished = torch.zeros(idx.size(0), dtype=torch.bool, device=idx.device)
    bar = tqdm(total=max_new_tokens, desc="sample", unit="tok", leave=False, disable=None if progress else True)
    for _ in range(max_new_tokens):
        if cache is not None and 0 < cache.length < cfg.seq_len:
            logits, _ = model(idx[:, -1:], cache=cache)  # only the newest token; the rest is cached
        else:  # no cache, an empty one, or a full one: the window slides, positions shift, start again
            if cache is not None:
                cache.length = 0
            logits, _ = model(idx[:, -cfg.seq_len :], cache=cache)  # the model sees at most its context
        logits = logits[:, -1, :].float()  # (B, V)
        if not bool(torch.isfinite(logits).all()):
            raise NonFiniteLogits("the model's logits are not finite (its weights overflow)")
        if temperature == 0:
            next_id = logits.argmax(-1, keepdim=True)
        else:
            # from the top logit down, and a temperature too small for fp32 taken as its smallest: greedy, not NaN
            logits = (logits - logits.amax(-1, keepdim=True)) / max(temperature, torch.finfo(torch.float32).tiny)
            next_id = draw(logits, top_k, generator)
        if stop_token is not None:
            next_id = next_id.masked_fill(finished[:, None], stop_token)
            finished |= next_id[:, 0] == stop_token
        idx = torch.cat([idx, next_id], dim=1)
        bar.update()
        if stop_token is not None and stop_early and bool(finished.all()):
            break
    bar.close()
    return idx


def draw(logits: torch.Tensor, top_k: int | None, generator: torch.Generator | None) -> torch.Tensor:
    """One id per row of (B, V) logits, from their softmax, or from that of the `top_k` largest. The draw is made
    among those k alone: `multinomial` spends a random number on every column, which over GPT-2's 50,257 ids was
    1.7 ms a token on a CPU core, against 0.2 ms for the 50 that `run.py sample` keeps by default."""
    if not top_k or top_k >= logits.size(-1):
        return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
    values, ids = torch.topk(logits, top_k)  # (B, k)
    return ids.gather(-1, torch.multinomial(torch.softmax(values, dim=-1), 1, generator=generator))


def sample_texts(
    model: torch.nn.Module, cfg: GPTConfig, tokenizer: Tokenizer, prompt: str, *args: Any, **kwargs: Any
) -> list[str]:
    """`num_samples` continuations of `prompt` (each returned with the prompt in front), drawn together
    from one generator seeded with `seed`: the same arguments (those of `sample_ids`) give the same texts. Accepts
    a prepared model as it is (no unwrap needed); `device` is where the model lives (`accelerator.device` in
    training). With `stop_at_eot` (the default) a text ends before the first end-of-text the model writes."""
    rows = sample_ids(model, cfg, tokenizer, prompt, *args, **kwargs)
    return decode_samples(rows, tokenizer, len(encode_prompt(tokenizer, prompt)), kwargs.get("stop_at_eot", True))


class NonFiniteLogits(UserError):
    """The weights give inf or NaN logits: nothing can be drawn from them (a run that diverged, or damaged weights)."""


def sample_ids(
    model: torch.nn.Module,
    cfg: GPTConfig,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    seed: int,
    device: str | torch.device,
    num_samples: int = 1,
    use_cache: bool = True,
    stop_at_eot: bool = True,
    stop_early: bool = True,
    progress: bool = False,
) -> list[list[int]]:
    """The token ids `sample_texts` decodes: each row is the prompt's ids and then the new ones. With `stop_at_eot`
    a row ends with the first end-of-text the model wrote (when it wrote one); `stop_early=False` still runs all
    `max_new_tokens` forward passes (the training samples, see the module); `progress` as `generate`'s."""
    if temperature < 0:
        raise UserError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 0:
        raise UserError(f"top_k must be >= 0 (0 = whole vocabulary), got {top_k}")
    if max_new_tokens < 0 or num_samples < 1:
        raise UserError(f"need max_new_tokens >= 0 and num_samples >= 1, got {max_new_tokens} and {num_samples}")
    ids = encode_prompt(tokenizer, prompt)
    if max(ids) >= cfg.vocab_size:  # a model with fewer ids than its tokenizer: trained with another one
        raise UserError(
            f"the prompt's token {max(ids)} is past the model's {cfg.vocab_size} ids: its embedding was not made for "
            f"this tokenizer ({tokenizer.name}), so it was trained with another one"
        )
    device = torch.device(device)
    idx = torch.tensor([ids] * num_samples, dtype=torch.long, device=device)
    generator = torch.Generator(device=device).manual_seed(seed)
    was_training = model.training
    model.eval()
    stop = tokenizer.eot_token if stop_at_eot else None
    out = generate(
        model, cfg, idx, max_new_tokens, temperature, top_k, generator,
        use_cache=use_cache, stop_token=stop, stop_early=stop_early, progress=progress,
    )  # fmt: skip
    model.train(was_training)
    rows = out.tolist()
    if stop is None:
        return rows
    cut = []
    for row in rows:
        new = row[len(ids) :]
        cut.append(row[: len(ids) + new.index(stop) + 1] if stop in new else row)
    return cut


def decode_samples(rows: list[list[int]], tokenizer: Tokenizer, prompt_len: int, stop_at_eot: bool) -> list[str]:
    """The texts of `sample_ids` rows: a final end-of-text that ended a sample is not part of its text, nor the one
    an empty prompt starts from (no text encodes to it, so a one-token prompt of end-of-text is that start)."""
    eot = tokenizer.eot_token
    start = 1 if eot is not None and prompt_len == 1 and rows and rows[0][0] == eot else 0
    return [
        tokenizer.decode(row[start:-1] if ended_at_eot(row, prompt_len, eot, stop_at_eot) else row[start:])
        for row in rows
    ]


def ended_at_eot(row: list[int], prompt_len: int, eot: int | None, stop_at_eot: bool) -> bool:
    """Whether a `sample_ids` row stopped at an end-of-text the model wrote."""
    return stop_at_eot and eot is not None and len(row) > prompt_len and row[-1] == eot


def eot_note(rows: list[list[int]], prompt_len: int, eot: int | None, stop_at_eot: bool, asked: int) -> str | None:
    """One line for the samples that ended at end-of-text before `asked` new tokens: shorter than asked, and why."""
    short = [
        (i, len(row) - prompt_len) for i, row in enumerate(rows, 1) if ended_at_eot(row, prompt_len, eot, stop_at_eot)
    ]
    short = [(i, n) for i, n in short if n < asked]
    if not short:
        return None
    which = "sample" if len(rows) == 1 else "samples " + ", ".join(str(i) for i, _ in short)
    after = ", ".join(str(n - 1) for _, n in short)
    return (
        f"note: {which} stopped at end-of-text (a document's end) after {after} of {asked} new tokens; "
        "--stop_at_eot false writes on past it"
    )


def context_warning(rows: list[list[int]], prompt_len: int, seq_len: int) -> str | None:
    """One line when a sample outgrew the model's context, so that what the model read was cropped (see the module):
    the last token of a row was predicted from the len(row) - 1 before it."""
    longest = max(len(row) for row in rows)
    if longest == prompt_len or longest - 1 <= seq_len:
        return None
    if prompt_len > seq_len:
        return (
            f"warning: the prompt has {prompt_len} tokens, more than the model's {seq_len}-token context: only its "
            f"last {seq_len} were read, and each new token was predicted from the {seq_len} tokens before it"
        )
    return (
        f"warning: the samples outgrew the model's {seq_len}-token context (prompt {prompt_len} tokens + "
        f"{longest - prompt_len} new): past it, each new token was predicted from the {seq_len} tokens before it"
    )


def encode_prompt(tokenizer: Tokenizer, prompt: str) -> list[int]:
    try:
        ids = tokenizer.encode(prompt)
    except ValueError as e:  # a character outside a char vocabulary
        raise UserError(f"cannot encode the prompt: {e}") from None
    if not ids:  # an empty prompt starts from end-of-text, where a document would begin
        if tokenizer.eot_token is None:
            raise UserError("the prompt is empty and this tokenizer has no end-of-text token to start from")
        ids = [tokenizer.eot_token]
    return ids


def usable_device(name: str) -> torch.device:
    """`--device` parsed and tried before the model loads: a misspelt name or a device this machine lacks (cuda
    without a GPU or a CUDA build) is one line, not torch's assertion from deep inside `.to()`."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UserError(f"--device {name!r} is not a device name (cpu, cuda, cuda:1, mps, ...)") from None
    if device.type == "meta":
        raise UserError("--device meta holds no weights to sample with; use cpu or an accelerator")
    try:
        torch.empty(0, device=device)
    except (RuntimeError, AssertionError, ValueError) as e:
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise UserError(f"--device {name} cannot be used here: {first.split('. ')[0]}") from None
    return device


def run_sample(cfg: SampleConfig) -> None:
    """`run.py sample`: print `num_samples` continuations, separated by a line of dashes."""
    from accel_gpt.allocator import keep_freed_memory
    from accel_gpt.weights import load_model

    device = usable_device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":  # each token's (samples, vocabulary) buffers, reused instead of mapped in afresh
        keep_freed_memory()
    model, card = load_model(cfg.checkpoint, device)
    tokenizer = card.tokenizer
    rows = sample_ids(
        model,
        card.model,
        tokenizer,
        cfg.prompt,
        cfg.max_new_tokens,
        cfg.temperature,
        cfg.top_k,
        cfg.seed,
        device,
        cfg.num_samples,
        stop_at_eot=cfg.stop_at_eot,
        progress=True,
    )
    prompt_len = len(encode_prompt(tokenizer, cfg.prompt))
    for note in (
        context_warning(rows, prompt_len, card.model.seq_len),
        eot_note(rows, prompt_len, tokenizer.eot_token, cfg.stop_at_eot, cfg.max_new_tokens),
    ):
        if note:
            print(note, file=sys.stderr)
    print(f"\n{'-' * 40}\n".join(decode_samples(rows, tokenizer, prompt_len, cfg.stop_at_eot)))
