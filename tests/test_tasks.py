"""Tasks (dlm.tasks, `dlm eval --task`, `dlm task sudoku`): the sudoku generator against an independent solver,
the CSV layout, the character tokenizer, answer-only training, fill-in-the-middle data, the metrics, the
cases, every paradigm through every task, and bad --data."""

from __future__ import annotations

import json
import random

import pytest
import torch

from conftest import cli
from dlm.errors import DlmError
from dlm.tasks import sudoku


# an independent sudoku solver: plain backtracking in reading order over sets (the generator's uses bitmasks and
# the most constrained cell first)

def count_by_backtracking(grid: list[int], limit: int = 2) -> int:
    g = list(grid)

    def ok(i: int, d: int) -> bool:
        r, c = divmod(i, 9)
        if d in g[r * 9:r * 9 + 9] or d in g[c::9]:
            return False
        br, bc = r - r % 3, c - c % 3
        return all(g[(br + a) * 9 + bc + b] != d for a in range(3) for b in range(3))

    def solve(i: int, want: int) -> int:  # solutions found, at most `want`
        while i < 81 and g[i]:
            i += 1
        if i == 81:
            return 1
        n = 0
        for d in range(1, 10):
            if ok(i, d):
                g[i] = d
                n += solve(i + 1, want - n)
                g[i] = 0
                if n >= want:
                    break
        return n

    for i, v in enumerate(g):  # the givens must not clash already
        if v:
            g[i] = 0
            if not ok(i, v):
                return 0
            g[i] = v
    return solve(0, limit)


def test_generated_puzzles_have_exactly_one_solution():
    pairs = sudoku.generate(12, (34, 50), seed=7)
    for quiz, solution in pairs:
        grid = [int(c) for c in quiz]
        assert 34 <= sum(1 for v in grid if v) <= 50
        assert count_by_backtracking(grid) == 1
        assert sudoku.is_valid(quiz, [int(c) for c in solution])
        assert all(q in ("0", s) for q, s in zip(quiz, solution))
    assert pairs == sudoku.generate(12, (34, 50), seed=7)  # reproducible
    assert pairs[:3] == sudoku.generate(3, (34, 50), seed=7)  # puzzle k depends on (seed, k) only
    assert pairs != sudoku.generate(12, (34, 50), seed=8)


def test_the_counter_and_the_generators_solver_agree_on_ambiguous_and_broken_grids():
    quiz, solution = sudoku.generate(1, (40, 40), seed=1)[0]
    grid = [int(c) for c in quiz]
    rng = random.Random(0)
    givens = [i for i, v in enumerate(grid) if v]
    for _ in range(3):  # blank many givens: several solutions
        g = list(grid)
        for i in rng.sample(givens, 25):
            g[i] = 0
        assert sudoku.count_solutions(g) == count_by_backtracking(g) == 2
    g = list(grid)
    i = grid.index(0)
    g[i] = next(d for d in range(1, 10) if d != int(solution[i]))
    assert sudoku.count_solutions(g) == count_by_backtracking(g)  # 0 (a wrong digit) or 0 by a clash
    with pytest.raises(DlmError, match="--clues"):
        sudoku.parse_clues("10-20")
    with pytest.raises(DlmError, match="--clues"):
        sudoku.parse_clues("forty")


def test_grading_a_solution():
    quiz, solution = sudoku.generate(1, (45, 45), seed=2)[0]
    assert sudoku.grade(quiz, solution, solution) == {"accuracy": 1.0, "cell_accuracy": 1.0, "valid": 1.0,
                                                      "blanks": 36}
    blank = quiz.index("0")
    other = next(d for d in "123456789" if d != solution[blank])
    wrong = solution[:blank] + other + solution[blank + 1:]
    g = sudoku.grade(quiz, solution, wrong)
    assert g["accuracy"] == 0.0 and g["valid"] == 0.0 and g["cell_accuracy"] == pytest.approx(35 / 36)
    assert sudoku.grade(quiz, solution, "12x")["valid"] == 0.0


def test_the_csv_layout_round_trips_and_bad_csvs_are_refused(tmp_path):
    from dlm.data.corpus import Corpus
    from dlm.data.csvtask import SEP, read_pairs, write_pairs

    pairs = sudoku.generate(5, (40, 50), seed=3)
    path = tmp_path / "p.csv"
    write_pairs(path, pairs)
    assert path.read_text().splitlines()[0] == "quizzes,solutions"
    assert read_pairs(path) == pairs
    docs = Corpus(str(path)).documents
    assert [d.text for d in docs] == [q + SEP + s for q, s in pairs] and len(docs[0].text) == 163
    other = tmp_path / "extreme.csv"  # Sudoku-Extreme's spelling: source,q,a,rating with '.' blanks
    other.write_text("source,q,a,rating\nx," + pairs[0][0].replace("0", ".") + "," + pairs[0][1] + ",3\n")
    assert read_pairs(other) == pairs[:1]
    bad = {
        "header.csv": "a,b\n1,2\n",
        "short.csv": "quizzes,solutions\n123,456\n",
        "clash.csv": f"quizzes,solutions\n{pairs[0][0]},{pairs[1][1]}\n",
        "empty.csv": "",
        "noquiz.csv": "quizzes,solutions\n",
    }
    for name, text in bad.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(DlmError, match=name):
            read_pairs(tmp_path / name)
    (tmp_path / "latin1.csv").write_bytes(b"quizzes,solutions\n\xff\n")
    with pytest.raises(DlmError, match="not UTF-8"):
        read_pairs(tmp_path / "latin1.csv")


def test_the_character_tokenizer_gives_one_token_per_cell(tmp_path):
    from dlm.data.csvtask import pair_text
    from dlm.tokenizer import Tokenizer

    q, s = sudoku.generate(1, (45, 45), seed=4)[0]
    tok = Tokenizer.train_chars([pair_text(q, s)])
    assert tok.vocab_size == 16 + 1 + 11  # specials, <unk>, 0-9 and '='
    ids = tok.encode(pair_text(q, s))
    assert len(ids) == 81 + 1 + 81 and tok.decode(ids) == pair_text(q, s)
    tok.save(tmp_path / "tokenizer.json")
    back = Tokenizer.from_file(tmp_path)
    assert back.encode(q) == tok.encode(q) and back.mask_id == 3 and back.fim_prefix_id == 4
    assert back.encode("x1") == [16, back.encode("1")[0]]  # an unseen character is <unk>
    assert back.encode("<mask>") == [16] * 6  # special-token text is text (here: characters it has not seen)


def test_answer_positions_follow_the_separator_within_a_document():
    from dlm.objectives.base import answer_positions

    SEP, EOS = 9, 2
    x = torch.tensor([[5, 6, SEP, 7, 8, EOS, 5, SEP, 7, EOS],
                      [7, 8, EOS, 5, 5, SEP, 6, 6, 6, 6]])
    want = [[0, 0, 0, 1, 1, 0, 0, 0, 1, 0],
            [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]]  # a window that starts inside an answer marks nothing before its SEP
    assert answer_positions(x, SEP, EOS).int().tolist() == want


def test_answer_only_losses_ignore_the_prompt(tmp_path):
    from dlm.config import TrainConfig
    from dlm.model import Transformer
    from dlm.objectives import make_objective
    from dlm.tokenizer import Tokenizer

    tok = Tokenizer.train_chars(["0123456789="])
    sep = tok.encode("=")[0]
    for objective in ("ar", "mdlm"):
        cfg = TrainConfig(objective=objective, seq_len=12, answer_sep="=", data="x.csv").resolved()
        obj = make_objective(cfg, tok)
        torch.manual_seed(0)
        model = Transformer(obj.model_config())
        batch = torch.tensor([tok.encode("1234=5678") + [tok.eos_id] + tok.encode("12=")])
        loss, extra = obj.loss(model, batch, torch.Generator().manual_seed(1))
        loss = loss.detach()
        assert torch.isfinite(loss) and obj.sep_id == sep
        if objective == "ar":  # the targets are the four answer tokens 5678, nothing of the prompts
            import torch.nn.functional as F

            logits = model(batch[:, :-1]).logits[0].detach()
            want = F.cross_entropy(logits[4:8].float(), batch[0, 5:9])
            assert extra["answer_tokens"] == 4 and loss.item() == pytest.approx(want.item(), rel=1e-5)
        if objective == "mdlm":  # the prompt is never noised
            from dlm.noise import mask_corrupt

            ans = obj.answers(batch[:, :-1])
            _, masked = mask_corrupt(batch[:, :-1], torch.ones(1, 12), tok.mask_id, torch.Generator(), ans)
            assert masked.int().tolist()[0] == [0] * 5 + [1] * 4 + [0] * 3
            assert obj.unknowns(batch[:, :-1]).equal(ans)  # a code corpus: --keep-given is off
    with pytest.raises(DlmError, match="one token"):
        make_objective(TrainConfig(objective="ar", answer_sep="=="), tok)


def test_keep_given_noises_only_the_unknown_cells():
    from dlm.config import TrainConfig
    from dlm.noise import mask_corrupt
    from dlm.objectives import make_objective
    from dlm.objectives.base import given_positions
    from dlm.tokenizer import Tokenizer

    tok = Tokenizer.train_chars(["0123456789="])
    e = [tok.eos_id]
    # two puzzles of four cells: quiz 1020 -> 1324, quiz 0004 -> 3214; the givens are the quiz's non-zero cells
    x = torch.tensor([tok.encode("1020=1324") + e + tok.encode("0004=3214") + e])
    given = given_positions(x, tok.encode("=")[0], tok.eos_id)
    assert given.int().tolist()[0] == [0] * 5 + [1, 0, 1, 0] + [0] + [0] * 5 + [0, 0, 0, 1] + [0]
    cfg = TrainConfig(objective="mdlm", seq_len=x.shape[1], data="p.csv").resolved()
    assert cfg.keep_given  # the default for a .csv task corpus
    obj = make_objective(cfg, tok)
    _, masked = mask_corrupt(x, torch.ones_like(x, dtype=torch.float), tok.mask_id, torch.Generator(), obj.unknowns(x))
    assert masked.int().tolist()[0] == [0] * 5 + [0, 1, 0, 1] + [0] + [0] * 5 + [1, 1, 1, 0] + [0]
    off = make_objective(TrainConfig(objective="mdlm", seq_len=x.shape[1], data="p.csv", keep_given=False).resolved(), tok)
    assert off.unknowns(x).int().sum() == 8  # every answer cell, the givens too
    # a window that starts inside a document pins nothing of a prompt and nothing past its prompt's length
    assert not given_positions(x[:, 2:], tok.encode("=")[0], tok.eos_id)[0, :8].any()
    assert TrainConfig(objective="ar", data="p.csv").resolved().keep_given is False
    assert TrainConfig.from_dict({"objective": "mdlm"}).keep_given is False  # a run saved before the option
    for bad in (dict(objective="ar", keep_given=True), dict(objective="mdlm", answer_sep="", keep_given=True)):
        with pytest.raises(DlmError, match="--keep-given"):
            TrainConfig(**bad).validate()


def test_usdm_answer_canvas_noises_only_the_unknown_cells():
    from dlm.config import TrainConfig
    from dlm.objectives import make_objective
    from dlm.tokenizer import Tokenizer

    tok = Tokenizer.train_chars(["0123456789="])
    e = [tok.eos_id]
    # windows of one puzzle each (+ 1 token of the next document, as training windows hold T + 1 tokens)
    x = torch.tensor([tok.encode("1020=1324") + e + tok.encode("0"), tok.encode("0004=3214") + e + tok.encode("1")])
    cfg = TrainConfig(objective="usdm", seq_len=10, canvas_length=4, data="p.csv").resolved()
    assert cfg.answer_sep == "=" and cfg.keep_given  # the defaults for a .csv task corpus
    obj = make_objective(cfg, tok)
    unknown, start, canvas = obj.answer_canvas(x, 4)
    assert start.tolist() == [5, 5]  # the canvas is the answer, right after '='
    assert [tok.decode(r) for r in canvas.tolist()] == ["1324", "3214"]
    assert unknown.int().tolist() == [[0] * 5 + [0, 1, 0, 1] + [0, 0], [0] * 5 + [1, 1, 1, 0] + [0, 0]]
    # the loss: givens stay clean whatever t; the unknown cells are noised and scored
    from dlm.model import Transformer
    from dlm.config import preset
    torch.manual_seed(0)
    model = Transformer(preset("tiny", vocab_size=tok.vocab_size, self_cond=True))
    seen = {}
    import dlm.objectives.usdm as U
    real = U.canvas_embeds

    def spy(model, zt, probs):
        seen["zt"] = zt.clone()
        return real(model, zt, probs)

    U.canvas_embeds = spy
    try:
        loss, info = obj.loss(model, x, torch.Generator().manual_seed(0))
    finally:
        U.canvas_embeds = real
    assert torch.isfinite(loss) and info["canvas_loss"] > 0
    given = ~unknown.gather(1, start[:, None] + torch.arange(4))
    assert torch.equal(seen["zt"][given], canvas[given])
    with pytest.raises(DlmError, match="--answer-sep"):  # a window without a whole answer
        obj.answer_canvas(x[:, 6:], 4)
    with pytest.raises(DlmError, match="--keep-given"):
        TrainConfig(objective="usdm", answer_sep="", keep_given=True).validate()


def test_fim_documents_and_the_fim_rate(corpus_dir, tokenizer_path, tiny_ar):
    import numpy as np

    from dlm.config import TrainConfig
    from dlm.data.corpus import Corpus
    from dlm.data.tokens import fim_document, load_tokens, token_file
    from dlm.tokenizer import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    text = "def f(x):\n    return x + 1\n"
    ids = fim_document(tok, text, np.random.default_rng(0))
    pre, suf, mid = tok.fim_prefix_id, tok.fim_suffix_id, tok.fim_middle_id
    assert ids[0] == pre and ids.count(suf) == ids.count(mid) == 1 and ids.index(suf) < ids.index(mid)
    p, s, m = (tok.decode(ids[1:ids.index(suf)]), tok.decode(ids[ids.index(suf) + 1:ids.index(mid)]),
               tok.decode(ids[ids.index(mid) + 1:]))
    assert p + m + s == text  # prefix, suffix, middle: the document rearranged, nothing lost

    corpus = Corpus(str(corpus_dir))
    plain = load_tokens(corpus, tok, "train")
    half = load_tokens(corpus, tok, "train", 0.5, seed=0)
    assert token_file(corpus, tok, "train") != token_file(corpus, tok, "train", 0.5, 0)
    docs = int((plain == tok.eos_id).sum())
    fim_docs = int((half == pre).sum())
    assert 0.25 * docs < fim_docs < 0.75 * docs and int((plain == pre).sum()) == 0
    assert np.array_equal(half, load_tokens(corpus, tok, "train", 0.5, seed=0))  # reproducible

    assert TrainConfig(objective="ar").resolved().fim_rate == 0.5  # the default of a new AR run
    saved = json.loads((tiny_ar / "config.json").read_text())["train"]
    assert saved["fim_rate"] == 0.5 and saved["answer_sep"] == ""  # what the run trained with is recorded
    assert TrainConfig(objective="mdlm").resolved().fim_rate == 0.0
    assert TrainConfig.from_dict({"objective": "ar"}).fim_rate == 0.0  # a run saved before FIM existed
    assert TrainConfig(objective="ar", data="p.csv").resolved().answer_sep == "="
    for bad, match in ((dict(objective="mdlm", fim_rate=0.5), "--fim-rate"), (dict(fim_rate=1.5), "--fim-rate"),
                       (dict(objective="joint", answer_sep="="), "--answer-sep")):
        with pytest.raises(DlmError, match=match):
            TrainConfig(**bad).validate()


def test_metrics():
    from dlm.tasks.metrics import edit_similarity, exact_match, levenshtein

    assert levenshtein("kitten", "sitting") == 3 and levenshtein("", "abc") == 3 and levenshtein("ab", "ab") == 0
    assert exact_match("  x =  1 ", "x = 1") == 1.0 and exact_match("x=1", "x = 1") == 0.0
    assert edit_similarity("abcd", "abce") == pytest.approx(0.75)
    assert edit_similarity("", "") == 1.0 and edit_similarity("", "abc") == 0.0
    assert edit_similarity("return   x", "return x") == 1.0


def test_completion_and_infill_cases(corpus_dir):
    from dlm.tasks import complete, infill
    from dlm.tasks.common import source_files

    files = {s.name: s.text for s in source_files(str(corpus_dir))}
    cs = complete.cases(str(corpus_dir), 20, seed=0)
    assert len(cs) == 20 and len({c.name for c in cs}) == 20
    assert [c.name for c in cs] == [c.name for c in complete.cases(str(corpus_dir), 20, seed=0)]
    assert [c.name for c in cs] != [c.name for c in complete.cases(str(corpus_dir), 20, seed=1)]
    for c in cs:
        name, line = c.name.rsplit(":", 1)
        assert c.target.strip() and files[name].startswith(c.prefix + "\n" + c.target)
        assert files[name].splitlines()[int(line) - 1] == c.target
    assert complete.next_line("x)\n    return y\nz") == "    return y" and complete.next_line("no newline") == ""
    for span in ("line", "lines"):
        for c in infill.cases(str(corpus_dir), 20, seed=0, span=span):
            name = c.name.rsplit(":", 1)[0]
            assert c.prefix + c.info["middle"] + c.suffix == files[name]
            assert 1 <= c.info["lines"] <= (1 if span == "line" else 5) and c.target.strip()
            assert infill.cut(c.info["middle"], c.info["lines"]).rstrip() == c.target.rstrip()
    with pytest.raises(DlmError, match="--span"):
        infill.cases(str(corpus_dir), 2, 0, "word")


def _shipped(name):
    from dlm.checkpoint import shipped

    p = shipped(name)
    if p is None:
        pytest.skip(f"the shipped checkpoint {name} is missing")
    return str(p)


@pytest.mark.parametrize("task,extra", [("complete", []), ("infill", ["--span", "lines"])])
def test_every_paradigm_runs_the_code_tasks(task, extra):
    base = ["eval", "--task", task, "--n", "2", "--json", *extra]
    runs = [["--model", _shipped("ar-small")], ["--model", _shipped("mdlm-small")],
            ["--model", _shipped("usdm-small"), "--steps", "8"],
            ["--model", _shipped("ar-small"), "--draft", "lookup"]]
    for args in runs:
        code, out, err = cli(*base, *args, "--max-new-tokens", "12")
        assert code == 0, err
        res = json.loads(out)
        assert res["task"] == task and res["n"] == 2
        assert {"exact_match", "edit_similarity", "tokens_per_forward", "forwards", "seconds"} <= set(res)
        assert 0 <= res["edit_similarity"] <= 1 and res["forwards"] > 0
        assert ("tau" in res) == ("--draft" in args)
        if "tau" in res:  # the summed histogram is the pooled tau's: sum(n * h[n]) / sum(h) over the cases' cycles
            h = res["acceptance_histogram"]
            assert sum(h) == res["cycles"] > 0 and h[0] == 0
            assert sum(n * c for n, c in enumerate(h)) / sum(h) == pytest.approx(res["tau"])


@pytest.fixture(scope="module")
def sudoku_models(tmp_path_factory):
    """Tiny AR, mdlm and usdm on 300 puzzles with the character tokenizer (trained for a few steps: the pipeline,
    not skill)."""
    from dlm.config import TrainConfig
    from dlm.data.csvtask import write_pairs
    from dlm.train import train

    root = tmp_path_factory.mktemp("sudoku")
    data = root / "train.csv"
    write_pairs(data, sudoku.generate(300, (40, 50), seed=0))
    out = {}
    for obj in ("ar", "mdlm", "usdm"):
        cfg = TrainConfig(objective=obj, preset="tiny", tokenizer="char", data=str(data), seq_len=164, batch_size=4,
                          max_steps=2, eval_every=2, eval_batches=1, save_every=2, log_every=1, canvas_length=81)
        out[obj] = train(cfg, root / obj, quiet=True)
    test = root / "test.csv"
    write_pairs(test, sudoku.generate(3, (40, 50), seed=1))
    return out, test


def test_every_paradigm_runs_sudoku(sudoku_models):
    models, test = sudoku_models
    cfg = json.loads((models["mdlm"] / "config.json").read_text())
    assert cfg["train"]["answer_sep"] == "=" and cfg["tokenizer"]["vocab_size"] == 28
    for args in (["--model", str(models["ar"])], ["--model", str(models["ar"]), "--draft", "lookup"],
                 ["--model", str(models["mdlm"]), "--steps", "10"], ["--model", str(models["usdm"]), "--steps", "4"]):
        code, out, err = cli("eval", "--task", "sudoku", "--data", str(test), "--n", "2", "--json", *args)
        assert code == 0, err
        res = json.loads(out)
        assert res["task"] == "sudoku" and res["n"] == 2
        assert {"accuracy", "cell_accuracy", "valid", "tokens_per_forward", "forwards", "seconds"} <= set(res)
        assert 0 <= res["cell_accuracy"] <= 1
    # mdlm fills only the blanks (the givens are pinned): at 10 steps, >= 3 cells per forward
    code, out, _ = cli("eval", "--task", "sudoku", "--data", str(test), "--n", "1", "--json",
                       "--model", str(models["mdlm"]), "--steps", "10")
    assert json.loads(out)["forwards"] == 10 and json.loads(out)["tokens_per_forward"] >= 3


def test_best_of_a_usdm_model_keeps_the_draw_it_scores_highest(sudoku_models):
    """usdm scores a canvas by the model's log-probability of its final tokens at the last step: --best-of keeps the
    draw (seed, seed + 1, ...) with the highest, as each draw reports it alone; AR has no --best-of."""
    from dlm.checkpoint import load_model
    from dlm.sampling import SampleConfig
    from dlm.tasks import run_task

    models, test = sudoku_models
    net, ck = load_model(models["usdm"])
    cases = sudoku.cases(str(test), 2, 0)
    cfg = SampleConfig(seed=3, steps=4)
    singles = [run_task("sudoku", net, ck, cfg.replace(seed=3 + t), cases=cases)["cases"] for t in range(3)]
    res = run_task("sudoku", net, ck, cfg, cases=cases, best_of=3, batch=6)
    for i, r in enumerate(res["cases"]):
        draws = [rows[i] for rows in singles]
        assert all(d["logprob"] < 0 for d in draws) and len({d["logprob"] for d in draws}) == 3
        best = max(draws, key=lambda d: d["logprob"])
        assert r["answer"] == best["answer"] and r["forwards"] == sum(d["forwards"] for d in draws)
    code, _, err = cli("eval", "--task", "sudoku", "--data", str(test), "--n", "1", "--model", str(models["ar"]),
                       "--temperature", "1", "--best-of", "2")
    assert code == 2 and "--best-of: an mdlm or usdm checkpoint" in err and len(err.strip().splitlines()) == 1


def test_dlm_task_sudoku_writes_the_public_layout(tmp_path):
    from dlm.data.csvtask import read_pairs

    out = tmp_path / "s.csv"
    code, stdout, err = cli("task", "sudoku", "--n", "4", "--clues", "44-46", "--seed", "5", "--out", str(out))
    assert code == 0, err and "wrote" in stdout
    pairs = read_pairs(out)
    assert pairs == sudoku.generate(4, (44, 46), seed=5)
    for args, needle in (([ "--clues", "9"], "--clues"), (["--out", str(tmp_path / "s.txt")], "--out")):
        full = ["task", "sudoku", "--n", "2", "--out", str(out), *args]
        code, _, err = cli(*full)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1


def test_bad_data_exits_2_with_one_line(tmp_path):
    ar = _shipped("ar-small")
    (tmp_path / "empty.py").write_text("")
    (tmp_path / "latin1.py").write_bytes(b"x = '\xe9'\n")
    (tmp_path / "wide.csv").write_text("quizzes,solutions,x\n1,2,3\n")
    (tmp_path / "emptydir").mkdir()
    for task, data, needle in (("complete", tmp_path / "missing", "no such"),
                               ("complete", tmp_path / "empty.py", "empty"),
                               ("infill", tmp_path / "latin1.py", "not UTF-8"),
                               ("complete", tmp_path / "emptydir", "empty"),
                               ("sudoku", tmp_path / "wide.csv", "81 digits"),
                               ("sudoku", tmp_path / "missing.csv", "no such"),
                               ("sudoku", tmp_path / "latin1.py", "not UTF-8"),
                               ("sudoku", tmp_path / "emptydir", "is a folder")):
        code, out, err = cli("eval", "--model", ar, "--task", task, "--data", str(data), "--n", "1", "--json")
        assert code == 2 and out == "", (task, data, err)
        assert err.startswith("dlm: error: ") and needle in err and len(err.strip().splitlines()) == 1, err
    code, _, err = cli("eval", "--model", ar, "--task", "poetry")
    assert code == 2 and "--task must be one of" in err
    code, _, err = cli("eval", "--model", ar, "--task", "complete", "--split", "train", "--n", "1")
    assert code == 2 and "--split with --task" in err and len(err.strip().splitlines()) == 1


def test_code_tasks_tune_on_the_val_split_apart_from_test():
    from dlm.tasks import complete, infill
    from dlm.tasks.common import source_files

    val, test = ({s.name for s in source_files(None, sp)} for sp in ("val", "test"))
    assert val and test and not val & test
    for mod in (complete, infill):
        names = {c.name.rsplit(":", 1)[0] for c in mod.cases(None, 8, 0, "line", "val")}
        assert names <= val


# the bench -------------------------------------------------------------------------------------------------------

def test_bench_interleaves_round_robin_and_rotates_each_repetition():
    from dlm.bench.harness import Item, Method, run_interleaved, schedule

    assert schedule(3, 2, 3) == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 1, 2),
                                 (1, 0, 1), (1, 0, 2), (1, 0, 0), (1, 1, 1), (1, 1, 2), (1, 1, 0),
                                 (2, 0, 2), (2, 0, 0), (2, 0, 1), (2, 1, 2), (2, 1, 0), (2, 1, 1)]
    calls = []
    methods = [Method(n, "ar", None, None, None) for n in "abc"]
    items = [Item(None, f"case{i}") for i in range(2)]

    def run(m, it):
        calls.append((m.name, it.case))
        return {"who": m.name, "case": it.case, "n": len(calls)}

    rows = run_interleaved(methods, items, 2, 1, run)
    assert calls[:3] == [("a", "case0"), ("b", "case0"), ("c", "case0")]  # each warmed up on its own, first
    assert [c[0] for c in calls[3:]] == list("abcabc" + "bcabca")
    assert all(rows[k][r][i]["who"] == "abc"[k] and rows[k][r][i]["case"] == f"case{i}"
               for k in range(3) for r in range(2) for i in range(2))


def test_bench_reports_medians_min_max_and_same_round_ratios():
    from dlm.bench.harness import Method
    from dlm.bench.stats import summarize
    from dlm.bench.tables import cell

    def row(sec, tokens=10):
        return {"tokens_per_second": tokens / sec, "tokens_per_forward": 1.0, "ttft": 0.01, "new_tokens": tokens,
                "forwards": tokens, "seconds": sec, "exact_match": 1.0}

    base = [[row(1.0), row(1.0), row(1.0)], [row(2.0), row(2.0), row(2.0)]]  # round 2: the machine got slower
    fast = [[row(0.5), row(0.5), row(1.0)], [row(1.0), row(1.0), row(2.0)]]  # twice as fast, in the same rounds
    s = summarize(Method("m", "spec", None, None, None), fast, base, ("exact_match",), "complete_")
    assert s["speedup"] == 2.0 and s["speedup_range"] == [2.0, 2.0]  # per-case ratios of the same round
    assert s["tokens_per_second"] == pytest.approx(15.0) and s["tokens_per_second_range"] == [10.0, 20.0]
    assert s["complete_exact_match"] == 1.0 and s["repeat"] == 2
    assert cell(s, "speedup", ".2f", True) == "2.00 (2.00-2.00)"
    assert cell({"repeat": 3, "x": 1.0, "x_range": [0.4, 1.6]}, "x", ".2f", True) == "noisy*"  # spread > figure


def test_bench_rows_carry_task_metrics_and_the_pareto_sweep_writes_a_plot(sudoku_models, tmp_path):
    from dlm.bench import run_bench

    models, test = sudoku_models
    out = tmp_path / "b.json"
    rep = run_bench(str(models["ar"]), prompts=1, max_new_tokens=81, out=str(out), data=str(test), warmup=0,
                    naive=False, quiet=True, mdlm=str(models["mdlm"]), repeat=2, task="sudoku")
    rows = {s["method"]: s for s in rep["summaries"]}
    assert rep["repeat"] == 2 and rep["task"] == "sudoku" and "mdlm confidence steps=81" in rows
    assert {"mdlm confidence block=4 steps=2", "mdlm confidence block=8 steps=4"} <= set(rows)
    for s in rows.values():
        assert {"accuracy", "cell_accuracy", "valid", "tokens_per_forward", "tokens_per_second_range",
                "speedup_vs_ar", "speedup_vs_ar_range"} <= set(s)
    assert all(len(r["seconds_per_repetition"]) == 2 for r in rep["per_case"]["ar (KV cache)"])
    assert out.with_suffix(".png").stat().st_size > 1000


def test_learned_positions_the_puzzle_preset_adds(tmp_path):
    from dlm.config import preset
    from dlm.hf import export_hf
    from dlm.model import Transformer
    from dlm.tokenizer import Tokenizer

    cfg = preset("puzzle", vocab_size=28)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    assert cfg.learned_pos and model.num_params() == cfg.num_params()
    x = torch.randint(0, 28, (2, 12))
    with torch.no_grad():
        full = model(x).logits
        cache = model.new_cache(2, 12)
        parts = torch.cat([model(x[:, :5], cache=cache).logits, model(x[:, 5:], cache=cache).logits], 1)
        shifted = model(x, pos=torch.arange(1, 13)).logits
    assert torch.allclose(full, parts, atol=1e-5)  # the cache's positions are the embedding's positions
    assert not torch.allclose(full, shifted, atol=1e-3)  # absolute positions matter (RoPE alone would not see it)
    with pytest.raises(DlmError, match="learned absolute positions"):
        export_hf(model, Tokenizer.train_chars(["0123456789="]), tmp_path / "hf")


def test_grid_positions_give_a_cells_row_column_and_box(tmp_path):
    from dlm.config import ModelConfig, preset
    from dlm.model import Transformer, param_shapes

    cfg = preset("sudoku", vocab_size=28)
    torch.manual_seed(0)
    model = Transformer(cfg).eval()
    assert cfg.grid_pos == 9 and model.num_params() == cfg.num_params()
    shapes, aliases = param_shapes(cfg)
    assert {k: tuple(v.shape) for k, v in model.state_dict().items() if k not in aliases} == shapes
    g = model.grid_embed
    for table in (g.row, g.col, g.box):
        torch.nn.init.eye_(table.weight[:, :10])  # one-hot: row r -> dim r, and so on
    pos = torch.arange(164)  # QUIZ (0..80) = (81) SOLUTION (82..162) <eos> (163)
    e = g(pos)  # (164, D): the sum of three one-hot rows
    which = lambda p: sorted(int(i) for i in torch.nonzero(e[p, :10]))  # noqa: E731
    cell = lambda r, c: r * 9 + c  # noqa: E731
    assert which(cell(4, 7)) == [4, 5, 7]  # row 4, column 7, box 5
    assert which(cell(0, 0)) == [0]  # row 0, column 0, box 0: one dim, three times
    assert torch.equal(e[cell(4, 7)], e[82 + cell(4, 7)])  # the solution's cell is the quiz's cell
    assert torch.equal(e[81], e[163]) and which(81) == [9]  # separator and <eos>: index 9 in every table
    for p in range(81):  # the boxes: cells (r, c) of box (r // 3) * 3 + c // 3
        box = e[p] - g.row.weight[p // 9] - g.col.weight[p % 9]
        assert torch.allclose(g.box.weight[(p // 9 // 3) * 3 + p % 9 // 3], box, atol=1e-6)
    for bad in (8, 3, 81):
        with pytest.raises(DlmError, match="grid_pos"):
            ModelConfig(vocab_size=28, grid_pos=bad)


def test_the_pareto_front_holds_the_ar_row_when_it_is_the_best_quality():
    """bench.png's front is over every row: AR, at the best quality and one token per forward, is on it, and a
    diffusion row it beats on both axes (slower, worse) is not."""
    from dlm.bench.stats import front_of

    rows = [{"paradigm": "ar", "tokens_per_forward": 1.0, "seconds": 0.10, "q": 0.36},
            {"paradigm": "mdlm", "tokens_per_forward": 4.0, "seconds": 0.08, "q": 0.30},
            {"paradigm": "mdlm", "tokens_per_forward": 1.0, "seconds": 0.30, "q": 0.28},
            {"paradigm": "usdm", "tokens_per_forward": 3.5, "seconds": 0.09, "q": 0.10}]
    assert front_of(rows, "tokens_per_forward", "q") == [(1.0, 0.36), (4.0, 0.30)]
    assert front_of(rows, "seconds", "q") == [(0.10, 0.36), (0.08, 0.30)]  # less time is better
