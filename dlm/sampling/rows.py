"""Rows: many sequences run through one forward per step, each with its own length (the diffusion samplers' batching).

The mdlm and usdm samplers are written as *row programs*: generators that yield events (Step, Commit)
and, when they need the model, a request (`Window`): "these tokens (or embeddings) at my next positions,
attending to my cache and to each other by this mask; keep the first `keep` of them in my cache; give
me the hidden states (or logits) at these window offsets". A one-row driver answers each request with a
forward of that row alone (the unbatched path, unchanged); `RowBatch` answers the requests of every
live row with one forward.

RowBatch keeps the K/V of every row in the model's KVCache buffers (n_layers, rows, n_kv_heads, C, head_dim) (or one
(rows, n_kv_heads_i, C, head_dim_i) per layer where the layers' shapes differ) in which slot == position:
row b holds its positions 0..length[b]-1 in slots 0..length[b]-1. A forward runs the rows' windows
right-padded to the longest, at their own positions, after the longest cache (Lc = max length): keys are
the slots 0..Lc-1 (row b sees those < length[b]) and the window (row b sees its own tokens by its request's
mask; a pad query sees itself only); a backbone's sliding-window layers also keep to a band of each
row's own positions (RowBatch._band). A forward that keeps anything writes the window's K/V into slots Lc..
of every row; each row's kept part is then moved to its own slots length[b]... A row that leaves is replaced
by the last row (rows stay 0..n-1; the forward runs on a view of them). What a row gets back depends on
nothing but its own tokens, up to the float rounding of batched matmuls.
"""

from __future__ import annotations

import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from dlm.errors import DlmError
from dlm.masks import LayerMasks, sliding_band
from dlm.model import KVCache, Transformer, canvas_embeds
from dlm.sampling.common import Event, Stats
from dlm.sampling.graphs import RowsStep, compilable


@dataclass
class Window:
    """A row program's request for one forward.

    tokens (T,) ids, or embeds (T, D) instead; they sit at the row's next T positions (its cache length
    onwards). mask (T, T) bool: which window keys each window query sees (the row's cache is always seen);
    None = all of them ("full"), "causal" = causal. keep: the first `keep` tokens' K/V stay in the row's cache.
    out: the window offsets whose outputs the program wants, as (start, stop); hidden: the program wants
    the final hidden states (B=1: (1, n, D)) rather than the logits (1, n, V).
    """

    tokens: Tensor | None = None
    embeds: Tensor | None = None
    canvas: bool = False  # tokens are a usdm canvas: embedded by canvas_embeds, self-conditioned on probs
    probs: Tensor | None = None  # (T, V) the previous step's distribution, or None (the canvas's first step)
    mask: Tensor | str | None = None
    keep: int = 0
    out: tuple[int, int] = (0, 0)
    hidden: bool = False
    on: str = "target"  # which model (and cache) serves it: a speculating row also asks its drafter ("draft")
    pos: Tensor | None = None  # (T,) explicit positions (default: the row's next T, after its context)
    taps: tuple[int, ...] = ()  # also return these layers' outputs over the whole window: (out, (T, F))
    ctx: Tensor | None = None  # (C, D) a DFlash drafter's new context features: their K/V are kept in the row's
    # next C slots (always, before the window, which then starts C positions later)
    at: int | None = None  # the window's K/V overwrite the row's cached slots at..at+T-1 (its positions), every cached
    # slot seen, the cache's length unchanged (Fast-dLLM's dual cache: a block rerun between its cached prefix and
    # suffix)

    @property
    def decodes(self) -> bool:
        """A plain decoding step: one token id, kept, its logits wanted, at the row's next position."""
        return (self.tokens is not None and self.tokens.shape[0] == 1 and self.keep == 1 and self.out == (0, 1)
                and not self.hidden and not self.canvas and self.embeds is None and self.pos is None and not self.taps
                and self.ctx is None and self.on == "target" and not isinstance(self.mask, Tensor) and self.at is None)

    @property
    def length(self) -> int:
        return (self.tokens if self.tokens is not None else self.embeds).shape[0]


@dataclass
class Crop:
    """A row program's request to cut its cache on `on` back to `length` slots (after a rejected draft); no forward.
    take (src, dst): first the slots src.. are copied to dst..length-1 (a draft tree's kept branch, written after
    the branches before it)."""

    length: int
    on: str = "target"
    take: tuple[int, int] | None = None


def same(request):
    """A request that is already a Window (or Crop)."""
    return request


def outputs(request, out):
    """The outputs sent back as they are."""
    return out


@dataclass
class RowProgram:
    """A request as a row of a batch: what every sampler's `row_program(model, ck, prompt, cfg, row, ...)` returns
    (the one row constructor; dlm.sampling.row_program picks the sampler).

    program: the row program (yields events and requests); window: a request -> the Window (or Crop) it asks for;
    answer: (request, outputs (1, n, V|D)) -> what the program is sent back; stats: the row's own counters, which
    its program keeps; drafter: a speculating row's drafter (its passes: the row's draft forwards)."""

    program: Iterator
    stats: object
    window: Callable = same
    answer: Callable = outputs
    drafter: object = None


def batchable(model) -> bool:
    """Whether RowBatch can run this model: one that answers rows_batchable, rows_cache, rows_band and rows_forward
    (the backbone, a DFlash drafter with K/V injection); another model's cache layout runs its rows in turn."""
    return bool(getattr(model, "rows_batchable", False))


def run_one(model, cache: KVCache | None, w: Window):
    """Answer one row's request with a forward of that row alone over its own cache (slots == positions; None: no
    cache, the window alone): its outputs (1, n, V|D), with the taps over the window (T, F) beside them when it asked
    for taps."""
    dev = (w.tokens if w.tokens is not None else w.embeds).device
    if w.at is not None:
        return run_in_place(model, cache, w)
    L0 = 0 if cache is None else cache.length
    T = w.length
    C = 0 if w.ctx is None else w.ctx.shape[0]
    pos = w.pos if w.pos is not None else torch.arange(L0 + C, L0 + C + T, device=dev)
    mask: Tensor | str
    if w.mask is None:
        mask = "full"
    elif isinstance(w.mask, str) or not L0:
        mask = w.mask
    else:
        mask = torch.cat([torch.ones(T, L0, dtype=torch.bool, device=dev), w.mask], 1)
    write = w.keep > 0
    x = w.tokens[None] if w.tokens is not None and not w.canvas else None
    e = w.embeds[None] if w.embeds is not None else None
    if w.canvas:  # a usdm canvas, self-conditioned on the previous step's distribution
        e = canvas_embeds(model, w.tokens[None], None if w.probs is None else w.probs[None])
    ctx = w.ctx[None] if C else None
    ctx_pos = torch.arange(L0, L0 + C, device=dev) if C else None
    last, taps = model.rows_forward(x, e, pos, cache, mask, write, ctx, ctx_pos, w.taps)
    if write and cache is not None:
        cache.crop(L0 + C + w.keep)
    a, b = w.out
    res = last[:, a:b] if w.hidden else model.head(last[:, a:b])
    if w.taps:
        return res, torch.cat([taps[i][0] for i in w.taps], -1)
    return res


def run_in_place(model, cache: KVCache, w: Window):
    """A window over slots already cached (Window.at): its K/V written over theirs, the queries at those positions
    seeing every cached slot in slot order (the keys in the same order as a full pass's); the cache's length is
    unchanged. Its outputs (1, n, V|D)."""
    T = w.length
    dev = w.tokens.device
    if w.mask is not None or w.canvas or w.embeds is not None or w.ctx is not None or w.taps or w.keep:
        raise DlmError("a window over cached slots takes tokens only, every slot seen")
    if w.at + T > cache.length:
        raise DlmError(f"a window over cached slots {w.at}..{w.at + T - 1} lies past the cache's {cache.length}")
    pos = w.pos if w.pos is not None else torch.arange(w.at, w.at + T, device=dev)
    seen = (torch.arange(cache.capacity, device=dev) < cache.length).expand(T, -1)  # (T, capacity)
    cache.slot = torch.arange(w.at, w.at + T, device=dev)
    try:
        last, _ = model.rows_forward(w.tokens[None], None, pos, cache, seen, True, None, None, ())
    finally:
        cache.slot = None
    a, b = w.out
    return last[:, a:b] if w.hidden else model.head(last[:, a:b])


def alone(model, cache: KVCache | None) -> Callable:
    """The answer to one row's requests when it runs by itself (drive's `answer`): a Window by run_one over the row's
    own cache, a Crop by cutting that cache."""

    def answer(req):
        if isinstance(req, Crop):
            cache.crop(req.length, req.take)
            return None
        return run_one(model, cache, req)

    return answer


def drive(program: Iterator, answer) -> Iterator:
    """Run a row program alone: yield its events, answer each of its requests (whatever is not an Event) with
    answer(request); returns what the program returns."""
    msg = None
    while True:
        try:
            ev = program.send(msg)
        except StopIteration as stop:
            return stop.value
        msg = None
        if not isinstance(ev, Event):
            msg = answer(ev)
        else:
            yield ev


def finish(program: Iterator, answer):
    """Run a program that yields requests only (a drafter's draft) to its end, each answered by answer(request);
    returns what the program returns."""
    msg = None
    while True:
        try:
            req = program.send(msg)
        except StopIteration as stop:
            return stop.value
        msg = answer(req)


class PrefixCache:
    """Prompts' K/V kept after their prefill, so that a later prompt sharing a prefix with one of them copies that
    prefix's K/V into its row instead of computing it (the prefix caching of vLLM and SGLang; a row batch's rows over
    one model: K/V of a causal window at slots == positions depend on the tokens up to theirs alone).

    Entries are keyed by their tokens and evicted least recently used past `budget` bytes. `longest(ids)` finds the
    longest common prefix of `ids` with any entry; each entry holds one tensor per cache buffer: (..., Hkv, P, hd)."""

    def __init__(self, budget: int):
        self.budget = budget  # bytes
        self.entries: OrderedDict[tuple[int, ...], list[Tensor]] = OrderedDict()
        self.bytes = 0
        self.hits = 0  # prompts that reused a prefix
        self.tokens = 0  # prompt tokens not computed

    def longest(self, ids: tuple[int, ...]) -> tuple[int, list[Tensor] | None]:
        """The longest prefix of ids some entry holds: (its length, that entry's buffers), or (0, None)."""
        best, got, key = 0, None, None
        for k, kv in self.entries.items():
            n = min(len(k), len(ids))
            if n <= best or k[0] != ids[0]:
                continue
            m = n if k[:n] == ids[:n] else next(i for i in range(n) if k[i] != ids[i])
            if m > best:
                best, got, key = m, kv, k
        if key is not None:
            self.entries.move_to_end(key)
        return best, got

    def put(self, ids: tuple[int, ...], kv: list[Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in kv)
        if size > self.budget or ids in self.entries:
            return
        self.entries[ids] = kv
        self.bytes += size
        while self.bytes > self.budget:
            _, old = self.entries.popitem(last=False)
            self.bytes -= sum(t.numel() * t.element_size() for t in old)


def _prompt(w: Window) -> bool:
    """A causal prompt whose K/V all stay and whose last position's logits are wanted (an AR row's first request)."""
    T = w.length
    return (w.tokens is not None and isinstance(w.mask, str) and w.mask == "causal" and w.keep == T
            and w.out == (T - 1, T) and not w.hidden and not w.canvas and w.embeds is None and w.pos is None
            and not w.taps and w.ctx is None and w.at is None and w.on == "target" and T > 1)


STEPS = ("eager", "static", "compiled")


class RowBatch:
    """The K/V of many rows (slots == positions per row) and the one forward that serves all their requests.

    The model is the backbone, or a DFlash drafter (K/V injection) whose rows' caches hold their context K/V. A forward
    may serve a subset of the rows (the others wait: a speculating row asks its drafter and its target in turn);
    `crop` cuts a row's cache back (a rejected draft); the slots per row grow when a window would not fit."""

    def __init__(self, model, capacity: int, step: str | RowsStep = "eager", prefix: int = 0):
        """prefix: bytes of prompts' K/V kept for later prompts that share a prefix with them (PrefixCache; 0: none)."""
        self.model = model
        self.prefix = PrefixCache(prefix) if prefix > 0 else None
        # step "compiled": the rows' one-token steps as one compiled static step (dlm.sampling.graphs.RowsStep) on
        # per-layer buffers; "static": the same step run eagerly (its check); "eager": the ordinary forward; a RowsStep
        # (another batch's, warmed): that one
        self.widths: set[int] = set()  # one-row windows of these widths run on the step's window (warm_windows)
        self.windowed = 0  # windows served there
        if isinstance(step, RowsStep):
            self.step = step
            step = "given"
        elif step not in STEPS:
            raise DlmError(f"step must be one of {', '.join(STEPS)}, got {step!r}")
        else:
            self.step = RowsStep(model, step == "compiled") if step != "eager" and compilable(model) else None
        if step == "compiled" and self.step is not None:
            try:
                self.step.warm(capacity)
            except Exception as e:  # (inductor needs a C++ compiler on a CPU, Triton on a GPU)
                warnings.warn(f"compiling the decode step failed, decoding eagerly instead: {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}", stacklevel=2)
                self.step = None
        self.C = capacity  # slots per row: the longest row plus the longest window (grown on demand)
        self.cache: KVCache | None = None  # the rows' K/V (its length unused: each row's is in `length`)
        self.window = model.rows_band
        self.length: list[int] = []
        self.clean: list[int] = []  # per buffer row: its first slots that hold finite values (written or zeroed)
        self.forwards = 0  # model calls (a step may take two: RowBatch.forward)
        self.seconds = 0.0  # wall time of the forwards

    def __len__(self) -> int:
        return len(self.length)

    def _reserve(self, n: int, C: int | None = None) -> None:
        """Buffers for at least n rows of at least C slots (rows grown by doubling, the rows' K/V kept).

        The buffers are not filled (zeroing every row's C slots of every layer, hundreds of MB paged in, cost seconds
        per growth on a busy CPU where rows use a few hundred of the C slots): growth copies the slots the rows have
        made finite, and a forward zeroes a row's slots up to the keys it reads first (`_clean`)."""
        have = 0 if self.cache is None else self.cache.rows
        C = max(C or self.C, self.C)
        if n <= have and C == self.C and self.cache is not None:
            return
        rows = max(n, 2 * have, 1 if self.step is None else 2) if n > have else have  # (the step: a buffer of one row
        # would be compiled apart)
        old = self.cache
        if self.step is not None:
            with torch.inference_mode():  # (what the compiled step was warmed up on)
                self.cache = self.model.rows_cache(rows, C, fill=False, per_layer=True)
        else:
            self.cache = self.model.rows_cache(rows, C, fill=False)
        if old is not None:
            used = max(self.clean, default=0)
            for new, was in zip(self.cache.buffers(), old.buffers()):
                new[..., :have, :, :used, :] = was[..., :used, :]
        self.clean += [0] * (rows - have)
        self.C = C

    def _clean(self, rows, upto: int) -> None:
        """Rows' slots before `upto` finite: the keys a forward reads (a row's own ones past its length are masked,
        and attention still multiplies them: unfilled memory there could be NaN). One write per buffer."""
        dirty = [(b, s) for b in rows for s in range(self.clean[b], upto)]
        if not dirty:
            return
        b_, s_ = torch.tensor(dirty, device=self.cache.k[0].device).unbind(1)
        for t in self.cache.buffers():
            t[..., b_, :, s_, :] = 0
        for b in rows:
            self.clean[b] = max(self.clean[b], upto)

    def add(self) -> int:
        """A new row with an empty cache; its index."""
        self._reserve(len(self.length) + 1)
        self.length.append(0)
        return len(self.length) - 1

    def crop(self, i: int, length: int, take: tuple[int, int] | None = None) -> None:
        """Row i's cache back to its first `length` slots (take: KVCache.crop's)."""
        if not 0 <= length <= self.length[i]:
            raise ValueError(f"crop({length}) outside [0, {self.length[i]}]")
        if take is not None:
            self.cache.map(lambda t: t[..., i:i + 1, :, :, :], self.length[i]).crop(length, take)
        self.length[i] = length

    def remove(self, i: int) -> int | None:
        """Drop row i; the last row moves into its place. Returns the index that moved (now i), or None."""
        last = len(self.length) - 1
        moved = None
        if i != last:
            n = self.length[last]
            for t in self.cache.buffers():
                t[..., i, :, :n, :] = t[..., last, :, :n, :]
            self.length[i] = n
            self.clean[i] = max(self.clean[i], n)
            moved = last
        self.length.pop()
        return moved

    def forward(self, windows: list[Window], rows: list[int] | None = None) -> list:
        """The requests of rows `rows` (default: every row, windows[j] row j's) served; each row's requested outputs
        (1, n, V|D), with its taps (T, F) beside them when it asked for taps.

        Usually one forward. When a few rows ask for much longer windows than the rest (an mdlm row folding its
        finished block into its pass, a usdm row prefilling its prompt, a speculating row's prompt), padding every
        row to the longest would cost more than a second forward: the rows run in two groups, by window length."""
        n = len(windows)
        rows = list(range(len(self.length))) if rows is None else rows
        assert n == len(rows) and n > 0
        t0 = time.perf_counter()
        kept = []
        if self.prefix is not None:
            windows, kept = self._reuse(windows, rows)
        Ts = [w.length + (0 if w.ctx is None else w.ctx.shape[0]) for w in windows]
        order = sorted(range(n), key=lambda j: Ts[j])
        best, cut = n * Ts[order[-1]], n  # padded tokens of one forward
        for i in range(1, n):  # rows order[:i] in a short forward, the rest in a long one
            if Ts[order[i - 1]] < Ts[order[i]]:
                cost = i * Ts[order[i - 1]] + (n - i) * Ts[order[-1]] + self.GROUP_COST
                if cost < best:
                    best, cut = cost, i
        self.forwards += 1 if cut == n else 2
        if cut == n:
            res = self._forward(rows, windows)
        else:
            res = [None] * n
            for grp in (sorted(order[:cut]), sorted(order[cut:])):
                for j, r in zip(grp, self._forward([rows[j] for j in grp], [windows[j] for j in grp])):
                    res[j] = r
        for b, ids in kept:  # prompts computed past what the prefix cache held: their K/V kept for the next ones
            self.prefix.put(ids, [t[..., b, :, :len(ids), :].clone() for t in self.cache.buffers()])
        dev = self.cache.k[0].device
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        self.seconds += time.perf_counter() - t0
        return res

    def _reuse(self, windows: list[Window], rows: list[int]) -> tuple[list[Window], list[tuple[int, tuple]]]:
        """Prompts of empty rows that share a prefix with a kept one: that prefix's K/V copied into the row's first
        slots, the window cut to the rest (at least the last token, whose logits are wanted). Returns the windows and
        the (row, prompt) pairs to keep after the forward (those the cache did not hold whole)."""
        out, kept = list(windows), []
        for j, (w, b) in enumerate(zip(windows, rows)):
            if self.length[b] or not _prompt(w):
                continue
            ids = tuple(w.tokens.tolist())
            T = len(ids)
            held, kv = self.prefix.longest(ids)
            if held < T:
                kept.append((b, ids))
            m = min(held, T - 1)
            if m == 0:
                continue
            self._reserve(len(self.length), T)
            for t, e in zip(self.cache.buffers(), kv):
                t[..., b, :, :m, :] = e[..., :m, :]
            self.length[b] = m
            self.clean[b] = max(self.clean[b], m)
            self.prefix.hits += 1
            self.prefix.tokens += m
            out[j] = Window(tokens=w.tokens[m:], mask="causal", keep=T - m, out=(T - m - 1, T - m))
        return out, kept

    def _band(self, windows: list[Window], lengths: Tensor, pos: Tensor, Lc: int) -> Tensor:
        """(n, 1, T, Lc + T): a sliding-window layer's band per row, from its positions (cache slot s holds position s,
        window key i sits at pos[b, i]), as run_blocks gives the row alone (masks.sliding_band): a causal query sees
        the keys of the last `window` positions up to its own; a bidirectional window over the cache (mask None: a
        canvas, DiffusionGemma's decoder) sees the cache's last window - 1 positions and the whole window."""
        if any(isinstance(w.mask, Tensor) for w in windows):  # (as the one-row forward: model.run_blocks)
            raise DlmError("a backbone with sliding-window layers needs its sliding layers' mask beside a "
                           "bool mask (dlm.masks.LayerMasks); this layout has none yet")
        W, dev = self.window, pos.device
        n, T = pos.shape
        keys = torch.cat([torch.arange(Lc, device=dev).expand(n, Lc), pos], 1)[:, None]  # (n, 1, K) positions
        full = torch.tensor([w.mask is None for w in windows], device=dev)
        block = torch.where(full, lengths, -1)[:, None, None]  # (n, 1, 1) a canvas starts at the row's length
        return sliding_band(pos[:, :, None], keys, W, block)[:, None]

    GROUP_COST = 24  # a second forward costs about this many padded tokens (its fixed overhead)

    def _step(self, idx: list[int], windows: list[Window]) -> list:
        """One token of rows idx (Window.decodes) through the compiled static step over rows 0..R-1 (R = max(idx) + 1)
        and slots 0..S-1: row b writes at its length and sees its cache and itself; a row of 0..R-1 outside idx writes
        at slot S - 1 = the longest row's length, past its own cache (nothing it keeps), and sees that slot alone."""
        dev = self.cache.k[0].device
        R = max(idx) + 1
        length = torch.tensor(self.length[:R], device=dev)  # (R,)
        S = int(length.max()) + 1
        if S > self.C:
            self._reserve(len(self.length), max(S, self.C + self.C // 2))
        self._clean(range(R), S)  # every row's slots the step reads (its own past its length are masked)
        at = torch.tensor(idx, device=dev)
        live = torch.zeros(R, dtype=torch.bool, device=dev)
        live[at] = True
        slot = torch.where(live, length, S - 1)  # (R,)
        tokens = torch.zeros(R, dtype=torch.long, device=dev)
        tokens[at] = torch.cat([w.tokens for w in windows])
        keys = torch.arange(S, device=dev)[None]  # (1, S)
        valid = torch.where(live[:, None], keys <= length[:, None], keys == S - 1)  # (R, S)
        # (a row's position is its slot)
        logits = self.step(tokens, slot, slot, valid, self.cache.k, self.cache.v)[at]  # (n, V)
        for b in idx:
            self.length[b] += 1
        return [logits[j:j + 1, None] for j in range(len(idx))]

    def warm_windows(self, widths) -> None:
        """One-row windows of these widths (a speculative verify's: the last token and the drafts, kept, every
        position's logits wanted, with any taps) served by the step's window (RowsStep.window), compiled now; where
        compiling fails, they stay on the ordinary forward, with a warning."""
        if self.step is None:
            return
        for T in widths:
            try:
                if self.step.compile:
                    self.step.warm_window(self.C, T)
            except Exception as e:  # (as the step's own warm-up)
                warnings.warn(f"compiling the {T}-token window failed, verifying eagerly instead: {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}", stacklevel=2)
                continue
            self.widths.add(T)

    def _verifies(self, idx: list[int], windows: list[Window]) -> bool:
        """Row 0 alone with a window of a warmed width: its tokens at its next positions, causal, kept, every
        position's logits wanted (a speculative verify)."""
        if idx != [0] or not self.widths:
            return False
        w = windows[0]
        return (w.tokens is not None and w.tokens.shape[0] in self.widths and isinstance(w.mask, str)
                and w.mask == "causal" and w.keep == w.length and w.out == (0, w.length) and not w.hidden
                and not w.canvas and w.embeds is None and w.pos is None and w.ctx is None and w.at is None
                and w.on == "target")

    def _window(self, w: Window) -> list:
        """Row 0's window (_verifies) through the step's window over its slots 0..S-1, S its length + T."""
        dev = self.cache.k[0].device
        T, L = w.length, self.length[0]
        S = L + T
        if S > self.C:
            self._reserve(len(self.length), max(S, self.C + self.C // 2))
        self._clean([0], S)
        slot = torch.arange(L, S, device=dev)[None]  # (1, T): a row's positions are its slots
        valid = torch.arange(S, device=dev)[None, None] <= slot[:, :, None]  # (1, T, S): its cache, then causal
        logits, tapped = self.step.window(w.tokens[None], slot, slot, valid, self.cache.k, self.cache.v, w.taps)
        self.length[0] = S
        self.clean[0] = max(self.clean[0], S)
        self.windowed += 1
        if not w.taps:
            return [logits]
        return [(logits, torch.cat([t[0] for t in tapped], -1))]

    def _forward(self, idx: list[int], windows: list[Window]) -> list:
        """One forward of rows idx (their windows); the kept K/V land in the rows' own slots."""
        model = self.model
        n = len(idx)
        if self.step is not None and all(w.decodes for w in windows):
            return self._step(idx, windows)
        if self.step is not None and self._verifies(idx, windows):
            return self._window(windows[0])
        length = [self.length[b] for b in idx]
        Ts = [w.length for w in windows]
        Cs = [0 if w.ctx is None else w.ctx.shape[0] for w in windows]
        T, Lc, Cm = max(Ts), max(length), max(Cs)
        if Lc + Cm + T > self.C:
            self._reserve(len(self.length), max(Lc + Cm + T, self.C + self.C // 2))
        if any(w.at is not None for w in windows) and n > 1:
            raise DlmError("a Window with `at` (a row rewriting its cache in place) is served alone")
        if n == 1 and not windows[0].canvas:  # one row: its own slots are a cache of its own (the one-row forward)
            b = idx[0]

            cache = self.cache.map(lambda t: t[..., b:b + 1, :, :, :], length[0])
            res = run_one(model, cache, windows[0])  # (reads its slots before its length only)
            self.length[b] = cache.length
            self.clean[b] = max(self.clean[b], cache.length)
            return [res]
        dev = self.cache.k[0].device
        prefix = idx == list(range(n))  # rows 0..n-1: the forward runs on a view of the buffers
        lengths = torch.tensor(length, device=dev)
        if all(w.pos is None for w in windows):
            pos = (lengths + torch.tensor(Cs, device=dev))[:, None] + torch.arange(T, device=dev)[None]  # (n, T)
            last = (lengths + torch.tensor(Cs, device=dev) + torch.tensor(Ts, device=dev) - 1)[:, None]
            pos = torch.minimum(pos, last)  # pads repeat the last one
        else:
            pos = torch.empty(n, T, dtype=torch.long, device=dev)
            for j, (w, t) in enumerate(zip(windows, Ts)):
                p = w.pos if w.pos is not None else torch.arange(length[j] + Cs[j], length[j] + Cs[j] + t, device=dev)
                pos[j, :t] = p
                pos[j, t:] = p[-1]
        K = Lc + Cm + T
        mask = torch.zeros(n, 1, T, K, dtype=torch.bool, device=dev)
        mask[:, 0, :, :Lc] = (torch.arange(Lc, device=dev)[None] < lengths[:, None])[:, None]  # each row's cache
        if Cm:  # each row's new context
            mask[:, 0, :, Lc:Lc + Cm] = (torch.arange(Cm, device=dev)[None] < torch.tensor(Cs, device=dev)[:, None])[:, None]
        # the window: row b's first Ts[b] queries see its first Ts[b] keys (all of them, or causally; a mask Tensor is
        # set below), a pad query sees itself only
        qi, ki = torch.arange(T, device=dev)[None, :, None], torch.arange(T, device=dev)[None, None, :]
        ti = torch.tensor(Ts, device=dev)[:, None, None]
        causal = torch.tensor([isinstance(w.mask, str) for w in windows], device=dev)[:, None, None]
        mask[:, 0, :, Lc + Cm:] = (qi == ki) | ((qi < ti) & (ki < ti) & (~causal | (ki <= qi)))  # (n, T, T)
        embeds = any(w.embeds is not None or w.canvas for w in windows)
        if embeds:
            e0 = next((w.embeds for w in windows if w.embeds is not None), None)
            dtype = e0.dtype if e0 is not None else model.embed_tokens.weight.dtype
            x = torch.zeros(n, T, model.cfg.dim, dtype=dtype, device=dev)
            for soft in (True, False):  # the canvases' embeddings, all rows' positions in one call (per position)
                rows = [b for b, w in enumerate(windows) if w.canvas and (w.probs is not None) == soft]
                if rows:
                    emb = canvas_embeds(model, torch.cat([windows[b].tokens for b in rows])[None],
                                        torch.cat([windows[b].probs for b in rows])[None] if soft else None)[0]
                    i = 0
                    for b in rows:
                        x[b, :Ts[b]] = emb[i:i + Ts[b]]
                        i += Ts[b]
        else:  # (n, T) the tokens, right-padded with 0
            x = torch.nn.utils.rnn.pad_sequence([w.tokens for w in windows], batch_first=True)
        ctx = torch.zeros(n, Cm, model.cfg.dim, dtype=x.dtype if embeds else self.cache.k[0].dtype,
                          device=dev) if Cm else None
        for b, w in enumerate(windows):
            t = Ts[b]
            if isinstance(w.mask, Tensor):
                mask[b, 0, :t, Lc + Cm:Lc + Cm + t] = w.mask
            if embeds and not w.canvas:
                x[b, :t] = w.embeds if w.embeds is not None else model.embed(w.tokens)
            if Cs[b]:
                ctx[b, :Cs[b]] = w.ctx
        ctx_pos = lengths[:, None] + torch.arange(Cm, device=dev)[None] if Cm else None
        keep = [w.keep for w in windows]
        taps = tuple(sorted({i for w in windows for i in w.taps}))

        def rows_of(t: Tensor) -> Tensor:
            if prefix:  # a view of the buffers: the window's K/V are written in place
                return t[..., :n, :, :, :]
            # some of the rows: a copy of their slots, the window's K/V copied back below
            return torch.cat([t[..., idx, :, :Lc, :], t.new_empty(*t.shape[:-4], n, t.shape[-3], Cm + T, t.shape[-1])],
                             -2)

        self._clean(idx, Lc)
        cache = self.cache.map(rows_of, Lc)
        spec: Tensor | str | LayerMasks = "full" if bool(mask.all()) else mask
        if self.window:  # sliding-window layers: each row's band
            spec = LayerMasks(mask, mask & self._band(windows, lengths, pos, Lc))
        # (write: slots Lc.. are scratch: writing the window there spares the attention a copy of the cache)
        last, tapped = model.rows_forward(None if embeds else x, x if embeds else None, pos, cache, spec, True, ctx,
                                          ctx_pos, taps)
        moves: list[tuple[int, int, int, int]] = []  # (row, its index in the forward, from slot, to slot)
        for j, (b, m) in enumerate(zip(idx, keep)):
            a = self.length[b]
            for src, dst, k in ((Lc, a, Cs[j]), (Lc + Cm, a + Cs[j], m)):  # the new context, then the kept window
                if k and (src != dst or not prefix):  # from the scratch slots to the row's own
                    moves += [(b, j, src + i, dst + i) for i in range(k)]
            self.length[b] = a + Cs[j] + m
            # finite now: a view's scratch slots (the context's K/V, written for every row of it) and the row's own
            self.clean[b] = max(self.clean[b], Lc + Cm if prefix else 0, self.length[b])
        if moves:  # one gather (every source read before any slot is written) and one scatter per buffer
            b_, j_, src_, dst_ = torch.tensor(moves, device=dev).unbind(1)
            for mine, got in zip(self.cache.buffers(), cache.buffers()):
                mine[..., b_, :, dst_, :] = got[..., j_, :, src_, :]
        # the head only where a row asked for logits (one matmul over all of them)
        res: list = [None] * n
        want = [(j, w) for j, w in enumerate(windows) if not w.hidden and w.out[1] > w.out[0]]
        if want:
            logits = model.head(torch.cat([last[j, w.out[0]:w.out[1]] for j, w in want]))
            i = 0
            for j, w in want:
                m = w.out[1] - w.out[0]
                res[j] = logits[i:i + m][None]
                i += m
        for j, w in enumerate(windows):
            if w.hidden:
                res[j] = last[j:j + 1, w.out[0]:w.out[1]]
            elif res[j] is None:
                res[j] = last.new_zeros(1, 0, model.cfg.vocab_size)
            if w.taps:
                res[j] = (res[j], torch.cat([tapped[i][j, :Ts[j]] for i in w.taps], -1))
        return res


@dataclass
class Raised(Event):
    """A row's program raised an exception (Programs with isolate=True: that row ends, the others go on)."""

    error: Exception
    row: int = 0


@dataclass
class _Live:
    program: Iterator
    window: Callable  # request -> Window (or Crop)
    answer: Callable  # (request, outputs (1, n, V|D)) -> what the program is sent back
    tag: object
    request: object = None


class Programs:
    """Row programs run together: the live rows' next requests served by one RowBatch forward per step (continuous
    batching). `models` beyond the target (a speculating row's drafter: name -> model) each hold a RowBatch of the
    same rows; a request's `on` names the one that serves it, a `Crop` cuts the row's cache there.

    Rows join with `add` (their first request is served at the next `step`) and leave when their program ends or
    `drop` is called (the last row takes the freed index). Events come back as (tag, event).
    """

    def __init__(self, model: Transformer, capacity: int, models: dict | None = None, isolate: bool = False,
                 step: str = "eager", prefix: int = 0):
        self.isolate = isolate  # a row whose program raises ends with a Raised event (else the exception propagates)
        # step: how the target's one-token steps run; prefix: bytes of prompts' K/V the target keeps (PrefixCache)
        self.batches = {"target": RowBatch(model, capacity, step, prefix)}
        for name, m in (models or {}).items():
            self.batches[name] = RowBatch(m, capacity)
        self.rows = self.batches["target"]
        self.live: list[_Live] = []

    def __len__(self) -> int:
        return len(self.live)

    @property
    def forwards(self) -> int:
        return self.rows.forwards

    def add_row(self, row: RowProgram, tag: object = None) -> list[tuple]:
        """A new row (a sampler's row_program); returns the events its program yields before its first request."""
        return Programs.add(self, row.program, row.window, row.answer, tag)  # (the base's: a subclass's add differs)

    def add(self, program: Iterator, window: Callable, answer: Callable, tag: object = None) -> list[tuple]:
        """A new row; returns the events its program yields before its first request."""
        live = _Live(program, window, answer, tag)
        for b in self.batches.values():
            b.add()
        self.live.append(live)
        out: list[tuple] = []
        if not self._advance(len(self.live) - 1, None, out):
            self.drop(len(self.live) - 1)
        return out

    def drop(self, i: int) -> None:
        """Remove row i now (finished, stopped or cancelled)."""
        for b in self.batches.values():
            b.remove(i)
        gone = self.live[i]
        last = self.live.pop()
        if i < len(self.live):
            self.live[i] = last
        gone.program.close()

    def index(self, tag: object) -> int | None:
        return next((i for i, lv in enumerate(self.live) if lv.tag is tag), None)

    def _advance(self, i: int, msg, out: list) -> bool:
        """Run row i's program up to its next request (collecting its events, applying its crops); False when it
        ended."""
        live = self.live[i]
        while True:
            try:
                ev = live.program.send(msg)
            except StopIteration:
                return False
            except Exception as e:
                if not self.isolate:
                    raise
                out.append((live.tag, Raised(e)))
                return False
            msg = None
            if isinstance(ev, Crop):
                self.batches[ev.on].crop(i, ev.length, ev.take)
            elif not isinstance(ev, Event):
                live.request = ev
                return True
            else:
                out.append((live.tag, ev))

    @torch.inference_mode()
    def step(self) -> list[tuple]:
        """One forward (two, in groups, when that is cheaper) of the model most live rows ask for: those rows'
        requests; returns their events and drops the rows whose program ended.

        Rows that ask another model (speculating rows in another phase: drafting while the others verify) wait a
        step and fall in with the rest, so the steps after serve every row in one forward."""
        windows = [lv.window(lv.request) for lv in self.live]
        groups = {name: [i for i, w in enumerate(windows) if w.on == name] for name in self.batches}
        name = max(groups, key=lambda k: len(groups[k]))
        idx = groups[name]
        outs = dict(zip(idx, self.batches[name].forward([windows[i] for i in idx], idx)))
        out: list[tuple] = []
        ended = [i for i, lv in enumerate(self.live)
                 if i in outs and not self._advance(i, lv.answer(lv.request, outs[i]), out)]
        for i in reversed(ended):
            self.drop(i)
        return out


def batch_stats(per_row: list[Stats], forwards: int) -> Stats:
    """The Done of a call whose rows ran together: totals over rows, `forwards` the model calls of the call, each
    row's own counters in extra["rows"] (its forwards: the passes it took part in, as many as it takes alone)."""
    stats = Stats(forwards=forwards, extra={"steps_per_canvas": []})
    for st in per_row:
        stats.new_tokens += st.new_tokens
        stats.steps += st.steps
        stats.canvases += st.canvases
        stats.draft_forwards += st.draft_forwards
        stats.extra["steps_per_canvas"] += st.extra.get("steps_per_canvas", [])
        if "revisions" in st.extra:
            stats.extra["revisions"] = stats.extra.get("revisions", 0) + st.extra["revisions"]
    own = sum(st.forwards for st in per_row)
    stats.extra["rows"] = [{"new_tokens": st.new_tokens, "forwards": st.forwards, "steps": st.steps,
                            "canvases": st.canvases, **{k: st.extra[k] for k in ("logprob",) if k in st.extra}}
                           for st in per_row]
    stats.extra["rows_per_forward"] = own / forwards if forwards else 0.0
    return stats
