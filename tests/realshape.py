"""Real-size checkpoints, one phase per process so that each reports its own peak memory (tests/test_scale.py).

    python tests/realshape.py make FAMILY HF_DIR TOKENIZER   random weights (bf16) in a real model's shape
    python tests/realshape.py import HF_DIR OUT              dlm import --hf
    python tests/realshape.py decode CK                      load as stored, prefill + 16 greedy tokens
    python tests/realshape.py equal CK HF_DIR                fp32 logits of dlm and transformers

Each prints one JSON line: peak_rss_gib (the process's high-water resident set: it counts the memory-mapped
weight pages it touched, which the kernel can drop) and what the phase measured.
"""

from __future__ import annotations

import json
import resource
import sys
import time

import torch

# the shapes of the public configs (random weights: nothing is downloaded)
SHAPES = {
    "qwen3-0.6b": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True),
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True,
                         rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def make(family: str, folder: str, tokenizer: str) -> dict:
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(SHAPES[family])
    cfg = AutoConfig.for_model(shape.pop("model_type"), **shape)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    shutil.copy(tokenizer, f"{folder}/tokenizer.json")
    return {"params": sum(p.numel() for p in model.parameters())}


def import_(folder: str, out: str) -> dict:
    from dlm.hf import import_hf

    t = time.perf_counter()
    import_hf(folder, out)
    return {"seconds": time.perf_counter() - t}


def decode(ck: str) -> dict:
    from dlm.checkpoint import load_model
    from dlm.sampling import SampleConfig, generate

    t = time.perf_counter()
    model, ckpt = load_model(ck, dtype=None)
    load_s, after_load = time.perf_counter() - t, peak_gib()
    res = generate(model, ckpt, "def main(", SampleConfig(max_new_tokens=16, temperature=0.0))
    return {"dtype": str(next(model.parameters()).dtype), "load_seconds": load_s, "peak_after_load_gib": after_load,
            "new_tokens": res.stats.as_dict()["new_tokens"], "tokens_per_second": res.stats.as_dict()["tokens_per_second"]}


def equal(ck: str, folder: str) -> dict:
    from transformers import AutoModelForCausalLM

    from dlm.checkpoint import load_model

    ids = torch.randint(0, 1000, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32).eval()
        want = hf(ids).logits
        del hf
        model, _ = load_model(ck, dtype=torch.float32)
        got = model(ids).logits
    return {"max_abs_logit_difference": float((got - want).abs().max()), "logit_scale": float(want.abs().max())}


if __name__ == "__main__":
    phase, *args = sys.argv[1:]
    out = {"make": make, "import": import_, "decode": decode, "equal": equal}[phase](*args)
    print(json.dumps({"phase": phase, **out, "peak_rss_gib": peak_gib()}))
