"""YaRN RoPE and the queries' attention temperature by position (Ministral 3, the backbone of Nemotron-Labs-Diffusion),
held against transformers' own Ministral3ForCausalLM on tiny random weights: logits of a sequence longer than the
original context (so both the interpolated frequencies and the temperature steps are exercised), and cached decoding."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import Ministral3Config, Ministral3ForCausalLM  # noqa: E402

from dlm.config import ModelConfig  # noqa: E402
from dlm.model import Transformer  # noqa: E402


def pair(rope: dict, seed: int = 0):
    c = Ministral3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rope_parameters=rope,
                         tie_word_embeddings=False, rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    m = Ministral3ForCausalLM(c).eval()
    with torch.no_grad():
        for t in m.parameters():
            t.normal_(0, 0.3) if t.dim() > 1 else t.uniform_(0.5, 1.5)
    scaling = {k: v for k, v in c.rope_parameters.items() if k not in ("rope_theta", "type", "max_position_embeddings")}
    ours = Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48,
                                   rope_theta=c.rope_parameters["rope_theta"], rope_scaling=scaling, norm_eps=1e-5,
                                   qk_norm=False, tie_embeddings=False, max_seq_len=256)).eval()
    state = {k[len("model."):] if k.startswith("model.") else k: v for k, v in m.state_dict().items()}
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not missing and not [k for k in unexpected if "rotary" not in k], (missing, unexpected)
    return m, ours


ROPES = {
    "ministral3": dict(rope_type="yarn", rope_theta=1e6, factor=16.0, original_max_position_embeddings=8,
                       beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1),
    "yarn-factor": dict(rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=16,
                        llama_4_scaling_beta=0.0),  # no temperature (transformers needs the key)
    "yarn-mscale": dict(rope_type="yarn", rope_theta=1e4, factor=8.0, original_max_position_embeddings=16,
                        mscale=1.0, mscale_all_dim=0.5, llama_4_scaling_beta=0.3),
}


@pytest.mark.parametrize("name", sorted(ROPES))
def test_logits_and_cached_decoding_match_transformers(name):
    m, ours = pair(dict(ROPES[name]))
    ids = torch.randint(0, 64, (2, 40), generator=torch.Generator().manual_seed(1))  # 40 > 8 / 16: past the original
    with torch.no_grad():
        ref = m(ids).logits
        torch.testing.assert_close(ours(ids).logits, ref, atol=1e-4, rtol=1e-4)
        cache = ours.new_cache(2, 64)
        steps = [ours(ids[:, :30], cache=cache).logits]
        for t in range(30, 40):  # token by token: each position's own temperature and frequencies
            steps.append(ours(ids[:, t:t + 1], cache=cache).logits)
        torch.testing.assert_close(torch.cat(steps, 1), ref, atol=1e-4, rtol=1e-4)


def test_the_temperature_and_the_factor_change_the_output():
    """The features are live: dropping either one moves the logits past the tolerance above."""
    rope = dict(ROPES["yarn-mscale"])
    m, ours = pair(rope)
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = ours(ids).logits
        for drop in ("llama_4_scaling_beta", "mscale_all_dim"):
            ours.cfg.rope_scaling = {k: v for k, v in rope.items() if k not in (drop, "rope_theta")}
            assert (ours(ids).logits - ref).abs().max() > 1e-2, drop
