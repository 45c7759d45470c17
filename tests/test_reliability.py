"""What dlm promises about a user's files and bad input (docs/reliability.md lists the promises and these tests).

- export/import never delete a file they did not write, and never write into their own input;
- a run folder belongs to one training; a torn metrics line or a killed write's leftovers do not stop a resume;
  a resume that contradicts the saved run, or a run that fails before its first checkpoint, leaves nothing;
- nothing a checkpoint records is followed as a path (its corpus, its reference model, an index's shards), and
  a config.json is held against its weights' header before anything is allocated;
- bad input of any kind is exit code 2 and one line `dlm: error: ...` (or `dlm CMD: error: ...`), with the
  folders around it exactly as they were (the table below); Ctrl-C is 130 and a closed pipe 141, quietly;
- options a checkpoint's paradigm does not read are named in a warning, not silently ignored.

Most commands run in this process (`dlm.cli.main`, fast); the lock, Ctrl-C and the broken pipe need real ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import cli, tiny_train_config
from dlm.checkpoint import load_model, open_checkpoint, save_checkpoint
from dlm.errors import DlmError


def one_line_error(res: tuple[int, str, str], *needles: str) -> str:
    code, _, err = res
    lines = [ln for ln in err.splitlines() if not ln.startswith("dlm: warning:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    assert lines[0].startswith("dlm") and ": error: " in lines[0], lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def snapshot(root: Path) -> dict[str, str]:
    """Every entry below root: files by content hash, links by target, folders as such."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def copy_checkpoint(src: Path, dst: Path, state: bool = False) -> Path:
    shutil.copytree(src, dst, ignore=None if state else shutil.ignore_patterns("state", "metrics.jsonl"))
    return dst


def edit_config(ck: Path, **changes) -> Path:
    cfg = json.loads((ck / "config.json").read_text())
    for key, value in changes.items():
        *parents, last = key.split("__")
        d = cfg
        for k in parents:
            d = d[k]
        d[last] = value
    (ck / "config.json").write_text(json.dumps(cfg))
    return ck


def as_paradigm(tiny_ar: Path, dst: Path, objective: str) -> Path:
    """tiny_ar's weights as an mdlm or usdm checkpoint (untrained as such: enough to see which sampler runs)."""
    from dlm.config import ModelConfig
    from dlm.model import Transformer

    model, ck = load_model(tiny_ar)
    meta = {k: v for k, v in ck.config.items() if k not in ("format", "version", "tokenizer")}
    meta["objective"] = objective
    if objective == "usdm":
        torch.manual_seed(0)
        net = Transformer(ModelConfig(**{**model.cfg.to_dict(), "self_cond": True}))
        net.load_state_dict(model.state_dict(), strict=False)
        model, meta = net, {**meta, "model": net.cfg.to_dict(), "canvas_length": 16,
                            "noise_vocab": ck.tokenizer.vocab_size}
    else:
        meta.update(block_size=0, mask_id=ck.tokenizer.mask_id)
    save_checkpoint(dst, model, ck.tokenizer, meta)
    return dst


@pytest.fixture(scope="module")
def hf_export(tiny_ar, tmp_path_factory) -> Path:
    from dlm.hf import export_hf

    model, ck = load_model(tiny_ar)
    return export_hf(model, ck.tokenizer, tmp_path_factory.mktemp("hf") / "tiny-hf")


@pytest.fixture(scope="module")
def paradigms(tiny_ar, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("paradigms")
    return {"ar": tiny_ar, **{o: as_paradigm(tiny_ar, root / o, o) for o in ("mdlm", "usdm")}}


def user_files(w: Path, jsonl: bytes, yaml: bytes) -> None:
    """A user's files that no command may touch, and the bad inputs (not UTF-8, a folder named like a file)."""
    (w / "user").mkdir()
    (w / "user" / "notes.txt").write_text("mine\n")
    (w / "afile").write_text("a file\n")
    (w / "link").symlink_to("user")
    (w / "d.jsonl").mkdir()
    (w / "bad.txt").write_bytes(b"def f(\xff):\n")
    (w / "bad.jsonl").write_bytes(jsonl)
    (w / "bad.yaml").write_bytes(yaml)


@pytest.fixture
def sandbox(tiny_ar, hf_export, corpus_dir, tokenizer_path, tmp_path, monkeypatch) -> dict[str, str]:
    """A working folder with a checkpoint, a transformers folder, a user's files and bad input files; the cwd."""
    w = tmp_path / "w"
    w.mkdir()
    copy_checkpoint(tiny_ar, w / "ck")
    shutil.copytree(hf_export, w / "hf")
    user_files(w, b'{"text": "ok"}\n{"text": "caf\xe9"}\n', b"max_steps: 3\nlr: \xff\n")
    (w / "bool.yaml").write_text("max_steps: true\n")
    monkeypatch.chdir(w)
    return {"w": str(w), "ck": str(w / "ck"), "hf": str(w / "hf"), "corpus": str(corpus_dir),
            "tok": str(tokenizer_path)}


TINY = ["--data", "{corpus}", "--tokenizer", "{tok}", "--seq-len", "32", "--batch-size", "2", "--max-steps", "2",
        "--eval-every", "1", "--eval-batches", "1", "--quiet"]
GEN = ["generate", "--model", "{ck}", "--prompt", "def f(", "--max-new-tokens", "2"]


def crafted(change):
    """Setup: a copy of the checkpoint at ./crafted, damaged by change(path)."""
    def setup(s: dict[str, str], paths: dict[str, Path]) -> None:
        change(copy_checkpoint(Path(s["ck"]), Path(s["w"]) / "crafted"))
    return setup


def nan_weights(ck: Path) -> None:
    from safetensors.torch import load_file, save_file

    t = load_file(ck / "model.safetensors")
    t["norm.weight"] = torch.full_like(t["norm.weight"], float("nan"))
    save_file(t, ck / "model.safetensors", metadata={"format": "pt"})


def hf_config(**changes):
    def setup(s: dict[str, str], paths: dict[str, Path]) -> None:
        cfg = json.loads((Path(s["hf"]) / "config.json").read_text())
        cfg.update(changes)
        for k, v in changes.items():
            if v is None:
                del cfg[k]
        (Path(s["hf"]) / "config.json").write_text(json.dumps(cfg))
    return setup


def hf_index(shard: str):
    def setup(s: dict[str, str], paths: dict[str, Path]) -> None:
        from safetensors import safe_open

        with safe_open(str(Path(s["hf"]) / "model.safetensors"), "pt") as fh:
            names = list(fh.keys())
        wmap = {n: "model.safetensors" for n in names}
        wmap[names[0]] = shard
        (Path(s["hf"]) / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    return setup


def hf_file(name: str, text=None, edit=None):
    """Setup: the transformers folder's file `name` replaced by text (or text(old text)), or its JSON changed by
    edit(obj)."""
    def setup(s: dict[str, str], paths: dict[str, Path]) -> None:
        p = Path(s["hf"]) / name
        if text is not None:
            p.write_text(text(p.read_text()) if callable(text) else text)
        else:
            p.write_text(json.dumps(edit(json.loads(p.read_text()))))
    return setup


def hf_int_weights(s: dict[str, str], paths: dict[str, Path]) -> None:
    """Setup: the weights as int64 tensors of the right names and shapes."""
    from safetensors.torch import load_file, save_file

    f = Path(s["hf"]) / "model.safetensors"
    save_file({k: v.to(torch.int64) for k, v in load_file(f).items()}, f)


def sudoku_csv(how: str):
    """Setup: ./s.csv, one puzzle row damaged by `how`: a 200,000-character field, a solution that breaks the
    rules while keeping its givens, or one that contradicts a given."""
    def setup(s: dict[str, str], paths: dict[str, Path]) -> None:
        from dlm.tasks.sudoku import generate

        (q, sol), = generate(1, (40, 50), 0)
        rows = [f"{q},{sol}"]
        if how == "long":
            rows.append("1" * 200_000 + "," + sol)
        elif how == "rules":  # two blanks of one row swapped: the row still holds 1-9, two columns do not
            i, j = next((a, b) for a in range(9) for b in range(a + 1, 9) if q[a] == q[b] == "0" and sol[a] != sol[b])
            bad = list(sol)
            bad[i], bad[j] = bad[j], bad[i]
            rows.append(f"{q},{''.join(bad)}")
        else:  # the givens
            k = next(k for k in range(81) if q[k] != "0")
            rows.append(f"{q},{sol[:k]}{(int(sol[k]) % 9) + 1}{sol[k + 1:]}")
        (Path(s["w"]) / "s.csv").write_text("quizzes,solutions\n" + "\n".join(rows) + "\n")
    return setup


SUDOKU = ["eval", "--model", "{ck}", "--task", "sudoku", "--n", "1"]


def records(**changes):
    """Setup: ./crafted records a corpus or reference elsewhere (a secret folder beside the sandbox)."""
    def setup(s: dict[str, str], paths: dict[str, Path]) -> None:
        secret = Path(s["w"]).parent / "secret"
        secret.mkdir(exist_ok=True)
        (secret / "passwords.txt").write_text("hunter2\n" * 400)
        edit_config(copy_checkpoint(Path(s["ck"]), Path(s["w"]) / "crafted"),
                    **{k: v.format(secret=secret) for k, v in changes.items()})
    return setup


# id, setup (or None), argv ({ck}, {hf}, {corpus}, {tok}, {mdlm} filled in), what the one line must say, stdin
CASES = [
    # devices
    ("device-tpu", None, [*GEN, "--device", "tpu"], ["--device", "'tpu'"], None),
    ("device-meta", None, [*GEN, "--device", "meta"], ["--device", "'meta'"], None),
    ("device-cuda-x", None, [*GEN, "--device", "cuda:x"], ["--device", "cuda:x"], None),
    ("train-device-tpu", None, ["train", "--out", "new", *TINY, "--device", "tpu"], ["--device"], None),
    # text that is not UTF-8, wherever it comes from
    ("prompt-not-utf8", None, [*GEN[:3], "--prompt", "def f(\udcff):"], ["--prompt", "UTF-8", "0xff"], None),
    ("prompt-file-not-utf8", None, [*GEN[:3], "--prompt-file", "bad.txt"], ["--prompt-file", "UTF-8"], None),
    ("stdin-not-utf8", None, [*GEN[:3], "--prompt-file", "-"], ["standard input", "UTF-8"], b"x = \xff\n"),
    ("suffix-not-utf8", None, [*GEN, "--suffix", "\udce9"], ["--suffix", "UTF-8"], None),
    ("jsonl-not-utf8", None, ["train", "--out", "new", *TINY, "--data", "bad.jsonl"],
     ["--data bad.jsonl", "line 2", "UTF-8"], None),
    ("config-not-utf8", None, ["train", "--config", "bad.yaml", "--out", "new"], ["--config", "UTF-8"], None),
    # config.json of the wrong shape, damaged or crafted weights
    ("config-model-str", crafted(lambda p: edit_config(p, model="x")), [*GEN[:2], "crafted", *GEN[3:]],
     ["config.json", "model must be an object"], None),
    ("config-vocab-str", crafted(lambda p: edit_config(p, model__vocab_size="x")), [*GEN[:2], "crafted", *GEN[3:]],
     ["model.vocab_size must be an integer", "'x'"], None),
    ("config-train-str", crafted(lambda p: edit_config(p, train=[1])), ["eval", "--model", "crafted"],
     ["train must be an object"], None),
    ("config-layers-absurd", crafted(lambda p: edit_config(p, model__n_layers=100000)),
     [*GEN[:2], "crafted", *GEN[3:]], ["model.n_layers must be in [1, 1024]", "100000"], None),
    ("config-layers-unbacked", crafted(lambda p: edit_config(p, model__n_layers=900, model__dim=4096)),
     [*GEN[:2], "crafted", *GEN[3:]], ["model.safetensors", "does not match its config.json"], None),
    ("nan-weights", crafted(nan_weights), [*GEN[:2], "crafted", *GEN[3:], "--temperature", "1"],
     ["norm.weight", "NaN"], None),
    ("usdm-without-self-cond", crafted(lambda p: edit_config(p, objective="usdm")), [*GEN[:2], "crafted", *GEN[3:]],
     ["self_cond"], None),
    # numbers out of range
    ("beta1", None, ["train", "--out", "new", *TINY, "--beta1", "5"], ["--beta1 must be in [0, 1)"], None),
    ("beta2", None, ["train", "--out", "new", *TINY, "--beta2", "-1"], ["--beta2 must be in [0, 1)"], None),
    ("seed-negative", None, ["train", "--out", "new", *TINY, "--seed", "-1"], ["--seed", "[0, "], None),
    ("seed-float", None, ["train", "--out", "new", *TINY, "--seed", "1e23"], ["--seed"], None),
    ("seed-huge", None, ["train", "--out", "new", *TINY, "--seed", str(10**23)], ["--seed", "[0, "], None),
    ("warmup-inf", None, ["train", "--out", "new", *TINY, "--warmup", "inf"], ["--warmup", "finite"], None),
    ("generate-seed", None, [*GEN, "--seed", "-1", "--temperature", "1"], ["--seed"], None),
    ("eval-batch-size", None, ["eval", "--model", "{ck}", "--batch-size", "0"], ["--batch-size must be > 0"], None),
    ("eval-max-batches", None, ["eval", "--model", "{ck}", "--max-batches", "-1"], ["--max-batches"], None),
    ("eval-seq-len", None, ["eval", "--model", "{ck}", "--seq-len", "-5"], ["--seq-len must be >= 0"], None),
    ("yaml-bool-steps", None, ["train", "--config", "bool.yaml", "--out", "new"], ["max_steps", "int"], None),
    ("demo-prompts", None, ["demo", "--prompts", "0"], ["--prompts must be > 0"], None),
    ("bench-warmup", None, ["bench", "--model", "{ck}", "--data", "{corpus}", "--warmup", "-1"], ["--warmup"], None),
    ("distill-prompts", None, ["distill", "--target", "{ck}", "--out", "x.jsonl", "--prompts", str(10**8)],
     ["--prompts must be in [1, 1000000]"], None),
    # misleading messages, now naming the option
    ("init-from-missing", None, ["train", "--out", "new", *TINY, "--objective", "mdlm", "--init-from", "nope"],
     ["--init-from nope", "not found"], None),
    ("init-from-not-a-checkpoint", None, ["train", "--out", "new", *TINY, "--objective", "mdlm", "--init-from",
                                          "user"], ["--init-from user", "not a dlm checkpoint"], None),
    ("target-missing", None, ["train", "--out", "new", *TINY, "--objective", "dflash", "--target", "nope"],
     ["--target nope"], None),
    # transformers folders
    ("hf-no-heads", hf_config(num_attention_heads=None), ["import", "--hf", "{hf}", "--out", "new"],
     ["num_attention_heads", "missing"], None),
    ("hf-hidden-size-str", hf_config(hidden_size="big"), ["import", "--hf", "{hf}", "--out", "new"],
     ["hidden_size must be a number", "'big'"], None),
    ("hf-layers-unbacked", hf_config(num_hidden_layers=900), ["import", "--hf", "{hf}", "--out", "new"],
     ["does not match its config.json", "missing"], None),
    ("hf-config-deep", hf_file("config.json", '{"a": ' + "[" * 200_000 + "]" * 200_000 + "}"),
     ["import", "--hf", "{hf}", "--out", "new"], ["config.json", "nested deeper than 64"], None),
    ("hf-gemma4-alone", hf_file("config.json", '{"model_type": "gemma4_text"}'),
     ["import", "--hf", "{hf}", "--out", "new"], ["num_hidden_layers is missing"], None),
    ("hf-eos-float", hf_file("generation_config.json", edit=lambda g: {**g, "eos_token_id": 2.5}),
     ["import", "--hf", "{hf}", "--out", "new"], ["generation_config.json", "eos_token_id", "2.5"], None),
    ("hf-temperature-str", hf_file("generation_config.json", edit=lambda g: {**g, "do_sample": True, "temperature": "hot"}),
     ["import", "--hf", "{hf}", "--out", "new"], ["generation_config.json", "temperature 'hot'"], None),
    ("hf-int64-weights", hf_int_weights, ["import", "--hf", "{hf}", "--out", "new"],
     ["model.safetensors", "int64", "floating point"], None),
    ("hf-rope-infinity", hf_config(rope_theta=float("inf")), ["import", "--hf", "{hf}", "--out", "new"],
     ["config.json", "not standard JSON: Infinity"], None),
    ("hf-rope-overflow", hf_file("config.json", lambda t: t.replace('"rope_theta": 1', '"rope_theta": 1e400, "x": 1')),
     ["import", "--hf", "{hf}", "--out", "new"], ["config.json", "1e400 is out of range"], None),
    ("hf-rope-string", hf_config(rope_theta="1e4"), ["import", "--hf", "{hf}", "--out", "new"],
     ["rope_theta must be a finite number > 0", "'1e4'"], None),
    ("hf-index-absolute", hf_index("/etc/passwd"), ["import", "--hf", "{hf}", "--out", "new"],
     ["'/etc/passwd'", "plain file name"], None),
    ("hf-index-dotdot", hf_index("../ck/model.safetensors"), ["import", "--hf", "{hf}", "--out", "new"],
     ["'../ck/model.safetensors'", "plain file name"], None),
    # sudoku data and the options that draw a case many times
    ("sudoku-field-200k", sudoku_csv("long"), [*SUDOKU, "--data", "s.csv"], ["s.csv", "line 3"], None),
    ("sudoku-breaks-rules", sudoku_csv("rules"), [*SUDOKU, "--data", "s.csv"],
     ["s.csv", "line 3", "breaks the rules", "column"], None),
    ("sudoku-breaks-givens", sudoku_csv("givens"), [*SUDOKU, "--data", "s.csv"],
     ["s.csv", "line 3", "contradicts a given"], None),
    ("sudoku-data-folder", None, [*SUDOKU, "--data", "user"], ["--data user is a folder"], None),
    ("code-data-folder", None, ["eval", "--model", "{ck}", "--task", "code", "--data", "user",
                                "--allow-code-execution"], ["--data user is a folder"], None),
    ("tries-huge", None, [*SUDOKU, "--tries", "1000000000", "--temperature", "1"],
     ["--tries must be in [1, 1024]", "1000000000"], None),
    ("best-of-huge", None, ["eval", "--model", "{mdlm}", "--task", "sudoku", "--n", "1", "--best-of", "1000000000",
                            "--temperature", "1"], ["--best-of must be in [1, 1024]"], None),
    ("samples-huge", None, [*SUDOKU, "--samples", "1000000000"], ["--samples must be in [1, 1024]"], None),
    ("eval-samples-huge", None, ["eval", "--model", "{ck}", "--samples", "100000"],
     ["--samples must be in [1, 1024]"], None),
    # --out that cannot be one
    ("train-out-file", None, ["train", "--out", "afile", *TINY], ["--out afile", "not a folder"], None),
    ("train-out-symlink", None, ["train", "--out", "link", *TINY], ["--out link", "not a folder"], None),
    ("export-out-file", None, ["export", "--model", "{ck}", "--out", "afile"], ["--out afile", "not a folder"], None),
    ("export-out-symlink", None, ["export", "--model", "{ck}", "--out", "link", "--overwrite"], ["not a folder"], None),
    ("export-out-dot", None, ["export", "--model", "{ck}", "--out", "."], ["--out .", "overlaps the input"], None),
    ("import-out-file", None, ["import", "--hf", "{hf}", "--out", "afile"], ["--out afile", "not a folder"], None),
    ("bench-out-dot", None, ["bench", "--model", "{ck}", "--data", "{corpus}", "--out", "."], ["--out", "file"], None),
    ("bench-out-dir", None, ["bench", "--model", "{ck}", "--data", "{corpus}", "--out", "user"], ["is a folder"], None),
    ("distill-out-dir", None, ["distill", "--target", "{ck}", "--out", "d.jsonl"], ["d.jsonl", "is a folder"], None),
    # wrong answers that looked right: a diffusion checkpoint where an ar one is meant
    ("bench-diffusion-model", None, ["bench", "--model", "{mdlm}", "--data", "{corpus}", "--out", ""],
     ["'mdlm'", "--mdlm"], None),
    ("draft-diffusion-target", None, ["generate", "--model", "{mdlm}", "--prompt", "x", "--draft", "lookup"],
     ["--draft", "AR target", "mdlm"], None),
    # a checkpoint's recorded paths are not followed
    ("eval-recorded-data", records(data="{secret}"), ["eval", "--model", "crafted"], ["--data", "not followed"], None),
    # (bench reads no recorded corpus: its cases come from --data or the embedded held-out split)
]


@pytest.mark.parametrize("name, setup, argv, needles, stdin", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_touches_nothing(sandbox, paradigms, name, setup, argv, needles, stdin):
    paths = {"mdlm": paradigms["mdlm"]}
    if setup is not None:
        setup(sandbox, paths)
    fill = {**sandbox, **{k: str(v) for k, v in paths.items()}}
    w = Path(sandbox["w"])
    before, outside = snapshot(w), snapshot(w.parent)
    line = one_line_error(cli(*[a.format(**fill) for a in argv], stdin=stdin), *needles)
    assert snapshot(w) == before and snapshot(w.parent) == outside, line  # nothing deleted, written or left behind
    assert "hunter2" not in line


def test_the_table_covers_every_command():
    commands = {c[2][0] for c in CASES}
    assert commands >= {"train", "generate", "eval", "export", "import", "bench", "demo", "distill"}


# --- export and import never delete what they did not write ------------------------------------------------------

def test_export_and_import_refuse_their_own_input(tiny_ar, tmp_path, monkeypatch):
    p = tmp_path / "P"
    run = copy_checkpoint(tiny_ar, p / "model", state=True)
    (p / "keep.txt").write_text("mine")
    before = snapshot(tmp_path)
    for argv in (["export", "--model", str(run), "--out", str(p)],  # the folder that holds the input
                 ["export", "--model", str(run), "--out", str(p), "--overwrite"],
                 ["export", "--model", str(run), "--out", str(run), "--overwrite"],  # the input itself (its state/)
                 ["export", "--model", str(run), "--out", str(run / "state"), "--overwrite"],  # inside it
                 ["export", "--model", str(run), "--out", str(run), "--format", "dlm", "--overwrite"]):
        one_line_error(cli(*argv), "overlaps the input")
    monkeypatch.chdir(run / "state")
    one_line_error(cli("export", "--model", str(run), "--out", ".."), "overlaps the input")
    assert snapshot(tmp_path) == before


def test_export_out_dotdot_and_import_over_user_files_keep_them(tiny_ar, hf_export, tmp_path, monkeypatch):
    p = tmp_path / "P"
    (p / "sub").mkdir(parents=True)
    (p / "notes.txt").write_text("mine")
    (p / "config.json").write_text("{\"mine\": true}")  # a user's file of the name an export writes
    monkeypatch.chdir(p / "sub")
    one_line_error(cli("export", "--model", str(tiny_ar), "--out", ".."), "not empty", "--overwrite")
    assert (p / "config.json").read_text() == "{\"mine\": true}"
    code, out, err = cli("export", "--model", str(tiny_ar), "--out", "..", "--overwrite")
    assert code == 0, err
    assert (p / "notes.txt").read_text() == "mine" and (p / "sub").is_dir()  # untouched: not ours
    assert json.loads((p / "config.json").read_text())["model_type"] == "qwen3"  # --overwrite: ours replaced it

    user = tmp_path / "U"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    one_line_error(cli("import", "--hf", str(hf_export), "--out", str(user)), "not empty")
    assert sorted(os.listdir(user)) == ["notes.txt"]
    assert cli("import", "--hf", str(hf_export), "--out", str(user), "--overwrite")[0] == 0
    assert (user / "notes.txt").read_text() == "mine"
    assert open_checkpoint(user).objective == "ar"
    assert not [f for f in tmp_path.rglob("*.tmp")]


def test_export_into_an_empty_current_folder(tiny_ar, tmp_path, monkeypatch):
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    assert cli("export", "--model", str(tiny_ar), "--out", ".", "--format", "dlm")[0] == 0
    assert Path.cwd() == tmp_path / "here" and open_checkpoint(".").objective == "ar"
    assert sorted(os.listdir(tmp_path)) == ["here"]


def test_an_export_that_fails_midway_leaves_nothing(tiny_ar, tmp_path, monkeypatch):
    import dlm.hf

    def full_disk(*a, **k):
        raise DlmError("No space left on device (simulated)")

    monkeypatch.setattr(dlm.hf, "write_json", full_disk)  # after model.safetensors was written
    (tmp_path / "existing").mkdir()
    (tmp_path / "existing" / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    one_line_error(cli("export", "--model", str(tiny_ar), "--out", str(tmp_path / "new")), "No space left")
    one_line_error(cli("export", "--model", str(tiny_ar), "--out", str(tmp_path / "existing"), "--overwrite"),
                   "No space left")
    assert snapshot(tmp_path) == before  # no half-written folder, no temporary one


OUTS = [".", "..", "P", "P/model", "P/model/state", "P/user", "P/user/notes.txt", "P/link", "P/new", "P/new/deeper",
        "P/afile", "P/model/config.json"]


@pytest.mark.parametrize("command", ["export-hf", "export-dlm", "import"])
def test_export_and_import_never_delete_a_file_they_did_not_write(command, tiny_ar, hf_export, tmp_path,
                                                                   monkeypatch):
    """Every --out, with and without --overwrite: afterwards every file that was there is there, and a changed
    one is only ever a file of the name the command writes, directly in the --out it was told."""
    p = tmp_path / "P"
    run = copy_checkpoint(tiny_ar, p / "model", state=True)
    (p / "user" / "deep").mkdir(parents=True)
    (p / "user" / "notes.txt").write_text("mine")
    (p / "user" / "deep" / "config.json").write_text("mine too")
    (p / "afile").write_text("a file")
    (p / "link").symlink_to("user")
    monkeypatch.chdir(p / "user")
    source = str(hf_export) if command == "import" else str(run)
    base = (["import", "--hf", source] if command == "import" else
            ["export", "--model", source, "--format", command.split("-")[1]])
    for out in OUTS:
        for overwrite in ((), ("--overwrite",)):
            before = snapshot(tmp_path)
            code, _, err = cli(*base, "--out", str(p / out) if out not in (".", "..") else out, *overwrite)
            assert code in (0, 2) and "Traceback" not in err, err
            after = snapshot(tmp_path)
            target = (p / "user" / out).resolve() if out in (".", "..") else (p / out).resolve()
            for rel, digest in before.items():
                assert rel in after, (out, overwrite, "deleted", rel)
                if after[rel] != digest:
                    assert overwrite and (tmp_path / rel).parent.resolve() == target, (out, overwrite, "changed", rel)
            if code == 2:
                assert after == before, (out, overwrite)
    assert not [f for f in tmp_path.rglob("*.tmp")]


# --- one training per folder; resume; failed runs ---------------------------------------------------------------

def _train_argv(out: Path, corpus_dir, tokenizer_path, steps: int) -> list[str]:
    return ["train", "--objective", "ar", "--preset", "tiny", "--data", str(corpus_dir), "--tokenizer",
            str(tokenizer_path), "--seq-len", "32", "--batch-size", "2", "--max-steps", str(steps), "--save-every",
            "50", "--eval-every", "1000", "--eval-batches", "1", "--log-every", "1", "--out", str(out), "--quiet"]


def test_a_second_training_on_the_same_folder_is_refused(corpus_dir, tokenizer_path, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # the second process imports everything first and waits: its lock check then comes within milliseconds
    go = tmp_path / "go"
    waiter = ("import sys, time, pathlib, torch, dlm.cli, dlm.train\n"
              "go = pathlib.Path(sys.argv[1])\n"
              "t0 = time.time()\n"
              "while not go.exists() and time.time() - t0 < 300: time.sleep(0.01)\n"
              "sys.exit(dlm.cli.main(sys.argv[2:]))\n")
    steps = 150
    second = subprocess.Popen([sys.executable, "-c", waiter, str(go), *_train_argv(out, corpus_dir, tokenizer_path,
                                                                                   steps)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = subprocess.Popen([sys.executable, "-m", "dlm.cli", *_train_argv(out, corpus_dir, tokenizer_path, steps)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 240
        while time.time() < deadline and not ((out / ".lock").exists() and (out / "metrics.jsonl").exists()):
            assert first.poll() is None, first.communicate()
            time.sleep(0.01)
        go.touch()  # the first is training now
        _, err2 = second.communicate(timeout=240)
        out1, err1 = first.communicate(timeout=600)
    finally:
        for p in (first, second):
            if p.poll() is None:
                p.kill()
    assert second.returncode == 2 and len(err2.strip().splitlines()) == 1, err2
    assert f"another training (pid {first.pid})" in err2 and "Traceback" not in err2
    assert first.returncode == 0, err1
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, steps + 1))  # its rows, each once
    assert not (out / ".lock").exists() and open_checkpoint(out).config["step"] == steps


@pytest.fixture
def finished_run(corpus_dir, tokenizer_path, tmp_path) -> Path:
    from dlm.train import train

    out = tmp_path / "r"
    train(tiny_train_config(corpus_dir, tokenizer_path, seq_len=32, batch_size=2, max_steps=6, eval_every=3,
                            save_every=3, log_every=1), out, quiet=True)
    return out


def test_resume_after_a_torn_metrics_line_and_leftover_temporary_files(finished_run, corpus_dir, tokenizer_path):
    out = finished_run
    with open(out / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 7, "loss": 3.1')  # a kill in the middle of a write
    leftovers = [out / f".model.safetensors.{os.getpid() + 1}.tmp", out / "state" / ".optimizer.safetensors.99.tmp",
                 out / ".tokenizer.json.12345.tmp"]
    for f in leftovers:
        f.write_bytes(b"\0" * 1000)
    (out / "state.tmp").mkdir()
    code, _, err = cli(*_train_argv(out, corpus_dir, tokenizer_path, 8)[:-1], "--resume", "--quiet")
    assert code == 0, err
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]  # every line parses
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 9))
    assert not any(f.exists() for f in leftovers) and not (out / "state.tmp").exists()


@pytest.mark.parametrize("option, value", [("--lr", "0.5"), ("--objective", "mdlm"), ("--seq-len", "48")])
def test_resume_refuses_options_that_contradict_the_saved_run(finished_run, corpus_dir, tokenizer_path, option,
                                                               value):
    before = snapshot(finished_run)
    argv = [a for a in _train_argv(finished_run, corpus_dir, tokenizer_path, 6) if a not in ("--seq-len", "32")]
    one_line_error(cli(*argv, "--resume", option, value), "--resume", option, value)
    assert snapshot(finished_run) == before


@pytest.mark.parametrize("how", ["refused", "diverged"])
def test_a_failed_training_leaves_nothing(how, corpus_dir, tokenizer_path, tmp_path, monkeypatch):
    out = tmp_path / "new"
    argv = _train_argv(out, corpus_dir, tokenizer_path, 4)
    if how == "diverged":  # fails in the loop, after tokenizer.json and the first metrics were written
        from dlm.objectives.ar import AR

        real = AR.loss
        monkeypatch.setattr(AR, "loss", lambda self, *a: (real(self, *a)[0] * float("nan"), {}))
        one_line_error(cli(*argv), "loss became nan")
    else:
        one_line_error(cli(*argv, "--beta1", "1.5"), "--beta1")
    assert not out.exists()
    empty = tmp_path / "empty"  # a folder the user made stays, empty
    empty.mkdir()
    one_line_error(cli(*_train_argv(empty, corpus_dir, tokenizer_path, 4), "--lr", "-1"), "--lr")
    assert empty.is_dir() and not any(empty.iterdir())


# --- confinement: a checkpoint's recorded paths, an index's shards, a config.json's sizes ---------------------------

def test_a_recorded_reference_path_is_not_followed(paradigms, tiny_ar, corpus_dir, tmp_path):
    """An mdlm checkpoint recording --init-from PATH (a valid AR model with its tokenizer): eval does not open it."""
    elsewhere = copy_checkpoint(tiny_ar, tmp_path / "elsewhere")
    ck = edit_config(copy_checkpoint(paradigms["mdlm"], tmp_path / "m"), train__init_from=str(elsewhere))
    code, out, err = cli("eval", "--model", str(ck), "--data", str(corpus_dir), "--max-batches", "1", "--samples",
                         "1", "--json")
    assert code == 0, err
    res = json.loads(out)
    assert res["reference"] != str(elsewhere) and f"--reference {elsewhere}" in res["reference_note"]
    code, out, err = cli("eval", "--model", str(ck), "--data", str(corpus_dir), "--max-batches", "1", "--samples",
                         "1", "--json", "--reference", str(elsewhere))  # named by the user: used
    assert code == 0 and json.loads(out)["reference"] == str(elsewhere), err


def test_a_reference_name_must_be_a_plain_shipped_name(monkeypatch, tmp_path):
    from dlm.checkpoint import shipped

    monkeypatch.setenv("DLM_CHECKPOINTS", str(tmp_path / "ckpts"))
    (tmp_path / "ckpts" / "ar-small").mkdir(parents=True)
    (tmp_path / "ckpts" / "ar-small" / "config.json").write_text("{}")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "config.json").write_text("{}")
    assert shipped("ar-small") == tmp_path / "ckpts" / "ar-small"
    for name in ("../outside", str(tmp_path / "outside"), "", ".", "ar-small/..", "checkpoints/ar-small"):
        assert shipped(name) is None, name


def test_shipped_checkpoints_record_no_absolute_paths():
    def strings(obj, where=""):
        if isinstance(obj, dict):
            for k, v in obj.items():
                yield from strings(v, f"{where}.{k}")
        elif isinstance(obj, list):
            for i, v in enumerate(obj):
                yield from strings(v, f"{where}[{i}]")
        elif isinstance(obj, str):
            yield where, obj

    root = Path(__file__).resolve().parent.parent / "checkpoints"
    configs = sorted(root.glob("*/config.json"))
    assert configs
    for cfg in configs:
        for where, s in strings(json.loads(cfg.read_text())):
            assert not os.path.isabs(s) and not s.startswith(("~", "..")), (cfg, where, s)


def test_a_drafter_records_its_target_by_name(tiny_ar, corpus_dir, tokenizer_path):
    from dlm.objectives.dflash import DFlash
    from dlm.tokenizer import Tokenizer

    cfg = tiny_train_config(corpus_dir, tokenizer_path, objective="dflash", target=str(tiny_ar), tokenizer=None)
    target = DFlash(cfg, Tokenizer.from_file(tiny_ar)).meta()["dflash"]["target"]
    assert target["name"] == tiny_ar.name and "path" not in target
    assert str(tiny_ar.parent) not in json.dumps(target)


def test_model_shapes_are_computed_exactly(tiny_ar):
    """The shapes a config implies (checked against a header before building) are a built model's."""
    from dlm.checkpoint import model_shapes
    from dlm.config import preset
    from dlm.drafter import build_drafter, drafter_shapes
    from dlm.model import Transformer, param_shapes

    for kw in ({}, {"tie_embeddings": False}, {"qk_norm": False}, {"self_cond": True}, {"head_dim": 32},
               {"learned_pos": True}):
        cfg = preset("tiny", vocab_size=300, **kw)
        assert param_shapes(cfg) == model_shapes(Transformer(cfg)), kw
    for features in (True, False):
        config = {"model": preset("tiny", vocab_size=300, n_layers=1).to_dict(),
                  "dflash": {"target_layer_ids": [0, 1], "block_size": 4, "mask_token_id": 3,
                             "target_features": features}}
        assert drafter_shapes(config) == model_shapes(build_drafter(config))


def test_a_crafted_config_allocates_nothing(tiny_ar, tmp_path, monkeypatch):
    """config.json asking for 1000 layers of width 8192 (~3T bytes) is refused from the header, before building."""
    import dlm.checkpoint

    ck = edit_config(copy_checkpoint(tiny_ar, tmp_path / "c"), model__n_layers=1000, model__dim=8192,
                     model__ffn_dim=1 << 16)
    monkeypatch.setattr(dlm.checkpoint, "Transformer", lambda cfg: pytest.fail("built before the header check"))
    with pytest.raises(DlmError, match="does not match its config.json"):
        load_model(ck)


def test_a_truncated_token_cache_is_rebuilt(corpus_dir, tokenizer_path, tmp_path, monkeypatch):
    from dlm.data.corpus import Corpus
    from dlm.data.tokens import load_tokens, token_file
    from dlm.tokenizer import Tokenizer

    monkeypatch.setenv("DLM_CACHE", str(tmp_path / "cache"))
    corpus, tok = Corpus(str(corpus_dir)), Tokenizer.from_file(tokenizer_path)
    good = load_tokens(corpus, tok, "val").copy()
    path = token_file(corpus, tok, "val")
    for cut in (len(path.read_bytes()) // 2, 100, 10, 0):  # inside the data, inside the header, empty
        path.write_bytes(path.read_bytes()[:cut])
        assert (load_tokens(corpus, tok, "val") == good).all()
    path.with_name("val.json").unlink()  # a build killed between the two files
    assert (load_tokens(corpus, tok, "val") == good).all() and path.with_name("val.json").exists()


def test_non_finite_model_output_is_named():
    from dlm.sampling.common import sample_from

    with pytest.raises(DlmError, match="NaN or infinite"):
        sample_from(torch.tensor([[0.5, float("nan")]]), None)


# --- signals and pipes ---------------------------------------------------------------------------------------------

def test_ctrl_c_at_any_moment_is_exit_130_without_a_traceback(tiny_ar):
    """SIGINT while dlm imports torch, loads, generates: exit 130, one line, no traceback."""
    code = ("import os, signal, sys\n"
            "from dlm.cli import main\n"  # (the interpreter's own start-up runs no code of dlm's)
            "if sys.argv[1] == 'forward':\n"  # during generation: at the model's third forward, whatever the speed
            "    import dlm.model\n"
            "    forward, calls = dlm.model.Transformer.forward, []\n"
            "    def interrupted(*a, **k):\n"
            "        calls.append(1)\n"
            "        if len(calls) == 3:\n"
            "            os.kill(os.getpid(), signal.SIGINT)\n"
            "        return forward(*a, **k)\n"
            "    dlm.model.Transformer.forward = interrupted\n"
            "else:\n"
            "    signal.signal(signal.SIGALRM, lambda *_: os.kill(os.getpid(), signal.SIGINT))\n"
            "    signal.setitimer(signal.ITIMER_REAL, float(sys.argv[1]))\n"
            "try:\n"
            "    code = main(sys.argv[2:])\n"
            "except KeyboardInterrupt as e:\n"  # one that escaped main is dlm's defect: its traceback enters dlm
            "    import traceback\n"
            "    if any(f.filename != '<string>' for f in traceback.extract_tb(e.__traceback__)):\n"
            "        raise\n"
            "    sys.exit(99)\n"  # delivered in this harness before main was entered (a busy CPU): not dlm's
            "sys.exit(code)\n")
    delays = ("0.001", "0.05", "0.3", "forward")

    def start(d):
        return subprocess.Popen([sys.executable, "-c", code, d, "generate", "--model", str(tiny_ar), "--prompt",
                                 "def f(", "--max-new-tokens", "400", "--temperature", "1"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    procs = [start(d) for d in delays]
    for d, p in zip(delays, procs):
        err = p.communicate(timeout=180)[1]
        for _ in range(3):  # the signal came before dlm's main: run that moment again
            if p.returncode != 99:
                break
            p = start(d)
            err = p.communicate(timeout=180)[1]
        assert p.returncode == 130 and "Traceback" not in err, (d, p.returncode, err)
        assert err.strip().splitlines() in ([], ["dlm: interrupted"]), (d, err)


def test_ctrl_c_swallowed_by_a_library_still_stops_the_command(tiny_ar, monkeypatch, capsys):
    """A library whose import catches everything (a bare `except:`) must not turn Ctrl-C into a finished run."""
    import dlm.cliargs
    from dlm.cli import main

    run, swallowed = dlm.cliargs.run, []

    def swallowing(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)  # the handler raises in here
        except BaseException as e:
            swallowed.append(e)
        return run(*args, **kwargs)

    monkeypatch.setattr(dlm.cliargs, "run", swallowing)
    before = signal.getsignal(signal.SIGINT)
    assert main(["generate", "--model", str(tiny_ar), "--prompt", "def f(", "--max-new-tokens", "2"]) == 130
    assert [type(e) for e in swallowed] == [KeyboardInterrupt] and capsys.readouterr().err == "dlm: interrupted\n"
    assert signal.getsignal(signal.SIGINT) is before  # main gives the handler back


def test_ctrl_c_that_breaks_an_import_into_another_error_is_still_an_interrupt(tiny_ar, monkeypatch, capsys):
    """Ctrl-C in the middle of a library's import can leave it half-loaded, and the next import of it fails with
    another error (numpy: "cannot load module more than once per process"): that is exit 130, not a traceback;
    the same error without a Ctrl-C is not hidden."""
    import dlm.cliargs
    from dlm.cli import main

    def broken_import(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(30)  # the handler raises in here
        except KeyboardInterrupt:
            pass  # the library swallowed it half-way ...
        raise ImportError("cannot load module more than once per process")  # ... and fails on the next import

    monkeypatch.setattr(dlm.cliargs, "run", broken_import)
    assert main(["generate", "--model", str(tiny_ar), "--prompt", "def f(", "--max-new-tokens", "2"]) == 130
    assert capsys.readouterr().err == "dlm: interrupted\n"

    def failing(*args, **kwargs):
        raise ImportError("a real import error")

    monkeypatch.setattr(dlm.cliargs, "run", failing)
    with pytest.raises(ImportError, match="a real import error"):
        main(["generate", "--model", str(tiny_ar), "--prompt", "def f(", "--max-new-tokens", "2"])


@pytest.mark.parametrize("extra", [[], ["--show"]])
def test_a_closed_pipe_is_exit_141_quietly(tiny_ar, extra):
    """`dlm generate | head -1`: the reader is gone; no message, exit 141 (SIGPIPE's status), as with --show."""
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, "-m", "dlm.cli", "generate", "--model", str(tiny_ar), "--prompt", "def f(",
                            "--max-new-tokens", "3", *extra], stdout=w, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(w)
    assert (p.returncode, p.stderr) == (141, "")


# --- options the paradigm does not read; stdout that is one JSON object ----------------------------------------

@pytest.mark.parametrize("paradigm, flags, warning", [
    ("ar", ["--block-size", "4"], "--block-size does not apply to an ar checkpoint; ignored"),
    ("ar", ["--steps", "3", "--canvas-length", "8"], "--steps, --canvas-length do not apply to an ar checkpoint; ignored"),
    ("mdlm", ["--canvas-length", "8"], "--canvas-length does not apply to an mdlm checkpoint; ignored"),
    ("usdm", ["--threshold", "0.5", "--steps", "2"], "--threshold does not apply to a usdm checkpoint; ignored"),
    ("ar", ["--draft", "lookup", "--naive", "--draft-passes", "2"],
     "--naive, --draft-passes do not apply to speculative decoding with --draft lookup; ignored"),
    ("mdlm", ["--fill-length", "4"], "--fill-length sizes <fill> markers, and the prompt has none; ignored"),
    ("mdlm", ["--steps", "2", "--temperature", "0.5", "--remasking", "random"], None),
    ("usdm", ["--t-max", "0.9", "--no-adaptive", "--steps", "3"], None),
    ("ar", ["--draft", "lookup", "--block-size", "3", "--lookup-ngram", "2", "--top-k", "5"], None),
])
def test_options_a_paradigm_does_not_read_are_named(paradigms, paradigm, flags, warning):
    code, out, err = cli("generate", "--model", str(paradigms[paradigm]), "--prompt", "def f(", "--max-new-tokens",
                         "4", *flags)
    assert code == 0, err
    assert [ln for ln in err.splitlines() if ln.startswith("dlm: warning:")] == ([f"dlm: warning: {warning}"]
                                                                               if warning else [])


@pytest.mark.parametrize("paradigm", ["ar", "mdlm", "usdm"])
def test_json_with_show_prints_one_json_object(paradigms, paradigm):
    code, out, err = cli("generate", "--model", str(paradigms[paradigm]), "--prompt", "def f(", "--max-new-tokens",
                         "4", "--json", "--show", *(["--steps", "2"] if paradigm != "ar" else []))
    assert code == 0, err
    res = json.loads(out)  # stdout is exactly one JSON object; the live view went to stderr
    assert res["new_tokens"] >= 1 and err.strip()


def test_the_cache_and_the_promises_are_documented():
    root = Path(__file__).resolve().parent.parent
    assert "DLM_CACHE" in (root / "README.md").read_text()
    doc = (root / "docs" / "reliability.md").read_text()
    for word in ("DLM_CACHE", "atomic", "--resume", ".lock", "exit code", "--overwrite", "not followed"):
        assert word in doc, word
    import re

    tests = {f"{m.group(1)}::{m.group(2)}" for m in re.finditer(r"tests/(test_\w+\.py)::(\w+)", doc)}
    assert len(tests) >= 10
    for t in tests:
        file, name = t.split("::")
        assert f"def {name}(" in (root / "tests" / file).read_text(), t
