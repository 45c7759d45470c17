"""Checkpoints: a folder with config.json, model.safetensors and tokenizer.json.

Loading never unpickles. Every file is written under a temporary name and renamed into place;
a missing, truncated or mismatched file is reported with its path.

config.json:
  {"format": "dlm", "version": 1, "objective": "ar", "model": {ModelConfig}, "train": {TrainConfig},
   "tokenizer": {"file": "tokenizer.json", "sha256": ..., "vocab_size": ...}, "step": N, ...objective extras}

This module holds the checkpoint format (its config schema, the weight checks, opening and loading); the files
it is written with are dlm.files (atomic writes, JSON, safetensors), the device choice dlm.device, the training
state for --resume dlm.trainstate.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dlm.config import ModelConfig
from dlm.files import (
    Lazy, mmap_tensors, read_json, read_tensors, tensor_shapes, write_folder, write_json, write_tensors,
)
from dlm.drafter import build_drafter, drafter_shapes
from dlm.errors import DlmError
from dlm.model import Transformer, param_shapes, rope_inv_freq
from dlm.tokenizer import Tokenizer

DEFAULT_CANVAS = 256  # usdm canvas length when a checkpoint records none (DiffusionGemma's)

CONFIG, WEIGHTS, TOKENIZER = "config.json", "model.safetensors", "tokenizer.json"
# files beside the weights of an imported model that carry its tokenizer's chat template, control tokens and every
# EOS id: kept as they are by import, export and training from it
SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
              "chat_template.json", "generation_config.json", "vocab.json", "merges.txt")
FORMAT_VERSION = 1


def hf_eos_ids(folder: Path, hf: dict[str, Any] | None = None) -> int | list[int] | None:
    """The EOS ids a transformers folder records (an id or a list, as written): generation_config.json's
    eos_token_id, else config.json's (`hf`: its contents; top level, else its text_config's), else None."""
    gen = Path(folder) / "generation_config.json"
    found, where = None, gen
    if gen.is_file() and read_json(gen).get("eos_token_id") is not None:
        found = read_json(gen)["eos_token_id"]
    hf = hf or {}
    for c in (hf, hf.get("text_config") or {}):
        if found is None and isinstance(c, dict) and c.get("eos_token_id") is not None:
            found, where = c["eos_token_id"], Path(folder) / "config.json"
    ids = found if isinstance(found, list) else [found]
    if found is not None and (not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                 for i in ids)):
        raise DlmError(f"{where}: eos_token_id must be a token id or a list of them, got {found!r}"[:200])
    return found


TOP_K_UNSET = 50  # transformers' top_k when a sampling generation_config.json leaves it out (GenerationConfig's)
# DiffusionGemma's generation_config.json keys and the SampleConfig fields they set (its generate reads them)
USDM_KEYS = {"t_min": "t_min", "t_max": "t_max", "max_denoising_steps": "steps",
             "stability_threshold": "stability_threshold", "confidence_threshold": "confidence_threshold"}


def generation_defaults(folder: Path, objective: str) -> dict[str, Any]:
    """The sampling defaults the generation_config.json kept beside an imported model's weights sets, as SampleConfig
    fields: what transformers' generate samples with when it is given no options. AR: do_sample true gives its
    temperature (1.0 unset), top_k (50 unset, transformers' default) and top_p (1.0 unset); do_sample false or unset
    is greedy, whatever temperature the file holds. usdm (DiffusionGemma): max_denoising_steps, t_min, t_max, the
    stopping thresholds and sampler_config's entropy_bound, each where the file sets it. Other paradigms, and a
    folder without the file (dlm's own checkpoints): none."""
    gen = Path(folder) / "generation_config.json"
    if objective not in ("ar", "usdm") or not gen.is_file():
        return {}
    g = read_json(gen)
    if not isinstance(g, dict):
        raise DlmError(f"{gen}: a JSON object expected, got {type(g).__name__}")
    if objective == "usdm":
        out = {field: g[key] for key, field in USDM_KEYS.items() if g.get(key) is not None}
        sc = g.get("sampler_config")
        bound = sc.get("entropy_bound") if isinstance(sc, dict) else None  # ({"_cls_name": ..., "entropy_bound": b})
        out |= {"entropy_bound": bound} if bound is not None else {}
        ints = {"steps", "stability_threshold"}
    elif not g.get("do_sample"):
        return {"temperature": 0.0}
    else:
        out = {k: g[k] for k in ("temperature", "top_k", "top_p") if g.get(k) is not None}
        out = {"temperature": 1.0, "top_k": TOP_K_UNSET, "top_p": 1.0} | out
        ints = {"top_k"}
    for k, v in out.items():  # (ranges: the sampler's own checks, as for an option given)
        if isinstance(v, bool) or not isinstance(v, int if k in ints else (int, float)) or v < 0:
            raise DlmError(f"{gen}: {k} {v!r} cannot be a sampling default (--generation-config none ignores the file)")
    return out


def import_tokenizer(src: Path, hf: dict[str, Any] | None = None) -> Tokenizer:
    """The tokenizer of a transformers folder, ending text at every EOS id the folder records (hf_eos_ids)."""
    return with_eos_ids(Tokenizer.from_file(Path(src) / TOKENIZER), hf_eos_ids(src, hf), Path(src))


def with_eos_ids(tok: Tokenizer, ids: Any, source: Path) -> Tokenizer:
    """tok ending text at the EOS ids `ids` (an id or a list; None: as it is), or a one-line error naming source."""
    if ids is None:
        return tok
    try:
        return tok.use_eos_ids(ids)
    except DlmError as e:
        raise DlmError(f"{source}: eos_token_id: {e}") from None


def state_tensors(model: nn.Module | dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's tensors (or a state dict's: a sharded model's gathered weights), shared ones (a tied LM head)
    stored once."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in (model if isinstance(model, dict) else model.state_dict()).items():
        if isinstance(t, Lazy):  # (made as it is written, in its dtype)
            out[name] = t
            continue
        if t.data_ptr() in seen and t.numel() > 0:
            continue
        seen.add(t.data_ptr())
        out[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out


def check_shapes(expected: dict[str, tuple[int, ...]], shapes: dict[str, tuple[int, ...]], source: Path,
                 aliases: dict[str, str] | None = None) -> None:
    """Raise unless the tensors `shapes` names (name -> shape: a state dict's, or a safetensors header's) are
    exactly the `expected` ones; a tied tensor may be stored under its alias (aliases: alias -> name)."""
    aliases = aliases or {}
    missing = [n for n in expected if n not in shapes and not any(a in shapes for a, m in aliases.items() if m == n)]
    unexpected = [n for n in shapes if aliases.get(n, n) not in expected]
    if missing or unexpected:
        raise DlmError(f"{source}: does not match its config.json (missing {missing[:4]}, unexpected {unexpected[:4]})")
    for n, shape in shapes.items():
        want = expected[aliases.get(n, n)]
        if tuple(shape) != tuple(want):
            raise DlmError(f"{source}: tensor {n} has shape {tuple(shape)}, config.json implies {tuple(want)}")


def model_shapes(model: nn.Module) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """A built model's tensors (name -> shape) and the aliases of the ones it holds under two names (a tied head)."""
    first: dict[int, str] = {}
    expected, aliases = {}, {}
    for n, t in model.state_dict(keep_vars=True).items():
        if id(t) in first:
            aliases[n] = first[id(t)]
        else:
            first[id(t)] = n
            expected[n] = tuple(t.shape)
    return expected, aliases


def all_finite(t: torch.Tensor) -> bool:
    """No NaN or infinity in t (min and max carry both: one pass, no temporary as large as t)."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def load_weights(model: nn.Module, tensors: dict[str, torch.Tensor], source: Path) -> None:
    """Load tensors into model, reporting missing/unexpected/misshapen names and non-finite values against `source`."""
    expected, aliases = model_shapes(model)
    check_shapes(expected, {n: tuple(t.shape) for n, t in tensors.items()}, source, aliases)
    for n, t in tensors.items():
        if not all_finite(t):
            raise DlmError(f"{source}: tensor {n} holds NaN or infinite values (a damaged or diverged checkpoint)")
    with torch.no_grad():
        for n, p in model.state_dict().items():
            if n in tensors:
                p.copy_(tensors[n].to(p.dtype))


# checkpoint folders --------------------------------------------------------------------------

def save_checkpoint(
    out: Path, model: nn.Module | dict[str, torch.Tensor], tokenizer: Tokenizer, meta: dict[str, Any], dtype: torch.dtype | None = None,
) -> None:
    """Write config.json, model.safetensors and tokenizer.json into `out` (each file atomically)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(out / TOKENIZER)
    write_tensors(out / WEIGHTS, state_tensors(model, dtype), metadata={"format": "pt"})
    tk = {"file": TOKENIZER, "sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size}
    if tokenizer.eos_record is not None:  # several EOS ids (an imported Gemma 4's): tokenizer.json cannot say
        tk["eos_ids"] = tokenizer.eos_record
    cfg = {"format": "dlm", "version": FORMAT_VERSION, **meta, "tokenizer": tk}
    write_json(out / CONFIG, cfg)  # last: a folder with a config.json is complete


@dataclass
class Checkpoint:
    path: Path
    config: dict[str, Any]
    tokenizer: Tokenizer

    @property
    def objective(self) -> str:
        return self.config.get("objective", "ar")

    @property
    def model_config(self) -> ModelConfig:
        try:
            return ModelConfig.from_dict(self.config["model"])
        except KeyError:
            raise DlmError(f"{self.path / CONFIG}: has no 'model' section") from None
        except (TypeError, DlmError) as e:
            raise DlmError(f"{self.path / CONFIG}: bad 'model' section ({e})") from None

    def tensors(self) -> dict[str, torch.Tensor]:
        return read_tensors(self.path / WEIGHTS)

    @property
    def mask_id(self) -> int | None:
        """The <mask> id masked diffusion uses: the one config.json records (an imported public model's own, e.g.
        LLaDA's 126336), else the tokenizer's."""
        m = self.config.get("mask_id")
        return m if m is not None else self.tokenizer.mask_id

    @property
    def block_size(self) -> int:
        """The block a block-diffusion checkpoint or a DFlash drafter was trained with (0: the whole sequence). The
        one accessor: read from the top level, else the drafter's section, else the key `block_length`."""
        c = self.config
        return int(c.get("block_size") or c.get("dflash", {}).get("block_size") or c.get("block_length") or 0)

    @property
    def fim(self) -> bool:
        """An AR checkpoint trained for fill-in-the-middle (--fim-rate > 0) with the FIM markers in its tokenizer."""
        tok = self.tokenizer
        markers = (tok.fim_prefix_id, tok.fim_suffix_id, tok.fim_middle_id)
        return float(self.config.get("train", {}).get("fim_rate") or 0) > 0 and None not in markers

    @property
    def canvas_length(self) -> int:
        """Tokens per canvas of a usdm checkpoint."""
        return int(self.config.get("canvas_length", self.config.get("train", {}).get("canvas_length",
                                                                                       DEFAULT_CANVAS)))

    def corpus(self, given: str | None) -> str:
        """The corpus to read: `given` (the user's --data), else the one recorded at training if it is the
        embedded stdlib. A recorded path is never followed: a checkpoint from elsewhere could name any folder."""
        if given:
            return given
        recorded = self.config.get("data", "stdlib")
        if recorded == "stdlib":
            return recorded
        import shlex

        raise DlmError(f"--data: {self.path} was trained on {recorded!r}; paths recorded in a checkpoint are not "
                       f"followed, so name the corpus yourself (e.g. --data {shlex.quote(recorded)})")

    @property
    def noise_vocab(self) -> int:
        """Size of the vocabulary uniform noise is drawn from (the tokenizer's, recorded at training)."""
        return int(self.config.get("noise_vocab", self.tokenizer.vocab_size))


# the entries of config.json that dlm reads, with their types ("?": may be null); others are kept and ignored
CONFIG_SCHEMA = {"version": "int", "objective": "str", "model": "dict", "train": "dict", "data": "str", "step": "int",
                 "params": "int", "tokenizer": "dict", "block_size": "int?", "block_length": "int?",
                 "canvas_length": "int", "noise_vocab": "int", "mask_id": "int?", "dtype": "str", "dflash": "dict",
                 # mdlm conventions of an imported public model (dlm.hf_mdlm, read by dlm.sampling.mdlm)
                 "shift": "bool", "context": "str", "preset": "str?", "family": "str"}
SECTION_SCHEMAS = {
    "train": {"seq_len": "int", "canvas_length": "int", "init_from": "str?", "data": "str"},
    "tokenizer": {"sha256": "str", "vocab_size": "int", "eos_ids": "ints"},
    "dflash": {"target_layer_ids": "ints", "block_size": "int", "mask_token_id": "int", "injection": "str",
               "target_features": "bool", "last_layer": "str", "target": "dict", "input_embedding_scale": "number",
               "output_multiplier": "number", "final_logit_softcapping": "number?", "conv_kernel_size": "int",
               "conv_group_size": "int", "selector_rank": "int", "selector_top_k": "int"},
}
_KINDS = {
    "int": ("an integer", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "dict": ("an object", lambda v: isinstance(v, dict)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "number": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    "ints": ("a list of integers", lambda v: isinstance(v, list) and all(_KINDS["int"][1](x) for x in v)),
}


def check_config(cfg: dict[str, Any], source: Path) -> None:
    """Raise DlmError naming the entry unless every entry dlm reads from a config.json has its type."""
    def check_entries(obj: dict[str, Any], schema: dict[str, str], prefix: str) -> None:
        for key, kind in schema.items():
            if key not in obj or (kind.endswith("?") and obj[key] is None):
                continue
            want, ok = _KINDS[kind.rstrip("?")]
            if not ok(obj[key]):
                raise DlmError(f"{source}: {prefix}{key} must be {want}, got {obj[key]!r}"[:240])

    check_entries(cfg, CONFIG_SCHEMA, "")
    for section, schema in SECTION_SCHEMAS.items():
        if section in cfg:
            check_entries(cfg[section], schema, f"{section}.")
    if cfg.get("objective") == "dflash":
        for key in ("model", "dflash"):
            if key not in cfg:
                raise DlmError(f"{source}: a dflash checkpoint's config.json needs its {key!r} section")
        if "model" in cfg["dflash"].get("target", {}) and not isinstance(cfg["dflash"]["target"]["model"], dict):
            raise DlmError(f"{source}: dflash.target.model must be an object")
    if "model" in cfg:
        try:
            mc = ModelConfig.from_dict(cfg["model"])
        except (TypeError, DlmError) as e:
            raise DlmError(f"{source}: bad 'model' section ({e})") from None
        if cfg.get("objective") == "usdm" and not mc.self_cond:
            raise DlmError(f"{source}: a usdm checkpoint's model has the self-conditioning module (model.self_cond: "
                           "true)")


def checkpoints_dir() -> Path:
    """Where the shipped reference checkpoints live ($DLM_CHECKPOINTS, else the repository's checkpoints/)."""
    env = os.environ.get("DLM_CHECKPOINTS")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "checkpoints"


def shipped(name: str) -> Path | None:
    """The shipped reference checkpoint of this name (a plain folder name: ar-small, mdlm-small, ...), if present."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name or ""):
        return None
    p = checkpoints_dir() / name
    return p if (p / "config.json").is_file() else None


def open_checkpoint(path: str | os.PathLike, option: str = "--model") -> Checkpoint:
    """Read config.json and tokenizer.json of a checkpoint folder, checking they belong together.

    option: the command-line option that named the folder (for the messages)."""
    p = Path(path)
    if not p.is_dir():
        raise DlmError(f"{option} {p}: checkpoint folder not found")
    if not (p / CONFIG).is_file():
        raise DlmError(f"{p / CONFIG}: missing ({option} {p} is not a dlm checkpoint folder)")
    cfg = read_json(p / CONFIG)
    if cfg.get("format") != "dlm":
        hint = " (a transformers checkpoint? use `dlm import --hf`)" if "model_type" in cfg else ""
        raise DlmError(f"{option} {p}: not a dlm checkpoint ({CONFIG} says format {cfg.get('format')!r}){hint}")
    check_config(cfg, p / CONFIG)
    if not (p / TOKENIZER).is_file():
        raise DlmError(f"{p / TOKENIZER}: missing")
    tok = recorded_tokenizer(p, cfg)
    want = cfg.get("tokenizer", {}).get("sha256")
    if want and want != tok.sha256:
        raise DlmError(f"{p / TOKENIZER}: does not match the tokenizer recorded in config.json (sha256 differs)")
    vocab = cfg.get("model", {}).get("vocab_size")
    if vocab is not None and vocab < tok.vocab_size:
        raise DlmError(f"{p / TOKENIZER}: {tok.vocab_size} tokens, more than config.json model.vocab_size {vocab}")
    return Checkpoint(p, cfg, tok)


def recorded_tokenizer(folder: Path, cfg: dict[str, Any]) -> Tokenizer:
    """A checkpoint folder's tokenizer with the EOS ids its config.json records (checkpoints imported before they
    were recorded there: the ones of the generation_config.json kept beside the weights)."""
    tok = Tokenizer.from_file(folder / TOKENIZER)
    ids = cfg.get("tokenizer", {}).get("eos_ids")
    if ids is None and (folder / "generation_config.json").is_file():
        ids = hf_eos_ids(folder)
    return with_eos_ids(tok, ids, folder / CONFIG)


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu",
               dtype: torch.dtype | None = torch.float32, option: str = "--model") -> tuple[nn.Module, Checkpoint]:
    """Build the model a checkpoint describes and load its weights (in eval mode).

    config.json is held against the names and shapes in the weights' header first, so a config that asks
    for more than its weights hold is refused before anything is allocated. The model is built on the meta
    device and takes the memory-mapped weights as they are: no random initialisation, and no copy but the one
    a change of dtype or device makes (dtype None: the dtype the weights are stored in)."""
    ck = open_checkpoint(path, option)
    dflash = ck.objective == "dflash"
    expected, aliases = drafter_shapes(ck.config) if dflash else param_shapes(ck.model_config)
    check_shapes(expected, tensor_shapes(ck.path / WEIGHTS), ck.path / WEIGHTS, aliases)
    with torch.device("meta"):
        model = build_drafter(ck.config) if dflash else Transformer(ck.model_config)
    assign_weights(model, mmap_tensors(ck.path / WEIGHTS), ck.path / WEIGHTS)
    return model.to(device=device, dtype=dtype).eval(), ck


def assign_weights(model: nn.Module, tensors: dict[str, torch.Tensor], source: Path) -> None:
    """Make `tensors` the weights of a model built on the meta device (checked as load_weights checks them);
    the RoPE frequencies are computed, a tied head is tied again."""
    expected, aliases = model_shapes(model)
    check_shapes(expected, {n: tuple(t.shape) for n, t in tensors.items()}, source, aliases)
    for n, t in tensors.items():
        if not all_finite(t):
            raise DlmError(f"{source}: tensor {n} holds NaN or infinite values (a damaged or diverged checkpoint)")
    full = {**{a: tensors[m] for a, m in aliases.items() if a not in tensors}, **tensors}
    model.load_state_dict(full, assign=True)
    model.inv_freq = rope_inv_freq(model.cfg)
    if "sliding" in model.cfg.layer_types:
        model.inv_freq_sliding = rope_inv_freq(model.cfg, "sliding")
    for a, m in aliases.items():  # assign made two parameters of one tensor: one parameter again
        owner, _, leaf = a.rpartition(".")
        setattr(model.get_submodule(owner), leaf, model.get_parameter(m))


def export_dlm(model: nn.Module, ck: Checkpoint, out: str | os.PathLike, dtype: torch.dtype,
               overwrite: bool = False) -> Path:
    """Copy a checkpoint without its training state (optionally in a smaller dtype): what ships."""
    meta = {k: v for k, v in ck.config.items() if k not in ("format", "version", "tokenizer")}
    with write_folder(out, overwrite=overwrite, inputs=(ck.path,)) as tmp:
        save_checkpoint(tmp, model, ck.tokenizer, {**meta, "dtype": str(dtype).removeprefix("torch.")}, dtype=dtype)
        if (ck.path / "metrics.jsonl").is_file():
            shutil.copy(ck.path / "metrics.jsonl", tmp / "metrics.jsonl")
    return Path(out)
