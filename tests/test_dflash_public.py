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
from dlm.sampling.speculative import Sampling, _taps, load_drafter, speculate  # noqa: E402

CK = Path(__file__).resolve().parents[1] / "checkpoints"
PROMPTS = ["def read_config(path):\n    ", "import os\nimport sys\n\n", "class Stack:\n    def push(self, item):\n        "]


@pytest.fixture(autouse=True)
def _cpu_clock(monkeypatch):
    # dflash_generate(return_stats=True) times itself with torch.cuda.synchronize(); on a CPU: the plain clock
    monkeypatch.setattr(dflash_model, "_cuda_time", time.perf_counter)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def reference(draft_dir: Path, target_dir: Path, ids: list[int], n: int, eos: int, block: int):
    tgt = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    dft = dflash_model.DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32).eval()
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
                          ({"architectures": ["DFlash2DraftModel"]}, "DFlash 2")]:
        (tmp_path / "d" / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(DlmError, match=match):
            import_hf(tmp_path / "d", tmp_path / "x3", target=tmp_path / "t-dlm")
    assert not (tmp_path / "x3").exists()  # nothing half-written
