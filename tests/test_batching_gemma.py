"""Rows on a gemma4 backbone: an imported DiffusionGemma's usdm rows (per-layer K/V of different shapes, sliding-window
layers of window 5) run as rows of one batch, and each comes out as it does alone, token for token and step for step,
with prompts shorter and longer than the window and canvases that stop at different points. A sliding layer's band is
each row's own (its cache and window at its own positions), not the batch's slots: the single forward is held to the
one-row forward, logits for logits. As tests/test_batching.py: tiny random models in float64, <eos> made frequent."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import random_transformer
from test_batching import MDLM, PROMPTS, TINY, check_usdm_rows_join, mdlm_alone, mdlm_jobs, rows_of

from dlm.config import GEMMA_LAYERS
from dlm.sampling import SampleConfig, mdlm, stream, stream_rows, usdm
from dlm.sampling.common import Prompt
from dlm.sampling.rows import RowBatch, Window, batchable, run_one

pytest.importorskip("transformers")
from test_diffusion_gemma import F, S, hf_diffusion_gemma, ours  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

V, EOS = 97, 1  # DiffusionGemma's vocabulary (noise over all of it) and <eos>


@pytest.fixture(scope="module")
def dg():
    """A tiny imported DiffusionGemma (sliding, full, sliding, full; window 5; soft-cap 30) whose <eos> is likely."""
    c, m = hf_diffusion_gemma((S, F, S, F), window=5, canvas=6)
    model = ours(c, m)
    with torch.no_grad():
        model.lm_head.weight[EOS] = 1.1 * model.lm_head.weight[12]
    return model.double().eval()


def test_a_gemma4_backbone_is_batchable(dg):
    assert batchable(dg) and dg.cfg.logit_softcap and "sliding" in dg.cfg.layer_types


@pytest.mark.parametrize("mask", ["causal", None])
def test_one_forward_of_rows_of_different_lengths_is_each_row_alone(dg, mask):
    """Rows whose caches hold 1, 3, 11 and 8 positions (window 5) and windows of 6, 2, 4 and 6 tokens, causal (a
    prefill) or bidirectional over the cache (a canvas): the batched forward's logits are each row's own."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, V, (n,), generator=g) for n in (1, 3, 11, 8)]
    wins = [torch.randint(5, V, (n,), generator=g) for n in (6, 2, 4, 6)]
    batch = RowBatch(dg, 64)
    for _ in prompts:
        batch.add()
    with torch.inference_mode():
        batch.forward([Window(tokens=p, mask="causal", keep=len(p)) for p in prompts])
        assert batch.length == [1, 3, 11, 8]
        got = batch.forward([Window(tokens=w, mask=mask, keep=len(w) if mask else 0, out=(0, len(w))) for w in wins])
        for p, w, out in zip(prompts, wins, got):
            cache = dg.new_cache(1, 64)
            run_one(dg, cache, Window(tokens=p, mask="causal", keep=len(p)))
            alone = run_one(dg, cache, Window(tokens=w, mask=mask, keep=len(w) if mask else 0, out=(0, len(w))))
            torch.testing.assert_close(out, alone, atol=1e-5, rtol=1e-5)
        assert batch.length == ([7, 5, 15, 14] if mask else [1, 3, 11, 8])


def usdm_run(model, prompts, cfg, batched: bool):
    run = usdm._generate_batched if batched else usdm._generate_in_turn
    return list(run(model, [Prompt(p) for p in prompts], cfg.canvas_length, cfg.steps, V, EOS, cfg, True))


USDM = [
    dict(canvas_length=6, steps=8),
    dict(canvas_length=8, steps=6, adaptive=False, seed=2),
    # every position accepted at a low temperature: the argmax canvas settles, canvases stop adaptively
    dict(canvas_length=2, steps=8, entropy_bound=100.0, t_max=0.5, t_min=0.5, confidence_threshold=5.0),
]


@pytest.mark.parametrize("opts", USDM, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_diffusion_gemma_rows_equal_each_row_alone(dg, opts):
    cfg = SampleConfig(max_new_tokens=18, **opts)
    tokens, steps, stats = rows_of(usdm_run(dg, PROMPTS, cfg, True), len(PROMPTS))
    alone = [rows_of(usdm_run(dg, [p], cfg.replace(seed=cfg.seed + r), False), 1) for r, p in enumerate(PROMPTS)]
    assert tokens == [a[0][0] for a in alone]
    for r, a in enumerate(alone):
        assert [(s.canvas, s.fixed, s.step, s.canvas_index) for s in steps[r]] == \
               [(s.canvas, s.fixed, s.step, s.canvas_index) for s in a[1][0]]
    assert any(EOS in t for t in tokens) and len({len(t) for t in tokens}) > 1, tokens  # rows end apart
    assert [r["forwards"] for r in stats.extra["rows"]] == [a[2].forwards for a in alone]
    if cfg.confidence_threshold > 1:  # canvases stopped adaptively after different numbers of steps
        assert len(set(stats.extra["steps_per_canvas"])) > 1
    assert stats.extra["rows_per_forward"] > 2  # rows shared forwards


def test_stream_rows_of_a_diffusion_gemma_run_together(dg):
    """The library's rows with options of their own (eval --batch): one batch, each row as `stream` gives it alone."""
    ck = SimpleNamespace(objective="usdm", path="tiny", config={}, canvas_length=6, noise_vocab=V,
                         tokenizer=SimpleNamespace(eos_id=EOS, eos_ids=[EOS], eos_set=frozenset([EOS])))
    cfgs = [SampleConfig(max_new_tokens=n, steps=s, seed=sd) for n, s, sd in [(12, 6, 0), (6, 4, 1), (18, 5, 2)]]
    prompts = [Prompt(p) for p in PROMPTS[1:4]]
    tokens, _, stats = rows_of(list(stream_rows(dg, ck, prompts, cfgs)), 3)
    assert tokens == [rows_of(list(stream(dg, ck, [p], c)), 1)[0][0] for p, c in zip(prompts, cfgs)]
    assert stats.extra["rows_per_forward"] > 1.5


def test_diffusion_gemma_rows_join_a_running_batch(dg):
    """The server's use: rows with their own options join between steps (and move into a leaving row's place)."""
    check_usdm_rows_join(dg, V, EOS, usdm_run)


def test_mdlm_rows_on_a_gemma4_backbone_of_full_layers():
    """An mdlm on a gemma4 backbone (only full-attention layers: a finished block's cached pass is a bool mask, which a
    sliding layer cannot take, alone or batched) runs its rows together too, greedy and sampled."""
    gemma = dict(GEMMA_LAYERS, layer_types=["full", "full"], sliding_window=4, full_head_dim=16, full_kv_heads=1,
                 k_eq_v=True, logit_softcap=30.0, embed_scale=TINY["dim"] ** 0.5)
    model = random_transformer(1, 0.3, **{**TINY, "vocab_size": 24}, **gemma)
    with torch.no_grad():
        model.lm_head.weight[2] = 1.1 * model.lm_head.weight[6]
    model = model.double().eval()
    assert batchable(model)
    for opts in (MDLM[0], MDLM[4]):
        cfg = SampleConfig(max_new_tokens=20, **opts)
        events = list(mdlm._run(model, mdlm_jobs(cfg), mdlm.check_options(cfg), cfg, 1, 2, True))
        tokens, _, stats = rows_of(events, len(PROMPTS))
        assert tokens == [rows_of(mdlm_alone(model, cfg, r, p), 1)[0][0] for r, p in enumerate(PROMPTS)]
        assert stats.extra["rows_per_forward"] > 1.5


@pytest.mark.parametrize("opts", [dict(), dict(temperature=1.0, seed=6)], ids=["greedy", "T=1"])
@pytest.mark.parametrize("kind", ["ar", "lookup"])
def test_speculative_rows_on_a_gemma4_target_equal_each_row_alone(kind, opts):
    """An imported Gemma 4 target (sliding layers of window 5, soft-cap) verifying rows of one batch: each row gets
    what it gets alone, draft for draft, and greedy rows are the target's own greedy output."""
    from test_batching import EOS as SPEC_EOS  # (the <eos> of the speculative samplers' checkpoint stand-in)
    from test_batching import KIND_OPTIONS, check_speculative_rows
    from test_gemma4 import hf_model
    from test_gemma4 import ours as gemma4_ours

    from dlm.sampling import speculative

    c, m = hf_model("moe-kv")
    target = gemma4_ours(c, m)
    with torch.no_grad():
        target.lm_head.weight[SPEC_EOS] = 1.3 * target.lm_head.weight[12]
    target = target.double().eval()
    cfg = SampleConfig(max_new_tokens=16, block_size=4, **opts, **KIND_OPTIONS.get(kind, {}))
    _, tokens, stats, _ = check_speculative_rows(target, kind, cfg)
    assert stats.extra["rows_per_forward"] > 1.5
    if not cfg.temperature:
        assert tokens == [speculative.target_greedy(target, p, 16, SPEC_EOS) for p in PROMPTS]
