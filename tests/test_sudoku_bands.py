"""Sudoku by difficulty and revision for masked diffusion: the sparse-puzzle generator (hard and extreme bands),
`dlm eval --task sudoku --clues`, and mdlm's `--revise` (a committed token sent back to <mask>) on a hand-made
model."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from conftest import cli
from dlm.errors import DlmError
from dlm.model import Transformer
from dlm.sampling import SampleConfig
from dlm.sampling.common import Commit, Stats, Step
from dlm.sampling.mdlm import MAX_REVISIONS, Job, Rule, check_options, denoise_sequence
from dlm.tasks import sudoku
from test_tasks import count_by_backtracking

# the hand-made model --------------------------------------------------------------------------------------------

V, EOS, MASK = 8, 1, 3
A, B, C, D = 4, 5, 6, 7
PA, PB, PC = 1, 2, 3  # positions of the three holes after a one-token prompt


class Fickle(torch.nn.Module):
    """A model written by hand. Position PA, masked, is A for sure while PB is masked and C once PB holds B;
    PB is B (p ~ 0.95), PC is D (less sure), so PA commits first, then PB, then PC. A visible token is itself
    for sure, except A at PA once PB holds B (then C); `always`: a masked PA is always A, a visible A never believed."""

    def __init__(self, always: bool = False):
        super().__init__()
        self.always = always
        self.cfg = SimpleNamespace(max_seq_len=16)
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    @property
    def device(self):
        return self.dummy.device

    def new_cache(self, *a, **kw):
        return None

    rows_forward = Transformer.rows_forward  # a row's forward: the final hidden states (here its logits)

    def head(self, h):  # (its final hidden states are its logits)
        return h

    def forward(self, tokens, *, pos, **kw):
        x = tokens[0]
        logits = torch.zeros(1, len(x), V)
        for j, p in enumerate(pos.tolist()):
            if p == PA:
                if x[j] == MASK:
                    logits[0, j, A if x[PB] == MASK or self.always else C] = 12.0
                elif x[j] == A and (self.always or x[PB] == B):
                    logits[0, j, C] = 12.0
                else:
                    logits[0, j, x[j]] = 12.0
            elif p in (PB, PC) and x[j] == MASK:
                logits[0, j, B if p == PB else D] = 5.0 if p == PB else 2.0
            else:
                logits[0, j, x[j]] = 12.0
        return SimpleNamespace(logits=logits, last=logits, taps={})


def run(model, revise: float):
    job = Job([2, None, None, None], 1, [(0, 4)], stop_at_eos=False, forbid_eos=True)
    stats = Stats()
    events = list(denoise_sequence(model, job, Rule(), None, MASK, EOS, temperature=0.0, top_k=0, top_p=1.0,
                                   gen=None, naive=True, stats=stats, revise=revise))
    out = [t for e in events if isinstance(e, Commit) for t in e.tokens]
    return out, stats, [e for e in events if isinstance(e, Step)]


def test_revise_sends_a_committed_token_back_and_off_changes_nothing():
    out, stats, steps = run(Fickle(), 0.0)
    assert out == [A, B, D] and stats.forwards == 3 and "revisions" not in stats.extra  # masked diffusion: A stays
    assert all(all(b >= a for a, b in zip(s.fixed, t.fixed)) for s, t in zip(steps, steps[1:]))  # never unmasked
    again, same, _ = run(Fickle(), 1e-12)  # on, but nothing falls below: the same tokens and passes
    assert again == out and same.forwards == stats.forwards and same.extra["revisions"] == 0
    out, stats, steps = run(Fickle(), 0.5)
    assert out == [C, B, D]  # A was committed first, then sent back once B made it unlikely, and re-predicted
    assert stats.extra["revisions"] == 1 and stats.forwards == 4
    assert steps[1].fixed[0] and not steps[2].fixed[0] and steps[2].canvas[0] == MASK  # committed, then revised


def test_the_sampler_scores_what_it_commits():
    """stats.extra["logprob"]: the model's log-probability of each token when it is committed, summed (what --best-of
    ranks draws by). The hand-made model commits A (logit 12), B (5), D (2) against zeros, <mask> and <eos> barred."""
    _, stats, _ = run(Fickle(), 0.0)
    want = sum(math.log(math.exp(a) / (math.exp(a) + V - 3)) for a in (12.0, 5.0, 2.0))
    assert stats.extra["logprob"] == pytest.approx(want, abs=1e-5)


def test_revision_ends_when_the_model_never_believes_a_token(monkeypatch):
    from dlm.sampling import mdlm

    out, stats, _ = run(Fickle(always=True), 0.5)  # A, sent back while holes remain; the last hole ends the block
    assert 1 <= stats.extra["revisions"] <= MAX_REVISIONS and out == [A, B, D]
    assert stats.forwards == 3 + stats.extra["revisions"]  # a pass that revises commits another hole
    monkeypatch.setattr(mdlm, "MAX_REVISIONS", 1)  # the cap binds: A is sent back once, then kept
    out, stats, _ = run(Fickle(always=True), 0.5)
    assert stats.extra["revisions"] == 1 and out == [A, B, D] and stats.forwards == 4


@pytest.mark.parametrize("bad", [-0.1, 1.0, float("nan")])
def test_bad_revise_is_refused(bad):
    with pytest.raises(DlmError, match="--revise must be in"):
        check_options(SampleConfig(revise=bad))


# difficulty bands ------------------------------------------------------------------------------------------------

def test_sparse_puzzles_have_one_solution_and_the_band_s_clues():
    import random

    for k in range(2):  # the local search of the hard and extreme bands (a mild band here: the test stays quick)
        quiz, solution = sudoku.make_sparse(random.Random(k), 24, (23, 25))
        assert 23 <= sudoku.clues_of(quiz) <= 25
        assert count_by_backtracking([int(c) for c in quiz]) == 1
        assert all(q == "0" or q == s for q, s in zip(quiz, solution))
        assert (quiz, solution) == sudoku.make_sparse(random.Random(k), 24, (23, 25))
    assert sudoku.SPARSE > 23  # generate() sends a draw of 23 clues there


def test_symmetric_copies_keep_the_clues_and_the_one_solution(tmp_path):
    from dlm.data.csvtask import read_pairs, write_pairs

    pairs = sudoku.generate(3, (30, 34), seed=4)
    copies = sudoku.augment(pairs, 4, seed=0)
    assert len(copies) == 12 and set(pairs) <= set(copies) and len(set(copies)) == 12
    for quiz, solution in copies:
        assert sudoku.is_valid(quiz, sudoku.parse_grid(solution))
        assert count_by_backtracking([int(c) for c in quiz]) == 1
    assert sorted(sudoku.clues_of(q) for q, _ in copies) == sorted([sudoku.clues_of(q) for q, _ in pairs] * 4)
    src, out = tmp_path / "src.csv", tmp_path / "out.csv"
    write_pairs(src, pairs + sudoku.generate(2, (44, 46), seed=4))
    code, stdout, _ = cli("task", "sudoku", "--source", str(src), "--clues", "30-34", "--augment", "2",
                          "--out", str(out))
    assert code == 0 and "6 puzzles" in stdout and set(pairs) <= set(read_pairs(out))
    for args, needle in ((["--augment", "0"], "--augment must be >= 1"), (["--clues", "20-21"], "no puzzle has")):
        code, _, err = cli("task", "sudoku", "--source", str(src), "--out", str(out), *args)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1
    before = src.read_bytes()
    code, _, err = cli("task", "sudoku", "--source", str(src), "--clues", "30-34", "--out", str(src))
    assert code == 2 and "is the --source file" in err and src.read_bytes() == before


def test_eval_clues_band(tmp_path):
    from dlm.data.csvtask import write_pairs

    data = tmp_path / "mixed.csv"
    pairs = sudoku.generate(3, (44, 46), seed=1) + sudoku.generate(3, (30, 32), seed=1)
    write_pairs(data, pairs)
    hard = sudoku.cases(str(data), 10, 0, clues="30-35")
    assert len(hard) == 3 and all(30 <= sudoku.clues_of(c.prefix) <= 32 for c in hard)
    fresh = sudoku.cases(None, 2, 0, clues="36-38")
    assert all(36 <= sudoku.clues_of(c.prefix) <= 38 for c in fresh)
    with pytest.raises(DlmError, match="no puzzle has 20-21 clues"):
        sudoku.cases(str(data), 10, 0, clues="20-21")
    for args, needle in ((["--task", "complete"], "--clues goes with --task sudoku"),
                         (["--task", "sudoku", "--data", str(data)], "--clues must")):
        code, _, err = cli("eval", "--model", str(tmp_path), "--clues", "9", *args)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def tiny_sudoku_mdlm(tmp_path_factory):
    """A tiny mdlm on 100 puzzles with the character tokenizer, two steps (the pipeline, not skill)."""
    from dlm.config import TrainConfig
    from dlm.data.csvtask import write_pairs
    from dlm.train import train

    root = tmp_path_factory.mktemp("sudoku-bands")
    write_pairs(root / "train.csv", sudoku.generate(100, (40, 50), seed=0))
    cfg = TrainConfig(objective="mdlm", preset="tiny", tokenizer="char", data=str(root / "train.csv"), seq_len=164,
                      batch_size=4, max_steps=2, eval_every=2, eval_batches=1, save_every=2, log_every=1)
    return train(cfg, root / "mdlm", quiet=True)


def test_eval_clues_reports_the_band(tiny_sudoku_mdlm):
    code, out, err = cli("eval", "--task", "sudoku", "--clues", "44-45", "--n", "1", "--json", "--model",
                         str(tiny_sudoku_mdlm), "--steps", "8", "--revise", "0.3")
    assert code == 0, err
    res = json.loads(out)
    assert res["clues"] == "44-45" and res["n"] == 1 and res["forwards"] >= 8 and res["revisions"] >= 0


# --tries: a decoder that consults the rules ------------------------------------------------------------------------

def test_tries_samples_again_only_the_grids_that_break_the_rules(tiny_sudoku_mdlm):
    """A grid that breaks the rules is sampled again with the next seed: the row keeps the last try's answer and the
    work of every try; a valid grid is never sampled again (the shipped sudoku-mdlm solves easy puzzles)."""
    from dlm.checkpoint import load_model
    from dlm.tasks import run_task

    net, ck = load_model(tiny_sudoku_mdlm)
    cases = sudoku.cases(None, 3, 0, clues="44-45")
    cfg = SampleConfig(temperature=1.0, seed=5, steps=8, max_new_tokens=81)
    singles = [run_task("sudoku", net, ck, cfg.replace(seed=5 + t), cases=cases)["cases"] for t in range(3)]
    assert not any(r["valid"] for rows in singles for r in rows)  # two training steps: no grid obeys the rules
    assert len({r["answer"] for rows in singles for r in rows[:1]}) > 1  # the seeds differ
    for batch in (1, 3):
        res = run_task("sudoku", net, ck, cfg, cases=cases, tries=3, batch=batch)
        assert res["rule_checked"] == 3 and res["tries"] == 3
        for i, r in enumerate(res["cases"]):
            assert r["tries"] == 3 and r["answer"] == singles[2][i]["answer"]
            assert r["forwards"] == sum(rows[i]["forwards"] for rows in singles)
            assert r["new_tokens"] == singles[2][i]["new_tokens"]  # the kept answer's tokens
    good, gck = load_model("checkpoints/sudoku-mdlm")
    easy = sudoku.cases(None, 3, 0, clues="46-50")
    once = run_task("sudoku", good, gck, cfg, cases=easy)
    res = run_task("sudoku", good, gck, cfg, cases=easy, tries=4)
    assert once["accuracy"] == 1.0 and res["tries"] == 1.0
    assert [r["answer"] for r in res["cases"]] == [r["answer"] for r in once["cases"]]
    assert res["forwards"] == once["forwards"]


def test_best_of_keeps_the_draw_the_model_scores_highest(tiny_sudoku_mdlm):
    """--best-of N: every case drawn N times (seeds seed, seed + 1, ...); the row is the draw whose committed tokens
    the model gives the highest total log-probability, as each draw reports it run alone, with every draw's
    forwards."""
    from dlm.checkpoint import load_model
    from dlm.tasks import run_task

    net, ck = load_model(tiny_sudoku_mdlm)
    cases = sudoku.cases(None, 3, 0, clues="44-45")
    cfg = SampleConfig(temperature=1.0, seed=5, steps=8, max_new_tokens=81)
    singles = [run_task("sudoku", net, ck, cfg.replace(seed=5 + t), cases=cases)["cases"] for t in range(4)]
    for batch in (1, 4):
        res = run_task("sudoku", net, ck, cfg, cases=cases, best_of=4, batch=batch)
        assert res["best_of"] == 4
        for i, r in enumerate(res["cases"]):
            draws = [rows[i] for rows in singles]
            assert len({d["logprob"] for d in draws}) > 1  # the draws differ in score
            best = max(draws, key=lambda d: d["logprob"])
            assert r["answer"] == best["answer"] and r["logprob"] == pytest.approx(best["logprob"], abs=1e-3)
            assert r["forwards"] == sum(d["forwards"] for d in draws) and r["new_tokens"] == best["new_tokens"]
    # pick vote: the answer most draws agree on (the score breaks ties); here draws 0 and 2 are made to agree
    from dlm import tasks

    real = tasks.run_cases

    def agreeing(task, items, *a):
        rows = real(task, items, *a)
        for r, (_, c) in zip(rows, items):
            if c.seed in (5, 7):  # draws 0 and 2 of each case write one answer, both with the lowest scores
                r["answer"], r["logprob"] = "same" + r["case"], -1e9 - c.seed
        return rows

    tasks.run_cases = agreeing
    try:
        res = run_task("sudoku", net, ck, cfg, cases=cases, best_of=4, batch=4, pick="vote")
    finally:
        tasks.run_cases = real
    assert res["pick"] == "vote" and all(r["answer"] == "same" + r["case"] for r in res["cases"])
    assert all(r["logprob"] == -1e9 - 5 for r in res["cases"])  # the tie between them broken by the score


def test_tries_bad_input_is_one_line(tiny_sudoku_mdlm):
    m = str(tiny_sudoku_mdlm)
    for args, needle in ((["--task", "sudoku", "--tries", "0", "--temperature", "1"], "--tries must be in [1, 1024]"),
                         (["--task", "sudoku", "--tries", "2"], "--tries needs --temperature > 0"),
                         (["--task", "complete", "--tries", "2", "--temperature", "1"], "has no rule checker"),
                         (["--tries", "2"], "--tries goes with --task sudoku"),
                         (["--task", "sudoku", "--best-of", "2"], "--best-of needs --temperature > 0"),
                         (["--task", "sudoku", "--best-of", "0", "--temperature", "1"], "--best-of must be in [1, 1024]"),
                         (["--task", "sudoku", "--best-of", "2", "--tries", "2", "--temperature", "1"],
                          "two decoders"),
                         (["--best-of", "2"], "--best-of goes with --task")):
        code, _, err = cli("eval", "--model", m, "--n", "1", *args)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    code, out, err = cli("eval", "--model", m, "--task", "sudoku", "--clues", "44-45", "--n", "1", "--steps", "4",
                         "--temperature", "1", "--tries", "2")
    assert code == 0 and "rule-checked: up to 2 tries" in out, err
