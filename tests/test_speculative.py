"""The lossless verifier: greedy equality with the target's own output, and exact distributions when sampling."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dlm.config import ModelConfig
from dlm.model import Transformer
from dlm.sampling.common import Commit
from dlm.sampling.speculative import (
    ARDraft, DFlashDraft, DiffusionDraft, PromptLookup, Sampling, SpecStats, Verified, WithLookup, speculate,
    spec_stats, target_greedy, verify_sample,
)


def random_model(seed: int, vocab: int = 48, dim: int = 32, layers: int = 2, std: float = 0.02,
                 dtype=torch.float64, device: torch.device | str = "cpu") -> Transformer:
    torch.manual_seed(seed)
    m = Transformer(ModelConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=64,
                                max_seq_len=256))
    if std != 0.02:
        with torch.no_grad():
            for p in m.parameters():
                if p.dim() >= 2:
                    p.normal_(0, std)
    return m.to(device, dtype).eval()


def random_dflash(target: Transformer, seed: int, block: int = 6, injection: str = "kv", features: bool = True,
                  noise: str = "mask", scramble: bool = False, **dflash2):
    from dlm.drafter import DFlashDrafter, target_layer_ids

    torch.manual_seed(seed)
    mc = ModelConfig(**{**target.cfg.to_dict(), "n_layers": 1})
    ids = target_layer_ids(target.cfg.n_layers, target.cfg.n_layers)
    mask = min(3, target.cfg.vocab_size - 1)
    d = DFlashDrafter(mc, ids, block, mask_id=mask, injection=injection, target_features=features, block_noise=noise,
                      **dflash2)
    if scramble:  # every matrix random, the convolutions and codebooks too (they start as identity and zero): an
        # untrained drafter's slots then vary with its context, where one at the default init repeats <mask>
        with torch.no_grad():
            for p in d.parameters():
                if p.dim() >= 2:
                    p.normal_(0, 0.3)
    return d.to(target.device, target.embed_tokens.weight.dtype).eval()


DFLASH2 = dict(conv_kernel_size=2, conv_group_size=8, selector_rank=4, selector_top_k=6, scramble=True)


def run(target, drafter, prompt, block_size, max_new, sampling=None, eos=None, branches=1):
    stats = SpecStats()
    events = list(speculate(target, drafter, prompt, block_size=block_size, max_new_tokens=max_new, sampling=sampling,
                            eos_id=eos, stats=stats, branches=branches))
    toks = [t for e in events if isinstance(e, Commit) for t in e.tokens]
    return toks, stats, events


def drafters_for(target, seed, sampling):
    dev = target.device
    return {
        "lookup": PromptLookup(3),
        "ar-self": ARDraft(target, sampling, 512),  # the target drafting for itself: everything accepted
        "ar-other": ARDraft(random_model(seed + 100, std=0.2, device=dev), sampling, 512),
        "dflash-kv": DFlashDraft(random_dflash(target, seed), target, sampling, 512),
        "dflash-input": DFlashDraft(random_dflash(target, seed, injection="input"), target, sampling, 512, passes=2),
        "dflash-nofeat": DFlashDraft(random_dflash(target, seed, features=False), target, sampling, 512),
        "dflash-uniform": DFlashDraft(random_dflash(target, seed, noise="uniform"), target, sampling, 512, passes=3),
        "mdlm": DiffusionDraft(random_model(seed + 200, std=0.2, device=dev), 3, 4, sampling, 512, passes=2),
        "joint": DiffusionDraft(random_model(seed + 300, std=0.2, device=dev), 3, 4, sampling, 512,
                                causal_context=True),
    }


@pytest.mark.parametrize("seed", range(3))
def test_greedy_equals_target_over_random_models(seed, device):
    target = random_model(seed, std=0.15, device=device)  # peaked enough to repeat itself: drafts get accepted
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 48, (int(n),), generator=g).tolist() for n in torch.randint(1, 20, (3,), generator=g)]
    for name, drafter in drafters_for(target, seed, Sampling()).items():
        for prompt in prompts:
            ref = target_greedy(target, prompt, 30, eos_id=None)
            gamma = 6 if name.startswith("dflash") else 5
            out, stats, _ = run(target, drafter, prompt, gamma, 30)
            assert out == ref, (name, prompt)
            assert 1 <= stats.committed / stats.cycles <= gamma
            if name == "ar-self":
                assert stats.committed / stats.cycles > gamma - 1  # all accepted (but the end)


@pytest.mark.parametrize("seed", range(3))
def test_a_drafter_with_lookup_is_lossless_and_drafts_with_both(seed, device):
    """FOLDER+lookup: greedy output is the target's; cycles whose context ends in a trigram seen before propose
    lookup's continuation (no drafter pass), the others the drafter's own draft; with an n-gram longer than any
    repeat, every cycle is the drafter's, draft for draft."""
    target = random_model(seed, std=0.15, device=device)  # peaked enough to repeat itself: lookup finds trigrams
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 48, (int(n),), generator=g).tolist() for n in torch.randint(2, 20, (3,), generator=g)]
    for main in (DFlashDraft(random_dflash(target, seed), target, Sampling(), 512),
                 ARDraft(random_model(seed + 100, std=0.2, device=device), Sampling(), 512)):
        both = WithLookup(main, PromptLookup(3))
        lookups = forwards = 0
        for prompt in prompts:
            ref = target_greedy(target, prompt, 40, eos_id=None)
            f0 = main.forwards
            out, _, events = run(target, both, prompt, 6, 40)
            assert out == ref, prompt
            forwards += main.forwards - f0
            seq = list(prompt)
            for e in events:  # each cycle's proposal: lookup's wherever its trigram matched
                if isinstance(e, Verified):
                    lk, n = PromptLookup(3).match(torch.tensor(seq), len(e.proposed))
                    if n == 3:
                        assert e.proposed == lk.tolist()
                        lookups += 1
                if isinstance(e, Commit):
                    seq += e.tokens
        assert lookups > 0 and forwards > 0 and both.lookups == lookups
        alone = WithLookup(main, PromptLookup(100))  # an n-gram longer than the text: the drafter alone
        for prompt in prompts:
            a = [e for e in run(target, alone, prompt, 6, 40)[2] if isinstance(e, Verified)]
            b = [e for e in run(target, main, prompt, 6, 40)[2] if isinstance(e, Verified)]
            assert [(e.proposed, e.accepted) for e in a] == [(e.proposed, e.accepted) for e in b]


@pytest.mark.parametrize("seed", range(3))
def test_draft_trees_greedy_equal_target(seed, device):
    """--draft-branches: trees of 2-3 branches (a DFlash 1 drafter's, a DFlash 2 selector's walks, and with prompt
    lookup beside) verified in one forward give the target's greedy output, with an end of text live and budgets that
    end mid-block; cycles kept a branch other than the first (its K/V moved into place behind the last token, which
    the next cycle reads)."""
    target = random_model(seed, vocab=12, std=0.15, device=device)  # (a small vocabulary: an untrained drafter's
    # second and third candidates are the target's choice often enough)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 12, (int(n),), generator=g).tolist() for n in torch.randint(1, 20, (3,), generator=g)]
    makers = {"dflash": lambda: DFlashDraft(random_dflash(target, seed, scramble=True), target, Sampling(), 512),
              "dflash2": lambda: DFlashDraft(random_dflash(target, seed, **DFLASH2), target, Sampling(), 512),
              "dflash2+lookup": lambda: WithLookup(DFlashDraft(random_dflash(target, seed, **DFLASH2), target,
                                                               Sampling(), 512), PromptLookup(3))}
    for name, make in makers.items():
        branched = 0
        for i, prompt in enumerate(prompts):
            eos = target_greedy(target, prompt, 40, eos_id=None)[25] if i == 0 else None
            ref = target_greedy(target, prompt, 37, eos_id=eos)
            for block, width in ((4, 2), (6, 3)):
                out, stats, _ = run(target, make(), prompt, block, 37, eos=eos, branches=width)
                assert out == ref, (name, prompt, block, width)
                branched += stats.branched
        assert branched > 0, name


def test_crop_take_moves_the_kept_branch_behind_the_last_token():
    """KVCache.crop(length, take=(src, dst)): slots src.. copied to dst..length-1 in every buffer, then the cut; a
    take outside the written slots is refused."""
    from dlm.model import KVCache

    cfg = ModelConfig(vocab_size=16, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=16, max_seq_len=32)
    cache = KVCache(cfg, 1, 12)
    for t in cache.buffers():
        t.copy_(torch.arange(12.0).view(1, 1, 1, 12, 1).expand_as(t))
    cache.length = 10  # the last token at 3, branch 0 at 4..6, branch 1 at 7..9
    cache.crop(6, take=(7, 4))  # branch 1's first two slots kept
    assert cache.length == 6
    for t in cache.buffers():
        assert t[..., :6, 0].flatten(0, -2).eq(torch.tensor([0.0, 1, 2, 3, 7, 8])).all()
    with pytest.raises(ValueError):
        cache.crop(6, take=(5, 4))  # slots 5..6 were cut
    assert cache.length == 6


def test_eos_and_budget_cut_like_the_target(device):
    target = random_model(7, std=0.15, device=device)
    prompt = [5, 6, 7, 8]
    ref = target_greedy(target, prompt, 60, eos_id=None)
    eos = ref[17]  # a token the target emits: generation must stop right after its first occurrence
    for drafter in (ARDraft(target, Sampling(), 512), PromptLookup(2)):
        out, _, _ = run(target, drafter, prompt, 5, 60, eos=eos)
        assert out == target_greedy(target, prompt, 60, eos_id=eos)
        assert out[-1] == eos and eos not in out[:-1]
        for n in (1, 2, 3, 13):
            assert run(target, drafter, prompt, 5, n)[0] == ref[:n]


def test_tau_histogram_and_rollback_bookkeeping():
    target = random_model(3, std=0.15)
    prompt = list(range(4, 14))
    out, stats, events = run(target, ARDraft(target, Sampling(), 512), prompt, 5, 41)
    assert len(out) == 41
    assert stats.cycles == 8 and stats.committed == 40  # 1 token from the prefill, then 8 full cycles of 4 + 1
    assert stats.histogram[5] == 8 and stats.forwards == 9
    ver = [e for e in events if isinstance(e, Verified)]
    assert all(v.accepted == len(v.proposed) == 4 for v in ver)
    # a drafter that never agrees: one token per cycle
    class Wrong(PromptLookup):
        def propose(self, seq, k):
            return (target_greedy(target, seq.tolist(), 1, None)[0] + 1 + torch.arange(k)) % 48, None
    out2, st2, _ = run(target, Wrong(), prompt, 5, 20)
    assert out2 == target_greedy(target, prompt, 20, None)
    assert st2.histogram == [0, 19] and st2.committed / st2.cycles == 1.0
    s = spec_stats(st2, "wrong", 5, 20, 0).as_dict()
    assert s["tau"] == 1.0 and s["acceptance_histogram"] == [0, 19, 0, 0, 0, 0] and s["forwards"] == 20


def test_prompt_lookup_proposes_the_continuation_of_the_last_ngram():
    lk = PromptLookup(3)
    seq = torch.tensor([1, 2, 3, 9, 8, 7, 6, 1, 2, 3])
    assert lk.propose(seq, 3)[0].tolist() == [9, 8, 7]
    assert lk.propose(seq, 10)[0].tolist() == [9, 8, 7, 6, 1, 2, 3]  # runs to the end of the context
    assert lk.propose(torch.tensor([5, 6, 7]), 4)[0].tolist() == []
    periodic = torch.tensor([4, 5] * 6)
    assert lk.propose(periodic, 4)[0].tolist() == [4, 5, 4, 5]  # a full continuation, not a stub


def test_verify_sample_certain_outcomes():
    """What verify_sample must do with certainty (the distributions are tests/test_verifier.py's): a
    proposal the target gives probability 0 is always rejected and never emitted; a drafter whose q
    equals p is always accepted, and the bonus is drawn from the row after the last proposal."""
    g = torch.Generator().manual_seed(1)
    p = torch.tensor([[0.0, 0.7, 0.3], [0.2, 0.3, 0.5], [0.0, 0.0, 1.0]], dtype=torch.float64)
    q = torch.tensor([[0.8, 0.1, 0.1], [0.2, 0.3, 0.5]], dtype=torch.float64)
    for _ in range(100):
        n, tok = verify_sample(torch.tensor([0, 1]), p, q, g)
        assert n == 0 and tok in (1, 2)  # rejected at slot 0; the residual max(0, p - q) excludes token 0
        n, tok = verify_sample(torch.tensor([1, 2]), p, torch.stack([p[0], p[1]]), g)
        assert (n, tok) == (2, 2)  # q == p: every proposal accepted, the bonus from p[2]
        n, tok = verify_sample(torch.tensor([0]), p, None, g)  # one-hot q on a token p excludes
        assert n == 0 and tok in (1, 2)


def exact_distribution(target: Transformer, prompt: list[int], n: int, temperature: float) -> dict:
    """P(x_1..x_n | prompt) for every sequence, by enumeration."""
    V = target.cfg.vocab_size
    out = {}
    with torch.no_grad():
        for seq in itertools.product(range(V), repeat=n):
            x = torch.tensor([prompt + list(seq)])
            logp = torch.log_softmax(target(x).logits[0].double() / temperature, -1)
            P = len(prompt)
            out[seq] = math.exp(sum(float(logp[P - 1 + i, seq[i]]) for i in range(n)))
    return out


@pytest.mark.parametrize("kind", ["ar-other", "lookup", "dflash-kv", "dflash-uniform", "mdlm", "dflash-tree",
                                  "dflash2-tree"])
def test_sampling_distribution_matches_target(kind):
    """Temperature 1: the speculative loop's sequences follow the target's exact distribution (chi-square).

    Four tokens: the prefill's, then one cycle of two proposals and the bonus, so acceptance, the
    residual draw at every slot and the bonus draw are all exercised. Seeded: the verdict is fixed.
    The trees (2 branches, a DFlash 1 drafter's and a DFlash 2 selector's): the first slot by recursive rejection
    over two draws without replacement, then the kept branch, whose K/V the next cycle reads.
    """
    V, n, N = 3, 4, 1200
    target = random_model(11, vocab=V, dim=16, layers=1, std=0.5)
    prompt = [1, 2, 1, 2, 1]
    exact = exact_distribution(target, prompt, n, 1.0)
    sampling = Sampling(temperature=1.0, gen=torch.Generator().manual_seed(123))
    drafter = {"ar-other": lambda: ARDraft(random_model(5, vocab=V, dim=16, layers=1, std=0.5), sampling, 64),
               "lookup": lambda: PromptLookup(2),
               "dflash-kv": lambda: DFlashDraft(_mask_free_dflash(target), target, sampling, 64),
               "dflash-uniform": lambda: DFlashDraft(random_dflash(target, 2, block=4, noise="uniform"), target,
                                                     sampling, 64, passes=2),
               "mdlm": lambda: DiffusionDraft(random_model(6, vocab=V, dim=16, layers=1, std=0.5), 2, 4, sampling, 64,
                                              passes=2),
               "dflash-tree": lambda: DFlashDraft(random_dflash(target, 2, block=4, scramble=True), target, sampling,
                                                  64),
               "dflash2-tree": lambda: DFlashDraft(random_dflash(target, 2, block=4, **{**DFLASH2, "selector_top_k": 3}),
                                                   target, sampling, 64)}[kind]()
    branches = 2 if kind.endswith("tree") else 1
    counts: dict = {}
    accepted = branched = 0
    for _ in range(N):
        out, stats, events = run(target, drafter, prompt, 3, n, sampling, branches=branches)
        counts[tuple(out)] = counts.get(tuple(out), 0) + 1
        accepted += sum(e.accepted for e in events if isinstance(e, Verified))
        branched += stats.branched
    assert accepted > N // 10  # the drafts were really used, not just rejected
    assert branched > N // 10 if branches > 1 else branched == 0  # (a tree's second branch kept too)
    # chi-square over cells with enough expected mass (the rest pooled)
    chi, dof, pooled_e, pooled_o = 0.0, -1, 0.0, 0
    for seq, p in exact.items():
        e, o = p * N, counts.get(seq, 0)
        if e >= 5:
            chi += (o - e) ** 2 / e
            dof += 1
        else:
            pooled_e += e
            pooled_o += o
    if pooled_e > 0:
        chi += (pooled_o - pooled_e) ** 2 / pooled_e
        dof += 1
    # 99.9% quantile of chi-square(dof), Wilson-Hilferty approximation
    z = 3.09
    crit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert chi < crit, (chi, crit, dof)


def _mask_free_dflash(target):
    """A DFlash drafter for a tiny vocabulary (no room for <mask>: its id is an ordinary token's)."""
    return random_dflash(target, 2, block=4)


def test_plain_sampling_is_reproducible_and_drafts_are_probabilities():
    target = random_model(4, vocab=8, dim=16, layers=1, std=0.5)
    s1 = Sampling(1.0, gen=torch.Generator().manual_seed(9))
    s2 = Sampling(1.0, gen=torch.Generator().manual_seed(9))
    a = run(target, ARDraft(target, s1, 64), [1, 2, 3], 4, 12, s1)[0]
    b = run(target, ARDraft(target, s2, 64), [1, 2, 3], 4, 12, s2)[0]
    assert a == b
    d = DFlashDraft(random_dflash(target, 0, block=5), target, s1, 64)
    with torch.no_grad():
        out = target(torch.tensor([[1, 2, 3]]), taps=d.taps)
        from dlm.sampling.speculative import _taps

        d.reset(torch.tensor([1, 2, 3]), _taps(out, d.taps))
        toks, q = d.propose(torch.tensor([1, 2, 3, 4]), 4)
    assert toks.shape == (4,) and q.shape == (4, 8)
    assert torch.allclose(q.sum(-1), torch.ones(4, dtype=q.dtype))


@pytest.mark.parametrize("causal", [False, True])
def test_diffusion_draft_with_its_cache_equals_the_whole_pass(causal):
    """The diffusion drafter's cached pass (finished blocks written once) gives the logits of one pass over the
    whole sequence with the mask its sampler uses, written out here from the rule: a committed token sees the
    blocks up to its own (causal: the positions up to itself), the current block and the slots see everything."""
    model, grid, k, mask_id = random_model(21, std=0.3), 4, 5, 3
    draft = DiffusionDraft(model, mask_id, grid, Sampling(), 256, causal_context=causal)
    seq = torch.randint(4, 48, (6,), generator=torch.Generator().manual_seed(0))
    draft.reset(seq, None)
    for grow in (0, 1, 3, 4, 2, 7):
        seq = torch.cat((seq, torch.randint(4, 48, (grow,))))
        S = seq.shape[0]
        got, _ = draft.propose(seq, k)
        cur = S // grid * grid
        n = S + k
        block = [p // grid if p < cur else cur // grid for p in range(n)]
        sees = torch.tensor([[block[j] <= block[i] and (not causal or j <= i or block[i] == cur // grid)
                              for j in range(n)] for i in range(n)])
        ids = torch.cat((seq, torch.full((k,), mask_id)))
        with torch.no_grad():
            logits = model(ids[None], mask=sees).logits[0, S:]
        logits[:, mask_id] = float("-inf")
        assert torch.equal(got, logits.argmax(-1)), grow
        assert draft.cached == cur
