"""The task metrics (docs/tasks.md; definitions in DESIGN.md).

exact_match      the two strings equal after whitespace normalisation (runs of whitespace -> one space,
                 ends stripped), as in CodeXGLUE's line-level completion
edit_similarity  1 - Levenshtein(a, b) / max(len(a), len(b)) on the normalised strings (1.0 when both
                 are empty): CodeXGLUE's edit similarity, on a 0-1 scale
"""

from __future__ import annotations


def normalize(s: str) -> str:
    return " ".join(s.split())


def levenshtein(a: str, b: str) -> int:
    """Edit distance (insertions, deletions, substitutions of one character each)."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def exact_match(pred: str, target: str) -> float:
    return float(normalize(pred) == normalize(target))


def edit_similarity(pred: str, target: str) -> float:
    a, b = normalize(pred), normalize(target)
    if not a and not b:
        return 1.0
    return 1.0 - levenshtein(a, b) / max(len(a), len(b))


def text_scores(pred: str, target: str) -> dict[str, float]:
    return {"exact_match": exact_match(pred, target), "edit_similarity": edit_similarity(pred, target)}
