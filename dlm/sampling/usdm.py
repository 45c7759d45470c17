"""The uniform-state diffusion sampler (DiffusionGemma's entropy-bound sampler).

Per canvas of L tokens at the positions they will hold once committed:

  1. the canvas starts as uniform random tokens (pinned template/suffix tokens stay put);
  2. each step runs the denoiser (bidirectional over the canvas, reading the encoder's cache
     without writing it), self-conditioned on the previous step's temperature-scaled logits
     (nothing on the first step; `self_cond_input="untempered"` feeds their T = 1 softmax instead,
     which is what training conditions on); temperature T = t_min + (t_max - t_min) * remaining / max_steps;
  3. a candidate token is sampled at every position; entropy-bound acceptance keeps the
     lowest-entropy positions whose cumulative entropy minus its largest term is <= the bound
     (at least one); every other position is re-noised with a fresh uniform token. Acceptance is
     decided anew each step, so tokens can be revised;
  4. adaptive stopping: stop once the argmax canvas has not changed for `stability_threshold`
     steps and the mean entropy is below `confidence_threshold`, or after `--steps` (default 48);
  5. commit the argmax of the last step's processed logits; tokens after the first <eos> (any of the
     tokenizer's EOS ids) are dropped and generation ends; otherwise an incremental causal prefill appends the canvas to
     the cache and the next canvas begins, until `max_new_tokens`. last_canvas "whole" (an imported DiffusionGemma's
     default, what its generate does): every canvas is whole, the last one too, what lies past `max_new_tokens`
     dropped; "fit" (dlm's own checkpoints' default): the last canvas holds only the positions left.

The arithmetic is the reference sampler's (transformers' DiffusionGemma generate), draw for draw from a generator
seeded as torch.manual_seed(seed) seeds the global one: the canvas's uniform draw, then per step the candidates
(multinomial) and the re-noise draw; the temperature as an fp32 tensor, entropies by Categorical's formula, the
acceptance and stopping comparisons in fp32. A self-conditioned model can amplify a difference of one float step
from one step to the next, so "about equal" arithmetic gives different samples.

A model trained with `--canvas-shift` (ModelConfig.canvas_shift) predicts canvas token j from the
denoiser's output at j - 1, and token 0 from the encoder's next-token logits after the text before the
canvas (from the prefill, which then computes the head at its last position): every rule above acts on
these aligned logits.

Infilling (`--suffix`) and templates (`<fill>` markers) are one canvas whose pinned tokens are
never re-noised; <eos> is not allowed inside their holes (the text continues after them).
An empty prefix starts from <eos>, the separator every training document follows.
The prompts of a call run as rows of one batch (every row's next pass in one forward; a row whose canvas
stops adaptively goes on to its next canvas, or leaves), row r sampling with its own generator seeded seed + r.

`forwards` counts every model call: the prompt prefill, every denoising step and the prefill of
each committed canvas that more text follows. With several rows the Done's `forwards` counts the batched
calls and extra["rows"] holds each row's own counters (its forwards: as many as it takes alone).
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch import Tensor

from dlm.errors import DlmError, check
from dlm.model import Transformer, align_canvas_logits
from dlm.sampling.common import (
    Clock, Commit, Eos, Event, Prompt, Stats, Step, check_fits, check_sampling, entropy,
    eos_set, make_generator, probs_from_logits, sample_from, through_eos,
)
from dlm.sampling.rows import Programs, RowProgram, Window, alone, batch_stats, batchable, drive

DEFAULT_STEPS = 48  # DiffusionGemma's max_denoising_steps
# the SampleConfig fields this sampler reads (see dlm.sampling.OPTIONS); --temperature is read to be refused with
# its own message (the temperature follows the t_max -> t_min schedule)
OPTIONS = frozenset({"temperature", "top_k", "top_p", "sampler", "steps", "entropy_bound", "canvas_length", "t_max",
                     "t_min", "stability_threshold", "confidence_threshold", "adaptive", "self_cond_input", "last_canvas", "suffix",
                     "fill_length"})


# plain functions (each testable on hand-made inputs) -----------------------------------------

def temperature(step: int, max_steps: int, t_max: float, t_min: float) -> Tensor:
    """Temperature of 1-based `step`: t_max on the first step, t_min + (t_max - t_min) / max_steps on the last.
    A 0-dim fp32 tensor, computed as DiffusionGemma's generate computes it (the remaining steps as an int32 tensor
    over max_steps): a temperature one float32 step apart moves the samples of a model whose self-conditioning
    amplifies small differences."""
    remaining = torch.tensor(max_steps - step + 1, dtype=torch.int32)
    return t_min + (t_max - t_min) * (remaining / max_steps)


def logits_entropy(logits: Tensor) -> Tensor:
    """Entropy in nats of the distributions softmax(logits) (..., V) -> (...), by torch.distributions.Categorical's
    arithmetic (the reference sampler's): normalised log-probabilities, clamped at the dtype's smallest value."""
    lp = logits - logits.logsumexp(-1, keepdim=True)
    return -(lp.clamp(min=torch.finfo(lp.dtype).min) * torch.softmax(lp, -1)).sum(-1)


def accept_by_entropy(ent: Tensor, bound: float, free: Tensor | None = None) -> Tensor:
    """DiffusionGemma's entropy-bound acceptance among the free positions, by its arithmetic: their entropies
    sorted ascending (in ent's dtype), a position kept where the cumulative entropy minus its own entropy (the
    largest so far) is <= bound. The lowest always passes (0 <= bound). ent (n,), free (n,) bool (default: all)
    -> (n,) bool."""
    free = torch.ones(ent.shape, dtype=torch.bool, device=ent.device) if free is None else free
    accept = torch.zeros_like(free)
    idx = free.nonzero().squeeze(1)
    if idx.numel() == 0:
        return accept
    e, order = torch.sort(ent[idx], dim=-1, descending=False)
    accept[idx[order]] = e.cumsum(-1) - e <= bound
    return accept


def renoise(candidates: Tensor, accepted: Tensor, holes: Tensor, pins: Tensor, noise: Tensor) -> Tensor:
    """The next canvas: accepted candidates, fresh noise at every other hole, pins where pinned. All (n,)."""
    return torch.where(holes, torch.where(accepted, candidates, noise), pins)


def should_stop(stable_steps: int, mean_entropy: float | Tensor, stability_threshold: int,
                confidence_threshold: float) -> bool:
    """Adaptive stopping: the argmax canvas unchanged for enough steps and the model confident enough (a tensor
    mean_entropy is compared in its own dtype, as the reference sampler compares it)."""
    return stable_steps >= stability_threshold and bool(mean_entropy < confidence_threshold)


def canvas_size(L: int, left: int, room: int, last_canvas: str) -> int:
    """Positions of the next canvas: L (last_canvas whole: a canvas is always whole, as DiffusionGemma's generate
    denoises it), or only the `left` tokens still wanted when fewer (fit); never more than the context's `room`."""
    return min(L if last_canvas == "whole" else min(L, left), room)


def span(p: Prompt, L: int, total: int, ctx: int, last_canvas: str) -> int:
    """Positions a row occupies in its cache at most: its prompt and every canvas it may denoise."""
    if p.canvas is not None or last_canvas != "whole":
        return len(p.ids) + total
    return min(ctx, len(p.ids) + -(-total // L) * L)


# options -------------------------------------------------------------------------------------

def check_options(model: Transformer, ck, cfg) -> tuple[int, int]:
    """Refuse what does not belong to a usdm sampler; returns (canvas length, steps per canvas at most)."""
    if cfg.sampler not in ("auto", "entropy_bound"):
        raise DlmError(f"--sampler {cfg.sampler} does not belong to a usdm checkpoint (allowed: auto, entropy_bound)")
    if cfg.block_size is not None:
        raise DlmError("--block-size is an mdlm / speculative option; a usdm checkpoint uses --canvas-length")
    check(cfg.temperature == 0,
          f"--temperature does not apply to usdm (its schedule is --t-max/--t-min), got {cfg.temperature}")
    check_sampling(1.0, cfg.top_k, cfg.top_p)
    ctx = model.cfg.max_seq_len
    L = cfg.canvas_length if cfg.canvas_length is not None else ck.canvas_length
    check(0 < L <= ctx, f"--canvas-length must be in [1, {ctx}] (the model's context), got {L}")
    check(cfg.max_new_tokens > 0, f"--max-new-tokens must be > 0, got {cfg.max_new_tokens}")
    steps = DEFAULT_STEPS if cfg.steps is None else cfg.steps
    check(steps > 0, f"--steps must be > 0, got {steps}")
    check(cfg.entropy_bound > 0, f"--entropy-bound must be > 0, got {cfg.entropy_bound}")
    check(cfg.t_min > 0, f"--t-min must be > 0, got {cfg.t_min}")
    check(cfg.t_min <= cfg.t_max, f"--t-min ({cfg.t_min}) must be <= --t-max ({cfg.t_max})")
    check(cfg.stability_threshold >= 1, f"--stability-threshold must be >= 1, got {cfg.stability_threshold}")
    check(cfg.confidence_threshold >= 0, f"--confidence-threshold must be >= 0, got {cfg.confidence_threshold}")
    check(cfg.self_cond_input in ("tempered", "untempered"),
          f"--self-cond-input must be tempered or untempered, got {cfg.self_cond_input!r}")
    check(cfg.last_canvas in (None, "whole", "fit"), f"--last-canvas must be whole or fit, got {cfg.last_canvas!r}")
    return L, steps


def with_last_canvas(ck, cfg):
    """cfg with last_canvas resolved: given, or the checkpoint's: whole for an imported DiffusionGemma (what its
    generate denoises), fit for dlm's own usdm checkpoints (a last canvas of only the positions left)."""
    if cfg.last_canvas is not None:
        return cfg
    imported = (ck.config.get("hf_config") or {}).get("model_type") == "diffusion_gemma"
    return cfg.replace(last_canvas="whole" if imported else "fit")


# the sampler ---------------------------------------------------------------------------------

def stream(model: Transformer, ck, prompts: list[Prompt], cfg, step_events: bool = False) -> Iterator[Event]:
    """Events of usdm generation for each prompt (cfg: SampleConfig). Bad options raise here, before any work.
    step_events: a Step event after every denoising step (the live view, the server's step streaming, tests)."""
    L, steps = check_options(model, ck, cfg)
    cfg = with_last_canvas(ck, cfg)
    tok = ck.tokenizer
    jobs = [row_prompt(ck, model, p, cfg) for p in prompts]
    return _generate(model, jobs, L, steps, ck.noise_vocab, tok.eos_set, cfg, step_events)


def row_prompt(ck, model: Transformer, p: Prompt, cfg) -> Prompt:
    """A request as a row: an empty prompt starts from <eos>, as documents do; refused when it does not fit."""
    p = Prompt(list(p.ids) or [ck.tokenizer.eos_id], p.canvas)
    check_fits(model.cfg.max_seq_len, p, cfg.max_new_tokens)
    return p


def row_seed(seed: int | None, row: int) -> int | None:
    """Row r of a call samples with its own generator seeded seed + r (as the server's n choices)."""
    return None if seed is None else seed + row


def _generate(model: Transformer, jobs: list[Prompt], L: int, steps: int, N: int, eos_id: Eos,
              cfg, step_events: bool = False) -> Iterator[Event]:
    """Rows in one batch when the model allows (one forward per step for every row), else one after another."""
    if len(jobs) > 1 and batchable(model):
        return _generate_batched(model, jobs, L, steps, N, eos_id, cfg, step_events)
    return _generate_in_turn(model, jobs, L, steps, N, eos_id, cfg, step_events)


@torch.inference_mode()
def _generate_in_turn(model: Transformer, jobs: list[Prompt], L: int, steps: int, N: int, eos_id: Eos,
                      cfg, step_events: bool = False) -> Iterator[Event]:
    clock = Clock()
    stats = Stats(extra={"steps_per_canvas": []})
    for row, p in enumerate(jobs):
        gen = make_generator(row_seed(cfg.seed, row), model.device)
        total = len(p.canvas) if p.canvas is not None else cfg.max_new_tokens
        cache = model.new_cache(1, span(p, L, total, model.cfg.max_seq_len, cfg.last_canvas))

        yield from drive(_row(p, L, steps, N, eos_id, cfg, gen, row, clock, stats, step_events, model.device,
                              model.cfg.max_seq_len, model.cfg.canvas_shift), alone(model, cache))
    yield clock.finish(stats)


def _generate_batched(model: Transformer, jobs: list[Prompt], L: int, steps: int, N: int, eos_id: Eos,
                      cfg, step_events: bool = False) -> Iterator[Event]:
    n = len(jobs)
    return _rows(model, jobs, [L] * n, [steps] * n, N, eos_id, [cfg] * n, [row_seed(cfg.seed, r) for r in range(n)],
                 step_events)


def stream_rows(model: Transformer, ck, prompts: list[Prompt], cfgs: list, step_events: bool = False) -> Iterator[Event]:
    """Rows that each bring their own SampleConfig (row r seeded cfgs[r].seed) in one batch (dlm.sampling.stream_rows).
    Bad options raise here, before any work."""
    Ls, steps = zip(*(check_options(model, ck, c) for c in cfgs))
    cfgs = [with_last_canvas(ck, c) for c in cfgs]
    jobs = [row_prompt(ck, model, p, c) for p, c in zip(prompts, cfgs)]
    return _rows(model, jobs, list(Ls), list(steps), ck.noise_vocab, ck.tokenizer.eos_set, cfgs,
                 [c.seed for c in cfgs], step_events)


@torch.inference_mode()
def _rows(model: Transformer, jobs: list[Prompt], Ls: list[int], steps: list[int], N: int, eos_id: Eos, cfgs: list,
          seeds: list, step_events: bool = False) -> Iterator[Event]:
    clock = Clock()
    longest = max(span(p, L, len(p.canvas) if p.canvas is not None else c.max_new_tokens, model.cfg.max_seq_len,
                       c.last_canvas) for p, c, L in zip(jobs, cfgs, Ls))
    batch = Batch(model, 2 * longest)
    per_row = []
    for row, (p, c) in enumerate(zip(jobs, cfgs)):
        st = Stats(extra={"steps_per_canvas": []})
        per_row.append(st)
        for _, ev in batch.add(p, Ls[row], steps[row], N, eos_id, c, row, st,
                               gen=make_generator(seeds[row], model.device), clock=clock, step_events=step_events):
            yield ev
    while len(batch):
        for _, ev in batch.step():
            yield ev
    yield clock.finish(batch_stats(per_row, batch.forwards))


class Batch(Programs):
    """usdm rows denoised side by side: every live row's next pass (a denoising step of its canvas, or the prefill of
    its prompt or of a committed canvas) in one forward; a row whose canvas stops adaptively moves on (or leaves)
    while the others go on. Each row keeps its own options and generator."""

    def __init__(self, model: Transformer, capacity: int):
        super().__init__(model, capacity)
        self.model = model

    def add(self, p: Prompt, L: int, steps: int, N: int, eos_id: Eos, cfg, row: int, stats: Stats, *,
            tag: object = None, gen: torch.Generator | None = None, clock: Clock | None = None,
            step_events: bool = False) -> list[tuple[object, Event]]:
        """A new row (p: its prompt, an empty one already replaced by <eos>; cfg: its SampleConfig; gen: its
        generator, default seeded row_seed(cfg.seed, row)); returns its events before its first pass (none)."""
        gen = gen if gen is not None else make_generator(row_seed(cfg.seed, row), self.model.device)
        return self.add_row(_row_program(self.model, p, L, steps, N, eos_id, cfg, row, stats, gen, clock, step_events),
                            tag)


def row_program(model: Transformer, ck, prompt: Prompt, cfg, row: int = 0, *, step_events: bool = False) -> RowProgram:
    """A request as a row of a batch (the server's), sampling with a generator seeded cfg.seed. Raises on bad options,
    before any work."""
    L, steps = check_options(model, ck, cfg)
    cfg = with_last_canvas(ck, cfg)
    p = row_prompt(ck, model, prompt, cfg)
    stats = Stats(extra={"steps_per_canvas": []})
    return _row_program(model, p, L, steps, ck.noise_vocab, ck.tokenizer.eos_set, cfg, row, stats,
                        make_generator(cfg.seed, model.device), None, step_events)


def _row_program(model: Transformer, p: Prompt, L: int, steps: int, N: int, eos_id: Eos, cfg, row: int, stats: Stats,
                 gen: torch.Generator, clock: Clock | None, step_events: bool) -> RowProgram:
    """The row's program yields its Windows itself (prefill, canvases): the row's window and answer are the identity."""
    program = _row(p, L, steps, N, eos_id, cfg, gen, row, clock, stats, step_events, model.device,
                   model.cfg.max_seq_len, model.cfg.canvas_shift)
    return RowProgram(program, stats)


def prefill(ids: list[int], shift: bool, dev: torch.device) -> Iterator[Window]:
    """A row program's request to append ids to its cache (causal); returns the next-token logits after them (1, 1, V)
    fp32 for a canvas_shift model (they predict the next canvas's first token), else None (no head is computed)."""
    m = len(ids)
    out = yield Window(tokens=torch.tensor(ids, device=dev), mask="causal", keep=m, out=(m - 1, m) if shift else (0, 0))
    return out.float() if shift else None


def _row(p: Prompt, L: int, steps: int, N: int, eos_id: Eos, cfg, gen: torch.Generator, row: int,
         clock: Clock | None, stats: Stats, step_events: bool, dev: torch.device, ctx: int, shift: bool):
    """One row as a program: its events, and a Window whenever it needs the model (its outputs are sent back in): the
    prefill of its prompt and of each committed canvas, a denoiser pass per step. The one-row driver and a batch run
    the same code."""
    total = len(p.canvas) if p.canvas is not None else cfg.max_new_tokens
    first = yield from prefill(list(p.ids), shift, dev)  # the prompt
    stats.forwards += 1
    done = 0  # tokens of this row committed
    canvas_index = 0
    while True:
        if p.canvas is not None:
            holes = torch.tensor([c is None for c in p.canvas], device=dev)
            pins = torch.tensor([0 if c is None else c for c in p.canvas], device=dev)
        else:
            n = canvas_size(L, total - done, ctx - len(p.ids) - done, cfg.last_canvas)
            holes = torch.ones(n, dtype=torch.bool, device=dev)
            pins = torch.zeros(n, dtype=torch.long, device=dev)
        tokens, used = yield from _canvas_program(holes, pins, N, eos_id, p.canvas is not None, canvas_index, row,
                                                  done, steps, cfg, gen, first, step_events, dev, stats)
        stats.canvases += 1
        stats.steps += used
        stats.extra["steps_per_canvas"].append(used)
        stats.forwards += used
        ended = False
        if p.canvas is None:  # what lies past max_new_tokens is dropped, then what follows the first EOS
            tokens, ended = through_eos(tokens[:total - done], eos_id)
        if clock is not None:
            clock.mark_first()
        yield Commit(tokens, row=row)
        stats.new_tokens += int(holes.sum()) if p.canvas is not None else len(tokens)
        done += len(tokens)
        canvas_index += 1
        if p.canvas is not None or ended or done >= total:
            break
        first = yield from prefill(tokens, shift, dev)  # incremental causal prefill
        stats.forwards += 1


def _canvas_program(holes: Tensor, pins: Tensor, N: int, eos_id: Eos, no_eos: bool, canvas_index: int, row: int,
                    offset: int, S: int, cfg, gen: torch.Generator, first: Tensor | None, step_events: bool,
                    dev: torch.device, stats: Stats | None = None):
    """One canvas as a program: Step events and a denoiser pass per step (bidirectional over the canvas, reading the
    row's cache without writing it, self-conditioned on the previous step's distribution: its logits (1, n, V) come
    back); returns (committed tokens, steps used).
    stats: the model's log-probability (T = 1) of the committed holes at the last step is added to extra["logprob"]
    (what --best-of ranks draws by)."""
    n = holes.shape[0]
    stop = sorted(eos_set(eos_id))
    canvas = renoise(pins, torch.zeros_like(holes), holes, pins, torch.randint(0, N, (n,), generator=gen, device=dev))
    prev_probs = None
    prev_argmax = None
    stable = 0
    for step in range(1, S + 1):
        T = temperature(step, S, cfg.t_max, cfg.t_min)
        out = yield Window(tokens=canvas, canvas=True, probs=prev_probs, out=(0, n))  # (1, n, V)
        raw = align_canvas_logits(out.float(), first)[0]  # (n, V) clean
        if no_eos:  # a hole inside a template: the text goes on after it
            raw[holes.nonzero(), torch.tensor(stop, dtype=torch.long, device=dev)] = float("-inf")  # (holes, EOS ids)
        logits = raw / T  # processed logits
        probs = probs_from_logits(logits, 1.0, cfg.top_k, cfg.top_p)  # (n, V) sampling distribution
        plain = cfg.top_k == 0 and cfg.top_p == 1.0
        ent = logits_entropy(logits) if plain else entropy(probs)  # (n,) entropy of the sampling distribution
        candidates = sample_from(probs, gen)  # (n,)
        accepted = accept_by_entropy(ent, cfg.entropy_bound, holes)
        noise = torch.randint(0, N, (n,), generator=gen, device=dev)
        canvas = renoise(candidates, accepted, holes, pins, noise)
        argmax = torch.where(holes, logits.argmax(-1), pins)
        stable = stable + 1 if prev_argmax is not None and bool(torch.equal(argmax, prev_argmax)) else 0
        prev_argmax = argmax
        # self-conditioning of the next step: the tempered softmax (the reference sampler), or the T = 1 softmax
        # that training feeds (untempered)
        if cfg.self_cond_input == "tempered" and plain:
            prev_probs = probs  # (the same softmax of the same logits: probs_from_logits divides by 1.0)
        else:
            prev_probs = torch.softmax(logits if cfg.self_cond_input == "tempered" else raw, -1)
        mean_ent = ent[holes].mean()
        if step_events:
            yield Step(canvas.tolist(), (accepted | ~holes).tolist(), step, canvas_index, float(mean_ent), row, offset)
        if cfg.adaptive and should_stop(stable, mean_ent, cfg.stability_threshold, cfg.confidence_threshold):
            break
    if stats is not None:
        lp = torch.log_softmax(raw.float(), -1).gather(-1, argmax[:, None])[:, 0]
        stats.extra["logprob"] = stats.extra.get("logprob", 0.0) + float(lp[holes].sum())
    return argmax.tolist(), step
