"""How close `dlm serve` at concurrency 16 comes to the forward's batching ceiling, per paradigm.

    python scripts/batch_ceiling.py --model checkpoints/ar-mid checkpoints/mdlm-small checkpoints/usdm-small \\
        --draft lookup --threads 1 --json ceiling.jsonl

For each served id: the loadtest row at --concurrency (16: 32 streamed greedy completions of --max-tokens, the
held-out stdlib prompts) on `dlm serve --threads T`, and the ceiling: the cost of one forward of 16 rows at the
paradigm's width (`dlm bench --shape CHECKPOINT --points 16 --row-tokens W`: AR 1 new token per row, mdlm its block,
usdm its canvas, speculative its verify block) over a cache of the requests' mean prompt plus half the generation,
the same threads. A row-step commits k tokens (the server's counters: tokens / (rows x steps); AR k = 1), so

    ceiling tok/s = 16 x k / t(16-row forward)         ratio = server tok/s / ceiling

in two clocks: wall (the server's tok/s as the clients see it; the ceiling's fastest forward by the wall clock) and
CPU (tokens per CPU second of the server process, all its threads, against the forward's process CPU time): on a
machine other work keeps busy the CPU ratio is the server's own efficiency, the wall ratio what the load leaves of
it. A speculative id's ceiling counts its target's verify only (a drafter pass adds to it: lookup's costs nothing).
`--pause PID` stops that process (SIGSTOP) for each timed part and resumes it right after.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx

from dlm.serve.loadtest import batching, default_prompts, measure, paused, started_server

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """user + system CPU seconds of a process, all its threads (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def server_pid() -> int | None:
    """The `dlm serve` this process started (its only child process)."""
    kids = [int(k) for t in Path(f"/proc/{os.getpid()}/task").iterdir()
            for k in (t / "children").read_text().split()]
    return kids[0] if len(kids) == 1 else None


def width(served: dict) -> int:
    """New tokens of one row in one target forward: AR 1, mdlm its block, usdm its canvas, speculative its block."""
    p = served["paradigm"]
    if p == "mdlm":
        return served["block_size"]
    if p == "usdm":
        return served["canvas_length"]
    if p == "speculative":
        return served.get("block_size") or 8
    return 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", required=True)
    ap.add_argument("--draft")
    ap.add_argument("--models", nargs="+", help="served ids to measure (default: every one)")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch threads of the server and the ceiling (0: torch's)")
    ap.add_argument("--repeat", type=int, default=3, help="rounds of the ceiling's forward timing")
    ap.add_argument("--canvas", type=int, default=0, help="usdm: the canvas a request of --max-tokens runs (0: max-tokens)")
    ap.add_argument("--block", type=int, default=0, help="speculative: the verify block (0: the drafter's, else 8)")
    ap.add_argument("--compile", action="store_true", help="dlm serve --compile")
    ap.add_argument("--pack-weights", action="store_true", help="dlm serve --pack-weights")
    ap.add_argument("--pause", type=int)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    import torch

    from dlm.bench.cost import run_cost

    if a.threads:
        torch.set_num_threads(a.threads)
    prompts = default_prompts()
    rows = []
    with started_server(a.model, a.draft, a.concurrency, a.threads, a.compile, a.pack_weights) as url:
        pid = server_pid()
        served = {m["id"]: m for m in httpx.get(url + "/v1/models", timeout=30).json()["data"]}
        for mid in a.models or served:
            info = served[mid].get("dlm", served[mid])
            load = os.getloadavg()[0]
            with paused(a.pause):
                c0 = cpu_seconds(pid) if pid else None
                before = batching(url, mid)
                row = measure(url, mid, a.concurrency, max(8, 2 * a.concurrency), a.max_tokens, prompts)
                c1 = cpu_seconds(pid) if pid else None
            after = batching(url, mid)
            row_steps = (after["decode_rows"] - before["decode_rows"]) if before and after else None
            # (the warm-up request is inside `measure`'s counters and CPU time: one request of 2c + 1)
            n = row["requests"] + 1
            k = 1.0 if info["paradigm"] == "ar" else (row["tokens"] * n / row["requests"]) / row_steps
            W = width(info)
            if info["paradigm"] == "usdm":
                W = a.canvas or a.max_tokens
            if info["paradigm"] == "speculative":
                W = a.block or W
            context = round(row["prompt_tokens"] / row["requests"] + a.max_tokens / 2)
            with paused(a.pause):
                wall = run_cost(info["checkpoint"], context=context, points=(16,), repeat=a.repeat, quiet=True,
                                row_tokens=W)
                cpu = run_cost(info["checkpoint"], context=context, points=(16,), repeat=a.repeat, quiet=True,
                               row_tokens=W, clock="cpu")
            t_wall = next(r["seconds"] for r in wall["rows"] if r["n"] == 16)
            t_cpu = next(r["seconds"] for r in cpu["rows"] if r["n"] == 16)
            out = {"model": mid, "paradigm": info["paradigm"], "width": W, "context": context, "k": k,
                   "tokens_per_second": row["tokens_per_second"], "rows_per_step": row.get("rows_per_step"),
                   "ceiling_wall": 16 * k / t_wall, "ratio_wall": row["tokens_per_second"] / (16 * k / t_wall),
                   "load": load, "threads": a.threads, "compile": a.compile, "pack_weights": a.pack_weights, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
            if c0 is not None:
                per_cpu = row["tokens"] * n / row["requests"] / (c1 - c0)
                out.update(server_cpu_s=c1 - c0, tokens_per_cpu_second=per_cpu, ceiling_cpu=16 * k / t_cpu,
                           ratio_cpu=per_cpu / (16 * k / t_cpu))
            print(json.dumps(out), flush=True)
            rows.append(out)
            if a.json:
                with open(a.json, "a") as fh:
                    fh.write(json.dumps(out) + "\n")
    print()
    print("| model | width | k | rows/step | tok/s | ceiling (wall) | ratio | tok per CPU s | ceiling (CPU) | ratio | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['width']} | {r['k']:.2f} | {r['rows_per_step'] or 0:.1f} | "
              f"{r['tokens_per_second']:.0f} | {r['ceiling_wall']:.0f} | {r['ratio_wall']:.0%} | "
              f"{r.get('tokens_per_cpu_second', 0):.0f} | {r.get('ceiling_cpu', 0):.0f} | {r.get('ratio_cpu', 0):.0%} | "
              f"{r['load']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
