"""The models a server holds and how requests run on them; no web framework here.

A request becomes a `Job`: its rows (one per prompt and choice, each a Prompt and a SampleConfig),
a thread-safe bridge that hands the sampler's events to the event loop, and a cancel flag that the
workers read between events (a client that leaves, a stop string that matched).

Two ways to run a job:

- Batched: a `RowsBatcher`, one thread per model id, runs every active row of every request (one row per
  prompt and choice) as its sampler's row program (`dlm.sampling.row_program`: AR decoding, an mdlm
  block's denoising, a usdm canvas, a joint model's modes, a speculating row with its own drafter fork)
  on one `dlm.sampling.rows.Programs`: each step, one forward serves every row's next request (a prompt's
  prefill, an AR token, a denoising step, a verify pass), each row over its own K/V slots, positions and
  masks, and one forward of a drafter's model every row that drafts. Rows that arrived join at the next
  step; rows that finished, stopped or were cancelled leave between steps. The samplers draw, stop at
  EOS and score (logprobs); each row keeps its own options and generator (seed + choice), so its tokens
  do not depend on the batch (greedy rows equal `dlm generate`'s, up to float rounding of batched
  matmuls). An AR request that asks for logprobs on a speculative id runs on its target's batcher (its
  output is the same).
- `naive` requests, infilling by an AR model or by speculation, --check-lossless, and models the row
  batch cannot run (a full-attention or shifted family, an input-injection drafter): one worker thread
  per job runs its rows one after another with `dlm.sampling.stream` (torch releases the GIL inside its
  ops, so jobs overlap on the cores).

Every job ends with exactly one `Done` (its forwards, draft forwards, seconds, time to first token;
batched: the mean batch its forwards ran in) or one `Failed`.
"""

from __future__ import annotations

import asyncio
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
from dlm.model import Transformer, pack_linears
from dlm.sampling import SampleConfig, mdlm, row_program, stream
from dlm.sampling.common import Commit, Done, Event, Prompt, Stats
from dlm.drafters import load_drafter
from dlm.sampling.rows import Programs, Raised, batchable
from dlm.sampling.speculative import Drafter, SpecStats, rows_batchable

log = logging.getLogger("dlm.serve")


# the event the server adds to the sampler's ----------------------------------------------------------

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
    rows: RowsBatcher | None = None  # the row batching thread of this id
    plain: RowsBatcher | None = None  # speculative: the target's, where its AR requests (logprobs) run

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
                 max_batch: int = 64, compile: bool = False, pack_weights: bool = False, prefix_cache: int = 256 << 20,
                 kv_dtype: str = "auto"):
        """compile: each model's one-token decoding steps run compiled (torch.compile, dlm.sampling.graphs.RowsStep),
        compiled while the server starts; where compiling fails, eagerly, with a warning. pack_weights: the models'
        large linear layers keep a copy in oneDNN's layout for products of several rows (model.PackedLinear).
        prefix_cache: bytes of prompts' K/V each batcher keeps for later prompts that share a prefix (rows.PrefixCache;
        0: none). kv_dtype: "bfloat16" keeps the AR models' K/V in bfloat16 (Transformer.kv_dtype: half their memory;
        not the float32 cache's rounding), "auto" in the weights' dtype."""
        if kv_dtype not in ("auto", "bfloat16"):
            raise DlmError(f"--kv-dtype must be auto or bfloat16, got {kv_dtype!r}")
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
            if kv_dtype == "bfloat16" and ck.objective == "ar":
                model.kv_dtype = torch.bfloat16
            if pack_weights:
                pack_linears(model)
            served = Served(name, ck.objective, model, ck, str(path))
            if ck.objective == "ar" or (ck.objective in ("mdlm", "usdm", "joint") and batchable(model)
                                        and mdlm.rows_fit(ck)):
                # (full attention, shifted: alone)
                served.rows = RowsBatcher(model, ck, max_batch, name, compile=compile, prefix=prefix_cache)
            if ck.objective == "ar":
                ar_models.append(served)
            self.models[name] = served
        if draft:
            if not ar_models:
                raise DlmError("--draft: speculative decoding needs an ar --model to verify the drafts")
            draft_id = "lookup" if draft == "lookup" else Path(draft).resolve().name
            for target in ar_models:
                base = load_drafter(draft, target.model, target.ck)
                sid = f"{target.id}+{draft_id}"
                served = Served(sid, "speculative", target.model, target.ck, target.path, base, draft_id,
                                plain=target.rows)
                if rows_batchable(target.model, base):
                    served.rows = RowsBatcher(target.model, target.ck, max_batch, sid, drafter=base, compile=compile,
                                              prefix=prefix_cache)
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
        logprobs = any(r.logprobs is not None for r in rows)  # (speculative: the target decodes them, as AR)
        batcher = served.plain if served.drafter is not None and logprobs else served.rows
        if batcher is not None and batcher.takes(rows):
            batcher.submit(job)
        else:
            threading.Thread(target=self._run, args=(served, job), daemon=True,
                             name=f"dlm-{served.id}").start()
        return job

    def stats(self) -> dict:
        return {s.id: s.rows.stats() for s in self.models.values() if s.rows is not None}

    def close(self) -> None:
        for s in self.models.values():
            if s.rows is not None:
                s.rows.close()

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


# continuous batching ------------------------------------------------------------------------------

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


@dataclass(eq=False)
class _Row:
    """A row in the batcher: its job, its index there, its sampler's counters (and its drafter: speculation)."""

    job: Job
    index: int
    stats: Stats | SpecStats = field(default_factory=lambda: Stats(extra={"steps_per_canvas": []}))
    drafter: Drafter | None = None


class RowsBatcher(_BatchThread):
    """One thread that runs every active row of a model (AR, mdlm, usdm, joint or speculative) in one forward per step
    and model (continuous batching).

    Each row is its sampler's row program (`dlm.sampling.row_program`: the sampler draws, stops and scores; the
    batcher only schedules). Between two steps it drops the rows whose request stopped them or went away, admits
    the rows that arrived (up to max_rows; the rest wait in arrival order) and runs one step of the batch
    (`dlm.sampling.rows.Programs`: every row's next request in one forward per model); a row whose generation ended
    leaves the batch there. A job's `Done` comes when its last row is over.
    """

    def __init__(self, model: Transformer, ck, max_rows: int = 64, name: str = "rows", drafter: Drafter | None = None,
                 compile: bool = False, prefix: int = 0):
        self.model, self.ck, self.drafter = model, ck, drafter
        self.prefix = prefix  # bytes of the prompts' K/V kept (rows.PrefixCache)
        self.step = "compiled" if compile else "eager"  # the target's one-token steps (rows.RowBatch)
        self.paradigm = "speculative" if drafter is not None else ck.objective
        self.max_rows = max_rows
        self.waiting: deque[_Row] = deque()
        self.batch = self._new_batch()
        self.counts = {"forwards": 0, "decode_steps": 0, "decode_rows": 0, "max_rows": 0}
        self._start(f"dlm-rows-{name}")

    def _new_batch(self) -> Programs:
        C = 2 * self.model.cfg.max_seq_len  # the longest row plus its longest window
        draft = self.drafter.row_model if self.drafter is not None else None
        batch = Programs(self.model, C, {"draft": draft} if draft is not None else None, isolate=True, step=self.step,
                         prefix=self.prefix)
        if self.drafter is not None and self.step == "compiled":  # a lone row's verify windows at the drafter's block
            batch.rows.warm_windows([self.drafter.default_block_size])
        return batch

    def takes(self, rows: list[Row]) -> bool:
        """Whether a request's rows run here (else on a thread of their own: --naive; infilling by an AR model or by
        speculation; --check-lossless)."""
        if any(r.cfg.naive for r in rows):
            return False
        if self.paradigm == "ar":
            return not any(r.prompt.canvas is not None for r in rows)
        if self.paradigm in ("speculative", "joint"):
            return not any(r.prompt.canvas is not None or r.cfg.check_lossless for r in rows)
        return True

    label = "row batcher"

    def stats(self) -> dict:
        c = super().stats()
        cache = self.batch.rows.prefix
        if cache is not None:  # prompts that reused a kept prefix, and the prompt tokens they did not compute
            c["prefix_hits"], c["prefix_tokens"] = cache.hits, cache.tokens
        return c

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
        row = row_program(self.model, self.ck, prompt, cfg, r.index, drafter=self.drafter,
                          logprobs=r.job.rows[r.index].logprobs, step_events=r.job.step_events)
        r.stats, r.drafter = row.stats, row.drafter
        return self.batch.add_row(row, r)

    def _emit(self, events: list) -> None:
        for r, ev in events:
            if isinstance(ev, Raised):  # its program failed (a bug, or its options broke its sampling): its request
                log.error("row failed", exc_info=ev.error)  # fails, the batch goes on
                if not r.job.failed:
                    r.job.cancel()
                    r.job.failed = True
                    r.job.emit(Failed(f"internal error: {type(ev.error).__name__}: {ev.error}"))
            elif not r.job.over(r.index):
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
