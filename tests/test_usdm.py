"""Uniform-state diffusion: objective, sampler (acceptance, stopping, canvas extension, infilling), bound, CLI, bench."""

from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import cli, tiny_train_config
from dlm.checkpoint import load_model
from dlm.config import preset
from dlm.errors import DlmError
from dlm.model import Transformer, canvas_embeds
from dlm.objectives.usdm import USDM, choose_canvas, fill_after_eos, joint_forward, uniform_elbo_integrand
from dlm.sampling import SampleConfig, encode, generate, stream
from dlm.sampling import rows
from dlm.sampling import usdm as us
from dlm.sampling.common import Commit, Done, Prompt, Step


@pytest.fixture(scope="module")
def tiny_usdm(corpus_dir, tokenizer_path, tiny_ar, tmp_path_factory):
    """usdm adapted from the tiny AR checkpoint (shares its tokenizer)."""
    from dlm.train import train

    out = tmp_path_factory.mktemp("ckpt") / "tiny-usdm"
    cfg = tiny_train_config(corpus_dir, tokenizer_path, objective="usdm", init_from=str(tiny_ar), tokenizer=None,
                            seq_len=64, canvas_length=16, max_steps=80, eval_every=40, save_every=80)
    train(cfg, out, quiet=True)
    return out


def tiny_model(vocab: int = 64, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    m = Transformer(preset("tiny", vocab_size=vocab, self_cond=True)).eval()
    with torch.no_grad():  # a non-trivial self-conditioning module (its norm weight is 1 at init)
        m.self_cond.norm.weight.normal_(1.0, 0.5)
    return m


# objective ---------------------------------------------------------------------------------------

def test_joint_forward_equals_cached_encoder_then_denoiser():
    """Training's one-pass [clean ; canvas] forward = the sampler's prefill + read-only denoiser pass."""
    m = tiny_model()
    g = torch.Generator().manual_seed(0)
    T, L = 24, 8
    clean = torch.randint(0, 64, (2, T), generator=g)
    canvas = torch.randint(0, 64, (2, L), generator=g)
    start = torch.tensor([5, 13])
    probs = torch.softmax(torch.randn(2, L, 64, generator=g), -1)
    with torch.no_grad():
        for p in (None, probs):
            joint = joint_forward(m, clean, canvas_embeds(m, canvas, p), start)  # (2, T + L, V)
            assert torch.allclose(joint[:, :T], m(clean).logits, atol=1e-5)  # the encoder part is plain causal
            for b in range(2):
                s = int(start[b])
                cache = m.new_cache(1, 64)
                m(clean[b:b + 1, :s], cache=cache)
                emb = canvas_embeds(m, canvas[b:b + 1], None if p is None else p[b:b + 1])
                ref = m(embeds=emb, pos=torch.arange(s, s + L), cache=cache, mask="full", write=False).logits
                assert cache.length == s  # the denoiser never writes
                assert torch.allclose(joint[b, T:], ref[0], atol=1e-5)


def test_self_conditioning_matches_description():
    m = tiny_model()
    sc = m.self_cond
    assert sc.out_norm.weight is None and sc.norm.weight is not None  # pre-norm with scale, out-norm without
    canvas = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        zero = canvas_embeds(m, canvas, torch.zeros(1, 6, 64))
        assert torch.equal(zero, canvas_embeds(m, canvas, None))  # a zero signal on the first step
        probs = torch.softmax(torch.randn(1, 6, 64), -1)
        soft = probs @ m.embed_tokens.weight
        want = sc.out_norm(m.embed_tokens(canvas) + sc.mlp(sc.norm(soft)))
        assert torch.allclose(canvas_embeds(m, canvas, probs), want, atol=1e-6)
        assert not torch.allclose(want, zero)


def test_canvas_choice_and_eos_fill():
    batch = torch.arange(33).repeat(64, 1)  # (64, T + 1 = 33)
    start, canvas = choose_canvas(batch, 8, torch.Generator().manual_seed(0))
    assert int(start.min()) >= 1 and int(start.max()) <= 33 - 8  # a prefix before, the canvas fits
    assert torch.equal(canvas, start[:, None] + torch.arange(8))
    assert len(set(start.tolist())) > 10
    c = torch.tensor([[5, 2, 7, 8, 2, 9], [1, 3, 4, 5, 6, 7]])
    assert fill_after_eos(c, 2).tolist() == [[5, 2, 2, 2, 2, 2], [1, 3, 4, 5, 6, 7]]


def test_loss_is_a_function_of_the_generator(tokenizer_path):
    from dlm.tokenizer import Tokenizer
    from dlm.config import TrainConfig

    tok = Tokenizer.from_file(tokenizer_path)
    obj = USDM(TrainConfig(objective="usdm", seq_len=32, canvas_length=8), tok)
    torch.manual_seed(0)
    model = obj.build_model()
    batch = torch.randint(3, tok.vocab_size, (4, 33))
    with torch.no_grad():
        l1, e1 = obj.loss(model, batch, torch.Generator().manual_seed(1))
        l2, e2 = obj.loss(model, batch, torch.Generator().manual_seed(1))
        l3, _ = obj.loss(model, batch, torch.Generator().manual_seed(2))
    assert float(l1) == float(l2) and e1 == e2 and float(l1) != float(l3)
    assert abs(float(l1) - (e1["ar_loss"] + e1["canvas_loss"])) < 1e-4
    obj.cfg.loss_weight = "inverse"  # 1 / (1 - t) >= 1: never smaller
    with torch.no_grad():
        assert float(obj.loss(model, batch, torch.Generator().manual_seed(1))[0]) >= float(l1) - 1e-6


def test_tiny_usdm_trains_from_ar(tiny_usdm, tiny_ar):
    rows = [json.loads(x) for x in (tiny_usdm / "metrics.jsonl").read_text().splitlines()]
    canvas = [r["canvas_loss"] for r in rows if "canvas_loss" in r]
    assert canvas[-1] < canvas[0] - 0.5
    model, ck = load_model(tiny_usdm)
    assert ck.objective == "usdm" and model.self_cond is not None and ck.config["canvas_length"] == 16
    ar, _ = load_model(tiny_ar)
    assert ar.embed_tokens.weight.shape == model.embed_tokens.weight.shape  # same shapes (the values at step 0:
    # tests/test_usdm_exact.py::test_init_from_loads_the_source_weights)


def test_canvas_scale_encoder_puts_the_canvas_on_the_embeddings_scale(corpus_dir, tiny_ar, tmp_path):
    """--canvas-scale encoder: the denoiser's canvas input has the RMS of the AR's token embeddings (recorded in
    the checkpoint's model config, so sampling rebuilds it); unit (the default) keeps DiffusionGemma's RMS 1."""
    from dlm.train import train

    ar, _ = load_model(tiny_ar)
    want = float(ar.embed_tokens.weight.detach().float().pow(2).mean().sqrt())
    cfg = tiny_train_config(corpus_dir, None, objective="usdm", init_from=str(tiny_ar), tokenizer=None, seq_len=64,
                            canvas_length=16, max_steps=2, eval_every=2, save_every=2, canvas_scale="encoder")
    train(cfg, tmp_path / "enc", quiet=True)
    model, ck = load_model(tmp_path / "enc")
    assert ck.model_config.canvas_rms == pytest.approx(want, rel=1e-4) and want < 0.5
    canvas = torch.randint(0, model.cfg.vocab_size, (2, 16))
    for probs in (None, torch.softmax(torch.randn(2, 16, model.cfg.vocab_size), -1)):
        rms = canvas_embeds(model, canvas, probs).pow(2).mean(-1).sqrt()
        assert torch.allclose(rms, torch.full_like(rms, want), rtol=1e-3)
    unit, _ = load_model(tmp_path / "enc")
    unit.self_cond.rms = 1.0
    assert torch.allclose(canvas_embeds(unit, canvas, None).pow(2).mean(-1).sqrt(), torch.ones(2, 16), rtol=1e-3)


def test_canvas_shift_predicts_each_canvas_token_from_the_position_before_it(corpus_dir, tiny_ar, tmp_path):
    """--canvas-shift (recorded in the checkpoint): canvas token 0 is the encoder's next-token prediction and
    token j the denoiser's output at j - 1; the sampler held against one uncached forward of the joint layout."""
    from dlm.data.corpus import Corpus
    from dlm.evaluate import evaluate
    from dlm.train import train

    cfg = tiny_train_config(corpus_dir, None, objective="usdm", init_from=str(tiny_ar), tokenizer=None, seq_len=64,
                            canvas_length=16, max_steps=2, eval_every=2, save_every=2, canvas_shift=True)
    train(cfg, tmp_path / "shift", quiet=True)
    model, ck = load_model(tmp_path / "shift")
    assert ck.model_config.canvas_shift and not load_model(tiny_ar)[1].model_config.canvas_shift

    ids = ck.tokenizer.encode("import os\nimport sys\n")[:6]
    cfg = SampleConfig(max_new_tokens=16, steps=1, seed=3, t_max=1e-3, t_min=1e-3)
    got = next(e for e in stream(model, ck, [Prompt(ids)], cfg) if isinstance(e, Commit)).tokens
    gen = us.make_generator(3, model.device)
    z0 = torch.randint(0, ck.noise_vocab, (16,), generator=gen)  # the sampler's first draw: the initial canvas
    T = len(ids)
    with torch.no_grad():
        logits = joint_forward(model, torch.tensor([ids]), canvas_embeds(model, z0[None], None),
                               torch.tensor([T]))[0]  # (T + L, V)
    want = torch.cat([logits[T - 1:T], logits[T:T + 15]]).argmax(-1).tolist()  # AR for token 0, then j - 1 -> j
    eos = ck.tokenizer.eos_id
    assert got == (want[:want.index(eos) + 1] if eos in want else want)
    assert got[0] == int(logits[T - 1].argmax())
    bound = evaluate(model, ck, Corpus(str(corpus_dir)), "val", 64, 4, 2, seed=0)  # the bound follows the shift
    model.cfg.canvas_shift = False  # the same weights unshifted: token j from position j
    plain = next(e for e in stream(model, ck, [Prompt(ids)], cfg) if isinstance(e, Commit)).tokens
    assert plain != got
    unshifted = evaluate(model, ck, Corpus(str(corpus_dir)), "val", 64, 4, 2, seed=0)
    assert unshifted["ar_perplexity"] == bound["ar_perplexity"]
    assert 1 < bound["perplexity_bound"] != unshifted["perplexity_bound"]


def test_canvas_shift_starts_from_the_ar_heads_alignment():
    """The reason for --canvas-shift with --canvas-scale encoder: at the AR initialisation (the shipped ar-small,
    held-out windows, the same t and corruption draws) the shifted canvas loss on the embeddings' scale is well
    below the unshifted one at either scale: the AR head already points at the next token, and the AR's layers
    see inputs of the scale they were trained on."""
    from pathlib import Path

    from dlm.config import TrainConfig
    from dlm.data.corpus import Corpus
    from dlm.data.tokens import Batches, load_tokens

    ar, ck = load_model(Path(__file__).resolve().parent.parent / "checkpoints" / "ar-small")
    obj = USDM(TrainConfig(objective="usdm", seq_len=128, canvas_length=32, self_cond_prob=0.0), ck.tokenizer)
    batches = list(Batches(load_tokens(Corpus("stdlib"), ck.tokenizer, "val"), 128, 8).sequential(2))
    rms = float(ar.embed_tokens.weight.detach().pow(2).mean().sqrt())
    loss = {}
    for shift, scale in ((False, 1.0), (False, rms), (True, rms)):
        torch.manual_seed(0)
        m = Transformer(type(ar.cfg)(**{**vars(ar.cfg), "self_cond": True, "canvas_rms": scale,
                                         "canvas_shift": shift})).eval()
        m.load_state_dict(ar.state_dict(), strict=False)  # the AR's weights, a fresh self-conditioning module
        with torch.no_grad():
            loss[shift, scale] = sum(obj.loss(m, b, torch.Generator().manual_seed(i))[1]["canvas_loss"]
                                     for i, b in enumerate(batches)) / len(batches)
    assert loss[True, rms] < min(loss[False, 1.0], loss[False, rms]) - 0.5, loss


def test_bad_training_options(corpus_dir, tokenizer_path, tmp_path):
    from dlm.train import train

    for kw, msg in ((dict(canvas_length=0), "--canvas-length"), (dict(canvas_length=65), "--canvas-length"),
                    (dict(loss_weight="x"), "--loss-weight"), (dict(self_cond_prob=2.0), "--self-cond-prob"),
                    (dict(canvas_scale="big"), "--canvas-scale")):
        with pytest.raises(DlmError, match=msg):
            train(tiny_train_config(corpus_dir, tokenizer_path, **{**dict(objective="usdm", seq_len=64, canvas_length=16), **kw}),
                  tmp_path / "x")
        assert not (tmp_path / "x").exists()  # refused before anything is written


# sampler: plain functions on hand-made inputs ---------------------------------------------------

def test_entropy_bound_acceptance_on_hand_made_logits():
    V = 16
    big = 60.0
    logits = torch.zeros(5, V)  # row 0: uniform (entropy log 16)
    logits[1, 3] = big  # peaked: ~0
    logits[2, [4, 5]] = big  # two-way: log 2
    logits[3, 7] = big  # peaked
    logits[4, 1] = big  # peaked
    ent = us.entropy(torch.softmax(logits, -1))
    assert torch.allclose(ent, torch.tensor([math.log(V), 0, math.log(2), 0, 0]), atol=1e-4)
    # sorted: 0, 0, 0, log 2, log 16; cumsum - max: 0, 0, 0, 0, log 2 -> the first four pass
    assert us.accept_by_entropy(ent, 0.1).tolist() == [False, True, True, True, True]
    # with log 2 among the earlier terms the two-way position is the last accepted... unless excluded
    free = torch.tensor([True, True, True, False, True])
    assert us.accept_by_entropy(ent, 0.1, free).tolist() == [False, True, True, False, True]
    ent2 = torch.tensor([0.5, 0.01, 0.02, 0.3, 0.04])  # sorted .01 .02 .04 .3 .5: sums before 0 .01 .03 .07 .37
    assert us.accept_by_entropy(ent2, 0.1).tolist() == [False, True, True, True, True]
    assert us.accept_by_entropy(ent2, 0.05).tolist() == [False, True, True, False, True]
    assert us.accept_by_entropy(torch.tensor([3.0, 2.0, 4.0]), 0.1).tolist() == [False, True, False]  # >= 1
    assert not us.accept_by_entropy(ent2, 0.1, torch.zeros(5, dtype=torch.bool)).any()


def test_temperature_schedule_and_stopping_rule():
    S = 48
    ts = [float(us.temperature(s, S, 0.8, 0.4)) for s in range(1, S + 1)]
    assert ts[0] == pytest.approx(0.8) and ts[-1] == pytest.approx(0.4 + 0.4 / S)
    assert all(a > b for a, b in zip(ts, ts[1:]))
    assert us.should_stop(1, 0.001, 1, 0.005) and not us.should_stop(0, 0.001, 1, 0.005)
    assert not us.should_stop(3, 0.01, 1, 0.005) and not us.should_stop(1, 0.001, 2, 0.005)


def test_renoise_keeps_accepted_and_pins():
    cand = torch.tensor([10, 11, 12, 13])
    acc = torch.tensor([True, False, True, False])
    holes = torch.tensor([True, True, True, False])
    pins = torch.tensor([0, 0, 0, 99])
    noise = torch.tensor([50, 51, 52, 53])
    assert us.renoise(cand, acc, holes, pins, noise).tolist() == [10, 51, 12, 99]


class FakeDenoiser:
    """Stands in for the model's denoiser passes: logits peaked at a known sequence (token = position + 10), sharper
    each call. `alone` stands in for usdm's one-row answer: the canvas passes go to the fake, the prefills to the
    model."""

    def __init__(self, V: int, peak: float = 30.0, sharpen: float = 0.0, eos_at: tuple[int, int] | None = None,
                 eos_id: int = 2):
        self.V, self.peak, self.sharpen, self.eos_at, self.eos_id = V, peak, sharpen, eos_at, eos_id
        self.calls: list[tuple[int, int, bool]] = []  # (first position, length, self-conditioned)
        self.canvas = -1

    def alone(self, model, cache):
        real = rows.alone(model, cache)

        def answer(w):
            if not w.canvas:
                return real(w)
            return self(w.tokens[None], torch.arange(cache.length, cache.length + w.length), w.probs)

        return answer

    def __call__(self, canvas, pos, prev_probs):
        n = canvas.shape[1]
        first = int(pos[0])
        if not self.calls or prev_probs is None:
            self.canvas += 1
        self.calls.append((first, n, prev_probs is not None))
        scale = 1.0 + self.sharpen * len(self.calls)
        logits = torch.zeros(1, n, self.V)
        target = (torch.arange(first, first + n) % 20) + 10
        logits[0, torch.arange(n), target] = self.peak * scale
        if self.eos_at is not None and self.canvas == self.eos_at[0]:
            logits[0, self.eos_at[1], self.eos_id] = 100.0
        return logits


def test_adaptive_stopping_and_canvas_extension(tiny_usdm, monkeypatch):
    model, ck = load_model(tiny_usdm)
    V = model.cfg.vocab_size
    prompt = "def f(x):\n"
    P = len(ck.tokenizer.encode(prompt))
    fake = FakeDenoiser(V)
    monkeypatch.setattr(us, "alone", fake.alone)
    cfg = SampleConfig(max_new_tokens=40, canvas_length=16, last_canvas="whole")
    res = generate(model, ck, prompt, cfg, keep_events=True)
    s = res.stats.as_dict()
    # three whole canvases (as DiffusionGemma's generate: the last one too, its 8 positions past max_new_tokens dropped)
    # at the positions their tokens will hold; each stops at step 2 (argmax stable, entropy ~0)
    assert [(c[0], c[1]) for c in fake.calls if not c[2]] == [(P, 16), (P + 16, 16), (P + 32, 16)]
    assert s["canvases"] == 3 and s["steps_per_canvas"] == [2, 2, 2]
    assert s["forwards"] == 1 + 6 + 2  # prompt prefill + steps + prefill of the two canvases more text followed
    assert res.tokens[0] == [(p % 20) + 10 for p in range(P, P + 40)]
    assert s["new_tokens"] == 40 and s["tokens_per_forward"] == pytest.approx(40 / 9)
    commits = [e for e in res.events if isinstance(e, Commit)]
    assert [len(c.tokens) for c in commits] == [16, 16, 8]
    steps = [e for e in res.events if isinstance(e, Step)]
    assert [(e.canvas_index, e.step) for e in steps] == [(0, 1), (0, 2), (1, 1), (1, 2), (2, 1), (2, 2)]
    assert all(e.entropy is not None and e.entropy < 0.005 for e in steps)
    # fixed steps: adaptive off runs every step
    fake2 = FakeDenoiser(V)
    monkeypatch.setattr(us, "alone", fake2.alone)
    res2 = generate(model, ck, prompt, cfg.replace(adaptive=False, steps=7))
    assert res2.stats.extra["steps_per_canvas"] == [7, 7, 7] and res2.tokens == res.tokens
    # stability threshold 3: three unchanged argmax canvases after the first
    monkeypatch.setattr(us, "alone", FakeDenoiser(V).alone)
    assert generate(model, ck, prompt, cfg.replace(stability_threshold=3)).stats.extra["steps_per_canvas"] == [4, 4, 4]
    # last_canvas fit (the default of dlm's own checkpoints): the last canvas holds only the 8 positions left, the
    # same tokens here (the fake reads positions)
    fake3 = FakeDenoiser(V)
    monkeypatch.setattr(us, "alone", fake3.alone)
    res3 = generate(model, ck, prompt, cfg.replace(last_canvas=None))
    assert [(c[0], c[1]) for c in fake3.calls if not c[2]] == [(P, 16), (P + 16, 16), (P + 32, 8)]
    assert res3.tokens == res.tokens


def test_stop_waits_for_confidence(tiny_usdm, monkeypatch):
    """The argmax is stable from step 2, but the canvas stops only once the mean entropy is below the threshold."""
    model, ck = load_model(tiny_usdm)
    monkeypatch.setattr(us, "alone", FakeDenoiser(model.cfg.vocab_size, peak=8.0, sharpen=0.1).alone)  # sharper each call
    res = generate(model, ck, "x = 1\n", SampleConfig(max_new_tokens=8, canvas_length=8, steps=10),
                   keep_events=True)
    ents = [e.entropy for e in res.events if isinstance(e, Step)]
    assert res.stats.extra["steps_per_canvas"] == [4] and len(ents) == 4
    assert min(ents[:3]) > 0.005 > ents[3]


def test_eos_ends_generation(tiny_usdm, monkeypatch):
    model, ck = load_model(tiny_usdm)
    eos = ck.tokenizer.eos_id
    fake = FakeDenoiser(model.cfg.vocab_size, eos_at=(1, 5), eos_id=eos)  # canvas 2 has <eos> at its position 5
    monkeypatch.setattr(us, "alone", fake.alone)
    res = generate(model, ck, "y = 2\n", SampleConfig(max_new_tokens=64, canvas_length=16))
    assert len(res.tokens[0]) == 16 + 6 and res.tokens[0][-1] == eos  # cut after the first <eos>
    assert res.stats.canvases == 2
    assert res.stats.forwards == 1 + 2 + 1 + 2  # no prefill after the last canvas


# sampler: the real model ------------------------------------------------------------------------

def test_sampler_runs_and_is_reproducible(tiny_usdm):
    model, ck = load_model(tiny_usdm)
    cfg = SampleConfig(max_new_tokens=24, steps=6, seed=3)
    a = generate(model, ck, "import os\n", cfg, keep_events=True)
    b = generate(model, ck, "import os\n", cfg)
    assert a.tokens == b.tokens and a.texts == b.texts
    s = a.stats.as_dict()
    assert s["new_tokens"] == len(a.tokens[0]) > 0
    assert sum(s["steps_per_canvas"]) + 1 + (s["canvases"] - 1) >= s["forwards"] - 1  # counted, not guessed
    steps = [e for e in a.events if isinstance(e, Step)]
    assert len(steps) == sum(s["steps_per_canvas"]) and all(len(e.canvas) == len(e.fixed) for e in steps)
    assert all(any(e.fixed) for e in steps)  # at least one accepted per step
    assert isinstance(a.events[-1], Done)
    # a batch of prompts: rows one after another
    both = generate(model, ck, ["import os\n", "import os\n"], cfg)
    assert both.tokens[0] == a.tokens[0] and len(both.tokens) == 2


def test_infilling_keeps_the_suffix_byte_exact(tiny_usdm):
    model, ck = load_model(tiny_usdm)
    tok = ck.tokenizer
    suffix = "\n    return result\n"
    res = generate(model, ck, "def f(x):\n    result = ", SampleConfig(max_new_tokens=6, suffix=suffix, steps=5),
                   keep_events=True)
    assert res.text.endswith(suffix) and res.tokens[0][-len(tok.encode(suffix)):] == tok.encode(suffix)
    assert res.stats.new_tokens == 6 and tok.eos_id not in res.tokens[0]
    pins = tok.encode(suffix)
    for e in res.events:
        if isinstance(e, Step):  # pinned positions are never re-noised
            assert e.canvas[6:] == pins and all(e.fixed[6:])
    # a template: everything but the markers is pinned
    res = generate(model, ck, "a = [<fill:3>]\nb = <fill:2>\n", SampleConfig(steps=4))
    tail = tok.decode(res.tokens[0])
    assert tail.endswith("\n") and "]\nb = " in tail and res.stats.new_tokens == 5


@pytest.mark.parametrize("mode", ["tempered", "untempered"])
def test_self_conditioning_input(tiny_usdm, monkeypatch, mode):
    """Step k + 1 is self-conditioned on step k's softmax: of the temperature-scaled logits (tempered, the
    reference) or of the raw logits (untempered, what training feeds)."""
    model, ck = load_model(tiny_usdm)
    seen = []

    def spy(model, cache):
        real = rows.alone(model, cache)

        def answer(w):
            out = real(w)
            if w.canvas:
                seen.append((w.probs, out[0].clone()))
            return out

        return answer

    monkeypatch.setattr(us, "alone", spy)
    cfg = SampleConfig(max_new_tokens=8, canvas_length=8, steps=3, adaptive=False, self_cond_input=mode)
    generate(model, ck, "x = 1\n", cfg)
    assert len(seen) == 3 and seen[0][0] is None
    T1 = us.temperature(1, 3, cfg.t_max, cfg.t_min)
    raw1 = seen[0][1]
    want = torch.softmax(raw1 / T1 if mode == "tempered" else raw1, -1)
    other = torch.softmax(raw1 if mode == "tempered" else raw1 / T1, -1)
    got = seen[1][0]
    assert torch.allclose(got, want, atol=1e-6) and not torch.allclose(got, other, atol=1e-3)


def test_bad_sampling_options(tiny_usdm):
    model, ck = load_model(tiny_usdm)
    bad = [
        (dict(canvas_length=0), "--canvas-length"),
        (dict(canvas_length=100_000), "--canvas-length"),
        (dict(entropy_bound=0.0), "--entropy-bound"),
        (dict(t_min=0.9, t_max=0.5), "--t-min"),
        (dict(sampler="confidence"), "--sampler"),
        (dict(steps=0), "--steps"),
        (dict(block_size=8), "--block-size is an mdlm"),
        (dict(temperature=0.7), "--temperature"),
        (dict(self_cond_input="raw"), "--self-cond-input"),
        (dict(suffix="x" * 3000, max_new_tokens=8), "no room to fill"),
    ]
    for kw, msg in bad:
        with pytest.raises(DlmError, match=msg):
            cfg = SampleConfig(**kw)
            stream(model, ck, encode(ck, "a = 1", cfg), cfg)  # refused before any work


def test_cli_generate_json_and_errors(tiny_usdm):
    p = cli("generate", "--model", str(tiny_usdm), "--prompt", "def g(", "--max-new-tokens", "20", "--json",
            "--max-denoising-steps", "5", check=True)
    out = json.loads(p.stdout)
    assert out["canvases"] == 2 and len(out["steps_per_canvas"]) == 2
    assert out["forwards"] > 0 and out["tokens_per_forward"] > 0 and out["new_tokens"] == 20
    p = cli("generate", "--model", str(tiny_usdm), "--prompt", "x", "--t-min", "0.9", "--t-max", "0.5")
    assert p.returncode == 2 and "--t-min" in p.stderr and "Traceback" not in p.stderr  # the rest: test_bad_sampling_options
    assert len(p.stderr.strip().splitlines()) == 1


# the likelihood bound ---------------------------------------------------------------------------

def brute_force_integrand(logits, x0, zt, t, N, rates):
    """The path-KL rate written out over every target state y (float64, small N)."""
    a = 1 - t
    p = torch.softmax(logits[:N].double(), -1)

    def xb(x):  # N q_t(. | x)
        v = torch.full((N,), 1 - a, dtype=torch.float64)
        v[x] += N * a
        return v

    xbp = N * a * p + (1 - a)
    total = 0.0
    for y in range(N):
        if y == zt:
            continue
        r_true = float(xb(x0)[y] / xb(x0)[zt])
        if rates == "udlm":
            r_model = float(xbp[y] / xbp[zt])
        else:
            r_model = sum(float(p[x]) * float(xb(x)[y] / xb(x)[zt]) for x in range(N))
        total += r_model - r_true + r_true * math.log(r_true / r_model)
    return total / (N * a)  # beta / N with beta = 1 / (1 - t)


@pytest.mark.parametrize("rates", ["mean", "udlm"])
def test_elbo_integrand_matches_brute_force(rates):
    N = 7
    g = torch.Generator().manual_seed(0)
    for t in (0.05, 0.4, 0.93):
        logits = torch.randn(1, 6, N, generator=g) * 2
        x0 = torch.tensor([[0, 1, 2, 3, 4, 5]])
        zt = torch.tensor([[0, 2, 2, 6, 4, 1]])  # some clean, some corrupted
        got = uniform_elbo_integrand(logits, x0, zt, torch.tensor([t]), N, rates)[0]
        want = [brute_force_integrand(logits[0, j], int(x0[0, j]), int(zt[0, j]), t, N, rates) for j in range(6)]
        assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=1e-9)
        assert (got > 0).all()
        perfect = torch.nn.functional.one_hot(x0, N).double() * 80  # a model that knows x: no loss at all
        assert uniform_elbo_integrand(perfect, x0, zt, torch.tensor([t]), N, rates).abs().max() < 1e-6


def integrate_over_t_and_zt(logits_for, x: int, N: int, rates: str, K: int = 8000) -> float:
    """int_0^1 E_{z_t | x}[integrand] dt by the midpoint rule and an exact sum over z_t (one position)."""
    ts = (torch.arange(K, dtype=torch.float64) + 0.5) / K
    a = 1 - ts
    total = torch.zeros(K, dtype=torch.float64)
    for z in range(N):
        val = uniform_elbo_integrand(logits_for(z, ts)[:, None], torch.full((K, 1), x), torch.full((K, 1), z), ts, N,
                                     rates)[:, 0]
        total += (a * (z == x) + (1 - a) / N) * val
    return float(total.mean())


def test_elbo_is_tight_for_the_true_posterior():
    """With the exact posterior p(x | z_t) of a known distribution, the mean-rate bound equals -log pi(x)."""
    N = 4
    pi = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)

    def posterior_logits(z, ts):
        a = (1 - ts)[:, None]
        q = a * (torch.arange(N) == z).double()[None] + (1 - a) / N  # q_t(z | x') for every x'
        return (pi[None] * q).log()  # (K, N), unnormalised

    for x in range(N):
        assert integrate_over_t_and_zt(posterior_logits, x, N, "mean") == pytest.approx(-math.log(pi[x]), rel=1e-4)


def test_udlm_bound_of_a_uniform_model_is_log_n():
    """UDLM rates with a uniform p are those of the stationary chain: p(x) = 1/N, and the bound is exactly log N."""
    N = 5
    uniform = lambda z, ts: torch.zeros(len(ts), N)  # noqa: E731
    assert integrate_over_t_and_zt(uniform, 0, N, "udlm") == pytest.approx(math.log(N), rel=2e-3)


def test_eval_reports_a_reproducible_bound(tiny_usdm, corpus_dir):
    from dlm.data.corpus import Corpus
    from dlm.evaluate import evaluate

    model, ck = load_model(tiny_usdm)
    corpus = Corpus(str(corpus_dir))
    r1 = evaluate(model, ck, corpus, "val", 64, 4, 2, seed=0)
    r2 = evaluate(model, ck, corpus, "val", 64, 4, 2, seed=0)
    assert r1 == r2
    assert 1 < r1["ar_perplexity"] < 2000 and r1["perplexity_bound"] > 1 and r1["tokens"] == 8 * 16
    assert math.isfinite(r1["perplexity_bound_no_sc"]) and r1["perplexity_bound_udlm"] > 1


def test_bench_has_usdm_rows(tiny_ar, tiny_usdm, corpus_dir):
    from dlm.bench import run_bench

    rep = run_bench(str(tiny_ar), prompts=2, max_new_tokens=12, data=str(corpus_dir), warmup=0, naive=False,
                    quiet=True, usdm=str(tiny_usdm), repeat=1, sweep=True)
    rows = {s["method"]: s for s in rep["summaries"]}
    assert {"usdm (adaptive)", "usdm (adaptive, 8 steps)", "usdm (fixed 48 steps)"} <= set(rows)
    fixed = rows["usdm (fixed 48 steps)"]
    assert fixed["forwards_per_canvas"] >= 48 and fixed["tokens_per_forward"] > 0
    assert rows["usdm (adaptive, 8 steps)"]["forwards_per_canvas"] <= 9  # the prefill and 8 steps at most
    assert "forwards_per_canvas" not in rows["ar (KV cache)"] and math.isfinite(fixed["gen_ppl"])
    with pytest.raises(DlmError, match="--usdm"):
        run_bench(str(tiny_ar), prompts=1, max_new_tokens=4, data=str(corpus_dir), quiet=True, usdm=str(tiny_ar))
