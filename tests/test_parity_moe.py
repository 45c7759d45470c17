"""dlm against transformers on the mixture-of-experts families, on configurations nobody here chose.

Qwen3-MoE (a row of dlm.families: Qwen3's layers, the topk router's experts stacked from the folder's one-by-one
tensors): hypothesis draws a tiny Qwen3MoeConfig (experts, top-k, norm_topk_prob, decoder_sparse_step and
mlp_only_layers mixing dense and sparse layers, KV heads, head dims, RoPE, tied or untied head), a byte-level BPE
tokenizer with its specials at any ids and a post-processor, EOS id lists with a token the model writes (so an
<eos> ends the generation) and a prompt. transformers builds Qwen3MoeForCausalLM (random weights, seeded) and
saves it as a hub folder; dlm imports it as `dlm import --hf` does and holds to transformers: the prompt's ids, the
logits (fp32), the greedy tokens of `generate` and their text; then dlm's export loads in transformers as
Qwen3MoeForCausalLM with the same logits, and imports back to the same tensors.

LLaDA 2 (BailingMoeV2) through transformers' Glm4MoeForCausalLM, whose layers compute what modeling_llada2_moe.py's
do (tests/test_hf_llada2.py reads the two side by side): hypothesis draws the experts, groups, top-k, shared
experts, first dense layers, partial rotary, KV heads and head dims (top-k of 2 or more: the one place the two
differ is a single chosen expert, whose raw score LLaDA 2 keeps and GLM normalises to 1); the weights are written
in LLaDA 2's public layout (fused query_key_value, experts one by one); dlm's logits are the reference's, and the
export gives back every tensor bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from dlm.checkpoint import load_model  # noqa: E402
from dlm.hf import export_hf, import_hf  # noqa: E402
from dlm.sampling import SampleConfig, encode, generate  # noqa: E402
from hfbuild import (  # noqa: E402
    POSTS, SPECIALS, assert_same_greedy, bpe_tokenizer, hf_greedy, llada2_tensors, randomize, save_folder,
)

pytestmark = pytest.mark.usefixtures("one_thread")
transformers.utils.logging.disable_progress_bar()
SETTINGS = settings(max_examples=5, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])
EAGER = "eager"  # transformers' loop over experts (its grouped_mm kernel wants 16-byte strides, tiny shapes lack them)
PROMPT_CHARS = st.characters(codec="utf-8", exclude_characters="<")


def free_greedy(m, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        x = torch.tensor([ids])
        for _ in range(n):
            x = torch.cat([x, m(x).logits[:, -1:].argmax(-1)], 1)
    return x[0, len(ids):].tolist()


# Qwen3-MoE --------------------------------------------------------------------------------------------------------

@st.composite
def qwen3_moe_cases(draw) -> dict:
    kv = draw(st.integers(1, 3))
    heads = kv * draw(st.integers(1, 2))
    layers = draw(st.integers(1, 4))
    experts = draw(st.integers(2, 6))
    vocab = draw(st.integers(300, 600))
    ids = draw(st.lists(st.integers(0, vocab - 1), min_size=len(SPECIALS), max_size=len(SPECIALS), unique=True))
    theta = draw(st.sampled_from([100.0, 1e4, 1e6]))
    return dict(
        config=dict(vocab_size=vocab, hidden_size=heads * draw(st.sampled_from([8, 16])),
                    intermediate_size=draw(st.integers(16, 64)), moe_intermediate_size=draw(st.integers(8, 32)),
                    num_hidden_layers=layers, num_key_value_heads=kv, num_attention_heads=heads,
                    head_dim=draw(st.sampled_from([8, 16])), num_experts=experts,
                    num_experts_per_tok=draw(st.integers(1, min(experts, 3))), norm_topk_prob=draw(st.booleans()),
                    decoder_sparse_step=draw(st.integers(1, 2)),
                    mlp_only_layers=draw(st.lists(st.integers(0, layers - 1), max_size=2, unique=True)),
                    rms_norm_eps=draw(st.sampled_from([1e-6, 1e-5])), tie_word_embeddings=draw(st.booleans()),
                    max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": theta}),
        specials=dict(zip(SPECIALS, ids)), post=draw(st.sampled_from(POSTS)),
        eos_tok=draw(st.booleans()), eos_at=draw(st.lists(st.integers(0, 9), max_size=2)),
        prompt=draw(st.text(PROMPT_CHARS, min_size=1, max_size=30)),
        new=draw(st.integers(1, 10)), seed=draw(st.integers(0, 2**16)), std=draw(st.sampled_from([0.1, 0.3])),
    )


def build_qwen3_moe(case: dict, folder):
    sp = case["specials"]
    c = transformers.Qwen3MoeConfig(**case["config"], bos_token_id=sp["<bos>"], eos_token_id=sp["<eos>"],
                                    pad_token_id=sp["<pad>"], experts_implementation="eager")
    torch.manual_seed(case["seed"])
    m = transformers.Qwen3MoeForCausalLM(c).eval()
    randomize(m, case["seed"], case["std"])
    tk = bpe_tokenizer(c.vocab_size, sp, case["post"])
    written = free_greedy(m, tk.encode(case["prompt"]).ids, 10)
    eos = ([sp["<eos>"]] if case["eos_tok"] else []) + [written[i] for i in case["eos_at"]]
    eos = list(dict.fromkeys(eos)) or [sp["<eos>"]]
    return save_folder(folder, m, tk, eos), eos


def check_qwen3_moe(case: dict, tmp) -> None:
    src, eos = build_qwen3_moe(case, tmp / "hf")
    import_hf(src, tmp / "ck", overwrite=True)
    net, ck = load_model(str(tmp / "ck"))
    tok = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, experts_implementation=EAGER).eval()
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and list(ck.tokenizer.eos_ids) == eos
    cfg = case["config"]
    sparse = [i for i in range(cfg["num_hidden_layers"])
              if i not in cfg["mlp_only_layers"] and (i + 1) % cfg["decoder_sparse_step"] == 0]
    assert [type(b.mlp).__name__ == "SparseMoE" for b in net.layers] == \
        [i in sparse for i in range(cfg["num_hidden_layers"])]
    p = case["prompt"]
    ids = tok(p)["input_ids"]
    sc = SampleConfig(max_new_tokens=case["new"])
    assert ck.tokenizer.encode(p) == ids and encode(ck, p, sc)[0].ids == ids
    x = torch.tensor([ids])
    with torch.no_grad():
        ref = model(x).logits
        torch.testing.assert_close(net(x).logits, ref, atol=2e-5, rtol=1e-5)
    theirs = hf_greedy(model, ids, case["new"])
    res = generate(net, ck, p, sc)
    assert_same_greedy(model, ids, res.tokens[0], theirs)
    if res.tokens[0] == theirs:
        cut = theirs[:-1] if theirs and theirs[-1] in eos else theirs
        assert res.text == tok.decode(cut, skip_special_tokens=True)
    export_hf(net, ck.tokenizer, tmp / "out", inputs=(tmp / "ck",), overwrite=True)
    back = AutoModelForCausalLM.from_pretrained(tmp / "out", experts_implementation=EAGER).eval()
    assert type(back) is type(model)
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, ref, atol=2e-5, rtol=1e-5)
    a, b = load_file(src / "model.safetensors"), load_file(tmp / "out" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)  # the experts one by one again
    import_hf(tmp / "out", tmp / "again", overwrite=True)
    a, b = load_file(tmp / "ck" / "model.safetensors"), load_file(tmp / "again" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@SETTINGS
@given(case=qwen3_moe_cases())
def test_qwen3_moe(case, tmp_path_factory):
    check_qwen3_moe(case, tmp_path_factory.mktemp("qwen3_moe"))


def test_qwen3_moe_named(tmp_path):
    """A fixed case: 4 layers, dense where decoder_sparse_step 2 skips (0, 2) and by mlp_only_layers (3), top-2 of 4
    unnormalised, the specials away from the front, the <eos> and a token the model writes as EOS ids."""
    case = dict(config=dict(vocab_size=400, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                            num_hidden_layers=4, num_key_value_heads=2, num_attention_heads=4, head_dim=8,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=2,
                            mlp_only_layers=[3], rms_norm_eps=1e-6, tie_word_embeddings=False,
                            max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
                specials={"<pad>": 7, "<bos>": 0, "<eos>": 399, "<unk>": 100}, post="bos", eos_tok=True, eos_at=[5],
                prompt="def main(argv): the quick brown fox", new=10, seed=0, std=0.3)
    check_qwen3_moe(case, tmp_path)
    net, ck = load_model(str(tmp_path / "ck"))
    assert net.cfg.moe.dense_layers == [0, 2, 3] and net.cfg.moe.router == "topk" and not net.cfg.moe.norm_topk
    assert ck.objective == "ar" and net.num_params() == net.cfg.num_params()


# Glm4Moe as LLaDA 2 ------------------------------------------------------------------------------------------------

@st.composite
def llada2_cases(draw) -> dict:
    kv = draw(st.integers(1, 2))
    heads = kv * draw(st.integers(1, 3))
    groups = draw(st.sampled_from([1, 2, 4]))
    experts = groups * draw(st.integers(2, 3))
    topk_group = draw(st.integers(1, groups))
    layers = draw(st.integers(1, 3))
    hd = draw(st.sampled_from([8, 16]))
    return dict(vocab=draw(st.integers(300, 500)), hidden=heads * draw(st.sampled_from([8, 16])), heads=heads, kv=kv,
                head_dim=hd, layers=layers, first_dense=draw(st.integers(0, layers)), experts=experts,
                groups=groups, topk_group=topk_group,
                # (top_k 2 or more: with one expert LLaDA 2 keeps its raw sigmoid score where GLM normalises it to 1)
                top_k=draw(st.integers(2, min(experts, topk_group * experts // groups, 4))),
                shared=draw(st.integers(0, 2)), moe_ffn=draw(st.integers(8, 24)), ffn=draw(st.integers(16, 48)),
                rotary=draw(st.sampled_from([0.25, 0.5, 1.0])), scale=draw(st.sampled_from([1.0, 2.5])),
                theta=draw(st.sampled_from([1e4, 6e5])), mask=draw(st.integers(0, 299)),
                seed=draw(st.integers(0, 2**16)), length=draw(st.integers(1, 24)))


def glm4_moe(case: dict):
    cfg = transformers.Glm4MoeConfig(
        vocab_size=case["vocab"], hidden_size=case["hidden"], intermediate_size=case["ffn"],
        num_hidden_layers=case["layers"], num_attention_heads=case["heads"], num_key_value_heads=case["kv"],
        head_dim=case["head_dim"], moe_intermediate_size=case["moe_ffn"], num_experts_per_tok=case["top_k"],
        n_shared_experts=case["shared"], n_routed_experts=case["experts"], routed_scaling_factor=case["scale"],
        n_group=case["groups"], topk_group=case["topk_group"], first_k_dense_replace=case["first_dense"],
        norm_topk_prob=True, use_qk_norm=True, attention_bias=False, max_position_embeddings=256, rms_norm_eps=1e-6,
        tie_word_embeddings=False, attn_implementation="sdpa", experts_implementation="eager",
        rope_parameters={"rope_theta": case["theta"], "rope_type": "default",
                         "partial_rotary_factor": case["rotary"]})
    torch.manual_seed(case["seed"])
    m = transformers.Glm4MoeForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(case["seed"])
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g) if "norm" in n
                    else torch.randn(p.shape, generator=g) * (0.5 if n.endswith("gate.weight") else 0.2))
        for layer in m.model.layers[case["first_dense"]:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(case["experts"], generator=g) * 0.3)
    return m


def llada2_folder(case: dict, ref, folder) -> dict:
    """The reference's weights under modeling_llada2_moe.py's names, its config.json keys, a tokenizer."""
    I = case["moe_ffn"]
    folder.mkdir(parents=True)
    save_file(llada2_tensors(ref), str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf = {"architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "num_hidden_layers": case["layers"],
          "hidden_size": case["hidden"], "intermediate_size": case["ffn"], "first_k_dense_replace": case["first_dense"],
          "hidden_act": "silu", "max_position_embeddings": 256, "moe_intermediate_size": I, "norm_topk_prob": True,
          "num_experts_per_tok": case["top_k"], "norm_head": False, "num_attention_heads": case["heads"],
          "num_experts": case["experts"], "num_key_value_heads": case["kv"], "rope_theta": case["theta"],
          "rope_scaling": None, "tie_word_embeddings": False, "torch_dtype": "float32", "use_bias": False,
          "rms_norm_eps": 1e-06, "head_dim": case["head_dim"], "num_shared_experts": case["shared"],
          "use_qkv_bias": False, "vocab_size": case["vocab"], "rotary_dim": int(case["head_dim"] * case["rotary"]),
          "moe_router_enable_expert_bias": True, "routed_scaling_factor": case["scale"], "n_group": case["groups"],
          "topk_group": case["topk_group"], "score_function": "sigmoid", "mask_token_id": case["mask"],
          "partial_rotary_factor": case["rotary"], "use_sliding_window": False}
    (folder / "config.json").write_text(json.dumps(hf))
    specials = dict(zip(SPECIALS, range(300, 304)))
    bpe_tokenizer(case["vocab"], specials).save(str(folder / "tokenizer.json"))
    return hf


@SETTINGS
@given(case=llada2_cases())
def test_glm4_moe_as_llada2(case, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("llada2")
    ref = glm4_moe(case)
    hf = llada2_folder(case, ref, tmp / "hf")
    import_hf(tmp / "hf", tmp / "ck")
    net, ck = load_model(str(tmp / "ck"))
    assert ck.config["family"] == "llada2" and ck.mask_id == case["mask"]
    x = torch.randint(0, case["vocab"], (2, case["length"]), generator=torch.Generator().manual_seed(case["seed"]))
    with torch.no_grad():
        torch.testing.assert_close(net(x).logits, ref(x).logits, atol=2e-5, rtol=1e-5)
    export_hf(net, ck.tokenizer, tmp / "out", inputs=(ck.path,))
    assert json.loads((tmp / "out" / "config.json").read_text()) == hf
    a, b = load_file(tmp / "hf" / "model.safetensors"), load_file(tmp / "out" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
