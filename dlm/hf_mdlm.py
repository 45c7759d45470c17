"""The public masked-diffusion families in their own layouts: LLaDA, Dream, SDAR, Fast-dLLM v2 <-> dlm mdlm.

Each family is a backbone dlm already has (Llama, Qwen2 with q/k/v biases, Qwen3) plus the conventions its
sampler needs, which the imported checkpoint records at its top level (dlm.sampling.mdlm reads them):

| family       | model_type     | layout                          | context      | shift | block | <mask> | preset       |
|--------------|----------------|---------------------------------|--------------|-------|-------|--------|--------------|
| llada        | llada          | its own (model.transformer.*)   | full         | no    | 0     | 126336 | llada        |
| dream        | Dream          | Qwen2 (q/k/v bias)              | full         | yes   | 0     | 151666 | dream        |
| sdar         | sdar           | Qwen3 (q/k-norm)                | block-causal | no    | 4     | 151669 | sdar         |
| fast-dllm-v2 | Fast_dLLM_Qwen | Qwen2 (q/k/v bias)              | block-causal | yes   | 32    | 151665 | fast-dllm-v2 |

context "full": every position attends to every other (no mask at all); block-causal: a block sees itself and the
blocks before it (dlm's own mdlm convention, decoded over an exact KV cache). shift: the output at position i
predicts token i + 1 (a block's first token is predicted by the last position before it). block: the training
block (`block_size` of SDAR's config, `bd_size` of Fast-dLLM v2's; 0 = none). <mask>: the config's
`mask_token_id` when it has one, else the family's id above.

The source config.json is kept in the checkpoint (`hf_config`), with the files beside the weights that carry the
tokenizer's settings, chat template and the remote code the config names; export writes them back, so an imported
folder exports to the same config and the same tensors.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dlm.checkpoint import import_tokenizer, save_checkpoint, state_tensors
from dlm.config import ModelConfig
from dlm.errors import DlmError
from dlm.files import write_folder, write_json, write_tensors
from dlm.hf_layout import assemble, dlm_name, hf_config, model_config_from_hf


@dataclass(frozen=True)
class Family:
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


FAMILIES = {f.model_type: f for f in (
    Family("llada", "llada", "LLaDAModelLM", "llada", "full", False, 0, None, 126336, "llada"),
    Family("dream", "Dream", "DreamModel", "qwen2", "full", True, 0, None, 151666, "dream"),
    Family("sdar", "sdar", "SDARForCausalLM", "qwen3", "block", False, 4, "block_size", 151669, "sdar"),
    Family("fast-dllm-v2", "Fast_dLLM_Qwen", "Fast_dLLM_QwenForCausalLM", "qwen2", "block", True, 32, "bd_size",
           151665, "fast-dllm-v2"),
)}
MODEL_TYPES = tuple(FAMILIES)
BY_NAME = {f.name: f for f in FAMILIES.values()}
# files beside the weights kept as they are (tokenizer settings, chat template, generation defaults)
SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
              "chat_template.json", "generation_config.json", "vocab.json", "merges.txt")


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
LLADA_TOP = {"embed_tokens.weight": "model.transformer.wte.weight", "norm.weight": "model.transformer.ln_f.weight",
             "lm_head.weight": "model.transformer.ff_out.weight"}


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


def llada_names(cfg: ModelConfig) -> dict[str, str]:
    """dlm name -> LLaDA's, for every tensor of a Transformer(cfg) (the tied head has none)."""
    out = {k: v for k, v in LLADA_TOP.items() if k != "lm_head.weight" or not cfg.tie_embeddings}
    for i in range(cfg.n_layers):
        for k, v in LLADA_LAYER.items():
            if k.endswith(".bias") and not cfg.attn_bias:
                continue
            out[f"layers.{i}.{k}"] = f"model.transformer.blocks.{i}.{v}"
    return out


# import / export --------------------------------------------------------------------------------------------

def family_of(hf: dict[str, Any]) -> Family:
    return FAMILIES[hf["model_type"]]


def model_config(hf: dict[str, Any], source: Path) -> ModelConfig:
    fam = family_of(hf)
    if fam.layout == "llada":
        return model_config_from_llada(hf, source)
    if fam.layout == "qwen2" and hf.get("attention_bias") is False:
        raise DlmError(f"{source}: {fam.model_type} has q/k/v biases (attention_bias false is not its layout)")
    if hf.get("use_sliding_window"):
        raise DlmError(f"{source}: sliding-window attention is not supported")
    cfg = model_config_from_hf({k: v for k, v in hf.items() if k != "attention_bias"}, source, family=fam.layout)
    if fam.layout == "qwen3" and hf.get("attention_bias"):
        raise DlmError(f"{source}: attention_bias true (a bias on q, k, v and o) is not supported for {fam.model_type}")
    return cfg


def conventions(hf: dict[str, Any], cfg: ModelConfig, source: Path) -> dict[str, Any]:
    """What the mdlm sampler needs, from the config (the family's defaults where it is silent)."""
    fam = family_of(hf)
    block = _number(hf, fam.block_key, source, fam.block) if fam.block_key else fam.block
    if block < 0:
        raise DlmError(f"{source}: {fam.block_key} must be >= 0, got {block}")
    mask = _number(hf, "mask_token_id", source, fam.mask_id)
    if not 0 <= mask < cfg.vocab_size:
        raise DlmError(f"{source}: mask_token_id {mask} is outside the vocabulary [0, {cfg.vocab_size})")
    return {"family": fam.name, "block_size": block, "mask_id": mask, "shift": fam.shift, "context": fam.context,
            "preset": fam.preset}


def dlm_state(raw: dict[str, torch.Tensor], cfg: ModelConfig, fam: Family, source: Path) -> dict[str, torch.Tensor]:
    """The folder's tensors under dlm's names (every expected one present, nothing else)."""
    if fam.layout == "llada":
        inv = {v: k for k, v in llada_names(cfg).items()}
        out = {}
        for name, t in raw.items():
            if name not in inv:
                raise DlmError(f"{source}: unexpected tensor {name!r} for LLaDA's layout")
            out[inv[name]] = t
        return out
    return {dlm_name(k, cfg, source): v for k, v in raw.items() if dlm_name(k, cfg, source) is not None}


def side_files(src: Path, hf: dict[str, Any]) -> list[str]:
    """The files kept beside the weights: tokenizer settings, chat template, and the remote code auto_map names."""
    names = [f for f in SIDE_FILES if (src / f).is_file()]
    auto = hf.get("auto_map") if isinstance(hf.get("auto_map"), dict) else {}
    for ref in auto.values():
        mod = str(ref).split("--")[-1].split(".")[0] + ".py"  # "configuration_llada.LLaDAConfig" -> its file
        if Path(mod).name == mod and (src / mod).is_file() and mod not in names:
            names.append(mod)
    return names


def import_folder(src: Path, out: Path, overwrite: bool, hf: dict[str, Any], read_weights) -> Path:
    """A local LLaDA / Dream / SDAR / Fast-dLLM v2 folder -> a dlm mdlm checkpoint, in the dtype it is stored in."""
    fam = family_of(hf)
    cfg = model_config(hf, src / "config.json")
    conv = conventions(hf, cfg, src / "config.json")
    if not (src / "tokenizer.json").is_file():
        raise DlmError(f"{src}: no tokenizer.json (dlm reads the fast tokenizer's file; transformers writes one: "
                       "AutoTokenizer.from_pretrained(FOLDER, trust_remote_code=True).save_pretrained(FOLDER))")
    tok = import_tokenizer(src, hf)
    raw = read_weights(src)
    state = dlm_state(raw, cfg, fam, src)
    model = assemble(cfg, state, src)
    dtype = state["embed_tokens.weight"].dtype
    meta = {"objective": "mdlm", "model": cfg.to_dict(), "imported_from": src.name, "data": "stdlib", **conv,
            "hf_config": hf}
    with write_folder(out, overwrite=overwrite, inputs=(src,)) as tmp:
        save_checkpoint(tmp, model, tok, meta, dtype=dtype)
        for f in side_files(src, hf):
            shutil.copyfile(src / f, tmp / f)
    return out


def layout_keys(cfg: ModelConfig, fam: Family, tok, dtype: str, src: dict[str, Any]) -> dict[str, Any]:
    """The config keys of the family's layout that carry the backbone's shape."""
    if fam.layout == "llada":
        out = {**LLADA_REQUIRED, "d_model": cfg.dim, "n_heads": cfg.n_heads, "n_kv_heads": cfg.n_kv_heads,
               "n_layers": cfg.n_layers, "mlp_hidden_size": cfg.ffn_dim, "rope_theta": cfg.rope_theta,
               "rms_norm_eps": cfg.norm_eps, "max_sequence_length": cfg.max_seq_len,
               "weight_tying": cfg.tie_embeddings, "include_qkv_bias": cfg.attn_bias, "embedding_size": cfg.vocab_size}
        out["vocab_size"] = min(src.get("vocab_size") or cfg.vocab_size, cfg.vocab_size)
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
        conv = conventions(out, cfg, Path("config.json"))
    except DlmError:
        conv = {}
    if conv.get("mask_id") != meta["mask_id"]:
        out["mask_token_id"] = meta["mask_id"]
    if fam.block_key and conv.get("block_size") != meta.get("block_size", fam.block):
        out[fam.block_key] = meta.get("block_size", fam.block)
    keys = [k for k in ("torch_dtype", "dtype") if k in src] or ["torch_dtype"]
    out.update({k: dtype for k in keys})
    return out


def hf_tensors(model, cfg: ModelConfig, fam: Family, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state = state_tensors(model, dtype)
    if fam.layout == "llada":
        names = llada_names(cfg)
        return {names[k]: v for k, v in state.items()}
    return {("" if k.startswith("lm_head.") else "model.") + k: v for k, v in state.items()}


def export_folder(model, tok, tmp: Path, dtype: torch.dtype, meta: dict[str, Any], side_dir: Path | None) -> None:
    """Write an imported mdlm checkpoint back in its family's layout into tmp."""
    fam = BY_NAME[meta["family"]]
    if model.cfg.qk_norm != (fam.layout == "qwen3") or (fam.layout == "qwen2" and not model.cfg.attn_bias):
        raise DlmError(f"--format hf: this backbone does not fit {fam.name}'s layout")
    dname = str(dtype).removeprefix("torch.")
    write_tensors(tmp / "model.safetensors", hf_tensors(model, model.cfg, fam, dtype), metadata={"format": "pt"})
    write_json(tmp / "config.json", export_config(model.cfg, meta, tok, dname))
    tok.save(tmp / "tokenizer.json")
    copied = set()
    if side_dir is not None:
        for f in side_files(side_dir, meta.get("hf_config") or {}):
            shutil.copyfile(side_dir / f, tmp / f)
            copied.add(f)
    if "tokenizer_config.json" not in copied:
        write_json(tmp / "tokenizer_config.json", tok.hf_config())
