"""`dlm`: train, generate, eval, export, import, bench, demo.

Every subcommand is a function below; tyro (through dlm.cliargs) turns its typed parameters into options.
"""

from __future__ import annotations

import sys

from dlm.errors import DlmError  # (the module imports little: main's handlers cover the rest)


def _device(name: str):
    from dlm.checkpoint import resolve_device

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


# the sampling options each paradigm reads (besides max_new_tokens, seed, and fill_length with <fill> markers);
# one it does not read is ignored, and `dlm generate` says so. An option a sampler refuses (usdm's --temperature,
# --suffix with an ar model) counts as read: its error is the message.
SAMPLER_OPTIONS = {
    "ar": {"temperature", "top_k", "top_p", "naive", "sampler", "suffix"},
    "mdlm": {"temperature", "top_k", "top_p", "naive", "sampler", "steps", "threshold", "entropy_bound", "block_size",
             "remasking", "suffix"},
    "usdm": {"temperature", "top_k", "top_p", "sampler", "steps", "entropy_bound", "block_size", "canvas_length",
             "t_max", "t_min", "stability_threshold", "confidence_threshold", "adaptive", "suffix"},
    "speculative": {"temperature", "top_k", "top_p", "block_size", "draft", "draft_passes", "lookup_ngram",
                    "check_lossless", "suffix"},
}


def unused_options(scfg, objective: str, prompt: str = "") -> list[str]:
    """Warnings naming the sampling options that were set (differ from their defaults) but are not read: by the
    checkpoint's paradigm (SAMPLER_OPTIONS), or --fill-length without <fill> markers in the prompt."""
    import dataclasses

    paradigm = "speculative" if scfg.draft else objective
    if paradigm not in SAMPLER_OPTIONS:
        return []  # a checkpoint that cannot sample: its own error follows
    reads = SAMPLER_OPTIONS[paradigm] | {"max_new_tokens", "seed", "fill_length"}
    if paradigm == "speculative":
        reads = reads - ({"draft_passes"} if scfg.draft == "lookup" else {"lookup_ngram"})
    defaults = type(scfg)()
    changed = {f.name for f in dataclasses.fields(scfg) if getattr(scfg, f.name) != getattr(defaults, f.name)}
    unused = [f.name for f in dataclasses.fields(scfg) if f.name in changed - reads]
    out = []
    if unused:
        names = ", ".join("--" + n.replace("_", "-") for n in unused)
        what = {"speculative": f"speculative decoding with --draft {scfg.draft}", "ar": "an ar checkpoint",
                "mdlm": "an mdlm checkpoint", "usdm": "a usdm checkpoint"}[paradigm]
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
    from dlm.train import train

    defaults = TrainConfig()
    explicit = {f.name for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(defaults, f.name)}
    path = train(cfg, out, resume=resume, quiet=quiet, explicit=explicit)
    print(f"checkpoint: {path}")


def generate_cmd(
    scfg, model: str, prompt: str = "", prompt_file: str | None = None, json: bool = False, show: bool = False,
    device: str = "cpu",
) -> None:
    """Generate text with a checkpoint (its paradigm's sampler).

    Args:
        model: checkpoint folder
        prompt: text to continue
        prompt_file: read the prompt from this file instead ('-' for standard input)
        json: print one JSON object with the text and the statistics
        show: live view: redraw the canvas at every denoising step (or stream tokens as they commit)
        device: cpu, cuda or auto
    """
    from dlm.checkpoint import load_model
    from dlm.sampling import encode, generate, stream

    if prompt_file:
        prompt = _read_text(prompt_file)
    prompt = _text(prompt, "--prompt-file" if prompt_file else "--prompt")
    if scfg.suffix is not None:
        _text(scfg.suffix, "--suffix")
    net, ck = load_model(model, device=_device(device))
    for warning in unused_options(scfg, ck.objective, prompt):
        sys.stderr.write(f"dlm: warning: {warning}; ignored\n")
    if show:  # with --json the live view goes to stderr: stdout holds the one JSON object
        from dlm.sampling.show import live

        view = _console(file=sys.stderr) if json else _console()
        res = live(stream(net, ck, encode(ck, prompt, scfg), scfg), ck.tokenizer, prompt, console=view)
    else:
        res = generate(net, ck, prompt, scfg)
    stats = res.stats.as_dict()
    if json:
        print(_dumps({"text": res.text, **stats}))
        return
    from rich.text import Text

    con = _console()
    con.print(Text.assemble((prompt, "dim"), (res.text, "bold green")))
    con.print(f"[dim]{stats['new_tokens']} tokens, {stats['forwards']} forwards "
              f"({stats['tokens_per_forward']:.2f} tok/forward), {stats['tokens_per_second']:.1f} tok/s[/]")


def eval_cmd(model: str, split: str = "test", data: str | None = None, seq_len: int = 0, batch_size: int = 8,
             max_batches: int = 0, seed: int = 0, samples: int = 4, reference: str | None = None,
             json: bool = False, device: str = "cpu") -> None:
    """Held-out loss and perplexity of a checkpoint.

    Args:
        model: checkpoint folder
        split: train, val or test
        data: corpus (default: the one the checkpoint was trained on)
        seq_len: window length (default: the training sequence length)
        batch_size: windows per forward
        max_batches: stop after this many batches (0 = the whole split)
        seed: seed of the Monte-Carlo likelihood bound of diffusion checkpoints
        samples: Monte-Carlo samples per window of a diffusion checkpoint's likelihood bound (LLaDA uses 128;
            averaged over a whole split, 4 already give a standard error of ~0.01 nats, reported)
        reference: AR checkpoint scored on the same windows beside a diffusion bound (default: the
            checkpoint's --init-from, else checkpoints/ar-small)
        json: print one JSON object
        device: cpu, cuda or auto
    """
    from dlm.checkpoint import load_model
    from dlm.config import check_seed
    from dlm.data.corpus import Corpus
    from dlm.evaluate import evaluate

    if batch_size <= 0:
        raise DlmError(f"--batch-size must be > 0, got {batch_size}")
    if max_batches < 0:
        raise DlmError(f"--max-batches must be >= 0 (0 = the whole split), got {max_batches}")
    if seq_len < 0:
        raise DlmError(f"--seq-len must be >= 0 (0 = the training sequence length), got {seq_len}")
    if samples <= 0:
        raise DlmError(f"--samples must be > 0, got {samples}")
    check_seed(seed)
    net, ck = load_model(model, device=_device(device))
    corpus = Corpus(ck.corpus(data))
    seq = seq_len or ck.config.get("train", {}).get("seq_len", 256)
    res = evaluate(net, ck, corpus, split, seq, batch_size, max_batches or None, seed, samples, reference)
    if json:
        print(_dumps(res))
    else:
        print(f"{split}: " + "  ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in res.items()))


def export_cmd(model: str, out: str, format: str = "hf", dtype: str = "float32", overwrite: bool = False) -> None:
    """Export a checkpoint: as a transformers folder (Qwen3/Llama), or as a dlm folder for shipping.

    Args:
        model: checkpoint folder
        out: folder to write (built under a temporary name, then moved into place; must not exist or be empty)
        format: hf (transformers / vLLM / SGLang layout; DFlash drafters in the public DFlash layout) or dlm (weights only, no training state)
        dtype: float32, float16 or bfloat16
        overwrite: --out may hold files: the files this export writes replace theirs; nothing else is deleted
    """
    import torch

    from dlm.checkpoint import export_dlm, load_model
    from dlm.hf import export_drafter, export_hf

    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    if dtype not in dtypes:
        raise DlmError(f"--dtype must be one of {sorted(dtypes)}, got {dtype!r}")
    if format not in ("hf", "dlm"):
        raise DlmError(f"--format must be hf or dlm, got {format!r}")
    net, ck = load_model(model)
    if format == "dlm":
        path = export_dlm(net, ck, out, dtypes[dtype], overwrite)
    elif ck.objective == "ar":
        path = export_hf(net, ck.tokenizer, out, dtypes[dtype], overwrite, inputs=(ck.path,))
    elif ck.objective == "dflash":  # the layout of the public DFlash drafters (vLLM, SGLang)
        path = export_drafter(net, ck, out, dtypes[dtype], overwrite)
    else:
        raise DlmError(f"--format hf: objective {ck.objective!r} has no transformers layout (ar has)")
    print(f"exported: {path}")


def import_cmd(hf: str, out: str, overwrite: bool = False) -> None:
    """Import a local Qwen3 or Llama folder (safetensors, sharded or not) as a dlm AR checkpoint.

    Args:
        hf: the transformers folder (config.json, *.safetensors, tokenizer.json)
        out: the dlm checkpoint folder to write (must not exist or be empty)
        overwrite: --out may hold files: the files this import writes replace theirs; nothing else is deleted
    """
    from dlm.hf import import_hf

    print(f"imported: {import_hf(hf, out, overwrite)}")


def bench_cmd(model: str | None = None, prompts: int = 8, max_new_tokens: int = 64,
              out: str | None = "bench.json", data: str | None = None, warmup: int = 1, naive: bool = True,
              mdlm: str | None = None, usdm: str | None = None, sweep: bool = False,
              draft: list[str] | None = None, temperature: list[float] | None = None,
              block_size: int | None = None) -> None:
    """Benchmark the paradigms side by side on held-out prompts (median tok/s, tok/forward, TTFT, quality).

    Args:
        model: the AR checkpoint: baseline rows, speculation target, judge of the quality column
            (default: the shipped ar-small)
        prompts: number of held-out prompts
        max_new_tokens: tokens to generate per prompt
        out: JSON report path ('' for none); the quality-vs-tokens-per-forward plot goes beside it (.png)
        data: corpus for the held-out prompts (default: the checkpoint's)
        warmup: untimed runs before measuring each method
        naive: include the naive (no KV cache) AR loop
        mdlm: an mdlm checkpoint for masked-diffusion rows (default: the shipped mdlm-small when --model and
            --draft are not given; '' for none)
        usdm: a usdm checkpoint for uniform-state rows (default: the shipped usdm-small when --model and
            --draft are not given; '' for none)
        sweep: sweep the diffusion samplers (steps, entropy bound, threshold, block length) instead of one row each
        draft: speculative rows: drafter checkpoints (dflash or AR) and/or 'lookup', each verified by --model
        temperature: temperatures of the speculative rows (default: 0 and 1), each beside the target alone
        block_size: speculative block per cycle, last token + proposals (default: each drafter's)
    """
    from dlm.bench import run_bench
    from dlm.demo import shipped

    def default(given: str | None, name: str) -> str | None:
        if given is not None:
            return given or None
        found = shipped(name)
        return str(found) if found else None

    if model is not None or draft:  # your own model, or a speculation benchmark: diffusion rows only when asked
        mdlm, usdm = mdlm or "", usdm or ""
    model = default(model, "ar-small")
    if model is None:
        raise DlmError("--model: no AR checkpoint given and the shipped ar-small is missing")
    temps = tuple(temperature) if temperature else (0.0, 1.0)
    for t in temps:
        if t < 0:
            raise DlmError(f"--temperature must be >= 0, got {t}")
    run_bench(model, prompts, max_new_tokens, out or None, data, warmup, naive, mdlm=default(mdlm, "mdlm-small"),
              usdm=default(usdm, "usdm-small"), sweep=sweep, draft=draft, temperatures=temps, block_size=block_size)
    if out:
        print(f"report: {out}")


def demo_cmd(prompts: int = 3, max_new_tokens: int = 48) -> None:
    """Show the shipped reference checkpoints completing held-out stdlib code, with the benchmark table.

    Args:
        prompts: held-out snippets to complete
        max_new_tokens: tokens per completion
    """
    from dlm.demo import run_demo

    for name, v in (("--prompts", prompts), ("--max-new-tokens", max_new_tokens)):
        if v <= 0:
            raise DlmError(f"{name} must be > 0, got {v}")
    run_demo(prompts, max_new_tokens)


def distill_cmd(target: str, out: str, data: str = "stdlib", prompts: int = 4096, max_new_tokens: int = 128,
                batch_size: int = 32, temperature: float = 0.0, min_chars: int = 64, max_chars: int = 400,
                seed: int = 0, device: str = "cpu", quiet: bool = False) -> None:
    """Generate a drafter's training data: the target's own continuations of train-split prompts (.jsonl).

    Args:
        target: the AR checkpoint whose outputs the drafter will learn
        out: the .jsonl file to write (one {"text", "prompt", "source"} object per line)
        data: corpus the prompts are cut from (its train split)
        prompts: number of prompts
        max_new_tokens: tokens the target generates per prompt
        batch_size: prompts generated together
        temperature: 0 = the target's greedy outputs; > 0 samples
        min_chars: shortest prompt, in characters (whole lines)
        max_chars: longest prompt, in characters
        seed: prompt choice and sampling seed
        device: cpu, cuda or auto
        quiet: no progress bar
    """
    from dlm.distill import distill

    res = distill(target, out, data, prompts, max_new_tokens, batch_size, temperature, min_chars, max_chars, seed,
                  device, quiet)
    print(f"wrote {res['out']}: {res['prompts']} prompts, {res['generated_tokens']} generated tokens "
          f"in {res['seconds']:.0f} s")


def _dumps(obj) -> str:  # (the commands' `json` flag shadows the module inside them)
    import json

    return json.dumps(obj)


def canonical_argv(argv: list[str]) -> list[str]:
    """Older spellings of options that now share one name (--gamma, --block-length -> --block-size, ...)."""
    from dlm.config import ALIASES

    spelled = {f"--{old}": f"--{new}" for old, new in ALIASES.items()}
    spelled.update({f"--{old.replace('_', '-')}": f"--{new.replace('_', '-')}" for old, new in ALIASES.items()})
    out = []
    for a in argv:
        name, eq, value = a.partition("=")
        out.append(spelled.get(name, name) + eq + value if a.startswith("--") else a)
    return out


def _train_config() -> type:
    from dlm.config import TrainConfig

    return TrainConfig


def _sample_config() -> type:
    from dlm.sampling import SampleConfig  # imports torch: only when `generate` runs

    return SampleConfig


def main(argv: list[str] | None = None) -> int:
    try:  # everything, imports included: Ctrl-C at any moment is exit 130 without a traceback
        from dlm.cliargs import Command, run

        commands = {  # the dataclasses are imported only for the command that runs
            "train": Command(train_cmd, _train_config, "cfg", group="training"),
            "generate": Command(generate_cmd, _sample_config, "scfg", group="sampling"),
            "eval": Command(eval_cmd),
            "export": Command(export_cmd),
            "import": Command(import_cmd),
            "bench": Command(bench_cmd),
            "demo": Command(demo_cmd),
            "distill": Command(distill_cmd),
        }
        argv = canonical_argv(list(sys.argv[1:] if argv is None else argv))
        run("dlm", "dlm: diffusion language models on one backbone", commands, argv)
        sys.stdout.flush()  # a reader that left (`| head`) is found here, not at exit
    except DlmError as e:
        sys.stderr.write(f"dlm: error: {e}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("dlm: interrupted\n")
        return 130
    except BrokenPipeError:  # `dlm ... | head`: the reader left; say nothing more, as a Unix tool does
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    return 0


if __name__ == "__main__":
    sys.exit(main())
