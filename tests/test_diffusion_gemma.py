"""DiffusionGemma (transformers' DiffusionGemmaForBlockDiffusion) on dlm's one backbone with the gemma4 layers:
encoder logits and KV cache, decoder logits with and without self-conditioning, on tiny random configs."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import DynamicCache  # noqa: E402
from transformers.models.diffusion_gemma import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion  # noqa: E402

from dlm.hf_gemma import dlm_state_diffusion_gemma, model_config_from_diffusion_gemma  # noqa: E402
from dlm.model import Transformer, canvas_embeds  # noqa: E402

S, F = "sliding_attention", "full_attention"
TINY_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=2, head_dim=8, position_embedding_size=16)


def hf_diffusion_gemma(layer_types, window=5, canvas=6, seed=0):
    tc = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=len(layer_types),
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
              num_global_key_value_heads=1, sliding_window=window, layer_types=list(layer_types), num_experts=4,
              top_k_experts=2, moe_intermediate_size=24, max_position_embeddings=128)
    c = DiffusionGemmaConfig(text_config=tc, vision_config=TINY_VISION, canvas_length=canvas)
    torch.manual_seed(seed)
    m = DiffusionGemmaForBlockDiffusion(c).eval()
    with torch.no_grad():  # away from init values (ties keep encoder and decoder equal)
        for name, t in m.named_parameters():
            t.copy_(1 + 0.3 * torch.randn_like(t) if t.dim() == 1 else 0.1 * torch.randn_like(t))
        for name, b in m.named_buffers():
            if name.endswith("layer_scalar"):
                b.fill_(0.8)
    return c, m


def ours(c, m) -> Transformer:
    model = Transformer(model_config_from_diffusion_gemma(c.to_dict())).eval()
    state, left = dlm_state_diffusion_gemma(m.state_dict())
    assert left and all(".vision_tower." in n or ".embed_vision." in n for n in left)
    state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model


@pytest.mark.parametrize("layers", [(S, F, S, F), (S, S, F), (F, S, S, S, F)])
def test_encoder_and_decoder_match_transformers(layers):
    c, m = hf_diffusion_gemma(layers)
    model = ours(c, m)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 97, (2, 11), generator=g)  # longer than the window (5)
    canvases = [torch.randint(0, 97, (2, 6), generator=g) for _ in range(2)]
    sc = torch.randn(2, 6, 97, generator=g) * 3
    with torch.no_grad():
        cache_hf = DynamicCache(config=c.text_config)
        enc = m.model.encoder(input_ids=prompt, cache=cache_hf)
        enc_logits = torch.tanh(m.lm_head(enc.last_hidden_state) / 30) * 30
        cache = model.new_cache(2, 64)
        ours_enc = model(prompt, cache=cache).logits
        torch.testing.assert_close(ours_enc, enc_logits, atol=1e-5, rtol=1e-5)
        for i in range(len(layers)):  # KV: transformers' sliding layers keep the last window - 1 slots
            k_hf, v_hf = cache_hf.layers[i].keys, cache_hf.layers[i].values
            n = k_hf.shape[2]
            torch.testing.assert_close(cache.k[i][:, :, 11 - n:11], k_hf, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(cache.v[i][:, :, 11 - n:11], v_hf, atol=1e-5, rtol=1e-5)
        pos = torch.arange(11, 17)
        for canvas in canvases:  # more than one canvas over the same cache (the decoder never writes it)
            for logits in (None, sc):
                ref = m(cache=cache_hf, decoder_input_ids=canvas, self_conditioning_logits=logits).logits
                probs = None if logits is None else torch.softmax(logits.float(), -1)
                got = model(embeds=canvas_embeds(model, canvas, probs), pos=pos, cache=cache, mask="full",
                            write=False).logits
                assert cache.length == 11
                torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layers", [(S, F, S, F), (F, S, S)])
def test_training_forward_is_transformers_encoder_and_decoder(layers):
    """usdm's training forward ([clean window ; canvas] in one pass, dlm.objectives.usdm.joint_forward) on the gemma4
    backbone with sliding layers: the clean rows are transformers' encoder over the window, the canvas rows its
    decoder over the encoder's cache of the tokens before the canvas (window 5, canvases after 7 and 3 tokens:
    sliding layers see the last window - 1 of them). What fine-tuning an imported DiffusionGemma trains on is what
    its sampler and transformers' generate compute."""
    from dlm.objectives.usdm import joint_forward

    c, m = hf_diffusion_gemma(layers, canvas=4)
    model = ours(c, m)
    g = torch.Generator().manual_seed(2)
    clean = torch.randint(0, 97, (2, 10), generator=g)
    canvas = torch.randint(0, 97, (2, 4), generator=g)
    start = torch.tensor([7, 3])
    with torch.no_grad():
        logits = joint_forward(model, clean, canvas_embeds(model, canvas, None), start)
        enc = m.model.encoder(input_ids=clean)
        torch.testing.assert_close(logits[:, :10], torch.tanh(m.lm_head(enc.last_hidden_state) / 30) * 30,
                                   atol=1e-5, rtol=1e-5)
        for b in range(2):
            cache_hf = DynamicCache(config=c.text_config)
            m.model.encoder(input_ids=clean[b:b + 1, :int(start[b])], cache=cache_hf)
            ref = m(cache=cache_hf, decoder_input_ids=canvas[b:b + 1]).logits
            torch.testing.assert_close(logits[b:b + 1, 10:], ref, atol=1e-5, rtol=1e-5)
