"""Infilling and templates: which canvas positions are pinned and which are to be generated.

Two ways to ask for it:
- a prefix and a suffix (`--prompt PREFIX --suffix SUFFIX`): the middle has `fill_length`
  positions to generate; the suffix is pinned after it;
- a template: text with fill markers. `<fill>` stands for `fill_length` positions; `<fill:N>`
  for exactly N. Everything else is pinned. The text before the first marker is the prefix.

Pinned positions are never re-noised or re-masked by a sampler, so the suffix and the template's
fixed text come out byte-exact.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dlm.errors import DlmError
from dlm.tokenizer import Tokenizer

FILL_RE = re.compile(r"<fill(?::(\d+))?>")


@dataclass
class Template:
    prefix: list[int]  # the prompt (goes into the cache; may be empty)
    canvas: list[int | None]  # None: generate here; int: pinned token

    @property
    def holes(self) -> int:
        return sum(1 for c in self.canvas if c is None)

    def fill(self, tokens: list[int]) -> list[int]:
        """The canvas with its holes filled, in order, from `tokens` (len == holes)."""
        it = iter(tokens)
        return [next(it) if c is None else c for c in self.canvas]


def has_markers(text: str) -> bool:
    return FILL_RE.search(text) is not None


def parse_template(tok: Tokenizer, text: str, fill_length: int) -> Template:
    if fill_length <= 0:
        raise DlmError(f"--fill-length must be > 0, got {fill_length}")
    parts = FILL_RE.split(text)  # text, n, text, n, ..., text
    prefix = tok.encode(parts[0])
    canvas: list[int | None] = []
    for i in range(1, len(parts), 2):
        n = int(parts[i]) if parts[i] else fill_length
        if n <= 0:
            raise DlmError(f"template: <fill:{n}> must ask for at least one token")
        canvas.extend([None] * n)
        canvas.extend(tok.encode(parts[i + 1]))
    if not any(c is None for c in canvas):
        raise DlmError("template has no <fill> marker")
    return Template(prefix, canvas)


def infill_template(tok: Tokenizer, prefix: str, suffix: str, fill_length: int) -> Template:
    if fill_length <= 0:
        raise DlmError(f"--max-new-tokens (the middle's length) must be > 0 to leave room to fill, got {fill_length}")
    return Template(tok.encode(prefix), [None] * fill_length + tok.encode(suffix))


def build_template(tok: Tokenizer, prompt: str, suffix: str | None, fill_length: int) -> Template | None:
    """The template a request describes, or None for plain continuation."""
    if suffix is not None:
        if has_markers(prompt):
            raise DlmError("--suffix cannot be combined with <fill> markers in --prompt")
        return infill_template(tok, prompt, suffix, fill_length)
    if has_markers(prompt):
        return parse_template(tok, prompt, fill_length)
    return None


def check_fits(t: Template, context: int) -> None:
    need = len(t.prefix) + len(t.canvas)
    if need > context:
        raise DlmError(f"prompt + fill + suffix is {need} tokens, more than the model's context of {context}: "
                       "no room to fill")
