"""`dlm eval --task code / code-infill`: programs run contained (dlm.sandbox), opt-in, pass@k, the public layouts."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dlm.errors import DlmError
from dlm.tasks import code
from dlm.sandbox import Limits, run

ROOT = Path(__file__).resolve().parents[1]
HUMANEVAL = [
    {"task_id": "T/0", "prompt": 'def add(a, b):\n    """Return a + b."""\n', "canonical_solution": "    c = a + b\n    return c\n",
     "test": "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(-1, 1) == 0\n",
     "entry_point": "add"},
    {"task_id": "T/1", "prompt": 'def double(xs):\n    """Double every item."""\n',
     "canonical_solution": "    out = []\n    for x in xs:\n        out.append(2 * x)\n\n    return out\n",
     "test": "def check(candidate):\n    assert candidate([1, 2]) == [2, 4]\n    assert candidate([]) == []\n",
     "entry_point": "double"},
]
MBPP = [{"task_id": 7, "text": "Write a function to add two numbers.", "code": "def add(a, b):\n    return a + b",
         "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"], "test_setup_code": "import math"}]


@pytest.fixture
def files(tmp_path):
    he, mb = tmp_path / "he.jsonl", tmp_path / "mbpp.jsonl"
    he.write_text("".join(json.dumps(p) + "\n" for p in HUMANEVAL))
    mb.write_text("".join(json.dumps(p) + "\n" for p in MBPP))
    return he, mb


def test_programs_run_in_a_child_process_with_limits(tmp_path):
    assert run("assert 1 + 1 == 2\n").passed
    bad = run("assert 1 + 1 == 3, 'wrong'\n")
    assert not bad.passed and bad.status == "failed" and "wrong" in bad.detail
    assert run("import sys\nsys.exit(3)\n").status == "failed"
    t0 = time.perf_counter()
    loop = run("while True:\n    pass\n", Limits(wall=1.0))
    assert loop.status == "timeout" and time.perf_counter() - t0 < 5
    # a child it spawns dies with it
    t0 = time.perf_counter()
    assert run("import subprocess, sys\nsubprocess.run([sys.executable, '-c', 'import time; time.sleep(30)'])\n",
               Limits(wall=1.0)).status == "timeout"
    assert time.perf_counter() - t0 < 5
    hog = run("x = bytearray(2 * 1024 ** 3)\n", Limits(memory_mb=256))
    assert not hog.passed and "MemoryError" in hog.detail
    # it runs in a fresh folder: what it writes lands there, not where dlm runs
    assert run("open('left.txt', 'w').write('x')\nimport os\nassert os.getcwd() != %r\n" % str(Path.cwd())).passed
    assert not (Path.cwd() / "left.txt").exists()
    # the environment is not inherited
    import os
    os.environ["DLM_SECRET_FOR_TEST"] = "1"
    try:
        assert run("import os\nassert 'DLM_SECRET_FOR_TEST' not in os.environ\n").passed
    finally:
        del os.environ["DLM_SECRET_FOR_TEST"]


def test_reference_solutions_pass_and_wrong_ones_fail(files):
    he, mb = files
    cases = code.cases(str(he), 10, 0)
    assert sorted(c.name for c in cases) == ["T/0", "T/1"]
    for c in cases:
        assert code.score(c, c.target) == {"pass_at_1": 1.0}
        assert code.score(c, "    return None\n") == {"pass_at_1": 0.0}
        # what follows a new top-level statement is cut (the Codex stop sequences)
        assert code.score(c, c.target + "\ndef helper():\n    raise SystemExit(1)\nhelper()\n") == {"pass_at_1": 1.0}
    (m,) = code.cases(str(mb), 1, 0)
    assert m.prefix.startswith('"""\nWrite a function') and "assert add(1, 2) == 3" in m.prefix
    assert code.score(m, "def add(a, b):\n    return a + b\n") == {"pass_at_1": 1.0}
    assert code.score(m, "def add(a, b):\n    return a - b\n") == {"pass_at_1": 0.0}


def test_pass_at_k_matches_the_subset_count():
    for n, c in [(5, 0), (5, 1), (5, 3), (6, 6), (10, 2)]:
        results = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(results, k))
            brute = sum(any(s) for s in subsets) / len(subsets)
            assert code.pass_at_k(n, c, k) == pytest.approx(brute)
    rows = [{"case": "a", "pass_at_1": x} for x in (1, 0, 0, 0, 0)] + [{"case": "b", "pass_at_1": 0}] * 5
    out = code.pass_at_ks(rows)
    assert set(out) == {"pass_at_1", "pass_at_5"}
    assert out["pass_at_1"] == pytest.approx(0.1) and out["pass_at_5"] == pytest.approx(0.5)


@pytest.mark.parametrize("span", ["line", "lines"])
def test_infilling_the_true_middle_passes(files, span):
    he, _ = files
    cases = code.Infill.cases(str(he), 100, 0, span)
    assert cases and all(c.info["lines"] == 1 for c in cases) == (span == "line")
    for c in cases:
        assert code.Infill.score(c, c.info["middle"]) == {"pass_at_1": 1.0, "exact_match": 1.0}
        wrong = "\n" + "\n".join("    raise ValueError" for _ in range(c.info["lines"]))
        assert code.Infill.score(c, wrong)["pass_at_1"] == 0.0


def test_bad_data_is_one_line(files, tmp_path):
    bad = tmp_path / "bad.jsonl"
    for text, match in [("{not json}\n", "line 1 is not JSON"), ('{"prompt": "x"}\n', "neither HumanEval"),
                        ("", "no problem"), ("[1, 2]\n", "not a JSON object")]:
        bad.write_text(text)
        with pytest.raises(DlmError, match=match):
            code.cases(str(bad), 1, 0)
    with pytest.raises(DlmError, match="needs --data"):
        code.cases(None, 1, 0)
    _, mb = files
    with pytest.raises(DlmError, match="canonical_solution"):
        code.Infill.cases(str(mb), 1, 0)


def test_cli_eval_code_on_a_shipped_model(files):
    he, _ = files
    cmd = [sys.executable, "-m", "dlm", "eval", "--model", str(ROOT / "checkpoints" / "ar-small"), "--task", "code",
           "--data", str(he), "--max-new-tokens", "16", "--samples", "2", "--temperature", "1", "--json",
           "--allow-code-execution"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("code execution isolation: ") == 1  # said once, on stderr
    res = json.loads(out.stdout)
    assert res["task"] == "code" and res["problems"] == 2 and res["n"] == 4
    assert 0.0 <= res["pass_at_1"] <= 1.0 and res["forwards"] > 0
    bad = subprocess.run(cmd[:9] + [str(he.parent / "missing.jsonl"), "--allow-code-execution"], capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode == 2 and "no such file" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("name", ["mdlm-small", "joint-small", "usdm-small"])
def test_eval_code_on_every_shipped_paradigm(files, name, capsys):
    """`dlm eval --task code` through each shipped reference's own sampler (the diffusion ones included)."""
    from dlm.cli import main

    he, _ = files
    assert main(["eval", "--model", str(ROOT / "checkpoints" / name), "--task", "code", "--data", str(he),
                 "--max-new-tokens", "8", "--json", "--allow-code-execution"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["problems"] == 2 and res["paradigm"] == name.split("-")[0] and 0.0 <= res["pass_at_1"] <= 1.0
    assert res["forwards"] > 0


def test_running_model_code_is_opt_in(files, monkeypatch):
    """Without --allow-code-execution (or DLM_ALLOW_CODE_EXECUTION=1): one line, exit 2, before any model loads."""
    he, _ = files
    monkeypatch.delenv("DLM_ALLOW_CODE_EXECUTION", raising=False)
    for task in ("code", "code-infill"):
        cmd = [sys.executable, "-m", "dlm", "eval", "--model", str(ROOT / "checkpoints" / "ar-small"), "--task", task,
               "--data", str(he), "--max-new-tokens", "4", "--n", "1"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert out.returncode == 2 and out.stdout == "" and "Traceback" not in out.stderr
        assert out.stderr.count("\n") == 1 and "--allow-code-execution" in out.stderr, out.stderr
    out = subprocess.run(cmd + ["--json"], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "DLM_ALLOW_CODE_EXECUTION": "1"})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["task"] == "code-infill" and "code execution isolation: " in out.stderr
