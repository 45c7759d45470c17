"""Task corpora in CSV: sudoku puzzles in the public layout, as training documents.

The layout of the public sets (Ye et al. 2024, the 1M Kaggle set): a header `quizzes,solutions`,
then one puzzle per row, 81 digits each, 0 = blank. Also read: the header spellings of other public
sets (`puzzle,solution`; `q,a` of Sudoku-Extreme, extra columns ignored) and `.` for a blank.

A puzzle becomes one document, QUIZ + SEP + SOLUTION (81 + 1 + 81 characters, quiz blanks as `0`):

    530070000600195000...=534678912672195348...

so a character tokenizer (`dlm train --tokenizer char`) gives exactly 163 tokens (164 with the
<eos> that ends each document: `--seq-len 164` puts one puzzle in each training window). The
objectives read only the answer after SEP (`--answer-sep`, '=' for a .csv corpus).
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from dlm.errors import DlmError

SEP = "="  # between a quiz and its solution in a document
CELLS = 81
QUIZ_COLUMNS = ("quizzes", "quiz", "puzzle", "puzzles", "q")
SOLUTION_COLUMNS = ("solutions", "solution", "a")


def pair_text(quiz: str, solution: str) -> str:
    """The training document of one puzzle."""
    return quiz + SEP + solution


def read_text_strict(path: Path, option: str = "--data") -> str:
    """A file's text; not UTF-8 is an error naming the file and the first bad byte."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DlmError(f"{option} {path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def _cells(value: str, what: str, where: str, blanks: bool) -> str:
    v = value.strip().replace(".", "0")
    if len(v) != CELLS or not v.isdigit() or not v.isascii():
        raise DlmError(f"{where}: {what} must be {CELLS} digits (0 or . = blank), got {value[:100]!r}")
    if not blanks and "0" in v:
        raise DlmError(f"{where}: a solution has no blanks, got {value[:100]!r}")
    return v


def rule_broken(solution: str) -> str | None:
    """The first row, column or box of a full grid that does not hold 1-9 once each (None: none)."""
    for kind, cells in (("row", lambda u, k: 9 * u + k), ("column", lambda u, k: u + 9 * k),
                        ("box", lambda u, k: 27 * (u // 3) + 3 * (u % 3) + 9 * (k // 3) + k % 3)):
        for u in range(9):
            if sorted(solution[cells(u, k)] for k in range(9)) != list("123456789"):
                return f"{kind} {u + 1} does not hold 1-9 once each"
    return None


def read_pairs(path: str | Path, option: str = "--data") -> list[tuple[str, str]]:
    """(quiz, solution) of every row of a sudoku CSV, checked: 81 digits each, the solution fills the quiz."""
    p = Path(path)
    if p.is_dir():
        raise DlmError(f"{option} {path} is a folder: give a CSV file (quizzes,solutions)")
    if not p.is_file():
        raise DlmError(f"{option}: no such file: {path}")
    text = read_text_strict(p, option)
    reader = csv.reader(io.StringIO(text))
    rows, lines = [], []
    try:
        for r in reader:
            if any(c.strip() for c in r):
                rows.append(r)
                lines.append(reader.line_num)
    except csv.Error as e:
        raise DlmError(f"{option} {path}: line {reader.line_num}: not a CSV row a puzzle fits in ({e})"[:300]) from None
    if not rows:
        raise DlmError(f"{option} {path}: empty (expected a header `quizzes,solutions` and one puzzle per row)")
    header = [h.strip().lower() for h in rows[0]]
    qi = next((header.index(n) for n in QUIZ_COLUMNS if n in header), None)
    si = next((header.index(n) for n in SOLUTION_COLUMNS if n in header), None)
    if qi is None or si is None:
        raise DlmError(f"{option} {path}: the header must name a quiz column ({'|'.join(QUIZ_COLUMNS)}) and a "
                       f"solution column ({'|'.join(SOLUTION_COLUMNS)}), got {rows[0][:6]}")
    pairs = []
    for n, r in zip(lines[1:], rows[1:]):
        where = f"{option} {path}: line {n}"
        if len(r) <= max(qi, si):
            raise DlmError(f"{where}: {len(r)} columns, expected at least {max(qi, si) + 1}")
        q, s = _cells(r[qi], "the quiz", where, True), _cells(r[si], "the solution", where, False)
        if any(a != "0" and a != b for a, b in zip(q, s)):
            raise DlmError(f"{where}: the solution contradicts a given digit of the quiz")
        broken = rule_broken(s)
        if broken:
            raise DlmError(f"{where}: the solution breaks the rules ({broken})")
        pairs.append((q, s))
    if not pairs:
        raise DlmError(f"{option} {path}: no puzzles after the header")
    return pairs


def write_pairs(path: str | Path, pairs: list[tuple[str, str]]) -> None:
    """The public layout, written under a temporary name and renamed into place."""
    import os

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    with open(tmp, "w", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(["quizzes", "solutions"])
        w.writerows(pairs)
    os.replace(tmp, p)
