"""The side-by-side harness: every paradigm on the same held-out task cases, measured the same way.

A `Method` is a model, its checkpoint and one SampleConfig (and a drafter for speculation). The bench
prompts are task cases (dlm.tasks): line completion of held-out files, with fill-in-the-middle cases
alongside, so the quality columns are task metrics (completion edit similarity and exact match,
infill exact match); generated-text perplexity under the AR reference stays as a secondary column.

Timings that can be trusted (`run_interleaved`):
- every method is warmed up on its own first;
- the timed runs are interleaved case by case: for each repetition, for each case, every method in
  turn (round-robin), the order of the methods rotated by one each repetition (`schedule`), so a burst
  of machine noise falls on all methods alike;
- `repeat` repetitions: a figure is the median over repetitions of the median over cases, shown with
  its min-max over repetitions; ratios (vs AR, speculative speedup) are per-case ratios against the
  AR baseline's run of the same case in the same round.

Each paradigm contributes methods (`ar_methods`, `mdlm_methods`, `usdm_methods`, `spec_methods`).

The package: harness.py (methods, cases, the interleaved schedule), methods.py (the catalogue of rows each paradigm
contributes), stats.py (medians, ratios, generated-text quality, Pareto fronts), tables.py (tables and plots);
`run_bench` here puts them together.
`--task NAME` sweeps the diffusion samplers over that task's cases instead (quality against tokens per
forward and against wall time: the Pareto plot).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

from dlm.bench.harness import (
    check_positive,
    environment,
    run_interleaved,
    run_item,
    write_json,
)
from dlm.bench.methods import (
    INFILL_NEW_TOKENS,
    bench_items,
    build_methods,
    infill_method,
)
from dlm.bench.stats import (
    equal_quality,
    gen_perplexity,
    median,
    noise,
    summarize,
    summarize_spec,
    unigram_entropy,
)
from dlm.bench.tables import plot_blocks, plot_pareto, print_report
from dlm.checkpoint import load_model
from dlm.errors import DlmError
from dlm.files import check_out_file


def relayout(methods) -> int:
    """--col-major: every model the methods run (the target, the other paradigms' models, the drafters') with its
    linear weights column-major (dlm.model.column_major), once each; the number of weights relaid."""
    from dlm.model import column_major

    return sum(column_major(x) for x in _models(methods))


def _models(methods) -> list[torch.nn.Module]:
    """Every model the methods run, once each: the targets, the other paradigms' models, the drafters'."""
    models = {id(x): x for m in methods
              for x in (m.model, getattr(m.drafter, "model", None), getattr(m.drafter, "row_model", None))
              if isinstance(x, torch.nn.Module)}
    return list(models.values())


def reblock(methods) -> int:
    """--blocked: every model the methods run with its float32 linear layers keeping a copy of their weight in dlm's
    blocked layout, for its kernel of 1-16 rows (dlm.model.pack_linears(blocked=True)); the number packed."""
    from dlm.model import pack_linears

    return sum(pack_linears(x, blocked=True) for x in _models(methods))


def compile_rows(methods, net, step: str = "compiled"):
    """--compile: the AR rows on the target `net` (the target alone beside each temperature's speculative rows, and
    "ar (KV cache)"; not the naive loop) decode through one row batch whose one-token steps run compiled (the step
    `dlm serve --compile` runs: dlm.sampling.graphs.RowsStep, compiled here, once; `step` "static": the same step
    eagerly), and the speculative rows through row batches on the same step, their verify windows (the drafter's
    block) on its window step (RowsStep.window), compiled here too. The AR rows' batch (its `rows.step` None where
    compiling failed: the rows then decode eagerly, with a warning), or None without such rows."""
    from dlm.sampling.rows import Programs
    from dlm.sampling.speculative import resolve_block_size, rows_batchable

    rows = [m for m in methods if m.paradigm == "ar" and m.model is net and not m.cfg.naive]
    spec = [m for m in methods if m.drafter is not None and m.model is net and rows_batchable(net, m.drafter)]
    if not rows and not spec:
        return None
    C = 2 * net.cfg.max_seq_len
    programs = Programs(net, C, step=step)
    for m in rows:
        m.rows = programs
    for m in spec:  # each drafter's rows beside the target's, on the same step; its verify windows on the step's window
        d = m.drafter
        draft = getattr(d, "row_model", None)
        m.rows = Programs(net, C, {"draft": draft} if draft is not None else None, step=programs.rows.step or "eager")
        m.rows.rows.warm_windows([resolve_block_size(d, m.cfg.block_size)])
    return programs


def run_bench(model: str, prompts: int = 8, max_new_tokens: int = 64, out: str | None = None, data: str | None = None,
              warmup: int = 1, naive: bool = True, quiet: bool = False, mdlm: str | None = None,
              usdm: str | None = None, sweep: bool = False, draft: list[str] | None = None,
              temperatures: tuple[float, ...] = (0.0, 1.0), block_size: int | None = None, repeat: int = 3,
              task: str | None = None, span: str = "line", joint: str | None = None,
              joint_blocks: tuple[int, ...] = (16,), col_major: bool = False, device: str = "cpu",
              blocked: bool = False, dtype: str | None = None, ar_step: str = "eager") -> dict[str, Any]:
    """Run every method on the same held-out cases, interleaved and repeated; print the tables, write the JSON
    report (and the PNG of quality against tokens per forward and wall time beside it).

    Without `task`: line-completion cases timed (`prompts` of them, `repeat` rounds), infill cases alongside (once)
    for the infill column. With `task` (complete, infill, sudoku): that task's cases, the diffusion samplers swept.
    With `draft` (drafter checkpoints and/or 'lookup'), each drafter runs in the speculative loop at every
    temperature beside the target alone at that temperature (speedup, tau, lossless fraction). Every model runs on
    `device` (cpu, cuda, cuda:N; on CUDA the AR rows replay their steps from CUDA graphs, dlm.sampling.graphs), in
    `dtype` (float32 unless given: bfloat16 or float16, e.g. on a GPU, where float32 products of a few rows are slow).
    ar_step "compiled" (--compile): the AR rows on the target decode on the compiled one-token step of `dlm serve
    --compile`, the speculative rows verify on its compiled windows (compile_rows); "static": those steps run eagerly
    (their check).
    """
    from dlm.tasks import task_module
    from dlm.tasks.common import window

    check_positive("prompts", prompts)
    check_positive("max-new-tokens", max_new_tokens)
    check_positive("repeat", repeat)
    if warmup < 0:
        raise DlmError(f"--warmup must be >= 0, got {warmup}")
    if task:
        task_module(task)
        sweep = True
    if out:
        check_out_file(out)  # before the run, not after it
    from dlm.bench.cost import check_dtype
    from dlm.device import resolve_device

    net, ck = load_model(model, device=resolve_device(device), dtype=check_dtype(dtype))
    if ck.objective != "ar":  # its rows would be labelled "ar (KV cache)" and it would judge the quality column
        hint = f" (pass it as --{ck.objective})" if ck.objective in ("mdlm", "usdm", "joint") else ""
        raise DlmError(f"--model {model}: objective {ck.objective!r}; bench's --model is the ar baseline, speculation "
                       f"target and quality judge, an ar checkpoint{hint}")
    items, infill_items = bench_items(task, data, prompts, span)
    if infill_items and ck.tokenizer.fim_prefix_id is None:  # e.g. an imported Gemma 4: infill needs FIM markers
        print(f"note: {ck.path.name}'s tokenizer has no fill-in-the-middle markers: no infill column", file=sys.stderr)
        infill_items = []
    methods, spec_groups = build_methods(net, ck, max_new_tokens, naive, mdlm, usdm, sweep, draft, temperatures,
                                         block_size, joint, joint_blocks)
    if col_major:
        relayout(methods)
    if blocked:
        reblock(methods)
    programs = compile_rows(methods, net, ar_step) if ar_step != "eager" else None
    stepped = programs is not None and programs.rows.step is not None
    context = min(window(m.ck, m.model) for m in methods)  # every method gets the same prompt tokens

    from rich.progress import Progress

    total = len(methods) * (len(items) * repeat + len(infill_items))
    with Progress(disable=quiet, transient=True) as bar:
        job = bar.add_task("bench", total=total)
        rows = run_interleaved(methods, items, repeat, warmup, lambda m, it: run_item(m, it, context),
                               lambda: bar.advance(job))
        infill_rows = (run_interleaved([infill_method(m) for m in methods], infill_items, 1, 0,
                                       lambda m, it: run_item(m, it, context),
                                       lambda: bar.advance(job)) if infill_items else None)
    metrics = items[0].task.METRICS
    prefix = "" if task else "complete_"
    summaries = []
    for k, m in enumerate(methods):
        s = summarize(m, rows[k], rows[0], metrics, prefix)
        if infill_rows:
            from dlm.tasks import infill

            s.update({f"infill_{q}": sum(r[q] for r in infill_rows[k][0]) / len(infill_items) for q in infill.METRICS})
            s["infill_tokens_per_forward"] = median([r["tokens_per_forward"] for r in infill_rows[k][0]])
        if not task:
            first = rows[k][0]
            s["gen_ppl"] = median([gen_perplexity(net, r["prompt"], r["tokens"], ck.tokenizer.eos_ids) for r in first])
            s["entropy"] = median([unigram_entropy(r["tokens"]) for r in first])
        summaries.append(s)
    by_name = {s["method"]: s for s in summaries}
    index = {m.name: k for k, m in enumerate(methods)}
    for t, base_m, group in spec_groups:
        by_name[base_m.name].update(temperature=t, speedup=1.0, speedup_range=[1.0, 1.0])
        for m in group:
            by_name[m.name].update(summarize_spec(rows[index[m.name]], rows[index[base_m.name]], t))
    per_case = {}
    for k, m in enumerate(methods):  # (a loop: as comprehensions, Python 3.12 lost this `k` to the inner one's `k`)
        per_case[m.name] = [{**{key: v for key, v in r.items() if key not in ("tokens", "prompt")},
                             "seconds_per_repetition": [rows[k][rr][i]["seconds"] for rr in range(repeat)]}
                            for i, r in enumerate(rows[k][0])]
    report = {"environment": environment(), "model": str(ck.path), "max_new_tokens": max_new_tokens,
              "task": task, "span": span if task == "infill" else None, "cases": len(items), "repeat": repeat,
              "warmup": warmup, "context": context, "col_major": col_major, "blocked": blocked,
              "ar_step": ar_step if stepped else "eager",
              "ar_step_forwards": programs.forwards if programs is not None else 0,
              "ar_step_windows": sum(m.rows.rows.windowed for m in methods if m.rows is not None and m.drafter),
              "device": str(net.device),
              "dtype": dtype or "float32",
              "order": "interleaved: each case runs every method in turn, the order rotated by one each repetition",
              "prompts": [it.case.name for it in items], "infill_cases": len(infill_items),
              "infill_max_new_tokens": min(max_new_tokens, INFILL_NEW_TOKENS) if infill_items else None,
              "summaries": summaries, "noise": noise(summaries), "per_case": per_case}
    if infill_rows:
        report["per_infill_case"] = {m.name: [{k: v for k, v in r.items() if k not in ("tokens", "prompt")}
                                              for r in infill_rows[k][0]] for k, m in enumerate(methods)}
    if mdlm and not task:
        report["equal_quality"] = equal_quality(summaries)
    if not quiet:
        print_report(report, [by_name[m.name] for t, b, g in spec_groups for m in [b] + g])
    if out:
        png = Path(out).with_suffix(".png")
        key = task_module(task).PRIMARY if task else "complete_edit_similarity"
        label = f"{task} {key.replace('_', ' ')}" if task else "completion edit similarity"
        note = plot_pareto(summaries, key, label, png)
        report["plot"] = None if note else str(png)
        if note:
            report["plot_note"] = note
        if joint and len(joint_blocks) > 1:
            blocks_png = Path(out).with_suffix(".blocks.png")
            if plot_blocks(summaries, blocks_png) is None:
                report["blocks_plot"] = str(blocks_png)
        write_json(out, report)
    return report
