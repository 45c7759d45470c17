"""Lossless speculative decoding: one verifier, three drafters.

Each cycle the drafter proposes up to B-1 tokens (B: the block size of a cycle, `--block-size`) (optionally with their probabilities q), the
target scores [last committed token, proposals] in one forward over its KV cache, and

  greedy       the longest prefix of proposals equal to the target's argmax is accepted, then the
               target's own next token (the bonus): the output is the target's greedy output;
  temperature  proposal x_i is accepted with probability min(1, p(x_i)/q(x_i)); at the first
               rejection a token is drawn from the normalised residual max(0, p - q) instead; after
               all are accepted the bonus is drawn from p. A drafter without probabilities counts
               as one-hot (q(x_i) = 1). The output is distributed exactly as the target's samples.

The target's cache is cropped back to the committed length; the drafter is told how many of its
tokens were accepted (and given the target's features of the committed positions, if it reads
them), and rolls its own state back.

The Drafter base (every kind derives from it; three methods matter to the verifier; attributes taps, and
name/default_block_size/forwards for reports):
  taps                      target layers whose outputs the drafter reads (() for none)
  reset(prompt, feats)      a new sequence: prompt ids (P,), the target's taps over it (P, F) or None
  propose(seq, k)           committed ids so far (S,) -> (tokens (k',), q (k', V) or None), k' <= k
  accept(ids, feats)        the cycle's verified positions that stay: the last committed token and
                            the n accepted proposals (n + 1,), with the target's taps over them
                            (n + 1, F) or None. (The bonus token is committed but not yet verified.)

Rows: `propose` is the drafter's `draft(seq, k)` program (dlm/sampling/rows.py) answered over the drafter's
own cache (`answer`); the verifier (`speculation`) is a row program too. Alone, a row's requests are answered
one by one; in a `Batch`, one target forward serves every row that verifies and one drafter forward every row
that drafts, each row at its own length (a rejected draft crops that row's cache only). The drafter's model,
if it has one, is `row_model`: its requests are `on="draft"` (a self-speculating drafter asks the target).

Statistics: forwards (the target's), draft_forwards (the drafter model's), and in Done.stats.extra:
tau (tokens committed per cycle, bonus included; 1 <= tau <= block size), acceptance_histogram[n]
(cycles that committed n tokens), cycles, draft_seconds, verify_seconds, gamma (the block size of a
cycle), drafter; with --check-lossless, lossless (true when every prompt's output is the target's own
greedy output).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch
from torch import Tensor

from dlm.drafter import first_draws
from dlm.errors import DlmError, check
from dlm.masks import mdlm_denoise_mask
from dlm.model import KVCache, Transformer
from dlm.sampling import ar
from dlm.sampling.common import (
    Clock, Commit, Eos, Event, Prompt, Sampling, Stats, Verified, eos_set, make_generator, sample_from, through_eos,
)
from dlm.sampling.mdlm import row_seed
from dlm.sampling.rows import (
    Crop, Programs, RowProgram, Window, batchable, drive, finish, outputs, run_one, same,
)

AR_DRAFT_BLOCK = 5  # default block of an AR draft model: 4 proposals + the bonus
LOOKUP_BLOCK = 8
MAX_BLOCK = 64  # the largest block of a cycle
# the SampleConfig fields speculative decoding reads (see dlm.sampling.OPTIONS); DRAFTER_OPTIONS: those only one
# kind of drafter reads (option -> the kind's name in `--draft`, and in words)
OPTIONS = frozenset({"temperature", "top_k", "top_p", "block_size", "draft", "draft_passes", "draft_top_k",
                     "draft_branches", "lookup_ngram", "check_lossless", "suffix"})
DRAFTER_OPTIONS = {"draft_passes": (("dflash", "diffusion"), "a DFlash or diffusion drafter"),
                   "draft_top_k": (("dflash",), "a DFlash 2 drafter"),
                   "draft_branches": (("dflash",), "a DFlash drafter"),
                   "lookup_ngram": (("lookup",), "prompt lookup")}


def kind_reads(kind: str | None, kinds: tuple[str, ...]) -> bool:
    """Whether a drafter of this kind (a combined one's: 'dflash+lookup'; None or '': no drafter) reads an option of
    DRAFTER_OPTIONS that drafters of `kinds` read."""
    return any(part in kinds for part in (kind or "").split("+"))


DIFFUSION_DRAFT_PASSES = 3  # refinement passes of a diffusion drafter at most (--draft-passes)


class Drafter:
    """What the verifier needs of a drafter, and the base of every kind (prompt lookup, an AR draft model, DFlash, a
    diffusion model, self-speculation): a kind overrides `draft` and `fork`, and what it keeps between cycles.

    Built once from a checkpoint by dlm.drafters.load_drafter (the sampler reads nothing from disk); `fork(cfg, gen)`
    gives each request a drafter of its own that shares the loaded weights and draws from the request's distribution
    with its generator (a row's Sampling comes from there)."""

    taps: tuple[int, ...] = ()  # target layers whose outputs it reads (() for none)
    kind = ""  # lookup | ar | dflash | diffusion | self, or KIND+lookup: which of DRAFTER_OPTIONS it reads
    name = ""
    default_block_size = LOOKUP_BLOCK
    max_block_size: int | None = None  # the largest block it can draft (None: MAX_BLOCK)
    row_model = None  # the model its `on="draft"` requests run on (None: it asks for none, or asks the target)
    forwards = 0  # forward passes of the drafter's model so far
    sampling = Sampling()  # the distribution it proposes from (a fork's: its request's)

    def fork(self, cfg, gen: torch.Generator | None = None) -> Drafter:
        """A fresh drafter for a request with these SampleConfig options, sharing this one's weights, drawing with
        `gen`."""
        raise NotImplementedError

    def bind(self, cache: KVCache) -> None:
        """The target's KV cache of this sequence (self-speculation drafts over it; the others ignore it)."""

    def reset(self, prompt: Tensor, feats: Tensor | None) -> None:
        """A new sequence: prompt ids (P,), the target's taps over it (P, F) or None."""

    def accept(self, ids: Tensor, feats: Tensor | None) -> None:
        """The verified positions that stay: the last committed token and the accepted proposals, with taps."""

    def draft(self, seq: Tensor, k: int) -> Iterator:
        """`propose` as a row program: yields Window / Crop requests, returns (tokens, q)."""
        raise NotImplementedError

    def answer(self, request):
        """A request of its draft answered over its own cache (the one-row path)."""
        raise AssertionError(f"{self.name} runs no model of its own")

    def draft_tree(self, seq: Tensor, k: int, width: int) -> Iterator:
        """`draft` as up to `width` branches that differ at the first slot (--draft-branches): returns tokens (W, k)
        and q (W, k, V) or None, each branch's first-slot q the distribution its draw came from. A kind that drafts
        one path (all but DFlash: the option is ignored there, as `dlm generate` warns) gives its `draft`."""
        tokens, q = yield from self.draft(seq, k)
        return tokens[None], None if q is None else q[None]

    def propose(self, seq: Tensor, k: int) -> tuple[Tensor, Tensor | None]:
        """Committed ids (S,) -> up to k proposals (k',) and their probabilities (k', V) or None (one-hot)."""
        return finish(self.draft(seq, k), self.answer)


# drafters -------------------------------------------------------------------------------------------

class PromptLookup(Drafter):
    """Propose the tokens that followed an earlier occurrence of the context's last n-gram.

    The longest n (<= max_ngram) with a match wins; among its matches the most recent one that is
    followed by k tokens, else the earliest (the longest continuation there is).
    """

    kind = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        check(max_ngram >= 1, f"--lookup-ngram must be >= 1, got {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min(min_ngram, max_ngram)
        self.forwards = 0
        self.default_block_size = LOOKUP_BLOCK
        self.name = f"lookup (n<={max_ngram})"
        self.sampling = Sampling()

    def fork(self, cfg, gen: torch.Generator | None = None) -> PromptLookup:
        d = PromptLookup(cfg.lookup_ngram, self.min_ngram)
        d.sampling = Sampling.of(cfg, gen)
        return d

    def draft(self, seq: Tensor, k: int) -> Iterator:
        return self.propose(seq, k)
        yield  # (a program that asks for no forward)

    def propose(self, seq: Tensor, k: int) -> tuple[Tensor, None]:
        return self.match(seq, k)[0], None

    def match(self, seq: Tensor, k: int, shortest: int | None = None) -> tuple[Tensor, int]:
        """Committed ids (S,) -> up to k proposals (k',) and the length n of the n-gram they follow (0: none), n at
        least `shortest` (default: its min_ngram)."""
        S = seq.shape[0]
        for n in range(min(self.max_ngram, S - 1), (shortest or self.min_ngram) - 1, -1):
            windows = seq.unfold(0, n, 1)[:-1]  # (S-n, n): every earlier n-gram (the suffix itself excluded)
            starts = (windows == seq[S - n:]).all(-1).nonzero()[:, 0] + n
            if starts.numel():
                full = starts[starts <= S - k]
                start = int(full[-1]) if full.numel() else int(starts[0])
                return seq[start:start + k], n
        return seq[:0], 0


class WithLookup(Drafter):
    """A model's drafter that gives way to prompt lookup: a cycle whose context ends in an n-gram of the lookup's
    longest length (--lookup-ngram) seen before proposes what followed it there, at no cost; every other cycle drafts
    with the model. The model still reads every committed position (a DFlash drafter's context waits in its pending
    features, an AR draft's cache catches up at its next draft)."""

    def __init__(self, main: Drafter, lookup: PromptLookup):
        self.main, self.lookup = main, lookup
        self.kind = f"{main.kind}+lookup"
        self.taps = main.taps
        self.name = f"{main.name} + lookup"
        self.default_block_size, self.max_block_size = main.default_block_size, main.max_block_size
        self.lookups = 0  # cycles drafted by lookup

    def fork(self, cfg, gen: torch.Generator | None = None) -> WithLookup:
        return WithLookup(self.main.fork(cfg, gen), self.lookup.fork(cfg, gen))

    @property
    def row_model(self):
        return self.main.row_model

    @property
    def sampling(self) -> Sampling:
        return self.main.sampling

    @sampling.setter
    def sampling(self, sampling: Sampling) -> None:
        self.main.sampling = sampling

    @property
    def forwards(self) -> int:
        return self.main.forwards

    @forwards.setter
    def forwards(self, n: int) -> None:
        self.main.forwards = n

    def bind(self, cache: KVCache) -> None:
        self.main.bind(cache)

    def reset(self, prompt: Tensor, feats: Tensor | None) -> None:
        self.main.reset(prompt, feats)

    def accept(self, ids: Tensor, feats: Tensor | None) -> None:
        self.main.accept(ids, feats)

    def answer(self, request):
        return self.main.answer(request)

    def draft(self, seq: Tensor, k: int) -> Iterator:
        tokens, n = self.lookup.match(seq, k, self.lookup.max_ngram)  # (only its longest n-gram counts)
        if k and n and tokens.numel():
            self.lookups += 1
            return tokens, None
        return (yield from self.main.draft(seq, k))

    def draft_tree(self, seq: Tensor, k: int, width: int) -> Iterator:
        tokens, n = self.lookup.match(seq, k, self.lookup.max_ngram)
        if k and n and tokens.numel():  # lookup's one path
            self.lookups += 1
            return tokens[None], None
        return (yield from self.main.draft_tree(seq, k, width))


class _OwnModel(Drafter):
    """A drafter with a model of its own (`model`, `capacity`): its requests run on that model (`row_model`); alone,
    over a cache of its own, made on the first request."""

    @property
    def row_model(self) -> Transformer:
        return self.model

    def answer(self, request):
        if self.cache is None:
            self.cache = self.model.new_cache(1, self.capacity)
        if isinstance(request, Crop):
            return self.cache.crop(request.length)
        return run_one(self.model, self.cache, request)


class ARDraft(_OwnModel):
    """A small AR model (same tokenizer) drafting one token per forward with its own KV cache."""

    kind = "ar"

    def __init__(self, model: Transformer, sampling: Sampling, capacity: int, name: str = "ar-draft"):
        self.model, self.sampling, self.capacity = model, sampling, capacity
        self.forwards = 0
        self.default_block_size = AR_DRAFT_BLOCK
        self.name = name

    def fork(self, cfg, gen: torch.Generator | None = None) -> ARDraft:
        return ARDraft(self.model, Sampling.of(cfg, gen), self.capacity, self.name)

    def reset(self, prompt: Tensor, feats: Tensor | None) -> None:
        self.cache = None  # its own cache, made on the first request of the one-row path
        self.cached = 0  # positions in its cache
        self.base = 0

    def draft(self, seq: Tensor, k: int) -> Iterator:
        yield Crop(self.cached, on="draft")  # the rejected proposals of the last cycle leave its cache
        # feed what the cache lacks (the last committed token, and after a full acceptance one more)
        x = seq[self.cached:]
        toks, qs = [], []
        self.base = seq.shape[0]
        for i in range(k):
            T = x.shape[0]
            logits = (yield Window(tokens=x, mask="causal", keep=T, out=(T - 1, T), on="draft"))[0, -1]  # (V,)
            self.cached += T
            self.forwards += 1
            t, q = self.sampling.draw(logits)
            if q is not None:
                qs.append(q)
            toks.append(t)
            x = t.view(1)
        return torch.stack(toks) if toks else seq[:0], torch.stack(qs) if qs else None

    def accept(self, ids: Tensor, feats: Tensor | None) -> None:
        # the cache holds seq + proposals[:k-1]; the accepted ones stay
        self.cached = min(self.cached, self.base + ids.shape[0] - 1)


REFINE_CONFIDENCE = 0.9  # a refining drafter keeps the slots it is this sure of (--draft-passes > 1)


def refine(logits: Tensor, passes: int, mask_id: int, again) -> Iterator:
    """The masked-draft refinement of every drafter that denoises a block (DFlash, a diffusion model): up to passes - 1
    times, keep the slots the draft is sure of (p >= REFINE_CONFIDENCE) and re-predict the others given them
    (`again(slots)`: a row program over the slots (k,), kept ones filled in and the others <mask>, that returns the
    new logits (k, V)); stops when every slot or none is sure. logits (k, V) -> (k, V)."""
    for _ in range(passes - 1):
        conf, guess = logits.float().softmax(-1).max(-1)  # (k,)
        keep = conf >= REFINE_CONFIDENCE
        if bool(keep.all()) or not bool(keep.any()):
            break
        logits = torch.where(keep[:, None], logits, (yield from again(torch.where(keep, guess, mask_id))))
    return logits


class DFlashDraft(Drafter):
    """A DFlash drafter: one bidirectional pass over [last token, masks] conditioned on target features."""

    kind = "dflash"

    def __init__(self, drafter, target: Transformer, sampling: Sampling, capacity: int, passes: int = 1,
                 name: str = "dflash", top_k: int | None = None):
        check(1 <= passes <= 3, f"--draft-passes must be 1, 2 or 3, got {passes}")
        check(passes == 1 or drafter.candidate_selector is None,
              f"--draft-passes {passes}: a DFlash 2 drafter's selector drafts in one pass (use 1)")
        check(top_k is None or drafter.candidate_selector is not None,
              f"--draft-top-k {top_k}: only a DFlash 2 drafter has candidates to choose among "
              "(this one has no selector)")
        check(top_k is None or top_k >= 1, f"--draft-top-k must be >= 1, got {top_k}")
        self.d, self.target, self.sampling, self.capacity, self.passes = drafter, target, sampling, capacity, passes
        self.top_k = top_k
        self.taps = drafter.taps
        self.forwards = 0
        self.default_block_size = self.max_block_size = drafter.block_size
        self.name = name
        self.noise: torch.Generator | None = None  # a uniform-noise drafter's random first block

    def fork(self, cfg, gen: torch.Generator | None = None) -> DFlashDraft:
        return DFlashDraft(self.d, self.target, Sampling.of(cfg, gen), self.capacity, cfg.draft_passes, self.name,
                           cfg.draft_top_k)

    def _feats(self, ids: Tensor, feats: Tensor | None) -> Tensor:
        if self.d.target_features:
            return self.d.norm_last(self.target, feats[None])  # (1, n, F)
        return self.target.embed_tokens(ids[None])  # the ablation without target features

    @property
    def row_model(self):
        return self.d

    def reset(self, prompt: Tensor, feats: Tensor | None) -> None:
        self.cache = None  # its own cache, made on the first request of the one-row path
        self.pending = self._feats(prompt, feats)  # context not yet in the drafter's cache: (1, C, F)

    def answer(self, request):
        if self.cache is None:
            self.cache = self.d.new_cache(self.capacity)
        if isinstance(request, Crop):
            return self.cache.crop(request.length)
        return run_one(self.d, self.cache, request)

    def draft(self, seq: Tensor, k: int) -> Iterator:
        if k == 0:
            return seq[:0], None
        logits = yield from self.draft_logits(seq, k)
        sel = self.d.candidate_selector
        if sel is None:
            return self.sampling.draw(logits)  # (k,), (k, V): slots drawn independently
        # DFlash 2: a path through each slot's top candidates, from the last committed token; its q is the
        # selector's distribution over the candidates, zero elsewhere (what the verifier's residual needs)
        t = self.sampling.temperature
        tokens, cands, q = sel.select(self.hidden[None], logits[None].float(), seq[-1:], t, self.sampling.gen,
                                      self.top_k)
        dense = None if q is None else torch.zeros(k, logits.shape[-1], device=q.device).scatter_(-1, cands[0], q[0])
        return tokens[0], dense

    def draft_tree(self, seq: Tensor, k: int, width: int) -> Iterator:
        logits = yield from self.draft_logits(seq, k)  # one pass: the branches differ in the tokens chosen, not in h
        sel = self.d.candidate_selector
        t = self.sampling.temperature
        if sel is not None:  # DFlash 2: each branch the selector's walk after its own first token
            tokens, cands, q = sel.branches(self.hidden, logits.float(), seq[-1], t, self.sampling.gen, width,
                                            self.top_k)
            if q is None:
                return tokens, None
            dense = torch.zeros(*q.shape[:2], logits.shape[-1], device=q.device)
            return tokens, dense.scatter_(-1, cands[None].expand(q.shape[0], -1, -1), q)
        if t == 0:  # DFlash 1: the slots are independent; the first slot's W best, the argmax after them
            first = torch.topk(logits[0], min(width, logits.shape[-1])).indices
            rest = logits[1:].argmax(-1)
            return torch.cat((first[:, None], rest[None].expand(first.shape[0], -1)), 1), None
        p = self.sampling.probs(logits)  # (k, V)
        first, q0 = first_draws(p[0], width, self.sampling.gen)
        W = first.shape[0]
        rest = sample_from(p[1:][None].expand(W, -1, -1), self.sampling.gen)  # (W, k - 1): each branch's own draws
        q = torch.cat((q0[:, None], p[1:][None].expand(W, -1, -1)), 1)
        return torch.cat((first[:, None], rest), 1), q

    def logits(self, seq: Tensor, k: int) -> Tensor:
        """The draft's logits for the k slots after seq's last token (k >= 1); the cache takes the new
        context. (k, V)"""
        return finish(self.draft_logits(seq, k), self.answer)

    def draft_logits(self, seq: Tensor, k: int) -> Iterator:
        """`logits` as a row program: the new context's K/V go to the row's drafter cache, the block is read only."""
        dev = seq.device  # the block sits at the last committed token's position (its anchor) onwards
        C = self.pending.shape[1]
        ctx = self.d.context(self.pending)[0] if C else None  # (C, D)
        block = torch.full((1, k + 1), self.d.mask_id, dtype=torch.long, device=dev)
        block[0, 0] = seq[-1]
        uniform = self.d.block_noise == "uniform"
        if uniform:  # the slots start as uniform random tokens (their own stream: the draft is reproducible)
            if self.noise is None:
                self.noise = torch.Generator(device=dev).manual_seed(0)
            block[0, 1:] = torch.randint(0, self.d.cfg.vocab_size, (k,), generator=self.noise, device=dev)

        def ask(ctx=None) -> Iterator:
            h = yield Window(embeds=self.d.embed(self.target, block)[0], ctx=ctx, out=(1, k + 1), hidden=True,
                             on="draft")
            self.forwards += 1
            return h[0]  # (k, D)

        h = yield from ask(ctx)
        self.pending = self.pending[:, :0]
        self.hidden = h  # (k, D): what DFlash 2's selector reads beside the logits
        logits = self.d.head(self.target, h)  # (k, V)
        for _ in range(self.passes - 1 if uniform else 0):  # revise: every slot re-predicted from the last guesses
            block[0, 1:] = logits.argmax(-1)
            logits = self.d.head(self.target, (yield from ask()))
        if uniform:
            return logits

        def again(slots: Tensor) -> Iterator:
            block[0, 1:] = slots
            return self.d.head(self.target, (yield from ask()))

        return (yield from refine(logits, self.passes, self.d.mask_id, again))

    def accept(self, ids: Tensor, feats: Tensor | None) -> None:
        self.pending = torch.cat((self.pending, self._feats(ids, feats)), dim=1)


class DiffusionDraft(_OwnModel):
    """A masked-diffusion checkpoint (mdlm, or a joint model's diffusion mode) with the target's tokenizer as the
    drafter: the k slots after the committed tokens are <mask>, denoised in one pass (or up to 3 with
    --draft-passes: slots the model is sure of, p >= 0.9, are kept, the others re-predicted given them). It reads
    none of the target's hidden states: only the committed tokens, through its own KV cache.

    The drafter's grid of blocks (its training block) decides what it sees, as its own sampler does: committed
    tokens in finished blocks are written to the cache once, block-causally (causally for a joint model), and the
    committed tokens of the current block are denoised together with the slots, which see all of them."""

    kind = "diffusion"

    def __init__(self, model: Transformer, mask_id: int, grid: int, sampling: Sampling, capacity: int,
                 passes: int = 1, causal_context: bool = False, name: str = "diffusion"):
        check(1 <= passes <= DIFFUSION_DRAFT_PASSES, f"--draft-passes must be 1, 2 or 3, got {passes}")
        self.model, self.mask_id, self.grid, self.sampling = model, mask_id, grid, sampling
        self.capacity, self.passes, self.causal_context, self.name = capacity, passes, causal_context, name
        self.forwards = 0
        self.default_block_size = LOOKUP_BLOCK
        self.cached = 0

    def fork(self, cfg, gen: torch.Generator | None = None) -> DiffusionDraft:
        return DiffusionDraft(self.model, self.mask_id, self.grid, Sampling.of(cfg, gen), self.capacity,
                              cfg.draft_passes, self.causal_context, self.name)

    def reset(self, prompt: Tensor, feats: Tensor | None) -> None:
        self.cache = None  # its own cache, made on the first request of the one-row path
        self.cached = 0

    def draft(self, seq: Tensor, k: int) -> Iterator:
        if k == 0:
            return seq[:0], None
        dev, S = seq.device, seq.shape[0]
        cur = (S // self.grid) * self.grid  # the current block starts here; finished blocks before it
        start, stop = self.cached, S + k
        ids = torch.cat((seq[start:], torch.full((k,), self.mask_id, dtype=torch.long, device=dev)))
        block_of = torch.arange(stop, device=dev) // self.grid
        block_of[cur:] = cur // self.grid  # the slots join the current block, wherever the grid would cut them
        sees = mdlm_denoise_mask(block_of, start, stop, self.causal_context)[:, start:]  # (the cache: always seen)
        logits = (yield Window(tokens=ids, mask=sees, keep=cur - start, out=(S - start, stop - start), on="draft"))[0]
        self.forwards += 1
        self.cached = cur  # the finished blocks' K/V stay
        logits[:, self.mask_id] = float("-inf")

        def again(slots: Tensor) -> Iterator:
            out = (yield Window(tokens=torch.cat((seq[cur:], slots)), out=(S - cur, stop - cur), on="draft"))[0]
            self.forwards += 1
            out[:, self.mask_id] = float("-inf")
            return out

        return self.sampling.draw((yield from refine(logits, self.passes, self.mask_id, again)))


# the verifier ----------------------------------------------------------------------------------------

@dataclass
class SpecStats:
    cycles: int = 0
    committed: int = 0
    histogram: list[int] = field(default_factory=list)
    forwards: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    branched: int = 0  # cycles whose accepted tokens came from a draft tree's branch other than the first
    branches: int = 1  # the draft trees' width (1: one path)

    def add(self, n: int) -> None:
        while len(self.histogram) <= n:
            self.histogram.append(0)
        self.histogram[n] += 1
        self.cycles += 1
        self.committed += n


def verify_greedy(draft: Tensor, logits: Tensor) -> tuple[int, int]:
    """draft (k,), target logits (k+1, V) -> (accepted, bonus token)."""
    pred = logits.argmax(-1)  # (k+1,)
    k = draft.shape[0]
    n = int((pred[:k] == draft).int().cumprod(0).sum()) if k else 0
    return n, int(pred[n])


def verify_sample(draft: Tensor, p: Tensor, q: Tensor | None, gen: torch.Generator | None) -> tuple[int, int]:
    """Speculative sampling. draft (k,), target probs p (k+1, V), draft probs q (k, V) or None (one-hot)."""
    k = draft.shape[0]
    n = 0
    if k:
        rows = torch.arange(k, device=p.device)
        px = p[rows, draft]
        qx = q[rows, draft] if q is not None else torch.ones_like(px)
        r = torch.rand(k, generator=gen, device=p.device)
        n = int((r * qx < px).int().cumprod(0).sum())  # accept x while r < p(x) / q(x)
    if n == k:
        return n, int(sample_from(p[k], gen))
    residual = p[n].clone()
    if q is not None:
        residual -= q[n]
    else:
        residual[draft[n]] = 0.0
    residual.clamp_(min=0.0)
    total = residual.sum()
    residual = residual / total if total > 0 else p[n]
    return n, int(sample_from(residual, gen))


def verify(draft: Tensor, logits: Tensor, q: Tensor | None, sampling: Sampling) -> tuple[int, int]:
    """The one verifier: greedy match at temperature 0, speculative sampling above (target logits (k+1, V))."""
    if sampling.temperature == 0:
        return verify_greedy(draft, logits)
    return verify_sample(draft, sampling.probs(logits), q, sampling.gen)


def tree_window(W: int, k: int, dev) -> tuple[Tensor, Tensor]:
    """A draft tree's verify window [last token, branch 0's k slots, ..., branch W-1's]: its mask (T, T) (each slot
    sees the last token and its own branch up to itself) and each token's depth (T,) (its offset from the last
    token's position)."""
    j = torch.arange(k, device=dev)
    depth = torch.cat((j.new_zeros(1), (j + 1).repeat(W)))
    branch = torch.cat((j.new_full((1,), -1), torch.arange(W, device=dev).repeat_interleave(k)))
    T = 1 + W * k
    causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()
    mask = causal & ((branch[None] == branch[:, None]) | (branch[None] == -1))
    return mask, depth


def branch_rows(w: int, k: int) -> list[int]:
    """The verify window's offsets of branch w's path: the last token, then its k slots."""
    return [0, *range(1 + w * k, 1 + (w + 1) * k)]


def verify_tree(drafts: Tensor, logits: Tensor, q: Tensor | None, sampling: Sampling) -> tuple[int, int, int]:
    """Multi-draft verification of a draft tree: drafts (W, k) (branches that differ at the first slot), the target's
    logits over `tree_window` (1 + W k, V), q (W, k, V) or None -> (the branch kept, accepted, bonus token).

    Greedy: the branch whose first token is the target's argmax, matched on along it. T > 0: the first slot by
    recursive rejection (SpecInfer's, over draws without replacement): branch w's token accepted with probability
    min(1, r_w(x) / q_w(x)), r_0 = p, r_{w+1} = norm(max(r_w - q_w, 0)); after the last rejection the bonus is a draw
    from that residual; past an accepted first token, speculative sampling along its branch. The tokens are
    distributed as the target's (tests/test_verifier.py)."""
    W, k = drafts.shape
    if sampling.temperature == 0:
        first = int(logits[0].argmax())
        hit = (drafts[:, 0] == first).nonzero()
        if not hit.numel():
            return 0, 0, first
        w = int(hit[0, 0])
        n, bonus = verify_greedy(drafts[w], logits[branch_rows(w, k)])
        return w, n, bonus
    gen = sampling.gen
    r = sampling.probs(logits[0])
    for w in range(W):
        x = int(drafts[w, 0])
        if float(torch.rand((), generator=gen, device=r.device)) * float(q[w, 0, x]) < float(r[x]):
            p = sampling.probs(logits[branch_rows(w, k)[1:]])  # (k, V): after each of the branch's slots
            n, bonus = verify_sample(drafts[w, 1:], p, q[w, 1:], gen)
            return w, n + 1, bonus
        left = (r - q[w, 0]).clamp_(min=0.0)
        total = left.sum()
        r = left / total if total > 0 else r
    return 0, 0, int(sample_from(r, gen))


def trim(tokens: list[int], room: int, eos_id: Eos) -> list[int]:
    """A cycle's committed tokens, cut to the room left and after an end of text."""
    return through_eos(tokens[:room], eos_id)[0]


def check_lossless_greedy(cfg) -> None:
    """--check-lossless compares greedy outputs: refused with sampling."""
    if cfg.check_lossless and cfg.temperature > 0:
        raise DlmError("--check-lossless compares greedy outputs token for token: use --temperature 0 "
                       "(sampling is lossless in distribution, which tests/test_verifier.py checks)")


MAX_BRANCHES = 8


def verify_width(block_size: int, branches: int) -> int:
    """Tokens of a verify window: the last token, then each branch's slots (and one slot to spare)."""
    return 1 + branches * (block_size - 1) + 1


def check_branches(cfg) -> None:
    check(1 <= cfg.draft_branches <= MAX_BRANCHES,
          f"--draft-branches must be in [1, {MAX_BRANCHES}], got {cfg.draft_branches}")


def _taps(out, layers: tuple[int, ...]) -> Tensor | None:
    return torch.cat([out.taps[i][0] for i in layers], dim=-1) if layers else None  # (T, F)


def speculation(drafter: Drafter, prompt: Sequence[int], *, block_size: int, max_new_tokens: int, sampling: Sampling,
                eos_id: Eos, row: int = 0, stats: SpecStats | None = None, clock: Clock | None = None,
                dev: torch.device | str = "cpu", branches: int = 1) -> Iterator:
    """One prompt's speculative decoding as a row program: its Commit and Verified events, and its requests (the
    target's prefill and verify passes, its drafter's; a Crop of the target's cache after each verify).

    branches > 1 (--draft-branches): each cycle drafts a tree of that many paths that differ at the first slot
    (`Drafter.draft_tree`), verified in one forward (`tree_window`, `verify_tree`); the kept branch's K/V are moved
    into place behind the last token (Crop.take)."""
    stats = stats if stats is not None else SpecStats()
    stats.branches = branches
    taps = drafter.taps
    P = len(prompt)
    seq = torch.empty(P + max_new_tokens + 1, dtype=torch.long, device=dev)
    seq[:P] = torch.tensor(list(prompt), dtype=torch.long, device=dev)
    t0 = time.perf_counter()
    logits, feats = _split((yield Window(tokens=seq[:P], mask="causal", keep=P, out=(P - 1, P), taps=taps)), taps)
    stats.forwards += 1
    tok = int(sampling.draw(logits[0, -1])[0])
    drafter.reset(seq[:P], feats)
    stats.verify_seconds += time.perf_counter() - t0
    seq[P] = tok
    S, new = P + 1, 1  # committed length (the target's cache holds all of them but the last), new tokens
    if clock is not None:
        clock.mark_first()
    yield Commit([tok], row=row)
    stop = eos_set(eos_id)
    while new < max_new_tokens and tok not in stop:
        t0 = time.perf_counter()
        # as many slots as tokens are still wanted (the bonus past them is dropped): the package's dflash_generate
        # drafts that block, and a DFlash block one slot shorter drafts other tokens (its slots see each other)
        want = min(block_size - 1, max_new_tokens - new)
        if branches > 1:
            tree, q = yield from drafter.draft_tree(seq[:S], want, branches)
        else:
            draft, q = yield from drafter.draft(seq[:S], want)
            tree, q = draft[None], None if q is None else q[None]  # (draft_tree's shapes: one branch)
        t1 = time.perf_counter()
        stats.draft_seconds += t1 - t0
        W, k = tree.shape
        if W == 1:
            draft, q = tree[0], None if q is None else q[0]
            block = torch.cat((seq[S - 1:S], draft))  # (k+1,)
            logits, feats = _split((yield Window(tokens=block, mask="causal", keep=k + 1, out=(0, k + 1), taps=taps)),
                                   taps)
            w, (n, bonus) = 0, verify(draft, logits[0], q, sampling)
            yield Crop(S + n)  # keep the last committed token and the accepted proposals
        else:
            mask, depth = tree_window(W, k, dev)
            window = torch.cat((seq[S - 1:S], tree.reshape(-1)))  # (1 + W k,)
            T = window.shape[0]
            logits, feats = _split((yield Window(tokens=window, mask=mask, pos=S - 1 + depth, keep=T, out=(0, T),
                                                 taps=taps)), taps)
            w, n, bonus = verify_tree(tree, logits[0], q, sampling)
            stats.branched += bool(n and w)
            draft = tree[w]
            rows = branch_rows(w, k)[:n + 1]
            block = window[rows]
            feats = feats[rows] if feats is not None else None
            # the kept branch's accepted slots from where the window wrote them to the slots behind the last token
            yield Crop(S + n, take=(rows[1] + S - 1, S) if n and w else None)
        stats.forwards += 1
        drafter.accept(block[:n + 1], feats[:n + 1] if feats is not None else None)
        stats.verify_seconds += time.perf_counter() - t1
        committed = trim(draft[:n].tolist() + [bonus], max_new_tokens - new, eos_id)
        stats.add(len(committed))
        seq[S:S + len(committed)] = torch.tensor(committed, device=dev)
        S += len(committed)
        new += len(committed)
        tok = committed[-1]
        yield Verified(draft.tolist(), n, row=row)
        yield Commit(committed, row=row)


def _split(out, taps: tuple[int, ...]) -> tuple[Tensor, Tensor | None]:
    return out if taps else (out, None)


class Alone:
    """The one-row answers of a row program: the target's requests over a cache of its own, the drafter's over the
    drafter's (a self-speculating drafter reads the target's: `bind`)."""

    def __init__(self, target: Transformer, capacity: int, drafter: Drafter | None = None):
        self.target, self.drafter = target, drafter
        self.cache = target.new_cache(1, capacity)
        if drafter is not None:
            drafter.bind(self.cache)

    def __call__(self, request):
        if request.on != "target":
            return self.drafter.answer(request)
        if isinstance(request, Crop):
            return self.cache.crop(request.length, request.take)
        return run_one(self.target, self.cache, request)


@torch.inference_mode()
def speculate(target: Transformer, drafter: Drafter, prompt: Sequence[int], *, block_size: int, max_new_tokens: int = 128,
              sampling: Sampling | None = None, eos_id: Eos = None, row: int = 0,
              stats: SpecStats | None = None, clock: Clock | None = None, branches: int = 1) -> Iterator[Event]:
    """Generate from one prompt with `drafter` proposing and `target` verifying (Commit and Verified events)."""
    program = speculation(drafter, prompt, block_size=block_size, max_new_tokens=max_new_tokens,
                          sampling=sampling or Sampling(), eos_id=eos_id, row=row, stats=stats, clock=clock,
                          dev=target.device, branches=branches)
    yield from drive(program, Alone(target, len(prompt) + max_new_tokens + verify_width(block_size, branches),
                                    drafter))


def drafter_capacity(target: Transformer) -> int:
    """Cache slots a drafter needs for any generation of this target (context + one block + bonus)."""
    return target.cfg.max_seq_len + MAX_BLOCK + 2


def resolve_block_size(drafter: Drafter, block_size: int | None) -> int:
    """The block of a cycle: --block-size, else the drafter's default."""
    if block_size is None:
        return drafter.default_block_size
    check(2 <= block_size <= MAX_BLOCK,
          f"--block-size must be in [2, {MAX_BLOCK}] (the last token + at least one proposal), got {block_size}")
    if drafter.max_block_size is not None and block_size > drafter.max_block_size:
        raise DlmError(f"--block-size {block_size} is larger than the block size the drafter was built for "
                       f"({drafter.max_block_size})")
    return block_size


# the sampler ------------------------------------------------------------------------------------------

def stream(model: Transformer, ck, prompts: list[Prompt], cfg, drafter: Drafter | None = None) -> Iterator[Event]:
    """Speculative decoding of an AR target (cfg: SampleConfig), one Done at the end. Several prompts run as rows of
    one Batch (one target forward per verify step, one drafter forward per draft step, for all of them) when the
    models allow, else one after another; row r drafts with its own fork of `drafter` and samples with its own
    generator (seeded seed + r), so its tokens are those it gets alone.

    `drafter`: built by dlm.drafters.load_drafter; the sampler reads nothing from disk.
    """
    if ck.objective not in ("ar", "joint"):
        raise DlmError(f"--draft: speculative decoding verifies with an AR target; {ck.path} is a "
                       f"{ck.objective} checkpoint")
    ar.check_options(model, prompts, cfg, "speculative decoding")
    check_lossless_greedy(cfg)
    check_branches(cfg)
    if drafter is None:
        raise DlmError("speculative decoding needs a drafter: load one with dlm.drafters.load_drafter")
    block_size = resolve_block_size(drafter, cfg.block_size)
    eos = ck.tokenizer.eos_ids

    def row(b: int, p: list[int], sampling: Sampling, spec: SpecStats, clock: Clock) -> tuple:
        if len(prompts) > 1:
            d = drafter.fork(cfg, sampling.gen)
        else:  # a lone row drafts with the caller's drafter (built with these options), from the row's distribution
            d = drafter
            d.sampling = sampling
        program = speculation(d, p, block_size=block_size, max_new_tokens=cfg.max_new_tokens, sampling=d.sampling,
                              eos_id=eos, row=b, stats=spec, clock=clock, dev=model.device,
                              branches=cfg.draft_branches)
        return program, d, len(p) + cfg.max_new_tokens + verify_width(block_size, cfg.draft_branches)

    return run_rows(model, ck, [p.ids for p in prompts], cfg, row, drafter.name, block_size, drafter)


def row_program(model: Transformer, ck, prompt: Prompt, cfg, row: int = 0, *, drafter: Drafter,
                stats: SpecStats | None = None, clock: Clock | None = None) -> RowProgram:
    """A request as a row of a batch (the server's): its program and its own fork of `drafter`, drawing with a
    generator seeded cfg.seed. Raises on bad options, before any work."""
    if ck.objective not in ("ar", "joint"):
        raise DlmError(f"--draft: speculative decoding verifies with an AR target; {ck.path} is a "
                       f"{ck.objective} checkpoint")
    ar.check_options(model, [prompt], cfg, "speculative decoding")
    check_lossless_greedy(cfg)
    check_branches(cfg)
    d = drafter.fork(cfg, make_generator(cfg.seed, model.device))
    B = resolve_block_size(d, cfg.block_size)
    stats = stats if stats is not None else SpecStats()
    program = speculation(d, prompt.ids, block_size=B, max_new_tokens=cfg.max_new_tokens, sampling=d.sampling,
                          eos_id=ck.tokenizer.eos_ids, row=row, stats=stats, clock=clock, dev=model.device,
                          branches=cfg.draft_branches)
    return RowProgram(program, stats, drafter=d)


def spec_stats(spec: SpecStats, drafter: str, block_size: int, new: int, draft_forwards: int) -> Stats:
    """The statistics of a speculative call (the Done event's), from its verify-cycle bookkeeping."""
    return Stats(new_tokens=new, forwards=spec.forwards, draft_forwards=draft_forwards, extra={
        "tau": spec.committed / spec.cycles if spec.cycles else 0.0,
        "acceptance_histogram": spec.histogram + [0] * (block_size + 1 - len(spec.histogram)),
        "cycles": spec.cycles, "draft_seconds": spec.draft_seconds, "verify_seconds": spec.verify_seconds,
        **({"branches": spec.branches, "branched_cycles": spec.branched} if spec.branches > 1 else {}),
        "block_size": block_size, "gamma": block_size, "drafter": drafter})  # gamma: the older key


def pooled(specs: list[SpecStats]) -> SpecStats:
    """The verify-cycle bookkeeping of several rows together."""
    out = SpecStats()
    for st in specs:
        out.cycles += st.cycles
        out.committed += st.committed
        out.forwards += st.forwards
        out.draft_seconds += st.draft_seconds
        out.verify_seconds += st.verify_seconds
        out.branched += st.branched
        out.branches = max(out.branches, st.branches)
        out.histogram += [0] * (len(st.histogram) - len(out.histogram))
        for n, c in enumerate(st.histogram):
            out.histogram[n] += c
    return out


def rows_batchable(model: Transformer, drafter: Drafter) -> bool:
    """Whether a Batch can run these rows: the target and the drafter's model (if any) on RowBatch."""
    m = getattr(drafter, "row_model", None)
    return batchable(model) and (m is None or batchable(m))


def run_rows(model: Transformer, ck, ids: list[list[int]], cfg, row, name: str, block_size: int,
             drafter: Drafter | None = None) -> Iterator[Event]:
    """Every prompt as a row program (`row(b, prompt, sampling, spec, clock)` -> (program, its drafter, the slots its
    target cache needs)): in one Batch when there are several and the models allow, else one after another; then
    one Done with the pooled verify statistics (batched: `forwards` and `draft_forwards` count the batched calls;
    extra["rows"] each row's own); with --check-lossless, whether each output is the target's own greedy output."""
    dev = model.device
    clock = Clock()
    specs = [SpecStats() for _ in ids]
    samplings = [Sampling(cfg.temperature, cfg.top_k, cfg.top_p, make_generator(row_seed(cfg.seed, b), dev))
                 for b in range(len(ids))]
    rows = [row(b, p, samplings[b], specs[b], clock) for b, p in enumerate(ids)]
    lossless = [cfg.max_new_tokens] * len(ids) if cfg.check_lossless else None
    return _run(model, ck, ids, rows, specs, clock, name, block_size, drafter, lossless)


def stream_rows(model: Transformer, ck, prompts: list[Prompt], cfgs: list, drafter: Drafter) -> Iterator[Event]:
    """Rows that each bring their own SampleConfig (row r samples with a generator seeded cfgs[r].seed and drafts with
    its own fork of `drafter`) in one Batch (dlm.sampling.stream_rows: eval's cases). Bad options raise here."""
    clock = Clock()
    specs = [SpecStats() for _ in prompts]
    built = [row_program(model, ck, p, c, r, drafter=drafter, stats=specs[r], clock=clock)
             for r, (p, c) in enumerate(zip(prompts, cfgs))]
    rows = [(rp.program, rp.drafter, len(p.ids) + c.max_new_tokens + verify_width(MAX_BLOCK, c.draft_branches))
            for rp, p, c in zip(built, prompts, cfgs)]
    B = max(resolve_block_size(drafter, c.block_size) for c in cfgs)
    lossless = [c.max_new_tokens for c in cfgs] if any(c.check_lossless for c in cfgs) else None
    return _run(model, ck, [p.ids for p in prompts], rows, specs, clock, drafter.name, B, drafter, lossless)


@torch.inference_mode()
def _run(model: Transformer, ck, ids: list[list[int]], rows: list[tuple], specs: list[SpecStats], clock: Clock,
         name: str, block_size: int, drafter: Drafter | None, lossless: list[int] | None) -> Iterator[Event]:
    outputs: list[list[int]] = [[] for _ in ids]
    drafters = [d for _, d, _ in rows]
    f0 = [d.forwards if d is not None else 0 for d in drafters]  # (a lone row drafts with the caller's drafter)
    batched = len(ids) > 1 and all(rows_batchable(model, d) for _, d, _ in rows)
    if batched:
        runner = rows[0][1]
        batch = Batch(model, getattr(runner, "row_model", None), max(c for _, _, c in rows))
        events = batch.run([p for p, _, _ in rows])
    else:
        events = (ev for p, d, c in rows for ev in drive(p, Alone(model, c, d)))
    for ev in events:
        if isinstance(ev, Commit):
            outputs[ev.row].extend(ev.tokens)
        yield ev
    own = [d.forwards - f if d is not None else 0 for d, f in zip(drafters, f0)]  # each row's drafter passes
    own_draft = sum(own)
    if drafter is not None and any(d is not drafter for d in drafters):  # the forks' passes, counted on the drafter
        drafter.forwards += own_draft  # the caller holds
    spec = pooled(specs)
    draft_forwards = own_draft
    if batched:
        spec.forwards = batch.forwards
        draft_forwards = batch.draft_forwards
        spec.verify_seconds, spec.draft_seconds = batch.seconds()
    stats = spec_stats(spec, name, block_size, sum(len(o) for o in outputs), draft_forwards)
    stats.extra["rows"] = [{"new_tokens": len(o), "forwards": st.forwards, "steps": 0, "canvases": 0,
                            "draft_forwards": f, "cycles": st.cycles,
                            "tau": st.committed / st.cycles if st.cycles else 0.0,
                            "acceptance_histogram": st.histogram + [0] * (block_size + 1 - len(st.histogram))}
                           for o, st, f in zip(outputs, specs, own)]
    if batched:
        # a row's passes of the target: its verify passes, and its draft passes when it drafts over the target
        on_target = sum(st.forwards + (f if d is not None and d.row_model is None else 0)
                        for st, d, f in zip(specs, drafters, own))
        stats.extra["rows_per_forward"] = on_target / batch.forwards if batch.forwards else 0.0
    done = clock.finish(stats)
    if lossless is not None:
        eos = ck.tokenizer.eos_ids
        stats.extra["lossless"] = all(o == target_greedy(model, p, m, eos) for o, p, m in zip(outputs, ids, lossless))
    yield done


class Batch(Programs):
    """Speculating rows together (continuous batching): each step, one target forward serves every row that verifies
    (or prefills, or drafts over the target: self-speculation) and one forward of the drafter's model every row that
    drafts, each row at its own length; a rejected draft crops that row's caches only. Rows join with `add` and leave
    when their program ends or `drop` is called; events come back as (tag, event)."""

    def __init__(self, target: Transformer, draft_model=None, capacity: int = 0):
        super().__init__(target, capacity or 2 * target.cfg.max_seq_len,
                         {"draft": draft_model} if draft_model is not None else None)

    def add(self, program: Iterator, tag: object = None, window=None, answer=None) -> list[tuple]:
        """A new row: a row program whose requests are Windows (`speculation`, joint's `quadratic_program`), or one
        with its own `window` and `answer` (a joint model's diffusion row: mdlm.batch_row)."""
        return super().add(program, window or same, answer or outputs, tag)

    @property
    def draft_forwards(self) -> int:
        return self.batches["draft"].forwards if "draft" in self.batches else 0

    def seconds(self) -> tuple[float, float]:
        """Wall time of the target's forwards and of the drafter's."""
        return self.rows.seconds, self.batches["draft"].seconds if "draft" in self.batches else 0.0

    def run(self, programs: list[Iterator]) -> Iterator[Event]:
        """Every program to its end, all of them from the start: their events."""
        for b, p in enumerate(programs):
            for _, ev in self.add(p, b):
                yield ev
        while len(self):
            for _, ev in self.step():
                yield ev


def target_greedy(model: Transformer, prompt: Sequence[int], max_new_tokens: int, eos_id: Eos) -> list[int]:
    """The target's own greedy output (AR with its KV cache): the reference of losslessness."""
    out: list[int] = []
    for ev in ar.decode(model, [list(prompt)], max_new_tokens, eos_id=eos_id):
        if isinstance(ev, Commit):
            out.extend(ev.tokens)
    return out
