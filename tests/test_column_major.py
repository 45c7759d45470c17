"""model.column_major: a model's linear weights stored column-major for decoding (the same values, MKL's plain product
instead of its transposed one): outputs equal up to float rounding, greedy decoding the same, tied and non-float32
weights left alone; `dlm bench --col-major` and `--shape ... --col-major` run on it."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import cli, random_transformer

from dlm.model import column_major

pytestmark = pytest.mark.usefixtures("one_thread")


def model(tie: bool = True):
    return random_transformer(3, 0.2, vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
                              ffn_dim=160, max_seq_len=64, tie_embeddings=tie).eval()


def test_column_major_keeps_the_outputs_and_leaves_tied_weights():
    plain, col = model(), model()
    before = {k: v.clone() for k, v in col.state_dict().items()}
    assert column_major(col) == 2 * 7  # q, k, v, o, gate, up, down per layer; the tied head is the embedding's
    assert col.lm_head.weight is col.embed_tokens.weight and col.lm_head.weight.is_contiguous()
    w = col.layers[0].mlp.gate_proj.weight
    assert w.shape == (160, 64) and w.stride() == (1, 160) and not w.is_contiguous()
    assert all(torch.equal(v, before[k]) for k, v in col.state_dict().items())  # the same values, laid out anew
    x = torch.randint(0, 300, (3, 11))
    with torch.inference_mode():
        torch.testing.assert_close(col(x).logits, plain(x).logits, rtol=1e-5, atol=1e-5)
        cache_p, cache_c = plain.new_cache(1, 64), col.new_cache(1, 64)
        tp = tc = x[:1]
        for _ in range(12):  # greedy decoding over the cache, one token at a time
            tp = torch.cat([tp, plain(tp[:, cache_p.length:], cache=cache_p).logits[:, -1:].argmax(-1)], 1)
            tc = torch.cat([tc, col(tc[:, cache_c.length:], cache=cache_c).logits[:, -1:].argmax(-1)], 1)
    assert torch.equal(tp, tc)
    assert column_major(col) == 0  # already column-major: nothing to do


def test_untied_head_relaid_and_other_dtypes_left_alone():
    m = model(tie=False)
    assert m.lm_head.weight is not m.embed_tokens.weight
    assert column_major(m) == 2 * 7 + 1
    b = model().to(torch.bfloat16)
    assert column_major(b) == 0


def test_bench_with_col_major(tiny_ar, tmp_path):
    out = tmp_path / "b.json"
    cli("bench", "--model", str(tiny_ar), "--draft", "lookup", "--prompts", "1", "--max-new-tokens", "8",
        "--repeat", "1", "--no-naive", "--temperature", "0", "--col-major", "--out", str(out), check=True)
    r = json.loads(out.read_text())
    assert r["col_major"] is True and r["dtype"] == "float32" and r["device"] == "cpu"
    from dlm.bench.cost import run_cost

    r = run_cost(str(tiny_ar), context=8, points=(2,), repeat=1, inner=1, machine_mb=8, quiet=True, col_major=True)
    assert r["shape"].endswith("(column-major)") and r["tokens"][1]["seconds"] > 0


def test_bench_in_bfloat16(tiny_ar, tmp_path):
    """`dlm bench --dtype bfloat16`: every row's model in bfloat16 (a GPU's usual dtype); speculation stays lossless
    against the target in that dtype; an unknown dtype is one line."""
    out = tmp_path / "b.json"
    cli("bench", "--model", str(tiny_ar), "--draft", "lookup", "--prompts", "1", "--max-new-tokens", "8",
        "--repeat", "1", "--no-naive", "--temperature", "0", "--dtype", "bfloat16", "--out", str(out), check=True)
    r = json.loads(out.read_text())
    assert r["dtype"] == "bfloat16"
    assert [s["lossless"] for s in r["summaries"] if "lookup" in s["method"]] == [1.0]
    bad = cli("bench", "--model", str(tiny_ar), "--dtype", "int8", "--out", "")
    assert bad.returncode == 2 and "--dtype" in bad.stderr and "Traceback" not in bad.stderr
