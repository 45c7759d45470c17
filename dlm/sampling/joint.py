"""Decoding a joint AR + diffusion checkpoint: its AR mode, its diffusion mode, and self-speculation.

`--sampler`:
  ar                   the AR half alone: KV-cached decoding (sampling/ar.py)
  confidence | threshold | entropy_bound | entropy | margin
                       the diffusion half: the mdlm samplers, block by block, the finished blocks
                       written causally as the AR half computes them (sampling/mdlm.py); with
                       --ar-seed (an imported Nemotron-Labs-Diffusion's default) its generate instead
                       (`seeded_program`): blocks from the prompt's end, each seeded by the AR mode; its other
                       settings --bidirectional-context, --shift-logits, --max-thinking-tokens
  self-spec-linear     (auto) two forwards per cycle: a draft pass [last token, <mask> x (B-1)],
                       bidirectional over the cached prefix without writing it (`SelfDraft`), then
                       the one verifier's causal pass over the filled block (sampling/speculative.py)
  self-spec-quadratic  one forward per cycle (`quadratic`): B rows, row i = [d_i, <mask> x B] at
                       positions from c + i; the row-first tokens d_0..d_{B-1} form a causal chain over
                       the cache (their logits verify the draft: the AR mode), the masks of row i see
                       the cache, d_0..d_i (their causal K/V) and the masks of their own row, so they
                       draft the next block as if d_0..d_i were accepted. The first mask slot of a row predicts the same position as the AR
                       logit of d_i, which is used instead; so every cycle yields >= 1 token and the
                       next draft is row n's slots 1..B-1 (n: the accepted drafts). Only the
                       row-first tokens stay in the KV cache (cropped to the accepted ones). --ar-mix-weight W:
                       verify with W x the AR logit + (1 - W) x the first mask slot's (greedy; not lossless)

Both self-speculation modes verify with the one verifier (`verify_greedy`, `verify_sample`): greedy
output (without --ar-mix-weight) equals the model's own AR greedy output token for token; at temperature > 0 it follows the AR
mode's distribution exactly. `--block-size` is B (default: the checkpoint's training block).
Counting: `forwards` are the model's verify passes (quadratic: every pass), `draft_forwards` the
linear mode's draft passes (the same weights: a linear cycle costs forwards + draft_forwards passes).
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch
from torch import Tensor

from dlm.config import DEFAULT_BLOCK_SIZE
from dlm.errors import DlmError, check
from dlm.masks import quadratic_self_spec_mask
from dlm.model import Transformer
from dlm.sampling import ar, mdlm, speculative
from dlm.sampling.common import (
    Clock, Commit, Eos, Event, Prompt, Stats, Step, Verified, eos_set, is_eos, make_generator,
)
from dlm.sampling.rows import Crop, RowProgram, Window, drive, run_one
from dlm.sampling.speculative import (
    Alone, Drafter, Sampling, SpecStats, check_lossless_greedy, run_rows, trim, verify,
)

SELF_SPEC = ("self-spec-linear", "self-spec-linear-ar", "self-spec-quadratic")
SEEDED_FAMILIES = ("nemotron-labs-diffusion",)  # imported families whose diffusion mode is --ar-seed by default
DIFFUSION = mdlm.RULES
SAMPLERS = ("auto", "ar", *SELF_SPEC, *DIFFUSION)
# the SampleConfig fields this sampler reads (see dlm.sampling.OPTIONS): its AR mode's, its diffusion mode's and
# self-speculation's
OPTIONS = ar.OPTIONS | mdlm.OPTIONS | frozenset({"check_lossless", "ar_seed", "draft_threshold", "ar_mix_weight",
                                                  "bidirectional_context", "shift_logits", "max_thinking_tokens",
                                                  "end_think"})


class SelfDraft(Drafter):
    """The linear self-speculation drafter: the model's diffusion mode over the target's own KV cache.

    Follows the drafter protocol of sampling/speculative.py; `bind` hands it the verifier's cache,
    which at every `propose` holds the committed positions before the last committed token.

    ar_first (self-spec-linear-ar): the last committed token attends causally (the cache and itself), so its
    output is the AR mode's next-token logit, and the first draft slot is read from it, as the quadratic mode's
    rows do; the masks still attend to it and to each other. The reference's draft (ar_first False) reads slot 1
    from a mask, which agrees with the AR mode's choice far less often (docs/joint.md, per-slot acceptance).
    """

    kind = "self"  # (row_model None: it asks the target)

    def __init__(self, model: Transformer, mask_id: int, block_size: int, sampling: Sampling, ar_first: bool = False,
                 threshold: float = 0.0):
        self.model, self.mask_id, self.sampling, self.ar_first = model, mask_id, sampling, ar_first
        self.threshold = threshold  # > 0: the draft in passes (--draft-threshold)
        self.default_block_size = block_size
        self.forwards = 0
        self.name = "self-spec-linear-ar" if ar_first else "self-spec-linear"
        self.cache = None

    def fork(self, cfg, gen: torch.Generator | None = None) -> SelfDraft:
        return SelfDraft(self.model, self.mask_id, self.default_block_size, Sampling.of(cfg, gen), self.ar_first,
                         cfg.draft_threshold)

    def bind(self, cache) -> None:
        self.cache = cache

    def answer(self, request):
        if isinstance(request, Crop):
            return self.cache.crop(request.length)
        return run_one(self.model, self.cache, request)

    def draft(self, seq: Tensor, k: int) -> Iterator:
        """A draft pass over the target's cache (it holds the committed positions before the last token), not
        written: a request to the target."""
        if k == 0:
            return seq[:0], None
        block = torch.full((k + 1,), self.mask_id, dtype=torch.long, device=seq.device)
        block[0] = seq[-1]  # at the last committed token's position, the slots after it
        if self.ar_first:  # one quadratic row: the token causal, masks after
            sees = quadratic_self_spec_mask(0, k, 0, seq.device)
            logits = (yield Window(tokens=block, mask=sees, out=(0, k + 1)))[0]  # (k + 1, V)
            logits = torch.cat([logits[:1], logits[2:]])  # slot 1 from the AR logit; the mask there is context only
        elif self.threshold > 0:  # (greedy: checked with the options)
            return (yield from self.draft_in_passes(block))
        else:
            logits = (yield Window(tokens=block, out=(1, k + 1)))[0]  # (k, V)
        self.forwards += 1
        logits[:, self.mask_id] = float("-inf")
        return self.sampling.draw(logits)

    def draft_in_passes(self, block: Tensor) -> Iterator:
        """--draft-threshold T (greedy): passes over [last token, slots] until no slot is a hole, each committing every
        hole whose proposal (the argmax, <mask> among the candidates) has probability >= T, at least the most probable
        (linear_spec_generate with its threshold)."""
        slots = block[1:].clone()  # (k,)
        while bool((slots == self.mask_id).any()):
            logits = (yield Window(tokens=torch.cat([block[:1], slots]), out=(1, len(block))))[0]  # (k, V)
            self.forwards += 1
            p = torch.softmax(logits.float(), dim=-1)
            cand = p.argmax(-1)
            conf = torch.where(slots == self.mask_id, p.gather(-1, cand[:, None])[:, 0], float("-inf"))
            take = conf >= self.threshold
            if not bool(take.any()):
                take = torch.zeros_like(take)
                take[conf.argmax()] = True
            slots = torch.where(take, cand, slots)
        return slots, None


@torch.inference_mode()
def quadratic(model: Transformer, prompt: Sequence[int], *, block_size: int, max_new_tokens: int, mask_id: int,
              sampling: Sampling, eos_id: Eos, row: int = 0, stats: SpecStats | None = None,
              clock: Clock | None = None, ar_mix: float | None = None) -> Iterator[Event]:
    """Quadratic self-speculation of one prompt (Commit and Verified events)."""
    program = quadratic_program(prompt, block_size=block_size, max_new_tokens=max_new_tokens, mask_id=mask_id,
                                sampling=sampling, eos_id=eos_id, row=row, stats=stats, clock=clock, dev=model.device,
                                ar_mix=ar_mix)
    yield from drive(program, Alone(model, quadratic_capacity(len(prompt), max_new_tokens, block_size)))


def quadratic_capacity(P: int, max_new_tokens: int, L: int) -> int:
    return P + max_new_tokens + L * (L + 1) + L + 1


def quadratic_program(prompt: Sequence[int], *, block_size: int, max_new_tokens: int, mask_id: int, sampling: Sampling,
                      eos_id: Eos, row: int = 0, stats: SpecStats | None = None, clock: Clock | None = None,
                      dev: torch.device | str = "cpu", ar_mix: float | None = None) -> Iterator:
    """Quadratic self-speculation of one prompt as a row program (its events, and its requests to the model: one
    pass per cycle, then a Crop of its cache to the accepted row-first tokens). ar_mix W (--ar-mix-weight, greedy):
    row i verifies with W * (d_i's AR logit) + (1 - W) * (its first mask slot's logit, the same position), as
    Nemotron-Labs-Diffusion's self_spec_generate mixes them (no longer the AR mode's output: not lossless), in every
    cycle but the first."""
    stats = stats if stats is not None else SpecStats()
    L = block_size
    prompt = list(prompt)
    c = 0  # the cache holds every committed token but the last (d_0 of the first cycle)
    if len(prompt) > 1:
        yield Window(tokens=torch.tensor(prompt[:-1], device=dev), mask="causal", keep=len(prompt) - 1)
        stats.forwards += 1
        c = len(prompt) - 1
    d0, draft, q = prompt[-1], torch.zeros(0, dtype=torch.long, device=dev), None
    new, first = 0, True
    while new < max_new_tokens:
        m = min(draft.shape[0], max_new_tokens - new - 1)
        draft, q = draft[:m], (q[:m] if q is not None else None)
        firsts = torch.cat([torch.tensor([d0], device=dev), draft])  # (m+1,) d_0 .. d_m
        ids = torch.cat([firsts, torch.full(((m + 1) * L,), mask_id, dtype=torch.long, device=dev)])
        pos = torch.cat([c + torch.arange(m + 1, device=dev),
                         (c + 1 + torch.arange(m + 1, device=dev))[:, None].add(torch.arange(L, device=dev)).flatten()])
        t0 = clock.elapsed() if clock is not None else 0.0
        Q = ids.shape[0]
        logits = (yield Window(tokens=ids, pos=pos, mask=quadratic_self_spec_mask(m, L, 0, dev), keep=m + 1,
                               out=(0, Q)))[0]  # (Q, V)
        stats.forwards += 1
        ar_logits = logits[:m + 1]  # (m+1, V): the AR mode's next-token logits after d_0 .. d_i
        if ar_mix is not None and not first:  # (the first cycle verifies no draft: its token is the AR mode's, as
            # their draft-only first pass's; a row's first mask slot predicts the same position as its AR logit)
            ar_logits = ar_logits * ar_mix + logits[m + 1:].view(m + 1, L, -1)[:, 0] * (1 - ar_mix)
        n, bonus = verify(draft, ar_logits, q, sampling)
        first = False
        c += n + 1  # keep d_0 .. d_n (d_0 was committed before, d_1 .. d_n now)
        yield Crop(c)
        slots = logits[m + 1:].view(m + 1, L, -1)[n, 1:]  # (L-1, V): row n drafts the block after the bonus
        slots[:, mask_id] = float("-inf")
        draft, q = sampling.draw(slots)
        if clock is not None:
            stats.verify_seconds += clock.elapsed() - t0
            clock.mark_first()
        committed = trim(firsts[1:n + 1].tolist() + [bonus], max_new_tokens - new, eos_id)
        stats.add(len(committed))
        new += len(committed)
        yield Verified(firsts[1:].tolist(), n, row=row)
        yield Commit(committed, row=row)
        if committed[-1] in eos_set(eos_id):
            break
        d0 = bonus


# an imported Nemotron-Labs-Diffusion's block diffusion (--ar-seed) -----------------------------------------------

def seeded_capacity(P: int, max_new_tokens: int, L: int) -> int:
    return P + -(-max_new_tokens // L) * L + L


def seeded_program(prompt: Sequence[int], *, block_size: int, max_new_tokens: int, steps: int | None, rule: mdlm.Rule,
                   mask_id: int, temperature: float, gen: torch.Generator | None, eos_id: Eos, stats: Stats,
                   row: int = 0, clock: Clock | None = None, dev: torch.device | str = "cpu",
                   step_events: bool = False, causal: bool = True, shift: bool = False,
                   think: tuple[int, int] | None = None) -> Iterator:
    """Block diffusion seeded by the AR mode, as Nemotron-Labs-Diffusion's `generate` decodes (causal_context on).

    A causal pass writes the prompt to the cache; its last output is the AR mode's next token (argmax, or a draw at
    temperature T from softmax(logits / T)), the first token of the first block. A block is [that token, <mask> x
    (L-1)] right after what the cache holds; each denoising pass runs it over the cache (every position of the block
    seeing every other), not written. A pass proposes argmax(logits) (<mask> among the candidates: a position that
    proposes it stays a hole), at temperature T the argmax of exp(logits) / (-log u)^T with u uniform in float64 per
    entry of the block's logits (LLaDA's Gumbel draw), scored by softmax(logits) of the proposal; it commits the
    rule's choice among the holes: threshold: every hole at or above --threshold and at least the most confident;
    otherwise the rule with the step's budget (the block's holes spread over --steps, default L, the remainder first).
    A block stops early once it holds an <eos> with no hole before it. A causal pass over the whole block then writes
    it to the cache and gives the next block's first token. The answer is cut after its first <eos> (no block
    follows) or at max_new_tokens. step_events: a Step event (the block) after every denoising pass.

    causal False (--bidirectional-context; its causal_context=False): the passes that write the prompt and each
    finished block to the cache attend bidirectionally (every position of the window seeing the whole window and the
    cache), and no AR seed: every block starts all <mask>. shift (--shift-logits; generate_diffusion's shift_logits,
    Dream-style): a pass reads position j's proposal from the output at j - 1, the block's first from the last output
    of the pass that wrote the cache before it.

    think (N, id) (--max-thinking-tokens N, --end-think; its generate's max_thinking_tokens and end_think_token_id): a
    block that reaches past N generated tokens, when the blocks before it hold no `id`, gets `id` at position N of the
    answer (the block's first when N lies before it, over the AR seed), a known token before the first pass."""
    L, P = block_size, len(prompt)
    stop = sorted(eos_set(eos_id))

    def seed_of(logits: Tensor) -> int:  # (1, V) -> the AR mode's next token
        if temperature > 0:
            return int(torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=gen)[0, 0])
        return int(logits[0].argmax())

    context = "causal" if causal else None  # (None: full attention over the window and the cache)
    last = (yield Window(tokens=torch.tensor(list(prompt), device=dev), mask=context, keep=P, out=(P - 1, P)))[0]
    stats.forwards += 1  # last: (1, V) the output at the position before the block
    new, index, made = 0, 0, []
    while new < max_new_tokens:
        block = torch.full((L,), mask_id, dtype=torch.long, device=dev)
        if causal:
            block[0] = seed_of(last)
        if think is not None and index * L + L > think[0] and think[1] not in made:
            block[max(0, think[0] - index * L)] = think[1]
        holes = block == mask_id  # (L,)
        budget = mdlm.step_budget(int(holes.sum()), steps or L)
        for i in range(steps or L):
            if not bool(holes.any()):
                break
            logits = (yield Window(tokens=block, out=(0, L)))[0].float()  # (L, V)
            if shift:
                logits = torch.cat([last.float(), logits[:-1]])
            stats.forwards += 1
            stats.steps += 1
            cand = mdlm.gumbel_draw(logits, temperature, 0, 1.0, gen) if temperature > 0 else logits.argmax(-1)
            conf = torch.softmax(logits, -1).gather(-1, cand[:, None])[:, 0]
            conf = torch.where(holes, conf, float("-inf"))
            if rule.kind == "threshold":
                take = holes & (conf >= rule.threshold)
                take[conf.argmax()] = True
            else:
                k = budget[i] if i < len(budget) else 0
                take = rule.select(conf, conf.new_zeros(L), holes, k, gen) if k else torch.zeros_like(holes)
            block = torch.where(take, cand, block)
            holes = block == mask_id
            if step_events:
                yield Step(block.tolist(), (~holes).tolist(), i + 1, canvas_index=index, row=row, offset=new)
            ends = is_eos(block, stop).nonzero()
            if len(ends) and not bool(holes[:int(ends[0, 0])].any()):
                break
        last = (yield Window(tokens=block, mask=context, keep=L, out=(L - 1, L)))[0]
        stats.forwards += 1
        stats.canvases += 1
        made += block.tolist()
        out = block.tolist()[:max_new_tokens - new]
        ends = [j for j, t in enumerate(out) if t in stop]
        out = out[:ends[0] + 1] if ends else out
        stats.new_tokens += len(out)
        new += len(out)
        if clock is not None:
            clock.mark_first()
        yield Commit(out, row=row)
        index += 1
        if ends:
            break


def seeded(ck, cfg) -> bool:
    """Whether a joint checkpoint's diffusion mode runs seeded_program: --ar-seed, else its family's default."""
    return cfg.ar_seed if cfg.ar_seed is not None else ck.config.get("family") in SEEDED_FAMILIES


def seeded_row(model: Transformer, ck, prompt: list[int], cfg, sampler: str, row: int, stats: Stats,
               clock: Clock | None, gen: torch.Generator | None, step_events: bool = False) -> Iterator:
    """seeded_program for one prompt, its options checked (its generate's two rules, temperature only)."""
    rule = mdlm.check_options(cfg.replace(sampler=sampler))
    if rule.kind not in ("confidence", "threshold") or rule.random:
        raise DlmError(f"--ar-seed decodes as Nemotron-Labs-Diffusion's generate: --sampler confidence (low-confidence "
                       f"remasking) or threshold, got --sampler {sampler}"
                       + (" --remasking random" if rule.random else "") + " (--no-ar-seed for dlm's own layout)")
    if cfg.top_k or cfg.top_p < 1:
        raise DlmError("--ar-seed draws as Nemotron-Labs-Diffusion's generate does (temperature only): "
                       "--top-k and --top-p do not apply")
    return seeded_program(prompt, block_size=block_of(ck, cfg), max_new_tokens=cfg.max_new_tokens, steps=cfg.steps,
                          rule=rule, mask_id=ck.mask_id, temperature=cfg.temperature, gen=gen,
                          eos_id=ck.tokenizer.eos_set, stats=stats, row=row, clock=clock, dev=model.device,
                          step_events=step_events, causal=not cfg.bidirectional_context, shift=cfg.shift_logits,
                          think=thinking(ck, cfg))


def seeded_stream(model: Transformer, ck, prompts: list[Prompt], cfg, sampler: str,
                  step_events: bool = False) -> Iterator[Event]:
    """Each prompt in turn through seeded_program (row r seeded cfg.seed + r); one Done."""
    clock, stats = Clock(), Stats()
    programs = [seeded_row(model, ck, p.ids, cfg, sampler, r, stats, clock,
                           make_generator(mdlm.row_seed(cfg.seed, r), model.device), step_events)
                for r, p in enumerate(prompts)]
    for p, program in zip(prompts, programs):
        yield from drive(program, Alone(model, seeded_capacity(len(p.ids), cfg.max_new_tokens, block_of(ck, cfg))))
    yield clock.finish(stats)


# the sampler ----------------------------------------------------------------------------------------

def resolve_sampler(cfg) -> str:
    """The mode a request runs (auto: self-spec-linear); refuses one that does not belong to a joint checkpoint."""
    sampler = "self-spec-linear" if cfg.sampler == "auto" else cfg.sampler
    if sampler not in SAMPLERS:
        raise DlmError(f"--sampler {cfg.sampler} does not belong to a joint checkpoint "
                       f"(allowed: {', '.join(SAMPLERS)})")
    return sampler


def check_draft_threshold(cfg, sampler: str) -> None:
    T = cfg.draft_threshold
    check(0 <= T <= 1, f"--draft-threshold must be in [0, 1] (0 = one pass), got {T}")
    check(T == 0 or (sampler == "self-spec-linear" and cfg.temperature == 0),
          f"--draft-threshold is the greedy draft of --sampler self-spec-linear (linear_spec_generate's threshold); "
          f"got --sampler {sampler} at --temperature {cfg.temperature}")
    W = cfg.ar_mix_weight
    check(W is None or 0 <= W <= 1, f"--ar-mix-weight must be in [0, 1], got {W}")
    check(W is None or (sampler == "self-spec-quadratic" and cfg.temperature == 0),
          f"--ar-mix-weight mixes the greedy verification of --sampler self-spec-quadratic (self_spec_generate's "
          f"ar_mix_weight); got --sampler {sampler} at --temperature {cfg.temperature}")


def thinking(ck, cfg) -> tuple[int, int] | None:
    """--max-thinking-tokens N with --end-think TEXT: (N, the token's id), or None."""
    if cfg.max_thinking_tokens is None:
        return None
    check(cfg.max_thinking_tokens >= 0, f"--max-thinking-tokens must be >= 0, got {cfg.max_thinking_tokens}")
    i = ck.tokenizer.tk.token_to_id(cfg.end_think)
    check(i is not None, f"--end-think {cfg.end_think!r} is not a token of this tokenizer (--max-thinking-tokens "
                         f"injects it as one token)")
    return cfg.max_thinking_tokens, i


def check_seeded_options(ck, cfg, sampler: str) -> None:
    """--bidirectional-context, --shift-logits and --max-thinking-tokens belong to the --ar-seed layout
    (Nemotron-Labs-Diffusion's generate)."""
    for on, flag in ((cfg.bidirectional_context, "--bidirectional-context"), (cfg.shift_logits, "--shift-logits"),
                     (cfg.max_thinking_tokens is not None, "--max-thinking-tokens")):
        check(not on or (sampler in DIFFUSION and seeded(ck, cfg)),
              f"{flag} applies to the diffusion mode in Nemotron-Labs-Diffusion's generate layout (--ar-seed, "
              f"--sampler confidence or threshold); got --sampler {sampler}"
              + (" --no-ar-seed" if sampler in DIFFUSION else ""))


def block_of(ck, cfg) -> int:
    """The block of self-speculation: --block-size, else the checkpoint's, else DEFAULT_BLOCK_SIZE."""
    B = cfg.block_size if cfg.block_size is not None else (ck.block_size or DEFAULT_BLOCK_SIZE)
    check(2 <= B <= speculative.MAX_BLOCK, f"--block-size must be in [2, {speculative.MAX_BLOCK}], got {B}")
    return B


def row_program(model: Transformer, ck, prompt: Prompt, cfg, row: int = 0, *, clock: Clock | None = None,
                step_events: bool = False, logprobs: int | None = None) -> RowProgram:
    """A request as a row of a batch over the joint model (the server's), in its mode: the AR mode, self-speculation
    or diffusion, sampling with a generator seeded cfg.seed. Raises on bad options, before any work."""
    sampler = resolve_sampler(cfg)
    check_draft_threshold(cfg, sampler)
    check_seeded_options(ck, cfg, sampler)
    if sampler == "ar":
        return ar.row_program(model, ck, prompt, cfg.replace(sampler="auto"), row, logprobs=logprobs)
    gen = make_generator(cfg.seed, model.device)
    if sampler in DIFFUSION and seeded(ck, cfg):
        st = Stats()
        return RowProgram(seeded_row(model, ck, prompt.ids, cfg, sampler, row, st, clock, gen, step_events), st)
    if sampler in DIFFUSION:
        job, rule, c = mdlm.row_job(model, ck, prompt, cfg.replace(sampler=sampler))
        st = Stats(extra={"steps_per_canvas": []})
        program, window, answer = mdlm.batch_row(model, job, rule, c, row, st, ck.mask_id, ck.tokenizer.eos_set, gen,
                                                 clock, step_events)
        return RowProgram(program, st, window, answer)
    B = block_of(ck, cfg)
    ar.check_options(model, [prompt], cfg, "self-speculation")
    check_lossless_greedy(cfg)
    sampling = Sampling.of(cfg, gen)
    spec = SpecStats()
    if sampler == "self-spec-quadratic":
        program = quadratic_program(prompt.ids, block_size=B, max_new_tokens=cfg.max_new_tokens, mask_id=ck.mask_id,
                                    sampling=sampling, eos_id=ck.tokenizer.eos_set, row=row, stats=spec, clock=clock,
                                    dev=model.device, ar_mix=cfg.ar_mix_weight)
        return RowProgram(program, spec)
    d = SelfDraft(model, ck.mask_id, B, sampling, ar_first=sampler == "self-spec-linear-ar",
                  threshold=cfg.draft_threshold)
    program = speculative.speculation(d, prompt.ids, block_size=B, max_new_tokens=cfg.max_new_tokens,
                                      sampling=sampling, eos_id=ck.tokenizer.eos_set, row=row, stats=spec, clock=clock,
                                      dev=model.device)
    return RowProgram(program, spec, drafter=d)


def stream(model: Transformer, ck, prompts: list[Prompt], cfg, step_events: bool = False) -> Iterator[Event]:
    """A joint checkpoint's sampler (cfg: SampleConfig): AR mode, diffusion mode or self-speculation."""
    sampler = resolve_sampler(cfg)
    if cfg.check_lossless and not sampler.startswith("self-spec"):
        raise DlmError(f"--check-lossless checks self-speculation (--sampler self-spec-linear, self-spec-quadratic) "
                       f"against the AR mode; --sampler {sampler} does not speculate: there is nothing to check")
    check_draft_threshold(cfg, sampler)
    check_seeded_options(ck, cfg, sampler)
    if sampler in DIFFUSION and seeded(ck, cfg):
        return seeded_stream(model, ck, prompts, cfg, sampler, step_events)
    if sampler in DIFFUSION:
        return mdlm.stream(model, ck, prompts, cfg.replace(sampler=sampler), step_events)
    if sampler == "ar":
        return ar.stream(model, ck, prompts, cfg.replace(sampler="auto"))
    B = block_of(ck, cfg)
    if sampler in ("self-spec-linear", "self-spec-linear-ar"):
        drafter = SelfDraft(model, ck.mask_id, B, Sampling(), ar_first=sampler == "self-spec-linear-ar",
                            threshold=cfg.draft_threshold)
        return speculative.stream(model, ck, prompts, cfg, drafter)  # (the drafter's default block is B)
    ar.check_options(model, prompts, cfg, "self-speculation")
    check_lossless_greedy(cfg)

    def row(b: int, p: list[int], sampling: Sampling, spec: SpecStats, clock: Clock) -> tuple:
        program = quadratic_program(p, block_size=B, max_new_tokens=cfg.max_new_tokens, mask_id=ck.mask_id,
                                    sampling=sampling, eos_id=ck.tokenizer.eos_set, row=b, stats=spec, clock=clock,
                                    dev=model.device, ar_mix=cfg.ar_mix_weight)
        return program, None, quadratic_capacity(len(p), cfg.max_new_tokens, B)

    return run_rows(model, ck, [p.ids for p in prompts], cfg, row, "self-spec-quadratic", B)
