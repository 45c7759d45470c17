"""The ceiling of one-pass block drafting for a target at temperature 1: what an ideal drafter would get.

    OMP_NUM_THREADS=1 python scripts/spec_ceiling.py --model checkpoints/ar-mid --draft checkpoints/dflash2-mid \\
        --prompts 8 --max-new-tokens 128 --block-size 8

(~5 min of one thread at the defaults, 32 continuations at every 8th cycle's context; the figures in docs/log/dflash.md
used --samples 64 --every 4: 154 contexts, 17 min.)

A DFlash drafter drafts a block in one pass: slot i cannot see the tokens sampled at slots < i. At temperature 1 the
verifier is speculative sampling (slot i's token x, drawn from the draft's q_i, is accepted with min(1, p(x) / q_i(x)),
p the target's distribution after the context and the accepted slots before; dlm.sampling.speculative.verify_sample),
so slot i is accepted, given the slots before it were, with probability sum_x min(p(x), q_i(x)).

1. The shipped drafter runs in dlm's own loop on `dlm bench`'s cases (held-out line completions, the same prompt
   tokens, T = 1, --block-size): every cycle's number of accepted slots is recorded (the verifier is wrapped), and the
   tokens it commits are a sample of the target at T = 1 (the loop is lossless). The target's entropy is measured
   over those tokens (one forward over each case's prompt and generation).
2. At the contexts where its cycles started (every --every-th cycle), ideal one-pass drafters are evaluated:
   - factorized: slot 1 is the target's own conditional p(. | context) (the drafter knows the context and the bonus
     token), slot i > 1 the target's marginal over the slots before it, sum over x_<i of p(x_<i) p(. | x_<i): what a
     drafter whose slots are drawn independently converges to when trained with cross-entropy on the target's own
     samples (a DFlash 1 drafter at its best; not in every context the best independent draft, but close to it).
     Estimated by Monte Carlo: --samples continuations drawn from the target at T = 1 from the context, the marginal
     of slot i the mean of their conditionals p(. | context, s_<i).
   - first-order (a DFlash 2 selector's shape, unbounded): slot i's draft may depend on the token chosen at slot
     i - 1 (slot 2 is then the target's own conditional), q_i(. | x) = E[p(. | s_<i-1, x) | x], estimated from the
     same continuations weighted by p(x | s_<i-1) (self-normalised importance weights).
   - top-k: the first-order draft restricted to the --top-k tokens of each slot's marginal, renormalised: a DFlash 2
     selector chooses among candidates fixed in the pass (the top-k of each slot's logits), only the walk through
     them depends on the slot before.
   Each is run through the verifier exactly, one path per context: the accepted token of slot i is drawn from
   min(p, q_i) / beta_i (its distribution given acceptance), beta_i = sum min(p, q_i), and P(at least i accepted) is
   the mean over contexts of beta_1 ... beta_i (an unbiased estimate with no rejected draws wasted). Tau at block B
   (B - 1 slots and the bonus token) is 1 + sum_{i < B} P(at least i accepted), for every B up to --slots + 1 at once.
   With few samples the Monte-Carlo marginal is noisier than the true one, and acceptance is concave in q: the
   factorized estimate errs low; the first-order one's importance weights make it err as well (either way). Both
   are small at 32-64 samples (docs/log/dflash.md has the check against slot 1 enumerated).

The speedup a tau gives is tau / (a cycle's cost in target steps): --cycle-steps, measured with scripts/spec_cycle.py
at one thread (a verify forward of B tokens and dflash2-mid's one-layer draft pass, measured as cycles: 1.80, 1.90
and 2.28 steps at blocks 4, 8 and 16; docs/log/dflash.md). At temperature
0 the ideal one-pass drafter is not bounded this way: the greedy path is a function of the context, so a drafter
that predicts it gets tau = B; there the limit is the drafter's capacity.

Figures: the shipped drafter's P(at least i accepted) and its conditional acceptance by slot, the ideal drafters'
the same (and the factorized one's slot 2 by slot 1's entropy), tau at each block and the speedups; the target's
mean entropy (nats) per generated token, the entropy of the ideal slot marginals. --json writes them. Acceptance
rates, not timings: noise on a busy machine does not move them (one thread).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch

from dlm.bench.methods import bench_items, spec_methods
from dlm.checkpoint import load_model
from dlm.model import KVCache, Transformer
from dlm.sampling import speculative
from dlm.sampling.common import entropy
from dlm.tasks.common import window


# the verifier's arithmetic -------------------------------------------------------------------------

def overlap(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Speculative sampling's acceptance of a draft from q against p: sum_x min(p(x), q(x)). (..., V) -> (...)"""
    return torch.minimum(p, q).sum(-1)


def accepted_draw(p: torch.Tensor, q: torch.Tensor, gen: torch.Generator) -> tuple[float, int]:
    """One slot through the verifier: its acceptance beta = sum min(p, q) and a token drawn as an accepted one is
    distributed, min(p, q) / beta (from p where the two do not overlap: the path then has probability 0). p, q (V,)"""
    m = torch.minimum(p, q)
    beta = float(m.sum())
    w = m if beta > 0 else p
    return beta, int(torch.multinomial(w, 1, generator=gen))


def chain(p_of, q_of, slots: int, gen: torch.Generator) -> list[float]:
    """beta_1 .. beta_slots along one accepted path: p_of(i, path) is the target's distribution at slot i after the
    path so far, q_of(i, path) the draft's; prod beta_1..beta_i is P(at least i accepted) given the path's draws."""
    path, betas = [], []
    for i in range(slots):
        beta, x = accepted_draw(p_of(i, path), q_of(i, path), gen)
        betas.append(beta)
        path.append(x)
    return betas


def at_least(betas: list[list[float]]) -> list[float]:
    """P(at least i accepted), i = 1..slots: the mean over paths of the running products of their betas."""
    n = len(betas[0])
    return [statistics.fmean(math.prod(b[:i + 1]) for b in betas) for i in range(n)]


def tau(p_at_least: list[float], block: int) -> float:
    """Tokens per cycle at block B: the bonus token and the accepted slots of the B - 1 drafted."""
    return 1.0 + sum(p_at_least[:block - 1])


def conditional(p_at_least: list[float]) -> list[float]:
    """Acceptance of slot i given slots < i were accepted."""
    prev = [1.0, *p_at_least[:-1]]
    return [a / b if b > 0 else 0.0 for a, b in zip(p_at_least, prev)]


# the ideal drafters on the target ------------------------------------------------------------------

class Rows:
    """Rows that continue one context in the target: a KV cache of `n` rows copied from the context's."""

    def __init__(self, model: Transformer, root: KVCache, n: int, room: int):
        self.model = model
        self.cache = model.new_cache(n, root.length + room, fill=False)
        for dst, src in zip(self.cache.buffers(), root.buffers()):
            dst[..., :root.length, :].copy_(src[..., :root.length, :].expand_as(dst[..., :root.length, :]))
        self.cache.length = root.length

    def probs(self, tokens: torch.Tensor, write: bool = True) -> torch.Tensor:
        """The target's T = 1 distributions after one more token per row (B,) -> (B, V); write=False leaves the
        rows where they were."""
        out = self.model(tokens[:, None], cache=self.cache, mask="causal", write=write)
        return torch.softmax(out.logits[:, -1].float(), -1)


def on_top(q: torch.Tensor, cands: torch.Tensor) -> torch.Tensor:
    """q restricted to the candidates and renormalised (a DFlash 2 selector's draft: zero outside them). (V,)"""
    out = torch.zeros_like(q)
    out[cands] = q[cands]
    return out / out.sum() if out.sum() > 0 else out


def ideal_betas(model: Transformer, root: KVCache, p1: torch.Tensor, slots: int, samples: int, top_k: int,
                gen: torch.Generator) -> dict[str, list[float]]:
    """The ideal drafters at one context (root: the target's cache over it, p1 (V,): its next-token distribution):
    beta_1..beta_slots of each along one accepted path of its own, and the entropies of the slot marginals.

    factorized   slot i: the target's marginal of slot i (slot 1: p1)
    first_order  slot i after slot i - 1's token x: E[p(. | s_<i-1, x) | x] over the target's continuations
    top_k        first_order restricted to the top_k tokens of slot i's marginal (a DFlash 2 selector's candidates:
                 chosen in the pass, before the walk), renormalised"""
    mc = Rows(model, root, samples, slots + 1)  # the Monte-Carlo continuations
    paths = Rows(model, root, 3, slots + 1)  # each drafter's accepted path
    prev = p1.expand(samples, -1)  # p(. | context, s_<i) of each continuation
    s = torch.multinomial(prev, 1, generator=gen)[:, 0]  # (N,) slot 1 of each continuation
    names = ("factorized", "first_order", "top_k")
    top = on_top(p1, torch.topk(p1, top_k).indices)
    qs = (p1, p1, top)
    out = {n: [] for n in names} | {"marginal_entropy": [float(entropy(p1))]}
    p, x = p1.expand(3, -1), [0, 0, 0]
    for i in range(slots):
        for j, n in enumerate(names):  # slot i through the verifier on each drafter's path
            b, x[j] = accepted_draw(p[j], qs[j], gen)
            out[n].append(b)
        if i == slots - 1:
            break

        def after(tok: int) -> torch.Tensor:
            """E[p(. | s_<i, tok) | tok]: the continuations with the path's own token at slot i, weighted by its
            probability after them (self-normalised importance weights)."""
            branch = mc.probs(torch.full((samples,), tok), write=False)  # (N, V)
            w = prev[:, tok].double()
            w = w / w.sum() if w.sum() > 0 else torch.full_like(w, 1.0 / samples)
            return (w[:, None].float() * branch).sum(0)

        q_first, q_top = after(x[1]), after(x[2])
        prev = mc.probs(s)  # (N, V): the continuations one slot on
        marginal = prev.mean(0)  # of slot i + 1
        qs = (marginal, q_first, on_top(q_top, torch.topk(marginal, top_k).indices))
        out["marginal_entropy"].append(float(entropy(marginal)))
        p = paths.probs(torch.tensor(x))  # each path's target distribution at slot i + 1
        s = torch.multinomial(prev, 1, generator=gen)[:, 0]
    return out


# the shipped drafter in dlm's loop -----------------------------------------------------------------

def run_shipped(model, ck, draft: str, items, max_new: int, block: int):
    """Each case through dlm's speculative loop at T = 1: (prompt ids, generated ids, [(drafted k, accepted n)])."""
    method = spec_methods(model, ck, [draft], max_new, 1.0, block)[0]
    context = min(window(ck, model), window(method.ck, method.model))
    cycles: list[tuple[int, int]] = []
    verify = speculative.verify

    def recorded(draft_ids, logits, q, sampling):
        n, bonus = verify(draft_ids, logits, q, sampling)
        cycles.append((int(draft_ids.shape[0]), n))
        return n, bonus

    from dlm.bench.harness import run_item

    speculative.verify = recorded
    runs = []
    try:
        for it in items:
            cycles.clear()
            row = run_item(method, it, context)
            runs.append((list(row["prompt"]), list(row["tokens"]), list(cycles)))
    finally:
        speculative.verify = verify
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the AR target")
    ap.add_argument("--draft", required=True, help="the shipped drafter (a folder, as dlm bench's --draft)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=8, help="the shipped drafter's block")
    ap.add_argument("--slots", type=int, default=15, help="slots of the ideal drafters (blocks up to slots + 1)")
    ap.add_argument("--samples", type=int, default=32, help="Monte-Carlo continuations per context")
    ap.add_argument("--top-k", type=int, default=16, help="candidates per slot of the top-k drafter (dflash2-mid's "
                    "selector: 16)")
    ap.add_argument("--every", type=int, default=8, help="the ideal drafters at every n-th cycle's context")
    ap.add_argument("--cycle-steps", default="4=1.80,8=1.90,16=2.28",
                    help="a cycle's cost in target steps by block (BLOCK=STEPS,...)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    costs = {int(b): float(c) for b, c in (x.split("=") for x in args.cycle_steps.split(","))}
    model, ck = load_model(args.model)
    items, _ = bench_items(None, None, args.prompts, "line")
    with torch.inference_mode():
        runs = run_shipped(model, ck, args.draft, items, args.max_new_tokens, args.block_size)
        gen = torch.Generator().manual_seed(args.seed)
        ents, ideal, starts = [], {"factorized": [], "first_order": [], "top_k": [], "marginal_entropy": []}, 0
        for prompt, toks, cycles in runs:
            seq = torch.tensor(prompt + toks)
            root = model.new_cache(1, len(seq) + 1)
            logits = model(seq[None], cache=root, mask="causal").logits[0].float()  # (L, V)
            p_all = torch.softmax(logits, -1)
            ents += entropy(p_all[len(prompt) - 1:-1]).tolist()  # each generated token's distribution
            pos = len(prompt) + 1  # the first cycle starts after the prefill's token
            for c, (k, n) in enumerate(cycles):
                if c % args.every == 0:
                    root.length = pos  # the forward over the whole sequence wrote every slot: any prefix holds
                    b = ideal_betas(model, root, p_all[pos - 1], args.slots, args.samples, args.top_k, gen)
                    for key in ideal:
                        ideal[key].append(b[key])
                    starts += 1
                pos += n + 1
    block = args.block_size
    full = [n for _, _, cyc in runs for k, n in cyc if k == block - 1]  # cycles with a whole block drafted
    shipped = [statistics.fmean(n >= i for n in full) for i in range(1, block)]
    toks = sum(len(t) - 1 for _, t, _ in runs)
    ncyc = sum(len(c) for _, _, c in runs)
    res = {"model": args.model, "draft": args.draft, "prompts": len(items), "max_new_tokens": args.max_new_tokens,
           "samples": args.samples, "contexts": starts, "block_size": block,
           "target_entropy_nats": statistics.fmean(ents), "generated_tokens": len(ents),
           "shipped": {"tau": toks / ncyc, "cycles": ncyc, "full_cycles": len(full), "at_least": shipped,
                       "conditional": conditional(shipped)},
           "marginal_entropy_nats": [statistics.fmean(e[i] for e in ideal["marginal_entropy"])
                                     for i in range(args.slots)]}
    print(f"target {args.model}: {len(ents)} tokens sampled at T = 1 on {len(items)} held-out cases, entropy "
          f"{res['target_entropy_nats']:.2f} nats/token (median {statistics.median(ents):.2f}); "
          f"ideal drafters at {starts} contexts, {args.samples} continuations each")
    print("slot marginal entropy (nats): " + " ".join(f"{e:.2f}" for e in res["marginal_entropy_nats"]))
    print(f"{args.draft} (block {block}): tau {res['shipped']['tau']:.2f} over {ncyc} cycles; "
          f"slot acceptance given the slots before (whole blocks, {len(full)} cycles):")
    print("  P(>= i)   " + " ".join(f"{a:.3f}" for a in shipped))
    print("  a_i       " + " ".join(f"{a:.3f}" for a in conditional(shipped)))
    for key in ("factorized", "first_order", "top_k"):
        al = at_least(ideal[key])
        taus = {b: tau(al, b) for b in sorted(costs) if b - 1 <= args.slots}
        res[key] = {"at_least": al, "conditional": conditional(al), "tau": taus,
                    "speedup": {b: taus[b] / costs[b] for b in taus}}
        print(f"ideal {key}" + (f" (top {args.top_k})" if key == "top_k" else "") + ":")
        print("  P(>= i)   " + " ".join(f"{a:.3f}" for a in al))
        print("  a_i       " + " ".join(f"{a:.3f}" for a in conditional(al)))
        print("  " + ", ".join(f"block {b}: tau {t:.2f}, {t / costs[b]:.2f}x at {costs[b]} steps a cycle"
                               for b, t in taus.items()))
    # what limits slot 2: the factorized drafter's acceptance there by how uncertain slot 1 was
    h1 = [e[0] for e in ideal["marginal_entropy"]]
    res["slot2_by_slot1_entropy"] = {}
    for lo, hi in ((0.0, 0.5), (0.5, 1.5), (1.5, 3.0), (3.0, 99.0)):
        sel = [b[1] for b, h in zip(ideal["factorized"], h1) if lo <= h < hi]
        if sel:
            res["slot2_by_slot1_entropy"][f"{lo}-{hi}"] = {"contexts": len(sel), "beta2": statistics.fmean(sel)}
    print("factorized slot 2 by slot 1's entropy (nats): " + ", ".join(
        f"{k}: {v['beta2']:.2f} ({v['contexts']})" for k, v in res["slot2_by_slot1_entropy"].items()))
    res["contexts_detail"] = [{"slot1_entropy": h, "factorized": f, "first_order": m, "top_k": t}
                              for h, f, m, t in zip(h1, ideal["factorized"], ideal["first_order"], ideal["top_k"])]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
