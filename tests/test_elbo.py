"""The likelihood bounds against their exact values, enumerated on a tiny vocabulary and length.

mdlm (`elbo_nll`): LLaDA's estimator draws l ~ U{1..B} per block and masks l random positions of it,
weighting their cross-entropy by B / l. Its expectation is a finite sum over every masking pattern
of every block, each pattern's logits computed here from the model directly (the clean blocks before
a block block-causal, the block itself bidirectional with its pattern masked): the exact ELBO. It
also equals the expected negative log-likelihood of the model read as an any-order autoregressive
model (a random order per block), so it is >= -log of the mixture over orders, a proper joint
distribution (checked to sum to 1). The Monte-Carlo mean must lie within a few standard errors
(exact, from the same enumeration) of the exact ELBO, and a leak of a block's clean copy into its
noisy pass moves the value by many standard errors.

usdm (`evaluate`, `uniform_elbo_integrand`): the bound is int_0^1 E_{z_t}[sum of the integrand] dt.
With 4 tokens and a canvas of 3 there are 64 noisy canvases: the expectation over z_t is a sum,
the integral over t a fine quadrature, each canvas's denoiser logits (self-conditioned on its first
pass, as in `evaluate`) computed here without the KV cache. Two checks: every number `evaluate`
reports equals the same quantity recomputed from its own draws (generator replayed), and its
UDLM-rate bound over many windows lies within a few standard errors of the exact integral.
The mean-rate bound (`bound_nats`) is not compared with its exact value by Monte Carlo: for a
denoiser that does not see t its integrand at z_t = x is (1 - p(x | z_t)) / t, so the integral is
set by the t >= 1e-6 clamp and a single draw's variance is ~1e5 (docs/testing.md, "findings").

The models are random with weights large enough that their logits depend strongly on the visible
tokens: a model blind to its input could not tell one mask pattern (or a leak) from another.
"""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import tiny_model
from dlm.model import Transformer
from dlm.objectives.mdlm import elbo_nll
from dlm.model import canvas_embeds
from dlm.objectives.usdm import uniform_elbo_integrand
from dlm.objectives.usdm import evaluate as usdm_evaluate

Z = 4.0  # standard errors allowed between a Monte-Carlo mean and its exact expectation


pytestmark = pytest.mark.usefixtures("one_thread")


# mdlm ------------------------------------------------------------------------------------------

R = 4  # real tokens 0..3
MASK = 4
T = 4
WINDOWS = torch.tensor([[0, 1, 2, 3], [3, 3, 1, 0], [2, 0, 2, 1]])


def blocks_of(T: int, L: int) -> list[tuple[int, int]]:
    L = L if 0 < L < T else T
    return [(s, min(s + L, T)) for s in range(0, T, L)]


def subsets(s: int, e: int) -> list[tuple[int, ...]]:
    return [S for l in range(1, e - s + 1) for S in itertools.combinations(range(s, e), l)]


@torch.no_grad()
def block_logprobs(model: Transformer, X: torch.Tensor, s: int, e: int, grid: int, leak: bool = False) -> dict:
    """For windows X (M, T) and block [s, e): {S: (M, e - s) log p(x_i | block with S masked)} for every
    non-empty S. The clean prefix x[:s] is block-causal (block by block, as the KV cache holds it), the
    noisy block sees the prefix and itself; with `leak` it also sees its own clean copy x[s:e]."""
    M = X.shape[0]
    n = e - s
    ctx = e if leak else s  # clean positions the noisy block reads
    out = {}
    all_S = subsets(s, e)
    noisy = X[:, s:e].repeat(len(all_S), 1)  # (|S| * M, n)
    for j, S in enumerate(all_S):
        for i in S:
            noisy[j * M:(j + 1) * M, i - s] = MASK
    ids = torch.cat([X[:, :ctx].repeat(len(all_S), 1), noisy], 1)
    pos = torch.cat([torch.arange(ctx), torch.arange(s, e)])
    mask = torch.zeros(ctx + n, ctx + n, dtype=torch.bool)
    blk = torch.arange(ctx) // grid
    mask[:ctx, :ctx] = blk[:, None] >= blk[None, :]  # clean: block-causal
    mask[ctx:, :] = True  # noisy: the clean context and the whole block
    logits = model(ids, pos=pos, mask=mask).logits[:, ctx:].double()  # (|S| * M, n, V)
    logits[..., MASK] = -math.inf
    logp = torch.log_softmax(logits, -1).gather(-1, X[:, s:e].repeat(len(all_S), 1)[..., None])[..., 0]
    for j, S in enumerate(all_S):
        out[S] = logp[j * M:(j + 1) * M]
    return out


def exact_mdlm(model: Transformer, X: torch.Tensor, L: int, leak: bool = False):
    """Exact (mean, variance) of elbo_nll's per-window estimator, and the any-order mixture's -log p(x)."""
    M, T = X.shape
    mean = torch.zeros(M, dtype=torch.float64)
    var = torch.zeros(M, dtype=torch.float64)
    mix_nll = torch.zeros(M, dtype=torch.float64)
    grid = L if 0 < L < T else T
    for s, e in blocks_of(T, L):
        n = e - s
        lp = block_logprobs(model, X, s, e, grid, leak)
        vals, probs = [], []
        for S, l in lp.items():
            vals.append((n / len(S)) * -l[:, [i - s for i in S]].sum(1))  # the estimator's value (M,)
            probs.append(1.0 / (n * math.comb(n, len(S))))  # P(l = |S|) P(S | l)
        vals_t, probs_t = torch.stack(vals), torch.tensor(probs, dtype=torch.float64)[:, None]
        m = (probs_t * vals_t).sum(0)
        mean += m
        var += (probs_t * vals_t ** 2).sum(0) - m ** 2
        # any-order mixture: mean over orders of prod_j p(x_{o_j} | positions o_j.. masked)
        mix = torch.zeros(M, dtype=torch.float64)
        for order in itertools.permutations(range(s, e)):
            mix += torch.exp(sum(lp[tuple(sorted(order[j:]))][:, order[j] - s] for j in range(n)))
        mix_nll += -torch.log(mix / math.factorial(n))
    return mean, var, mix_nll


@pytest.fixture(scope="module")
def mdlm_model() -> Transformer:
    return tiny_model(3, R + 1, max_seq_len=32)


def test_reference_is_a_distribution_and_the_elbo_bounds_it(mdlm_model):
    """The exact ELBO of every sequence of 4 tokens is >= -log of the any-order mixture, and that
    mixture sums to 1 over all 4**4 sequences (whole sequence and blocks of 2)."""
    X = torch.tensor(list(itertools.product(range(R), repeat=T)))
    for L in (0, 2):
        mean, _, mix_nll = exact_mdlm(mdlm_model, X, L)
        assert float(torch.exp(-mix_nll).sum()) == pytest.approx(1.0, abs=1e-9)
        assert bool((mean >= mix_nll - 1e-9).all())
        assert float((mean - mix_nll).max()) > 0.05  # a strict bound: orders disagree for this model


@pytest.mark.parametrize("L", [0, 2, 3], ids=["whole", "blocks-of-2", "blocks-of-3"])
def test_mdlm_monte_carlo_elbo_equals_the_enumerated_one(mdlm_model, L):
    samples = 1500 if L else 600
    est = elbo_nll(mdlm_model, WINDOWS, L, MASK, samples, torch.Generator().manual_seed(L))  # (samples, M)
    mean, var, mix_nll = exact_mdlm(mdlm_model, WINDOWS, L)
    se = (var / samples).sqrt()
    got = est.mean(0)
    assert bool(((got - mean).abs() < Z * se).all()), (got, mean, se)
    assert bool((got > mix_nll - Z * se).all())  # an upper bound on -log p of the model's joint
    # the sample spread agrees with the exact one (a wrong weighting of l changes it)
    torch.testing.assert_close(est.var(0), var, rtol=0.25, atol=1e-6)
    if L:  # a noisy block that sees its own clean copy gives another number, many errors away
        leaky, _, _ = exact_mdlm(mdlm_model, WINDOWS, L, leak=True)
        assert bool(((leaky - mean).abs() > 2 * Z * se).all()), (leaky, mean, se)


# usdm ------------------------------------------------------------------------------------------

def test_integrand_is_finite_at_the_ends_of_time():
    """t = 0 and t = 1 (where alpha = 1 or 0 divides) are clamped to [1e-6, 1 - 1e-6]: finite, >= 0."""
    logits = torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x0 = torch.tensor([[0, 1, 2], [3, 4, 0]])
    zt = torch.tensor([[0, 2, 2], [1, 4, 3]])
    for rates in ("mean", "udlm"):
        for t in (0.0, 1.0):
            v = uniform_elbo_integrand(logits, x0, zt, torch.full((2,), t, dtype=torch.float64), 5, rates)
            assert bool(torch.isfinite(v).all()) and bool((v >= 0).all())
            edge = torch.full((2,), 1e-6 if t == 0 else 1 - 1e-6, dtype=torch.float64)
            torch.testing.assert_close(v, uniform_elbo_integrand(logits, x0, zt, edge, 5, rates), rtol=1e-6, atol=1e-4)
    with pytest.raises(ValueError, match="rates must be 'mean' or 'udlm'"):
        uniform_elbo_integrand(logits, x0, zt, torch.full((2,), 0.5), 5, "plugin")


N = 4  # tokens (= noise vocabulary)
CANVAS = 3
SEQ = 5  # windows of SEQ + 1 tokens: prefix of 3, canvas of 3
WINDOW = [1, 0, 2, 3, 0, 1]  # periodic with period SEQ (last = first): every Batches window is this one


@torch.no_grad()
def denoiser_logits(model: Transformer, prefix: list[int], canvases: torch.Tensor,
                    leak: list[int] | None = None) -> torch.Tensor:
    """Self-conditioned denoiser logits (M, L, V) of canvases (M, L) after `prefix`, without a cache: the
    prefix causal, the canvas (at the positions after the prefix) seeing the prefix and itself; a first
    pass feeds the second's softmax. `leak`: clean canvas tokens appended to the context (as a cache that
    was not cropped back to the prefix would hold them)."""
    M, L = canvases.shape
    P = len(prefix)
    ctx = prefix + (leak or [])
    C = len(ctx)
    pre = torch.tensor(ctx).repeat(M, 1)
    pos = torch.cat([torch.arange(C), torch.arange(P, P + L)])
    mask = torch.ones(C + L, C + L, dtype=torch.bool).tril()
    mask[C:, :] = True

    def run(probs):
        x = torch.cat([model.embed_tokens(pre), canvas_embeds(model, canvases, probs)], 1)
        return model(embeds=x, pos=pos, mask=mask).logits[:, C:]

    first = run(None)
    return run(torch.softmax(first.double(), -1))


def exact_usdm(model: Transformer, prefix: list[int], canvas: list[int], rates: str = "udlm", K: int = 4000,
               leak: bool = False) -> tuple[float, float]:
    """Mean and variance over t ~ U(0, 1) and z_t of the per-token integrand (the bound in nats per token):
    an exact sum over the N^L noisy canvases, and a midpoint rule in u = sqrt(t) (dt = 2u du) for the
    integral, which is smooth in u where the integrand has its log(1/t) behaviour near t = 0."""
    zs = torch.tensor(list(itertools.product(range(N), repeat=len(canvas))))  # (N^L, L)
    logits = denoiser_logits(model, prefix, zs, canvas[:-1] if leak else None)
    x0 = torch.tensor(canvas)
    u = (torch.arange(K, dtype=torch.float64) + 0.5) / K
    t, w = u ** 2, 2 * u / K  # nodes and weights of int_0^1 dt
    a = (1 - t)[:, None]
    m1 = m2 = 0.0
    for j in range(zs.shape[0]):
        z = zs[j]
        qz = torch.prod(torch.where(z == x0, a + (1 - a) / N, (1 - a) / N), 1)  # q_t(z | x0) (K,)
        f = uniform_elbo_integrand(logits[j].expand(K, -1, -1), x0.expand(K, -1), z.expand(K, -1), t, N, rates)
        f = f.sum(1) / len(canvas)
        m1 += float((w * qz * f).sum())
        m2 += float((w * qz * f ** 2).sum())
    return m1, m2 - m1 ** 2


@pytest.fixture(scope="module")
def usdm_model() -> Transformer:
    return tiny_model(7, N, max_seq_len=32, self_cond=True)


def run_evaluate(model, monkeypatch, windows: int, samples: int, seed: int) -> dict:
    """`evaluate` over `windows` copies of WINDOW (the corpus stubbed; Batches as in `dlm eval`)."""
    import dlm.data.tokens as tokens

    stream = np.array(WINDOW[:-1] * windows + WINDOW[-1:], dtype=np.int64)
    monkeypatch.setattr(tokens, "load_tokens", lambda corpus, tok, split: stream)
    ck = SimpleNamespace(tokenizer=SimpleNamespace(vocab_size=N), noise_vocab=N, canvas_length=CANVAS)
    r = usdm_evaluate(model, ck, SimpleNamespace(spec="stub"), "val", SEQ, windows, 1, seed=seed, samples=samples)
    assert r["tokens"] == windows * CANVAS
    return r


def test_usdm_evaluate_recomputed_from_its_own_draws(usdm_model, monkeypatch):
    """Every number of `evaluate`, recomputed without the KV cache from the same t and z_t draws (the
    generator replayed in evaluate's order: per sample, t then the corruption): the prefix/canvas cut,
    the two self-conditioned passes, stratified t, and the per-token normalisation."""
    W, S, seed = 6, 4, 5
    r = run_evaluate(usdm_model, monkeypatch, W, S, seed)
    start = SEQ + 1 - CANVAS
    prefix, canvas = WINDOW[:start], torch.tensor([WINDOW[start:]] * W)
    g = torch.Generator().manual_seed(seed)
    sums = {"mean": 0.0, "udlm": 0.0, "no_sc": 0.0}
    for k in range(S):
        t = (k + torch.rand(W, generator=g)) / S
        hit = torch.rand(W, CANVAS, generator=g) < t[:, None]
        zt = torch.where(hit, torch.randint(0, N, (W, CANVAS), generator=g), canvas)
        first = denoiser_logits_first(usdm_model, prefix, zt)
        second = denoiser_logits(usdm_model, prefix, zt)
        sums["no_sc"] += float(uniform_elbo_integrand(first, canvas, zt, t, N).sum()) / S
        sums["mean"] += float(uniform_elbo_integrand(second, canvas, zt, t, N).sum()) / S
        sums["udlm"] += float(uniform_elbo_integrand(second, canvas, zt, t, N, "udlm").sum()) / S
    n = W * CANVAS
    assert r["bound_nats"] == pytest.approx(sums["mean"] / n, rel=1e-6)  # its softmax is float32
    assert math.log(r["perplexity_bound_udlm"]) == pytest.approx(sums["udlm"] / n, rel=1e-6)
    assert math.log(r["perplexity_bound_no_sc"]) == pytest.approx(sums["no_sc"] / n, rel=1e-6)
    with torch.no_grad():  # the AR number: the causal loss of each canvas token after the prefix
        logits = usdm_model(torch.tensor([WINDOW[:-1]])).logits[0, start - 1:]
    ar = float(torch.nn.functional.cross_entropy(logits.double(), torch.tensor(WINDOW[start:])))
    assert r["ar_nats"] == pytest.approx(ar, rel=1e-6)  # evaluate's cross-entropy is in float32


@torch.no_grad()
def denoiser_logits_first(model: Transformer, prefix: list[int], canvases: torch.Tensor) -> torch.Tensor:
    """The first (not self-conditioned) denoiser pass, without a cache."""
    M, L = canvases.shape
    P = len(prefix)
    mask = torch.ones(P + L, P + L, dtype=torch.bool).tril()
    mask[P:, :] = True
    x = torch.cat([model.embed_tokens(torch.tensor(prefix).repeat(M, 1)), canvas_embeds(model, canvases, None)], 1)
    return model(embeds=x, pos=torch.arange(P + L), mask=mask).logits[:, P:]


def test_usdm_evaluate_udlm_bound_equals_the_enumerated_one(usdm_model, monkeypatch):
    """`evaluate`'s UDLM-rate bound, a Monte-Carlo mean over many windows, against the exact integral
    (enumerated over z_t, quadrature over t); a denoiser reading the clean canvas is far from it."""
    W, S = 4096, 16
    r = run_evaluate(usdm_model, monkeypatch, W, S, seed=0)
    start = SEQ + 1 - CANVAS
    mean, var = exact_usdm(usdm_model, WINDOW[:start], WINDOW[start:])
    se = math.sqrt(var / (W * S))  # plain Monte-Carlo's error; stratified t does no worse
    got = math.log(r["perplexity_bound_udlm"])
    assert abs(got - mean) < Z * se, (got, mean, se)
    leaky, _ = exact_usdm(usdm_model, WINDOW[:start], WINDOW[start:], leak=True)
    assert abs(leaky - mean) > 2 * Z * se, (leaky, mean, se)
