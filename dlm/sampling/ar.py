"""Autoregressive decoding: prefill, then one token per forward with the KV cache.

`stream` runs a batch of prompts left-padded, each row with its own positions (`decode`); with
`--naive` it recomputes the whole sequence every step instead, one prompt after another
(`decode_naive`: the reference that cached decoding must match token for token, and a bench row).
`row_program` is one request as a row program (dlm.sampling.rows): what the server batches, every request's row
in one forward per token over the row batch.
"""

from __future__ import annotations

import warnings

from typing import Iterator, Sequence

import torch

from dlm.data.tokens import fim_prompt_ids
from dlm.errors import DlmError, check
from dlm.masks import causal_layers, key_valid_mask, padded_prefill_mask
from dlm.model import Transformer
from dlm.sampling.common import (
    Clock, Commit, Done, Eos, Event, Prompt, Sampling, Scored, Stats, check_fits, check_sampling, eos_set, is_eos,
    make_generator, sample_token,
)
from dlm.sampling.rows import RowProgram, Window


# the SampleConfig fields this sampler reads (dlm.sampling.OPTIONS gathers every sampler's: the CLI's warnings, the
# server's 400s and the bench derive from them); max_new_tokens and seed are read by every sampler
OPTIONS = frozenset({"temperature", "top_k", "top_p", "naive", "sampler", "suffix"})


def check_options(model: Transformer, prompts: Sequence[Prompt], cfg, what: str = "an ar checkpoint",
                  fim: bool = False) -> None:
    """Refuse what an AR decoder cannot do (cfg: SampleConfig); fim: the checkpoint fills one hole (--suffix)."""
    check_sampling(cfg.temperature, cfg.top_k, cfg.top_p)
    check(cfg.max_new_tokens > 0, f"--max-new-tokens must be > 0, got {cfg.max_new_tokens}")
    for p in prompts:
        if p.canvas is not None and not fim:
            raise DlmError(f"--suffix / <fill> markers: {what} cannot infill (use an mdlm or usdm checkpoint, "
                           "or an ar checkpoint trained with --fim-rate)")
        if p.canvas is not None and (None in p.canvas[p.canvas.index(None) + p.canvas.count(None):]
                                     or p.canvas[0] is not None):
            raise DlmError("<fill> markers: an ar checkpoint trained for fill-in-the-middle fills one hole right "
                           "after the prompt (use --suffix)")
        check(len(p.ids) > 0, "--prompt is empty: give at least one token of prompt")
        check_fits(model.cfg.max_seq_len, p, cfg.max_new_tokens)


def stream(model: Transformer, ck, prompts: list[Prompt], cfg, step_events: bool = False) -> Iterator[Event]:
    """The AR sampler (cfg: SampleConfig)."""
    if cfg.sampler not in ("auto", "ar"):
        raise DlmError(f"--sampler {cfg.sampler} does not belong to an ar checkpoint (allowed: auto)")
    check_options(model, prompts, cfg, fim=ck.fim)
    tok = ck.tokenizer
    if any(p.canvas is not None for p in prompts):
        return fill_in_the_middle(model, ck, prompts, cfg)
    ids = [p.ids for p in prompts]
    if cfg.naive:
        return decode_naive(model, ids, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed,
                            tok.eos_ids)
    return decode(model, ids, cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed, tok.eos_ids,
                  tok.pad_id)


def row_program(model: Transformer, ck, prompt: Prompt, cfg, row: int = 0, *, logprobs: int | None = None,
                step_events: bool = False) -> RowProgram:
    """A request as a row of a batch (the server's): its prompt prefilled in one request, then one token per request,
    sampled with a generator of its own seeded cfg.seed (greedy: none); logprobs (None: off): each token comes as a
    Scored event with its log-probability and that many alternatives. Raises on bad options, before any work."""
    if cfg.sampler not in ("auto", "ar"):
        raise DlmError(f"--sampler {cfg.sampler} does not belong to an ar checkpoint (allowed: auto)")
    check_options(model, [prompt], cfg)
    gen = make_generator(cfg.seed, model.device) if cfg.temperature > 0 else None
    stats = Stats()
    program = _row(prompt.ids, cfg.max_new_tokens, Sampling.of(cfg, gen), eos_set(ck.tokenizer.eos_ids), row, logprobs,
                   stats, model.device)
    return RowProgram(program, stats)


def _row(ids: list[int], max_new_tokens: int, sampling: Sampling, eos: frozenset[int], row: int,
         logprobs: int | None, stats: Stats, dev: torch.device) -> Iterator:
    """One prompt's decoding as a row program: its Commit (Scored) events and its requests, the prompt's then each
    new token's (causal, kept in the row's cache; the logits of the last position)."""
    P = len(ids)
    logits = (yield Window(tokens=torch.tensor(ids, device=dev), mask="causal", keep=P, out=(P - 1, P)))[0, -1]  # (V,)
    while True:
        stats.forwards += 1
        tok = sampling.draw(logits)[0]  # ()
        t = int(tok)
        if logprobs is None:
            yield Commit([t], row)
        else:
            lp = torch.log_softmax(logits.float(), -1)
            top = []
            if logprobs > 0:
                vals, idx = torch.topk(lp, logprobs)
                top = list(zip(idx.tolist(), vals.tolist()))
            yield Scored([t], row, float(lp[t]), top)
        stats.new_tokens += 1
        if t in eos or stats.new_tokens >= max_new_tokens:
            return
        logits = (yield Window(tokens=tok.view(1), mask="causal", keep=1, out=(0, 1)))[0, -1]


def fill_in_the_middle(model: Transformer, ck, prompts: list[Prompt], cfg) -> Iterator[Event]:
    """Infilling with an AR checkpoint trained for it (PSM: <fim_prefix> P <fim_suffix> S <fim_middle>, then the
    middle up to <eos>): each row's output is its middle (at most the hole's length), then its suffix, pinned,
    byte-exact, as a diffusion sampler's canvas. Rows without a hole are plain continuations."""
    tok = ck.tokenizer
    ids, suffixes = [], []
    for p in prompts:
        suffix = [] if p.canvas is None else [t for t in p.canvas if t is not None]
        ids.append(p.ids if p.canvas is None else fim_prompt_ids(tok, p.ids, suffix))
        suffixes.append(None if p.canvas is None else suffix)
    budget = [cfg.max_new_tokens if p.canvas is None else p.canvas.count(None) for p in prompts]
    for p, n in zip(ids, budget):  # the FIM markers take room too: refused here, before any work
        check_fits(model.cfg.max_seq_len, Prompt(p), n)
    return _fim_rows(model, ids, suffixes, budget, cfg, tok)


def _fim_rows(model: Transformer, ids: list[list[int]], suffixes: list, budget: list[int], cfg,
              tok) -> Iterator[Event]:
    inner = (decode_naive(model, ids, max(budget), cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed, tok.eos_ids)
             if cfg.naive else
             decode(model, ids, max(budget), cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed, tok.eos_ids, tok.pad_id))
    stop = eos_set(tok.eos_ids)
    made = [0] * len(ids)  # new tokens per row (a middle's ending <eos> is not output)
    ended = [False] * len(ids)
    for ev in inner:
        if isinstance(ev, Commit):
            row = ev.row
            for t in ev.tokens:
                if ended[row]:
                    break
                if suffixes[row] is not None and t in stop:  # the middle is over: the suffix follows
                    ended[row] = True
                    yield Commit(list(suffixes[row]), row=row)
                    break
                yield Commit([t], row=row)
                made[row] += 1
                if made[row] == budget[row] or t in stop:
                    ended[row] = True
                    if suffixes[row] is not None:
                        yield Commit(list(suffixes[row]), row=row)
        elif isinstance(ev, Done):
            for row, s in enumerate(suffixes):
                if not ended[row] and s is not None:
                    yield Commit(list(s), row=row)
            ev.stats.new_tokens = sum(made)
            yield ev
        else:
            yield ev


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
        mask = causal_layers(model.cfg, padded_prefill_mask(valid[:, :P]))  # (B, 1, P, P); a pad query sees itself only
    else:
        mask = "causal"
    cache = model.new_cache(B, capacity)
    out = model(ids, pos=pos, cache=cache, mask=mask)
    return out.logits[:, -1], cache, valid, pos[:, -1] + 1


@torch.inference_mode()
def decode(model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
           top_k: int = 0, top_p: float = 1.0, seed: int | None = 0, eos_id: Eos = None,
           pad_id: int = 0, cuda_graphs: bool | None = None) -> Iterator[Event]:
    """A batch of prompts with the KV cache: one forward per new token for the whole batch.

    cuda_graphs: replay each step from a captured CUDA graph (dlm.sampling.graphs); None: on a CUDA device
    whenever the model's step can be captured."""
    from dlm.sampling.graphs import StepGraph, graphable

    gen = make_generator(seed, model.device)
    clock = Clock()
    B, P = len(prompts), max(len(p) for p in prompts)
    logits, cache, valid, pos = prefill(model, prompts, P + max_new_tokens, pad_id)
    graphed = graphable(model) if cuda_graphs is None else cuda_graphs
    step = None
    if graphed and max_new_tokens > 1:
        try:
            step = StepGraph(model, cache, capture=model.device.type == "cuda")
        except RuntimeError as e:  # a step the CUDA graph cannot hold (an op that waits on the host): run eagerly
            cache.slot = None  # (the warm-up wrote only the next step's slot, which that step overwrites)
            if cuda_graphs:
                raise
            warnings.warn(f"decoding without CUDA graphs: the step could not be captured ({e})", stacklevel=2)
    stats = Stats(forwards=1)
    done = torch.zeros(B, dtype=torch.bool, device=model.device)
    for i in range(max_new_tokens):
        nxt = sample_token(logits, temperature, top_k, top_p, gen)  # (B,)
        clock.mark_first()
        for b in range(B):
            if not done[b]:
                yield Commit([int(nxt[b])], row=b)
                stats.new_tokens += 1
        done |= is_eos(nxt, eos_id)
        if bool(done.all()) or i == max_new_tokens - 1:
            break
        valid[:, cache.length] = True
        if step is not None:
            logits = step(nxt, pos, valid)
        else:
            mask = causal_layers(model.cfg, key_valid_mask(valid[:, :cache.length + 1])) if B > 1 else "causal"
            logits = model(nxt[:, None], pos=pos[:, None], cache=cache, mask=mask).logits[:, -1]  # mask (B,1,1,S)
        pos = pos + 1
        stats.forwards += 1
    yield clock.finish(stats)


@torch.inference_mode()
def decode_naive(model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, seed: int | None = 0,
                 eos_id: Eos = None) -> Iterator[Event]:
    """No cache: every step runs the model over the whole sequence so far (one prompt after another)."""
    gen = make_generator(seed, model.device)
    clock = Clock()
    stats = Stats()
    stop = eos_set(eos_id)
    for row, prompt in enumerate(prompts):
        seq = torch.tensor([list(prompt)], dtype=torch.long, device=model.device)
        for _ in range(max_new_tokens):
            logits = model(seq).logits[:, -1]
            stats.forwards += 1
            nxt = sample_token(logits, temperature, top_k, top_p, gen)  # (1,)
            clock.mark_first()
            yield Commit([int(nxt[0])], row=row)
            stats.new_tokens += 1
            if int(nxt[0]) in stop:
                break
            seq = torch.cat([seq, nxt[:, None]], dim=1)
    yield clock.finish(stats)
