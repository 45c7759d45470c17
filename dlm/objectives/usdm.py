"""Uniform-state diffusion (DiffusionGemma): one set of weights run two ways.

Encoder: causal over the clean text (prompt and committed canvases); writes the KV cache; trained
with the ordinary next-token loss. Denoiser: bidirectional over one canvas of `canvas_length`
tokens at the positions those tokens will hold once committed; reads the encoder's K/V of
everything before the canvas and never writes it. There is no mask token: corrupted tokens are
uniform random tokens, and the denoiser predicts the clean token at every canvas position.

One training forward holds both uses. The input is [clean window (T) ; corrupted canvas (L)] with
a boolean mask: the clean part is causal (its logits give the next-token loss), and canvas
queries see the clean keys strictly before the canvas start plus the whole canvas. Because the
encoder of the sampler is the same causal pass and K/V of a key depend only on the keys before
it, this is exactly what the sampler computes with a prefilled cache and `write=False`
(tests/test_usdm.py holds the two against each other).

Training windows are packed documents separated by <eos>. One canvas per window is chosen with
its start uniform in [1, T + 1 - L] (at least one clean token before it; any start, because a
prompt can have any length). DiffusionGemma fills the last, partly filled canvas of a document
with <eos> and scores it; here that maps onto: inside the chosen canvas, every position after the
first <eos> (the document's end) becomes <eos> and is scored, so the model learns to fill the
rest of a canvas with <eos> once the text is over, which is where the sampler cuts. The next
document's tokens are never on that canvas. With one canvas per window there are no later
canvases to pad.

Self-conditioning: a first denoiser pass without self-conditioning and without gradient; with
probability `self_cond_prob` per example its softmax feeds the second pass (`canvas_embeds`);
the loss is on the second pass. Loss = next-token CE (weight 1) + canvas CE on every canvas
position, corrupted or not (weight 1, or 1 / (1 - t) with `--loss-weight inverse`).

`evaluate` is the held-out likelihood bound (`dlm eval`): the continuous-time ELBO of
uniform-state diffusion (UDLM, Schiff et al. 2024), Monte-Carlo over t, next to the encoder's
own next-token perplexity on the same canvas tokens.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dlm.noise import sample_t, uniform_corrupt
from dlm.objectives import Objective


def canvas_embeds(model: nn.Module, canvas: Tensor, probs: Tensor | None) -> Tensor:
    """Denoiser input: token embeddings of the canvas (B, L) plus the self-conditioning signal.

    probs (B, L, V): the previous pass's distribution (softmax of its processed logits), or None on
    a canvas's first step (a zero signal: rows of zeros in probs are the same as None).
    """
    emb = model.embed_tokens(canvas)  # (B, L, D)
    soft = None if probs is None else probs.to(emb.dtype) @ model.embed_tokens.weight  # (B, L, D)
    return model.self_cond(emb, soft)


def joint_mask(T: int, L: int, start: Tensor) -> Tensor:
    """(B, 1, T + L, T + L) bool: clean part causal; canvas rows see clean keys < start[b] and the whole canvas."""
    dev = start.device
    B = start.shape[0]
    m = torch.zeros(B, T + L, T + L, dtype=torch.bool, device=dev)
    m[:, :T, :T] = torch.tril(torch.ones(T, T, dtype=torch.bool, device=dev))
    m[:, T:, :T] = torch.arange(T, device=dev)[None, None, :] < start[:, None, None]
    m[:, T:, T:] = True
    return m[:, None]


def joint_forward(model: nn.Module, clean: Tensor, canvas_emb: Tensor, start: Tensor) -> Tensor:
    """Encoder over clean (B, T) and denoiser over a canvas (B, L, D) placed at start[b]; logits (B, T + L, V)."""
    B, T = clean.shape
    L = canvas_emb.shape[1]
    dev = clean.device
    x = torch.cat([model.embed_tokens(clean), canvas_emb.to(model.embed_tokens.weight.dtype)], 1)  # (B, T + L, D)
    pos = torch.cat([torch.arange(T, device=dev).expand(B, T), start[:, None] + torch.arange(L, device=dev)], 1)
    return model(embeds=x, pos=pos, mask=joint_mask(T, L, start)).logits


def fill_after_eos(canvas: Tensor, eos_id: int) -> Tensor:
    """Every position after the first <eos> of each row becomes <eos> (the document is over)."""
    is_eos = (canvas == eos_id).long()
    after = (is_eos.cumsum(1) - is_eos) > 0  # strictly after the first <eos>
    return canvas.masked_fill(after, eos_id)


def choose_canvas(batch: Tensor, L: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """One canvas per window (B, T + 1): start (B,) uniform in [1, T + 1 - L], canvas tokens (B, L)."""
    B, T1 = batch.shape
    n_starts = T1 - L  # starts 1 .. T + 1 - L
    start = 1 + (torch.rand(B, generator=gen, device=batch.device) * n_starts).long().clamp(max=n_starts - 1)
    idx = start[:, None] + torch.arange(L, device=batch.device)  # (B, L)
    return start, batch.gather(1, idx)


def noise_vocab(ck_config: dict[str, Any], tokenizer) -> int:
    """Size of the vocabulary uniform noise is drawn from (the tokenizer's, recorded at training)."""
    return int(ck_config.get("noise_vocab", tokenizer.vocab_size))


class USDM(Objective):
    name = "usdm"
    self_cond = True

    def loss(self, model: nn.Module, batch: Tensor, gen: torch.Generator) -> tuple[Tensor, dict[str, float]]:
        cfg, dev = self.cfg, batch.device
        x, y = batch[:, :-1], batch[:, 1:]  # (B, T)
        B, T = x.shape
        L = cfg.canvas_length
        t = sample_t(B, gen, dev)  # (B,)
        start, canvas = choose_canvas(batch, L, gen)
        canvas = fill_after_eos(canvas, self.tok.eos_id)  # (B, L) targets
        zt, _ = uniform_corrupt(canvas, t, self.tok.vocab_size, gen)
        sel = torch.rand(B, generator=gen, device=dev) < cfg.self_cond_prob  # (B,) rows that self-condition

        probs = None
        if bool(sel.any()):  # first pass (no gradient) for the self-conditioned rows only
            with torch.no_grad():
                rows = sel.nonzero().squeeze(1)
                keep = int(start[rows].max())  # the canvas reads clean keys < start only
                first = joint_forward(model, x[rows, :keep], canvas_embeds(model, zt[rows], None), start[rows])
                probs = torch.zeros(B, L, first.shape[-1], device=dev, dtype=torch.float32)
                probs[rows] = torch.softmax(first[:, keep:].float(), -1)
        logits = joint_forward(model, x, canvas_embeds(model, zt, probs), start)  # (B, T + L, V)

        ar = F.cross_entropy(logits[:, :T].flatten(0, 1).float(), y.flatten())
        ce = F.cross_entropy(logits[:, T:].flatten(0, 1).float(), canvas.flatten(), reduction="none").view(B, L)
        per_row = ce.mean(1)  # (B,)
        weight = 1.0 / (1.0 - t) if cfg.loss_weight == "inverse" else torch.ones_like(t)
        diff = (per_row * weight).mean()
        return ar + diff, {"ar_loss": float(ar.detach()), "canvas_loss": float(per_row.mean().detach())}

    def meta(self) -> dict[str, Any]:
        return {"canvas_length": self.cfg.canvas_length, "noise_vocab": self.tok.vocab_size}


# the likelihood bound -----------------------------------------------------------------------------

def uniform_elbo_integrand(logits: Tensor, x0: Tensor, zt: Tensor, t: Tensor, N: int) -> Tensor:
    """Per-position integrand of the continuous-time negative ELBO of uniform-state diffusion (nats).

    Forward process: a token is replaced by a uniform draw over N tokens with probability t,
    alpha_t = 1 - t, q(z_t | x) = alpha_t x + (1 - alpha_t) / N. Write xb = N alpha x + (1 - alpha) 1
    and, for the model's clean-token distribution p (softmax of the logits over the N tokens),
    xb_p = N alpha p + (1 - alpha) 1. The true reverse rate (given x) from state i = z_t to y != i is
    (beta / N) xb_y / xb_i with beta = -alpha'/alpha = 1 / (1 - t); the model's is the same with xb_p.
    The path-space KL per unit time is
        sum_{y != i} R_model - R_true + R_true log(R_true / R_model)
      = beta / N * [ N / xb_p,i - N / xb_i + sum_{y != i} (xb_y / xb_i) log((xb_y xb_p,i) / (xb_i xb_p,y)) ]
    (UDLM's continuous-time ELBO, Schiff et al. 2024). -log p(x) <= int_0^1 E_{z_t}[sum over positions] dt:
    the prior term vanishes (alpha_1 = 0: q_1 is uniform) and so does reconstruction (alpha_0 = 1).

    logits (B, L, V >= N), x0, zt (B, L), t (B,) -> (B, L) float64, >= 0.
    """
    a = (1.0 - t.double().clamp(1e-6, 1 - 1e-6))[:, None]  # alpha_t (B, 1)
    p = torch.softmax(logits[..., :N].double(), -1)  # (B, L, N)
    xbp = N * a[..., None] * p + (1 - a)[..., None]  # (B, L, N)
    log_xbp = xbp.log()
    xbp_i = xbp.gather(-1, zt[..., None]).squeeze(-1)  # (B, L)
    same = zt == x0
    hi = N * a + 1 - a  # xb at the clean token
    lo = (1 - a).expand_as(xbp_i)  # xb elsewhere
    xb_i = torch.where(same, hi.expand_as(xbp_i), lo)
    # sum_{y != i} xb_y log xb_p,y  =  sum_y (...) - xb_i log xb_p,i
    s_all = (1 - a) * log_xbp.sum(-1) + N * a * log_xbp.gather(-1, x0[..., None]).squeeze(-1)
    s = s_all - xb_i * xbp_i.log()
    # sum_{y != i} r log r with r = xb_y / xb_i: N - 1 terms of (1-a)/hi if z = x, else one term hi/(1-a)
    r_same, r_diff = (1 - a) / hi, hi / (1 - a)
    rlogr = torch.where(same, ((N - 1) * r_same * r_same.log()).expand_as(xb_i), (r_diff * r_diff.log()).expand_as(xb_i))
    inner = N / xbp_i - N / xb_i + rlogr + (N / xb_i - 1) * xbp_i.log() - s / xb_i
    return (inner / (N * a)).clamp(min=0.0)  # beta / N = 1 / (N (1 - t)) = 1 / (N alpha)


@torch.inference_mode()
def evaluate(model: nn.Module, ck, corpus, split: str, seq_len: int, batch_size: int, max_batches: int | None,
             seed: int, samples: int = 4) -> dict[str, Any]:
    """ELBO-based perplexity bound on held-out canvases, and the encoder's own perplexity on the same tokens.

    Windows of seq_len + 1 tokens, in order; the canvas is each window's last L tokens (as they are in
    the corpus; no <eos> filling), the prefix everything before it. For each window `samples`
    stratified times t_k = (k + u_k) / samples, a corruption z_t, and the self-conditioned denoiser
    (a first pass without self-conditioning feeds the second, as in sampling). Reported per canvas
    token: `bound_nats` (and `perplexity_bound` = exp), the same bound with the first pass alone
    (`perplexity_bound_no_sc`), and `ar_nats` / `ar_perplexity`: the encoder's causal next-token
    loss on the same canvas tokens given the same prefix. Seeded: the same seed, the same numbers.
    """
    from dlm.data.tokens import Batches, load_tokens

    tok = ck.tokenizer
    N = noise_vocab(ck.config, tok)
    L = int(ck.config.get("canvas_length", ck.config.get("train", {}).get("canvas_length", 256)))
    seq = min(seq_len, model.cfg.max_seq_len)
    from dlm.errors import check

    check(0 < L < seq + 1, f"--seq-len {seq} leaves no prefix before a canvas of {L} tokens (need seq-len >= {L})")
    check(samples > 0, f"samples must be > 0, got {samples}")
    dev = model.device
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    batches = Batches(load_tokens(corpus, tok, split), seq, batch_size)
    start = seq + 1 - L  # canvas = window[start:], prefix = window[:start]
    bound = bound_nosc = ar = 0.0
    count = 0
    for batch in batches.sequential(max_batches):
        batch = batch.to(dev)
        B = batch.shape[0]
        prefix, canvas = batch[:, :start], batch[:, start:]  # (B, P), (B, L)
        cache = model.new_cache(B, seq + 1)
        first = model(prefix, cache=cache).logits[:, -1:]  # (B, 1, V) predicts canvas[0]
        rest = model(canvas[:, :-1], cache=cache).logits  # (B, L - 1, V) incremental prefill
        ar += float(F.cross_entropy(torch.cat([first, rest], 1).flatten(0, 1).float(), canvas.flatten(), reduction="sum"))
        cache.crop(start)
        pos = torch.arange(start, start + L, device=dev)
        for k in range(samples):
            t = (k + torch.rand(B, generator=gen, device=dev)) / samples  # (B,) stratified
            zt, _ = uniform_corrupt(canvas, t, N, gen)
            l1 = model(embeds=canvas_embeds(model, zt, None), pos=pos, cache=cache, mask="full", write=False).logits
            l2 = model(embeds=canvas_embeds(model, zt, torch.softmax(l1.float(), -1)), pos=pos, cache=cache,
                       mask="full", write=False).logits
            bound_nosc += float(uniform_elbo_integrand(l1, canvas, zt, t, N).sum()) / samples
            bound += float(uniform_elbo_integrand(l2, canvas, zt, t, N).sum()) / samples
        count += canvas.numel()
    b, b0, a = bound / count, bound_nosc / count, ar / count
    return {"bound_nats": b, "perplexity_bound": math.exp(b), "perplexity_bound_no_sc": math.exp(b0),
            "ar_nats": a, "ar_perplexity": math.exp(a), "tokens": count, "canvas_length": L, "samples": samples,
            "seed": seed}
