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
import math
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from dlm.config import ModelConfig
from dlm.drafter import build_drafter, drafter_shapes
from dlm.errors import DlmError, check
from dlm.model import Transformer, param_shapes, rope_inv_freq
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


# safetensors dtype names (https://github.com/huggingface/safetensors: the format is an 8-byte little-endian header
# length, a JSON header of name -> dtype, shape, data_offsets, then the tensors' bytes back to back)
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL"}
_DTYPES_BY_NAME = {v: k for k, v in SAFETENSORS_DTYPES.items()}


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    """A safetensors file, written tensor by tensor from the tensors' own memory: no copy of the whole model is
    made (a real-size checkpoint is written with one tensor in flight at a time)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, t in sorted(tensors.items()):
        if t.dtype not in SAFETENSORS_DTYPES:
            raise DlmError(f"{path}: tensor {name} has dtype {t.dtype}, which safetensors cannot hold")
        n = t.numel() * t.element_size()
        header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    with open(tmp, "wb") as fh:
        fh.write(len(head).to_bytes(8, "little") + head)
        for name, t in sorted(tensors.items()):
            if t.numel():
                fh.write(memoryview(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()))
    _fsync_replace(tmp, path)


def mmap_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, memory-mapped (copy-on-write): nothing is read until it is used, and
    pages the process never writes stay the file's (the kernel may drop and reread them)."""
    import mmap

    path = Path(path)
    bad = f"{path}: truncated or corrupt safetensors file"
    if not path.is_file():
        raise DlmError(f"{path}: missing")
    try:
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            n = int.from_bytes(fh.read(8), "little")
            if size < 8 or n > size - 8:
                raise DlmError(f"{bad} (header of {n} bytes in a file of {size})")
            header = json.loads(fh.read(n))
            buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY) if size > 8 + n else b""
    except (json.JSONDecodeError, UnicodeDecodeError, OSError, ValueError) as e:
        raise DlmError(f"{bad} ({str(e).splitlines()[0][:160]})") from None
    if not isinstance(header, dict):
        raise DlmError(f"{bad} (its header is not an object)")
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape = _DTYPES_BY_NAME[info["dtype"]], tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise DlmError(f"{bad} (tensor {name!r}: unknown dtype or bad shape/offsets)") from None
        count = math.prod(shape)
        start = 8 + n + begin
        if begin < 0 or end != begin + count * dtype.itemsize or start + count * dtype.itemsize > size:
            raise DlmError(f"{bad} (tensor {name!r} lies outside the file or has the wrong size)")
        if count == 0:
            out[name] = torch.empty(shape, dtype=dtype)
        elif start % dtype.itemsize:  # not aligned to its element size: read a copy
            out[name] = torch.frombuffer(bytearray(buf[start:start + count * dtype.itemsize]), dtype=dtype).view(shape)
        else:
            out[name] = torch.frombuffer(buf, dtype=dtype, count=count, offset=start).view(shape)
    return out


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
    existed = dst.exists()
    if existed and any(dst.iterdir()) and not overwrite:
        raise DlmError(f"{option} {out}: exists and is not empty; choose another folder, or pass --overwrite "
                       "to replace the files this command writes there (nothing else is deleted)")
    tmp = dst.parent / f".{dst.name or 'out'}.{os.getpid()}.tmp"
    try:
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as e:
        raise DlmError(f"{option} {out}: cannot create it ({e.strerror})") from None
    try:
        yield tmp
        if not existed:  # the usual case: the whole folder appears at once
            os.replace(tmp, dst)
            return
        # an existing folder (empty, or --overwrite; `.` too): our files move in one by one, config.json last
        # (a folder with a config.json is complete); nothing else there is touched
        files = sorted(tmp.iterdir(), key=lambda f: (f.name == CONFIG, f.name))
        for f in files:
            there = dst / f.name
            if there.is_dir() and not there.is_symlink():
                raise DlmError(f"{option} {out}: holds a folder named {f.name}, a file this command writes")
        for f in files:
            os.replace(f, dst / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_out_file(path: str | os.PathLike, option: str = "--out") -> Path:
    """A file that a command will write at its end (a report, a .jsonl), checked before any work is done."""
    p = Path(path)
    if not str(path) or p.name in ("", ".", "..") or str(path).endswith(os.sep):
        raise DlmError(f"{option} {str(path)!r}: must name a file, not a folder")
    if p.is_dir():
        raise DlmError(f"{option} {path}: is a folder; give a file name (e.g. {p / 'out.json'})")
    if p.exists() and not p.is_file():
        raise DlmError(f"{option} {path}: exists and is not a regular file")
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise DlmError(f"{option} {path}: {parent} is a file, not a folder")
    return p


# model weights -------------------------------------------------------------------------------

def state_tensors(model: nn.Module | dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's tensors (or a state dict's: a sharded model's gathered weights), shared ones (a tied LM head)
    stored once."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in (model if isinstance(model, dict) else model.state_dict()).items():
        if t.data_ptr() in seen and t.numel() > 0:
            continue
        seen.add(t.data_ptr())
        out[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return out


def tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a safetensors file's tensors, from its header alone (no tensor is read)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise DlmError(f"{path}: missing")
    try:
        with safe_open(str(path), framework="pt") as fh:
            return {k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()}
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise DlmError(f"{path}: truncated or corrupt safetensors file ({str(e).splitlines()[0][:160]})") from None


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
        """The block a block-diffusion checkpoint or a DFlash drafter was trained with (0: the whole sequence). The
        one accessor: read from the top level, else the drafter's section, else the older key `block_length`."""
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
                 "canvas_length": "int", "noise_vocab": "int", "mask_id": "int?", "dtype": "str", "dflash": "dict"}
SECTION_SCHEMAS = {
    "train": {"seq_len": "int", "canvas_length": "int", "init_from": "str?", "data": "str"},
    "tokenizer": {"sha256": "str", "vocab_size": "int"},
    "dflash": {"target_layer_ids": "ints", "block_size": "int", "mask_token_id": "int", "injection": "str",
               "target_features": "bool", "last_layer": "str", "target": "dict", "input_embedding_scale": "number",
               "output_multiplier": "number", "final_logit_softcapping": "number?"},
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
    index = name.partition(":")[2]
    check(name in ("cpu", "cuda") or (name.startswith("cuda:") and index.isdigit() and index.isascii()),
          f"--device must be auto, cpu, cuda or cuda:N, got {name!r}")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise DlmError(f"--device {name}: no CUDA device is available")
    if index and int(index) >= torch.cuda.device_count():
        raise DlmError(f"--device {name}: there are {torch.cuda.device_count()} CUDA devices (cuda:0 .. "
                       f"cuda:{torch.cuda.device_count() - 1})")
    return torch.device(name)


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


# training state ------------------------------------------------------------------------------

def optimizer_tensors(opt: torch.optim.Optimizer | dict) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An optimizer's state (or its state_dict(): a sharded optimizer's gathered state) as tensors + JSON."""
    sd = opt if isinstance(opt, dict) else opt.state_dict()
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


def save_state(out: Path, model: nn.Module | dict[str, torch.Tensor], opt: torch.optim.Optimizer | dict,
               trainer: dict[str, Any]) -> None:
    """Write OUT/state as a whole: build state.tmp, then swap it in. (model and opt: objects, or their state dicts.)"""
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
