"""Samplers: one contract for every paradigm.

    stream(model, ck, prompts, cfg, drafter=None) -> Iterator[Event]

model: the network a checkpoint describes (`dlm.checkpoint.load_model`); ck: its Checkpoint
(tokenizer, paradigm, training meta); prompts: Prompt objects (or plain lists of token ids), one
output row each; cfg: one SampleConfig. The events end with exactly one Done (dlm.sampling.common
defines the events and the statistics). The paradigm comes from the checkpoint; a drafter (`cfg.draft`,
or a `drafter` object already loaded) makes it speculative decoding of an AR target.

    ar           sampling/ar.py            prefill, then one token per forward with the KV cache
    mdlm         sampling/mdlm.py          masked diffusion, block by block over a KV cache
    usdm         sampling/usdm.py          DiffusionGemma's entropy-bound canvas sampler
    joint        sampling/joint.py         AR mode, diffusion mode, self-speculation (linear, quadratic)
    speculative  sampling/speculative.py   the one lossless verifier and the drafters

`generate()` is the text-in, text-out wrapper that drains the stream.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator, Sequence

from torch import nn

from dlm.checkpoint import Checkpoint
from dlm.config import check_seed
from dlm.errors import DlmError
from dlm.sampling import ar, joint, mdlm, speculative, usdm
from dlm.sampling.common import Clock, Done, Event, Prompt, Result, drain
from dlm.sampling.infill import encode_prompt
from dlm.sampling.rows import batch_stats, batchable

SAMPLERS = {"ar": ar, "mdlm": mdlm, "usdm": usdm, "joint": joint}

# The one table of options: the SampleConfig fields each paradigm's sampler reads, as each sampler declares them
# next to its code. `dlm generate`'s warnings, the server's 400s and the bench's method options derive from it.
# An option a sampler reads to refuse (usdm's --temperature) counts as read: its error is the message.
OPTIONS = {name: s.OPTIONS for name, s in SAMPLERS.items()} | {"speculative": speculative.OPTIONS}
EVERY = frozenset({"max_new_tokens", "seed"})  # read by every sampler


def options_read(paradigm: str, drafter_kind: str | None = None) -> frozenset[str]:
    """The options a paradigm's sampler reads (speculative decoding: less those another kind of drafter reads)."""
    reads = OPTIONS[paradigm] | EVERY
    if paradigm == "speculative" and drafter_kind is not None:
        reads -= {o for o, (kinds, _) in speculative.DRAFTER_OPTIONS.items() if drafter_kind not in kinds}
    return reads


@dataclass
class SampleConfig:
    """Sampling options (each paradigm reads the ones that concern it).

    Attributes:
        max_new_tokens: tokens to generate at most (infilling: the middle's length)
        temperature: 0 = greedy; > 0 samples (AR, speculative, mdlm)
        top_k: keep the k most likely tokens (0 = off)
        top_p: nucleus sampling mass in (0, 1]
        seed: makes sampling reproducible
        naive: AR, mdlm: recompute the whole sequence every step (no KV cache)
        sampler: confidence | threshold | entropy_bound | entropy | margin | origin (mdlm); entropy_bound (usdm); ar | self-spec-linear | self-spec-linear-ar | self-spec-quadratic | confidence | threshold | entropy_bound | entropy | margin (joint); auto = the paradigm's default
        steps: denoising steps per block (mdlm; default: one token per step; threshold / entropy_bound: at most this many) or per canvas at most (usdm; default 48)
        threshold: mdlm threshold sampler: commit every position with confidence above this
        entropy_bound: entropy-bound acceptance: cumulative entropy minus its largest entropy <= this
        block_size: a block of positions: mdlm's semi-autoregressive block (default: the checkpoint's training block, else the whole generation); speculative: the block of one verify cycle, the last committed token + block_size-1 proposals (default: the drafter's: its block size for DFlash, 5 for an AR draft, 8 for lookup)
        remasking: mdlm: low_confidence | random
        preset: mdlm: a public model's decoding recipe: llada | fast-dllm | dream | sdar | fast-dllm-v2 | llada2 | none (options given explicitly win; default: the one an imported checkpoint records, docs/public-models.md)
        prefix_cache: mdlm, a full-attention checkpoint (LLaDA, Dream): Fast-dLLM's approximate prefix cache (a block's later passes read the K/V its first pass computed for the positions before it); off = exact, the whole sequence every step
        schedule: mdlm: positions committed per step: even (a block's holes spread evenly over --steps, LLaDA) or dream (Dream's time grid, linspace(1, 1e-3, steps + 1): int(holes x (1 - t[i+1] / t[i])), the rest at the last step)
        whole_blocks: mdlm: pad the last block with holes to its full size and denoise it whole, as training saw blocks (SDAR, Fast-dLLM v2); what lies past --max-new-tokens is dropped
        eos_early_stop: mdlm: stop denoising the positions after a committed <eos> at once (fewer passes; the tokens before it may differ from the public models' own generate, which denoises the block whole and cuts after the <eos>: the default)
        confidence: mdlm: the probability the commit rules read: model (the model's probability of the proposed token) or sampled (at temperature > 0, its probability under the distribution it was drawn from, temperature and top-k/top-p applied: SDAR's generate; the sdar preset's)
        mask_proposals: mdlm: keep <mask> among the candidates a step proposes (a position whose proposal is <mask> stays masked), as LLaDA's, Dream's and SDAR's own generate functions do (their presets set it); off: <mask> is never proposed
        draw_holes: mdlm at temperature > 0: a draw only for the positions still masked, one each in order (torch's categorical draw), the confidence, entropy and margin read from the distribution drawn from (Dream's sample_tokens; the dream preset's); default: a draw for every position of the block, the scores from the model's own distribution
        sub_block: mdlm: commit only in the first stretch of this many positions of the block that still has holes (Fast-dLLM v2: 8); default: the whole block
        revise: mdlm revision (ReMDM-style): a committed token whose probability under a later pass falls below this goes back to <mask> and is predicted again (at most 3 times per position); 0 = off
        canvas_length: usdm: tokens per canvas (default: the checkpoint's)
        t_max: usdm: temperature of the first step
        t_min: usdm: temperature approached at the last step
        stability_threshold: usdm adaptive stopping: steps the argmax canvas must stay unchanged
        confidence_threshold: usdm adaptive stopping: mean entropy below which a canvas may stop
        adaptive: usdm: stop a canvas early (adaptive stopping); off = always the full number of steps
        self_cond_input: usdm: what the next step is self-conditioned on: tempered (the softmax of the temperature-scaled logits, as DiffusionGemma's reference sampler) or untempered (their T = 1 softmax, what training feeds)
        last_canvas: usdm, when --max-new-tokens ends inside a canvas: whole (denoise a whole canvas, as DiffusionGemma's generate does; what lies past --max-new-tokens is dropped) or fit (a canvas of only the positions left); default: whole for an imported DiffusionGemma, fit for dlm's own usdm checkpoints
        suffix: infilling: text after the hole (pinned, comes out byte-exact)
        fill_length: template markers: positions per <fill> (<fill:N> asks for N)
        draft: speculative decoding: a drafter checkpoint folder, or 'lookup' (prompt lookup)
        draft_passes: DFlash: denoising passes per draft (1-3; later passes re-predict the slots below 0.9 confidence)
        draft_top_k: DFlash 2: candidates per slot the selector chooses among (default: the drafter's selector_top_k, what it was trained with); at T > 0 more candidates give its proposal distribution more of the target's support
        lookup_ngram: prompt lookup: longest n-gram to match in the context
        check_lossless: speculative: also run the target alone and report whether the outputs agree
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    naive: bool = False
    # diffusion (mdlm, usdm)
    sampler: str = "auto"
    steps: int | None = None
    threshold: float = 0.9
    entropy_bound: float = 0.1
    block_size: int | None = None
    remasking: str = "low_confidence"
    preset: str | None = None
    prefix_cache: bool = False
    sub_block: int | None = None
    schedule: str = "even"
    whole_blocks: bool = False
    eos_early_stop: bool = False
    confidence: str = "model"
    mask_proposals: bool = False
    draw_holes: bool = False
    revise: float = 0.0
    canvas_length: int | None = None
    t_max: float = 0.8
    t_min: float = 0.4
    stability_threshold: int = 1
    confidence_threshold: float = 0.005
    adaptive: bool = True
    self_cond_input: str = "tempered"
    last_canvas: str | None = None
    suffix: str | None = None
    fill_length: int = 16
    # speculative decoding
    draft: str | None = None
    draft_passes: int = 1
    draft_top_k: int | None = None
    lookup_ngram: int = 3
    check_lossless: bool = False

    def replace(self, **kw) -> SampleConfig:
        return dataclasses.replace(self, **kw)


def stream(model: nn.Module, ck: Checkpoint, prompts: Sequence[Prompt | Sequence[int]], cfg: SampleConfig,
           drafter: speculative.Drafter | None = None, step_events: bool = False) -> Iterator[Event]:
    """The event stream of the sampler that fits the checkpoint's paradigm (or the drafter). step_events: the
    diffusion samplers also yield a Step (the canvas) after every denoising step, a host read per step that only
    a live view or a test needs."""
    if isinstance(prompts, str) or any(isinstance(p, str) for p in prompts):
        raise TypeError("stream() takes Prompts or token ids; encode text with dlm.sampling.encode()")
    ps = [p if isinstance(p, Prompt) else Prompt(list(p)) for p in prompts]
    if not ps:
        raise DlmError("no prompt given")
    if cfg.seed is not None:
        check_seed(cfg.seed)
    if cfg.draft or drafter is not None:
        if drafter is None:  # built once, here, before the sampler runs (dlm.drafters: every kind in one place)
            from dlm.drafters import load_drafter

            drafter = load_drafter(cfg.draft, model, ck, passes=cfg.draft_passes, lookup_ngram=cfg.lookup_ngram,
                                   top_k=cfg.draft_top_k)
        return speculative.stream(model, ck, ps, cfg, drafter)
    if ck.objective not in SAMPLERS:
        raise DlmError(f"checkpoint {ck.path}: objective {ck.objective!r} has no sampler "
                       f"(samplers exist for {sorted(SAMPLERS)}; a dflash drafter is used with --draft)")
    return SAMPLERS[ck.objective].stream(model, ck, ps, cfg, step_events)


def stream_rows(model: nn.Module, ck: Checkpoint, prompts: Sequence[Prompt | Sequence[int]], cfgs: Sequence[SampleConfig],
                step_events: bool = False, drafter: speculative.Drafter | None = None) -> Iterator[Event]:
    """Rows that each bring their own SampleConfig, its seed included (row r samples with a generator seeded
    cfgs[r].seed, not seed + r): eval's cases, the server's requests. mdlm and usdm checkpoints, and speculative
    decoding with `drafter` (each row its own fork of it), run them as rows of one batch (one forward per step and
    model for all of them); other paradigms, --naive and models the row batch cannot run take them one after
    another. Events carry their row; one Done: totals, each row's own counters in
    extra["rows"]. Bad options raise here, before any work."""
    ps = [p if isinstance(p, Prompt) else Prompt(list(p)) for p in prompts]
    cfgs = list(cfgs)
    if not ps or len(ps) != len(cfgs):
        raise DlmError(f"stream_rows: {len(ps)} prompts and {len(cfgs)} sampling configs (one each, at least one)")
    for c in cfgs:
        if c.seed is not None:
            check_seed(c.seed)
    if drafter is not None:
        return speculative.stream_rows(model, ck, ps, cfgs, drafter)
    if (ck.objective in ("mdlm", "usdm") and batchable(model) and mdlm.rows_fit(ck)
            and not any(c.naive or c.draft for c in cfgs)):
        return SAMPLERS[ck.objective].stream_rows(model, ck, ps, cfgs, step_events)
    streams = [stream(model, ck, [p], c, step_events=step_events) for p, c in zip(ps, cfgs)]  # (checks first)
    return _in_turn(streams)


def _in_turn(streams: list[Iterator[Event]]) -> Iterator[Event]:
    clock = Clock()
    per_row = []
    for r, events in enumerate(streams):
        for ev in events:
            if isinstance(ev, Done):
                per_row.append(ev.stats)
                continue
            ev.row = r
            yield ev
    stats = batch_stats(per_row, sum(st.forwards for st in per_row))
    yield clock.finish(stats)


def encode(ck: Checkpoint, texts: str | Sequence[str], cfg: SampleConfig) -> list[Prompt]:
    """Text requests as Prompts (plain continuation, or infilling/templates per cfg.suffix and markers)."""
    texts = [texts] if isinstance(texts, str) else list(texts)
    return [encode_prompt(ck.tokenizer, t, cfg.suffix, cfg.max_new_tokens, cfg.fill_length) for t in texts]


def generate(model: nn.Module, ck: Checkpoint, prompts: str | list[str], cfg: SampleConfig | None = None,
             keep_events: bool = False) -> Result:
    """Sample and decode: the Python entry point behind `dlm generate`."""
    cfg = cfg or SampleConfig()
    ps = encode(ck, prompts, cfg)
    return drain(stream(model, ck, ps, cfg, step_events=keep_events), ck.tokenizer.text, ck.tokenizer.eos_ids,
                 rows=len(ps), keep_events=keep_events)
