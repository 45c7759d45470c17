"""usdm, held by values: the sampler's acceptance with a denoiser that reads the canvas, the loss by
hand, and `--init-from` by the weights themselves.

The sampler test answers the canvas program's denoiser requests with a rule over the canvas whose predictions have known
entropies (0 for a one-hot prediction, log m for a uniform one over m tokens, at any temperature):
position j is certain once its left neighbour holds one of the tokens j - 1 may take, so which
positions the entropy bound accepts, which are re-noised, and when the canvas stops follow step by
step and are asserted exactly. Noise is drawn from tokens 0..7 and the rule's tokens are >= 10, so
a re-noised position can never pass for an accepted one.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from dlm.checkpoint import open_checkpoint, save_checkpoint
from dlm.config import ModelConfig
from dlm.model import Transformer
from dlm.model import canvas_embeds
from dlm.objectives.usdm import USDM
from dlm.sampling import SampleConfig
from dlm.sampling import usdm as us
from dlm.sampling.common import Step, entropy_bound_accept
from dlm.sampling.rows import Window, drive

NOISE = 8  # noise tokens 0..7
VOCAB = 40
# the tokens each position may take when uncertain (uniform over them; the argmax is the first) and the
# token it takes when certain (the last): entropies log 2, log 4, log 2 (the pin's), log 4, log 3
SUPPORT = [[10, 11], [12, 13, 14, 15], [16, 17], [18, 19, 20, 21], [22, 23, 24]]
PIN = 17  # position 2 is pinned to this token (one of its own support: a settled left neighbour)


def rule_logits(canvas: torch.Tensor) -> torch.Tensor:
    """(n,) canvas -> (n, V) logits: position j is one-hot on SUPPORT[j][-1] when j == 0 or canvas[j-1] is
    in SUPPORT[j-1], else uniform over SUPPORT[j]."""
    n = canvas.shape[0]
    logits = torch.full((n, VOCAB), -math.inf)
    for j in range(n):
        settled_left = j == 0 or int(canvas[j - 1]) in SUPPORT[j - 1]
        if settled_left:
            logits[j, SUPPORT[j][-1]] = 0.0
        else:
            logits[j, SUPPORT[j]] = 0.0
    return logits


class RuleDenoiser:
    """Answers the canvas program's denoiser passes (Windows) in place of the model; records the canvases shown."""

    def __init__(self):
        self.seen: list[list[int]] = []

    def __call__(self, req: Window) -> torch.Tensor:
        self.seen.append(req.tokens.tolist())
        return rule_logits(req.tokens)[None]


def sample_cfg(**kw):
    base = dict(steps=10, t_max=0.8, t_min=0.4, entropy_bound=0.5, top_k=0, top_p=1.0,
                adaptive=True, stability_threshold=1, confidence_threshold=0.005)
    return SampleConfig(**{**base, **kw})  # the real config: every sampler option at its default


def canvas_program(holes: torch.Tensor, pins: torch.Tensor, cfg, seed: int):
    """The sampler's program of one canvas (no <eos> ban, canvas 0 of row 0, Step events), as a row runs it."""
    gen = torch.Generator().manual_seed(seed)
    return us._canvas_program(holes, pins, NOISE, 2, False, 0, 0, 0, cfg.steps, cfg, gen, None, True, torch.device("cpu"))


def run_canvas(cfg, holes=(True, True, False, True, True), seed=0):
    fake = RuleDenoiser()
    holes_t = torch.tensor(holes)
    pins = torch.tensor([0 if h else PIN for h in holes])
    it = drive(canvas_program(holes_t, pins, cfg, seed), fake)
    steps = []
    while True:
        try:
            steps.append(next(it))
        except StopIteration as stop:
            tokens, n = stop.value
            return steps, tokens, n, fake


def test_pinned_positions_do_not_compete_and_accepted_sets_are_exact():
    """Step 1: positions 0 and 3 are certain (entropy 0), 4 has log 3 and 1 has log 4; the pin's own
    prediction (log 2) is not free, so 4's cumulative entropy before it is 0 <= 0.5 and it is accepted,
    1 is re-noised. (Were the pin in the race, its log 2 would come before 4 and push it out.)
    Step 2: every hole is certain and accepted. Step 3: the argmax canvas is unchanged and every
    entropy is 0: stop. The pin never moves."""
    steps, tokens, n, fake = run_canvas(sample_cfg())
    assert all(isinstance(s, Step) for s in steps) and [s.step for s in steps] == [1, 2, 3] and n == 3
    s1, s2, s3 = steps
    assert s1.fixed == [True, False, True, True, True]
    assert s1.canvas[0] == 11 and s1.canvas[2] == PIN and s1.canvas[3] == 21
    assert s1.canvas[1] < NOISE  # re-noised with a fresh noise token
    assert s1.canvas[4] in SUPPORT[4]  # accepted with its sampled candidate
    assert s2.fixed == [True] * 5 and s2.canvas == [11, 15, PIN, 21, 24]
    assert s3.fixed == [True] * 5 and s3.canvas == [11, 15, PIN, 21, 24]
    assert tokens == [11, 15, PIN, 21, 24]
    assert [c[2] for c in fake.seen] == [PIN] * 3  # the denoiser always saw the pin
    assert fake.seen[0][2] == PIN and all(t < NOISE for j, t in enumerate(fake.seen[0]) if j != 2)  # step 1: noise
    # mean entropy of the holes only (the pin's log 2 is not counted)
    assert s1.entropy == pytest.approx((0 + math.log(4) + 0 + math.log(3)) / 4)
    assert s2.entropy == 0.0 and s3.entropy == 0.0


def test_entropy_bound_accepts_less_when_tighter():
    """A bound of 0: after the certain ones, one more (the least uncertain, position 4, entropy log 3)
    is still accepted, since the rule subtracts the largest term; with the bound below log 3 nothing
    changes, and with a bound of 10 every hole is accepted at step 1."""
    steps, _, _, _ = run_canvas(sample_cfg(entropy_bound=1e-9))
    assert steps[0].fixed == [True, False, True, True, True]
    steps, _, n, _ = run_canvas(sample_cfg(entropy_bound=10.0))
    assert steps[0].fixed == [True] * 5 and steps[0].canvas[1] in SUPPORT[1]
    # without the pin (every position a hole), 2 is uncertain (log 2) and is accepted before 4 (log 3)
    steps, tokens, n, _ = run_canvas(sample_cfg(), holes=(True,) * 5)
    assert steps[0].fixed == [True, False, True, False, False]
    assert steps[0].canvas[2] in SUPPORT[2] and steps[0].canvas[3] < NOISE


def test_stop_step_follows_stability_and_confidence():
    """The argmax canvas changes between steps 1 and 2 (uncertain positions argmax the first token of
    their support, certain ones the last) and is stable from step 2 on."""
    assert run_canvas(sample_cfg(stability_threshold=1))[2] == 3
    assert run_canvas(sample_cfg(stability_threshold=2))[2] == 4
    assert run_canvas(sample_cfg(stability_threshold=3, steps=4))[2] == 4  # the cap
    assert run_canvas(sample_cfg(adaptive=False, steps=6))[2] == 6
    # confidence 0 can never be undercut (entropy 0 is not < 0): every step runs
    assert run_canvas(sample_cfg(confidence_threshold=0.0, steps=5))[2] == 5


def test_stop_needs_confidence_as_well_as_stability():
    """A position that never becomes certain (its rule looks at a left neighbour that is always noise)
    keeps the mean entropy at log 3 / 5 (> 0.2) from step 3 on: the argmax is stable from step 1, yet the canvas never stops."""
    def stubborn(req):
        logits = rule_logits(req.tokens)
        logits[4] = -math.inf
        logits[4, SUPPORT[4]] = 0.0  # always uncertain
        return logits[None]

    holes = torch.ones(5, dtype=torch.bool)
    it = drive(canvas_program(holes, torch.zeros(5, dtype=torch.long), sample_cfg(steps=7, confidence_threshold=0.2),
                              1), stubborn)
    events = list(it)
    assert len(events) == 7 and all(e.entropy == pytest.approx(math.log(3) / 5) for e in events[2:])
    assert us.should_stop(5, math.log(3) / 5, 1, 0.2) is False and us.should_stop(5, 0.19, 1, 0.2) is True


def test_entropy_bound_accept_ignores_positions_that_are_not_free():
    ent = torch.tensor([0.0, math.log(4), math.log(2), 0.0, math.log(3)])
    free = torch.tensor([True, True, False, True, True])
    assert entropy_bound_accept(ent, 0.5, free).tolist() == [True, False, False, True, True]
    assert entropy_bound_accept(ent, 0.5).tolist() == [True, False, True, True, False]  # the pin would compete
    assert entropy_bound_accept(ent, 0.5, free, k_min=4).tolist() == [True, True, False, True, True]
    assert entropy_bound_accept(torch.tensor([2.0, 1.0]), 0.5, torch.tensor([False, True])).tolist() == [False, True]


# the loss, by hand ----------------------------------------------------------------------------

def canvas_logits_by_hand(model, prefix: torch.Tensor, canvas_ids: torch.Tensor, probs) -> torch.Tensor:
    """Denoiser logits (L, V) of one canvas after `prefix` (P,), positions P.., no cache, no joint mask."""
    P, L = prefix.shape[0], canvas_ids.shape[0]
    mask = torch.ones(P + L, P + L, dtype=torch.bool).tril()
    mask[P:, :] = True
    x = torch.cat([model.embed_tokens(prefix[None]), canvas_embeds(model, canvas_ids[None], probs)], 1)
    return model(embeds=x, pos=torch.arange(P + L), mask=mask).logits[0, P:]


@pytest.mark.parametrize("weighting,sc_prob", [("constant", 0.5), ("inverse", 0.5), ("constant", 0.0),
                                               ("constant", 1.0)])
def test_usdm_loss_by_hand(weighting, sc_prob):
    """USDM.loss = next-token CE over the clean window + mean over rows of (mean canvas CE against the
    clean canvas, <eos>-filled, x weight), the canvas scored after a self-conditioning pass where drawn."""
    V, L, T, B, eos = 16, 4, 12, 6, 2
    model = tiny_model(0, V, 0.3, self_cond=True)
    tok = SimpleNamespace(eos_id=eos, vocab_size=V)
    obj = USDM(SimpleNamespace(canvas_length=L, self_cond_prob=sc_prob, loss_weight=weighting), tok)
    g = torch.Generator().manual_seed(4)
    batch = torch.randint(3, V, (B, T + 1), generator=g)
    batch[1, 7] = eos  # a document ends inside some canvases
    batch[4, 3] = eos
    with torch.no_grad():
        loss, extra = obj.loss(model, batch, torch.Generator().manual_seed(9))
    # the draws, in the objective's order: t, the canvas start, the corruption (where, then what), the rows
    g = torch.Generator().manual_seed(9)
    t = 1e-3 + (1 - 2e-3) * torch.rand(B, generator=g, dtype=torch.float32)
    start = 1 + (torch.rand(B, generator=g) * (T + 1 - L)).long().clamp(max=T - L)
    where = torch.rand(B, L, generator=g) < t[:, None]
    noise = torch.randint(0, V, (B, L), generator=g)
    sel = torch.rand(B, generator=g) < sc_prob
    assert 0 < int(sel.sum()) < B or sc_prob in (0.0, 1.0)  # both kinds of rows occur
    ar_terms, canvas_terms = [], []
    with torch.no_grad():
        for b in range(B):
            ar_terms.append(F.cross_entropy(model(batch[b:b + 1, :-1]).logits[0], batch[b, 1:], reduction="sum"))
            s = int(start[b])
            clean = batch[b, s:s + L].tolist()
            if eos in clean:  # after the document's end, every position is <eos>
                k = clean.index(eos)
                clean = clean[:k] + [eos] * (L - k)
            clean = torch.tensor(clean)
            zt = torch.where(where[b], noise[b], clean)
            probs = None
            if sel[b]:
                probs = torch.softmax(canvas_logits_by_hand(model, batch[b, :s], zt, None).float(), -1)[None]
            logits = canvas_logits_by_hand(model, batch[b, :s], zt, probs)
            w = 1 / (1 - float(t[b])) if weighting == "inverse" else 1.0
            canvas_terms.append(F.cross_entropy(logits, clean) * w)
    want = torch.stack(ar_terms).sum() / (B * T) + torch.stack(canvas_terms).mean()
    assert float(loss) == pytest.approx(float(want), rel=1e-6)
    assert extra["ar_loss"] == pytest.approx(float(torch.stack(ar_terms).sum() / (B * T)), rel=1e-6)
    unweighted = [c / (1 / (1 - float(t[b])) if weighting == "inverse" else 1.0) for b, c in enumerate(canvas_terms)]
    assert extra["canvas_loss"] == pytest.approx(float(torch.stack(unweighted).mean()), rel=1e-6)


# --init-from, by values ---------------------------------------------------------------------

def test_init_from_loads_the_source_weights(tokenizer_path, tmp_path):
    """An usdm run from an AR checkpoint starts from that checkpoint's tensors, value for value; only the
    self-conditioning module (new to usdm) keeps its fresh initialisation."""
    from dlm.tokenizer import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    torch.manual_seed(0)
    mc = ModelConfig(vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64,
                     max_seq_len=64)
    src = Transformer(mc)
    with torch.no_grad():
        for p in src.parameters():
            p.add_(torch.randn_like(p))  # far from any fresh initialisation
    save_checkpoint(tmp_path / "ar", src, tok, {"objective": "ar", "model": mc.to_dict()})
    cfg = SimpleNamespace(init_from=str(tmp_path / "ar"), preset="tiny", seq_len=32, canvas_length=8,
                          self_cond_prob=0.5, loss_weight="constant", canvas_scale="unit", canvas_shift=False)
    model = USDM(cfg, tok).build_model()
    tensors = open_checkpoint(tmp_path / "ar").tensors()
    got = model.state_dict()
    assert model.self_cond is not None and model.cfg.dim == 32 and model.cfg.n_layers == 2
    for name, value in tensors.items():
        assert torch.equal(got[name], value), name
    assert {n for n in got if n not in tensors and not n.startswith("self_cond.")} <= {"lm_head.weight"}
