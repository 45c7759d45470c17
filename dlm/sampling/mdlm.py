"""Masked-diffusion sampling (LLaDA, Fast-dLLM, entropy-bounded), block by block over a KV cache.

The sequence (prompt + generation, or prompt + template canvas) is cut into blocks on a grid of
`block_size` positions counted from position 0, as in training, so the prompt's last partial block
is denoised together with the first generated tokens (its prompt tokens pinned). Each block starts
with its holes set to <mask>; every denoising step runs the block against the cache (bidirectional
inside the block, the finished blocks before it in the cache), proposes a token for every masked
position and commits some of them by a rule:

  confidence     LLaDA: the k most confident positions (probability of the proposed token), k from a
                 budget that spreads the block's holes over `--steps` (low-confidence remasking);
                 `--remasking random` picks the k positions at random instead; `--remasking sequential`
                 (SDAR's `sequential`) the k positions from the block's first hole on, left to right (a
                 position in that stretch that is no longer a hole, after a <mask> proposal left one before
                 it, is drawn again, as there)
  threshold      Fast-dLLM: every position whose confidence is above `--threshold` (at least one; strictly above,
                 as Fast-dLLM, SDAR and Fast-dLLM v2 compare: `--threshold 1` commits the budget's most confident)
  entropy_bound  sort positions by entropy ascending; accept the longest prefix whose cumulative
                 entropy minus its largest entropy <= `--entropy-bound` (at least one).
                 `--entropy-form sdar` (the sdar preset) is SDAR's `entropy_bounded` as published instead
                 (select_sdar_entropy): its "entropy" is one number for the whole block, the sum over the
                 block's positions of -p log p, p the probability of the token drawn at each position (its
                 sum runs over the block, not over the vocabulary), so the holes commit in order, as many
                 as multiples of that number stay below the bound (at least one); and a block gets at most
                 `--steps` + 1 passes: one that takes them all keeps its holes (<mask> in the output) and
                 is left out of the context of every later block, even when its last pass filled it, as
                 SDAR's generate never writes it to its KV cache (that write opens the pass after the last
                 hole); the row then recomputes the whole sequence each pass, `--naive`'s way
  entropy        Dream's entropy order: the k positions whose predictive distribution has the lowest
                 entropy, k from the same budget as confidence
  margin         top-probability margin (Kim et al. 2025, "Train for the worst, plan for the best"): every
                 position whose two most likely tokens are more than `--threshold` apart in probability, at
                 least the k with the widest margin (k from the budget); `--threshold 1` is the pure order
                 (the k widest margins). A position torn between two tokens waits, however likely the
                 first of them
  origin         Dream's `alg="origin"`: at step i of --steps every masked position is committed with
                 probability 1 - t[i+1] / t[i] on Dream's time grid (all at the last step), one uniform draw
                 per masked position in order from the row's generator (with --seed S, the draws of
                 torch.manual_seed(S) on the CPU, as Dream's generate draws them); with --draw-holes at
                 temperature > 0 the tokens are drawn after those uniforms, for the positions chosen only, as
                 Dream draws them

`--alg-temp A` (Dream's `alg_temp`; confidence, entropy and margin): the k positions a step commits are drawn
without replacement with probabilities softmax(score / A) over the row's whole sequence (torch.multinomial from the
row's generator, after the step's token draws: with --seed S, Dream's draws after torch.manual_seed(S)) instead of
the k with the highest score. 0 (the default): the top k.

With `--steps` the adaptive rules commit at least the budget of the step too, so a block never takes
more than `--steps` passes (without `--revise`).

`--revise P` (revision, in the spirit of ReMDM, Wang et al. 2025): masked diffusion commits a token for
good, so an early mistake stays and the cells after it are fitted around it. With revision, each pass
also reads the probability the model now gives to every token this block has already committed (the
logits at its position, where the token is visible; no extra forward); a committed token whose
probability has fallen below P goes back to <mask>, and is proposed again from the next pass on (not in
the pass that revised it). A position is sent back at most `MAX_REVISIONS` times, so a block ends; a
committed <eos>, the prompt's tokens and pinned tokens are never revised. Off (0), nothing changes.

`--schedule dream`: how many positions a step commits follows Dream's time grid (dream_count) instead of
spreading the block's holes evenly over `--steps` (LLaDA's). `--schedule block` (the llada2 presets): the block's
length is spread over `--steps`, however many of its positions are prompt tokens (LLaDA 2's generate: a block that
holds the prompt's tail commits the same number per step as any other).

`--editing-threshold E` (LLaDA 2.1's token editing, the llada2.1 preset): every pass also re-reads the tokens this
block has already committed (not the prompt's): where the model's most likely token differs from the committed one
with probability above E, it replaces it, in the same pass that commits masks. Once the block has no hole left,
up to `--max-post-steps` more passes only edit; the block ends at the first of them that changes nothing (LLaDA
2.1's generate, step for step). With editing, every pass proposes (at temperature > 0: draws) a token for every
position of the block, and the masks and the edits read the same proposals, as LLaDA 2.1 does. Off (no E): committed
tokens stay.

`--mask-proposals` (the llada, dream and sdar presets): <mask> stays among the tokens a step proposes, as in those
families' own generate functions (a position whose proposal is <mask> stays a hole; a trained model rarely proposes
it); past the planned --steps it is excluded, so a block always ends. Off: <mask> is never proposed.

`--threshold-cap` (the dream preset; the threshold rule with --steps): the step's quota (the block's holes spread
evenly over --steps) is the most a step commits, not the least: the most confident positions above `--threshold`, at
least the most confident; what a step leaves is carried to the next, and past --steps the passes go on while the
block's quota is not spent (Dream's `alg="confidence_threshold"`, its generate's `left_tokens_last_step`).

`--leave-holes` (the dream preset): a block ends after its planned passes (--steps; with --threshold-cap once its
quota is spent) even with holes left, which stay <mask> in the output and in what later blocks read, and <mask>
stays among the proposals on every pass (Dream's generate and Fast-dLLM's Dream block decoding: with one step per
block over the prefix cache the block's first position alone is written). Off, and with --revise (its passes go on
past the plan): a block is denoised until it has no hole.

`--gumbel` (the llada preset): at temperature > 0 a pass draws as LLaDA's generate does, float64 Gumbel noise for every
token of every position of the whole sequence (gumbel_draw), so that `--seed S` gives the tokens LLaDA's generate gives
after torch.manual_seed(S). The distribution is the same as the default draw's (one Exp(1) race per position of the
block); the draws are L x V float64 uniforms a pass instead of N x V float32 ones.

`--whole-blocks` (SDAR, Fast-dLLM v2): the last block is padded with holes to its full size and denoised whole,
as in training; what lies past `--max-new-tokens` is dropped.

`--sub-block N` (Fast-dLLM v2's sub-blocks): every pass still denoises the whole block, but a step commits
only inside the first N-position stretch of the block (counted from its start) that still has holes, and reads
(at temperature > 0: draws for) that stretch's positions only, as Fast-dLLM v2's generate draws.

`--block-cache` (with --sub-block; Fast-dLLM v2's `use_block_cache`): a pass whose sub-block starts with a known
token runs that sub-block's positions only, over the cache, which then holds the block's K/V as its last whole pass
computed them; the sub-block's own K/V are written over theirs (Window.at). A whole pass runs when a sub-block
starts with a hole, and on a block's first pass after its first token is known. An approximation (the rest of the
block's K/V are stale), as Fast-dLLM v1's prefix cache is; off, every pass runs the whole block.

`--greedy-first` (the fast-dllm-v2 preset; shifted checkpoints): the first token of a block after a finished one,
committed alone from the finished block's last output, is that output's argmax at any temperature (Fast-dLLM v2's
generate appends it so; no draw is taken for it).

Two conventions a checkpoint records (public models imported by dlm.hf_mdlm carry them; a checkpoint dlm
trains has neither):

  shift: true         position i's output predicts token i + 1 (Dream, Fast-dLLM v2: models adapted from an
                      AR checkpoint keep its next-token alignment); a block's first position is predicted by
                      the output at the position before it (with block-causal context: the last position of
                      the finished block, computed blind to this block, so its prediction is final from the
                      first pass: that pass commits it alone, autoregressively, as Fast-dLLM v2 appends a
                      block's first token before denoising the rest, and as Fast-dLLM decodes Dream over its
                      prefix cache); position 0 by its own output
  context: "full"     every position attends to every other, the holes after the block included, and the
                      prompt to the canvas (LLaDA, Dream: trained without blocks). Blocks then only order the
                      commits; they are laid from the end of the prompt (LLaDA's semi-autoregressive
                      remasking). Exact decoding runs the whole sequence at every step (no cache: any change
                      anywhere changes every K/V); `--prefix-cache` is Fast-dLLM's approximation: a block's
                      first pass runs the whole sequence and keeps the K/V of the positions before the
                      block, which its later passes read instead of recomputing them; `--dual-cache` (its
                      dual cache) keeps the first pass's K/V of the positions after the block too, and the
                      later passes run the block alone (its K/V written over its own slots, the keys in
                      position order as in a full pass). At temperature > 0 with --gumbel the draws are
                      Fast-dLLM's: noise for every position a pass runs, twice a pass over the prefix cache
                      (its loop's first draw is unused), and the draws of the pass its cached functions run
                      after a block that the first pass filled (taken here without the forward: idle_draws).
                      Shifted (Dream): a block's first pass commits its first position
                      alone, whatever the rule's count, as Fast-dLLM's Dream block
                      decoding does

`--preset NAME` sets a family's published recipe (PRESETS below: the rule, block, steps, threshold,
cache); an option given explicitly wins. A checkpoint may record its family's preset, used when none
is named (`--preset none`: dlm's own defaults).

Pinned tokens (the prompt's tail, a suffix, a template's text) are never masked and come out
byte-exact. A continuation ends at its first committed <eos>: the block that holds it is denoised whole
(its positions after the <eos> too, as the public models' own generate functions do: they change how many
positions each step commits and what the positions before the <eos> see), the output is cut after it and no
block follows. `--eos-early-stop` stops denoising the positions after a committed <eos> at once (fewer
passes; the tokens before it may then differ from the authors' code).

A finished block is written to the cache with the block-causal mask of training (it sees itself and
the blocks before). That write is folded into the next block's first denoising pass: one forward
runs [finished blocks not yet cached ; current block], the finished rows blind to the current block,
and the cache is then cropped back to the finished blocks. The prompt's full blocks are folded into
the first pass the same way, so every forward is a denoising step. `--naive` recomputes the whole
sequence under the same mask at every step instead (no cache): the reference the cached loop must
match token for token.

Several prompts run as rows of one batch (`Batch`, over dlm/sampling/rows.py): every step, one forward
serves each row's next pass, each row with its own blocks, K/V slots, positions, mask, options and
generator (row r seeded seed + r), so a row's tokens are the ones it gets alone; a row whose generation
ended leaves. The Done's `forwards` then counts the batched calls, extra["rows"] each row's own counters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Iterator

import torch
from torch import Tensor

from dlm.errors import DlmError, check
from dlm.masks import mdlm_denoise_mask
from dlm.sampling.common import (
    Clock, Commit, Eos, Event, Prompt, Stats, Step, check_fits, check_sampling, draw, entropy, entropy_bound_accept,
    eos_index, eos_set, filtered_logits, is_eos, make_generator, probs_from_logits,
)
from dlm.sampling.rows import Crop, Programs, RowProgram, Window, alone, batch_stats, batchable, drive, finish

RULES = ("confidence", "threshold", "entropy_bound", "entropy", "margin", "origin")
MAX_REVISIONS = 3  # --revise: times one position may be sent back to <mask> (so a block always ends)
# the SampleConfig fields this sampler reads (see dlm.sampling.OPTIONS)
OPTIONS = frozenset({"temperature", "top_k", "top_p", "naive", "sampler", "steps", "threshold", "entropy_bound",
                     "block_size", "remasking", "revise", "suffix", "fill_length", "preset", "prefix_cache",
                     "dual_cache",
                     "sub_block", "block_cache", "greedy_first", "schedule", "whole_blocks", "eos_early_stop",
                     "confidence", "mask_proposals", "draw_holes", "gumbel", "editing_threshold", "max_post_steps",
                     "alg_temp", "logits_eos_inf", "confidence_eos_eot_inf", "cfg_scale", "entropy_form",
                     "threshold_cap", "leave_holes", "redraw_committed"})

# The published decoding recipes of the public masked-diffusion families, as SampleConfig settings (docs/public-
# models.md has a command for each). steps: per block; block_size None: the whole generation.
PRESETS: dict[str, dict] = {
    # LLaDA: low-confidence remasking, semi-autoregressive blocks of 32, one token per step (steps = gen length)
    "llada": {"sampler": "confidence", "block_size": 32, "steps": 32, "mask_proposals": True, "gumbel": True},
    # Fast-dLLM (v1) on LLaDA / Dream: every position with confidence > 0.9 (at least one), blocks of 32 over the
    # prefix cache
    "fast-dllm": {"sampler": "threshold", "threshold": 0.9, "block_size": 32, "prefix_cache": True},
    # Dream: entropy-ordered unmasking over the whole generation on its time grid (steps default: one per token)
    # (--sampler threshold: its confidence_threshold, at most steps' even quota a step; a block ends after its --steps,
    # holes left as <mask>, as Dream's and Fast-dLLM's Dream block decoding end)
    "dream": {"sampler": "entropy", "schedule": "dream", "mask_proposals": True, "draw_holes": True,
              "threshold_cap": True, "leave_holes": True},
    # SDAR: blocks of 4 over the KV cache, 4 steps per block, low_confidence_dynamic at 0.9
    # (its quota: the block's length over the steps, prompt positions included; entropy_bounded as published)
    "sdar": {"sampler": "threshold", "threshold": 0.9, "block_size": 4, "steps": 4, "whole_blocks": True,
             "confidence": "sampled", "mask_proposals": True, "schedule": "block", "entropy_form": "sdar",
             "redraw_committed": True},
    # Fast-dLLM v2: blocks of 32 over the KV cache, threshold 0.9 within sub-blocks of 8; sampled: a block's first
    # token its argmax, the others drawn (<mask> among the candidates) and thresholded on the drawn token's probability
    "fast-dllm-v2": {"sampler": "threshold", "threshold": 0.9, "block_size": 32, "sub_block": 8,
                     "whole_blocks": True, "greedy_first": True, "confidence": "sampled", "mask_proposals": True},
    # LLaDA 2: blocks of 32 over the KV cache, 32 steps per block, every position above 0.95 (else the step's quota,
    # the block's length over the steps), <mask> among the candidates, sampled: the drawn token's probability
    "llada2": {"sampler": "threshold", "threshold": 0.95, "block_size": 32, "steps": 32, "whole_blocks": True,
               "schedule": "block", "mask_proposals": True, "confidence": "sampled"},
    # LLaDA 2.1 (quality mode, its model card): LLaDA 2's recipe with masks committed above 0.7 and token editing
    # above 0.5, up to 16 editing passes after a block's last mask
    "llada2.1": {"sampler": "threshold", "threshold": 0.7, "block_size": 32, "steps": 32, "whole_blocks": True,
                 "schedule": "block", "mask_proposals": True, "confidence": "sampled", "editing_threshold": 0.5,
                 "max_post_steps": 16},
}


def apply_preset(cfg, recorded: str | None = None):
    """cfg (SampleConfig) with a preset's settings for the options the user did not set (cfg.given) and that are
    still at their defaults: cfg.preset, else the checkpoint's recorded one; "none": no preset."""
    name = cfg.preset if cfg.preset is not None else recorded
    if name in (None, "none"):
        return cfg
    if name not in PRESETS:
        raise DlmError(f"--preset must be one of {', '.join(['none', *PRESETS])}, got {name!r}")
    defaults = type(cfg)()
    return cfg.replace(**{k: v for k, v in PRESETS[name].items()
                          if k not in cfg.given and getattr(cfg, k) == getattr(defaults, k)})


# the acceptance rules (plain functions over one block's positions) ------------------------------

def step_budget(n: int, steps: int) -> list[int]:
    """Positions to unmask at each of min(steps, n) steps: n spread evenly, the remainder first."""
    s = max(1, min(steps, n))
    base, rem = divmod(n, s)
    return [base + (i < rem) for i in range(s)]


def dream_count(holes: int, step: int, steps: int, eps: float = 1e-3) -> int:
    """Positions to unmask at step `step` of `steps` with `holes` still masked, by Dream's schedule: times
    t = linspace(1, eps, steps + 1), int(holes * (1 - t[step + 1] / t[step])) (fp32, as Dream computes it), every
    remaining hole at the last step. Early steps may unmask none."""
    if step >= steps - 1:
        return holes
    t = torch.linspace(1, eps, steps + 1)
    return int(torch.tensor(float(holes)) * (1 - t[step + 1] / t[step]))


def top_k_of(score: Tensor, masked: Tensor, k: int, span: tuple[int, int] | None = None,
             over: bool = False) -> Tensor:
    """Bool (N,): the k masked positions with the highest score (all of them if fewer). span (offset, total): the
    scores are ranked inside a row of `total` positions, -inf outside the block, as LLaDA's and Dream's generate rank
    them (torch.topk then breaks exact ties, such as confidences of 1, as theirs does). over (--redraw-committed): k
    above the masked positions takes the rest from the others, the ones torch.topk picks among their -inf scores (as
    SDAR's generate does: they are drawn again)."""
    k = min(k, (span[1] if span is not None else len(masked)) if over else int(masked.sum()))
    chosen = torch.zeros_like(masked)
    if k > 0:
        score = torch.where(masked, score.float().nan_to_num(neginf=-1e30), float("-inf"))  # masked ones first
        if span is None:
            chosen[score.topk(k).indices] = True
        else:
            row = score.new_full((span[1],), float("-inf"))
            row[span[0]:span[0] + len(score)] = score
            idx = row.topk(k).indices - span[0]
            chosen[idx[(idx >= 0) & (idx < len(masked))]] = True
    return chosen


def draw_k_of(score: Tensor, masked: Tensor, k: int, temp: float, gen: torch.Generator | None,
              span: tuple[int, int] | None = None) -> Tensor:
    """Bool (N,): k masked positions drawn without replacement with probabilities softmax(score / temp), the scores
    placed in a row of span's `total` positions (-inf elsewhere) as Dream's generate places them (its alg_temp: one
    torch.multinomial over the row, the same draws from the same generator). If the softmax underflows everywhere:
    the top k."""
    k = min(k, int(masked.sum()))
    chosen = torch.zeros_like(masked)
    if k <= 0:
        return chosen
    at, total = span if span is not None else (0, len(masked))
    row = score.new_full((total,), float("-inf"), dtype=torch.float32)
    row[at:at + len(score)] = torch.where(masked, score.float(), float("-inf"))
    probs = torch.softmax(row / temp, dim=-1)  # (total,)
    if not bool(torch.isfinite(probs).all()):
        return top_k_of(score, masked, k, span)
    idx = torch.multinomial(probs, k, generator=gen) - at
    idx = idx[(idx >= 0) & (idx < len(masked))]  # (a zero-probability pick outside the block: none is committed)
    chosen[idx] = True
    return chosen & masked


def select_confidence(conf: Tensor, masked: Tensor, k: int, span: tuple[int, int] | None = None) -> Tensor:
    """LLaDA low-confidence remasking: keep the k most confident proposals, re-mask the rest."""
    return top_k_of(conf, masked, k, span)


def select_random(masked: Tensor, k: int, gen: torch.Generator | None,
                  span: tuple[int, int] | None = None) -> Tensor:
    """LLaDA random remasking: k masked positions chosen uniformly at random. span (offset, total): one draw for
    every position of a sequence of `total` (LLaDA's generate draws torch.rand over the whole sequence each step),
    the block's N from `offset` on read."""
    if span is None:
        score = torch.rand(masked.shape, generator=gen, device=masked.device)
    else:
        score = torch.rand(span[1], generator=gen, device=masked.device)[span[0]:span[0] + len(masked)]
    return top_k_of(score, masked, k)


def select_sequential(masked: Tensor, k: int) -> Tensor:
    """SDAR's sequential remasking: bool (N,), the k positions from the first masked one on (fewer at the block's
    end). A position in that stretch that is no longer masked (a <mask> proposal kept a hole before it) is chosen
    too: SDAR's generate draws it again."""
    chosen = torch.zeros_like(masked)
    at = masked.nonzero()
    if len(at):
        chosen[int(at[0]):int(at[0]) + int(k)] = True
    return chosen


def select_sdar_entropy(conf: Tensor, masked: Tensor, bound: float) -> Tensor:
    """SDAR's entropy_bounded as its generate.py computes it: conf (N,) the probability of the token drawn at every
    position of the block (the drawn distribution's), masked (N,) -> bool (N,). Its per-position "entropy" sums
    -p log p over the block's positions (conf is (B, L) there, summed over L), so every masked position has the same
    value; sorted ascending (torch.sort: the masked ones in its order), the first k are committed, k the number of
    prefix sums below the bound (torch.searchsorted, fp32), at least one."""
    p = conf.float()[None].clamp_min(1e-12)  # (1, N), as there
    ent = torch.where(masked[None], -(p * p.log()).sum(dim=-1), torch.inf)  # (1, N)
    ranked, order = torch.sort(ent, dim=1, descending=False)
    k = torch.searchsorted(torch.cumsum(ranked, dim=1)[0], torch.tensor(bound, device=conf.device), right=False)
    k = max(1, min(int(k), int(masked.sum())))
    chosen = torch.zeros_like(masked)
    chosen[order[0, :k]] = True
    return chosen


def select_threshold(conf: Tensor, masked: Tensor, threshold: float, k_min: int = 1,
                     span: tuple[int, int] | None = None, first: bool = False, at_most: bool = False,
                     over: bool = False) -> Tensor:
    """Fast-dLLM: every masked position with confidence above threshold, at least the k_min most confident. first
    (k_min 1): the one is the first of the most confident (an argmax, as Fast-dLLM v2's generate takes it), not
    torch.topk's pick among equals (confidences of exactly 1 under top-p). at_most (--threshold-cap, Dream's
    confidence_threshold): k_min is the most it commits instead, the most confident of those above the threshold, at
    least the most confident of all. over: see top_k_of (--redraw-committed)."""
    chosen = masked & (conf > threshold)
    if at_most:
        return top_k_of(conf, masked, max(1, min(int(k_min), int(chosen.sum()))), span)
    if int(chosen.sum()) >= k_min:
        return chosen
    if first and k_min == 1:
        chosen[torch.where(masked, conf.float(), float("-inf")).argmax()] = True
        return chosen
    return top_k_of(conf, masked, k_min, span, over)


def origin_transfer(step: int, steps: int, eps: float = 1e-3) -> float | Tensor:
    """Dream's `alg="origin"`: the probability that a masked position is committed at step `step` of `steps`,
    1 - t[step + 1] / t[step] on t = linspace(1, eps, steps + 1) (fp32, as Dream computes it); 1 at the last."""
    if step >= steps - 1:
        return 1
    t = torch.linspace(1, eps, steps + 1)
    return 1 - t[step + 1] / t[step]


def select_origin(masked: Tensor, p: float | Tensor, gen: torch.Generator | None) -> Tensor:
    """Dream's origin: each masked position independently with probability p, one uniform draw per masked position
    in order (torch.rand(n) < p, as Dream draws them)."""
    chosen = torch.zeros_like(masked)
    at = masked.nonzero()[:, 0]
    chosen[at] = torch.rand(len(at), generator=gen, device=masked.device) < p
    return chosen


def select_entropy_bound(ent: Tensor, masked: Tensor, bound: float, k_min: int = 1) -> Tensor:
    """The lowest-entropy prefix whose cumulative entropy minus its largest entropy <= bound (>= k_min)."""
    return entropy_bound_accept(ent, bound, masked, k_min)


@dataclass(frozen=True)
class Rule:
    """Which positions a denoising step commits."""

    kind: str = "confidence"  # confidence | threshold | entropy_bound | entropy | margin | origin
    threshold: float = 0.9
    bound: float = 0.1
    random: bool = False  # confidence: random remasking instead of low-confidence
    sequential: bool = False  # confidence: SDAR's sequential remasking (select_sequential)
    form: str = "eb"  # entropy_bound: eb (the EB-sampler's acceptance) or sdar (SDAR's as published: select_sdar_entropy)
    sampled: bool = False  # confidence read from the distribution the token was drawn from (SDAR), not the model's
    holes: bool = False  # at temperature > 0: draw for the masked positions only, every score from the drawn
    # distribution (Dream's sample_tokens)
    gumbel: bool = False  # at temperature > 0: LLaDA's float64 Gumbel draw over the whole sequence (gumbel_draw)
    alg_temp: float = 0.0  # > 0: the k positions are drawn, softmax(score / alg_temp) (Dream's alg_temp, draw_k_of)
    no_eos: int | None = None  # --logits-eos-inf: this <eos> id's logit is -inf before the draw
    eos_eot: tuple[int, ...] = ()  # --confidence-eos-eot-inf: <eos> then <|eot_id|> (if the tokenizer has one)
    cfg_scale: float = 0.0  # --cfg-scale: classifier-free guidance against a pass with the known tokens masked
    first: bool = False  # threshold: the at-least-one is the first most confident (--sub-block: Fast-dLLM v2's argmax)
    cap: bool = False  # threshold: the step's count is the most it commits, the rest carried (--threshold-cap)
    leave: bool = False  # a block ends after its planned passes, holes or not (--leave-holes)
    redraw: bool = False  # confidence / threshold: a count above the holes re-draws committed positions (SDAR's)

    def top(self, score: Tensor, masked: Tensor, k: int, gen: torch.Generator | None,
            span: tuple[int, int] | None) -> Tensor:
        """The k masked positions with the highest score, or with alg_temp drawn by it."""
        if self.alg_temp:
            return draw_k_of(score, masked, k, self.alg_temp, gen, span)
        return top_k_of(score, masked, k, span, self.redraw and self.kind == "confidence")

    def hidden(self, temperature: float) -> tuple[int, ...]:
        """The ids whose confidence is read as 0 (--confidence-eos-eot-inf): the softmax the confidence reads has
        their logits at -inf. As LLaDA's generate: <eos> and <|eot_id|> greedy; at temperature > 0 <|eot_id|> only
        (its <eos> assignment goes to the noised copy of the logits, after the draw)."""
        return self.eos_eot if temperature == 0 else self.eos_eot[1:]

    def select(self, conf: Tensor, ent: Tensor, masked: Tensor, k: int | float | Tensor, gen: torch.Generator | None,
               margin: Tensor | None = None, span: tuple[int, int] | None = None) -> Tensor:
        """k: positions to commit at least (origin: the probability of each); span: see select_random."""
        if self.kind == "origin":
            return select_origin(masked, k, gen)
        if self.kind == "threshold":
            return select_threshold(conf, masked, self.threshold, k, span, self.first, self.cap, self.redraw)
        if self.kind == "margin":  # (margin: top_margin of the step's logits)
            chosen = masked & (margin > self.threshold)
            return chosen if int(chosen.sum()) >= k else self.top(margin, masked, k, gen, span)
        if self.kind == "entropy_bound":
            if self.form == "sdar":
                return select_sdar_entropy(conf, masked, self.bound)
            return select_entropy_bound(ent, masked, self.bound, k)
        if self.kind == "entropy":  # Dream: the k lowest-entropy positions
            return self.top(-ent, masked, k, gen, span)
        if self.sequential:
            return select_sequential(masked, k)
        return select_random(masked, k, gen, span) if self.random else self.top(conf, masked, k, gen, span)

    def passes(self, steps: int | None, n: int) -> int | None:
        """The most passes a block gets, None: until it has no hole (SDAR's entropy_bounded: --steps + 1)."""
        return (steps or n) + 1 if self.kind == "entropy_bound" and self.form == "sdar" else None


def top_margin(logits: Tensor) -> Tensor:
    """logits (N, V) -> (N,): the probability of each position's most likely token minus that of its second."""
    top2 = torch.softmax(logits.float(), dim=-1).topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def gumbel_draw(logits: Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator | None,
                span: tuple[int, int] | None = None) -> Tensor:
    """LLaDA's draw (its generate's add_gumbel_noise): logits (N, V) -> tokens (N,), the argmax of
    exp(logits) / (-log u)^T in float64, u uniform in float64 for every token of every position of the row's whole
    sequence (span (offset, total): the N rows from offset are read; None: the N alone), drawn in one call from gen.
    The distribution is the tempered softmax's, as any draw's; with --seed S these are the draws of LLaDA's generate
    after torch.manual_seed(S) (on the CPU). top-k / top-p leave tokens out (exp(-inf) = 0)."""
    N, V = logits.shape
    at, total = span if span is not None else (0, N)
    u = torch.rand(total, V, dtype=torch.float64, generator=gen, device=logits.device)[at:at + N]  # (N, V)
    x = logits.double()
    if top_k or top_p < 1.0:
        x = x.masked_fill(filtered_logits(logits, temperature, top_k, top_p) == float("-inf"), float("-inf"))
    return (x.exp() / (-torch.log(u)) ** temperature).argmax(-1)


def propose(logits: Tensor, temperature: float, top_k: int, top_p: float,
            gen: torch.Generator | None, sampled: bool = False, gumbel: bool = False,
            span: tuple[int, int] | None = None, hide: tuple[int, ...] = ()) -> tuple[Tensor, Tensor, Tensor]:
    """logits (N, V) -> proposed tokens (N,), their probability (N,), entropy (N,) in nats of the model's
    distribution. The probability is the model's; sampled (at temperature > 0): the one of the distribution the token
    was drawn from (temperature, top-k, top-p applied), as SDAR's generate reads its confidence. gumbel: drawn by
    gumbel_draw (span: its rows' place in the whole sequence). hide: ids whose logits are -inf in the softmax the
    (model's) probability is read from, after the draw (Rule.hidden)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    ent = entropy(logp.exp())
    if gumbel and temperature > 0:
        cand, probs = gumbel_draw(logits, temperature, top_k, top_p, gen, span), None
        if sampled:
            probs = probs_from_logits(logits, temperature, top_k, top_p)
    else:
        cand, probs = draw(logits, temperature, top_k, top_p, gen)
    if sampled and probs is not None:
        return cand, probs.gather(-1, cand[:, None])[:, 0], ent
    if hide:
        logp = torch.log_softmax(logits.float().index_fill(-1, torch.tensor(hide, device=logits.device),
                                                           float("-inf")), dim=-1)
    conf = logp.gather(-1, cand[:, None])[:, 0].exp()
    return cand, conf, ent


def denoise_step(logits: Tensor, x: Tensor, masked: Tensor, rule: Rule, k: int, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, gen: torch.Generator | None = None,
                 span: tuple[int, int] | None = None, pad: tuple[int, int] = (0, 0)) -> tuple[Tensor, Tensor, float]:
    """One step on a block: logits (N, V), tokens x (N,), masked (N,) bool. pad (before, after): with rule.holes at
    temperature > 0, the draw of the masked positions' rows is one torch.multinomial over that many more rows before
    and after them (whose draws are dropped), as Fast-dLLM's Dream block decoding draws rows it does not read.

    Returns (new tokens (N,), newly committed (N,) bool, mean entropy of the masked positions).
    """
    if rule.holes and rule.kind == "origin" and temperature > 0:  # Dream's origin: the transfer draw, then a token
        chosen = select_origin(masked, k, gen)  # draw for each position it chose, in order
        at = chosen.nonzero()[:, 0]
        cand = x.clone()
        if len(at):
            probs = probs_from_logits(logits[at], temperature, top_k, top_p)  # (n, V)
            cand[at] = torch.multinomial(probs, 1, replacement=True, generator=gen)[:, 0]
        ent = entropy(torch.softmax(logits[masked].float(), dim=-1))
        return cand, chosen, float(ent.mean())
    if temperature == 0 and not (rule.holes and rule.alg_temp):  # greedy: only the masked positions' proposals are
        at = masked.nonzero()[:, 0]  # read (the same values, less work; sequential may draw others again)
        if rule.sequential or rule.redraw:
            at = torch.arange(len(masked), device=masked.device)
        cand, conf, ent = (t.new_zeros(masked.shape).scatter(0, at, part)
                           for t, part in zip((x, x.float(), x.float()),
                                              propose(logits[at], 0.0, top_k, top_p, gen, hide=rule.hidden(0.0))))
    elif rule.holes:  # Dream: one draw per masked position, in order, and every score from the drawn distribution
        at = masked.nonzero()[:, 0]  # (greedy, with alg_temp: the most likely token, scored as Dream's generate does)
        probs = probs_from_logits(logits[at], temperature or 1.0, top_k, top_p)  # (n, V)
        if temperature > 0:  # (torch's Categorical draw)
            rows = torch.cat([probs.new_ones(pad[0], probs.shape[1]), probs, probs.new_ones(pad[1], probs.shape[1])])
            tok = torch.multinomial(rows, 1, replacement=True, generator=gen)[pad[0]:pad[0] + len(at), 0]
        else:
            tok = probs.max(dim=-1).indices
        parts = (tok, probs.gather(-1, tok[:, None])[:, 0], -(probs * torch.log(probs + 1e-10)).sum(-1))
        cand, conf, ent = (t.new_zeros(masked.shape).scatter(0, at, part)
                           for t, part in zip((x, x.float(), x.float()), parts))
        if rule.kind == "margin":
            top2 = probs.topk(2, dim=-1).values
            return _commit(rule, x, masked, k, gen, span, cand, conf, ent,
                           x.float().new_zeros(masked.shape).scatter(0, at, top2[:, 0] - top2[:, 1]))
    else:  # a draw for every position (what each row's generator consumes stays as it was)
        cand, conf, ent = propose(logits, temperature, top_k, top_p, gen, rule.sampled, rule.gumbel, span,
                                  rule.hidden(temperature))
    margin = top_margin(logits) if rule.kind == "margin" else None
    return _commit(rule, x, masked, k, gen, span, cand, conf, ent, margin)


def _commit(rule: Rule, x: Tensor, masked: Tensor, k, gen, span, cand: Tensor, conf: Tensor, ent: Tensor,
            margin: Tensor | None) -> tuple[Tensor, Tensor, float]:
    """The rule's choice among the proposals: (new tokens (N,), newly committed (N,), mean entropy of the holes)."""
    chosen = rule.select(conf, ent, masked, k, gen, margin, span)
    return torch.where(chosen, cand, x), chosen, float(ent[masked].mean())


def select_revisions(logits: Tensor, x: Tensor, committed: Tensor, threshold: float,
                     left: Tensor) -> Tensor:
    """Revision: bool (N,), the committed positions whose token's probability under this pass (logits (N, V),
    tokens x (N,)) is below threshold and that may still be revised (left (N,) > 0)."""
    p = torch.softmax(logits.float(), dim=-1).gather(-1, x[:, None])[:, 0]
    return committed & (left > 0) & (p < threshold)


def select_edits(cand: Tensor, conf: Tensor, x: Tensor, editable: Tensor, threshold: float) -> Tensor:
    """Token editing (LLaDA 2.1): the pass's proposals cand (N,) and their confidence conf (N,), the tokens x (N,),
    editable (N,) bool -> bool (N,): the editable positions whose proposal differs from x with confidence above
    threshold."""
    return editable & (conf > threshold) & (cand != x)


# one sequence, block by block -------------------------------------------------------------------

def plan_blocks(prefix_len: int, total: int, grid: int, one_tail: bool = False,
                origin: int = 0) -> list[tuple[int, int]]:
    """Blocks [start, end) over positions 0..total-1 on a grid of `grid` positions counted from `origin` (the
    positions before it are one block).

    With one_tail, the prompt's full blocks keep the grid and everything after them is one block (an
    infilling canvas sees its suffix).
    """
    cut = origin + ((prefix_len - origin) // grid) * grid if one_tail else total
    blocks = [(0, origin)] if origin > 0 else []
    blocks += [(s, min(s + grid, cut)) for s in range(origin, cut, grid)]
    if cut < total:
        blocks.append((cut, total))
    return blocks


@dataclass
class Job:
    """One sequence to denoise: known tokens (None = hole) over prompt + canvas, and its blocks."""

    known: list[int | None]
    prefix_len: int
    blocks: list[tuple[int, int]]
    stop_at_eos: bool  # continuation: cut after the first <eos>
    forbid_eos: bool  # templates / infilling: a hole never becomes <eos>
    causal_context: bool = False  # finished blocks are written causally (a joint model), not block-causally
    full_context: bool = False  # every position attends to every other, holes included (LLaDA, Dream)
    shift: bool = False  # position i's output predicts token i + 1 (Dream, Fast-dLLM v2)
    limit: int | None = None  # whole blocks: positions from here on are padding, denoised but never emitted
    eos_early_stop: bool = False  # stop denoising a block's positions after a committed <eos> at once
    mask_proposals: bool = False  # <mask> stays among the candidates (a position that draws it stays a hole)
    block_cache: bool = False  # a pass over a sub-block that starts with a known token runs that sub-block alone
    greedy_first: bool = False  # shift: a block's first token (committed alone) is the argmax at any temperature


class Denoising:
    """The state of one sequence being denoised: tokens, holes, the block of each position, its cache."""

    def __init__(self, model, job: Job, mask_id: int, naive: bool, prefix_cache: bool = False,
                 own_cache: bool = True, dual_cache: bool = False):
        dev = model.device
        prefix_cache = prefix_cache or dual_cache
        naive = naive or (job.full_context and not prefix_cache)  # full context: exact means no cache
        self.model, self.job, self.naive = model, job, naive
        self.dual = dual_cache and job.full_context and not naive
        total = len(job.known)
        self.seq = torch.tensor([mask_id if k is None else k for k in job.known], dtype=torch.long, device=dev)
        self.hole = torch.tensor([k is None for k in job.known], dtype=torch.bool, device=dev)
        self.block_of = torch.empty(total, dtype=torch.long, device=dev)
        for i, (s, e) in enumerate(job.blocks):
            self.block_of[s:e] = i
        self.cache = None if naive or not own_cache else model.new_cache(1, total)
        self.cached = 0  # positions 0..cached-1 are in the cache (slots == positions)
        self.block = None  # full context with the prefix cache: the block whose prefix the cache holds
        self.kept = False  # block cache: the cache also holds the current block's K/V (slots cached..), from its last
        # whole pass
        self.before = None  # shift: the output (V,) at the position before the block, from its first pass
        self.recompute = False  # a block was left with holes (leave): recompute from position 0, cache dropped
        self.span = None  # the last pass: (the block's offset in the positions it ran, how many it ran)
        self.reread = False  # the last pass read the prefix cache (a block's later pass, without the dual cache)

    def leave(self, s: int, e: int) -> None:
        """Block [s, e) took all the passes SDAR's entropy_bounded allows (its holes stay): no later block sees it (its
        block index after every block's), so every later pass recomputes the sequence without a cache (naive)."""
        self.block_of[s:e] = len(self.job.blocks)
        self.recompute = not self.naive
        self.naive = True

    def logits(self, s: int, e: int) -> Tensor:
        """One denoising pass over block [s, e) run alone, over this sequence's own cache: the logits (e - s, V) that
        predict its positions (with shift: the outputs one position earlier)."""
        return finish(self.denoise(s, e), alone(self.model, self.cache))

    def denoise(self, s: int, e: int, sub: tuple[int, int] | None = None) -> Iterator[Window | Crop]:
        """One denoising pass over block [s, e) as the requests of a row program (served alone or by a RowBatch that
        holds this row's cache); returns the logits (e - s, V) that predict the block's positions.

        sub (a, b): the block cache's pass over positions s + a .. s + b - 1 alone, their K/V written over the ones
        the block's last whole pass kept, every query seeing the whole block; returns their logits (b - a, V) (with
        shift, s + a's is its own output: a known token's, read by no step).

        Full context: the whole sequence, every position seeing every other (with the prefix cache: the whole
        sequence on the block's first pass, its prefix's K/V kept; then the block and everything after it,
        reading them; with the dual cache: the first pass's K/V of every position kept, then the block alone,
        its K/V written over its own slots, reading the prefix and the suffix from the cache).

        naive: the whole sequence so far, every finished block block-causal, this one last. Cached:
        the finished blocks not yet in the cache are written in this same pass (block-causal, blind
        to this block, kept); else the block reads the cache only."""
        seq, job = self.seq, self.job
        mask, at = None, None
        self.reread = False
        if sub is not None:
            a, b = sub
            rows = (yield Window(tokens=seq[s + a:s + b], at=s + a, out=(0, b - a)))[0]  # (b - a, V)
            return torch.cat([rows[:1], rows[:-1]]) if job.shift else rows
        if job.full_context:
            start, stop, keep = s, len(seq), 0
            if self.naive or self.block != s:
                start = 0
                if not self.naive:
                    yield Crop(0)
                    keep, self.block = (len(seq) if self.dual else s), s
            elif self.dual:
                stop, at = e, s
            else:
                self.reread = True
        elif self.naive:
            if self.recompute:  # (the cache held the blocks before a left block: dropped)
                yield Crop(0)
                self.recompute = False
            start, stop, keep = 0, e, 0
            mask = mdlm_denoise_mask(self.block_of, 0, e, job.causal_context)  # (e, e)
        else:
            if self.kept:  # (block cache: the last pass kept the block's K/V; this one computes them afresh)
                yield Crop(self.cached)
            start, stop = min(self.cached, s), e
            keep = s - start
            if start < s:
                mask = mdlm_denoise_mask(self.block_of, start, e, job.causal_context)[:, start:]  # (T, T)
            self.cached = s
            if job.block_cache:  # the block's K/V stay too, for the sub-blocks' passes that follow
                keep, self.kept = e - start, True
        lo = max(start, s - 1) if job.shift else s  # the first position whose output is read
        self.span = (s - start, stop - start)
        rows = (yield Window(tokens=seq[start:stop], mask=mask, keep=keep, out=(lo - start, e - start), at=at))[0]
        if not job.shift:
            return rows
        if s == 0:  # nothing before position 0: its own output predicts it
            return torch.cat([rows[:1], rows[:e - 1]])
        if lo == s - 1:
            self.before = rows[0]
            rows = rows[1:]
        return torch.cat([self.before[None], rows[:e - 1 - s]])


@torch.inference_mode()
def denoise_sequence(model, job: Job, rule: Rule, steps: int | None, mask_id: int, eos_id: Eos, *,
                     temperature: float, top_k: int, top_p: float, gen: torch.Generator | None,
                     naive: bool = False, row: int = 0, clock: Clock | None = None,
                     stats: Stats | None = None, revise: float = 0.0,
                     step_events: bool = True, prefix_cache: bool = False,
                     sub_block: int | None = None, schedule: str = "even", edit: float | None = None,
                     post_steps: int = 16, dual_cache: bool = False) -> Iterator[Event]:
    """Events of one sequence, block by block; counts forwards, steps, canvases and new tokens in `stats`
    (and, with revise > 0, the tokens sent back to <mask> in stats.extra["revisions"]).
    step_events: a Step event (the canvas, read back from the device) after every denoising step."""
    state = Denoising(model, job, mask_id, naive, prefix_cache, dual_cache=dual_cache)
    program = _program(state, rule, steps, mask_id, eos_id, temperature=temperature, top_k=top_k, top_p=top_p,
                       gen=gen, row=row, clock=clock, stats=stats, revise=revise, step_events=step_events,
                       sub_block=sub_block, schedule=schedule, edit=edit, post_steps=post_steps)
    yield from drive(program, alone(model, state.cache))


def _program(state: Denoising, rule: Rule, steps: int | None, mask_id: int, eos_id: Eos, *,
             temperature: float, top_k: int, top_p: float, gen: torch.Generator | None, row: int = 0,
             clock: Clock | None = None, stats: Stats | None = None, revise: float = 0.0,
             step_events: bool = True, sub_block: int | None = None,
             schedule: str = "even", edit: float | None = None,
             post_steps: int = 16) -> Iterator[Event | Window | Crop]:
    """One sequence as a row program: its events, and the requests of each denoising pass (Denoising.denoise: the
    outputs are sent back in). The one-row driver (denoise_sequence) and a batch (Batch) run the same code."""
    stats = stats if stats is not None else Stats()
    if revise > 0:
        stats.extra.setdefault("revisions", 0)
    job = state.job
    seq, hole, P = state.seq, state.hole, job.prefix_len
    stop = sorted(eos_set(eos_id))
    index = 0  # canvases (blocks with holes) of this row so far
    for s, e in job.blocks:
        masked = hole[s:e].clone()  # (Lb,)
        n = int(masked.sum())
        budget = step_budget(n, steps or n) if n else []
        if n and schedule == "block":  # LLaDA 2: the block's length over the steps, prompt positions included; steps
            # above the generation's length shrink to it (LLaDA 2's generate: min(steps, gen_length))
            budget = step_budget(e - s, min(steps or (e - s), (job.limit or len(job.known)) - P))
        step = 0
        g = max(s, P)  # the block's generated part starts here
        left = torch.full_like(masked, MAX_REVISIONS, dtype=torch.long) if revise > 0 else None
        # shift, and the position before the block is not recomputed with it (block-causal context, or the prefix
        # cache): the block's first token is committed alone on its first pass
        ar_first = job.shift and (not job.full_context or not state.naive) and s > 0 and bool(masked[0])
        post = 0  # editing: passes after the block's last hole
        used = 0  # --threshold-cap: positions the block's passes chose so far
        cap = rule.passes(steps, n)  # (SDAR's entropy_bounded: a block may end with holes)
        kv = False  # block cache: the cache holds the block's K/V from a whole pass after its first token was known
        while True:
            holes = bool(masked.any())
            if not holes:
                if edit is None or not n:
                    break
                post += 1
                if post > post_steps:
                    break
            was = masked.clone()
            sub = None  # block cache: this pass runs the current sub-block (a, b) alone
            if job.block_cache and kv and holes and not state.naive:  # (naive: a block SDAR's entropy_bounded left)
                a = int(masked.nonzero()[0]) // sub_block * sub_block
                if not bool(masked[a]):
                    sub = (a, min(a + sub_block, e - s))
            logits = yield from state.denoise(s, e, sub)  # (Lb, V), or (b - a, V) for a sub-block alone
            if job.block_cache and sub is None:
                kv = not (step == 0 and ar_first)
            stats.forwards += 1
            if rule.cfg_scale > 0:  # LLaDA's unsupervised classifier-free guidance: the same pass with every known
                # token (the prompt) at <mask>, logits = un + (scale + 1) (cond - un)
                keep = seq.clone()
                seq[~hole] = mask_id
                un = yield from state.denoise(s, e)  # (Lb, V)
                seq.copy_(keep)
                stats.forwards += 1
                logits = un + (rule.cfg_scale + 1) * (logits - un)
            # (mask proposals: a position whose proposal is <mask> stays a hole, as in the public generate functions;
            # past the planned steps <mask> is never proposed, so a block always ends)
            if not (job.mask_proposals and (rule.leave or step < (cap or steps or n))):
                logits[:, mask_id] = float("-inf")
            if job.forbid_eos:
                logits[:, stop] = float("-inf")
            if rule.no_eos is not None:  # --logits-eos-inf (LLaDA's logits_eos_inf)
                logits[:, rule.no_eos] = float("-inf")
            if rule.kind == "origin":  # Dream's origin: a probability per position, not a count
                k = origin_transfer(step, steps or n)
            elif rule.cap:  # the quota so far less what the block has committed (<mask> proposals included);
                k = sum(budget[:step + 1]) - used  # past the planned steps, what is left of the block's quota
            elif schedule == "dream":  # Dream: a count from the holes left and the time grid
                k = dream_count(int(masked.sum()), step, steps or n)
            else:
                k = budget[step] if step < len(budget) else 1
            back = None
            if left is not None:  # revision: committed tokens the model no longer believes go back to <mask>
                committed = hole[s:e] & ~masked & (seq[s:e] != mask_id) & ~is_eos(seq[s:e], stop)
                back = select_revisions(logits, seq[s:e], committed, revise, left)
                if bool(back.any()):
                    seq[s:e] = torch.where(back, mask_id, seq[s:e])
                    left -= back.long()
                    stats.extra["revisions"] += int(back.sum())
                else:
                    back = None
            free = masked if back is None else masked & ~back  # a revised position is proposed from the next pass
            step_rule, pad = rule, (0, 0)
            if step == 0 and ar_first:  # the block's first position reads only finished blocks: commit it alone, its
                # proposal whatever the rule's count (Fast-dLLM's generate writes it before the block's other passes)
                free = free & (torch.arange(len(free), device=free.device) == 0)
                if rule.kind != "origin":
                    step_rule = replace(rule, kind="confidence", random=False, sequential=False, alg_temp=0.0)
                    k = 1
            if sub_block and bool(free.any()):  # commit only in the first sub-block that still has holes
                part = torch.arange(len(free), device=free.device) // sub_block
                free = free & (part == part[free][0])
            proposed = None
            # (full context: random remasking and the Gumbel draw take uniforms for every position the pass ran, as
            # LLaDA's and Fast-dLLM's generate functions do: the whole sequence; over the prefix cache the block and
            # what follows it; over the dual cache the block)
            span = state.span if job.full_context else None
            if rule.gumbel and temperature > 0 and state.reread:  # Fast-dLLM's generate_with_prefix_cache draws its
                # noise twice on a pass that reads the cache, the first draw unused: taken here too, so that the
                # later draws are its draws
                torch.rand(span[1], logits.shape[-1], dtype=torch.float64, generator=gen, device=logits.device)
            if rule.holes and job.full_context and job.shift and not state.naive:  # Fast-dLLM's Dream block decoding
                # draws a token for every row of its first pass, and (confidence_threshold) for every hole after the
                # block too
                if step_rule is not rule:
                    pad = (span[0], span[1] - span[0] - 1)
                elif rule.kind == "threshold":
                    pad = (0, int((seq[e:s - span[0] + span[1]] == mask_id).sum()))
            if edit is not None:  # (LLaDA 2.1: one proposal for every position of the block, for the masks and edits)
                proposed = propose(logits, temperature, top_k, top_p, gen, rule.sampled, rule.gumbel, span,
                                   rule.hidden(temperature))
            if bool(free.any()):
                a, b = 0, e - s  # the positions the step reads: the block, or the sub-block it commits in
                if sub_block:
                    a = int(free.nonzero()[0]) // sub_block * sub_block
                    b = min(a + sub_block, e - s)
                    assert sub is None or sub == (a, b)
                rows = logits if sub is not None else logits[a:b]  # (b - a, V)
                if proposed is None:
                    t = 0.0 if job.greedy_first and ar_first and step == 0 else temperature
                    part_x, part, ent = denoise_step(rows, seq[s + a:s + b], free[a:b], step_rule, k, t, top_k, top_p,
                                                     gen, span if span is None else (span[0] + a, span[1]), pad)
                    x, chosen = seq[s:e].clone(), torch.zeros_like(free)
                    x[a:b], chosen[a:b] = part_x, part
                else:
                    margin = top_margin(logits) if rule.kind == "margin" else None
                    x, chosen, ent = _commit(step_rule, seq[s:e], free, k, gen, span, *proposed, margin)
                at = chosen[a:b].nonzero()[:, 0]  # the model's log-probability of what it commits (best-of-N reads it)
                stats.extra["logprob"] = stats.extra.get("logprob", 0.0) + float(
                    torch.log_softmax(rows[at].float(), -1).gather(-1, x[a:b][at, None]).sum())
            else:
                x, chosen, ent = seq[s:e], torch.zeros_like(free), None
            if rule.sequential:  # (its stretch may hold committed positions, drawn again; never pinned ones)
                chosen = chosen & hole[s:e]
                x = torch.where(chosen, x, seq[s:e])
            elif rule.redraw:  # (committed positions drawn again, the prompt's in the block too; never a pinned one in
                chosen = chosen & (hole[s:e] | (torch.arange(s, e, device=seq.device) < P))  # the canvas)
                x = torch.where(chosen, x, seq[s:e])
            seq[s:e] = x
            if back is not None:
                masked |= back
            masked = (masked & ~chosen) | (chosen & (x == mask_id))  # (a drawn <mask> is a hole again)
            used += int(chosen.sum())
            if job.stop_at_eos and job.eos_early_stop:  # what follows a committed <eos> will be dropped
                ends = (chosen & is_eos(x, stop)).nonzero()
                if len(ends):
                    masked[int(ends[0]) + 1:] = False
            edited = False
            if proposed is not None:  # token editing: committed tokens (before this pass) the model now replaces
                editable = hole[s:e] & ~was & (seq[s:e] != mask_id)
                changes = select_edits(proposed[0], proposed[1], seq[s:e], editable, edit)
                if bool(changes.any()):
                    seq[s:e] = torch.where(changes, proposed[0], seq[s:e])
                    stats.extra["edits"] = stats.extra.get("edits", 0) + int(changes.sum())
                    edited = True
            step += 1
            if step_events:
                yield Step(seq[g:e].tolist(), (seq[g:e] != mask_id).tolist(), step, index, ent, row, g - P)
            if not holes and not edited:
                break
            if rule.leave and bool(masked.any()) and (  # --leave-holes: the planned passes are spent
                    (used >= n and step >= len(budget)) if rule.cap else step >= (steps or n)):
                break
            if cap is not None and step >= cap:  # SDAR's entropy_bounded: its passes are spent (holes or not), so
                state.leave(s, e)  # its generate never writes the block to its cache (that write opens a pass)
                break
        if n and step == 1 and job.full_context and not state.naive and not bool(masked.any()):  # (over the prefix
            # or dual cache, a block its first pass filled)
            idle_draws(rule, temperature, gen, len(seq) - s if not state.dual else e - s, logits.shape[-1],
                       1 if state.dual else 2, seq.device)
        if n:
            index += 1
            stats.canvases += 1
            stats.steps += step
            stats.extra.setdefault("steps_per_canvas", []).append(step)
        hi = e if job.limit is None else min(e, job.limit)  # (whole blocks: the padding is never emitted)
        out = seq[g:hi].tolist()
        if not out:
            continue
        generated = hole[g:hi].tolist()
        if clock is not None:
            clock.mark_first()
        if job.stop_at_eos and eos_index(out, stop) is not None:
            cut = eos_index(out, stop) + 1
            stats.new_tokens += sum(generated[:cut])
            yield Commit(out[:cut], row)
            break
        stats.new_tokens += sum(generated)
        yield Commit(out, row)


def idle_draws(rule: Rule, temperature: float, gen: torch.Generator | None, rows: int, vocab: int, gumbels: int,
               device) -> None:
    """The draws of the pass Fast-dLLM's generate_with_prefix_cache / generate_with_dual_cache run after a block's
    first pass has filled it (they test for holes after each later pass, so a block gets one at least; it commits
    nothing), taken without its forward so that the draws after it are theirs: its Gumbel noise (--gumbel at
    temperature > 0: `gumbels` draws of rows x vocab float64 uniforms, two over the prefix cache, one over the dual
    cache), then random remasking's uniforms (rows)."""
    if rule.gumbel and temperature > 0:
        for _ in range(gumbels):
            torch.rand(rows, vocab, dtype=torch.float64, generator=gen, device=device)
    if rule.random:
        torch.rand(rows, generator=gen, device=device)


# the sampler --------------------------------------------------------------------------------------

def check_options(cfg) -> Rule:
    """Validate the mdlm options of a SampleConfig; return the acceptance rule."""
    sampler = "confidence" if cfg.sampler == "auto" else cfg.sampler
    if sampler not in RULES:
        raise DlmError(f"--sampler {cfg.sampler} does not belong to an mdlm checkpoint "
                       f"(allowed: auto, {', '.join(RULES)})")
    check_sampling(cfg.temperature, cfg.top_k, cfg.top_p)
    check(cfg.max_new_tokens > 0, f"--max-new-tokens must be > 0, got {cfg.max_new_tokens}")
    check(cfg.steps is None or cfg.steps > 0, f"--steps must be > 0, got {cfg.steps}")
    check(0 < cfg.threshold <= 1, f"--threshold must be in (0, 1], got {cfg.threshold}")
    check(cfg.entropy_bound > 0, f"--entropy-bound must be > 0, got {cfg.entropy_bound}")
    check(cfg.block_size is None or cfg.block_size > 0, f"--block-size must be > 0, got {cfg.block_size}")
    check(cfg.remasking in ("low_confidence", "random", "sequential"),
          f"--remasking must be low_confidence, random or sequential, got {cfg.remasking!r}")
    check(cfg.remasking == "low_confidence" or sampler == "confidence",
          f"--remasking {cfg.remasking} goes with --sampler confidence, got --sampler {sampler}")
    check(cfg.entropy_form in ("eb", "sdar"), f"--entropy-form must be eb or sdar, got {cfg.entropy_form!r}")
    check(cfg.sub_block is None or cfg.sub_block > 0, f"--sub-block must be > 0, got {cfg.sub_block}")
    if getattr(cfg, "block_cache", False):
        check(cfg.sub_block is not None, "--block-cache keeps a block's K/V for its sub-blocks' passes: it needs "
              "--sub-block")
        check(not cfg.naive, "--block-cache is an approximation, --naive the exact recomputation: give one")
        check(not getattr(cfg, "revise", 0.0) and getattr(cfg, "editing_threshold", None) is None,
              "--block-cache runs a sub-block alone: --revise and --editing-threshold read the whole block")
    check(cfg.schedule in ("even", "dream", "block"), f"--schedule must be even, dream or block, got {cfg.schedule!r}")
    edit = getattr(cfg, "editing_threshold", None)
    check(edit is None or 0 <= edit < 1, f"--editing-threshold must be in [0, 1), got {edit}")
    check(getattr(cfg, "max_post_steps", 16) >= 0, f"--max-post-steps must be >= 0, got {cfg.max_post_steps}")
    check(cfg.confidence in ("model", "sampled"), f"--confidence must be model or sampled, got {cfg.confidence!r}")
    revise = getattr(cfg, "revise", 0.0)
    check(0 <= revise < 1, f"--revise must be in [0, 1) (0 = off), got {revise}")
    check(not (cfg.gumbel and cfg.draw_holes), "--gumbel (the llada preset's) and --draw-holes (the dream preset's) "
          "are two ways to draw: give one (--no-gumbel or --no-draw-holes)")
    alg_temp = cfg.alg_temp or 0.0
    check(alg_temp >= 0 and math.isfinite(alg_temp), f"--alg-temp must be >= 0 (0 = off), got {cfg.alg_temp}")
    check(not alg_temp or (sampler in ("confidence", "entropy", "margin") and cfg.remasking == "low_confidence"),
          f"--alg-temp goes with --sampler confidence, entropy or margin, got --sampler {sampler}"
          + (" --remasking random" if cfg.remasking == "random" else ""))
    check(cfg.cfg_scale >= 0 and math.isfinite(cfg.cfg_scale),
          f"--cfg-scale must be >= 0 (0 = off), got {cfg.cfg_scale}")
    check(not (cfg.redraw_committed and cfg.draw_holes), "--redraw-committed (the sdar preset's) draws a token for "
          "every position of the block: it does not go with --draw-holes")
    check(not (cfg.confidence_eos_eot_inf and (cfg.draw_holes or cfg.confidence == "sampled")),
          "--confidence-eos-eot-inf reads the model's probability: it does not go with --draw-holes or "
          "--confidence sampled")
    return Rule(sampler, cfg.threshold, cfg.entropy_bound, cfg.remasking == "random", cfg.remasking == "sequential",
                cfg.entropy_form, cfg.confidence == "sampled", cfg.draw_holes, cfg.gumbel, alg_temp,
                cfg_scale=float(cfg.cfg_scale), first=cfg.sub_block is not None,
                cap=cfg.threshold_cap and sampler == "threshold", leave=cfg.leave_holes and not revise,
                redraw=cfg.redraw_committed and sampler in ("confidence", "threshold")
                and cfg.remasking == "low_confidence")


def with_end_ids(rule: Rule, cfg, tok) -> Rule:
    """The rule with the ids --logits-eos-inf and --confidence-eos-eot-inf name: the tokenizer's <eos> and its
    <|eot_id|> (LLaDA's 126081 and 126348)."""
    eot = tok.tk.token_to_id("<|eot_id|>")
    return replace(rule, no_eos=tok.eos_id if cfg.logits_eos_inf else None,
                   eos_eot=(tok.eos_id, *(() if eot is None else (eot,))) if cfg.confidence_eos_eot_inf else ())


def make_job(prompt: Prompt, cfg, train_block: int, context: int, causal_context: bool = False,
             full_context: bool = False, shift: bool = False) -> Job:
    """Blocks for a request: --block-size, else the training grid (whole sequence when trained without
    blocks); an infilling/template canvas is one block after the prompt's full blocks (it sees its suffix).
    Full context: the grid starts at the end of the prompt (there is no training grid)."""
    plain = prompt.canvas is None
    canvas = [None] * cfg.max_new_tokens if plain else list(prompt.canvas)
    check_fits(context, prompt, cfg.max_new_tokens)
    known = list(prompt.ids) + canvas
    if shift and not prompt.ids:
        raise DlmError("this checkpoint predicts each token from the position before it: the prompt must not be "
                       "empty")
    P = len(prompt.ids)
    origin = P if full_context else 0
    limit = None
    grid = cfg.block_size or train_block
    if getattr(cfg, "whole_blocks", False) and plain and grid:  # the last block padded with holes to its full size
        padded = origin + -(-(len(known) - origin) // grid) * grid
        padded = min(padded, max(context, len(known)))
        if padded > len(known):
            limit, known = len(known), known + [None] * (padded - len(known))
    if cfg.block_size is not None:
        blocks = plan_blocks(P, len(known), cfg.block_size, origin=origin)
    else:
        blocks = plan_blocks(P, len(known), train_block or len(known), one_tail=not plain, origin=origin)
    return Job(known, P, blocks, stop_at_eos=plain, forbid_eos=not plain, causal_context=causal_context,
               full_context=full_context, shift=shift, limit=limit,
               eos_early_stop=bool(getattr(cfg, "eos_early_stop", False)),
               mask_proposals=bool(getattr(cfg, "mask_proposals", False)),
               block_cache=bool(getattr(cfg, "block_cache", False)),
               greedy_first=bool(getattr(cfg, "greedy_first", False)))


def full_only(option: str) -> DlmError:
    """The refusal of one of Fast-dLLM's approximate caches on a checkpoint that is not full-attention."""
    return DlmError(f"{option} applies to a full-attention checkpoint (LLaDA, Dream); this one decodes over an exact "
                    "KV cache already")


def stream(model, ck, prompts: list[Prompt], cfg, step_events: bool = False) -> Iterator[Event]:
    """The mdlm sampler (cfg: SampleConfig). Several prompts run as rows of one batch (one forward per step for all
    of them; `--naive`, and a full-attention or shifted checkpoint, run them one after another), row r sampling with
    its own generator seeded seed + r. step_events: a Step event after every denoising step (the live view, the
    server's step streaming, tests)."""
    asked_cache = cfg.prefix_cache
    cfg = apply_preset(cfg, ck.config.get("preset"))
    tok = ck.tokenizer
    rule = with_end_ids(check_options(cfg), cfg, tok)
    mask_id = ck.mask_id  # an imported model's own <mask> id, else the tokenizer's
    if mask_id is None:
        raise DlmError(f"{ck.path}: the tokenizer has no <mask> token")
    causal = ck.objective == "joint"  # its AR half: the context is causal
    context = ck.config.get("context", "block")
    if context not in ("block", "full"):
        raise DlmError(f"{ck.path}: context must be block or full, got {context!r}"[:200])
    full = context == "full"
    shift = bool(ck.config.get("shift"))
    if asked_cache and not full:
        raise full_only("--prefix-cache")
    if cfg.dual_cache and not full:
        raise full_only("--dual-cache")
    if cfg.dual_cache and cfg.naive:
        raise DlmError("--dual-cache and --naive contradict each other (--naive recomputes the whole sequence every "
                       "step): give one")
    if cfg.dual_cache and "prefix_cache" in cfg.given and not cfg.prefix_cache:
        raise DlmError("--dual-cache keeps the prefix cache too: it does not go with --no-prefix-cache")
    if not full:  # (a preset's prefix cache: this checkpoint's exact cache is already there)
        cfg = cfg.replace(prefix_cache=False)
    if cfg.block_cache and full:
        raise DlmError("--block-cache applies to a block-causal checkpoint (Fast-dLLM v2, SDAR, dlm's own); this one "
                       "attends over the whole sequence (its approximate caches are --prefix-cache and --dual-cache)")
    if cfg.block_cache and getattr(model, "rows_band", 0):
        raise DlmError("--block-cache does not go with sliding-window layers (its sub-block passes attend over "
                       "every slot)")
    if cfg.cfg_scale > 0 and (not full or cfg.prefix_cache or cfg.dual_cache):
        raise DlmError("--cfg-scale applies to a full-attention checkpoint (LLaDA) without --prefix-cache or "
                       "--dual-cache: the unconditional pass reads the whole sequence")
    jobs = [make_job(p, cfg, ck.block_size, model.cfg.max_seq_len, causal, full, shift) for p in prompts]
    return _run(model, jobs, rule, cfg, mask_id, tok.eos_set, step_events)


def row_seed(seed: int | None, row: int) -> int | None:
    """Row r of a call samples with its own generator, seeded seed + r (the server's n choices do the same), so a
    row's tokens do not depend on the rows beside it."""
    return None if seed is None else seed + row


def _run(model, jobs: list[Job], rule: Rule, cfg, mask_id: int, eos_id: Eos,
         step_events: bool = False) -> Iterator[Event]:
    """Rows in one batch (one forward per step for all of them) when the model allows, else one after another."""
    if len(jobs) > 1 and not cfg.naive and batchable(model) and all(job_fits_rows(j) for j in jobs):
        return _run_batched(model, jobs, rule, cfg, mask_id, eos_id, step_events)
    return _run_in_turn(model, jobs, rule, cfg, mask_id, eos_id, step_events)


def _run_in_turn(model, jobs: list[Job], rule: Rule, cfg, mask_id: int, eos_id: Eos,
                 step_events: bool = False) -> Iterator[Event]:
    clock = Clock()
    stats = Stats(extra={"steps_per_canvas": []})
    for row, job in enumerate(jobs):
        gen = make_generator(row_seed(cfg.seed, row), model.device)
        yield from denoise_sequence(model, job, rule, cfg.steps, mask_id, eos_id, temperature=cfg.temperature,
                                    top_k=cfg.top_k, top_p=cfg.top_p, gen=gen, naive=cfg.naive, row=row,
                                    clock=clock, stats=stats, revise=getattr(cfg, "revise", 0.0),
                                    step_events=step_events, prefix_cache=getattr(cfg, "prefix_cache", False),
                                    sub_block=getattr(cfg, "sub_block", None),
                                    schedule=getattr(cfg, "schedule", "even"),
                                    edit=getattr(cfg, "editing_threshold", None),
                                    post_steps=getattr(cfg, "max_post_steps", 16),
                                    dual_cache=getattr(cfg, "dual_cache", False))
    stats.extra["forwards_per_canvas"] = stats.forwards / stats.canvases if stats.canvases else 0.0
    yield clock.finish(stats)


def _run_batched(model, jobs: list[Job], rule: Rule, cfg, mask_id: int, eos_id: Eos,
                 step_events: bool = False) -> Iterator[Event]:
    n = len(jobs)
    return _run_rows(model, jobs, [rule] * n, [cfg] * n, [row_seed(cfg.seed, r) for r in range(n)], mask_id, eos_id,
                     step_events)


def job_fits_rows(job: Job) -> bool:
    """Whether a Batch can run this job: block-causal context over the exact cache, unshifted, without the block cache
    (a full-attention or shifted imported model, and the block cache, run their rows one after another)."""
    return not job.full_context and not job.shift and not job.block_cache


def rows_fit(ck) -> bool:
    """Whether a checkpoint's conventions let its requests share a Batch (the server's row batcher asks)."""
    return ck.config.get("context", "block") == "block" and not ck.config.get("shift")


def stream_rows(model, ck, prompts: list[Prompt], cfgs: list, step_events: bool = False) -> Iterator[Event]:
    """Rows that each bring their own SampleConfig (row r seeded cfgs[r].seed) in one batch (dlm.sampling.stream_rows).
    Bad options raise here, before any work."""
    rows = [row_job(model, ck, p, c) for p, c in zip(prompts, cfgs)]
    jobs, rules, cfgs = [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]
    return _run_rows(model, jobs, rules, cfgs, [c.seed for c in cfgs], ck.mask_id, ck.tokenizer.eos_set, step_events)


def row_job(model, ck, prompt: Prompt, cfg) -> tuple[Job, Rule, Any]:
    """A prompt as a row of a Batch: its job, its rule and its options (the checkpoint's preset applied). Raises on
    bad options and on a checkpoint whose rows cannot share a Batch, before any work."""
    if not rows_fit(ck):
        raise DlmError(f"{ck.path}: a full-attention or shifted checkpoint runs its rows one after another (stream)")
    if ck.mask_id is None:
        raise DlmError(f"{ck.path}: the tokenizer has no <mask> token")
    cfg = apply_preset(cfg, ck.config.get("preset")).replace(prefix_cache=False)
    if cfg.dual_cache:
        raise full_only("--dual-cache")
    rule = with_end_ids(check_options(cfg), cfg, ck.tokenizer)
    if cfg.block_cache:
        raise DlmError("--block-cache runs its rows one after another (dlm generate), not in a batch")
    if cfg.cfg_scale > 0:
        raise DlmError("--cfg-scale applies to a full-attention checkpoint (LLaDA), whose rows run one after another")
    job = make_job(prompt, cfg, ck.block_size, model.cfg.max_seq_len, ck.objective == "joint")
    return job, rule, cfg


@torch.inference_mode()
def _run_rows(model, jobs: list[Job], rules: list[Rule], cfgs: list, seeds: list, mask_id: int, eos_id: Eos,
              step_events: bool = False) -> Iterator[Event]:
    clock = Clock()
    batch = Batch(model, 2 * max(len(j.known) for j in jobs), mask_id, eos_id)
    per_row = []
    for row, (job, rule, c) in enumerate(zip(jobs, rules, cfgs)):
        st = Stats()
        per_row.append(st)
        for _, ev in batch.add(job, rule, c, row, st, gen=make_generator(seeds[row], model.device), clock=clock,
                               step_events=step_events):
            yield ev
    while len(batch):
        for _, ev in batch.step():
            yield ev
    stats = batch_stats(per_row, batch.forwards)
    own = sum(st.forwards for st in per_row)
    stats.extra["forwards_per_canvas"] = own / stats.canvases if stats.canvases else 0.0
    yield clock.finish(stats)


class Batch(Programs):
    """mdlm rows denoised together: every live row's next pass in one forward (continuous batching).

    Each row keeps its own blocks, rule, budget, sampling options and generator; rows join with `add` and leave when
    their generation ends or `drop` is called; events come back as (tag, event), the event's `row` the one given.
    """

    def __init__(self, model, capacity: int, mask_id: int, eos_id: Eos):
        super().__init__(model, capacity)
        self.model, self.mask_id, self.eos_id = model, mask_id, eos_id

    def add(self, job: Job, rule: Rule, cfg, row: int, stats: Stats, *, tag: object = None,
            gen: torch.Generator | None = None, clock: Clock | None = None,
            step_events: bool = False) -> list[tuple[object, Event]]:
        """A new row (cfg: its SampleConfig; gen: its generator, default seeded row_seed(cfg.seed, row));
        returns the events it produces before its first pass (pinned blocks of a template)."""
        gen = gen if gen is not None else make_generator(row_seed(cfg.seed, row), self.model.device)
        return super().add(*batch_row(self.model, job, rule, cfg, row, stats, self.mask_id, self.eos_id, gen, clock,
                                      step_events), tag)


def row_program(model, ck, prompt: Prompt, cfg, row: int = 0, *, step_events: bool = False) -> RowProgram:
    """A request as a row of a batch (the server's), sampling with a generator seeded cfg.seed. Raises on bad options,
    before any work."""
    job, rule, cfg = row_job(model, ck, prompt, cfg)
    stats = Stats(extra={"steps_per_canvas": []})
    program, window, answer = batch_row(model, job, rule, cfg, row, stats, ck.mask_id, ck.tokenizer.eos_set,
                                        make_generator(cfg.seed, model.device), step_events=step_events)
    return RowProgram(program, stats, window, answer)


def batch_row(model, job: Job, rule: Rule, cfg, row: int, stats: Stats, mask_id: int, eos_id: int,
              gen: torch.Generator, clock: Clock | None = None, step_events: bool = False) -> tuple:
    """A job as a row of a Programs batch: its program, and how its requests become Windows and its outputs answers
    (as they are: the program asks Windows and reads their outputs)."""
    state = Denoising(model, job, mask_id, naive=False, own_cache=False)
    program = _program(state, rule, cfg.steps, mask_id, eos_id, temperature=cfg.temperature,
                       top_k=cfg.top_k, top_p=cfg.top_p, gen=gen, row=row, clock=clock, stats=stats,
                       revise=getattr(cfg, "revise", 0.0), step_events=step_events,
                       sub_block=getattr(cfg, "sub_block", None), schedule=getattr(cfg, "schedule", "even"),
                       edit=getattr(cfg, "editing_threshold", None), post_steps=getattr(cfg, "max_post_steps", 16))
    return program, lambda w: w, lambda w, out: out
