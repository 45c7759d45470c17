"""Rows: the mdlm and usdm samplers run many prompts in one forward per step, and each row comes out as it
does alone (its own one-row path, row r seeded seed + r), token for token: greedy and sampled, rows of
different prompt lengths, rows that end at different points (an <eos>, their own max_new_tokens, an
adaptive stop), rows that join a running batch and rows that leave it.

Tiny random models with a 24-token vocabulary make <eos> frequent, so some rows stop early and others
do not; every case asserts that its rows stop at different points, and that the batch shared forwards. They
run in float64, where the rounding of batched matmuls (rows padded to a common length, attention over a
common key range) is far too small to tip an argmax or a draw; the shipped checkpoints are held in float32."""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import random_transformer

from dlm.checkpoint import load_model
from dlm.config import ModelConfig
from dlm.drafter import DFlashDrafter
from dlm.sampling import SampleConfig, generate, joint, mdlm, speculative, usdm
from dlm.sampling.common import Commit, Done, Prompt, Stats, Step, Verified
from dlm.sampling.joint import SelfDraft
from dlm.sampling.speculative import ARDraft, DFlashDraft, DiffusionDraft, PromptLookup, Sampling, WithLookup

pytestmark = pytest.mark.usefixtures("one_thread")

CK = Path(__file__).resolve().parent.parent / "checkpoints"
V, MASK, EOS = 24, 1, 2
PROMPTS = [[5, 9, 3], [7], [4, 11, 6, 8, 10, 3, 12, 9, 5, 13, 7], [15, 3, 8, 21, 6], [20, 19, 18, 17, 16, 14, 3, 4]]
TINY = dict(vocab_size=V, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=64, max_seq_len=128)


def with_eos(model, like: int):
    """<eos> takes the place of token `like` wherever that one is likely (its output row, a little longer): rows
    that would repeat `like` end there, the others run on."""
    with torch.no_grad():
        model.lm_head.weight[EOS] = 1.1 * model.lm_head.weight[like]
    return model.double().eval()  # (float64: the rounding of batched matmuls never tips a draw or an argmax)


@pytest.fixture(scope="module")
def mdlm_model():
    return with_eos(random_transformer(1, 0.3, **TINY), 6)


@pytest.fixture(scope="module")
def usdm_model():
    return with_eos(random_transformer(2, 0.3, **TINY, self_cond=True), 12)


def rows_of(events, n: int) -> tuple[list[list[int]], list[list[Step]], Stats]:
    """Tokens and Step events per row, and the one Done's statistics."""
    tokens: list[list[int]] = [[] for _ in range(n)]
    steps: list[list[Step]] = [[] for _ in range(n)]
    done = [e for e in events if isinstance(e, Done)]
    assert len(done) == 1 and isinstance(events[-1], Done)
    for e in events:
        if isinstance(e, Commit):
            tokens[e.row].extend(e.tokens)
        elif isinstance(e, Step):
            steps[e.row].append(e)
    return tokens, steps, done[0].stats


def assert_stopping_points_differ(tokens: list[list[int]], max_new: int) -> None:
    assert any(EOS in t for t in tokens), tokens  # rows stop at <eos> ...
    assert len({len(t) for t in tokens}) > 1, tokens  # ... at different points


# mdlm ------------------------------------------------------------------------------------------------

def mdlm_jobs(cfg, prompts=PROMPTS):
    return [mdlm.make_job(Prompt(p), cfg, 0, TINY["max_seq_len"]) for p in prompts]


def mdlm_alone(model, cfg, r: int, prompt):
    """Row r on its own: the one-row path, with the seed it has in a call of several rows."""
    one = cfg.replace(seed=cfg.seed + r)
    return list(mdlm._run_in_turn(model, mdlm_jobs(one, [prompt]), mdlm.check_options(one), one, MASK, EOS, True))


MDLM = [
    dict(block_size=4),
    dict(block_size=8, sampler="threshold", threshold=0.6),
    dict(block_size=8, steps=3, sampler="entropy_bound", entropy_bound=0.8),
    dict(block_size=4, revise=0.3),
    dict(block_size=8, temperature=1.0, seed=11),
    dict(block_size=4, temperature=0.8, top_k=8, seed=5, remasking="random", steps=2),
    dict(block_size=16, temperature=1.0, top_p=0.9, seed=3, sampler="entropy_bound", entropy_bound=1.0),
]


@pytest.mark.parametrize("opts", MDLM, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_mdlm_rows_equal_each_row_alone(mdlm_model, opts):
    cfg = SampleConfig(max_new_tokens=20, **opts)
    rule = mdlm.check_options(cfg)
    events = list(mdlm._run(mdlm_model, mdlm_jobs(cfg), rule, cfg, MASK, EOS, True))
    tokens, steps, stats = rows_of(events, len(PROMPTS))
    alone = [rows_of(mdlm_alone(mdlm_model, cfg, r, p), 1) for r, p in enumerate(PROMPTS)]
    assert tokens == [a[0][0] for a in alone]
    for r, a in enumerate(alone):  # the same denoising steps, canvas by canvas
        assert [(s.canvas, s.fixed, s.step, s.canvas_index, s.offset) for s in steps[r]] == \
               [(s.canvas, s.fixed, s.step, s.canvas_index, s.offset) for s in a[1][0]]
    assert_stopping_points_differ(tokens, 20)
    # one Done: totals, and each row's own counters as it counts them alone
    assert [dict(new_tokens=a[2].new_tokens, forwards=a[2].forwards, steps=a[2].steps, canvases=a[2].canvases,
                 logprob=pytest.approx(a[2].extra["logprob"], rel=1e-9)) for a in alone] == stats.extra["rows"]
    assert stats.new_tokens == sum(a[2].new_tokens for a in alone) == sum(map(len, tokens))
    assert stats.steps == sum(a[2].steps for a in alone)
    assert stats.forwards < sum(a[2].forwards for a in alone)  # rows shared forwards
    assert stats.extra["rows_per_forward"] > 1.5


@pytest.mark.parametrize("name,opts", [("mdlm-small", {}), ("mdlm-small", dict(temperature=1.0, seed=3)),
                                       ("usdm-small", dict(steps=10))])
def test_shipped_checkpoints_batch_rows_in_float32(name, opts):
    """generate() with several prompts (rows of one batch) == each prompt alone, on a trained model in float32."""
    model, ck = load_model(CK / name)
    cfg = SampleConfig(max_new_tokens=24, **opts)
    texts = ["def read_config(path):\n    ", "import os\n", "class Stack:\n    def push(self, item):\n        ", "x = "]
    res = generate(model, ck, texts, cfg)
    assert res.stats.extra["rows_per_forward"] > 3
    for r, t in enumerate(texts):
        assert res.tokens[r] == generate(model, ck, t, cfg.replace(seed=cfg.seed + r)).tokens[0]


def test_mdlm_library_call_batches_rows_and_keeps_the_contract(mdlm_model):
    """mdlm.stream's row path: the same tokens as --naive (which runs rows in turn)."""
    cfg = SampleConfig(max_new_tokens=12, block_size=4)
    rule = mdlm.check_options(cfg)
    fast = rows_of(list(mdlm._run(mdlm_model, mdlm_jobs(cfg), rule, cfg, MASK, EOS)), len(PROMPTS))
    slow = rows_of(list(mdlm._run(mdlm_model, mdlm_jobs(cfg), rule, cfg.replace(naive=True), MASK, EOS)),
                   len(PROMPTS))
    assert fast[0] == slow[0]
    assert fast[2].forwards < slow[2].forwards


def test_mdlm_rows_join_and_leave_a_running_batch(mdlm_model):
    """The server's use: rows with options of their own join between steps; a dropped row leaves; the others
    are as they are alone."""
    cfgs = [SampleConfig(max_new_tokens=n, block_size=b, temperature=t, seed=s, sampler=sm)
            for n, b, t, s, sm in [(20, 4, 0.0, 0, "confidence"), (9, 8, 1.0, 4, "confidence"),
                                   (16, 4, 0.7, 2, "threshold"), (13, 16, 0.0, 0, "entropy_bound"),
                                   (20, 8, 1.0, 9, "confidence")]]
    batch = mdlm.Batch(mdlm_model, 256, MASK, EOS)
    got: list[list[int]] = [[] for _ in PROMPTS]
    arrive = {0: [0, 1], 3: [2], 5: [3, 4]}  # step -> rows that join before it
    leave = 7  # row 4 is cancelled after this step
    step = 0
    while step == 0 or len(batch) or any(k >= step for k in arrive):
        for r in arrive.get(step, []):
            c = cfgs[r]
            for _, ev in batch.add(mdlm_jobs(c, [PROMPTS[r]])[0], mdlm.check_options(c), c, r, Stats(), tag=r):
                got[r] += ev.tokens if isinstance(ev, Commit) else []
        if len(batch):
            for r, ev in batch.step():
                got[r] += ev.tokens if isinstance(ev, Commit) else []
        if step == leave:
            batch.drop(batch.index(4))
        step += 1
    for r, c in enumerate(cfgs):
        alone = rows_of(mdlm_alone(mdlm_model, c, r, PROMPTS[r]), 1)[0][0]
        if r == 4:
            assert got[r] == alone[:len(got[r])] and len(got[r]) < len(alone)  # it left early
        else:
            assert got[r] == alone, r


# usdm ------------------------------------------------------------------------------------------------

def usdm_run(model, prompts, cfg, batched: bool):
    L, steps = cfg.canvas_length, cfg.steps
    run = usdm._generate_batched if batched else usdm._generate_in_turn
    return list(run(model, [Prompt(p) for p in prompts], L, steps, V, EOS, cfg, True))


USDM = [
    dict(canvas_length=6, steps=8),
    dict(canvas_length=5, steps=12, seed=4, entropy_bound=0.5),
    dict(canvas_length=8, steps=6, adaptive=False, seed=2),
    dict(canvas_length=16, steps=10, seed=7, top_k=6, self_cond_input="untempered"),
    dict(canvas_length=2, steps=16, confidence_threshold=5.0, seed=1),  # stops once the argmax canvas is stable
]


@pytest.mark.parametrize("opts", USDM, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_usdm_rows_equal_each_row_alone(usdm_model, opts):
    cfg = SampleConfig(max_new_tokens=18, **opts)
    tokens, steps, stats = rows_of(usdm_run(usdm_model, PROMPTS, cfg, True), len(PROMPTS))
    alone = [rows_of(usdm_run(usdm_model, [p], cfg.replace(seed=cfg.seed + r), False), 1)
             for r, p in enumerate(PROMPTS)]
    assert tokens == [a[0][0] for a in alone]
    for r, a in enumerate(alone):
        assert [(s.canvas, s.fixed, s.step, s.canvas_index, s.offset) for s in steps[r]] == \
               [(s.canvas, s.fixed, s.step, s.canvas_index, s.offset) for s in a[1][0]]
        assert [s.entropy for s in steps[r]] == pytest.approx([s.entropy for s in a[1][0]], rel=1e-9)
    assert_stopping_points_differ(tokens, 18)
    assert [dict(new_tokens=a[2].new_tokens, forwards=a[2].forwards, steps=a[2].steps, canvases=a[2].canvases,
                 logprob=pytest.approx(a[2].extra["logprob"], rel=1e-9)) for a in alone] == stats.extra["rows"]
    assert stats.extra["steps_per_canvas"] == sum((a[2].extra["steps_per_canvas"] for a in alone), [])
    if cfg.confidence_threshold > 1:  # canvases stopped adaptively after different numbers of steps
        assert len(set(stats.extra["steps_per_canvas"])) > 1
    assert stats.forwards < sum(a[2].forwards for a in alone)


def test_usdm_rows_join_a_running_batch_with_their_own_options(usdm_model):
    check_usdm_rows_join(usdm_model, V, EOS, usdm_run)


def check_usdm_rows_join(model, vocab: int, eos: int, run) -> None:
    """The server's use: usdm rows with their own options join between steps (and move into a leaving row's place);
    each comes out as run(model, [prompt], cfg, False) gives it alone."""
    cfgs = [SampleConfig(max_new_tokens=n, canvas_length=L, steps=s, seed=sd)
            for n, L, s, sd in [(18, 6, 8, 0), (7, 4, 5, 1), (12, 12, 10, 2), (16, 5, 6, 3), (10, 10, 4, 4)]]
    batch = usdm.Batch(model, 256)
    got: list[list[int]] = [[] for _ in PROMPTS]
    arrive = {0: [0, 1], 2: [2], 6: [3, 4]}
    step = 0
    while step == 0 or len(batch) or any(k >= step for k in arrive):
        for r in arrive.get(step, []):
            c = cfgs[r]
            batch.add(Prompt(PROMPTS[r]), c.canvas_length, c.steps, vocab, eos, c, r,
                      Stats(extra={"steps_per_canvas": []}), tag=r)
        if len(batch):
            for r, ev in batch.step():
                got[r] += ev.tokens if isinstance(ev, Commit) else []
        step += 1
    for r, c in enumerate(cfgs):
        alone = rows_of(run(model, [PROMPTS[r]], c.replace(seed=c.seed + r), False), 1)[0][0]
        assert got[r] == alone, r


# eval --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,opts", [("mdlm-small", dict(max_new_tokens=8)),
                                       ("usdm-small", dict(max_new_tokens=8, steps=6))])
def test_eval_task_in_batches_gives_the_same_answers_and_counters(name, opts):
    """`dlm eval --task complete --cases-per-batch B`: cases as rows of one batch, the same answers, scores and per-case
    counters as case by case (samples > 1: each sample its own seed, as case by case)."""
    from dlm.tasks import run_task

    model, ck = load_model(CK / name)
    cfg = SampleConfig(**opts)
    one = run_task("complete", model, ck, cfg, n=3, samples=2)
    many = run_task("complete", model, ck, cfg, n=3, samples=2, batch=4)
    keys = ("case", "answer", "exact_match", "edit_similarity", "new_tokens", "forwards", "steps", "canvases")
    assert [{k: r[k] for k in keys} for r in many["cases"]] == [{k: r[k] for k in keys} for r in one["cases"]]
    assert many["tokens_per_forward"] == one["tokens_per_forward"]
    assert many["edit_similarity"] == one["edit_similarity"]


def test_eval_batch_must_be_positive(capsys):
    from dlm.cli import main

    assert main(["eval", "--model", str(CK / "mdlm-small"), "--task", "complete", "--n", "2", "--batch", "0"]) == 2
    err = capsys.readouterr().err
    assert "--cases-per-batch must be > 0" in err and len(err.strip().splitlines()) == 1


# speculative decoding and joint self-speculation -------------------------------------------------------

def _ck(objective: str = "ar"):
    """What the speculative and joint samplers read of a checkpoint."""
    return SimpleNamespace(objective=objective, path="tiny", tokenizer=SimpleNamespace(eos_id=EOS, eos_ids=[EOS], eos_set=frozenset([EOS])), mask_id=MASK,
                           block_size=4)


@pytest.fixture(scope="module")
def target():
    return with_eos(random_transformer(3, 0.3, **TINY), 6)


def _perturbed(model, seed: int, std: float):
    """A copy of `model` with noise on its weights: a drafter that agrees with it often, not always."""
    m = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)
    return m


def _dflash(version: int, passes: int = 1):
    torch.manual_seed(7 + version)
    extra = dict(conv_kernel_size=2, conv_group_size=8, selector_rank=4, selector_top_k=5) if version == 2 else {}
    d = DFlashDrafter(ModelConfig(**{**TINY, "n_layers": 1}), [0, 1], 5, mask_id=MASK, **extra)
    with torch.no_grad():  # (DFlash 2 starts as DFlash 1: random convolutions and codebooks, so they take part)
        for p in d.parameters():
            p.normal_(0, 0.3 if p.dim() >= 2 else 0.1).add_(1.0 if p.dim() == 1 else 0.0)
    return d.double().eval()


DRAFTERS = {
    "ar": lambda t: ARDraft(_perturbed(t, 1, 0.05), Sampling(), 256),
    "dflash": lambda t: DFlashDraft(_dflash(1), t, Sampling(), 256),
    "dflash-2-passes": lambda t: DFlashDraft(_dflash(1), t, Sampling(), 256, passes=2),
    "dflash2": lambda t: DFlashDraft(_dflash(2), t, Sampling(), 256),
    "dflash-tree": lambda t: DFlashDraft(_dflash(1), t, Sampling(), 256),
    "dflash2-tree": lambda t: DFlashDraft(_dflash(2), t, Sampling(), 256),
    "diffusion": lambda t: DiffusionDraft(_perturbed(t, 2, 0.05), MASK, 4, Sampling(), 256, passes=2),
    "lookup": lambda t: PromptLookup(2),  # (rows fork the drafter with their options: KIND_OPTIONS)
    "dflash2+lookup": lambda t: WithLookup(DFlashDraft(_dflash(2), t, Sampling(), 256), PromptLookup(2)),
    "ar+lookup": lambda t: WithLookup(ARDraft(_perturbed(t, 1, 0.05), Sampling(), 256), PromptLookup(2)),
    "self-spec-linear": lambda t: SelfDraft(t, MASK, 4, Sampling()),
    "self-spec-linear-ar": lambda t: SelfDraft(t, MASK, 4, Sampling(), ar_first=True),
}
KIND_OPTIONS = {"dflash-2-passes": dict(draft_passes=2), "dflash-tree": dict(draft_branches=2),
                "dflash2-tree": dict(draft_branches=3), "diffusion": dict(draft_passes=2), "lookup": dict(lookup_ngram=2),
                "dflash2+lookup": dict(lookup_ngram=2), "ar+lookup": dict(lookup_ngram=2)}
SPEC = [dict(), dict(temperature=1.0, seed=6), dict(temperature=0.8, top_k=8, seed=5)]


def _spec(target, kind: str, prompts, cfg):
    if kind == "self-spec-quadratic":
        return list(joint.stream(target, _ck("joint"), [Prompt(p) for p in prompts], cfg.replace(sampler=kind)))
    drafter = DRAFTERS[kind](target)
    return list(speculative.stream(target, _ck(), [Prompt(p) for p in prompts], cfg, drafter))


def _verified(events, n: int) -> list[list[tuple]]:
    out: list[list[tuple]] = [[] for _ in range(n)]
    for e in events:
        if isinstance(e, Verified):
            out[e.row].append((e.proposed, e.accepted))
    return out


def check_speculative_rows(target, kind: str, cfg):
    """PROMPTS as rows of one batch against each alone (row r seeded cfg.seed + r): the same tokens, draft for draft,
    rows stopping at different points; returns (batched events, tokens, stats, each row's events alone)."""
    events = _spec(target, kind, PROMPTS, cfg)
    tokens, _, stats = rows_of(events, len(PROMPTS))
    alone = [_spec(target, kind, [p], cfg.replace(seed=cfg.seed + r)) for r, p in enumerate(PROMPTS)]
    assert tokens == [rows_of(a, 1)[0][0] for a in alone]
    assert _verified(events, len(PROMPTS)) == [_verified(a, 1)[0] for a in alone]
    assert_stopping_points_differ(tokens, cfg.max_new_tokens)
    return events, tokens, stats, alone


@pytest.mark.parametrize("opts", SPEC, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "greedy")
@pytest.mark.parametrize("kind", [*DRAFTERS, "self-spec-quadratic"])
def test_speculative_rows_equal_each_row_alone(target, kind, opts):
    """Every kind of drafter (and joint's self-speculation): several prompts in one batch (one target forward per
    verify step, one drafter forward per draft step) give each row what it gets alone, draft for draft; greedy rows
    are the target's own greedy output (lossless, row by row)."""
    cfg = SampleConfig(max_new_tokens=20, block_size=4, **opts, **KIND_OPTIONS.get(kind, {}))
    events, tokens, stats, alone = check_speculative_rows(target, kind, cfg)
    own = [rows_of(a, 1)[2] for a in alone]
    assert [r["forwards"] for r in stats.extra["rows"]] == [st.forwards for st in own]
    assert [r["draft_forwards"] for r in stats.extra["rows"]] == [st.draft_forwards for st in own]
    assert stats.extra["cycles"] == sum(st.extra["cycles"] for st in own)
    assert stats.extra["acceptance_histogram"] == [sum(h) for h in zip(*(st.extra["acceptance_histogram"] for st in own))]
    assert stats.forwards < sum(st.forwards for st in own) and stats.extra["rows_per_forward"] > 1.5
    if kind in ("ar", "dflash", "diffusion"):
        assert 0 < stats.draft_forwards < sum(st.draft_forwards for st in own)  # the drafter's passes shared too
    if kind.endswith("-tree"):  # rows kept a later branch: its K/V moved within the row's own slots of the batch
        assert stats.extra["branched_cycles"] == sum(st.extra["branched_cycles"] for st in own) > 0
    assert any(n > 0 for v in _verified(events, len(PROMPTS)) for _, n in v)  # drafts were accepted ...
    assert any(n < len(d) for v in _verified(events, len(PROMPTS)) for d, n in v)  # ... and turned down
    if not cfg.temperature:
        assert tokens == [speculative.target_greedy(target, p, 20, EOS) for p in PROMPTS]


def test_speculative_rows_join_and_leave_a_running_batch(target):
    """Rows that join a running speculative batch (DFlash 2 drafting, each row its own options) and a row dropped
    halfway come out as they do alone."""
    base = DRAFTERS["dflash2"](target)
    batch = speculative.Batch(target, base.row_model, 64)  # (the slots grow as rows need them)
    cfgs = [SampleConfig(max_new_tokens=n, block_size=b, temperature=t, seed=s)
            for n, b, t, s in [(20, 4, 0.0, 0), (9, 3, 1.0, 1), (24, 5, 0.7, 2), (16, 2, 0.0, 3), (20, 4, 1.0, 4)]]
    got: list[list[int]] = [[] for _ in PROMPTS]
    arrive = {0: [0, 1], 2: [2], 5: [3, 4]}
    step = 0
    while step == 0 or len(batch) or any(k >= step for k in arrive):
        for r in arrive.get(step, []):
            c = cfgs[r]
            d = base.fork(c)
            d.sampling = Sampling(c.temperature, c.top_k, c.top_p, torch.Generator().manual_seed(c.seed))
            batch.add(speculative.speculation(d, PROMPTS[r], block_size=c.block_size, max_new_tokens=c.max_new_tokens,
                                              sampling=d.sampling, eos_id=EOS, row=r), tag=r)
        if step == 8 and batch.index(4) is not None:
            batch.drop(batch.index(4))
        if len(batch):
            for r, ev in batch.step():
                got[r] += ev.tokens if isinstance(ev, Commit) else []
        step += 1
    for r, c in enumerate(cfgs):
        alone = rows_of(_spec(target, "dflash2", [PROMPTS[r]], c), 1)[0][0]
        if r == 4:
            assert got[r] == alone[:len(got[r])] and len(got[r]) < len(alone)  # it left early
        else:
            assert got[r] == alone, r


def test_eval_task_with_a_drafter_in_batches_gives_the_same_answers_and_counters():
    """`dlm eval --draft D --cases-per-batch B`: speculative cases as rows of one batch, the same answers, scores, per-case
    counters and acceptance statistics as case by case (samples > 1: each sample its own seed)."""
    from dlm.drafters import load_drafter
    from dlm.tasks import run_task

    model, ck = load_model(CK / "ar-small")
    drafter = load_drafter(str(CK / "dflash-small"), model, ck)
    cfg = SampleConfig(max_new_tokens=8, temperature=1.0)
    one = run_task("complete", model, ck, cfg, drafter=drafter, n=3, samples=2)
    many = run_task("complete", model, ck, cfg, drafter=drafter, n=3, samples=2, batch=4)
    keys = ("case", "answer", "exact_match", "edit_similarity", "new_tokens", "forwards", "draft_forwards", "cycles",
            "tau", "acceptance_histogram")
    assert [{k: r[k] for k in keys} for r in many["cases"]] == [{k: r[k] for k in keys} for r in one["cases"]]
    for k in ("tokens_per_forward", "edit_similarity", "tau", "acceptance_histogram", "draft_forwards"):
        assert many[k] == one[k], k
