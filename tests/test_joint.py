"""Joint AR + diffusion: the mask, the two losses, and lossless self-speculation (linear and quadratic)."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_greedy_continuation, cli, tiny_model, tiny_train_config
from dlm.checkpoint import load_model
from dlm.config import ModelConfig
from dlm.errors import DlmError
from dlm.masks import joint_train_mask, quadratic_self_spec_mask
from dlm.model import Transformer
from dlm.objectives.joint import Joint
from dlm.sampling import SampleConfig, generate
from dlm.sampling.common import Commit, Verified
from dlm.sampling.joint import SelfDraft, quadratic
from dlm.sampling.speculative import Sampling, SpecStats, speculate, target_greedy

PROMPTS = ["def parse(self, text):\n    result = []\n", "import os\nimport sys\n\n\ndef main(", "class A:\n    def "]


@pytest.fixture(scope="module")
def tiny_joint(tiny_ar, corpus_dir, tokenizer_path, tmp_path_factory):
    """A tiny joint model adapted from the tiny AR checkpoint (blocks of 8)."""
    from dlm.train import train

    out = tmp_path_factory.mktemp("ckpt") / "tiny-joint"
    cfg = tiny_train_config(corpus_dir, tokenizer_path, objective="joint", block_size=8, seq_len=64,
                            init_from=str(tiny_ar), max_steps=60, eval_every=60, save_every=60)
    train(cfg, out, quiet=True)
    return out


SHAPE = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=256)  # the random models here


def test_the_mask_drawn_in_the_docs():
    m = joint_train_mask(6, 3).int()
    noisy, clean = m[:6], m[6:]
    assert noisy[:3].tolist() == [[1, 1, 1, 0, 0, 0] + [0] * 6] * 3
    assert noisy[3:].tolist() == [[0, 0, 0, 1, 1, 1] + [1, 1, 1, 0, 0, 0]] * 3
    assert torch.equal(clean[:, 6:], torch.ones(6, 6, dtype=torch.int).tril()) and clean[:, :6].sum() == 0


def test_clean_half_is_the_ar_model_and_noisy_blocks_see_no_later_clean_token(corpus_dir, tokenizer_path):
    """The clean half's logits are the plain causal forward's; a noisy block is blind to its own and later
    clean tokens (a leak would let it copy its answer)."""
    m = tiny_model(0, 24, 0.3, **SHAPE)
    T, L = 12, 4
    x0 = torch.randint(0, 20, (2, T), generator=torch.Generator().manual_seed(1))
    xt = x0.clone()
    xt[:, ::2] = 3  # some masks
    pos = torch.arange(T).repeat(2)
    with torch.no_grad():
        out = m(torch.cat([xt, x0], 1), pos=pos, mask=joint_train_mask(T, L)).logits
        assert torch.allclose(out[:, T:], m(x0).logits, atol=1e-10)
        x1 = x0.clone()
        x1[:, 4:] = (x1[:, 4:] + 1) % 20  # change the clean tokens of blocks 1 and 2
        out1 = m(torch.cat([xt, x1], 1), pos=pos, mask=joint_train_mask(T, L)).logits
    assert torch.allclose(out[:, :8], out1[:, :8], atol=1e-10)  # noisy blocks 0, 1: same
    assert not torch.allclose(out[:, 8:T], out1[:, 8:T])  # noisy block 2 reads clean block 1


def test_loss_is_the_weighted_sum_of_its_parts(corpus_dir, tokenizer_path):
    from dlm.tokenizer import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    cfg = tiny_train_config(corpus_dir, tokenizer_path, objective="joint", block_size=4, seq_len=16)
    m = Transformer(ModelConfig(vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                ffn_dim=64)).double()
    batch = torch.randint(10, 200, (2, 17), generator=torch.Generator().manual_seed(0))
    losses = {}
    for ar_w, dlm_w in ((1.0, 0.0), (0.0, 1.0), (1.0, 0.3)):
        obj = Joint(cfg.__class__(**{**cfg.to_dict(), "ar_weight": ar_w, "dlm_weight": dlm_w}), tok)
        losses[(ar_w, dlm_w)], extra = obj.loss(m, batch, torch.Generator().manual_seed(5))
    ar = F.cross_entropy(m(batch[:, :-1]).logits.flatten(0, 1), batch[:, 1:].flatten())
    assert torch.allclose(losses[(1.0, 0.0)], ar)  # the AR part is exactly the causal next-token loss
    assert torch.allclose(losses[(1.0, 0.3)], losses[(1.0, 0.0)] + 0.3 * losses[(0.0, 1.0)])
    assert float(losses[(0.0, 1.0)].detach()) > 0


def test_loss_reads_responses_only(corpus_dir, tokenizer_path):
    """With response flags: the AR part is the cross-entropy of the response targets only, and the noisy half
    holds <mask> only at response positions."""
    from dlm.tokenizer import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    cfg = tiny_train_config(corpus_dir, tokenizer_path, objective="joint", block_size=4, seq_len=16)
    m = Transformer(ModelConfig(vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                ffn_dim=64)).double()
    batch = torch.randint(10, 200, (2, 17), generator=torch.Generator().manual_seed(0))
    sup = torch.zeros(2, 17, dtype=torch.bool)
    sup[0, 6:], sup[1, 2:9] = True, True
    seen = []
    hook = m.embed_tokens.register_forward_hook(lambda mod, args, out: seen.append(args[0].clone()))
    obj = Joint(cfg.__class__(**{**cfg.to_dict(), "ar_weight": 1.0, "dlm_weight": 0.0}), tok)
    for seed in range(6):
        loss, _ = obj.loss(m, batch, torch.Generator().manual_seed(seed), sup=sup)
    hook.remove()
    noisy = torch.stack([x[:, :16] for x in seen])  # (6, 2, 16)
    assert not (noisy == tok.mask_id)[:, ~sup[:, :16]].any() and (noisy == tok.mask_id)[:, sup[:, :16]].any()
    ce = F.cross_entropy(m(batch[:, :-1]).logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="none").view(2, 16)
    assert torch.allclose(loss, ce[sup[:, 1:]].mean())


def _joint(corpus_dir, tokenizer_path, **kw):
    from dlm.tokenizer import Tokenizer

    tok = Tokenizer.from_file(tokenizer_path)
    cfg = tiny_train_config(corpus_dir, tokenizer_path, objective="joint", block_size=4, seq_len=16, **kw)
    m = Transformer(ModelConfig(vocab_size=tok.vocab_size, dim=32, n_layers=2, n_heads=4, n_kv_heads=2,
                                ffn_dim=64)).double()
    return cfg, tok, m


def test_a_second_stream_feeds_the_diffusion_loss_alone(corpus_dir, tokenizer_path):
    """--dlm-data: a batch (B, 2, T + 1) gives the AR loss of stream 0 (its causal next-token loss, whatever
    stream 1 holds) and the diffusion loss of stream 1 (whatever stream 0 holds); with flags, the AR loss reads
    stream 0's response targets only."""
    cfg, tok, m = _joint(corpus_dir, tokenizer_path, dlm_data=str(corpus_dir))
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(10, 200, (2, 2, 17), generator=g)
    b2 = torch.randint(10, 200, (2, 17), generator=g)

    def loss(ar_w, dlm_w, first, second, sup=None):
        obj = Joint(cfg.__class__(**{**cfg.to_dict(), "ar_weight": ar_w, "dlm_weight": dlm_w}), tok)
        return obj.loss(m, torch.stack([first, second], 1), torch.Generator().manual_seed(5), sup=sup)

    ar, extra = loss(1.0, 0.0, a, b)
    assert torch.allclose(ar, F.cross_entropy(m(a[:, :-1]).logits.flatten(0, 1), a[:, 1:].flatten()))
    assert torch.allclose(ar, loss(1.0, 0.0, a, b2)[0])  # stream 1 does not reach the AR loss
    diff = loss(0.0, 1.0, a, b)[0]
    assert torch.allclose(diff, loss(0.0, 1.0, b2, b)[0])  # stream 0 does not reach the diffusion loss
    assert not torch.allclose(diff, loss(0.0, 1.0, a, b2)[0])
    one_stream = Joint(cfg.__class__(**{**cfg.to_dict(), "ar_weight": 0.0, "dlm_weight": 1.0}), tok)
    assert torch.allclose(diff, one_stream.loss(m, b, torch.Generator().manual_seed(5))[0])  # the same noise
    assert torch.allclose(loss(1.0, 0.3, a, b)[0], ar + 0.3 * diff)
    sup = torch.ones(2, 2, 17, dtype=torch.bool)
    sup[:, 0, :9] = False  # stream 0: the first 8 targets are a prompt
    ce = F.cross_entropy(m(a[:, :-1]).logits.flatten(0, 1), a[:, 1:].flatten(), reduction="none").view(2, 16)
    assert torch.allclose(loss(1.0, 0.0, a, b, sup)[0], ce[:, 8:].mean())


@pytest.mark.parametrize("rate", [0.0, 0.5, 1.0])
def test_draft_rate_noises_blocks_as_a_draft_sees_them(corpus_dir, tokenizer_path, rate):
    """--draft-rate p: a share p of the blocks hold their first token and <mask> everywhere else (a linear draft
    [last token, <mask> x (L-1)], a quadratic row [d_i, <mask> x L]); the others are noised at a random time."""
    cfg, tok, m = _joint(corpus_dir, tokenizer_path, draft_rate=rate)
    obj = Joint(cfg.__class__(**cfg.to_dict()), tok)
    batch = torch.randint(10, 200, (8, 17), generator=torch.Generator().manual_seed(0))
    seen = []
    hook = m.embed_tokens.register_forward_hook(lambda mod, args, out: seen.append(args[0].clone()))
    for seed in range(4):
        obj.loss(m, batch, torch.Generator().manual_seed(seed))
    hook.remove()
    blocks = torch.stack([x[:, :16] for x in seen]).view(-1, 4) == tok.mask_id  # (4 seeds x 8 rows x 4 blocks, 4)
    draft_form = ~blocks[:, 0] & blocks[:, 1:].all(1)
    share = float(draft_form.float().mean())
    if rate == 1.0:
        assert share == 1.0
    elif rate == 0.0:
        assert share < 0.3 and blocks[:, 0].any()  # at a random time the first token is masked too
    else:
        assert 0.3 < share < 0.85, share


@pytest.mark.parametrize("ar_first", [False, True])
def test_draft_blocks_train_the_view_they_decode_from(corpus_dir, tokenizer_path, ar_first):
    """A draft-form block of the training forward computes what the draft pass of self-spec-linear (the block
    [kept, <mask> x (L-1)] bidirectional over a cache of the prefix) or, with --draft-ar-first, of
    self-spec-linear-ar (the kept token causal, the masks after it) computes at decoding (float64)."""
    cfg, tok, m = _joint(corpus_dir, tokenizer_path, draft_rate=1.0, draft_ar_first=ar_first)
    obj = Joint(cfg, tok)
    L, T = 4, 16
    x0 = torch.randint(10, 200, (2, T), generator=torch.Generator().manual_seed(0))
    masked = (torch.arange(T) % L != 0).expand(2, T)
    xt = x0.masked_fill(masked, tok.mask_id)
    draft = torch.ones(2, T // L, dtype=torch.bool)
    draft[1, 2] = False  # a block of row 1 keeps the reference's view: only draft-form blocks change
    with torch.no_grad():
        h_noisy, h_clean = obj.joint_forward(m, xt, x0, draft)
        assert torch.allclose(h_clean, m(x0, head=False).last, atol=1e-10)  # the clean half is the AR model
        for r in range(2):
            for b in range(1, T // L):
                cache = m.new_cache(1, 64)
                m(x0[r:r + 1, :b * L], cache=cache)
                causal = ar_first and bool(draft[r, b])
                sees = quadratic_self_spec_mask(0, L - 1, cache.length, torch.device("cpu")) if causal else "full"
                ref = m(xt[r:r + 1, b * L:(b + 1) * L], pos=b * L + torch.arange(L), cache=cache, mask=sees,
                        write=False, head=False).last[0]
                assert torch.allclose(h_noisy[r, b * L:(b + 1) * L], ref, atol=1e-10), (r, b)
                if causal:  # the kept token's state is the AR model's at its position
                    assert torch.allclose(h_noisy[r, b * L], h_clean[r, b * L], atol=1e-10)
                else:
                    assert not torch.allclose(h_noisy[r, b * L], h_clean[r, b * L], atol=1e-6)


def test_ar_target_teaches_the_drafts_the_ar_distribution(corpus_dir, tokenizer_path):
    """--ar-target a: the target of a masked token is (1 - a) x the data token + a x the AR half's next-token
    distribution at the position before (the AR model's own, <mask> excluded); a = 0 is the public loss."""
    from dlm.objectives.mdlm import masked_logits

    torch.manual_seed(0)  # the model's weights: not whatever state the process's generator is in
    cfg, tok, m = _joint(corpus_dir, tokenizer_path, draft_rate=1.0, ar_weight=0.0, dlm_weight=1.0)
    with torch.no_grad():  # peaked distributions: a fresh model's are near uniform, where soft and hard agree
        for w in m.parameters():
            if w.dim() > 1:
                w.mul_(6)
    batch = torch.randint(10, 200, (2, 17), generator=torch.Generator().manual_seed(0))

    def loss(a):
        obj = Joint(cfg.__class__(**{**cfg.to_dict(), "ar_target": a}), tok)
        return obj.loss(m, batch, torch.Generator().manual_seed(3))[0]

    x0 = batch[:, :-1]
    masked = (torch.arange(16) % 4 != 0).expand(2, 16)  # every block in draft form: its first token kept
    xt = x0.masked_fill(masked, tok.mask_id)
    obj = Joint(cfg, tok)
    h_noisy, _ = obj.joint_forward(m, xt, x0)
    logq = F.log_softmax(masked_logits(m, h_noisy[masked], tok.mask_id), -1)
    p = F.softmax(m(x0).logits, -1)  # the AR model alone: the teacher
    p[..., tok.mask_id] = 0
    p = (p / p.sum(-1, keepdim=True))[:, :-1][masked[:, 1:]]  # the position before each masked token
    soft = -(p * logq.masked_fill(p == 0, 0.0)).sum(-1).sum() / 32
    hard = F.nll_loss(logq, x0[masked], reduction="sum") / 32
    assert torch.allclose(loss(0.0), hard) and torch.allclose(loss(1.0), soft)
    assert torch.allclose(loss(0.25), 0.75 * hard + 0.25 * soft) and not torch.allclose(soft, hard)


def test_training_with_a_second_stream(corpus_dir, tokenizer_path, tiny_joint, tmp_path):
    """`dlm train --objective joint --dlm-data D --draft-rate p`: a run reads both corpora and records them;
    wrong options are refused before anything is written."""
    jsonl = tmp_path / "self.jsonl"
    cli("distill", "--target", str(tiny_joint), "--data", str(corpus_dir), "--out", str(jsonl), "--prompts", "160",
        "--max-new-tokens", "24", "--min-chars", "40", "--max-chars", "80", "--quiet", check=True)
    out = tmp_path / "run"
    r = cli("train", "--objective", "joint", "--init-from", str(tiny_joint), "--data", str(corpus_dir),
            "--dlm-data", str(jsonl), "--draft-rate", "0.5", "--block-size", "8", "--seq-len", "16",
            "--batch-size", "4", "--max-steps", "2", "--eval-every", "2", "--eval-batches", "1", "--log-every", "1",
            "--out", str(out), "--quiet")
    assert r.returncode == 0, r.stderr
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(x.get("val_loss", x.get("loss"))) for x in rows) and all(x["dlm_loss"] > 0 for x in rows if "loss" in x)
    meta = json.loads((out / "config.json").read_text())
    assert meta["dlm_data"] == str(jsonl) and meta["draft_rate"] == 0.5
    for args, msg in [(["--objective", "ar", "--dlm-data", str(jsonl)], "--dlm-data applies to --objective joint"),
                      (["--objective", "joint", "--draft-rate", "1.5"], "--draft-rate must be in"),
                      (["--objective", "joint", "--ar-target", "-0.1"], "--ar-target must be in"),
                      (["--objective", "mdlm", "--ar-target", "0.5"], "--ar-target applies to --objective joint"),
                      (["--objective", "joint", "--draft-ar-first"], "--draft-ar-first changes how"),
                      (["--objective", "mdlm", "--draft-ar-first"], "--draft-ar-first applies to --objective joint"),
                      (["--objective", "joint", "--dlm-data", str(tmp_path / "missing.jsonl")], "missing.jsonl")]:
        bad = tmp_path / "bad"
        r = cli("train", *args, "--init-from", str(tiny_joint), "--data", str(corpus_dir), "--seq-len", "32",
                "--max-steps", "1", "--out", str(bad))
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr and not bad.exists(), r.stderr


def test_quadratic_rows_are_the_ar_logits_and_linear_drafts():
    """One quadratic pass = the AR logits after d_0..d_i and, per row, a draft of L masks over a cache that
    holds the prefix and d_0..d_i (as if they were accepted) (same numbers, float64)."""
    m = tiny_model(1, 24, 0.3, **SHAPE)
    prefix, d, L = [5, 6, 7, 8], [9, 10, 11], 3
    m_ = len(d) - 1
    with torch.no_grad():
        cache = m.new_cache(1, 64)
        m(torch.tensor([prefix]), cache=cache)
        c = cache.length
        ids = torch.tensor(d + [3] * (len(d) * L))
        pos = torch.cat([c + torch.arange(len(d)), (c + 1 + torch.arange(len(d)))[:, None].add(torch.arange(L)).flatten()])
        out = m(ids[None], pos=pos, cache=cache, mask=quadratic_self_spec_mask(m_, L, c, torch.device("cpu"))).logits[0]
        ar = m(torch.tensor([prefix + d])).logits[0, len(prefix):]
        assert torch.allclose(out[:len(d)], ar, atol=1e-10)
        for i in range(len(d)):
            ref_cache = m.new_cache(1, 64)
            m(torch.tensor([prefix + d[:i + 1]]), cache=ref_cache)
            masks = torch.tensor([[3] * L])
            ref = m(masks, pos=len(prefix) + i + 1 + torch.arange(L), cache=ref_cache, mask="full", write=False)
            assert torch.allclose(out[len(d) + i * L:len(d) + (i + 1) * L], ref.logits[0], atol=1e-10)


@pytest.mark.parametrize("L", [2, 4, 8])
def test_both_modes_are_lossless_on_a_random_model(L):
    m = tiny_model(2, 24, 0.3, **SHAPE)
    prompt = [4, 5, 6, 7]
    ref = target_greedy(m, prompt, 40, None)
    q = [t for e in quadratic(m, prompt, block_size=L, max_new_tokens=40, mask_id=3, sampling=Sampling(),
                              eos_id=None) if isinstance(e, Commit) for t in e.tokens]
    lin = [t for e in speculate(m, SelfDraft(m, 3, L, Sampling()), prompt, block_size=L, max_new_tokens=40)
           if isinstance(e, Commit) for t in e.tokens]
    ev = list(speculate(m, SelfDraft(m, 3, L, Sampling(), ar_first=True), prompt, block_size=L, max_new_tokens=40))
    lin_ar = [t for e in ev if isinstance(e, Commit) for t in e.tokens]
    assert q == ref and lin == ref and lin_ar == ref
    # self-spec-linear-ar reads its first draft slot from the AR logit: at greedy decoding the verifier always takes it
    cycles = [e for e in ev if isinstance(e, Verified) and e.proposed]
    assert cycles and all(e.accepted >= 1 for e in cycles)


def test_trained_joint_model_self_speculates_losslessly(tiny_joint):
    model, ck = load_model(tiny_joint, dtype=torch.float64)
    cfg = SampleConfig(max_new_tokens=32)
    ar = generate(model, ck, PROMPTS[:2], cfg.replace(sampler="ar"))
    for sampler in ("self-spec-linear", "self-spec-linear-ar", "self-spec-quadratic"):
        for block in (4, 8):
            res = generate(model, ck, PROMPTS[:2], cfg.replace(sampler=sampler, block_size=block))
            s = res.stats.as_dict()
            assert res.tokens == ar.tokens, (sampler, block)  # lossless: the AR mode's greedy output
            assert 1.0 <= s["tau"] <= block and s["gamma"] == block
    # accepted drafts (n > 0, both modes) are exercised by test_sampling_follows_the_ar_distribution
    checked = generate(model, ck, PROMPTS[2], cfg.replace(sampler="self-spec-quadratic", check_lossless=True))
    assert checked.stats.extra["lossless"] is True
    quad = generate(model, ck, PROMPTS[0], cfg.replace(sampler="self-spec-quadratic")).stats
    assert quad.draft_forwards == 0 and quad.forwards == quad.extra["cycles"] + 1  # one pass per cycle + prefill
    lin = generate(model, ck, PROMPTS[0], cfg.replace(sampler="self-spec-linear")).stats
    assert lin.extra["cycles"] - 1 <= lin.draft_forwards <= lin.extra["cycles"]  # a draft pass per cycle (none when no room is left)


def test_diffusion_mode_and_meta(tiny_joint):
    model, ck = load_model(tiny_joint)
    assert ck.objective == "joint" and ck.block_size == 8 and ck.config["dlm_weight"] == 0.3
    res = generate(model, ck, PROMPTS[0], SampleConfig(max_new_tokens=16, sampler="threshold", threshold=0.5))
    assert res.stats.canvases >= 2 and res.stats.new_tokens == len(res.tokens[0])
    naive = generate(model, ck, PROMPTS[0], SampleConfig(max_new_tokens=16, sampler="confidence", naive=True))
    cached = generate(model, ck, PROMPTS[0], SampleConfig(max_new_tokens=16, sampler="confidence"))
    assert naive.tokens == cached.tokens  # the causal context written block by block = recomputed each step
    rows = [json.loads(x) for x in (tiny_joint / "metrics.jsonl").read_text().splitlines()]
    assert all("ar_loss" in r and "dlm_loss" in r for r in rows if "loss" in r)


def exact_next2(m: Transformer, prompt: list[int], T: float) -> dict:
    V = m.cfg.vocab_size
    out = {}
    with torch.no_grad():
        p1 = torch.softmax(m(torch.tensor([prompt])).logits[0, -1] / T, -1)
        for a in range(V):
            p2 = torch.softmax(m(torch.tensor([prompt + [a]])).logits[0, -1] / T, -1)
            for b in range(V):
                out[(a, b)] = float(p1[a] * p2[b])
    return out


@pytest.mark.parametrize("mode", ["linear", "linear-ar", "quadratic"])
def test_sampling_follows_the_ar_distribution(mode):
    """At T = 0.8 the first two emitted tokens are distributed as the AR mode's (chi-square, seeded). The
    second token comes from a verify cycle (one draft), so acceptance and the residual draw both count."""
    V, T, N = 5, 0.8, 1500
    m = tiny_model(3, V, 0.3, **{**SHAPE, "dim": 16, "ffn_dim": 32, "n_layers": 1})
    with torch.no_grad():  # make the draft agree often enough that acceptance and rejection both occur
        m.lm_head.weight.mul_(0.5)
    prompt = [1, 2, 1, 2]
    exact = exact_next2(m, prompt, T)
    sampling = Sampling(T, gen=torch.Generator().manual_seed(0))
    counts: Counter = Counter()
    accepted = 0
    for _ in range(N):
        if mode.startswith("linear"):
            ev = list(speculate(m, SelfDraft(m, 4, 3, sampling, ar_first=mode == "linear-ar"), prompt, block_size=3,
                                max_new_tokens=3, sampling=sampling))
        else:
            ev = list(quadratic(m, prompt, block_size=3, max_new_tokens=3, mask_id=4, sampling=sampling, eos_id=None))
        toks = [t for e in ev if isinstance(e, Commit) for t in e.tokens]
        accepted += sum(e.accepted for e in ev if isinstance(e, Verified))
        counts[tuple(toks[:2])] += 1
    assert accepted > N // 20
    chi, dof = 0.0, -1
    for seq, p in exact.items():
        e = p * N
        if e >= 5:
            chi += (counts[seq] - e) ** 2 / e
            dof += 1
    z = 3.09  # 99.9% quantile (Wilson-Hilferty)
    assert chi < dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3, (chi, dof)


def test_bad_options(tiny_joint, tiny_ar):
    model, ck = load_model(tiny_joint)
    for kw, msg in [(dict(sampler="nope"), "does not belong to a joint"), (dict(block_size=1), "--block-size"),
                    (dict(sampler="self-spec-quadratic", check_lossless=True, temperature=1.0), "--check-lossless"),
                    (dict(sampler="self-spec-linear", suffix="x"), "cannot infill")]:
        with pytest.raises(DlmError, match=msg):
            generate(model, ck, "x = 1\n", SampleConfig(max_new_tokens=8, **kw))
    r = cli("train", "--objective", "joint", "--init-from", str(tiny_ar), "--block-size", "7", "--seq-len", "64",
            "--out", str(tiny_joint.parent / "bad"))
    assert r.returncode == 2 and "--block-size must divide" in r.stderr and not (tiny_joint.parent / "bad").exists()


def test_bench_rows_for_self_speculation(tiny_joint, tiny_ar, corpus_dir, tmp_path):
    """`dlm bench --joint`: the AR mode and every (mode, block) row on the same cases; the self-speculation rows
    are lossless against the AR mode, and the block-size plot is written."""
    from dlm.bench import run_bench

    out = tmp_path / "bench.json"
    report = run_bench(str(tiny_ar), prompts=2, max_new_tokens=12, out=str(out), data=str(corpus_dir), warmup=0,
                       naive=False, quiet=True, draft=None, temperatures=(0.0,), repeat=1, joint=str(tiny_joint),
                       joint_blocks=(4, 8))
    rows = {s["method"]: s for s in report["summaries"]}
    assert set(rows) == {"ar (KV cache)", "joint ar mode", "joint self-spec-linear B=4", "joint self-spec-linear B=8",
                         "joint self-spec-linear-ar B=4", "joint self-spec-linear-ar B=8",
                         "joint self-spec-quadratic B=4", "joint self-spec-quadratic B=8"}
    for name, s in rows.items():
        if "self-spec" in name:
            assert s["lossless"] == 1.0 and s["tau"] >= 1.0 and s["speedup"] > 0, name
    assert rows["joint self-spec-quadratic B=4"]["draft_forwards"] == 0
    assert rows["joint self-spec-linear B=8"]["draft_forwards"] > 0
    assert Path(report["blocks_plot"]).stat().st_size > 0


def test_eval_reports_the_ar_mode_beside_its_reference(tiny_joint, tiny_ar, corpus_dir):
    """`dlm eval` of a joint checkpoint: its AR mode's perplexity is the causal loss of the model itself, and the
    AR model it was adapted from is scored on the same windows."""
    proc = cli("eval", "--model", str(tiny_joint), "--data", str(corpus_dir), "--reference", str(tiny_ar),
               "--max-batches", "2", "--seq-len", "64", "--json")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(proc.stdout)
    from dlm.data.corpus import Corpus
    from dlm.evaluate import ar_loss

    model, ck = load_model(tiny_joint)
    own = ar_loss(model, ck.tokenizer, Corpus(str(corpus_dir)), "test", 64, 8, 2)
    assert res["ar_mode_loss"] == pytest.approx(own["loss"]) and res["tokens"] == own["tokens"]
    ref, rck = load_model(tiny_ar)
    assert res["reference_loss"] == pytest.approx(ar_loss(ref, rck.tokenizer, Corpus(str(corpus_dir)), "test", 64, 8,
                                                          2)["loss"])
    assert res["ar_mode_loss"] != pytest.approx(res["reference_loss"])  # training moved the AR mode


def test_distill_from_a_joint_model_writes_its_ar_modes_continuations(tiny_joint, corpus_dir, tmp_path):
    """`dlm distill --target JOINT`: training data for the model's own diffusion half, from its AR mode."""
    out = tmp_path / "self.jsonl"
    cli("distill", "--target", str(tiny_joint), "--data", str(corpus_dir), "--out", str(out), "--prompts", "3",
        "--max-new-tokens", "12", "--quiet", check=True)
    model, ck = load_model(tiny_joint)
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == 3
    for r in rows:
        assert_greedy_continuation(model, ck, r, 12)
