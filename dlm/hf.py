"""transformers interop: the one import/export driver. Every family is a row of dlm.families (its model_types,
config mapping, tensor names, transforms, conventions); this module runs each row the same way:

  import:  config.json -> ModelConfig -> tokenizer -> conventions -> the tensors' names and shapes held against
           the config (from the shards' headers, before anything is read) -> each tensor renamed, cut or stacked
           from the memory-mapped shards, checked finite and written as it is made -> the side files
  export:  the row -> its config.json, the tensors under its names (transforms inverted), the tokenizer and the
           side files the checkpoint kept

Importing a model takes little memory beyond the pages the kernel maps and the one tensor being written
(docs/scale.md has the figures). Nothing here imports transformers.

Drafters get the layout of the public DFlash checkpoints (z-lab/*-DFlash-b16): architectures ["DFlashDraftModel"],
model_type qwen3, `dflash_config` {target_layer_ids, mask_token_id, block_size}, top-level block_size and
num_target_layers; weights layers.N.*, fc.weight, hidden_norm.weight, norm.weight (no embedding, no lm_head).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from dlm.checkpoint import SIDE_FILES, Checkpoint, all_finite, generation_defaults, save_checkpoint, state_tensors
from dlm.errors import DlmError
from dlm.families import Family, export_family, family_of, prepare
from dlm.files import Lazy, Stacked, mmap_tensors, read_json, write_folder, write_json, write_tensors
from dlm import hf_mdlm
from dlm.hf_layout import remote_code
from dlm.model import param_shapes
from dlm.tokenizer import Tokenizer


def import_hf(folder: str | os.PathLike, out: str | os.PathLike, overwrite: bool = False,
              target: str | os.PathLike | None = None) -> Path:
    """Read a local transformers folder of any row of dlm.families into a dlm checkpoint, in the dtype it is stored
    in: Qwen3 / Qwen2 / Llama / Ministral 3 / Qwen3-MoE / Gemma 4 -> ar; LLaDA, Dream, SDAR, Fast-dLLM v2, LLaDA 2 ->
    mdlm with their conventions; Nemotron-Labs-Diffusion -> joint; DiffusionGemma -> usdm; a public DFlash drafter
    -> dflash for `target` (a dlm ar checkpoint)."""
    src, out = Path(folder), Path(out)
    if not src.is_dir():
        raise DlmError(f"--hf: folder not found: {src}")
    hf = read_json(src / "config.json")
    fam = family_of(hf, src / "config.json")
    cfg, tok, extra = prepare(fam, hf, src, target)
    sampling = generation_defaults(src, fam.objective) if fam.tokenizer else {}  # (a bad file: refused here)
    meta = {"objective": fam.objective, "model": cfg.to_dict(), "imported_from": src.name, "data": "stdlib",
            **extra, **({"hf_config": hf} if fam.keep_config else {})}
    expected, aliases = shapes_of(meta)
    tensors, left = import_tensors(fam, cfg, expected, aliases, read_hf_weights(src), src)
    with write_folder(out, overwrite=overwrite, inputs=(src,)) as tmp:
        save_checkpoint(tmp, tensors, tok, meta)
        if fam.tokenizer:
            for f in side_files(src, hf, fam):
                shutil.copyfile(src / f, tmp / f)
    if left:
        towers = sorted({".".join(n.split(".")[:3]) for n in left})
        print(f"note: left out {len(left)} tensors of {', '.join(towers)} (text weights only)", file=sys.stderr)
    if sampling.get("temperature", 1.0) > 0 and sampling:
        shown = ", ".join(f"{k} {v}" for k, v in sampling.items())
        print(f"note: generate, chat and serve default to generation_config.json's {shown} "
              f"(--generation-config none: dlm's own)", file=sys.stderr)
    return out


def weight_files(folder: Path) -> list[str]:
    """The safetensors files of a transformers folder: model.safetensors, or the shards its index names
    (plain file names inside the folder: an index cannot point outside it)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        wmap = read_json(index).get("weight_map")
        if not isinstance(wmap, dict) or not wmap:
            raise DlmError(f"{index}: weight_map must be a non-empty object of tensor name -> shard file")
        bad = [f for f in wmap.values()
               if not isinstance(f, str) or Path(f).name != f or f in ("", ".", "..") or "\\" in f]
        if bad:
            raise DlmError(f"{index}: shard {bad[0]!r} is not a plain file name in {folder} (an index may only name "
                           "files beside it)")
        files = sorted(set(wmap.values()))
        return files
    if (folder / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise DlmError(f"{folder}: no model.safetensors or model.safetensors.index.json (only safetensors are read)")


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a transformers folder, memory-mapped (nothing is read until it is used; an import reads each
    once and write_tensors releases its pages: files.release)."""
    tensors: dict[str, torch.Tensor] = {}
    for f in weight_files(folder):
        for name, t in mmap_tensors(folder / f, transient=True).items():
            if not t.is_floating_point():
                raise DlmError(f"{folder / f}: tensor {name} holds {str(t.dtype).removeprefix('torch.')} values; "
                               "weights are floating point (F32, F16, BF16)")
            tensors[name] = t
    return tensors


def shapes_of(meta: dict[str, Any]) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """The tensors (name -> shape) and tied aliases of the checkpoint `meta` describes."""
    if meta["objective"] == "dflash":
        from dlm.drafter import drafter_shapes

        return drafter_shapes(meta)
    from dlm.config import ModelConfig

    return param_shapes(ModelConfig.from_dict(meta["model"]))


def hf_plan(fam: Family, cfg, expected: dict[str, tuple[int, ...]]) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """transformers name -> (its shape, (the dlm names it makes, the transformers names they are made from, the
    transform or None)) for the tensors `expected` (dlm name -> shape): the names map's, and the transforms' shapes
    from to_hf on the meta device."""
    out: dict[str, tuple[tuple[int, ...], tuple]] = {}
    owned = set()
    for tr in fam.transforms:
        for names, hfs in tr.groups(cfg):
            metas = tr.to_hf(cfg, names, [torch.empty(expected[n], device="meta") for n in names])
            out.update({h: (tuple(m.shape), (names, hfs, tr)) for h, m in zip(hfs, metas)})
            owned.update(names)
    for name, shape in expected.items():
        if name not in owned:
            hfs = fam.hf_names(name)
            assert hfs is not None, f"{fam.name}: no transformers name for {name}"
            out.update({h: (shape, ((name,), hfs, None)) for h in hfs})
    return out


def import_tensors(fam: Family, cfg, expected: dict[str, tuple[int, ...]], aliases: dict[str, str],
                   raw: dict[str, torch.Tensor], src: Path) -> tuple[dict[str, Lazy], list[str]]:
    """The checkpoint's tensors, each made from the folder's memory-mapped ones (`raw`) only as it is written, after
    every name and shape is held against the config; and the folder's tensors left out (rows that leave others)."""
    plan = {n: p for _, p in hf_plan(fam, cfg, expected).values() for n in p[0]}
    plan = {n: (p[0], p[1], p[2], p[0].index(n)) for n, p in plan.items()}  # dlm -> (group, hf names, transform, j)
    want = {h: s for h, (s, _) in hf_plan(fam, cfg, expected).items()}  # transformers name -> shape
    tied = {h for a in aliases for h in fam.hf_names(a) or ()}
    left = [h for h in raw if h not in want and h not in tied and not fam.ignored(h)]
    if left and fam.others == "refuse":
        raise DlmError(f"{src}: unexpected tensor {left[0]!r} for {fam.name}'s layout")
    missing = [hfs[0] for _, hfs, tr, _ in plan.values()
               if (any(h not in raw for h in hfs) if tr else not any(h in raw for h in hfs))]
    if missing:
        raise DlmError(f"{src}: does not match its config.json (missing {sorted(set(missing))[:4]})")
    for h, shape in want.items():
        if h in raw and tuple(raw[h].shape) != shape:
            raise DlmError(f"{src}: tensor {h} has shape {tuple(raw[h].shape)}, config.json implies {shape}")
    embed = fam.hf_names("embed_tokens.weight") or ()
    dtype = next((raw[h].dtype for h in embed if h in raw), next(iter(raw.values())).dtype)

    def make(name: str) -> torch.Tensor:
        names, hfs, tr, j = plan[name]
        if tr is not None:
            t = tr.to_dlm(cfg, names, [raw[h] for h in hfs])[j]
        else:
            present = [h for h in hfs if h in raw]
            t = raw[present[0]]
            for h in present[1:]:  # one tensor stored under several names: the same values
                if not torch.equal(raw[h], t):
                    raise DlmError(f"{src}: {h} differs from {present[0]} (one backbone holds one)")
        if not all(all_finite(p) for p in (t.parts if isinstance(t, Stacked) else [t])):
            raise DlmError(f"{src}: tensor {name} holds NaN or infinite values")
        return t.to(dtype)

    return {n: Lazy(shape, dtype, lambda n=n: make(n)) for n, shape in expected.items()}, left


def side_files(src: Path, hf: dict[str, Any], fam: Family) -> list[str]:
    """The files kept beside the weights: tokenizer settings, chat template, generation defaults (SIDE_FILES), and
    for rows with remote code what the auto_maps name and what that imports (hf_layout.remote_code)."""
    names = [f for f in SIDE_FILES if (src / f).is_file()]
    return names + ([f for f in remote_code(src, hf) if f not in names] if fam.remote_code else [])


def export_tensors(fam: Family, model, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's tensors under the row's transformers names (its transforms inverted)."""
    cfg, state = model.cfg, state_tensors(model, dtype)
    out, done = {}, set()
    for tr in fam.transforms:
        for names, hfs in tr.groups(cfg):
            out.update(zip(hfs, tr.to_hf(cfg, names, [state[n] for n in names])))
            done.update(names)
    for name, t in state.items():
        if name not in done:
            out.update({h: t for h in fam.hf_names(name)})
    return out


def export_hf(model, tok: Tokenizer, out: str | os.PathLike, dtype: torch.dtype = torch.float32,
              overwrite: bool = False, inputs: tuple[str | os.PathLike, ...] = ()) -> Path:
    """Write a transformers-loadable folder (config.json, model.safetensors, tokenizer files) in the layout of the
    checkpoint's row (dlm.families.export_family); inputs[0]: the checkpoint, whose recorded config and side files
    the export writes back."""
    src = Path(inputs[0]) if inputs else None
    meta = read_json(src / "config.json") if src is not None and (src / "config.json").is_file() else {}
    meta = hf_mdlm.finetuned_meta(meta) or meta  # a fine-tuned SDAR / LLaDA 2: its family's layout again
    fam = export_family(model, meta)
    if fam.fits is not None:
        fam.fits(model)
    dname = str(dtype).removeprefix("torch.")
    with write_folder(out, overwrite=overwrite, inputs=inputs) as tmp:
        write_tensors(tmp / "model.safetensors", export_tensors(fam, model, dtype), metadata={"format": "pt"})
        write_json(tmp / "config.json", fam.export_config(model, tok, dname, meta))
        if fam.tokenizer:
            tok.save(tmp / "tokenizer.json")
            copied = set(side_files(src, meta.get("hf_config") or {}, fam)) if src is not None else set()
            for f in copied:
                shutil.copyfile(src / f, tmp / f)
            hfc = tok.hf_config()
            for f, obj in (("tokenizer_config.json", hfc),
                           ("special_tokens_map.json", {k: v for k, v in hfc.items()
                                                        if k.endswith("_token") and v is not None}),
                           ("generation_config.json", {"bos_token_id": tok.bos_id, "eos_token_id": tok.hf_eos_token_id,
                                                       "pad_token_id": tok.pad_id})):
                if f not in copied:
                    write_json(tmp / f, obj)
    return Path(out)


# public DFlash drafters ----------------------------------------------------------------------------------

def export_drafter(drafter, ck: Checkpoint, out: str | os.PathLike, dtype: torch.dtype = torch.float32,
                   overwrite: bool = False) -> Path:
    """Write the drafter as a public-layout DFlash folder (config.json + model.safetensors)."""
    return export_hf(drafter, ck.tokenizer, out, dtype, overwrite, inputs=(ck.path,))


def prenorm_warning(drafter, ck: Checkpoint) -> str | None:
    """Why an exported drafter would be served other features than it was trained on, if it would.

    Public engines read target layer i as transformers' hidden_states[i + 1], whose last entry is after the
    target's final norm; drafters trained before dlm read the same (last_layer "normed") read it before."""
    last = ck.config["dflash"]["target"]["model"]["n_layers"] - 1
    if drafter.last_layer != "prenorm" or last not in drafter.layer_ids:
        return None
    return (f"{ck.path.name} was trained on target layer {last} (the last) before the final norm; vLLM and SGLang "
            "feed it after the norm, so they will draft worse than dlm does: retrain it (new drafters read it normed)")
