"""The captured decoding step (dlm.sampling.graphs): the static step a CUDA graph replays (its write slot a tensor,
every slot attended to under a mask) gives the eager step's tokens and logits, over generated configurations.
On the CPU the same static step runs eagerly; with `pytest --device cuda` it is captured and replayed."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dlm.config import ModelConfig, MoEConfig
from dlm.errors import DlmError
from dlm.model import Transformer
from dlm.sampling.ar import decode
from dlm.sampling.common import Commit
from dlm.sampling.graphs import StepGraph, graphable


def model_of(seed: int, heads: int, kv: int, head_dim: int, qk_norm: bool, bias: bool, tie: bool) -> Transformer:
    cfg = ModelConfig(dim=32, n_layers=2, n_heads=heads, n_kv_heads=kv, head_dim=head_dim, ffn_dim=48,
                      vocab_size=97, max_seq_len=128, qk_norm=qk_norm, attn_bias=bias, tie_embeddings=tie)
    torch.manual_seed(seed)
    model = Transformer(cfg).eval()
    with torch.no_grad():  # peaked logits: greedy choices far from ties
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8)
    return model


configs = st.fixed_dictionaries({
    "seed": st.integers(0, 2**16), "heads": st.sampled_from([2, 4]), "kv": st.sampled_from([1, 2]),
    "head_dim": st.sampled_from([8, 16]), "qk_norm": st.booleans(), "bias": st.booleans(), "tie": st.booleans()})


def tokens(model, prompts, n, graphs):
    return [(ev.row, ev.tokens) for ev in decode(model, prompts, n, eos_id=None, cuda_graphs=graphs)
            if isinstance(ev, Commit)]


@settings(max_examples=12, deadline=None)
@given(cfg=configs, lengths=st.lists(st.integers(1, 9), min_size=1, max_size=3), new=st.integers(2, 12))
def test_static_step_decodes_the_eager_tokens(cfg, lengths, new, device):
    model = model_of(**cfg).to(device)
    g = torch.Generator().manual_seed(cfg["seed"])
    prompts = [torch.randint(0, 97, (n,), generator=g).tolist() for n in lengths]  # unequal: left-padded rows
    with torch.inference_mode():
        assert tokens(model, prompts, new, True) == tokens(model, prompts, new, False)


@settings(max_examples=8, deadline=None)
@given(cfg=configs, context=st.integers(1, 40), T=st.sampled_from([1, 3, 8]))
def test_static_step_of_t_tokens_gives_the_eager_logits(cfg, context, T, device):
    model = model_of(**cfg).to(device)
    x = torch.randint(0, 97, (1, context), device=device)
    new = torch.randint(0, 97, (1, T), device=device)
    pos = torch.arange(context, context + T, device=device)[None]
    with torch.inference_mode():
        eager, static = model.new_cache(1, 64), model.new_cache(1, 64)
        model(x, cache=eager)
        model(x, cache=static)
        want = model(new, pos=pos, cache=eager).logits  # (1, T, V)
        step = StepGraph(model, static, capture=device.type == "cuda", tokens=T)
        mask = torch.ones(1, T, 64, dtype=torch.bool, device=device).tril(context)  # query i sees slots 0 .. context + i
        got = step(new, pos, mask)
        step.close()
    got = got if T > 1 else got[:, None]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert static.length == eager.length == context + T and static.slot is None
    torch.testing.assert_close(static.k[:, :, :, :context + T], eager.k[:, :, :, :context + T])


def test_what_cannot_be_captured_decodes_eagerly():
    base = dict(dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=48, vocab_size=97, max_seq_len=64)
    assert not graphable(Transformer(ModelConfig(**base)))  # on the CPU: nothing to capture
    sliding = Transformer(ModelConfig(**base, layer_types=["sliding", "full"], sliding_window=4))
    moe = Transformer(ModelConfig(**base, moe=MoEConfig(n_experts=4, top_k=2, ffn_dim=16, n_group=1, topk_group=1)))
    for model in (sliding, moe):
        assert not graphable(model)
    cache = sliding.new_cache(1, 16)
    step = StepGraph(sliding, cache, capture=False)
    with pytest.raises(DlmError, match="sliding-window"):
        step(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), torch.ones(1, 16, dtype=torch.bool))


def test_a_step_that_cannot_be_captured_decodes_eagerly_with_a_warning(monkeypatch):
    import dlm.sampling.graphs as graphs

    model = model_of(seed=3, heads=2, kv=1, head_dim=8, qk_norm=True, bias=False, tie=True)
    prompts = [[5, 6, 7], [8, 9]]
    with torch.inference_mode():
        want = tokens(model, prompts, 6, False)

        def refuse(*a, **kw):
            raise RuntimeError("operation not permitted when stream is capturing")

        monkeypatch.setattr(graphs, "graphable", lambda m: True)  # as on a GPU
        monkeypatch.setattr(graphs.StepGraph, "__init__", refuse)
        with pytest.warns(UserWarning, match="without CUDA graphs"):
            assert tokens(model, prompts, 6, None) == want
        with pytest.raises(RuntimeError, match="capturing"):  # asked for by name: the error, not a fallback
            tokens(model, prompts, 6, True)
