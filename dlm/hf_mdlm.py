"""The public masked-diffusion families in their own layouts: LLaDA, Dream, SDAR, Fast-dLLM v2, LLaDA 2 <-> dlm mdlm:
their config.json mappings and the conventions their samplers need (rows of dlm.families; dlm.hf imports and
exports them).

Each family is a backbone dlm already has (Llama, Qwen2 with q/k/v biases, Qwen3) plus the conventions its
sampler needs, which the imported checkpoint records at its top level (dlm.sampling.mdlm reads them):

| family       | model_type     | layout                          | context      | shift | block | <mask> | preset       |
|--------------|----------------|---------------------------------|--------------|-------|-------|--------|--------------|
| llada        | llada          | its own (model.transformer.*)   | full         | no    | 0     | 126336 | llada        |
| dream        | Dream          | Qwen2 (q/k/v bias)              | full         | yes   | 0     | 151666 | dream        |
| sdar         | sdar           | Qwen3 (q/k-norm)                | block-causal | no    | 4     | 151669 | sdar         |
| fast-dllm-v2 | Fast_dLLM_Qwen | Qwen2 (q/k/v bias)              | block-causal | yes   | 32    | 151665 | fast-dllm-v2 |
| llada2       | llada2_moe     | BailingMoeV2 (its own names)    | block-causal | no    | 32    | 156895 | llada2       |

context "full": every position attends to every other (no mask at all); block-causal: a block sees itself and the
blocks before it (dlm's own mdlm convention, decoded over an exact KV cache). shift: the output at position i
predicts token i + 1 (a block's first token is predicted by the last position before it). block: the training
block (`block_size` of SDAR's config, `bd_size` of Fast-dLLM v2's; 0 = none). <mask>: the config's
`mask_token_id` when it has one, else the family's id above.

LLaDA 2 (LLaDA2.0-mini 16B-A1.4B, LLaDA2.0-flash 100B-A6.1B; remote code modeling_llada2_moe.py) is the Qwen3 block
(q/k-norm, GQA, SwiGLU) with partial rotary (`partial_rotary_factor`, `ModelConfig.partial_rotary`), a fused
`query_key_value` projection (split into q, k, v on import, concatenated back on export: dlm.families.SPLIT_QKV)
and, from layer
`first_k_dense_replace` on, a mixture of experts with shared experts and a sigmoid, group-limited router
(`ModelConfig.moe`, dlm.moe); its experts, stored one by one, are stacked into dlm's fused expert tensors
(dlm.families.EXPERTS).

The source config.json is kept in the checkpoint (`hf_config`), with the files beside the weights that carry the
tokenizer's settings, chat template and the remote code (what the auto_maps name and what it imports); export
writes them back, so an imported folder exports to the same config and the same tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dlm.config import ModelConfig
from dlm.errors import DlmError
from dlm.hf_layout import hf_config, model_config_from_hf


@dataclass(frozen=True)
class Conventions:
    """An mdlm family's layout and sampler conventions (the table above); its row in dlm.families reads them."""

    name: str  # dlm's name (the checkpoint's "family")
    model_type: str  # config.json's model_type
    architecture: str
    layout: str  # llada | qwen2 | qwen3: the weight names and config keys
    context: str  # full | block
    shift: bool
    block: int  # default training block when the config names none (0 = none)
    block_key: str | None  # the config key holding the block
    mask_id: int  # default <mask> id when the config names none
    preset: str


CONVENTIONS = {f.model_type: f for f in (
    Conventions("llada", "llada", "LLaDAModelLM", "llada", "full", False, 0, None, 126336, "llada"),
    Conventions("dream", "Dream", "DreamModel", "qwen2", "full", True, 0, None, 151666, "dream"),
    Conventions("sdar", "sdar", "SDARForCausalLM", "qwen3", "block", False, 4, "block_size", 151669, "sdar"),
    Conventions("fast-dllm-v2", "Fast_dLLM_Qwen", "Fast_dLLM_QwenForCausalLM", "qwen2", "block", True, 32, "bd_size",
           151665, "fast-dllm-v2"),
    Conventions("llada2", "llada2_moe", "LLaDA2MoeModelLM", "llada2", "block", False, 32, None, 156895, "llada2"),
)}
BY_NAME = {f.name: f for f in CONVENTIONS.values()}


# LLaDA's layout ----------------------------------------------------------------------------------------------

# LLaDA's config switches that must hold their Llama-like values (None: absent is fine too)
LLADA_REQUIRED = {"block_type": "llama", "activation_type": "silu", "layer_norm_type": "rms", "rope": True,
                  "alibi": False, "include_bias": False, "attention_layer_norm": False, "input_emb_norm": False,
                  "scale_logits": False, "block_group_size": 1, "multi_query_attention": False,
                  "layer_norm_with_affine": True, "bias_for_layer_norm": False}
LLADA_DEFAULTS = {"block_type": "sequential", "activation_type": "swiglu", "layer_norm_type": "default",
                  "rope": False, "alibi": False, "include_bias": False, "attention_layer_norm": False,
                  "input_emb_norm": False, "scale_logits": False, "block_group_size": 1,
                  "multi_query_attention": None, "layer_norm_with_affine": True, "bias_for_layer_norm": None}
# dlm name inside a layer -> LLaDA's
LLADA_LAYER = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "q_proj.weight",
               "self_attn.k_proj.weight": "k_proj.weight", "self_attn.v_proj.weight": "v_proj.weight",
               "self_attn.q_proj.bias": "q_proj.bias", "self_attn.k_proj.bias": "k_proj.bias",
               "self_attn.v_proj.bias": "v_proj.bias", "self_attn.o_proj.weight": "attn_out.weight",
               "post_attention_layernorm.weight": "ff_norm.weight", "mlp.gate_proj.weight": "ff_proj.weight",
               "mlp.up_proj.weight": "up_proj.weight", "mlp.down_proj.weight": "ff_out.weight"}


def _number(hf: dict[str, Any], key: str, source: Path, default: Any = None, kind: type = int) -> Any:
    v = hf.get(key)
    if v is None:
        if default is None:
            raise DlmError(f"{source}: {key} is missing")
        return default
    ok = isinstance(v, (int, float)) if kind is float else isinstance(v, int)
    if not ok or isinstance(v, bool):
        raise DlmError(f"{source}: {key} must be {'a number' if kind is float else 'an integer'}, got {v!r}"[:200])
    return v


def model_config_from_llada(hf: dict[str, Any], source: Path) -> ModelConfig:
    """LLaDA's config.json (its own keys) -> ModelConfig: a Llama block (SwiGLU, RMSNorm, RoPE), full MHA or GQA."""
    for key, want in LLADA_REQUIRED.items():
        got = hf.get(key, LLADA_DEFAULTS[key])
        if key == "multi_query_attention":
            got = bool(got)
        if key == "bias_for_layer_norm" and got is None:
            got = bool(hf.get("include_bias", False))
        if got != want:
            raise DlmError(f"{source}: LLaDA {key} {got!r} is not supported ({want!r} is)"[:200])
    d, heads = _number(hf, "d_model", source), _number(hf, "n_heads", source)
    if heads <= 0 or d % heads:
        raise DlmError(f"{source}: d_model ({d}) must be a multiple of n_heads ({heads})")
    vocab = _number(hf, "embedding_size", source, _number(hf, "vocab_size", source))
    ffn = _number(hf, "mlp_hidden_size", source, _number(hf, "mlp_ratio", source, 4) * d)
    try:
        return ModelConfig(
            vocab_size=vocab, dim=d, n_layers=_number(hf, "n_layers", source), n_heads=heads,
            n_kv_heads=_number(hf, "n_kv_heads", source, heads), head_dim=d // heads, ffn_dim=ffn,
            rope_theta=float(_number(hf, "rope_theta", source, 10000.0, float)),
            norm_eps=float(_number(hf, "rms_norm_eps", source, 1e-5, float)), qk_norm=False,
            attn_bias=bool(hf.get("include_qkv_bias", False)), tie_embeddings=bool(hf.get("weight_tying", True)),
            max_seq_len=_number(hf, "max_sequence_length", source, 1024))
    except DlmError as e:
        raise DlmError(f"{source}: {e}") from None


# LLaDA 2's layout (modeling_llada2_moe.py: LLaDA2MoeModelLM) ---------------------------------------------------

# config switches that must hold these values (the config class's default when absent)
LLADA2_REQUIRED = {"hidden_act": ("silu", "silu"), "use_qk_norm": (True, True), "norm_head": (False, False),
                   "use_bias": (False, True), "use_sliding_window": (False, False), "rope_scaling": (None, None),
                   "score_function": ("sigmoid", "sigmoid"), "moe_router_enable_expert_bias": (True, True),
                   "norm_topk_prob": (True, True)}
LLADA2_WHY = {"use_bias": "a bias on the attention output (dense) is not supported",
              "norm_topk_prob": "its modeling code normalises the top-k weights whatever the key says"}
# dlm name inside a layer -> LLaDA 2's (q/k/v: the fused query_key_value; the experts: one module each)
LLADA2_LAYER = {"input_layernorm.weight": "input_layernorm.weight",
                "post_attention_layernorm.weight": "post_attention_layernorm.weight",
                "self_attn.q_norm.weight": "attention.query_layernorm.weight",
                "self_attn.k_norm.weight": "attention.key_layernorm.weight",
                "self_attn.o_proj.weight": "attention.dense.weight",
                "mlp.gate_proj.weight": "mlp.gate_proj.weight", "mlp.up_proj.weight": "mlp.up_proj.weight",
                "mlp.down_proj.weight": "mlp.down_proj.weight", "mlp.gate.weight": "mlp.gate.weight",
                "mlp.gate.expert_bias": "mlp.gate.expert_bias",
                **{f"mlp.shared_experts.{p}_proj.weight": f"mlp.shared_experts.{p}_proj.weight"
                   for p in ("gate", "up", "down")}}


def model_config_from_llada2(hf: dict[str, Any], source: Path) -> ModelConfig:
    """LLaDA 2's config.json (configuration_llada2_moe.py's keys and defaults) -> ModelConfig with its partial rotary
    and its mixture of experts."""
    for key, (want, default) in LLADA2_REQUIRED.items():
        got = hf.get(key, default)
        if got != want:
            why = LLADA2_WHY.get(key, f"{want!r} is")
            raise DlmError(f"{source}: LLaDA 2 {key} {got!r} is not supported ({why})"[:200])
    d, heads = _number(hf, "hidden_size", source), _number(hf, "num_attention_heads", source)
    if heads <= 0 or d % heads:
        raise DlmError(f"{source}: hidden_size ({d}) must be a multiple of num_attention_heads ({heads})")
    hd = _number(hf, "head_dim", source, d // heads)
    prf = float(_number(hf, "partial_rotary_factor", source, 0.5, float))
    if hf.get("rotary_dim") is not None and _number(hf, "rotary_dim", source) != int(hd * prf):
        raise DlmError(f"{source}: rotary_dim {hf['rotary_dim']} is not head_dim x partial_rotary_factor "
                       f"({int(hd * prf)})")
    layers = _number(hf, "num_hidden_layers", source)
    moe = None
    if hf.get("num_experts") is not None:
        moe = {"n_experts": _number(hf, "num_experts", source), "top_k": _number(hf, "num_experts_per_tok", source, 2),
               "ffn_dim": _number(hf, "moe_intermediate_size", source), "shared": hf.get("num_shared_experts") or 0,
               "first_dense": _number(hf, "first_k_dense_replace", source, 0),
               "n_group": _number(hf, "n_group", source, 8), "topk_group": _number(hf, "topk_group", source, 4),
               "scale": float(_number(hf, "routed_scaling_factor", source, 2.5, float))}
    dense = moe is None or moe["first_dense"] > 0
    ffn = _number(hf, "intermediate_size", source) if dense else hf.get("intermediate_size") or moe["ffn_dim"]
    kv = hf.get("num_key_value_heads") or heads  # (0: as many as the query heads, the config class says)
    try:
        return ModelConfig(
            vocab_size=_number(hf, "vocab_size", source), dim=d, n_layers=layers, n_heads=heads, n_kv_heads=kv,
            head_dim=hd, ffn_dim=ffn, rope_theta=float(_number(hf, "rope_theta", source, 10000.0, float)),
            norm_eps=float(_number(hf, "rms_norm_eps", source, 1e-5, float)), qk_norm=True,
            attn_bias=bool(hf.get("use_qkv_bias", False)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_seq_len=_number(hf, "max_position_embeddings", source, 16384), partial_rotary=prf, moe=moe)
    except DlmError as e:
        raise DlmError(f"{source}: {e}") from None


# import / export --------------------------------------------------------------------------------------------

def family_of(hf: dict[str, Any]) -> Conventions:
    return CONVENTIONS[hf["model_type"]]


def model_config(hf: dict[str, Any], source: Path) -> ModelConfig:
    fam = family_of(hf)
    if fam.layout == "llada":
        return model_config_from_llada(hf, source)
    if fam.layout == "llada2":
        return model_config_from_llada2(hf, source)
    if fam.layout == "qwen2" and hf.get("attention_bias") is False:
        raise DlmError(f"{source}: {fam.model_type} has q/k/v biases (attention_bias false is not its layout)")
    if hf.get("use_sliding_window"):
        raise DlmError(f"{source}: sliding-window attention is not supported")
    cfg = model_config_from_hf({k: v for k, v in hf.items() if k != "attention_bias"}, source, family=fam.layout)
    if fam.layout == "qwen3" and hf.get("attention_bias"):
        raise DlmError(f"{source}: attention_bias true (a bias on q, k, v and o) is not supported for {fam.model_type}")
    return cfg


def conventions(hf: dict[str, Any], cfg: ModelConfig, source: Path, tok_mask: int | None = None) -> dict[str, Any]:
    """What the mdlm sampler needs, from the config (the family's defaults where it is silent). <mask>: the config's
    mask_token_id, else the tokenizer's mask token (tok_mask: `<|MASK|>`, `<|mask|>`, ...), else the family's id."""
    fam = family_of(hf)
    block = _number(hf, fam.block_key, source, fam.block) if fam.block_key else fam.block
    if block < 0:
        raise DlmError(f"{source}: {fam.block_key} must be >= 0, got {block}")
    mask = _number(hf, "mask_token_id", source, fam.mask_id if tok_mask is None else tok_mask)
    if not 0 <= mask < cfg.vocab_size:
        raise DlmError(f"{source}: mask_token_id {mask} is outside the vocabulary [0, {cfg.vocab_size})")
    return {"family": fam.name, "block_size": block, "mask_id": mask, "shift": fam.shift, "context": fam.context,
            "preset": fam.preset}


def layout_keys(cfg: ModelConfig, fam: Conventions, tok, dtype: str, src: dict[str, Any]) -> dict[str, Any]:
    """The config keys of the family's layout that carry the backbone's shape."""
    if fam.layout == "llada":
        out = {**LLADA_REQUIRED, "d_model": cfg.dim, "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads,
               "n_layers": cfg.n_layers, "mlp_hidden_size": cfg.ffn_dim, "rope_theta": cfg.rope_theta,
               "rms_norm_eps": cfg.norm_eps, "max_sequence_length": cfg.max_seq_len,
               "weight_tying": cfg.tie_embeddings, "include_qkv_bias": cfg.attn_bias, "embedding_size": cfg.vocab_size}
        out["vocab_size"] = min(src.get("vocab_size") or cfg.vocab_size, cfg.vocab_size)
        return out
    if fam.layout == "llada2":
        out = {k: want for k, (want, _) in LLADA2_REQUIRED.items()}
        out.update({"vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.ffn_dim,
                    "num_hidden_layers": cfg.n_layers, "num_attention_heads": cfg.n_heads,
                    "num_key_value_heads": cfg.n_kv_heads, "head_dim": cfg.head_dim,
                    "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
                    "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_embeddings,
                    "use_qkv_bias": cfg.attn_bias, "partial_rotary_factor": cfg.partial_rotary})
        if "rotary_dim" in src:
            out["rotary_dim"] = int(cfg.head_dim * cfg.partial_rotary)
        m = cfg.moe
        out.update({"num_experts": m and m.n_experts, "num_experts_per_tok": m and m.top_k,
                    "moe_intermediate_size": m and m.ffn_dim, "num_shared_experts": m and m.shared,
                    "first_k_dense_replace": m.first_dense if m else 0, "n_group": m and m.n_group,
                    "topk_group": m and m.topk_group, "routed_scaling_factor": m and m.scale})
        return out
    base = hf_config(cfg, tok, dtype)
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
            "rope_scaling", "tie_word_embeddings", "hidden_act")
    return {k: base[k] for k in keep}


def export_config(cfg: ModelConfig, meta: dict[str, Any], tok, dtype: str) -> dict[str, Any]:
    """config.json in the family's layout: the imported one, unchanged where it still describes the checkpoint
    (an imported folder exports to the config it came with), the backbone's keys and conventions written over it
    where they no longer do."""
    fam = BY_NAME[meta["family"]]
    src = dict(meta.get("hf_config") or {})
    out = {**src, "model_type": fam.model_type}
    out.setdefault("architectures", [fam.architecture])
    try:
        same = bool(src) and model_config(out, Path("config.json")) == cfg
    except DlmError:
        same = False
    if not same:
        out.update(layout_keys(cfg, fam, tok, dtype, src))
    try:
        # (the tokenizer's <mask> counts where the imported config relied on it; a config written from the backbone
        # names its mask_token_id unless it is the family's)
        conv = conventions(out, cfg, Path("config.json"), tok.mask_id if src else None)
    except DlmError:
        conv = {}
    if conv.get("mask_id") != meta["mask_id"]:
        out["mask_token_id"] = meta["mask_id"]
    if fam.block_key and conv.get("block_size") != meta.get("block_size", fam.block):
        out[fam.block_key] = meta.get("block_size", fam.block)
    keys = [k for k in ("torch_dtype", "dtype") if k in src] or ["torch_dtype"]
    out.update({k: dtype for k in keys})
    return out


def finetuned_meta(meta: dict[str, Any]) -> dict[str, Any] | None:
    """A checkpoint dlm fine-tuned from an imported family (`dlm train --objective mdlm --init-from`: the import's
    hf_config travels on) whose convention is the one dlm trains (block-causal, unshifted: SDAR, LLaDA 2): the meta
    its export writes the family's layout from (the family named, the trained block and <mask>). Else None: a family
    read shifted or with full attention (Dream, Fast-dLLM v2, LLaDA) is no longer that family once dlm fine-tunes it
    its own way."""
    hf = meta.get("hf_config")
    if meta.get("objective") != "mdlm" or meta.get("family") or not isinstance(hf, dict):
        return None
    fam = CONVENTIONS.get(hf.get("model_type"))
    if fam is None or fam.context != "block" or fam.shift or meta.get("mask_id") is None:
        return None
    return {**meta, "family": fam.name}
