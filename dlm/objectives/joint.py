"""Joint AR + diffusion (Nemotron-Labs-Diffusion, TiDAR): one backbone, two losses.

One forward runs [x_t ; x_0] (2T tokens, positions 0..T-1 twice) under one boolean mask
("sbd_block_diff"):

    noisy block b  -> itself (bidirectional) and the clean tokens of the blocks < b
    clean token i  -> the clean tokens <= i (causal: the AR half)

    e.g. T = 6, blocks of 3 (n = noisy, c = clean; rows are queries, 1 = may attend):

              n0 n1 n2 n3 n4 n5 | c0 c1 c2 c3 c4 c5
        n0-n2  1  1  1  .  .  . |  .  .  .  .  .  .
        n3-n5  .  .  .  1  1  1 |  1  1  1  .  .  .
        c0     .  .  .  .  .  . |  1  .  .  .  .  .
        c1     .  .  .  .  .  . |  1  1  .  .  .  .
        ...                                   (causal)

The clean half is ordinary causal attention, so its logits give the AR loss and its K/V are exactly
what an AR KV cache holds at inference; the noisy half learns p(block | clean prefix), which is what
a draft block over that cache computes. Loss = ar_weight * CE(clean half, next tokens)
+ dlm_weight * sum over masked noisy tokens of CE / t, divided by the window's tokens (MDLM's
ELBO estimate); public defaults 1.0 and 0.3. Each block has its own time t ~ U(eps, 1 - eps).

Decoding a joint checkpoint (dlm.sampling.joint): its AR mode, its diffusion mode (the mdlm samplers
with a causal context), and lossless self-speculation (linear and quadratic).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dlm.config import TrainConfig
from dlm.errors import DlmError, check
from dlm.noise import mask_corrupt
from dlm.objectives.base import ALL, Objective, share
from dlm.objectives.mdlm import block_ids, masked_logits, stratified_t

DEFAULT_BLOCK_SIZE = 16  # the public recipe trains with 64 and decodes with 32 or 16; small models use 16


def joint_mask(T: int, L: int, device: torch.device | str = "cpu") -> Tensor:
    """(2T, 2T) bool attention mask over [x_t | x_0] (True = may attend)."""
    blk = block_ids(T, L, device)
    q, k = blk[:, None], blk[None, :]
    noisy = torch.cat([q == k, q > k], dim=1)  # (T, 2T): own noisy block; clean blocks strictly before
    causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    clean = torch.cat([torch.zeros(T, T, dtype=torch.bool, device=device), causal], dim=1)  # the AR half
    return torch.cat([noisy, clean], dim=0)


def block_size_of(cfg: TrainConfig) -> int:
    return DEFAULT_BLOCK_SIZE if cfg.block_size is None else cfg.block_size


class Joint(Objective):
    name = "joint"

    def __init__(self, cfg, tokenizer):
        super().__init__(cfg, tokenizer)
        check(tokenizer.mask_id is not None, f"--objective joint: the tokenizer {tokenizer.source} has no <mask> token")
        self.mask_id = tokenizer.mask_id
        self.block_size = block_size_of(cfg)

    @classmethod
    def check_config(cls, cfg: TrainConfig) -> None:
        B = block_size_of(cfg)
        check(B >= 2, f"--block-size must be >= 2, got {B}")
        if cfg.seq_len % B:
            raise DlmError(f"--block-size must divide --seq-len ({cfg.seq_len}), got {B}")
        check(cfg.ar_weight >= 0, f"--ar-weight must be >= 0, got {cfg.ar_weight}")
        check(cfg.dlm_weight >= 0, f"--dlm-weight must be >= 0, got {cfg.dlm_weight}")
        check(cfg.ar_weight + cfg.dlm_weight > 0, "--ar-weight and --dlm-weight cannot both be 0")

    def loss(self, model: nn.Module, batch: Tensor, gen: torch.Generator, rows: slice = ALL,
             sup: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
        x0, y = batch[:, :-1], batch[:, 1:]  # (B, T)
        B, T = x0.shape
        L = self.block_size
        nb = T // L
        t = stratified_t(B * nb, gen, x0.device).view(B, nb)  # one time per block, stratified over the batch
        t_tok = t.repeat_interleave(L, dim=1)  # (B, T)
        ans = self.answers(batch, sup)  # responses of a prompted corpus: the only targets and noised tokens
        xt, masked = mask_corrupt(x0, t_tok, self.mask_id, gen, corruptible=None if ans is None else ans[:, :T])
        n_diff = (B * T if ans is None else max(1, int(ans[:, :T].sum()))) / share(batch, rows)
        n_ar = (B * T if ans is None else max(1, int(ans[:, 1:].sum()))) / share(batch, rows)
        x0, y, xt, masked, t_tok = x0[rows], y[rows], xt[rows], masked[rows], t_tok[rows]  # (b, T): this slice
        pos = torch.arange(T, device=x0.device).repeat(2)  # (2T,) both halves at positions 0..T-1
        out = model(torch.cat([xt, x0], dim=1), pos=pos, mask=joint_mask(T, L, x0.device), head=False)
        h_noisy, h_clean = out.last[:, :T], out.last[:, T:]
        if ans is None:
            ar = F.cross_entropy(model.lm_head(h_clean).flatten(0, 1).float(), y.flatten(), reduction="sum") / n_ar
        else:
            keep = ans[rows, 1:]
            ar = F.cross_entropy(model.lm_head(h_clean[keep]).float(), y[keep], reduction="sum") / n_ar
        logits = masked_logits(model, h_noisy[masked], self.mask_id)  # (N, V)
        ce = F.cross_entropy(logits, x0[masked], reduction="none")  # (N,)
        diff = (ce / t_tok[masked]).sum() / n_diff
        loss = self.cfg.ar_weight * ar + self.cfg.dlm_weight * diff
        n = int(masked.sum())
        return loss, {"ar_loss": float(ar.detach()), "dlm_loss": float(diff.detach()),
                      "ce_masked": float(ce.detach().mean()) if n else 0.0}

    def meta(self) -> dict[str, Any]:
        return {"block_size": self.block_size, "mask_id": self.mask_id, "ar_weight": self.cfg.ar_weight,
                "dlm_weight": self.cfg.dlm_weight}
