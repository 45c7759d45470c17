"""`dlm generate --show`: watch the text form.

`live(events, tokenizer, prompt)` consumes a sampler's event stream, draws it, and returns the
same `Result` as `drain`. In a terminal, each `Step` redraws the canvas in place (rich Live):
accepted/pinned tokens bright, noise (usdm) or masks (mdlm) dim, with the canvas number, the
step, the fixed count and the mean entropy. `Commit` events of a sampler without steps (AR,
speculative) stream as plain text. When stdout is not a terminal, every step prints one compact
line instead (noise as '·', masks as '░', newlines as '⏎'), so logs and pipes stay readable.
"""

from __future__ import annotations

import sys
from typing import Iterator

from rich.console import Console, Group
from rich.live import Live
from rich.text import Text

from dlm.sampling.common import Commit, Done, Event, Result, Step, before_eos, drain

NOISE_DOT, MASK_BLOCK, NEWLINE = "·", "░", "⏎"
TAIL_LINES = 8  # committed lines kept above the canvas in the terminal view


class View:
    """What has been committed per row, and the canvas of the latest step."""

    def __init__(self, tokenizer, prompts: list[str], mask_id: int | None = None):
        self.tok = tokenizer
        self.mask_id = mask_id if mask_id is not None else tokenizer.mask_id  # an imported model's own, if recorded
        self.prompts = prompts
        self.committed: dict[int, list[int]] = {}
        self.step: Step | None = None
        self.saw_steps = False

    def piece(self, tid: int) -> str:
        return self.tok.decode([tid])

    def text(self, tokens: list[int]) -> str:
        """Decoded text up to the first <eos> (what the Result will hold)."""
        return self.tok.text(before_eos(tokens, self.tok.eos_ids))

    def canvas_text(self, step: Step) -> Text:
        """The canvas as rich Text: fixed tokens bright, noise dim, masks as blocks."""
        out = Text()
        mask_id = self.mask_id
        for tid, fixed in zip(step.canvas, step.fixed):
            if fixed:
                out.append(self.piece(tid), style="bold green")
            elif mask_id is not None and tid == mask_id:
                out.append(MASK_BLOCK, style="dim")
            else:
                out.append(self.piece(tid).replace("\n", NEWLINE), style="dim red")
        return out

    def compact(self, step: Step, width: int = 100) -> str:
        """One line per step for logs: status, then the canvas with noise as '·' and masks as '░'."""
        mask_id = self.mask_id
        chars = []
        for tid, fixed in zip(step.canvas, step.fixed):
            if fixed:
                chars.append(self.piece(tid).replace("\n", NEWLINE))
            else:
                chars.append(MASK_BLOCK if mask_id is not None and tid == mask_id else NOISE_DOT)
        body = "".join(chars)
        if len(body) > width:
            body = body[:width - 1] + "…"
        return f"{self.status(step)} | {body}"

    def status(self, step: Step) -> str:
        n, k = len(step.fixed), sum(step.fixed)
        ent = f"  entropy {step.entropy:.3f}" if step.entropy is not None else ""
        row = f"row {step.row}  " if len(self.prompts) > 1 else ""
        return f"{row}canvas {step.canvas_index + 1}  step {step.step:>2}  fixed {k:>3}/{n}{ent}"

    def frame(self) -> Group:
        """Terminal frame: the tail of prompt + committed text, the live canvas, a status line."""
        row = self.step.row if self.step is not None else 0
        prompt = self.prompts[row] if row < len(self.prompts) else ""
        done = self.text(self.committed.get(row, []))
        head = Text()
        head.append(prompt, style="dim")
        head.append(done)
        lines = head.split("\n", allow_blank=True)
        if len(lines) > TAIL_LINES:
            head = Text("\n").join(lines[-TAIL_LINES:])
        if self.step is not None:
            head.append_text(self.canvas_text(self.step))
        parts: list = [head]
        if self.step is not None:
            parts.append(Text(self.status(self.step), style="bold cyan"))
        return Group(*parts)


def _terminal(events: Iterator[Event], view: View, console: Console) -> Iterator[Event]:
    live: Live | None = None
    streamed: dict[int, str] = {}
    try:
        for ev in events:
            if isinstance(ev, Step):
                view.step, view.saw_steps = ev, True
                if live is None:
                    live = Live(view.frame(), console=console, auto_refresh=False, vertical_overflow="crop")
                    live.start()
                live.update(view.frame(), refresh=True)
            elif isinstance(ev, Commit):
                view.committed.setdefault(ev.row, []).extend(ev.tokens)
                if live is not None:
                    view.step = None if view.step is not None and view.step.row == ev.row else view.step
                    live.update(view.frame(), refresh=True)
                else:  # no steps: plain streaming of what became final
                    if not streamed:
                        console.print(Text(view.prompts[0] if view.prompts else "", style="dim"), end="")
                    text = view.text(view.committed[ev.row])
                    new = text[len(streamed.get(ev.row, "")):]
                    streamed[ev.row] = text
                    if ev.row == 0:
                        console.print(Text(new, style="bold green"), end="")
            yield ev
    finally:
        if live is not None:
            live.stop()
        elif streamed:
            console.print()


def _lines(events: Iterator[Event], view: View, out) -> Iterator[Event]:
    streamed: dict[int, str] = {}
    for ev in events:
        if isinstance(ev, Step):
            view.saw_steps = True
            print(view.compact(ev), file=out, flush=True)
        elif isinstance(ev, Commit):
            view.committed.setdefault(ev.row, []).extend(ev.tokens)
            text = view.text(view.committed[ev.row])
            if view.saw_steps:
                piece = view.text(ev.tokens).replace("\n", NEWLINE)
                print(f"commit ({len(ev.tokens)} tokens): {piece}", file=out, flush=True)
            elif ev.row == 0:  # plain streaming (AR)
                out.write(text[len(streamed.get(0, "")):])
                out.flush()
            streamed[ev.row] = text
        elif isinstance(ev, Done) and not view.saw_steps and streamed:
            out.write("\n")
            out.flush()
        yield ev


def live(events: Iterator[Event], tokenizer, prompt: str | list[str], console: Console | None = None,
         rows: int | None = None, mask_id: int | None = None) -> Result:
    """Draw a sampler's events while running it; returns what `drain` returns. mask_id: the checkpoint's <mask>
    (default: the tokenizer's)."""
    prompts = [prompt] if isinstance(prompt, str) else list(prompt)
    console = console or Console()
    view = View(tokenizer, prompts, mask_id)
    watched = _terminal(events, view, console) if console.is_terminal else _lines(events, view, console.file or sys.stdout)
    return drain(watched, tokenizer.text, tokenizer.eos_ids, rows=rows or len(prompts))
