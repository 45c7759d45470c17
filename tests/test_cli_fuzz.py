"""Random command lines at every subcommand: no traceback, ever.

Each example is `dlm COMMAND` with a few options that keep the work small (a tiny checkpoint, a tiny corpus,
2 steps or 2 tokens), then random options of the command with values drawn by the option's type from pools
of edge cases (negative, zero, huge, NaN, not-a-number, empty, `.`, `..`, a file where a folder is meant,
non-UTF-8, paths that do not exist ...), sometimes of the wrong type, and stray tokens. It runs in this process
(`dlm.cli.main`); the only acceptable outcomes are exit code 0, or 2 with one line `dlm...: error: ...` (after
any `dlm: warning:` lines). Deterministic (derandomized), bounded examples, no example database.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import os
import shutil
import sys
from pathlib import Path

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from test_reliability import as_paradigm, copy_checkpoint, user_files  # noqa: E402

INTS = ["-1", "0", "1", "2", "3"]
FLOATS = ["-1", "0", "0.5", "1", "2", "1e23", "nan", "inf", "-inf", "1e-9"]
PATHS = ["", ".", "..", "-", "nope", "afile", "user", "link", "bad.txt", "bad.jsonl", "bad.yaml", "out/x",
         "new.jsonl", "d.jsonl", "a\udcffb", "lookup", "stdlib", "{ck}", "{hf}", "{corpus}", "{tok}", "{mdlm}", "{usdm}"]
TEXTS = ["", "def f(", "x = <fill> + 1", "<fill:3>", "<fill:0>", "a\udcffb", "\n" * 3]
STRINGS = {  # options with a few meaningful values: those, and some that are not
    "device": ["auto", "cpu", "tpu", "meta", "cuda", "cuda:0", "cuda:x", "cuda:-1"],
    "dtype": ["float32", "float16", "bfloat16", "int8"], "format": ["hf", "dlm", "onnx"],
    "objective": ["ar", "mdlm", "usdm", "dflash", "gan"], "preset": ["tiny", "draft", "huge"],
    "sampler": ["auto", "confidence", "threshold", "entropy_bound", "ar", "x"], "split": ["train", "val", "test", "x"],
    "remasking": ["low_confidence", "random", "x"], "injection": ["kv", "input", "x"],
    "loss_weight": ["constant", "inverse", "x"], "prompt": TEXTS, "suffix": TEXTS,
}
BAD = ["1e23", str(10**30), "x", "", "0x10", "-", "a\udcffb"]  # not a number, or not one of this type
BASE = {  # options that keep the work small; the random ones come after and may override them
    "train": ["--out", "{run}", "--data", "{corpus}", "--tokenizer", "{tok}", "--seq-len", "16", "--batch-size", "2",
              "--max-steps", "2", "--eval-every", "1", "--eval-batches", "1", "--quiet"],
    "generate": ["--model", "{ck}", "--max-new-tokens", "2", "--prompt", "def f("],
    "eval": ["--model", "{ck}", "--data", "{corpus}", "--max-batches", "1", "--batch-size", "2", "--samples", "1"],
    "export": ["--model", "{ck}", "--out", "exported"],
    "import": ["--hf", "{hf}", "--out", "imported"],
    "bench": ["--model", "{ck}", "--data", "{corpus}", "--prompts", "1", "--max-new-tokens", "2", "--warmup", "0",
              "--out", ""],
    "demo": ["--prompts", "1", "--max-new-tokens", "2"],
    "distill": ["--target", "{ck}", "--out", "d/out.jsonl", "--data", "{corpus}", "--prompts", "2",
                "--max-new-tokens", "2", "--batch-size", "2", "--quiet"],
}


def options(command: str) -> dict[str, str]:
    """--option -> its type, as a string ("int", "float | None", "bool", "list[str] | None", ...)."""
    import dlm.cli

    fn = getattr(dlm.cli, f"{command}_cmd")
    out = {}
    for p in inspect.signature(fn).parameters.values():
        if p.name in ("cfg", "scfg"):
            cls = dlm.cli._train_config() if p.name == "cfg" else dlm.cli._sample_config()
            out.update({f.name: f.type for f in dataclasses.fields(cls)})
        else:
            out[p.name] = str(p.annotation)
    return {"--" + k.replace("_", "-"): v for k, v in out.items()}


def value(name: str, kind: str) -> st.SearchStrategy[list[str]]:
    pool = STRINGS.get(name[2:].replace("-", "_")) or (INTS if "int" in kind else FLOATS if "float" in kind else PATHS)
    # mostly a value of the option's type; one time in eight a wrong one
    one = st.integers(0, 7).flatmap(lambda i: st.sampled_from(BAD + PATHS if i == 0 else pool))
    if kind.startswith("list"):
        return st.lists(one, min_size=0, max_size=3)
    return st.lists(one, min_size=1, max_size=1)


@st.composite
def argv(draw, command: str) -> list[str]:
    opts = options(command)
    args = [command, *BASE[command]]
    for _ in range(draw(st.integers(0, 4))):
        name = draw(st.sampled_from(sorted(opts)))
        kind = opts[name]
        if "bool" in kind:
            args.append(draw(st.sampled_from([name, "--no-" + name[2:]])))
        else:
            args += [name, *draw(value(name, kind))]
    if draw(st.integers(0, 9)) == 0:  # a stray token
        args.insert(draw(st.integers(1, len(args))), draw(st.sampled_from(["--bogus", "-h", "x", "--", "--config",
                                                                             "--config=bad.yaml", "-"])))
    return args


@pytest.fixture(scope="module")
def world(tiny_ar, tokenizer_path, tmp_path_factory) -> dict[str, str]:
    """A folder the examples run in: copies of everything they may write to or read (nothing shared is touched)."""
    from dlm.checkpoint import load_model
    from dlm.data.corpus import stdlib_root
    from dlm.hf import export_hf

    w = tmp_path_factory.mktemp("fuzz") / "w"
    corpus = w / "corpus"
    corpus.mkdir(parents=True)
    for rel in ("bisect.py", "colorsys.py", "keyword.py", "queue.py", "sched.py", "getopt.py", "abc.py", "copy.py",
                "textwrap.py", "string.py", "shlex.py", "fnmatch.py"):
        shutil.copy(stdlib_root() / rel, corpus / rel)
    copy_checkpoint(tiny_ar, w / "ck")
    shutil.copy(tokenizer_path, w / "tokenizer.json")
    model, ck = load_model(tiny_ar)
    export_hf(model, ck.tokenizer, w / "hf")
    for o in ("mdlm", "usdm"):
        as_paradigm(tiny_ar, w / o, o)
    user_files(w, b'{"text": "caf\xe9"}\n', b"max_steps: 2\nlr: \xff\n")
    (w / "checkpoints").mkdir()  # DLM_CHECKPOINTS: no shipped models (demo and bench defaults stay fast)
    return {"w": str(w), "ck": str(w / "ck"), "hf": str(w / "hf"), "corpus": str(corpus),
            "tok": str(w / "tokenizer.json"), "mdlm": str(w / "mdlm"), "usdm": str(w / "usdm")}


def run_in(world: dict[str, str], args: list[str]) -> tuple[int, str]:
    from dlm.cli import main

    old = (os.getcwd(), sys.stdin, os.environ.get("DLM_CHECKPOINTS"))
    os.chdir(world["w"])
    os.environ["DLM_CHECKPOINTS"] = str(Path(world["w"]) / "checkpoints")
    sys.stdin = io.TextIOWrapper(io.BytesIO(b"def f("), encoding="utf-8")
    run_in.calls = getattr(run_in, "calls", 0) + 1
    fill = {**world, "run": f"run{run_in.calls}"}  # a new training folder each time (or every run is refused)
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main([a.format(**fill) if "{" in a and "<fill>" not in a else a for a in args])
            except SystemExit as e:
                code = e.code
    finally:
        os.chdir(old[0])
        sys.stdin = old[1]
        if old[2] is None:
            os.environ.pop("DLM_CHECKPOINTS", None)
        else:
            os.environ["DLM_CHECKPOINTS"] = old[2]
    return code, err.getvalue()


EXAMPLES = {"train": 25, "generate": 60, "eval": 30, "export": 30, "import": 25, "bench": 25, "demo": 15,
            "distill": 25}


@pytest.mark.parametrize("command", list(EXAMPLES))
def test_random_command_lines_never_raise(world, command):
    @settings(max_examples=EXAMPLES[command], deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(args=argv(command))
    def check(args):
        code, err = run_in(world, args)  # any exception but SystemExit(0 | 2) fails the test here
        assert code in (0, None, 2) and "Traceback" not in err, (args, code, err)
        if code == 2:
            lines = [ln for ln in err.splitlines() if not ln.startswith("dlm: warning:")]
            assert len(lines) == 1 and lines[0].startswith("dlm") and ": error: " in lines[0], (args, err)

    check()
