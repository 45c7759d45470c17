"""The `dlm` command line, run as a user runs it: real subprocesses, real files."""

import json

import pytest

from conftest import run_cli


def test_help_lists_the_commands():
    p = run_cli("--help", check=True)
    for cmd in ("train", "generate", "eval", "export", "import", "bench", "demo"):
        assert cmd in p.stdout
    assert "--max-new-tokens" in run_cli("generate", "--help", check=True).stdout


def test_train_from_a_yaml_config_then_generate_eval_bench(corpus_dir, tokenizer_path, tmp_path):
    cfg = tmp_path / "recipe.yaml"
    cfg.write_text(f"objective: ar\npreset: tiny\ndata: {corpus_dir}\ntokenizer: {tokenizer_path}\n"
                   "seq_len: 64\nbatch_size: 4\nmax_steps: 12\neval_every: 6\nsave_every: 6\nlog_every: 3\n")
    out = tmp_path / "m"
    run_cli("train", "--config", str(cfg), "--max-steps", "8", "--out", str(out), "--quiet", check=True)
    assert json.loads((out / "config.json").read_text())["step"] == 8  # the command line overrides the file

    g = run_cli("generate", "--model", str(out), "--prompt", "def main(", "--max-new-tokens", "12", "--json",
                check=True)
    res = json.loads(g.stdout)
    assert {"text", "new_tokens", "forwards", "tokens_per_forward", "seconds", "tokens_per_second"} <= set(res)
    assert res["new_tokens"] == res["forwards"] <= 12 and res["tokens_per_forward"] == 1.0

    e = run_cli("eval", "--model", str(out), "--split", "test", "--json", check=True)
    ev = json.loads(e.stdout)
    assert set(ev) >= {"loss", "perplexity", "tokens"} and ev["tokens"] > 0
    assert ev["perplexity"] == pytest.approx(2.718281828 ** ev["loss"], rel=1e-6)

    report = tmp_path / "bench.json"
    b = run_cli("bench", "--model", str(out), "--prompts", "2", "--max-new-tokens", "8", "--out", str(report),
                check=True)
    assert "ar (KV cache)" in b.stdout
    rep = json.loads(report.read_text())
    names = [s["method"] for s in rep["summaries"]]
    assert names[:2] == ["ar (KV cache)", "ar (naive, no cache)"]
    assert all(s["tokens_per_forward"] == 1.0 and s["new_tokens"] == 8 for s in rep["summaries"][:2])


def test_export_and_import_round_trip_through_the_cli(tiny_ar, tmp_path):
    run_cli("export", "--model", str(tiny_ar), "--format", "hf", "--out", str(tmp_path / "hf"), check=True)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["Qwen3ForCausalLM"]
    run_cli("import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back"), check=True)
    a = run_cli("generate", "--model", str(tiny_ar), "--prompt", "import ", "--json", "--max-new-tokens", "10",
                check=True)
    b = run_cli("generate", "--model", str(tmp_path / "back"), "--prompt", "import ", "--json",
                "--max-new-tokens", "10", check=True)
    assert json.loads(a.stdout)["text"] == json.loads(b.stdout)["text"]


class _Proc:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def cli(*args):
    """`dlm ARGS` in this process (fast); the exit code as the console script would return it."""
    import contextlib
    import io

    from dlm.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code
    return _Proc(code, out.getvalue(), err.getvalue())


def _one_line_error(p, *needles):
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_bad_inputs_get_one_line_and_exit_2(tiny_ar, corpus_dir, tokenizer_path, tmp_path):
    out = tmp_path / "never"
    base = ["train", "--data", str(corpus_dir), "--tokenizer", str(tokenizer_path), "--out", str(out)]
    _one_line_error(run_cli(*base, "--objective", "gan"), "--objective", "ar")  # one real subprocess
    _one_line_error(cli(*base, "--preset", "huge"), "--preset", "tiny")
    _one_line_error(cli(*base, "--max-steps", "ten"), "--max-steps", "int")
    empty = tmp_path / "empty"
    empty.mkdir()
    _one_line_error(cli("train", "--data", str(empty), "--out", str(out)), "empty")
    assert not out.exists()

    gen = ["generate", "--model", str(tiny_ar), "--prompt", "def f():"]
    _one_line_error(cli(*gen, "--temperature", "-0.5"), "--temperature", ">= 0")
    _one_line_error(cli(*gen, "--top-p", "0"), "--top-p", "(0, 1]")
    _one_line_error(cli(*gen, "--top-p", "1.2"), "--top-p")
    _one_line_error(cli("generate", "--model", str(tiny_ar), "--prompt", "x " * 700), "context")
    _one_line_error(cli("generate", "--model", str(tmp_path / "nothing")), "not found")
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in ("config.json", "tokenizer.json"):
        (broken / f).write_bytes((tiny_ar / f).read_bytes())
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    _one_line_error(cli(*gen[:1], "--model", str(broken)), "model.safetensors")
    _one_line_error(cli("export", "--model", str(tiny_ar), "--format", "onnx", "--out", str(out)), "--format")
    assert not out.exists()
    _one_line_error(cli("frobnicate"), "invalid choice")
    cfgfile = tmp_path / "c.yaml"
    cfgfile.write_text("max_steps: many\n")
    _one_line_error(cli("train", "--config", str(cfgfile), "--out", str(out)), "max_steps")
