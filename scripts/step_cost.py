"""What one decoding step of R rows costs: the bare forward against the row batch's step, by the thread's CPU clock.

    python scripts/step_cost.py --model checkpoints/ar-mid --rows 1 4 16 --context 250 --steps eager compiled

For each R: the bare forward (`model.new_cache(R)` holding `--context` tokens of every row, one new token per row,
the head included) and the row batch's step as `dlm serve` runs it (`rows.RowBatch`, rows of `--context` +- 10%
cached tokens, each step one token per row through `RowBatch.forward`, the head and the cache's growth included),
each step variant named by --steps (RowBatch's `step`: eager, static, compiled). One torch thread unless
--threads; each figure is the best and the median over --rounds rounds of the per-step mean of --iters steps,
`time.thread_time` (the work itself, not what other processes take of the machine). `--pack-weights` packs the
linears as the server's option does. Prints one JSON line per (R, variant) and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from dlm.checkpoint import load_model
from dlm.model import pack_linears
from dlm.sampling.rows import RowBatch, Window

clock = time.thread_time


def bare(model, R: int, context: int, iters: int, rounds: int) -> list[float]:
    """Per-step CPU seconds of the plain forward of R rows over a cache of `context` tokens (each round from there)."""
    V = model.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    cache = model.new_cache(R, context + iters + 1)
    model(torch.randint(0, V, (R, context), generator=g), cache=cache, head=False)
    tok = torch.randint(0, V, (R, 1), generator=g)
    out = []
    for _ in range(rounds + 1):  # (the first round warms up)
        cache.crop(context)
        t = clock()
        for _ in range(iters):
            model(tok, cache=cache)
        out.append((clock() - t) / iters)
    return out[1:]


def row_batch(model, R: int, context: int, iters: int, rounds: int, step: str) -> list[float]:
    """Per-step CPU seconds of RowBatch.forward with R one-token rows (the server's decode step), rows of about
    `context` cached tokens (their lengths differ, as a server's rows do)."""
    V = model.cfg.vocab_size
    g = torch.Generator().manual_seed(1)
    rb = RowBatch(model, 2 * model.cfg.max_seq_len, step)
    lengths = [max(2, context + (context // 10) * ((i * 7) % 5 - 2) // 2) for i in range(R)]
    for P in lengths:  # each prompt's prefill (as rows join a server)
        rb.add()
        ids = torch.randint(0, V, (P,), generator=g)
        rb.forward([Window(tokens=ids, mask="causal", keep=P, out=(P - 1, P))], [len(rb) - 1])
    toks = [torch.randint(0, V, (1,), generator=g) for _ in range(R)]
    out = []
    for _ in range(rounds + 1):
        for i, P in enumerate(lengths):
            rb.crop(i, P)
        t = clock()
        for _ in range(iters):
            rb.forward([Window(tokens=toks[i], mask="causal", keep=1, out=(0, 1)) for i in range(R)])
        out.append((clock() - t) / iters)
    return out[1:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--context", type=int, default=250)
    ap.add_argument("--steps", nargs="+", default=["eager"], help="RowBatch step variants (eager, static, compiled)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--pack-weights", action="store_true")
    ap.add_argument("--pack-min", type=int, default=1 << 20, help="--pack-weights: oneDNN's layout from this many weights")
    ap.add_argument("--blocked", action="store_true", help="--pack-weights with dlm's blocked float32 layout")
    ap.add_argument("--no-bare", action="store_true", help="skip the bare forward")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the weights' and K/V's dtype")
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "bfloat16"],
                    help="the row batch's K/V dtype (dlm serve --kv-dtype)")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    model, _ = load_model(a.model, dtype=getattr(torch, a.dtype))
    model.eval()
    if a.kv_dtype == "bfloat16":
        model.kv_dtype = torch.bfloat16
    if a.pack_weights:
        pack_linears(model, a.pack_min, blocked=a.blocked)
    rows = []
    with torch.inference_mode():
        for R in a.rows:
            variants = ([] if a.no_bare else [("bare", lambda: bare(model, R, a.context, a.iters, a.rounds))])
            variants += [(s, lambda s=s: row_batch(model, R, a.context, a.iters, a.rounds, s)) for s in a.steps]
            for name, run in variants:
                ts = run()
                r = {"rows": R, "variant": name, "best_ms": 1e3 * min(ts), "median_ms": 1e3 * statistics.median(ts),
                     "context": a.context, "threads": a.threads, "dtype": a.dtype,
                     "kv_dtype": a.kv_dtype, "load": os.getloadavg()[0],
                     "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
                print(json.dumps(r), flush=True)
                rows.append(r)
                if a.json:
                    with open(a.json, "a") as fh:
                        fh.write(json.dumps(r) + "\n")
    print()
    print("| rows | variant | best ms | median ms | load |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rows']} | {r['variant']} | {r['best_ms']:.2f} | {r['median_ms']:.2f} | {r['load']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
