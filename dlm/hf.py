"""transformers interop: export a dlm AR checkpoint as Qwen3/Llama, import a local Qwen3/Llama folder.

dlm's parameter names are transformers' without the `model.` prefix, so the mapping is a rename.
Qwen3 when q/k-norm is on, Llama when it is off. Nothing here imports transformers.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from dlm.checkpoint import read_json, read_tensors, save_checkpoint, state_tensors, write_json, write_tensors
from dlm.config import ModelConfig
from dlm.errors import DlmError
from dlm.model import Transformer
from dlm.tokenizer import Tokenizer


def hf_config(cfg: ModelConfig, tok: Tokenizer, dtype: str = "float32") -> dict[str, Any]:
    family = "qwen3" if cfg.qk_norm else "llama"
    rope_params: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling:
        rope_params = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    out: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM" if family == "qwen3" else "LlamaForCausalLM"],
        "model_type": family,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,  # transformers 4.x
        "rope_scaling": cfg.rope_scaling,
        "rope_parameters": rope_params,  # transformers 5.x
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": tok.bos_id,
        "eos_token_id": tok.eos_id,
        "pad_token_id": tok.pad_id,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if family == "qwen3":
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
    else:
        out.update(mlp_bias=False, pretraining_tp=1)
    return out


def export_hf(model: Transformer, tok: Tokenizer, out: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Path:
    """Write a transformers-loadable folder (config.json, model.safetensors, tokenizer files)."""
    out = Path(out)
    if model.cfg.self_cond:
        raise DlmError("--format hf: this checkpoint has a self-conditioning module that Qwen3/Llama cannot hold")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {("" if k.startswith("lm_head.") else "model.") + k: v
               for k, v in state_tensors(model, dtype).items()}
    write_tensors(tmp / "model.safetensors", tensors, metadata={"format": "pt"})
    dname = str(dtype).removeprefix("torch.")
    write_json(tmp / "config.json", hf_config(model.cfg, tok, dname))
    write_json(tmp / "generation_config.json", {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id,
                                                "pad_token_id": tok.pad_id})
    tok.save(tmp / "tokenizer.json")
    hfc = tok.hf_config()
    write_json(tmp / "tokenizer_config.json", hfc)
    write_json(tmp / "special_tokens_map.json",
               {k: v for k, v in hfc.items() if k.endswith("_token") and v is not None})
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _rope(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = hf.get("rope_parameters") or {}
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind == "default":
            scaling = None
        elif kind != "llama3":
            raise DlmError(f"config.json: rope scaling {kind!r} is not supported (default and llama3 are)")
        else:
            scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    return float(theta), scaling


def model_config_from_hf(hf: dict[str, Any], source: Path) -> ModelConfig:
    kind = hf.get("model_type")
    if kind not in ("qwen3", "llama"):
        raise DlmError(f"{source}: model_type {kind!r} is not supported (qwen3 and llama are)")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise DlmError(f"{source}: attention/MLP biases are not supported")
    if hf.get("use_sliding_window"):
        raise DlmError(f"{source}: sliding-window attention is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise DlmError(f"{source}: hidden_act {hf.get('hidden_act')!r} is not supported (silu is)")
    theta, scaling = _rope(hf)
    n_heads = hf["num_attention_heads"]
    return ModelConfig(
        vocab_size=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=n_heads,
        n_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads, ffn_dim=hf["intermediate_size"],
        rope_theta=theta, rope_scaling=scaling, norm_eps=hf.get("rms_norm_eps", 1e-6),
        qk_norm=kind == "qwen3", tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_seq_len=hf.get("max_position_embeddings", 4096),
    )


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(read_json(index).get("weight_map", {}).values()))
        if not files:
            raise DlmError(f"{index}: empty weight_map")
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise DlmError(f"{folder}: no model.safetensors or model.safetensors.index.json (only safetensors are read)")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(read_tensors(folder / f))
    return tensors


def import_hf(folder: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Read a local Qwen3/Llama folder into a dlm checkpoint (objective "ar")."""
    src, out = Path(folder), Path(out)
    if not src.is_dir():
        raise DlmError(f"--hf: folder not found: {src}")
    hf = read_json(src / "config.json")
    cfg = model_config_from_hf(hf, src / "config.json")
    tok = Tokenizer.from_file(src / "tokenizer.json")
    raw = read_hf_weights(src)
    tensors = {}
    for k, v in raw.items():
        if k.startswith("model."):
            tensors[k[len("model."):]] = v
        elif k == "lm_head.weight":
            if not cfg.tie_embeddings:
                tensors[k] = v
        elif "rotary_emb" not in k:
            raise DlmError(f"{src}: unexpected tensor {k!r}")
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in Transformer(cfg).state_dict().items()}
    if cfg.tie_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise DlmError(f"{src}: weights missing for {missing[:4]}")
    for k, v in tensors.items():
        if k not in expected or tuple(v.shape) != expected[k]:
            raise DlmError(f"{src}: tensor {k!r} {tuple(v.shape)} does not fit config.json")
    with torch.device("meta"):
        model = Transformer(cfg)
    tied = {"lm_head.weight": tensors["embed_tokens.weight"]} if cfg.tie_embeddings else {}
    model.load_state_dict({**tensors, **tied}, assign=True)
    dtype = next(iter(raw.values())).dtype
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_checkpoint(tmp, model, tok, {"objective": "ar", "model": cfg.to_dict(), "imported_from": str(src.resolve()),
                                      "data": "stdlib"}, dtype=dtype)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
