"""`dlm import --hf` streams: a sharded checkpoint is imported tensor by tensor from its memory-mapped shards, the
experts of a mixture-of-experts layer stacked as they are written, so that the import's peak memory is the
interpreter's plus about one tensor, whatever the model's size (docs/BENCHMARKS.md, "Real size on one machine").

The checkpoint is LLaDA 2-shaped (the family whose experts are stored one module each and stacked into dlm's fused
expert tensors), written by dlm.bench.size in the hub's sharded layout: ~100 MB in 3 shards, its largest output
tensor 16 MiB. The import runs in a child process that reports how far its resident high-water mark (VmHWM, reset
before the import; it counts the memory-mapped pages the process touched) rose above its resident set during
import_hf. An import that stacked the experts in memory, or that
kept every mapped page it read resident, rises by the model's size; a streaming one by a few tensors.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dlm.bench.size import hf_shapes, write
from dlm.files import Stacked, mmap_tensors, write_tensors

ROOT = Path(__file__).resolve().parent.parent

CONFIG = dict(architectures=["LLaDA2MoeModelLM"], model_type="llada2_moe", vocab_size=4096, hidden_size=256,
              intermediate_size=512, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              num_experts=128, num_experts_per_tok=4, moe_intermediate_size=128, num_shared_experts=1,
              first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
              partial_rotary_factor=0.5, rope_theta=600000.0, max_position_embeddings=512, rms_norm_eps=1e-6,
              tie_word_embeddings=False, use_qk_norm=True, use_bias=False, mask_token_id=4000, torch_dtype="bfloat16")

CHILD = """
import json, sys
from dlm.hf import import_hf

def status(key):
    with open("/proc/self/status") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith(key + ":"))

import_hf(sys.argv[1], sys.argv[2])  # a warm-up import of a tiny folder: the modules and libraries it loads
with open("/proc/self/clear_refs", "w") as fh:
    fh.write("5")  # the high-water mark VmHWM restarts from the resident set now
before = status("VmRSS")
import_hf(sys.argv[3], sys.argv[4])
print(json.dumps({"before": before, "rise": status("VmHWM") - before}))
"""


def import_rise(warm: Path, src: Path, out: Path, pythonpath: Path = ROOT) -> int:
    """Bytes by which a child process's peak RSS rose while it imported src into out (after importing warm)."""
    env = {"PYTHONPATH": str(pythonpath), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    res = subprocess.run([sys.executable, "-c", CHILD, str(warm), str(out) + "-warm", str(src), str(out)],
                         capture_output=True, text=True, env=env, cwd=pythonpath, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])["rise"]


def test_a_sharded_moe_import_stays_within_one_tensor_of_memory(tmp_path):
    src, out, warm = tmp_path / "hf", tmp_path / "ck", tmp_path / "warm"
    write({**CONFIG, "num_hidden_layers": 2, "num_experts": 8}, warm)
    info = write(CONFIG, src, shard_bytes=40 * 10**6)
    assert info["shards"] >= 3 and (src / "model.safetensors.index.json").is_file()
    expert_bytes = sum(math.prod(s) * 2 for k, s in hf_shapes(CONFIG).items() if ".experts." in k)
    assert expert_bytes > 90 * 2**20 and info["bytes"] > 90 * 2**20
    largest_out = 128 * 2 * 128 * 256 * 2  # (E, 2I, D) bf16: gate_up_proj of one MoE layer, 16 MiB
    assert largest_out >= info["largest_tensor_bytes"]

    rise = import_rise(warm, src, out)
    # streaming: the tokenizer and a tensor or two in flight, within twice the largest output tensor (~26 MiB
    # measured); a copy of the experts (stacking in memory) or every page read kept resident would add >= 96 MiB
    # (the import without streaming rose by 316 MiB on the 160 MB version of this folder)
    bound = 24 * 2**20 + 2 * largest_out
    assert rise < bound, f"import's peak RSS rose by {rise / 2**20:.0f} MiB (bound {bound / 2**20:.0f} MiB)"

    # and what it wrote is the stack of the experts, in order
    got = mmap_tensors(out / "model.safetensors")
    raw = {}
    for f in sorted(src.glob("model-*.safetensors")):
        raw.update(mmap_tensors(f))
    p = "model.layers.2.mlp.experts."
    gu = torch.stack([torch.cat((raw[f"{p}{e}.gate_proj.weight"], raw[f"{p}{e}.up_proj.weight"]))
                      for e in range(CONFIG["num_experts"])])
    down = torch.stack([raw[f"{p}{e}.down_proj.weight"] for e in range(CONFIG["num_experts"])])
    assert torch.equal(got["layers.2.mlp.experts.gate_up_proj"], gu)
    assert torch.equal(got["layers.2.mlp.experts.down_proj"], down)
    assert got["layers.2.mlp.experts.gate_up_proj"].dtype == torch.bfloat16


def test_a_stacked_tensor_is_written_as_its_parts_laid_end_to_end(tmp_path):
    g = torch.Generator().manual_seed(0)
    parts = [torch.randn(3, 4, generator=g) for _ in range(6)]  # fp32 parts of a (3, 6, 4) stack, written as bf16
    whole = Stacked(parts, (3, 6, 4)).to(torch.bfloat16)
    write_tensors(tmp_path / "w.safetensors", {"a": torch.ones(2), "s": whole})
    got = mmap_tensors(tmp_path / "w.safetensors")
    assert torch.equal(got["s"], torch.cat(parts).view(3, 6, 4).to(torch.bfloat16))
    assert torch.equal(got["a"], torch.ones(2))
    with pytest.raises(ValueError, match="cannot make"):
        Stacked(parts, (3, 6, 5))
