"""Real size on one machine: synthetic checkpoints at public configs, and what importing and generating them costs.

    python -m dlm.bench.size write NAME FOLDER [--layers N]      a transformers folder in the hub's sharded layout
    python -m dlm.bench.size measure NAME WORK [--layers N] [--target CK] [--keep]
                                                                 write, `dlm import --hf`, `dlm generate`; one JSON line
    python -m dlm.bench.size table RESULTS.jsonl                 measure's lines as a markdown table

`write` lays out random bf16 weights at the named public config (CONFIGS: the config.json of the public checkpoint,
its shape keys as published) in the hub's layout: model-0000i-of-0000n.safetensors shards of at most 5 GB,
model.safetensors.index.json, config.json and a real tokenizer.json (the shipped ar-small's byte-level BPE: the
vocabulary of the model is larger than the tokenizer's, as it often is). The tensor names are the family's own,
from dlm's exporters (dlm.hf, dlm.hf_mdlm, dlm.hf_gemma), which the parity tests hold to transformers and the
authors' code. Each shard is written tensor by tensor from one 64 MiB pool of N(0, 0.02) values read at a random
offset per tensor, so the writer itself stays small in memory and is bound by the disk, not by a random generator.

`measure` runs each step in a child process and reads its memory from /proc while it runs: peak RSS (ru_maxrss, the
resident high-water mark, which counts memory-mapped file pages the process touched), and the peaks of its
anonymous memory (RssAnon: what the process allocated) and of its file-backed pages (RssFile: mapped weights),
sampled every 50 ms. The import streams when its peak stays near the interpreter's own (~0.3 GB) plus the largest
tensor it writes; `dlm generate` memory-maps when its anonymous memory stays far below the model's bytes.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from dlm.errors import DlmError

SHARD_BYTES = 5 * 10**9  # the hub's default shard size (save_pretrained's max_shard_size "5GB")
POOL = 32 * 2**20  # elements of the random pool (bf16: 64 MiB)

QWEN3_1_7B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=2048,
                  intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, hidden_act="silu", attention_bias=False, torch_dtype="bfloat16")
QWEN3_8B = dict(QWEN3_1_7B, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                tie_word_embeddings=False)
# Ministral 3 8B (transformers' Ministral3Config defaults: mistralai/Ministral-3-8B-Base-2512's text stack)
MINISTRAL3_8B = dict(architectures=["Ministral3ForCausalLM"], model_type="ministral3", vocab_size=131072,
                     hidden_size=4096, intermediate_size=14336, num_hidden_layers=34, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, hidden_act="silu", max_position_embeddings=262144,
                     rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None,
                     rope_parameters={"type": "yarn", "rope_type": "yarn", "rope_theta": 1000000.0, "factor": 16.0,
                                      "original_max_position_embeddings": 16384, "max_position_embeddings": 262144,
                                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                                      "llama_4_scaling_beta": 0.1}, torch_dtype="bfloat16")
# the text stack of Gemma 4 26B-A4B and DiffusionGemma 26B-A4B (the published text_config; transformers' class
# defaults are a smaller dense model): 5 sliding (window 1024) : 1 full layers, full layers head_dim 512 with 2 KV
# heads and K = V, a dense GeGLU MLP and 128 experts (top 8) in every layer
GEMMA4_26B_A4B = dict(vocab_size=262144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
                      num_attention_heads=16, num_key_value_heads=8, num_global_key_value_heads=2, head_dim=256,
                      global_head_dim=512, attention_k_eq_v=True, enable_moe_block=True, num_experts=128,
                      top_k_experts=8, moe_intermediate_size=704, hidden_activation="gelu_pytorch_tanh",
                      max_position_embeddings=262144, rms_norm_eps=1e-6, sliding_window=1024,
                      final_logit_softcapping=30.0, attention_bias=False, hidden_size_per_layer_input=0,
                      num_kv_shared_layers=0, use_double_wide_mlp=False, tie_word_embeddings=True,
                      layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5,
                      rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                       "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                          "rope_theta": 1000000.0}})
# the public configs: the keys that shape the model as published, and the <mask> id; no EOS / BOS ids (the tokenizer
# is not the models' own: its own special tokens are used)
CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-1.7b": QWEN3_1_7B,
    "qwen3-8b": QWEN3_8B,
    "llada-8b": dict(architectures=["LLaDAModelLM"], model_type="llada", d_model=4096, n_heads=32, n_kv_heads=32,
                     n_layers=32, mlp_hidden_size=12288, vocab_size=126464, embedding_size=126464, rope_theta=500000.0,
                     max_sequence_length=4096, rms_norm_eps=1e-5, weight_tying=False, block_type="llama",
                     activation_type="silu", layer_norm_type="rms", rope=True, alibi=False, include_bias=False,
                     include_qkv_bias=False, attention_layer_norm=False, input_emb_norm=False, scale_logits=False,
                     block_group_size=1, multi_query_attention=None, layer_norm_with_affine=True,
                     bias_for_layer_norm=False, mask_token_id=126336, torch_dtype="bfloat16"),
    "dream-7b": dict(architectures=["DreamModel"], model_type="Dream", vocab_size=152064, hidden_size=3584,
                     intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                     max_position_embeddings=131072, rope_theta=1000000.0, rms_norm_eps=1e-6,
                     tie_word_embeddings=False, hidden_act="silu", mask_token_id=151666, torch_dtype="bfloat16"),
    "sdar-1.7b": dict(QWEN3_1_7B, architectures=["SDARForCausalLM"], model_type="sdar", block_size=4,
                      mask_token_id=151669),
    "fast-dllm-v2-1.5b": dict(architectures=["Fast_dLLM_QwenForCausalLM"], model_type="Fast_dLLM_Qwen",
                              vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                              num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
                              rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
                              bd_size=32, mask_token_id=151665, torch_dtype="bfloat16"),
    "llada2.0-mini": dict(architectures=["LLaDA2MoeModelLM"], model_type="llada2_moe", vocab_size=157184,
                          hidden_size=2048, intermediate_size=5120, num_hidden_layers=20, num_attention_heads=16,
                          num_key_value_heads=4, head_dim=128, num_experts=256, num_experts_per_tok=8,
                          moe_intermediate_size=512, num_shared_experts=1, first_k_dense_replace=1, n_group=8,
                          topk_group=4, routed_scaling_factor=2.5, partial_rotary_factor=0.5, rope_theta=600000.0,
                          max_position_embeddings=16384, rms_norm_eps=1e-6, tie_word_embeddings=False,
                          use_qk_norm=True, use_qkv_bias=False, use_bias=False, hidden_act="silu",
                          score_function="sigmoid", moe_router_enable_expert_bias=True, norm_topk_prob=True,
                          mask_token_id=156895, torch_dtype="bfloat16"),
    # z-lab/Qwen3-8B-DFlash-b16: 5 Qwen3-8B layers over target layers [1, 9, 17, 25, 33], blocks of 16
    "qwen3-8b-dflash": dict(architectures=["DFlashDraftModel"], model_type="qwen3", vocab_size=151936,
                            hidden_size=4096, intermediate_size=12288, num_hidden_layers=5, num_attention_heads=32,
                            num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
                            rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", block_size=16,
                            num_target_layers=36,
                            dflash_config={"target_layer_ids": [1, 9, 17, 25, 33], "mask_token_id": 151669,
                                           "block_size": 16}, torch_dtype="bfloat16"),
    "ministral3-8b": MINISTRAL3_8B,
    # Nemotron-Labs-Diffusion 8B: the Ministral 3 8B backbone under encoder.* + diffusion_head, <mask> 100, block 32
    "nemotron-labs-diffusion-8b": dict(MINISTRAL3_8B, architectures=["MinistralDiffEncoderModel"],
                                       model_type="ministral_dlm", dlm_paradigm="sbd_block_diff", dlm_type="llada",
                                       mask_token_id=100, block_size=32),
    "qwen3-30b-a3b": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
                          hidden_size=2048, intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                          tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
                          use_sliding_window=False, torch_dtype="bfloat16"),
    "diffusiongemma-26b-a4b": dict(architectures=["DiffusionGemmaForBlockDiffusion"], model_type="diffusion_gemma",
                                   canvas_length=256, tie_word_embeddings=True, torch_dtype="bfloat16",
                                   text_config=dict(GEMMA4_26B_A4B, model_type="diffusion_gemma_text")),
    "gemma4-26b-a4b": dict(architectures=["Gemma4ForConditionalGeneration"], model_type="gemma4",
                           tie_word_embeddings=True, torch_dtype="bfloat16",
                           text_config=dict(GEMMA4_26B_A4B, model_type="gemma4_text")),
}
LAYER_KEY = {"llada": "n_layers"}  # the depth's key where it is not num_hidden_layers


def _text(hf: dict[str, Any]) -> dict[str, Any]:
    """The part of a config.json that holds the layers: text_config (Gemma 4, DiffusionGemma), else the whole."""
    return hf["text_config"] if isinstance(hf.get("text_config"), dict) else hf


def depth(hf: dict[str, Any]) -> int:
    return _text(hf)[LAYER_KEY.get(hf["model_type"], "num_hidden_layers")]


def tokenizer_file() -> Path:
    from dlm.checkpoint import checkpoints_dir

    return checkpoints_dir() / "ar-small" / "tokenizer.json"


def config_of(name: str, layers: int = 0) -> dict[str, Any]:
    if name not in CONFIGS:
        raise DlmError(f"unknown config {name!r} (one of {', '.join(CONFIGS)})")
    hf = json.loads(json.dumps(CONFIGS[name]))
    if layers:
        t = _text(hf)
        t[LAYER_KEY.get(hf["model_type"], "num_hidden_layers")] = layers
        if "layer_types" in t:  # (the published pattern's first layers)
            t["layer_types"] = t["layer_types"][:layers]
    return hf


def hf_shapes(hf: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The folder's tensors (transformers names -> shapes) for a config, from dlm's exporters run on the meta device."""
    from dlm.families import family_of, is_drafter
    from dlm.hf import hf_plan
    from dlm.hf_layout import model_config_from_hf
    from dlm.model import param_shapes

    if is_drafter(hf):
        from dlm.drafter import drafter_shapes

        cfg = model_config_from_hf({**hf, "model_type": "qwen3"}, Path("config.json"))
        meta = {"objective": "dflash", "model": cfg.to_dict(),
                "dflash": {"target_layer_ids": hf["dflash_config"]["target_layer_ids"], "block_size": hf["block_size"],
                           "mask_token_id": hf["dflash_config"]["mask_token_id"], "injection": "kv",
                           "target_features": True}}
        expected, _ = drafter_shapes(meta)
        return dict(expected)
    fam = family_of(hf, Path("config.json"))  # the family's row: its names and transforms, as import reads them
    cfg = fam.config(hf, Path("config.json"))
    expected, _ = param_shapes(cfg)
    # a tensor stored under several names (DiffusionGemma's encoder copy of the decoder's text stack) is saved once,
    # under the first: transformers' save_pretrained writes a tied tensor once, under the tie's source
    return {h: s for h, (s, (_, hfs, tr)) in hf_plan(fam, cfg, expected).items() if tr or h == hfs[0]}


def _shard(shapes: dict[str, tuple[int, ...]], itemsize: int, shard_bytes: int) -> list[list[str]]:
    """Tensors in order, cut into shards of at most shard_bytes (a larger tensor alone in its shard)."""
    shards: list[list[str]] = [[]]
    size = 0
    for k, s in shapes.items():
        n = math.prod(s) * itemsize
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(k)
        size += n
    return shards


def write_shard(path: Path, shapes: dict[str, tuple[int, ...]], pool: torch.Tensor, rng: random.Random) -> None:
    """One safetensors file: the header, then each tensor's bytes read from the pool (wrapping around) in slices."""
    from dlm.files import SAFETENSORS_DTYPES

    dtype, header, offset = pool.dtype, {"__metadata__": {"format": "pt"}}, 0
    for k, s in shapes.items():
        n = math.prod(s) * dtype.itemsize
        header[k] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(s), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    raw = pool.view(torch.uint8).numpy()
    with open(path, "wb") as fh:
        fh.write(len(head).to_bytes(8, "little") + head)
        for s in shapes.values():
            left, at = math.prod(s) * dtype.itemsize, rng.randrange(len(raw) // 2) * 2
            while left:
                n = min(left, len(raw) - at)
                fh.write(memoryview(raw[at:at + n]))
                left, at = left - n, 0


def write(name: str | dict[str, Any], folder: str | os.PathLike, layers: int = 0, seed: int = 0,
          shard_bytes: int = SHARD_BYTES) -> dict[str, Any]:
    """A synthetic transformers folder at CONFIGS[name] (`layers`: that depth instead of the published one), or at
    the config.json `name` is (a dict)."""
    folder = Path(folder)
    hf = config_of(name, layers) if isinstance(name, str) else dict(name)
    name = name if isinstance(name, str) else hf["model_type"]
    shapes = hf_shapes(hf)
    torch.manual_seed(seed)
    pool = (torch.randn(POOL) * 0.02).to(torch.bfloat16)
    rng = random.Random(seed)
    shards = _shard(shapes, pool.dtype.itemsize, shard_bytes)
    folder.mkdir(parents=True, exist_ok=False)
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    t0 = time.perf_counter()
    for f, names in zip(files, shards):
        write_shard(folder / f, {k: shapes[k] for k in names}, pool, rng)
    total = sum(math.prod(s) for s in shapes.values())
    index = {"metadata": {"total_size": total * pool.dtype.itemsize},
             "weight_map": {k: f for f, names in zip(files, shards) for k in names}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
    shutil.copyfile(tokenizer_file(), folder / "tokenizer.json")
    largest = max(math.prod(s) for s in shapes.values()) * pool.dtype.itemsize
    return {"name": name, "layers": depth(hf), "params": total,
            "bytes": total * pool.dtype.itemsize, "shards": len(files), "tensors": len(shapes),
            "largest_tensor_bytes": largest, "write_seconds": time.perf_counter() - t0}


# measuring a child process --------------------------------------------------------------------------------------

def _status(pid: int) -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                if key in ("VmRSS", "RssAnon", "RssFile"):
                    out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError):
        pass
    return out


def run_measured(cmd: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run cmd; its wall time, exit code, stdout, peak RSS (ru_maxrss) and the sampled peaks of RssAnon / RssFile."""
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    import threading

    out: dict[str, list[str]] = {"stdout": [], "stderr": []}
    readers = [threading.Thread(target=lambda s=s, k=k: out[k].extend(s.readlines()), daemon=True)
               for s, k in ((p.stdout, "stdout"), (p.stderr, "stderr"))]
    for r in readers:
        r.start()
    peak = {"RssAnon": 0, "RssFile": 0}
    while True:
        st = _status(p.pid)
        for k in peak:
            peak[k] = max(peak[k], st.get(k, 0))
        done, status, usage = os.wait4(p.pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    p.returncode = os.waitstatus_to_exitcode(status)
    for r in readers:
        r.join()
    return {"rc": p.returncode, "seconds": time.perf_counter() - t0, "peak_rss": usage.ru_maxrss * 1024,
            "peak_anon": peak["RssAnon"], "peak_file": peak["RssFile"], "stdout": "".join(out["stdout"]),
            "stderr": "".join(out["stderr"])[-2000:]}


GENERATE = ["--prompt", "def main(", "--max-new-tokens", "8", "--json"]
# DiffusionGemma denoises a whole canvas (256 positions, 48 steps) before its first token, each step a forward of
# the canvas through the 262144-row head: on a CPU that is many minutes, so it is measured on a canvas of 32 in 8 steps
GENERATE_ARGS = {"diffusiongemma-26b-a4b": ["--canvas-length", "32", "--steps", "8"]}


def measure(name: str, work: str | os.PathLike, layers: int = 0, target: str | None = None,
            keep: bool = False) -> dict[str, Any]:
    """Write the synthetic folder, import it, generate from it; each in a child process (nice'd by the caller)."""
    work = Path(work)
    src, ck = work / f"{name}-hf", work / f"{name}-dlm"
    for p in (src, ck):
        if p.exists():
            shutil.rmtree(p)
    row: dict[str, Any] = {"name": name, "date": time.strftime("%Y-%m-%d"), "torch_threads": torch.get_num_threads()}
    row.update(write(name, src, layers))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    dlm = [sys.executable, "-m", "dlm"]
    try:
        imp = run_measured(dlm + ["import", "--hf", str(src), "--out", str(ck)]
                           + (["--target", target] if target else []), env)
        if imp["rc"]:
            raise DlmError(f"import failed: {imp['stderr']}")
        row["import"] = {k: v for k, v in imp.items() if k not in ("stdout", "stderr")}
        from dlm.files import tensor_shapes

        row["largest_output_bytes"] = max(math.prod(s) for s in tensor_shapes(ck / "model.safetensors").values()) \
            * row["bytes"] // row["params"]  # (LLaDA 2: a layer's stacked experts)
        shutil.rmtree(src)  # (the disk: only the checkpoint is needed from here on)
        gen_model = ["--model", target, "--draft", str(ck)] if target else ["--model", str(ck)]
        gen = run_measured(dlm + ["generate"] + gen_model + GENERATE + GENERATE_ARGS.get(name, []), env)
        if gen["rc"]:
            raise DlmError(f"generate failed: {gen['stderr']}")
        res = json.loads(gen["stdout"].strip().splitlines()[-1])
        row["generate"] = {**{k: v for k, v in gen.items() if k not in ("stdout", "stderr")},
                           "ttft": res.get("ttft"), "new_tokens": res.get("new_tokens"), "forwards": res.get("forwards"),
                           **({"args": GENERATE_ARGS[name]} if name in GENERATE_ARGS else {})}
    finally:
        if not keep:
            for p in (src, ck):
                shutil.rmtree(p, ignore_errors=True)
    return row


FAMILY = {"qwen3-1.7b": "AR (Qwen3)", "qwen3-8b": "AR (Qwen3)", "llada-8b": "LLaDA", "dream-7b": "Dream",
          "sdar-1.7b": "SDAR", "fast-dllm-v2-1.5b": "Fast-dLLM v2", "llada2.0-mini": "LLaDA 2 (MoE)",
          "qwen3-8b-dflash": "DFlash drafter", "ministral3-8b": "AR (Ministral 3)",
          "nemotron-labs-diffusion-8b": "Nemotron-Labs-Diffusion (joint)", "qwen3-30b-a3b": "AR (Qwen3-MoE)",
          "diffusiongemma-26b-a4b": "DiffusionGemma (usdm)", "gemma4-26b-a4b": "AR (Gemma 4)"}


def table(rows: list[dict[str, Any]]) -> str:
    """measure's JSON lines as the markdown table of docs/BENCHMARKS.md."""
    G = 2**30
    out = ["| family | config (depth) | params | bytes (bf16) | largest tensor (read or written) | import: wall, peak RSS (anon / mapped) "
           "| generate: TTFT, peak RSS (anon / mapped) | date |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "import" not in r:
            continue
        i, g = r["import"], r["generate"]
        full = depth(CONFIGS[r["name"]])
        layers = f"{r['layers']} of {full} layers" if r["layers"] != full else f"{full} layers"
        largest = max(r["largest_tensor_bytes"], r.get("largest_output_bytes", 0))
        out.append(f"| {FAMILY.get(r['name'], r['name'])} | {r['name']} ({layers}) | {r['params'] / 1e9:.2f}B "
                   f"| {r['bytes'] / G:.2f} GiB | {largest / G:.2f} GiB "
                   f"| {i['seconds']:.0f} s, {i['peak_rss'] / G:.2f} GiB ({i['peak_anon'] / G:.2f} / "
                   f"{i['peak_file'] / G:.2f}) | {g['ttft']:.1f} s, {g['peak_rss'] / G:.2f} GiB "
                   f"({g['peak_anon'] / G:.2f} / {g['peak_file'] / G:.2f}) | {r['date']} |")
    return "\n".join(out)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("write", "measure", "table"))
    ap.add_argument("name", help="a config (CONFIGS); table: the JSON lines file measure's output was collected in")
    ap.add_argument("folder", nargs="?")
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--target", default=None, help="measure a DFlash drafter: the dlm checkpoint of its target")
    ap.add_argument("--keep", action="store_true", help="measure: keep the folders")
    a = ap.parse_args()
    if a.what == "table":
        print(table([json.loads(line) for line in Path(a.name).read_text().splitlines() if line.strip()]))
        sys.exit(0)
    if a.name not in CONFIGS or not a.folder:
        ap.error(f"give a config ({', '.join(CONFIGS)}) and a folder")
    try:
        out = write(a.name, a.folder, a.layers) if a.what == "write" else measure(a.name, a.folder, a.layers,
                                                                                  a.target, a.keep)
    except DlmError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(json.dumps(out))
