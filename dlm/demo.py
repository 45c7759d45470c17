"""`dlm demo` (= `make demo`): the shipped reference checkpoints at work on held-out stdlib code."""

from __future__ import annotations

import time

from dlm.checkpoint import checkpoints_dir, shipped
from dlm.errors import DlmError


def run_demo(prompts: int = 3, max_new_tokens: int = 48, bench_prompts: int = 4, temperature: float = 0.7,
             bench_tokens: int = 32, repeat: int = 3, quick: bool = False) -> None:
    """quick: seconds instead of minutes: one completion, then each paradigm once on one held-out prompt (no
    benchmark: one run's tok/s is noise; tok/forward is not), then sudoku-mdlm on 3 puzzles."""
    from rich.console import Console
    from rich.panel import Panel
    from rich.text import Text

    from dlm.bench import run_bench
    from dlm.checkpoint import load_model
    from dlm.data.corpus import Corpus
    from dlm.data.tokens import heldout_prompts
    from dlm.sampling import SampleConfig, generate

    t0 = time.perf_counter()
    ar = shipped("ar-small")
    if ar is None:
        raise DlmError(f"the reference checkpoint ar-small is not in {checkpoints_dir()} "
                       "(run from the repository, or set DLM_CHECKPOINTS)")
    con = Console(width=max(100, Console().width))
    model, ck = load_model(ar)
    con.print(f"[bold]dlm demo[/]: {ar.name} ({ck.config.get('params', 0) / 1e6:.1f}M parameters, "
              f"trained on the Python standard library) completing held-out files it never saw "
              f"(temperature {temperature:g}, top-p 0.95, seed 0)\n")
    for p in heldout_prompts(Corpus("stdlib"), "test", n=prompts, seed=1):
        res = generate(model, ck, p.text, SampleConfig(max_new_tokens=max_new_tokens, temperature=temperature,
                                                       top_p=0.95, seed=0))
        s = res.stats.as_dict()
        body = Text.assemble((p.text[-300:], "dim"), (res.text, "bold green"))
        con.print(Panel(body, title=p.name, subtitle=f"{s['new_tokens']} tokens, {s['tokens_per_second']:.0f} tok/s",
                        title_align="left"))
    if quick:
        side_by_side(con, p.text, model, ck)
        sudoku(con, 3, models=("sudoku-mdlm",))
        con.print(f"[dim]demo took {time.perf_counter() - t0:.1f} s (`dlm demo` without --quick: the benchmark, "
                  "a few minutes)[/]")
        return
    mdlm, usdm = shipped("mdlm-small"), shipped("usdm-small")
    drafts = [str(p) for p in (shipped("dflash-small"), shipped("ar-draft")) if p] + ["lookup"]
    con.print("\n[bold]Side by side[/] (dlm bench: every shipped paradigm on the same held-out cases, greedy; "
              f"`dlm bench --prompts {bench_prompts} --max-new-tokens {bench_tokens} --repeat {repeat} --no-naive "
              "--mdlm checkpoints/mdlm-small --usdm checkpoints/usdm-small --draft checkpoints/dflash-small "
              "checkpoints/ar-draft lookup --temperature 0`)")
    run_bench(str(ar), prompts=bench_prompts, max_new_tokens=bench_tokens, out=None, naive=False,
              mdlm=str(mdlm) if mdlm else None, usdm=str(usdm) if usdm else None,
              draft=drafts, temperatures=(0.0,), repeat=repeat)
    mid_pair(con, bench_prompts, repeat)
    sudoku(con)
    con.print(f"[dim]demo took {time.perf_counter() - t0:.1f} s[/]")


def side_by_side(con, prompt: str, ar_model, ar_ck, new: int = 16) -> None:
    """Each shipped paradigm once on the same prompt, greedy: its text and tokens per forward."""
    from rich.table import Table

    from dlm.checkpoint import load_model
    from dlm.sampling import SampleConfig, generate

    con.print(f"\n[bold]Side by side[/] (each paradigm once on the same held-out prompt, {new} tokens, greedy: "
              "`dlm generate --model checkpoints/MODEL --temperature 0 OPTIONS`)")
    table = Table("model", "paradigm", "options", "text", "tok/forward")
    rows = [("ar-small", {}), ("ar-small", {"draft": "dflash-small"}),
            ("mdlm-small", {"sampler": "entropy_bound", "entropy_bound": 1.0, "steps": 8}), ("usdm-small", {"steps": 8})]
    for name, opts in rows:
        draft = opts.get("draft")
        if shipped(name) is None or (draft and shipped(draft) is None):
            continue
        model, ck = (ar_model, ar_ck) if name == "ar-small" else load_model(shipped(name))
        cfg = SampleConfig(max_new_tokens=new, **{**opts, **({"draft": str(shipped(draft))} if draft else {})})
        res = generate(model, ck, prompt, cfg)
        s = res.stats.as_dict()
        shown = " ".join(f"--{k.replace('_', '-')} {'checkpoints/' + v if k == 'draft' else v}" for k, v in opts.items())
        table.add_row(name, "speculative" if draft else ck.objective, shown, repr(res.text)[1:-1][:48],
                      f"{s['tokens_per_forward']:.2f}")
    con.print(table)


def mid_pair(con, prompts: int, repeat: int, tokens: int = 64) -> None:
    """The pair with the field's proportions (a 16-layer target, a 1-layer DFlash 2 drafter) beside prompt lookup."""
    from dlm.bench import run_bench

    target, drafter = shipped("ar-mid"), shipped("dflash2-mid")
    if target is None or drafter is None:
        return
    con.print("\n[bold]Speculation at the field's proportions[/]: a DFlash 2 drafter pays when its pass costs a "
              "small part of a target step; dflash-small's 3 layers on ar-small's 4 cost about one step, "
              "dflash2-mid's 1 layer on ar-mid's 16 about a fifth. `+lookup`: the drafter gives way to prompt lookup "
              "where the context repeats (greedy, block 8, every model's float32 weights kept in dlm's blocked "
              "layout for its kernel of 1-16 rows: the target alone at its fastest in eager decoding: "
              "`dlm bench --model checkpoints/ar-mid --draft checkpoints/dflash2-mid lookup "
              f"checkpoints/dflash2-mid+lookup --prompts {prompts} --max-new-tokens {tokens} --repeat {repeat} "
              "--no-naive --temperature 0 --blocked`)")
    run_bench(str(target), prompts=prompts, max_new_tokens=tokens, out=None, naive=False,
              draft=[str(drafter), "lookup", f"{drafter}+lookup"], temperatures=(0.0,), repeat=repeat,
              blocked=True)


def sudoku(con, n: int = 10, threshold: float = 0.999, models: tuple[str, ...] = ("sudoku-mdlm", "sudoku-ar")) -> None:
    """The shipped sudoku references on n fresh held-out puzzles: masked diffusion against AR of its size."""
    from rich.table import Table

    from dlm.checkpoint import load_model
    from dlm.sampling import SampleConfig
    from dlm.tasks import run_task
    from dlm.tasks import sudoku as task

    rows = [(name, sampler) for name, sampler in (("sudoku-mdlm", "threshold"), ("sudoku-ar", "auto"))
            if shipped(name) and name in models]
    if not rows:
        return
    cases = task.cases(None, n, 0)
    con.print(f"\n[bold]Sudoku[/] ({n} fresh 40-50-clue puzzles, never seen in training; "
              f"`dlm eval --model checkpoints/MODEL --task sudoku --n {n}`, mdlm with `--sampler threshold "
              f"--threshold {threshold:g}`)")
    table = Table("model", "decoding", "grids solved", "cells right", "cells per forward")
    for name, sampler in rows:
        model, ck = load_model(shipped(name))
        cfg = SampleConfig(max_new_tokens=81, sampler=sampler, threshold=threshold)
        r = run_task("sudoku", model, ck, cfg, cases=cases)
        how = f"parallel, confidence > {threshold:g}" if sampler == "threshold" else "left to right"
        table.add_row(name, how, f"{round(r['accuracy'] * n)}/{n}", f"{r['cell_accuracy']:.3f}",
                      f"{r['tokens_per_forward']:.2f}")
    con.print(table)
