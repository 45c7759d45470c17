"""The family table (dlm.families) and the one driver (dlm.hf) on their own: the names maps, a Gemma 4 folder saved
by the multimodal class (its text weights under model.language_model.*, a vision tower left out), and import's
streaming: every tensor is made from the memory-mapped shards only as it is written."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dlm.errors import DlmError
from dlm.families import BY_NAME, EXPERTS, FAMILIES
from dlm.hf import import_hf

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")


def test_names_maps_fill_the_layer_index_and_the_rest():
    llada, qwen, dg = BY_NAME["llada"], BY_NAME["qwen3"], BY_NAME["diffusion-gemma"]
    assert llada.hf_names("layers.12.mlp.down_proj.weight") == ("model.transformer.blocks.12.ff_out.weight",)
    assert qwen.hf_names("layers.3.self_attn.q_norm.weight") == ("model.layers.3.self_attn.q_norm.weight",)
    assert qwen.hf_names("lm_head.weight") == ("lm_head.weight",)
    assert dg.hf_names("self_cond.norm.weight") == ("model.decoder.self_conditioning.pre_norm.weight",)
    assert dg.hf_names("layers.0.layer_scalar") == ("model.decoder.layers.0.layer_scalar",
                                                    "model.encoder.language_model.layers.0.layer_scalar")
    assert llada.hf_names("layers.x.mlp.down_proj.weight") is None  # `{}` is a layer index only
    assert qwen.ignored("model.rotary_emb.inv_freq") and not qwen.ignored("model.norm.weight")


def test_every_row_names_every_tensor_of_a_tiny_config():
    """Each row's names map and transforms say where every tensor of its backbone goes, one name each way."""
    from dlm.config import ModelConfig
    from dlm.model import param_shapes

    moe = {"n_experts": 4, "top_k": 2, "ffn_dim": 8}
    cfgs = {"qwen3_moe": ModelConfig(dim=16, n_heads=2, n_kv_heads=1, n_layers=2, head_dim=8,
                                     moe={**moe, "router": "topk", "dense_layers": [0]}),
            "llada2": ModelConfig(dim=16, n_heads=2, n_kv_heads=1, n_layers=2, head_dim=8, partial_rotary=0.5,
                                  moe={**moe, "shared": 1, "first_dense": 1, "n_group": 2, "topk_group": 1})}
    plain = {"qk_norm": False}
    over = {"llama": plain, "ministral3": plain, "llada": plain, "nemotron-labs-diffusion": plain,
            **{k: {"qk_norm": False, "attn_bias": True} for k in ("qwen2", "dream", "fast-dllm-v2")}}
    for fam in FAMILIES:
        if fam.objective == "dflash" or fam.name.startswith(("gemma4", "diffusion-gemma")):  # ("*" rules)
            continue
        cfg = cfgs.get(fam.name, ModelConfig(dim=16, n_heads=2, n_kv_heads=1, n_layers=2, head_dim=8,
                                             **over.get(fam.name, {})))
        expected, _ = param_shapes(cfg)
        owned = {n for tr in fam.transforms for names, _ in tr.groups(cfg) for n in names}
        named = {n: fam.hf_names(n) for n in expected if n not in owned}
        assert all(named.values()), (fam.name, [n for n, h in named.items() if not h])
        hf = [h for hs in named.values() for h in hs] + [h for tr in fam.transforms for _, hs in tr.groups(cfg)
                                                        for h in hs]
        assert len(hf) == len(set(hf)), fam.name
    assert EXPERTS in BY_NAME["qwen3_moe"].transforms


def test_a_multimodal_gemma4_folder_imports_its_text_weights(tmp_path):
    """model_type gemma4 (Gemma4ForConditionalGeneration's layout): the text config, the text weights under
    model.language_model.*, the other towers left out with a note; the same checkpoint as the text folder's."""
    from test_gemma4 import hf_model
    from test_hf_gemma import save_tokenizer

    _, m = hf_model("moe-kv")
    text = tmp_path / "text"
    m.save_pretrained(text)
    save_tokenizer(text)
    mm = tmp_path / "mm"
    mm.mkdir()
    t = load_file(text / "model.safetensors")
    t = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v for k, v in t.items()}
    t["model.vision_tower.patch.weight"] = torch.ones(2, 2)
    save_file(t, str(mm / "model.safetensors"), metadata={"format": "pt"})
    (mm / "config.json").write_text(json.dumps({"model_type": "gemma4",
                                                "text_config": json.loads((text / "config.json").read_text())}))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (mm / f).write_bytes((text / f).read_bytes())
    import_hf(text, tmp_path / "a")
    import_hf(mm, tmp_path / "b")
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    (mm / "config.json").write_text(json.dumps({"model_type": "gemma4"}))
    with pytest.raises(DlmError, match="gemma4 needs a text_config object"):
        import_hf(mm, tmp_path / "c")


def test_import_makes_each_tensor_as_it_is_written(tmp_path, monkeypatch):
    """The driver hands save_checkpoint lazy tensors (dlm.files.Lazy): none is made before the write starts, and
    each is made once."""
    import dlm.hf
    from test_parity_moe import build_qwen3_moe

    case = dict(config=dict(vocab_size=300, hidden_size=16, intermediate_size=16, moe_intermediate_size=8,
                            num_hidden_layers=2, num_key_value_heads=1, num_attention_heads=2, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                            mlp_only_layers=[], rms_norm_eps=1e-6, tie_word_embeddings=True,
                            max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
                specials={"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3}, post="", eos_tok=True, eos_at=[],
                prompt="a", new=1, seed=0, std=0.1)
    src, _ = build_qwen3_moe(case, tmp_path / "hf")
    made, seen = [], {}
    real = dlm.hf.import_tensors

    def spy(*a):
        tensors, left = real(*a)
        assert not made  # nothing made yet
        for name, lazy in tensors.items():
            seen[name] = lazy
            tensors[name] = lazy._replace(make=lambda n=name, f=lazy.make: made.append(n) or f())
        return tensors, left

    monkeypatch.setattr(dlm.hf, "import_tensors", spy)
    import_hf(src, tmp_path / "ck")
    assert sorted(made) == sorted(seen) and "layers.0.mlp.experts.gate_up_proj" in made
    monkeypatch.setattr(dlm.hf, "import_tensors", real)
    # a NaN in one expert is named, and nothing is left behind
    t = load_file(src / "model.safetensors")
    t["model.layers.1.mlp.experts.3.down_proj.weight"][0, 0] = float("nan")
    save_file(t, str(src / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(DlmError, match="layers.1.mlp.experts.down_proj holds NaN"):
        import_hf(src, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
