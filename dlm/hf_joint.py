"""Nemotron-Labs-Diffusion (model_type `ministral_dlm`, paradigm `sbd_block_diff`) <-> a dlm `joint` checkpoint.

One set of weights with an AR mode and a block-diffusion mode, as dlm's joint paradigm is: the backbone is Ministral
3 (Llama's layers: no q/k-norm, no biases, SwiGLU) with YaRN RoPE and the queries' attention temperature by position
(`rope_parameters.llama_4_scaling_beta`, `ModelConfig.rope_scaling`); the weights sit under `encoder.` (the decoder
stack, embeddings and final norm) and `diffusion_head.` (the one LM head both modes read). The import records the
config's `<mask>` id (`mask_token_id`, 100 in the released models) and block (`block_size`, 32); the source
config.json is kept (`hf_config`) with the tokenizer's side files and the remote code its auto_map names, and the
export writes the same layout back.

Decoding (dlm's joint samplers): `--sampler ar` is `ar_generate`; `--sampler threshold --threshold 0.9 --block-size
32` is `generate` (block diffusion over a causal prefix cache); `--sampler self-spec-linear --block-size 32` is
`linear_spec_generate`; `--sampler self-spec-quadratic --block-size 16` is `self_spec_generate`.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from dlm.checkpoint import import_tokenizer, save_checkpoint, state_tensors
from dlm.config import ModelConfig
from dlm.errors import DlmError
from dlm.files import write_folder, write_json, write_tensors
from dlm.hf_layout import assemble, hf_config, model_config_from_hf
from dlm.model import Transformer
from dlm.tokenizer import Tokenizer

MODEL_TYPES = ("ministral_dlm",)
FAMILY = "nemotron-labs-diffusion"
ARCHITECTURE = "MinistralDiffEncoderModel"
MASK_ID, BLOCK = 100, 32  # the released models' (the config's keys win)
SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
              "generation_config.json")


def model_config(hf: dict[str, Any], source: Path) -> ModelConfig:
    paradigm = hf.get("dlm_paradigm", "sbd_block_diff")
    if paradigm != "sbd_block_diff":
        raise DlmError(f"{source}: dlm_paradigm {paradigm!r}: dlm imports the joint AR + diffusion checkpoints "
                       "(sbd_block_diff)")
    if hf.get("dlm_type", "llada") != "llada":
        raise DlmError(f"{source}: dlm_type {hf.get('dlm_type')!r} (shifted predictions) is not supported by dlm's joint "
                       "samplers (dlm_type llada is)")
    return model_config_from_hf(hf, source, family="ministral3")  # its backbone: a plain Ministral 3 (dlm.hf_layout)


def conventions(hf: dict[str, Any], cfg: ModelConfig, source: Path) -> dict[str, Any]:
    mask, block = hf.get("mask_token_id", MASK_ID), hf.get("block_size", BLOCK)
    for key, v in (("mask_token_id", mask), ("block_size", block)):
        if not isinstance(v, int) or isinstance(v, bool):
            raise DlmError(f"{source}: {key} must be an integer, got {v!r}"[:200])
    if not 0 <= mask < cfg.vocab_size:
        raise DlmError(f"{source}: mask_token_id {mask} is outside the vocabulary [0, {cfg.vocab_size})")
    if block < 2:
        raise DlmError(f"{source}: block_size must be >= 2, got {block}")
    return {"family": FAMILY, "mask_id": mask, "block_size": block}


def dlm_name(name: str, cfg: ModelConfig, source: Path) -> str | None:
    if name.startswith("encoder."):
        return None if "rotary_emb" in name else name[len("encoder."):]
    if name == "diffusion_head.weight":
        return None if cfg.tie_embeddings else "lm_head.weight"
    raise DlmError(f"{source}: unexpected tensor {name!r} for {FAMILY}'s layout (encoder.*, diffusion_head.weight)")


def side_files(src: Path, hf: dict[str, Any]) -> list[str]:
    names = [f for f in SIDE_FILES if (src / f).is_file()]
    auto = hf.get("auto_map") if isinstance(hf.get("auto_map"), dict) else {}
    for ref in auto.values():
        mod = str(ref).split("--")[-1].split(".")[0] + ".py"
        if Path(mod).name == mod and (src / mod).is_file() and mod not in names:
            names.append(mod)
    names += sorted(p.name for p in src.glob("*.py") if p.name not in names)  # the remote code imports its siblings
    return names


def import_folder(src: Path, out: Path, overwrite: bool, hf: dict[str, Any], read_weights) -> Path:
    cfg = model_config(hf, src / "config.json")
    conv = conventions(hf, cfg, src / "config.json")
    if not (src / "tokenizer.json").is_file():
        raise DlmError(f"{src}: no tokenizer.json (dlm reads the fast tokenizer's file)")
    tok = import_tokenizer(src, hf)
    raw = read_weights(src)
    state = {dlm_name(k, cfg, src): v for k, v in raw.items() if dlm_name(k, cfg, src) is not None}
    model = assemble(cfg, state, src)
    meta = {"objective": "joint", "model": cfg.to_dict(), "imported_from": src.name, "data": "stdlib", **conv,
            "hf_config": hf}
    with write_folder(out, overwrite=overwrite, inputs=(src,)) as tmp:
        save_checkpoint(tmp, model, tok, meta, dtype=state["embed_tokens.weight"].dtype)
        for f in side_files(src, hf):
            shutil.copyfile(src / f, tmp / f)
    return out


def export_folder(model: Transformer, tok: Tokenizer, tmp: Path, dtype: torch.dtype, meta: dict[str, Any],
                  side_dir: Path | None) -> None:
    """The checkpoint back in the ministral_dlm layout: the imported config.json, its shape keys rewritten where the
    checkpoint no longer matches them, its <mask> id and block."""
    cfg = model.cfg
    if cfg.qk_norm or cfg.attn_bias or cfg.sandwich_norm:
        raise DlmError(f"--format hf: this backbone does not fit {FAMILY}'s layout (Ministral 3: no q/k-norm, no bias)")
    src = dict(meta.get("hf_config") or {})
    out = {**src, "model_type": "ministral_dlm", "dlm_paradigm": "sbd_block_diff"}
    out.setdefault("architectures", [ARCHITECTURE])
    try:
        same = bool(src) and model_config(out, Path("config.json")) == cfg
    except DlmError:
        same = False
    if not same:
        base = hf_config(cfg, tok)
        out.update({k: base[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                         "num_attention_heads", "num_key_value_heads", "head_dim",
                                         "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_parameters",
                                         "tie_word_embeddings", "hidden_act")})
    out["mask_token_id"], out["block_size"] = meta["mask_id"], meta["block_size"]
    dname = str(dtype).removeprefix("torch.")
    out.update({k: dname for k in ([k for k in ("torch_dtype", "dtype") if k in src] or ["torch_dtype"])})
    tensors = {("diffusion_head.weight" if k == "lm_head.weight" else "encoder." + k): v
               for k, v in state_tensors(model, dtype).items()}
    write_tensors(tmp / "model.safetensors", tensors, metadata={"format": "pt"})
    write_json(tmp / "config.json", out)
    tok.save(tmp / "tokenizer.json")
    copied = set()
    if side_dir is not None:
        for f in side_files(side_dir, src):
            shutil.copyfile(side_dir / f, tmp / f)
            copied.add(f)
    if "tokenizer_config.json" not in copied:
        write_json(tmp / "tokenizer_config.json", tok.hf_config())
