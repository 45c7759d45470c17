"""dlm.masks: every attention mask against a small expectation written out by hand or by plain loops."""

from __future__ import annotations

import pytest
import torch

from dlm import masks as M


def grid(rows: list[str]) -> list[list[bool]]:
    """A mask drawn as strings: '1' may attend, '.' may not."""
    return [[c == "1" for c in r.replace(" ", "")] for r in rows]


def loops(Q: int, K: int, sees) -> list[list[bool]]:
    return [[bool(sees(q, k)) for k in range(K)] for q in range(Q)]


def test_block_causal_with_a_partial_last_block():
    assert M.block_causal_mask(5, 2).tolist() == grid([
        "11...",
        "11...",
        "1111.",
        "1111.",
        "11111",
    ])


def test_block_diffusion_train_over_xt_and_x0():
    # T = 4, L = 2: [x_t (4) | x_0 (4)]
    assert M.block_diffusion_train_mask(4, 2).tolist() == grid([
        "11.. ....",
        "11.. ....",
        "..11 11..",
        "..11 11..",
        ".... 11..",
        ".... 11..",
        ".... 1111",
        ".... 1111",
    ])


def test_joint_train_clean_half_is_causal():
    assert M.joint_train_mask(4, 2).tolist() == grid([
        "11.. ....",
        "11.. ....",
        "..11 11..",
        "..11 11..",
        ".... 1...",
        ".... 11..",
        ".... 111.",
        ".... 1111",
    ])


def test_joint_train_draft_form_blocks_keep_their_first_token_causal():
    draft = torch.tensor([[False, True], [True, True]])  # row 0: block 1 is draft-form; row 1: both
    m = M.joint_train_mask(4, 2, draft=draft)
    assert m.shape == (2, 8, 8)
    base = M.joint_train_mask(4, 2)
    want0, want1 = base.clone(), base.clone()
    want0[2, 3] = False  # block 1's kept token (query 2) no longer sees the mask after it (key 3)
    want1[0, 1] = want1[2, 3] = False
    assert torch.equal(m[0], want0) and torch.equal(m[1], want1)


@pytest.mark.parametrize("T,L,start", [(3, 2, [0, 2]), (4, 3, [4, 1, 3])])
def test_usdm_canvas_train(T, L, start):
    st = torch.tensor(start)
    m = M.usdm_canvas_train_mask(T, L, st)
    assert m.shape == (len(start), 1, T + L, T + L)
    for b, s in enumerate(start):
        want = loops(T + L, T + L, lambda q, k: k <= q if q < T else (k >= T or k < s))
        assert m[b, 0].tolist() == want


def test_usdm_canvas_train_drawn():
    m = M.usdm_canvas_train_mask(3, 2, torch.tensor([2]))[0, 0]
    assert m.tolist() == grid([
        "1.. ..",
        "11. ..",
        "111 ..",
        "11. 11",
        "11. 11",
    ])


def test_dflash_multi_anchor_drawn():
    # context of 6, two blocks of 2 anchored at 1 and 4
    m = M.dflash_train_mask(torch.tensor([[1, 4]]), 6, 2)[0, 0]
    assert m.tolist() == grid([
        "1..... 11..",
        "1..... 11..",
        "1111.. ..11",
        "1111.. ..11",
    ])
    mc = M.dflash_train_mask(torch.tensor([[1, 4]]), 6, 2, causal_ctx=True)[0, 0]
    assert mc.shape == (10, 10)
    assert mc[:6].tolist() == loops(6, 10, lambda q, k: k <= q)  # the context rows: causal, blind to the blocks
    assert torch.equal(mc[6:], m)


def test_dflash_multi_anchor_per_row():
    anchors = torch.tensor([[0, 3, 7], [2, 5, 6]])
    g, C = 3, 10
    m = M.dflash_train_mask(anchors, C, g)
    for b in range(2):
        want = loops(3 * g, C + 3 * g, lambda q, k: k < int(anchors[b, q // g]) if k < C else (k - C) // g == q // g)
        assert m[b, 0].tolist() == want


def test_elbo_noisy_block_reads_the_clean_blocks_before():
    assert M.elbo_noisy_block_mask(4, 2).tolist() == grid([
        ".... 11..",
        ".... 11..",
        "11.. ..11",
        "11.. ..11",
    ])


@pytest.mark.parametrize("T,S", [(1, 1), (2, 5), (3, 3), (4, 9)])
def test_causal_over_a_cached_prefix(T, S):
    assert M.causal_mask(T, S).tolist() == loops(T, S, lambda q, k: k <= S - T + q)


def test_sdpa_mask_specs():
    cpu = torch.device("cpu")
    assert M.sdpa_mask("full", 3, 5, cpu) == (None, False)
    assert M.sdpa_mask("causal", 1, 5, cpu) == (None, False)  # one query sees every key anyway
    assert M.sdpa_mask("causal", 3, 3, cpu) == (None, True)
    m, c = M.sdpa_mask("causal", 2, 4, cpu)
    assert not c and m.tolist() == grid(["111.", "1111"])
    t, _ = M.sdpa_mask(torch.ones(2, 3, dtype=torch.bool), 2, 3, cpu)
    assert t.shape == (1, 1, 2, 3)
    with pytest.raises(ValueError):
        M.sdpa_mask(torch.ones(2, 3), 2, 3, cpu)
    with pytest.raises(ValueError):
        M.sdpa_mask(torch.ones(2, 4, dtype=torch.bool), 2, 3, cpu)


def test_padded_prefill_and_key_valid():
    valid = torch.tensor([[False, False, True, True], [True, True, True, True]])
    m = M.padded_prefill_mask(valid)
    assert m.shape == (2, 1, 4, 4)
    assert m[0, 0].tolist() == grid(["1...", ".1..", "..1.", "..11"])  # a pad sees itself only
    assert m[1, 0].tolist() == loops(4, 4, lambda q, k: k <= q)
    kv = M.key_valid_mask(valid)
    assert kv.shape == (2, 1, 1, 4) and kv[:, 0, 0].tolist() == valid.tolist()


def test_mdlm_denoise_block_causal_and_causal_context():
    block_of = torch.tensor([0, 0, 0, 1, 1, 2, 2])
    # rows 3..6 (blocks 1 and 2), keys 0..6
    assert M.mdlm_denoise_mask(block_of, 3, 7).tolist() == grid([
        "11111 ..",
        "11111 ..",
        "11111 11",
        "11111 11",
    ])
    # causal context: the finished block 1's rows are causal, the last block's rows see all of it
    assert M.mdlm_denoise_mask(block_of, 3, 7, causal_context=True).tolist() == grid([
        "1111. ..",
        "11111 ..",
        "11111 11",
        "11111 11",
    ])


def test_quadratic_self_spec_rows():
    # m = 1 (two rows), L = 2 masks per row, one cached key: [cache | f0 f1 | r0 r0 | r1 r1]
    assert M.quadratic_self_spec_mask(1, 2, 1).tolist() == grid([
        "1 1. .. ..",
        "1 11 .. ..",
        "1 1. 11 ..",
        "1 1. 11 ..",
        "1 11 .. 11",
        "1 11 .. 11",
    ])
    # m = 0 (linear-ar): the token causal, the masks after it see it and each other
    assert M.quadratic_self_spec_mask(0, 3, 2).tolist() == grid([
        "11 1 ...",
        "11 1 111",
        "11 1 111",
        "11 1 111",
    ])


def test_dflash_draft_at_inference():
    cpu = torch.device("cpu")
    assert M.dflash_draft_mask("kv", 3, 2, 4, cpu) == "full"
    assert M.dflash_draft_mask("input", 3, 0, 4, cpu) == "full"
    # input injection: [cache (2) ; new context (2) ; block (3)]
    assert M.dflash_draft_mask("input", 2, 2, 3, cpu).tolist() == grid([
        "11 1. ...",
        "11 11 ...",
        "11 11 111",
        "11 11 111",
        "11 11 111",
    ])


def test_flex_attention_reads_the_same_predicates():
    """The predicates are flex_attention mask_mods: its own mask builder (vmap) gives what `dense` gives."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    anchors = torch.tensor([[1, 5], [0, 9]])
    draft = torch.tensor([[True, False], [False, True]])
    valid = torch.tensor([[False, True, True], [True, True, True]])
    block_of = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    start = torch.tensor([0, 3])
    cases = [  # predicate, batch, queries, keys, dense mask
        (M.block_causal(3), 1, 7, 7, M.block_causal_mask(7, 3)),
        (M.block_diffusion_train(7, 3), 1, 14, 14, M.block_diffusion_train_mask(7, 3)),
        (M.joint_train(8, 4, draft), 2, 16, 16, M.joint_train_mask(8, 4, draft=draft)),
        (M.usdm_canvas_train(6, start), 2, 10, 10, M.usdm_canvas_train_mask(6, 4, start)[:, 0]),
        (M.dflash_train(anchors, 12, 3, True), 2, 18, 18, M.dflash_train_mask(anchors, 12, 3, True)[:, 0]),
        (M.elbo_noisy_block(7, 3), 1, 7, 14, M.elbo_noisy_block_mask(7, 3)),
        (M.causal(3), 1, 4, 7, M.causal_mask(4, 7)),
        (M.padded_prefill(valid), 2, 3, 3, M.padded_prefill_mask(valid)[:, 0]),
        (M.mdlm_denoise(block_of, 2, 8, True), 1, 6, 8, M.mdlm_denoise_mask(block_of, 2, 8, True)),
        (M.quadratic_self_spec(2, 3, 4), 1, 12, 16, M.quadratic_self_spec_mask(2, 3, 4)),
        (M.dflash_draft(2, 3), 1, 7, 9, M.dflash_draft_mask("input", 2, 3, 4, "cpu")),
    ]
    for pred, B, Q, K, want in cases:
        got = flex.create_mask(pred, B, 1, Q, K, device="cpu")[:, 0]
        assert torch.equal(got, want.expand(B, Q, K)), pred
