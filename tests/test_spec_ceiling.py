"""scripts/spec_ceiling.py's arithmetic: the accepted-path estimate of P(at least i accepted) against exact enumeration
and against dlm's own verifier, and its ideal drafters on a tiny target against their closed forms."""

from __future__ import annotations

import functools
import importlib.util
import itertools
import math
from pathlib import Path

import pytest
import torch

from dlm.sampling.speculative import verify_sample
from conftest import tiny_model

SCRIPT = Path(__file__).parent.parent / "scripts" / "spec_ceiling.py"
spec = importlib.util.spec_from_file_location("spec_ceiling", SCRIPT)
sc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sc)


def toy_target(seed: int, V: int, S: int):
    """A random joint over S slots of V tokens: p(. | prefix) for every prefix, peaked enough to differ by prefix."""
    g = torch.Generator().manual_seed(seed)
    table = {pre: torch.softmax(2.5 * torch.randn(V, generator=g, dtype=torch.float64), -1)
             for n in range(S) for pre in itertools.product(range(V), repeat=n)}
    return lambda prefix: table[tuple(prefix)]


def exact_at_least(p, qs, V: int, S: int) -> list[float]:
    """P(at least i accepted) by enumeration: sum over x_1..x_i of prod_j min(p(x_j | x_<j), q_j(x_j))."""
    out = []
    for i in range(1, S + 1):
        out.append(sum(math.prod(min(float(p(xs[:j])[xs[j]]), float(qs[j][xs[j]])) for j in range(i))
                       for xs in itertools.product(range(V), repeat=i)))
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_accepted_path_estimate_matches_enumeration_and_the_verifier(seed):
    V, S = 3, 3
    p = toy_target(seed, V, S)
    g = torch.Generator().manual_seed(seed + 10)
    qs = [torch.softmax(torch.randn(V, generator=g, dtype=torch.float64), -1) for _ in range(S)]  # a one-pass draft
    exact = exact_at_least(p, qs, V, S)
    paths = [sc.chain(lambda i, path: p(path), lambda i, path: qs[i], S, g) for _ in range(1500)]
    est = sc.at_least(paths)
    assert est == pytest.approx(exact, abs=0.04)
    # dlm's verifier, drafting each slot from q_i independently, accepts as often
    n_runs, counts = 2000, [0] * S
    q = torch.stack(qs)  # (S, V)
    for _ in range(n_runs):
        draft = torch.stack([torch.multinomial(qs[i], 1, generator=g)[0] for i in range(S)])
        probs = torch.stack([p(draft[:i].tolist()) for i in range(S)] + [torch.full((V,), 1.0 / V, dtype=q.dtype)])
        n, _ = verify_sample(draft, probs, q, g)
        for i in range(n):
            counts[i] += 1
    assert [c / n_runs for c in counts] == pytest.approx(exact, abs=0.04)
    assert sc.tau(exact, 3) == pytest.approx(1 + exact[0] + exact[1])
    assert sc.conditional(exact)[1] == pytest.approx(exact[1] / exact[0])


def test_copy_target_closed_form():
    """x1 ~ Bernoulli(a), x2 = x1: the marginal draft of slot 2 is accepted with a^2 + (1 - a)^2."""
    a = 0.3
    p1 = torch.tensor([1 - a, a], dtype=torch.float64)

    def p(i, path):
        return p1 if i == 0 else torch.eye(2, dtype=torch.float64)[path[0]]

    g = torch.Generator().manual_seed(0)
    paths = [sc.chain(p, lambda i, path: p1, 2, g) for _ in range(3000)]
    assert sc.at_least(paths)[1] == pytest.approx(a * a + (1 - a) ** 2, abs=0.03)


def test_ideal_drafters_on_a_tiny_target():
    """ideal_betas' two drafters on a tiny random Transformer against their closed forms by enumeration."""
    V, S = 5, 3
    model = tiny_model(3, V, std=1.0)
    ctx = torch.tensor([[1, 4, 2]])

    @functools.cache
    @torch.inference_mode()
    def p(prefix):  # the target's T = 1 distribution after ctx + prefix
        x = torch.cat((ctx, torch.tensor([list(prefix)], dtype=torch.long)), 1)
        return torch.softmax(model(x).logits[0, -1].double(), -1)

    m2 = sum(p(())[a] * p((a,)) for a in range(V))
    m3 = sum(p(())[a] * p((a,))[b] * p((a, b)) for a in range(V) for b in range(V))
    exact_f = exact_at_least(lambda pre: p(tuple(pre)), [p(()), m2, m3], V, S)

    def q3(b):  # the first-order draft of slot 3 after slot 2's b
        w = torch.stack([p(())[a] * p((a,))[b] for a in range(V)])
        return sum(w[a] * p((a, b)) for a in range(V)) / w.sum()

    exact_m3 = sum(float(p(())[a] * p((a,))[b] * torch.minimum(p((a, b)), q3(b)).sum())
                   for a in range(V) for b in range(V))
    root = model.new_cache(1, 16)
    with torch.inference_mode():
        root_p = torch.softmax(model(ctx, cache=root).logits[0, -1].float(), -1)
        g = torch.Generator().manual_seed(0)
        runs = [sc.ideal_betas(model, root, root_p, S, 300, 2, g) for _ in range(100)]
    assert root.length == 3  # the context's cache is copied, not written
    fact = sc.at_least([r["factorized"] for r in runs])
    first = sc.at_least([r["first_order"] for r in runs])
    assert fact == pytest.approx(exact_f, abs=0.05)
    assert first[:2] == pytest.approx([1.0, 1.0], abs=1e-5)  # slot 2 after slot 1's own token: the target's conditional
    assert first[2] == pytest.approx(exact_m3, abs=0.05)
    assert exact_m3 > exact_f[2] + 0.05  # the configuration separates the two drafters
    # the top-2 drafter: slot 1 is p1 on its top 2, slot 2 the target's conditional on the top 2 of slot 2's marginal
    top1, top2 = torch.topk(p(()), 2).indices, torch.topk(m2, 2).indices
    exact_t = [float(p(())[top1].sum())]
    exact_t.append(sum(float(p(())[a] * torch.minimum(p((a,)), sc.on_top(p((a,)), top2)).sum()) for a in top1.tolist()))
    assert sc.at_least([r["top_k"][:2] for r in runs]) == pytest.approx(exact_t, abs=0.05)
