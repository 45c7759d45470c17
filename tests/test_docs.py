"""The docs as tests: the command blocks of README.md and docs/*.md run as a user types them, and what a block
shows after a command is what the command prints.

A fenced block is marked by an HTML comment on the line above it (invisible on the rendered page):

    <!-- test: fast -->     run in the default suite (a few seconds)
    <!-- test: slow -->     run with `pytest -m slow` (minutes: trainings, whole-split evals, benchmarks)
    <!-- test: skip: WHY --> not run here (a GPU, an engine, a download, a file the user brings), and why

A block whose lines start with `$ ` is a session: each command runs in bash (`dlm` is this checkout's
`python -m dlm`) in a scratch folder holding `checkpoints/` and `recipes/`, and the lines up to the
next `$ ` are its expected output: exact, but for wall-clock figures (tok/s, seconds, ids and
timestamps of the server) and a `...` that stands for any text (an abridged output). A block
without `$ ` lines is a script that must exit 0. Every block that runs `dlm`, `curl` or `make`
must be marked (test_every_command_block_is_marked); `dlm serve` blocks run against a server that
the test starts with the documented command (port 8000 replaced by a free one).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import start_server

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```", re.S | re.M)
MARK = re.compile(r"<!-- test: (fast|slow|skip|output)(?::\s*(.*?))? -->\s*$")
COMMAND = re.compile(r"^(\$ )?([A-Z_]+=\S* )*(dlm|curl|make|python -m dlm)\b", re.M)


@dataclass
class Block:
    doc: Path
    line: int  # of the opening fence
    text: str
    mark: str | None  # fast | slow | skip | output (what the python block above it prints) | None
    why: str = ""
    lang: str = ""
    output: str | None = None  # a python block's: the next block, marked output

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def blocks() -> list[Block]:
    out = []
    for doc in DOCS:
        text = doc.read_text()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            above = text[:m.start()].rstrip("\n").rpartition("\n")[2]
            mark = MARK.search(above)
            out.append(Block(doc, line, m.group(2), mark.group(1) if mark else None,
                             (mark.group(2) or "") if mark else "", m.group(1).strip()))
    for a, b in zip(out, out[1:]):
        if b.mark == "output" and a.doc == b.doc:
            a.output = b.text
    return out


def session(text: str) -> list[tuple[str, str]]:
    """A block's `$ ` commands with their expected output; a command goes on over a line ending in a backslash
    and over indented lines that follow it."""
    steps: list[list[str]] = []
    cont = False
    for line in text.splitlines():
        if line.startswith("$ "):
            steps.append([line[2:], ""])
            cont = line.endswith("\\")
        elif steps and (cont or (line[:1].isspace() and not steps[-1][1])):
            steps[-1][0] += "\n" + line
            cont = line.endswith("\\")
        elif steps:
            steps[-1][1] += line + "\n"
            cont = False
    return [(c, o) for c, o in steps]


# wall-clock figures and server ids: any value
_VOLATILE = [
    (re.compile(r'("(?:seconds|wall_seconds|tokens_per_second|ttft|queued_seconds|draft_seconds|verify_seconds|'
                r'prefill_seconds)": ?)-?[\d.]+(?:e-?\d+)?'), r"\1~"),
    (re.compile(r"('(?:seconds|tokens_per_second|ttft|queued_seconds|draft_seconds|verify_seconds)': )"
                r"-?[\d.]+(?:e-?\d+)?"), r"\1~"),
    (re.compile(r"[\d,]+(?:\.\d+)? tok/s"), "~ tok/s"),
    (re.compile(r"\b(in|took) [\d.]+ s\b"), r"\1 ~ s"),
    (re.compile(r'"id":"(?:chat)?cmpl-[0-9a-f]+"'), '"id":~'),
    (re.compile(r'"created":\d+'), '"created":~'),
]


def normal(text: str) -> str:
    for pattern, repl in _VOLATILE:
        text = pattern.sub(repl, text)
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


_FLOAT = re.compile(r"-?\d+\.\d{4,}(?:e-?\d+)?")  # a measured figure (a loss, an entropy, a log-probability)


def same(expected: str, got: str) -> bool:
    """Text and counts exactly; figures of 4+ decimals to 1e-5 relative (float sums differ in the last digits across
    CPUs and BLAS builds); `...` in expected stands for any text."""
    want, have = normal(expected), normal(got)
    split = re.compile(f"({_FLOAT.pattern})")
    pattern = ".*?".join("".join(f"({_FLOAT.pattern})" if i % 2 else re.escape(piece)
                                 for i, piece in enumerate(split.split(part))) for part in want.split("..."))
    m = re.fullmatch(pattern, have, re.S)
    floats = [float(x) for x in _FLOAT.findall(want)]
    return m is not None and all(abs(float(g) - w) <= 1e-5 * max(abs(w), 1e-3) for g, w in zip(m.groups(), floats))


def shell(tmp: Path, port: int | None = None) -> dict:
    bin_dir = tmp / ".bin"
    bin_dir.mkdir(exist_ok=True)
    dlm = bin_dir / "dlm"
    dlm.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m dlm "$@"\n')
    dlm.chmod(0o755)
    for name in ("checkpoints", "recipes"):
        if not (tmp / name).exists():
            (tmp / name).symlink_to(ROOT / name)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT), "COLUMNS": "100",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "NO_COLOR": "1", "TERM": "dumb"}


def run_block(block: Block, tmp: Path, port: int | None = None) -> None:
    env = shell(tmp)
    steps = session(block.text)

    def fix(cmd: str) -> str:
        return cmd.replace("127.0.0.1:8000", f"127.0.0.1:{port}") if port else cmd

    if not steps:
        argv = [sys.executable, "-c"] if block.lang == "python" else ["bash", "-e", "-c"]
        p = subprocess.run([*argv, fix(block.text)], cwd=tmp, env=env, capture_output=True, text=True, timeout=1800)
        assert p.returncode == 0, f"{block.name}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        if block.output is not None:
            assert same(block.output, p.stdout), f"{block.name} printed\n{p.stdout}\nthe doc shows\n{block.output}"
        return
    for cmd, want in steps:
        if cmd.startswith("dlm serve"):
            continue  # (the server the fixture started)
        p = subprocess.run(["bash", "-c", fix(cmd)], cwd=tmp, env=env, capture_output=True, text=True, timeout=1800)
        got = p.stdout + p.stderr
        if want.strip():
            assert same(want, got), f"{block.name}: `{cmd}` printed\n{got}\nthe doc shows\n{want}"
        else:
            assert p.returncode == 0, f"{block.name}: `{cmd}` exit {p.returncode}\n{got[-3000:]}"


def _serve_command(block: Block) -> list[str] | None:
    """The `dlm serve` arguments a block runs against: its own command's, else (a block that calls 127.0.0.1:8000)
    the first `dlm serve` command of its doc."""
    found = re.search(r"^(?:\$ )?dlm serve ((?:.*\\\n)*.*)$", block.text, re.M)
    if found:
        return found.group(1).replace("\\\n", " ").split()
    if "127.0.0.1:8000" in block.text:
        return next((args for b in blocks() if b.doc == block.doc and b is not block and "127.0.0.1:8000" not in b.text
                     for args in [_serve_command(b)] if args), None)
    return None


def _by(mark: str) -> list[Block]:
    return [b for b in blocks() if b.mark == mark]


def test_every_command_block_is_marked():
    unmarked = [b.name for b in blocks() if b.mark is None and COMMAND.search(b.text)]
    assert not unmarked, f"command blocks without <!-- test: fast|slow|skip: why --> above them: {unmarked}"
    assert all(b.why for b in _by("skip")), [b.name for b in _by("skip") if not b.why]


def test_commands_pass_what_they_mean():
    """A newline inside double quotes is two characters to bash (a backslash and an n): the docs write $'...'."""
    for b in blocks():
        for line in b.text.splitlines():
            cmd = line.removeprefix("$ ")
            if re.match(r"([A-Z_]+=\S* )*dlm ", cmd):
                for quoted in re.findall(r'(?<![$\\])"((?:[^"\\]|\\.)*)"', cmd):
                    assert "\\n" not in quoted, f"{b.name}: {cmd}"


def test_the_runner_compares_what_it_should():
    assert same('{"text": "a", "seconds": 0.1, "tokens_per_second": 10.0}',
                '{"text": "a", "seconds": 2.5, "tokens_per_second": 3.25}')
    assert not same('{"text": "a", "seconds": 0.1}', '{"text": "b", "seconds": 0.1}')
    assert not same('{"forwards": 26}', '{"forwards": 22}')
    assert same('{... "forwards": 26, ...}', '{"text": "x", "forwards": 26, "tau": 1.2}')
    assert same('{"loss": 2.111851204009283}', '{"loss": 2.1118512}') and not same('{"loss": 2.1118}', '{"loss": 2.1119}')
    assert same("8 tokens, 8 forwards (1.00 tok/forward), 90.2 tok/s", "8 tokens, 8 forwards (1.00 tok/forward), 3.5 tok/s")
    assert session("$ dlm a \\\n    --b\nout\n$ dlm c\n") == [("dlm a \\\n    --b", "out\n"), ("dlm c", "")]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The servers the docs' `dlm serve` commands start, one per distinct command: {command: port}."""
    procs, ports = [], {}
    tmp = tmp_path_factory.mktemp("docs-serve")
    env = shell(tmp)
    yield lambda args: ports.get(tuple(args)) or _start(args, tmp, env, procs, ports)
    for p in procs:
        p.send_signal(signal.SIGINT)
        p.wait(timeout=30)


def _start(args: list[str], tmp: Path, env: dict, procs: list, ports: dict) -> int:
    p, base = start_server(args, env=env, cwd=tmp)
    procs.append(p)
    port = int(base.rpartition(":")[2])
    ports[tuple(args)] = port
    return port


def _run(block: Block, tmp_path: Path, served) -> None:
    args = _serve_command(block)
    run_block(block, tmp_path, served(args) if args else None)


@pytest.mark.parametrize("block", _by("fast"), ids=lambda b: b.name)
def test_fast_doc_block(block, tmp_path, served):
    _run(block, tmp_path, served)


@pytest.mark.slow
@pytest.mark.parametrize("block", _by("slow"), ids=lambda b: b.name)
def test_slow_doc_block(block, tmp_path, served):
    _run(block, tmp_path, served)
