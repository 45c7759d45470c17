"""model.fuse_projections (the server's --pack-weights): each attention's q, k, v and each MLP's gate, up as one linear
layer for inference. Each output is the same dot product as before, but the library may sum it in another order for
a wider product: the logits are the separate layers' up to float rounding on configurations drawn by hypothesis, with a
KV cache, after pack_linears' transposed weights too, and the shipped ar-mid decodes the same greedy tokens; the
weights stay the layers' own (views of the joined one: the state dict unchanged), training keeps the separate
products."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import random_transformer

from dlm.model import PackedLinear, fuse_projections, pack_linears

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

configs = st.fixed_dictionaries({
    "dim": st.sampled_from([16, 32, 48]), "n_layers": st.integers(1, 3), "n_heads": st.sampled_from([2, 4]),
    "n_kv_heads": st.sampled_from([1, 2]), "head_dim": st.sampled_from([8, 16]), "ffn_dim": st.sampled_from([24, 64]),
    "qk_norm": st.booleans(), "attn_bias": st.booleans(), "tie_embeddings": st.booleans()})


@settings(max_examples=15, deadline=None, derandomize=True, database=None)
@given(cfg=configs, rows=st.integers(1, 6), context=st.integers(0, 9), new=st.integers(1, 4),
       packed=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_fused_projections_give_the_same_logits(cfg, rows, context, new, packed, seed):
    plain = random_transformer(seed, 0.3, vocab_size=50, max_seq_len=32, **cfg).eval()
    fused = random_transformer(seed, 0.3, vocab_size=50, max_seq_len=32, **cfg).eval()
    if packed:  # the server's --pack-weights first: the transposed copies are joined too
        pack_linears(plain, min_transposed=1)
        pack_linears(fused, min_transposed=1)
    keys = {k: v.clone() for k, v in fused.state_dict().items()}
    assert fuse_projections(fused) == 2 * cfg["n_layers"]
    assert fuse_projections(fused) == 0  # (once)
    assert all(torch.equal(v, keys[k]) for k, v in fused.state_dict().items()) and list(keys) == list(fused.state_dict())
    a = fused.layers[0].self_attn
    joined = a.qkv[0]
    assert isinstance(joined, PackedLinear) == packed
    assert a.k_proj.weight.untyped_storage().data_ptr() == joined.weight.untyped_storage().data_ptr()  # views
    x = torch.randint(0, 50, (rows, context + new))
    with torch.inference_mode():
        caches = [m.new_cache(rows, 32) for m in (plain, fused)]
        for m, c in zip((plain, fused), caches):
            if context:
                m(x[:, :context], cache=c)
        want = plain(x[:, context:], cache=caches[0]).logits
        got = fused(x[:, context:], cache=caches[1]).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        n = context + new
        for t0, t1 in zip(caches[0].buffers(), caches[1].buffers()):
            torch.testing.assert_close(t1[..., :n, :], t0[..., :n, :], rtol=1e-5, atol=1e-5)


def test_training_keeps_the_separate_products():
    m = random_transformer(0, 0.2, vocab_size=40, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32,
                           max_seq_len=16)
    fuse_projections(m)
    m(torch.randint(0, 40, (2, 5))).logits.sum().backward()
    a, p = m.layers[0].self_attn, m.layers[0].mlp
    assert all(w.grad is not None and w.grad.abs().sum() > 0
               for w in (a.q_proj.weight, a.k_proj.weight, a.v_proj.weight, p.gate_proj.weight, p.up_proj.weight))


AR_MID = Path(__file__).resolve().parents[1] / "checkpoints" / "ar-mid"


@pytest.mark.skipif(not (AR_MID / "config.json").exists(), reason="needs the shipped ar-mid")
def test_ar_mid_decodes_the_same_tokens_fused():
    from dlm.checkpoint import load_model
    from dlm.sampling import ar
    from dlm.sampling.common import Commit

    model, _ = load_model(AR_MID)
    prompts = [[5, 90, 311, 47, 1200, 8], [700, 12, 13, 14]]

    def tokens():
        return [t for ev in ar.decode(model.eval(), prompts, 12, 0.0, 0, 1.0, 0, None) if isinstance(ev, Commit)
                for t in ev.tokens]

    with torch.inference_mode():
        want = tokens()
        x = torch.tensor([prompts[0]])
        logits = model(x).logits
    assert fuse_projections(model) == 32
    with torch.inference_mode():
        assert tokens() == want
        torch.testing.assert_close(model(x).logits, logits, rtol=1e-5, atol=1e-5)
