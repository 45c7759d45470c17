"""Shared fixtures: a small corpus, a tokenizer and a tiny AR checkpoint, built once per session.

Everything is trained here, from the running interpreter's standard library; nothing is
downloaded. The token cache goes to a temporary folder.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # one core per worker


def random_transformer(seed: int, std: float, **config):
    """A Transformer of ModelConfig(**config) under torch.manual_seed(seed), its matrices redrawn from N(0, std): large
    enough weights for peaked, context-dependent distributions (the exact-distribution tests need them)."""
    from dlm.config import ModelConfig
    from dlm.model import Transformer

    torch.manual_seed(seed)
    m = Transformer(ModelConfig(**config))
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.normal_(0, std)
    return m


TINY_SHAPE = dict(dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, max_seq_len=64)  # the tests' tiny models


def tiny_model(seed: int, vocab: int, std: float = 0.5, *, dtype: torch.dtype = torch.float64, **config):
    """The tests' tiny random Transformer: random_transformer's weights for TINY_SHAPE (config overrides it) in eval mode
    and `dtype` (float64: no rounding tips a comparison); a self-conditioned one (self_cond=True) with its norm's
    weights drawn away from 1."""
    m = random_transformer(seed, std, **{**TINY_SHAPE, "vocab_size": vocab, **config})
    if config.get("self_cond"):
        with torch.no_grad():
            m.self_cond.norm.weight.normal_(1.0, 0.5)
    return m.to(dtype).eval()


def assert_greedy_continuation(model, ck, row: dict, max_new_tokens: int) -> None:
    """A `dlm distill` row is its prompt followed by the model's greedy continuation, cut at <eos>."""
    from dlm.sampling.speculative import target_greedy

    eos = ck.tokenizer.eos_id
    ref = target_greedy(model, ck.tokenizer.encode(row["prompt"]), max_new_tokens, eos)
    cut = ref.index(eos) if eos in ref else len(ref)
    assert row["text"] == row["prompt"] + ck.tokenizer.decode(ref[:cut])


# what torch.compile's C++ backend on a CPU and dlm's kernels (dlm/kernels) are built with
needs_cxx = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")),
                               reason="needs a C++ compiler (inductor on a CPU, dlm's kernels)")


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu",
                     help="where the tests that take a device (the `device` fixture) run their models: cpu, cuda, "
                          "cuda:N (default: cpu)")


@pytest.fixture(scope="session")
def device(request) -> torch.device:
    """The --device the tests that take one run on (the CPU unless told): the exactness tests of the CUDA-graph
    step and of the speculative loop run there unchanged (scripts/gpu_check.py --parts tests)."""
    from dlm.device import resolve_device
    from dlm.errors import DlmError

    try:
        return resolve_device(request.config.getoption("--device"))
    except DlmError as e:
        raise pytest.UsageError(str(e)) from None


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: one thread is fastest, and the CPU is shared (use: pytestmark = usefixtures("one_thread"))."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

# a fixed slice of the stdlib: enough for tokenizer training and a few hundred steps
CORPUS_FILES = [
    "json/__init__.py", "json/decoder.py", "json/encoder.py", "json/scanner.py", "json/tool.py",
    "csv.py", "textwrap.py", "string.py", "shlex.py", "fnmatch.py", "glob.py", "bisect.py", "heapq.py",
    "colorsys.py", "keyword.py", "queue.py", "sched.py", "getopt.py", "abc.py", "copy.py", "base64.py",
    "calendar.py", "cmd.py", "code.py", "codeop.py", "contextvars.py", "dataclasses.py", "difflib.py",
    "enum.py", "filecmp.py", "fractions.py", "functools.py", "gettext.py", "graphlib.py", "hmac.py",
    "html/__init__.py", "html/parser.py", "imghdr.py", "ipaddress.py", "linecache.py", "locale.py",
    "mimetypes.py", "numbers.py", "operator.py", "optparse.py", "pprint.py", "quopri.py", "random.py",
    "reprlib.py", "secrets.py", "selectors.py", "shutil.py", "statistics.py", "stringprep.py",
    "tabnanny.py", "tempfile.py", "timeit.py", "token.py", "tokenize.py", "trace.py", "traceback.py",
    "types.py", "typing.py", "uuid.py", "warnings.py", "weakref.py", "zipapp.py",
]


class Ran(NamedTuple):
    """What a `dlm` command did: its exit code as the console script returns it, and what it wrote."""

    returncode: int
    stdout: str
    stderr: str


def cli(*args: str, check: bool = False, stdin: bytes | None = None, env: dict | None = None) -> Ran:
    """`dlm ARGS` in this process: no interpreter to start and no torch to import again (a subprocess pays 4-8 s for
    them). check: fail the test unless it exits 0. stdin: what the command reads; env: variables set while it runs."""
    from dlm.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved = (sys.stdin, {k: os.environ.get(k) for k in env or {}})
    if stdin is not None:
        sys.stdin = io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8", errors="surrogateescape")
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:
                code = e.code
    finally:
        sys.stdin = saved[0]
        for k, v in saved[1].items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    ran = Ran(0 if code is None else code, out.getvalue(), err.getvalue())
    if check and ran.returncode != 0:
        raise AssertionError(f"dlm {' '.join(args)} failed ({ran.returncode}):\n{ran.stdout}\n{ran.stderr}")
    return ran


def run_cli(*args: str, check: bool = False, env: dict | None = None, timeout: float = 300, **kw):
    """`python -m dlm.cli ARGS` in a process of its own, for what only a real process shows (the console it draws
    on, what it imports, how it exits); returns CompletedProcess (text). Everything else: `cli`."""
    e = {**os.environ, **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "dlm.cli", *args], capture_output=True, text=True, env=e,
                          timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"dlm {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def start_server(args: list[str], *, env: dict | None = None, cwd: Path | None = None) -> tuple[subprocess.Popen, str]:
    """A real `dlm serve ARGS --port 0` process and its base URL, once it prints its address and /health answers.
    The caller stops it (SIGINT) and reads its exit status."""
    import time

    import httpx

    env = env or {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.Popen([sys.executable, "-m", "dlm", "serve", *args, "--port", "0", "--log-level", "warning"],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = ""
    while "playground:" not in line:
        line = proc.stdout.readline()
        assert line, proc.stderr.read()
    base = line.split()[1].rstrip("/")
    for _ in range(100):
        try:
            httpx.get(base + "/health")
            break
        except httpx.TransportError:
            time.sleep(0.1)
    return proc, base


@pytest.fixture(scope="session", autouse=True)
def _token_cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("dlm-cache")
    old = os.environ.get("DLM_CACHE")
    os.environ["DLM_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("DLM_CACHE", None)
    else:
        os.environ["DLM_CACHE"] = old


@pytest.fixture(scope="session")
def corpus_dir(tmp_path_factory) -> Path:
    from dlm.data.corpus import stdlib_root

    root = stdlib_root()
    out = tmp_path_factory.mktemp("corpus")
    for rel in CORPUS_FILES:
        src = root / rel
        if src.is_file():
            dst = out / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dst)
    return out


@pytest.fixture(scope="session")
def tokenizer_path(corpus_dir, tmp_path_factory) -> Path:
    from dlm.data.corpus import Corpus
    from dlm.tokenizer import Tokenizer

    tok = Tokenizer.train(Corpus(str(corpus_dir)).texts("train"), vocab_size=1024)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(path)
    return path


def tiny_train_config(corpus_dir, tokenizer_path, **kw):
    from dlm.config import TrainConfig

    base = dict(objective="ar", preset="tiny", data=str(corpus_dir), tokenizer=str(tokenizer_path), seq_len=128,
                batch_size=8, max_steps=120, lr=3e-3, eval_every=60, eval_batches=2, save_every=60, log_every=10)
    return TrainConfig(**{**base, **kw})


@pytest.fixture(scope="session")
def tiny_ar(corpus_dir, tokenizer_path, tmp_path_factory) -> Path:
    """A tiny AR checkpoint trained for a few seconds (it has learned something, not much)."""
    from dlm.train import train

    out = tmp_path_factory.mktemp("ckpt") / "tiny-ar"
    train(tiny_train_config(corpus_dir, tokenizer_path), out, quiet=True)
    return out
