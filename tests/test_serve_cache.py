"""The AR batcher's K/V buffers are allocated unfilled: nothing it has not written is ever read.

The buffers come from torch.empty (zeroing rows x 2 x context columns of every layer cost seconds on a busy CPU);
attention multiplies every key column it is given, masked ones by 0, so a NaN left there would reach the output.
Here every column the batcher has not written is NaN when it grows, and rows of different prompt lengths join a
running batch (more rows than the buffers hold, prompts longer than the batch's timeline): every row's tokens must
still be its tokens alone."""

import math
import time

import torch

from dlm.checkpoint import load_model
from dlm.sampling import SampleConfig, generate
from dlm.sampling.common import Prompt
from dlm.serve.engine import ARBatcher, Commit, Job, Row, _buffers


def test_unwritten_columns_are_never_read(tiny_ar, monkeypatch):
    grow = ARBatcher._reserve

    def poisoned(self, n):
        before = None if self.cache is None else _buffers(self.cache)[0].shape[-4]
        grow(self, n)
        if _buffers(self.cache)[0].shape[-4] != before:  # new buffers: all but the copied rows' :L columns are NaN
            for t in _buffers(self.cache):
                t[..., before or 0:, :, :, :] = math.nan
                t[..., :, :, self.L:, :] = math.nan

    monkeypatch.setattr(ARBatcher, "_reserve", poisoned)
    torch.manual_seed(0)
    model, ck = load_model(tiny_ar)
    tok = ck.tokenizer
    first = ["def f(x):", "x = 1", "for i in range(10):\n    print(i)", "return", "import os"]  # past 4 rows: growth
    later = ["# a comment that runs long " * 6,  # longer than the batch's timeline: the rows there move right
             "y", "while True:\n    pass\n"]  # shorter: columns before their prompts
    texts = first + later
    budget = [40 + 2 * i for i in range(len(first))] + [12, 9, 16]  # rows leave at different steps
    want = [generate(model, ck, t, SampleConfig(max_new_tokens=b)).tokens[0] for t, b in zip(texts, budget)]
    batcher = ARBatcher(model, ck, max_rows=64, name="test")
    try:
        jobs = []
        for i, (t, b) in enumerate(zip(texts, budget)):
            if i >= len(first):  # these join a running batch
                time.sleep(0.02)
            jobs.append(Job([Row(Prompt(tok.encode(t)), SampleConfig(max_new_tokens=b, temperature=0.0))]))
            batcher.submit(jobs[-1])
        got = [[t for ev in job.drain(timeout=120) if isinstance(ev, Commit) for t in ev.tokens] for job in jobs]
    finally:
        batcher.close()
    assert got == want
    assert batcher.counts["max_rows"] >= 5 and batcher.counts["decode_rows"] > batcher.counts["decode_steps"]
