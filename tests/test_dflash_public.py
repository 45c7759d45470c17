"""Public DFlash drafters (z-lab's layout) against the reference: the `dflash` package's DFlashDraftModel and its
`dflash_generate`, on a transformers Qwen3 target. Both directions: a drafter built by the package (random weights)
imported into dlm, and dlm's trained drafter exported and run by the package. Equal tokens and equal acceptance
lengths, cycle for cycle, at T = 0; equal drafter logits."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch

dflash_model = pytest.importorskip("dflash.model")
transformers = pytest.importorskip("transformers")

from dlm.checkpoint import load_model  # noqa: E402
from dlm.cli import main  # noqa: E402
from dlm.errors import DlmError  # noqa: E402
from dlm.hf import import_hf  # noqa: E402
from dlm.sampling.common import Commit  # noqa: E402
from dlm.drafters import load_drafter  # noqa: E402
from dlm.sampling.speculative import Sampling, _taps, speculate  # noqa: E402

CK = Path(__file__).resolve().parents[1] / "checkpoints"
PROMPTS = ["def read_config(path):\n    ", "import os\nimport sys\n\n", "class Stack:\n    def push(self, item):\n        "]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def _cpu_clock(monkeypatch):
    # dflash_generate(return_stats=True) times itself with torch.cuda.synchronize(); on a CPU: the plain clock
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)


def reference(draft_dir: Path, target_dir: Path, ids: list[int], n: int, eos: int, block: int, v2: bool = False):
    tgt = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    cls = dflash_model.DFlash2DraftModel if v2 else dflash_model.DFlashDraftModel
    dft = cls.from_pretrained(draft_dir, dtype=torch.float32).eval()
    res = dflash_model.dflash_generate(dft, tgt, torch.tensor([ids]), n, [eos], block_size=block, return_stats=True)
    return res.output_ids[0, len(ids):].tolist(), res.acceptance_lengths


def ours(target_ck: Path, draft_ck: Path, ids: list[int], n: int, block: int):
    m, ck = load_model(target_ck)
    drafter = load_drafter(str(draft_ck), m, ck, Sampling())
    out, acc = [], []
    for ev in speculate(m, drafter, ids, block_size=block, max_new_tokens=n, eos_id=ck.tokenizer.eos_id):
        if isinstance(ev, Commit):
            if out:  # the prefill's token is no cycle
                acc.append(len(ev.tokens))
            out += ev.tokens
    return out, acc


def test_a_dlm_trained_drafter_exported_runs_exactly_in_the_reference(tmp_path):
    main(["export", "--model", str(CK / "ar-small"), "--format", "hf", "--out", str(tmp_path / "target")])
    main(["export", "--model", str(CK / "dflash-small"), "--format", "hf", "--out", str(tmp_path / "draft")])
    _, ck = load_model(CK / "ar-small")
    tok = ck.tokenizer
    accepted = 0
    for text in PROMPTS:
        ids = tok.encode(text)
        ref_tokens, ref_acc = reference(tmp_path / "draft", tmp_path / "target", ids, 48, tok.eos_id, 8)
        got_tokens, got_acc = ours(CK / "ar-small", CK / "dflash-small", ids, 48, 8)
        assert got_tokens == ref_tokens and got_acc == ref_acc
        accepted += sum(ref_acc) - len(ref_acc)
    assert accepted > 10  # a trained drafter: the comparison covers accepted drafts, not only rejections
    # and back: the exported folder imports to the same tensors, bit for bit
    main(["import", "--hf", str(tmp_path / "draft"), "--target", str(CK / "ar-small"), "--out", str(tmp_path / "back")])
    a, _ = load_model(CK / "dflash-small")
    b, _ = load_model(tmp_path / "back")
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def tiny_target(folder: Path) -> None:
    """A random Qwen3 built by transformers, with the shipped tokenizer (its vocabulary size)."""
    _, ck = load_model(CK / "ar-small")
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=ck.tokenizer.vocab_size, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256, tie_word_embeddings=True, rms_norm_eps=1e-6,
                                   initializer_range=0.2)
    transformers.Qwen3ForCausalLM(cfg).eval().save_pretrained(folder)
    shutil.copy(CK / "ar-small" / "tokenizer.json", folder / "tokenizer.json")


def tiny_drafter(folder: Path, mask_id: int, vocab: int, **numerics) -> None:
    """A random DFlash drafter built by the dflash package's own class."""
    torch.manual_seed(1)
    cfg = transformers.Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.2,
                                   architectures=["DFlashDraftModel"], num_target_layers=4, block_size=8,
                                   dflash_config={"target_layer_ids": [1, 3], "mask_token_id": mask_id,
                                                  "block_size": 8, **numerics})
    dflash_model.DFlashDraftModel(cfg).eval().save_pretrained(folder)


@pytest.mark.parametrize("numerics", [{}, {"input_embedding_scale": 1.5, "output_multiplier": 0.8,
                                           "final_logit_softcapping": 4.0}], ids=["plain", "scaled"])
def test_a_reference_drafter_imports_and_runs_exactly(tmp_path, numerics):
    tiny_target(tmp_path / "t")
    _, ck = load_model(CK / "ar-small")
    tok = ck.tokenizer
    tiny_drafter(tmp_path / "d", tok.mask_id, tok.vocab_size, **numerics)
    import_hf(tmp_path / "t", tmp_path / "t-dlm")
    import_hf(tmp_path / "d", tmp_path / "d-dlm", target=tmp_path / "t-dlm")
    # the drafter's logits for one block after a context, both ways
    tgt = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "t", dtype=torch.float32).eval()
    dft = dflash_model.DFlashDraftModel.from_pretrained(tmp_path / "d", dtype=torch.float32).eval()
    ids = tok.encode(PROMPTS[0])
    P, B = len(ids), 8
    with torch.inference_mode():
        out = tgt(torch.tensor([ids]), output_hidden_states=True)
        hidden = dflash_model.extract_context_feature(out.hidden_states, dft.target_layer_ids)
        block = torch.full((1, B), tok.mask_id)
        block[0, 0] = int(out.logits[0, -1].argmax())
        emb = torch.nn.functional.embedding(block, tgt.get_input_embeddings().weight) * numerics.get(
            "input_embedding_scale", 1.0)
        h = dft(target_hidden=hidden, noise_embedding=emb, position_ids=torch.arange(P + B)[None])
        want = dft.compute_logits(h[:, 1:], tgt.lm_head)[0]
        m, mck = load_model(tmp_path / "t-dlm")
        drafter = load_drafter(str(tmp_path / "d-dlm"), m, mck, Sampling())
        seq = torch.tensor(ids + [int(block[0, 0])])
        drafter.reset(seq[:P], _taps(m(seq[None, :P], taps=drafter.taps), drafter.taps))
        got = drafter.logits(seq, B - 1)
    assert torch.allclose(got.float(), want.float(), atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    # the whole loop: the same tokens and acceptance lengths as dflash_generate
    for text in PROMPTS:
        ids = tok.encode(text)
        assert ours(tmp_path / "t-dlm", tmp_path / "d-dlm", ids, 32, 8) == \
            reference(tmp_path / "d", tmp_path / "t", ids, 32, tok.eos_id, 8)
    # export writes the reference layout back: the same config entries and tensors
    main(["export", "--model", str(tmp_path / "d-dlm"), "--format", "hf", "--out", str(tmp_path / "d2")])
    c1, c2 = (json.loads((tmp_path / x / "config.json").read_text()) for x in ("d", "d2"))
    assert c2["dflash_config"] == c1["dflash_config"] and c2["architectures"] == ["DFlashDraftModel"]
    from safetensors.torch import load_file

    w1, w2 = load_file(tmp_path / "d" / "model.safetensors"), load_file(tmp_path / "d2" / "model.safetensors")
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)


def test_bad_drafter_folders_are_one_line(tmp_path):
    tiny_target(tmp_path / "t")
    _, ck = load_model(CK / "ar-small")
    tiny_drafter(tmp_path / "d", ck.tokenizer.mask_id, ck.tokenizer.vocab_size)
    import_hf(tmp_path / "t", tmp_path / "t-dlm")
    with pytest.raises(DlmError, match="give --target"):
        import_hf(tmp_path / "d", tmp_path / "x1")
    with pytest.raises(DlmError, match="hidden size 64 differs from the target's 256"):
        import_hf(tmp_path / "d", tmp_path / "x2", target=CK / "ar-small")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    for change, match in [({"dflash_config": {**cfg["dflash_config"], "target_layer_ids": [1, 9]}}, "not layers"),
                          ({"num_target_layers": 6}, "target of 6 layers"),
                          ({"layer_types": ["sliding_attention"] * 2}, "sliding-window"),
                          ({"architectures": ["DFlash2DraftModel"]}, "does not match its config.json")]:
        (tmp_path / "d" / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(DlmError, match=match):
            import_hf(tmp_path / "d", tmp_path / "x3", target=tmp_path / "t-dlm")
    assert not (tmp_path / "x3").exists()  # nothing half-written


# DFlash 2: the convolutions and the candidate selector ------------------------------------------------------

def tiny_drafter2(folder: Path, mask_id: int, vocab: int) -> None:
    """A random DFlash 2 drafter built by the dflash package's DFlash2DraftModel, saved in the public layout (the
    selector's codebooks without `.weight`); convolutions away from the identity, a non-zero successor codebook."""
    from safetensors.torch import save_file

    torch.manual_seed(2)
    cfg = transformers.Qwen3Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.2,
                                   architectures=["DFlash2DraftModel"], num_target_layers=4, block_size=8,
                                   dflash_config={"target_layer_ids": [1, 3], "mask_token_id": mask_id, "block_size": 8,
                                                  "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8,
                                                  "selector_top_k": 6})
    m = dflash_model.DFlash2DraftModel(cfg).eval()
    with torch.no_grad():
        for layer in m.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.copy_(torch.randn_like(conv.base_kernel) * 0.3 + 0.7)
                conv.kernel_projection.weight.normal_(0, 0.05)
        sel = m.candidate_selector
        for p in (sel.predecessor_codebook.weight, sel.successor_codebook.weight, sel.hidden_projection.weight):
            p.normal_(0, 1.0)
    m.save_pretrained(folder)
    w = {k.removesuffix(".weight") if "codebook" in k else k: v.contiguous()
         for k, v in m.state_dict().items() if "rotary" not in k}
    save_file(w, folder / "model.safetensors", metadata={"format": "pt"})


def test_a_reference_dflash2_drafter_imports_and_runs_exactly(tmp_path, monkeypatch):
    tiny_target(tmp_path / "t")
    _, ck = load_model(CK / "ar-small")
    tok = ck.tokenizer
    tiny_drafter2(tmp_path / "d", tok.mask_id, tok.vocab_size)
    import_hf(tmp_path / "t", tmp_path / "t-dlm")
    import_hf(tmp_path / "d", tmp_path / "d-dlm", target=tmp_path / "t-dlm")
    tgt = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "t", dtype=torch.float32).eval()
    dft = dflash_model.DFlash2DraftModel.from_pretrained(tmp_path / "d", dtype=torch.float32).eval()
    assert float(dft.candidate_selector.successor_codebook.weight.detach().abs().sum()) > 0  # the public names loaded
    ids = tok.encode(PROMPTS[2])
    P, B = len(ids), 8
    with torch.inference_mode():
        out = tgt(torch.tensor([ids]), output_hidden_states=True)
        hidden = dflash_model.extract_context_feature(out.hidden_states, dft.target_layer_ids)
        anchor = int(out.logits[0, -1].argmax())
        block = torch.full((1, B), tok.mask_id)
        block[0, 0] = anchor
        emb = torch.nn.functional.embedding(block, tgt.get_input_embeddings().weight)
        h = dft(target_hidden=hidden, noise_embedding=emb, position_ids=torch.arange(P + B)[None])[:, 1:]
        want_logits = dft.compute_logits(h, tgt.lm_head)[0]
        want_tokens, _, _ = dft.propose(h, block[:, 0], tgt.lm_head, 0.0)
        m, mck = load_model(tmp_path / "t-dlm")
        drafter = load_drafter(str(tmp_path / "d-dlm"), m, mck, Sampling())
        seq = torch.tensor(ids + [anchor])
        drafter.reset(seq[:P], _taps(m(seq[None, :P], taps=drafter.taps), drafter.taps))
        got_tokens, q = drafter.propose(seq, B - 1)
        # the slot-by-slot walk (what dlm runs above WALK_ABOVE candidates) picks the package's path too
        import dlm.drafter

        with monkeypatch.context() as mp:
            mp.setattr(dlm.drafter, "WALK_ABOVE", 0)
            drafter.reset(seq[:P], _taps(m(seq[None, :P], taps=drafter.taps), drafter.taps))
            walked, _ = drafter.propose(seq, B - 1)
    assert torch.equal(got_tokens, want_tokens[0]) and q is None
    assert torch.equal(walked, want_tokens[0])
    # the selector changed the draft: a DFlash 1 reading of the same logits (each slot's argmax) differs
    assert not torch.equal(want_logits.argmax(-1), want_tokens[0])
    for text in PROMPTS:
        ids = tok.encode(text)
        assert ours(tmp_path / "t-dlm", tmp_path / "d-dlm", ids, 32, 8) == \
            reference(tmp_path / "d", tmp_path / "t", ids, 32, tok.eos_id, 8, v2=True)
    # export: the public DFlash 2 layout, loadable by the package, the same tensors
    main(["export", "--model", str(tmp_path / "d-dlm"), "--format", "hf", "--out", str(tmp_path / "d2")])
    c1, c2 = (json.loads((tmp_path / x / "config.json").read_text()) for x in ("d", "d2"))
    assert c2["architectures"] == ["DFlash2DraftModel"] and c2["dflash_config"] == c1["dflash_config"]
    from safetensors.torch import load_file

    w1, w2 = load_file(tmp_path / "d" / "model.safetensors"), load_file(tmp_path / "d2" / "model.safetensors")
    assert w1.keys() == w2.keys() and all(torch.equal(w1[k], w2[k]) for k in w1)
    again = dflash_model.DFlash2DraftModel.from_pretrained(tmp_path / "d2", dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), dft.state_dict().values()))


def test_dflash2_starts_as_the_dflash1_drafter_it_grows_from():
    from dlm.config import ModelConfig
    from dlm.drafter import DFlashDrafter

    cfg = ModelConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=64)
    torch.manual_seed(0)
    d1 = DFlashDrafter(cfg, [0, 1], 8, 3)
    d2 = DFlashDrafter(cfg, [0, 1], 8, 3, conv_kernel_size=2, conv_group_size=8, selector_rank=4, selector_top_k=5)
    missing = d2.load_state_dict(d1.state_dict(), strict=False).missing_keys
    assert missing and all("conv" in k or "candidate_selector" in k for k in missing)
    x, ctx = torch.randn(1, 8, 32), torch.randn(1, 5, 32)
    pos, cpos = torch.arange(5, 13), torch.arange(5)
    with torch.no_grad():
        assert torch.equal(d1(x, ctx, pos, cpos), d2(x, ctx, pos, cpos))  # identity convolutions
        h = d2(x, ctx, pos, cpos)
        logits = torch.randn(1, 7, 50)
        tokens, _, _ = d2.candidate_selector.select(h[:, 1:], logits, torch.tensor([4]), 0.0, None)
    assert torch.equal(tokens[0], logits[0].argmax(-1))  # zero successor codebook: each slot's argmax


def test_the_selector_walk_chooses_as_its_table(monkeypatch):
    """Many candidates (--draft-top-k) are scored slot by slot, only the row the walk reads; the choices, the draws
    and q are the table's, greedy and at T > 0, with the trained number of candidates and with more."""
    import dlm.drafter as drafter
    from dlm.drafter import CandidateSelector

    torch.manual_seed(0)
    sel = CandidateSelector(300, 32, rank=8, top_k=16)
    with torch.no_grad():
        sel.successor_codebook.weight.normal_(0, 1.0)
    h, logits, anchor = torch.randn(3, 7, 32), torch.randn(3, 7, 300) * 2, torch.tensor([1, 5, 9])
    for top_k in (None, 64):
        for t in (0.0, 1.0):
            monkeypatch.setattr(drafter, "WALK_ABOVE", 10**6)
            a = sel.select(h, logits, anchor, t, torch.Generator().manual_seed(3), top_k)
            monkeypatch.setattr(drafter, "WALK_ABOVE", 0)
            b = sel.select(h, logits, anchor, t, torch.Generator().manual_seed(3), top_k)
            assert a[1].shape[-1] == (top_k or 16)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
            if t == 0:
                assert a[2] is None and b[2] is None
            else:
                torch.testing.assert_close(a[2], b[2], rtol=0, atol=1e-6)
                torch.testing.assert_close(b[2].sum(-1), torch.ones(3, 7))
    # the wider candidate set changes the draws at T > 0 (more of the vocabulary can be proposed)
    narrow = sel.select(h, logits, anchor, 1.0, torch.Generator().manual_seed(4))[0]
    wide = sel.select(h, logits, anchor, 1.0, torch.Generator().manual_seed(4), 256)[0]
    assert not torch.equal(narrow, wide)


@pytest.mark.parametrize("top_k", [None, 6])
def test_the_selector_q_keeps_speculative_sampling_exact(top_k, monkeypatch):
    """At T > 0 the verifier reads the selector's q over the candidates (zero elsewhere): the first emitted token
    follows the target's p exactly, with the trained 3 candidates (the table) and with 6 (--draft-top-k: the walk);
    reading the slot's softmax instead (the DFlash 1 q) does not."""
    from test_verifier import assert_follows, chi_square

    from dlm.drafter import CandidateSelector
    from dlm.sampling.speculative import verify_sample

    torch.manual_seed(0)
    V, D = 8, 6
    sel = CandidateSelector(V, D, rank=3, top_k=3)
    with torch.no_grad():
        for w in sel.parameters():
            w.normal_(0, 1.5)
    h, logits, anchor = torch.randn(1, 2, D), torch.randn(1, 2, V) * 2, torch.tensor([5])
    p = torch.softmax(torch.randn(3, V), -1)  # the target's distributions at the two slots and the bonus
    gen = torch.Generator().manual_seed(0)
    n = 12000
    right, wrong = torch.zeros(V), torch.zeros(V)
    import dlm.drafter as drafter

    monkeypatch.setattr(drafter, "WALK_ABOVE", 4)  # 6 candidates take the walk
    for _ in range(n):
        tokens, cands, q = sel.select(h, logits, anchor, 1.0, gen, top_k)
        dense = torch.zeros(2, V).scatter_(-1, cands[0], q[0])
        k, bonus = verify_sample(tokens[0], p, dense, gen)
        right[int(tokens[0, 0]) if k > 0 else bonus] += 1
        k, bonus = verify_sample(tokens[0], p, torch.softmax(logits[0], -1), gen)
        wrong[int(tokens[0, 0]) if k > 0 else bonus] += 1
    assert_follows(right, p[0], "selector q")
    stat, dof = chi_square(wrong, p[0])
    assert stat > 50  # the DFlash 1 q is not the selector's proposal distribution: the output drifts


# DFlash 2 grown from a trained trunk ----------------------------------------------------------------------------

THIRD_PARTY = PROMPTS + ["def fibonacci(n):\n    ", "import json\n\ndef load(path):\n",
                         "class Node:\n    def __init__(self):\n", "for key, value in items.items():\n    ",
                         "# sort the list in place\n", "while True:\n    line = "]


@pytest.fixture(scope="module")
def trunk(tmp_path_factory):
    """ar-small and dflash-small exported to the public layouts (the target, and the DFlash 1 trunk a DFlash 2
    drafter is grown from), the target imported back."""
    d = tmp_path_factory.mktemp("trunk")
    main(["export", "--model", str(CK / "ar-small"), "--format", "hf", "--out", str(d / "t")])
    main(["export", "--model", str(CK / "dflash-small"), "--format", "hf", "--out", str(d / "d1")])
    import_hf(d / "t", d / "t-dlm")
    return d


def grown_drafter2(trunk: Path, folder: Path, seed: int, conv: float, selector: float) -> None:
    """A DFlash 2 drafter built by the package's DFlash2DraftModel from dflash-small's trained trunk: convolutions at
    the identity plus noise of scale `conv`, a selector of random codebooks of scale `selector` (public layout)."""
    from safetensors.torch import load_file, save_file

    c = json.loads((trunk / "d1" / "config.json").read_text())
    c["architectures"] = ["DFlash2DraftModel"]
    c["dflash_config"].update(conv_kernel_size=2, conv_group_size=32, selector_rank=16, selector_top_k=8)
    c.pop("model_type")
    torch.manual_seed(seed)
    m = dflash_model.DFlash2DraftModel(transformers.Qwen3Config(**c)).eval()
    missing = m.load_state_dict(load_file(trunk / "d1" / "model.safetensors"), strict=False).missing_keys
    assert missing and all("_conv." in k or "candidate_selector." in k for k in missing)
    with torch.no_grad():
        for layer in m.layers:
            for cv in (layer.attention_conv, layer.mlp_conv):
                cv.base_kernel.zero_()
                cv.base_kernel[:, 0] = 1.0  # (the identity)
                cv.base_kernel.add_(torch.randn_like(cv.base_kernel) * conv)
                cv.kernel_projection.weight.normal_(0, conv / 4)
        sel = m.candidate_selector
        for p in (sel.predecessor_codebook.weight, sel.successor_codebook.weight, sel.hidden_projection.weight):
            p.normal_(0, selector)
    m.save_pretrained(folder)
    w = {k.removesuffix(".weight") if "codebook" in k else k: v.contiguous()
         for k, v in m.state_dict().items() if "rotary" not in k}
    save_file(w, folder / "model.safetensors", metadata={"format": "pt"})


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=4, deadline=None, derandomize=True, database=None)
@example(seed=2, conv=0.05, selector=0.3, prompt=0, n=48)  # found: its last block was drafted one slot short
@example(seed=2, conv=0.05, selector=0.3, prompt=2, n=48)
@given(seed=st.integers(0, 2 ** 16), conv=st.sampled_from([0.02, 0.05, 0.1]), selector=st.sampled_from([0.1, 0.3]),
       prompt=st.integers(0, len(THIRD_PARTY) - 1), n=st.integers(9, 40))
def test_a_grown_dflash2_drafter_accepts_as_dflash_generate(trunk, tmp_path_factory, seed, conv, selector, prompt, n):
    """Imported with --target, a DFlash 2 drafter grown from dflash-small (convolutions and selector off their
    identity) accepts, cycle for cycle, what the package's dflash_generate accepts, the last block (which ends
    where --max-new-tokens does) included; the tokens are the target's."""
    d = tmp_path_factory.mktemp("d2")
    grown_drafter2(trunk, d / "hf", seed, conv, selector)
    import_hf(d / "hf", d / "dlm", target=trunk / "t-dlm")
    ids = load_model(trunk / "t-dlm")[1].tokenizer.encode(THIRD_PARTY[prompt])
    got = ours(trunk / "t-dlm", d / "dlm", ids, n, 8)
    want = reference(d / "hf", trunk / "t", ids, n, 2, 8, v2=True)
    assert got == want and (len(got[0]) == n or got[0][-1] == 2)
