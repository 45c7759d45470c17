"""scripts/slot_acceptance.py's figures on a random target and drafter: over every candidate the selector's draw is the
drafter's whole softmax, p's mass on them is 1, and the acceptance sum min(p, q) is 1 exactly where q is p."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from test_speculative import random_dflash, random_model

SCRIPT = Path(__file__).parent.parent / "scripts" / "slot_acceptance.py"
spec = importlib.util.spec_from_file_location("slot_acceptance", SCRIPT)
sa = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sa)


def test_figures_agree_at_the_limits():
    target = random_model(0, std=0.15)
    d = random_dflash(target, 1, block=5)
    ids = torch.randint(4, 48, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    V = target.cfg.vocab_size
    with torch.no_grad():
        res = sa.score(target, d, ids, 3, (4, V))
    A = len(range(3, 40 - 5 + 1, 3))
    assert res["full"].shape == (A, 4)
    torch.testing.assert_close(res[f"sel {V}"], res["full"])  # all candidates, no selector: the whole softmax
    torch.testing.assert_close(res[f"mass {V}"], torch.ones(A, 4))
    assert (res["sel 4"] <= res["mass 4"] + 1e-6).all() and (res["mass 4"] < 1).any()
    assert ((res["full"] > 0) & (res["full"] < 1)).all()
    # the drafter's head replaced by the target's own next-token distribution at slot 1: acceptance 1 there
    out = target(torch.tensor([ids]), head=True)
    p_next = torch.softmax(out.logits[0].float(), -1)
    anchors = torch.arange(3, 40 - 5 + 1, 3)
    head = d.head
    d.head = lambda tgt, h: torch.log(p_next[anchors][:, None].expand(-1, h.shape[1], -1))
    try:
        with torch.no_grad():
            res = sa.score(target, d, ids, 3, (V,))
    finally:
        d.head = head
    torch.testing.assert_close(res["full"][:, 0], torch.ones(A))
    assert (res["full"][:, 1:] < 1).all()
