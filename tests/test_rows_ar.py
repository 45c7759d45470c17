"""AR decoding as a row program (ar.row_program) on the one row batch (rows.Programs, what the server runs): each
row comes out as `ar.decode` gives that prompt alone with its own seed, token for token, whatever it shares a batch
with and whenever it joins; its logprobs are the lone model's; a row whose program raises ends alone.

A tiny random model in float64 with a 24-token vocabulary (the rounding of batched matmuls never tips an argmax or a
draw there) whose <eos> is likely after some contexts, so rows end at different points."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import random_transformer

from dlm.config import SampleConfig
from dlm.sampling import ar, row_program
from dlm.sampling.common import Commit, Prompt, Scored
from dlm.sampling.rows import Programs, Raised

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

V, EOS = 24, 2
CK = SimpleNamespace(objective="ar", path="tiny", fim=False, tokenizer=SimpleNamespace(eos_ids=(EOS,), pad_id=0))


@pytest.fixture(scope="module")
def model():
    m = random_transformer(3, 0.3, vocab_size=V, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=64,
                           max_seq_len=96)
    with torch.no_grad():
        m.lm_head.weight[EOS] = 1.1 * m.lm_head.weight[7]  # <eos> wherever 7 is likely
    return m.double().eval()


def alone(model, prompt: list[int], cfg: SampleConfig) -> list[int]:
    return [t for ev in ar.decode(model, [prompt], cfg.max_new_tokens, cfg.temperature, cfg.top_k, cfg.top_p,
                                  cfg.seed, EOS) if isinstance(ev, Commit) for t in ev.tokens]


rows = st.lists(st.tuples(st.lists(st.integers(3, V - 1), min_size=1, max_size=20),  # prompt
                          st.integers(1, 30),  # max new tokens
                          st.sampled_from([(0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 5, 0.9)]),  # temperature, top-k, top-p
                          st.integers(0, 2 ** 20),  # seed
                          st.integers(0, 6)),  # the step it joins at
                min_size=2, max_size=6)


@settings(max_examples=12, deadline=None, derandomize=True, database=None)
@given(rows=rows)
def test_ar_rows_joining_a_running_batch_equal_each_prompt_alone(model, rows):
    joined(model, rows, 64)


class Poisoned(torch.nn.Module):
    """The model, its row batch's unfilled buffers full of NaN: a slot read before it is written or zeroed poisons
    the row (attention multiplies masked keys too)."""

    def __init__(self, model):
        super().__init__()
        self.m = model

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.m, name)

    def rows_cache(self, rows: int, capacity: int, fill: bool = True, per_layer: bool = False):
        cache = self.m.rows_cache(rows, capacity, fill, per_layer)
        if not fill:
            for t in cache.buffers():
                t.fill_(float("nan"))
        return cache


@settings(max_examples=8, deadline=None, derandomize=True, database=None)
@given(rows=rows)
def test_the_row_batch_grows_unfilled_and_reads_no_unwritten_slot(model, rows):
    """Rows join as the buffers grow (more rows, more slots from a capacity of 4), unfilled: still each prompt alone."""
    joined(Poisoned(model), rows, 4, alone_model=model)


def joined(model, rows, capacity: int, alone_model=None, kind: str = "eager", prefix: int = 0) -> Programs:
    cfgs = [SampleConfig(max_new_tokens=n, temperature=t, top_k=k, top_p=p, seed=s) for _, n, (t, k, p), s, _ in rows]
    batch = Programs(model, capacity, step=kind, prefix=prefix)
    got: list[list[int]] = [[] for _ in rows]
    forwards, step = 0, 0
    with torch.inference_mode():
        while step <= max(r[4] for r in rows) or len(batch):
            for i, r in enumerate(rows):
                if r[4] == step:
                    assert batch.add_row(row_program(model, CK, Prompt(r[0]), cfgs[i], i), i) == []
            events = batch.step() if len(batch) else []
            forwards += bool(events)
            for i, ev in events:
                assert ev.row == i
                got[i].extend(ev.tokens)
            step += 1
    want = [alone(alone_model or model, r[0], c) for r, c in zip(rows, cfgs)]
    assert got == want
    assert batch.forwards <= sum(len(w) for w in want)  # rows shared forwards (or ended at once)
    assert (batch.rows.step is not None) == (kind != "eager")
    return batch


def test_rows_end_at_eos_or_their_budget_and_score_as_the_lone_model(model):
    prompts = [[5, 9, 3], [7], [4, 11, 6, 8, 10, 3, 12, 9, 5, 13, 7], [15, 3, 8, 21, 6]]
    cfgs = [SampleConfig(max_new_tokens=n, temperature=1.0, seed=5 + i) for i, n in enumerate([20, 2, 20, 3])]
    batch = Programs(model, 64)
    scored: list[list[Scored]] = [[] for _ in prompts]
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            batch.add_row(row_program(model, CK, Prompt(p), cfgs[i], i, logprobs=3), i)
        while len(batch):
            for i, ev in batch.step():
                assert isinstance(ev, Scored)
                scored[i].append(ev)
        for i, p in enumerate(prompts):
            toks = [e.tokens[0] for e in scored[i]]
            assert toks == alone(model, p, cfgs[i])
            lp = torch.log_softmax(model(torch.tensor([p + toks[:-1]])).logits[0, len(p) - 1:].float(), -1)
            assert [e.logprob for e in scored[i]] == pytest.approx(lp[torch.arange(len(toks)), toks].tolist(),
                                                                   abs=1e-9)
            for e, row in zip(scored[i], lp):
                vals, idx = row.topk(3)
                assert [a for a, _ in e.top] == idx.tolist()
                assert [b for _, b in e.top] == pytest.approx(vals.tolist(), abs=1e-9)
    ends = [e[-1].tokens[0] == EOS for e in scored]
    assert any(ends) and not all(ends)  # some rows stop at <eos>, others run to their budget


def test_a_row_whose_program_raises_ends_alone(model):
    def sampled_then_broken():
        program = row_program(model, CK, Prompt([4, 4]), SampleConfig(max_new_tokens=8), 0).program
        msg = None
        for _ in range(3):
            req = program.send(msg)
            msg = yield req
        raise RuntimeError("mid-way")

    good = [5, 3, 8]
    for isolate in (True, False):
        batch = Programs(model, 64, isolate=isolate)
        out, raised = [], []
        with torch.inference_mode():
            batch.add_row(row_program(model, CK, Prompt(good), SampleConfig(max_new_tokens=12), 0), "good")
            batch.add(sampled_then_broken(), lambda r: r, lambda r, o: o, "bad")
            if not isolate:
                with pytest.raises(RuntimeError, match="mid-way"):
                    while len(batch):
                        batch.step()
                continue
            while len(batch):
                for tag, ev in batch.step():
                    (raised if isinstance(ev, Raised) else out).append((tag, ev))
        assert [tag for tag, _ in raised] == ["bad"] and str(raised[0][1].error) == "mid-way"
        assert [t for tag, ev in out if tag == "good" for t in ev.tokens] == alone(model, good, SampleConfig(
            max_new_tokens=12))


@pytest.mark.parametrize("step", ["static", pytest.param("compiled", marks=pytest.mark.slow)])
@settings(max_examples=6, deadline=None, derandomize=True, database=None)
@given(rows=rows)
def test_ar_rows_on_the_static_step_equal_each_prompt_alone(model, rows, step):
    """The rows' one-token steps as one static step over every row's slots (rows.RowBatch step="static"; "compiled":
    the same step through torch.compile) give each prompt's tokens alone, rows joining and leaving at any step, the
    buffers growing unfilled (NaN) from a capacity of 4."""
    joined(Poisoned(model), rows, 4, alone_model=model, kind=step)


@settings(max_examples=12, deadline=None, derandomize=True, database=None)
@given(prompt=st.lists(st.integers(3, V - 1), min_size=1, max_size=20),
       windows=st.lists(st.tuples(st.lists(st.integers(0, V - 1), min_size=2, max_size=6), st.integers(0, 5),
                                  st.sampled_from([(), (0,), (1, 0), (0, 1)])), min_size=1, max_size=4))
def test_verify_windows_on_the_step_window_equal_the_row_alone(model, prompt, windows):
    """A speculative verify's window on the row batch's step (RowBatch.warm_windows, RowsStep.window, run statically):
    every position's logits and the taps asked for (any order) are those of the row's own forward over its own
    cache; then the row keeps some of the window (a crop) and goes on, the buffers growing from 4 slots."""
    from dlm.sampling.rows import RowBatch, Window, run_one

    with torch.inference_mode():  # (as Programs.step serves a batch)
        batch = RowBatch(model, 4, "static")
        batch.warm_windows({len(w) for w, _, _ in windows})
        batch.add()
        cache = model.new_cache(1, 96)
        p = Window(tokens=torch.tensor(prompt), mask="causal", keep=len(prompt), out=(len(prompt) - 1, len(prompt)))
        torch.testing.assert_close(batch.forward([p])[0], run_one(model, cache, p), rtol=0, atol=1e-12)
        for toks, kept, taps in windows:
            T = len(toks)
            w = Window(tokens=torch.tensor(toks), mask="causal", keep=T, out=(0, T), taps=taps)
            a, b = batch.forward([w])[0], run_one(model, cache, w)
            for x, y in zip(a if taps else (a,), b if taps else (b,)):
                torch.testing.assert_close(x, y, rtol=0, atol=1e-12)
            n = cache.length - T + min(kept, T)  # a verify keeps the last token and the accepted drafts
            batch.crop(0, n)
            cache.crop(n)
    assert batch.windowed == len(windows)


@settings(max_examples=6, deadline=None, derandomize=True, database=None)
@given(rows=rows)
def test_rows_over_a_bfloat16_cache_equal_each_prompt_alone_over_one(model, rows):
    """Transformer.kv_dtype (`dlm serve --kv-dtype bfloat16`): the row batch keeps K/V in bfloat16 under wider weights;
    each row's tokens are the prompt's alone with a bfloat16 cache, on the eager and the static step."""
    import copy

    half = copy.deepcopy(model)
    half.kv_dtype = torch.bfloat16
    assert half.new_cache(1, 4).k.dtype == torch.bfloat16
    for kind in ("eager", "static"):
        batch = joined(Poisoned(half), rows, 4, alone_model=half, kind=kind)
        assert all(t.dtype == torch.bfloat16 for t in batch.rows.cache.buffers())


prefixed = st.tuples(st.lists(st.integers(3, V - 1), min_size=1, max_size=16),  # a prefix the prompts share
                     st.lists(st.tuples(st.integers(0, 16),  # how much of it a prompt starts with
                                        st.lists(st.integers(3, V - 1), max_size=5),  # then its own tokens
                                        st.integers(1, 20),
                                        st.sampled_from([(0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 5, 0.9)]),
                                        st.integers(0, 2 ** 20),
                                        st.integers(0, 12)),
                              min_size=2, max_size=6),
                     st.sampled_from([700, 4096, 1 << 20]))  # bytes of the prefix cache (512 per token here)


@settings(max_examples=12, deadline=None, derandomize=True, database=None)
@given(case=prefixed)
def test_prompts_that_reuse_a_kept_prefix_equal_each_prompt_alone(model, case):
    """Rows whose prompts share prefixes (or repeat) join a running batch whose prefix cache holds the earlier prompts'
    K/V (evicted past a small budget), over unfilled buffers growing from a capacity of 4: each prompt alone."""
    base, spec, budget = case
    rows = [(base[:k] + own or base[:1], n, s, seed, j) for k, own, n, s, seed, j in spec]
    joined(Poisoned(model), rows, 4, alone_model=model, prefix=budget)


@pytest.mark.parametrize("kind", ["eager", "static"])
def test_a_repeated_prompt_computes_only_its_last_token(model, kind):
    """The same prompt joining three times (greedy and sampled) and a longer one that starts with it: each as alone;
    the repeats copy all but the prompt's last token from the prefix cache, the longer one the whole first prompt."""
    p = [5, 9, 3, 11, 4, 8, 6]
    rows = [(p, 12, (0.0, 0, 1.0), 0, 0), (p, 12, (0.0, 0, 1.0), 0, 2), (p, 12, (1.0, 0, 1.0), 7, 3),
            (p + [13, 5], 12, (0.8, 5, 0.9), 3, 5), (p, 12, (1.0, 0, 1.0), 7, 9)]
    batch = joined(model, rows, 64, prefix=1 << 20, kind=kind)
    assert (batch.rows.prefix.hits, batch.rows.prefix.tokens) == (4, 3 * (len(p) - 1) + len(p))


AR_MID = Path(__file__).resolve().parents[1] / "checkpoints" / "ar-mid"


@pytest.mark.slow
@pytest.mark.skipif(not (AR_MID / "config.json").exists(), reason="needs the shipped ar-mid")
def test_ar_mid_rows_on_the_compiled_step_decode_their_greedy_tokens_alone():
    """The shipped ar-mid in float32 (what `dlm serve --compile` runs): rows through the compiled whole-stack step
    (frozen weights, in-place K/V writes) joining at different steps decode the greedy tokens of each prompt alone."""
    from dlm.checkpoint import load_model

    model, _ = load_model(AR_MID)
    greedy = (0.0, 0, 1.0)
    rows = [([5, 90, 311, 47, 1200, 8], 24, greedy, 0, 0), ([700, 12, 13, 14], 20, greedy, 0, 0),
            (list(range(100, 160)), 16, greedy, 0, 3), ([3000, 41], 12, greedy, 0, 5)]
    joined(model.eval(), rows, 2 * model.cfg.max_seq_len, kind="compiled")
