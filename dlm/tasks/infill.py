"""Fill-in-the-middle: one line (`--span line`) or 1-5 consecutive lines (`--span lines`) of a held-out
source file are removed; the model gets the prefix and the suffix and its middle is scored against the
removed text (exact_match, edit_similarity, whitespace-normalised).

How each paradigm is asked (the same prefix and suffix tokens for all):
- diffusion (mdlm, usdm) infills natively: Prompt(prefix, [hole] * k + suffix), the suffix pinned.
  k = the true middle's token length + MARGIN tokens (an oracle length, as in LLaDA's and DreamOn's
  infilling evaluations, plus room: the model is not told the exact length). The answer is the text of
  the k hole positions: the generated middle ends where the pinned suffix begins.
- AR (and speculative decoding) through the fill-in-the-middle format it is trained with by
  `--fim-rate` (Bavarian et al. 2022): <fim_prefix> prefix <fim_suffix> suffix <fim_middle>, then the
  middle up to <eos> (at most --max-new-tokens). An AR model trained without FIM (the shipped ar-small)
  has never seen the markers: it infills poorly, and that is what the task reports.
Both answers are cut alike before scoring: `line` keeps the first line of the middle, `lines` as many
lines as the removed middle has (the truth's line count is the one thing both are told).
The cuts sit before newlines, not after (prefix + "\n" + middle lines, then "\n" + suffix): byte-level
BPE merges a newline with the indentation that follows it, so every part starts where a token does
(dlm.tasks.complete says more); one leading newline of an answer is dropped before the cut.
Prefix and suffix are truncated (prefix from the left, suffix from the right) so that prefix + room +
suffix fit the model's window; the suffix gets at most a third of it.
"""

from __future__ import annotations

from dlm.data.tokens import fim_prompt_ids
from dlm.errors import DlmError
from dlm.sampling.common import Prompt
from dlm.tasks.common import Case, Request, check_n, pick, rng_for, source_files
from dlm.tasks.metrics import text_scores

NAME = "infill"
METRICS = ("exact_match", "edit_similarity")
PRIMARY = "edit_similarity"  # the quality axis of `dlm bench --task`
MARGIN = 4  # hole positions beyond the true middle's length (diffusion)
SPANS = ("line", "lines")


def cases(data: str | None, n: int, seed: int, span: str = "line", split: str = "test") -> list[Case]:
    if span not in SPANS:
        raise DlmError(f"--span must be one of {list(SPANS)}, got {span!r}")
    check_n(n)
    files = source_files(data, split)
    spots = []
    for f, src in enumerate(files):
        lines = src.text.splitlines(keepends=True)
        code = [i for i, ln in enumerate(lines) if ln.strip()]
        spots += [(f, i) for i in code if code[0] < i < code[-1]]  # some text before and some after
    if not spots:
        raise DlmError(f"--data {data}: no line to infill (a case needs a non-blank line with text before and after)")
    rng = rng_for(f"{NAME}-{span}", seed)
    out = []
    for f, i in pick(rng, spots, n):
        lines = files[f].text.splitlines(keepends=True)
        m = 1
        if span == "lines":  # 1-5 lines, some text left after them
            m = rng.randint(1, max(k for k in range(1, 6) if any(ln.strip() for ln in lines[i + k:]) or k == 1))
        middle = "".join(lines[i:i + m])  # ends with a newline: text follows
        prefix, suffix = "".join(lines[:i]), "".join(lines[i + m:])
        out.append(Case(f"{files[f].name}:{i + 1}", prefix[:-1], middle.rstrip("\r\n"), "\n" + suffix,
                        {"lines": m, "middle": "\n" + middle[:-1]}))
    return out


def request(case: Case, ck, cfg, style: str, context: int) -> Request:
    tok = ck.tokenizer
    new = cfg.max_new_tokens
    room = context - new - 3  # the three FIM markers of the AR form
    if room < 2:
        raise DlmError(f"--max-new-tokens {new}: no room left for a prefix and a suffix in a window of {context}")
    suf_ids = tok.encode(case.suffix, specials=False)[: room // 3]
    pre_ids = tok.encode_tail(case.prefix, room - len(suf_ids))
    if style == "ar":
        return Request(Prompt(fim_prompt_ids(tok, pre_ids, suf_ids)), new, lambda res: res.text)
    k = max(1, min(new, len(tok.encode(case.info["middle"], specials=False)) + MARGIN))
    return Request(Prompt(pre_ids, [None] * k + suf_ids), k,
                   lambda res: tok.decode([t for t in res.tokens[0][:k]]))


def default_new_tokens(span: str) -> int:
    """--max-new-tokens when not given: room for one line (~10 BPE tokens in the stdlib), or for five."""
    return 32 if span == "line" else 128


def cut(answer: str, lines: int) -> str:
    """The first `lines` lines of an answer, after one leading newline."""
    if answer.startswith("\n"):
        answer = answer[1:]
    return "\n".join(answer.split("\n")[:lines])


def score(case: Case, answer: str) -> dict[str, float]:
    return text_scores(cut(answer, case.info["lines"]), case.target)
