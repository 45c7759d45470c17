"""The backbone with Gemma 4's layers (ModelConfig's layer types, sandwich norms, experts) against transformers'
Gemma 4 on tiny random configs that transformers builds: logits within fp32 rounding, cached decoding, the MoE
paths equal; a config.json of the older `arch` form loads into the same fields."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers.models.gemma4 import Gemma4ForCausalLM, Gemma4TextConfig  # noqa: E402

from dlm.config import ModelConfig  # noqa: E402
from dlm.errors import DlmError  # noqa: E402
from dlm.hf_gemma import dlm_state, model_config_from_gemma  # noqa: E402
from dlm.model import Transformer  # noqa: E402

ATTN = "sdpa"  # transformers' default; its eager kernel differs from both by fp32 rounding (<2e-5)
S, F = "sliding_attention", "full_attention"
PATTERNS = {
    "moe-kv": dict(layer_types=[S, F, S, F], attention_k_eq_v=True, enable_moe_block=True, final_logit_softcapping=30.0),
    "dense": dict(layer_types=[S, S, F], attention_k_eq_v=False, enable_moe_block=False, final_logit_softcapping=None),
    "moe-v": dict(layer_types=[F, S, S, F], attention_k_eq_v=False, enable_moe_block=True, final_logit_softcapping=5.0),
}


def hf_model(pattern: str, seed: int = 0):
    p = PATTERNS[pattern]
    c = Gemma4TextConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=len(p["layer_types"]),
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
                         num_global_key_value_heads=1, sliding_window=5, num_experts=4, top_k_experts=2,
                         moe_intermediate_size=24, hidden_size_per_layer_input=0, max_position_embeddings=128, **p)
    c._attn_implementation = ATTN
    torch.manual_seed(seed)
    m = Gemma4ForCausalLM(c).eval()
    with torch.no_grad():  # norms and scalars away from their init values, so a missed multiply shows
        for name, t in m.named_parameters():
            if t.dim() == 1 or "per_expert_scale" in name:
                t.copy_(1 + 0.3 * torch.randn_like(t))
            elif t.dim() >= 2:
                t.normal_(0, 0.1)
        for name, b in m.named_buffers():
            if name.endswith("layer_scalar"):
                b.fill_(0.7)
    return c, m


def ours(c, m) -> Transformer:
    model = Transformer(model_config_from_gemma(c.to_dict())).eval()
    state = dlm_state(m.state_dict())
    if model.cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_ar_logits_match_transformers(pattern):
    c, m = hf_model(pattern)
    model = ours(c, m)
    ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(1))  # prompt longer than the window
    with torch.no_grad():
        ref = m(ids).logits
        got = model(ids).logits
    assert ref.abs().max() > 0.5
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_cached_decoding_matches_full_forward_and_crop():
    c, m = hf_model("moe-kv")
    model = ours(c, m)
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = m(ids).logits
        cache = model.new_cache(1, 32)
        assert cache.k[0].shape != cache.k[1].shape  # per-layer shapes: sliding (2, 8), full K=V (1, 16)
        out = [model(ids[:, :6], cache=cache).logits]
        for i in range(6, 12):
            out.append(model(ids[:, i:i + 1], cache=cache).logits)
        torch.testing.assert_close(torch.cat(out, 1), ref, atol=1e-5, rtol=1e-5)
        cache.crop(9)  # roll back and re-decode: the same logits
        again = model(ids[:, 9:12], cache=cache).logits
        torch.testing.assert_close(again, ref[:, 9:12], atol=1e-5, rtol=1e-5)


def test_moe_grouped_equals_eager():
    c, m = hf_model("moe-v")
    model = ours(c, m)
    ids = torch.randint(0, 97, (3, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        fast = model(ids).logits
        for layer in model.layers:
            layer.experts.grouped = False
        slow = model(ids).logits
    torch.testing.assert_close(fast, slow, atol=1e-6, rtol=1e-6)


def test_bad_arch_is_one_line_error():
    c, _ = hf_model("dense")
    d = c.to_dict()
    d["layer_types"] = [S, F]  # 2 types for 3 layers
    with pytest.raises(DlmError, match="layer_types"):
        model_config_from_gemma(d)


def test_training_masks_on_sliding_layers_are_refused():
    c, m = hf_model("dense")
    model = ours(c, m)
    ids = torch.randint(0, 97, (1, 6))
    with pytest.raises(DlmError, match="sliding-window"):
        model(ids, mask=torch.ones(6, 6, dtype=torch.bool))


@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_num_params_from_the_config(pattern):
    c, m = hf_model(pattern)
    model = ours(c, m)
    assert model.cfg.num_params() == sum(p.numel() for p in model.parameters())


# what model_config_from_gemma wrote for hf_model("moe-kv") into config.json while the layers were an `arch` object
ARCH_CONFIG = {
    "vocab_size": 97, "dim": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "head_dim": 8, "ffn_dim": 48,
    "rope_theta": 10000.0, "rope_scaling": None, "norm_eps": 1e-06, "qk_norm": True, "attn_bias": False,
    "partial_rotary": 1.0, "moe": None, "tie_embeddings": True, "max_seq_len": 128, "self_cond": False,
    "canvas_rms": 1.0, "canvas_shift": False, "learned_pos": False, "grid_pos": 0,
    "arch": {"family": "gemma4", "layer_types": ["sliding", "full", "sliding", "full"], "sliding_window": 5,
             "full_head_dim": 16, "full_kv_heads": 1, "full_rope_theta": 1000000.0, "full_partial_rotary": 0.25,
             "k_eq_v": True, "moe": {"n_experts": 4, "top_k": 2, "ffn_dim": 24}, "final_softcap": 30.0}}


def test_a_config_of_the_older_arch_form_loads_into_the_fields():
    """Checkpoints imported while Gemma 4's layers were an `arch` object load as the same model (the same config, the
    same logits) and are written back in the fields' form."""
    c, m = hf_model("moe-kv")
    cfg = ModelConfig.from_dict(ARCH_CONFIG)
    assert cfg == model_config_from_gemma(c.to_dict())
    assert "arch" not in cfg.to_dict() and ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.moe.router == "softmax" and cfg.logit_softcap == 30.0 and cfg.embed_scale == 32 ** 0.5
    with pytest.raises(DlmError, match="model.arch"):
        ModelConfig.from_dict({**ARCH_CONFIG, "arch": {**ARCH_CONFIG["arch"], "family": "llama"}})
