"""Rows: many sequences run through one forward per step, each with its own length (the diffusion samplers' batching).

The mdlm and usdm samplers are written as *row programs*: generators that yield events (Step, Commit)
and, when they need the model, a request (`Window`): "these tokens (or embeddings) at my next positions,
attending to my cache and to each other by this mask; keep the first `keep` of them in my cache; give
me the hidden states (or logits) at these window offsets". A one-row driver answers each request with a
forward of that row alone (the unbatched path, unchanged); `RowBatch` answers the requests of every
live row with one forward.

RowBatch keeps the K/V of every row in one buffer (n_layers, rows, n_kv_heads, C, head_dim) in which
slot == position: row b holds its positions 0..length[b]-1 in slots 0..length[b]-1. A forward runs the
rows' windows right-padded to the longest, at their own positions, after the longest cache (Lc =
max length): keys are the slots 0..Lc-1 (row b sees those < length[b]) and the window (row b sees its
own tokens by its request's mask; a pad query sees itself only). A forward that keeps anything writes
the window's K/V into slots Lc.. of every row; each row's kept part is then moved to its own slots
length[b]... A row that leaves is replaced by the last row (rows stay 0..n-1; the forward runs on a
view of them). What a row gets back depends on nothing but its own tokens, up to the float rounding of
batched matmuls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from dlm.model import KVCache, Transformer, canvas_embeds
from dlm.sampling.common import Event, Stats


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

    @property
    def length(self) -> int:
        return (self.tokens if self.tokens is not None else self.embeds).shape[0]


def batchable(model) -> bool:
    """Whether RowBatch can run this model (the plain backbone; a family with its own cache layout runs rows in turn)."""
    return isinstance(model, Transformer) and not model.cfg.arch


def run_one(model: Transformer, cache: KVCache, w: Window) -> Tensor:
    """Answer one row's request with a forward of that row alone over its own cache (slots == positions)."""
    dev = model.device
    L0 = cache.length
    T = w.length
    pos = torch.arange(L0, L0 + T, device=dev)
    mask: Tensor | str
    if w.mask is None:
        mask = "full"
    elif isinstance(w.mask, str):
        mask = w.mask
    else:
        mask = torch.cat([torch.ones(T, L0, dtype=torch.bool, device=dev), w.mask], 1)
    write = w.keep > 0
    x = w.tokens[None] if w.tokens is not None else None
    e = w.embeds[None] if w.embeds is not None else None
    out = model(x, embeds=e, pos=pos, cache=cache, mask=mask, write=write, head=not w.hidden)
    if write:
        cache.crop(L0 + w.keep)
    a, b = w.out
    return out.last[:, a:b] if w.hidden else out.logits[:, a:b]


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


class RowBatch:
    """The K/V of many rows (slots == positions per row) and the one forward that serves all their requests."""

    def __init__(self, model: Transformer, capacity: int):
        self.model = model
        self.C = capacity  # slots per row: the longest row plus the longest window
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.length: list[int] = []
        self.forwards = 0  # model calls (a step may take two: RowBatch.forward)

    def __len__(self) -> int:
        return len(self.length)

    def _reserve(self, n: int) -> None:
        have = 0 if self.k is None else self.k.shape[1]
        if n <= have:
            return
        rows = max(n, 2 * have, 1)
        cache = self.model.new_cache(rows, self.C)
        if self.k is not None:
            cache.k[:, :have] = self.k
            cache.v[:, :have] = self.v
        self.k, self.v = cache.k, cache.v

    def add(self) -> int:
        """A new row with an empty cache; its index."""
        self._reserve(len(self.length) + 1)
        self.length.append(0)
        return len(self.length) - 1

    def remove(self, i: int) -> int | None:
        """Drop row i; the last row moves into its place. Returns the index that moved (now i), or None."""
        last = len(self.length) - 1
        moved = None
        if i != last:
            n = self.length[last]
            self.k[:, i, :, :n] = self.k[:, last, :, :n]
            self.v[:, i, :, :n] = self.v[:, last, :, :n]
            self.length[i] = n
            moved = last
        self.length.pop()
        return moved

    def forward(self, windows: list[Window]) -> list[Tensor]:
        """Every row's request served (windows[b] is row b's); each row's requested outputs (1, n, V|D).

        Usually one forward. When a few rows ask for much longer windows than the rest (an mdlm row folding its
        finished block into its pass, a usdm row prefilling its prompt), padding every row to the longest would
        cost more than a second forward: the rows run in two groups, by window length."""
        n = len(windows)
        assert n == len(self.length) and n > 0
        Ts = [w.length for w in windows]
        order = sorted(range(n), key=lambda b: Ts[b])
        best, cut = n * Ts[order[-1]], n  # padded tokens of one forward
        for i in range(1, n):  # rows order[:i] in a short forward, the rest in a long one
            if Ts[order[i - 1]] < Ts[order[i]]:
                cost = i * Ts[order[i - 1]] + (n - i) * Ts[order[-1]] + self.GROUP_COST
                if cost < best:
                    best, cut = cost, i
        self.forwards += 1 if cut == n else 2
        if cut == n:
            return self._forward(list(range(n)), windows)
        res: list[Tensor | None] = [None] * n
        for idx in (sorted(order[:cut]), sorted(order[cut:])):
            for b, r in zip(idx, self._forward(idx, [windows[b] for b in idx])):
                res[b] = r
        return res

    GROUP_COST = 24  # a second forward costs about this many padded tokens (its fixed overhead)

    def _forward(self, idx: list[int], windows: list[Window]) -> list[Tensor]:
        """One forward of rows idx (their windows); the kept K/V land in the rows' own slots."""
        model, dev = self.model, self.model.device
        n = len(idx)
        whole = idx == list(range(len(self.length)))
        length = [self.length[b] for b in idx]
        Ts = [w.length for w in windows]
        T, Lc = max(Ts), max(length)
        if Lc + T > self.C:
            raise RuntimeError(f"row cache too small: {Lc} + {T} > {self.C}")
        lengths = torch.tensor(length, device=dev)
        pos = lengths[:, None] + torch.arange(T, device=dev)[None]  # (n, T) each row's next positions
        pos = torch.minimum(pos, (lengths + torch.tensor(Ts, device=dev) - 1)[:, None])  # pads repeat the last one
        mask = torch.zeros(n, 1, T, Lc + T, dtype=torch.bool, device=dev)
        mask[:, 0, :, :Lc] = (torch.arange(Lc, device=dev)[None] < lengths[:, None])[:, None]  # each row's cache
        mask[:, 0, :, Lc:] = torch.eye(T, dtype=torch.bool, device=dev)  # a pad query sees itself only
        embeds = any(w.embeds is not None or w.canvas for w in windows)
        if embeds:
            x = torch.zeros(n, T, model.cfg.dim, dtype=model.embed_tokens.weight.dtype, device=dev)
            for soft in (True, False):  # the canvases' embeddings, all rows' positions in one call (per position)
                rows = [b for b, w in enumerate(windows) if w.canvas and (w.probs is not None) == soft]
                if rows:
                    emb = canvas_embeds(model, torch.cat([windows[b].tokens for b in rows])[None],
                                        torch.cat([windows[b].probs for b in rows])[None] if soft else None)[0]
                    i = 0
                    for b in rows:
                        x[b, :Ts[b]] = emb[i:i + Ts[b]]
                        i += Ts[b]
        else:
            x = torch.zeros(n, T, dtype=torch.long, device=dev)
        for b, w in enumerate(windows):
            t = Ts[b]
            if w.mask is None:
                mask[b, 0, :t, Lc:Lc + t] = True
            elif isinstance(w.mask, str):  # causal
                mask[b, 0, :t, Lc:Lc + t] = torch.ones(t, t, dtype=torch.bool, device=dev).tril()
            else:
                mask[b, 0, :t, Lc:Lc + t] = w.mask
            if embeds and not w.canvas:
                x[b, :t] = w.embeds if w.embeds is not None else model.embed_tokens(w.tokens) * model.embed_scale
            elif not embeds:
                x[b, :t] = w.tokens
        keep = [w.keep for w in windows]
        write = True  # (slots Lc.. are scratch: writing the window there spares the attention a copy of the cache)
        cache = KVCache.__new__(KVCache)
        if whole:  # a view of the buffers: the window's K/V are written in place
            cache.k, cache.v = self.k[:, :n], self.v[:, :n]
        else:  # a group of the rows: a copy of their slots, the window's K/V copied back below
            cache.k = torch.cat([self.k[:, idx, :, :Lc], self.k.new_empty(self.k.shape[0], n, self.k.shape[2], T,
                                                                           self.k.shape[4])], 3)
            cache.v = torch.cat([self.v[:, idx, :, :Lc], torch.empty_like(cache.k[:, :, :, Lc:])], 3)
        cache.length = Lc
        spec: Tensor | str = "full" if bool(mask.all()) else mask
        out = model(None if embeds else x, embeds=x if embeds else None, pos=pos, cache=cache, mask=spec, write=write,
                    head=False)
        if write:
            for j, (b, m) in enumerate(zip(idx, keep)):
                a = self.length[b]
                if m and (a != Lc or not whole):  # the kept K/V from the window's slots to the row's own
                    self.k[:, b, :, a:a + m] = cache.k[:, j, :, Lc:Lc + m].clone()
                    self.v[:, b, :, a:a + m] = cache.v[:, j, :, Lc:Lc + m].clone()
                self.length[b] = a + m
        # the head only where a row asked for logits (one matmul over all of them)
        res: list[Tensor | None] = [None] * n
        want = [(j, w) for j, w in enumerate(windows) if not w.hidden and w.out[1] > w.out[0]]
        if want:
            logits = model.lm_head(torch.cat([out.last[j, w.out[0]:w.out[1]] for j, w in want]))
            i = 0
            for j, w in want:
                m = w.out[1] - w.out[0]
                res[j] = logits[i:i + m][None]
                i += m
        for j, w in enumerate(windows):
            if w.hidden:
                res[j] = out.last[j:j + 1, w.out[0]:w.out[1]]
            elif res[j] is None:
                res[j] = out.last.new_zeros(1, 0, model.cfg.vocab_size)
        return res


@dataclass
class _Live:
    program: Iterator
    window: Callable  # request -> Window
    answer: Callable  # (request, outputs (1, n, V|D)) -> what the program is sent back
    tag: object
    request: object = None


class Programs:
    """Row programs run together: every live row's next request served by one RowBatch forward (continuous batching).

    Rows join with `add` (their first request is served at the next `step`) and leave when their program ends or
    `drop` is called (the last row takes the freed index). Events come back as (tag, event).
    """

    def __init__(self, model: Transformer, capacity: int):
        self.rows = RowBatch(model, capacity)
        self.live: list[_Live] = []

    def __len__(self) -> int:
        return len(self.live)

    @property
    def forwards(self) -> int:
        return self.rows.forwards

    def add(self, program: Iterator, window: Callable, answer: Callable, tag: object = None) -> list[tuple]:
        """A new row; returns the events its program yields before its first request."""
        live = _Live(program, window, answer, tag)
        self.rows.add()
        self.live.append(live)
        out: list[tuple] = []
        if not self._advance(live, None, out):
            self.drop(len(self.live) - 1)
        return out

    def drop(self, i: int) -> None:
        """Remove row i now (finished, stopped or cancelled)."""
        self.rows.remove(i)
        gone = self.live[i]
        last = self.live.pop()
        if i < len(self.live):
            self.live[i] = last
        gone.program.close()

    def index(self, tag: object) -> int | None:
        return next((i for i, lv in enumerate(self.live) if lv.tag is tag), None)

    def _advance(self, live: _Live, msg, out: list) -> bool:
        """Run a row's program up to its next request (collecting its events); False when it ended."""
        while True:
            try:
                ev = live.program.send(msg)
            except StopIteration:
                return False
            msg = None
            if not isinstance(ev, Event):
                live.request = ev
                return True
            out.append((live.tag, ev))

    @torch.inference_mode()
    def step(self) -> list[tuple]:
        """One forward (two, in groups, when that is cheaper): every live row's request; returns their events and
        drops the rows whose program ended."""
        outs = self.rows.forward([lv.window(lv.request) for lv in self.live])
        out: list[tuple] = []
        ended = [i for i, (lv, o) in enumerate(zip(self.live, outs))
                 if not self._advance(lv, lv.answer(lv.request, o), out)]
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
                            "canvases": st.canvases} for st in per_row]
    stats.extra["rows_per_forward"] = own / forwards if forwards else 0.0
    return stats
