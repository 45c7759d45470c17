"""The `dlm` command line, run as a user runs it, on real files: in this process (conftest.cli), and in a process of
its own where only that shows the behaviour (the console it draws on, what it imports)."""

import json

import pytest

from conftest import cli, run_cli


def test_help_lists_the_commands():
    p = cli("--help", check=True)
    for cmd in ("train", "generate", "eval", "export", "import", "bench", "demo"):
        assert cmd in p.stdout
    assert "--max-new-tokens" in cli("generate", "--help", check=True).stdout


def test_train_from_a_yaml_config_then_generate_eval_bench(corpus_dir, tokenizer_path, tmp_path):
    cfg = tmp_path / "recipe.yaml"
    cfg.write_text(f"objective: ar\npreset: tiny\ndata: {corpus_dir}\ntokenizer: {tokenizer_path}\n"
                   "seq_len: 64\nbatch_size: 4\nmax_steps: 12\neval_every: 6\nsave_every: 6\nlog_every: 3\n")
    out = tmp_path / "m"
    cli("train", "--config", str(cfg), "--max-steps", "8", "--out", str(out), "--quiet", check=True)
    assert json.loads((out / "config.json").read_text())["step"] == 8  # the command line overrides the file

    g = cli("generate", "--model", str(out), "--prompt", "def main(", "--max-new-tokens", "12", "--json",
            check=True)
    res = json.loads(g.stdout)
    assert {"text", "new_tokens", "forwards", "tokens_per_forward", "seconds", "tokens_per_second"} <= set(res)
    assert res["new_tokens"] == res["forwards"] <= 12 and res["tokens_per_forward"] == 1.0

    e = cli("eval", "--model", str(out), "--data", str(corpus_dir), "--split", "test", "--json", check=True)
    ev = json.loads(e.stdout)
    assert set(ev) >= {"loss", "perplexity", "tokens"} and ev["tokens"] > 0
    assert ev["perplexity"] == pytest.approx(2.718281828 ** ev["loss"], rel=1e-6)

    report = tmp_path / "bench.json"
    b = cli("bench", "--model", str(out), "--data", str(corpus_dir), "--prompts", "2", "--max-new-tokens", "8",
            "--out", str(report), check=True)
    assert "ar (KV cache)" in b.stdout
    rep = json.loads(report.read_text())
    names = [s["method"] for s in rep["summaries"]]
    assert names[:2] == ["ar (KV cache)", "ar (naive, no cache)"]
    assert all(s["tokens_per_forward"] == 1.0 and s["new_tokens"] == 8 for s in rep["summaries"][:2])


def test_export_and_import_round_trip_through_the_cli(tiny_ar, tmp_path):
    cli("export", "--model", str(tiny_ar), "--format", "hf", "--out", str(tmp_path / "hf"), check=True)
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["architectures"] == ["Qwen3ForCausalLM"]
    cli("import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back"), check=True)
    a = cli("generate", "--model", str(tiny_ar), "--prompt", "import ", "--json", "--max-new-tokens", "10",
            check=True)
    b = cli("generate", "--model", str(tmp_path / "back"), "--prompt", "import ", "--json",
            "--max-new-tokens", "10", check=True)
    assert json.loads(a.stdout)["text"] == json.loads(b.stdout)["text"]


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


# --- the command line itself (tyro, via dlm.cliargs): parsed in this process, the command replaced by a recorder

@pytest.fixture
def parsed(monkeypatch):
    """parsed("train", "--out", "x") -> the keyword arguments `dlm train --out x` calls train_cmd with."""
    import functools

    import dlm.cli

    def parse(*args):
        name = next(a for a in args if not a.startswith("-"))
        real, got = getattr(dlm.cli, f"{name}_cmd"), {}
        monkeypatch.setattr(dlm.cli, f"{name}_cmd", functools.wraps(real)(lambda **kw: got.update(kw)))
        p = cli(*args)
        assert p.returncode == 0, (p.returncode, p.stderr)
        return got

    return parse


def test_usage_errors_are_one_line_and_exit_2():
    _one_line_error(cli("train", "--out", "x", "--max-steps", "abc"), "dlm train: error:", "--max-steps", "int")
    _one_line_error(cli("bench", "--temperature", "0", "hot"), "dlm bench: error:", "--temperature")
    _one_line_error(cli("export", "--model", "m", "--out", "o", "--bogus", "1"), "error:", "--bogus")
    _one_line_error(cli("train"), "dlm train: error:", "required", "--out")
    _one_line_error(cli("export", "--model", "m"), "required", "--out")
    _one_line_error(cli("train", "--out"), "--out")  # no value
    _one_line_error(cli("generate", "--model", "m", "--no-such-flag"), "--no-such-flag")
    _one_line_error(cli(), "dlm: error:", "COMMAND")
    _one_line_error(cli("--bogus"), "dlm: error:", "--bogus")
    _one_line_error(cli("frobnicate", "--out", "x"), "invalid choice", "frobnicate")
    p = run_cli("export", "--model", "m", "--out", "o", "--bogus")  # the real console: no box, no usage dump
    _one_line_error(p, "dlm export: error:", "--bogus")
    assert p.stdout == ""


def test_usage_errors_stay_one_line_without_tyros_error_hook(monkeypatch):
    """tyro._errors is private: without its hook, tyro's error box is flattened to one line."""
    errors = pytest.importorskip("tyro._errors")  # (tyro 1.0.0 has no such module: the fallback is the rule there)
    monkeypatch.delattr(errors, "on_parse_error")
    _one_line_error(cli("train", "--out", "x", "--max-steps", "abc"), "dlm train: error:", "--max-steps")
    _one_line_error(cli("export", "--model", "m", "--out", "o", "--bogus"), "dlm export: error:", "--bogus")
    _one_line_error(cli("import", "--out", "o"), "dlm import: error:", "--hf")


def test_help_is_fast_and_shows_the_docstrings():
    import subprocess
    import sys

    code = ("import sys; from dlm.cli import main\ntry: main(['--help'])\nexcept SystemExit as e: assert e.code == 0\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "train" in p.stdout and p.stderr.strip() == "False"  # `dlm --help` does not import torch
    h = cli("train", "--help")
    assert h.returncode == 0
    for text in ("--max-steps", "--config", "--resume", "--no-resume", "continue the training state",
                 "cosine decays", "--target-layers"):
        assert text in h.stdout, text
    assert "--cfg." not in h.stdout and "--training." not in h.stdout  # the dataclass's fields are flat
    g = cli("generate", "--help")
    assert g.returncode == 0 and "nucleus sampling mass" in g.stdout and "--check-lossless" in g.stdout


# every subcommand's --help, and options refused by their values: answered before torch, transformers or the
# samplers are imported (what makes them take a fraction of a second instead of several)
_LIGHT = [[c, "--help"] for c in ("train", "generate", "eval", "export", "import", "bench", "demo", "distill", "serve",
                                  "task", "chat", "sudoku")] + [
    ["sudoku", "123"],
    ["chat", "--model", "checkpoints/ar-small", "--top-p", "2"],
    ["generate", "--model", "checkpoints/ar-small", "--top-p", "1.5"],
    ["generate", "--model", "checkpoints/ar-small", "--temperature", "-1"],
    ["generate", "--model", "checkpoints/ar-small", "--max-new-tokens", "0"],
    ["generate", "--model", "checkpoints/ar-small", "--device", "gpu"],
    ["eval", "--model", "checkpoints/ar-small", "--task", "sudoku", "--top-k", "-3"],
    ["eval", "--model", "checkpoints/ar-small", "--batch-size", "0"],
    ["train", "--out", "never", "--preset", "nope"],
    ["train", "--out", "never", "--lr", "-1"],
    ["bench", "--temperature", "-1"],
    ["demo", "--prompts", "0"],
    ["distill", "--target", "checkpoints/ar-small", "--out", "x.jsonl", "--device", "tpu"],
    ["serve", "--model", "checkpoints/ar-small", "--port", "70000"],
    ["export", "--model", "checkpoints/ar-small", "--out", "never", "--dtype", "int8"],
]


def test_help_and_refused_options_do_not_import_torch(tmp_path):
    import subprocess
    import sys

    code = ("import json, sys\nfrom dlm.cli import main\nout = []\n"
            "for argv in json.loads(sys.argv[1]):\n"
            "    try:\n        code = main(argv)\n    except SystemExit as e:\n        code = e.code\n"
            "    out.append([code, [m for m in ('torch', 'transformers', 'dlm.sampling') if m in sys.modules]])\n"
            "print(json.dumps(out), file=sys.stderr)")
    p = subprocess.run([sys.executable, "-c", code, json.dumps(_LIGHT)], capture_output=True, text=True, cwd=tmp_path,
                       timeout=120)
    got = json.loads(p.stderr.strip().splitlines()[-1])
    for argv, (code, heavy) in zip(_LIGHT, got, strict=True):
        assert code == (0 if "--help" in argv else 2), (argv, code, p.stderr)
        assert heavy == [], (argv, heavy)  # imported by this command line (or an earlier one)


def _options_help(command: str) -> dict[str, str]:
    """`dlm COMMAND --help` as {option: its help text on one line} (tyro's boxes taken apart)."""
    import re

    out, name = {}, None
    for line in cli(command, "--help").stdout.splitlines():
        body = line.replace("│", " ")
        row = body.strip()
        m = re.match(r" {1,3}(--[a-z0-9-]+)", body)  # (an option's first row; its help goes on indented)
        if m:
            name = m.group(1)
            out[name] = row
        elif name and row and not set(row) <= set("─╭╮╰╯- "):
            out[name] += " " + row
        else:
            name = None
    return out


def test_help_says_each_default_once_and_lists_every_preset():
    import re

    from dlm.config import PRESETS

    for command in ("train", "generate", "eval", "bench", "serve", "distill", "demo", "task", "export", "import", "chat",
                    "sudoku"):
        for option, text in _options_help(command).items():
            # tyro's own "(default: X)" comes last, and only when the help does not already say the default
            assert not re.search(r"default.*\(default: [^()]*\)$", text, re.I) or not re.search(
                r"\(default: (None|0|False|True|\d+)\)$", text), (command, option, text)
    assert "(default: the shipped ar-small)" in _options_help("bench")["--model"]
    assert "(default: None)" not in _options_help("bench")["--model"]
    preset = _options_help("train")["--preset"]
    assert all(name in preset for name in PRESETS), preset
    assert cli("--version").stdout.strip().startswith("dlm 0.")


def test_check_lossless_needs_a_method_that_speculates():
    from pathlib import Path

    joint = Path(__file__).resolve().parent.parent / "checkpoints" / "joint-small"
    p = cli("generate", "--model", str(joint), "--sampler", "ar", "--check-lossless", "--prompt", "x",
            "--max-new-tokens", "2")
    _one_line_error(p, "--check-lossless", "--sampler ar")


def test_flags_lists_optionals_and_underscores(parsed):
    a = parsed("generate", "--model", "m", "--json", "--max_new_tokens", "7", "--no-adaptive", "--temperature", "-0.5")
    assert a["json"] is True and a["show"] is False and a["model"] == "m" and a["prompt_file"] is None
    s = a["scfg"]
    assert (s.max_new_tokens, s.adaptive, s.temperature, s.suffix, s.steps) == (7, False, -0.5, None, None)
    assert parsed("generate", "--model", "m", "--json", "--no-json")["json"] is False  # the last one wins
    assert parsed("generate", "--model", "m", "--suffix", "None")["scfg"].suffix == "None"  # a string, as before

    b = parsed("bench", "--draft", "A", "B", "C", "--temperature", "0", "1", "--no-naive", "--usdm", "")
    assert b["draft"] == ["A", "B", "C"] and b["temperature"] == [0.0, 1.0]
    assert b["naive"] is False and b["usdm"] == "" and b["model"] is None and b["mdlm"] is None
    assert b["out"] == "bench.json"

    t = parsed("train", "--out", "x", "--target-layers", "1", "2", "--resume", "--max-steps=5", "--no-target-features")
    assert t["out"] == "x" and t["resume"] is True and t["quiet"] is False
    cfg = t["cfg"]
    assert (cfg.target_layers, cfg.max_steps, cfg.target_features, cfg.tokenizer) == ([1, 2], 5, False, None)


def test_config_file_gives_defaults_the_command_line_overrides(parsed, tmp_path):
    y = tmp_path / "run.yaml"
    y.write_text("out: runs/from-file\nmax_steps: 12\nlr: 1e-3\ntarget-layers: [1, 2]\nquiet: true\ntokenizer: null\n")
    t = parsed("train", "--config", str(y))  # --out, required on the command line, comes from the file
    assert t["out"] == "runs/from-file" and t["quiet"] is True
    assert (t["cfg"].max_steps, t["cfg"].lr, t["cfg"].target_layers) == (12, 1e-3, [1, 2])
    t = parsed("train", "--max-steps", "3", f"--config={y}", "--out", "elsewhere", "--no-quiet")
    assert (t["out"], t["quiet"], t["cfg"].max_steps, t["cfg"].lr) == ("elsewhere", False, 3, 1e-3)

    j = tmp_path / "gen.json"
    j.write_text(json.dumps({"model": "m", "max-new-tokens": 9, "draft": "lookup", "json": True}))
    g = parsed("generate", "--config", str(j), "--max-new-tokens", "4")
    assert g["model"] == "m" and g["json"] is True and (g["scfg"].max_new_tokens, g["scfg"].draft) == (4, "lookup")

    e = tmp_path / "export.yaml"  # end to end: the command runs with the file's --model, or the command line's
    e.write_text(f"model: {tmp_path / 'from-file'}\nout: {tmp_path / 'o'}\n")
    _one_line_error(cli("export", "--config", str(e)), "not found", "from-file")
    _one_line_error(cli("export", "--config", str(e), "--model", str(tmp_path / "from-cli")), "from-cli")


def test_bad_config_files_get_one_line_and_exit_2(tmp_path):
    def cfg(name, text):
        (tmp_path / name).write_text(text)
        return str(tmp_path / name)

    _one_line_error(cli("train", "--config", cfg("a.yaml", "out: x\nmax_stepz: 3\n")), "unknown", "max_stepz")
    _one_line_error(cli("generate", "--config", cfg("b.yaml", "model: m\nout: x\n")), "unknown", "'out'")
    _one_line_error(cli("train", "--config", cfg("c.yaml", "out: x\nresume: 1\n")), "resume", "bool")
    _one_line_error(cli("train", "--config", cfg("d.yaml", "out: x\nmax_steps: 2.5\n")), "max_steps", "int")
    _one_line_error(cli("train", "--config", cfg("e.yaml", "out: x\ntarget_layers: [a]\n")), "target_layers")
    _one_line_error(cli("train", "--config", cfg("f.yaml", "- out\n")), "mapping")
    _one_line_error(cli("train", "--config", cfg("g.yaml", "out: [\n")), "cannot parse")
    _one_line_error(cli("train", "--config", cfg("h.json", "{out: x}")), "cannot parse")
    _one_line_error(cli("train", "--config", str(tmp_path / "missing.yaml")), "no such file")
    _one_line_error(cli("train", "--config", cfg("i.yaml", "!!python/object:os.system {}\n")), "cannot parse")


def test_a_fill_template_prints_the_filled_document_and_a_suffix_its_middle():
    from pathlib import Path

    from dlm.checkpoint import load_model
    from dlm.sampling import SampleConfig, generate

    mdlm = Path(__file__).resolve().parent.parent / "checkpoints" / "mdlm-small"
    template = '{"name": "<fill:4>", "size": <fill:2>}'
    p = cli("generate", "--model", str(mdlm), "--prompt", template, "--json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    fills = out["fills"]
    assert len(fills) == 2 and out["text"] == '{"name": "' + fills[0] + '", "size": ' + fills[1] + "}"
    shown = cli("generate", "--model", str(mdlm), "--prompt", template).stdout.splitlines()[0]
    assert shown == out["text"]  # the document whole, not the template followed by the canvas
    prefix, suffix = "def add(a, b):\n    ", "\n\ndef sub(a, b):\n    return a - b\n"
    p = cli("generate", "--model", str(mdlm), "--prompt", prefix, "--suffix", suffix, "--max-new-tokens", "8", "--json")
    net, ck = load_model(mdlm)
    full = generate(net, ck, prefix, SampleConfig(max_new_tokens=8, suffix=suffix)).text
    assert json.loads(p.stdout)["text"] + suffix == full  # the middle alone, as the server's suffix returns it


def test_train_says_what_it_does_from_the_first_second_and_shows_no_nan(corpus_dir, tokenizer_path, tmp_path):
    from dlm.config import TrainConfig
    from dlm.train import prepare

    said = []
    prepare(TrainConfig(data=str(corpus_dir), tokenizer=str(tokenizer_path), seq_len=32, batch_size=2), tmp_path / "a",
            False, None, say=said.append)
    assert said == [f"reading the corpus ({corpus_dir})", "loading the tokenizer", "building the model",
                    "tokenizing the corpus (once per corpus and tokenizer: cached)"]
    # a terminal (rich draws into the pipe as into one with these): a spinner from the imports on, and a bar that
    # shows no figure before the first one exists
    tty = run_cli("train", "--data", str(corpus_dir), "--tokenizer", str(tokenizer_path), "--seq-len", "32",
                  "--batch-size", "2", "--max-steps", "4", "--log-every", "2", "--eval-every", "4", "--eval-batches",
                  "1", "--out", str(tmp_path / "b"), env={"TTY_INTERACTIVE": "1", "TTY_COMPATIBLE": "1",
                                                          "COLUMNS": "120"}, check=True)
    assert "train\x1b[0m importing torch" in tty.stderr, tty.stderr[-2000:]
    assert "loss –  val –  – tok/s" in tty.stdout and "nan" not in tty.stdout.lower(), tty.stdout[-2000:]


def test_sudoku_prints_a_solved_grid_and_refuses_a_bad_puzzle():
    from dlm.tasks.sudoku import generate, is_valid

    quiz, solution = generate(1, (34, 36), 5)[0]
    p = cli("sudoku", quiz.replace("0", "."))
    assert p.returncode == 0, p.stderr
    rows = [line for line in p.stdout.splitlines() if line[:1].isdigit()]
    grid = [int(c) for line in rows for c in line if c.isdigit()]
    assert len(rows) == 9 and is_valid(quiz, grid) and "".join(map(str, grid)) == solution
    assert "solved" in p.stdout
    _one_line_error(cli("sudoku", "123"), "81 cells")
    _one_line_error(cli("sudoku", "11" + "0" * 79), "no solution")


def test_chat_reads_lines_and_answers_each_through_the_servers_template(monkeypatch):
    import io
    from pathlib import Path

    from dlm.chat import chat_prompt, reply_of
    from dlm.checkpoint import load_model
    from dlm.sampling import SampleConfig, generate

    ar = Path(__file__).resolve().parent.parent / "checkpoints" / "ar-small"
    monkeypatch.setattr("sys.stdin", io.StringIO("Read a file.\n\nThen sort it.\n"))
    p = cli("chat", "--model", str(ar), "--system", "You write Python.", "--max-new-tokens", "12")
    assert p.returncode == 0, p.stderr
    net, ck = load_model(ar)
    cfg = SampleConfig(max_new_tokens=12)
    history = [("system", "You write Python."), ("user", "Read a file.")]
    first = reply_of(generate(net, ck, chat_prompt(history), cfg).text).strip("\n")
    history += [("assistant", first), ("user", "Then sort it.")]
    second = reply_of(generate(net, ck, chat_prompt(history), cfg).text).strip("\n")
    assert p.stdout == first + "\n" + second + "\n"


@pytest.mark.slow
def test_demo_quick():
    p = run_cli("demo", "--quick", check=True)
    assert "Side by side" in p.stdout and "sudoku-mdlm" in p.stdout and "speculative" in p.stdout


def test_a_preset_fills_only_the_options_not_given(monkeypatch, tmp_path):
    """`--threshold 0.9 --preset llada2` runs at 0.9 (the flag's value is SampleConfig's default, which a preset
    would otherwise take for "not given"); what is left out comes from the preset; --config keys count as given."""
    import functools

    import dlm.cli as c
    from dlm.sampling.mdlm import apply_preset

    seen = {}

    @functools.wraps(c.generate_cmd)
    def fake(*args, **kw):
        seen.update(kw)

    monkeypatch.setattr(c, "generate_cmd", fake)
    c.main(["generate", "--model", "m", "--prompt", "p", "--threshold", "0.9", "--preset", "llada2"])
    cfg = seen["scfg"]
    assert cfg.given == {"threshold", "preset"}
    ran = apply_preset(cfg)
    assert ran.threshold == 0.9 and ran.block_size == 32 and ran.schedule == "block" and ran.given == cfg.given
    c.main(["generate", "--model", "m", "--prompt", "p", "--preset", "llada2", "--no-whole-blocks"])
    ran = apply_preset(seen["scfg"])
    assert ran.threshold == 0.95 and not ran.whole_blocks  # --no-FLAG is given too
    conf = tmp_path / "c.yaml"
    conf.write_text("threshold: 0.9\nschedule: even\n")
    c.main(["generate", "--config", str(conf), "--model", "m", "--prompt", "p", "--preset", "llada2"])
    ran = apply_preset(seen["scfg"])
    assert ran.threshold == 0.9 and ran.schedule == "even" and ran.block_size == 32
