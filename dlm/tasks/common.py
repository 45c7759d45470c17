"""What the tasks share: a case, the source files cases are cut from, how a case becomes a request for a
paradigm, and running a method over the cases (the statistics summed the way DESIGN.md defines them).

A task module (complete, infill, sudoku) provides:
    NAME, METRICS, PRIMARY           its name, the metrics it averages, the one a Pareto plot draws
    default_new_tokens(span)         --max-new-tokens when not given
    cases(data, n, seed, span)       the cases, reproducible for (data, n, seed)
    request(case, ck, cfg, style, context) -> Request   what the sampler is asked
    score(case, answer) -> dict      the metrics of one answer
`style` is how the checkpoint generates: "ar" (AR and speculative decoding: left to right) or
"diffusion" (mdlm, usdm: a canvas with holes and pinned tokens).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from dlm.errors import DlmError
from dlm.sampling.common import Prompt, Result


@dataclass
class Case:
    name: str  # where it was cut: file:line
    prefix: str  # what comes before (complete, infill), the quiz (sudoku)
    target: str  # what the answer is scored against
    suffix: str = ""  # infill: what comes after
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Request:
    prompt: Prompt
    max_new_tokens: int
    read: Callable[[Result], str]  # the answer in a sampler's result


@dataclass
class Source:
    name: str
    text: str


def source_files(data: str | None, split: str = "test") -> list[Source]:
    """Held-out source files: the stdlib corpus's test split (data None; `split` "val" for tuning), a file, or
    every text file of a folder (all of it: the user's own data is held out by definition). Bad data: one
    DlmError line."""
    from dlm.data.corpus import Corpus
    from dlm.data.csvtask import read_text_strict

    if data is None:
        docs = Corpus("stdlib").split(split)
    else:
        p = Path(data).expanduser()
        if not p.exists():
            raise DlmError(f"--data: no such file or directory: {data}")
        if p.is_file():
            text = read_text_strict(p)
            if not text.strip():
                raise DlmError(f"--data {data}: the file is empty")
            return [Source(p.name, text)]
        docs = Corpus(str(p)).documents
    return [Source(d.name, d.text) for d in sorted(docs, key=lambda d: d.name)]


def pick(rng, items: list, n: int) -> list:
    """n items without replacement (all of them when fewer), in a reproducible order."""
    return rng.sample(items, min(n, len(items)))


def rng_for(task: str, seed: int):
    import random

    return random.Random(f"{task}:{seed}")


def style_of(ck, drafter: Any, cfg) -> str:
    """ar: AR targets, speculative decoding and a joint model's AR and self-speculation modes (left to right);
    diffusion: mdlm, usdm and a joint model's mdlm samplers (a canvas)."""
    if drafter is not None or cfg.draft or ck.objective == "ar":
        return "ar"
    if ck.objective == "joint" and (cfg.sampler in ("auto", "ar") or cfg.sampler.startswith("self-spec")):
        return "ar"
    return "diffusion"


def window(ck, model) -> int:
    """Tokens a prompt and its generation may span: the training window (the model's context at most)."""
    seq = int(ck.config.get("train", {}).get("seq_len", 0) or 0)
    return min(model.cfg.max_seq_len, seq) if seq else model.cfg.max_seq_len


MAX_DRAWS = 1024  # --samples, --tries, --best-of: draws of one case at most


def check_draws(option: str, n: int) -> None:
    """An option that draws a case n times: 1 <= n <= MAX_DRAWS."""
    if not 1 <= n <= MAX_DRAWS:
        raise DlmError(f"{option} must be in [1, {MAX_DRAWS}], got {n}")


def check_n(n: int) -> None:
    if n <= 0:
        raise DlmError(f"--n must be > 0, got {n}")


def doc_seed(name: str) -> int:
    return int.from_bytes(hashlib.sha1(name.encode()).digest()[:4], "big")
