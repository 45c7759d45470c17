"""Checkpoint folders: round trip, and a clear error naming the file for every kind of damage."""

import json
import shutil

import pytest
import torch

from dlm.checkpoint import export_dlm, load_model
from dlm.files import read_tensors
from dlm.errors import DlmError


@pytest.fixture
def ck_copy(tiny_ar, tmp_path):
    dst = tmp_path / "ck"
    shutil.copytree(tiny_ar, dst, ignore=shutil.ignore_patterns("state"))
    return dst


def test_loading_never_unpickles(ck_copy):
    head = (ck_copy / "model.safetensors").read_bytes()[:8]
    assert int.from_bytes(head, "little") < 10_000_000  # a safetensors header length, not a pickle/zip
    m, ck = load_model(ck_copy)
    assert not m.training and ck.tokenizer.vocab_size == m.cfg.vocab_size


@pytest.mark.parametrize("damage, message", [
    (lambda p: (p / "model.safetensors").unlink(), "model.safetensors: missing"),
    (lambda p: (p / "config.json").unlink(), "config.json: missing"),
    (lambda p: (p / "tokenizer.json").unlink(), "tokenizer.json: missing"),
    (lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:5000]),
     "model.safetensors: truncated or corrupt"),
    (lambda p: (p / "config.json").write_text("{broken"), "config.json: not valid JSON"),
    (lambda p: (p / "config.json").write_text(json.dumps(
        {**json.loads((p / "config.json").read_text()),
         "model": {**json.loads((p / "config.json").read_text())["model"], "dim": 96}})),
     "model.safetensors: tensor .* has shape"),
    (lambda p: (p / "config.json").write_text(json.dumps(
        {**json.loads((p / "config.json").read_text()),
         "model": {**json.loads((p / "config.json").read_text())["model"], "n_layers": 3}})),
     "model.safetensors: does not match"),
    (lambda p: (p / "tokenizer.json").write_text(
        (p / "tokenizer.json").read_text().replace('"<fill>"', '"<fil>"')), "tokenizer.json: does not match"),
])
def test_damaged_checkpoints_name_the_file(ck_copy, damage, message):
    damage(ck_copy)
    with pytest.raises(DlmError, match=message):
        load_model(ck_copy)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(DlmError, match="not found"):
        load_model(tmp_path / "missing")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(DlmError, match="dlm import --hf"):
        load_model(tmp_path / "hf")


def test_export_dlm_half_precision(ck_copy, tmp_path):
    m, ck = load_model(ck_copy)
    export_dlm(m, ck, tmp_path / "half", torch.float16)
    assert all(t.dtype == torch.float16 for t in read_tensors(tmp_path / "half" / "model.safetensors").values())
    m2, _ = load_model(tmp_path / "half")
    x = torch.randint(0, m.cfg.vocab_size, (1, 16))
    with torch.no_grad():
        assert (m(x).logits - m2(x).logits).abs().max() < 0.05
    assert (tmp_path / "half" / "metrics.jsonl").exists()
