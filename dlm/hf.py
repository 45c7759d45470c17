"""transformers interop: export a dlm AR checkpoint as Qwen3/Qwen2/Llama, import a local Qwen3/Qwen2/Llama folder,
and export a DFlash drafter in the layout of the public DFlash checkpoints. The public masked-diffusion families
(LLaDA, Dream, SDAR, Fast-dLLM v2) are dlm.hf_mdlm's, Gemma 4 / DiffusionGemma dlm.hf_gemma's.

dlm's parameter names are transformers' without the `model.` prefix, so the mapping is a rename.
Qwen3 when q/k-norm is on, Qwen2 when q/k/v biases are, Llama when neither is. Nothing here imports transformers.

Drafters (`export_drafter`) get the layout of the public DFlash checkpoints (z-lab/*-DFlash-b16):
architectures ["DFlashDraftModel"], model_type qwen3, `dflash_config` {target_layer_ids,
mask_token_id, block_size}, top-level block_size and num_target_layers; weights layers.N.*,
fc.weight, hidden_norm.weight, norm.weight (no embedding, no lm_head).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

from dlm.checkpoint import Checkpoint, all_finite, check_shapes, import_tokenizer, save_checkpoint, state_tensors
from dlm.files import mmap_tensors, read_json, release, tensor_shapes, write_folder, write_json, write_tensors
from dlm import hf_gemma, hf_joint, hf_mdlm
from dlm.hf_layout import (  # noqa: F401  (the layout's functions, here where they have always been importable)
    ARCHITECTURES, assemble, dlm_name, hf_config, hf_family, model_config_from_hf, read_hf_weights, weight_files,
)
from dlm.drafter import DFlashDrafter
from dlm.errors import DlmError
from dlm.model import Transformer, param_shapes
from dlm.tokenizer import Tokenizer


def export_hf(model: Transformer, tok: Tokenizer, out: str | os.PathLike, dtype: torch.dtype = torch.float32,
              overwrite: bool = False, inputs: tuple[str | os.PathLike, ...] = ()) -> Path:
    """Write a transformers-loadable folder (config.json, model.safetensors, tokenizer files)."""
    if hf_gemma.is_gemma(model.cfg):  # Gemma 4 / DiffusionGemma (dlm.hf_gemma); the imported config and side files
        src = Path(inputs[0]) if inputs else None
        meta = read_json(src / "config.json") if src is not None and (src / "config.json").is_file() else {}
        with write_folder(out, overwrite=overwrite, inputs=inputs) as tmp:
            source = meta.get("hf_config")
            if source is not None and meta.get("canvas_length") is not None:  # DiffusionGemma: the canvas it runs
                source = {**source, "canvas_length": meta["canvas_length"]}
            hf_gemma.export_folder(model, tok, tmp, dtype, source, side_dir=src)
        return Path(out)
    src = Path(inputs[0]) if inputs else None
    meta = read_json(src / "config.json") if src is not None and (src / "config.json").is_file() else {}
    if meta.get("family") == hf_joint.FAMILY:  # an imported Nemotron-Labs-Diffusion: its own layout
        with write_folder(out, overwrite=overwrite, inputs=inputs) as tmp:
            hf_joint.export_folder(model, tok, tmp, dtype, meta, src)
        return Path(out)
    meta = hf_mdlm.finetuned_meta(meta) or meta  # a fine-tuned SDAR / LLaDA 2: its family's layout again
    if meta.get("family") in hf_mdlm.BY_NAME:  # an imported LLaDA / Dream / SDAR / Fast-dLLM v2: its own layout
        with write_folder(out, overwrite=overwrite, inputs=inputs) as tmp:
            hf_mdlm.export_folder(model, tok, tmp, dtype, meta, src)
        return Path(out)
    if model.cfg.self_cond:
        raise DlmError("--format hf: this checkpoint has a self-conditioning module that Qwen3/Llama cannot hold")
    if model.cfg.learned_pos or model.cfg.grid_pos:
        raise DlmError("--format hf: this checkpoint has learned absolute positions that Qwen3/Llama cannot hold")
    with write_folder(out, overwrite=overwrite, inputs=inputs) as tmp:
        _write_hf(model, tok, tmp, dtype)
    return Path(out)


def _write_hf(model: Transformer, tok: Tokenizer, tmp: Path, dtype: torch.dtype) -> None:
    tensors = {("" if k.startswith("lm_head.") else "model.") + k: v
               for k, v in state_tensors(model, dtype).items()}
    write_tensors(tmp / "model.safetensors", tensors, metadata={"format": "pt"})
    dname = str(dtype).removeprefix("torch.")
    write_json(tmp / "config.json", hf_config(model.cfg, tok, dname))
    write_json(tmp / "generation_config.json", {"bos_token_id": tok.bos_id, "eos_token_id": tok.hf_eos_token_id,
                                                "pad_token_id": tok.pad_id})
    tok.save(tmp / "tokenizer.json")
    hfc = tok.hf_config()
    write_json(tmp / "tokenizer_config.json", hfc)
    write_json(tmp / "special_tokens_map.json",
               {k: v for k, v in hfc.items() if k.endswith("_token") and v is not None})


def drafter_config(drafter: DFlashDrafter, ck: Checkpoint, dtype: str) -> dict[str, Any]:
    """config.json in the layout of the public DFlash drafters (Qwen3 layers + dflash_config)."""
    cfg = drafter.cfg
    out = hf_config(cfg, ck.tokenizer, dtype)
    out.update({
        "architectures": ["DFlash2DraftModel" if drafter.version == 2 else "DFlashDraftModel"],
        "model_type": "qwen3",
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * cfg.n_layers,
        "block_size": drafter.block_size,  # top level, where the z-lab checkpoints keep it
        "num_target_layers": ck.config["dflash"]["target"]["model"]["n_layers"],
        "dflash_config": {"target_layer_ids": drafter.layer_ids, "mask_token_id": drafter.mask_id,
                          "block_size": drafter.block_size, **drafter.numerics()},
    })
    return out


def prenorm_warning(drafter: DFlashDrafter, ck: Checkpoint) -> str | None:
    """Why an exported drafter would be served other features than it was trained on, if it would.

    Public engines read target layer i as transformers' hidden_states[i + 1], whose last entry is after the
    target's final norm; drafters trained before dlm read the same (last_layer "normed") read it before."""
    last = ck.config["dflash"]["target"]["model"]["n_layers"] - 1
    if drafter.last_layer != "prenorm" or last not in drafter.layer_ids:
        return None
    return (f"{ck.path.name} was trained on target layer {last} (the last) before the final norm; vLLM and SGLang "
            "feed it after the norm, so they will draft worse than dlm does: retrain it (new drafters read it normed)")


def export_drafter(drafter: DFlashDrafter, ck: Checkpoint, out: str | os.PathLike,
                   dtype: torch.dtype = torch.float32, overwrite: bool = False) -> Path:
    """Write the drafter as a public-layout DFlash folder (config.json + model.safetensors)."""
    if not drafter.target_features or drafter.injection != "kv":
        raise DlmError("--format hf: only drafters with target features and K/V injection have the public DFlash "
                       "layout (this one is an ablation)")
    with write_folder(out, overwrite=overwrite, inputs=(ck.path,)) as tmp:
        tensors = {k.removesuffix(".weight") if k.removesuffix(".weight") in CODEBOOKS else k: v
                   for k, v in state_tensors(drafter, dtype).items()}  # the public DFlash 2 names of the codebooks
        write_tensors(tmp / "model.safetensors", tensors, metadata={"format": "pt"})
        write_json(tmp / "config.json", drafter_config(drafter, ck, str(dtype).removeprefix("torch.")))
    return Path(out)


def import_hf(folder: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False,
              target: str | os.PathLike | None = None) -> Path:
    """Read a local Qwen3/Qwen2/Llama/Gemma 4 folder into a dlm checkpoint (objective "ar"), in the dtype it is stored in;
    a LLaDA, Dream, SDAR, Fast-dLLM v2 or LLaDA 2 folder into an mdlm checkpoint with its conventions (dlm.hf_mdlm);
    a Nemotron-Labs-Diffusion folder into a joint checkpoint (dlm.hf_joint);
    a DiffusionGemma folder into a usdm checkpoint (dlm.hf_gemma); a public DFlash drafter folder into a dflash
    checkpoint for `target` (`import_drafter`).

    The weights are memory-mapped and written out tensor by tensor: importing a model takes little memory beyond
    the pages the kernel maps (docs/scale.md has the figures for Qwen3-0.6B and Llama-3.2-1B shapes)."""
    src, out = Path(folder), Path(out)
    if not src.is_dir():
        raise DlmError(f"--hf: folder not found: {src}")
    hf = read_json(src / "config.json")
    if is_drafter(hf):
        return import_drafter(src, target, out, overwrite)
    if hf.get("model_type") in hf_joint.MODEL_TYPES:  # Nemotron-Labs-Diffusion -> joint (dlm.hf_joint)
        return hf_joint.import_folder(src, out, overwrite, hf, read_hf_weights)
    if hf.get("model_type") in hf_mdlm.MODEL_TYPES:  # LLaDA / Dream / SDAR / Fast-dLLM v2 -> mdlm (dlm.hf_mdlm)
        return hf_mdlm.import_folder(src, out, overwrite, hf, read_hf_weights)
    if hf.get("model_type") in hf_gemma.MODEL_TYPES:  # Gemma 4 / DiffusionGemma (dlm.hf_gemma)
        path, note = hf_gemma.import_folder(src, out, overwrite, hf, read_hf_weights)
        if note:
            print(f"note: {note}", file=sys.stderr)
        return path
    cfg = model_config_from_hf(hf, src / "config.json")
    tok = import_tokenizer(src, hf)
    # the config against the weights' headers (names and shapes) before anything is read or allocated
    expected, aliases = param_shapes(cfg)
    shapes = {}
    for f in weight_files(src):
        for k, shape in tensor_shapes(src / f).items():
            if dlm_name(k, cfg, src) is not None:
                shapes[dlm_name(k, cfg, src)] = shape
    check_shapes(expected, shapes, src, aliases)
    raw = read_hf_weights(src)
    tensors = {dlm_name(k, cfg, src): v for k, v in raw.items() if dlm_name(k, cfg, src) is not None}
    model = assemble(cfg, tensors, src)
    dtype = next(iter(raw.values())).dtype
    with write_folder(out, overwrite=overwrite, inputs=(src,)) as tmp:
        save_checkpoint(tmp, model, tok, {"objective": "ar", "model": cfg.to_dict(), "imported_from": src.name,
                                          "data": "stdlib"}, dtype=dtype)
    return out


# public DFlash drafters ----------------------------------------------------------------------------------

DFLASH_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")


def is_drafter(hf: dict[str, Any]) -> bool:
    """A transformers folder holding a DFlash drafter (z-lab's layout), not a model of its own."""
    return bool(set(hf.get("architectures") or []) & set(DFLASH_ARCHITECTURES)) or "dflash_config" in hf


def _draft_value(hf: dict[str, Any], key: str, default: Any = None) -> Any:
    """A drafter setting: from `dflash_config`, else the top level (where z-lab's package reads it too)."""
    return (hf.get("dflash_config") or {}).get(key, hf.get(key, default))


def zlab_layer_ids(n_target_layers: int, n_features: int) -> list[int]:
    """z-lab's default target layers: one -> the middle one; more -> evenly spread over 1 .. N - 3."""
    if n_features == 1:
        return [n_target_layers // 2]
    span = n_target_layers - 4
    return [round(1 + i * span / (n_features - 1)) for i in range(n_features)]


CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def _dlm_draft_name(name: str) -> str:
    """The public DFlash 2 layout stores the selector's codebooks without `.weight` (z-lab's loader maps them)."""
    return name + ".weight" if name in CODEBOOKS else name


def import_drafter(folder: str | os.PathLike, target: str | os.PathLike | None, out: str | os.PathLike,
                   overwrite: bool = False) -> Path:
    """Read a public DFlash drafter folder (config.json with dflash_config, model.safetensors) into a dlm dflash
    checkpoint for `target` (a dlm AR checkpoint: the drafter has no embedding, head or tokenizer of its own).
    Hidden size, vocabulary, the target layers it reads and its mask token are checked against the target."""
    from dlm.checkpoint import open_checkpoint
    from dlm.drafter import drafter_shapes, target_fingerprint

    src, out = Path(folder), Path(out)
    hf = read_json(src / "config.json")
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
    meta = {"objective": "dflash", "model": cfg.to_dict(), "imported_from": src.name, "data": "stdlib",
            "dflash": dflash}
    expected, aliases = drafter_shapes(meta)
    shapes = {_dlm_draft_name(k): s for f in weight_files(src) for k, s in tensor_shapes(src / f).items()
              if "rotary_emb" not in k}
    check_shapes(expected, shapes, src, aliases)
    raw = {_dlm_draft_name(k): v for k, v in read_hf_weights(src).items() if "rotary_emb" not in k}
    for k, v in raw.items():
        if not all_finite(v):
            raise DlmError(f"{src}: tensor {k} holds NaN or infinite values")
        release(v)
    # the fingerprint reads 16 rows of the target's embedding, memory-mapped: the target is not loaded (an 8B
    # target's every page would be read to check it, or copied to fp32)
    embed = mmap_tensors(tck.path / "model.safetensors").get("embed_tokens.weight")
    if embed is None or tuple(embed.shape) != (tc.vocab_size, tc.dim):
        raise DlmError(f"--target {target}: its model.safetensors has no embed_tokens.weight of shape "
                       f"{(tc.vocab_size, tc.dim)}")
    dflash["target"] = {"name": tck.path.name, "model": tc.to_dict(), "tokenizer_sha256": tck.tokenizer.sha256,
                        "fingerprint": target_fingerprint(embed)}
    dtype = next(iter(raw.values())).dtype
    with write_folder(out, overwrite=overwrite, inputs=(src,)) as tmp:
        save_checkpoint(tmp, raw, tck.tokenizer, meta, dtype=dtype)
    return out
