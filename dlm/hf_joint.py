"""Nemotron-Labs-Diffusion <-> a dlm `joint` checkpoint. Two generations of the released folders: model_type
`ministral_dlm` (MinistralDiffEncoderModel, paradigm `sbd_block_diff`) and `nemotron_labs_diffusion`
(NemotronLabsDiffusionModel, paradigm `bidirectional` as the folders ship it, `block_diff` in training); the same
weights and keys, the same backbone; the export keeps the folder's own model_type, architecture and paradigm.

One set of weights with an AR mode and a block-diffusion mode, as dlm's joint paradigm is: the backbone is Ministral
3 (Llama's layers: no q/k-norm, no biases, SwiGLU) with YaRN RoPE and the queries' attention temperature by position
(`rope_parameters.llama_4_scaling_beta`, `ModelConfig.rope_scaling`); the weights sit under `encoder.` (the decoder
stack, embeddings and final norm) and `diffusion_head.` (the one LM head both modes read). The import records the
config's `<mask>` id (`mask_token_id`, 100 in the released models) and block (`block_size`, 32); the source
config.json is kept (`hf_config`) with the tokenizer's side files and the remote code, and the export writes the
same layout back (the row of dlm.families: weights `encoder.*`, head `diffusion_head.weight`).

Decoding (dlm's joint samplers, held to the authors' functions by tests/test_upstream_nemotron.py): `--sampler ar` is
`ar_generate`; `--sampler threshold --threshold 0.9 --block-size 32` is `generate` (block diffusion seeded by the AR
mode over a causal prefix cache: `--ar-seed`, this family's default); `--sampler self-spec-linear --block-size 32` is
`linear_spec_generate` (`--draft-threshold T` its threshold); `--sampler self-spec-quadratic --block-size 16` is
`self_spec_generate`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dlm.config import ModelConfig
from dlm.errors import DlmError
from dlm.hf_layout import hf_config, model_config_from_hf
from dlm.tokenizer import Tokenizer

MODEL_TYPES = ("ministral_dlm", "nemotron_labs_diffusion")
FAMILY = "nemotron-labs-diffusion"
ARCHITECTURE = "MinistralDiffEncoderModel"
# model_type -> (its architecture, the dlm_paradigm values of a joint AR + diffusion folder, the first the default)
LAYOUTS = {"ministral_dlm": ("MinistralDiffEncoderModel", ("sbd_block_diff",)),
           "nemotron_labs_diffusion": ("NemotronLabsDiffusionModel", ("bidirectional", "block_diff"))}
MASK_ID, BLOCK = 100, 32  # the released models' (the config's keys win)


def model_config(hf: dict[str, Any], source: Path) -> ModelConfig:
    _, paradigms = LAYOUTS.get(hf.get("model_type"), LAYOUTS["ministral_dlm"])
    paradigm = hf.get("dlm_paradigm", paradigms[0])
    if paradigm not in paradigms:
        raise DlmError(f"{source}: dlm_paradigm {paradigm!r}: dlm imports the joint AR + diffusion checkpoints "
                       f"({' or '.join(paradigms)} for model_type {hf.get('model_type', 'ministral_dlm')})")
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


def export_config(model, tok: Tokenizer, dname: str, meta: dict[str, Any]) -> dict[str, Any]:
    """config.json back in the imported folder's layout (ministral_dlm when none was imported): the imported one, its
    shape keys rewritten where the checkpoint no longer matches them, its <mask> id and block."""
    cfg = model.cfg
    src = dict(meta.get("hf_config") or {})
    kind = src.get("model_type") if src.get("model_type") in LAYOUTS else "ministral_dlm"
    arch, paradigms = LAYOUTS[kind]
    out = {**src, "model_type": kind}
    if out.get("dlm_paradigm") not in paradigms:
        out["dlm_paradigm"] = paradigms[0]
    out.setdefault("architectures", [arch])
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
    out.update({k: dname for k in ([k for k in ("torch_dtype", "dtype") if k in src] or ["torch_dtype"])})
    return out
