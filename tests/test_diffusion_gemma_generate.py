"""An imported DiffusionGemma samples what transformers' DiffusionGemmaForBlockDiffusion.generate samples: same seed,
same tokens, at the model's generation defaults (48 steps, t 0.8 -> 0.4, entropy bound 0.1, adaptive stopping) and
near zero temperature, on tiny configurations drawn by hypothesis (sliding and full layers, windows shorter and longer
than the prompt, one KV head on the full layers, 2-4 experts top-1/2, EOS id lists, canvases of 8-16, budgets that end
inside a canvas, weights scaled up so entropies differ, prompts with and without <bos>).

The self-conditioned denoiser can amplify a difference of one float32 step into other samples within a few steps, so
this holds only where the arithmetic is the same: the reference's temperature, entropy and acceptance arithmetic
(dlm.sampling.usdm), sliding layers reading only the prefix's last window - 1 keys (dlm.model.run_blocks), and
weights at the same memory alignment on both sides (MKL's matmuls round differently on unaligned rows: transformers'
own generate differs between a model built in memory and the same model loaded from its folder, so both models here
hold freshly allocated weights)."""

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("hypothesis")
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from transformers.models.diffusion_gemma import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion  # noqa: E402

from conftest import cli  # noqa: E402
from dlm.checkpoint import load_model  # noqa: E402
from dlm.sampling import SampleConfig, stream  # noqa: E402
from dlm.sampling.common import Commit  # noqa: E402
from test_diffusion_gemma import TINY_VISION, F, S  # noqa: E402
from test_hf_gemma import save_tokenizer  # noqa: E402

V = 97  # save_tokenizer's vocabulary: pad 0, eos 1, bos 2, control tokens up to 6


def build(layers, window, experts, top_k, canvas, scale, seed):
    tc = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=len(layers),
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
              num_global_key_value_heads=1, sliding_window=window, layer_types=list(layers), num_experts=experts,
              top_k_experts=top_k, moe_intermediate_size=24, max_position_embeddings=256)
    c = DiffusionGemmaConfig(text_config=tc, vision_config=TINY_VISION, canvas_length=canvas)
    torch.manual_seed(seed)
    m = DiffusionGemmaForBlockDiffusion(c).eval()
    with torch.no_grad():  # away from init values, scaled so that entropies differ (ties keep encoder = decoder)
        for t in m.parameters():
            t.copy_(1 + 0.3 * torch.randn_like(t) if t.dim() == 1 else scale * torch.randn_like(t))
    return m


def imported(m, eos, folder):
    """dlm's import of m's folder (a real tokenizer, generation_config's EOS list), weights freshly allocated."""
    m.save_pretrained(folder / "src")
    save_tokenizer(folder / "src")
    (folder / "src" / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "bos_token_id": 2,
                                                                      "pad_token_id": 0}))
    cli("import", "--hf", str(folder / "src"), "--out", str(folder / "ck"), check=True)
    net, ck = load_model(str(folder / "ck"))
    with torch.no_grad():  # the checkpoint's tensors are memory-mapped at the file's offsets: align them as m's
        for p in net.parameters():
            p.data = p.data.clone()
    return net, ck


def reference(m, prompt, n, eos, seed, **opts):
    """transformers' generate: whole canvases (max_new_tokens rounded up), pad after the first EOS. The tokens dlm
    commits: the first n, through the first EOS."""
    torch.manual_seed(seed)
    with torch.no_grad():
        out = m.generate(torch.tensor([prompt]), max_new_tokens=n, eos_token_id=eos, pad_token_id=0,
                         disable_compile=True, **opts).sequences[0, len(prompt):].tolist()
    ends = [i for i, t in enumerate(out) if t in eos]
    # (it denoises and returns whole canvases; it stops after the canvas where every row has met an EOS)
    assert len(out) % m.config.canvas_length == 0 and (len(out) >= n or ends)
    out = out[:n]
    ends = [i for i in ends if i < n]
    return out[:ends[0] + 1] if ends else out


def ours(net, ck, prompt, n, seed, **opts):
    cfg = SampleConfig(max_new_tokens=n, seed=seed, **opts)
    return [t for e in stream(net, ck, [prompt], cfg) if isinstance(e, Commit) for t in e.tokens]


GREEDYISH = dict(t_min=1e-5, t_max=1e-4)


@st.composite
def cases(draw):
    n = draw(st.integers(2, 5))
    layers = [draw(st.sampled_from([S, F])) for _ in range(n - 1)] + [F]  # (transformers makes the last one full)
    canvas = draw(st.integers(8, 16))
    return dict(layers=layers, window=draw(st.integers(2, 12)), experts=draw(st.integers(2, 4)),
                top_k=draw(st.integers(1, 2)), canvas=canvas, scale=draw(st.sampled_from([0.1, 0.3, 0.6])),
                eos=draw(st.lists(st.integers(1, 6), min_size=1, max_size=2, unique=True)),
                prompt_len=draw(st.integers(3, 14)), bos=draw(st.booleans()),
                n=draw(st.integers(1, 2 * canvas + canvas // 2)), seed=draw(st.integers(0, 2 ** 16)))


ISSUE = dict(layers=[S, F, S, S, F], window=8, experts=4, top_k=2, canvas=16, scale=0.3, eos=[1, 5], prompt_len=11,
             bos=True, n=40, seed=0)


@settings(max_examples=4, deadline=None, derandomize=True, database=None)
@example(ISSUE)
@given(cases())
def test_generate_equals_transformers_generate_same_seed(tmp_path_factory, case):
    m = build(case["layers"], case["window"], case["experts"], case["top_k"], case["canvas"], case["scale"],
              case["seed"])
    net, ck = imported(m, case["eos"], tmp_path_factory.mktemp("dg"))
    g = torch.Generator().manual_seed(case["seed"])
    prompt = torch.randint(7, V, (case["prompt_len"],), generator=g).tolist()  # (no special token inside)
    prompt = [2] + prompt if case["bos"] else prompt
    n, eos, seed = case["n"], case["eos"], case["seed"]
    got = ours(net, ck, prompt, n, seed)
    assert got == reference(m, prompt, n, eos, seed)  # sampled, at the model's generation defaults
    assert ours(net, ck, prompt, n, seed, **GREEDYISH) == reference(m, prompt, n, eos, seed, **GREEDYISH)
    assert len(got) == n or got[-1] in eos


def test_the_last_canvas_is_whole_unless_fit(tmp_path):
    """max_new_tokens 20 on a canvas of 16: an imported DiffusionGemma denoises the second canvas whole (16
    positions, as transformers' generate does) and cuts it to 4 tokens; --last-canvas fit denoises only the 4
    positions left."""
    from dlm.sampling.common import Step

    m = build(ISSUE["layers"], 8, 4, 2, 16, 0.1, 3)
    net, ck = imported(m, [6], tmp_path)
    prompt = [2, 20, 21, 22, 23]
    for last, width in ((None, 16), ("whole", 16), ("fit", 4)):
        cfg = SampleConfig(max_new_tokens=20, seed=0, t_min=1e-5, t_max=1e-4, last_canvas=last)
        ev = list(stream(net, ck, [prompt], cfg, step_events=True))
        widths = {e.canvas_index: len(e.canvas) for e in ev if isinstance(e, Step)}
        got = [t for e in ev if isinstance(e, Commit) for t in e.tokens]
        assert widths == {0: 16, 1: width} and len(got) == 20 and 6 not in got
    with pytest.raises(Exception, match="--last-canvas"):
        list(stream(net, ck, [prompt], SampleConfig(last_canvas="half")))
