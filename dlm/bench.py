"""The side-by-side harness: every paradigm on the same held-out prompts, measured the same way.

A `Method` is a model, its checkpoint and one SampleConfig (and a drafter for speculation): it runs
one prompt through the sampler contract (dlm.sampling.stream) into a `Result`. `measure` warms each
method up, runs it on every prompt and keeps the per-prompt statistics; `summarize` reports medians.
Each paradigm contributes methods (`ar_methods`, `mdlm_methods`, `usdm_methods`, `spec_methods`).
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dlm.checkpoint import check_out_file, load_model
from dlm.errors import DlmError
from dlm.sampling import SampleConfig, stream
from dlm.sampling.common import Result, drain


@dataclass
class Method:
    name: str  # row label, e.g. "ar (KV cache)"
    paradigm: str  # ar | mdlm | usdm | spec | ...
    model: Any
    ck: Any
    cfg: SampleConfig
    settings: dict[str, Any] = field(default_factory=dict)  # what a reader needs to reproduce the row
    drafter: Any = None  # speculation: the drafter, loaded once

    def run(self, ids: list[int]) -> Result:
        tok = self.ck.tokenizer
        return drain(stream(self.model, self.ck, [ids], self.cfg, self.drafter), tok.decode, tok.eos_id)


def measure(method: Method, prompts: list[list[int]], warmup: int = 1) -> list[dict[str, Any]]:
    """Per-prompt statistics, after `warmup` untimed runs on the first prompt."""
    for _ in range(warmup):
        method.run(prompts[0])
    rows = []
    for ids in prompts:
        res = method.run(ids)
        rows.append({**res.stats.as_dict(), "tokens": res.tokens[0], "text": res.texts[0]})
    return rows


def median(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def summarize(method: Method, rows: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("tokens_per_second", "tokens_per_forward", "ttft", "new_tokens", "forwards", "seconds")
    out: dict[str, Any] = {"method": method.name, "paradigm": method.paradigm, "prompts": len(rows),
                           **{k: median([r[k] for r in rows]) for k in keys}, "settings": method.settings}
    for k in ("canvases", "forwards_per_canvas"):  # diffusion samplers
        if all(r.get(k) for r in rows):
            out[k] = median([r[k] for r in rows])
    return out


def environment() -> dict[str, Any]:
    return {
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def write_json(path: str | os.PathLike, report: dict[str, Any]) -> None:
    from dlm.checkpoint import write_json as atomic_write

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(p, report)


def print_table(summaries: list[dict[str, Any]], columns: list[tuple[str, str, str]], title: str = "") -> None:
    """columns: (key, header, format spec)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title or None)
    table.add_column("method", style="bold")
    for _, header, _ in columns:
        table.add_column(header, justify="right")
    for s in summaries:
        cells = []
        for key, _, fmt in columns:
            v = s.get(key)
            cells.append("–" if v is None or (isinstance(v, float) and v != v) else format(v, fmt))
        table.add_row(s["method"], *cells)
    Console(width=max(120, Console().width)).print(table)


BASE_COLUMNS = [
    ("tokens_per_second", "tok/s", ".1f"),
    ("tokens_per_forward", "tok/fwd", ".2f"),
    ("ttft", "TTFT s", ".3f"),
    ("new_tokens", "new tok", ".0f"),
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

def usdm_methods(path: str, ref_ck, max_new_tokens: int) -> list[Method]:
    """usdm at its default settings (adaptive stopping) and with a fixed 48 steps per canvas."""
    from dlm.sampling.usdm import check_options

    net, ck = load_paired(path, "usdm", ref_ck)

    def method(name: str, cfg: SampleConfig) -> Method:
        L, steps = check_options(net, ck, cfg)
        settings = {"model": str(ck.path), "canvas_length": L, "steps": steps, "adaptive": cfg.adaptive,
                    "entropy_bound": cfg.entropy_bound, "seed": cfg.seed}
        return Method(name, "usdm", net, ck, cfg, settings)

    cfg = SampleConfig(max_new_tokens=max_new_tokens)
    return [method("usdm (adaptive)", cfg), method("usdm (fixed 48 steps)", cfg.replace(adaptive=False))]


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

    Without sweep: LLaDA confidence at one token per step, Fast-dLLM threshold 0.9, entropy bound 0.1.
    With sweep: confidence at block/1, /2, /4, /8 steps; entropy bounds 0.03 .. 3; thresholds 0.9 .. 0.5;
    the entropy-bound sampler at half and twice the block length.
    """
    rows: list[dict[str, Any]] = [dict(sampler="confidence"), dict(sampler="threshold", threshold=0.9),
                                  dict(sampler="entropy_bound", entropy_bound=0.1)]
    if sweep:  # small models are unsure (entropies of several nats): the useful bounds reach far above 0.1
        steps = sorted({max(1, round(block / d)) for d in (1, 2, 3, 4, 6, 8)}, reverse=True)
        rows = [dict(sampler="confidence", steps=s) for s in steps]
        rows += [dict(sampler="entropy_bound", entropy_bound=b) for b in (0.1, 1.0, 3.0, 5.0, 8.0, 12.0)]
        rows += [dict(sampler="threshold", threshold=t) for t in (0.9, 0.5, 0.3, 0.1)]
        rows += [dict(sampler="entropy_bound", entropy_bound=5.0, block_size=b)
                 for b in (max(1, block // 2), 2 * block)]
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
        short = {"steps": "steps", "entropy_bound": "bound", "threshold": "thr", "block_size": "block"}
        name = " ".join([f"mdlm {opts['sampler']}"] + [f"{short[k]}={v}" for k, v in opts.items() if k != "sampler"])
        settings = {"model": str(ck.path), "greedy": True, "block_size": cfg.block_size or ck.block_size or "whole",
                    **opts}
        methods.append(Method(name, "mdlm", net, ck, cfg, settings))
    return methods


def plot_quality(summaries: list[dict[str, Any]], path: Path) -> str | None:
    """Generated-text perplexity against tokens per forward, one line per sampler; None, or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    groups: dict[str, list[dict[str, Any]]] = {}
    for s in summaries:
        st = s["settings"]
        key = " ".join(str(x) for x in (s["paradigm"], st.get("sampler"), st.get("block_size") and
                                        f"(block {st['block_size']})") if x)
        groups.setdefault(key, []).append(s)
    for key, rows in groups.items():
        rows = sorted(rows, key=lambda r: r["tokens_per_forward"])
        ax.plot([r["tokens_per_forward"] for r in rows], [r["gen_ppl"] for r in rows], marker="o", label=key)
    ax.set_xlabel("tokens per forward (median over prompts)")
    ax.set_ylabel("gen PPL under the AR reference (median)")
    ax.set_title("quality vs tokens per forward (lower right is better)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    os.replace(tmp, path)
    return None


# speculative rows ----------------------------------------------------------------------------------

SPEC_COLUMNS = [("temperature", "T", "g"), ("tau", "tau", ".2f"), ("speedup", "speedup", ".2f"),
                ("lossless", "lossless", ".2f"), ("draft_share", "draft time", ".0%")]


def target_method(model, ck, max_new_tokens: int, temperature: float, seed: int = 0) -> Method:
    """The target alone (AR with its KV cache) at a temperature: what speculation is measured against."""
    cfg = SampleConfig(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    return Method(f"target alone T={temperature:g}", "ar", model, ck, cfg,
                  {"model": str(ck.path), "temperature": temperature, "spec_base": True})


def spec_methods(model, ck, drafts: list[str], max_new_tokens: int, temperature: float,
                 block_size: int | None = None, seed: int = 0) -> list[Method]:
    """One row per drafter ('lookup' or a drafter checkpoint), in the lossless speculative loop."""
    from dlm.sampling.speculative import Sampling, load_drafter, resolve_gamma

    methods, seen = [], set()
    for spec in drafts:
        drafter = load_drafter(spec, model, ck, Sampling(temperature))
        g = resolve_gamma(drafter, block_size)
        cfg = SampleConfig(max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, block_size=g)
        name = drafter.name if drafter.name not in seen else f"{drafter.name} [{spec}]"  # two folders, one name
        seen.add(drafter.name)
        methods.append(Method(f"{name} T={temperature:g}", "spec", model, ck, cfg,
                              {"draft": spec, "gamma": g, "temperature": temperature}, drafter=drafter))
    return methods


def summarize_spec(rows: list[dict[str, Any]], base_rows: list[dict[str, Any]], temperature: float) -> dict[str, Any]:
    """tau pooled over all cycles, the summed histogram, per-prompt speedup over the target alone (median)."""
    cycles = sum(r["cycles"] for r in rows)
    hist = [sum(h) for h in zip(*(r["acceptance_histogram"] for r in rows))]
    out: dict[str, Any] = {
        "temperature": temperature,
        "tau": sum(r["tau"] * r["cycles"] for r in rows) / cycles if cycles else float("nan"),
        "acceptance_histogram": hist,
        "speedup": median([b["seconds"] / r["seconds"] for r, b in zip(rows, base_rows) if r["seconds"] > 0]),
        "draft_forwards": median([r["draft_forwards"] for r in rows]),
        "draft_share": sum(r["draft_seconds"] for r in rows) / max(
            1e-9, sum(r["draft_seconds"] + r["verify_seconds"] for r in rows)),
        "lossless": None,
    }
    if temperature == 0:  # token-for-token equality only means something for greedy decoding
        out["lossless"] = sum(r["tokens"] == b["tokens"] for r, b in zip(rows, base_rows)) / len(rows)
    return out


def build_methods(net, ck, max_new_tokens: int, naive: bool, mdlm: str | None, usdm: str | None, sweep: bool,
                  draft: list[str] | None, temperatures: tuple[float, ...], block_size: int | None):
    """Every row of a bench run; the speculative groups as (temperature, baseline, drafter rows)."""
    methods = ar_methods(net, ck, max_new_tokens, naive=naive)
    if mdlm:
        methods += mdlm_methods(mdlm, ck, max_new_tokens, sweep)
    if usdm:
        methods += usdm_methods(usdm, ck, max_new_tokens)
    spec_groups: list[tuple[float, Method, list[Method]]] = []
    for t in (temperatures if draft else ()):
        base = methods[0] if t == 0 else target_method(net, ck, max_new_tokens, t)
        group = spec_methods(net, ck, list(draft), max_new_tokens, t, block_size)
        spec_groups.append((t, base, group))
        methods += ([] if t == 0 else [base]) + group
    return methods, spec_groups


def measure_all(methods: list[Method], ids: list[list[int]], warmup: int, net, ck):
    """Per-prompt rows of every method with the quality columns, and the summaries."""
    summaries, rows_of = [], {}
    for m in methods:
        rows = measure(m, ids, warmup=warmup)
        rows_of[m.name] = rows
        for r, p in zip(rows, ids):
            r["gen_ppl"] = gen_perplexity(net, p, r["tokens"], ck.tokenizer.eos_id)
            r["entropy"] = unigram_entropy(r["tokens"])
        summary = summarize(m, rows)
        summary.update(gen_ppl=median([r["gen_ppl"] for r in rows]), entropy=median([r["entropy"] for r in rows]))
        if all(r["canvases"] for r in rows):
            summary["forwards_per_canvas"] = median([r["forwards"] / r["canvases"] for r in rows])
        summaries.append(summary)
    return summaries, rows_of


def print_report(report: dict[str, Any], spec_rows: list[dict[str, Any]], n_prompts: int, max_new_tokens: int) -> None:
    print_table(report["summaries"], BASE_COLUMNS + [("forwards_per_canvas", "fwd/canvas", ".1f"),
                                                     ("speedup_vs_ar", "vs AR", ".2f")] + QUALITY_COLUMNS,
                title=f"{n_prompts} held-out prompts, {max_new_tokens} new tokens, medians")
    for q in report.get("equal_quality", []):
        if q["ratio"] is not None:
            print(f"{q['method']}: {q['forwards']:.0f} forwards; confidence top-k needs "
                  f"{q['confidence_forwards']:.1f} at the same gen PPL {q['gen_ppl']:.2f} (x{q['ratio']:.2f})")
    if spec_rows:
        print_table(spec_rows, [("temperature", "T", "g"), ("tokens_per_second", "tok/s", ".1f")] + SPEC_COLUMNS[1:]
                    + [("draft_forwards", "draft fwd", ".0f")],
                    title="speculative decoding: speedup = target alone / method, per prompt (median); "
                          "tau pooled over cycles")


def run_bench(model: str, prompts: int = 8, max_new_tokens: int = 64, out: str | None = None, data: str | None = None,
              warmup: int = 1, naive: bool = True, quiet: bool = False, mdlm: str | None = None,
              usdm: str | None = None, sweep: bool = False, draft: list[str] | None = None,
              temperatures: tuple[float, ...] = (0.0, 1.0), block_size: int | None = None) -> dict[str, Any]:
    """Run every method on the same held-out prompts; print the table, write the JSON report (and a PNG
    of quality against tokens per forward beside it). mdlm/usdm: checkpoints for those rows (None: none).

    With `draft` (drafter checkpoints and/or 'lookup'), each drafter runs in the speculative loop at
    every temperature beside the target alone at that temperature (speedup, tau, lossless fraction).
    """
    from dlm.data.corpus import Corpus
    from dlm.data.tokens import heldout_prompts

    check_positive("prompts", prompts)
    check_positive("max-new-tokens", max_new_tokens)
    if warmup < 0:
        raise DlmError(f"--warmup must be >= 0, got {warmup}")
    if out:
        check_out_file(out)  # before the run, not after it
    net, ck = load_model(model)
    if ck.objective != "ar":  # its rows would be labelled "ar (KV cache)" and it would judge the quality column
        hint = f" (pass it as --{ck.objective})" if ck.objective in ("mdlm", "usdm") else ""
        raise DlmError(f"--model {model}: objective {ck.objective!r}; bench's --model is the ar baseline, speculation "
                       f"target and quality judge, an ar checkpoint{hint}")
    corpus = Corpus(ck.corpus(data))
    ps = heldout_prompts(corpus, "test", n=prompts)
    ids = [ck.tokenizer.encode(p.text) for p in ps]
    methods, spec_groups = build_methods(net, ck, max_new_tokens, naive, mdlm, usdm, sweep, draft, temperatures,
                                         block_size)
    summaries, rows_of = measure_all(methods, ids, warmup, net, ck)
    base = summaries[0]["tokens_per_second"]
    for s in summaries:
        s["speedup_vs_ar"] = s["tokens_per_second"] / base if base else float("nan")
    by_name = {s["method"]: s for s in summaries}
    for t, base_m, group in spec_groups:
        by_name[base_m.name].update(temperature=t, speedup=1.0)
        for m in group:
            by_name[m.name].update(summarize_spec(rows_of[m.name], rows_of[base_m.name], t))
    per_prompt = {name: [{k: v for k, v in r.items() if k != "tokens"} for r in rows] for name, rows in rows_of.items()}
    report = {"environment": environment(), "model": str(ck.path), "max_new_tokens": max_new_tokens,
              "prompts": [p.name for p in ps], "summaries": summaries, "per_prompt": per_prompt}
    if mdlm:
        report["equal_quality"] = equal_quality(summaries)
    if not quiet:
        print_report(report, [by_name[m.name] for t, b, g in spec_groups for m in [b] + g], len(ps), max_new_tokens)
    if out:
        png = Path(out).with_suffix(".png")
        note = plot_quality(summaries, png)
        report["plot"] = None if note else str(png)
        if note:
            report["plot_note"] = note
        write_json(out, report)
    return report
