"""The bench statistics: medians over repetitions, ratios in the same round, generated-text quality, Pareto fronts."""

from __future__ import annotations

import statistics
from typing import Any

import torch

from dlm.bench.harness import Method
from dlm.sampling.common import Eos, through_eos


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


def noisy(v: float, lo: float, hi: float) -> bool:
    """A figure whose min-max spread over repetitions is wider than the figure itself: noise, not a measurement."""
    return hi - lo > abs(v)


@torch.inference_mode()
def gen_perplexity(ref, prompt: list[int], new: list[int], eos_id: Eos = None) -> float:
    """Perplexity of generated tokens under the reference AR model, conditioned on the prompt.

    The quality column every paradigm shares (all share the reference tokenizer). Tokens after
    the first <eos> are not scored.
    """
    import math

    import torch.nn.functional as F

    new = through_eos(new, eos_id)[0]
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


def front_of(rows: list[dict[str, Any]], x: str, key: str) -> list[tuple[float, float]]:
    """The Pareto front (x, quality) of the bench rows, every paradigm's (AR included: it is often the best quality,
    and a method it beats on both axes is off the front). More tokens per forward is better; on any other x
    (seconds) less is."""
    sign = 1 if x == "tokens_per_forward" else -1
    return [(sign * a, q) for a, q in pareto([(sign * r[x], r[key]) for r in rows])]


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points (x, quality) no other point beats on both (higher x and higher quality are better), by x."""
    front = [p for p in points if not any(q[0] >= p[0] and q[1] >= p[1] and q != p for q in points)]
    return sorted(set(front))


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


def noise(summaries: list[dict[str, Any]]) -> dict[str, float]:
    """How noisy the timings were: (max - min) / median of tok/s over repetitions, across the rows."""
    spread = [(s["tokens_per_second_range"][1] - s["tokens_per_second_range"][0]) / s["tokens_per_second"]
              for s in summaries if s.get("tokens_per_second")]
    return {"median": median(spread), "max": max(spread) if spread else float("nan")}
