"""Samplers, one file per paradigm, and the dispatch from a checkpoint to its sampler.

`SampleConfig` holds every sampling option of every paradigm (the CLI's `generate` flags);
`stream()` picks the sampler the checkpoint's objective calls for and returns its event stream.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Iterator

from torch import nn

from dlm.checkpoint import Checkpoint
from dlm.errors import DlmError
from dlm.sampling.common import Event, Result, drain


@dataclass
class SampleConfig:
    """Sampling options.

    Attributes:
        max_new_tokens: tokens to generate at most
        temperature: 0 = greedy; > 0 samples (AR, speculative, mdlm)
        top_k: keep the k most likely tokens (0 = off)
        top_p: nucleus sampling mass in (0, 1]
        seed: makes sampling reproducible
        naive: AR only: recompute the whole sequence every step (no KV cache)
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    naive: bool = False

    def replace(self, **kw) -> SampleConfig:
        return dataclasses.replace(self, **kw)


def stream(model: nn.Module, ck: Checkpoint, prompts: list[list[int]], cfg: SampleConfig) -> Iterator[Event]:
    """The event stream of the sampler that fits the checkpoint's paradigm."""
    tok = ck.tokenizer
    if ck.objective == "ar":
        from dlm.sampling.ar import ar_stream, naive_stream

        common = dict(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k,
                      top_p=cfg.top_p, seed=cfg.seed, eos_id=tok.eos_id, pad_id=tok.pad_id)
        if cfg.naive:
            if len(prompts) != 1:
                raise DlmError("--naive takes one prompt at a time")
            return naive_stream(model, prompts[0], **common)
        return ar_stream(model, prompts, **common)
    raise DlmError(f"checkpoint {ck.path}: objective {ck.objective!r} has no sampler")


def generate(model: nn.Module, ck: Checkpoint, prompts: str | list[str], cfg: SampleConfig | None = None,
             keep_events: bool = False) -> Result:
    """Encode, sample, decode: the Python entry point behind `dlm generate`."""
    cfg = cfg or SampleConfig()
    texts = [prompts] if isinstance(prompts, str) else list(prompts)
    ids = [ck.tokenizer.encode(t) for t in texts]
    return drain(stream(model, ck, ids, cfg), ck.tokenizer.decode, ck.tokenizer.eos_id, rows=len(ids),
                 keep_events=keep_events)
