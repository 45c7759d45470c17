"""The bench tables and plots."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dlm.bench.stats import front_of, noisy


def cell(s: dict[str, Any], key: str, fmt: str, show_range: bool = False) -> str:
    v = s.get(key)
    if v is None or (isinstance(v, float) and v != v):
        return "–"
    rng = s.get(f"{key}_range")
    if rng and s.get("repeat", 1) > 1:
        lo, hi = rng
        if noisy(v, lo, hi):
            return "noisy*"
        if show_range:
            return f"{format(v, fmt)} ({format(lo, fmt)}-{format(hi, fmt)})"
    return format(v, fmt)


def print_table(summaries: list[dict[str, Any]], columns: list[tuple], title: str = "") -> None:
    """columns: (key, header, format spec[, show the min-max over repetitions])."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title or None)
    table.add_column("method", style="bold", no_wrap=True)
    for col in columns:
        table.add_column(col[1], justify="right")
    marked = False
    for s in summaries:
        cells = [cell(s, col[0], col[2], len(col) > 3 and col[3]) for col in columns]
        marked = marked or "noisy*" in cells
        table.add_row(s["method"], *cells)
    con = Console(width=max(140, Console().width))
    con.print(table)
    if marked:
        con.print("[dim]noisy*: its min-max over the repetitions is wider than the figure itself, so it is not "
                  "shown (run more --repeat, or on a quieter machine)[/]")


BASE_COLUMNS = [
    ("tokens_per_forward", "tok/fwd", ".2f"),
    ("tokens_per_second", "tok/s", ".1f"),
    ("ttft", "TTFT s", ".3f"),
]


QUALITY_COLUMNS = [("gen_ppl", "gen PPL", ".2f"), ("entropy", "entropy", ".2f")]


def pyplot():
    """matplotlib's pyplot on the file-only backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(plt, fig, path: Path) -> None:
    """Lay a figure out, write it under a temporary name, then rename it into place."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def plot_pareto(summaries: list[dict[str, Any]], key: str, label: str, path: Path) -> str | None:
    """Quality (`key`) against tokens per forward and against wall time per case: one line per sampler, the AR
    rows as stars, the Pareto front of all rows dashed. None, or why there is no plot."""
    plt = pyplot()
    if plt is None:
        return "matplotlib is not installed: no plot"
    rows = [s for s in summaries if s.get(key) is not None and s[key] == s[key]]
    if not rows:
        return f"no row has {key}: no plot"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    groups: dict[str, list[dict[str, Any]]] = {}
    for s in rows:
        st = s["settings"]
        name = " ".join(str(x) for x in (s["paradigm"], st.get("sampler"), st.get("block_size") and
                                         f"(block {st['block_size']})") if x)
        groups.setdefault(name, []).append(s)
    for ax, x, xlabel in ((axes[0], "tokens_per_forward", "tokens per forward (median over cases)"),
                          (axes[1], "seconds", "seconds per case (median; lower is faster)")):
        for name, g in groups.items():
            g = sorted(g, key=lambda r: r[x])
            star = g[0]["paradigm"] in ("ar", "spec")
            ax.plot([r[x] for r in g], [r[key] for r in g], marker="*" if star else "o", markersize=11 if star else 5,
                    linestyle="none" if star else "-", label=name)
        front = front_of(rows, x, key)
        if len(front) > 1:
            ax.plot([f[0] for f in front], [f[1] for f in front], "k--", alpha=0.4, label="Pareto front")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(label)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{label} against parallelism and wall time (upper right / upper left is better)", fontsize=10)
    save_figure(plt, fig, path)
    return None


SPEC_COLUMNS = [("temperature", "T", "g"), ("tau", "tau", ".2f"), ("speedup", "speedup", ".2f"),
                ("lossless", "lossless", ".2f"), ("draft_share", "draft time", ".0%")]


def plot_blocks(summaries: list[dict[str, Any]], path: Path) -> str | None:
    """Tokens per forward and tau of each self-speculation mode against its block size."""
    plt = pyplot()
    if plt is None:
        return "matplotlib is not installed: no plot"
    modes: dict[str, list[dict[str, Any]]] = {}
    for s in summaries:
        if s["settings"].get("sampler", "").startswith("self-spec"):
            modes.setdefault(s["settings"]["sampler"], []).append(s)
    if not modes:
        return "no self-speculation rows: no plot"
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, label in ((axes[0], "tokens_per_forward", "tokens per forward"), (axes[1], "tau", "tau"),
                           (axes[2], "speedup", "speedup vs its AR mode (this CPU)")):
        for mode, rows in modes.items():
            rows = sorted(rows, key=lambda r: r["settings"]["block_size"])
            ax.plot([r["settings"]["block_size"] for r in rows], [r.get(key) for r in rows], marker="o", label=mode)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("joint self-speculation against block size (greedy, held-out completion cases)", fontsize=10)
    save_figure(plt, fig, path)
    return None


def print_report(report: dict[str, Any], spec_rows: list[dict[str, Any]]) -> None:
    n, new, R = report["cases"], report["max_new_tokens"], report["repeat"]
    if report.get("task"):
        task = report["task"]
        from dlm.tasks import task_module

        cols = [(m, m.replace("_", " "), ".3f") for m in task_module(task).METRICS]
        title = (f"dlm bench --task {task}: {n} cases, {R} interleaved repetitions; medians over cases; vs AR = "
                 "per-case tok/s ratio to ar (KV cache) in the same round, median (min-max over repetitions)")
        print_table(report["summaries"], cols + BASE_COLUMNS + [("seconds", "s/case", ".3f"),
                                                              ("speedup_vs_ar", "vs AR", ".2f", True)], title)
    else:
        title = (f"{n} held-out completion cases (+ {report['infill_cases']} infill cases), {new} new tokens, "
                 f"{R} interleaved repetitions; medians; vs AR = per-case tok/s ratio to ar (KV cache) in the same "
                 "round, median (min-max over repetitions)")
        cols = [("complete_edit_similarity", "compl. ES", ".3f"), ("complete_exact_match", "compl. EM", ".2f"),
                ("infill_exact_match", "infill EM", ".2f")] + BASE_COLUMNS + [
            ("speedup_vs_ar", "vs AR", ".2f", True), ("gen_ppl", "gen PPL", ".2f")]
        print_table(report["summaries"], cols, title)
    for q in report.get("equal_quality", []):
        if q["ratio"] is not None:
            print(f"{q['method']}: {q['forwards']:.0f} forwards; confidence top-k needs "
                  f"{q['confidence_forwards']:.1f} at the same gen PPL {q['gen_ppl']:.2f} (x{q['ratio']:.2f})")
    if spec_rows:
        print_table(spec_rows, [("temperature", "T", "g"), ("tokens_per_second", "tok/s", ".1f")] + [
            ("tokens_per_forward", "tok/fwd", ".2f"), ("tau", "tau", ".2f"), ("speedup", "speedup", ".2f", True),
            ("lossless", "lossless", ".2f"),
            ("draft_share", "draft time", ".0%"), ("draft_forwards", "draft fwd", ".0f")],
                    title="speculative decoding: speedup = target alone / method, per case in the same round "
                          "(median; min-max over repetitions); tau pooled over cycles"
                          + ("; the target alone on the compiled one-token step (--compile)"
                             if report.get("ar_step") == "compiled" else ""))
    if R > 1:  # (one repetition has no spread to report)
        print(f"noise: tok/s min-max over {R} repetitions, relative to the median: {report['noise']['median']:.0%} "
              f"for the median row, {report['noise']['max']:.0%} at most")
