"""The training losses of ar, mdlm and dflash, recomputed by hand from the same random draws.

Each reference runs the model the plain way, one sequence (or one block) at a time, instead of the
objective's one-pass masked forward: the mdlm noisy block reads the clean blocks before it (block-causal)
and itself, never its own clean copy; the dflash block reads the target's features strictly before its
anchor. The draws (times, masks, anchors) are replayed with a generator seeded as the objective's.
(usdm's loss: tests/test_usdm_exact.py.)
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from dlm.config import ModelConfig
from dlm.masks import dflash_draft_mask
from dlm.model import Transformer
from dlm.objectives.ar import AR
from dlm.drafter import DFlashDrafter
from dlm.objectives.dflash import DFlash, slot_weights
from dlm.objectives.mdlm import MDLM

V, MASK = 24, 3
NOTHING_MASKED_SEED = 3  # with T = 2 this generator draws t = 0.005 and masks neither position


def test_ar_loss_is_mean_next_token_cross_entropy():
    model = tiny_model(0, V, 0.4)
    batch = torch.randint(0, V, (3, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss, extra = AR(SimpleNamespace(), SimpleNamespace()).loss(model, batch, torch.Generator())
        want = sum(F.cross_entropy(model(batch[b:b + 1, :-1]).logits[0], batch[b, 1:], reduction="sum")
                   for b in range(3)) / 30
    assert float(loss) == pytest.approx(float(want), rel=1e-6) and extra == {}  # its cross-entropy is float32


@pytest.mark.parametrize("L", [0, 4], ids=["whole", "blocks-of-4"])
def test_mdlm_loss_by_hand(L):
    """sum over masked tokens of CE / t (t the time of its block), over B * T; the mask rate reported."""
    B, T = 3, 12
    model = tiny_model(1, V, 0.4)
    obj = MDLM(SimpleNamespace(block_size=L, seq_len=T), SimpleNamespace(mask_id=MASK, source="test"))
    batch = torch.randint(4, V, (B, T + 1), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        loss, extra = obj.loss(model, batch, torch.Generator().manual_seed(5))
    # the draws: one stratified time per block (offset, then the shuffle), then the mask
    g = torch.Generator().manual_seed(5)
    Lb = L or T
    nb = T // Lb
    u = (torch.rand(1, generator=g) + torch.arange(B * nb)) / (B * nb)
    u = u[torch.randperm(B * nb, generator=g)]
    t = (1e-3 + (1 - 2e-3) * u).view(B, nb)
    masked = torch.rand(B, T, generator=g) < t.repeat_interleave(Lb, 1)
    x0 = batch[:, :-1]
    total, ce_sum, n = 0.0, 0.0, 0
    with torch.no_grad():
        for b in range(B):
            for k in range(nb):
                s, e = k * Lb, (k + 1) * Lb
                noisy = torch.where(masked[b, s:e], MASK, x0[b, s:e])
                ids = torch.cat([x0[b, :s], noisy])[None]  # the clean blocks before, then this noisy block
                blk = torch.arange(e) // Lb
                mask = blk[:, None] >= blk[None, :]  # block-causal: the noisy block (last) sees all before it
                logits = model(ids, pos=torch.arange(e), mask=mask).logits[0, s:].double()
                logits[:, MASK] = float("-inf")
                for i in range(s, e):
                    if masked[b, i]:
                        ce = float(F.cross_entropy(logits[i - s], x0[b, i]))
                        total += ce / float(t[b, k])
                        ce_sum += ce
                        n += 1
    assert 0 < n < B * T
    assert float(loss) == pytest.approx(total / (B * T), rel=1e-9)
    assert extra == {"ce_masked": pytest.approx(ce_sum / n, rel=1e-6), "mask_rate": pytest.approx(n / (B * T))}


def test_mdlm_loss_with_nothing_masked_is_zero():
    """A draw that masks no position (seed chosen for it): loss 0 and the masked cross-entropy reported as 0."""
    model = tiny_model(1, V, 0.4)
    obj = MDLM(SimpleNamespace(block_size=0, seq_len=2), SimpleNamespace(mask_id=MASK, source="test"))
    batch = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        loss, extra = obj.loss(model, batch, torch.Generator().manual_seed(NOTHING_MASKED_SEED))
    assert float(loss) == 0.0 and extra == {"ce_masked": 0.0, "mask_rate": 0.0}


def dflash_objective(target: Transformer, gamma: int, anchors: int) -> DFlash:
    """A DFlash objective around an in-memory target (its constructor reads a checkpoint folder)."""
    obj = DFlash.__new__(DFlash)
    obj.cfg = SimpleNamespace(anchors=anchors)
    obj.target = target.requires_grad_(False)
    obj.block_size = gamma
    return obj


@pytest.mark.parametrize("injection,features,every", [("kv", True, False), ("input", True, False),
                                                    ("kv", False, False), ("kv", True, True)],
                         ids=["kv", "input", "no-target-features", "every-position-an-anchor"])
def test_dflash_loss_by_hand(injection, features, every):
    """Per anchor: the block [x_a, <mask> x (g-1)] reads the context of positions < a (the target's features,
    or its token embeddings in the ablation; as K/V of every layer, or as input rows for "input"); slot k's
    cross-entropy against x_{a+k} weighted by the decaying slot weights; the mean over blocks."""
    g, B, T1, A = 4, 2, 16, 2  # A != g - 1: a sum over the wrong axis shows
    if every:  # every position that has g - 1 labels after it: 13 blocks per row
        A = T1 - g + 1
    target = tiny_model(3, V, 0.4, n_layers=2)
    with torch.no_grad():  # a head that argmaxes token 5 always, so slots hit where the label is 5
        head = torch.nn.Linear(16, V, bias=True).double()
        head.weight.copy_(target.lm_head.weight)
        head.bias.zero_()
        head.bias[5] = 50.0
    target.lm_head = head
    torch.manual_seed(4)
    d = DFlashDrafter(ModelConfig(**{**target.cfg.to_dict(), "n_layers": 1}), [0, 1], g, mask_id=MASK,
                      injection=injection, target_features=features).double()
    with torch.no_grad():
        d.fc.weight.normal_(0, 0.3)
    obj = dflash_objective(target, g, A)
    g6 = torch.Generator().manual_seed(6)
    batch = torch.where(torch.rand(B, T1, generator=g6) < 0.5, 5, torch.randint(4, V, (B, T1), generator=g6))
    with torch.no_grad():
        loss, extra = obj.loss(d, batch, torch.Generator().manual_seed(8))
    gen = torch.Generator().manual_seed(8)
    anchors = torch.rand(B, T1 - g + 1, generator=gen).argsort(1)[:, :A].sort(1).values
    w = slot_weights(g)
    blocks = []
    hits = []
    with torch.no_grad():
        taps = target(batch, taps=[0, 1]).taps
        # layer 1 is the target's last: read after its final norm, as public engines feed it (last_layer "normed")
        feats = torch.cat([taps[0], target.norm(taps[1])], -1) if features else target.embed_tokens(batch)  # (B, T1, F)
        for b in range(B):
            for a in anchors[b].tolist():
                block = torch.tensor([[int(batch[b, a])] + [MASK] * (g - 1)])
                ctx = d.context(feats[b:b + 1, :a]) if a else None
                h = d(target.embed_tokens(block), ctx, torch.arange(a, a + g), torch.arange(a),
                      mask=dflash_draft_mask(d.injection, 0, a, g, "cpu"))  # "input": context rows causal, block all
                logits = target.lm_head(h[0, 1:]).double()
                labels = batch[b, a + 1:a + g]
                blocks.append((F.cross_entropy(logits, labels, reduction="none") * w.double()).sum())
                hit = (logits.argmax(-1) == labels).int()
                hits.append(hit)
    assert float(loss) == pytest.approx(float(torch.stack(blocks).mean()), rel=1e-6)
    hits = torch.stack(hits)  # (B * A, g - 1)
    assert 0 < float(hits.double().mean()) < 1 and hits[:, 0].sum() != hits[:, 1].sum()  # the metrics see hits
    if every:
        assert anchors.tolist() == [list(range(A))] * B
    assert extra["acc_slot1"] == pytest.approx(float(hits[:, 0].double().mean()))
    assert extra["tau_train"] == pytest.approx(1 + float(hits.cumprod(1).sum(1).double().mean()))


# response-only losses (a prompted corpus: `dlm distill` data) -------------------------------------

def test_ar_loss_reads_response_targets_only():
    """With response flags, the mean cross-entropy over the targets that are response tokens."""
    model = tiny_model(0, V, 0.4)
    batch = torch.randint(4, V, (2, 11), generator=torch.Generator().manual_seed(0))
    sup = torch.zeros(2, 11, dtype=torch.bool)
    sup[0, 4:] = True  # row 0: prompt 0..3, response 4..10
    sup[1, 2:6] = True  # row 1: a response 2..5, then the next document's prompt
    with torch.no_grad():
        loss, extra = AR(SimpleNamespace(), SimpleNamespace()).loss(model, batch, torch.Generator(), sup=sup)
        ce = torch.stack([F.cross_entropy(model(batch[b:b + 1, :-1]).logits[0], batch[b, 1:], reduction="none")
                          for b in range(2)])  # (2, 10)
    want = ce[sup[:, 1:]].sum() / sup[:, 1:].sum()
    assert float(loss) == pytest.approx(float(want), rel=1e-6) and extra["answer_tokens"] == 11


def test_mdlm_noises_response_tokens_only():
    """The noisy input holds <mask> only where the flags mark a response; the loss is normalised by their count."""
    B, T = 4, 24
    model = tiny_model(1, V, 0.4)
    obj = MDLM(SimpleNamespace(block_size=0, seq_len=T), SimpleNamespace(mask_id=MASK, source="test"))
    batch = torch.randint(4, V, (B, T + 1), generator=torch.Generator().manual_seed(2))
    sup = torch.arange(T + 1)[None, :].expand(B, -1) >= torch.tensor([[3], [10], [0], [20]])
    seen = []
    hook = model.embed_tokens.register_forward_hook(lambda m, args, out: seen.append(args[0].clone()))
    with torch.no_grad():
        for seed in range(5):
            obj.loss(model, batch, torch.Generator().manual_seed(seed), sup=sup)
    hook.remove()
    xt = torch.stack(seen)  # (5, B, T)
    assert not (xt == MASK)[:, ~sup[:, :T]].any()  # a prompt token is never noised
    assert (xt == MASK)[:, sup[:, :T]].float().mean() > 0.2  # responses are


@pytest.mark.parametrize("gap", [False, True], ids=["one-document", "next-prompt-inside"])
def test_dflash_loss_reads_responses_only(gap):
    """Every position whose first label is a response token an anchor (A = their count), no other; a block's
    slots count up to its first label that is not a response (the next document's prompt); the mean over
    the blocks that count."""
    g, B, T1 = 4, 2, 16
    target = tiny_model(3, V, 0.4, n_layers=2)
    torch.manual_seed(4)
    d = DFlashDrafter(ModelConfig(**{**target.cfg.to_dict(), "n_layers": 1}), [0, 1], g, mask_id=MASK).double()
    batch = torch.randint(4, V, (B, T1), generator=torch.Generator().manual_seed(6))
    sup = torch.zeros(B, T1, dtype=torch.bool)
    sup[0, 5:] = True  # prompt 0..4, response 5..15
    sup[1, 3:] = True
    if gap:
        sup[1, 9:12] = False  # row 1: response 3..8, the next document's prompt 9..11, its response 12..15
    valid = [[a for a in range(T1 - g + 1) if sup[b, a + 1]] for b in range(B)]
    A = max(map(len, valid))
    obj = dflash_objective(target, g, A)
    with torch.no_grad():
        loss, extra = obj.loss(d, batch, torch.Generator().manual_seed(8), sup=sup)
    w = slot_weights(g)
    blocks = []
    with torch.no_grad():
        taps = target(batch, taps=[0, 1]).taps
        feats = torch.cat([taps[0], target.norm(taps[1])], -1)
        for b in range(B):
            for a in valid[b]:
                block = torch.tensor([[int(batch[b, a])] + [MASK] * (g - 1)])
                h = d(target.embed_tokens(block), d.context(feats[b:b + 1, :a]) if a else None,
                      torch.arange(a, a + g), torch.arange(a), mask=dflash_draft_mask(d.injection, 0, a, g, "cpu"))
                ce = F.cross_entropy(target.lm_head(h[0, 1:]).double(), batch[b, a + 1:a + g], reduction="none")
                keep = sup[b, a + 1:a + g].int().cumprod(0).double()
                blocks.append((ce * w.double() * keep).sum())
    assert len(blocks) < B * (T1 - g + 1)  # some positions were not anchors
    assert float(loss) == pytest.approx(float(torch.stack(blocks).mean()), rel=1e-6)
