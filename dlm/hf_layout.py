"""transformers' Qwen3 / Qwen2 / Llama / Ministral 3 / Qwen3-MoE layout: config.json keys <-> ModelConfig, and a
folder's remote code. The rows of dlm.families (and dlm.hf_mdlm's public masked-diffusion models, most of which
use this layout) build on it. Nothing here imports transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dlm.config import ModelConfig
from dlm.errors import DlmError
from dlm.files import read_json
from dlm.tokenizer import Tokenizer


def hf_family(cfg: ModelConfig) -> str:
    """The transformers family a dlm backbone is: Qwen3 (q/k-norm), Qwen3-MoE (q/k-norm, the topk router's experts),
    Qwen2 (q/k/v bias), Ministral 3 (neither, with the queries' attention temperature: Llama's layers, YaRN) or Llama
    (neither)."""
    if (cfg.moe and cfg.moe.router == "topk" and cfg.moe.first_dense == 0 and cfg.qk_norm and not cfg.attn_bias
            and cfg.partial_rotary == 1):
        return "qwen3_moe"
    if cfg.moe or cfg.partial_rotary != 1:
        raise DlmError("--format hf: a mixture-of-experts or partial-rotary backbone has no Qwen3/Qwen2/Llama layout "
                       "(an imported LLaDA 2 exports to its own)")
    if cfg.qk_norm and cfg.attn_bias:
        raise DlmError("--format hf: q/k-norm with q/k/v biases has no transformers layout (Qwen3 or Qwen2 has one)")
    if cfg.qk_norm or cfg.attn_bias:
        return "qwen3" if cfg.qk_norm else "qwen2"
    return "ministral3" if "llama_4_scaling_beta" in (cfg.rope_scaling or {}) else "llama"


ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                 "ministral3": "Ministral3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def hf_config(cfg: ModelConfig, tok: Tokenizer, dtype: str = "float32") -> dict[str, Any]:
    family = hf_family(cfg)
    rope_params: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling:
        rope_params = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURES[family]],
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
        "eos_token_id": tok.hf_eos_token_id,
        "pad_token_id": tok.pad_id,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if family in ("qwen3", "qwen2", "qwen3_moe"):
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.n_layers)
        if family == "qwen3_moe":
            m = cfg.moe
            out.update(num_experts=m.n_experts, num_experts_per_tok=m.top_k, moe_intermediate_size=m.ffn_dim,
                       norm_topk_prob=m.norm_topk, decoder_sparse_step=1, mlp_only_layers=list(m.dense_layers),
                       output_router_logits=False)
        if family == "qwen2":
            out.pop("attention_bias")  # Qwen2's q/k/v always carry a bias (the key means nothing to it)
    elif family == "ministral3":  # the temperature's keys live in rope_parameters, as Ministral3Config keeps them
        out.update(sliding_window=None, rope_scaling=None)
        out.pop("attention_bias")
    else:
        out.update(mlp_bias=False, pretraining_tp=1)
    return out


def _rope(hf: dict[str, Any], temperature: bool = False) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and the scaling dict (ModelConfig.rope_scaling); temperature: the family reads
    llama_4_scaling_beta (Ministral 3; Llama and Qwen ignore the key, and so does this then)."""
    params = hf.get("rope_parameters") or {}
    for key in ("rope_parameters", "rope_scaling"):
        if hf.get(key) is not None and not isinstance(hf[key], dict):
            raise DlmError(f"config.json: {key} must be an object, got {hf[key]!r}"[:200])
    theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = hf.get("rope_scaling") or (params if params.get("rope_type", "default") != "default"
                                         or "llama_4_scaling_beta" in params else None)
    if scaling and not temperature:
        scaling = {k: v for k, v in scaling.items() if k != "llama_4_scaling_beta"}
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type"))
        orig = scaling.get("original_max_position_embeddings")
        if scaling.get("llama_4_scaling_beta") and (not isinstance(orig, int) or isinstance(orig, bool) or orig < 1):
            raise DlmError(f"config.json: rope llama_4_scaling_beta needs original_max_position_embeddings (a "
                           f"positive integer), got {orig!r}"[:200])
        if kind == "default" and "llama_4_scaling_beta" in scaling:  # plain RoPE, the queries' temperature kept
            scaling = {"rope_type": "default", "llama_4_scaling_beta": scaling["llama_4_scaling_beta"],
                       **({"original_max_position_embeddings": orig} if orig is not None else {})}
        elif kind == "default":
            scaling = None
        elif kind not in ("llama3", "yarn"):
            raise DlmError(f"config.json: rope scaling {kind!r} is not supported (default, llama3 and yarn are)")
        else:  # (transformers' standardized copy repeats the context length and the old key `type`)
            scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type", "max_position_embeddings")}
            scaling["rope_type"] = kind
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not 0 < theta < float("inf"):
        raise DlmError(f"config.json: rope_theta must be a finite number > 0, got {theta!r}"[:200])
    return float(theta), scaling


def model_config_from_hf(hf: dict[str, Any], source: Path, family: str | None = None) -> ModelConfig:
    """A Qwen3 / Qwen2 / Llama / Ministral 3 / Qwen3-MoE config.json (or one in their layout: family names which) ->
    ModelConfig. Ministral 3 is Llama's layers with YaRN and the queries' attention temperature (rope_parameters'
    llama_4_scaling_beta), both in ModelConfig.rope_scaling. Qwen3-MoE is Qwen3's layers with the topk router's
    experts in place of the MLP, except in the mlp_only_layers and the layers decoder_sparse_step skips."""
    kind = family if family is not None else hf.get("model_type")
    if kind not in ("qwen3", "qwen2", "llama", "ministral3", "qwen3_moe"):
        raise DlmError(f"{source}: model_type {kind!r} is not supported (qwen3, qwen2, llama, ministral3 and "
                       "qwen3_moe are in this layout)")
    if (hf.get("attention_bias") and kind != "qwen2") or hf.get("mlp_bias"):
        raise DlmError(f"{source}: attention/MLP biases are not supported (except Qwen2's q/k/v biases)")
    if hf.get("use_sliding_window") or (kind == "ministral3" and hf.get("sliding_window")):
        raise DlmError(f"{source}: sliding-window attention is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise DlmError(f"{source}: hidden_act {hf.get('hidden_act')!r} is not supported (silu is)")
    theta, scaling = _rope(hf, temperature=kind == "ministral3")

    def get(key: str, default: Any = None) -> Any:
        if hf.get(key) is None:
            if default is None:
                raise DlmError(f"{source}: {key} is missing (a {kind} config.json has it)")
            return default
        v = hf[key]
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise DlmError(f"{source}: {key} must be a number, got {v!r}"[:200])
        return v

    n_heads, dim = get("num_attention_heads"), get("hidden_size")
    moe = _qwen3_moe(hf, source, get) if kind == "qwen3_moe" else None
    try:
        return ModelConfig(
            vocab_size=get("vocab_size"), dim=dim, n_layers=get("num_hidden_layers"), n_heads=n_heads,
            n_kv_heads=get("num_key_value_heads", n_heads),
            head_dim=get("head_dim", dim // n_heads if isinstance(n_heads, int) and n_heads > 0 else 0),
            ffn_dim=get("intermediate_size"), rope_theta=theta, rope_scaling=scaling,
            norm_eps=get("rms_norm_eps", 1e-6),
            qk_norm=kind in ("qwen3", "qwen3_moe"), attn_bias=kind == "qwen2", moe=moe,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_seq_len=get("max_position_embeddings", 4096),
        )
    except DlmError as e:
        raise DlmError(f"{source}: {e}") from None


def _qwen3_moe(hf: dict[str, Any], source: Path, get) -> dict[str, Any] | None:
    """Qwen3-MoE's experts (MoEConfig's topk router): layer i has them unless it is one of mlp_only_layers or
    (i + 1) is not a multiple of decoder_sparse_step (transformers' Qwen3MoeDecoderLayer); None: no experts."""
    n = hf.get("num_experts", hf.get("num_local_experts"))
    if not n:
        return None
    L, step = get("num_hidden_layers"), get("decoder_sparse_step", 1)
    only = hf.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in only):
        raise DlmError(f"{source}: mlp_only_layers must be a list of layer indices, got {only!r}"[:200])
    if not isinstance(step, int) or step < 1:
        raise DlmError(f"{source}: decoder_sparse_step must be a positive integer, got {step!r}")
    dense = sorted({i for i in range(L) if i in only or (i + 1) % step})
    return {"n_experts": n, "top_k": get("num_experts_per_tok"), "ffn_dim": get("moe_intermediate_size"),
            "router": "topk", "norm_topk": bool(hf.get("norm_topk_prob", False)), "dense_layers": dense}


def remote_code(src: Path, hf: dict[str, Any]) -> list[str]:
    """The remote code of a folder, in the order found: the modules the `auto_map` of config.json (`hf`) and of
    tokenizer_config.json name, then every module beside them that those import, recursively (Dream's
    modeling_dream.py imports generation_utils.py, which its folder must carry to load)."""
    import ast

    def named(cfg: Any) -> list[str]:
        auto = cfg.get("auto_map") if isinstance(cfg, dict) else None
        refs = []
        for v in (auto.values() if isinstance(auto, dict) else []):
            refs += v if isinstance(v, list) else [v]
        return [str(r).split("--")[-1].split(".")[0] for r in refs if isinstance(r, str)]

    tok_cfg = read_json(src / "tokenizer_config.json") if (src / "tokenizer_config.json").is_file() else {}
    todo, out = named(hf) + named(tok_cfg), []
    while todo:
        mod = todo.pop(0)
        f = f"{mod}.py"
        if Path(f).name != f or f in out or not (src / f).is_file():
            continue
        out.append(f)
        try:
            tree = ast.parse((src / f).read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # (not Python dlm can read: kept, its imports unknown)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.module:
                    todo.append(node.module.split(".")[0])
                if node.level and not node.module:  # from . import a, b
                    todo += [n.name for n in node.names]
            elif isinstance(node, ast.Import):
                todo += [n.name.split(".")[0] for n in node.names]
    return out
