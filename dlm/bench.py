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
`--task NAME` sweeps the diffusion samplers over that task's cases instead (quality against tokens per
forward and against wall time: the Pareto plot).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import torch

from dlm.checkpoint import load_model
from dlm.files import check_out_file
from dlm.errors import DlmError
from dlm.sampling import SampleConfig, options_read, stream
from dlm.sampling.common import Result, drain
from dlm.tasks.common import Case


@dataclass
class Method:
    name: str  # row label, e.g. "ar (KV cache)"
    paradigm: str  # ar | mdlm | usdm | spec | ...
    model: Any
    ck: Any
    cfg: SampleConfig
    settings: dict[str, Any] = field(default_factory=dict)  # what a reader needs to reproduce the row
    drafter: Any = None  # speculation: the drafter, loaded once

    def __post_init__(self) -> None:
        """A row sets only options its sampler reads (dlm.sampling.OPTIONS): a setting that would be ignored is a
        bug in the row, not a measurement."""
        if not isinstance(self.cfg, SampleConfig) or not hasattr(self.ck, "objective"):
            return  # a stand-in row (the harness's tests)
        paradigm = "speculative" if self.drafter is not None or self.cfg.draft else self.ck.objective
        kind = getattr(self.drafter, "kind", None)
        defaults = SampleConfig()
        ignored = [f.name for f in dataclasses.fields(self.cfg) if getattr(self.cfg, f.name) != getattr(defaults, f.name)
                   and f.name not in options_read(paradigm, kind)]
        if ignored:
            raise ValueError(f"bench row {self.name!r}: {paradigm} does not read {', '.join(ignored)}")

    def run(self, ids: list[int]) -> Result:
        tok = self.ck.tokenizer
        return drain(stream(self.model, self.ck, [ids], self.cfg, self.drafter), tok.decode, tok.eos_id)


@dataclass
class Item:
    """One bench prompt: a case of a task."""

    task: ModuleType
    case: Case


def run_item(method: Method, item: Item, context: int) -> dict[str, Any]:
    """One case through one method (the task builds the request for the method's paradigm)."""
    from dlm.tasks import run_case

    return run_case(item.task, item.case, method.model, method.ck, method.cfg, method.drafter, context)


def schedule(n_methods: int, n_items: int, repeat: int) -> list[tuple[int, int, int]]:
    """The order of the timed runs as (repetition, item, method): round-robin over the methods for each item,
    the methods' order rotated by one each repetition."""
    out = []
    for r in range(repeat):
        order = [(r + j) % n_methods for j in range(n_methods)]
        for i in range(n_items):
            out += [(r, i, m) for m in order]
    return out


def run_interleaved(methods: list[Method], items: list[Item], repeat: int, warmup: int,
                    run: Callable[[Method, Item], dict[str, Any]],
                    progress: Callable[[], None] | None = None) -> list[list[list[dict[str, Any]]]]:
    """rows[method][repetition][item], after `warmup` untimed runs of each method on its own (first item)."""
    for m in methods:
        for _ in range(warmup):
            run(m, items[0])
    rows: list[list[list[Any]]] = [[[None] * len(items) for _ in range(repeat)] for _ in methods]
    for r, i, k in schedule(len(methods), len(items), repeat):
        rows[k][r][i] = run(methods[k], items[i])
        if progress:
            progress()
    return rows


def median(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None and x == x]
    return statistics.median(xs) if xs else float("nan")


def over_reps(per_rep: list[float]) -> tuple[float, float, float]:
    """(median, min, max) over repetitions."""
    xs = [x for x in per_rep if x is not None and x == x]
    return (statistics.median(xs), min(xs), max(xs)) if xs else (float("nan"),) * 3


SPEED_KEYS = ("tokens_per_second", "tokens_per_forward", "ttft", "new_tokens", "forwards", "seconds")


def summarize(method: Method, reps: list[list[dict[str, Any]]], base: list[list[dict[str, Any]]] | None = None,
              metrics: tuple[str, ...] = (), prefix: str = "") -> dict[str, Any]:
    """Medians over cases, then the median and min-max over repetitions; the task metrics (means over the cases of
    the first repetition: greedy and seeded runs repeat themselves); per-case ratios against `base` (the AR
    baseline's rows of the same rounds): tok/s ratio (`speedup_vs_ar`) and wall-time ratio (`speedup`)."""
    out: dict[str, Any] = {"method": method.name, "paradigm": method.paradigm, "prompts": len(reps[0]),
                           "repeat": len(reps), "settings": method.settings}
    for k in SPEED_KEYS:
        out[k], lo, hi = over_reps([median([r.get(k) for r in rep]) for rep in reps])
        out[f"{k}_range"] = [lo, hi]
    for k in ("canvases", "forwards_per_canvas"):  # diffusion samplers
        if all(r.get(k) for r in reps[0]):
            out[k] = median([r[k] for r in reps[0]])
    if all(r.get("canvases") for r in reps[0]):
        out["forwards_per_canvas"] = median([r["forwards"] / r["canvases"] for r in reps[0]])
    for m in metrics:
        out[prefix + m] = sum(r[m] for r in reps[0]) / len(reps[0])
    if base is not None:
        tps = [median([r["tokens_per_second"] / b["tokens_per_second"] for r, b in zip(rep, brep)
                       if b["tokens_per_second"] > 0]) for rep, brep in zip(reps, base)]
        out["speedup_vs_ar"], lo, hi = over_reps(tps)
        out["speedup_vs_ar_range"] = [lo, hi]
        wall = [median([b["seconds"] / r["seconds"] for r, b in zip(rep, brep) if r["seconds"] > 0])
                for rep, brep in zip(reps, base)]
        out["speedup"], lo, hi = over_reps(wall)
        out["speedup_range"] = [lo, hi]
    return out


def environment() -> dict[str, Any]:
    return {
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def write_json(path: str | os.PathLike, report: dict[str, Any]) -> None:
    from dlm.files import write_json as atomic_write

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(p, report)


def noisy(v: float, lo: float, hi: float) -> bool:
    """A figure whose min-max spread over repetitions is wider than the figure itself: noise, not a measurement."""
    return hi - lo > abs(v)


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


def check_positive(name: str, v: int) -> None:
    if v <= 0:
        raise DlmError(f"--{name} must be > 0, got {v}")


# AR rows -----------------------------------------------------------------------------------------

def ar_methods(model, ck, max_new_tokens: int, naive: bool = True) -> list[Method]:
    cfg = SampleConfig(max_new_tokens=max_new_tokens)
    settings = {"model": str(ck.path), "greedy": True}
    methods = [Method("ar (KV cache)", "ar", model, ck, cfg, settings)]
    if naive:
        methods.append(Method("ar (naive, no cache)", "ar", model, ck, cfg.replace(naive=True), settings))
    return methods


def load_paired(path: str, objective: str, ref_ck):
    """A diffusion checkpoint for the bench: of the given objective, with the reference model's tokenizer
    (the quality column scores its text under that model)."""
    net, ck = load_model(path, option=f"--{objective}")
    if ck.objective != objective:
        raise DlmError(f"--{objective} {path}: objective {ck.objective!r}, expected a {objective} checkpoint")
    if ck.tokenizer.sha256 != ref_ck.tokenizer.sha256:
        raise DlmError(f"--{objective} {path}: its tokenizer differs from the reference model's {ref_ck.path} "
                       "(the quality column needs one)")
    return net, ck


# usdm rows --------------------------------------------------------------------------------------

def usdm_settings(sweep: bool) -> list[tuple[str, dict[str, Any]]]:
    """(row name, SampleConfig fields) of the usdm rows: its defaults (48 steps at most, adaptive stopping) and a
    parallel setting (8 steps per canvas at most); the sweep adds fixed steps and entropy bounds."""
    rows = [("usdm (adaptive)", {}), ("usdm (adaptive, 8 steps)", dict(steps=8))]
    if sweep:
        rows += [("usdm (fixed 48 steps)", dict(adaptive=False))]
        rows += [(f"usdm steps={n}", dict(steps=n)) for n in (24, 16, 4)]
        rows += [(f"usdm bound={b}", dict(entropy_bound=b)) for b in (0.5, 2.0)]
    return rows


def usdm_methods(path: str, ref_ck, max_new_tokens: int, sweep: bool = False) -> list[Method]:
    """Rows for a usdm checkpoint (`usdm_settings`), with the reference AR model's tokenizer."""
    from dlm.sampling.usdm import check_options

    net, ck = load_paired(path, "usdm", ref_ck)

    def method(name: str, cfg: SampleConfig) -> Method:
        L, steps = check_options(net, ck, cfg)
        settings = {"model": str(ck.path), "sampler": "entropy_bound", "canvas_length": L, "steps": steps,
                    "adaptive": cfg.adaptive, "entropy_bound": cfg.entropy_bound, "seed": cfg.seed}
        return Method(name, "usdm", net, ck, cfg, settings)

    cfg = SampleConfig(max_new_tokens=max_new_tokens)
    return [method(name, cfg.replace(**opts)) for name, opts in usdm_settings(sweep)]


@torch.inference_mode()
def gen_perplexity(ref, prompt: list[int], new: list[int], eos_id: int | None = None) -> float:
    """Perplexity of generated tokens under the reference AR model, conditioned on the prompt.

    The quality column every paradigm shares (all share the reference tokenizer). Tokens after
    the first <eos> are not scored.
    """
    import math

    import torch.nn.functional as F

    if eos_id is not None and eos_id in new:
        new = new[:new.index(eos_id) + 1]
    if not new:
        return float("nan")
    seq = torch.tensor([prompt + new], device=ref.device)[:, -ref.cfg.max_seq_len:]
    logits = ref(seq[:, :-1]).logits[0, -len(new):]
    nll = F.cross_entropy(logits.float(), seq[0, -len(new):], reduction="mean")
    return math.exp(float(nll))


def unigram_entropy(tokens: list[int]) -> float:
    """Entropy (nats) of the token histogram: low values flag repetitive output."""
    import math
    from collections import Counter

    if not tokens:
        return float("nan")
    n = len(tokens)
    return max(0.0, -sum(c / n * math.log(c / n) for c in Counter(tokens).values()))


QUALITY_COLUMNS = [("gen_ppl", "gen PPL", ".2f"), ("entropy", "entropy", ".2f")]


# mdlm rows ---------------------------------------------------------------------------------------

def mdlm_settings(block: int, sweep: bool) -> list[dict[str, Any]]:
    """The sampler settings of the mdlm rows (SampleConfig fields); `block` is the sampling block size.

    Without sweep: LLaDA confidence at one token per step (the quality reference), and a parallel setting: the
    entropy bound 1.0 with a budget of block/4 steps (so at least 4 tokens per forward in a block of 32).
    With sweep: confidence at block/1, /2, /3, /4, /6, /8 steps; entropy bounds 0.01 .. 12; thresholds 0.999 .. 0.1
    (the near-certain end decides sudoku, where two cells committed together can clash); the entropy-bound sampler
    at half and twice the block length; confidence at two tokens per step in blocks of 4 and 8.
    """
    rows: list[dict[str, Any]] = [dict(sampler="confidence"),
                                  dict(sampler="entropy_bound", entropy_bound=1.0, steps=max(1, block // 4))]
    if sweep:  # small models are unsure (entropies of several nats): the useful bounds reach far above 0.1
        steps = sorted({max(1, round(block / d)) for d in (1, 2, 3, 4, 6, 8)}, reverse=True)
        rows = [dict(sampler="confidence", steps=s) for s in steps]
        rows += [dict(sampler="entropy_bound", entropy_bound=b) for b in (0.01, 0.1, 1.0, 3.0, 5.0, 8.0, 12.0)]
        rows += [dict(sampler="threshold", threshold=t) for t in (0.999, 0.99, 0.9, 0.5, 0.3, 0.1)]
        rows += [dict(sampler="entropy_bound", entropy_bound=5.0, block_size=b)
                 for b in (max(1, block // 2), 2 * block)]
        # two tokens per step in short blocks: near left-to-right order, which a small model's line completions
        # need (docs/mdlm.md: 0.90-0.93x its one-token edit similarity at 2 tokens per forward)
        rows += [dict(sampler="confidence", block_size=b, steps=b // 2) for b in (4, 8) if b < block]
    return rows


def equal_quality(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each adaptive mdlm row, the forwards confidence top-k needs for the same generated-text PPL.

    The confidence rows (same block length) give forwards as a piecewise-linear function of gen PPL;
    a row whose PPL falls outside their range gets no comparison. ratio < 1: fewer forwards at equal quality.
    """
    out = []
    for s in summaries:
        st = s["settings"]
        if s["paradigm"] != "mdlm" or st.get("sampler") == "confidence":
            continue
        conf = sorted(((c["gen_ppl"], c["forwards"]) for c in summaries if c["paradigm"] == "mdlm"
                       and c["settings"].get("sampler") == "confidence"
                       and c["settings"].get("block_size") == st.get("block_size")),
                      key=lambda r: r[1], reverse=True)
        target, match = s["gen_ppl"], None
        for (p0, f0), (p1, f1) in zip(conf, conf[1:]):  # by falling forwards
            if min(p0, p1) <= target <= max(p0, p1):
                match = f0 if p1 == p0 else f0 + (f1 - f0) * (target - p0) / (p1 - p0)
                break
        out.append({"method": s["method"], "forwards": s["forwards"], "gen_ppl": target,
                    "confidence_forwards": match, "ratio": s["forwards"] / match if match else None})
    return out


def mdlm_methods(path: str, ref_ck, max_new_tokens: int, sweep: bool = False) -> list[Method]:
    """Rows for an mdlm checkpoint, greedy, with the reference AR model's tokenizer."""
    net, ck = load_paired(path, "mdlm", ref_ck)
    block = ck.block_size or max_new_tokens
    methods = []
    for opts in mdlm_settings(block, sweep):
        cfg = SampleConfig(max_new_tokens=max_new_tokens, **opts)
        short = {"steps": "steps", "entropy_bound": "bound", "threshold": "thr", "block_size": "block"}  # (names)
        name = " ".join([f"mdlm {opts['sampler']}"] + [f"{short[k]}={v}" for k, v in opts.items() if k != "sampler"])
        settings = {"model": str(ck.path), "greedy": True, "block_size": cfg.block_size or ck.block_size or "whole",
                    **opts}
        methods.append(Method(name, "mdlm", net, ck, cfg, settings))
    return methods


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points (x, quality) no other point beats on both (higher x and higher quality are better), by x."""
    front = [p for p in points if not any(q[0] >= p[0] and q[1] >= p[1] and q != p for q in points)]
    return sorted(set(front))


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
    rows as stars, the Pareto front of the diffusion rows dashed. None, or why there is no plot."""
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
        diff = [r for r in rows if r["paradigm"] not in ("ar", "spec")]
        sign = 1 if x == "tokens_per_forward" else -1  # the front: more tokens per forward, or less time
        front = pareto([(sign * r[x], r[key]) for r in diff])
        if len(front) > 1:
            ax.plot([sign * f[0] for f in front], [f[1] for f in front], "k--", alpha=0.4, label="Pareto front")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(label)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{label} against parallelism and wall time (upper right / upper left is better)", fontsize=10)
    save_figure(plt, fig, path)
    return None


# speculative rows ----------------------------------------------------------------------------------

SPEC_COLUMNS = [("temperature", "T", "g"), ("tau", "tau", ".2f"), ("speedup", "speedup", ".2f"),
                ("lossless", "lossless", ".2f"), ("draft_share", "draft time", ".0%")]


def target_method(model, ck, max_new_tokens: int, temperature: float, seed: int = 0) -> Method:
    """The target alone (AR with its KV cache) at a temperature: what speculation is measured against."""
    cfg = SampleConfig(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    return Method(f"target alone T={temperature:g}", "ar", model, ck, cfg,
                  {"model": str(ck.path), "temperature": temperature, "spec_base": True})


def joint_methods(path: str, ref_ck, max_new_tokens: int, blocks: tuple[int, ...]) -> tuple[Method, list[Method]]:
    """A joint checkpoint's AR mode (the baseline its self-speculation must reproduce) and one row per
    self-speculation mode and block size, greedy."""
    from dlm.sampling.joint import SELF_SPEC

    net, ck = load_paired(path, "joint", ref_ck)
    cfg = SampleConfig(max_new_tokens=max_new_tokens)
    base = Method("joint ar mode", "ar", net, ck, cfg.replace(sampler="ar"),
                  {"model": str(ck.path), "sampler": "ar", "greedy": True, "spec_base": True})
    rows = [Method(f"joint {mode} B={b}", "spec", net, ck, cfg.replace(sampler=mode, block_size=b),
                   {"model": str(ck.path), "sampler": mode, "gamma": b, "block_size": b, "temperature": 0.0})
            for mode in SELF_SPEC for b in blocks]
    return base, rows


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


def spec_methods(model, ck, drafts: list[str], max_new_tokens: int, temperature: float,
                 block_size: int | None = None, seed: int = 0) -> list[Method]:
    """One row per drafter ('lookup' or a drafter checkpoint), in the lossless speculative loop."""
    from dlm.drafters import load_drafter
    from dlm.sampling.speculative import Sampling, resolve_block_size

    methods, seen = [], set()
    for spec in drafts:
        drafter = load_drafter(spec, model, ck, Sampling(temperature))
        g = resolve_block_size(drafter, block_size)
        cfg = SampleConfig(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, block_size=g)
        name = drafter.name if drafter.name not in seen else f"{drafter.name} [{spec}]"  # two folders, one name
        seen.add(drafter.name)
        methods.append(Method(f"{name} T={temperature:g}", "spec", model, ck, cfg,
                              {"draft": spec, "gamma": g, "temperature": temperature}, drafter=drafter))
    return methods


def summarize_spec(reps: list[list[dict[str, Any]]], base_reps: list[list[dict[str, Any]]],
                   temperature: float) -> dict[str, Any]:
    """tau pooled over all cycles, the summed histogram (first repetition), the per-case wall-time speedup over the
    target alone in the same round (median over cases, then median and min-max over repetitions)."""
    rows, base_rows = reps[0], base_reps[0]
    cycles = sum(r["cycles"] for rep in reps for r in rep)
    hist = [sum(h) for h in zip(*(r["acceptance_histogram"] for r in rows))]
    wall = [median([b["seconds"] / r["seconds"] for r, b in zip(rep, brep) if r["seconds"] > 0])
            for rep, brep in zip(reps, base_reps)]
    speedup, lo, hi = over_reps(wall)
    out: dict[str, Any] = {
        "temperature": temperature,
        "tau": sum(r["tau"] * r["cycles"] for rep in reps for r in rep) / cycles if cycles else float("nan"),
        "acceptance_histogram": hist,
        "speedup": speedup, "speedup_range": [lo, hi],
        "draft_forwards": median([r["draft_forwards"] for r in rows]),
        "draft_share": sum(r["draft_seconds"] for rep in reps for r in rep) / max(
            1e-9, sum(r["draft_seconds"] + r["verify_seconds"] for rep in reps for r in rep)),
        "lossless": None,
    }
    if temperature == 0:  # token-for-token equality only means something for greedy decoding
        out["lossless"] = sum(r["tokens"] == b["tokens"] for r, b in zip(rows, base_rows)) / len(rows)
    return out


def build_methods(net, ck, max_new_tokens: int, naive: bool, mdlm: str | None, usdm: str | None, sweep: bool,
                  draft: list[str] | None, temperatures: tuple[float, ...], block_size: int | None,
                  joint: str | None = None, joint_blocks: tuple[int, ...] = (16,)):
    """Every row of a bench run; the speculative groups as (temperature, baseline, drafter rows)."""
    methods = ar_methods(net, ck, max_new_tokens, naive=naive)
    if mdlm:
        methods += mdlm_methods(mdlm, ck, max_new_tokens, sweep)
    if usdm:
        methods += usdm_methods(usdm, ck, max_new_tokens, sweep)
    spec_groups: list[tuple[float, Method, list[Method]]] = []
    for t in (temperatures if draft else ()):
        base = methods[0] if t == 0 else target_method(net, ck, max_new_tokens, t)
        group = spec_methods(net, ck, list(draft), max_new_tokens, t, block_size)
        spec_groups.append((t, base, group))
        methods += ([] if t == 0 else [base]) + group
    if joint:  # self-speculation: measured against the joint model's own AR mode
        base, group = joint_methods(joint, ck, max_new_tokens, joint_blocks)
        spec_groups.append((0.0, base, group))
        methods += [base] + group
    return methods, spec_groups


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
                          "(median; min-max over repetitions); tau pooled over cycles")
    print(f"noise: tok/s min-max over {R} repetitions, relative to the median: {report['noise']['median']:.0%} "
          f"for the median row, {report['noise']['max']:.0%} at most")


def noise(summaries: list[dict[str, Any]]) -> dict[str, float]:
    """How noisy the timings were: (max - min) / median of tok/s over repetitions, across the rows."""
    spread = [(s["tokens_per_second_range"][1] - s["tokens_per_second_range"][0]) / s["tokens_per_second"]
              for s in summaries if s.get("tokens_per_second")]
    return {"median": median(spread), "max": max(spread) if spread else float("nan")}


INFILL_NEW_TOKENS = 64  # the infill column's cap: one removed line needs ~10 tokens, and a window must hold both sides


def infill_method(m: Method) -> Method:
    """The method as the infill column runs it: at most INFILL_NEW_TOKENS new tokens (a long completion run,
    e.g. 256 tokens, would leave no room in the window for the hole's prefix and suffix)."""
    if m.cfg.max_new_tokens <= INFILL_NEW_TOKENS:
        return m
    return replace(m, cfg=m.cfg.replace(max_new_tokens=INFILL_NEW_TOKENS))


def bench_items(task: str | None, data: str | None, n: int, span: str) -> tuple[list[Item], list[Item]]:
    """The timed items (completion cases, or --task's) and the infill cases run alongside (none with --task)."""
    from dlm.tasks import complete, infill, task_module

    if task:
        mod = task_module(task)
        return [Item(mod, c) for c in mod.cases(data, n, 0, span)], []
    return ([Item(complete, c) for c in complete.cases(data, n, 0)],
            [Item(infill, c) for c in infill.cases(data, n, 0, "line")])


def run_bench(model: str, prompts: int = 8, max_new_tokens: int = 64, out: str | None = None, data: str | None = None,
              warmup: int = 1, naive: bool = True, quiet: bool = False, mdlm: str | None = None,
              usdm: str | None = None, sweep: bool = False, draft: list[str] | None = None,
              temperatures: tuple[float, ...] = (0.0, 1.0), block_size: int | None = None, repeat: int = 3,
              task: str | None = None, span: str = "line", joint: str | None = None,
              joint_blocks: tuple[int, ...] = (16,)) -> dict[str, Any]:
    """Run every method on the same held-out cases, interleaved and repeated; print the tables, write the JSON
    report (and the PNG of quality against tokens per forward and wall time beside it).

    Without `task`: line-completion cases timed (`prompts` of them, `repeat` rounds), infill cases alongside (once)
    for the infill column. With `task` (complete, infill, sudoku): that task's cases, the diffusion samplers swept.
    With `draft` (drafter checkpoints and/or 'lookup'), each drafter runs in the speculative loop at every
    temperature beside the target alone at that temperature (speedup, tau, lossless fraction).
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
    net, ck = load_model(model)
    if ck.objective != "ar":  # its rows would be labelled "ar (KV cache)" and it would judge the quality column
        hint = f" (pass it as --{ck.objective})" if ck.objective in ("mdlm", "usdm", "joint") else ""
        raise DlmError(f"--model {model}: objective {ck.objective!r}; bench's --model is the ar baseline, speculation "
                       f"target and quality judge, an ar checkpoint{hint}")
    items, infill_items = bench_items(task, data, prompts, span)
    methods, spec_groups = build_methods(net, ck, max_new_tokens, naive, mdlm, usdm, sweep, draft, temperatures,
                                         block_size, joint, joint_blocks)
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
            s["gen_ppl"] = median([gen_perplexity(net, r["prompt"], r["tokens"], ck.tokenizer.eos_id) for r in first])
            s["entropy"] = median([unigram_entropy(r["tokens"]) for r in first])
        summaries.append(s)
    by_name = {s["method"]: s for s in summaries}
    index = {m.name: k for k, m in enumerate(methods)}
    for t, base_m, group in spec_groups:
        by_name[base_m.name].update(temperature=t, speedup=1.0, speedup_range=[1.0, 1.0])
        for m in group:
            by_name[m.name].update(summarize_spec(rows[index[m.name]], rows[index[base_m.name]], t))
    per_case = {m.name: [{**{k: v for k, v in r.items() if k not in ("tokens", "prompt")},
                          "seconds_per_repetition": [rows[k][rr][i]["seconds"] for rr in range(repeat)]}
                         for i, r in enumerate(rows[k][0])] for k, m in enumerate(methods)}
    report = {"environment": environment(), "model": str(ck.path), "max_new_tokens": max_new_tokens,
              "task": task, "span": span if task == "infill" else None, "cases": len(items), "repeat": repeat,
              "warmup": warmup, "context": context,
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
