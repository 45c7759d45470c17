"""Samplers, one file per paradigm, and the dispatch from a checkpoint to its sampler.

`SampleConfig` holds every sampling option of every paradigm (the CLI's `generate` flags).
Each sampler module exposes `stream(model, ck, prompts, cfg) -> Iterator[Event]`, where
prompts are strings (a sampler may need them whole: templates, suffixes). `stream()` below picks
the module from the checkpoint's objective, or the speculative loop when a drafter is given.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Iterator

from torch import nn

from dlm.checkpoint import Checkpoint
from dlm.errors import DlmError
from dlm.sampling.common import Event, Result, drain

# objective -> sampler module
SAMPLERS: dict[str, str] = {
    "ar": "dlm.sampling.ar",
    "mdlm": "dlm.sampling.mdlm",
    "usdm": "dlm.sampling.usdm",
}


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
        sampler: diffusion sampler: confidence | threshold | entropy_bound (mdlm); entropy_bound (usdm); auto = the paradigm's default
        steps: mdlm: denoising steps per block (default: one token per step; threshold / entropy_bound: at most this many)
        threshold: mdlm threshold sampler: commit every position with confidence >= this
        entropy_bound: entropy-bound acceptance: cumulative entropy minus its largest term <= this
        block_length: mdlm: semi-autoregressive block length (default: the checkpoint's training block length, else the whole generation)
        remasking: mdlm: low_confidence | random
        canvas_length: usdm: tokens per canvas (default: the checkpoint's)
        max_denoising_steps: usdm: denoising steps per canvas at most
        t_max: usdm: temperature of the first step
        t_min: usdm: temperature approached at the last step
        stability_threshold: usdm adaptive stopping: steps the argmax canvas must stay unchanged
        confidence_threshold: usdm adaptive stopping: mean entropy below which a canvas may stop
        adaptive: usdm: stop a canvas early (adaptive stopping); off = always max_denoising_steps
        suffix: infilling: text after the hole (pinned, comes out byte-exact)
        fill_length: template markers: positions per <fill> (<fill:N> asks for N)
        draft: speculative decoding: a drafter checkpoint folder, or 'lookup' (prompt lookup)
        gamma: speculative: block of one cycle, the last committed token + gamma-1 proposals (0 = the drafter's default: its block size for DFlash, 5 for an AR draft, 8 for lookup)
        draft_passes: DFlash: denoising passes per draft (1-3; later passes re-predict the slots below 0.9 confidence)
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
    block_length: int | None = None
    remasking: str = "low_confidence"
    canvas_length: int | None = None
    max_denoising_steps: int = 48
    t_max: float = 0.8
    t_min: float = 0.4
    stability_threshold: int = 1
    confidence_threshold: float = 0.005
    adaptive: bool = True
    suffix: str | None = None
    fill_length: int = 16
    # speculative decoding
    draft: str | None = None
    gamma: int = 0
    draft_passes: int = 1
    lookup_ngram: int = 3
    check_lossless: bool = False

    def replace(self, **kw) -> SampleConfig:
        return dataclasses.replace(self, **kw)


def stream(model: nn.Module, ck: Checkpoint, prompts: list[str], cfg: SampleConfig) -> Iterator[Event]:
    """The event stream of the sampler that fits the checkpoint's paradigm (or the drafter)."""
    if cfg.draft:
        from dlm.sampling import speculative

        return speculative.stream(model, ck, prompts, cfg)
    if ck.objective not in SAMPLERS:
        raise DlmError(f"checkpoint {ck.path}: objective {ck.objective!r} has no sampler "
                       f"(samplers exist for {sorted(SAMPLERS)})")
    return importlib.import_module(SAMPLERS[ck.objective]).stream(model, ck, prompts, cfg)


def generate(model: nn.Module, ck: Checkpoint, prompts: str | list[str], cfg: SampleConfig | None = None,
             keep_events: bool = False) -> Result:
    """Sample and decode: the Python entry point behind `dlm generate`."""
    cfg = cfg or SampleConfig()
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    return drain(stream(model, ck, texts, cfg), ck.tokenizer.decode, ck.tokenizer.eos_id, rows=len(texts),
                 keep_events=keep_events)
