"""Masked (absorbing) diffusion: MDLM / LLaDA, and block diffusion (BD3-LM).

Forward process: t ~ U(eps, 1 - eps), linear schedule: each token becomes <mask> with probability t.
The denoiser sees the corrupted sequence bidirectionally and is trained with cross-entropy on the
masked positions only, weighted by 1/t, summed and divided by the number of tokens: a Monte-Carlo
estimate of the negative ELBO per token (MDLM, LLaDA).

Block diffusion (`--block-size B`, BD3-LM): the window is cut into blocks of B tokens, each with a
time of its own. One pass runs [x_t | x_0] (2T tokens, positions 0..T-1 twice) under a boolean mask:

    noisy block b  -> itself (bidirectional) and the clean blocks < b
    clean block b  -> the clean blocks <= b                      (what the KV cache holds at sampling)

so the noisy half learns p(block b | clean blocks before it), which is how generation proceeds
block by block with an exact KV cache. The loss reads the noisy half only. `block_size` 0 is
whole-sequence MDLM (mask "full", T tokens).

The likelihood bound (`dlm eval`) uses LLaDA's lower-variance form of the same ELBO: per block,
l ~ U{1..B} positions are masked and their cross-entropy is weighted by B / l.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dlm.config import TrainConfig
from dlm.errors import DlmError, check
from dlm.masks import block_causal_mask, block_diffusion_train_mask, elbo_noisy_block_mask
from dlm.noise import EPS, mask_corrupt
from dlm.objectives.base import ALL, Objective, share


def block_ids(T: int, L: int, device: torch.device | str = "cpu") -> Tensor:
    """(T,) index of the block of each position (blocks of L tokens from position 0)."""
    return torch.arange(T, device=device) // L


def stratified_t(n: int, gen: torch.Generator, device: torch.device | str, eps: float = EPS) -> Tensor:
    """(n,) times in [eps, 1 - eps], one per stratum of [0, 1) in shuffled order (low-variance, as MDLM)."""
    u = (torch.rand(1, generator=gen, device=device) + torch.arange(n, device=device)) / n
    u = u[torch.randperm(n, generator=gen, device=device)]
    return eps + (1 - 2 * eps) * u


def noisy_hidden(model: nn.Module, xt: Tensor, x0: Tensor | None, L: int) -> Tensor:
    """Final hidden states (B, T, D) of the noisy positions of x_t, given the clean x_0 when L < T."""
    B, T = xt.shape
    if x0 is None:  # whole-sequence diffusion
        return model(xt, mask="full", head=False).last
    pos = torch.arange(T, device=xt.device).repeat(2)  # (2T,) both halves at positions 0..T-1
    out = model(torch.cat([xt, x0], dim=1), pos=pos, mask=block_diffusion_train_mask(T, L, xt.device), head=False)
    return out.last[:, :T]


def masked_logits(model: nn.Module, h: Tensor, mask_id: int) -> Tensor:
    """LM head on hidden states (N, D) -> (N, V) in fp32 at least, <mask> never predicted."""
    logits = model.head(h)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    logits[:, mask_id] = float("-inf")
    return logits


class MDLM(Objective):
    name = "mdlm"

    def __init__(self, cfg, tokenizer):
        super().__init__(cfg, tokenizer)
        check(tokenizer.mask_id is not None, f"--objective mdlm: the tokenizer {tokenizer.source} has no <mask> token")
        self.mask_id = tokenizer.mask_id

    @classmethod
    def check_config(cls, cfg: TrainConfig) -> None:
        B = cfg.block_size or 0
        check(B >= 0, f"--block-size must be >= 0 (0 = whole sequence), got {B}")
        if B and cfg.seq_len % B:
            raise DlmError(f"--block-size must divide --seq-len ({cfg.seq_len}), got {B}")

    @property
    def block_size(self) -> int:
        """Blocks of this many tokens (the whole window when 0 or >= seq_len)."""
        B = self.cfg.block_size or 0
        return B if 0 < B < self.cfg.seq_len else 0

    def loss(self, model: nn.Module, batch: Tensor, gen: torch.Generator, rows: slice = ALL,
             sup: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
        x0 = batch[:, :-1]  # (B, T)
        B, T = x0.shape
        L = self.block_size or T
        nb = T // L
        t = stratified_t(B * nb, gen, x0.device).view(B, nb)  # one time per block, stratified over the batch
        t_tok = t.repeat_interleave(L, dim=1)  # (B, T)
        ans = self.unknowns(x0, sup)  # pairs, responses: only the answer is noised (its givens too unless --keep-given)
        xt, masked = mask_corrupt(x0, t_tok, self.mask_id, gen, corruptible=ans)
        denom = (B * T if ans is None else max(1, int(ans.sum()))) / share(batch, rows)
        x0, xt, masked, t_tok = x0[rows], xt[rows], masked[rows], t_tok[rows]  # (b, T): this slice's rows
        h = noisy_hidden(model, xt, x0 if self.block_size else None, L)  # (b, T, D)
        logits = masked_logits(model, h[masked], self.mask_id)  # (N, V)
        ce = F.cross_entropy(logits, x0[masked], reduction="none")  # (N,)
        loss = (ce / t_tok[masked]).sum() / denom
        n = int(masked.sum())
        return loss, {"ce_masked": float(ce.detach().mean()) if n else 0.0, "mask_rate": n / masked.numel()}

    def meta(self) -> dict[str, Any]:
        return {"block_size": self.block_size, "mask_id": self.mask_id}


# likelihood bound --------------------------------------------------------------------------------

@torch.inference_mode()
def elbo_nll(model: nn.Module, x0: Tensor, L: int, mask_id: int, samples: int, gen: torch.Generator,
             fixed: Tensor | None = None, shift: bool = False) -> Tensor:
    """Monte-Carlo negative ELBO (nats, summed over tokens) of each window x0 (B, T): (samples, B).

    Per block and sample, l ~ U{1..L} positions are masked uniformly at random; the masked tokens'
    cross-entropy is weighted by L / l (LLaDA's estimator of the 1/t-weighted ELBO). With blocks, the
    clean context's K/V are computed once (block-causal, as at sampling) and read by every sample.
    fixed (B, T) bool: positions that are never masked (a condition: the bound is then of the other tokens
    given them, LLaDA's conditional likelihood); L counts a block's free positions only.
    shift: a masked position's token is predicted by the output one position earlier (Dream's likelihood; position
    0 by its own); whole windows only (check_bound).
    """
    B, T = x0.shape
    L = L if 0 < L < T else T
    nb = math.ceil(T / L)
    dev = x0.device
    blk = block_ids(T, L, dev)
    size = torch.bincount(blk, minlength=nb).float()  # (nb,) tokens per block (the last may be shorter)
    cache = None
    if nb > 1:
        cache = model.new_cache(B, 2 * T)
        model(x0, pos=torch.arange(T, device=dev), cache=cache, mask=block_causal_mask(T, L, dev), head=False)
        noisy_mask = elbo_noisy_block_mask(T, L, dev)  # (T, 2T) noisy block b: the cached clean blocks < b, itself
    free = size[None].expand(B, nb)  # (B, nb) positions that may be masked per block
    if fixed is not None:
        free = free - torch.zeros(B, nb, device=dev).index_add_(1, blk, fixed.float())
    out = torch.zeros(samples, B, device=dev, dtype=torch.float64)
    for s in range(samples):
        l = (torch.rand(B, nb, generator=gen, device=dev) * free).floor() + 1  # (B, nb) in 1..free
        l = torch.where(free > 0, l, torch.zeros_like(l))  # a block with nothing free masks nothing
        # position i is masked when it is among the l first of its block in a random order (fixed ones last)
        key = blk[None].float() * 2 + torch.rand(B, T, generator=gen, device=dev)  # by block, then at random
        if fixed is not None:
            key = key + fixed.float()
        order = key.argsort(1).argsort(1)  # global rank; block b holds ranks start_b .. start_b + size_b - 1
        start = torch.cat([torch.zeros(1, device=dev), size.cumsum(0)[:-1]])  # (nb,)
        masked = (order - start[blk][None]) < l[:, blk]  # (B, T)
        xt = torch.where(masked, torch.full_like(x0, mask_id), x0)
        if cache is None:
            h = model(xt, mask="full", head=False).last
        else:
            h = model(xt, pos=torch.arange(T, device=dev), cache=cache, mask=noisy_mask, write=False, head=False).last
        if shift:
            h = shifted(h)
        ce = torch.zeros(B, T, device=dev, dtype=torch.float64)
        ce[masked] = F.cross_entropy(masked_logits(model, h[masked], mask_id), x0[masked], reduction="none").double()
        out[s] = (ce * (free[:, blk] / l[:, blk].clamp(min=1))).sum(1)
    return out


def shifted(h: Tensor) -> Tensor:
    """Outputs (B, T, ...) realigned for a shifted model: row i holds the output at i - 1 (row 0 its own)."""
    return torch.cat([h[:, :1], h[:, :-1]], 1)


def check_bound(ck) -> None:
    """The likelihood bound of a shifted checkpoint reads the output one position earlier (Dream: whole windows);
    with blocks (Fast-dLLM v2) a block's first token would be read across the block boundary, which its training
    and its decoding do differently: refused rather than scored one way or the other."""
    if ck.config.get("shift") and ck.block_size:
        raise DlmError(f"{ck.path}: the likelihood bound of a shifted block model ({ck.config.get('family', 'shift')}) "
                       "is not implemented (generation is)")
    if ck.mask_id is None:
        raise DlmError(f"{ck.path}: the tokenizer has no <mask> token")


def mdlm_eval(model, ck, corpus, split: str, seq_len: int, batch_size: int, max_batches: int | None, seed: int,
              samples: int) -> dict[str, Any]:
    """`dlm eval` for mdlm: the ELBO perplexity bound on held-out windows (seeded, reproducible)."""
    from dlm.data.tokens import Batches, load_tokens

    check(samples > 0, f"--samples must be > 0, got {samples}")
    check_bound(ck)
    tok = ck.tokenizer
    L = ck.block_size
    T = min(seq_len, model.cfg.max_seq_len)
    batches = Batches(load_tokens(corpus, tok, split), T, batch_size, where=f"{corpus.spec}, its {split} split")
    gen = torch.Generator(device=model.device)
    gen.manual_seed(seed)
    per_sample, count = torch.zeros(samples, dtype=torch.float64), 0
    for batch in batches.sequential(max_batches):
        x0 = batch[:, :-1].to(model.device)  # (B, T): the same windows as the AR number
        per_sample += elbo_nll(model, x0, L, ck.mask_id, samples, gen,
                               shift=bool(ck.config.get("shift"))).sum(1).double().cpu()
        count += x0.numel()
    per_tok = per_sample / count  # (samples,) each sample's bound in nats / token
    nll = float(per_tok.mean())
    stderr = float(per_tok.std() / math.sqrt(samples)) if samples > 1 else float("nan")
    return {"loss_bound": nll, "perplexity_bound": math.exp(nll), "loss_bound_stderr": stderr, "samples": samples,
            "block_size": L, "block_length": L, "tokens": count, "seed": seed}  # block_length: the same, under the other name
