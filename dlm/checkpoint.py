"""Checkpoints: a folder with config.json, model.safetensors and tokenizer.json.

Loading never unpickles. Every file is written under a temporary name and renamed into place;
a missing, truncated or mismatched file is reported with its path.

config.json:
  {"format": "dlm", "version": 1, "objective": "ar", "model": {ModelConfig}, "train": {TrainConfig},
   "tokenizer": {"file": "tokenizer.json", "sha256": ..., "vocab_size": ...}, "step": N, ...objective extras}

Training state for --resume lives in OUT/state/ (model + optimizer in safetensors, trainer.json),
swapped in as a whole folder so a kill at any moment leaves either the old or the new state.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from dlm.config import ModelConfig
from dlm.drafter import build_drafter
from dlm.errors import DlmError, check
from dlm.model import Transformer
from dlm.tokenizer import Tokenizer

DEFAULT_CANVAS = 256  # usdm canvas length when a checkpoint records none (DiffusionGemma's)

CONFIG, WEIGHTS, TOKENIZER = "config.json", "model.safetensors", "tokenizer.json"
FORMAT_VERSION = 1


# atomic file helpers -------------------------------------------------------------------------

def _fsync_replace(tmp: Path, dst: Path) -> None:
    os.chmod(tmp, 0o644)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, dst)


def write_json(path: Path, obj: Any) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    _fsync_replace(tmp, path)


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp), metadata=metadata)
    _fsync_replace(tmp, path)


def read_json(path: Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise DlmError(f"{path}: missing")
    try:
        obj = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DlmError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise DlmError(f"{path}: expected a JSON object")
    return obj


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise DlmError(f"{path}: missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise DlmError(f"{path}: truncated or corrupt safetensors file ({str(e).splitlines()[0][:160]})") from None


@contextmanager
def write_folder(out: str | os.PathLike, *, overwrite: bool = False, inputs: tuple[str | os.PathLike, ...] = (),
                 option: str = "--out") -> Iterator[Path]:
    """Build a folder under a temporary name beside `out`, then move it into place.

    `out` must not exist, or be empty, unless `overwrite`; even then only the files this write
    produced replace their namesakes in `out`: nothing else there is deleted. `out` may never be
    one of `inputs`, inside one, or hold one (an ancestor of an input). A failed build leaves
    nothing behind.
    """
    out = Path(out)
    if out.is_symlink() or (out.exists() and not out.is_dir()):
        raise DlmError(f"{option} {out}: exists and is not a folder")
    dst = out.resolve()
    for src in inputs:
        src = Path(src).resolve()
        if dst == src or dst in src.parents or src in dst.parents:
            raise DlmError(f"{option} {out}: overlaps the input {src} (write somewhere else)")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise DlmError(f"{option} {out}: exists and is not empty; choose another folder, or pass --overwrite "
                       "to replace the files this command writes there (nothing else is deleted)")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        yield tmp
        if out.exists() and not any(out.iterdir()):
            out.rmdir()
        if not out.exists():
            os.replace(tmp, dst)
            return
        for f in sorted(tmp.iterdir()):  # --overwrite: replace our files one by one, keep the rest
            os.replace(f, dst / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# model weights -------------------------------------------------------------------------------

def state_tensors(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's tensors, shared ones (a tied LM head) stored once."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in model.state_dict().items():
        if t.data_ptr() in seen and t.numel() > 0:
            continue
        seen.add(t.data_ptr())
        out[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out


def load_weights(model: nn.Module, tensors: dict[str, torch.Tensor], source: Path) -> None:
    """Load tensors into model, reporting missing/unexpected/misshapen names against `source`."""
    expected = model.state_dict()
    tied = {n for n, t in expected.items() for m, u in expected.items()
            if n != m and t.data_ptr() == u.data_ptr() and m in tensors and n not in tensors}
    missing = [n for n in expected if n not in tensors and n not in tied]
    unexpected = [n for n in tensors if n not in expected]
    if missing or unexpected:
        raise DlmError(f"{source}: does not match its config.json (missing {missing[:4]}, unexpected {unexpected[:4]})")
    for n, t in tensors.items():
        if tuple(t.shape) != tuple(expected[n].shape):
            raise DlmError(f"{source}: tensor {n} has shape {tuple(t.shape)}, config.json implies {tuple(expected[n].shape)}")
    with torch.no_grad():
        for n, p in expected.items():
            if n in tensors:
                p.copy_(tensors[n].to(p.dtype))


# checkpoint folders --------------------------------------------------------------------------

def save_checkpoint(
    out: Path, model: nn.Module, tokenizer: Tokenizer, meta: dict[str, Any], dtype: torch.dtype | None = None,
) -> None:
    """Write config.json, model.safetensors and tokenizer.json into `out` (each file atomically)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(out / TOKENIZER)
    write_tensors(out / WEIGHTS, state_tensors(model, dtype), metadata={"format": "pt"})
    cfg = {"format": "dlm", "version": FORMAT_VERSION, **meta,
           "tokenizer": {"file": TOKENIZER, "sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size}}
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
    def block_size(self) -> int:
        """The block a block-diffusion checkpoint was trained with (0: the whole sequence)."""
        return int(self.config.get("block_size", self.config.get("block_length")) or 0)

    @property
    def canvas_length(self) -> int:
        """Tokens per canvas of a usdm checkpoint."""
        return int(self.config.get("canvas_length", self.config.get("train", {}).get("canvas_length",
                                                                                       DEFAULT_CANVAS)))

    @property
    def noise_vocab(self) -> int:
        """Size of the vocabulary uniform noise is drawn from (the tokenizer's, recorded at training)."""
        return int(self.config.get("noise_vocab", self.tokenizer.vocab_size))


def open_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Read config.json and tokenizer.json of a checkpoint folder, checking they belong together."""
    p = Path(path)
    if not p.is_dir():
        raise DlmError(f"--model: checkpoint folder not found: {p}")
    cfg = read_json(p / CONFIG)
    if cfg.get("format") != "dlm":
        hint = " (a transformers checkpoint? use `dlm import --hf`)" if "model_type" in cfg else ""
        raise DlmError(f"{p / CONFIG}: not a dlm checkpoint{hint}")
    if not (p / TOKENIZER).is_file():
        raise DlmError(f"{p / TOKENIZER}: missing")
    tok = Tokenizer.from_file(p / TOKENIZER)
    want = cfg.get("tokenizer", {}).get("sha256")
    if want and want != tok.sha256:
        raise DlmError(f"{p / TOKENIZER}: does not match the tokenizer recorded in config.json (sha256 differs)")
    vocab = cfg.get("model", {}).get("vocab_size")
    if vocab is not None and vocab < tok.vocab_size:
        raise DlmError(f"{p / TOKENIZER}: {tok.vocab_size} tokens, more than config.json model.vocab_size {vocab}")
    return Checkpoint(p, cfg, tok)


def resolve_device(name: str) -> torch.device:
    """--device: auto (CUDA when there is one), cpu, cuda or cuda:N."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check(name in ("cpu", "cuda") or name.startswith("cuda:"), f"--device must be auto, cpu or cuda[:N], got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DlmError(f"--device {name}: no CUDA device is available")
    return torch.device(name)


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> tuple[nn.Module, Checkpoint]:
    """Build the model a checkpoint describes and load its weights (in eval mode)."""
    ck = open_checkpoint(path)
    model = build_drafter(ck.config) if ck.objective == "dflash" else Transformer(ck.model_config)
    load_weights(model, ck.tensors(), ck.path / WEIGHTS)
    return model.to(device=device, dtype=dtype).eval(), ck


def export_dlm(model: nn.Module, ck: Checkpoint, out: str | os.PathLike, dtype: torch.dtype,
               overwrite: bool = False) -> Path:
    """Copy a checkpoint without its training state (optionally in a smaller dtype): what ships."""
    meta = {k: v for k, v in ck.config.items() if k not in ("format", "version", "tokenizer")}
    with write_folder(out, overwrite=overwrite, inputs=(ck.path,)) as tmp:
        save_checkpoint(tmp, model, ck.tokenizer, {**meta, "dtype": str(dtype).removeprefix("torch.")}, dtype=dtype)
        if (ck.path / "metrics.jsonl").is_file():
            shutil.copy(ck.path / "metrics.jsonl", tmp / "metrics.jsonl")
    return Path(out)


# training state ------------------------------------------------------------------------------

def optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    sd = opt.state_dict()
    tensors = {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            tensors[f"state.{idx}.{k}"] = v if torch.is_tensor(v) else torch.tensor(v)
    return tensors, {"param_groups": sd["param_groups"]}


def restore_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, v in tensors.items():
        _, idx, k = name.split(".", 2)
        state.setdefault(int(idx), {})[k] = v
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def save_state(out: Path, model: nn.Module, opt: torch.optim.Optimizer, trainer: dict[str, Any]) -> None:
    """Write OUT/state as a whole: build state.tmp, then swap it in."""
    out = Path(out)
    tmp, cur, old = out / "state.tmp", out / "state", out / "state.old"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_tensors(tmp / WEIGHTS, state_tensors(model))
    t, m = optimizer_tensors(opt)
    write_tensors(tmp / "optimizer.safetensors", t)
    write_json(tmp / "optimizer.json", m)
    write_json(tmp / "trainer.json", trainer)
    if cur.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(cur, old)
    os.replace(tmp, cur)
    shutil.rmtree(old, ignore_errors=True)


def find_state(out: Path) -> Path | None:
    """The newest complete state folder (state/, or state.old/ if a swap was cut short)."""
    for name in ("state", "state.old"):
        p = Path(out) / name
        if (p / "trainer.json").is_file():
            return p
    return None
