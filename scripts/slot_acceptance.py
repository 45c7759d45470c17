"""A DFlash 2 drafter's acceptance slot by slot, teacher-forced on the target's own text, without running the loop.

    python scripts/slot_acceptance.py --model checkpoints/ar-mid --draft checkpoints/dflash2-mid \\
        --data ar-mid-t1-dev.jsonl --top-k 16 64 256

--data: a `dlm distill` .jsonl of the target's continuations (at T = 1 for the sampled figures, greedy for the greedy
ones; fresh seeds, not the drafter's training data). Every third position of each continuation starts a block; its
slots see the text before them as the training loss does (the gold token before each slot as the selector's
predecessor). Per slot, the mean over blocks of:

    sel K        sum min(p, q): the acceptance probability at T = 1 of a proposal drawn from the selector's
                 softmax over the top K of the slot's logits (p the target's softmax at that position)
    full         the same for q the drafter's softmax over the whole vocabulary (no selector: DFlash 1's draw)
    mass K       p's mass on those K candidates (what a q restricted to them can reach)
    greedy K     whether the selector's argmax among K candidates is the gold token (on greedy text: the greedy
                 acceptance of that slot, given the slots before)

and tau ~ 1 + sum_i prod_{j <= i} a_j, as if the slots were independent given the ones before (they are not quite:
the figure ranks drafters, the bench measures them).
"""

from __future__ import annotations

import argparse
import json

import torch

from dlm.checkpoint import load_model
from dlm.masks import dflash_train_mask


def score(target, d, ids: list[int], start: int, ks: tuple[int, ...], every: int = 3) -> dict[str, torch.Tensor]:
    """Per-slot figures (name -> (A, S)) of the blocks anchored at start, start + every, ... of ids."""
    g, T1 = d.block_size, len(ids)
    anchors = torch.arange(start, T1 - g + 1, every)[None]  # (1, A)
    A = anchors.shape[1]
    idx = anchors[:, :, None] + torch.arange(g)  # (1, A, g)
    batch = torch.tensor([ids])
    out = target(batch, taps=d.taps, head=False)
    p = torch.softmax(target.head(out.last[0, idx[0, :, :-1].reshape(-1)]).float(), -1).view(A, g - 1, -1)
    ctx = d.context(d.features(target, batch, out.taps))
    block = torch.full((1, A, g), d.mask_id, dtype=torch.long)
    block[:, :, 0] = batch.gather(1, anchors)
    labels = batch.gather(1, idx[:, :, 1:].reshape(1, -1)).view(A, g - 1)
    mask = dflash_train_mask(anchors, T1, g, causal_ctx=d.injection == "input")
    h = d(d.embed(target, block.view(1, A * g)), ctx, pos=idx.view(1, A * g), ctx_pos=torch.arange(T1), mask=mask,
          segment=g).view(A, g, -1)[:, 1:]  # (A, S, D)
    logits = d.head(target, h).float()  # (A, S, V)
    res = {"full": torch.minimum(p, torch.softmax(logits, -1)).sum(-1)}
    prev = torch.cat((block[0, :, :1], labels[:, :-1]), -1)  # (A, S) the gold token before each slot
    sel = d.candidate_selector
    for k in ks:
        unary, cands = torch.topk(logits, k, -1)
        if sel is not None:
            sc = sel.scores(h.reshape(-1, h.shape[-1]), unary.reshape(-1, k), cands.reshape(-1, k),
                            prev.reshape(-1)).float().view(A, g - 1, k)
        else:
            sc = unary
        pc = p.gather(-1, cands)
        res[f"sel {k}"] = torch.minimum(pc, torch.softmax(sc, -1)).sum(-1)
        res[f"mass {k}"] = pc.sum(-1)
        gold = cands == labels[..., None]
        res[f"greedy {k}"] = ((sc.argmax(-1) == gold.int().argmax(-1)) & gold.any(-1)).float()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the AR target")
    ap.add_argument("--draft", required=True, help="a DFlash drafter folder")
    ap.add_argument("--data", required=True, help="a dlm distill .jsonl of the target's continuations")
    ap.add_argument("--cases", type=int, default=32)
    ap.add_argument("--top-k", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    target, ck = load_model(args.model)
    d, _ = load_model(args.draft)
    d = d.float().eval()
    tok = ck.tokenizer
    sums: dict[str, list[torch.Tensor]] = {}
    with torch.no_grad():
        for line in open(args.data).readlines()[:args.cases]:
            r = json.loads(line)
            ids = tok.encode(r["text"])[:target.cfg.max_seq_len]
            P = len(tok.encode(r["prompt"]))
            if len(ids) - d.block_size + 1 <= P:
                continue
            for name, v in score(target, d, ids, max(P - 1, 0), tuple(args.top_k)).items():
                sums.setdefault(name, []).append(v.mean(0))  # (S,) this case's mean per slot
    report = {}
    for name, per in sums.items():
        m = torch.stack(per).mean(0).tolist()
        tau, prod = 1.0, 1.0
        for x in m:
            prod *= x
            tau += prod
        report[name] = {"slots": m, "tau": tau}
        print(f"{name:12s} " + " ".join(f"{x:.3f}" for x in m) + f"   tau ~ {tau:.2f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)


if __name__ == "__main__":
    main()
