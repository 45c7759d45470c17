"""Autoregressive decoding: prefill, then one token per forward with the KV cache.

`ar_stream` is the sampler (a generator of events) for a batch of prompts, left-padded, each row
with its own positions; `naive_stream` recomputes the whole sequence every step (the reference
that cached decoding must match token for token, and a benchmark row). `generate` drains either.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch

from dlm.errors import DlmError, check
from dlm.model import Transformer
from dlm.sampling.common import Clock, Commit, Done, Event, Result, Stats, check_sampling, drain, make_generator, sample_token


def check_room(model: Transformer, prompt_len: int, max_new_tokens: int) -> None:
    check(max_new_tokens > 0, f"--max-new-tokens must be > 0, got {max_new_tokens}")
    check(prompt_len > 0, "--prompt is empty: give at least one token of prompt")
    ctx = model.cfg.max_seq_len
    if prompt_len + max_new_tokens > ctx:
        raise DlmError(
            f"--prompt is {prompt_len} tokens; with --max-new-tokens {max_new_tokens} that exceeds the model's "
            f"context of {ctx} tokens (allowed: prompt + max-new-tokens <= {ctx})"
        )


def prefill(model: Transformer, prompts: Sequence[Sequence[int]], capacity: int, pad_id: int):
    """Left-pad the prompts, run them through the model once and fill a fresh cache.

    Returns (last logits (B, V), cache, key_valid (B, capacity) bool, next positions (B,)).
    """
    dev = model.device
    B, P = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((B, P), pad_id, dtype=torch.long, device=dev)
    valid = torch.zeros(B, capacity, dtype=torch.bool, device=dev)
    for b, p in enumerate(prompts):
        ids[b, P - len(p):] = torch.tensor(list(p), device=dev)
        valid[b, P - len(p):P] = True
    pads = (~valid[:, :P]).sum(1)  # (B,)
    pos = (torch.arange(P, device=dev)[None] - pads[:, None]).clamp(min=0)  # (B, P)
    if bool(pads.any()):
        causal = torch.tril(torch.ones(P, P, dtype=torch.bool, device=dev))
        mask = (causal[None] & valid[:, None, :P]) | torch.eye(P, dtype=torch.bool, device=dev)[None]
        mask = mask[:, None]  # (B, 1, P, P); a pad query sees itself only
    else:
        mask = "causal"
    cache = model.new_cache(B, capacity)
    out = model(ids, pos=pos, cache=cache, mask=mask)
    return out.logits[:, -1], cache, valid, pos[:, -1] + 1


@torch.inference_mode()
def ar_stream(
    model: Transformer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 128, temperature: float = 0.0,
    top_k: int = 0, top_p: float = 1.0, seed: int | None = 0, eos_id: int | None = None, pad_id: int = 0,
) -> Iterator[Event]:
    check_sampling(temperature, top_k, top_p)
    check_room(model, max(len(p) for p in prompts), max_new_tokens)
    gen = make_generator(seed, model.device)
    clock = Clock()
    B, P = len(prompts), max(len(p) for p in prompts)
    logits, cache, valid, pos = prefill(model, prompts, P + max_new_tokens, pad_id)
    forwards, new = 1, 0
    done = torch.zeros(B, dtype=torch.bool, device=model.device)
    for i in range(max_new_tokens):
        nxt = sample_token(logits, temperature, top_k, top_p, gen)  # (B,)
        clock.mark_first()
        for b in range(B):
            if not done[b]:
                yield Commit([int(nxt[b])], row=b)
                new += 1
        if eos_id is not None:
            done |= nxt == eos_id
        if bool(done.all()) or i == max_new_tokens - 1:
            break
        valid[:, cache.length] = True
        mask = valid[:, None, None, :cache.length + 1] if B > 1 else "causal"  # (B, 1, 1, S)
        logits = model(nxt[:, None], pos=pos[:, None], cache=cache, mask=mask).logits[:, -1]
        pos = pos + 1
        forwards += 1
    yield Done(Stats(new_tokens=new, forwards=forwards, seconds=clock.elapsed(), ttft=clock.first))


@torch.inference_mode()
def naive_stream(
    model: Transformer, prompt: Sequence[int], *, max_new_tokens: int = 128, temperature: float = 0.0,
    top_k: int = 0, top_p: float = 1.0, seed: int | None = 0, eos_id: int | None = None, pad_id: int = 0,
) -> Iterator[Event]:
    """No cache: every step runs the model over the whole sequence so far (one prompt)."""
    check_sampling(temperature, top_k, top_p)
    check_room(model, len(prompt), max_new_tokens)
    gen = make_generator(seed, model.device)
    clock = Clock()
    seq = torch.tensor([list(prompt)], dtype=torch.long, device=model.device)
    forwards = new = 0
    for _ in range(max_new_tokens):
        logits = model(seq).logits[:, -1]
        forwards += 1
        nxt = sample_token(logits, temperature, top_k, top_p, gen)  # (1,)
        clock.mark_first()
        yield Commit([int(nxt[0])])
        new += 1
        if eos_id is not None and int(nxt[0]) == eos_id:
            break
        seq = torch.cat([seq, nxt[:, None]], dim=1)
    yield Done(Stats(new_tokens=new, forwards=forwards, seconds=clock.elapsed(), ttft=clock.first))


def stream(model: Transformer, ck, prompts: list[str], cfg) -> Iterator[Event]:
    """The AR sampler for `dlm generate` (cfg: SampleConfig)."""
    if cfg.sampler not in ("auto", "ar"):
        raise DlmError(f"--sampler {cfg.sampler} does not belong to an ar checkpoint (allowed: auto)")
    if cfg.suffix is not None:
        raise DlmError("--suffix: an ar checkpoint cannot infill (use an mdlm or usdm checkpoint)")
    tok = ck.tokenizer
    ids = [tok.encode(p) for p in prompts]
    opts = dict(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                seed=cfg.seed, eos_id=tok.eos_id, pad_id=tok.pad_id)
    if cfg.naive:
        if len(ids) != 1:
            raise DlmError("--naive takes one prompt at a time")
        return naive_stream(model, ids[0], **opts)
    return ar_stream(model, ids, **opts)


def generate(model: Transformer, tokenizer, prompt: str | list[str], *, naive: bool = False, **opts) -> Result:
    """Generate continuations of one prompt or a batch; returns texts, tokens and statistics."""
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    ids = [tokenizer.encode(p) for p in prompts]
    opts.setdefault("eos_id", tokenizer.eos_id)
    opts.setdefault("pad_id", tokenizer.pad_id)
    if naive:
        if len(ids) != 1:
            raise DlmError("the naive loop takes one prompt at a time")
        events = naive_stream(model, ids[0], **opts)
    else:
        events = ar_stream(model, ids, **opts)
    return drain(events, tokenizer.decode, tokenizer.eos_id, rows=len(ids))
