"""model.pack_linears / PackedLinear: the linear layers of a model for inference keep a copy of their weight for products
of several rows (oneDNN-packed for large weights, transposed for small ones); outputs stay those of F.linear up to
float rounding, one row and training are F.linear itself, the weights (tied
ones too) and the state dict are unchanged."""

from __future__ import annotations


import pytest
import torch
from conftest import needs_cxx, random_transformer

from hypothesis import given, settings
from hypothesis import strategies as st

from dlm.model import BLOCKED_ROWS, PackedLinear, pack_linears

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN (mkldnn)")]


def model():
    return random_transformer(1, 0.2, vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                              ffn_dim=160, max_seq_len=64).eval()


def test_packed_linears_give_the_same_outputs_and_keep_the_weights():
    plain, packed = model(), model()
    keys = set(plain.state_dict())
    assert pack_linears(packed, min_elements=64 * 64, min_transposed=0) == 2 * 5 + 1  # q, o, gate, up, down, the head
    assert isinstance(packed.lm_head, PackedLinear) and packed.lm_head.weight is packed.embed_tokens.weight
    assert not isinstance(packed.layers[0].self_attn.k_proj, PackedLinear)  # 32 x 64: under the threshold
    assert set(packed.state_dict()) == keys
    x = torch.randint(0, 300, (4, 9))
    with torch.inference_mode():
        want, got = plain(x).logits, packed(x).logits  # several rows: the packed product
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        one = x[:1, :1]
        assert torch.equal(packed(one).logits, plain(one).logits)  # one row: F.linear itself
    lin = packed.layers[0].mlp.gate_proj
    h = torch.randn(3, 64)
    y = lin(h)  # with gradients (training): F.linear itself, differentiable
    assert torch.equal(y, torch.nn.functional.linear(h, lin.weight)) and y.requires_grad


def test_small_weights_transposed_give_the_same_outputs():
    plain, packed = model(), model()
    assert pack_linears(packed, min_transposed=1) == 2 * 7 + 1  # every weight under a million entries: transposed
    assert all(m.packed is None and m.wt.is_contiguous() for m in packed.modules() if isinstance(m, PackedLinear))
    assert packed.lm_head.weight is packed.embed_tokens.weight
    x = torch.randint(0, 300, (4, 9))
    with torch.inference_mode():
        torch.testing.assert_close(packed(x).logits, plain(x).logits, rtol=1e-5, atol=1e-5)
        one = x[:1, :1]
        assert torch.equal(packed(one).logits, plain(one).logits)
        lin = torch.nn.Linear(48, 80)  # with a bias (Qwen2's q, k, v)
        h = torch.randn(2, 5, 48)
        torch.testing.assert_close(PackedLinear(lin, "transposed")(h), lin(h), rtol=1e-5, atol=1e-6)
    m = model()
    assert pack_linears(m, min_transposed=0) == 0  # nothing large enough for oneDNN, nothing transposed


@needs_cxx
@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 20), n16=st.integers(1, 6), k=st.integers(1, 70), bias=st.booleans(), seed=st.integers(0, 99))
def test_blocked_kernel_is_the_product_row_by_row(rows, n16, k, bias, seed):
    """dlm.kernels.blocked_linear over generated shapes (any K, outputs a multiple of 16, 1-20 rows: past 16 the layer
    hands over to F.linear): F.linear's values up to float rounding, and each row's output bit for bit what that row
    gets alone (a verify's logits are the one-token steps')."""
    from dlm import kernels

    assert kernels.blocked_linear()
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, 16 * n16, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(lin.weight.shape, generator=g))
    x = torch.randn(rows, k, generator=g)
    packed = PackedLinear(lin, "blocked")
    with torch.inference_mode():
        y = packed(x)
        torch.testing.assert_close(y, lin(x), rtol=1e-5, atol=1e-4)
        if rows <= BLOCKED_ROWS:
            for r in (0, rows - 1):
                assert torch.equal(packed(x[r:r + 1]), y[r:r + 1])
        assert packed(x[None]).shape == (1, rows, 16 * n16)


@needs_cxx
def test_blocked_linears_give_the_same_outputs():
    """pack_linears(blocked=True): every float32 weight with a multiple of 16 outputs blocked (the head's 300 are not:
    it stays F.linear's, tied to the embedding), the logits F.linear's up to float rounding, the state dict unchanged;
    bfloat16 keeps the other layouts."""
    plain, packed = model(), model()
    keys = set(plain.state_dict())
    assert pack_linears(packed, min_transposed=0, blocked=True) == 2 * 7
    assert all(m.blocked is not None for m in packed.modules() if isinstance(m, PackedLinear))
    assert type(packed.lm_head) is torch.nn.Linear and packed.lm_head.weight is packed.embed_tokens.weight
    assert set(packed.state_dict()) == keys
    x = torch.randint(0, 300, (4, 9))
    with torch.inference_mode():
        for t in (x, x[:1, :1], x[:, :3]):
            torch.testing.assert_close(packed(t).logits, plain(t).logits, rtol=1e-5, atol=1e-5)
    b = model().to(torch.bfloat16)
    assert pack_linears(b, min_elements=1, blocked=True) == 2 * 7 + 1
    assert not any(m.blocked is not None for m in b.modules() if isinstance(m, PackedLinear))


def test_bfloat16_packed():
    b = model().to(torch.bfloat16)
    assert pack_linears(b, min_elements=1) == 2 * 7 + 1
    with torch.inference_mode():
        out = b(torch.randint(0, 300, (3, 5))).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


@needs_cxx
def test_row_linears_keep_eager_bits_and_compile_one_row_as_a_reduction():
    """graphs.row_linears: every linear (plain or packed) wrapped; eager outputs bit for bit, weights, ties and the
    state dict unchanged; compiled, one row is the multiply-and-sum (no matrix product left in the generated code)
    and several rows the layer's product, both equal to F.linear up to float rounding."""
    from torch._inductor.utils import run_and_get_code

    from dlm.sampling.graphs import RowLinear, row_linears

    plain, wrapped = model(), model()
    pack_linears(wrapped, min_elements=64 * 64, min_transposed=1)
    keys = set(plain.state_dict())
    assert row_linears(wrapped) == 2 * 7 + 1
    assert isinstance(wrapped.lm_head, RowLinear) and wrapped.lm_head.weight is wrapped.embed_tokens.weight
    assert set(wrapped.state_dict()) == keys
    x = torch.randint(0, 300, (4, 9))
    with torch.inference_mode():
        for t in (x, x[:1, :1]):
            assert torch.equal(wrapped(t).logits, plain(t).logits)
        lin = wrapped.layers[1].mlp.down_proj
        f = torch.compile(lambda h: lin(h), dynamic=True)
        for rows in (1, 3):
            h = torch.randn(rows, 1, 160)
            y, code = run_and_get_code(f, h)
            torch.testing.assert_close(y, torch.nn.functional.linear(h, lin.weight), rtol=1e-5, atol=1e-5)
            products = sum(c.count("extern_kernels.mm") + c.count("_mkl_linear") + c.count("mkldnn._linear")
                           for c in code)
            assert (products == 0) == (rows == 1), code
