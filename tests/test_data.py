"""Tokenizer round trips, corpora, deterministic disjoint splits, the token cache and packing."""

import json

import numpy as np
import pytest
import torch

from dlm.data.corpus import Corpus, split_of
from dlm.data.tokens import Batches, heldout_prompts, load_flags, load_tokens, token_file
from dlm.errors import DlmError
from dlm.tokenizer import SPECIALS, Tokenizer


@pytest.fixture(scope="module")
def tok(tokenizer_path):
    return Tokenizer.from_file(tokenizer_path)


TEXTS = [
    "", " ", "\n\n\t  \r\n", "def f(x):\n    return x ** 2\n", "héllo wörld — ünïcödé ✓ 😀 日本語",
    "<eos><mask><pad> are text here", "\x00\x01 control", "a" * 500, "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \u200b zero width",
]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_special_tokens_are_reserved_and_never_produced_by_text(tok):
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.mask_id) == (0, 1, 2, 3)
    assert tok.fill_id == SPECIALS.index("<fill>") and tok.fim_middle_id is not None
    ids = tok.encode("<eos> <mask> <fill> <pad>")
    assert not set(ids) & tok.special_ids


def test_any_hf_tokenizer_json_can_be_used(tok, tmp_path):
    # a tokenizer whose end token goes by another name, as GPT-2/Qwen tokenizers do
    data = json.loads(tok.to_json())
    for t in data["added_tokens"]:
        if t["content"] == "<eos>":
            t["content"] = "<|endoftext|>"
        if t["content"] in ("<mask>", "<pad>", "<bos>"):
            t["content"] = t["content"].replace("<", "<x")
    data["model"]["vocab"]["<|endoftext|>"] = data["model"]["vocab"].pop("<eos>")
    for name in ("<mask>", "<pad>", "<bos>"):
        data["model"]["vocab"][name.replace("<", "<x")] = data["model"]["vocab"].pop(name)
    p = tmp_path / "tokenizer.json"
    p.write_text(json.dumps(data))
    other = Tokenizer.from_file(p)
    assert other.eos_id == 2 and other.mask_id is None and other.pad_id == other.eos_id
    assert other.decode(other.encode("x = 1\n")) == "x = 1\n"


def test_bad_tokenizer_files(tmp_path):
    with pytest.raises(DlmError, match="not found"):
        Tokenizer.from_file(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DlmError, match="not a valid tokenizer"):
        Tokenizer.from_file(tmp_path / "bad.json")
    with pytest.raises(DlmError, match="vocab-size"):
        Tokenizer.train(["abc"], vocab_size=100)


def test_stdlib_splits_are_disjoint_deterministic_and_complete():
    c = Corpus("stdlib")
    names = [d.name for d in c.documents]
    assert len(names) > 300 and all(n.endswith(".py") for n in names)
    assert not any("/test/" in f"/{n}" or "site-packages" in n for n in names)
    splits = {s: {d.name for d in c.docs(s)} for s in ("train", "val", "test")}
    assert not splits["train"] & splits["val"] and not splits["train"] & splits["test"]
    assert not splits["val"] & splits["test"]
    assert splits["train"] | splits["val"] | splits["test"] == set(names)
    assert all(split_of(n) == "test" for n in splits["test"])
    assert splits == {s: {d.name for d in Corpus("stdlib").docs(s)} for s in splits}  # deterministic
    assert len(splits["test"]) >= 10 and len(splits["val"]) >= 10


def test_held_out_text_never_reaches_the_training_tokens(corpus_dir, tok):
    c = Corpus(str(corpus_dir))
    train = np.asarray(load_tokens(c, tok, "train"))
    held = c.docs("test")[0]
    probe = tok.encode(held.text)[:64]  # a long token sequence of a held-out file
    window = np.lib.stride_tricks.sliding_window_view(train, len(probe))
    assert not (window == np.asarray(probe)).all(axis=1).any()


def test_text_jsonl_and_folder_corpora(tmp_path, tok):
    lines = [f"line {i}: {'x' * (i % 7)}\n" for i in range(1000)]
    (tmp_path / "a.txt").write_text("".join(lines))
    c = Corpus(str(tmp_path / "a.txt"))
    assert len(c.documents) == 9 and "".join(d.text for d in c.documents) == "".join(lines)
    rows = [{"text": f"doc {i}\n" * 3} for i in range(40)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    j = Corpus(str(tmp_path / "d.jsonl"))
    assert len(j.documents) == 40 and j.docs("test") and j.docs("val")
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "x.py").write_text("print(1)\n")
    (folder / "y.bin").write_bytes(b"\x00\x01\x02")
    (folder / ".hidden").write_text("secret\n")
    assert [d.name for d in Corpus(str(folder)).documents] == ["x.py"]


def test_bad_corpora(tmp_path):
    with pytest.raises(DlmError, match="no such file"):
        Corpus(str(tmp_path / "nope"))
    (tmp_path / "empty.txt").write_text("   \n\n")
    with pytest.raises(DlmError, match="empty"):
        Corpus(str(tmp_path / "empty.txt"))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"txt": "no"}\n')
    with pytest.raises(DlmError, match="line 2"):
        Corpus(str(tmp_path / "bad.jsonl"))
    (tmp_path / "bad.jsonl").write_text('{"text": "ok", "prompt": "o"}\n{"text": "ok", "prompt": "no"}\n')
    with pytest.raises(DlmError, match="line 2: its 'prompt' must be a string that starts its 'text'"):
        Corpus(str(tmp_path / "bad.jsonl"))


def test_prompted_jsonl_flags_mark_the_response_tokens(tmp_path, tok):
    """A .jsonl with prompts (as `dlm distill` writes): prompt and response tokenized apart, and beside the
    tokens a flag per token, 1 on the response and its <eos>, 0 on the prompt; a row without a prompt is all
    response. The batches carry the flags of their own windows."""
    rows = [{"prompt": f"def f{i}(x):\n    y", "text": f"def f{i}(x):\n    y = x + {i}\n    return y\n"}
            for i in range(60)] + [{"text": "no prompt here\n"}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = Corpus(str(tmp_path / "d.jsonl"))
    assert c.prompted and c.kind == "jsonl"
    toks, flags = load_tokens(c, tok, "train"), load_flags(c, tok, "train")
    assert flags.dtype == np.uint8 and flags.shape == toks.shape
    pos = 0
    for d in c.docs("train"):
        pre, resp = tok.encode(d.text[:d.prompt_chars]) if d.prompt_chars else [], tok.encode(d.text[d.prompt_chars:])
        n = len(pre) + len(resp) + 1
        assert toks[pos:pos + n].tolist() == pre + resp + [tok.eos_id]
        assert flags[pos:pos + n].tolist() == [0] * len(pre) + [1] * (len(resp) + 1)
        pos += n
    assert pos == len(toks) and 0 < flags.mean() < 1
    b = Batches(toks, 16, 4, flags=flags)
    x, sup = b.batch_sup(3)
    assert sup.dtype == torch.bool and sup.shape == x.shape
    for row, f in zip(x, sup):  # each window's flags are its own tokens' (found by its position in the stream)
        i = next(i for i in range(b.n) if (b.window(i) == row.numpy()).all())
        assert f.tolist() == b.window(i, flags).astype(bool).tolist()
    assert load_flags(Corpus(str(tmp_path / "d.jsonl")), tok, "val") is not None
    (tmp_path / "plain.jsonl").write_text("".join(json.dumps({"text": r["text"]}) + "\n" for r in rows))
    assert load_flags(Corpus(str(tmp_path / "plain.jsonl")), tok, "train") is None


def test_token_cache_is_reused_and_documents_end_with_eos(corpus_dir, tok):
    c = Corpus(str(corpus_dir))
    a = load_tokens(c, tok, "val")
    path = token_file(c, tok, "val")
    mtime = path.stat().st_mtime_ns
    b = load_tokens(c, tok, "val")
    assert path.stat().st_mtime_ns == mtime and np.array_equal(a, b)
    assert int(a[-1]) == tok.eos_id
    assert int((np.asarray(a) == tok.eos_id).sum()) == len(c.docs("val"))


def test_batches_are_a_function_of_seed_and_step(corpus_dir, tok):
    arr = load_tokens(Corpus(str(corpus_dir)), tok, "train")
    b1, b2 = Batches(arr, 64, 4, seed=3), Batches(arr, 64, 4, seed=3)
    assert b1.batch(7).shape == (4, 65)
    assert np.array_equal(b1.batch(7), b2.batch(7))
    assert not np.array_equal(b1.batch(7), b1.batch(8))
    assert not np.array_equal(b1.batch(0), Batches(arr, 64, 4, seed=4).batch(0))
    with pytest.raises(DlmError, match="too few"):
        Batches(arr[:10], 64, 4)


def test_heldout_prompts_are_deterministic_and_held_out(corpus_dir):
    c = Corpus(str(corpus_dir))
    ps = heldout_prompts(c, n=3)
    assert ps == heldout_prompts(c, n=3)
    test_names = {d.name for d in c.docs("test")}
    assert ps and all(p.name.rsplit(":", 1)[0] in test_names for p in ps)
