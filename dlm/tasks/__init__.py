"""Tasks that judge generated text by what it gets right (docs/tasks.md).

    complete   line-level code completion (CodeXGLUE): exact_match, edit_similarity
    infill     fill-in-the-middle of one line or 1-5 lines: exact_match, edit_similarity
    sudoku     solving puzzles (Ye et al. 2024): accuracy, cell_accuracy, valid
    code       HumanEval / MBPP programs run against their tests: pass@k
    code-infill  Bavarian et al.'s single- and multi-line infilling of HumanEval solutions: pass@1

`run_task` runs one method (a checkpoint with a SampleConfig, a drafter for speculation) over a
task's cases through the sampler contract, every paradigm alike, and reports the task's metrics (means
over cases) beside the statistics of DESIGN.md, summed over the cases: tokens_per_forward = all new
tokens / all forwards; tau pooled over all verify cycles, and acceptance_histogram[n] the cycles (of all cases)
that committed n tokens, from which the acceptance rate of each draft slot follows.
"""

from __future__ import annotations

import collections
import time
from typing import Any

from dlm.errors import DlmError
from dlm.tasks import code, complete, infill, sudoku
from dlm.tasks.common import Case, check_draws, style_of, window

TASKS: dict[str, Any] = {"complete": complete, "infill": infill, "sudoku": sudoku, "code": code,
                         "code-infill": code.Infill}


def task_module(name: str) -> Any:
    if name not in TASKS:
        raise DlmError(f"--task must be one of {sorted(TASKS)}, got {name!r}")
    return TASKS[name]


def run_case(task: Any, case: Case, model, ck, cfg, drafter=None, context: int = 0) -> dict[str, Any]:
    """One case: the request for the method's paradigm, the answer, its metrics and the call's statistics."""
    from dlm.sampling import stream
    from dlm.sampling.common import drain

    req = task.request(case, ck, cfg, style_of(ck, drafter, cfg), context or window(ck, model))
    tok = ck.tokenizer
    res = drain(stream(model, ck, [req.prompt], cfg.replace(max_new_tokens=req.max_new_tokens), drafter),
                tok.text, tok.eos_set)
    return _case_row(task, case, req, res)


def run_case_rows(task: Any, case: Case, programs, ck, cfg, context: int = 0, drafter=None) -> dict[str, Any]:
    """run_case through a row batch (`programs`: dlm.sampling.rows.Programs over an AR checkpoint's model, with the
    drafter's model beside it when there is one), as `dlm serve` runs a request: the prompt prefilled as a row, then
    one token per step through the batch's one-token step, or with `drafter` speculative cycles, their verify windows
    on the batch's window step where it has one (compiled: `dlm bench --compile`, what `dlm serve --compile` runs).
    An infilling request runs as run_case runs it."""
    from dlm.sampling import ar
    from dlm.sampling import speculative as spec
    from dlm.sampling.common import Clock, Commit, drain

    model = programs.rows.model
    req = task.request(case, ck, cfg, style_of(ck, drafter, cfg), context or window(ck, model))
    if req.prompt.canvas is not None:
        return run_case(task, case, model, ck, cfg, drafter, context)
    cfg = cfg.replace(max_new_tokens=req.max_new_tokens)
    if drafter is None:
        rp = ar.row_program(model, ck, req.prompt, cfg)
    else:
        rp = spec.row_program(model, ck, req.prompt, cfg, drafter=drafter)
        block, f0 = spec.resolve_block_size(rp.drafter, cfg.block_size), rp.drafter.forwards
    clock = Clock()

    def events():
        out = programs.add_row(rp)
        new = 0
        while True:
            for _, ev in out:
                if isinstance(ev, Commit):
                    clock.mark_first()
                    new += len(ev.tokens)
                yield ev
            if not len(programs):
                break
            out = programs.step()
        stats = rp.stats if drafter is None else spec.spec_stats(rp.stats, drafter.name, block, new,
                                                                  rp.drafter.forwards - f0)
        yield clock.finish(stats)

    tok = ck.tokenizer
    return _case_row(task, case, req, drain(events(), tok.text, tok.eos_set))


def _case_row(task: Any, case: Case, req, res) -> dict[str, Any]:
    answer = req.read(res)
    return {"case": case.name, "answer": answer, "target": case.target, **task.score(case, answer),
            **res.stats.as_dict(), "tokens": res.tokens[0], "prompt": req.prompt.ids}


def run_cases(task: Any, items: list[tuple[Case, Any]], model, ck, context: int = 0,
              drafter=None) -> list[dict[str, Any]]:
    """Several cases (each with its SampleConfig, seed included) as rows of one batch (dlm.sampling.stream_rows):
    the same answers and per-case counters (new tokens, forwards, steps, canvases: each row's own) as run_case;
    a case's `seconds` is the batch's wall time shared out evenly (latency is not measured per case here)."""
    from dlm.sampling import stream_rows
    from dlm.sampling.common import Result, Stats, drain

    ctx = context or window(ck, model)
    reqs = [task.request(case, ck, cfg, style_of(ck, drafter, cfg), ctx) for case, cfg in items]
    cfgs = [cfg.replace(max_new_tokens=req.max_new_tokens) for req, (_, cfg) in zip(reqs, items)]
    tok = ck.tokenizer
    res = drain(stream_rows(model, ck, [r.prompt for r in reqs], cfgs, drafter=drafter), tok.text, tok.eos_set,
                rows=len(reqs))
    rows = []
    for i, ((case, _), req) in enumerate(zip(items, reqs)):
        own = res.stats.extra["rows"][i]
        st = Stats(new_tokens=own["new_tokens"], forwards=own["forwards"], canvases=own["canvases"],
                   steps=own["steps"], seconds=res.stats.seconds / len(reqs),
                   draft_forwards=own.get("draft_forwards", 0))
        if "tau" in own:  # speculation: the row's own verify-cycle counters
            st.extra = {k: own[k] for k in ("tau", "cycles", "acceptance_histogram")}
        if "logprob" in own:  # mdlm, usdm: the model's log-probability of what the row committed
            st.extra["logprob"] = own["logprob"]
        rows.append(_case_row(task, case, req, Result([res.tokens[i]], [res.texts[i]], st)))
    return rows


def summarize(task: Any, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The task's metrics (means over cases) and the statistics summed over cases."""
    n = len(rows)
    out: dict[str, Any] = {"task": task.NAME, "n": n}
    out.update({m: sum(r[m] for r in rows) / n for m in task.METRICS})
    new, fwd = sum(r["new_tokens"] for r in rows), sum(r["forwards"] for r in rows)
    out.update(tokens_per_forward=new / fwd if fwd else 0.0, forwards=fwd, new_tokens=new,
               seconds=sum(r["seconds"] for r in rows))
    if getattr(task, "PASS_AT_K", None):  # several samples per problem: pass@k by problem
        out.update(code.pass_at_ks(rows))
        out["problems"] = len({r["case"] for r in rows})
    if any("revisions" in r for r in rows):  # mdlm --revise: committed tokens sent back to <mask>, all cases
        out["revisions"] = sum(r.get("revisions", 0) for r in rows)
    if any("tau" in r for r in rows):
        cycles = sum(r.get("cycles", 0) for r in rows)
        out["tau"] = sum(r["tau"] * r.get("cycles", 0) for r in rows) / cycles if cycles else 0.0
        out["draft_forwards"] = sum(r["draft_forwards"] for r in rows)
        out["cycles"] = cycles
        out["acceptance_histogram"] = [sum(h) for h in zip(*(r["acceptance_histogram"] for r in rows))]
    return out


# a case's work over its tries or draws (its new tokens stay the kept answer's: tokens per forward is then the
# answer's tokens over all the forwards spent on it)
SUMMED = ("forwards", "draft_forwards", "steps", "canvases", "seconds")


def _check_draws(option: str, n: int, cfg, ck) -> None:
    """An option that draws a case n times: n >= 1, and (n > 1) draws that differ with the seed (usdm always
    samples; the others need --temperature > 0)."""
    check_draws(option, n)
    if n > 1 and cfg.temperature <= 0 and ck.objective != "usdm":
        raise DlmError(f"{option} needs --temperature > 0: greedy decoding writes the same answer every time")


def check_best_of(best_of: int, cfg, ck, tries: int = 1) -> None:
    """--best-of N: an mdlm or usdm checkpoint (their samplers score what they commit), draws that differ."""
    if best_of > 1 and ck.objective not in ("mdlm", "usdm"):
        raise DlmError(f"--best-of: an mdlm or usdm checkpoint (their samplers score what they commit), "
                       f"got {ck.objective}")
    _check_draws("--best-of", best_of, cfg, ck)
    if best_of > 1 and tries > 1:
        raise DlmError("--best-of and --tries are two decoders: give one")


def check_tries(name: str, tries: int, cfg, ck) -> None:
    """--tries N: a task with a rule checker, and a sampler whose output changes with its seed."""
    if tries > 1 and not hasattr(task_module(name), "valid"):
        raise DlmError(f"--tries: the {name} task has no rule checker to judge a try (sudoku has)")
    _check_draws("--tries", tries, cfg, ck)


def run_task(name: str, model, ck, cfg, drafter=None, data: str | None = None, n: int = 100, seed: int = 0,
             span: str = "line", context: int = 0, progress: bool = False,
             cases: list[Case] | None = None, samples: int = 1, batch: int = 1, tries: int = 1,
             best_of: int = 1, pick: str = "score") -> dict[str, Any]:
    """Every case of the task (`cases`, else the task's cases of data, n, seed, span) through one method, `samples`
    times each (seeds seed, seed + 1, ...: pass@k); returns the summary with the per-case rows under "cases".
    batch > 1: an mdlm or usdm checkpoint, or speculative decoding with `drafter`, runs that many cases at once as rows
    of one batch (the same answers and counters; only the wall time changes); other methods run case by case.

    tries > 1 is a decoder that consults the task's rule checker (`valid`, which never reads the solution): a case
    whose answer breaks the rules is sampled again with the next seed (sample j's try t: seed + j + t x samples), up
    to `tries` times; its row keeps the last answer (its tokens), the work of every try (forwards, seconds) and
    `tries`.
    Its figures are the decoder's, not the model's alone, and are reported as such ("rule_checked").

    best_of > 1 (mdlm, usdm) draws each case that many times (sample j's draw t: seed + j + t x samples) and keeps the
    draw whose committed tokens the model gives the highest total log-probability (pick "score"), or the answer most
    draws agree on, that score breaking ties (pick "vote"): the model's own choice, no checker; the row keeps every
    draw's work and `best_of`."""
    task = task_module(name)
    check_draws("--samples", samples)
    if batch < 1:
        raise DlmError(f"--cases-per-batch must be >= 1, got {batch}")
    check_tries(name, tries, cfg, ck)
    check_best_of(best_of, cfg, ck, tries)
    if pick not in ("score", "vote"):
        raise DlmError(f"--pick must be score or vote, got {pick!r}")
    cases = cases if cases is not None else task.cases(data, n, seed, span)
    t0 = time.perf_counter()
    from rich.progress import Progress

    def run(items: list) -> list[dict[str, Any]]:
        out = []
        if batch > 1 and (drafter is not None or ck.objective in ("mdlm", "usdm")) and not cfg.naive:
            for i in range(0, len(items), batch):
                out += run_cases(task, items[i:i + batch], model, ck, context, drafter)
                bar.advance(job, len(items[i:i + batch]))
        else:
            for case, c in items:
                out.append(run_case(task, case, model, ck, c, drafter, context))
                bar.advance(job)
        return out

    with Progress(disable=not progress, transient=True) as bar:
        job = bar.add_task(f"{name}", total=len(cases) * samples)
        items = [(case, cfg if j == 0 else cfg.replace(seed=cfg.seed + j)) for case in cases for j in range(samples)]
        if best_of > 1:  # every draw of every item, then each item's best by the model's own score
            bar.update(job, total=len(items) * best_of)
            draws = run([(case, c.replace(seed=c.seed + t * samples)) for case, c in items for t in range(best_of)])
            rows = []
            for i in range(len(items)):
                mine = draws[i * best_of:(i + 1) * best_of]
                votes = collections.Counter(r["answer"] for r in mine) if pick == "vote" else None
                best = max(mine, key=lambda r: (votes[r["answer"]] if votes else 0, r.get("logprob", 0.0)))
                rows.append({**best, **{k: sum(r[k] for r in mine) for k in SUMMED if k in best}, "best_of": best_of})
        else:
            rows = run(items)
        for r in rows:
            r["tries"] = 1
        for t in range(1, tries):  # the rule checker's rounds: only the answers that break the rules go again
            again = [i for i, r in enumerate(rows) if not task.valid(items[i][0], r["answer"])]
            if not again:
                break
            bar.update(job, total=bar.tasks[0].total + len(again))
            redo = run([(items[i][0], items[i][1].replace(seed=items[i][1].seed + t * samples)) for i in again])
            for i, r in zip(again, redo):
                r.update({k: rows[i][k] + r[k] for k in SUMMED if k in r}, tries=t + 1)
                rows[i] = r
    out = summarize(task, rows)
    if tries > 1:
        out.update(rule_checked=tries, tries=sum(r["tries"] for r in rows) / len(rows))
    if best_of > 1:
        out.update(best_of=best_of, pick=pick)
    out["wall_seconds"] = time.perf_counter() - t0
    out["cases"] = [{k: v for k, v in r.items() if k not in ("tokens", "prompt")} for r in rows]
    return out
