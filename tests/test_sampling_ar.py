"""AR generation: cached decoding equals the naive loop, batches equal single prompts, the knobs work."""

import pytest
import torch

from dlm.checkpoint import load_model
from dlm.config import preset
from dlm.errors import DlmError
from dlm.model import Transformer
from dlm.sampling import SampleConfig, generate
from dlm.sampling.ar import decode, decode_naive
from dlm.sampling.common import Commit, Done, drain, probs_from_logits, sample_from, sample_token


def tokens(events):
    return drain(events, lambda t: "", None).tokens[0]


@pytest.mark.parametrize("seed", range(4))
def test_cached_greedy_equals_naive_loop_on_random_models(seed):
    torch.manual_seed(seed)
    m = Transformer(preset("tiny", vocab_size=50, n_layers=2 + seed % 2)).eval()
    prompt = torch.randint(0, 50, (5 + 3 * seed,), generator=torch.Generator().manual_seed(seed)).tolist()
    a = tokens(decode(m, [prompt], 40))
    b = tokens(decode_naive(m, [prompt], 40))
    assert a == b and len(a) == 40


def test_cached_equals_naive_on_trained_model(tiny_ar):
    m, ck = load_model(tiny_ar)
    for text in ["def ", "import os\n", "class Foo(object):\n    def __init__(self"]:
        ids = ck.tokenizer.encode(text)
        a = tokens(decode(m, [ids], 30, eos_id=ck.tokenizer.eos_id))
        b = tokens(decode_naive(m, [ids], 30, eos_id=ck.tokenizer.eos_id))
        assert a == b


def test_batch_of_prompts_equals_single_prompts(tiny_ar):
    m, ck = load_model(tiny_ar)
    texts = ["def f(", "import sys\nimport os\n\n", "x = [1, 2, 3"]
    cfg = SampleConfig(max_new_tokens=20)
    batch = generate(m, ck, texts, cfg)
    for i, t in enumerate(texts):
        single = generate(m, ck, t, cfg)
        assert batch.tokens[i] == single.tokens[0]
    assert batch.stats.forwards == 20 and batch.stats.new_tokens == sum(len(t) for t in batch.tokens)


def test_sampling_is_reproducible_with_a_seed(tiny_ar):
    m, ck = load_model(tiny_ar)
    cfg = SampleConfig(max_new_tokens=25, temperature=1.0, top_p=0.95, seed=7)
    a, b = generate(m, ck, "def ", cfg), generate(m, ck, "def ", cfg)
    c = generate(m, ck, "def ", cfg.replace(seed=8))
    assert a.tokens == b.tokens and a.tokens != c.tokens


def test_stops_at_eos_and_counts_forwards():
    torch.manual_seed(0)
    m = Transformer(preset("tiny", vocab_size=20)).eval()
    events = list(decode(m, [[5, 6, 7]], 10, eos_id=None))
    first = [e.tokens[0] for e in events if isinstance(e, Commit)]
    eos = first[3]  # pretend the 4th greedy token is the end token
    stopped = list(decode(m, [[5, 6, 7]], 10, eos_id=eos))
    toks = [e.tokens[0] for e in stopped if isinstance(e, Commit)]
    assert toks == first[:first.index(eos) + 1]
    done = stopped[-1]
    assert isinstance(done, Done) and done.stats.forwards == len(toks) and done.stats.new_tokens == len(toks)


def test_top_k_and_top_p_on_hand_made_logits():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = probs_from_logits(logits, 1.0, top_k=2)
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p = probs_from_logits(logits, 1.0, top_p=0.8)  # 0.5 + 0.3 reaches 0.8: the rest is cut
    assert torch.allclose(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p = probs_from_logits(logits, 1.0, top_p=0.81)
    assert p[2] > 0 and p[3] == 0
    p = probs_from_logits(logits, 1.0, top_p=0.1)  # the top token always stays
    assert torch.allclose(p, torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert torch.allclose(probs_from_logits(logits, 0.5), torch.softmax(logits / 0.5, -1))
    assert int(sample_token(logits, 0.0, 0, 1.0, None)) == 0
    g = torch.Generator().manual_seed(0)
    draws = [int(sample_token(logits, 1.0, 2, 1.0, g)) for _ in range(300)]
    assert set(draws) == {0, 1}


def test_bad_sampling_inputs(tiny_ar):
    m, ck = load_model(tiny_ar)
    for cfg, msg in [(SampleConfig(temperature=-1), "--temperature"), (SampleConfig(top_p=0), "--top-p"),
                     (SampleConfig(top_p=1.5), "--top-p"), (SampleConfig(top_k=-1), "--top-k"),
                     (SampleConfig(max_new_tokens=0), "--max-new-tokens"),
                     (SampleConfig(sampler="entropy_bound"), "does not belong"),
                     (SampleConfig(max_new_tokens=600), "context")]:
        with pytest.raises(DlmError, match=msg):
            generate(m, ck, "def f():", cfg)
    with pytest.raises(DlmError, match="context"):
        generate(m, ck, "x " * 600, SampleConfig(max_new_tokens=4))


def test_a_fim_trained_ar_checkpoint_infills_with_a_suffix():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "checkpoints"
    m, ck = load_model(root / "ar-small-fim")
    tok = ck.tokenizer
    assert ck.fim
    prefixes = ["def add(a, b):\n    return", "import os\n"]
    suffix = "\n\nprint(add(1, 2))\n"
    res = generate(m, ck, prefixes, SampleConfig(max_new_tokens=12, suffix=suffix))
    for row, prefix in enumerate(prefixes):
        # the middle is the model's own greedy continuation of the PSM prompt, written here by hand
        psm = [tok.fim_prefix_id, *tok.encode(prefix), tok.fim_suffix_id, *tok.encode(suffix), tok.fim_middle_id]
        ref = tokens(decode(m, [psm], 12, eos_id=tok.eos_id))
        middle = ref[:ref.index(tok.eos_id)] if tok.eos_id in ref else ref
        assert res.tokens[row] == middle + tok.encode(suffix)
        assert res.texts[row].endswith(suffix)  # the suffix comes out byte-exact
    assert res.stats.new_tokens == sum(len(t) - len(tok.encode(suffix)) for t in res.tokens)
    # a checkpoint trained without FIM refuses, and a FIM checkpoint fills one hole only
    m2, ck2 = load_model(root / "ar-small")
    assert not ck2.fim
    with pytest.raises(DlmError, match="cannot infill"):
        generate(m2, ck2, "x", SampleConfig(suffix="y"))
    with pytest.raises(DlmError, match="one hole"):
        generate(m, ck, "a <fill> b <fill> c", SampleConfig())


def test_sample_from_draws_what_multinomial_draws():
    """The same tokens as torch.multinomial(probs, 1) from the same generator, which ends in the same state:
    softmaxes over a large vocabulary, peaked and flat rows, zeros, unnormalized weights, float64, one row."""
    g = torch.Generator().manual_seed(1)
    cases = [torch.softmax(torch.randn(32, 4096, generator=g) * s, -1) for s in (0.5, 3.0, 30.0)]
    cases += [torch.tensor([[0.0, 0.2, 0.0, 0.8], [3.0, 0.0, 1.0, 0.0]]),  # zeros; weights that do not sum to 1
              torch.softmax(torch.randn(5, 7, 300, generator=g, dtype=torch.float64), -1), torch.tensor([0.1, 0.9])]
    for probs in cases:
        a, b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
        for _ in range(3):
            want = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=a).reshape(probs.shape[:-1])
            assert torch.equal(sample_from(probs, b), want)
        assert torch.equal(a.get_state(), b.get_state())


def test_sample_from_refuses_a_distribution_it_cannot_draw_from():
    for bad, msg in (([[0.5, float("nan")]], "NaN or infinite"), ([[0.5, float("inf")]], "NaN or infinite"),
                     ([[0.5, 0.5], [0.0, 0.0]], "no probability mass")):
        with pytest.raises(DlmError, match=msg):
            sample_from(torch.tensor(bad), torch.Generator().manual_seed(0))


def test_exponentials_are_exponential_draws(monkeypatch):
    """The fast draws are exponential_'s values, bit for bit, and leave the generator where exponential_ does (their
    probe passes on this torch); so are the values near a float32 rounding midpoint, recomputed one by one (here a
    quarter of them, where one in 10^7 is in use)."""
    from dlm.sampling import common

    assert common._exact_exponentials()
    for units in (common.MIDPOINT_UNITS, 1 << 26):
        monkeypatch.setattr(common, "MIDPOINT_UNITS", units)
        for shape in ((32, 4096), (3, 5, 7), (1,), (1 << 20,), (0, 9)):
            a, b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
            want = torch.empty(shape).exponential_(1, generator=a)
            assert torch.equal(common.exponentials(want, b), want) and torch.equal(a.get_state(), b.get_state())
    for like in (torch.empty(4, 9, dtype=torch.float64), torch.empty(4, 9, dtype=torch.bfloat16)):  # exponential_
        a, b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        assert torch.equal(common.exponentials(like, b), torch.empty_like(like).exponential_(1, generator=a))
