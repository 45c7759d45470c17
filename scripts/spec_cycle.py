"""Where a speculative cycle's time goes: each drafter against the target alone, in the thread's CPU time.

    OMP_NUM_THREADS=1 python scripts/spec_cycle.py --model checkpoints/ar-mid \\
        --draft runs/dflash2-mid checkpoints/ar-draft lookup --prompts 8 --max-new-tokens 128 --repeat 3

The cases are `dlm bench`'s (held-out line completions, greedy or at --temperature, the same prompt tokens), run one
at a time as the bench runs them, interleaved (each case through every method in turn, the order rotated each round).
Every span is timed with the thread's CPU clock (time.thread_time), so the figures are the work itself and not the
time the process waited for a core: on a busy machine they hold where the wall clock does not. (Cache and memory
contention still move them by several percent; --block-size applies to every drafter, as in dlm bench.)

Per method: the speedup (median over cases of the target alone's CPU time / the method's, each round, then the
median over rounds), tau (tokens per cycle, the prefill's token excluded) and the per-cycle breakdown in target
steps (one step: the median CPU time of the target alone's one-token forward, its head included):

    verify fwd    the target's forward over the block, its head over the block's positions
    draft model   the drafter's own model: an AR draft's forwards and heads, a DFlash drafter's layers
    draft head    a DFlash drafter's logits (the target's LM head over its slots)
    draft fc      a DFlash drafter's context features (fc + hidden_norm over the newly committed positions)
    selector      a DFlash 2 drafter's candidate selector (top-k of each slot's logits, the path through them)
    rest          everything else: the verifier, the caches' crops, the bookkeeping, the Python between

--json writes the figures.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections import defaultdict

import torch

from dlm import drafter as dflash
from dlm.bench import reblock, relayout
from dlm.bench.harness import run_item
from dlm.bench.methods import bench_items, build_methods
from dlm.checkpoint import load_model
from dlm.model import Transformer
from dlm.tasks.common import window

clock = time.thread_time


class Spans:
    """CPU seconds per label, collected by wrapping methods (labelled by which model they run on)."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, list[float]] = defaultdict(list)
        self.depth = 0

    def wrap(self, cls, name: str, label) -> None:
        f = getattr(cls, name)

        @functools.wraps(f)
        def timed(obj, *a, **k):
            if self.depth:  # a span inside a span counts once, in the outer one
                return f(obj, *a, **k)
            self.depth += 1
            t = clock()
            try:
                return f(obj, *a, **k)
            finally:
                self.depth -= 1
                dt = clock() - t
                lab = label(obj, a, k)
                self.seconds[lab] += dt
                self.calls[lab].append(dt)

        setattr(cls, name, timed)

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()


def instrument(spans: Spans, target: Transformer) -> None:
    def on_target(obj, a, k):
        if obj is not target:
            return "draft model"
        x = a[0] if a and a[0] is not None else k.get("embeds")
        return "prefill" if x.shape[1] > 64 else "verify fwd"

    spans.wrap(Transformer, "forward", on_target)
    spans.wrap(Transformer, "head", lambda obj, a, k: "verify fwd" if obj is target else "draft model")
    spans.wrap(dflash.DFlashDrafter, "forward", lambda obj, a, k: "draft model")
    spans.wrap(dflash.DFlashDrafter, "head", lambda obj, a, k: "draft head")
    spans.wrap(dflash.DFlashDrafter, "context", lambda obj, a, k: "draft fc")
    spans.wrap(dflash.CandidateSelector, "select", lambda obj, a, k: "selector")


PARTS = ("verify fwd", "draft model", "draft head", "draft fc", "selector", "rest")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the AR target")
    ap.add_argument("--draft", nargs="+", required=True, help="drafter folders and/or 'lookup' (as dlm bench's)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--col-major", action="store_true", help="every model's linear weights column-major (dlm bench's)")
    ap.add_argument("--blocked", action="store_true", help="every model's float32 weights blocked (dlm bench's)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    net, ck = load_model(args.model)
    items, _ = bench_items(None, None, args.prompts, "line")
    _, groups = build_methods(net, ck, args.max_new_tokens, False, None, None, False, args.draft,
                              (args.temperature,), args.block_size)
    _, base, group = groups[0]
    methods = [base, *group]  # the target alone at this temperature, then each drafter
    if args.col_major:
        relayout(methods)
    if args.blocked:
        reblock(methods)
    context = min(window(m.ck, m.model) for m in methods)
    spans = Spans()
    instrument(spans, net)
    for m in methods:  # warm-up
        run_item(m, items[0], context)
    M = len(methods)
    cpu = [[[0.0] * len(items) for _ in range(args.repeat)] for _ in methods]  # [method][round][case]
    parts = [defaultdict(float) for _ in methods]
    steps: list[float] = []
    tokens, cycles = [0] * M, [0] * M
    for r in range(args.repeat):
        for i, it in enumerate(items):
            for j in range(M):
                k = (r + j) % M
                spans.clear()
                t = clock()
                row = run_item(methods[k], it, context)
                cpu[k][r][i] = clock() - t
                if k == 0:  # the target alone: its one-token steps
                    steps += spans.calls["verify fwd"]
                for name, s in spans.seconds.items():
                    parts[k][name] += s
                parts[k]["total"] += cpu[k][r][i]
                tokens[k] += len(row["tokens"])
                cycles[k] += row.get("cycles", 0)
    step = statistics.median(steps)
    out = {"model": args.model, "temperature": args.temperature, "step_ms": 1e3 * step, "prompts": len(items),
           "repeat": args.repeat, "methods": []}
    print(f"one target step (T = 1, head included): {1e3 * step:.2f} ms CPU (median of {len(steps)})")
    for k, m in enumerate(methods):
        ratio = statistics.median(statistics.median(cpu[0][r][i] / cpu[k][r][i] for i in range(len(items)))
                                  for r in range(args.repeat))
        p = parts[k]
        row = {"method": m.name, "speedup_cpu": ratio, "tokens": tokens[k]}
        if k:
            n = cycles[k]
            p["rest"] = p["total"] - p["prefill"] - sum(p[x] for x in PARTS[:-1])
            row.update(tau=(tokens[k] - len(items) * args.repeat) / n, cycles=n,
                       cycle_steps={x: p[x] / n / step for x in PARTS})
            row["cycle_steps"]["total"] = sum(row["cycle_steps"].values())
            cs = row["cycle_steps"]
            print(f"{m.name}: {ratio:.2f}x, tau {row['tau']:.2f}, a cycle {cs['total']:.3f} steps = "
                  + " + ".join(f"{x} {cs[x]:.3f}" for x in PARTS if cs[x] > 0.0005))
        else:
            print(f"{m.name}: 1.00x")
        out["methods"].append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
