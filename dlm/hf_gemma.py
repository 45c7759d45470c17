"""Gemma 4 / DiffusionGemma interop: transformers' config and weight names onto a ModelConfig with Gemma 4's layers.

A Gemma 4 text config (model_type gemma4_text, or the text_config of a gemma4 / diffusion_gemma
config) becomes a ModelConfig with Gemma 4's layers (its layer types and per-type attention, sandwich norms,
GeGLU, the softmax-routed experts, soft-cap: config.GEMMA_LAYERS and the per-layer fields). Weight names are
transformers' without the model prefix (`model.`, `model.language_model.`, ...).
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


def is_gemma(cfg: ModelConfig) -> bool:
    """Whether cfg has Gemma 4's layers (what this layout holds)."""
    return cfg.sandwich_norm


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


# ---------------------------------------------------------------------------------------------------------------
# import / export (dlm.hf dispatches here by model_type)

MODEL_TYPES = ("gemma4_text", "gemma4", "diffusion_gemma")


def import_folder(src, out, overwrite: bool, hf: dict[str, Any], read_weights) -> tuple[Any, str | None]:
    """A local Gemma 4 (text or multimodal: text weights) or DiffusionGemma folder -> a dlm checkpoint
    (objective ar or usdm). Returns (path, a note on what was left out, or None)."""
    import shutil
    from pathlib import Path

    import torch

    from dlm.checkpoint import SIDE_FILES, all_finite, check_shapes, import_tokenizer, save_checkpoint
    from dlm.files import release, write_folder
    from dlm.model import Transformer, param_shapes

    src, out = Path(src), Path(out)
    kind = hf.get("model_type")
    raw = read_weights(src)
    if kind == "diffusion_gemma":
        cfg, objective = model_config_from_diffusion_gemma(hf), "usdm"
        state, left = dlm_state_diffusion_gemma(raw)
        for name, t in raw.items():  # transformers ties the decoder to the encoder, but not layer_scalar
            if name.startswith("model.encoder.language_model.") and name.endswith("layer_scalar"):
                dec = raw.get("model.decoder." + name[len("model.encoder.language_model."):])
                if dec is not None and not torch.equal(dec, t):
                    raise DlmError(f"{src}: {name} differs between encoder and decoder (one backbone holds one)")
    else:
        t = hf.get("text_config") if kind == "gemma4" else hf
        if not isinstance(t, dict):
            raise DlmError(f"{src}/config.json: gemma4 needs a text_config object")
        cfg, objective = model_config_from_gemma(t), "ar"
        state = dlm_state({k: v for k, v in raw.items() if k == "lm_head.weight"
                           or k.startswith(("model.language_model.", "model.layers.", "model.embed_tokens.",
                                            "model.norm."))})
        left = [k for k in raw if k not in ("lm_head.weight",) and not k.startswith(
            ("model.language_model.", "model.layers.", "model.embed_tokens.", "model.norm."))]
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    expected, aliases = param_shapes(cfg)
    check_shapes(expected, {k: tuple(v.shape) for k, v in state.items()}, src, aliases)
    for k, v in state.items():
        if not all_finite(v):
            raise DlmError(f"{src}: tensor {k} holds NaN or infinite values")
        release(v)  # (its mapped pages leave the resident set: the import streams)
    tok = import_tokenizer(src, hf)
    with torch.device("meta"):
        model = Transformer(cfg)
    tied = {"lm_head.weight": state["embed_tokens.weight"]} if cfg.tie_embeddings else {}
    model.load_state_dict({**state, **tied}, assign=True, strict=False)
    dtype = state["embed_tokens.weight"].dtype
    meta = {"objective": objective, "model": cfg.to_dict(), "imported_from": src.name, "data": "stdlib",
            "hf_config": hf}
    if objective == "usdm":  # the reference sampler's canvas, and noise over the model's whole vocabulary
        meta.update(canvas_length=int(hf.get("canvas_length", 256)), noise_vocab=cfg.vocab_size)
    with write_folder(out, overwrite=overwrite, inputs=(src,)) as tmp:
        save_checkpoint(tmp, model, tok, meta, dtype=dtype)
        for f in SIDE_FILES:
            if (src / f).is_file():
                shutil.copyfile(src / f, tmp / f)
    note = None
    if left:
        towers = sorted({".".join(n.split(".")[:3]) for n in left})
        note = f"left out {len(left)} tensors of {', '.join(towers)} (text weights only)"
    return out, note


def hf_tensors(model, dtype) -> tuple[dict[str, Any], dict[str, Any]]:
    """(transformers tensors, config.json) of a gemma4 backbone: Gemma4ForCausalLM (ar), or
    DiffusionGemmaForBlockDiffusion (self-conditioned: usdm), the encoder's copy written beside the decoder's."""
    from dlm.checkpoint import state_tensors

    cfg = model.cfg
    state = state_tensors(model, dtype)
    text = gemma_text_config(cfg)
    if not cfg.self_cond:
        out = {("" if k.startswith("lm_head.") else "model.") + k: v for k, v in state.items()}
        return out, {**text, "architectures": ["Gemma4ForCausalLM"]}
    inv = {v: k for k, v in DG_SELF_COND.items()}
    out = {}
    for k, v in state.items():
        if k.startswith("self_cond."):
            out["model.decoder.self_conditioning." + inv[k[len("self_cond."):]]] = v
        elif k.startswith("lm_head."):
            out[k] = v
        else:
            out["model.decoder." + k] = v
            out["model.encoder.language_model." + k] = v
    for k in ("attention_k_eq_v", "hidden_size_per_layer_input", "num_kv_shared_layers", "enable_moe_block"):
        text.pop(k)
    text["model_type"] = "diffusion_gemma_text"
    return out, {"model_type": "diffusion_gemma", "architectures": ["DiffusionGemmaForBlockDiffusion"],
                 "text_config": text}


def export_folder(model, tok, tmp, dtype, source_config: dict[str, Any] | None, side_dir=None) -> None:
    """Write a gemma4 backbone as a transformers folder into tmp (config.json, model.safetensors, tokenizer)."""
    import shutil
    from pathlib import Path

    from dlm.checkpoint import SIDE_FILES
    from dlm.files import write_json, write_tensors

    tensors, config = hf_tensors(model, dtype)
    src = source_config or {}
    if config["model_type"] == "diffusion_gemma" and src.get("model_type") == "diffusion_gemma":
        config = {**{k: v for k, v in src.items() if k != "text_config"}, **config,
                  "text_config": {**src.get("text_config", {}), **config["text_config"]}}
    elif src.get("model_type") == "gemma4_text":
        config = {**src, **config}
    config["dtype"] = str(dtype).removeprefix("torch.")
    for k, v in (("eos_token_id", tok.hf_eos_token_id), ("bos_token_id", tok.bos_id), ("pad_token_id", tok.pad_id)):
        config.setdefault(k, v)
    write_tensors(Path(tmp) / "model.safetensors", tensors, metadata={"format": "pt"})
    write_json(Path(tmp) / "config.json", config)
    tok.save(Path(tmp) / "tokenizer.json")
    copied = set()
    if side_dir is not None:
        for f in SIDE_FILES:
            if (Path(side_dir) / f).is_file():
                shutil.copyfile(Path(side_dir) / f, Path(tmp) / f)
                copied.add(f)
    if "tokenizer_config.json" not in copied:
        write_json(Path(tmp) / "tokenizer_config.json", tok.hf_config())
    if "generation_config.json" not in copied:  # every EOS id, where transformers' generate reads them
        write_json(Path(tmp) / "generation_config.json", {"eos_token_id": tok.hf_eos_token_id,
                                                          "bos_token_id": tok.bos_id, "pad_token_id": tok.pad_id})
