"""DFlash: target layers, the multi-block mask, drafting = training computation, training, export, bad input."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dlm.checkpoint import load_model
from dlm.config import ModelConfig
from dlm.errors import DlmError
from dlm.masks import dflash_draft_mask, dflash_train_mask
from dlm.model import Transformer
from dlm.drafter import DFlashDrafter, DynamicConv, default_draft_layers, target_layer_ids
from dlm.objectives.dflash import DFlash, gamma_w, slot_weights
from dlm.sampling.common import Commit
from dlm.sampling.speculative import DFlashDraft, Sampling, _taps, speculate, target_greedy
from conftest import assert_greedy_continuation, cli, tiny_train_config


def test_target_layer_ids_follow_the_paper_and_handle_small_targets():
    assert target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert target_layer_ids(48, 5) == [1, 12, 23, 34, 45]
    assert target_layer_ids(36, 1) == [18]
    assert target_layer_ids(4, 4) == [0, 1, 2, 3]  # N - 4 = 0: spread over every layer instead
    assert target_layer_ids(4, 2) == [0, 3]
    assert target_layer_ids(2, 2) == [0, 1]
    assert target_layer_ids(7, 5) == [0, 2, 3, 4, 6]  # N - 4 < L - 1
    assert target_layer_ids(8, 5) == [1, 2, 3, 4, 5]  # N - 4 = L - 1: the formula, all distinct
    with pytest.raises(DlmError, match="too shallow"):
        target_layer_ids(4, 5)
    assert default_draft_layers(36) == 5 and default_draft_layers(4) == 2 and default_draft_layers(12) == 3


def test_slot_weights_decay_and_normalise():
    w = slot_weights(16)
    assert w.shape == (15,) and math.isclose(float(w.sum()), 1.0, rel_tol=1e-6)
    assert math.isclose(float(w[1] / w[0]), math.exp(-1 / 7), rel_tol=1e-6)
    assert gamma_w(16) == 7 and gamma_w(10) == 5 and gamma_w(8) == 4
    assert bool((w[1:] < w[:-1]).all())


def _tiny_target(seed=0, layers=4):
    torch.manual_seed(seed)
    return Transformer(ModelConfig(vocab_size=64, dim=32, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=64,
                                   max_seq_len=128)).double().eval()


def _drafter(target, injection="kv", features=True, layers=2, block=6, conv=0):
    torch.manual_seed(1)
    mc = ModelConfig(**{**target.cfg.to_dict(), "n_layers": layers})
    d = DFlashDrafter(mc, target_layer_ids(target.cfg.n_layers, 3), block, mask_id=3, injection=injection,
                      target_features=features, conv_kernel_size=conv, conv_group_size=8)
    for m in d.modules():  # DFlash 2: convolutions away from the identity, so a leak across blocks would show
        if isinstance(m, DynamicConv):
            torch.nn.init.normal_(m.base_kernel, std=0.5)
            torch.nn.init.normal_(m.kernel_projection.weight, std=0.2)
    return d.double().eval()


@pytest.mark.parametrize("injection,conv", [("kv", 0), ("input", 0), ("kv", 2), ("kv", 3)])
def test_multi_block_training_equals_one_block_at_a_time(injection, conv):
    """Many blocks in one masked forward = each block alone over the context strictly before its anchor; DFlash 2's
    convolutions too (`segment`: nothing reaches a block from the one laid before it)."""
    tgt = _tiny_target()
    d = _drafter(tgt, injection, conv=conv)
    torch.manual_seed(2)
    batch = torch.randint(8, 64, (2, 30))
    g = d.block_size
    anchors = torch.tensor([[0, 7, 20], [3, 4, 24]])
    with torch.no_grad():
        out = tgt(batch, taps=d.layer_ids, head=False)
        ctx = d.context(d.features(tgt, batch, out.taps))
        B, A = anchors.shape
        idx = anchors[:, :, None] + torch.arange(g)
        block = torch.full((B, A, g), d.mask_id)
        block[:, :, 0] = batch.gather(1, anchors)
        x = tgt.embed_tokens(block.view(B, A * g))
        mask = dflash_train_mask(anchors, 30, g, causal_ctx=injection == "input")
        h = d(x, ctx, pos=idx.view(B, -1), ctx_pos=torch.arange(30), mask=mask, segment=g).view(B, A, g, -1)
        if conv:  # without the segments the blocks after the first would read their neighbour's last slot
            leak = d(x, ctx, pos=idx.view(B, -1), ctx_pos=torch.arange(30), mask=mask).view(B, A, g, -1)
            assert torch.allclose(leak[:, 0], h[:, 0]) and not torch.allclose(leak[:, 1:], h[:, 1:], atol=1e-3)
        for b in range(B):
            for a in range(A):
                p = int(anchors[b, a])
                xa = x[b:b + 1, a * g:(a + 1) * g]
                cache = d.new_cache(64)
                m = dflash_draft_mask(d.injection, 0, p, g, "cpu")
                ref = d(xa, ctx[b:b + 1, :p] if p else None, idx[b, a], torch.arange(p), cache=cache, mask=m)
                assert torch.allclose(ref[0], h[b, a], atol=1e-10), (b, a)
                assert cache.length == p  # only context K/V persist


def test_mask_blocks_see_context_strictly_before_their_anchor_and_not_each_other():
    m = dflash_train_mask(torch.tensor([[2, 5]]), 8, 3)[0, 0]  # (6, 8 + 6)
    assert m.shape == (6, 14)
    assert m[0, :8].tolist() == [True, True] + [False] * 6
    assert m[3, :8].tolist() == [True] * 5 + [False] * 3
    assert m[:3, 8:].tolist() == [[True] * 3 + [False] * 3] * 3
    assert m[3:, 8:].tolist() == [[False] * 3 + [True] * 3] * 3


@pytest.mark.parametrize("injection,features", [("kv", True), ("input", True), ("kv", False)])
def test_incremental_drafting_matches_a_fresh_forward(injection, features):
    """The drafter's cache (context K/V only, grown each cycle) gives what a fresh forward over all context gives."""
    tgt = _tiny_target()
    d = _drafter(tgt, injection, features)
    dd = DFlashDraft(d, tgt, Sampling(), capacity=128)
    seq = torch.randint(8, 64, (48,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = tgt(seq[None], taps=d.layer_ids)
        feats = _taps(full, d.layer_ids) if features else None
        P = 10
        dd.reset(seq[:P], feats[:P] if features else None)
        S = P + 1  # committed: the prompt and the prefill's token
        for n in (None, 3, 0, 5, 4):  # accepted proposals of each cycle
            if n is not None:  # the verified block [last token, n accepted] stays; a bonus follows
                dd.accept(seq[S - 1:S + n], feats[S - 1:S + n] if features else None)
                S += n + 1
            toks, _ = dd.propose(seq[:S], 5)
            start = S - 1
            ctx = d.context(d.features(tgt, seq[None, :start], {i: full.taps[i][:, :start] for i in d.layer_ids}))
            block = torch.full((1, 6), d.mask_id)
            block[0, 0] = seq[start]
            mask = dflash_train_mask(torch.tensor([[start]]), start, 6, causal_ctx=injection == "input")
            h = d(tgt.embed_tokens(block), ctx, pos=torch.arange(start, start + 6)[None], ctx_pos=torch.arange(start),
                  mask=mask)
            assert toks.tolist() == tgt.lm_head(h[0, 1:]).argmax(-1).tolist()


# training on the tiny preset -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_draft_data(tiny_ar, corpus_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("distill") / "gen.jsonl"
    cli("distill", "--target", str(tiny_ar), "--data", str(corpus_dir), "--out", str(out), "--prompts", "192",
        "--max-new-tokens", "64", "--batch-size", "64", "--quiet", check=True)
    return out


@pytest.fixture(scope="module")
def tiny_dflash(tiny_ar, tiny_draft_data, corpus_dir, tokenizer_path, tmp_path_factory):
    from dlm.train import train

    out = tmp_path_factory.mktemp("dflash") / "tiny-dflash"
    cfg = tiny_train_config(corpus_dir, tokenizer_path, objective="dflash", target=str(tiny_ar), tokenizer=None,
                            data=str(tiny_draft_data), seq_len=96, batch_size=8, max_steps=150, lr=3e-3,
                            block_size=8, eval_every=150, save_every=150)
    train(cfg, out, quiet=True)
    return out


def test_distill_writes_the_targets_own_continuations(tiny_ar, tiny_draft_data):
    rows = [json.loads(x) for x in tiny_draft_data.read_text().splitlines()]
    assert len(rows) == 192
    model, ck = load_model(tiny_ar)
    r = rows[0]
    assert r["text"].startswith(r["prompt"]) and len(r["text"]) > len(r["prompt"])
    assert_greedy_continuation(model, ck, r, 64)


def test_dflash_trains_on_tiny_and_drafts_with_tau_above_one(tiny_ar, tiny_dflash, corpus_dir):
    cfg = json.loads((tiny_dflash / "config.json").read_text())
    assert cfg["objective"] == "dflash" and cfg["dflash"]["block_size"] == 8
    assert cfg["dflash"]["target_layer_ids"] == [0, 1]  # every layer of a 2-layer target
    rows = [json.loads(x) for x in (tiny_dflash / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < losses[0] - 1.0
    from dlm.data.corpus import Corpus
    from dlm.data.tokens import heldout_prompts

    target, ck = load_model(tiny_ar)
    drafter, _ = load_model(tiny_dflash)
    dd = DFlashDraft(drafter, target, Sampling(), capacity=512)
    committed = cycles = 0
    for p in heldout_prompts(Corpus(str(corpus_dir)), "test", n=4):
        from dlm.sampling.speculative import SpecStats

        ids = ck.tokenizer.encode(p.text)
        st = SpecStats()
        out = [t for e in speculate(target, dd, ids, block_size=8, max_new_tokens=48, stats=st) if hasattr(e, "tokens")
               for t in e.tokens]
        assert out == target_greedy(target, ids, 48, None)
        committed, cycles = committed + st.committed, cycles + st.cycles
    assert committed / cycles > 1.3


def test_generate_json_and_check_lossless(tiny_ar, tiny_dflash):
    for draft, extra in ((str(tiny_dflash), ["--gamma", "4"]), ("lookup", []), (str(tiny_ar), [])):
        r = cli("generate", "--model", str(tiny_ar), "--prompt", "def main(self):\n", "--max-new-tokens", "24",
                "--draft", draft, "--json", "--check-lossless", *extra, check=True)
        out = json.loads(r.stdout)
        assert out["lossless"] is True and 1 <= out["tau"] <= out["gamma"]
        assert sum(out["acceptance_histogram"]) == out["cycles"] and len(out["acceptance_histogram"]) == out["gamma"] + 1
        assert out["forwards"] == out["cycles"] + 1 and 0 < out["new_tokens"] <= 24
        assert ("draft_forwards" in out) and out["draft_seconds"] >= 0 and out["verify_seconds"] > 0


def test_export_matches_the_public_dflash_layout(tiny_dflash, tiny_ar, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "hf"
    cli("export", "--model", str(tiny_dflash), "--out", str(out), "--format", "hf", check=True)
    cfg = json.loads((out / "config.json").read_text())
    drafter, ck = load_model(tiny_dflash)
    mc = drafter.cfg
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["dflash_config"]["target_layer_ids"] == ck.config["dflash"]["target_layer_ids"]
    assert cfg["dflash_config"]["mask_token_id"] == ck.tokenizer.mask_id
    assert cfg["block_size"] == cfg["dflash_config"]["block_size"] == 8
    assert cfg["num_target_layers"] == 2 and cfg["num_hidden_layers"] == mc.n_layers
    assert cfg["tie_word_embeddings"] is False and cfg["layer_types"] == ["full_attention"] * mc.n_layers
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "rms_norm_eps", "rope_theta", "vocab_size", "max_position_embeddings", "hidden_act"):
        assert key in cfg
    w = load_file(str(out / "model.safetensors"))
    D, hd, H, Hkv, F = mc.dim, mc.head_dim, mc.n_heads, mc.n_kv_heads, mc.ffn_dim
    L = len(cfg["dflash_config"]["target_layer_ids"])
    want = {"fc.weight": (D, L * D), "hidden_norm.weight": (D,), "norm.weight": (D,)}
    for i in range(mc.n_layers):
        p = f"layers.{i}."
        want.update({p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
                     p + "self_attn.q_proj.weight": (H * hd, D), p + "self_attn.k_proj.weight": (Hkv * hd, D),
                     p + "self_attn.v_proj.weight": (Hkv * hd, D), p + "self_attn.o_proj.weight": (D, H * hd),
                     p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                     p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                     p + "mlp.down_proj.weight": (D, F)})
    assert {k: tuple(v.shape) for k, v in w.items()} == want
    # what public engines compute from this folder: test_public_engines_draft_what_dlm_drafts


def test_public_engines_draft_what_dlm_drafts(tiny_dflash, tiny_ar, tmp_path):
    """Target and drafter exported, run the public way (transformers' hidden_states[id + 1] as features, the
    published draft forward on the exported weights) = the logits of dlm's speculative loop. The drafter reads
    the target's last layer, which transformers gives after the final norm."""
    from safetensors.torch import load_file

    transformers = pytest.importorskip("transformers")
    for src, name in ((tiny_ar, "target"), (tiny_dflash, "drafter")):
        cli("export", "--model", str(src), "--out", str(tmp_path / name), "--format", "hf", check=True)
    cfg = json.loads((tmp_path / "drafter" / "config.json").read_text())
    w = load_file(str(tmp_path / "drafter" / "model.safetensors"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "target", dtype=torch.float32).eval()
    target, ck = load_model(tiny_ar)
    drafter, dck = load_model(tiny_dflash)
    layer_ids = cfg["dflash_config"]["target_layer_ids"]
    assert dck.config["dflash"]["last_layer"] == "normed" and target.cfg.n_layers - 1 in layer_ids
    ids = ck.tokenizer.encode("def read_lines(path, encoding=None):\n    ")
    B = cfg["block_size"]

    def dlm_logits():  # the prefill and the first draft of dlm's speculative loop
        dd = DFlashDraft(drafter, target, Sampling(), capacity=256)
        events = speculate(target, dd, ids, block_size=B, max_new_tokens=16)
        first = next(e for e in events if isinstance(e, Commit)).tokens[0]  # the prefill's token: the drafter is reset
        with torch.inference_mode():
            return dd.logits(torch.tensor(ids + [first]), B - 1), first

    with torch.no_grad():
        ours, first = dlm_logits()
        hs = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
        feat = torch.cat([hs[i + 1] for i in layer_ids], -1)  # (1, P, L*D): the public engines' features
        block = torch.full((1, B), cfg["dflash_config"]["mask_token_id"])
        block[0, 0] = first
        h = _public_forward(cfg, w, feat, hf.get_input_embeddings()(block))
        theirs = hf.lm_head(h[0, 1:])  # (B-1, V)
        assert (ours - theirs).abs().max() <= 1e-4
        drafter.last_layer = "prenorm"  # the reading of drafters trained before: not what the engines feed
        assert (dlm_logits()[0] - theirs).abs().max() > 1e-2


def test_drafters_without_the_flag_keep_the_prenorm_reading_and_export_with_a_warning(tiny_dflash, tiny_ar, tmp_path):
    """A drafter trained before last_layer existed (dflash-small was one) reads the last layer's pre-norm tap, as it was
    trained; its export still works (the README's command) but warns that public engines feed it otherwise."""
    import shutil

    old = tmp_path / "old"
    shutil.copytree(tiny_dflash, old)
    meta = json.loads((old / "config.json").read_text())
    del meta["dflash"]["last_layer"]
    (old / "config.json").write_text(json.dumps(meta))
    drafter, _ = load_model(old)
    target, _ = load_model(tiny_ar)
    assert drafter.last_layer == "prenorm"
    x = torch.randint(8, 500, (1, 12))
    with torch.no_grad():
        taps = target(x, taps=drafter.layer_ids).taps
        assert torch.equal(drafter.features(target, x, taps), torch.cat([taps[i] for i in drafter.layer_ids], -1))
        drafter.last_layer = "normed"
        assert not torch.equal(drafter.features(target, x, taps), torch.cat([taps[i] for i in drafter.layer_ids], -1))
    r = cli("export", "--model", str(old), "--out", str(tmp_path / "hf-old"), "--format", "hf", check=True)
    assert "dlm: warning:" in r.stderr and "before the final norm" in r.stderr and (tmp_path / "hf-old").is_dir()
    r = cli("export", "--model", str(tiny_dflash), "--out", str(tmp_path / "hf-new"), "--format", "hf", check=True)
    assert r.stderr == ""


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _public_forward(cfg, w, feat, x):
    """DFlash's published draft forward, from config.json + weights alone: ctx = hidden_norm(fc(features)) of C
    positions; a block x (1, B, D) at positions C .. C+B-1; q from the block, k/v from [ctx ; block]."""
    eps, hd = cfg["rms_norm_eps"], cfg["head_dim"]
    H, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    C, B = feat.shape[1], x.shape[1]
    ctx = _rms(feat @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    pos = torch.arange(C + B)
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
    ang = pos[:, None].float() * inv
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()

    def rope(t, c, s):
        t1, t2 = t.chunk(2, -1)
        return t * c + torch.cat((-t2, t1), -1) * s

    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        hn = _rms(x, w[p + "input_layernorm.weight"], eps)
        q = (hn @ w[p + "self_attn.q_proj.weight"].T).view(B, H, hd)
        q = _rms(q, w[p + "self_attn.q_norm.weight"], eps).transpose(0, 1)
        kv_in = torch.cat((ctx[0], hn[0]), 0)  # (C + B, D)
        k = (kv_in @ w[p + "self_attn.k_proj.weight"].T).view(-1, Hkv, hd)
        k = _rms(k, w[p + "self_attn.k_norm.weight"], eps).transpose(0, 1)
        v = (kv_in @ w[p + "self_attn.v_proj.weight"].T).view(-1, Hkv, hd).transpose(0, 1)
        q, k = rope(q, cos[C:], sin[C:]), rope(k, cos, sin)
        k, v = k.repeat_interleave(H // Hkv, 0), v.repeat_interleave(H // Hkv, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(hd), -1) @ v  # non-causal
        x = x + (att.transpose(0, 1).reshape(1, B, H * hd) @ w[p + "self_attn.o_proj.weight"].T)
        hn = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
        g = hn @ w[p + "mlp.gate_proj.weight"].T
        x = x + (torch.nn.functional.silu(g) * (hn @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
    return _rms(x, w["norm.weight"], eps)


def test_ablations_train_and_stay_lossless(tiny_ar, tiny_draft_data, corpus_dir, tokenizer_path, tmp_path):
    from dlm.train import train

    target, ck = load_model(tiny_ar)
    for name, kw in (("input", dict(injection="input")), ("nofeat", dict(target_features=False))):
        out = tmp_path / name
        cfg = tiny_train_config(corpus_dir, tokenizer_path, objective="dflash", target=str(tiny_ar), tokenizer=None,
                                data=str(tiny_draft_data), seq_len=64, batch_size=4, max_steps=6, block_size=8,
                                eval_every=6, save_every=6, **kw)
        train(cfg, out, quiet=True)
        drafter, dck = load_model(out)
        assert dck.config["dflash"]["injection"] == kw.get("injection", "kv")
        assert drafter.fc.weight.shape[1] == (64 if name == "nofeat" else 128)
        ids = ck.tokenizer.encode("class A:\n    def f(self):\n")
        out_t = [t for e in speculate(target, DFlashDraft(drafter, target, Sampling(), 256), ids, block_size=8,
                                      max_new_tokens=20) if hasattr(e, "tokens") for t in e.tokens]
        assert out_t == target_greedy(target, ids, 20, None)
    r = cli("export", "--model", str(tmp_path / "nofeat"), "--out", str(tmp_path / "x"), "--format", "hf")
    assert r.returncode == 2 and "ablation" in r.stderr


# bad input -------------------------------------------------------------------------------------------

def test_bad_input_is_one_clear_error(tiny_ar, tiny_dflash, tmp_path, corpus_dir, tokenizer_path):
    from dlm.sampling import SampleConfig, generate
    from dlm.train import train

    def err(*args):  # through the CLI: one line on stderr, exit code 2
        r = cli(*args)
        assert r.returncode == 2, r.stderr
        assert r.stderr.startswith("dlm: error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
        return r.stderr

    gen = ["generate", "--model", str(tiny_ar), "--prompt", "x = 1\n", "--max-new-tokens", "8"]
    assert "--block-size" in err(*gen, "--draft", str(tiny_dflash), "--gamma", "1")  # the old spelling still works
    assert "too shallow" in err("train", "--objective", "dflash", "--data", str(corpus_dir), "--target", str(tiny_ar),
                                "--target-layers", "0", "1", "5", "--out", str(tmp_path / "a"))
    assert not (tmp_path / "a").exists()  # refused before anything was written
    assert "follows a drafter checkpoint folder" in err(*gen, "--draft", "lookup+lookup")
    assert "no such folder" in err(*gen, "--draft", str(tmp_path / "nope") + "+lookup")

    target, ck = load_model(tiny_ar)

    def refused(match, **kw):
        with pytest.raises(DlmError, match=match):
            generate(target, ck, "x = 1\n", SampleConfig(max_new_tokens=8, **kw))

    refused("larger than the block size", draft=str(tiny_dflash), block_size=9)
    refused("no such folder", draft=str(tmp_path / "nope"))
    refused("--check-lossless", draft="lookup", check_lossless=True, temperature=1.0)
    refused("--draft-passes", draft=str(tiny_dflash), draft_passes=4)
    refused("no selector", draft=str(tiny_dflash), draft_top_k=64)  # a DFlash 1 drafter has no candidates to widen
    # a target of the same shape but other weights than the drafter was trained for
    other = tmp_path / "other-ar"
    train(tiny_train_config(corpus_dir, tokenizer_path, max_steps=2, eval_every=2, save_every=2, seq_len=32,
                            batch_size=2), other, quiet=True)
    other_model, other_ck = load_model(other)
    with pytest.raises(DlmError, match="another target"):
        generate(other_model, other_ck, "x", SampleConfig(max_new_tokens=4, draft=str(tiny_dflash)))
    # a drafter with another tokenizer
    from dlm.data.corpus import Corpus
    from dlm.tokenizer import Tokenizer

    tok2 = tmp_path / "tok2.json"
    Tokenizer.train(Corpus(str(corpus_dir)).texts("train"), vocab_size=600).save(tok2)
    other2 = tmp_path / "other-tok"
    train(tiny_train_config(corpus_dir, tok2, max_steps=2, eval_every=2, save_every=2, seq_len=32, batch_size=2),
          other2, quiet=True)
    refused("tokenizer differs", draft=str(other2))
    # training options
    from dlm.config import TrainConfig

    def bad_train(match, **kw):
        with pytest.raises(DlmError, match=match):
            DFlash.check_config(TrainConfig(objective="dflash", data=str(corpus_dir), **kw))

    bad_train("needs --target")
    bad_train("--block-size", target=str(tiny_ar), block_size=1)
    bad_train("--draft-layers", target=str(tiny_ar), draft_layers=-1)
    bad_train("--injection", target=str(tiny_ar), injection="cross")
    bad_train("too shallow", target=str(tiny_ar), target_layers=[0, 1, 1])
    bad_train("distinct", target=str(tiny_ar), target_layers=[1, 1])
    bad_train("AR checkpoint", target=str(tiny_dflash))
    bad_train("--selector-soft needs --distill-logits", target=str(tiny_ar), selector_rank=4, selector_soft=True)


def test_bench_puts_drafters_beside_the_target_alone(tiny_ar, tiny_dflash, corpus_dir, tmp_path):
    from dlm.bench import run_bench

    out = tmp_path / "bench.json"
    rep = run_bench(str(tiny_ar), prompts=2, max_new_tokens=16, out=str(out), data=str(corpus_dir), warmup=0,
                    naive=False, quiet=True, draft=["lookup", str(tiny_dflash)], temperatures=(0.0, 1.0), repeat=2)
    rows = {s["method"]: s for s in rep["summaries"]}
    spec = [s for s in rep["summaries"] if s["paradigm"] == "spec"]
    assert len(spec) == 4 and "target alone T=1" in rows and rows["ar (KV cache)"]["speedup"] == 1.0
    for s in spec:
        assert 1 <= s["tau"] <= s["settings"]["gamma"] and s["speedup"] > 0 and 0 <= s["draft_share"] <= 1
        assert s["speedup_range"][0] <= s["speedup"] <= s["speedup_range"][1]  # min-max over the 2 repetitions
        assert sum(s["acceptance_histogram"]) > 0
        assert s["lossless"] == (1.0 if s["temperature"] == 0 else None)
    assert json.loads(out.read_text())["summaries"][0]["method"] == "ar (KV cache)"
    rep = run_bench(str(tiny_ar), prompts=1, max_new_tokens=16, out="", data=str(corpus_dir), warmup=0, naive=False,
                    quiet=True, draft=[f"{tiny_dflash}@2", str(tiny_dflash)], temperatures=(0.0,), repeat=1)
    two = [s for s in rep["summaries"] if s["settings"].get("draft_passes") == 2]
    assert len(two) == 1 and "2 passes" in two[0]["method"] and two[0]["draft_forwards"] > 0
    rep = run_bench(str(tiny_ar), prompts=1, max_new_tokens=16, out="", data=str(corpus_dir), warmup=0, naive=False,
                    quiet=True, draft=[f"{tiny_dflash}@x3", str(tiny_dflash)], temperatures=(0.0,), repeat=1)
    tree = [s for s in rep["summaries"] if s["settings"].get("draft_branches") == 3]
    assert len(tree) == 1 and "3 branches" in tree[0]["method"] and tree[0]["lossless"] == 1.0


def test_bench_with_blocked_weights(tiny_ar, tiny_dflash, tmp_path):
    """`dlm bench --blocked`: the target's and the drafter's float32 weights in dlm's blocked layout; greedy speculation
    lossless against the blocked target; the report says so."""
    out = tmp_path / "b.json"
    cli("bench", "--model", str(tiny_ar), "--draft", "lookup", str(tiny_dflash), "--prompts", "1",
        "--max-new-tokens", "8", "--repeat", "1", "--no-naive", "--temperature", "0", "--blocked", "--out",
        str(out), check=True)
    r = json.loads(out.read_text())
    assert r["blocked"] is True and r["col_major"] is False
    assert [s["lossless"] for s in r["summaries"] if s["paradigm"] == "spec"] == [1.0, 1.0]


@pytest.mark.parametrize("step", ["static", pytest.param("compiled", marks=pytest.mark.slow)])
def test_bench_rows_on_the_row_batch_step(tiny_ar, tiny_dflash, step):
    """`dlm bench --compile`: the AR rows on the target run through a row batch's one-token step, and the speculative
    rows through row batches on the same step, their verify windows on its window step (compiled, or the same static
    steps run eagerly), prompt by prompt: the same greedy answers as the ordinary loops', the steps' forwards and
    windows counted, the speculative rows lossless against the target on its step; the report names the step."""
    from dlm.bench import run_bench

    kw = dict(prompts=2, max_new_tokens=12, out=None, warmup=0, naive=False, quiet=True, mdlm="", usdm="",
              draft=["lookup", str(tiny_dflash)], temperatures=(0.0,), repeat=1)
    plain = run_bench(str(tiny_ar), **kw)
    rows = run_bench(str(tiny_ar), **kw, ar_step=step)
    assert plain["ar_step"] == "eager" and rows["ar_step"] == step
    assert plain["ar_step_forwards"] == 0 and rows["ar_step_forwards"] > 0  # (the row batch served them)
    assert plain["ar_step_windows"] == 0 and rows["ar_step_windows"] > 0  # (and the verify windows)
    names = [s["method"] for s in plain["summaries"] if s["paradigm"] in ("ar", "spec")]
    assert len(names) == 3
    for name in names:
        a, b = plain["per_case"][name], rows["per_case"][name]
        assert [r["answer"] for r in a] == [r["answer"] for r in b]
        assert [r["new_tokens"] for r in a] == [r["new_tokens"] for r in b] and all(r["new_tokens"] for r in b)
    spec = [s for s in rows["summaries"] if s["paradigm"] == "spec"]
    assert [s["lossless"] for s in spec] == [1.0, 1.0] and all(s["tau"] > 1 for s in spec)
    # the drafter read the same target features from the window step (its taps): the same drafts, the same cycles
    assert [s["tau"] for s in spec] == [s["tau"] for s in plain["summaries"] if s["paradigm"] == "spec"]


def test_bench_drafter_specs():
    from dlm.bench.methods import split_spec

    assert split_spec("d@2") == ("d", 2, None, 1)
    assert split_spec("d@top256") == ("d", 1, 256, 1)
    assert split_spec("d@x3") == ("d", 1, None, 3)
    assert split_spec("runs/d@top64x2") == ("runs/d", 1, 64, 2)
    assert split_spec("runs/d") == ("runs/d", 1, None, 1)
    assert split_spec("we@ird") == ("we@ird", 1, None, 1)  # not an option: the folder's own name


def test_dflash_training_resumes_exactly(tiny_ar, tiny_draft_data, corpus_dir, tokenizer_path, tmp_path, monkeypatch):
    from dlm.data.tokens import Batches
    from dlm.train import train

    def cfg(steps):
        return tiny_train_config(corpus_dir, tokenizer_path, objective="dflash", target=str(tiny_ar), tokenizer=None,
                                 data=str(tiny_draft_data), seq_len=48, batch_size=2, max_steps=steps, block_size=8,
                                 log_every=1, eval_every=100, save_every=3)

    train(cfg(6), tmp_path / "straight", quiet=True)
    batch = Batches.batch_sup  # what the training loop reads (a distilled corpus: with its response flags)

    def interrupted(self, step):
        if step == 4:
            raise KeyboardInterrupt
        return batch(self, step)

    monkeypatch.setattr(Batches, "batch_sup", interrupted)
    with pytest.raises(KeyboardInterrupt):  # killed after the state of step 3 was saved
        train(cfg(6), tmp_path / "resumed", quiet=True)
    monkeypatch.setattr(Batches, "batch_sup", batch)
    train(cfg(6), tmp_path / "resumed", resume=True, quiet=True)

    def losses(p):
        return [r["loss"] for r in map(json.loads, (p / "metrics.jsonl").read_text().splitlines()) if "loss" in r]

    assert losses(tmp_path / "straight") == losses(tmp_path / "resumed")


def test_init_from_continues_a_drafter_at_any_block_and_refuses_a_mismatch(tiny_ar, tiny_dflash, tiny_draft_data,
                                                                           corpus_dir, tokenizer_path):
    from dlm.objectives.dflash import DFlash
    from dlm.tokenizer import Tokenizer

    def objective(**kw):
        cfg = tiny_train_config(corpus_dir, tokenizer_path, objective="dflash", target=str(tiny_ar), tokenizer=None,
                                data=str(tiny_draft_data), seq_len=96, **{"block_size": 8, **kw})
        return DFlash(cfg, Tokenizer.from_file(tiny_ar / "tokenizer.json"))

    trained, _ = load_model(tiny_dflash)
    for block in (8, 4):  # the block may change (stage 2 at a smaller block): no weight depends on it
        warm = objective(init_from=str(tiny_dflash), block_size=block).build_model()
        for k, v in trained.state_dict().items():
            torch.testing.assert_close(warm.state_dict()[k], v)
    layers = json.loads((tiny_dflash / "config.json").read_text())["dflash"]["target_layer_ids"]
    with pytest.raises(DlmError, match="target layers"):
        objective(init_from=str(tiny_dflash), target_layers=layers[:-1] or [0, 1]).build_model()
    with pytest.raises(DlmError, match="starts from a dflash drafter"):
        objective(init_from=str(tiny_ar)).build_model()


# DFlash 2 training, --init-from DFlash 1, --distill-logits -----------------------------------------------------

def test_selector_terms_train_what_the_selector_drafts():
    """The selector's term, teacher-forced: a slot's pick is the greedy path's token as long as the path follows the
    gold; a gold token outside the top-k is dropped; with a zero successor codebook and k = V the term is the plain
    cross-entropy of the logits."""
    import torch.nn.functional as F

    from dlm.drafter import CandidateSelector
    from dlm.objectives.dflash import selector_terms

    torch.manual_seed(0)
    V, D, S = 12, 8, 5
    sel = CandidateSelector(V, D, rank=4, top_k=4)
    with torch.no_grad():
        for w in sel.parameters():
            w.normal_(0, 2.0)
    h, logits, anchor = torch.randn(1, S, D), torch.randn(1, S, V), torch.tensor([3])
    path, cands, _ = sel.select(h, logits, anchor, 0.0, None)
    gold = path.clone()
    other = [int(c) for c in cands[0, 2] if int(c) != int(path[0, 2])][0]
    gold[0, 2] = other  # the gold leaves the path at slot 2 (still a candidate)
    gold[0, 4] = [t for t in range(V) if t not in cands[0, 4].tolist()][0]  # and is no candidate at slot 4
    ce, is_cand, picked = selector_terms(sel, h, logits, anchor, gold)
    assert picked[0, :2].all() and not picked[0, 2]
    assert is_cand[0, :4].all() and not is_cand[0, 4] and ce[0, 4] == 0 and (ce[0, :4] > 0).all()
    # teacher forcing: slot 3 is scored after the gold token of slot 2, not after the path's
    sc = sel.scores(h[:, 3], *torch.topk(logits[:, 3], 4), gold[:, 2])
    assert bool(picked[0, 3]) == (int(torch.topk(logits[:, 3], 4).indices[0, sc.argmax(-1)]) == int(gold[0, 3]))
    with torch.no_grad():
        sel.successor_codebook.weight.zero_()
    sel.top_k = V
    ce, is_cand, _ = selector_terms(sel, h, logits, anchor, gold)
    assert is_cand.all()
    torch.testing.assert_close(ce[0], F.cross_entropy(logits[0], gold[0], reduction="none"))


def _objective(tiny_ar, tiny_draft_data, corpus_dir, tokenizer_path, **kw):
    from dlm.tokenizer import Tokenizer

    cfg = tiny_train_config(corpus_dir, tokenizer_path, objective="dflash", target=str(tiny_ar), tokenizer=None,
                            data=str(tiny_draft_data), seq_len=96, **{"block_size": 8, **kw})
    return DFlash(cfg, Tokenizer.from_file(tiny_ar / "tokenizer.json"))


def test_dflash2_grown_from_a_dflash1_drafter_starts_as_it(tiny_ar, tiny_dflash, tiny_draft_data, corpus_dir,
                                                           tokenizer_path):
    """--init-from a DFlash 1 drafter with the convolutions and the selector on: the same logits (the same loss and
    training acceptance) at step 0; the selector's term then enters as its weight ramps, and trains the codebooks."""
    dflash2 = dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=64, selector_ramp=0.5)
    o1 = _objective(tiny_ar, tiny_draft_data, corpus_dir, tokenizer_path, init_from=str(tiny_dflash))
    o2 = _objective(tiny_ar, tiny_draft_data, corpus_dir, tokenizer_path, init_from=str(tiny_dflash), **dflash2)
    m1, m2 = o1.build_model(), o2.build_model()
    assert m1.version == 1 and m2.version == 2
    batch = torch.tensor([[t] + target_greedy(o1.target, [t], 96, None) for t in (5, 9)])  # what it was trained on
    l1, x1 = o1.loss(m1, batch, torch.Generator().manual_seed(1))
    l2, x2 = o2.loss(m2, batch, torch.Generator().manual_seed(1))
    assert torch.equal(l1, l2) and x1["tau_train"] == x2["tau_train"] and x1["acc_slot1"] == x2["acc_slot1"]
    assert o2.selector_weight() == 0.0
    o2.step = o2.cfg.max_steps // 4  # half way up the ramp
    assert o2.selector_weight() == pytest.approx(0.5)
    l3, x3 = o2.loss(m2, batch, torch.Generator().manual_seed(1))
    assert float(l3.detach()) > float(l1.detach()) and x3["selector_ce"] > 0 and 0 < x3["gold_in_top_k"] <= 1
    l3.backward()
    sel = m2.candidate_selector
    assert float(sel.successor_codebook.weight.grad.abs().sum()) > 0  # the zero codebook starts to learn
    assert float(m2.layers[0].attention_conv.base_kernel.grad.abs().sum()) > 0


def test_a_drafter_grown_by_depth_starts_as_it_and_trains_its_new_layer(tiny_ar, tiny_dflash, tiny_draft_data,
                                                                        corpus_dir, tokenizer_path):
    """--draft-layers above the --init-from drafter's: the same loss and training acceptance at step 0 (the new layer
    adds nothing to the residual stream), every weight of the new layer gets a gradient after one step's worth of
    movement of its output projections, and fewer layers than the drafter's is refused."""
    base, _ = load_model(tiny_dflash)
    n = base.cfg.n_layers
    o1 = _objective(tiny_ar, tiny_draft_data, corpus_dir, tokenizer_path, init_from=str(tiny_dflash))
    o2 = _objective(tiny_ar, tiny_draft_data, corpus_dir, tokenizer_path, init_from=str(tiny_dflash),
                    draft_layers=n + 1)
    m1, m2 = o1.build_model(), o2.build_model()
    assert len(m2.layers) == n + 1
    for k, v in m1.state_dict().items():  # the old layers as trained
        torch.testing.assert_close(m2.state_dict()[k], v)
    batch = torch.tensor([[t] + target_greedy(o1.target, [t], 96, None) for t in (5, 9)])
    l1, x1 = o1.loss(m1, batch, torch.Generator().manual_seed(1))
    l2, x2 = o2.loss(m2, batch, torch.Generator().manual_seed(1))
    torch.testing.assert_close(l2, l1)
    assert x1["tau_train"] == x2["tau_train"] and x1["acc_slot1"] == x2["acc_slot1"]
    new = m2.layers[n]
    l2.backward()
    assert float(new.self_attn.o_proj.weight.grad.abs().sum()) > 0 and float(new.mlp.down_proj.weight.grad.abs().sum()) > 0
    with torch.no_grad():  # once its outputs move, the layer's inside learns too
        new.self_attn.o_proj.weight.normal_(0, 0.02)
    m2.zero_grad()
    l3, _ = o2.loss(m2, batch, torch.Generator().manual_seed(1))
    l3.backward()
    assert float(new.self_attn.q_proj.weight.grad.abs().sum()) > 0
    assert n > 1
    with pytest.raises(DlmError, match="grow"):
        _objective(tiny_ar, tiny_draft_data, corpus_dir, tokenizer_path, init_from=str(tiny_dflash),
                   draft_layers=n - 1).build_model()


def test_selector_soft_matches_the_targets_distribution_over_the_candidates():
    """--selector-soft: the selector's term is the soft cross-entropy against the teacher's softmax over the
    candidates, renormalised: minimal (its entropy) where the scores equal the teacher's logits there, counted at
    every slot, and equal to the hard term when the teacher puts all its mass on the gold token."""
    from dlm.drafter import CandidateSelector
    from dlm.objectives.dflash import selector_terms

    torch.manual_seed(0)
    V, D, S, k = 12, 8, 5, 4
    sel = CandidateSelector(V, D, rank=4, top_k=k)
    with torch.no_grad():
        sel.successor_codebook.weight.zero_()  # scores = the draft logits of the candidates
    h, logits, anchor = torch.randn(1, S, D), torch.randn(1, S, V), torch.tensor([3])
    gold = torch.randint(0, V, (1, S))
    cands = torch.topk(logits, k).indices
    teacher = torch.randn(1, S, V)
    teacher.scatter_(-1, cands, logits.gather(-1, cands))  # the teacher agrees with the draft over the candidates
    ce, is_cand, _ = selector_terms(sel, h, logits, anchor, gold, teacher)
    p = torch.softmax(logits.gather(-1, cands), -1)
    torch.testing.assert_close(ce, -(p * p.log()).sum(-1))  # the entropy: nothing left to learn
    with torch.no_grad():  # other scores of the same candidates (the codebooks move them) cost more (Gibbs)
        sel.successor_codebook.weight.normal_(0, 1.0)
    ce_other, _, _ = selector_terms(sel, h, logits, anchor, gold, teacher)
    assert (ce_other > ce).all()
    with torch.no_grad():
        sel.successor_codebook.weight.zero_()
    gold = cands[..., 1]  # every gold a candidate; a one-hot teacher on it is the hard term
    onehot = torch.full((1, S, V), -1e4).scatter_(-1, gold[..., None], 0.0)
    hard, _, _ = selector_terms(sel, h, logits, anchor, gold)
    torch.testing.assert_close(selector_terms(sel, h, logits, anchor, gold, onehot)[0], hard)


def test_distill_logits_reads_the_targets_next_token_distribution(tiny_ar, tiny_dflash, tiny_draft_data, corpus_dir,
                                                                  tokenizer_path, monkeypatch):
    """The soft label of a slot is the target's softmax at the position before it: on the target's own greedy text
    its argmax is the slot's token (an off-by-one would read the next or the previous one)."""
    import dlm.objectives.dflash as mod

    seen = []
    mod_soft = mod.soft_cross_entropy
    monkeypatch.setattr(mod, "soft_cross_entropy", lambda l, t: (seen.append(t), mod_soft(l, t))[1])
    o = _objective(tiny_ar, tiny_draft_data, corpus_dir, tokenizer_path, init_from=str(tiny_dflash),
                   distill_logits=True, anchors=1000)
    m = o.build_model()
    text = [5] + target_greedy(o.target, [5], 47, None)
    batch = torch.tensor([text])
    loss, _ = o.loss(m, batch, torch.Generator().manual_seed(0))
    (teacher,) = seen
    g, n_pos = 8, len(text) - 8 + 1
    labels = torch.stack([batch[0, a + 1:a + g] for a in range(n_pos)])  # every anchor, in order
    assert teacher.shape[:3] == (1, n_pos, g - 1)
    assert (teacher[0].argmax(-1) == labels).float().mean() > 0.98
    hard = _objective(tiny_ar, tiny_draft_data, corpus_dir, tokenizer_path, init_from=str(tiny_dflash), anchors=1000)
    h_loss, _ = hard.loss(m, batch, torch.Generator().manual_seed(0))
    assert abs(float(loss.detach()) - float(h_loss.detach())) > 1e-3  # soft labels: another loss than the hard ones


def test_dflash2_trains_by_the_cli_and_drafts_losslessly(tiny_ar, tiny_dflash, tiny_draft_data, corpus_dir,
                                                         tokenizer_path, tmp_path):
    out = tmp_path / "d2"
    cli("train", "--objective", "dflash", "--target", str(tiny_ar), "--data", str(tiny_draft_data),
        "--init-from", str(tiny_dflash), "--block-size", "8", "--seq-len", "96", "--batch-size", "4",
        "--max-steps", "4", "--eval-every", "4", "--eval-batches", "1", "--save-every", "4", "--log-every", "2",
        "--conv-kernel-size", "2", "--selector-rank", "8", "--selector-top-k", "4", "--distill-logits",
        "--out", str(out), "--quiet", check=True)
    cfg = json.loads((out / "config.json").read_text())
    d = cfg["dflash"]
    assert (d["conv_kernel_size"], d["conv_group_size"], d["selector_rank"], d["selector_top_k"]) == (2, 16, 8, 4)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert any("selector_ce" in r for r in rows)
    target, ck = load_model(tiny_ar)
    drafter, _ = load_model(out)
    assert drafter.version == 2
    ids = ck.tokenizer.encode("def main(")
    dd = DFlashDraft(drafter, target, Sampling(), capacity=256)
    got = [t for e in speculate(target, dd, ids, block_size=8, max_new_tokens=24) if hasattr(e, "tokens")
           for t in e.tokens]
    assert got == target_greedy(target, ids, 24, None)
    # continuing it needs its own DFlash 2 options; options of another objective are refused
    r = cli("train", "--objective", "dflash", "--target", str(tiny_ar), "--data", str(tiny_draft_data),
            "--init-from", str(out), "--block-size", "8", "--seq-len", "96", "--max-steps", "2",
            "--out", str(tmp_path / "d3"), "--quiet")
    assert r.returncode == 2 and "conv_kernel_size 2" in r.stderr and "Traceback" not in r.stderr
    # continued, it keeps its candidates per slot unless the run gives others (they are no weights)
    for extra, want in (([], 4), (["--selector-top-k", "6"], 6)):
        more = tmp_path / f"d{want}"
        cli("train", "--objective", "dflash", "--target", str(tiny_ar), "--data", str(tiny_draft_data),
            "--init-from", str(out), "--block-size", "8", "--seq-len", "96", "--batch-size", "2",
            "--max-steps", "1", "--eval-every", "1", "--eval-batches", "1", "--conv-kernel-size", "2", "--selector-rank", "8", *extra,
            "--out", str(more), "--quiet", check=True)
        assert json.loads((more / "config.json").read_text())["dflash"]["selector_top_k"] == want
    # a wider selector (rank 8 -> 12): the old codes kept, the new successor codes zero, the same drafts
    w = _objective(tiny_ar, tiny_draft_data, corpus_dir, tokenizer_path, init_from=str(out), conv_kernel_size=2,
                   selector_rank=12).build_model().eval()
    assert w.candidate_selector.successor_codebook.weight.shape[1] == 12
    assert torch.equal(w.candidate_selector.successor_codebook.weight[:, :8],
                       drafter.candidate_selector.successor_codebook.weight)
    assert not w.candidate_selector.successor_codebook.weight[:, 8:].any()
    assert w.candidate_selector.hidden_projection.weight[8:].abs().sum() > 0  # new codes random, not zero
    runs = []
    for dr in (w, drafter):  # at T = 1 the proposals and their q reach the tokens: equal draws, equal text
        s = Sampling(temperature=1.0, gen=torch.Generator().manual_seed(3))
        runs.append([e.tokens for e in speculate(target, DFlashDraft(dr, target, s, capacity=256), ids, block_size=8,
                                                 max_new_tokens=24, sampling=s) if hasattr(e, "tokens")])
    assert runs[0] == runs[1]
    wide = tmp_path / "wide"
    cli("train", "--objective", "dflash", "--target", str(tiny_ar), "--data", str(tiny_draft_data),
        "--init-from", str(out), "--block-size", "8", "--seq-len", "96", "--batch-size", "2", "--max-steps", "1",
        "--eval-every", "1", "--eval-batches", "1", "--conv-kernel-size", "2", "--selector-rank", "12",
        "--out", str(wide), "--quiet", check=True)
    r = cli("train", "--objective", "dflash", "--target", str(tiny_ar), "--data", str(tiny_draft_data),
            "--init-from", str(wide), "--block-size", "8", "--seq-len", "96", "--max-steps", "1",
            "--conv-kernel-size", "2", "--selector-rank", "8", "--out", str(tmp_path / "narrow"), "--quiet")
    assert r.returncode == 2 and "selector_rank 12" in r.stderr and "Traceback" not in r.stderr
    r = cli("train", "--objective", "ar", "--data", str(corpus_dir), "--selector-rank", "4", "--max-steps", "1",
            "--out", str(tmp_path / "a"), "--quiet")
    assert r.returncode == 2 and "--selector-rank applies to --objective dflash" in r.stderr


def test_a_uniform_noise_drafter_trains_revises_and_stays_lossless(tiny_ar, tiny_dflash, tiny_draft_data, tmp_path):
    """--block-noise uniform: the block's slots are random tokens (a fraction of them, per block) in training and at
    the first draft pass; later passes feed every slot's guess back (revision). Recorded in the checkpoint, loaded
    back, and the output is the target's."""
    out = tmp_path / "u"
    cli("train", "--objective", "dflash", "--target", str(tiny_ar), "--data", str(tiny_draft_data),
        "--init-from", str(tiny_dflash), "--block-size", "8", "--seq-len", "96", "--batch-size", "4",
        "--max-steps", "3", "--eval-every", "3", "--eval-batches", "1", "--log-every", "1",
        "--block-noise", "uniform", "--out", str(out), "--quiet", check=True)
    assert json.loads((out / "config.json").read_text())["dflash"]["block_noise"] == "uniform"
    target, ck = load_model(tiny_ar)
    drafter, _ = load_model(out)
    assert drafter.block_noise == "uniform"
    ids = ck.tokenizer.encode("def main(")
    for passes in (1, 3):
        dd = DFlashDraft(drafter, target, Sampling(), capacity=256, passes=passes)
        got = [t for e in speculate(target, dd, ids, block_size=8, max_new_tokens=24) if hasattr(e, "tokens")
               for t in e.tokens]
        assert got == target_greedy(target, ids, 24, None)
        assert dd.forwards >= passes * 2  # every cycle ran its passes (at least two cycles)
    r = cli("train", "--objective", "ar", "--data", str(tiny_draft_data), "--block-noise", "uniform",
            "--max-steps", "1", "--out", str(tmp_path / "a"), "--quiet")
    assert r.returncode == 2 and "--block-noise applies to --objective dflash" in r.stderr
