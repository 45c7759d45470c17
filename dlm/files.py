"""Files written so that nothing half-written is ever left: atomic JSON and safetensors writes, output folders
built under a temporary name then moved into place, and reading them back with the path in every error.
Loading never unpickles."""

from __future__ import annotations

import json
import math
import mmap
import os
import shutil
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from dlm.errors import DlmError

# atomic file helpers -------------------------------------------------------------------------

def _fsync_replace(tmp: Path, dst: Path) -> None:
    os.chmod(tmp, 0o644)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, dst)


def write_json(path: Path, obj: Any) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, allow_nan=False) + "\n")  # standard JSON only: no NaN, no Infinity
    _fsync_replace(tmp, path)


# safetensors dtype names (https://github.com/huggingface/safetensors: the format is an 8-byte little-endian header
# length, a JSON header of name -> dtype, shape, data_offsets, then the tensors' bytes back to back)
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL"}
_DTYPES_BY_NAME = {v: k for k, v in SAFETENSORS_DTYPES.items()}


class Stacked:
    """A tensor that exists only as its parts laid end to end (row-major): a stack of experts stored one by one, written
    part by part (write_tensors) so that the whole is never in memory. parts: tensors whose elements, in order, are
    the whole's; dtype: what the whole is written as (each part is converted as it is written)."""

    def __init__(self, parts: list[torch.Tensor], shape: tuple[int, ...], dtype: torch.dtype | None = None):
        self.parts, self.shape = list(parts), torch.Size(shape)
        self.dtype = dtype if dtype is not None else parts[0].dtype
        if sum(p.numel() for p in self.parts) != self.shape.numel():
            raise ValueError(f"parts of {sum(p.numel() for p in self.parts)} elements cannot make a {tuple(shape)}")

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating_point

    def to(self, dtype: torch.dtype) -> "Stacked":
        return Stacked(self.parts, self.shape, dtype)


class Lazy(NamedTuple):
    """A tensor made only when write_tensors writes it (its shape and dtype known before): an imported tensor cut,
    stacked or checked from memory-mapped shards; make() returns a tensor or a Stacked one."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[], "torch.Tensor | Stacked"]

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.dtype.itemsize


def write_tensors(path: Path, tensors: dict[str, torch.Tensor | Stacked | Lazy],
                  metadata: dict[str, str] | None = None) -> None:
    """A safetensors file, written tensor by tensor from the tensors' own memory: no copy of the whole model is
    made (a real-size checkpoint is written with one tensor in flight at a time; a Stacked one part by part).
    The pages of a memory-mapped import source are released once written (release)."""
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
            if isinstance(t, Lazy):
                want, t = t, t.make()
                assert tuple(t.shape) == tuple(want.shape) and t.dtype == want.dtype, (name, t.shape, want)
            for part in (t.parts if isinstance(t, Stacked) else [t]):
                if part.numel():
                    data = part.detach().cpu().to(t.dtype).contiguous()
                    fh.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
                    del data
                    release(part)
    _fsync_replace(tmp, path)


class _Mapping(mmap.mmap):
    """A memory map of an import's source file (mmap_tensors(transient=True)): read once, then let go."""


_TRANSIENT: "weakref.WeakKeyDictionary[_Mapping, int]" = weakref.WeakKeyDictionary()  # mapping -> its address


def release(t: torch.Tensor | Stacked) -> None:
    """Drop the resident pages of the file a tensor was memory-mapped from by mmap_tensors(transient=True)
    (MADV_DONTNEED over the whole mapping: the kernel maps a touched page's neighbours too, up to 64 KiB around it,
    so dropping the tensor's own pages would leave its neighbours' behind; they leave this process's resident set,
    stay in the page cache and are reread if touched again). Nothing happens to a tensor mapped otherwise. Such a
    mapping must only be read: a page written would be lost."""
    if isinstance(t, Stacked):
        for p in t.parts:
            release(p)
        return
    if not _TRANSIENT or t.device.type != "cpu" or t.numel() == 0:
        return
    ptr = t.untyped_storage().data_ptr()
    for m, base in list(_TRANSIENT.items()):
        if base <= ptr < base + len(m):
            m.madvise(mmap.MADV_DONTNEED)
            return


def mmap_tensors(path: Path, transient: bool = False) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, memory-mapped (copy-on-write): nothing is read until it is used, and
    pages the process never writes stay the file's (the kernel may drop and reread them). transient: an import's
    source, read once: release(t) drops a tensor's pages from the resident set once it has been used."""
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
            buf = (_Mapping if transient else mmap.mmap)(fh.fileno(), 0, access=mmap.ACCESS_COPY) \
                if size > 8 + n else b""
    except (json.JSONDecodeError, UnicodeDecodeError, OSError, ValueError) as e:
        raise DlmError(f"{bad} ({str(e).splitlines()[0][:160]})") from None
    if not isinstance(header, dict):
        raise DlmError(f"{bad} (its header is not an object)")
    if isinstance(buf, _Mapping):
        _TRANSIENT[buf] = torch.frombuffer(buf, dtype=torch.uint8, count=1).data_ptr()
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


JSON_DEPTH = 64  # objects and arrays nested deeper than this are refused (a config.json needs a handful)


def json_depth(obj: Any) -> int:
    """The deepest nesting of objects and arrays in a parsed JSON value (a scalar: 0), without recursion."""
    deepest, todo = 0, [(obj, 1)]
    while todo:
        o, d = todo.pop()
        if isinstance(o, (dict, list)):
            deepest = max(deepest, d)
            todo.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return deepest


def loads_bounded(text: str | bytes, **kw: Any) -> Any:
    """json.loads, refusing (ValueError) what nests deeper than JSON_DEPTH: the decoder's own recursion stops
    at the interpreter's limit (RecursionError, caught here), the rest is measured after parsing."""
    try:
        obj = json.loads(text, **kw)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {JSON_DEPTH} levels") from None
    if json_depth(obj) > JSON_DEPTH:
        raise ValueError(f"JSON nested deeper than {JSON_DEPTH} levels")
    return obj


def _standard_number(s: str) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise ValueError(f"not standard JSON: the number {s[:40]} is out of range")
    return v


def _no_constant(s: str) -> Any:
    raise ValueError(f"not standard JSON: {s} is no JSON number")


def read_json(path: Path) -> dict:
    """A JSON object from a file: standard JSON only (no NaN, Infinity or numbers past a float's range), nested at
    most JSON_DEPTH deep; anything else is one DlmError line naming the file."""
    path = Path(path)
    if not path.is_file():
        raise DlmError(f"{path}: missing")
    try:
        obj = loads_bounded(path.read_text(encoding="utf-8"), parse_float=_standard_number,
                            parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DlmError(f"{path}: not valid JSON ({e})") from None
    except ValueError as e:
        raise DlmError(f"{path}: {e}"[:300]) from None
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
        files = sorted(tmp.iterdir(), key=lambda f: (f.name == "config.json", f.name))
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
