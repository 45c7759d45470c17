"""Side-by-side CPU timing of the Gemma 4 mixture-of-experts block: dlm's grouped path and eager reference
(dlm.moe.Experts, SoftmaxRouter) against transformers' Gemma4TextExperts on the same weights (router included in both).

    OMP_NUM_THREADS=1 python scripts/moe_bench.py [--tokens 512] [--experts 8] [--top-k 2] [--dim 64] [--ffn 64]

Interleaved, repeated; prints the median time of each and the ratio transformers / dlm-grouped (> 1: dlm faster).
transformers picks its experts kernel itself (grouped_mm where torch can dispatch it, else eager); both are timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--ffn", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=30)
    a = ap.parse_args()
    from transformers.models.gemma4 import Gemma4TextConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts, Gemma4TextRouter

    from dlm.config import MoEConfig
    from dlm.model import ACTIVATIONS, RMSNorm
    from dlm.moe import Experts, SoftmaxRouter

    torch.manual_seed(0)
    c = Gemma4TextConfig(vocab_size=97, hidden_size=a.dim, intermediate_size=a.ffn, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, enable_moe_block=True,
                         num_experts=a.experts, top_k_experts=a.top_k, moe_intermediate_size=a.ffn,
                         hidden_size_per_layer_input=0)
    kinds = {}
    for impl in ("grouped_mm", "eager"):
        cc = Gemma4TextConfig(**{**c.to_dict(), "experts_implementation": impl}) if impl != "eager" else c
        cc._experts_implementation = impl
        kinds[impl] = cc
    hf_router = Gemma4TextRouter(c).eval()
    hf_experts = Gemma4TextExperts(kinds["grouped_mm"]).eval()
    torch.nn.init.normal_(hf_experts.gate_up_proj, std=0.05)
    torch.nn.init.normal_(hf_experts.down_proj, std=0.05)
    torch.nn.init.normal_(hf_router.proj.weight, std=0.5)
    moe = MoEConfig(n_experts=a.experts, top_k=a.top_k, ffn_dim=a.ffn, router="softmax")
    ours_router = SoftmaxRouter(a.dim, moe, RMSNorm(a.dim, c.rms_norm_eps, scale=False, upcast=True))
    ours_router.load_state_dict(hf_router.state_dict())
    ours = Experts(a.dim, a.experts, a.ffn, ACTIVATIONS["gelu_tanh"])
    ours.load_state_dict(hf_experts.state_dict())
    x = torch.randn(a.tokens, a.dim)

    def hf(impl):
        hf_experts.config = kinds[impl]
        _, w, idx = hf_router(x)
        return hf_experts(x, idx, w)

    def dlm(grouped):
        ours.grouped = grouped
        w, idx = ours_router(x)
        return ours(x, w, idx)

    runs = {"transformers grouped_mm": lambda: hf("grouped_mm"), "transformers eager": lambda: hf("eager"),
            "dlm grouped": lambda: dlm(True), "dlm eager": lambda: dlm(False)}
    with torch.inference_mode():
        outs = {k: f() for k, f in runs.items()}
        ref = outs["transformers eager"]
        diffs = {k: float((v - ref).abs().max()) for k, v in outs.items()}
        times = {k: [] for k in runs}
        for _ in range(a.repeats):  # interleaved
            for k, f in runs.items():
                t = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out = {"shape": vars(a), "threads": torch.get_num_threads(), "median_ms": med, "max_abs_diff_vs_hf_eager": diffs,
           "ratio_hf_grouped_mm_over_dlm_grouped": med["transformers grouped_mm"] / med["dlm grouped"],
           "ratio_hf_eager_over_dlm_grouped": med["transformers eager"] / med["dlm grouped"]}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
