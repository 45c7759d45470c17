"""Load test of a running `dlm serve`: throughput and latency per model at several concurrencies.

    python -m dlm.serve.loadtest --url http://127.0.0.1:8000 --concurrency 1 4 16
    python -m dlm.serve.loadtest --serve checkpoints/ar-small checkpoints/mdlm-small checkpoints/usdm-small \\
        --draft checkpoints/dflash-small          # starts `dlm serve` on a free port, measures, stops it

For each model and each concurrency c, c clients each send streaming completions one after
another (greedy, held-out stdlib prompts, --max-tokens each) until --requests have finished, after
one untimed warm-up request. With --repeat R the whole sweep runs R times (rows interleaved, so a
busy spell of the machine does not land on one row) and each figure is the median over the runs.
Reported per row:

  tok/s        completion tokens of all requests / wall time from the first request sent to the last done
  p50 / p99 s  request latency (sent -> last chunk) percentiles
  TTFT p50 s   sent -> first chunk with text
  rows/step    AR: mean rows per batched forward during the row (the server's /health counters)

Clients and server share this machine's cores: the figures are the whole system's, client included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator

import httpx


def percentile(xs: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def default_prompts(n: int = 32) -> list[str]:
    """Held-out stdlib snippets (the benchmark's prompts)."""
    from dlm.data.corpus import Corpus
    from dlm.data.tokens import heldout_prompts

    return [p.text for p in heldout_prompts(Corpus("stdlib"), "test", n=n)]


async def _one(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> dict:
    t0 = time.perf_counter()
    first = None
    tokens = prompt_tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "latency": time.perf_counter() - t0}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            msg = json.loads(line[6:])
            if first is None and msg.get("choices") and msg["choices"][0].get("text"):
                first = time.perf_counter() - t0
            if "usage" in msg and msg["usage"]:
                tokens = msg["usage"]["completion_tokens"]
                prompt_tokens = msg["usage"]["prompt_tokens"]
    return {"status": 200, "latency": time.perf_counter() - t0, "ttft": first, "tokens": tokens,
            "prompt_tokens": prompt_tokens}


async def _level(url: str, model: str, concurrency: int, requests: int, max_tokens: int, prompts: list[str],
                 headers: dict, extra: dict) -> tuple[list[dict], dict | None]:
    """The row's results, and the server's batching counters after the warm-up (None: not a dlm server)."""
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        def body(i: int) -> dict:
            return {"model": model, "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens, "stream": True,
                    "stream_options": {"include_usage": True}, "temperature": 0, **extra}

        await _one(client, url, body(0), headers)  # warm-up
        before = await asyncio.to_thread(batching, url, model)  # (its steps, one row each, are not the row's)
        counter = iter(range(requests))
        results: list[dict] = []

        async def worker() -> None:
            for i in counter:
                results.append(await _one(client, url, body(i), headers))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    for r in results:
        r["wall"] = wall
    return results, before


def batching(url: str, model: str) -> dict | None:
    """A dlm server's batching counters of `model` (/health); None from another OpenAI-compatible server."""
    try:
        return httpx.get(url + "/health", timeout=30).json().get("batching", {}).get(model)
    except ValueError:  # not JSON: vLLM's /health answers 200 with an empty body
        return None


def measure(url: str, model: str, concurrency: int, requests: int, max_tokens: int = 64,
            prompts: list[str] | None = None, api_key: str | None = None) -> dict[str, Any]:
    """One row: `requests` streamed completions of `model` by `concurrency` clients."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    prompts = prompts or default_prompts()
    results, before = asyncio.run(_level(url, model, concurrency, requests, max_tokens, prompts, headers, {}))
    after = batching(url, model)
    ok = [r for r in results if r["status"] == 200]
    wall = results[0]["wall"] if results else 0.0
    tokens = sum(r["tokens"] for r in ok)
    lat = [r["latency"] for r in ok]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    row = {"model": model, "concurrency": concurrency, "requests": len(results), "errors": len(results) - len(ok),
           "tokens": tokens, "prompt_tokens": sum(r["prompt_tokens"] for r in ok), "seconds": wall, "tokens_per_second": tokens / wall if wall else 0.0,
           "latency_p50": percentile(lat, 50) if lat else None, "latency_p99": percentile(lat, 99) if lat else None,
           "ttft_p50": percentile(ttft, 50) if ttft else None, "max_tokens": max_tokens}
    if before and after and after["decode_steps"] > before["decode_steps"]:
        row["rows_per_step"] = (after["decode_rows"] - before["decode_rows"]) / (after["decode_steps"] - before["decode_steps"])
    return row


def combine(rows: list[dict]) -> dict:
    """Rows of the same model and concurrency from repeated runs: the median of each figure."""
    if len(rows) == 1:
        return rows[0]
    out = dict(rows[0])
    for k, v in rows[0].items():
        if isinstance(v, float) or k in ("tokens", "errors", "requests"):
            vals = [r[k] for r in rows if r.get(k) is not None]
            out[k] = statistics.median(vals) if vals else None
    out["errors"] = sum(r["errors"] for r in rows)
    out["requests"] = sum(r["requests"] for r in rows)
    out["runs"] = len(rows)
    out["tokens_per_second_runs"] = [round(r["tokens_per_second"], 1) for r in rows]
    return out


def table(rows: list[dict]) -> str:
    out = ["| model | concurrency | requests | tok/s | latency p50 s | latency p99 s | TTFT p50 s | rows/step | errors |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = lambda v, d=2: "–" if v is None else f"{v:.{d}f}"  # noqa: E731
        out.append(f"| {r['model']} | {r['concurrency']} | {r['requests']} | {r['tokens_per_second']:.1f} | "
                   f"{f(r['latency_p50'])} | {f(r['latency_p99'])} | {f(r['ttft_p50'], 3)} | "
                   f"{f(r.get('rows_per_step'), 1)} | {r['errors']} |")
    return "\n".join(out)


@contextmanager
def paused(pid: int | None) -> Iterator[None]:
    """A background process (a training run sharing the machine) stopped (SIGSTOP) while a timed part runs, resumed
    (SIGCONT) after; one that has ended is left alone."""
    def send(sig: int) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass

    if pid:
        send(signal.SIGSTOP)
    try:
        yield
    finally:
        if pid:
            send(signal.SIGCONT)


@contextmanager
def started_server(checkpoints: list[str], draft: str | None, max_concurrency: int, threads: int = 0,
                   compile: bool = False, pack_weights: bool = False,
                   prefix_cache_mb: int | None = None, kv_dtype: str = "auto") -> Iterator[str]:
    """`dlm serve` in a subprocess on a free port of 127.0.0.1 (with its --compile, --pack-weights, --kv-dtype,
    --prefix-cache-mb: None its default); yields its URL, stops it afterwards."""
    cmd = [sys.executable, "-m", "dlm.cli", "serve", "--model", *checkpoints, "--port", "0", "--max-concurrency",
           str(max_concurrency), "--max-queue", "1024", "--log-level", "warning", "--threads", str(threads)]
    if prefix_cache_mb is not None:
        cmd += ["--prefix-cache-mb", str(prefix_cache_mb)]
    if compile:
        cmd.append("--compile")
    if pack_weights:
        cmd.append("--pack-weights")
    if kv_dtype != "auto":
        cmd += ["--kv-dtype", kv_dtype]
    if draft:
        cmd += ["--draft", draft]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        url = None
        for line in proc.stdout:
            if line.startswith("playground:"):
                url = line.split()[1].rstrip("/")
                break
        if url is None:
            raise SystemExit(f"dlm serve did not start (exit code {proc.wait()})")
        for _ in range(300):
            try:
                httpx.get(url + "/health", timeout=5)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        yield url
    finally:
        proc.send_signal(2)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dlm.serve.loadtest", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running dlm serve (default: start one with --serve)")
    ap.add_argument("--serve", nargs="+", metavar="CHECKPOINT", help="start `dlm serve --model CHECKPOINT...`")
    ap.add_argument("--draft", help="with --serve: --draft for the AR models (adds MODEL+DRAFT ids)")
    ap.add_argument("--models", nargs="+", help="model ids to load (default: every served id)")
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=0, help="requests per row (default: max(8, 2 x concurrency))")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="with --serve: torch threads of the server (0: default)")
    ap.add_argument("--compile", action="store_true", help="with --serve: dlm serve --compile")
    ap.add_argument("--pack-weights", action="store_true", help="with --serve: dlm serve --pack-weights")
    ap.add_argument("--prefix-cache-mb", type=int, help="with --serve: dlm serve --prefix-cache-mb (default: its own)")
    ap.add_argument("--repeat", type=int, default=1, help="run the sweep this many times; medians per row")
    ap.add_argument("--api-key", default=os.environ.get("DLM_API_KEY"))
    ap.add_argument("--json", help="write the rows as JSON lines to this file")
    a = ap.parse_args(argv)
    if not a.url and not a.serve:
        ap.error("give --url of a running server or --serve CHECKPOINT...")
    if any(c < 1 for c in a.concurrency) or a.max_tokens < 1 or a.requests < 0 or a.repeat < 1:
        ap.error("--concurrency, --max-tokens and --repeat must be >= 1, --requests >= 0")
    prompts = default_prompts()

    def run(url: str) -> list[dict]:
        headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
        served = [m["id"] for m in httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"]]
        runs: dict[tuple[str, int], list[dict]] = {}
        for r in range(a.repeat):
            for model in a.models or served:
                for c in a.concurrency:
                    row = measure(url, model, c, a.requests or max(8, 2 * c), a.max_tokens, prompts, a.api_key)
                    print(json.dumps({"run": r, **row}), flush=True)
                    runs.setdefault((model, c), []).append(row)
        return [combine(rs) for rs in runs.values()]

    if a.url:
        rows = run(a.url.rstrip("/"))
    else:
        with started_server(a.serve, a.draft, max(a.concurrency), a.threads, a.compile, a.pack_weights,
                            a.prefix_cache_mb) as url:
            rows = run(url)
    print()
    print(table(rows))
    if a.json:
        with open(a.json, "w") as fh:
            for r in rows:
                fh.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
