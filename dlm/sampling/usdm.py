"""The uniform-state diffusion sampler (DiffusionGemma's entropy-bound sampler).

Per canvas of L tokens at the positions they will hold once committed:

  1. the canvas starts as uniform random tokens (pinned template/suffix tokens stay put);
  2. each step runs the denoiser (bidirectional over the canvas, reading the encoder's cache
     without writing it), self-conditioned on the previous step's temperature-scaled logits
     (nothing on the first step); temperature T = t_min + (t_max - t_min) * remaining / max_steps;
  3. a candidate token is sampled at every position; entropy-bound acceptance keeps the
     lowest-entropy positions whose cumulative entropy minus its largest term is <= the bound
     (at least one); every other position is re-noised with a fresh uniform token. Acceptance is
     decided anew each step, so tokens can be revised;
  4. adaptive stopping: stop once the argmax canvas has not changed for `stability_threshold`
     steps and the mean entropy is below `confidence_threshold`, or after `max_denoising_steps`;
  5. commit the argmax of the last step's processed logits; tokens after the first <eos> are
     dropped and generation ends; otherwise an incremental causal prefill appends the canvas to
     the cache and the next canvas begins, until `max_new_tokens`.

Infilling (`--suffix`) and templates (`<fill>` markers) are one canvas whose pinned tokens are
never re-noised; <eos> is not allowed inside their holes (the text continues after them).
An empty prefix starts from <eos>, the separator every training document follows.
Prompts of a batch are generated one after another (rows of the event stream).

`forwards` counts every model call: the prompt prefill, every denoising step and the prefill of
each committed canvas that more text follows.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import Tensor

from dlm.errors import DlmError, check
from dlm.model import Transformer
from dlm.objectives.usdm import canvas_embeds, noise_vocab
from dlm.sampling.common import (
    Clock, Commit, Done, Event, Stats, Step, check_sampling, entropy, entropy_bound_accept, make_generator,
    probs_from_logits, sample_from,
)
from dlm.sampling.infill import Template, build_template, check_fits

DEFAULT_CANVAS = 256


# plain functions (each testable on hand-made inputs) -----------------------------------------

def temperature(step: int, max_steps: int, t_max: float, t_min: float) -> float:
    """Temperature of 1-based `step`: t_max on the first step, t_min + (t_max - t_min) / max_steps on the last."""
    remaining = max_steps - step + 1
    return t_min + (t_max - t_min) * remaining / max_steps


def renoise(candidates: Tensor, accepted: Tensor, holes: Tensor, pins: Tensor, noise: Tensor) -> Tensor:
    """The next canvas: accepted candidates, fresh noise at every other hole, pins where pinned. All (n,)."""
    return torch.where(holes, torch.where(accepted, candidates, noise), pins)


def should_stop(stable_steps: int, mean_entropy: float, stability_threshold: int, confidence_threshold: float) -> bool:
    """Adaptive stopping: the argmax canvas unchanged for enough steps and the model confident enough."""
    return stable_steps >= stability_threshold and mean_entropy < confidence_threshold


def cut_at_eos(tokens: list[int], eos_id: int) -> tuple[list[int], bool]:
    """Tokens up to and including the first <eos>, and whether there was one."""
    if eos_id in tokens:
        return tokens[:tokens.index(eos_id) + 1], True
    return tokens, False


def denoise(model: Transformer, cache, canvas: Tensor, pos: Tensor, prev_probs: Tensor | None) -> Tensor:
    """One denoiser pass over canvas (B, n) at positions pos (n,), reading the cache; logits (B, n, V) fp32."""
    x = canvas_embeds(model, canvas, prev_probs)
    return model(embeds=x, pos=pos, cache=cache, mask="full", write=False).logits.float()


# options -------------------------------------------------------------------------------------

def canvas_length_of(ck, cfg) -> int:
    if cfg.canvas_length is not None:
        return cfg.canvas_length
    return int(ck.config.get("canvas_length", ck.config.get("train", {}).get("canvas_length", DEFAULT_CANVAS)))


def check_options(model: Transformer, ck, cfg) -> int:
    """Refuse what does not belong to a usdm sampler; returns the canvas length."""
    if cfg.sampler not in ("auto", "entropy_bound"):
        raise DlmError(f"--sampler {cfg.sampler} does not belong to a usdm checkpoint (allowed: auto, entropy_bound)")
    for name, value, instead in (("steps", cfg.steps, "--max-denoising-steps"), ("block_length", cfg.block_length,
                                                                               "--canvas-length")):
        if value is not None:
            raise DlmError(f"--{name.replace('_', '-')} is an mdlm option; a usdm checkpoint uses {instead}")
    check(cfg.temperature == 0,
          f"--temperature does not apply to usdm (its schedule is --t-max/--t-min), got {cfg.temperature}")
    check_sampling(1.0, cfg.top_k, cfg.top_p)
    ctx = model.cfg.max_seq_len
    L = canvas_length_of(ck, cfg)
    check(0 < L <= ctx, f"--canvas-length must be in [1, {ctx}] (the model's context), got {L}")
    check(cfg.max_new_tokens > 0, f"--max-new-tokens must be > 0, got {cfg.max_new_tokens}")
    check(cfg.max_denoising_steps > 0, f"--max-denoising-steps must be > 0, got {cfg.max_denoising_steps}")
    check(cfg.entropy_bound > 0, f"--entropy-bound must be > 0, got {cfg.entropy_bound}")
    check(cfg.t_min > 0, f"--t-min must be > 0, got {cfg.t_min}")
    check(cfg.t_min <= cfg.t_max, f"--t-min ({cfg.t_min}) must be <= --t-max ({cfg.t_max})")
    check(cfg.stability_threshold >= 1, f"--stability-threshold must be >= 1, got {cfg.stability_threshold}")
    check(cfg.confidence_threshold >= 0, f"--confidence-threshold must be >= 0, got {cfg.confidence_threshold}")
    return L


# the sampler ---------------------------------------------------------------------------------

def stream(model: Transformer, ck, prompts: list[str], cfg) -> Iterator[Event]:
    """Events of usdm generation for each prompt (cfg: SampleConfig). Bad options raise here, before any work."""
    L = check_options(model, ck, cfg)
    tok = ck.tokenizer
    ctx = model.cfg.max_seq_len
    jobs = []
    for p in prompts:
        tpl = build_template(tok, p, cfg.suffix, cfg.max_new_tokens if cfg.suffix is not None else cfg.fill_length)
        prefix = tpl.prefix if tpl is not None else tok.encode(p)
        prefix = prefix or [tok.eos_id]
        if tpl is not None:
            check_fits(Template(prefix, tpl.canvas), ctx)
            tpl = Template(prefix, tpl.canvas)
        elif len(prefix) + cfg.max_new_tokens > ctx:
            raise DlmError(f"--prompt is {len(prefix)} tokens; with --max-new-tokens {cfg.max_new_tokens} that exceeds "
                           f"the model's context of {ctx} tokens (allowed: prompt + max-new-tokens <= {ctx})")
        jobs.append((prefix, tpl))
    return _generate(model, jobs, L, noise_vocab(ck.config, tok), tok.eos_id, cfg)


def stream_ids(model: Transformer, ck, prompts: list[list[int]], cfg) -> Iterator[Event]:
    """Continuations of prompts given as token ids (the benchmark's entry point)."""
    L = check_options(model, ck, cfg)
    tok = ck.tokenizer
    ctx = model.cfg.max_seq_len
    jobs = []
    for ids in prompts:
        prefix = list(ids) or [tok.eos_id]
        check(len(prefix) + cfg.max_new_tokens <= ctx,
              f"prompt of {len(prefix)} tokens + --max-new-tokens {cfg.max_new_tokens} exceeds the context of {ctx}")
        jobs.append((prefix, None))
    return _generate(model, jobs, L, noise_vocab(ck.config, tok), tok.eos_id, cfg)


@torch.inference_mode()
def _generate(model: Transformer, jobs, L: int, N: int, eos_id: int, cfg) -> Iterator[Event]:
    dev = model.device
    gen = make_generator(cfg.seed, dev)
    clock = Clock()
    stats = Stats(extra={"canvases": 0, "steps_per_canvas": []})
    for row, (prefix, tpl) in enumerate(jobs):
        total = len(tpl.canvas) if tpl is not None else cfg.max_new_tokens
        cache = model.new_cache(1, len(prefix) + total)
        model(torch.tensor([prefix], device=dev), cache=cache, head=False)  # prompt prefill
        stats.forwards += 1
        done = 0  # tokens of this row committed
        canvas_index = 0
        while True:
            if tpl is not None:
                holes = torch.tensor([c is None for c in tpl.canvas], device=dev)
                pins = torch.tensor([0 if c is None else c for c in tpl.canvas], device=dev)
            else:
                n = min(L, total - done)
                holes = torch.ones(n, dtype=torch.bool, device=dev)
                pins = torch.zeros(n, dtype=torch.long, device=dev)
            tokens, steps = yield from _denoise_canvas(model, cache, holes, pins, N, eos_id, tpl is not None,
                                                       canvas_index, row, cfg, gen)
            stats.extra["canvases"] += 1
            stats.extra["steps_per_canvas"].append(steps)
            stats.forwards += steps
            ended = False
            if tpl is None:
                tokens, ended = cut_at_eos(tokens, eos_id)
            clock.mark_first()
            yield Commit(tokens, row=row)
            stats.new_tokens += int(holes.sum()) if tpl is not None else len(tokens)
            done += len(tokens)
            canvas_index += 1
            if tpl is not None or ended or done >= total:
                break
            model(torch.tensor([tokens], device=dev), cache=cache, head=False)  # incremental causal prefill
            stats.forwards += 1
    stats.seconds = clock.elapsed()
    stats.ttft = clock.first
    yield Done(stats)


def _denoise_canvas(model: Transformer, cache, holes: Tensor, pins: Tensor, N: int, eos_id: int, no_eos: bool,
                    canvas_index: int, row: int, cfg, gen: torch.Generator):
    """Denoise one canvas (yields Step events); returns (committed tokens, steps)."""
    dev = model.device
    n = holes.shape[0]
    pos = torch.arange(cache.length, cache.length + n, device=dev)
    canvas = renoise(pins, torch.zeros_like(holes), holes, pins, torch.randint(0, N, (n,), generator=gen, device=dev))
    prev_probs = None
    prev_argmax = None
    stable = 0
    S = cfg.max_denoising_steps
    for step in range(1, S + 1):
        T = temperature(step, S, cfg.t_max, cfg.t_min)
        logits = denoise(model, cache, canvas[None], pos, prev_probs)[0] / T  # (n, V) processed logits
        if no_eos:  # a hole inside a template: the text goes on after it
            logits[holes, eos_id] = float("-inf")
        probs = probs_from_logits(logits, 1.0, cfg.top_k, cfg.top_p)  # (n, V) sampling distribution
        ent = entropy(probs)  # (n,)
        candidates = sample_from(probs, gen)  # (n,)
        accepted = entropy_bound_accept(ent, cfg.entropy_bound, holes)
        noise = torch.randint(0, N, (n,), generator=gen, device=dev)
        canvas = renoise(candidates, accepted, holes, pins, noise)
        argmax = torch.where(holes, logits.argmax(-1), pins)
        stable = stable + 1 if prev_argmax is not None and bool(torch.equal(argmax, prev_argmax)) else 0
        prev_argmax = argmax
        prev_probs = torch.softmax(logits, -1)[None]  # self-conditioning of the next step
        mean_ent = float(ent[holes].mean())
        yield Step(canvas.tolist(), (accepted | ~holes).tolist(), step, canvas_index, mean_ent, row)
        if cfg.adaptive and should_stop(stable, mean_ent, cfg.stability_threshold, cfg.confidence_threshold):
            break
    return argmax.tolist(), step
