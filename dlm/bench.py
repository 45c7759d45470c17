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


# speculative rows ----------------------------------------------------------------------------------

SPEC_COLUMNS = [("temperature", "T", "g"), ("tau", "tau", ".2f"), ("speedup", "speedup", ".2f"),
                ("lossless", "lossless", ".2f"), ("draft_share", "draft time", ".0%")]


def target_method(model, ck, max_new_tokens: int, temperature: float, seed: int = 0) -> Method:
    """The target alone (AR with its KV cache) at a temperature: what speculation is measured against."""
    from dlm.sampling.ar import ar_stream
    from dlm.sampling.common import drain

    tok = ck.tokenizer

    def run(ids: list[int]) -> Result:
        return drain(ar_stream(model, [ids], max_new_tokens=max_new_tokens, temperature=temperature, seed=seed,
                               eos_id=tok.eos_id, pad_id=tok.pad_id), tok.decode, tok.eos_id)

    return Method(f"target alone T={temperature:g}", "ar", run,
                  {"model": str(ck.path), "temperature": temperature, "spec_base": True})


def spec_methods(model, ck, drafts: list[str], max_new_tokens: int, temperature: float, gamma: int = 0,
                 seed: int = 0) -> list[Method]:
    """One row per drafter ('lookup' or a drafter checkpoint), in the lossless speculative loop."""
    from dlm.sampling.common import drain, make_generator
    from dlm.sampling.speculative import Sampling, generate_ids, load_drafter, resolve_gamma

    tok = ck.tokenizer
    methods = []
    for spec in drafts:
        sampling = Sampling(temperature, gen=make_generator(seed, model.device))
        drafter = load_drafter(spec, model, ck, sampling, capacity=model.cfg.max_seq_len + 66)
        g = resolve_gamma(drafter, gamma)

        def run(ids: list[int], drafter=drafter, g=g, sampling=sampling) -> Result:
            return drain(generate_ids(model, drafter, ids, g, max_new_tokens, sampling, tok.eos_id), tok.decode,
                         tok.eos_id)

        methods.append(Method(f"{drafter.name} T={temperature:g}", "spec", run,
                              {"draft": spec, "gamma": g, "temperature": temperature}))
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


def run_bench(model: str, prompts: int = 8, max_new_tokens: int = 64, out: str | None = None, data: str | None = None,
              warmup: int = 1, naive: bool = True, quiet: bool = False, draft: list[str] | None = None,
              temperatures: tuple[float, ...] = (0.0, 1.0), gamma: int = 0) -> dict[str, Any]:
    """Run every method on the same held-out prompts; print the table, write the JSON report.

    With `draft` (drafter checkpoints and/or 'lookup'), each drafter runs in the speculative loop at
    every temperature beside the target alone at that temperature (speedup, tau, lossless fraction).
    """
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
    spec_groups: list[tuple[float, Method, list[Method]]] = []
    for t in (temperatures if draft else ()):
        base = methods[0] if t == 0 else target_method(net, ck, max_new_tokens, t)
        group = spec_methods(net, ck, list(draft), max_new_tokens, t, gamma)
        spec_groups.append((t, base, group))
        methods += ([] if t == 0 else [base]) + group
    summaries, per_prompt, rows_of = [], {}, {}
    for m in methods:
        rows = measure(m, ids, warmup=warmup)
        rows_of[m.name] = rows
        for r, p in zip(rows, ids):
            r["gen_ppl"] = gen_perplexity(net, p, r["tokens"], ck.tokenizer.eos_id)
            r["entropy"] = unigram_entropy(r["tokens"])
        summary = summarize(m, rows)
        summary.update(gen_ppl=median([r["gen_ppl"] for r in rows]), entropy=median([r["entropy"] for r in rows]))
        summaries.append(summary)
        per_prompt[m.name] = [{k: v for k, v in r.items() if k != "tokens"} for r in rows]
    base = summaries[0]["tokens_per_second"]
    for s in summaries:
        s["speedup_vs_ar"] = s["tokens_per_second"] / base if base else float("nan")
    by_name = {s["method"]: s for s in summaries}
    for t, base_m, group in spec_groups:
        by_name[base_m.name].update(temperature=t, speedup=1.0)
        for m in group:
            by_name[m.name].update(summarize_spec(rows_of[m.name], rows_of[base_m.name], t))
    report = {"environment": environment(), "model": str(ck.path), "max_new_tokens": max_new_tokens,
              "prompts": [p.name for p in ps], "summaries": summaries, "per_prompt": per_prompt}
    if not quiet:
        print_table(summaries, BASE_COLUMNS + [("speedup_vs_ar", "vs AR", ".2f")] + QUALITY_COLUMNS,
                    title=f"{len(ps)} held-out prompts, {max_new_tokens} new tokens, medians")
        if draft:
            spec_rows = [by_name[m.name] for t, b, g in spec_groups for m in [b] + g]
            print_table(spec_rows, [("temperature", "T", "g"), ("tokens_per_second", "tok/s", ".1f")] + SPEC_COLUMNS[1:]
                        + [("draft_forwards", "draft fwd", ".0f")],
                        title="speculative decoding: speedup = target alone / method, per prompt (median); "
                              "tau pooled over cycles")
    if out:
        write_json(out, report)
    return report
