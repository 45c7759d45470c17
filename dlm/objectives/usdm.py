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

Shifted prediction (`--canvas-shift`, ModelConfig.canvas_shift; Dream and DiffuLLaMA do this when they
adapt an AR model to masked diffusion): the denoiser's output at canvas position j is scored against
token j + 1 and the encoder's next-token logits at the last clean position against token 0, so every
canvas logit starts out where the AR head points (`align_canvas_logits`).

`evaluate` is the held-out likelihood bound (`dlm eval`): the continuous-time ELBO of
uniform-state diffusion (as in UDLM, Schiff et al. 2024), Monte-Carlo over t, next to the
encoder's own next-token perplexity on the same canvas tokens.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dlm.config import TrainConfig
from dlm.errors import DlmError, check
from dlm.masks import usdm_canvas_train_mask
from dlm.model import align_canvas_logits, canvas_embeds
from dlm.noise import sample_t, uniform_corrupt
from dlm.objectives.base import ALL, Objective


def joint_forward(model: nn.Module, clean: Tensor, canvas_emb: Tensor, start: Tensor) -> Tensor:
    """Encoder over clean (B, T) and denoiser over a canvas (B, L, D) placed at start[b]; logits (B, T + L, V)."""
    B, T = clean.shape
    L = canvas_emb.shape[1]
    dev = clean.device
    x = torch.cat([model.embed(clean), canvas_emb.to(model.embed_tokens.weight.dtype)], 1)  # (B, T + L, D)
    pos = torch.cat([torch.arange(T, device=dev).expand(B, T), start[:, None] + torch.arange(L, device=dev)], 1)
    window = model.cfg.sliding_window if "sliding" in model.cfg.layer_types else None
    return model(embeds=x, pos=pos, mask=usdm_canvas_train_mask(T, L, start, window)).logits


def fill_after_eos(canvas: Tensor, eos_id: int) -> Tensor:
    """Every position after the first <eos> of each row becomes <eos> (the document is over)."""
    is_eos = (canvas == eos_id).long()
    after = (is_eos.cumsum(1) - is_eos) > 0  # strictly after the first <eos>
    return canvas.masked_fill(after, eos_id)


def before_canvas(logits: Tensor, start: Tensor) -> Tensor:
    """The encoder's next-token logits at the last clean position before each row's canvas: (B, 1, V)."""
    return logits[torch.arange(logits.shape[0], device=logits.device), start - 1][:, None]


def choose_canvas(batch: Tensor, L: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    """One canvas per window (B, T + 1): start (B,) uniform in [1, T + 1 - L], canvas tokens (B, L)."""
    B, T1 = batch.shape
    n_starts = T1 - L  # starts 1 .. T + 1 - L
    start = 1 + (torch.rand(B, generator=gen, device=batch.device) * n_starts).long().clamp(max=n_starts - 1)
    idx = start[:, None] + torch.arange(L, device=batch.device)  # (B, L)
    return start, batch.gather(1, idx)


class USDM(Objective):
    name = "usdm"
    self_cond = True

    @classmethod
    def check_config(cls, cfg: TrainConfig) -> None:
        check(0 < cfg.canvas_length <= cfg.seq_len,
              f"--canvas-length must be in [1, --seq-len {cfg.seq_len}] (a prefix precedes the canvas), "
              f"got {cfg.canvas_length}")
        check(cfg.loss_weight in ("constant", "inverse"),
              f"--loss-weight must be constant or inverse, got {cfg.loss_weight!r}")
        check(0 <= cfg.self_cond_prob <= 1, f"--self-cond-prob must be in [0, 1], got {cfg.self_cond_prob}")
        check(cfg.canvas_scale in ("unit", "encoder"), f"--canvas-scale must be unit or encoder, got {cfg.canvas_scale!r}")

    def build_model(self) -> nn.Module:
        model = super().build_model()
        if self.cfg.canvas_shift:
            model.cfg.canvas_shift = True
        if self.cfg.canvas_scale == "encoder":  # the canvas enters at the clean tokens' scale
            rms = float(model.embed_tokens.weight.detach().float().pow(2).mean().sqrt())
            model.cfg.canvas_rms = model.self_cond.rms = round(rms, 6)
        return model

    uses_every_param = False  # a step where no row self-conditions leaves the self-conditioning MLP without gradient

    def loss(self, model: nn.Module, batch: Tensor, gen: torch.Generator, rows: slice = ALL,
             sup: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
        cfg, dev = self.cfg, batch.device
        B = batch.shape[0]
        L = cfg.canvas_length
        t = sample_t(B, gen, dev)  # (B,)
        if self.sep_id is None:
            start, canvas = choose_canvas(batch, L, gen)
        else:  # supervised pairs: the canvas is the answer (DiffusionGemma's SFT), its givens kept with --keep-given
            sup, start, canvas = self.answer_canvas(batch, L, sup)
        canvas = fill_after_eos(canvas, self.tok.eos_id)  # (B, L) targets
        resp = None if sup is None else sup.gather(1, start[:, None] + torch.arange(L, device=dev))  # (B, L)
        zt, _ = uniform_corrupt(canvas, t, self.tok.vocab_size, gen)
        if resp is not None and self.sep_id is not None:  # givens (not in resp) stay clean, as they are pinned when solving
            zt = torch.where(resp, zt, canvas)
        sel = torch.rand(B, generator=gen, device=dev) < cfg.self_cond_prob  # (B,) rows that self-condition
        any_sel = bool(sel.any())  # over the whole batch: every slice runs the same modules
        batch, t, start, canvas, zt, sel = batch[rows], t[rows], start[rows], canvas[rows], zt[rows], sel[rows]
        if sup is not None:
            sup, resp = sup[rows], resp[rows]
        x, y = batch[:, :-1], batch[:, 1:]  # (b, T): this slice's rows
        B, T = x.shape
        shift = model.cfg.canvas_shift

        probs = None
        if any_sel:  # first pass (no gradient) for the self-conditioned rows only; zero signal for the others
            probs = torch.zeros(B, L, model.cfg.vocab_size, device=dev, dtype=torch.float32)
            if bool(sel.any()):
                with torch.no_grad():
                    rs = sel.nonzero().squeeze(1)
                    keep = int(start[rs].max())  # the canvas reads clean keys < start only
                    first = joint_forward(model, x[rs, :keep], canvas_embeds(model, zt[rs], None), start[rs])
                    den = align_canvas_logits(first[:, keep:], before_canvas(first, start[rs]) if shift else None)
                    probs[rs] = torch.softmax(den.float(), -1)
        logits = joint_forward(model, x, canvas_embeds(model, zt, probs), start)  # (B, T + L, V)
        den = align_canvas_logits(logits[:, T:], before_canvas(logits, start) if shift else None)  # (B, L, V)

        ce = F.cross_entropy(den.flatten(0, 1).float(), canvas.flatten(), reduction="none").view(B, L)
        if sup is None:
            ar = F.cross_entropy(logits[:, :T].flatten(0, 1).float(), y.flatten())
            per_row = ce.mean(1)  # (B,)
        else:  # a prompted corpus: the loss reads the response tokens only (of the canvas, of the AR targets)
            keep = sup[:, 1:]
            ar = F.cross_entropy(logits[:, :T][keep].float(), y[keep], reduction="sum") / keep.sum().clamp(min=1)
            per_row = (ce * resp).sum(1) / resp.sum(1).clamp(min=1)
        weight = 1.0 / (1.0 - t) if cfg.loss_weight == "inverse" else torch.ones_like(t)
        diff = (per_row * weight).mean()
        return ar + diff, {"ar_loss": float(ar.detach()), "canvas_loss": float(per_row.mean().detach())}

    def answer_canvas(self, batch: Tensor, L: int, sup: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Windows (B, T + 1) of supervised pairs (--answer-sep): the canvas starts at each row's first answer
        position (a window must hold a separator with L tokens after it). Returns the flags (B, T + 1) of the
        positions the loss reads (the answer's unknowns: every answer token, less the givens with --keep-given),
        start (B,) and the canvas tokens (B, L)."""
        ans = self.answers(batch, sup)  # (B, T + 1)
        has = ans.any(1)
        first = ans.float().argmax(1)  # the first answer position
        if not bool(has.all()) or int(first.max()) + L > batch.shape[1]:
            raise DlmError(f"--answer-sep: every training window must hold a separator followed by --canvas-length "
                           f"{L} tokens (a .csv task corpus with --seq-len equal to a document's length)")
        start = first
        canvas = batch.gather(1, start[:, None] + torch.arange(L, device=batch.device))
        return self.unknowns(batch, sup), start, canvas

    def meta(self) -> dict[str, Any]:
        return {"canvas_length": self.cfg.canvas_length, "noise_vocab": self.tok.vocab_size}


# the likelihood bound -----------------------------------------------------------------------------

def uniform_elbo_integrand(logits: Tensor, x0: Tensor, zt: Tensor, t: Tensor, N: int, rates: str = "mean") -> Tensor:
    """Per-position integrand of the continuous-time negative ELBO of uniform-state diffusion (nats per unit t).

    Forward process: a token is replaced by a uniform draw over N tokens with probability t;
    alpha = 1 - t; q(z_t | x) = alpha x + (1 - alpha) / N; the forward jump rate is beta = 1 / alpha.
    Write xb(x) = N alpha x + (1 - alpha) 1 (so q(y | x) = xb(x)_y / N). Given the clean token x, the
    reverse rate from i = z_t to y != i is R_y = (beta / N) xb(x)_y / xb(x)_i. A model's reverse rates
    Rhat_y, from the denoiser's clean-token distribution p (softmax of the logits over the N tokens),
    give the bound -log p(x) <= int_0^1 E_{z_t} sum_positions sum_{y != i} [Rhat_y - R_y + R_y log(R_y / Rhat_y)] dt
    (the path-space KL of a continuous-time Markov chain; the prior term vanishes since alpha_1 = 0
    makes q_1 uniform, and reconstruction since alpha_0 = 1). Two choices of Rhat:

      rates="mean": Rhat_y = (beta / N) sum_x p(x) xb(x)_y / xb(x)_i, the reverse rate of the marginal
        process when p is the true posterior of the clean token (exact for a perfect denoiser, so the
        bound is tight there). This is what a denoiser trained with cross-entropy estimates.
      rates="udlm": Rhat_y = (beta / N) xbp_y / xbp_i with xbp = N alpha p + (1 - alpha) 1: p plugged into
        the posterior formula (UDLM, Schiff et al. 2024, whose training loss is this ELBO).

    logits (B, L, V >= N), x0, zt (B, L), t (B,) -> (B, L) float64, >= 0. Both are written in closed
    form (tests hold them against the sum over every y).
    """
    a = (1.0 - t.double().clamp(1e-6, 1 - 1e-6))[:, None]  # alpha_t (B, 1)
    p = torch.softmax(logits[..., :N].double(), -1)  # (B, L, N)
    same = zt == x0
    hi = N * a + 1 - a  # xb at the clean token; 1 - a elsewhere
    r_same, r_diff = (1 - a) / hi, hi / (1 - a)  # R_y / (beta / N) when z = x, resp. R_x when z != x
    # true rates: sum_{y != i} R_y and sum R log R (in units of beta / N)
    sum_r = torch.where(same, ((N - 1) * r_same).expand_as(same), (r_diff + N - 2).expand_as(same))
    rlogr = torch.where(same, ((N - 1) * r_same * r_same.log()).expand_as(same), (r_diff * r_diff.log()).expand_as(same))
    if rates == "mean":
        pz = p.gather(-1, zt[..., None]).squeeze(-1)  # (B, L)
        c = 1 - pz + pz * r_same  # Rhat_y = c + p_y (r_diff - 1) for y != i
        h = c[..., None] + p * (r_diff - 1)[..., None]  # (B, L, N)
        sum_h = (N - 1) * c + (r_diff - 1) * (1 - pz)
    elif rates == "udlm":
        xbp = N * a[..., None] * p + (1 - a)[..., None]  # (B, L, N)
        xbp_i = xbp.gather(-1, zt[..., None])  # (B, L, 1)
        h = xbp / xbp_i
        sum_h = N / xbp_i.squeeze(-1) - 1
    else:
        raise ValueError(f"rates must be 'mean' or 'udlm', got {rates!r}")
    log_h = h.log()
    tot = log_h.sum(-1)
    lh_i = log_h.gather(-1, zt[..., None]).squeeze(-1)
    lh_x = log_h.gather(-1, x0[..., None]).squeeze(-1)
    rlogh = torch.where(same, r_same * (tot - lh_i), r_diff * lh_x + (tot - lh_i - lh_x))  # sum_{y != i} R_y log Rhat_y
    return ((sum_h - sum_r + rlogr - rlogh) / (N * a)).clamp(min=0.0)  # times beta / N = 1 / (N alpha)


def encoder_nll(model: nn.Module, cache, prefix: Tensor, canvas: Tensor) -> tuple[float, Tensor]:
    """The encoder's causal next-token loss (nats, summed) on the canvas tokens given the prefix, and its
    logits for canvas[0] (B, 1, V); leaves prefix + canvas in the cache."""
    first = model(prefix, cache=cache).logits[:, -1:]  # (B, 1, V) predicts canvas[0]
    rest = model(canvas[:, :-1], cache=cache).logits  # (B, L - 1, V) incremental prefill
    logits = torch.cat([first, rest], 1).flatten(0, 1).float()
    return float(F.cross_entropy(logits, canvas.flatten(), reduction="sum")), first


def canvas_bounds(model: nn.Module, cache, canvas: Tensor, start: int, samples: int, N: int,
                  gen: torch.Generator, first: Tensor | None = None) -> dict[str, float]:
    """Summed ELBO integrands of canvases (B, L) after the cached prefix, `samples` stratified times each:
    self-conditioned with mean rates ("mean") and UDLM's rates ("udlm"), first pass alone ("no_sc").
    first (B, 1, V): the encoder's logits for canvas[0], which a model with canvas_shift predicts it with."""
    B, L = canvas.shape
    check(first is not None or not model.cfg.canvas_shift,
          "a canvas_shift model's bound needs the encoder's logits for canvas[0]")
    first = first if model.cfg.canvas_shift else None
    pos = torch.arange(start, start + L, device=canvas.device)
    sums = {"mean": 0.0, "udlm": 0.0, "no_sc": 0.0}
    for k in range(samples):
        t = (k + torch.rand(B, generator=gen, device=canvas.device)) / samples  # (B,) stratified over [0, 1)
        zt, _ = uniform_corrupt(canvas, t, N, gen)
        l1 = model(embeds=canvas_embeds(model, zt, None), pos=pos, cache=cache, mask="full", write=False).logits
        l1 = align_canvas_logits(l1, first)
        l2 = model(embeds=canvas_embeds(model, zt, torch.softmax(l1.float(), -1)), pos=pos, cache=cache,
                   mask="full", write=False).logits
        l2 = align_canvas_logits(l2, first)
        sums["no_sc"] += float(uniform_elbo_integrand(l1, canvas, zt, t, N).sum()) / samples
        sums["mean"] += float(uniform_elbo_integrand(l2, canvas, zt, t, N).sum()) / samples
        sums["udlm"] += float(uniform_elbo_integrand(l2, canvas, zt, t, N, rates="udlm").sum()) / samples
    return sums


@torch.inference_mode()
def evaluate(model: nn.Module, ck, corpus, split: str, seq_len: int, batch_size: int, max_batches: int | None,
             seed: int, samples: int = 4) -> dict[str, Any]:
    """ELBO-based perplexity bound on held-out canvases, and the encoder's own perplexity on the same tokens.

    Windows of seq_len + 1 tokens, in order; the canvas is each window's last L tokens (as they are in
    the corpus; no <eos> filling), the prefix everything before it. For each window `samples`
    stratified times t_k = (k + u_k) / samples, a corruption z_t, and the self-conditioned denoiser
    (a first pass without self-conditioning feeds the second, as in sampling). Reported per canvas
    token, all in nats or as exp(nats):
      bound_nats, perplexity_bound   the continuous-time ELBO with the denoiser's posterior-mean reverse
                                     rates (`uniform_elbo_integrand`, rates="mean"), self-conditioned
      perplexity_bound_udlm          the same with UDLM's plug-in rates (looser for a cross-entropy denoiser)
      perplexity_bound_no_sc         mean rates, first pass alone (no self-conditioning)
      ar_nats, ar_perplexity         the encoder's causal next-token loss on the same canvas tokens given
                                     the same prefix ("the AR number")
    A Monte-Carlo estimate (over t and z_t) of an upper bound on -log p(canvas | prefix); seeded: the
    same seed gives the same numbers.
    """
    from dlm.data.tokens import Batches, load_tokens

    tok = ck.tokenizer
    N = ck.noise_vocab
    L = ck.canvas_length
    seq = min(seq_len, model.cfg.max_seq_len)
    check(0 < L < seq + 1, f"--seq-len {seq} leaves no prefix before a canvas of {L} tokens (need seq-len >= {L})")
    check(samples > 0, f"samples must be > 0, got {samples}")
    dev = model.device
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    batches = Batches(load_tokens(corpus, tok, split), seq, batch_size, where=f"{corpus.spec}, its {split} split")
    start = seq + 1 - L  # canvas = window[start:], prefix = window[:start]
    sums = {"mean": 0.0, "udlm": 0.0, "no_sc": 0.0}
    ar = 0.0
    count = 0
    for batch in batches.sequential(max_batches):
        batch = batch.to(dev)
        prefix, canvas = batch[:, :start], batch[:, start:]  # (B, P), (B, L)
        cache = model.new_cache(batch.shape[0], seq + 1)
        nll, first = encoder_nll(model, cache, prefix, canvas)
        ar += nll
        cache.crop(start)
        for k, v in canvas_bounds(model, cache, canvas, start, samples, N, gen, first).items():
            sums[k] += v
        count += canvas.numel()
    b = {k: v / count for k, v in sums.items()}
    a = ar / count
    return {"bound_nats": b["mean"], "perplexity_bound": math.exp(b["mean"]),
            "perplexity_bound_udlm": math.exp(b["udlm"]), "perplexity_bound_no_sc": math.exp(b["no_sc"]),
            "ar_nats": a, "ar_perplexity": math.exp(a), "tokens": count, "canvas_length": L, "samples": samples,
            "seed": seed}
