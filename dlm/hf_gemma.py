"""Gemma 4 / DiffusionGemma interop: transformers' config and weight names onto a ModelConfig with Gemma 4's layers.

A Gemma 4 text config (model_type gemma4_text, or the text_config of a gemma4 / diffusion_gemma
config) becomes a ModelConfig with Gemma 4's layers (its layer types and per-type attention, sandwich norms,
GeGLU, the softmax-routed experts, soft-cap: config.GEMMA_LAYERS and the per-layer fields). Weight names are
transformers' without the model prefix (`model.`, `model.language_model.`, ...): the rows of dlm.families.
"""

from __future__ import annotations

import math
from typing import Any

from dlm.config import GEMMA_LAYERS, ModelConfig
from dlm.errors import DlmError

LAYER_KIND = {"sliding_attention": "sliding", "full_attention": "full"}


def model_config_from_gemma(t: dict[str, Any], **extra: Any) -> ModelConfig:
    """A Gemma 4 text config (dict, as in config.json) -> ModelConfig with Gemma 4's layers; a field missing or of
    the wrong type is one DlmError line naming it."""
    try:
        return _gemma_config(t, **extra)
    except KeyError as e:
        raise DlmError(f"config.json: {e.args[0]} is missing (a Gemma 4 config.json has it)") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise DlmError(f"config.json: a Gemma 4 field has the wrong type or value ({e})"[:300]) from None


def _gemma_config(t: dict[str, Any], **extra: Any) -> ModelConfig:
    if t.get("hidden_size_per_layer_input"):
        raise DlmError("Gemma 4 per-layer embeddings (hidden_size_per_layer_input > 0: the E2B/E4B models) are not supported")
    if t.get("num_kv_shared_layers"):
        raise DlmError("Gemma 4 KV-shared layers (num_kv_shared_layers > 0) are not supported")
    if t.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise DlmError(f"Gemma 4 hidden_activation {t.get('hidden_activation')!r} is not supported (gelu_pytorch_tanh is)")
    n = t["num_hidden_layers"]
    types = t.get("layer_types") or ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]
    kinds = [LAYER_KIND[x] for x in types]
    rp = t.get("rope_parameters") or {}
    sl = rp.get("sliding_attention") or {"rope_theta": 10_000.0}
    fu = rp.get("full_attention") or {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}
    base = (t.get("head_dim", 256), t["num_key_value_heads"])
    if t.get("per_layer_config") is not None:  # transformers 5: each layer's overrides of the base head dim / KV heads
        plc = {int(k): v for k, v in t["per_layer_config"].items()}
        spec = [(plc.get(i, {}).get("head_dim", base[0]), plc.get(i, {}).get("num_key_value_heads", base[1]))
                for i in range(n)]
    else:  # the older keys, read as transformers reads them: full layers global_head_dim (512), and
        # num_global_key_value_heads when K = V
        glob = (t.get("global_head_dim") or 512,
                (t.get("num_global_key_value_heads") if t.get("attention_k_eq_v") else None) or base[1])
        spec = [glob if k == "full" else base for k in kinds]
    if any(s != base for s, k in zip(spec, kinds) if k == "sliding"):
        raise DlmError("Gemma 4 sliding-attention layers with their own head dims or KV heads are not supported")
    specs = {s for s, k in zip(spec, kinds) if k == "full"}
    if len(specs) > 1:
        raise DlmError(f"Gemma 4 full-attention layers with different specs {sorted(specs)} are not supported")
    full_hd, full_kv = specs.pop() if specs else base
    moe = None
    if t.get("enable_moe_block"):
        moe = {"n_experts": t["num_experts"], "top_k": t["top_k_experts"], "ffn_dim": t["moe_intermediate_size"],
               "router": "softmax"}
    return ModelConfig(vocab_size=t["vocab_size"], dim=t["hidden_size"], n_layers=n,
                       n_heads=t["num_attention_heads"], n_kv_heads=t["num_key_value_heads"],
                       head_dim=t.get("head_dim", 256), ffn_dim=t["intermediate_size"],
                       rope_theta=float(sl.get("rope_theta", 10_000.0)), norm_eps=t.get("rms_norm_eps", 1e-6),
                       tie_embeddings=bool(t.get("tie_word_embeddings", True)),
                       max_seq_len=min(t.get("max_position_embeddings", 131072), 1 << 20),
                       layer_types=kinds, sliding_window=t.get("sliding_window", 512), full_head_dim=full_hd,
                       full_kv_heads=full_kv, full_rope_theta=float(fu.get("rope_theta", 1e6)),
                       full_rotary=float(fu.get("partial_rotary_factor", 1.0))
                       if fu.get("rope_type", "default") == "proportional" else 1.0,
                       k_eq_v=bool(t.get("attention_k_eq_v", False)), moe=moe,
                       logit_softcap=float(t.get("final_logit_softcapping") or 0.0),
                       embed_scale=math.sqrt(t["hidden_size"]), **GEMMA_LAYERS, **extra)


def gemma_text_config(cfg: ModelConfig) -> dict[str, Any]:
    """The inverse of model_config_from_gemma: a Gemma 4 text config dict."""
    moe = cfg.moe
    kinds = cfg.layer_types or ["full"] * cfg.n_layers
    types = [{"sliding": "sliding_attention", "full": "full_attention"}[k] for k in kinds]
    full_hd, full_kv = cfg.full_head_dim or cfg.head_dim, cfg.full_kv_heads or cfg.n_kv_heads
    return {
        "model_type": "gemma4_text", "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "sliding_window": cfg.sliding_window, "layer_types": types,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": cfg.full_rotary,
                               "rope_theta": cfg.full_rope_theta or cfg.rope_theta}},
        "final_logit_softcapping": cfg.logit_softcap or None, "hidden_size_per_layer_input": 0,
        "attention_k_eq_v": cfg.k_eq_v, "num_kv_shared_layers": 0,
        "enable_moe_block": moe is not None, "num_experts": moe and moe.n_experts, "top_k_experts": moe and moe.top_k,
        "moe_intermediate_size": moe and moe.ffn_dim,
        "global_head_dim": full_hd, "num_global_key_value_heads": full_kv,
        "per_layer_config": {str(i): {"head_dim": full_hd, "num_key_value_heads": full_kv}
                             for i, k in enumerate(kinds) if k == "full"},
    }


TEXT_PREFIXES = ("model.language_model.", "model.", "language_model.model.", "language_model.")


def dlm_state(hf_state: dict[str, Any], prefixes: tuple[str, ...] = TEXT_PREFIXES) -> dict[str, Any]:
    """transformers' text weights -> dlm names (prefix dropped; lm_head kept). Other towers are left to the caller."""
    out = {}
    for name, t in hf_state.items():
        if name == "lm_head.weight":
            out[name] = t
            continue
        for p in prefixes:
            if name.startswith(p):
                out[name[len(p):]] = t
                break
    return out


def model_config_from_diffusion_gemma(hf: dict[str, Any]) -> ModelConfig:
    """A DiffusionGemma config (model_type diffusion_gemma) -> a usdm ModelConfig: the text stack (full layers
    K = V, MoE in every layer, soft-cap 30 unless said) with self-conditioning."""
    t = dict(hf.get("text_config") or {})
    t.setdefault("final_logit_softcapping", 30.0)
    t["attention_k_eq_v"], t["enable_moe_block"] = True, True
    t.setdefault("hidden_size_per_layer_input", 0)
    return model_config_from_gemma(t, self_cond=True)


# DiffusionGemma: the encoder's text stack and the decoder share their weights (transformers ties them); the
# decoder's copy is what dlm's one backbone reads, plus its self-conditioning module
DG_SELF_COND = {"pre_norm.weight": "norm.weight", "gate_proj.weight": "mlp.gate_proj.weight",
                "up_proj.weight": "mlp.up_proj.weight", "down_proj.weight": "mlp.down_proj.weight"}


def dlm_state_diffusion_gemma(hf_state: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """DiffusionGemma weights -> (dlm state, names left out: the vision tower and embedder)."""
    out, left = {}, []
    for name, t in hf_state.items():
        if name == "lm_head.weight":
            out[name] = t
        elif name.startswith("model.decoder.self_conditioning."):
            out["self_cond." + DG_SELF_COND[name[len("model.decoder.self_conditioning."):]]] = t
        elif name.startswith("model.decoder."):
            out[name[len("model.decoder."):]] = t
        elif name.startswith("model.encoder.language_model."):
            out.setdefault(name[len("model.encoder.language_model."):], t)  # tied: same values as the decoder's
        else:
            left.append(name)
    return out, left


# the rows of dlm.families: conventions and config.json on export

def conventions(hf: dict[str, Any], cfg: ModelConfig, source, tok) -> dict[str, Any]:
    """A DiffusionGemma checkpoint's: the reference sampler's canvas, and noise over the model's whole vocabulary."""
    return {"canvas_length": int(hf.get("canvas_length", 256)), "noise_vocab": cfg.vocab_size}


def export_config(model, tok, dtype: str, meta: dict[str, Any]) -> dict[str, Any]:
    """config.json of a Gemma 4 backbone: Gemma4ForCausalLM (ar), or DiffusionGemmaForBlockDiffusion
    (self-conditioned: usdm), over the imported config where the checkpoint keeps one (with the canvas it runs)."""
    cfg = model.cfg
    text = gemma_text_config(cfg)
    if not cfg.self_cond:
        config = {**text, "architectures": ["Gemma4ForCausalLM"]}
    else:
        for k in ("attention_k_eq_v", "hidden_size_per_layer_input", "num_kv_shared_layers", "enable_moe_block"):
            text.pop(k)
        text["model_type"] = "diffusion_gemma_text"
        config = {"model_type": "diffusion_gemma", "architectures": ["DiffusionGemmaForBlockDiffusion"],
                  "text_config": text}
    src = meta.get("hf_config") or {}
    if src and meta.get("canvas_length") is not None:  # DiffusionGemma: the canvas it runs
        src = {**src, "canvas_length": meta["canvas_length"]}
    if config["model_type"] == "diffusion_gemma" and src.get("model_type") == "diffusion_gemma":
        config = {**{k: v for k, v in src.items() if k != "text_config"}, **config,
                  "text_config": {**src.get("text_config", {}), **config["text_config"]}}
    elif src.get("model_type") == "gemma4_text":
        config = {**src, **config}
    config["dtype"] = dtype
    for k, v in (("eos_token_id", tok.hf_eos_token_id), ("bos_token_id", tok.bos_id), ("pad_token_id", tok.pad_id)):
        config.setdefault(k, v)
    return config
