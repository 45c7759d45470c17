"""LLaDA 2 (LLaDA2.0-mini 16B-A1.4B, LLaDA2.0-flash 100B-A6.1B: BailingMoeV2, remote code modeling_llada2_moe.py)
imported into dlm's mdlm paradigm and exported back.

transformers 5.24 has no LLaDA 2 / BailingMoeV2 class, but it has GLM 4 MoE, whose layers compute what
modeling_llada2_moe.py's do (read side by side):

- RMSNorm: fp32 normalisation, weight x normed cast back (LLaDA2MoeRMSNorm = Glm4MoeRMSNorm);
- attention: q/k/v projections (LLaDA 2 fuses them into `query_key_value`, viewed as heads [q ; k ; v]), an RMSNorm
  per head on q and k before RoPE (`query_layernorm` / `key_layernorm` = q_norm / k_norm), partial rotary: the
  first head_dim x partial_rotary_factor dimensions turned by rotate_half with frequencies over that many, scale
  head_dim^-0.5, output projection without bias (`dense`, use_bias false = o_proj);
- the feed-forward: the dense SwiGLU MLP in the first `first_k_dense_replace` layers, then the MoE block:
  fp32 router logits, sigmoid scores, the choice on scores + expert_bias (= e_score_correction_bias) limited to
  the topk_group groups whose two best scores sum highest, top num_experts_per_tok, weights = the unbiased scores
  of the chosen, over their sum + 1e-20 (LLaDA 2: when top_k > 1; GLM: norm_topk_prob, true here as in LLaDA 2's
  configs), x routed_scaling_factor; SwiGLU experts; plus the shared experts (moe_intermediate_size x
  num_shared_experts) on every token;
- the decoder layer (pre-norm residuals), final norm, untied head.

So the reference is transformers' Glm4MoeForCausalLM, built tiny with random weights; the test writes its weights
in LLaDA 2's public layout (names and fusions from modeling_llada2_moe.py) and holds dlm's import to it: the causal
path (its own mask), the block-causal path of LLaDA 2's generate (its block_diffusion_attention_mask given as a 4D
mask), and the decoding recipe (a loop written here from LLaDA2MoeModelLM.generate). Each test says which behaviour
of the public code it covers.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dlm.checkpoint import load_model
from dlm.config import MoEConfig
from dlm.errors import DlmError
from dlm.hf import export_hf, import_hf
from dlm.sampling import SampleConfig
from dlm.sampling.common import Prompt
from dlm.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

# (block_causal: LLaDA 2 generate's block_diffusion_attention_mask is the same tril over blocks as SDAR's)
from hfbuild import llada2_tensors  # noqa: E402
from test_hf_mdlm import assert_import_refuses, assert_rows_equal_each_row_alone, block_causal, generate_ids, tokens  # noqa: E402
pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-6  # float64
E, TOPK, GROUPS, TOPK_GROUP, I, SHARED, SCALE = 8, 3, 4, 2, 24, 1, 2.5


@pytest.fixture(scope="module")
def tok(tokenizer_path):
    return Tokenizer.from_file(tokenizer_path)


def reference_model(tok: Tokenizer):
    """transformers' Glm4MoeForCausalLM with LLaDA 2's switches: 3 layers (the first dense), 8 experts in 4 groups
    (top 3 from the best 2 groups), one shared expert, partial rotary 0.5, q/k-norm; random weights with a non-zero
    expert bias, peaked distributions, and <eos> / <mask> never the most likely token."""
    cfg = transformers.Glm4MoeConfig(
        vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, moe_intermediate_size=I, num_experts_per_tok=TOPK, n_shared_experts=SHARED,
        n_routed_experts=E, routed_scaling_factor=SCALE, n_group=GROUPS, topk_group=TOPK_GROUP,
        first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=True, attention_bias=False,
        max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False, attn_implementation="sdpa",
        experts_implementation="eager",  # (its grouped_mm kernel takes no float64)
        rope_parameters={"rope_theta": 600000.0, "rope_type": "default", "partial_rotary_factor": 0.5})
    torch.manual_seed(0)
    m = transformers.Glm4MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 1.5 if n == "lm_head.weight" else 0.5 if n.endswith("gate.weight") else 0.2)
        for layer in m.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3)
        for t in (tok.eos_id, tok.mask_id):
            m.lm_head.weight[t] = 0.0
    return m


def config_json(tok: Tokenizer) -> dict:
    """LLaDA2.0-mini's config.json keys (configuration_llada2_moe.py), tiny."""
    return {
        "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "attention_dropout": 0.0,
        "auto_map": {"AutoConfig": "configuration_llada2_moe.LLaDA2MoeConfig",
                     "AutoModel": "modeling_llada2_moe.LLaDA2MoeModel",
                     "AutoModelForCausalLM": "modeling_llada2_moe.LLaDA2MoeModelLM"},
        "num_hidden_layers": 3, "hidden_size": 64, "intermediate_size": 96, "first_k_dense_replace": 1,
        "hidden_act": "silu", "max_position_embeddings": 256, "moe_intermediate_size": I, "norm_topk_prob": True,
        "num_experts_per_tok": TOPK, "norm_head": False, "num_attention_heads": 4, "num_experts": E,
        "num_key_value_heads": 2, "rope_theta": 600000, "rope_scaling": None, "tie_word_embeddings": False,
        "torch_dtype": "float32", "use_bias": False, "use_rmsnorm": True, "rms_norm_eps": 1e-06, "head_dim": 16,
        "num_shared_experts": SHARED, "use_cache": False, "use_qkv_bias": False, "embedding_dropout": 0.0,
        "output_dropout": 0.0, "vocab_size": tok.vocab_size, "rotary_dim": 8, "router_dtype": "fp32",
        "moe_router_enable_expert_bias": True, "routed_scaling_factor": SCALE, "n_group": GROUPS,
        "topk_group": TOPK_GROUP, "score_function": "sigmoid", "initializer_range": 0.02, "output_router_logits": False,
        "pad_token_id": tok.pad_id, "eos_token_id": tok.eos_id, "mask_token_id": tok.mask_id,
        "partial_rotary_factor": 0.5, "use_sliding_window": False}


def public_folder(tok: Tokenizer, folder, ref) -> dict:
    folder.mkdir(parents=True)
    save_file(llada2_tensors(ref), str(folder / "model.safetensors"), metadata={"format": "pt"})
    hf = config_json(tok)
    (folder / "config.json").write_text(json.dumps(hf, indent=2))
    shutil.copyfile(tok.source, folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(tok.hf_config()))
    for f in ("configuration_llada2_moe.py", "modeling_llada2_moe.py"):
        (folder / f).write_text("# remote code of the folder (kept as it is)\n")
    return hf


@pytest.fixture(scope="module")
def imported(tok, tmp_path_factory):
    """(transformers reference in float64, public folder, its config, dlm model in float64, Checkpoint)."""
    tmp = tmp_path_factory.mktemp("llada2")
    ref = reference_model(tok)
    hf = public_folder(tok, tmp / "hf", ref)
    import_hf(tmp / "hf", tmp / "dlm")
    model, ck = load_model(tmp / "dlm", dtype=torch.float64)
    return ref.double(), tmp / "hf", hf, model, ck


def test_import_records_the_conventions_and_the_backbone(imported, tok):
    """LLaDA 2 is block diffusion over blocks of 32 on a grid from position 0 (its generate), unshifted (the block's
    logits at their own positions), <mask> from the config; its backbone: q/k-norm, partial rotary 0.5, the MoE from
    layer first_k_dense_replace on."""
    _, _, _, model, ck = imported
    c = ck.config
    assert (c["objective"], c["family"], c["block_size"], c["shift"], c["context"], c["preset"], c["mask_id"]) == \
        ("mdlm", "llada2", 32, False, "block", "llada2", tok.mask_id)
    cfg = model.cfg
    assert (cfg.qk_norm, cfg.attn_bias, cfg.partial_rotary, cfg.tie_embeddings) == (True, False, 0.5, False)
    assert cfg.moe == MoEConfig(n_experts=E, top_k=TOPK, ffn_dim=I, router="sigmoid", shared=SHARED, first_dense=1,
                                n_group=GROUPS, topk_group=TOPK_GROUP, scale=SCALE)
    assert model.num_params() == cfg.num_params()
    assert type(model.layers[0].mlp).__name__ == "MLP" and type(model.layers[1].mlp).__name__ == "SparseMoE"


def test_causal_path_matches_the_reference(imported, tok):
    """Fused q/k/v split (heads q, k, v), q/k-norm, partial rotary, GQA, the dense first layer, the router (sigmoid,
    selection bias, group limit, normalised and scaled weights), the experts and the shared expert: dlm's logits
    are the reference's on the same weights."""
    ref, _, _, model, _ = imported
    x = tokens(40, 1, tok.vocab_size)
    with torch.no_grad():
        want = ref(x).logits
        assert (model(x).logits - want).abs().max() <= TOL


def test_the_router_choices_are_exercised(imported, tok):
    """The inputs reach the behaviours the match covers: without the selection bias, or without the group limit,
    the logits change (so both were exercised), and the bias never enters the weights (a bias shift common to
    every expert changes nothing)."""
    _, _, _, model, _ = imported
    x = tokens(40, 1, tok.vocab_size)
    gates = [layer.mlp.gate for layer in model.layers[1:]]
    with torch.no_grad():
        base = model(x).logits
        saved = [g.expert_bias.clone() for g in gates]
        for g in gates:
            g.expert_bias.add_(5.0)  # the same for every expert: the same choices, the same weights
        assert (model(x).logits - base).abs().max() <= TOL
        for g in gates:
            g.expert_bias.zero_()
        assert (model(x).logits - base).abs().max() > 1e-3
        for g, s in zip(gates, saved):
            g.expert_bias.copy_(s)
            g.n_group = g.topk_group = 1
        assert (model(x).logits - base).abs().max() > 1e-3
        for g in gates:
            g.n_group, g.topk_group = GROUPS, TOPK_GROUP
        assert (model(x).logits - base).abs().max() <= TOL


def test_block_causal_path_matches_the_reference(imported, tok):
    """The sampler's view of a block (blocks of 32 on the grid from 0, the prompt's partial block denoised with the
    first new tokens) is the reference's logits under generate's block_diffusion_attention_mask."""
    from dlm.sampling.mdlm import Denoising, make_job

    ref, _, _, model, ck = imported
    P, B = 40, 32
    prompt = tokens(P, 2, tok.vocab_size, (tok.mask_id,))[0].tolist()
    seq = prompt + [tok.mask_id] * (2 * B - P)
    with torch.no_grad():
        want = ref(torch.tensor([seq]), attention_mask=block_causal(2 * B, B)).logits[0, B:2 * B]
        for naive in (True, False):
            job = make_job(Prompt(prompt), SampleConfig(max_new_tokens=2 * B - P, preset="none"), B,
                           model.cfg.max_seq_len, False, False, False)
            state = Denoising(model, job, ck.mask_id, naive, False)
            for bs, be in job.blocks:
                if be <= B and state.hole[bs:be].any():
                    state.logits(bs, be)
            assert (state.logits(B, 2 * B) - want).abs().max() <= TOL


def llada2_reference(ref, prompt: list[int], gen_length: int, block: int, steps: int, threshold: float,
                     mask_id: int) -> list[int]:
    """LLaDA2MoeModelLM.generate (temperature 0): blocks of `block` on the grid from position 0, the sequence up to
    the current block recomputed under the block mask each step; per step the masked positions above `threshold`,
    or if fewer than the step's quota (block spread over steps) the quota's most confident; the <mask> logit set
    to -inf (as dlm does: its head row is zero here, so never chosen either way)."""
    steps = min(steps, gen_length)
    P = len(prompt)
    n_blocks = -(-(P + gen_length) // block)
    x = torch.tensor([prompt + [mask_id] * (n_blocks * block - P)])
    quota = [block // steps + (i < block % steps) for i in range(steps)]
    for b in range(P // block, n_blocks):
        hi = (b + 1) * block
        for k in quota:
            masked = x[0, hi - block:hi] == mask_id
            if not masked.any():
                break
            logits = ref(x[:, :hi], attention_mask=block_causal(hi, block)).logits[0, -block:]
            logits[:, mask_id] = float("-inf")
            p, x0 = torch.softmax(logits, -1).max(-1)
            conf = torch.where(masked, p, float("-inf"))
            high = conf > threshold
            pick = high if int(high.sum()) >= k else \
                torch.zeros_like(high).index_fill_(0, conf.topk(min(k, int(masked.sum()))).indices, True)
            x[0, hi - block:hi] = torch.where(pick, x0, x[0, hi - block:hi])
    return x[0, P:P + gen_length].tolist()


def test_generation_follows_llada2_generate(imported, tok):
    """`dlm generate` on the imported checkpoint runs its recorded preset (blocks of 32, 32 steps a block, threshold
    0.95, whole blocks) and gives the tokens of the reference loop written from LLaDA 2's generate."""
    ref, _, _, model, ck = imported
    prompt = tokens(6, 8, tok.vocab_size, (tok.mask_id, tok.eos_id))[0].tolist()
    n = 40  # two blocks, the second cut at the end (generate's gen_length)
    stats = {}
    ids = generate_ids(model, ck, prompt, SampleConfig(max_new_tokens=n), stats)
    with torch.no_grad():
        want = llada2_reference(ref, prompt, n, 32, 32, 0.95, tok.mask_id)
    cut = want.index(tok.eos_id) + 1 if tok.eos_id in want else len(want)
    assert ids == want[:cut] and len(ids) == n
    assert stats["forwards"] < n  # the threshold commits several tokens in some passes


def test_rows_of_the_imported_model_equal_each_row_alone(imported, tok):
    """Rows of one batch (the server's row batcher, `eval --batch`) share each forward through the experts; each
    row's tokens are the ones it gets alone."""
    _, _, _, model, ck = imported
    done = assert_rows_equal_each_row_alone(model, ck, tok, (6, 35, 4))
    assert done.stats.extra.get("rows_per_forward", 1) > 1


def test_export_round_trip_is_exact(imported, tmp_path):
    """import -> export gives back the public folder: the same config.json, every tensor bit-identical under its
    name (query_key_value fused again, the experts one by one), the remote code; reimported, the same checkpoint."""
    _, folder, hf, _, ck = imported
    model, ck = load_model(ck.path, dtype=None)
    export_hf(model, ck.tokenizer, tmp_path / "out", dtype=torch.float32, inputs=(ck.path,))
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == hf
    a, b = load_file(folder / "model.safetensors"), load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert (tmp_path / "out" / "modeling_llada2_moe.py").is_file()
    import_hf(tmp_path / "out", tmp_path / "again")
    again, ck2 = load_model(tmp_path / "again", dtype=None)
    for k in ("block_size", "shift", "context", "mask_id", "preset", "family", "hf_config", "model"):
        assert ck2.config[k] == ck.config[k]
    sa, sb = model.state_dict(), again.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_export_without_the_source_config_writes_the_layout_keys(imported, tmp_path):
    """A checkpoint that no longer holds the imported config.json exports one written from its backbone (LLaDA 2's
    keys: the switches, partial_rotary_factor, the MoE sizes) that imports back to the same model."""
    _, _, _, _, ck = imported
    shutil.copytree(ck.path, tmp_path / "ck")
    meta = json.loads((tmp_path / "ck" / "config.json").read_text())
    (tmp_path / "ck" / "config.json").write_text(json.dumps({**meta, "hf_config": {}}))
    model, ck2 = load_model(tmp_path / "ck", dtype=None)
    export_hf(model, ck2.tokenizer, tmp_path / "out", inputs=(ck2.path,))
    hf = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (hf["model_type"], hf["partial_rotary_factor"], hf["num_experts"], hf["first_k_dense_replace"],
            hf["use_bias"], hf["mask_token_id"]) == ("llada2_moe", 0.5, E, 1, False, ck.mask_id)
    import_hf(tmp_path / "out", tmp_path / "again")
    again, _ = load_model(tmp_path / "again", dtype=None)
    assert again.cfg == model.cfg
    sa, sb = model.state_dict(), again.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


def test_cli_import_generate_eval_export(imported, tmp_path, capsys):
    """The commands of docs/public-models.md on the tiny folder: import, generate (its preset), eval (the likelihood
    bound over blocks of 32; the execution-based code task), export to the same folder."""
    from dlm.cli import main
    from test_code_task import HUMANEVAL

    _, folder, hf, _, _ = imported
    assert main(["import", "--hf", str(folder), "--out", str(tmp_path / "ck")]) == 0
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path / "ck"), "--prompt", "def f(x):", "--max-new-tokens", "8",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["new_tokens"] >= 1 and out["forwards"] >= 1
    data = tmp_path / "docs"
    data.mkdir()
    for i in range(12):
        (data / f"{i}.txt").write_text("def f(x):\n    return x + %d\n" % i * 4)
    assert main(["eval", "--model", str(tmp_path / "ck"), "--data", str(data), "--split", "test", "--seq-len", "64",
                 "--samples", "2", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["tokens"] > 0 and res["loss_bound"] > 0 and res["samples"] == 2
    he = tmp_path / "he.jsonl"
    he.write_text("".join(json.dumps(p) + "\n" for p in HUMANEVAL))
    assert main(["eval", "--model", str(tmp_path / "ck"), "--task", "code", "--data", str(he), "--max-new-tokens", "8",
                 "--json", "--allow-code-execution"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["problems"] == 2 and 0.0 <= res["pass_at_1"] <= 1.0 and res["forwards"] > 0
    assert main(["export", "--model", str(tmp_path / "ck"), "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == hf


def test_lm_eval_adapter_reads_the_block_view(imported, tok):
    """The lm-eval adapter on the imported checkpoint: a one-token continuation's ELBO is exact, log p(token | the
    context, <mask>) with the <mask> logit excluded, read at the token's own position under LLaDA 2's block mask
    (here the reference's logits); a longer one is a seeded Monte-Carlo bound below zero."""
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance

    from dlm.lmeval import DlmLM

    ref, _, _, _, ck = imported
    lm = DlmLM(path=str(ck.path), samples=4)
    ctx = tokens(37, 3, tok.vocab_size, (tok.mask_id,))[0].tolist()  # the token in the second block of 32
    ll, _ = lm._score(ctx, [11])
    with torch.no_grad():
        logits = ref(torch.tensor([ctx + [tok.mask_id]]), attention_mask=block_causal(38, 32)).logits[0, -1]
    logits[tok.mask_id] = float("-inf")
    assert ll == pytest.approx(float(torch.log_softmax(logits, -1)[11]), abs=1e-4)
    (a, _), = lm.loglikelihood([Instance("loglikelihood", {}, ("def f(x):", " return x + 1"), 0)])
    assert a < 0


@pytest.mark.parametrize("change,msg", [
    ({"use_bias": True}, "use_bias"),
    ({"norm_head": True}, "norm_head"),
    ({"score_function": "softmax"}, "score_function"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"use_qk_norm": False}, "use_qk_norm"),
    ({"rotary_dim": 16}, "rotary_dim"),
    ({"n_group": 3}, "n_group"),
    ({"num_experts": 16}, "missing"),
    ({"mask_token_id": 10 ** 7}, "mask_token_id"),
])
def test_import_refuses_folders_that_do_not_fit(imported, change, msg, tmp_path):
    _, folder, hf, _, _ = imported
    assert_import_refuses(folder, hf, change, msg, tmp_path)


def test_a_stray_expert_tensor_is_refused(imported, tmp_path):
    _, folder, _, _, _ = imported
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    t = load_file(bad / "model.safetensors")
    t["model.layers.1.mlp.experts.8.gate_proj.weight"] = t["model.layers.1.mlp.experts.0.gate_proj.weight"].clone()
    save_file(t, str(bad / "model.safetensors"))
    with pytest.raises(DlmError, match="unexpected tensor 'model.layers.1.mlp.experts.8"):
        import_hf(bad, tmp_path / "out")


# LLaDA2.0-mini's and -flash's config.json (inclusionAI's configs: the keys that set the sizes)
MINI = {"num_hidden_layers": 20, "hidden_size": 2048, "intermediate_size": 5120, "moe_intermediate_size": 512,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 128}
FLASH = {"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 9216, "moe_intermediate_size": 1024,
         "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128}
COMMON = {"architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "first_k_dense_replace": 1,
          "hidden_act": "silu", "max_position_embeddings": 16384, "norm_topk_prob": True, "num_experts_per_tok": 8,
          "norm_head": False, "num_experts": 256, "rope_theta": 600000, "rope_scaling": None,
          "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_bias": False, "rms_norm_eps": 1e-06,
          "num_shared_experts": 1, "use_qkv_bias": False, "vocab_size": 157184, "rotary_dim": 64,
          "moe_router_enable_expert_bias": True, "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4,
          "score_function": "sigmoid", "pad_token_id": 156892, "partial_rotary_factor": 0.5,
          "use_sliding_window": False}


@pytest.mark.parametrize("sizes,total,active", [(MINI, 16e9, 1.4e9), (FLASH, 100e9, 6.1e9)])
def test_published_configs_map_to_their_sizes(sizes, total, active, tmp_path):
    """The released configs describe 16B-A1.4B (mini) and 100B-A6.1B (flash) models: the count of the imported config
    equals the count written here from the layer shapes, and the active count (8 of 256 experts) is the published
    one to the model card's rounding."""
    from dlm.hf_mdlm import conventions, model_config

    hf = {**COMMON, **sizes}
    cfg = model_config(hf, tmp_path / "config.json")
    L, D, F, Im, H, KV, hd = (sizes[k] for k in ("num_hidden_layers", "hidden_size", "intermediate_size",
                                                 "moe_intermediate_size", "num_attention_heads", "num_key_value_heads",
                                                 "head_dim"))
    V = 157184
    attn = D * (H + 2 * KV) * hd + H * hd * D + 2 * hd + 2 * D  # qkv, dense, q/k-norm, the two layer norms
    moe = 256 * 3 * D * Im + 256 * D + 3 * D * Im  # experts, router, shared expert
    want = 2 * V * D + D + L * attn + 3 * D * F + (L - 1) * moe
    assert cfg.num_params() == want
    assert abs(cfg.num_params() - total) / total < 0.03  # 16.26 B, 102.9 B
    act = want - (L - 1) * (256 - 8) * 3 * D * Im
    assert abs(act - active) / active < 0.03  # 1.44 B, 6.15 B
    c = conventions(hf, cfg, tmp_path / "config.json")
    assert (c["family"], c["block_size"], c["mask_id"], c["shift"], c["context"]) == ("llada2", 32, 156895, False,
                                                                                        "block")


def test_fine_tuning_keeps_the_frozen_router(imported, tmp_path, capsys):
    """`dlm train --init-from` an imported LLaDA 2 with --freeze-router: the experts and the rest learn, the routers
    (weights and selection bias) keep theirs. Without it the router weights learn and expert_bias still stays as
    imported: a buffer, as LLaDA 2's own fine-tuning code keeps it (inclusionAI/dFactory registers it as a buffer
    and updates it nowhere). The fine-tuned checkpoint exports in LLaDA 2's layout (its config.json, the remote code
    beside it, expert_bias unchanged), and imports back to the same logits."""
    from dlm.cli import main

    _, _, hf, _, ck = imported
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(16):
        (docs / f"{i}.txt").write_text("def f(x):\n    return x + %d\n" % i * 8)
    common = ["--data", str(docs), "--seq-len", "64", "--block-size", "32", "--batch-size", "2", "--max-steps", "2",
              "--eval-every", "2", "--eval-batches", "1", "--quiet"]
    assert main(["train", "--objective", "mdlm", "--init-from", str(ck.path), *common, "--freeze-router",
                 "--out", str(tmp_path / "ft")]) == 0
    assert main(["train", "--objective", "mdlm", "--init-from", str(ck.path), *common, "--out", str(tmp_path / "ft2")]) == 0
    a = load_file(ck.path / "model.safetensors")
    for ft, router_learns in (("ft", False), ("ft2", True)):
        b = load_file(tmp_path / ft / "model.safetensors")
        changed = {k for k in a if not torch.equal(a[k], b[k])}
        assert any(".experts." in k for k in changed)
        assert any(k.endswith(".mlp.gate.weight") for k in changed) == router_learns
        assert not any(k.endswith("expert_bias") for k in changed)
    capsys.readouterr()
    assert main(["export", "--model", str(tmp_path / "ft2"), "--out", str(tmp_path / "hf")]) == 0
    out = tmp_path / "hf"
    assert json.loads((out / "config.json").read_text()) == hf  # (the backbone's shape is the import's)
    assert all((out / f).is_file() for f in ("configuration_llada2_moe.py", "modeling_llada2_moe.py"))
    src, got = load_file(ck.path.parent / "hf" / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(got) == set(src)
    assert all(torch.equal(got[k], src[k]) for k in src if k.endswith("expert_bias"))
    assert not all(torch.equal(got[k], src[k]) for k in src)
    model, _ = load_model(tmp_path / "ft2", dtype=torch.float32)
    back, _ = load_model(import_hf(out, tmp_path / "back"), dtype=torch.float32)
    ids = torch.arange(5, 21)[None]
    with torch.no_grad():
        assert torch.equal(model(ids, pos=torch.arange(16), mask="full").logits,
                           back(ids, pos=torch.arange(16), mask="full").logits)


def test_a_fine_tuned_model_read_another_way_keeps_no_family_layout():
    """Fine-tuning trains dlm's convention (block-causal, unshifted): SDAR and LLaDA 2 are read that way and export
    in their layout again; Dream, Fast-dLLM v2 (shifted) and LLaDA (full attention) do not."""
    from dlm.hf_mdlm import finetuned_meta

    meta = {"objective": "mdlm", "mask_id": 3, "block_size": 32}
    assert finetuned_meta({**meta, "hf_config": {"model_type": "llada2_moe"}})["family"] == "llada2"
    assert finetuned_meta({**meta, "hf_config": {"model_type": "sdar"}})["family"] == "sdar"
    for mt in ("Dream", "Fast_dLLM_Qwen", "llada", "qwen3"):
        assert finetuned_meta({**meta, "hf_config": {"model_type": mt}}) is None
    assert finetuned_meta({**meta, "objective": "ar", "hf_config": {"model_type": "llada2_moe"}}) is None


@pytest.mark.parametrize("change,msg", [
    ({"partial_rotary": 0.01}, "partial_rotary"), ({"partial_rotary": 1.5}, "partial_rotary"),
    ({"moe": {"n_experts": 8}}, "model.moe must be null or"),
    ({"moe": {**{"n_experts": 8, "top_k": 2, "ffn_dim": 16, "shared": 0, "first_dense": 0, "n_group": 4,
                 "topk_group": 1, "scale": 1.0}, "top_k": 5}}, "top_k"),
    ({"moe": {"n_experts": 8, "top_k": 2, "ffn_dim": 16, "shared": 0, "first_dense": 3, "n_group": 4,
              "topk_group": 1, "scale": 1.0}}, "first_dense"),
    ({"moe": {"n_experts": 8, "top_k": 2, "ffn_dim": 16, "shared": 0, "first_dense": 0, "n_group": 4,
              "topk_group": 1, "scale": "2"}}, "scale"),
])
def test_bad_backbone_switches_are_one_line(change, msg):
    from dlm.config import ModelConfig

    with pytest.raises(DlmError, match=msg) as e:
        ModelConfig(dim=64, n_heads=4, n_kv_heads=2, n_layers=2, **change)
    assert "\n" not in str(e.value)
