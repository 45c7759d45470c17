"""`dlm`: train, generate, chat, sudoku, eval, export, import, bench, demo, distill, task, serve.

Every subcommand is a function below; tyro (through dlm.cliargs) turns its typed parameters into options.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Literal

from dlm.errors import DlmError  # (the module imports little: main's handlers cover the rest)


def _device(name: str):
    from dlm.device import resolve_device

    return resolve_device(name)


def _console(**kw):
    """A rich Console that lets a broken pipe (`dlm generate | head -1`) reach main (exit 141, quietly):
    rich's own reaction is exit code 1."""
    from rich.console import Console

    class PipeConsole(Console):
        def on_broken_pipe(self) -> None:
            self.quiet = True
            raise BrokenPipeError

    return PipeConsole(**kw)


def _text(text: str, option: str) -> str:
    """Text from the command line or a file must be UTF-8 (undecodable bytes arrive as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = ord(text[e.start]) - 0xDC00 if 0xDC80 <= ord(text[e.start]) <= 0xDCFF else ord(text[e.start])
        raise DlmError(f"{option}: not UTF-8 text (byte {bad:#04x} at character {e.start})") from None
    return text


def _read_text(path: str) -> str:
    """--prompt-file: a UTF-8 file, or standard input for '-'."""
    from pathlib import Path

    try:
        if path == "-":
            stdin = getattr(sys.stdin, "buffer", None)
            data = stdin.read() if stdin is not None else sys.stdin.read().encode("utf-8", "surrogateescape")
        elif Path(path).exists() and not Path(path).is_file():  # a folder, or a device that never ends
            raise DlmError(f"--prompt-file {path}: not a regular file ('-' reads standard input)")
        else:
            with open(path, "rb") as fh:
                data = fh.read()
    except OSError as e:
        raise DlmError(f"--prompt-file: cannot read {path} ({e.strerror})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        where = "standard input" if path == "-" else path
        raise DlmError(f"--prompt-file: {where} is not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start})") \
            from None


def unused_options(scfg, objective: str, prompt: str = "") -> list[str]:
    """Warnings naming the sampling options that were set (differ from their defaults) but are not read: by the
    checkpoint's paradigm (dlm.sampling.OPTIONS, each sampler's own declaration), or --fill-length without <fill>
    markers in the prompt."""
    import dataclasses

    from dlm.sampling import OPTIONS, options_read
    from dlm.drafters import drafter_kind

    paradigm = "speculative" if scfg.draft else objective
    if paradigm not in OPTIONS:
        return []  # a checkpoint that cannot sample: its own error follows
    reads = options_read(paradigm, drafter_kind(scfg.draft) if scfg.draft else None) | {"fill_length"}
    defaults = type(scfg)()
    changed = {f.name for f in dataclasses.fields(scfg) if getattr(scfg, f.name) != getattr(defaults, f.name)}
    unused = [f.name for f in dataclasses.fields(scfg) if f.name in changed - reads]
    out = []
    if unused:
        names = ", ".join("--" + n.replace("_", "-") for n in unused)
        what = f"speculative decoding with --draft {scfg.draft}" if paradigm == "speculative" else \
            f"{'an' if paradigm in ('ar', 'mdlm') else 'a'} {paradigm} checkpoint"
        out.append(f"{names} {'does' if len(unused) == 1 else 'do'} not apply to {what}")
    if "fill_length" in changed and "<fill" not in prompt:
        out.append("--fill-length sizes <fill> markers, and the prompt has none")
    return out


def train_cmd(cfg, out: str, resume: bool = False, quiet: bool = False) -> None:
    """Train a model (AR, diffusion, or a DFlash drafter) into a checkpoint folder.

    Args:
        out: the checkpoint folder to write (config.json, model.safetensors, tokenizer.json, metrics.jsonl)
        resume: continue the training state saved in --out (exactly, after any interruption)
        quiet: no progress bar
    """
    import dataclasses

    from dlm.config import TrainConfig

    if not resume:  # a bad option is refused before torch is imported (resumed: checked against the saved run)
        cfg.validate()
    if quiet or os.environ.get("RANK", "0") != "0":
        from dlm.train import train
    else:  # a few seconds: said from the first one
        with _console(stderr=True).status("[bold]train[/] importing torch"):
            from dlm.train import train

    defaults = TrainConfig()
    explicit = {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(defaults, f.name)}
    path = train(cfg, out, resume=resume, quiet=quiet, explicit=explicit)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for the run
        print(f"checkpoint: {path}")


def generate_cmd(
    scfg, model: str, prompt: str = "", prompt_file: str | None = None, json: bool = False, show: bool = False,
    device: str = "auto", dtype: Literal["auto", "stored", "fp32", "bf16"] = "auto",
) -> None:
    """Generate text with a checkpoint (its paradigm's sampler).

    Args:
        model: checkpoint folder
        prompt: text to continue
        prompt_file: read the prompt from this file instead ('-' for standard input)
        json: print one JSON object with the text and the statistics
        show: live view: redraw the canvas at every denoising step (or stream tokens as they commit)
        device: auto (a CUDA GPU when there is one, else the CPU), cpu, cuda or cuda:N
        dtype: the weights' precision: stored (as the checkpoint holds them, memory-mapped: no copy of a large
            imported model; fp32 for what dlm trains), fp32 or bf16; auto = stored, but float16 weights
            (the shipped checkpoints) run in fp32 on a CPU, as eval and bench run them, and fp32 weights in bf16
            on a GPU that supports it
    """
    from dlm.device import check_device_name

    scfg.check()  # a bad option is refused before torch and the samplers are imported
    check_device_name(device)
    if prompt_file:
        prompt = _read_text(prompt_file)
    prompt = _text(prompt, "--prompt-file" if prompt_file else "--prompt")
    if scfg.suffix is not None:
        _text(scfg.suffix, "--suffix")
    import torch

    from dlm.checkpoint import load_model
    from dlm.sampling import encode, generate, stream, with_model_defaults
    if dtype == "auto":
        from dlm.checkpoint import open_checkpoint

        dev = _device(device)
        stored = open_checkpoint(model).config.get("dtype")
        if dev.type == "cpu":
            dtype = "fp32" if stored == "float16" else "stored"
        else:
            dtype = "bf16" if stored in (None, "float32") and torch.cuda.is_bf16_supported() else "stored"
    net, ck = load_model(model, device=_device(device),
                         dtype={"fp32": torch.float32, "bf16": torch.bfloat16, "stored": None}[dtype])
    for warning in unused_options(scfg, ck.objective, prompt):
        sys.stderr.write(f"dlm: warning: {warning}; ignored\n")
    scfg = with_model_defaults(ck, scfg)  # an imported model's generation_config.json, for the options not given
    if show:  # with --json the live view goes to stderr: stdout holds the one JSON object
        from dlm.sampling.show import live

        view = _console(file=sys.stderr) if json else _console()
        res = live(stream(net, ck, encode(ck, prompt, scfg), scfg, step_events=True), ck.tokenizer, prompt,
                   console=view, mask_id=ck.mask_id)
    else:
        res = generate(net, ck, prompt, scfg)
    stats = res.stats.as_dict()
    pieces, out = _output(ck, prompt, scfg, res)
    if json:
        print(_dumps({**out, **stats}))
        return
    from rich.text import Text

    con = _console()
    con.print(Text.assemble(*((text, "bold green" if new else "dim") for text, new in pieces)))
    con.print(f"[dim]{stats['new_tokens']} tokens, {stats['forwards']} forwards "
              f"({stats['tokens_per_forward']:.2f} tok/forward), {stats['tokens_per_second']:.1f} tok/s[/]")


def _output(ck, prompt: str, scfg, res) -> tuple[list[tuple[str, bool]], dict]:
    """What `dlm generate` shows: the document as (text, generated?) pieces, and its --json fields. A suffix
    request's text is the middle (the suffix follows it, as the server's `suffix` returns it); a <fill> template's
    text is the filled document whole, with each hole's text in "fills"; otherwise the continuation."""
    from dlm.sampling import encode
    from dlm.sampling.infill import filled_pieces, has_markers

    if scfg.suffix is not None:
        middle = res.text[:len(res.text) - len(scfg.suffix)] if res.text.endswith(scfg.suffix) else res.text
        return [(prompt, False), (middle, True), (scfg.suffix, False)], {"text": middle}
    if has_markers(prompt):
        (p,) = encode(ck, prompt, scfg)
        pieces = [(ck.tokenizer.decode(p.ids), False)] + filled_pieces(ck.tokenizer, p, res.tokens[0])
        return pieces, {"text": "".join(t for t, _ in pieces), "fills": [t for t, new in pieces if new]}
    return [(prompt, False), (res.text, True)], {"text": res.text}


def chat_cmd(scfg, model: str, system: str | None = None, device: str = "auto") -> None:
    """Chat with a checkpoint from the terminal: each line of standard input is a user message; the reply follows.

    The messages go through the chat template the server's /v1/chat/completions uses (docs/serve.md); the reply
    ends at the template's next header. The earliest turns are dropped when the conversation outgrows the model's
    context. The shipped models were trained on code, not chat: expect code-shaped replies.

    Args:
        model: checkpoint folder
        system: a system message put first
        device: auto (a CUDA GPU when there is one, else the CPU), cpu, cuda or cuda:N
    """
    from dlm.device import check_device_name

    scfg.check()
    check_device_name(device)
    from dlm.chat import chat_prompt, reply_of
    from dlm.checkpoint import load_model
    from dlm.sampling import generate, with_model_defaults

    net, ck = load_model(model, device=_device(device))
    for warning in unused_options(scfg, ck.objective):
        sys.stderr.write(f"dlm: warning: {warning}; ignored\n")
    scfg = with_model_defaults(ck, scfg)  # an imported model's generation_config.json, for the options not given
    head = [("system", _text(system, "--system"))] if system else []
    turns: list[tuple[str, str]] = []
    room = net.cfg.max_seq_len - scfg.max_new_tokens
    tty = sys.stdin.isatty()
    while True:
        if tty:
            sys.stderr.write("> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line:
            break
        if not line.strip():
            continue
        turns.append(("user", line.rstrip("\n")))
        while len(ck.tokenizer.encode(chat_prompt(head + turns))) > room and len(turns) > 1:
            turns = turns[2:] if len(turns) > 2 else turns[1:]  # the earliest exchange goes
        res = generate(net, ck, chat_prompt(head + turns), scfg)
        reply = reply_of(res.text).strip("\n")
        turns.append(("assistant", reply))
        print(reply, flush=True)


def sudoku_cmd(puzzle: str, model: str | None = None, device: str = "auto") -> None:
    """Solve one sudoku with a checkpoint trained on them and print the grid.

    Args:
        puzzle: 81 cells row by row, 0 or . for a blank (spaces, | and newlines are skipped)
        model: a sudoku checkpoint (default: the shipped sudoku-mdlm, decoding in parallel: --sampler threshold
            --threshold 0.999, as docs/sudoku.md measures it)
        device: auto (a CUDA GPU when there is one, else the CPU), cpu, cuda or cuda:N
    """
    from dlm.device import check_device_name

    quiz = "".join("0" if c == "." else c for c in puzzle if c not in " |\n\t-+")
    if len(quiz) != 81 or not all(c in "0123456789" for c in quiz):
        raise DlmError(f"the puzzle must be 81 cells, digits with 0 or . for a blank; got {len(quiz)} characters "
                       f"{'(not all digits)' if not quiz.replace('.', '').isdigit() else ''}".rstrip())
    check_device_name(device)
    from dlm.tasks import sudoku as rules

    grid = [int(c) for c in quiz]
    if rules.count_solutions(grid, 1) == 0:
        raise DlmError("the puzzle has no solution (its givens break the rules, or no grid completes them)")
    from dlm.checkpoint import load_model, shipped
    from dlm.config import SampleConfig
    from dlm.sampling import stream
    from dlm.sampling.common import drain
    from dlm.tasks.common import Case, style_of

    if model is None:
        found = shipped("sudoku-mdlm")
        if found is None:
            raise DlmError("--model: no checkpoint given and the shipped sudoku-mdlm is missing")
        model = str(found)
    net, ck = load_model(model, device=_device(device))
    if not ck.config.get("train", {}).get("data", "").endswith(".csv"):
        sys.stderr.write(f"dlm: warning: {model} was not trained on sudoku puzzles (a .csv corpus)\n")
    cfg = SampleConfig(max_new_tokens=81, sampler="threshold" if ck.objective == "mdlm" else "auto", threshold=0.999)
    req = rules.request(Case("puzzle", quiz, ""), ck, cfg, style_of(ck, None, cfg), 0)
    res = drain(stream(net, ck, [req.prompt], cfg.replace(max_new_tokens=req.max_new_tokens)), ck.tokenizer.decode,
                ck.tokenizer.eos_set)
    answer = req.read(res)
    cells = rules.parse_grid(answer)
    from rich.text import Text

    con = _console()
    out = Text()
    for r in range(9):
        if r in (3, 6):
            out.append("------+-------+------\n")
        for c in range(9):
            if c in (3, 6):
                out.append("| ")
            i = r * 9 + c
            digit = str(cells[i]) if cells else (answer.strip()[i:i + 1] or "?")
            out.append(digit, style="dim" if quiz[i] != "0" else "bold green")
            out.append(" " if c < 8 else "")
        out.append("\n")
    con.print(out, end="")
    s = res.stats.as_dict()
    verdict = "solved: every row, column and box holds 1-9" if rules.is_valid(quiz, cells) else \
        "not solved: the grid breaks the rules"
    con.print(f"[dim]{verdict}; {rules.clues_of(quiz)} givens, {81 - rules.clues_of(quiz)} cells filled in "
              f"{s['forwards']} forwards ({ck.path.name})[/]")


def eval_cmd(model: str, scfg=None, split: str = "test", data: str | None = None, seq_len: int = 0, batch_size: int = 8,
             max_batches: int = 0, samples: int | None = None, reference: str | None = None, json: bool = False,
             device: str = "auto", task: str | None = None, n: int = 100, span: str = "line",
             context: int = 0, clues: str | None = None, cases_per_batch: int = 1, tries: int = 1,
             best_of: int = 1, pick: str = "score", allow_code_execution: bool = False) -> None:
    """Held-out loss and perplexity of a checkpoint; or, with --task, what it gets right on a task.

    --task complete|infill|sudoku runs the task's cases through the checkpoint's sampler with the generation
    options below (speculative decoding with --draft; greedy unless --temperature is given: an imported model's
    generation_config.json sampling defaults are not read here, so scores stay comparable); --seed picks the cases
    and seeds sampling (and the likelihood bound of a diffusion checkpoint without --task). docs/tasks.md describes
    the tasks.

    Args:
        model: checkpoint folder
        split: train, val or test; with --task complete/infill on the stdlib: val (to tune on) or test
        data: corpus (default: the one the checkpoint was trained on); with --task: a source file or folder
            (complete, infill; default: the stdlib's held-out test split) or a sudoku CSV (default: fresh puzzles)
        seq_len: window length (default: the training sequence length)
        batch_size: the likelihood eval (no --task): windows per forward (--task batches cases: --cases-per-batch)
        max_batches: stop after this many batches (0 = the whole split)
        samples: Monte-Carlo samples per window of a diffusion checkpoint's likelihood bound (default 4; LLaDA uses
            128; averaged over a whole split, 4 already give a standard error of ~0.01 nats, reported); with --task:
            samples per case, seeds --seed, --seed + 1, ... (default 1; --task code reports pass@k up to it)
        reference: AR checkpoint scored on the same windows beside a diffusion bound (default: the
            checkpoint's --init-from, else checkpoints/ar-small)
        json: print one JSON object
        device: auto (a CUDA GPU when there is one, else the CPU), cpu, cuda or cuda:N
        task: complete (next line of code), infill (a removed middle), sudoku (solve puzzles), code (HumanEval /
            MBPP jsonl: programs run against their tests, pass@k) or code-infill (HumanEval solutions with a hole)
        n: --task: number of cases, picked reproducibly by --seed
        span: --task infill: line (one line) or lines (1-5 lines)
        context: --task: tokens of prompt + generation at most (0 = the checkpoint's training window)
        clues: --task sudoku: givens per puzzle, A-B: fresh held-out puzzles of that difficulty (default 40-50;
            easy 40-50, medium 30-40, hard 22-27, extreme 17-21); with --data, only its puzzles in A-B
        cases_per_batch: --task, mdlm and usdm checkpoints and --draft: cases generated together as rows of one batch
            (the same answers and tokens per forward, less wall time; 1 = one case at a time; older spelling --batch)
        tries: --task sudoku: a decoder that consults the rules: a grid that breaks them is sampled again with the
            next seed, up to this many tries (needs --temperature > 0 but for usdm); reported as rule-checked, with
            the work of every try counted, never as the model's own figure (1 = off)
        best_of: --task, an mdlm or usdm checkpoint: draw each case this many times (mdlm needs --temperature > 0;
            seeds --seed, --seed + 1, ...) and keep the draw whose committed tokens the model itself gives the highest
            log-probability (no checker); every draw's forwards count (1 = off)
        pick: --best-of: score (the draw the model scores highest) or vote (the answer most draws agree on, the
            score breaking ties)
        allow_code_execution: --task code, code-infill: run the programs the model wrote (contained: namespaces or
            a fresh uid, limits; docs/reliability.md); also DLM_ALLOW_CODE_EXECUTION=1
    """
    from dlm.config import SampleConfig, check_seed
    from dlm.device import check_device_name

    scfg = scfg or SampleConfig()
    check_seed(scfg.seed)
    check_device_name(device)
    if clues is not None and task != "sudoku":
        raise DlmError("--clues goes with --task sudoku")
    if task is not None:
        if task in ("code", "code-infill"):
            from dlm.sandbox import allowed

            allowed(allow_code_execution, task)  # refused in one line unless asked for
        _eval_task(model, device, scfg, task, data, n, span, context, json, split, 1 if samples is None else samples,
                   clues, cases_per_batch, tries, best_of, pick)
        return
    if tries != 1:
        raise DlmError("--tries goes with --task sudoku")
    if best_of != 1:
        raise DlmError("--best-of goes with --task")
    samples = 4 if samples is None else samples
    if batch_size <= 0:
        raise DlmError(f"--batch-size must be > 0 (windows per forward), got {batch_size}")
    if max_batches < 0:
        raise DlmError(f"--max-batches must be >= 0 (0 = the whole split), got {max_batches}")
    if seq_len < 0:
        raise DlmError(f"--seq-len must be >= 0 (0 = the training sequence length), got {seq_len}")
    if not 1 <= samples <= 1024:
        raise DlmError(f"--samples must be in [1, 1024], got {samples}")
    from dlm.checkpoint import load_model

    net, ck = load_model(model, device=_device(device))
    from dlm.data.corpus import Corpus
    from dlm.evaluate import evaluate

    corpus = Corpus(ck.corpus(data))
    seq = seq_len or ck.config.get("train", {}).get("seq_len", 256)
    res = evaluate(net, ck, corpus, split, seq, batch_size, max_batches or None, scfg.seed, samples, reference)
    if json:
        print(_dumps(res))
    else:
        print(f"{split}: " + "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in res.items()))


def _eval_task(model: str, device: str, scfg, task: str, data: str | None, n: int, span: str, context: int,
               json: bool, split: str = "test", samples: int = 1, clues: str | None = None, batch: int = 1,
               tries: int = 1, best_of: int = 1, pick: str = "score") -> None:
    from dlm.config import SampleConfig

    scfg.check()  # bad options are refused before torch and the samplers are imported
    if context < 0:
        raise DlmError(f"--context must be >= 0 (0 = the training window), got {context}")
    if not 1 <= samples <= 1024:
        raise DlmError(f"--samples must be in [1, 1024], got {samples}")
    if batch <= 0:
        raise DlmError(f"--cases-per-batch must be > 0 (1 = one case at a time), got {batch}")
    if data is None and task != "sudoku" and split not in ("val", "test"):
        raise DlmError(f"--split with --task: val (to tune on) or test, got {split!r}")
    from dlm.tasks import run_task, task_module

    mod = task_module(task)
    if scfg.max_new_tokens == SampleConfig.max_new_tokens:  # not given: the task's own budget
        scfg = scfg.replace(max_new_tokens=mod.default_new_tokens(span))
    extra = {"clues": clues} if clues is not None else {}
    cases = mod.cases(data, n, scfg.seed, span, split, **extra)  # bad --data is refused before the model is loaded
    from dlm.checkpoint import load_model

    net, ck = load_model(model, device=_device(device))
    drafter = None
    if scfg.draft:
        from dlm.sampling.common import make_generator
        from dlm.drafters import load_drafter
        from dlm.sampling.speculative import Sampling

        drafter = load_drafter(scfg.draft, net, ck, Sampling(scfg.temperature, scfg.top_k, scfg.top_p,
                                                             make_generator(scfg.seed, net.device)),
                               scfg.draft_passes, scfg.lookup_ngram, scfg.draft_top_k)
    res = run_task(task, net, ck, scfg, drafter, data, n, scfg.seed, span, context, progress=not json, cases=cases,
                   samples=samples, batch=batch, tries=tries, best_of=best_of, pick=pick)
    res.pop("cases")
    res.update(model=str(ck.path), paradigm="speculative" if drafter else ck.objective, seed=scfg.seed)
    if task in ("infill", "code-infill"):
        res["span"] = span
    if clues is not None:
        res["clues"] = clues
    if json:
        print(_dumps(res))
        return
    unit = "problems" if "problems" in res else "cases"  # (res["n"]: the runs, cases x --samples)
    count = f"{res['n'] // samples} {unit}" + (f" x {samples} samples" if samples > 1 else "")
    print(f"{task} ({count}, {ck.path}): " + "  ".join(
        f"{k} {res[k]:.3f}" for k in [*mod.METRICS, *(k for k in res if k.startswith("pass_at_") and k not in
                                                       mod.METRICS), "tokens_per_forward"]
        + (["tau"] if "tau" in res else []))
        + f"  forwards {res['forwards']}  {res['seconds']:.1f} s"
        + (f"  [rule-checked: up to {tries} tries, {res['tries']:.2f} per case; not the model's own figure]"
           if tries > 1 else "")
        + (f"  [best of {best_of} draws by the model's own {'log-probability' if pick == 'score' else 'vote'}; every "
           "draw's forwards counted]"
           if best_of > 1 else ""))


def export_cmd(model: str, out: str, format: str = "hf", dtype: str = "float32", overwrite: bool = False) -> None:
    """Export a checkpoint: as a transformers folder (Qwen3/Llama), or as a dlm folder for shipping.

    Args:
        model: checkpoint folder
        out: folder to write (built under a temporary name, then moved into place; must not exist or be empty)
        format: hf (transformers / vLLM / SGLang layout; DFlash drafters in the public DFlash layout) or dlm (weights only, no training state)
        dtype: float32, float16 or bfloat16
        overwrite: --out may hold files: the files this export writes replace theirs; nothing else is deleted
    """
    if dtype not in ("float32", "float16", "bfloat16"):
        raise DlmError(f"--dtype must be one of ['bfloat16', 'float16', 'float32'], got {dtype!r}")
    if format not in ("hf", "dlm"):
        raise DlmError(f"--format must be hf or dlm, got {format!r}")
    import torch

    from dlm.checkpoint import export_dlm, load_model
    from dlm.hf import export_hf, prenorm_warning
    from dlm.hf_mdlm import finetuned_meta

    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    net, ck = load_model(model, dtype=None)  # as stored: each tensor is cast as it is written
    if format == "dlm":
        path = export_dlm(net, ck, out, dtypes[dtype], overwrite)
    elif (ck.objective in ("ar", "dflash") or (ck.objective == "usdm" and net.cfg.sandwich_norm)
          or ck.config.get("family") or finetuned_meta(ck.config)):
        # a row of dlm.families: ar's backbones, DiffusionGemma (usdm), an imported family's own layout (a fine-tuned
        # SDAR / LLaDA 2: its family's), the public DFlash drafters' (vLLM, SGLang)
        path = export_hf(net, ck.tokenizer, out, dtypes[dtype], overwrite, inputs=(ck.path,))
        if ck.objective == "dflash" and (warning := prenorm_warning(net, ck)):  # a warning, not a refusal: drafters
            sys.stderr.write(f"dlm: warning: {warning}\n")  # trained before last_layer existed
    else:
        raise DlmError(f"--format hf: objective {ck.objective!r} has no transformers layout (ar has)")
    print(f"exported: {path}")


def import_cmd(hf: str, out: str, overwrite: bool = False, target: str | None = None) -> None:
    """Import a local Qwen3, Qwen2, Llama, Ministral 3, Qwen3-MoE or Gemma 4 folder (safetensors, sharded or not) as a
    dlm AR checkpoint, a LLaDA, Dream, SDAR, Fast-dLLM v2 or LLaDA 2 folder as an mdlm checkpoint (its block, shift,
    <mask> id and decoding preset recorded: docs/public-models.md), a Nemotron-Labs-Diffusion folder as a joint
    checkpoint, a DiffusionGemma folder as a usdm checkpoint (text weights), or a public DFlash drafter folder (z-lab's layout: dflash_config) as a dlm drafter for --target.

    Args:
        hf: the transformers folder (config.json, *.safetensors, tokenizer.json; a drafter has no tokenizer)
        out: the dlm checkpoint folder to write (must not exist or be empty)
        overwrite: --out may hold files: the files this import writes replace theirs; nothing else is deleted
        target: a drafter's target: the dlm ar checkpoint it drafts for (its tokenizer, checked shapes)
    """
    from dlm.hf import import_hf

    print(f"imported: {import_hf(hf, out, overwrite, target)}")


def bench_cmd(model: str | None = None, prompts: int = 8, max_new_tokens: int = 0,
              out: str | None = "bench.json", data: str | None = None, warmup: int = 1, naive: bool = True,
              mdlm: str | None = None, usdm: str | None = None, sweep: bool = False,
              draft: list[str] | None = None, temperature: list[float] | None = None,
              block_size: int | None = None, repeat: int = 3, task: str | None = None, span: str = "line",
              joint: str | None = None, joint_blocks: list[int] | None = None, shape: str | None = None,
              context: int = 256, points: list[int] | None = None, layers: int = 0, device: str = "auto",
              clock: str = "wall", dtype: str | None = None, row_tokens: int = 1, col_major: bool = False,
              blocked: bool = False, compile: bool = False) -> None:
    """Benchmark the paradigms side by side on held-out task cases: task metrics, tok/forward, tok/s, TTFT, ratios
    against AR in the same round (methods interleaved case by case, repeated; medians and min-max).

    Args:
        model: the AR checkpoint: baseline rows, speculation target, judge of the gen PPL column
            (default: the shipped ar-small)
        prompts: number of held-out cases (line completion; as many infill cases alongside)
        max_new_tokens: tokens to generate per case (default 64; with --task, the task's budget)
        out: JSON report path ('' for none); the quality-vs-tokens-per-forward/wall-time plot goes beside it (.png)
        data: source files for the cases (default: the stdlib's held-out split); with --task sudoku, a CSV
        warmup: untimed runs of each method on its own before the interleaved, timed runs
        naive: include the naive (no KV cache) AR loop
        mdlm: an mdlm checkpoint for masked-diffusion rows (default: the shipped mdlm-small when --model and
            --draft are not given; '' for none)
        usdm: a usdm checkpoint for uniform-state rows (default: the shipped usdm-small when --model and
            --draft are not given; '' for none)
        sweep: sweep the diffusion samplers (steps, entropy bound, threshold, block length) instead of two rows each
        draft: speculative rows: drafter checkpoints (dflash, AR, mdlm or joint) and/or 'lookup', each verified by --model; FOLDER+lookup that drafter giving way to prompt lookup where the context repeats; FOLDER@N drafts with N passes (--draft-passes), FOLDER@topK a DFlash 2 drafter with K candidates per slot (--draft-top-k), FOLDER@xW (or @topKxW) a DFlash drafter drafting W branches (--draft-branches)
        temperature: temperatures of the speculative rows (default: 0 and 1), each beside the target alone; the other rows are greedy (an imported model's generation_config.json sampling defaults are not read)
        block_size: speculative block per cycle, last token + proposals (default: each drafter's)
        repeat: interleaved repetitions (figures: medians; ratios: min-max over repetitions too)
        task: complete, infill or sudoku: a Pareto sweep of the diffusion samplers on that task's cases (quality
            against tokens per forward and against wall time; the PNG beside --out)
        span: --task infill: line or lines
        joint: a joint AR + diffusion checkpoint: its AR mode and its self-speculation rows (greedy), measured
            against its own AR mode (tau, lossless, speedup) and against --model
        joint_blocks: block sizes of the self-speculation rows (default: 16); several also plot tau and tokens
            per forward against block size (.blocks.png beside --out)
        shape: the cost curve instead (dlm.bench.cost): a named shape with random weights (ar-small, ar-mid, 25m,
            100m, qwen3-0.6b, qwen3-1.7b, llada-8b) or a checkpoint folder: the cost of a forward of T new tokens
            and of B rows x 1 token relative to one, the machine's bandwidth and matmul throughput, decode against
            the bandwidth limit, the break-even tau of a drafter (table, JSON at --out, plot beside it)
        context: --shape: tokens already in the cache
        points: --shape: the values of T and B (default: 1 2 4 8 16 32 64)
        layers: --shape NAME: measure at this depth (0 = the shape's own; llada-8b: 4 of its 32 layers)
        device: auto (a CUDA GPU when there is one, else the CPU), cpu, cuda or cuda:N: where every model runs
        clock: --shape: wall, or cpu (the process's CPU time: on a busy machine at one thread, the forward's own cost
            without the time it waited for a core)
        dtype: the weights' dtype, float32, bfloat16 or float16 (default: float32; --shape on a checkpoint: its
            own)
        row_tokens: --shape: new tokens of each row in the B-rows curve (1: decoding; a diffusion block's or a
            speculative verify's width: what a batch of those rows costs)
        col_major: every model's linear weights stored column-major (float32 on a CPU): MKL's product of a few rows
            is then much cheaper relative to one row (a speculative verify's block); decoding's values are the same,
            their rounding not bit-identical to the default layout's (dlm.model.column_major)
        blocked: every model's float32 linear layers keep a copy of their weight in blocks of 16 output columns for
            dlm's own kernel of 1-16 rows (dlm.model.PackedLinear): a decoding step and a verify's few rows read the
            weights at the memory's speed (ar-mid's step ~1.4x faster than over column-major weights); values within
            float rounding of the default layout's, each row's independent of the rows beside it
        compile: the AR rows on --model (the target alone beside the speculative rows, ar (KV cache)) decode on the
            compiled one-token step that `dlm serve --compile` runs (torch.compile, the layers as one graph; compiled
            once at the start, a minute or more): the speculative rows are then measured against dlm's fastest one-row
            AR decoding on a CPU; their verify windows run on compiled graphs of their own at each drafter's block
            (a few minutes more), their draft passes eagerly
    """
    if shape is not None:
        from dlm.bench.cost import POINTS, run_cost

        if model is not None or draft or joint or task or compile:
            raise DlmError("--shape measures one model's cost curve; it does not combine with --model, --draft, "
                           "--joint or --task")
        if layers < 0:
            raise DlmError(f"--layers must be >= 0 (0 = the shape's own depth), got {layers}")
        run_cost(shape, context, tuple(points or POINTS), repeat, layers=layers, out=out or None, device=device,
                 clock=clock, dtype=dtype, row_tokens=row_tokens, col_major=col_major)
        if out:
            print(f"report: {out}")
        return
    temps = tuple(temperature) if temperature else (0.0, 1.0)
    for t in temps:
        if t < 0:
            raise DlmError(f"--temperature must be >= 0, got {t}")
    if max_new_tokens < 0:
        raise DlmError(f"--max-new-tokens must be > 0 (0 = the default), got {max_new_tokens}")
    from dlm.bench import run_bench
    from dlm.checkpoint import shipped

    def default(given: str | None, name: str) -> str | None:
        if given is not None:
            return given or None
        found = shipped(name)
        return str(found) if found else None

    if model is not None or draft or joint:  # your own model, or a speculation benchmark: diffusion rows only when asked
        mdlm, usdm = mdlm or "", usdm or ""
    model = default(model, "ar-small")
    if model is None:
        raise DlmError("--model: no AR checkpoint given and the shipped ar-small is missing")
    if not max_new_tokens:
        from dlm.tasks import task_module

        max_new_tokens = task_module(task).default_new_tokens(span) if task else 64
    run_bench(model, prompts, max_new_tokens, out or None, data, warmup, naive, mdlm=default(mdlm, "mdlm-small"),
              usdm=default(usdm, "usdm-small"), sweep=sweep, draft=draft, temperatures=temps, block_size=block_size,
              repeat=repeat, task=task, span=span, joint=joint, joint_blocks=tuple(joint_blocks or (16,)),
              col_major=col_major, device=device, dtype=dtype, blocked=blocked,
              ar_step="compiled" if compile else "eager")
    if out:
        print(f"report: {out}")


def demo_cmd(prompts: int = 3, max_new_tokens: int = 48, quick: bool = False) -> None:
    """Show the shipped reference checkpoints completing held-out stdlib code, with the benchmark table.

    Args:
        prompts: held-out snippets to complete
        max_new_tokens: tokens per completion
        quick: a taste in seconds: one completion of 24 tokens, each paradigm once on one prompt (tokens per
            forward; no benchmark), sudoku-mdlm on 3 puzzles
    """
    for name, v in (("--prompts", prompts), ("--max-new-tokens", max_new_tokens)):
        if v <= 0:
            raise DlmError(f"{name} must be > 0, got {v}")
    from dlm.demo import run_demo

    if quick:
        run_demo(1, 24, quick=True)
    else:
        run_demo(prompts, max_new_tokens)


def distill_cmd(target: str, out: str, data: str = "stdlib", prompts: int = 4096, max_new_tokens: int = 128,
                batch_size: int = 32, temperature: float = 0.0, min_chars: int = 64, max_chars: int = 400,
                seed: int = 0, device: str = "auto", quiet: bool = False) -> None:
    """Generate a drafter's training data: the target's own continuations of train-split prompts (.jsonl).

    Args:
        target: the AR checkpoint whose outputs the drafter will learn (a joint checkpoint: its AR mode, for its own diffusion half)
        out: the .jsonl file to write (one {"text", "prompt", "source"} object per line)
        data: corpus the prompts are cut from (its train split)
        prompts: number of prompts
        max_new_tokens: tokens the target generates per prompt
        batch_size: prompts generated together
        temperature: 0 = the target's greedy outputs; > 0 samples
        min_chars: shortest prompt, in characters (whole lines)
        max_chars: longest prompt, in characters
        seed: prompt choice and sampling seed
        device: auto (a CUDA GPU when there is one, else the CPU), cpu, cuda or cuda:N
        quiet: no progress bar
    """
    from dlm.distill import distill

    res = distill(target, out, data, prompts, max_new_tokens, batch_size, temperature, min_chars, max_chars, seed,
                  device, quiet)
    print(f"wrote {res['out']}: {res['prompts']} prompts, {res['generated_tokens']} generated tokens "
          f"in {res['seconds']:.0f} s")


def serve_cmd(model: list[str], draft: str | None = None, host: str = "127.0.0.1", port: int = 8000,
              max_concurrency: int = 8, max_queue: int = 32, api_key: str | None = None,
              max_body: int = 1 << 20, device: str = "auto", threads: int = 0, log_level: str = "info",
              compile: bool = False, pack_weights: bool = False, prefix_cache_mb: int = 256,
              kv_dtype: Literal["auto", "bfloat16"] = "auto") -> None:
    """Serve checkpoints over an OpenAI-compatible HTTP API, with the playground page at / (docs/serve.md).

    Args:
        model: checkpoint folders (ar, mdlm, usdm); repeat the option or list several; the model ids are the folder names
        draft: a drafter (dflash or AR checkpoint folder, 'lookup', or FOLDER+lookup): each AR model is also served speculatively, as MODEL+DRAFT
        host: address to listen on (127.0.0.1: this machine only)
        port: port to listen on
        max_concurrency: requests generating at once (AR requests share batched forwards)
        max_queue: requests waiting for a slot beyond those; more get 429 with Retry-After
        api_key: require `Authorization: Bearer KEY` on /v1/ (default: the DLM_API_KEY environment variable, else none)
        max_body: largest request body in bytes (larger: 413)
        device: auto (a CUDA GPU when there is one, else the CPU), cpu, cuda or cuda:N
        threads: torch CPU threads (0: torch's default less one, at least one: a core for the HTTP loop)
        log_level: uvicorn's log level (debug logs every request)
        compile: compile the AR decoding step (torch.compile, the layers as one graph, weights frozen) while the
            server starts: faster steps of several rows after a minute or more of compiling; with --draft, a lone
            request's verify windows at the drafter's block are compiled too (a few minutes more); falls back to eager
            decoding with a warning when compiling fails
        pack_weights: keep a copy of each large linear weight (>= 1M entries, float32 or bfloat16, CPU) in oneDNN's
            layout: products of 2-16 rows 1.5-3.7x faster on an AVX2 CPU, at the memory of those weights once more
        prefix_cache_mb: MB of prompts' K/V kept per model so that a prompt sharing a prefix with an earlier one (a
            system prompt, a repeated request) computes only the rest; least recently used out first (0: off)
        kv_dtype: the AR models' K/V as they decode: auto (the weights' dtype) or bfloat16 (under float32 weights: half
            the memory of the rows' and the prefix cache's K/V; keys and values rounded to bfloat16, so a completion
            can differ from the float32 model's where two tokens are near a tie)
    """
    if max_concurrency < 1:
        raise DlmError(f"--max-concurrency must be >= 1, got {max_concurrency}")
    if max_queue < 0:
        raise DlmError(f"--max-queue must be >= 0, got {max_queue}")
    if not 0 <= port <= 65535:
        raise DlmError(f"--port must be in [0, 65535], got {port}")
    if max_body < 1024:
        raise DlmError(f"--max-body must be >= 1024 bytes, got {max_body}")
    if threads < 0:
        raise DlmError(f"--threads must be >= 0, got {threads}")
    if prefix_cache_mb < 0:
        raise DlmError(f"--prefix-cache-mb must be >= 0 (0: off), got {prefix_cache_mb}")
    from dlm.device import check_device_name

    check_device_name(device)
    try:
        from dlm.serve.app import serve
    except ImportError as e:
        raise DlmError(f"dlm serve needs FastAPI and uvicorn: pip install 'dlm[serve]' ({e})") from None
    import torch

    # (0: a core left to the event loop that streams every row's tokens: on 2 cores ar-mid serves 208 tok/s at
    # concurrency 4 on one thread against 140 on two, and the Qwen3-0.6B shape, bound by memory, the same on either)
    torch.set_num_threads(threads or max(1, torch.get_num_threads() - 1))
    try:
        serve(model, draft, host, port, max_concurrency, max_queue, api_key or os.environ.get("DLM_API_KEY"),
              max_body, device, log_level, compile, pack_weights, prefix_cache_mb << 20, kv_dtype)
    except OSError as e:
        raise DlmError(f"--host {host} --port {port}: cannot listen ({e.strerror or e})") from None


def task_cmd(name: Literal["sudoku"], out: str, n: int = 1000,
             clues: str = "40-50", seed: int = 0, source: str | None = None, augment: int = 1) -> None:
    """Write task data: `dlm task sudoku` writes puzzles with exactly one solution as a CSV in the public layout
    (`quizzes,solutions`, 81 digits each, 0 = blank), for `dlm train --data` and `dlm eval --task sudoku --data`.

    Args:
        name: the task whose data to write: sudoku
        out: the .csv file to write (written under a temporary name, then renamed)
        n: number of puzzles
        clues: givens per puzzle, A-B (drawn uniformly) or A; many clues = easy (40-50: naked singles mostly suffice)
        seed: puzzle k depends only on (seed, k): the same seed gives the same puzzles
        source: take the puzzles from this CSV instead of generating them: those with --clues givens, at most --n
        augment: write each puzzle and augment - 1 random symmetric copies of it (digits relabelled, rows, columns,
            bands and stacks permuted, transposed: same difficulty, one solution), shuffled
    """
    import time
    from pathlib import Path

    from dlm.data.csvtask import read_pairs, write_pairs
    from dlm.tasks.sudoku import augment as symmetric_copies
    from dlm.tasks.sudoku import clues_of, generate, parse_clues

    if not out.lower().endswith(".csv"):
        raise DlmError(f"--out must name a .csv file (training reads .csv as sudoku puzzles), got {out!r}")
    if augment < 1:
        raise DlmError(f"--augment must be >= 1, got {augment}")
    if source is not None and Path(source).resolve() == Path(out).resolve():
        raise DlmError(f"--out {out} is the --source file: write the puzzles to another file (the source stays as it is)")
    t0 = time.perf_counter()
    lo, hi = parse_clues(clues)
    if source is not None:
        pairs = [p for p in read_pairs(source, "--source") if lo <= clues_of(p[0]) <= hi][:n]
        if not pairs:
            raise DlmError(f"--source {source}: no puzzle has {clues} clues")
    else:
        pairs = generate(n, (lo, hi), seed)
    pairs = symmetric_copies(pairs, augment, seed) if augment > 1 else pairs
    write_pairs(out, pairs)
    print(f"wrote {out}: {len(pairs)} puzzles ({clues} clues, seed {seed}) in {time.perf_counter() - t0:.1f} s")


def _dumps(obj) -> str:  # (the commands' `json` flag shadows the module inside them)
    import json

    return json.dumps(obj)


def canonical_argv(argv: list[str]) -> list[str]:
    """Other names of options as their one name (--gamma, --block-length -> --block-size, ...: config.ALIASES)."""
    from dlm.config import ALIASES

    spelled = {f"--{old}": f"--{new}" for old, new in ALIASES.items()}
    spelled.update({f"--{old.replace('_', '-')}": f"--{new.replace('_', '-')}" for old, new in ALIASES.items()})
    out = []
    for a in argv:
        name, eq, value = a.partition("=")
        out.append(spelled.get(name, name) + eq + value if a.startswith("--") else a)
    return out


def merge_repeated(argv: list[str], command: str, option: str) -> list[str]:
    """`dlm COMMAND --model a --model b` -> `--model a b` (a list option given once per value)."""
    if next((a for a in argv if not a.startswith("-")), None) != command:
        return argv
    values, out, i = [], [], 0
    while i < len(argv):
        a = argv[i]
        if a == option:
            i += 1
            while i < len(argv) and not argv[i].startswith("--"):
                values.append(argv[i])
                i += 1
            continue
        if a.startswith(option + "="):
            values.append(a.partition("=")[2])
        else:
            out.append(a)
        i += 1
    return out + [option, *values] if values else out


def _train_config() -> type:
    from dlm.config import TrainConfig

    return TrainConfig


def _sample_config() -> type:
    from dlm.config import SampleConfig

    return SampleConfig


def main(argv: list[str] | None = None) -> int:
    interrupts: list[int] = []

    def on_interrupt(signum: int, frame: object) -> None:
        interrupts.append(signum)
        raise KeyboardInterrupt

    # Ctrl-C is recorded as well as raised: a library whose import catches everything (a bare `except:`) would
    # otherwise swallow it and the command would run on as if nothing had been pressed
    previous = None
    try:  # everything, imports included: Ctrl-C at any moment is exit 130 without a traceback
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGINT, on_interrupt)
        from dlm.cliargs import Command, run

        commands = {  # the dataclasses are imported only for the command that runs
            "train": Command(train_cmd, _train_config, "cfg", group="training"),
            "generate": Command(generate_cmd, _sample_config, "scfg", group="sampling"),
            "eval": Command(eval_cmd, _sample_config, "scfg", group="sampling"),
            "export": Command(export_cmd),
            "import": Command(import_cmd),
            "bench": Command(bench_cmd),
            "demo": Command(demo_cmd),
            "chat": Command(chat_cmd, _sample_config, "scfg", group="sampling"),
            "sudoku": Command(sudoku_cmd, positional=("puzzle",)),
            "distill": Command(distill_cmd),
            "serve": Command(serve_cmd),
            "task": Command(task_cmd, positional=("name",)),
        }
        argv = merge_repeated(canonical_argv(list(sys.argv[1:] if argv is None else argv)), "serve", "--model")
        if argv[:1] in (["--version"], ["-V"]):
            from dlm import __version__

            print(f"dlm {__version__}")
            return 0
        run("dlm", "dlm: diffusion language models on one backbone (dlm --version: its version)", commands, argv)
        if interrupts:
            raise KeyboardInterrupt
        sys.stdout.flush()  # a reader that left (`| head`) is found here, not at exit
    except DlmError as e:
        sys.stderr.write(f"dlm: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("dlm: interrupted\n")
        return 130
    except BrokenPipeError:  # `dlm ... | head`: the reader left; say nothing more, as a Unix tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception:
        if interrupts:  # Ctrl-C broke a library's import half-way and it surfaced as another error (numpy's
            sys.stderr.write("dlm: interrupted\n")  # "cannot load module more than once per process")
            return 130
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    return 0


if __name__ == "__main__":
    sys.exit(main())
