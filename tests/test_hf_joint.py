"""Nemotron-Labs-Diffusion (`ministral_dlm`, `sbd_block_diff`) imported as a dlm joint checkpoint: a tiny random
Ministral 3 built by transformers, saved in the released layout (weights under `encoder.` and `diffusion_head.`,
the diffusion keys in config.json). The AR mode is held against transformers' Ministral3ForCausalLM on the same
weights (YaRN past the original context, the queries' temperature); the diffusion and self-speculation modes decode;
the export is the same folder again."""

import json

import pytest
import torch

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import Ministral3Config, Ministral3ForCausalLM  # noqa: E402

from conftest import cli  # noqa: E402
from dlm.checkpoint import load_model  # noqa: E402
from dlm.sampling import SampleConfig, generate  # noqa: E402
from test_hf_gemma import save_tokenizer  # noqa: E402

ROPE = dict(rope_type="yarn", rope_theta=1e6, factor=16.0, original_max_position_embeddings=8, beta_fast=32.0,
            beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1)


def nemotron_folder(tmp_path, **extra):
    """A tiny model in the released Nemotron-Labs-Diffusion layout, and transformers' Ministral 3 of the same
    weights."""
    c = Ministral3Config(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, max_position_embeddings=256, rope_parameters=dict(ROPE),
                         tie_word_embeddings=False, rms_norm_eps=1e-5, eos_token_id=1, bos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    m = Ministral3ForCausalLM(c).eval()
    with torch.no_grad():
        for t in m.parameters():
            t.normal_(0, 0.3) if t.dim() > 1 else t.uniform_(0.5, 1.5)
    src = tmp_path / "nld"
    src.mkdir(parents=True)
    hf = {**c.to_dict(), "model_type": "ministral_dlm", "architectures": ["MinistralDiffEncoderModel"],
          "auto_map": {"AutoModel": "modeling_ministral_dlm.MinistralDiffEncoderModel"},
          "dlm_paradigm": "sbd_block_diff", "dlm_type": "llada", "mask_token_id": 4, "block_size": 8, **extra}
    (src / "config.json").write_text(json.dumps(hf))
    (src / "modeling_ministral_dlm.py").write_text("# the remote code (kept beside the weights)\n")
    weights = {("diffusion_head.weight" if k == "lm_head.weight" else "encoder." + k.removeprefix("model.")): v
               for k, v in m.state_dict().items()}
    save_file({k: v.contiguous() for k, v in weights.items()}, src / "model.safetensors")
    save_tokenizer(src)
    return src, m


def test_import_ar_mode_matches_transformers_and_the_modes_decode(tmp_path):
    src, m = nemotron_folder(tmp_path)
    cli("import", "--hf", str(src), "--out", str(tmp_path / "ck"), check=True)
    net, ck = load_model(str(tmp_path / "ck"))
    assert ck.objective == "joint" and ck.mask_id == 4 and ck.block_size == 8
    assert ck.config["family"] == "nemotron-labs-diffusion" and (tmp_path / "ck" / "modeling_ministral_dlm.py").exists()
    ids = torch.randint(5, 97, (2, 40), generator=torch.Generator().manual_seed(1))  # past the original context (8)
    with torch.no_grad():
        torch.testing.assert_close(net(ids).logits, m(ids).logits, atol=1e-4, rtol=1e-4)  # the AR mode
    prompt = "a b c d e f g h i"
    ar = generate(net, ck, prompt, SampleConfig(max_new_tokens=20, sampler="ar")).text
    for sampler, block in (("self-spec-linear", 8), ("self-spec-quadratic", 4)):  # lossless: the AR mode's tokens
        got = generate(net, ck, prompt, SampleConfig(max_new_tokens=20, sampler=sampler, block_size=block)).text
        assert got == ar, sampler
    out = generate(net, ck, prompt, SampleConfig(max_new_tokens=16, sampler="threshold", threshold=0.9))
    assert out.stats.new_tokens > 0 and "<mask>" not in out.text


def test_export_is_the_same_folder_and_bad_folders_are_refused(tmp_path):
    src, _ = nemotron_folder(tmp_path)
    cli("import", "--hf", str(src), "--out", str(tmp_path / "ck"), check=True)
    cli("export", "--model", str(tmp_path / "ck"), "--format", "hf", "--out", str(tmp_path / "back"), check=True)
    a, b = load_file(src / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    want, got = json.loads((src / "config.json").read_text()), json.loads((tmp_path / "back" / "config.json").read_text())
    assert {k: v for k, v in got.items() if k not in ("torch_dtype", "dtype")} == \
        {k: v for k, v in want.items() if k not in ("torch_dtype", "dtype")}
    assert (tmp_path / "back" / "modeling_ministral_dlm.py").exists()
    for i, (extra, needle) in enumerate((({"dlm_paradigm": "bidirectional"}, "dlm_paradigm 'bidirectional'"),
                                         ({"dlm_type": "dream"}, "dlm_type 'dream'"),
                                         ({"mask_token_id": 500}, "outside the vocabulary"))):
        bad, _ = nemotron_folder(tmp_path / f"bad{i}", **extra)
        code, _, err = cli("import", "--hf", str(bad), "--out", str(tmp_path / "x"))
        assert code == 2
        assert needle in err and len(err.strip().splitlines()) == 1 and not (tmp_path / "x").exists()


def test_an_imported_model_evaluates_its_ar_mode_as_transformers_scores_it(tmp_path):
    """`dlm eval` of the imported joint checkpoint reports its AR mode's held-out perplexity (library and CLI), and
    that mode's next-token cross-entropy on a sequence equals transformers' Ministral3ForCausalLM's."""
    from dlm.data.corpus import Corpus
    from dlm.evaluate import evaluate

    src, m = nemotron_folder(tmp_path)
    cli("import", "--hf", str(src), "--out", str(tmp_path / "ck"), check=True)
    net, ck = load_model(str(tmp_path / "ck"))
    data = tmp_path / "docs"
    data.mkdir()
    for i in range(12):
        (data / f"{i}.txt").write_text(" ".join("abcdefghij"[(i * j) % 10] for j in range(60)))
    res = evaluate(net, ck, Corpus(str(data)), "test", seq_len=32, batch_size=2)
    assert res["tokens"] > 0 and res["ar_mode_perplexity"] > 1
    ids = torch.tensor([ck.tokenizer.encode(" ".join("abcdefghij"[j % 10] for j in range(40)))])
    with torch.no_grad():
        want = torch.nn.functional.cross_entropy(m(ids).logits[0, :-1], ids[0, 1:])
        got = torch.nn.functional.cross_entropy(net(ids).logits[0, :-1], ids[0, 1:])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    out = cli("eval", "--model", str(tmp_path / "ck"), "--data", str(data), "--split", "test", "--seq-len", "32",
              "--json", check=True).stdout
    assert "ar_mode_perplexity" in out


def test_the_newer_folders_nemotron_labs_diffusion_import_and_export_as_they_are(tmp_path):
    """The newer folders (model_type nemotron_labs_diffusion, NemotronLabsDiffusionModel, dlm_paradigm bidirectional as
    they ship, block_diff as trained): the same weights and keys; the export keeps their model_type, architecture and
    paradigm; a paradigm of the other generation is refused."""
    new = {"model_type": "nemotron_labs_diffusion", "architectures": ["NemotronLabsDiffusionModel"],
           "auto_map": {"AutoModel": "modeling_nemotron_labs_diffusion.NemotronLabsDiffusionModel"}}
    for i, paradigm in enumerate(("bidirectional", "block_diff")):
        src, m = nemotron_folder(tmp_path / f"n{i}", **new, dlm_paradigm=paradigm)
        cli("import", "--hf", str(src), "--out", str(tmp_path / f"ck{i}"), check=True)
        net, ck = load_model(str(tmp_path / f"ck{i}"))
        assert ck.objective == "joint" and ck.config["family"] == "nemotron-labs-diffusion" and ck.mask_id == 4
        ids = torch.randint(5, 97, (1, 20), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            torch.testing.assert_close(net(ids).logits, m(ids).logits, atol=1e-4, rtol=1e-4)
        cli("export", "--model", str(tmp_path / f"ck{i}"), "--format", "hf", "--out", str(tmp_path / f"back{i}"),
            check=True)
        got = json.loads((tmp_path / f"back{i}" / "config.json").read_text())
        assert (got["model_type"], got["architectures"], got["dlm_paradigm"]) == \
            ("nemotron_labs_diffusion", ["NemotronLabsDiffusionModel"], paradigm)
    bad, _ = nemotron_folder(tmp_path / "bad", **new, dlm_paradigm="sbd_block_diff")
    code, _, err = cli("import", "--hf", str(bad), "--out", str(tmp_path / "x"))
    assert code == 2 and "dlm_paradigm 'sbd_block_diff'" in err and len(err.strip().splitlines()) == 1
