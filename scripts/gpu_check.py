"""The GPU figures of docs/BENCHMARKS.md (section "On a GPU"), in one run on a CUDA machine.

    python scripts/gpu_check.py OUT_DIR [--refs DIR] [--budget SECONDS]

Each part is timed on its own and writes its result into OUT_DIR/gpu.json as soon as it ends, so a run cut short
keeps what it measured; a part that fails records its error and the next one runs. The parts:

- machine: the device, a device-to-device copy (GB/s, bytes read plus written), a bf16 8192^3 matmul (TFLOP/s);
- devices: the shipped checkpoints' greedy `dlm generate` on cuda against the CPU's output recorded in --refs
  (cpu-NAME.json, written by `dlm generate ... --json --device cpu` with the same arguments, listed in cases.sh);
- decode: AR decode at batch 1 on Qwen3-0.6B's shape (random bf16 weights made by transformers): dlm's decode loop
  against transformers' `generate` on the same weights, greedy, 256 new tokens; the bandwidth limit beside them;
- cost: `dlm bench --shape` at bf16 for qwen3-0.6b, qwen3-1.7b and llada-8b at full depth (the cost of verifying
  T tokens relative to one decode step), and a draft pass modelled as 1 and 5 target-shaped layers over 16 tokens;
- usdm: one 256-token canvas at 16 and 48 denoising steps on Qwen3-0.6B's shape (self-conditioned denoiser);
- train: `dlm train --preset base` under torchrun with FSDP2 on one GPU, bf16, AR and mdlm: tokens/s and MFU;
- pair (pair_bf16: in bfloat16): the shipped pair (ar-mid, dflash2-mid) in `dlm bench --device cuda` (the target alone
  replays CUDA graphs, the speculative loop is eager), beside ar-mid's eager and graphed decode on a code prompt;
- cycle: ar-mid's step of T = 1..16 new tokens eager and replayed from a CUDA graph, and one target-shaped layer's
  (a DFlash drafter's pass): what a graphed speculative loop would pay per cycle;
- tests: the tests that take a device (`pytest --device cuda`: the CUDA-graph step, the speculative loop's
  greedy exactness).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PEAK_BF16 = {"H100": 989e12, "H200": 989e12}  # dense bf16 tensor-core peak (datasheet, SXM)
# GPU_CHECK_DRY=1: the same glue on the CPU at toy sizes (checks the script, not the machine)
DRY = os.environ.get("GPU_CHECK_DRY") == "1"
DEV = "cpu" if DRY else "cuda"


def sync() -> None:
    if not DRY:
        torch.cuda.synchronize()


def cuda_time(fn, n: int = 5) -> float:
    """Median seconds of n calls, after one warm-up call."""
    fn()
    sync()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2]


def part_machine() -> dict:
    n, size = (1024, 2**24) if DRY else (8192, 2**29)
    x = torch.randn(size, device=DEV, dtype=torch.bfloat16)  # 1 GiB
    y = torch.empty_like(x)
    t = cuda_time(lambda: y.copy_(x), 10)
    a, b = (torch.randn(n, n, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    mm = cuda_time(lambda: a @ b, 10)
    import transformers

    p = None if DRY else torch.cuda.get_device_properties(0)
    return {"name": p.name if p else "cpu", "sms": p.multi_processor_count if p else None,
            "memory_gib": p.total_memory / 2**30 if p else None, "torch": torch.__version__, "transformers": transformers.__version__,
            "copy_gb_s": 2 * x.numel() * 2 / t / 1e9, "matmul_bf16_tflop_s": 2 * n**3 / mm / 1e12}


def part_devices(refs: Path, out: Path) -> dict:
    """Greedy generate on cuda against the recorded CPU output, per shipped checkpoint."""
    prompt = 'def parse_args(argv):\n    """Parse the command line."""\n'
    rows = {}
    for line in (refs / "cases.sh").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        name, args = line.split("|", 1)
        cmd = [sys.executable, "-m", "dlm", "generate", *args.split(), "--prompt", prompt, "--max-new-tokens", "48",
               "--temperature", "0", "--json", "--device", DEV]
        t = time.time()
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
        row = {"rc": r.returncode, "seconds": time.time() - t}
        if r.returncode:
            row["stderr"] = r.stderr[-600:]
        else:
            if DRY:  # the CPU's outputs: the references of a GPU run
                (out / f"{DEV}-{name}.json").write_text(r.stdout)
            gpu = json.loads(r.stdout)
            row["text"] = gpu["text"]
            cpu = json.loads((refs / f"cpu-{name}.json").read_text())
            row["same_text"] = gpu["text"] == cpu["text"]
            n = 0
            while n < min(len(gpu["text"]), len(cpu["text"])) and gpu["text"][n] == cpu["text"][n]:
                n += 1
            row["common_prefix_chars"] = n
            row["chars"] = [len(cpu["text"]), len(gpu["text"])]
            row["stats"] = {k: gpu.get(k) for k in ("new_tokens", "forwards", "tokens_per_forward", "acceptance")}
        rows[name] = row
    return rows


def qwen3_pair():
    """(transformers model, dlm model) on the GPU in bf16 with the same random weights, Qwen3-0.6B's config."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dlm.families import BY_NAME
    from dlm.hf import import_tensors
    from dlm.hf_layout import model_config_from_hf
    from dlm.model import Transformer, param_shapes

    hc = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                     num_hidden_layers=2 if DRY else 28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                     max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
                     bos_token_id=151643, eos_token_id=151645)
    torch.manual_seed(0)
    with torch.device(DEV):
        hf = Qwen3ForCausalLM(hc).to(torch.bfloat16).eval()
    cfg = model_config_from_hf(hc.to_dict(), Path("config.json"))
    src = Path("qwen3-0.6b")
    expected, aliases = param_shapes(cfg)  # the qwen3 row's names, as `dlm import --hf` reads them
    lazy, _ = import_tensors(BY_NAME["qwen3"], cfg, expected, aliases, hf.state_dict(), src)
    state = {k: t.make() for k, t in lazy.items()}
    with torch.device(DEV):
        model = Transformer(cfg).to(torch.bfloat16).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    return hf, model


@torch.inference_mode()
def part_decode(new: int = 16 if DRY else 256) -> dict:
    from dlm.bench.cost import weight_bytes_per_token
    from dlm.sampling.ar import decode
    from dlm.sampling.common import Commit

    hf, model = qwen3_pair()
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 151000, (32,), generator=g).tolist()

    def ours(n: int) -> list[int]:
        return [t for ev in decode(model, [prompt], n, eos_id=None) if isinstance(ev, Commit) for t in ev.tokens]

    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    ids = torch.tensor([prompt], device=DEV)

    def theirs(n: int) -> list[int]:
        o = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return o[0, len(prompt):].tolist()

    res = {}
    for name, fn in (("dlm", ours), ("transformers", theirs), ("dlm_again", ours), ("transformers_again", theirs)):
        fn(16)  # warm-up
        sync()
        t = time.perf_counter()
        toks = fn(new)
        sync()
        res[name] = {"seconds": time.perf_counter() - t, "tokens": len(toks), "ids": toks}
        res[name]["tok_s"] = len(toks) / res[name]["seconds"]
    a, b = res["dlm"]["ids"], res["transformers"]["ids"]
    same = 0
    while same < min(len(a), len(b)) and a[same] == b[same]:
        same += 1
    for v in res.values():
        del v["ids"]
    wb = weight_bytes_per_token(model)
    kv = 2 * model.cfg.n_layers * model.cfg.n_kv_heads * model.cfg.head_dim * 2 * (32 + new // 2)  # mean context
    res.update({"greedy_common_prefix": same, "new_tokens": new, "weight_bytes": wb, "kv_bytes_mean": kv})
    return res


@torch.inference_mode()
def part_graphs(new: int = 16 if DRY else 256) -> dict:
    """dlm's decode loop, eager against CUDA-graph steps (dlm.sampling.graphs), batch 1 and 16, Qwen3-0.6B's shape;
    and one replayed step alone."""
    from dlm.bench.cost import shape_model
    from dlm.sampling.ar import decode
    from dlm.sampling.common import Commit
    from dlm.sampling.graphs import StepGraph

    model, _ = shape_model("ar-small" if DRY else "qwen3-0.6b", device=DEV, dtype="bfloat16")
    g = torch.Generator().manual_seed(0)
    res = {}
    for B in (1, 16):
        prompts = [torch.randint(0, 4000, (32,), generator=g).tolist() for _ in range(B)]
        ids = {}
        for mode in ("eager", "graphs", "eager_again", "graphs_again"):
            graphs = mode.startswith("graphs")
            list(decode(model, prompts, 8, eos_id=None, cuda_graphs=graphs))  # warm-up
            sync()
            t = time.perf_counter()
            toks = [tk for ev in decode(model, prompts, new, eos_id=None, cuda_graphs=graphs)
                    if isinstance(ev, Commit) for tk in ev.tokens]
            sync()
            sec = time.perf_counter() - t
            res[f"b{B}_{mode}"] = {"seconds": sec, "tok_s": len(toks) / sec}
            ids[mode] = toks
        res[f"b{B}_same_tokens"] = ids["eager"] == ids["graphs"]
    cache = model.new_cache(1, 512)
    cache.length = 256
    step = StepGraph(model, cache, capture=not DRY)
    tok, pos = torch.zeros(1, dtype=torch.long, device=DEV), torch.full((1,), 256, device=DEV)
    valid = torch.zeros(1, 512, dtype=torch.bool, device=DEV)
    valid[:, :257] = True

    def one():
        cache.length = 256
        step(tok, pos, valid)

    res["one_step_ms"] = cuda_time(one, 50) * 1e3
    step.close()
    return res


@torch.inference_mode()
def part_graphs_fp32() -> dict:
    """Graphed against eager decode in float32, greedy, 16 rows of unequal prompts (left-padded): the shipped ar-small
    and Qwen3-0.6B's shape (random weights); the tokens should agree but at exact ties."""
    from dlm.bench.cost import shape_model
    from dlm.checkpoint import load_model
    from dlm.sampling.ar import decode
    from dlm.sampling.common import Commit

    res = {}
    g = torch.Generator().manual_seed(1)
    for name in ("ar-small", "qwen3-0.6b"):
        if name == "ar-small":
            model, _ = load_model(ROOT / "checkpoints" / "ar-small", device=DEV)
        else:
            model, _ = shape_model("ar-small" if DRY else name, device=DEV)
        lengths = torch.randint(3, 40, (16,), generator=g).tolist()
        prompts = [torch.randint(5, 4000, (n,), generator=g).tolist() for n in lengths]
        out = {}
        for graphs in (False, True):
            out[graphs] = [(ev.row, ev.tokens[0]) for ev in decode(model, prompts, 64, eos_id=None, cuda_graphs=graphs)
                           if isinstance(ev, Commit)]
        res[name] = {"same": out[False] == out[True], "tokens": len(out[False]),
                     "rows_equal": sum(all(a == b for (ra, a), (rb, b) in zip(out[False], out[True]) if ra == r)
                                       for r in range(16))}
        del model
    return res


@torch.inference_mode()
def part_graph_curve() -> dict:
    """The cost curve with graphed steps: T new tokens over a cache of 256 (a verify of T), relative to T = 1."""
    from dlm.bench.cost import shape_model
    from dlm.sampling.graphs import StepGraph

    res = {}
    for shape in ("ar-small",) if DRY else ("qwen3-0.6b", "qwen3-1.7b", "llada-8b"):
        if not DRY:
            torch.cuda.empty_cache()
        model, _ = shape_model(shape, layers=32 if shape == "llada-8b" else 0, device=DEV, dtype="bfloat16")
        curve = {}
        for T in (1, 2, 4, 8, 16, 32, 64):
            cache = model.new_cache(1, 256 + T)
            cache.length = 256
            st = StepGraph(model, cache, capture=not DRY, tokens=T)
            tok = torch.randint(0, 1000, (1, T), device=DEV)
            p = torch.arange(256, 256 + T, device=DEV)[None]
            mask = torch.ones(1, T, 256 + T, dtype=torch.bool, device=DEV).tril(256)

            def run():
                cache.length = 256
                st(tok, p, mask)

            curve[T] = cuda_time(run, 30) * 1e3
            st.close()
        res[f"graphed_curve_{shape}_ms"] = curve
        res[f"graphed_curve_{shape}_ratio"] = {T: v / curve[1] for T, v in curve.items()}
        del model
    return res


@torch.inference_mode()
def part_static(new: int = 16 if DRY else 256) -> dict:
    """transformers' generate with a static cache (it compiles the decode step, CUDA graphs included): the
    ceiling a compiled decode loop reaches on this shape, beside the eager loops of part_decode."""
    hf, model = qwen3_pair()
    del model
    prompt = torch.randint(0, 151000, (1, 32), generator=torch.Generator().manual_seed(0)).to(DEV)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    res = {}
    for name in ("first", "second", "third"):  # the first call compiles
        sync()
        t = time.perf_counter()
        o = hf.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static")
        sync()
        res[name] = {"seconds": time.perf_counter() - t, "tok_s": (o.shape[1] - 32) / (time.perf_counter() - t)}
    return res


def part_cost(out: Path) -> dict:
    from dlm.bench.cost import run_cost

    res = {}
    for shape in ("ar-small",) if DRY else ("qwen3-0.6b", "qwen3-1.7b", "llada-8b"):
        layers = 32 if shape == "llada-8b" else 0
        r = run_cost(shape, context=256, points=(1, 2, 4, 8, 16, 32, 64), repeat=3, inner=10, layers=layers,
                     out=str(out / f"cost-{shape}.json"), device=DEV, dtype="bfloat16", quiet=True)
        res[shape] = {"tokens": {row["n"]: row["ratio"] for row in r["tokens"]},
                      "rows": {row["n"]: row["ratio"] for row in r["rows"]},
                      "one_token_ms": r["tokens"][0]["seconds"] * 1e3, "decode": r["decode"], "machine": r["machine"]}
    # a draft pass: k target-shaped layers over a block of 16 new tokens (context 256), head included
    from dlm.bench.cost import shape_model

    first = next(iter(res))
    full = res[first]["one_token_ms"]
    for k in (1, 5):
        m, _ = shape_model(first, layers=k, device=DEV, dtype="bfloat16")
        cache = m.new_cache(1, 300)
        cache.length = 256
        x = torch.randint(0, 1000, (1, 16), device=DEV)

        def run():
            cache.length = 256
            with torch.inference_mode():
                m(x, cache=cache)

        t = cuda_time(run, 20) * 1e3
        res[f"draft_{k}_layers_ms"] = t
        res[f"draft_{k}_layers_in_target_steps"] = t / full
        del m, cache
    return res


@torch.inference_mode()
def part_usdm() -> dict:
    from dlm.bench.cost import SHAPES
    from dlm.config import ModelConfig
    from dlm.model import Transformer
    from dlm.sampling.usdm import denoise, logits_entropy

    cfg = ModelConfig(**{**SHAPES["qwen3-0.6b"], "self_cond": True, **({"n_layers": 2} if DRY else {})})
    torch.manual_seed(0)
    with torch.device(DEV):
        model = Transformer(cfg).to(torch.bfloat16).eval()
    prompt = torch.randint(0, 151000, (1, 64), device=DEV)
    L = 32 if DRY else 256
    res = {}
    for steps in (2, 4) if DRY else (16, 48):
        def canvas_run():
            cache = model.new_cache(1, 64 + L)
            model(prompt, cache=cache, head=False)
            canvas = torch.randint(0, 151000, (1, L), device=DEV)
            pos = torch.arange(64, 64 + L, device=DEV)
            prev = None
            for _ in range(steps):
                logits = denoise(model, cache, canvas, pos, prev)  # (1, L, V)
                prev = torch.softmax(logits, -1).to(torch.bfloat16)
                canvas = torch.where(logits_entropy(logits) < 2.0, logits.argmax(-1), canvas)

        t = cuda_time(canvas_run, 3)
        res[f"steps_{steps}"] = {"seconds": t, "tok_s": L / t, "step_ms": t / steps * 1e3}
    return res


def part_train() -> dict:
    res = {}
    for objective, batch in (("ar", 16), ("ar", 64), ("mdlm", 64)):
        out = Path(f"/tmp/train-{objective}-{batch}")
        cmd = ["torchrun", "--standalone", "--nproc-per-node", "1", "-m", "dlm", "train", "--preset", "base",
               "--objective", objective, "--fsdp", "--device", DEV, "--dtype", "bf16", "--data", "dlm",
               "--tokenizer", "checkpoints/ar-small", "--batch-size", str(batch // 8 if DRY else batch),
               "--max-steps", "12" if DRY else "60",
               "--log-every", "10", "--eval-every", "1000", "--save-every", "1000", "--warmup", "5", "--out",
               str(out), "--quiet"]
        t = time.time()
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=240)
        row = {"rc": r.returncode, "wall_s": time.time() - t}
        if r.returncode:
            row["stderr"] = r.stderr[-1500:]
        else:
            rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
            tps = [x["tokens_per_second"] for x in rows if "tokens_per_second" in x][1:]  # the first holds warm-up
            cfg = json.loads((out / "config.json").read_text())
            from dlm.config import ModelConfig

            n = ModelConfig.from_dict(cfg["model"]).num_params()
            med = sorted(tps)[len(tps) // 2] if tps else None
            name = "cpu" if DRY else torch.cuda.get_device_name(0)
            peak = next((v for k, v in PEAK_BF16.items() if k in name), 989e12)
            row.update({"params": n, "tokens_per_second": med, "all_tps": tps, "batch_tokens": batch * 256,
                        "mfu_6N": 6 * n * med / peak if med else None, "loss_last": rows[-1].get("loss")})
        res[f"{objective}-b{batch}"] = row
    return res


def part_pair(out: Path, dtype: str | None = None) -> dict:
    from dlm.bench import run_bench
    from dlm.checkpoint import load_model
    from dlm.sampling.ar import decode

    drafts = ["checkpoints/dflash2-mid", "checkpoints/dflash2-mid@x3", "checkpoints/dflash2-mid+lookup", "lookup",
              "checkpoints/ar-draft"]  # (@x3: a draft tree, docs/log/dflash.md, whose verify a GPU may take for free)
    n, new = (2, 16) if DRY else (8, 128)
    rep = run_bench("checkpoints/ar-mid", prompts=n, max_new_tokens=new, out=str(out / f"pair-{dtype or 'fp32'}.json"),
                    naive=False, mdlm=None, usdm=None, draft=drafts, temperatures=(0.0, 1.0), repeat=2, device=DEV,
                    dtype=dtype)
    keep = ("method", "tokens_per_second", "tokens_per_forward", "speedup", "speedup_range", "tau", "lossless",
            "temperature")
    res = {"rows": [{k: s.get(k) for k in keep if k in s} for s in rep["summaries"]]}
    # the target alone, eager and graphed, on a code prompt, greedy, <eos> off
    model, ck = load_model("checkpoints/ar-mid", device=DEV, dtype=getattr(torch, dtype or "float32"))
    prompts = [ck.tokenizer.encode((ROOT / "dlm" / "sampling" / "ar.py").read_text()[:800])]
    with torch.inference_mode():
        for name, graphs in (("eager", False), ("graphed", not DRY)):
            t = cuda_time(lambda: list(decode(model, prompts, new, eos_id=None, cuda_graphs=graphs)), 5)
            res[f"ar_{name}_tok_s"] = new / t
    return res


@torch.inference_mode()
def part_cycle(dtype: str = "float32") -> dict:
    """Seconds of ar-mid's step of T new tokens over a 200-token cache, eager and graphed, and of one
    target-shaped layer with the head (a one-layer DFlash drafter's pass over its block)."""
    from dlm.bench.cost import shape_model
    from dlm.sampling.graphs import StepGraph

    res = {}
    for name, (shape, layers) in {"ar-mid": ("checkpoints/ar-mid", 0), "one_layer": ("ar-mid", 1)}.items():
        m, _ = shape_model(shape, layers=layers, device=DEV, dtype=dtype)
        ctx, cap = 200, 512
        for T in (1, 2, 4, 8, 16):
            cache = m.new_cache(1, cap)
            m(torch.randint(0, 4000, (1, ctx), device=DEV), cache=cache)
            x = torch.randint(0, 4000, (1, T), device=DEV)
            pos = torch.arange(ctx, ctx + T, device=DEV)[None]

            def eager():
                cache.length = ctx
                m(x, pos=pos, cache=cache)

            row = {"eager_ms": cuda_time(eager, 30) * 1e3}
            cache.length = ctx
            step = StepGraph(m, cache, capture=not DRY, tokens=T)
            mask = torch.ones(1, T, cap, dtype=torch.bool, device=DEV).tril(ctx)

            def graphed():
                cache.length = ctx
                step(x, pos, mask)

            row["graphed_ms"] = cuda_time(graphed, 30) * 1e3
            step.close()
            res[f"{name}_T{T}"] = row
    return res


def part_cycle_tf32() -> dict:
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        return part_cycle()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = False


@torch.inference_mode()
def part_cycle_profile() -> dict:
    """The CUDA kernels of ar-mid's eager step of 1 and of 8 new tokens (float32): which ones grow with T."""
    from torch.profiler import ProfilerActivity, profile

    from dlm.bench.cost import shape_model

    m, _ = shape_model("checkpoints/ar-mid", device=DEV, dtype="float32")
    res = {}
    for T in (1, 8):
        cache = m.new_cache(1, 512)
        m(torch.randint(0, 4000, (1, 200), device=DEV), cache=cache)
        x = torch.randint(0, 4000, (1, T), device=DEV)
        pos = torch.arange(200, 200 + T, device=DEV)[None]
        mask = torch.ones(1, 1, T, 512, dtype=torch.bool, device=DEV).tril(200)
        cache.slot = torch.arange(T, device=DEV) + 200  # the graphed step's form: every slot under a mask
        for _ in range(3):
            cache.length = 200
            m(x, pos=pos, cache=cache, mask=mask)
        sync()
        with profile(activities=[ProfilerActivity.CUDA] if not DRY else [ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                cache.length = 200
                m(x, pos=pos, cache=cache, mask=mask)
            sync()
        cache.slot = None
        ev = sorted(prof.key_averages(), key=lambda e: -getattr(e, "device_time_total", 0))[:12]
        res[f"T{T}"] = [(e.key[:90], e.count, round(getattr(e, "device_time_total", 0) / 5, 1)) for e in ev]
    return res


def part_tests() -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_graphs.py",
           "tests/test_speculative.py", "--device", DEV, "-k", "not distribution"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    return {"rc": r.returncode, "tail": r.stdout[-3000:] + r.stderr[-1500:]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--refs", default="")
    ap.add_argument("--budget", type=float, default=480)
    ap.add_argument("--parts", default="machine,decode,cost,usdm,train,devices,static")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    start, res = time.time(), {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    parts = {"machine": part_machine, "devices": lambda: part_devices(Path(a.refs), out), "decode": part_decode,
             "cost": lambda: part_cost(out), "usdm": part_usdm, "train": part_train, "static": part_static,
             "graphs": part_graphs, "graph_curve": part_graph_curve,
             "graphs_fp32": part_graphs_fp32, "pair": lambda: part_pair(out),
             "pair_bf16": lambda: part_pair(out, "bfloat16"), "cycle": part_cycle,
             "cycle_bf16": lambda: part_cycle("bfloat16"), "cycle_tf32": part_cycle_tf32,
             "cycle_profile": part_cycle_profile, "tests": part_tests}
    for name in a.parts.split(","):
        if time.time() - start > a.budget:
            res[name] = {"skipped": "out of time"}
            continue
        t = time.time()
        try:
            res[name] = parts[name]()
        except Exception as e:  # noqa: BLE001 - a failed part is recorded and the next one runs
            res[name] = {"error": repr(e), "traceback": traceback.format_exc()[-3000:]}
        res[name + "_seconds"] = round(time.time() - t, 1)
        (out / "gpu.json").write_text(json.dumps(res, indent=1, default=str))
        print(f"== {name} ({res[name + '_seconds']} s)\n{json.dumps(res[name], default=str)[:1500]}", flush=True)
        if not DRY:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
