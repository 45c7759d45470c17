"""The models a server holds and how requests run on them; no web framework here.

A request becomes a `Job`: its rows (one per prompt and choice, each a Prompt and a SampleConfig),
a thread-safe bridge that hands the sampler's events to the event loop, and a cancel flag that the
workers read between events (a client that leaves, a stop string that matched).

Two ways to run a job:

- AR models (and AR requests that ask for logprobs on a speculative model: its output is the
  same): an `ARBatcher`, one thread per model, owns a batched KV cache and runs *every* active row
  of every request in one forward per token (continuous batching). Between two forwards it admits
  the rows that arrived (their prompts prefilled together in one forward, left-padded), and drops
  the rows that finished, stopped or were cancelled, so a request arriving while others decode
  joins at the next step boundary instead of waiting for them. Each row keeps its own positions,
  sampling options and random generator, so a row's tokens do not depend on what it shares a
  batch with (greedy rows equal `dlm generate`'s, up to float rounding of batched matmuls).
- mdlm and usdm models: a `RowsBatcher`, one thread per model, runs every active row of every
  request as a row of one `dlm.sampling.mdlm.Batch` / `usdm.Batch`: each step, one forward serves
  every row's next pass (an mdlm block's denoising step, a usdm canvas's step or prefill), each row
  over its own K/V slots, positions and masks. Rows that arrived join at the next step; rows that
  finished, stopped or were cancelled leave between steps. Each row keeps its own options and
  generator (seed + choice), so its tokens do not depend on the batch (up to float rounding).
- speculative decoding (a target and its drafter) and joint models (self-speculation and the diffusion
  mode): a `RowsBatcher` too, over a `dlm.sampling.speculative.Batch`: each step, one target forward
  serves every row that verifies, prefills, or drafts over the target (self-speculation, a joint
  row's diffusion step), and one forward of the drafter's model every row that drafts; each row at
  its own length, its own drafter fork, options and generator. A joint model's AR mode (`sampler: ar`)
  runs on an `ARBatcher` of its own over the same model, as an AR model's requests do.
- `naive` requests, --check-lossless, and models the row batch cannot run (a family
  with its own cache layout, an input-injection drafter): one worker thread per job runs its rows one
  after another with `dlm.sampling.stream` (torch releases the GIL inside its ops, so jobs overlap on
  the cores).

Every job ends with exactly one `Done` (its forwards, draft forwards, seconds, time to first token;
batched: the mean batch its forwards ran in) or one `Failed`.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator

import torch

from dlm.checkpoint import load_model, open_checkpoint
from dlm.errors import DlmError
from dlm.masks import causal_layers, key_valid_mask
from dlm.model import Transformer
from dlm.sampling import SampleConfig, ar, joint, mdlm, speculative, stream, usdm
from dlm.sampling.common import Commit, Done, Event, Prompt, Stats, eos_set, make_generator, sample_token
from dlm.drafters import load_drafter
from dlm.sampling.rows import batchable
from dlm.sampling.speculative import Drafter, Sampling, SpecStats, rows_batchable

log = logging.getLogger("dlm.serve")


# events the server adds to the sampler's ------------------------------------------------------------

@dataclass
class Scored(Commit):
    """One AR token with its log-probability and the top alternatives (requests that ask for logprobs)."""

    logprob: float = 0.0
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Failed(Event):
    """The job could not run to its end (client: the request's fault, reported as a 4xx)."""

    message: str
    client: bool = False


# a request in flight ---------------------------------------------------------------------------------

@dataclass
class Row:
    """One output row of a request: a prompt and the options it runs with (its own seed)."""

    prompt: Prompt
    cfg: SampleConfig
    logprobs: int | None = None  # AR: how many alternatives to return per token (0: the chosen token only)


class Job:
    """A request's rows, the bridge of its events to the event loop, and its cancel flags."""

    def __init__(self, rows: list[Row], loop: asyncio.AbstractEventLoop | None = None, step_events: bool = False):
        self.rows = rows
        self.step_events = step_events  # the diffusion samplers' Step events: only when the client streams them
        self.loop = loop
        self.events: asyncio.Queue[Event] | queue.SimpleQueue = asyncio.Queue() if loop else queue.SimpleQueue()
        self.cancelled = threading.Event()
        self.stopped = [False] * len(rows)  # the consumer's: a stop string matched in that row
        self.t0 = time.perf_counter()
        self.first: float | None = None
        # batching bookkeeping (the batcher's thread only)
        self.live = 0
        self.forwards = 0
        self.draft_forwards = 0  # speculative rows: their drafters' own passes
        self.batch_rows = 0  # rows of all the forwards this job took part in
        self.steps = 0  # diffusion: denoising steps and canvases of its rows
        self.canvases = 0
        self.failed = False  # a Failed was emitted: no Done follows

    def emit(self, ev: Event) -> None:
        if self.first is None and isinstance(ev, Commit):
            self.first = time.perf_counter() - self.t0
        if self.loop is None:
            self.events.put(ev)
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, ev)
        except RuntimeError:  # the loop is closed (the server shut down): nobody is listening
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()

    def stop_row(self, row: int) -> None:
        self.stopped[row] = True

    def over(self, row: int) -> bool:
        """Should the workers stop producing this row? (checked between events)"""
        return self.cancelled.is_set() or self.stopped[row]

    async def __aiter__(self) -> AsyncIterator[Event]:
        while True:
            ev = await self.events.get()
            yield ev
            if isinstance(ev, (Done, Failed)):
                return

    def drain(self, timeout: float | None = None) -> list[Event]:
        """All events of a job started without a loop (tests, scripts)."""
        out = []
        while True:
            ev = self.events.get(timeout=timeout)
            out.append(ev)
            if isinstance(ev, (Done, Failed)):
                return out


# the served models --------------------------------------------------------------------------------

_counts = threading.local()


# forwards are counted as they run: a row cut short (a stop string, a disconnect) never reaches its sampler's Done,
# whose steps and canvases the job's Done sums for the rows that do
def _count_forward(module, args, output) -> None:
    _counts.forwards = getattr(_counts, "forwards", 0) + 1


def _ar_mode(rows: list[Row]) -> bool:
    """Whether a joint model's rows all run its AR mode (not naive: that one recomputes, on a thread of its own)."""
    try:
        return all(joint.resolve_sampler(r.cfg) == "ar" and not r.cfg.naive for r in rows)
    except DlmError:
        return False


@dataclass
class Served:
    """One model id: a checkpoint, its paradigm, and how it runs."""

    id: str
    paradigm: str  # ar | mdlm | usdm | speculative
    model: Transformer
    ck: object  # dlm.checkpoint.Checkpoint
    path: str
    drafter: Drafter | None = None  # speculative: the drafter this id verifies (its model shared by every request)
    draft: str | None = None  # the drafter's id (folder name, or 'lookup')
    batcher: ARBatcher | None = None  # AR: the batching thread of the target
    rows: RowsBatcher | None = None  # mdlm, usdm, joint, speculative: the row batching thread
    ar_mode: ARBatcher | None = None  # joint: the batching thread of its AR mode

    @property
    def context(self) -> int:
        return self.model.cfg.max_seq_len

    def describe(self) -> dict:
        d = {"paradigm": self.paradigm, "checkpoint": self.path, "context": self.context,
             "parameters": sum(p.numel() for p in self.model.parameters())}
        if self.draft:
            d["draft"] = self.draft
            d["drafter"] = self.drafter.name
        if self.paradigm == "mdlm":
            d["block_size"] = self.ck.block_size or None
        if self.paradigm == "usdm":
            d["canvas_length"] = self.ck.canvas_length
        return d


class Engine:
    """The models of one server, loaded once; starts jobs on them."""

    def __init__(self, models: list[str], draft: str | None = None, device: str | torch.device = "cpu",
                 max_batch: int = 64):
        if not models:
            raise DlmError("--model: give at least one checkpoint folder")
        self.models: dict[str, Served] = {}
        ar_models: list[Served] = []
        for path in models:
            name = Path(path).resolve().name
            if name in self.models:
                raise DlmError(f"--model {path}: two models named {name!r} (model ids are the folder names)")
            ck = open_checkpoint(path)
            if ck.objective == "dflash":
                raise DlmError(f"--model {path}: a dflash checkpoint is a drafter; serve it with --draft {path} "
                               "next to the AR --model it drafts for")
            model, ck = load_model(path, device=device)
            model.register_forward_hook(_count_forward)
            served = Served(name, ck.objective, model, ck, str(path))
            if ck.objective == "ar":
                served.batcher = ARBatcher(model, ck, max_batch, name)
                ar_models.append(served)
            elif ck.objective in ("mdlm", "usdm", "joint") and batchable(model) and mdlm.rows_fit(ck):
                served.rows = RowsBatcher(model, ck, max_batch, name)  # (full-attention / shifted: one by one)
                if ck.objective == "joint":
                    served.ar_mode = ARBatcher(model, ck, max_batch, f"{name}-ar")
            self.models[name] = served
        if draft:
            if not ar_models:
                raise DlmError("--draft: speculative decoding needs an ar --model to verify the drafts")
            draft_id = "lookup" if draft == "lookup" else Path(draft).resolve().name
            for target in ar_models:
                base = load_drafter(draft, target.model, target.ck, Sampling())
                sid = f"{target.id}+{draft_id}"
                served = Served(sid, "speculative", target.model, target.ck, target.path, base, draft_id,
                                target.batcher)
                if rows_batchable(target.model, base):
                    served.rows = RowsBatcher(target.model, target.ck, max_batch, sid, drafter=base)
                self.models[sid] = served

    def get(self, model_id: str) -> Served | None:
        return self.models.get(model_id)

    def validate(self, served: Served, prompts: list[Prompt], cfg: SampleConfig) -> None:
        """The sampler's own checks of these options (DlmError, before any work)."""
        drafter = served.drafter.fork(cfg) if served.drafter is not None else None
        gen = stream(served.model, served.ck, prompts, cfg, drafter=drafter)
        gen.close()

    def start(self, served: Served, rows: list[Row], loop: asyncio.AbstractEventLoop | None = None,
              step_events: bool = False) -> Job:
        job = Job(rows, loop, step_events)
        logprobs = any(r.logprobs is not None for r in rows)
        infill = any(r.prompt.canvas is not None for r in rows)  # FIM rows: the AR sampler's own infilling
        if served.batcher is not None and (served.drafter is None or logprobs) and not infill:
            served.batcher.submit(job)
        elif served.ar_mode is not None and not infill and _ar_mode(rows):
            served.ar_mode.submit(job)
        elif served.rows is not None and served.rows.takes(rows):
            served.rows.submit(job)
        else:
            threading.Thread(target=self._run, args=(served, job), daemon=True,
                             name=f"dlm-{served.id}").start()
        return job

    def stats(self) -> dict:
        out = {s.id: (s.rows or s.batcher).stats() for s in self.models.values()
               if (s.batcher is not None and s.drafter is None) or s.rows is not None}
        out.update({f"{s.id}:ar": s.ar_mode.stats() for s in self.models.values() if s.ar_mode is not None})
        return out

    def close(self) -> None:
        for s in self.models.values():
            for b in (s.batcher, s.rows, s.ar_mode):
                if b is not None:
                    b.close()

    @torch.inference_mode()
    def _run(self, served: Served, job: Job) -> None:
        """One job on the sampler of its paradigm, row after row; stops between events when told to."""
        _counts.forwards = 0
        draft_forwards = 0
        done = Stats()  # the samplers' own Done statistics, summed over rows
        failed = None
        try:
            for i, row in enumerate(job.rows):
                if job.cancelled.is_set():
                    break
                drafter = served.drafter.fork(row.cfg) if served.drafter is not None else None
                events = stream(served.model, served.ck, [row.prompt], row.cfg, drafter=drafter,
                                step_events=job.step_events)
                try:
                    for ev in events:
                        if isinstance(ev, Done):
                            done.steps += ev.stats.steps
                            done.canvases += ev.stats.canvases
                            break
                        ev.row = i
                        job.emit(ev)
                        if job.over(i):
                            break
                finally:
                    events.close()
                    if drafter is not None:
                        draft_forwards += drafter.forwards
        except DlmError as e:
            failed = Failed(str(e), client=True)
        except Exception as e:  # a bug: the request fails, the server goes on
            log.exception("generation failed")
            failed = Failed(f"internal error: {type(e).__name__}: {e}")
        if failed is not None:
            job.emit(failed)
            return
        job.emit(Done(Stats(forwards=_counts.forwards, draft_forwards=draft_forwards, steps=done.steps,
                            canvases=done.canvases,
                            seconds=time.perf_counter() - job.t0, ttft=job.first)))


# continuous batching of AR requests -----------------------------------------------------------------

@dataclass
class _Slot:
    """A row being decoded by the batcher."""

    job: Job
    index: int  # the row within its job
    ids: list[int]
    temperature: float
    top_k: int
    top_p: float
    max_new: int
    logprobs: int | None
    gen: torch.Generator | None
    produced: int = 0
    last: int = 0
    pos: int = 0  # position of the next token fed
    done: bool = False


def _buffers(cache) -> list[torch.Tensor]:
    """Every K and V buffer of a cache, rows at dim -4 and columns at dim -2: the plain backbone's two
    (n_layers, B, H, C, hd) tensors, or one per layer (B, H_i, C, hd_i) where the layers' shapes differ."""
    return [cache.k, cache.v] if isinstance(cache.k, torch.Tensor) else [*cache.k, *cache.v]


def _cache_view(cache, n: int, length: int):
    """The cache over its first n rows (a view: writes land in it)."""
    view = copy.copy(cache)
    if isinstance(cache.k, torch.Tensor):
        view.k, view.v = cache.k[:, :n], cache.v[:, :n]
    else:
        view.k, view.v = [t[:n] for t in cache.k], [t[:n] for t in cache.v]
    view.length = length
    return view


class _BatchThread:
    """What both batchers share: one daemon thread; jobs arrive through `submit` and join between two steps (each of
    its rows queued by `_queue`); every round runs `_round` under inference mode; a bug fails the jobs in flight
    (`_in_flight`), `_reset` empties the batch, and the thread keeps serving."""

    label = "batcher"

    def _start(self, name: str) -> None:
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        self.inbox.put(job)

    def close(self) -> None:
        self._closed = True
        self.inbox.put(None)

    def stats(self) -> dict:
        c = dict(self.counts)
        c["mean_rows_per_step"] = c["decode_rows"] / c["decode_steps"] if c["decode_steps"] else 0.0
        c["active_rows"] = self._active()
        c["waiting_rows"] = len(self.waiting)
        return c

    def _loop(self) -> None:
        while not self._closed:
            try:
                self._take(block=not self._active() and not self.waiting)
                with torch.inference_mode():
                    self._round()
            except Exception as e:  # a bug: fail what is in flight, keep serving
                log.exception("%s failed", self.label)
                for job in {id(r.job): r.job for r in self._in_flight()}.values():
                    job.emit(Failed(f"internal error: {type(e).__name__}: {e}"))
                self.waiting.clear()
                with torch.inference_mode():
                    self._reset()

    def _take(self, block: bool) -> None:
        """Move the jobs that arrived into the waiting rows (blocking when there is nothing to do)."""
        jobs = []
        if block:
            jobs.append(self.inbox.get())
        while True:
            try:
                jobs.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        for job in jobs:
            if job is not None:
                job.live = len(job.rows)
                self._queue(job)


class ARBatcher(_BatchThread):
    """One thread that decodes every active AR row in one forward per step (continuous batching).

    The K/V buffers are the model's cache for `rows` rows and C columns (C = 2x the context; a backbone whose layers'
    head dims or KV heads differ has one buffer per layer), with one shared column count L. A step
    feeds each row its last token at its own position and writes column L for every row; `valid` (rows, C) says
    which columns each row attends to. Admitted rows are prefilled together (left-padded, one forward) and their
    K/V copied into the columns just before L; positions are each row's own (RoPE is in the keys). Each row's
    columns stay contiguous, ending at L - 1 (a prompt longer than L moves the rows there to the right first):
    a sliding-window layer's window of the last N keys is its last N columns. A finished row is replaced by the
    last row (rows stay 0..n-1, the forward runs on a view of them); when L reaches C, or the columns no row uses
    pile up, every row's columns are moved to the right end of a shorter timeline (repack).
    """

    def __init__(self, model: Transformer, ck, max_rows: int = 64, name: str = "ar"):
        self.model, self.tok = model, ck.tokenizer
        self.max_rows = max_rows
        self.C = 2 * model.cfg.max_seq_len
        self.waiting: deque[_Slot] = deque()
        self.rows: list[_Slot] = []
        self.cache = None  # the model's KV cache for the rows (dlm.model.KVCache)
        self.valid: torch.Tensor | None = None
        self.L = 0
        self.counts = {"forwards": 0, "prefills": 0, "decode_steps": 0, "decode_rows": 0, "max_rows": 0,
                       "repacks": 0}
        self._start(f"dlm-batch-{name}")

    # the loop ---------------------------------------------------------------------------------------

    label = "AR batcher"

    def _active(self) -> int:
        return len(self.rows)

    def _in_flight(self) -> list:
        return [*self.rows, *self.waiting]

    def _round(self) -> None:
        self._drop()
        if self.waiting and len(self.rows) < self.max_rows:
            self._admit()
            self._drop()
        if self.rows:
            self._step()
            self._drop()

    def _reset(self) -> None:
        self.rows.clear()
        self.L = 0
        if self.valid is not None:
            self.valid.zero_()

    def _queue(self, job: Job) -> None:
        dev = self.model.device
        for i, r in enumerate(job.rows):
            c = r.cfg
            self.waiting.append(_Slot(job, i, list(r.prompt.ids), c.temperature, c.top_k, c.top_p,
                                      c.max_new_tokens, r.logprobs,
                                      make_generator(c.seed, dev) if c.temperature > 0 else None))

    def _finish(self, slot: _Slot) -> None:
        job = slot.job
        job.live -= 1
        if job.live == 0:
            job.emit(Done(Stats(forwards=job.forwards, seconds=time.perf_counter() - job.t0, ttft=job.first,
                                extra={"batch_rows_mean": job.batch_rows / job.forwards if job.forwards else 0.0})))

    def _drop(self) -> None:
        """Remove finished, stopped and cancelled rows (the last row moves into each freed one)."""
        for i in range(len(self.rows) - 1, -1, -1):
            s = self.rows[i]
            if s.done or s.job.over(s.index):
                self._remove(i)
                self._finish(s)
        if any(s.job.over(s.index) for s in self.waiting):
            keep = deque()
            for s in self.waiting:
                if s.job.over(s.index):
                    self._finish(s)
                else:
                    keep.append(s)
            self.waiting = keep

    def _remove(self, i: int) -> None:
        last, L = len(self.rows) - 1, self.L
        if i != last:
            for t in _buffers(self.cache):
                t[..., i, :, :L, :] = t[..., last, :, :L, :]
            self.valid[i] = self.valid[last]
            self.rows[i] = self.rows[last]
        self.valid[last] = False
        self.rows.pop()
        if not self.rows:
            self.L = 0

    def _reserve(self, n: int) -> None:
        """Buffers for at least n rows (grown by doubling, the rows kept).

        The buffers are not filled: zeroing rows x C columns of every layer (hundreds of MB, all of it paged in)
        cost more than a second of a busy CPU where rows use a few hundred of the C columns. Nothing unwritten is
        read: columns :L of rows :n are always written (a step writes column L of every row, an admitted row gets
        its prompt's columns and zeros before them), and a forward reads columns :L + 1 of rows :n only."""
        have = 0 if self.cache is None else _buffers(self.cache)[0].shape[-4]
        if n <= have:
            return
        rows = min(self.max_rows, max(n, 2 * have, 4))
        cache = copy.copy(self.cache) if self.cache is not None else self.model.new_cache(0, self.C)
        empty = [torch.empty((*t.shape[:-4], rows, *t.shape[-3:]), dtype=t.dtype, device=t.device)
                 for t in _buffers(cache)]  # (.., rows, H, C, hd): K then V
        valid = torch.zeros(rows, self.C, dtype=torch.bool, device=self.model.device)
        if self.cache is not None:
            L = self.L
            for new, old in zip(empty, _buffers(self.cache)):
                new[..., :have, :, :L, :] = old[..., :L, :]
            valid[:have] = self.valid
        if isinstance(cache.k, torch.Tensor):
            cache.k, cache.v = empty
        else:
            h = len(empty) // 2
            cache.k, cache.v = empty[:h], empty[h:]
        self.cache, self.valid = cache, valid

    def _admit(self) -> None:
        new = [self.waiting.popleft() for _ in range(min(len(self.waiting), self.max_rows - len(self.rows)))]
        W = max(len(s.ids) for s in new)
        logits, pc, pvalid, pos = ar.prefill(self.model, [s.ids for s in new], W, self.tok.pad_id)  # one forward
        self.counts["forwards"] += 1
        self.counts["prefills"] += 1
        for job in {id(s.job): s.job for s in new}.values():
            job.forwards += 1
            job.batch_rows += len(new)
        n, m = len(self.rows), len(new)
        self._reserve(n + m)
        if W > self.L and n:  # the rows there move right, to end at W - 1 too (each row's columns contiguous)
            d, L = W - self.L, self.L
            for t in _buffers(self.cache):
                t[..., :n, :, d:W, :] = t[..., :n, :, :L, :].clone()
                t[..., :n, :, :d, :] = 0  # (unused now, masked: finite, as attention reads them)
            self.valid[:n, d:W] = self.valid[:n, :L].clone()
            self.valid[:n, :d] = False
        self.L = L = max(self.L, W)
        for t, p in zip(_buffers(self.cache), _buffers(pc)):
            t[..., n:n + m, :, :L - W, :] = 0  # (unused by these rows, masked: finite, as attention reads them)
            t[..., n:n + m, :, L - W:L, :] = p
        self.valid[n:n + m] = False
        self.valid[n:n + m, L - W:L] = pvalid
        for s, p in zip(new, pos.tolist()):
            s.pos = p
        self.rows.extend(new)
        self._commit(new, logits)

    def _step(self) -> None:
        """One forward: every active row's next token."""
        if self.L + 1 > self.C or self._wasted() > self.C // 4:
            self._repack()
        n, L, dev = len(self.rows), self.L, self.model.device
        x = torch.tensor([[s.last] for s in self.rows], dtype=torch.long, device=dev)  # (n, 1)
        pos = torch.tensor([[s.pos] for s in self.rows], dtype=torch.long, device=dev)  # (n, 1)
        self.valid[:n, L] = True
        seen = self.valid[:n, :L + 1]
        mask = "causal" if bool(seen.all()) else causal_layers(self.model.cfg, key_valid_mask(seen))  # (n,1,1,L+1)
        logits = self.model(x, pos=pos, cache=_cache_view(self.cache, n, L), mask=mask).logits[:, -1]
        self.L = L + 1
        for s in self.rows:
            s.pos += 1
        c = self.counts
        c["forwards"] += 1
        c["decode_steps"] += 1
        c["decode_rows"] += n
        c["max_rows"] = max(c["max_rows"], n)
        for job in {id(s.job): s.job for s in self.rows}.values():
            job.forwards += 1
            job.batch_rows += n
        self._commit(self.rows, logits)

    def _commit(self, slots: list[_Slot], logits: torch.Tensor) -> None:
        """Choose each row's next token from its logits (n, V) with its own options; emit it."""
        lp = torch.log_softmax(logits.float(), -1) if any(s.logprobs is not None for s in slots) else None
        greedy = logits.argmax(-1).tolist()
        eos = eos_set(self.tok.eos_ids)
        for i, s in enumerate(slots):
            if s.done:
                continue
            if s.temperature == 0:
                t = greedy[i]
            else:
                try:
                    t = int(sample_token(logits[i:i + 1], s.temperature, s.top_k, s.top_p, s.gen)[0])
                except Exception as e:  # one row's options broke its sampling: fail its request, not the batch
                    log.exception("sampling failed")
                    s.done = True
                    s.job.cancel()
                    s.job.emit(Failed(f"internal error while sampling: {type(e).__name__}: {e}"))
                    continue
            if s.logprobs is not None:
                top = []
                if s.logprobs > 0:
                    vals, idx = torch.topk(lp[i], s.logprobs)
                    top = list(zip(idx.tolist(), vals.tolist()))
                ev = Scored([t], s.index, float(lp[i, t]), top)
            else:
                ev = Commit([t], s.index)
            s.job.emit(ev)
            s.produced += 1
            s.last = t
            if t in eos or s.produced >= s.max_new:
                s.done = True

    def _wasted(self) -> int:
        """Columns before the first one any row uses."""
        n = len(self.rows)
        if not n:
            return 0
        return int(self.valid[:n, :self.L].any(0).to(torch.int8).argmax())

    def _repack(self) -> None:
        """Move every row's columns to the right end of a timeline as long as the longest row."""
        n, L = len(self.rows), self.L
        first = self.valid[:n, :L].to(torch.int8).argmax(1).tolist()  # each row's first used column
        L2 = max(L - f for f in first)
        for i, f in enumerate(first):
            d = L2 - (L - f)
            if d != f:
                for t in _buffers(self.cache):
                    t[..., i, :, d:L2, :] = t[..., i, :, f:L, :].clone()
                self.valid[i, d:L2] = self.valid[i, f:L].clone()
                self.valid[i, :d] = False
        self.valid[:, L2:] = False
        self.L = L2
        self.counts["repacks"] += 1


# continuous batching of mdlm and usdm requests -------------------------------------------------------

@dataclass(eq=False)
class _Row:
    """A row in the batcher: its job, its index there, its sampler's counters (and its drafter: speculation)."""

    job: Job
    index: int
    stats: Stats | SpecStats = field(default_factory=lambda: Stats(extra={"steps_per_canvas": []}))
    drafter: Drafter | None = None


class RowsBatcher(_BatchThread):
    """One thread that runs every active mdlm, usdm, joint or speculative row in one forward per step and model
    (continuous batching).

    Between two steps it drops the rows whose request stopped them or went away, admits the rows that arrived
    (up to max_rows; the rest wait in arrival order) and runs one step of the batch (`mdlm.Batch` / `usdm.Batch` /
    `speculative.Batch`: every row's next pass in one forward per model); a row whose generation ended leaves the
    batch there. A job's `Done` comes when its last row is over.
    """

    def __init__(self, model: Transformer, ck, max_rows: int = 64, name: str = "rows", drafter: Drafter | None = None):
        self.model, self.ck, self.drafter = model, ck, drafter
        self.paradigm = "speculative" if drafter is not None else ck.objective
        self.max_rows = max_rows
        self.waiting: deque[_Row] = deque()
        self.batch = self._new_batch()
        self.counts = {"forwards": 0, "decode_steps": 0, "decode_rows": 0, "max_rows": 0}
        self._start(f"dlm-rows-{name}")

    def _new_batch(self):
        C = 2 * self.model.cfg.max_seq_len  # the longest row plus its longest window
        if self.paradigm == "mdlm":
            return mdlm.Batch(self.model, C, self.ck.mask_id, self.ck.tokenizer.eos_ids)
        if self.paradigm == "usdm":
            return usdm.Batch(self.model, C)
        return speculative.Batch(self.model, self.drafter.row_model if self.drafter is not None else None, C)

    def takes(self, rows: list[Row]) -> bool:
        """Whether a request's rows run here (else on a thread of their own: --naive, infilling by speculation,
        --check-lossless; a joint model's AR mode goes to its AR batcher before this is asked)."""
        if any(r.cfg.naive for r in rows):
            return False
        if self.paradigm in ("speculative", "joint"):
            return not any(r.prompt.canvas is not None or r.cfg.check_lossless for r in rows)
        return True

    label = "row batcher"

    def _active(self) -> int:
        return len(self.batch)

    def _in_flight(self) -> list:
        return [lv.tag for lv in self.batch.live] + list(self.waiting)

    def _round(self) -> None:
        self._drop()
        self._admit()
        if len(self.batch):
            self._step()

    def _reset(self) -> None:
        self.batch = self._new_batch()

    def _queue(self, job: Job) -> None:
        self.waiting.extend(_Row(job, i) for i in range(len(job.rows)))

    def _finish(self, r: _Row) -> None:
        job = r.job
        job.live -= 1
        if isinstance(r.stats, Stats):
            job.steps += r.stats.steps
            job.canvases += r.stats.canvases
        if r.drafter is not None and r.drafter.row_model is not None:
            job.draft_forwards += r.drafter.forwards
        if job.live == 0 and not job.failed:
            job.emit(Done(Stats(forwards=job.forwards, draft_forwards=job.draft_forwards, steps=job.steps,
                                canvases=job.canvases,
                                seconds=time.perf_counter() - job.t0, ttft=job.first,
                                extra={"batch_rows_mean": job.batch_rows / job.forwards if job.forwards else 0.0})))

    def _drop(self) -> None:
        """Rows whose request stopped them or went away leave (between two steps)."""
        for i in range(len(self.batch) - 1, -1, -1):
            r = self.batch.live[i].tag
            if r.job.over(r.index):
                self.batch.drop(i)
                self._finish(r)
        if any(r.job.over(r.index) for r in self.waiting):
            keep = deque()
            for r in self.waiting:
                if r.job.over(r.index):
                    self._finish(r)
                else:
                    keep.append(r)
            self.waiting = keep

    def _admit(self) -> None:
        while self.waiting and len(self.batch) < self.max_rows:
            r = self.waiting.popleft()
            spec = r.job.rows[r.index]
            try:
                events = self._add(r, spec.prompt, spec.cfg)
            except DlmError as e:  # (the options were checked when the request came: not expected)
                r.job.cancel()
                r.job.failed = True  # (its other rows leave at the next drop)
                r.job.emit(Failed(str(e), client=True))
                self._finish(r)
                continue
            self._emit(events)
            if self.batch.index(r) is None:  # over before any forward (a template with no holes)
                self._finish(r)

    def _add(self, r: _Row, prompt: Prompt, cfg: SampleConfig) -> list:
        model, ck = self.model, self.ck
        step_events = r.job.step_events
        if self.paradigm == "speculative":
            r.stats = SpecStats()
            program, r.drafter = speculative.batch_row(model, ck, prompt, cfg, self.drafter, r.index, r.stats)
            return self.batch.add(program, tag=r)
        if self.paradigm == "joint":
            program, window, answer, r.stats, r.drafter = joint.batch_row(model, ck, prompt, cfg, r.index,
                                                                          step_events=step_events)
            return self.batch.add(program, r, window, answer)
        if self.paradigm == "mdlm":
            job, rule, cfg = mdlm.row_job(model, ck, prompt, cfg)
            return self.batch.add(job, rule, cfg, r.index, r.stats, tag=r,
                                  gen=make_generator(cfg.seed, model.device), step_events=step_events)
        L, steps = usdm.check_options(model, ck, cfg)
        cfg = usdm.with_last_canvas(ck, cfg)
        p = usdm.row_prompt(ck, model, prompt, cfg)
        return self.batch.add(p, L, steps, ck.noise_vocab, ck.tokenizer.eos_ids, cfg, r.index, r.stats, tag=r,
                              gen=make_generator(cfg.seed, model.device), step_events=step_events)

    def _emit(self, events: list) -> None:
        for r, ev in events:
            if not r.job.over(r.index):
                r.job.emit(ev)

    def _step(self) -> None:
        rows = [lv.tag for lv in self.batch.live]
        before = self.batch.forwards
        events = self.batch.step()
        n, f = len(rows), self.batch.forwards - before
        c = self.counts
        c["forwards"] += f
        c["decode_steps"] += 1
        c["decode_rows"] += n
        c["max_rows"] = max(c["max_rows"], n)
        for job in {id(r.job): r.job for r in rows}.values():
            job.forwards += f
            job.batch_rows += n * f
        self._emit(events)
        live = {id(lv.tag) for lv in self.batch.live}
        for r in rows:
            if id(r) not in live:  # its generation ended
                self._finish(r)
