"""The cost curve (`dlm bench --shape`): where a machine has idle compute, and what tau a drafter needs there.

Speculation and batching both bet that a forward over several new tokens (or several rows) costs about what one
token costs: the weights are read once either way, and at small batch the arithmetic units wait on memory or on
per-operator overhead. How far that holds is a property of the machine and the model's shape, so it is measured,
not assumed:

- `tokens`: one row, a forward of T new tokens over a cache of `context` tokens (what verifying a speculative block
  costs), relative to T = 1;
- `rows`: B rows, one new token each over their own caches (a batch of decodes), relative to B = 1; with
  `row_tokens` W, B rows of W new tokens each (a batch of diffusion blocks or speculative verifies of width W);
- the machine: memory bandwidth (reading and copying a large array) and matmul throughput (a large square matmul);
- decode at T = 1 as a fraction of the bandwidth limit (bytes of weights and K/V read per token over the read
  bandwidth);
- the break-even tau: a cycle verifies a block of T tokens (cost(T) target steps) after a draft pass of c target
  steps and yields tau tokens, so speculation pays when tau > cost(T) + c.

The model is random weights at a named shape (SHAPES), or any dlm checkpoint folder as stored. Each point is timed in
`repeat` rounds, the points' order rotated each round (as the side-by-side harness interleaves its methods) so a
burst of machine load falls on all of them; a point's figure is its fastest forward over all rounds (other work on the
machine only ever slows a forward down, so the fastest is the closest to the machine's own cost; `range` is the
spread of the rounds' fastest, the noise). On a machine that other work keeps busy, `clock="cpu"` times the process's
CPU time instead of the wall clock: at one thread that is the forward's own cost without the time it waited for a
core (a long forward is interrupted more often than a short one, so wall-clock ratios come out too high there).
"""

from __future__ import annotations

import copy
import os
import time
from pathlib import Path
from typing import Any

import torch

from dlm.config import PRESETS, ModelConfig
from dlm.errors import DlmError, check

# Named shapes: the public configs' sizes (random weights: nothing is downloaded). `layers` is the depth the shape is
# measured at when the full model would not fit a small machine (a cost per layer scales with depth).
SHAPES: dict[str, dict[str, Any]] = {
    "ar-small": dict(PRESETS["small"], vocab_size=4096),
    "ar-mid": dict(PRESETS["small"], vocab_size=4096, n_layers=16),
    "25m": dict(PRESETS["base"], vocab_size=4096),  # dim 512, 8 layers: ~27M
    "100m": dict(dim=768, n_layers=14, n_heads=12, n_kv_heads=6, ffn_dim=2304, vocab_size=4096, max_seq_len=2048),
    "qwen3-0.6b": dict(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=3072,
                       vocab_size=151936, rope_theta=1e6, max_seq_len=40960),
    "qwen3-1.7b": dict(dim=2048, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=6144,
                       vocab_size=151936, rope_theta=1e6, max_seq_len=40960),
    # LLaDA-8B's layer (full multi-head attention, no q/k norm, untied head), at reduced depth: 4 of its 32 layers
    "llada-8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=12288, vocab_size=126464,
                     rope_theta=5e5, qk_norm=False, tie_embeddings=False, max_seq_len=4096),
}
REDUCED_DEPTH = {"llada-8b": 4}
POINTS = (1, 2, 4, 8, 16, 32, 64)
DRAFT_COSTS = (0.0, 1 / 6, 0.5, 1.0)  # a draft pass's cost in target steps (break-even tau columns)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_dtype(dtype: str | None) -> torch.dtype:
    """--dtype: its torch dtype (None: float32), or a one-line error."""
    check(dtype is None or dtype in DTYPES, f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype or "float32"]


def shape_model(shape: str, layers: int = 0, device: str | torch.device = "cpu",
                dtype: str | None = None) -> tuple[torch.nn.Module, str]:
    """(model, label): random weights at a named shape (at `layers` depth if given; float32 unless `dtype`), or a
    checkpoint folder's model as stored (or cast to `dtype`)."""
    from dlm.model import Transformer, rope_inv_freq

    check(bool(shape.strip()), "--shape needs a named shape or a checkpoint folder, got ''")
    key = shape.lower()
    if key in SHAPES:
        fields = dict(SHAPES[key])
        depth = layers or REDUCED_DEPTH.get(key, fields["n_layers"])
        label = key if depth == fields["n_layers"] else f"{key} ({depth} of {fields['n_layers']} layers)"
        cfg = ModelConfig(**{**fields, "n_layers": depth})
        dt = DTYPES[dtype or "float32"]
        need, free = cfg.num_params() * dt.itemsize, available_bytes()
        if free is not None and torch.device(device).type == "cpu" and need > free:
            raise DlmError(f"--shape {key}: {need / 2**30:.1f} GiB of {dtype or 'float32'} weights, "
                           f"{free / 2**30:.1f} GiB of memory available (--layers N measures it at a smaller depth)")
        with torch.device("meta"):
            model = Transformer(cfg)
        model = model.to_empty(device=device).to(dt)
        with torch.no_grad():  # the values do not change the cost; fast to fill (no per-matrix init pass)
            g = torch.Generator(device=device).manual_seed(0)
            for p in model.parameters():
                if p.dim() == 1:
                    p.fill_(1.0)
                else:
                    p.uniform_(-0.02, 0.02, generator=g)
        model.inv_freq = rope_inv_freq(cfg).to(device)
        if cfg.tie_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        return model.eval(), label
    if Path(shape).is_dir():
        from dlm.checkpoint import load_model, open_checkpoint

        ck = open_checkpoint(shape, "--shape")
        if ck.objective == "dflash":
            raise DlmError(f"--shape {shape}: a DFlash drafter runs inside its target's cycle; measure the target "
                           "(its draft share: dlm bench --draft)")
        check(not layers, "--layers sets the depth of a named --shape, not of a checkpoint")
        model, _ = load_model(shape, device=device)
        return (model.to(DTYPES[dtype]) if dtype else model), str(shape)
    raise DlmError(f"--shape must be one of {', '.join(SHAPES)} or a checkpoint folder, got {shape!r}")


def dtype_of(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def timed(fn, inner: int, device: torch.device, clock: str = "wall") -> float:
    """Seconds of the fastest of `inner` calls (after the caller's warm-up)."""
    now, ts = CLOCKS[clock], []
    for _ in range(inner):
        sync(device)
        t = now()
        fn()
        sync(device)
        ts.append(now() - t)
    return min(ts)


def machine(device: torch.device, mb: int = 256, n: int = 2048, inner: int = 3, clock: str = "wall",
            dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Memory bandwidth (GB/s: reading an array of `mb` MB, copying it) and matmul throughput (GFLOP/s: n x n in
    `dtype`, random values)."""
    x = torch.rand(mb * 2**20 // 4, device=device)
    y = torch.empty_like(x)
    a, b = (torch.rand(n, n, device=device, dtype=dtype) for _ in range(2))
    for f in (lambda: x.sum(), lambda: y.copy_(x), lambda: a @ b):
        f()  # warm-up: page the arrays in, pick the kernels
    read = timed(lambda: x.sum(), inner, device, clock)
    copy = timed(lambda: y.copy_(x), inner, device, clock)
    mm = timed(lambda: a @ b, inner, device, clock)
    nbytes = x.numel() * 4
    return {"read_gb_s": nbytes / read / 1e9, "copy_gb_s": 2 * nbytes / copy / 1e9,
            "matmul_gflop_s": 2 * n**3 / mm / 1e9,
            "array_mb": mb, "matmul_n": n, "matmul_dtype": str(dtype).removeprefix("torch."),
            "last_cache_bytes": last_cache_bytes() if device.type == "cpu" else None}


def kv_bytes(cfg: ModelConfig, rows: int, tokens: int, itemsize: int) -> int:
    return 2 * cfg.n_layers * rows * cfg.n_kv_heads * tokens * cfg.head_dim * itemsize


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights a one-token forward reads: every matrix, but of an untied input embedding only its row."""
    cfg = model.cfg
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not cfg.tie_embeddings:
        w = model.embed_tokens.weight
        total -= (w.shape[0] - 1) * w.shape[1] * w.element_size()
    return total


def last_cache_bytes() -> int | None:
    """The CPU's last-level cache (Linux sysfs), or None where it cannot be read."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    best = None
    for idx in sorted(base.glob("index*")) if base.is_dir() else []:
        try:
            size = (idx / "size").read_text().strip()
            level = int((idx / "level").read_text())
        except (OSError, ValueError):
            continue
        mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:], 1)
        if size.rstrip("KMG").isdigit() and (best is None or level >= best[0]):
            best = (level, int(size.rstrip("KMG")) * mult)
    return best[1] if best else None


def available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


@torch.inference_mode()
def run_cost(shape: str, context: int = 256, points: tuple[int, ...] = POINTS, repeat: int = 3, inner: int = 5,
             layers: int = 0, out: str | None = None, device: str = "auto", machine_mb: int = 256,
             clock: str = "wall", quiet: bool = False, dtype: str | None = None,
             row_tokens: int = 1, col_major: bool = False) -> dict[str, Any]:
    """Measure the cost curve of one shape; print the tables, write the JSON report (and the PNG beside it).
    col_major: the linear weights stored column-major (dlm.model.column_major)."""
    from dlm.bench.harness import environment, write_json
    from dlm.device import resolve_device

    check(context >= 1, f"--context must be >= 1, got {context}")
    check(repeat >= 1, f"--repeat must be > 0, got {repeat}")
    check(bool(points) and all(p >= 1 for p in points), f"--points must be integers >= 1, got {list(points)}")
    check(clock in CLOCKS, f"--clock must be wall or cpu, got {clock!r}")
    check_dtype(dtype)
    check(row_tokens >= 1, f"--row-tokens must be >= 1, got {row_tokens}")
    points = tuple(sorted(set(points) | {1}))
    if out:
        from dlm.files import check_out_file

        check_out_file(out, "--out")
    dev = resolve_device(device)
    check(clock == "wall" or dev.type == "cpu",
          "--clock cpu times a CPU run; a GPU's forward is timed by the wall clock")
    load_before = os.getloadavg()
    model, label = shape_model(shape, layers, dev, dtype)
    if col_major:
        from dlm.model import column_major

        column_major(model)
        label += " (column-major)"
    cfg = model.cfg
    widest = max(max(points), row_tokens)  # the most new tokens of one row
    check(context + widest <= cfg.max_seq_len,
          f"--context {context} + {widest} new tokens exceeds the model's max_seq_len {cfg.max_seq_len}")
    itemsize = next(model.parameters()).element_size()
    dtype = next(model.parameters()).dtype
    free = available_bytes()

    def cached(rows: int, capacity: int):
        cache = model.new_cache(rows, capacity)
        if hasattr(cache, "k"):  # the values do not change the cost: random K/V instead of a prefill
            g = torch.Generator(device=dev).manual_seed(1)
            cache.k.normal_(generator=g)
            cache.v.normal_(generator=g)
        else:  # a family's own cache: fill it with a real prefill
            model(torch.randint(0, cfg.vocab_size, (rows, context), device=dev), cache=cache, head=False)
        cache.length = context
        return cache

    # the measurements: ("tokens", T) -> one row, T new tokens; ("rows", B) -> B rows, row_tokens new tokens each
    todo, skipped = [], []
    for kind in ("tokens", "rows"):
        for n in points:
            new = n if kind == "tokens" else row_tokens
            need = kv_bytes(cfg, n if kind == "rows" else 1, context + new, itemsize)
            if free is not None and dev.type == "cpu" and need > free // 2:
                skipped.append({"kind": kind, "n": n, "why": f"its K/V cache needs {need / 2**30:.1f} GiB, "
                                f"{free / 2**30:.1f} GiB available"})
            else:
                todo.append((kind, n))
    # one cache for the most rows, sized for the longest block; fewer rows read its first rows (each layer's slice of
    # the first B rows is laid out as a cache of B rows would be), so the K/V memory is that of the largest point
    need_rows = sorted({n if kind == "rows" else 1 for kind, n in todo})
    full = cached(need_rows[-1], context + widest)
    caches = {}
    for rows in need_rows:
        if hasattr(full, "k"):
            caches[rows] = copy.copy(full)
            caches[rows].k, caches[rows].v = full.k[:, :rows], full.v[:, :rows]
        else:  # a family's own cache: one per row count
            caches[rows] = full if rows == need_rows[-1] else cached(rows, context + widest)
    inputs = {(k, n): torch.randint(0, cfg.vocab_size, (n, row_tokens) if k == "rows" else (1, n),
                                    generator=torch.Generator().manual_seed(n)).to(dev) for k, n in todo}

    def forward(kind: str, n: int) -> None:
        cache = caches[n if kind == "rows" else 1]
        cache.length = context
        model(inputs[(kind, n)], cache=cache)  # the logits of every new token: what a verify step reads

    for k, n in todo:  # warm-up
        forward(k, n)
    rounds: dict[tuple[str, int], list[float]] = {p: [] for p in todo}
    for r in range(repeat):
        for j in range(len(todo)):
            k, n = todo[(r + j) % len(todo)]
            rounds[(k, n)].append(timed(lambda: forward(k, n), inner, dev, clock))
    secs = {p: min(v) for p, v in rounds.items()}
    spread = {p: (min(v), max(v)) for p, v in rounds.items()}
    del caches, full
    # the matmul in the model's dtype; on a GPU large enough to fill the chip
    mach = machine(dev, machine_mb, n=8192 if dev.type == "cuda" else 2048, clock=clock, dtype=dtype_of(model))
    load_after = os.getloadavg()

    one = secs[("tokens", 1)]  # each curve against its own n = 1 (the same forward, timed in its own slots)
    curve = {kind: [{"n": n, "seconds": secs[(kind, n)], "ratio": secs[(kind, n)] / secs[(kind, 1)],
                     "range": list(spread[(kind, n)]),
                     "tokens_per_second": n * (row_tokens if kind == "rows" else 1) / secs[(kind, n)]}
                    for (k2, n) in todo if k2 == kind] for kind in ("tokens", "rows")}
    per_token = weight_bytes_per_token(model) + kv_bytes(cfg, 1, context, itemsize)
    limit = mach["read_gb_s"] * 1e9 / per_token
    decode = {"tokens_per_second": 1 / one, "bytes_per_token": per_token, "weight_bytes": weight_bytes_per_token(model),
              "kv_bytes": kv_bytes(cfg, 1, context, itemsize), "limit_tokens_per_second": limit,
              "fraction_of_limit": (1 / one) / limit,
              # weights and K/V that fit the last-level cache are not read from memory each token: no DRAM bound
              "fits_in_cache": bool(mach["last_cache_bytes"] and per_token <= mach["last_cache_bytes"])}
    break_even = [{"block": row["n"], "cost": row["ratio"],
                   "tau": {f"{c:.3g}": row["ratio"] + c for c in DRAFT_COSTS},
                   "tau_for_2x": {f"{c:.3g}": 2 * (row["ratio"] + c) for c in DRAFT_COSTS}}
                  for row in curve["tokens"] if row["n"] > 1]
    report = {"shape": label, "config": cfg.to_dict(), "params": sum(p.numel() for p in model.parameters()),
              "dtype": str(dtype).removeprefix("torch."), "device": str(dev), "context": context,
              "row_tokens": row_tokens, "repeat": repeat, "inner": inner, "clock": clock, "tokens": curve["tokens"],
              "rows": curve["rows"], "skipped": skipped,
              "machine": mach,
              "decode": decode, "break_even": break_even,
              "load_average": {"before": list(load_before), "after": list(load_after)}, "environment": environment()}
    if not quiet:
        print_cost(report)
    if out:
        write_json(out, report)
        png = Path(out).with_suffix(".png")
        why = plot_cost(report, png)
        if not quiet:
            print(f"plot: {png}" if why is None else f"plot: none ({why})")
    return report


def print_cost(r: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=max(120, Console().width))
    m, d = r["machine"], r["decode"]
    con.print(f"[bold]{r['shape']}[/]: {r['params'] / 1e6:.1f}M parameters, {r['dtype']}, {r['device']}, "
              f"{r['environment']['threads']} threads, {r['clock']} clock; cache of {r['context']} tokens; "
              "load average "
              f"{r['load_average']['before'][0]:.2f} before, {r['load_average']['after'][0]:.2f} after")
    t = Table(title="cost of one forward relative to one token of one row (the fastest of "
                    f"{r['repeat']} interleaved rounds of {r['inner']} forwards)")
    for col in ("n", "T new tokens", "ms", f"B rows x {r.get('row_tokens', 1)} tokens", "ms", "rows: tok/s"):
        t.add_column(col, justify="right")
    by = {k: {row["n"]: row for row in r[k]} for k in ("tokens", "rows")}
    for n in sorted(set(by["tokens"]) | set(by["rows"])):
        tk, rw = by["tokens"].get(n), by["rows"].get(n)
        t.add_row(str(n), f"{tk['ratio']:.2f}x" if tk else "–", f"{tk['seconds'] * 1e3:.1f}" if tk else "–",
                  f"{rw['ratio']:.2f}x" if rw else "–", f"{rw['seconds'] * 1e3:.1f}" if rw else "–",
                  f"{rw['tokens_per_second']:.0f}" if rw else "–")
    con.print(t)
    for s in r["skipped"]:
        con.print(f"[dim]skipped {s['kind']} {s['n']}: {s['why']}[/]")
    con.print(f"machine: read {m['read_gb_s']:.1f} GB/s, copy {m['copy_gb_s']:.1f} GB/s, matmul "
              f"{m['matmul_gflop_s']:.0f} GFLOP/s ({m.get('matmul_dtype', 'float32')} {m['matmul_n']}^2)")
    con.print(f"decode: {d['tokens_per_second']:.1f} tok/s = {d['fraction_of_limit']:.0%} of the bandwidth limit "
              f"({d['limit_tokens_per_second']:.1f} tok/s: {d['bytes_per_token'] / 1e6:.1f} MB of weights and K/V "
              "per token)" + (f"; they fit the {r['machine']['last_cache_bytes'] / 2**20:.0f} MiB last-level cache, "
                               "so memory bandwidth does not bound it" if d["fits_in_cache"] else ""))
    if r["break_even"]:
        b = Table(title="break-even tau (tokens per cycle) for a block of T tokens after a draft pass of c target "
                        "steps: cost(T) + c; 2x needs twice that")
        b.add_column("T", justify="right")
        b.add_column("cost(T)", justify="right")
        for c in DRAFT_COSTS:
            b.add_column(f"c = {c:.2g}", justify="right")
        b.add_column("2x at c = 1/6", justify="right")
        for row in r["break_even"]:
            b.add_row(str(row["block"]), f"{row['cost']:.2f}", *[f"{v:.2f}" for v in row["tau"].values()],
                      f"{row['tau_for_2x'][f'{1 / 6:.3g}']:.2f}")
        con.print(b)


def plot_cost(r: dict[str, Any], path: Path) -> str | None:
    """The two curves against the number of new tokens / rows (log-log), with the free (1x) and the compute-bound
    (n x) lines. None when written, else why not."""
    from dlm.bench.tables import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return "matplotlib is not installed: pip install 'dlm[plot]'"
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ns = sorted({row["n"] for k in ("tokens", "rows") for row in r[k]})
    ax.plot(ns, [1] * len(ns), ":", color="gray", label="free (1x)")
    ax.plot(ns, ns, "--", color="gray", label="proportional (n x)")
    for k, label in (("tokens", "1 row, T new tokens"), ("rows", f"B rows x {r.get('row_tokens', 1)} tokens")):
        if r[k]:
            ax.plot([row["n"] for row in r[k]], [row["ratio"] for row in r[k]], "o-", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("new tokens T / rows B")
    ax.set_ylabel("cost relative to one token")
    ax.set_title(f"{r['shape']} ({r['params'] / 1e6:.1f}M, {r['dtype']}), cache {r['context']}, {r['device']}, "
                 f"{r['environment']['threads']} threads, {r['clock']} clock", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(plt, fig, path)
    return None
