"""Execution-based code generation (HumanEval, MBPP) and the infilling protocol of Bavarian et al. (2022).

`--task code --data FILE.jsonl` reads problems in either public layout, one JSON object a line:
- HumanEval: task_id, prompt (signature + docstring), test (defines `check(candidate)`), entry_point,
  canonical_solution (optional here; the infilling task needs it);
- MBPP: task_id, text (the description), test_list (assert lines), test_setup_code (optional), code
  (the reference solution, optional).
The model continues the prompt (MBPP's prompt: the description and the first test in a docstring, as
in the Codex-style zero-shot prompt); the completion is cut at the first line that starts a new top-level
statement (`\\ndef`, `\\nclass`, `\\nif`, `\\nprint`, `\\n#`: the Codex paper's stop sequences) and the
program (prompt + completion + tests) runs contained (dlm.sandbox: namespaces or a fresh uid, limits): it
passes when its tests ran to the end. Running model-written code is opt-in: `--allow-code-execution` or
DLM_ALLOW_CODE_EXECUTION=1 (`dlm.sandbox.allowed`, read before torch loads).

pass@k (Chen et al. 2021): with `--samples N` each problem is sampled N times (seeds --seed .. --seed+N-1;
use --temperature > 0, greedy gives N equal samples) and pass@k = mean over problems of
1 - C(N - c, k) / C(N, k), c the samples that pass, for every k in (1, 5, 10, 100) up to N.

`--task code-infill` (HumanEval files with canonical_solution): Bavarian et al.'s single-line
(`--span line`: one non-blank line of the canonical solution removed) and multi-line (`--span lines`: 2-5
consecutive lines) infilling. The model gets the prompt and the solution around the hole (AR with FIM
markers, diffusion with the suffix pinned, as `--task infill`), and the filled program runs the tests.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from dlm import sandbox
from dlm.errors import DlmError
from dlm.sampling.common import Prompt
from dlm.tasks import infill
from dlm.tasks.common import Case, Request, check_n, pick, rng_for

NAME = "code"
METRICS = ("pass_at_1",)
PRIMARY = "pass_at_1"
PASS_AT_K = (1, 5, 10, 100)
STOPS = ("\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#")
_SAID: list[str] = []


def run_program(source: str) -> sandbox.Outcome:
    """One program through the runner; the first one says on stderr which isolation the programs get."""
    try:
        if not _SAID:
            _SAID.append(sandbox.describe())
            print(_SAID[0], file=sys.stderr)
        return sandbox.run(source)
    except sandbox.SandboxError as e:
        raise DlmError(str(e)) from None


def read_problems(data: str | None) -> list[dict[str, Any]]:
    """The problems of a HumanEval- or MBPP-layout JSONL file (bad input: one DlmError line)."""
    if data is None:
        raise DlmError("--task code needs --data FILE.jsonl (HumanEval or MBPP layout)")
    p = Path(data).expanduser()
    if p.is_dir():
        raise DlmError(f"--data {data} is a folder: --task code reads one .jsonl file")
    if not p.is_file():
        raise DlmError(f"--data: no such file: {data}")
    out = []
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise DlmError(f"--data {data}: not UTF-8 text") from None
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DlmError(f"--data {data}: line {i} is not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise DlmError(f"--data {data}: line {i} is not a JSON object")
        if {"prompt", "test", "entry_point"} <= obj.keys():
            obj["layout"] = "humaneval"
        elif {"text", "test_list"} <= obj.keys() and isinstance(obj["test_list"], list):
            obj["layout"] = "mbpp"
        else:
            raise DlmError(f"--data {data}: line {i} is neither HumanEval (prompt, test, entry_point) nor MBPP "
                           f"(text, test_list) layout; keys: {sorted(obj)}")
        obj.setdefault("task_id", f"line {i}")
        out.append(obj)
    if not out:
        raise DlmError(f"--data {data}: no problem in the file")
    return out


def prompt_of(prob: dict[str, Any]) -> str:
    if prob["layout"] == "humaneval":
        return prob["prompt"]
    return f'"""\n{prob["text"].strip()}\n{prob["test_list"][0]}\n"""\n'


def tests_of(prob: dict[str, Any]) -> str:
    if prob["layout"] == "humaneval":
        return f"\n\n{prob['test']}\n\ncheck({prob['entry_point']})\n"
    return "\n\n" + "\n".join(prob["test_list"]) + "\n"


def truncate(completion: str) -> str:
    """The completion up to the first stop sequence (a new top-level statement)."""
    cut = min((i for i in (completion.find(s) for s in STOPS) if i >= 0), default=len(completion))
    return completion[:cut]


def program(prob: dict[str, Any], body: str) -> str:
    """The program that runs: setup code (MBPP), the prompt's code and the body, then the tests."""
    setup = (prob.get("test_setup_code") or "") if prob["layout"] == "mbpp" else ""
    return (setup + "\n" if setup else "") + body + tests_of(prob)


def cases(data: str | None, n: int, seed: int, span: str = "line", split: str = "test") -> list[Case]:
    check_n(n)
    probs = read_problems(data)
    chosen = probs if n >= len(probs) else pick(rng_for(NAME, seed), probs, n)
    return [Case(str(p["task_id"]), prompt_of(p), p.get("canonical_solution") or p.get("code") or "", "",
                 {"problem": p}) for p in chosen]


def default_new_tokens(span: str) -> int:
    return 256


def request(case: Case, ck, cfg, style: str, context: int) -> Request:
    new = cfg.max_new_tokens
    ids = ck.tokenizer.encode_tail(case.prefix, max(1, context - new))
    return Request(Prompt(ids), new, lambda res: res.text)


def score(case: Case, answer: str) -> dict[str, float]:
    prob = case.info["problem"]
    out = run_program(program(prob, case.prefix + truncate(answer)))
    return {"pass_at_1": float(out.passed)}


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of Chen et al. (2021): 1 - C(n - c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_ks(rows: list[dict[str, Any]]) -> dict[str, float]:
    """pass@k for every k in PASS_AT_K up to the samples per problem (rows: one per sample, by case name)."""
    by: dict[str, list[float]] = {}
    for r in rows:
        by.setdefault(r["case"], []).append(r["pass_at_1"])
    n = min(len(v) for v in by.values())
    return {f"pass_at_{k}": sum(pass_at_k(len(v), int(sum(v)), k) for v in by.values()) / len(by)
            for k in PASS_AT_K if k <= n}


class Infill:
    """`--task code-infill`: Bavarian et al.'s single-line / multi-line infilling on HumanEval problems."""

    NAME = "code-infill"
    METRICS = ("pass_at_1", "exact_match")
    PRIMARY = "pass_at_1"
    PASS_AT_K = PASS_AT_K

    @staticmethod
    def cases(data: str | None, n: int, seed: int, span: str = "line", split: str = "test") -> list[Case]:
        check_n(n)
        if span not in ("line", "lines"):
            raise DlmError(f"--span must be line or lines, got {span!r}")
        spots = []
        for p in read_problems(data):
            sol = p.get("canonical_solution")
            if p["layout"] != "humaneval" or not sol:
                continue
            lines = sol.rstrip("\n").split("\n")
            code = [i for i, ln in enumerate(lines) if ln.strip()]
            if span == "line":
                spots += [(p, lines, i, 1) for i in code]
            else:
                spots += [(p, lines, i, m) for i in code for m in range(2, 6) if i + m <= len(lines)
                          and lines[i + m - 1].strip()]
        if not spots:
            raise DlmError(f"--data {data}: no HumanEval problem with a canonical_solution to cut a hole in")
        out = []
        for p, lines, i, m in pick(rng_for("code-infill", seed), spots, n):
            prefix = (p["prompt"] + "\n".join(lines[:i])).rstrip("\n")  # the cut sits before a newline
            middle = "\n".join(lines[i:i + m])
            suffix = "\n" + "\n".join(lines[i + m:]) + "\n"
            out.append(Case(f"{p['task_id']}:{i + 1}", prefix, middle, suffix,
                            {"problem": p, "lines": m, "middle": "\n" + middle}))
        return out

    @staticmethod
    def default_new_tokens(span: str) -> int:
        return infill.default_new_tokens(span)

    @staticmethod
    def request(case: Case, ck, cfg, style: str, context: int) -> Request:
        return infill.request(case, ck, cfg, style, context)

    @staticmethod
    def score(case: Case, answer: str) -> dict[str, float]:
        middle = infill.cut(answer, case.info["lines"])
        out = run_program(program(case.info["problem"], case.prefix + "\n" + middle + case.suffix))
        return {"pass_at_1": float(out.passed), "exact_match": float(middle.strip() == case.target.strip())}
