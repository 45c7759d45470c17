"""The backbone's attention modes, positions, cache and taps, each held against a full recompute."""

import pytest
import torch

from dlm.config import ModelConfig, preset
from dlm.errors import DlmError
from dlm.masks import sdpa_mask
from dlm.model import Transformer

V = 97


def tiny(seed=0, **kw) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(preset("tiny", vocab_size=V, **kw)).eval()


def ids(B=2, T=24, seed=1):
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def close(a, b, tol=1e-5):
    assert (a - b).abs().max().item() <= tol, (a - b).abs().max().item()


@pytest.mark.parametrize("qk_norm", [True, False])
def test_cached_causal_decoding_matches_full_recompute(qk_norm):
    m, x = tiny(qk_norm=qk_norm), ids()
    full = m(x).logits
    cache = m.new_cache(2, 64)
    parts, start = [], 0
    for n in (7, 1, 5, 1, 1, 9):  # prefill, single steps, multi-token chunks
        parts.append(m(x[:, start:start + n], cache=cache).logits)
        start += n
    assert cache.length == 24
    close(torch.cat(parts, 1), full)


def test_block_over_cached_prefix_reads_without_writing():
    m, x = tiny(), ids(T=20)
    cache = m.new_cache(2, 64)
    m(x[:, :12], cache=cache)
    k_before = cache.k.clone()
    blk = m(x[:, 12:], cache=cache, mask="full", write=False).logits
    assert cache.length == 12 and torch.equal(cache.k, k_before)
    # reference: the whole sequence with an explicit mask (prefix causal, block bidirectional)
    mask = torch.tril(torch.ones(20, 20, dtype=torch.bool))
    mask[12:, 12:] = True
    close(blk, m(x, mask=mask).logits[:, 12:])


def test_explicit_positions_place_a_block_away_from_the_cache_end():
    m, x = tiny(), ids(T=16)
    cache = m.new_cache(2, 64)
    m(x[:, :8], cache=cache)
    # the block sits at positions 20..27 although the cache ends at 8
    pos = torch.arange(20, 28)
    out = m(x[:, 8:], cache=cache, mask="full", write=False, pos=pos).logits
    ref_pos = torch.cat([torch.arange(8), pos])
    mask = torch.tril(torch.ones(16, 16, dtype=torch.bool))
    mask[8:, 8:] = True
    close(out, m(x, pos=ref_pos, mask=mask).logits[:, 8:])
    # and it differs from the same block at the next positions (positions matter)
    other = m(x[:, 8:], cache=cache, mask="full", write=False).logits
    assert (other - out).abs().max() > 1e-3


def test_block_diagonal_mask_equals_separate_sequences():
    m, x = tiny(), ids(B=1, T=20)
    causal = torch.tril(torch.ones(20, 20, dtype=torch.bool))
    mask = causal.clone()
    mask[12:, :12] = False  # two documents packed in one row
    pos = torch.cat([torch.arange(12), torch.arange(8)])
    out = m(x, mask=mask, pos=pos).logits
    close(out[:, :12], m(x[:, :12]).logits)
    close(out[:, 12:], m(x[:, 12:]).logits)


def test_bool_mask_shapes_and_causal_equivalence():
    m, x = tiny(), ids()
    tril = torch.tril(torch.ones(24, 24, dtype=torch.bool))
    close(m(x, mask=tril).logits, m(x).logits)
    close(m(x, mask=tril[None, None].expand(2, 1, 24, 24)).logits, m(x).logits)
    with pytest.raises(ValueError):
        m(x, mask=torch.ones(3, 3, dtype=torch.bool))
    with pytest.raises(ValueError):
        sdpa_mask("sideways", 2, 2, torch.device("cpu"))


def test_crop_rolls_back_the_cache():
    m, x = tiny(), ids(T=16)
    cache = m.new_cache(2, 64)
    m(x[:, :10], cache=cache)
    m(ids(T=5, seed=9), cache=cache)  # junk that will be rejected
    cache.crop(10)
    after = m(x[:, 10:], cache=cache).logits
    close(after, m(x).logits[:, 10:])
    with pytest.raises(ValueError):
        cache.crop(99)


def test_cache_capacity_is_enforced():
    m = tiny()
    cache = m.new_cache(1, 8)
    m(ids(B=1, T=6), cache=cache)
    with pytest.raises(DlmError, match="KV cache full"):
        m(ids(B=1, T=3), cache=cache)


def test_context_features_in_cache_equal_context_given_inline():
    """ctx K/V written to the cache and read later == the same ctx passed with the block."""
    m, x = tiny(), ids(T=6)
    ctx = torch.randn(2, 5, m.cfg.dim, generator=torch.Generator().manual_seed(3))
    ctx_pos = torch.arange(5)
    inline = m(x, ctx=ctx, ctx_pos=ctx_pos, pos=torch.arange(5, 11), mask="full").logits
    cache = m.new_cache(2, 32)
    first = m(x, cache=cache, ctx=ctx, ctx_pos=ctx_pos, pos=torch.arange(5, 11), mask="full", write=False).logits
    assert cache.length == 5  # only the context was written
    again = m(x, cache=cache, pos=torch.arange(5, 11), mask="full", write=False).logits
    close(first, inline)
    close(again, inline)


def test_taps_return_layer_outputs():
    m, x = tiny(), ids()
    out = m(x, taps=(0, 1))
    assert set(out.taps) == {0, 1} and out.taps[1].shape == (2, 24, m.cfg.dim)
    close(m.norm(out.taps[1]), out.last)  # the last layer's output, normed, is the final hidden state
    assert m(x, head=False).logits is None


def test_presets_sizes():
    assert preset("tiny", vocab_size=4096).num_params() < 1_000_000
    assert 2_000_000 < preset("small", vocab_size=4096).num_params() < 10_000_000
    assert 10_000_000 < preset("base", vocab_size=4096).num_params() < 100_000_000
    m = Transformer(preset("tiny", vocab_size=4096))
    assert m.num_params() == m.cfg.num_params()


def test_config_validation():
    with pytest.raises(DlmError, match="n_heads"):
        ModelConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(DlmError, match="--preset"):
        preset("huge")
    with pytest.raises(DlmError, match="unknown fields"):
        ModelConfig.from_dict({"dim": 8, "colour": 1})
