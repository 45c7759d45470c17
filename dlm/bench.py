"""The side-by-side harness: every paradigm on the same held-out prompts, measured the same way.

A `Method` turns one prompt's token ids into a `Result` (text, tokens, statistics). `measure`
warms each method up, runs it on every prompt and keeps the per-prompt statistics; `summarize`
reports medians. Each paradigm contributes methods (see `methods_for`).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from dlm.errors import DlmError
from dlm.sampling.common import Result


@dataclass
class Method:
    name: str  # row label, e.g. "ar (KV cache)"
    paradigm: str  # ar | mdlm | usdm | spec | ...
    run: Callable[[list[int]], Result]
    settings: dict[str, Any] = field(default_factory=dict)  # what a reader needs to reproduce the row


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
    from dlm.sampling.ar import ar_stream, naive_stream
    from dlm.sampling.common import drain

    tok = ck.tokenizer
    opts = dict(max_new_tokens=max_new_tokens, temperature=0.0, eos_id=tok.eos_id, pad_id=tok.pad_id)

    def cached(ids: list[int]) -> Result:
        return drain(ar_stream(model, [ids], **opts), tok.decode, tok.eos_id)

    def recompute(ids: list[int]) -> Result:
        return drain(naive_stream(model, ids, **opts), tok.decode, tok.eos_id)

    methods = [Method("ar (KV cache)", "ar", cached, {"model": str(ck.path), "greedy": True})]
    if naive:
        methods.append(Method("ar (naive, no cache)", "ar", recompute, {"model": str(ck.path), "greedy": True}))
    return methods


# usdm rows --------------------------------------------------------------------------------------

DEFAULT_USDM = "checkpoints/usdm-small"


def usdm_methods(path: str | None, ref_ck, max_new_tokens: int) -> list[Method]:
    """usdm at its default settings (adaptive stopping) and with a fixed 48 steps per canvas.

    path None: checkpoints/usdm-small when it exists; '' : no usdm rows.
    """
    from dlm.checkpoint import load_model
    from dlm.sampling import SampleConfig
    from dlm.sampling.common import drain
    from dlm.sampling.usdm import check_options, stream_ids

    if path is None:
        path = DEFAULT_USDM if Path(DEFAULT_USDM).is_dir() else ""
    if not path:
        return []
    net, ck = load_model(path)
    if ck.objective != "usdm":
        raise DlmError(f"--usdm {path}: objective {ck.objective!r}, expected a usdm checkpoint")
    if ck.tokenizer.sha256 != ref_ck.tokenizer.sha256:
        raise DlmError(f"--usdm {path}: its tokenizer differs from {ref_ck.path}'s (the quality column needs one)")
    tok = ck.tokenizer

    def method(name: str, cfg: SampleConfig) -> Method:
        L = check_options(net, ck, cfg)

        def run(ids: list[int]) -> Result:
            return drain(stream_ids(net, ck, [ids], cfg), tok.decode, tok.eos_id)

        settings = {"model": str(ck.path), "canvas_length": L, "max_denoising_steps": cfg.max_denoising_steps,
                    "adaptive": cfg.adaptive, "entropy_bound": cfg.entropy_bound, "seed": cfg.seed}
        return Method(name, "usdm", run, settings)

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


def run_bench(model: str, prompts: int = 8, max_new_tokens: int = 64, out: str | None = None, data: str | None = None,
              warmup: int = 1, naive: bool = True, quiet: bool = False, usdm: str | None = None) -> dict[str, Any]:
    """Run every method on the same held-out prompts; print the table, write the JSON report."""
    from dlm.checkpoint import load_model
    from dlm.data.corpus import Corpus
    from dlm.data.tokens import heldout_prompts

    check_positive("prompts", prompts)
    check_positive("max-new-tokens", max_new_tokens)
    net, ck = load_model(model)
    corpus = Corpus(data or ck.config.get("data", "stdlib"))
    ps = heldout_prompts(corpus, "test", n=prompts)
    ids = [ck.tokenizer.encode(p.text) for p in ps]
    methods = ar_methods(net, ck, max_new_tokens, naive=naive)
    methods += usdm_methods(usdm, ck, max_new_tokens)
    summaries, per_prompt = [], {}
    for m in methods:
        rows = measure(m, ids, warmup=warmup)
        for r, p in zip(rows, ids):
            r["gen_ppl"] = gen_perplexity(net, p, r["tokens"], ck.tokenizer.eos_id)
            r["entropy"] = unigram_entropy(r["tokens"])
        summary = summarize(m, rows)
        summary.update(gen_ppl=median([r["gen_ppl"] for r in rows]), entropy=median([r["entropy"] for r in rows]))
        if all("canvases" in r for r in rows):
            summary["forwards_per_canvas"] = median([r["forwards"] / max(r["canvases"], 1) for r in rows])
        summaries.append(summary)
        per_prompt[m.name] = [{k: v for k, v in r.items() if k != "tokens"} for r in rows]
    base = summaries[0]["tokens_per_second"]
    for s in summaries:
        s["speedup_vs_ar"] = s["tokens_per_second"] / base if base else float("nan")
    report = {"environment": environment(), "model": str(ck.path), "max_new_tokens": max_new_tokens,
              "prompts": [p.name for p in ps], "summaries": summaries, "per_prompt": per_prompt}
    if not quiet:
        extra = [("speedup_vs_ar", "vs AR", ".2f"), ("forwards_per_canvas", "fwd/canvas", ".1f")]
        print_table(summaries, BASE_COLUMNS + extra + QUALITY_COLUMNS,
                    title=f"{len(ps)} held-out prompts, {max_new_tokens} new tokens, medians")
    if out:
        write_json(out, report)
    return report
