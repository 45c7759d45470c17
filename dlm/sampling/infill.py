"""Turning a text request into a Prompt: plain continuation, infilling, or a template.

Three ways to ask:
- plain text: continue it for max_new_tokens tokens (Prompt.canvas is None);
- a prefix and a suffix (`--prompt PREFIX --suffix SUFFIX`): the middle has max_new_tokens
  positions to generate; the suffix is pinned after it;
- a template: text with fill markers. `<fill>` stands for `fill_length` positions; `<fill:N>`
  for exactly N. Everything else is pinned. The text before the first marker is the prefix.

Pinned positions are never re-noised or re-masked by a sampler, so the suffix and the template's
fixed text come out byte-exact.
"""

from __future__ import annotations

import re

from dlm.errors import DlmError
from dlm.sampling.common import Prompt
from dlm.tokenizer import Tokenizer

FILL_RE = re.compile(r"<fill(?::(\d+))?>")


def has_markers(text: str) -> bool:
    return FILL_RE.search(text) is not None


def parse_template(tok: Tokenizer, text: str, fill_length: int) -> Prompt:
    if fill_length <= 0:
        raise DlmError(f"--fill-length must be > 0, got {fill_length}")
    parts = FILL_RE.split(text)  # text, n, text, n, ..., text
    prefix = tok.lead_ids + tok.encode(parts[0], specials=False)  # what the tokenizer puts before a text (<bos>)
    canvas: list[int | None] = []
    for i in range(1, len(parts), 2):
        n = int(parts[i]) if parts[i] else fill_length
        if n <= 0:
            raise DlmError(f"template: <fill:{n}> must ask for at least one token")
        canvas.extend([None] * n)
        canvas.extend(tok.encode(parts[i + 1], specials=False))
    return Prompt(prefix, canvas)


def infill_prompt(tok: Tokenizer, prefix: str, suffix: str, middle: int) -> Prompt:
    if middle <= 0:
        raise DlmError(f"--max-new-tokens (the middle's length) must be > 0 to leave room to fill, got {middle}")
    return Prompt(tok.lead_ids + tok.encode(prefix, specials=False),
                  [None] * middle + tok.encode(suffix, specials=False))


def encode_prompt(tok: Tokenizer, text: str, suffix: str | None = None, max_new_tokens: int = 128,
                  fill_length: int = 16) -> Prompt:
    """The Prompt a text request describes (continuation, infilling with a suffix, or a template)."""
    if suffix is not None:
        if has_markers(text):
            raise DlmError("--suffix cannot be combined with <fill> markers in --prompt")
        return infill_prompt(tok, text, suffix, max_new_tokens)
    if has_markers(text):
        return parse_template(tok, text, fill_length)
    return Prompt(tok.encode(text))


def filled_pieces(tok: Tokenizer, prompt: Prompt, tokens: list[int]) -> list[tuple[str, bool]]:
    """A template's canvas as it came out: its stretches in order, (text, True) for a filled hole and (text, False)
    for pinned text, each decoded on its own (a pinned stretch was encoded on its own: its text comes back
    byte-exact). tokens: the row's new tokens (the canvas, holes filled)."""
    pieces: list[tuple[str, bool]] = []
    canvas = prompt.canvas or []
    start = 0
    for i in range(1, len(canvas) + 1):
        if i == len(canvas) or (canvas[i] is None) != (canvas[start] is None):
            ids = tokens[start:i]
            if ids:
                pieces.append((tok.decode(ids), canvas[start] is None))
            start = i
    return pieces
