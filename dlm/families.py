"""The transformers families dlm reads and writes, one row each (`FAMILIES`); dlm.hf's one driver imports and
exports every row the same way (config -> tokenizer -> tensors -> checks -> save, and back).

A row says:
- which config.json model_type(s) it reads, and the paradigm (objective) its checkpoints are;
- `config`: config.json -> ModelConfig (a one-line DlmError on what does not fit), and `export_config` back;
- `names`: dlm tensor name -> transformers name(s), litgpt's weight-map style: `{}` stands for a layer index, a
  trailing `*` for the rest of a name; the first entry that matches wins; a tuple: the tensor is stored under
  each name (DiffusionGemma's tied encoder copy: import reads the first present and holds the others equal);
- `transforms`: the tensors a names map cannot pair one to one (LLaDA 2's fused query_key_value, experts stored
  one by one), each a small pair of functions (`Transform`);
- `conventions`: the checkpoint's top-level keys beside the model (an mdlm family's <mask> id, block, shift and
  preset; DiffusionGemma's canvas); `keep_config`: the source config.json is recorded (`hf_config`) so the export
  writes it back; `remote_code`: the folder's remote code travels with the side files (dlm.checkpoint.SIDE_FILES);
- `fits`: the export's refusal of a model the layout cannot hold.

Adding a family is a row here, plus at most one transform. Nothing here imports transformers.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from dlm import hf_gemma, hf_joint, hf_mdlm
from dlm.checkpoint import import_tokenizer
from dlm.config import ModelConfig
from dlm.errors import DlmError
from dlm.files import Stacked, mmap_tensors
from dlm.hf_layout import hf_config, hf_family, model_config_from_hf
from dlm.moe import is_moe_layer
from dlm.tokenizer import Tokenizer


@dataclass(frozen=True)
class Transform:
    """dlm tensors made from several transformers tensors, or several from one. `groups(cfg)`: per group, (dlm
    names, transformers names); `to_dlm(cfg, dlm names, transformers tensors)` -> the dlm tensors, `to_hf(cfg, dlm
    names, dlm tensors)` -> the transformers ones, in the groups' orders. Import runs to_dlm on memory-mapped
    tensors as each result is written; the shapes a folder must hold are to_hf's on the meta device."""

    groups: Callable[[ModelConfig], list[tuple[tuple[str, ...], tuple[str, ...]]]]
    to_dlm: Callable[[ModelConfig, tuple[str, ...], list[Tensor]], list[Tensor]]
    to_hf: Callable[[ModelConfig, tuple[str, ...], list[Tensor]], list[Tensor]]


def _qkv_sizes(cfg: ModelConfig) -> list[int]:
    return [cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim]


# LLaDA 2's query_key_value: rows [q ; k ; v] (its attention views the fused output as heads q, then k, then v)
SPLIT_QKV = Transform(
    groups=lambda cfg: [(tuple(f"layers.{i}.self_attn.{n}_proj.{kind}" for n in "qkv"),
                         (f"model.layers.{i}.attention.query_key_value.{kind}",))
                        for i in range(cfg.n_layers) for kind in ("weight", "bias")[:1 + cfg.attn_bias]],
    to_dlm=lambda cfg, names, ts: list(ts[0].split(_qkv_sizes(cfg), 0)),
    to_hf=lambda cfg, names, ts: [torch.cat(ts, 0)])


def _expert_groups(cfg: ModelConfig) -> list[tuple[tuple[str, ...], tuple[str, ...]]]:
    out = []
    for i in range(cfg.n_layers):
        if is_moe_layer(cfg, i):
            p, experts = f"model.layers.{i}.mlp.experts.", range(cfg.moe.n_experts)
            out.append(((f"layers.{i}.mlp.experts.gate_up_proj",),
                        tuple(f"{p}{e}.{w}_proj.weight" for e in experts for w in ("gate", "up"))))
            out.append(((f"layers.{i}.mlp.experts.down_proj",), tuple(f"{p}{e}.down_proj.weight" for e in experts)))
    return out


def stack_experts(cfg: ModelConfig, names: tuple[str, ...], ts: list[Tensor]) -> list[Stacked]:
    """The experts of a layer stored one by one -> dlm's fused tensor: gate_up_proj (E, 2I, D) from each expert's
    [gate ; up], down_proj (E, D, I). Lazily: the parts laid end to end are the stack's bytes (files.Stacked), written
    part by part, so no layer's experts are ever in memory at once."""
    E = cfg.moe.n_experts
    per = len(ts) // E  # 2: gate and up; 1: down
    dtypes = {t.dtype for t in ts}
    if len(dtypes) > 1:
        raise DlmError(f"the experts of {names[0].rsplit('.', 2)[0]} are stored in several dtypes "
                       f"({', '.join(sorted(str(d).removeprefix('torch.') for d in dtypes))})")
    return [Stacked(ts, (E, sum(t.shape[0] for t in ts[:per]), ts[0].shape[1]))]


def unstack_experts(cfg: ModelConfig, names: tuple[str, ...], ts: list[Tensor]) -> list[Tensor]:
    (t,) = ts
    if names[0].endswith("gate_up_proj"):
        I = cfg.moe.ffn_dim
        return [part for e in range(t.shape[0]) for part in (t[e, :I], t[e, I:])]
    return list(t.unbind(0))


# experts stored one by one as model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight (LLaDA 2, Qwen3-MoE)
EXPERTS = Transform(groups=_expert_groups, to_dlm=stack_experts, to_hf=unstack_experts)


Prepare = Callable[["Family", dict, Path, Any], tuple[ModelConfig, Tokenizer, dict]]


@dataclass(frozen=True)
class Family:
    name: str  # dlm's name of the family (recorded as the checkpoint's "family" by the mdlm and joint rows)
    model_types: tuple[str, ...]  # the config.json model_type(s) read as this family
    objective: str  # the paradigm of the imported checkpoint
    config: Callable[[dict[str, Any], Path], ModelConfig]  # config.json (its path for errors) -> ModelConfig
    export_config: Callable[[Any, Tokenizer, str, dict[str, Any]], dict[str, Any]]  # (model, tok, dtype, meta)
    names: dict[str, str | tuple[str, ...]]
    transforms: tuple[Transform, ...] = ()
    conventions: Callable[[dict[str, Any], ModelConfig, Path, Tokenizer], dict[str, Any]] | None = None
    keep_config: bool = False
    remote_code: bool = False
    others: str = "refuse"  # tensors the names do not claim: refuse, or leave (noted: a multimodal folder's towers)
    fits: Callable[[Any], None] | None = None  # raises when the layout cannot hold the model
    tokenizer: bool = True  # the folder carries its tokenizer (a DFlash drafter has none: its target's)
    prepare: Prepare | None = None  # config -> tokenizer -> conventions, when the row needs more (a drafter)
    ignore: tuple[str, ...] = ("*rotary_emb*",)  # transformers tensors never kept
    _rx: list = field(default_factory=list, compare=False, repr=False)

    def __post_init__(self):
        for pat, hf in self.names.items():
            self._rx.append((_pattern(pat), (hf,) if isinstance(hf, str) else tuple(hf)))

    def hf_names(self, name: str) -> tuple[str, ...] | None:
        """The transformers name(s) of dlm tensor `name` (None: the names map has none)."""
        for rx, hfs in self._rx:
            m = rx.fullmatch(name)
            if m:
                return tuple(_fill(h, m.groups()) for h in hfs)
        return None

    def ignored(self, hf_name: str) -> bool:
        return any(_pattern(p).fullmatch(hf_name) for p in self.ignore)


def _pattern(p: str) -> re.Pattern:
    return re.compile(re.escape(p).replace(r"\{\}", r"(\d+)").replace(r"\*", "(.*)"))


def _fill(p: str, groups: tuple[str, ...]) -> str:
    it = iter(groups)
    return re.sub(r"\{\}|\*", lambda _: next(it), p)


# config.json <-> ModelConfig per row ------------------------------------------------------------------------

def _ar_config(kind: str) -> Callable[[dict, Path], ModelConfig]:
    return lambda hf, source: model_config_from_hf(hf, source, family=kind)


def _ar_export(model, tok: Tokenizer, dtype: str, meta: dict) -> dict[str, Any]:
    return hf_config(model.cfg, tok, dtype)


def _mdlm_conventions(hf: dict, cfg: ModelConfig, source: Path, tok: Tokenizer) -> dict[str, Any]:
    return hf_mdlm.conventions(hf, cfg, source, tok.mask_id)


def _mdlm_export(model, tok: Tokenizer, dtype: str, meta: dict) -> dict[str, Any]:
    return hf_mdlm.export_config(model.cfg, meta, tok, dtype)


def _gemma_config(hf: dict, source: Path) -> ModelConfig:
    t = hf.get("text_config") if hf.get("model_type") == "gemma4" else hf
    if not isinstance(t, dict):
        raise DlmError(f"{source}: gemma4 needs a text_config object")
    return hf_gemma.model_config_from_gemma(t)


def _drafter_fits(model) -> None:
    if not model.target_features or model.injection != "kv":
        raise DlmError("--format hf: only drafters with target features and K/V injection have the public DFlash "
                       "layout (this one is an ablation)")


def _mdlm_fits(name: str) -> Callable[[Any], None]:
    def fits(model) -> None:
        fam, c = hf_mdlm.BY_NAME[name], model.cfg
        if (c.qk_norm != (fam.layout in ("qwen3", "llada2")) or (fam.layout == "qwen2" and not c.attn_bias)
                or (fam.layout != "llada2" and (c.moe or c.partial_rotary != 1))):
            raise DlmError(f"--format hf: this backbone does not fit {fam.name}'s layout")
    return fits


def _joint_fits(model) -> None:
    c = model.cfg
    if c.qk_norm or c.attn_bias or c.sandwich_norm:
        raise DlmError(f"--format hf: this backbone does not fit {hf_joint.FAMILY}'s layout (Ministral 3: no "
                       "q/k-norm, no bias)")


# public DFlash drafters (z-lab's layout) ------------------------------------------------------------------

def drafter_config(drafter, meta: dict[str, Any], tok: Tokenizer, dtype: str) -> dict[str, Any]:
    """config.json in the layout of the public DFlash drafters (Qwen3 layers + dflash_config)."""
    cfg = drafter.cfg
    out = hf_config(cfg, tok, dtype)
    out.update({
        "architectures": ["DFlash2DraftModel" if drafter.version == 2 else "DFlashDraftModel"],
        "model_type": "qwen3",
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * cfg.n_layers,
        "block_size": drafter.block_size,  # top level, where the z-lab checkpoints keep it
        "num_target_layers": meta["dflash"]["target"]["model"]["n_layers"],
        "dflash_config": {"target_layer_ids": drafter.layer_ids, "mask_token_id": drafter.mask_id,
                          "block_size": drafter.block_size, **drafter.numerics()},
    })
    return out


def _draft_value(hf: dict[str, Any], key: str, default: Any = None) -> Any:
    """A drafter setting: from `dflash_config`, else the top level (where z-lab's package reads it too)."""
    return (hf.get("dflash_config") or {}).get(key, hf.get(key, default))


def zlab_layer_ids(n_target_layers: int, n_features: int) -> list[int]:
    """z-lab's default target layers: one -> the middle one; more -> evenly spread over 1 .. N - 3."""
    if n_features == 1:
        return [n_target_layers // 2]
    span = n_target_layers - 4
    return [round(1 + i * span / (n_features - 1)) for i in range(n_features)]


def drafter_plan(hf: dict[str, Any], src: Path, target: str | os.PathLike | None):
    """The dflash row's config step: a public DFlash drafter's config.json held against `target` (a dlm ar
    checkpoint: the drafter has no embedding, head or tokenizer of its own; hidden size, vocabulary, the target
    layers it reads and its mask token are checked) -> (ModelConfig, the target's tokenizer, the dflash section)."""
    from dlm.checkpoint import open_checkpoint
    from dlm.drafter import target_fingerprint

    v2 = "DFlash2DraftModel" in (hf.get("architectures") or [])
    if target is None:
        raise DlmError(f"--hf {src}: a DFlash drafter drafts for a target model: give --target, the dlm checkpoint "
                       "of that target (`dlm import --hf TARGET_FOLDER` makes one)")
    tck = open_checkpoint(target, "--target")
    if tck.objective != "ar":
        raise DlmError(f"--target {target}: a drafter's target is an ar checkpoint, got objective {tck.objective!r}")
    tc = tck.model_config
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"} or hf.get("use_sliding_window") or _draft_value(hf, "is_causal"):
        raise DlmError(f"--hf {src}: sliding-window or causal draft layers are not supported (full-attention "
                       "bidirectional draft layers are)")
    cfg = model_config_from_hf({**hf, "model_type": "qwen3", "vocab_size": hf.get("vocab_size", tc.vocab_size)},
                               src / "config.json")
    if cfg.dim != tc.dim:
        raise DlmError(f"--hf {src}: hidden size {cfg.dim} differs from the target's {tc.dim}")
    if cfg.vocab_size != tc.vocab_size:
        raise DlmError(f"--hf {src}: vocabulary {cfg.vocab_size} differs from the target's {tc.vocab_size}")
    n_target = hf.get("num_target_layers", tc.n_layers)
    if n_target != tc.n_layers:
        raise DlmError(f"--hf {src}: drafts for a target of {n_target} layers, the target has {tc.n_layers}")
    layer_ids = _draft_value(hf, "target_layer_ids") or zlab_layer_ids(tc.n_layers, cfg.n_layers)
    bad = [i for i in layer_ids if not isinstance(i, int) or not 0 <= i < tc.n_layers]
    if bad:
        raise DlmError(f"--hf {src}: target_layer_ids {bad} are not layers of the target (0 .. {tc.n_layers - 1})")
    mask_id = _draft_value(hf, "mask_token_id")
    if not isinstance(mask_id, int) or not 0 <= mask_id < tc.vocab_size:
        raise DlmError(f"--hf {src}: dflash_config.mask_token_id must be a token id of the target, got {mask_id!r}")
    block = _draft_value(hf, "block_size", 16)
    softcap = _draft_value(hf, "final_logit_softcapping")
    dflash = {"target_layer_ids": list(layer_ids), "block_size": int(block), "mask_token_id": mask_id,
              "injection": "kv", "target_features": True,
              "last_layer": "normed",  # public engines read the last layer after the target's final norm
              "input_embedding_scale": float(_draft_value(hf, "input_embedding_scale", 1.0)),
              "output_multiplier": float(_draft_value(hf, "output_multiplier", 1.0)),
              "final_logit_softcapping": float(softcap) if softcap else None}
    if v2:  # DFlash 2: the convolutions and the candidate selector (z-lab's defaults where the config is silent)
        for key, default in (("conv_kernel_size", 2), ("conv_group_size", 16), ("selector_rank", 256),
                             ("selector_top_k", 16)):
            v = _draft_value(hf, key, default)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise DlmError(f"--hf {src}: dflash_config.{key} must be a positive integer, got {v!r}")
            dflash[key] = v
        if cfg.dim % dflash["conv_group_size"]:
            raise DlmError(f"--hf {src}: conv_group_size {dflash['conv_group_size']} does not divide the hidden "
                           f"size {cfg.dim}")
    # the fingerprint reads 16 rows of the target's embedding, memory-mapped: the target is not loaded (an 8B
    # target's every page would be read to check it, or copied to fp32)
    embed = mmap_tensors(tck.path / "model.safetensors").get("embed_tokens.weight")
    if embed is None or tuple(embed.shape) != (tc.vocab_size, tc.dim):
        raise DlmError(f"--target {target}: its model.safetensors has no embed_tokens.weight of shape "
                       f"{(tc.vocab_size, tc.dim)}")
    dflash["target"] = {"name": tck.path.name, "model": tc.to_dict(), "tokenizer_sha256": tck.tokenizer.sha256,
                        "fingerprint": target_fingerprint(embed)}
    return cfg, tck.tokenizer, {"dflash": dflash}


# the names maps ---------------------------------------------------------------------------------------------

PREFIXED = {"lm_head.weight": "lm_head.weight", "*": "model.*"}  # Qwen, Llama, Gemma: transformers' less `model.`
LLADA = {"embed_tokens.weight": "model.transformer.wte.weight", "norm.weight": "model.transformer.ln_f.weight",
         "lm_head.weight": "model.transformer.ff_out.weight",
         **{f"layers.{{}}.{k}": f"model.transformer.blocks.{{}}.{v}" for k, v in hf_mdlm.LLADA_LAYER.items()}}
LLADA2 = {"embed_tokens.weight": "model.word_embeddings.weight", "norm.weight": "model.norm.weight",
          "lm_head.weight": "lm_head.weight",
          **{f"layers.{{}}.{k}": f"model.layers.{{}}.{v}" for k, v in hf_mdlm.LLADA2_LAYER.items()}}
DIFFUSION_GEMMA = {**{f"self_cond.{v}": f"model.decoder.self_conditioning.{k}"
                      for k, v in hf_gemma.DG_SELF_COND.items()},
                   "lm_head.weight": "lm_head.weight",
                   "*": ("model.decoder.*", "model.encoder.language_model.*")}  # (transformers ties the two)
DFLASH = {**{f"{c}.weight": c for c in ("candidate_selector.predecessor_codebook",  # (stored without .weight)
                                          "candidate_selector.successor_codebook")}, "*": "*"}


def _mdlm(name: str, names: dict, transforms: tuple[Transform, ...] = ()) -> Family:
    f = hf_mdlm.BY_NAME[name]
    return Family(name, (f.model_type,), "mdlm", hf_mdlm.model_config, _mdlm_export, names, transforms,
                  conventions=_mdlm_conventions, keep_config=True, remote_code=True, fits=_mdlm_fits(name))


FAMILIES: tuple[Family, ...] = (
    Family("qwen3", ("qwen3",), "ar", _ar_config("qwen3"), _ar_export, PREFIXED),
    Family("qwen2", ("qwen2",), "ar", _ar_config("qwen2"), _ar_export, PREFIXED),
    Family("llama", ("llama",), "ar", _ar_config("llama"), _ar_export, PREFIXED),
    Family("ministral3", ("ministral3",), "ar", _ar_config("ministral3"), _ar_export, PREFIXED),
    Family("qwen3_moe", ("qwen3_moe",), "ar", _ar_config("qwen3_moe"), _ar_export, PREFIXED, (EXPERTS,)),
    Family("gemma4", ("gemma4_text",), "ar", _gemma_config, hf_gemma.export_config, PREFIXED, keep_config=True,
           others="leave"),
    Family("gemma4-multimodal", ("gemma4",), "ar", _gemma_config, hf_gemma.export_config,  # (its text weights;
           {"lm_head.weight": "lm_head.weight", "*": "model.language_model.*"}, keep_config=True,  # exports as
           others="leave"),  # Gemma4ForCausalLM: the "gemma4" row)
    Family("diffusion-gemma", ("diffusion_gemma",), "usdm",
           lambda hf, source: hf_gemma.model_config_from_diffusion_gemma(hf), hf_gemma.export_config,
           DIFFUSION_GEMMA, conventions=hf_gemma.conventions, keep_config=True, others="leave"),
    _mdlm("llada", LLADA),
    _mdlm("dream", PREFIXED),
    _mdlm("sdar", PREFIXED),
    _mdlm("fast-dllm-v2", PREFIXED),
    _mdlm("llada2", LLADA2, (SPLIT_QKV, EXPERTS)),
    Family(hf_joint.FAMILY, hf_joint.MODEL_TYPES, "joint", hf_joint.model_config, hf_joint.export_config,
           {"lm_head.weight": "diffusion_head.weight", "*": "encoder.*"},
           conventions=lambda hf, cfg, source, tok: hf_joint.conventions(hf, cfg, source), keep_config=True,
           remote_code=True, fits=_joint_fits),
    Family("dflash", (), "dflash", None, lambda model, tok, dtype, meta: drafter_config(model, meta, tok, dtype),
           DFLASH, fits=_drafter_fits, tokenizer=False,
           prepare=lambda fam, hf, src, target: drafter_plan(hf, src, target)),
)
BY_NAME = {f.name: f for f in FAMILIES}
BY_MODEL_TYPE = {t: f for f in FAMILIES for t in f.model_types}
DFLASH_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")


def is_drafter(hf: dict[str, Any]) -> bool:
    """A transformers folder holding a DFlash drafter (z-lab's layout), not a model of its own."""
    return bool(set(hf.get("architectures") or []) & set(DFLASH_ARCHITECTURES)) or "dflash_config" in hf


def family_of(hf: dict[str, Any], source: Path) -> Family:
    """The row that reads a folder's config.json."""
    if is_drafter(hf):
        return BY_NAME["dflash"]
    kind = hf.get("model_type")
    if kind not in BY_MODEL_TYPE:
        raise DlmError(f"{source}: model_type {kind!r} is not supported ({', '.join(BY_MODEL_TYPE)} are)"[:300])
    return BY_MODEL_TYPE[kind]


def export_family(model, meta: dict[str, Any]) -> Family:
    """The row a checkpoint exports to: an imported family's own (recorded), a drafter's, Gemma 4's layers', else
    the transformers family its backbone is (dlm.hf_layout.hf_family)."""
    cfg = model.cfg
    if meta.get("family") in BY_NAME:
        return BY_NAME[meta["family"]]
    if meta.get("objective") == "dflash":
        return BY_NAME["dflash"]
    if cfg.sandwich_norm:
        return BY_NAME["diffusion-gemma" if cfg.self_cond else "gemma4"]
    if cfg.self_cond:
        raise DlmError("--format hf: this checkpoint has a self-conditioning module that Qwen3/Llama cannot hold")
    if cfg.learned_pos or cfg.grid_pos:
        raise DlmError("--format hf: this checkpoint has learned absolute positions that Qwen3/Llama cannot hold")
    return BY_NAME[hf_family(cfg)]


def prepare(fam: Family, hf: dict[str, Any], src: Path, target: Any) -> tuple[ModelConfig, Tokenizer, dict]:
    """config.json -> ModelConfig, the folder's tokenizer, the checkpoint's conventions."""
    if fam.prepare is not None:
        return fam.prepare(fam, hf, src, target)
    cfg = fam.config(hf, src / "config.json")
    if not (src / "tokenizer.json").is_file():
        raise DlmError(f"{src}: no tokenizer.json (dlm reads the fast tokenizer's file; transformers writes one: "
                       "AutoTokenizer.from_pretrained(FOLDER, trust_remote_code=True).save_pretrained(FOLDER))")
    tok = import_tokenizer(src, hf)
    extra = fam.conventions(hf, cfg, src / "config.json", tok) if fam.conventions else {}
    return cfg, tok, extra
