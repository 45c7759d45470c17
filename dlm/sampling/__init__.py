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

from typing import Iterator, Sequence

from torch import nn

from dlm.checkpoint import Checkpoint
from dlm.config import SampleConfig, check_seed
from dlm.errors import DlmError
from dlm.sampling import ar, joint, mdlm, speculative, usdm
from dlm.sampling.common import Clock, Done, Event, Prompt, Result, drain
from dlm.sampling.infill import encode_prompt
from dlm.sampling.rows import RowProgram, batch_stats, batchable

SAMPLERS = {"ar": ar, "mdlm": mdlm, "usdm": usdm, "joint": joint}

# The one table of options: the SampleConfig fields each paradigm's sampler reads, as each sampler declares them
# next to its code. `dlm generate`'s warnings, the server's 400s and the bench's method options derive from it.
# An option a sampler reads to refuse (usdm's --temperature) counts as read: its error is the message.
OPTIONS = {name: s.OPTIONS for name, s in SAMPLERS.items()} | {"speculative": speculative.OPTIONS}
EVERY = frozenset({"max_new_tokens", "seed", "generation_config"})  # read by every sampler


def options_read(paradigm: str, drafter_kind: str | None = None) -> frozenset[str]:
    """The options a paradigm's sampler reads (speculative decoding: less those another kind of drafter reads)."""
    reads = OPTIONS[paradigm] | EVERY
    if paradigm == "speculative" and drafter_kind is not None:
        reads -= {o for o, (kinds, _) in speculative.DRAFTER_OPTIONS.items()
                  if not speculative.kind_reads(drafter_kind, kinds)}
    return reads


def with_model_defaults(ck: Checkpoint, cfg: SampleConfig) -> SampleConfig:
    """cfg with the sampling defaults of the generation_config.json an imported model keeps beside its weights
    (dlm.checkpoint.generation_defaults: what transformers' `generate` samples with, given no options) for the
    options the user did not set (cfg.given: flags, --config keys, request fields), as a preset fills them;
    cfg.generation_config "none": dlm's own defaults. `dlm generate`, `dlm chat` and `dlm serve` apply it; eval and
    bench pin their own settings (greedy unless told)."""
    if cfg.generation_config not in ("auto", "none"):
        raise DlmError(f"--generation-config must be auto or none, got {cfg.generation_config!r}")
    if cfg.generation_config == "none":
        return cfg
    from dlm.checkpoint import generation_defaults

    found = generation_defaults(ck.path, ck.objective)
    return cfg.replace(**{k: v for k, v in found.items() if k not in cfg.given})


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


def row_program(model: nn.Module, ck: Checkpoint, prompt: Prompt, cfg: SampleConfig, row: int = 0, *,
                drafter: speculative.Drafter | None = None, logprobs: int | None = None,
                step_events: bool = False) -> RowProgram:
    """A request as a row of a batch (dlm.sampling.rows.Programs: the server's batchers): the one row constructor of
    every sampler, `row_program(model, ck, prompt, cfg, row, ...)` in its module, picked as `stream` picks the
    sampler; its generator is seeded cfg.seed. logprobs (AR, and the target of a speculative model: AR decoding):
    each token comes as a Scored event with that many alternatives. Raises on bad options, before any work."""
    if logprobs is not None or (drafter is None and ck.objective == "ar"):
        return ar.row_program(model, ck, prompt, cfg, row, logprobs=logprobs)
    if drafter is not None:
        return speculative.row_program(model, ck, prompt, cfg, row, drafter=drafter)
    if ck.objective not in SAMPLERS:
        raise DlmError(f"checkpoint {ck.path}: objective {ck.objective!r} has no sampler")
    return SAMPLERS[ck.objective].row_program(model, ck, prompt, cfg, row, step_events=step_events)


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
    return drain(stream(model, ck, ps, cfg, step_events=keep_events), ck.tokenizer.text, ck.tokenizer.eos_set,
                 rows=len(ps), keep_events=keep_events)
