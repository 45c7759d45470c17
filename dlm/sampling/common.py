"""What every sampler shares: the request, the events, the statistics, and turning logits into tokens.

The sampler contract (dlm.sampling.stream): a function of the model(s), the prompts and one
SampleConfig that returns a generator of events. Bad options raise DlmError when it is called,
before any work. The events:

  Commit    tokens that are final, appended to a row's output
  Step      one denoising step of a canvas (mdlm block, usdm canvas): what the live view draws
  Verified  one speculative verify cycle: what the drafter proposed and how much was accepted
  Done      exactly one, last: the statistics of the whole call

Statistics (Stats), one definition each, the same in every paradigm:

  new_tokens          tokens generated (committed), over all rows
  forwards            forward passes of the model that produces the final tokens (the target)
  draft_forwards      forward passes of a drafter model (speculative decoding; 0 otherwise)
  canvases            canvases (usdm) or blocks (mdlm) denoised (0 for AR and speculation)
  steps               denoising steps over all canvases (0 for AR and speculation)
  tokens_per_forward  new tokens / forwards
  tokens_per_second   new tokens / seconds (wall time of the whole call, prefill included)
  ttft                seconds until the first token was committed

End of text: a checkpoint may have several EOS ids (Gemma 4's <eos> and <end_of_turn>; the tokenizer's `eos_ids`,
the first one its `eos_id`, and `eos_set`, the same as a set, which the samplers receive). Every sampler stops at any
of them, through the helpers below (`Eos`: a set, one id, or None for none), and what follows the first one is never
output.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Collection, Iterator, Sequence

import torch
from torch import Tensor

from dlm.errors import DlmError, check


@dataclass
class Prompt:
    """One request: the prompt's token ids and, for infilling and templates, the canvas to fill.

    canvas None: continue the prompt for max_new_tokens tokens. Otherwise each entry is a pinned
    token (comes out byte-exact) or None (a hole to generate); the prompt precedes it.
    """

    ids: list[int]
    canvas: list[int | None] | None = None


def check_fits(context: int, prompt: Prompt, max_new_tokens: int) -> None:
    """The one rule: the prompt and what is generated after it must fit the model's context."""
    P = len(prompt.ids)
    if prompt.canvas is None and P + max_new_tokens > context:
        raise DlmError(f"--prompt is {P} tokens; with --max-new-tokens {max_new_tokens} that exceeds the model's "
                       f"context of {context} tokens (allowed: prompt + max-new-tokens <= {context})")
    if prompt.canvas is not None and P + len(prompt.canvas) > context:
        raise DlmError(f"--prompt is {P} tokens and the canvas to fill (holes + pinned suffix or template text) "
                       f"{len(prompt.canvas)}: more than the model's context of {context} tokens, no room to fill")


@dataclass
class Event:
    pass


@dataclass
class Commit(Event):
    """Tokens that are final, appended to row `row`'s output."""

    tokens: list[int]
    row: int = 0


@dataclass
class Scored(Commit):
    """One AR token with its log-probability and the top alternatives (a row that asks for logprobs)."""

    logprob: float = 0.0
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Step(Event):
    """One denoising step of a canvas: what the live view draws and the tests read.

    `canvas` is the canvas after the step: the positions this canvas generates (an mdlm block, a
    usdm canvas, an infilling or template canvas), pinned positions included, the prompt excluded,
    masks or noise where nothing is accepted yet. `offset` is where canvas[0] falls in the row's
    output. `fixed[i]` is True where position i holds an accepted/unmasked/pinned token.
    """

    canvas: list[int]
    fixed: list[bool]
    step: int  # 1-based step within this canvas
    canvas_index: int = 0  # which canvas / block of the generation
    entropy: float | None = None  # mean entropy (nats) of the step's predictive distribution
    row: int = 0
    offset: int = 0


@dataclass
class Verified(Event):
    """One verify cycle: what the drafter proposed and how many of those the target accepted."""

    proposed: list[int]
    accepted: int
    row: int = 0


@dataclass
class Stats:
    new_tokens: int = 0
    forwards: int = 0
    draft_forwards: int = 0
    canvases: int = 0
    steps: int = 0
    seconds: float = 0.0
    ttft: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # paradigm-specific (steps_per_canvas, tau, ...)

    def as_dict(self) -> dict[str, Any]:
        return {
            "new_tokens": self.new_tokens,
            "forwards": self.forwards,
            "draft_forwards": self.draft_forwards,
            "canvases": self.canvases,
            "steps": self.steps,
            "tokens_per_forward": self.new_tokens / self.forwards if self.forwards else 0.0,
            "seconds": self.seconds,
            "tokens_per_second": self.new_tokens / self.seconds if self.seconds > 0 else 0.0,
            "ttft": self.ttft,
            **self.extra,
        }


@dataclass
class Done(Event):
    stats: Stats


@dataclass
class Result:
    tokens: list[list[int]]  # new tokens per row (an ending <eos> included)
    texts: list[str]  # decoded new text per row (without the ending <eos>)
    stats: Stats
    events: list[Event] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.texts[0]


Eos = int | Collection[int] | None  # the EOS ids a sampler stops at: a set (a tokenizer's eos_set), one, or none


def eos_set(eos: Eos) -> frozenset[int]:
    """The EOS ids as a set (empty for None): a tokenizer's eos_set as it is; an id or a list (a caller outside the
    samplers) converted."""
    if isinstance(eos, frozenset):
        return eos
    if eos is None:
        return frozenset()
    if isinstance(eos, int):
        return frozenset((eos,))
    return frozenset(int(e) for e in eos)


def eos_index(tokens: Sequence[int], eos: Eos) -> int | None:
    """Where the first EOS is in tokens, or None."""
    stop = eos_set(eos)
    return next((i for i, t in enumerate(tokens) if t in stop), None)


def through_eos(tokens: Sequence[int], eos: Eos) -> tuple[list[int], bool]:
    """Tokens up to and including the first EOS (the rest dropped), and whether there was one."""
    i = eos_index(tokens, eos)
    return (list(tokens), False) if i is None else (list(tokens[:i + 1]), True)


def before_eos(tokens: Sequence[int], eos: Eos) -> list[int]:
    """Tokens before the first EOS: the text a row shows."""
    i = eos_index(tokens, eos)
    return list(tokens if i is None else tokens[:i])


def is_eos(x: Tensor, eos: Eos) -> Tensor:
    """x (…) of token ids -> (…) bool: where x holds an EOS."""
    stop = eos_set(eos)
    if not stop:
        return torch.zeros_like(x, dtype=torch.bool)
    return torch.isin(x, torch.tensor(sorted(stop), dtype=x.dtype, device=x.device))


def drain(events: Iterator[Event], decode, eos_id: Eos, rows: int = 1, keep_events: bool = False) -> Result:
    """Run a sampler to the end and collect its output."""
    tokens: list[list[int]] = [[] for _ in range(rows)]
    kept: list[Event] = []
    stats = Stats()
    for ev in events:
        if keep_events:
            kept.append(ev)
        if isinstance(ev, Commit):
            tokens[ev.row].extend(ev.tokens)
        elif isinstance(ev, Done):
            stats = ev.stats
    texts = []
    for t in tokens:
        texts.append(decode(before_eos(t, eos_id)))
    return Result(tokens, texts, stats, kept)


class Clock:
    """Wall time of a generation, with the time to first token."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.first: float | None = None

    def mark_first(self) -> None:
        if self.first is None:
            self.first = time.perf_counter() - self.t0

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def finish(self, stats: Stats) -> Done:
        """The Done event of a call: its statistics with the wall time and time to first token."""
        stats.seconds = self.elapsed()
        stats.ttft = self.first
        return Done(stats)


def check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    check(temperature >= 0, f"--temperature must be >= 0 (0 = greedy), got {temperature}")
    check(top_k >= 0, f"--top-k must be >= 0 (0 = off), got {top_k}")
    check(0 < top_p <= 1, f"--top-p must be in (0, 1], got {top_p}")


def filtered_logits(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """The logits (…, V) a draw's distribution is the softmax of, in fp32: temperature, then top-k, then top-p
    (nucleus), the tokens left out at -inf. transformers' sampling warpers in their order and arithmetic (its
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper), so that a draw from the same generator is its draw."""
    logits = logits.float()
    if temperature != 1.0:  # (x / 1.0 is x: the pass is skipped, not the arithmetic changed)
        logits = logits / max(temperature, 1e-6)
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # (…, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        # a token goes when the mass of the tokens no more likely than it, itself included, is <= 1 - top_p (the
        # mass before it in descending order already reaches top_p); the most likely always stays
        ranked, idx = torch.sort(logits, dim=-1)  # ascending
        drop = ranked.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[..., -1] = False
        logits = logits.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return logits


def probs_from_logits(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """The sampling distribution (…, V) in fp32: the softmax of filtered_logits (temperature, top-k, top-p)."""
    return torch.softmax(filtered_logits(logits, temperature, top_k, top_p), dim=-1)


NONFINITE = ("the model's output holds NaN or infinite values: its weights are damaged, or the dtype overflowed "
             "(try float32)")


def exponentials(like: Tensor, gen: torch.Generator | None) -> Tensor:
    """Exp(1) draws shaped like `like`: the values `torch.empty_like(like).exponential_(1, generator=gen)` draws, from
    the same words of the generator (which ends in the same state); for a CPU float32 tensor and a generator of
    its own at about half the cost.

    torch's CPU kernel draws each value as -log1p(-u), u a float64 uniform (53 bits of one 64-bit word), with the C
    library's log1p one value at a time, then rounds it to float32. Here the uniforms come from torch.rand (the same
    words, the same u) and log1p is torch's vectorized one, which can differ from the C library's in the last bit of the
    float64. After rounding to float32 that can matter only for a float64 within a few of its units of a float32
    rounding midpoint (about one value in 10^8): those are recomputed with the C library's log1p (math.log1p). Whether
    this reproduces exponential_ for the torch at hand is checked once, on a probe; if it does not, exponential_ draws.
    """
    # (gen None is torch's default generator, which other threads may draw from between two reads of its state)
    if gen is None or like.device.type != "cpu" or like.dtype != torch.float32 or not _exact_exponentials():
        return torch.empty_like(like).exponential_(1, generator=gen)
    return _exponentials(like.shape, gen)


MIDPOINT_UNITS = 16  # torch's log1p and the C library's differ by at most one unit of the float64


def _exponentials(shape, gen: torch.Generator) -> Tensor:
    state = gen.get_state()  # (to draw the uniforms again for the few values recomputed below)
    e = torch.rand(shape, dtype=torch.float64, generator=gen).neg_().log1p_().neg_()  # in place: a single buffer
    # the float64s within MIDPOINT_UNITS units of a float32 rounding midpoint: the 29 low mantissa bits, which float32
    # rounds away (in the low 32-bit word), near 2^28
    m = MIDPOINT_UNITS
    low = e.view(torch.int32)[..., 0::2]
    near = ((low - ((1 << 28) - m)) & ((1 << 29) - 1)) <= 2 * m
    q = e.float()
    if bool(near.any()):
        now = gen.get_state()
        gen.set_state(state)
        u = torch.rand(shape, dtype=torch.float64, generator=gen)
        gen.set_state(now)
        at = near.nonzero(as_tuple=True)
        q[at] = torch.tensor([-math.log1p(-x) for x in u[at].tolist()], dtype=torch.float64).float()
    return q


@functools.cache
def _exact_exponentials() -> bool:
    """Whether _exponentials draws exponential_'s very values (a probe of 2^16 draws, and the generator's state)."""
    if sys.byteorder != "little":  # (the low word of a float64 is read as the first int32)
        return False
    a, b = torch.Generator().manual_seed(20240), torch.Generator().manual_seed(20240)
    want = torch.empty(1 << 16).exponential_(1, generator=a)
    return torch.equal(_exponentials(want.shape, b), want) and torch.equal(a.get_state(), b.get_state())


def sample_from(probs: Tensor, gen: torch.Generator | None) -> Tensor:
    """One draw per row of probs (…, V) -> (…,), the token torch.multinomial(probs, 1) draws from the same generator.

    On the CPU it is multinomial's own method, without multinomial's checks over the whole distribution (three
    passes and three host reads per call): q ~ Exp(1) per entry from gen, the argmax of probs / q. A distribution
    with NaN or infinite values, or with no mass, is refused from the entry that draw picks (a NaN or an infinity
    always wins the argmax; a distribution without mass picks a zero)."""
    flat = probs.detach().reshape(-1, probs.shape[-1])  # (a draw carries no gradient)
    if flat.device.type != "cpu":
        if not bool(torch.isfinite(flat).all()):  # (torch.multinomial would fail with an internal error)
            raise DlmError(NONFINITE)
        return torch.multinomial(flat, 1, generator=gen).reshape(probs.shape[:-1])
    q = exponentials(flat, gen)
    tokens = torch.div(flat, q, out=q).argmax(-1)
    picked = flat.gather(-1, tokens[:, None])
    if not bool(((picked > 0) & (picked < float("inf"))).all()):
        if not bool(torch.isfinite(flat).all()):
            raise DlmError(NONFINITE)
        raise DlmError("a sampling distribution has no probability mass (every entry is zero)")
    return tokens.reshape(probs.shape[:-1])


def draw(logits: Tensor, temperature: float, top_k: int, top_p: float,
         gen: torch.Generator | None) -> tuple[Tensor, Tensor | None]:
    """The one draw of every sampler: logits (…, V) -> tokens (…,) and the distribution they were drawn from
    (…, V), the draft probabilities a verifier needs; greedy (temperature 0) takes the argmax, and its
    distribution is None (one-hot)."""
    if temperature == 0:
        return logits.argmax(-1), None
    probs = probs_from_logits(logits, temperature, top_k, top_p)
    return sample_from(probs, gen), probs


def sample_token(logits: Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator | None) -> Tensor:
    """Greedy when temperature == 0, else a draw from the processed distribution. (…, V) -> (…,)."""
    return draw(logits, temperature, top_k, top_p, gen)[0]


@dataclass
class Sampling:
    """The distribution of a row (temperature, top-k, top-p) and its random stream."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    gen: torch.Generator | None = None

    @classmethod
    def of(cls, cfg, gen: torch.Generator | None = None) -> Sampling:
        """A SampleConfig's distribution, drawn with `gen`."""
        return cls(cfg.temperature, cfg.top_k, cfg.top_p, gen)

    def probs(self, logits: Tensor) -> Tensor:
        return probs_from_logits(logits, self.temperature, self.top_k, self.top_p)

    def draw(self, logits: Tensor) -> tuple[Tensor, Tensor | None]:
        """Tokens from logits (…, V) and their draft probabilities (None: greedy, one-hot)."""
        return draw(logits, self.temperature, self.top_k, self.top_p, self.gen)


def make_generator(seed: int | None, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed if seed is not None else torch.seed())
    return g


def entropy(probs: Tensor) -> Tensor:
    """Entropy in nats of distributions (..., V) -> (...); 0 log 0 = 0."""
    return -(probs * probs.clamp_min(1e-30).log()).sum(-1)


def entropy_bound_accept(ent: Tensor, bound: float, free: Tensor | None = None, k_min: int = 1) -> Tensor:
    """Which positions to accept: sort the free positions by entropy ascending and keep the longest
    prefix whose cumulative entropy minus its largest entropy is <= bound; at least k_min (usdm: 1;
    mdlm: its step budget). DiffusionGemma's rule, shared by the usdm and mdlm samplers.

    ent (n,) entropies; free (n,) bool: positions that may be accepted (default all). -> (n,) bool.
    """
    n = ent.shape[0]
    free = torch.ones(n, dtype=torch.bool, device=ent.device) if free is None else free
    accept = torch.zeros(n, dtype=torch.bool, device=ent.device)
    idx = free.nonzero().squeeze(1)
    if idx.numel() == 0:
        return accept
    e, order = torch.sort(ent[idx].double(), stable=True)
    # the largest of an ascending prefix is its last term, so cumsum - max = the sum of the terms before it
    before = torch.cat([e.new_zeros(1), e.cumsum(0)[:-1]])  # non-decreasing: the passing ones form a prefix
    k = min(idx.numel(), max(k_min, int((before <= bound).sum())))
    accept[idx[order[:k]]] = True
    return accept
