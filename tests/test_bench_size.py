"""The synthetic checkpoints of dlm.bench.size (docs/BENCHMARKS.md, "Real size on one machine") hold the layout
transformers itself saves for the families it implements: the same tensor names and shapes as its model classes
built on the meta device from the same config.json (nothing is allocated or written), less the copies its
save_pretrained leaves out (tied weights), with Qwen3-MoE's experts stored one module each as the public checkpoint
stores them (transformers fuses them when it loads). Ministral 3's config is transformers' own defaults."""

from __future__ import annotations

import pytest
import torch

from dlm.bench.size import CONFIGS, config_of, hf_shapes

transformers = pytest.importorskip("transformers")


def meta_shapes(hf: dict, cls) -> dict[str, tuple[int, ...]]:
    cfg = transformers.AutoConfig.for_model(**{k: v for k, v in hf.items() if k != "architectures"})
    with torch.device("meta"):
        model = cls(cfg)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name, layers, cls, saved", [
    ("ministral3-8b", 2, "Ministral3ForCausalLM", lambda k: True),
    ("gemma4-26b-a4b", 6, "Gemma4ForConditionalGeneration", lambda k: k != "lm_head.weight"),  # (tied)
    # DiffusionGemma: the decoder's text stack and self-conditioning; the encoder's text stack and the head are tied
    # to the decoder's (its vision tower is not written)
    ("diffusiongemma-26b-a4b", 6, "DiffusionGemmaForBlockDiffusion",
     lambda k: k.startswith("model.decoder.")),
])
def test_the_synthetic_layout_is_the_one_transformers_saves(name, layers, cls, saved):
    hf = config_of(name, layers)
    ours = hf_shapes(hf)
    theirs = {k: s for k, s in meta_shapes(hf, getattr(transformers, cls)).items() if saved(k)}
    assert ours == theirs


def test_qwen3_moe_experts_are_stored_one_by_one_and_stack_to_transformers_fused_ones():
    hf = config_of("qwen3-30b-a3b", 2)
    ours, theirs = hf_shapes(hf), meta_shapes(hf, transformers.Qwen3MoeForCausalLM)
    assert {k: s for k, s in ours.items() if ".experts." not in k} == \
           {k: s for k, s in theirs.items() if ".experts." not in k}
    E, I, D = hf["num_experts"], hf["moe_intermediate_size"], hf["hidden_size"]
    for i in range(2):
        p = f"model.layers.{i}.mlp.experts."
        assert theirs[p + "gate_up_proj"] == (E, 2 * I, D) and theirs[p + "down_proj"] == (E, D, I)
        assert all(ours[f"{p}{e}.{w}_proj.weight"] == (I, D) for e in range(E) for w in ("gate", "up"))
        assert all(ours[f"{p}{e}.down_proj.weight"] == (D, I) for e in range(E))
    assert sum(".experts." in k for k in ours) == 2 * 3 * E


def test_ministral3_is_transformers_default_config():
    defaults = transformers.Ministral3Config().to_dict()
    for name in ("ministral3-8b", "nemotron-labs-diffusion-8b"):
        hf = CONFIGS[name]
        shape_keys = [k for k in hf if k in defaults and k not in ("architectures", "model_type")]
        assert len(shape_keys) >= 10
        assert {k: hf[k] for k in shape_keys} == {k: defaults[k] for k in shape_keys}
