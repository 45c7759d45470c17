"""dlm's own CPU kernels (dlm/kernels) against PyTorch's operators over drawn shapes: the row attention kernel of the
compiled one-token step equals scaled_dot_product_attention, reads no slot its mask forbids, and is what a compiled
row step calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import needs_cxx, random_transformer

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from dlm import kernels  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_thread"), needs_cxx]


@pytest.fixture(scope="module")
def built():
    assert kernels.row_attention(), "the row attention kernel did not build"


cases = st.tuples(st.integers(1, 5),  # rows
                  st.integers(1, 3),  # K/V heads
                  st.integers(1, 4),  # query heads per K/V head
                  st.sampled_from([8, 16, 24, 40, 64, 72, 128]),  # head dim (with and without a vector-width tail)
                  st.integers(1, 40),  # slots read
                  st.integers(0, 9),  # capacity beyond them
                  st.sampled_from([torch.float32, torch.float64]),
                  st.floats(0.05, 1.0),  # scale
                  st.integers(0, 2 ** 31 - 1),
                  st.booleans())  # K/V in bfloat16 (under float32 queries)


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(case=cases)
def test_row_attention_equals_sdpa_and_reads_no_masked_slot(built, case):
    R, H, G, D, S, extra, dtype, scale, seed, half_kv = case
    half_kv = half_kv and dtype == torch.float32
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(R, H, G, D, generator=g, dtype=dtype)
    kb = 3 * torch.randn(R + 1, H, S + extra, D, generator=g, dtype=dtype)  # (buffers: more rows and slots than read)
    vb = torch.randn(R + 1, H, S + extra, D, generator=g, dtype=dtype)
    if half_kv:  # (the reference: the same bfloat16 values, widened)
        kb, vb = kb.bfloat16(), vb.bfloat16()
    mask = torch.rand(R, 1, 1, S, generator=g) < 0.6
    mask[torch.arange(R), 0, 0, torch.randint(0, S, (R,), generator=g)] = True  # every row reads a slot
    ref = F.scaled_dot_product_attention(q, kb[:R, :, :S].to(dtype), vb[:R, :, :S].to(dtype), attn_mask=mask,
                                         scale=scale)
    poisoned = ~mask[:, 0, 0, :, None].expand(R, S, D)[:, None].expand(R, H, S, D)
    kb[:R, :, :S][poisoned] = float("nan")  # a forbidden slot's K and V: read, they would poison the row
    vb[:R, :, :S][poisoned] = float("nan")
    kb[:, :, S:] = vb[:, :, S:] = float("nan")
    y = torch.ops.dlm.row_attention(q, kb[:R, :, :S], vb[:R, :, :S], mask, scale)
    assert y.shape == ref.shape and y.dtype == dtype and y.is_contiguous()
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol)


def test_row_attention_rejects_what_it_cannot_read(built):
    q, k = torch.randn(2, 1, 2, 8), torch.randn(2, 1, 5, 8)
    mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    for bad in ((q, k, k, mask.float()), (q, k, k[..., :4], mask), (q, k.transpose(2, 3).contiguous().transpose(2, 3),
                                                                     k, mask),
                (q.double(), k.bfloat16(), k.bfloat16(), mask), (q, k.bfloat16(), k, mask)):
        with pytest.raises(RuntimeError, match="row_attention"):
            torch.ops.dlm.row_attention(*bad, 0.5)


@pytest.mark.parametrize("kv,tuned", [(None, False), (torch.bfloat16, False),
                                      pytest.param(None, True, marks=pytest.mark.slow),
                                      pytest.param(torch.bfloat16, True, marks=pytest.mark.slow)])
def test_a_compiled_row_step_calls_the_kernel_and_equals_the_eager_step(built, kv, tuned):
    """graphs.RowsStep on a CPU sets every attention layer on the kernel: the compiled step's code calls it, and its
    logits are the eager step's (float32 rounding) over buffers whose unread slots are NaN; with the K/V kept in
    bfloat16 (Transformer.kv_dtype) too. Its products as shipped (autotuned: ~3x the compile time, slow) or as
    inductor writes them untuned."""
    from torch._inductor.utils import run_and_get_code

    from dlm.sampling.graphs import RowsStep

    m = random_transformer(5, 0.3, vocab_size=40, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                           ffn_dim=64, max_seq_len=64).eval()
    m.kv_dtype = kv
    eager, compiled = RowsStep(m, compile=False), RowsStep(m)
    if not tuned:
        compiled.options = dict(freezing=True)
    assert all(layer.self_attn.row_kernel for layer in m.layers)
    R, S = 3, 9
    with torch.inference_mode():
        cache = m.rows_cache(R, 16, per_layer=True)
        assert cache.k[0].dtype == (kv or torch.float32)
        for t in cache.buffers():
            t.normal_()
        length = torch.tensor([8, 3, 5])  # row r writes at slot length[r] and reads slots 0..length[r]
        valid = torch.arange(S)[None] <= length[:, None]
        ks, vs = [k.clone() for k in cache.k], [v.clone() for v in cache.v]
        for t in ks + vs:  # (what the compiled step must not read: NaN)
            t[:, :, S:] = float("nan")
            for r in range(R):
                t[r, :, length[r] + 1:] = float("nan")
        tokens = torch.tensor([4, 17, 33])
        want = eager(tokens, length, length, valid, cache.k, cache.v)
        got, code = run_and_get_code(compiled, tokens, length, length, valid, ks, vs)
    assert any("dlm.row_attention" in c for c in code)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
