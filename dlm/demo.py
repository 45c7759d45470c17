"""`dlm demo` (= `make demo`): the shipped reference checkpoints at work on held-out stdlib code."""

from __future__ import annotations

import time

from dlm.checkpoint import checkpoints_dir, shipped
from dlm.errors import DlmError


def run_demo(prompts: int = 3, max_new_tokens: int = 48, bench_prompts: int = 4, temperature: float = 0.7,
             bench_tokens: int = 32, repeat: int = 3) -> None:
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
    mdlm, usdm = shipped("mdlm-small"), shipped("usdm-small")
    drafts = [str(p) for p in (shipped("dflash-small"), shipped("ar-draft")) if p] + ["lookup"]
    con.print("\n[bold]Side by side[/] (dlm bench: every shipped paradigm on the same held-out cases, greedy; "
              f"`dlm bench --prompts {bench_prompts} --max-new-tokens {bench_tokens} --repeat {repeat} --no-naive "
              "--mdlm checkpoints/mdlm-small --usdm checkpoints/usdm-small --draft checkpoints/dflash-small "
              "checkpoints/ar-draft lookup --temperature 0`)")
    run_bench(str(ar), prompts=bench_prompts, max_new_tokens=bench_tokens, out=None, naive=False,
              mdlm=str(mdlm) if mdlm else None, usdm=str(usdm) if usdm else None,
              draft=drafts, temperatures=(0.0,), repeat=repeat)
    sudoku(con)
    con.print(f"[dim]demo took {time.perf_counter() - t0:.1f} s[/]")


def sudoku(con, n: int = 10, threshold: float = 0.999) -> None:
    """The shipped sudoku references on n fresh held-out puzzles: masked diffusion against AR of its size."""
    from rich.table import Table

    from dlm.checkpoint import load_model
    from dlm.sampling import SampleConfig
    from dlm.tasks import run_task
    from dlm.tasks import sudoku as task

    rows = [(name, sampler) for name, sampler in (("sudoku-mdlm", "threshold"), ("sudoku-ar", "auto"))
            if shipped(name)]
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
