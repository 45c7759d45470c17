"""`dlm bench --shape`: the cost curve of one forward against new tokens and rows, on the machine it runs on."""

import json

import pytest

from conftest import cli
from test_cli import _one_line_error


def test_cost_curve_of_a_named_shape_through_the_cli(tmp_path):
    out = tmp_path / "cost.json"
    p = cli("bench", "--shape", "ar-small", "--points", "4", "2", "--context", "32", "--repeat", "1",
            "--out", str(out), check=True)
    assert "break-even tau" in p.stdout and "bandwidth limit" in p.stdout
    r = json.loads(out.read_text())
    assert r["shape"] == "ar-small" and r["context"] == 32 and r["params"] == 3_803_904
    for kind in ("tokens", "rows"):
        assert [row["n"] for row in r[kind]] == [1, 2, 4]  # n = 1 is always measured: the ratios are against it
        assert all(row["seconds"] > 0 and row["ratio"] > 0 and row["tokens_per_second"] > 0 for row in r[kind])
        assert all(len(row["range"]) == 2 and row["range"][0] <= row["seconds"] <= row["range"][1] for row in r[kind])
    assert r["tokens"][0]["ratio"] == 1.0 and r["rows"][0]["ratio"] == 1.0  # each curve against its own n = 1
    assert r["decode"]["tokens_per_second"] == pytest.approx(1 / r["tokens"][0]["seconds"])
    m, d = r["machine"], r["decode"]
    assert m["read_gb_s"] > 0 and m["copy_gb_s"] > 0 and m["matmul_gflop_s"] > 0
    # bytes per token: the float32 weights (tied head: counted once) and the K/V of 32 cached tokens
    assert d["weight_bytes"] == 3_803_904 * 4 and d["kv_bytes"] == 2 * 4 * 2 * 32 * 64 * 4
    assert d["fraction_of_limit"] == pytest.approx(d["tokens_per_second"] / d["limit_tokens_per_second"])
    assert d["fits_in_cache"] == bool(m["last_cache_bytes"] and d["bytes_per_token"] <= m["last_cache_bytes"])
    for b in r["break_even"]:
        assert b["tau"]["0"] == b["cost"] and b["tau_for_2x"]["1"] == pytest.approx(2 * (b["cost"] + 1))
    assert [b["block"] for b in r["break_even"]] == [2, 4]
    pytest.importorskip("matplotlib")
    assert out.with_suffix(".png").stat().st_size > 0


def test_cost_curve_of_a_checkpoint_folder_as_stored(tiny_ar):
    import torch

    from dlm.bench.cost import run_cost
    from dlm.checkpoint import load_model

    r = run_cost(str(tiny_ar), context=16, points=(3,), repeat=2, inner=2, machine_mb=8, clock="cpu", quiet=True)
    assert r["clock"] == "cpu" and r["tokens"][1]["seconds"] > 0
    model, _ = load_model(tiny_ar)
    assert r["params"] == sum(p.numel() for p in model.parameters()) and r["dtype"] == "float32"
    assert [row["n"] for row in r["tokens"]] == [1, 3] and r["tokens"][0]["ratio"] == 1.0
    assert r["environment"]["threads"] == torch.get_num_threads()


def test_named_shapes_have_the_public_models_sizes():
    from dlm.bench.cost import SHAPES, shape_model
    from dlm.config import ModelConfig

    sizes = {k: ModelConfig(**v).num_params() for k, v in SHAPES.items()}
    assert sizes["qwen3-0.6b"] == 596_049_920  # Qwen3-0.6B: 0.6B, 0.44B without the embedding
    assert round(sizes["qwen3-1.7b"] - 151936 * 2048, -8) == 1.4e9  # Qwen3-1.7B: 1.4B without the embedding
    assert round(sizes["llada-8b"], -9) == 8e9
    model, label = shape_model("qwen3-0.6b", layers=1)
    assert label == "qwen3-0.6b (1 of 28 layers)" and model.lm_head.weight is model.embed_tokens.weight
    one_layer = ModelConfig(**{**SHAPES["qwen3-0.6b"], "n_layers": 1})
    assert sum(p.numel() for p in model.parameters()) == one_layer.num_params()


def test_bad_shape_options_get_one_line_and_exit_2(tiny_ar, tmp_path):
    _one_line_error(cli("bench", "--shape", "gpt-9"), "dlm: error:", "--shape", "qwen3-0.6b")
    _one_line_error(cli("bench", "--shape", "ar-small", "--model", str(tiny_ar)), "--shape", "--model")
    _one_line_error(cli("bench", "--shape", "ar-small", "--points", "0"), "--points")
    _one_line_error(cli("bench", "--shape", "ar-small", "--layers", "-1"), "--layers")
    _one_line_error(cli("bench", "--shape", str(tiny_ar), "--layers", "2"), "--layers")
    _one_line_error(cli("bench", "--shape", "ar-small", "--context", "5000"), "max_seq_len")
    _one_line_error(cli("bench", "--shape", "ar-small", "--out", str(tmp_path)), "--out")
    _one_line_error(cli("bench", "--shape", "ar-small", "--clock", "sundial"), "--clock")
    _one_line_error(cli("bench", "--shape", ""), "--shape")
    _one_line_error(cli("bench", "--shape", "llada-8b", "--layers", "1000"), "GiB", "--layers")  # never allocated


def test_cost_curve_in_another_dtype(tiny_ar):
    import torch

    from dlm.bench.cost import run_cost, shape_model

    r = run_cost(str(tiny_ar), context=8, points=(2,), repeat=1, inner=1, machine_mb=4, quiet=True, dtype="bfloat16")
    assert r["dtype"] == "bfloat16" and r["machine"]["matmul_dtype"] == "bfloat16"
    model, _ = shape_model("ar-small", layers=1, dtype="float16")
    assert {p.dtype for p in model.parameters()} == {torch.float16}
    # bytes per token follow the dtype: 2 bytes a weight
    assert r["decode"]["weight_bytes"] == sum(p.numel() * 2 for p in shape_model(str(tiny_ar))[0].parameters())
    _one_line_error(cli("bench", "--shape", "ar-small", "--dtype", "int8"),
                    "--dtype must be one of float32, bfloat16, float16")


def test_rows_of_several_new_tokens(tiny_ar):
    """--row-tokens W: B rows of W new tokens each (a batch of diffusion blocks); tok/s counts every row's W."""
    from dlm.bench.cost import run_cost

    r = run_cost(str(tiny_ar), context=8, points=(2,), repeat=1, inner=1, machine_mb=8, clock="cpu", quiet=True,
                 row_tokens=5)
    assert r["row_tokens"] == 5 and [row["n"] for row in r["rows"]] == [1, 2]
    for row in r["rows"]:
        assert row["tokens_per_second"] == pytest.approx(row["n"] * 5 / row["seconds"])
    assert r["tokens"][1]["tokens_per_second"] == pytest.approx(2 / r["tokens"][1]["seconds"])
    _one_line_error(cli("bench", "--shape", str(tiny_ar), "--row-tokens", "0"), "--row-tokens")
