"""Line-level code completion (CodeXGLUE's line-level setting).

A case: a held-out source file cut at a random line start; the model gets everything before the cut
(truncated from the left to fit its window) and its answer, the next line it writes, is scored against
the file's (exact_match, edit_similarity; dlm.tasks.metrics). Blank target lines are skipped. Every
paradigm continues the same prompt tokens.

The prompt stops before the newline that ends the last line, and the answer is the generated text
between the first newline and the next: byte-level BPE merges a newline with the indentation after it
(`"\n        "` is one token), so a prompt that ended with a bare newline token would end where no
training text ever does, and the models answer with a blank line.
"""

from __future__ import annotations

from dlm.sampling.common import Prompt
from dlm.tasks.common import Case, Request, check_n, pick, rng_for, source_files
from dlm.tasks.metrics import text_scores

NAME = "complete"
METRICS = ("exact_match", "edit_similarity")
PRIMARY = "edit_similarity"  # the quality axis of `dlm bench --task`


def cases(data: str | None, n: int, seed: int, span: str = "line", split: str = "test") -> list[Case]:
    check_n(n)
    files = source_files(data, split)
    spots = []
    for f, src in enumerate(files):
        lines = src.text.splitlines(keepends=True)
        seen_code = False
        for i, line in enumerate(lines):
            if seen_code and line.strip():
                spots.append((f, i))
            seen_code = seen_code or bool(line.strip())
    if not spots:
        from dlm.errors import DlmError

        raise DlmError(f"--data {data}: no line to complete (a case needs a non-blank line after some text)")
    out = []
    for f, i in pick(rng_for(NAME, seed), spots, n):
        lines = files[f].text.splitlines(keepends=True)
        prefix = "".join(lines[:i])
        out.append(Case(f"{files[f].name}:{i + 1}", prefix[:-1], lines[i].rstrip("\r\n")))
    return out


def default_new_tokens(span: str) -> int:
    """--max-new-tokens when not given: a line of stdlib code is ~10 BPE tokens; its newline comes within 32."""
    return 32


def next_line(text: str) -> str:
    """The line that starts after the first newline of a generation ('' when there is none)."""
    parts = text.split("\n")
    return parts[1].rstrip("\r") if len(parts) > 1 else ""


def request(case: Case, ck, cfg, style: str, context: int) -> Request:
    new = cfg.max_new_tokens
    ids = ck.tokenizer.encode_tail(case.prefix, max(1, context - new))
    return Request(Prompt(ids), new, lambda res: next_line(res.text))


def score(case: Case, answer: str) -> dict[str, float]:
    return text_scores(answer, case.target)
