"""dlm's logits against transformers' on the same weights (Qwen3, Qwen2 and Llama), and import/export."""

import json

import pytest
import torch
from safetensors.torch import save_file

from dlm.checkpoint import load_model, save_checkpoint
from dlm.config import ModelConfig
from dlm.errors import DlmError
from dlm.hf import export_hf, import_hf
from dlm.model import Transformer
from dlm.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")
TOL = 1e-4


@pytest.fixture(scope="module")
def tok(tokenizer_path):
    return Tokenizer.from_file(tokenizer_path)


def make(family: str, tok, **kw) -> Transformer:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=tok.vocab_size, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=160,
                      qk_norm=family == "qwen3", attn_bias=family == "qwen2", tie_embeddings=family == "qwen3",
                      rope_theta=50000.0, max_seq_len=256, **kw)
    m = Transformer(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights, so a mix-up would show
        for n, p in m.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
            elif n.endswith("bias"):  # Qwen2's q/k/v biases (they start at zero)
                p.normal_(0, 0.1)
    return m


def hf_load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_export_matches_transformers_with_and_without_cache(family, tok, tmp_path):
    m = make(family, tok)
    export_hf(m, tok, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["model_type"] == family
    hf = hf_load(tmp_path / "hf")
    assert type(hf).__name__ == {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                 "llama": "LlamaForCausalLM"}[family]
    x = torch.randint(0, tok.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = m(x, taps=(0, 1, 2))
        theirs = hf(x, output_hidden_states=True)
        assert (ours.logits - theirs.logits).abs().max() <= TOL
        for i in range(3):  # hidden_states[i + 1] is the output of decoder layer i
            if i < 2:
                assert (ours.taps[i] - theirs.hidden_states[i + 1]).abs().max() <= TOL
        # with the KV cache: prefill 30, then 10 more one by one
        pkv = hf(x[:, :30], use_cache=True).past_key_values
        cache = m.new_cache(2, 64)
        m(x[:, :30], cache=cache)
        for j in range(30, 40):
            out_hf = hf(x[:, j:j + 1], past_key_values=pkv, use_cache=True)
            pkv = out_hf.past_key_values
            out = m(x[:, j:j + 1], cache=cache).logits
            assert (out - out_hf.logits).abs().max() <= TOL


def test_llama3_rope_scaling_matches_transformers(tok, tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    m = make("llama", tok, rope_scaling=scaling)
    export_hf(m, tok, tmp_path / "hf")
    hf = hf_load(tmp_path / "hf")
    x = torch.randint(0, tok.vocab_size, (1, 200), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (m(x).logits - hf(x).logits).abs().max() <= TOL


def test_exported_tokenizer_loads_in_transformers(tok, tmp_path):
    export_hf(make("qwen3", tok), tok, tmp_path / "hf")
    at = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    for s in ["def f(x):\n    return x  # <eos> stays text", "héllo wörld 😀\n\t x = 1"]:
        assert at.encode(s, add_special_tokens=False) == tok.encode(s)
        assert at.decode(tok.encode(s)) == s
    assert at.eos_token_id == tok.eos_id and at.pad_token_id == tok.pad_id


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_import_sharded_folder_roundtrip(family, tok, tmp_path):
    m = make(family, tok)
    export_hf(m, tok, tmp_path / "hf")
    # re-shard the weights into two files with an index, as large checkpoints come
    from safetensors.torch import load_file

    src = tmp_path / "hf"
    tensors = load_file(src / "model.safetensors")
    (src / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, str(src / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    import_hf(src, tmp_path / "dlm")
    back, ck = load_model(tmp_path / "dlm")
    assert ck.objective == "ar" and back.cfg.qk_norm == (family == "qwen3")
    assert back.cfg.attn_bias == (family == "qwen2")
    x = torch.randint(0, tok.vocab_size, (1, 30))
    with torch.no_grad():
        assert torch.equal(back(x).logits, m(x).logits)


def test_import_refuses_unsupported_models(tok, tmp_path):
    export_hf(make("qwen3", tok), tok, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    for change, msg in [({"model_type": "gpt2"}, "not supported"), ({"attention_bias": True}, "biases"),
                        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn")]:
        (tmp_path / "hf" / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(DlmError, match=msg):
            import_hf(tmp_path / "hf", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(DlmError, match="not found"):
        import_hf(tmp_path / "nope", tmp_path / "out")


def test_export_refuses_models_transformers_cannot_hold(tok, tmp_path):
    m = make("qwen3", tok, self_cond=True)
    with pytest.raises(DlmError, match="self-conditioning"):
        export_hf(m, tok, tmp_path / "hf")
    save_checkpoint(tmp_path / "ck", m, tok, {"objective": "usdm", "model": m.cfg.to_dict()})
    assert load_model(tmp_path / "ck")[1].objective == "usdm"
