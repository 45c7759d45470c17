"""The --show live view: terminal redraw, per-step lines when piped, plain streaming for AR; same Result as drain."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from conftest import cli
from dlm.sampling.common import Commit, Done, Stats, Step, drain
from dlm.sampling.show import MASK_BLOCK, NOISE_DOT, live
from dlm.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tokenizer_path):
    return Tokenizer.from_file(tokenizer_path)


def usdm_events(tok):
    """A hand-made usdm stream: two steps of one canvas (noise, then all accepted), a commit, done."""
    words = tok.encode("x = 1\ny = 2")
    noise = tok.encode("zzqq") * 4
    n = len(words)
    return [
        Step(noise[:n - 1] + words[-1:], [False] * (n - 1) + [True], 1, 0, 2.5),
        Step(list(words), [True] * n, 2, 0, 0.001),
        Commit(list(words)),
        Done(Stats(new_tokens=n, forwards=3, extra={"canvases": 1, "steps_per_canvas": [2]})),
    ]


def mdlm_events(tok):
    words = tok.encode("a = b")
    m = tok.mask_id
    return [
        Step([m] * len(words), [False] * len(words), 1, 0, None),
        Step(words[:1] + [m] * (len(words) - 1), [True] + [False] * (len(words) - 1), 2, 0, None),
        Commit(list(words)),
        Done(Stats(new_tokens=len(words), forwards=2)),
    ]


def ar_events(tok):
    ids = tok.encode("print(1)") + [tok.eos_id]
    return [*(Commit([i]) for i in ids), Done(Stats(new_tokens=len(ids), forwards=len(ids)))]


def piped(events, tok, prompt="p"):
    buf = io.StringIO()
    res = live(iter(events), tok, prompt, console=Console(file=buf, force_terminal=False))
    return res, buf.getvalue()


def same_result(res, events, tok):
    ref = drain(iter(events), tok.decode, tok.eos_id)
    assert res.tokens == ref.tokens and res.texts == ref.texts and res.stats == ref.stats


def test_piped_usdm_prints_one_line_per_step(tok):
    events = usdm_events(tok)
    res, out = piped(events, tok)
    same_result(res, events, tok)
    lines = out.splitlines()
    assert lines[0].startswith("canvas 1  step  1") and "entropy 2.500" in lines[0] and NOISE_DOT in lines[0]
    assert lines[1].startswith("canvas 1  step  2") and "x = 1⏎y = 2" in lines[1] and NOISE_DOT not in lines[1]
    assert lines[2].startswith("commit (") and len(lines) == 3


def test_piped_mdlm_shows_masks(tok):
    events = mdlm_events(tok)
    res, out = piped(events, tok)
    same_result(res, events, tok)
    first = out.splitlines()[0]
    assert MASK_BLOCK in first and "entropy" not in first


def test_piped_ar_streams_plain_text(tok):
    events = ar_events(tok)
    res, out = piped(events, tok)
    same_result(res, events, tok)
    assert out == "print(1)\n"


def test_terminal_redraws_and_returns_the_result(tok):
    for events in (usdm_events(tok), mdlm_events(tok), ar_events(tok)):
        buf = io.StringIO()
        res = live(iter(events), tok, "prompt> ", console=Console(file=buf, force_terminal=True, width=80))
        same_result(res, events, tok)
        text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buf.getvalue())
        if isinstance(events[0], Step):
            assert "step  2" in text and "\x1b[1A" in buf.getvalue()  # redrawn in place
            if events[0].entropy is not None:  # usdm: accepted bright, noise dim
                assert "\x1b[1;32m" in buf.getvalue() and "\x1b[2;31m" in buf.getvalue()
        else:
            assert "prompt> print(1)" in text and "<eos>" not in text


def test_cli_show_piped(tiny_ar):
    p = cli("generate", "--model", str(tiny_ar), "--prompt", "def f(", "--max-new-tokens", "5", "--show", check=True)
    assert "tokens, 5 forwards" in p.stdout
