"""Gemma 4 / DiffusionGemma interop: transformers' config and weight names onto a gemma4 ModelConfig.

A Gemma 4 text config (model_type gemma4_text, or the text_config of a gemma4 / diffusion_gemma
config) becomes a ModelConfig whose `arch` holds the per-layer specs (dlm.gemma4). Weight names are
transformers' without the model prefix (`model.`, `model.language_model.`, ...).
"""

from __future__ import annotations

from typing import Any

from dlm.config import ModelConfig
from dlm.errors import DlmError

LAYER_KIND = {"sliding_attention": "sliding", "full_attention": "full"}


def model_config_from_gemma(t: dict[str, Any], **extra: Any) -> ModelConfig:
    """A Gemma 4 text config (dict, as in config.json) -> ModelConfig with arch family gemma4."""
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
    plc = {int(k): v for k, v in (t.get("per_layer_config") or {}).items()}
    full_idx = [i for i, k in enumerate(kinds) if k == "full"]
    specs = {(plc.get(i, {}).get("head_dim", t.get("global_head_dim", 512)),
              plc.get(i, {}).get("num_key_value_heads", t.get("num_global_key_value_heads") or t["num_key_value_heads"]))
             for i in full_idx}
    if len(specs) > 1:
        raise DlmError(f"Gemma 4 full-attention layers with different specs {sorted(specs)} are not supported")
    full_hd, full_kv = specs.pop() if specs else (t.get("head_dim", 256), t["num_key_value_heads"])
    moe = None
    if t.get("enable_moe_block"):
        moe = {"n_experts": t["num_experts"], "top_k": t["top_k_experts"], "ffn_dim": t["moe_intermediate_size"]}
    arch = {"family": "gemma4", "layer_types": kinds, "sliding_window": t.get("sliding_window", 512),
            "full_head_dim": full_hd, "full_kv_heads": full_kv, "full_rope_theta": float(fu.get("rope_theta", 1e6)),
            "full_partial_rotary": float(fu.get("partial_rotary_factor", 1.0))
            if fu.get("rope_type", "default") == "proportional" else 1.0,
            "k_eq_v": bool(t.get("attention_k_eq_v", False)), "moe": moe,
            "final_softcap": t.get("final_logit_softcapping")}
    return ModelConfig(vocab_size=t["vocab_size"], dim=t["hidden_size"], n_layers=n,
                       n_heads=t["num_attention_heads"], n_kv_heads=t["num_key_value_heads"],
                       head_dim=t.get("head_dim", 256), ffn_dim=t["intermediate_size"],
                       rope_theta=float(sl.get("rope_theta", 10_000.0)), norm_eps=t.get("rms_norm_eps", 1e-6),
                       qk_norm=True, tie_embeddings=bool(t.get("tie_word_embeddings", True)),
                       max_seq_len=min(t.get("max_position_embeddings", 131072), 1 << 20), arch=arch, **extra)


def gemma_text_config(cfg: ModelConfig) -> dict[str, Any]:
    """The inverse of model_config_from_gemma: a Gemma 4 text config dict."""
    a = cfg.arch
    moe = a.get("moe") or {}
    types = [{"sliding": "sliding_attention", "full": "full_attention"}[k] for k in a["layer_types"]]
    return {
        "model_type": "gemma4_text", "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim,
        "intermediate_size": cfg.ffn_dim, "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "sliding_window": a["sliding_window"], "layer_types": types,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": a.get("full_partial_rotary", 1.0),
                               "rope_theta": a.get("full_rope_theta", cfg.rope_theta)}},
        "final_logit_softcapping": a.get("final_softcap"), "hidden_size_per_layer_input": 0,
        "attention_k_eq_v": bool(a.get("k_eq_v")), "num_kv_shared_layers": 0,
        "enable_moe_block": bool(moe), "num_experts": moe.get("n_experts"), "top_k_experts": moe.get("top_k"),
        "moe_intermediate_size": moe.get("ffn_dim"),
        "global_head_dim": a["full_head_dim"], "num_global_key_value_heads": a["full_kv_heads"],
        "per_layer_config": {str(i): {"head_dim": a["full_head_dim"], "num_key_value_heads": a["full_kv_heads"]}
                             for i, k in enumerate(a["layer_types"]) if k == "full"},
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
