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

Two additions for self-speculation (off by default, so the default run is the public recipe):
--dlm-data reads a second corpus side by side (batches (B, 2, T + 1)): the AR loss keeps reading the
corpus, through a plain causal forward, while the diffusion loss reads e.g. the AR mode's own greedy
continuations, so the drafts learn what the verifier accepts without the AR mode learning from its own
samples. --draft-rate p noises a share p of the blocks as a draft sees its block: the first token kept,
every other token masked (t = 1); with --draft-ar-first the kept token of those blocks attends causally (the
clean prefix and itself), as `self-spec-linear-ar` decodes: its first slot is the AR logit of the kept token and
the masks read that token's causal states. --ar-target a makes the target of a masked token (1 - a) x the data token
+ a x the AR half's own next-token distribution at that position (from the same forward, detached): a draft
slot sees the prefix its AR verifier sees (the first slot exactly), so the AR mode is the teacher of what it
will accept, in full distribution rather than one sampled token.

Decoding a joint checkpoint (dlm.sampling.joint): its AR mode, its diffusion mode (the mdlm samplers
with a causal context), and lossless self-speculation (linear and quadratic).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dlm.config import TrainConfig, block_size_of
from dlm.errors import DlmError, check
from dlm.masks import joint_train_mask
from dlm.noise import mask_corrupt
from dlm.objectives.base import ALL, Objective, share
from dlm.objectives.mdlm import masked_logits, stratified_t


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
        check(0 <= cfg.draft_rate <= 1, f"--draft-rate must be in [0, 1], got {cfg.draft_rate}")
        check(0 <= cfg.ar_target <= 1, f"--ar-target must be in [0, 1], got {cfg.ar_target}")
        check(not cfg.draft_ar_first or cfg.draft_rate > 0,
              "--draft-ar-first changes how the draft-form blocks attend: it needs --draft-rate > 0")

    def loss(self, model: nn.Module, batch: Tensor, gen: torch.Generator, rows: slice = ALL,
             sup: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
        if batch.dim() == 3:  # (B, 2, T + 1) with --dlm-data: the AR loss reads [:, 0], the diffusion loss [:, 1]
            s0, s1 = (None, None) if sup is None else (sup[:, 0], sup[:, 1])
            ar = self.ar_loss(model, batch[:, 0], rows, s0)
            _, diff, ce = self.joint_losses(model, batch[:, 1], gen, rows, s1, with_ar=False)
        else:
            ar, diff, ce = self.joint_losses(model, batch, gen, rows, sup)
        loss = self.cfg.ar_weight * ar + self.cfg.dlm_weight * diff
        return loss, {"ar_loss": float(ar.detach()), "dlm_loss": float(diff.detach()), "ce_masked": ce}

    def noise(self, x0: Tensor, gen: torch.Generator,
              ans: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """(x_t, masked, t per token, draft-form blocks (B, T // L) or None) for windows x0 (B, T): one time per
        block, stratified over the batch; with --draft-rate, that share of the blocks is noised as a
        self-speculation draft sees its block: the first token kept, every other token masked (t = 1)."""
        B, T = x0.shape
        L = self.block_size
        nb = T // L
        t = stratified_t(B * nb, gen, x0.device).view(B, nb)
        t_tok = t.repeat_interleave(L, dim=1)  # (B, T)
        draft = None
        if self.cfg.draft_rate > 0:
            draft = torch.rand(B, nb, generator=gen, device=x0.device) < self.cfg.draft_rate
            first = (torch.arange(T, device=x0.device) % L == 0).expand(B, T)
            t_tok = torch.where(draft.repeat_interleave(L, 1), torch.where(first, 0.0, 1.0), t_tok)
        xt, masked = mask_corrupt(x0, t_tok, self.mask_id, gen, corruptible=ans)
        return xt, masked, t_tok, draft

    def joint_forward(self, model: nn.Module, xt: Tensor, x0: Tensor,
                      draft: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Final hidden states of the noisy and the clean half of [x_t | x_0] under the joint mask; with
        --draft-ar-first, the kept token of each draft-form block (draft (B, T // L)) attends causally."""
        B, T = x0.shape
        L = self.block_size
        ar_first = self.cfg.draft_ar_first and draft is not None and bool(draft.any())
        mask = joint_train_mask(T, L, x0.device, draft=draft if ar_first else None)
        pos = torch.arange(T, device=x0.device).repeat(2)  # (2T,) both halves at positions 0..T-1
        out = model(torch.cat([xt, x0], dim=1), pos=pos, mask=mask, head=False)
        return out.last[:, :T], out.last[:, T:]

    def masked_ce(self, model: nn.Module, h_noisy: Tensor, x0: Tensor, masked: Tensor, t_tok: Tensor,
                  n: float, h_clean: Tensor | None = None) -> tuple[Tensor, float]:
        """Sum over masked tokens of CE / t, over n; with --ar-target, the CE against the mixed target (the data
        token and the AR half's distribution at the clean position before: the one that predicts it). The
        reported mean CE is always the data token's."""
        logits = masked_logits(model, h_noisy[masked], self.mask_id)  # (N, V)
        ce = F.cross_entropy(logits, x0[masked], reduction="none")  # (N,)
        loss = ce
        a = self.cfg.ar_target
        if a > 0 and h_clean is not None:
            teach = masked.clone()
            teach[:, 0] = False  # position 0 has no AR prediction: the data token alone
            sel = teach[masked]  # (N,) which masked tokens have a teacher
            prev = torch.roll(teach, -1, dims=1)  # the clean position before each taught token
            with torch.no_grad():
                p_ar = F.softmax(model.head(h_clean[prev]).float(), dim=-1)  # (M, V)
                p_ar[:, self.mask_id] = 0.0  # the draft never predicts <mask>
                p_ar = p_ar / p_ar.sum(-1, keepdim=True)
            logq = F.log_softmax(logits[sel], dim=-1).masked_fill(p_ar == 0, 0.0)  # no 0 x -inf at <mask>
            soft = -(p_ar * logq).sum(-1)  # (M,)
            loss = ce.clone()
            loss[sel] = (1 - a) * ce[sel] + a * soft
        return (loss / t_tok[masked]).sum() / n, float(ce.detach().mean()) if ce.numel() else 0.0

    @staticmethod
    def next_ce(model: nn.Module, h_clean: Tensor, y: Tensor, keep: Tensor | None, n: float) -> Tensor:
        if keep is None:
            return F.cross_entropy(model.head(h_clean).flatten(0, 1).float(), y.flatten(), reduction="sum") / n
        return F.cross_entropy(model.head(h_clean[keep]).float(), y[keep], reduction="sum") / n

    @staticmethod
    def count(ans: Tensor | None, n: int, batch: Tensor, rows: slice) -> float:
        """The whole batch's target count (n, or the flagged positions), scaled to this slice's share."""
        return (n if ans is None else max(1, int(ans.sum()))) / share(batch, rows)

    def joint_losses(self, model: nn.Module, batch: Tensor, gen: torch.Generator, rows: slice,
                     sup: Tensor | None, with_ar: bool = True) -> tuple[Tensor | None, Tensor, float]:
        """(AR loss or None, diffusion loss, mean masked CE) from one forward over [x_t | x_0] of the same
        windows (the public recipe); with_ar False: the diffusion loss alone (the clean half is its context)."""
        x0, y = batch[:, :-1], batch[:, 1:]  # (B, T)
        B, T = x0.shape
        ans = self.answers(batch, sup)  # responses of a prompted corpus: the only targets and noised tokens
        xt, masked, t_tok, draft = self.noise(x0, gen, None if ans is None else ans[:, :T])
        n_diff = self.count(None if ans is None else ans[:, :T], B * T, batch, rows)
        x0, y, xt, masked, t_tok = x0[rows], y[rows], xt[rows], masked[rows], t_tok[rows]  # (b, T): this slice
        h_noisy, h_clean = self.joint_forward(model, xt, x0, None if draft is None else draft[rows])
        ar = None
        if with_ar:
            n_ar = self.count(None if ans is None else ans[:, 1:], B * T, batch, rows)
            ar = self.next_ce(model, h_clean, y, None if ans is None else ans[rows, 1:], n_ar)
        diff, ce = self.masked_ce(model, h_noisy, x0, masked, t_tok, n_diff, h_clean)
        return ar, diff, ce

    def ar_loss(self, model: nn.Module, batch: Tensor, rows: slice, sup: Tensor | None) -> Tensor:
        """The AR loss alone: one causal forward over the clean windows (what the clean half computes)."""
        x0, y = batch[:, :-1], batch[:, 1:]
        ans = self.answers(batch, sup)
        n_ar = self.count(None if ans is None else ans[:, 1:], y.numel(), batch, rows)
        h = model(x0[rows], head=False).last
        return self.next_ce(model, h, y[rows], None if ans is None else ans[rows, 1:], n_ar)

    def meta(self) -> dict[str, Any]:
        return {"block_size": self.block_size, "mask_id": self.mask_id, "ar_weight": self.cfg.ar_weight,
                "dlm_weight": self.cfg.dlm_weight, "draft_rate": self.cfg.draft_rate,
                "ar_target": self.cfg.ar_target, "draft_ar_first": self.cfg.draft_ar_first,
                "dlm_data": self.cfg.dlm_data}
