"""The verifier is lossless: what speculative decoding emits is distributed exactly as the target's samples.

Three layers, each against a reference computed here, independently of dlm's code:

  one slot     `verify_sample` on hand-written p and q (and the one-hot q = None of prompt lookup),
               many draws, compared with the exact output distribution p, and P(accept) = sum min(p, q);
  many slots   prefix-independent p and q rows, so emitted token j (when there is one) must follow p[j]
               and the acceptance length has a known law;
  the loop     `speculate` with every drafter (prompt lookup, an AR draft model, a DFlash drafter) on a
               tiny random target with 8 tokens, at temperature 0.7, 1.0 and 1.3, with and without
               top-k / top-p: the marginal of each of the first four emitted tokens against the target's
               exact distribution, enumerated from the target's own logits under the same processing
               (written again below, not taken from dlm.sampling).

Every test is seeded (the verdict is fixed) and uses chi-square with an exact p-value and a small
threshold (1e-4), so a correct verifier passes with room to spare and the deliberate bugs listed in
docs/testing.md fail by orders of magnitude.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import tiny_model
from dlm.config import ModelConfig
from dlm.model import Transformer
from dlm.sampling.common import Commit
from dlm.sampling.speculative import (
    ARDraft, DFlashDraft, PromptLookup, Sampling, WithLookup, speculate, verify_greedy, verify_sample, verify_tree,
)
from dlm.drafter import DFlashDrafter, first_draws

V = 8  # vocabulary of the loop test: small enough to enumerate four tokens (8**3 prefixes)
ALPHA = 1e-4  # a correct verifier fails a given check with this probability (each seed fixed)


# statistics ------------------------------------------------------------------------------------

def chi2_sf(x: float, dof: int) -> float:
    """P(chi-square(dof) > x), exact (regularised upper incomplete gamma at half-integer shape)."""
    y = x / 2
    if dof % 2 == 0:
        term = total = math.exp(-y)
        for i in range(1, dof // 2):
            term *= y / i
            total += term
        return total
    total = math.erfc(math.sqrt(y))
    for i in range(1, (dof + 1) // 2):
        total += math.exp(-y + (i - 0.5) * math.log(y) - math.lgamma(i + 0.5)) if y > 0 else 0.0
    return total


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of observed counts against exact probabilities; cells expecting < 5 pooled."""
    n = float(counts.sum())
    e = probs.double() * n
    o = counts.double()
    if bool(((e == 0) & (o > 0)).any()):
        return math.inf, 1  # a token the target can never emit
    big = e >= 5
    stat = float(((o[big] - e[big]) ** 2 / e[big]).sum())
    cells = int(big.sum())
    pe, po = float(e[~big].sum()), float(o[~big].sum())
    if pe > 0:
        stat += (po - pe) ** 2 / pe
        cells += 1
    return stat, max(cells - 1, 1)


def assert_follows(counts: torch.Tensor, probs: torch.Tensor, what: str) -> None:
    stat, dof = chi_square(counts, probs)
    p = chi2_sf(stat, dof) if math.isfinite(stat) else 0.0
    n = float(counts.sum())
    assert p > ALPHA, (f"{what}: observed {(counts.double() / n).numpy().round(3)} vs exact "
                       f"{probs.double().numpy().round(3)} (chi2 {stat:.1f}, dof {dof}, p {p:.2g}, n {int(n)})")


def test_chi2_sf_known_values():
    assert chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(5.991464547107979, 2) == pytest.approx(0.05, rel=1e-9)
    assert chi2_sf(24.321886347856854, 7) == pytest.approx(0.001, rel=1e-9)
    assert chi2_sf(0.0, 5) == pytest.approx(1.0)


# one slot --------------------------------------------------------------------------------------

P3 = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]], dtype=torch.float64)  # target at the slot, then the bonus
Q3 = torch.tensor([[0.2, 0.3, 0.5]], dtype=torch.float64)


def one_slot_draws(p: torch.Tensor, q: torch.Tensor | None, n: int, seed: int, fixed: int | None = None):
    """n calls of verify_sample with one proposal (drawn from q, or `fixed` for a one-hot drafter)."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q[0], n, replacement=True, generator=g) if q is not None else torch.full((n,), fixed)
    out = torch.empty(n, dtype=torch.long)
    acc = torch.empty(n, dtype=torch.long)
    bonus = []
    for i in range(n):
        k, tok = verify_sample(drafts[i:i + 1], p, q, g)
        acc[i] = k
        out[i] = drafts[i] if k == 1 else tok
        if k == 1:
            bonus.append(tok)
        else:
            assert tok != int(drafts[i]), "the rejected draft was drawn again"
    return drafts, out, acc, torch.tensor(bonus, dtype=torch.long)


def test_one_slot_rule_outputs_exactly_p():
    """p = [.5, .3, .2], q = [.2, .3, .5]: the emitted token follows p (not [.81, .09, .10], which `r < p`
    without q gives), P(accept) = sum min(p, q) = 0.7, and after an acceptance the bonus follows p[1]."""
    n = 6000
    _, out, acc, bonus = one_slot_draws(P3, Q3, n, seed=0)
    assert_follows(torch.bincount(out, minlength=3), P3[0], "emitted token")
    assert_follows(torch.bincount(acc, minlength=2), torch.tensor([0.3, 0.7]), "acceptance")
    assert_follows(torch.bincount(bonus, minlength=3), P3[1], "bonus token")


@pytest.mark.parametrize("fixed", [0, 2])
def test_one_slot_rule_one_hot_draft(fixed):
    """A drafter without probabilities (prompt lookup) counts as one-hot: accept x with probability p(x),
    else draw from p with x removed; the emitted token follows p."""
    n = 4000
    _, out, acc, _ = one_slot_draws(P3, None, n, seed=1 + fixed, fixed=fixed)
    assert_follows(torch.bincount(out, minlength=3), P3[0], "emitted token")
    px = float(P3[0, fixed])
    assert_follows(torch.bincount(acc, minlength=2), torch.tensor([1 - px, px]), "acceptance")


def test_one_slot_rule_edge_cases_are_exact():
    """Certain outcomes: a draft the target gives probability 0 is always rejected (and never emitted);
    a drafter equal to the target is always accepted; a zero-probability bonus never appears."""
    g = torch.Generator().manual_seed(3)
    p = torch.tensor([[0.0, 0.6, 0.4], [0.0, 0.0, 1.0]], dtype=torch.float64)
    q = torch.tensor([[0.9, 0.05, 0.05]], dtype=torch.float64)
    for _ in range(200):
        n, tok = verify_sample(torch.tensor([0]), p, q, g)
        assert n == 0 and tok in (1, 2)
        n, tok = verify_sample(torch.tensor([1]), p, p[:1], g)  # q == p: r * q < p for every r < 1
        assert n == 1 and tok == 2
        n, tok = verify_sample(torch.tensor([0]), p, None, g)  # one-hot on a token p excludes
        assert n == 0 and tok in (1, 2)
    n, tok = verify_sample(torch.zeros(0, dtype=torch.long), p[1:], None, g)  # no proposal: the bonus alone
    assert (n, tok) == (0, 2)


def test_verify_sample_is_a_function_of_its_generator():
    """Seeded runs repeat exactly: every random draw comes from the generator passed in."""
    p = random_rows(3, 6, 1)
    q = random_rows(2, 6, 2)
    draft = torch.tensor([1, 4])

    def draws(seed, global_seed):
        g = torch.Generator().manual_seed(seed)
        torch.manual_seed(global_seed)  # the global generator is elsewhere on each run
        return [verify_sample(draft, p, q, g) for _ in range(50)] + [verify_sample(draft, p, None, g) for _ in range(50)]

    assert draws(0, 1) == draws(0, 2)
    assert draws(0, 1) != draws(1, 1)


# many slots ------------------------------------------------------------------------------------

def random_rows(k: int, n: int, seed: int, sparsity: float = 0.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(k, n, generator=g, dtype=torch.float64) ** 2 + 0.02
    if sparsity:
        w = w * (torch.rand(k, n, generator=g, dtype=torch.float64) > sparsity)
        w[:, 0] += 0.05  # every row keeps some mass
    return w / w.sum(-1, keepdim=True)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "top-k-like"])
def test_many_slots_emit_p_row_by_row(sparse):
    """Rows of p independent of the prefix: emitted token j (when there is one) follows p[j], and
    P(at least j accepted) = prod_{i<j} sum min(p_i, q_i). Sparse rows (zeros, as top-k / top-p leave)
    put draft mass where the target has none and the other way round."""
    k, n_tok, n = 3, 6, 3000
    p = random_rows(k + 1, n_tok, 10 + sparse, 0.4 if sparse else 0.0)
    q = random_rows(k, n_tok, 20 + sparse, 0.4 if sparse else 0.0)
    g = torch.Generator().manual_seed(30 + sparse)
    drafts = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g) for i in range(k)], 1)  # (n, k)
    per_slot = [[] for _ in range(k + 1)]
    lengths = torch.zeros(k + 1, dtype=torch.long)
    for i in range(n):
        acc, tok = verify_sample(drafts[i], p, q, g)
        lengths[acc] += 1
        emitted = drafts[i, :acc].tolist() + [tok]
        for j, t in enumerate(emitted):
            per_slot[j].append(t)
    for j in range(k + 1):
        assert_follows(torch.bincount(torch.tensor(per_slot[j]), minlength=n_tok), p[j], f"slot {j}")
    a = torch.minimum(p[:k], q).sum(-1)  # acceptance probability of each slot
    reach = torch.cat([torch.ones(1, dtype=torch.float64), torch.cumprod(a, 0)])  # P(n >= j)
    law = reach - torch.cat([reach[1:], torch.zeros(1, dtype=torch.float64)])  # P(n = j)
    assert_follows(lengths, law, "acceptance length")


def test_verify_greedy_by_hand():
    logits = torch.full((4, 5), -1.0)
    logits[0, 2] = logits[1, 4] = logits[2, 0] = logits[3, 3] = 2.0  # argmax 2, 4, 0, 3
    assert verify_greedy(torch.tensor([2, 4, 0]), logits) == (3, 3)  # all accepted, the bonus after them
    assert verify_greedy(torch.tensor([2, 4, 1]), logits) == (2, 0)  # the target's token at the first miss
    assert verify_greedy(torch.tensor([2, 1, 0]), logits) == (1, 4)  # a later match does not count
    assert verify_greedy(torch.tensor([1, 4, 0]), logits) == (0, 2)
    assert verify_greedy(torch.zeros(0, dtype=torch.long), logits[:1]) == (0, 2)  # no proposal


# draft trees (--draft-branches) -----------------------------------------------------------------

def test_first_draws_are_draws_without_replacement():
    """first_draws(q, 2): the pair (a, b) has probability q(a) q(b) / (1 - q(a)), b != a; each draw's distribution is
    q without the draws before it, renormalised; no more draws than q has tokens with mass."""
    q = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05], dtype=torch.float64)
    g = torch.Generator().manual_seed(4)
    n = 6000
    counts = torch.zeros(25, dtype=torch.long)
    for _ in range(n):
        pick, qs = first_draws(q, 2, g)
        a, b = pick.tolist()
        counts[5 * a + b] += 1
        assert torch.allclose(qs[0], q) and qs[1, a] == 0 and torch.allclose(qs[1], q * (torch.arange(5) != a) / (1 - q[a]))
    law = torch.tensor([float(q[a] * q[b] / (1 - q[a])) if a != b else 0.0 for a in range(5) for b in range(5)],
                       dtype=torch.float64)
    assert_follows(counts, law, "pairs without replacement")
    pick, qs = first_draws(torch.tensor([0.0, 0.7, 0.3]), 3, g)
    assert sorted(pick.tolist()) == [1, 2] and qs.shape == (2, 3)


def first_slot_acceptance(r: torch.Tensor, q: torch.Tensor, width: int) -> float:
    """P(some branch's first token is accepted), enumerated: draw x from q, accept with min(1, r(x) / q(x)); else
    the next branch draws from q without x against the residual norm(max(r - q, 0))."""
    if width == 0 or float(q.sum()) <= 0:
        return 0.0
    total = 0.0
    left = (r - q).clamp(min=0)
    left = left / left.sum() if float(left.sum()) > 0 else r
    for x in range(q.shape[0]):
        if float(q[x]) == 0:
            continue
        a = min(1.0, float(r[x] / q[x]))
        rest = q.clone()
        rest[x] = 0
        after = first_slot_acceptance(left, rest / rest.sum(), width - 1) if float(rest.sum()) > 0 else 0.0
        total += float(q[x]) * (a + (1 - a) * after)
    return total


@pytest.mark.parametrize("width", [2, 3])
def test_tree_verifier_emits_p_and_accepts_more(width):
    """verify_tree on prefix-independent rows (the target's p at the first slot, the second, the bonus; each branch's
    q): the first emitted token follows p[0], the second p[1], the third p[2]; the first slot is accepted with the
    probability enumerated above (for 2 and 3 branches above one branch's sum min(p, q)), and the acceptance length
    has the law that gives along the kept branch."""
    k, n_tok, n = 2, 6, 4000
    p = random_rows(k + 1, n_tok, 40 + width)
    q = random_rows(k, n_tok, 50 + width)
    g = torch.Generator().manual_seed(60 + width)
    sampling = Sampling(1.0, gen=g)
    per_slot = [[] for _ in range(k + 1)]
    lengths = torch.zeros(k + 1, dtype=torch.long)
    logits = torch.cat([p[:1]] + [p[1:]] * width).log()  # the window: the last token, then each branch's slots
    for _ in range(n):
        first, q0 = first_draws(q[0], width, g)
        rest = torch.multinomial(q[1], width, replacement=True, generator=g)
        drafts = torch.stack((first, rest), 1)  # (W, k)
        qw = torch.stack((q0, q[1][None].expand(width, -1)), 1)  # (W, k, V)
        w, acc, tok = verify_tree(drafts, logits, qw, sampling)
        lengths[acc] += 1
        for j, t in enumerate(drafts[w, :acc].tolist() + [tok]):
            per_slot[j].append(t)
    for j in range(k + 1):
        assert_follows(torch.bincount(torch.tensor(per_slot[j]), minlength=n_tok), p[j], f"slot {j}")
    a1 = first_slot_acceptance(p[0], q[0], width)
    assert a1 > float(torch.minimum(p[0], q[0]).sum()) + 0.05
    a2 = float(torch.minimum(p[1], q[1]).sum())
    assert_follows(lengths, torch.tensor([1 - a1, a1 * (1 - a2), a1 * a2], dtype=torch.float64), "acceptance length")


def test_tree_verifier_greedy_takes_the_branch_that_matches():
    """Greedy: the branch whose first token is the target's argmax after the last token, then matched along its own
    rows of the window (the last token's, then branch 0's three, then branch 1's)."""
    logits = torch.full((7, 5), -1.0)
    for row, tok in enumerate([3, 1, 2, 0, 0, 2, 4]):  # the target's argmax at each window row
        logits[row, tok] = 2.0
    assert verify_tree(torch.tensor([[1, 2, 0], [3, 0, 2]]), logits, None, Sampling()) == (1, 3, 4)  # all of branch 1
    assert verify_tree(torch.tensor([[3, 2, 1], [2, 0, 2]]), logits, None, Sampling()) == (0, 1, 1)  # branch 0, then 1
    assert verify_tree(torch.tensor([[1, 2, 0], [2, 0, 2]]), logits, None, Sampling()) == (0, 0, 3)  # none: the argmax


# the loop, against the target's exact distribution ---------------------------------------------

def processed(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The sampling distribution, written out: softmax(logits / T), the top_k largest kept, then the
    smallest set of most likely tokens whose mass reaches top_p (float64; rows (..., V))."""
    z = logits.double() / temperature
    if top_k:
        kth = z.sort(-1, descending=True).values[..., top_k - 1:top_k]
        z = torch.where(z >= kth, z, torch.full_like(z, -math.inf))
    p = torch.softmax(z, -1)
    if top_p < 1:
        flat = p.reshape(-1, p.shape[-1]).clone()
        for row in flat:
            order = row.argsort(descending=True).tolist()
            mass = 0.0
            for j, t in enumerate(order):
                if mass >= top_p:
                    row[order[j:]] = 0.0
                    break
                mass += float(row[t])
        p = (flat / flat.sum(-1, keepdim=True)).view_as(p)
    return p


def exact_marginals(target: Transformer, prompt: list[int], n: int, temperature: float, top_k: int,
                    top_p: float) -> torch.Tensor:
    """(n, V): the exact distribution of each of the first n sampled tokens, by enumerating every prefix."""
    prefixes = torch.tensor([prompt])  # (M, P + d) all continuations of length d
    weight = torch.ones(1, dtype=torch.float64)  # their probabilities
    out = []
    with torch.no_grad():
        for _ in range(n):
            p = processed(target(prefixes).logits[:, -1], temperature, top_k, top_p)  # (M, V)
            joint = weight[:, None] * p
            out.append(joint.sum(0))
            weight = joint.flatten()
            M = prefixes.shape[0]
            prefixes = torch.cat([prefixes.repeat_interleave(V, 0), torch.arange(V).repeat(M)[:, None]], 1)
    return torch.stack(out)


def tiny_dflash(target: Transformer, seed: int, block: int) -> DFlashDrafter:
    torch.manual_seed(seed)
    d = DFlashDrafter(ModelConfig(**{**target.cfg.to_dict(), "n_layers": 1}), [0], block, mask_id=V - 1)
    with torch.no_grad():
        d.fc.weight.normal_(0, 0.5)
    return d.eval()


PROMPT = [2, 5, 0, 7, 3, 6, 1, 4, 2, 0]  # every token occurs with a continuation: prompt lookup always proposes
GAMMA = 3  # two proposals per cycle: slots 0 and 1, the residual at either, and the bonus
NEW = 4  # tokens per run: the prefill's draw, then the first cycle (2 proposals + bonus)
RUNS = 300
PROCESSING = {  # (temperature, top_k, top_p): each temperature plain, and with a cut of the tail
    "T0.7": (0.7, 0, 1.0), "T0.7-topk3": (0.7, 3, 1.0),
    "T1.0": (1.0, 0, 1.0), "T1.0-topp0.8": (1.0, 0, 0.8),
    "T1.3": (1.3, 0, 1.0), "T1.3-topk5-topp0.9": (1.3, 5, 0.9),
}


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> Transformer:
    return tiny_model(11, V, dtype=torch.float32)


@pytest.fixture(scope="module")
def exact(target):
    return {name: exact_marginals(target, PROMPT, NEW, *proc) for name, proc in PROCESSING.items()}


KINDS = ["lookup", "ar-draft", "dflash", "dflash+lookup"]


def make_drafter(kind: str, target: Transformer, sampling: Sampling):
    if kind == "lookup":
        return PromptLookup(2)
    if kind == "ar-draft":  # the target with noise on every weight: it agrees often, not always
        draft = tiny_model(11, V, dtype=torch.float32)
        torch.manual_seed(5)
        with torch.no_grad():
            for p in draft.parameters():
                if p.dim() >= 2:
                    p.add_(torch.randn_like(p) * 0.2)
        return ARDraft(draft, sampling, 32)
    if kind == "dflash+lookup":  # bigrams seen before: lookup's proposal (one-hot q), else the drafter's (its q)
        return WithLookup(make_drafter("dflash", target, sampling), PromptLookup(2))
    return DFlashDraft(tiny_dflash(target, 2, GAMMA), target, sampling, 32)


@pytest.mark.parametrize("proc", list(PROCESSING))
@pytest.mark.parametrize("kind", KINDS)
def test_speculate_emits_the_target_distribution(kind, proc, target, exact):
    """The first four emitted tokens of `speculate`, each against its exact marginal under the target.

    Token 1 is the prefill's draw; tokens 2 and 3 come from the first cycle's two slots (an accepted
    proposal or the residual draw), token 4 from the bonus or the next cycle. Seeded per case."""
    temperature, top_k, top_p = PROCESSING[proc]
    seed = 1000 + 17 * list(PROCESSING).index(proc) + KINDS.index(kind)
    sampling = Sampling(temperature, top_k, top_p, torch.Generator().manual_seed(seed))
    drafter = make_drafter(kind, target, sampling)
    counts = torch.zeros(NEW, V, dtype=torch.long)
    accepted = 0
    for _ in range(RUNS):
        toks = []
        for ev in speculate(target, drafter, PROMPT, block_size=GAMMA, max_new_tokens=NEW, sampling=sampling):
            if isinstance(ev, Commit):
                toks.extend(ev.tokens)
            elif hasattr(ev, "accepted"):
                accepted += ev.accepted
        assert len(toks) == NEW
        counts[torch.arange(NEW), torch.tensor(toks)] += 1
    assert accepted > RUNS // 10, "the drafts were hardly ever accepted: the test would not exercise acceptance"
    if kind == "dflash+lookup":  # both proposers took part
        assert drafter.lookups > RUNS // 10 and drafter.forwards > RUNS // 10, (drafter.lookups, drafter.forwards)
    for j in range(NEW):
        assert_follows(counts[j], exact[proc][j], f"{kind} {proc} token {j + 1}")


def test_processing_reference_is_what_the_sampler_documents():
    """The test's own processing (above) agrees with dlm's on random logits, so the loop test's exact
    distributions are those the sampler promises (temperature, then top-k, then top-p)."""
    from dlm.sampling.common import probs_from_logits

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, V, generator=g) * 2
    for proc in PROCESSING.values():
        torch.testing.assert_close(processed(logits, *proc), probs_from_logits(logits, *proc).double(),
                                   atol=1e-6, rtol=1e-5)
