"""The training loop: metrics, checkpoints, exact resume after kill -9, refusals that leave nothing behind."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import tiny_train_config
from dlm.checkpoint import load_model, open_checkpoint
from dlm.trainstate import find_state
from dlm.errors import DlmError
from dlm.config import TrainConfig
from dlm.train import lr_at, train


def rows(path):
    return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]


def test_metrics_and_checkpoint_files(tiny_ar):
    r = rows(tiny_ar)
    train_rows = [x for x in r if "loss" in x]
    val_rows = [x for x in r if "val_loss" in x]
    assert {"step", "loss", "lr", "tokens_per_second"} <= set(train_rows[0])
    assert [x["step"] for x in val_rows] == [60, 120]
    assert val_rows[-1]["val_loss"] < val_rows[0]["val_loss"]
    assert train_rows[-1]["loss"] < train_rows[0]["loss"] - 0.5
    assert {p.name for p in tiny_ar.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json",
                                                    "metrics.jsonl", "state"}
    assert not list(tiny_ar.glob("*.tmp")) and not list(tiny_ar.glob(".*tmp"))
    ck = open_checkpoint(tiny_ar)
    assert ck.objective == "ar" and ck.config["step"] == 120 and ck.config["train"]["seq_len"] == 128
    st = find_state(tiny_ar)
    assert st is not None and {p.name for p in st.iterdir()} == {
        "model.safetensors", "optimizer.safetensors", "optimizer.json", "trainer.json"}


def test_lr_schedule():
    cfg = TrainConfig(lr=1.0, max_steps=100, warmup=0.1, min_lr_ratio=0.1)
    assert lr_at(cfg, 0) == pytest.approx(0.1) and lr_at(cfg, 9) == pytest.approx(1.0)
    assert lr_at(cfg, 10) == pytest.approx(1.0) and lr_at(cfg, 99) == pytest.approx(0.1, abs=1e-3)
    assert all(lr_at(cfg, s) >= lr_at(cfg, s + 1) for s in range(10, 99))


def _cli_train(out, corpus_dir, tokenizer_path, extra=()):
    return [sys.executable, "-m", "dlm.cli", "train", "--objective", "ar", "--preset", "tiny", "--data",
            str(corpus_dir), "--tokenizer", str(tokenizer_path), "--seq-len", "64", "--batch-size", "4",
            "--max-steps", "40", "--save-every", "10", "--eval-every", "20", "--eval-batches", "1",
            "--log-every", "1", "--seed", "5", "--out", str(out), "--quiet", *extra]


def test_resume_after_kill_9_continues_exactly(corpus_dir, tokenizer_path, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ref = tmp_path / "ref"
    subprocess.run(_cli_train(ref, corpus_dir, tokenizer_path), check=True, env=env, capture_output=True)
    run = tmp_path / "run"
    proc = subprocess.Popen(_cli_train(run, corpus_dir, tokenizer_path), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:
        if (run / "metrics.jsonl").exists() and any(r.get("step", 0) >= 23 for r in rows(run)):
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = max(r["step"] for r in rows(run))
    assert 23 <= killed_at < 40, killed_at
    subprocess.run(_cli_train(run, corpus_dir, tokenizer_path, ["--resume"]), check=True, env=env,
                   capture_output=True)
    a, b = rows(ref), rows(run)
    assert [r["step"] for r in a] == [r["step"] for r in b]  # no duplicated or missing rows
    for x, y in zip(a, b):
        assert x.get("loss") == y.get("loss") and x.get("val_loss") == y.get("val_loss"), (x, y)
    ma, _ = load_model(ref)
    mb, _ = load_model(run)
    for (n, p), q in zip(ma.state_dict().items(), mb.state_dict().values()):
        assert torch.equal(p, q), n


def test_resume_extends_a_finished_run(corpus_dir, tokenizer_path, tmp_path):
    out = tmp_path / "r"
    train(tiny_train_config(corpus_dir, tokenizer_path, max_steps=10, eval_every=5, save_every=5), out, quiet=True)
    train(tiny_train_config(corpus_dir, tokenizer_path, max_steps=15, eval_every=5, save_every=5), out,
          resume=True, quiet=True)
    assert open_checkpoint(out).config["step"] == 15
    assert max(r["step"] for r in rows(out)) == 15


@pytest.mark.parametrize("change, message", [
    (dict(objective="gan"), "--objective must be one of"),
    (dict(preset="huge"), "--preset must be one of"),
    (dict(max_steps=0), "--max-steps must be > 0"),
    (dict(lr=-1.0), "--lr must be > 0"),
    (dict(seq_len=100000), "too few for one sequence"),
    (dict(tokenizer="/nonexistent/tokenizer.json"), "--tokenizer .*no such file"),
])
def test_refused_runs_leave_nothing_behind(corpus_dir, tokenizer_path, tmp_path, change, message):
    out = tmp_path / "out"
    with pytest.raises(DlmError, match=message):
        train(tiny_train_config(corpus_dir, tokenizer_path, **change), out, quiet=True)
    assert not out.exists()


def test_refuses_to_overwrite_and_to_resume_nothing(tiny_ar, corpus_dir, tokenizer_path, tmp_path):
    with pytest.raises(DlmError, match="not empty"):
        train(tiny_train_config(corpus_dir, tokenizer_path), tiny_ar, quiet=True)
    shipped = tmp_path / "shipped"
    shipped.mkdir()
    for f in ("config.json", "model.safetensors", "tokenizer.json"):
        (shipped / f).write_bytes((tiny_ar / f).read_bytes())
    with pytest.raises(DlmError, match="no training state"):
        train(tiny_train_config(corpus_dir, tokenizer_path), shipped, resume=True, quiet=True)
