"""Where a speculative cycle's time goes on the compiled path (`dlm bench --compile`'s rows), in thread CPU time.

    OMP_NUM_THREADS=1 python scripts/rows_cycle.py --model checkpoints/ar-mid --draft checkpoints/dflash2-mid \\
        --prompts 8 --max-new-tokens 128 [--temperature 1 --block-size 4] [--no-blocked]

The cases and methods are `dlm bench`'s (held-out line completions; the target alone, then the drafter), with every
model's float32 weights blocked (--blocked) and the rows run as `dlm bench --compile` runs them: the target alone on
the compiled one-token step, the speculative rows verifying on the step's compiled window of the drafter's block. Each
row batch forward is timed with the thread's CPU clock and filed by what it served: the target's prefill, its
one-token steps, its verify windows (by width), the drafter's passes. Per method: the seconds of each, the count, and
per cycle (a verify) the verify, the draft pass and the rest (the selector, the verifier, the bookkeeping), in
one-token steps of the target alone in the same run. scripts/spec_cycle.py splits an eager cycle finer.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from dlm.bench import compile_rows, reblock
from dlm.bench.harness import run_item
from dlm.bench.methods import bench_items, build_methods
from dlm.checkpoint import load_model
from dlm.sampling import rows as R
from dlm.tasks.common import window


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the AR target")
    ap.add_argument("--draft", required=True, help="a drafter folder (as dlm bench's --draft)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--no-blocked", action="store_true", help="keep the weights as stored")
    args = ap.parse_args()
    torch.set_num_threads(1)
    net, ck = load_model(args.model)
    items, _ = bench_items(None, None, args.prompts, "line")
    _, groups = build_methods(net, ck, args.max_new_tokens, False, None, None, False, [args.draft],
                              (args.temperature,), args.block_size)
    _, base, group = groups[0]
    methods = [base, *group]
    if not args.no_blocked:
        reblock(methods)
    compile_rows(methods, net)
    context = min(window(m.ck, m.model) for m in methods)
    spent: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    forward = R.RowBatch.forward

    def timed(self, windows, rows=None):
        t0 = time.thread_time()
        out = forward(self, windows, rows)
        T = max(w.length for w in windows)
        kind = ("draft" if self.model is not net else "step" if T == 1 else
                f"verify{T}" if T <= 64 and any(w.out == (0, w.length) for w in windows) else "prefill")
        spent[kind] += time.thread_time() - t0
        count[kind] += 1
        return out

    R.RowBatch.forward = timed
    for m in methods:  # warm-up
        run_item(m, items[0], context)
    step = None
    for m in methods:
        spent.clear()
        count.clear()
        t0 = time.thread_time()
        for it in items:
            run_item(m, it, context)
        total = time.thread_time() - t0
        if m.drafter is None:
            step = spent["step"] / max(count["step"], 1)
        parts = ", ".join(f"{k} {spent[k]:.3f} s / {count[k]}" for k in sorted(spent))
        print(f"{m.name}: {total:.3f} s ({parts})")
        verify = sum(spent[k] for k in spent if k.startswith("verify"))
        cycles = sum(count[k] for k in count if k.startswith("verify"))
        if m.drafter is not None and cycles and step:
            rest = total - verify - spent["draft"] - spent["prefill"]
            print(f"  per cycle, in target steps ({step * 1e3:.2f} ms): verify {verify / cycles / step:.2f}, "
                  f"draft {spent['draft'] / cycles / step:.2f}, rest {rest / cycles / step:.2f}")


if __name__ == "__main__":
    main()
