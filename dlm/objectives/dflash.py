"""The DFlash training objective: anchors, the multi-block mask and the slot-weighted loss.

The drafter itself (the model) is dlm.drafter. Training: the frozen target runs over a window of
its own generations (`dlm distill`), anchors are drawn at random positions, each anchor starts a
block whose labels are the next B-1 tokens, and all blocks of a window are trained in one forward
under a mask where a block sees the context strictly before its anchor and itself
(`multi_block_mask`). The loss at slot k is weighted exp(-(k-1)/gamma_w), normalised.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dlm.checkpoint import load_model, load_weights, open_checkpoint
from dlm.config import ModelConfig, TrainConfig, block_size_of
from dlm.drafter import (
    INJECTIONS, DFlashDrafter, check_target, default_draft_layers, default_features, mask_token_id,
    target_fingerprint, target_layer_ids,
)
from dlm.errors import DlmError, check
from dlm.model import run_blocks
from dlm.objectives.base import ALL, Objective, share

GAMMA_W = {16: 7.0, 10: 5.0, 8: 4.0}  # loss decay of the paper, per block size


def gamma_w(block_size: int) -> float:
    """Decay of the slot weights: 7 for blocks of 16, 5 for 10, 4 for 8 (the paper); ~0.45*B otherwise."""
    return GAMMA_W.get(block_size, max(1.0, 0.45 * block_size))


def slot_weights(block_size: int, device: torch.device | str = "cpu") -> Tensor:
    """Loss weights of slots 1 .. B-1: exp(-(k-1)/gamma_w), normalised to sum 1. (B-1,)"""
    k = torch.arange(1, block_size, dtype=torch.float32, device=device)
    w = torch.exp(-(k - 1) / gamma_w(block_size))
    return w / w.sum()


def multi_block_mask(anchors: Tensor, n_ctx: int, block_size: int, causal_ctx: bool = False) -> Tensor:
    """Attention mask of many blocks trained in one forward.

    anchors (B, A): each block's first position. Keys are [ctx (n_ctx) ; blocks (A*block_size)].
    A block's queries see the context strictly before its anchor and the block itself, no other
    block. With causal_ctx (input-only injection) the context positions are queries too, causal
    among themselves, and come first. Returns bool (B, 1, Q, n_ctx + A*block_size).
    """
    B, A = anchors.shape
    dev = anchors.device
    which = torch.arange(A, device=dev).repeat_interleave(block_size)  # (A*g,) block of each slot
    ctx_ok = torch.arange(n_ctx, device=dev)[None, None, :] < anchors.repeat_interleave(block_size, 1)[:, :, None]
    own = (which[:, None] == which[None, :]).expand(B, -1, -1)  # (B, A*g, A*g)
    rows = torch.cat((ctx_ok, own), dim=-1)  # (B, A*g, C + A*g)
    if causal_ctx:
        causal = torch.ones(n_ctx, n_ctx, dtype=torch.bool, device=dev).tril()
        ctx_rows = torch.cat((causal, torch.zeros(n_ctx, A * block_size, dtype=torch.bool, device=dev)), dim=-1)
        rows = torch.cat((ctx_rows.expand(B, -1, -1), rows), dim=1)
    return rows[:, None]


# the objective ------------------------------------------------------------------------------------

class DFlash(Objective):
    """Train a DFlash drafter against a frozen AR target (`--target DIR`)."""

    name = "dflash"

    @classmethod
    def check_config(cls, cfg: TrainConfig) -> None:
        check(bool(cfg.target), "--objective dflash needs --target AR_CHECKPOINT (the model to speed up)")
        B = block_size_of(cfg)
        check(B >= 2, f"--block-size must be >= 2, got {B}")
        check(B <= cfg.seq_len + 1, f"--block-size {B} exceeds --seq-len + 1 ({cfg.seq_len + 1})")
        check(cfg.injection in INJECTIONS, f"--injection must be one of {list(INJECTIONS)}, got {cfg.injection!r}")
        check(cfg.draft_layers >= 0, f"--draft-layers must be >= 0 (0 = default), got {cfg.draft_layers}")
        check(cfg.anchors >= 0, f"--anchors must be >= 0 (0 = default), got {cfg.anchors}")
        tck = open_checkpoint(cfg.target, "--target")
        if tck.objective != "ar":
            raise DlmError(f"--target {cfg.target}: a DFlash target must be an AR checkpoint, "
                           f"got objective {tck.objective!r}")
        N = tck.model_config.n_layers
        ids = [int(i) for i in cfg.target_layers]
        check(len(ids) <= N, f"--target-layers: {len(ids)} layers requested, the target is too shallow ({N} layers)")
        for i in ids:
            check(0 <= i < N, f"--target-layers: layer {i} is outside the target's layers 0 .. {N - 1} (too shallow)")
        check(len(set(ids)) == len(ids), f"--target-layers must be distinct, got {ids}")

    def __init__(self, cfg, tokenizer):
        super().__init__(cfg, tokenizer)
        target, tck = load_model(cfg.target, option="--target")
        if tck.tokenizer.sha256 != tokenizer.sha256:
            raise DlmError(f"--tokenizer does not match the target's ({cfg.target}/tokenizer.json); "
                           "leave --tokenizer unset to use the target's")
        self.target = target.requires_grad_(False)
        self.target_ck = tck
        N = target.cfg.n_layers
        self.layer_ids = [int(i) for i in cfg.target_layers] or target_layer_ids(N, default_features(N))
        self.mask_id = mask_token_id(tck.tokenizer, target.cfg.vocab_size)
        self.n_layers = cfg.draft_layers or default_draft_layers(N)
        self.block_size = block_size_of(cfg)

    def build_model(self) -> DFlashDrafter:
        tc = self.target.cfg
        mc = ModelConfig(**{**tc.to_dict(), "n_layers": self.n_layers, "qk_norm": True, "self_cond": False,
                            "tie_embeddings": False})
        model = DFlashDrafter(mc, self.layer_ids, self.block_size, self.mask_id, self.cfg.injection,
                              self.cfg.target_features)
        with torch.no_grad():  # the drafter's output feeds the target's head: start at the target's scale
            model.norm.weight.copy_(self.target.norm.weight)
        if self.cfg.init_from:  # warm start: continue a drafter of the same shape (e.g. longer, or on more data)
            ck = open_checkpoint(self.cfg.init_from, "--init-from")
            if ck.objective != "dflash":
                raise DlmError(f"--init-from {ck.path}: a dflash run starts from a dflash drafter, "
                               f"not from objective {ck.objective!r}")
            d = ck.config["dflash"]
            check_target(d, self.target, self.target_ck.tokenizer.sha256, str(ck.path))
            if (d["target_layer_ids"], d["block_size"], d["injection"]) != (self.layer_ids, self.block_size,
                                                                              self.cfg.injection):
                raise DlmError(f"--init-from {ck.path}: target layers {d['target_layer_ids']}, block size "
                               f"{d['block_size']}, injection {d['injection']!r}; this run has {self.layer_ids}, "
                               f"{self.block_size}, {self.cfg.injection!r}")
            load_weights(model, ck.tensors(), ck.path / "model.safetensors")
        return model

    def trainable(self, model: nn.Module) -> list[nn.Parameter]:
        return list(model.parameters())  # the target lives here, not in the drafter

    def anchors_per_window(self, T1: int) -> int:
        """--anchors, or the paper's coverage: 512 blocks of 16 per 3072 tokens, each position in ~2.7 blocks."""
        n_pos = T1 - self.block_size + 1
        return max(1, min(n_pos, self.cfg.anchors or round(T1 * 8 / (3 * self.block_size))))

    def loss(self, model: DFlashDrafter, batch: Tensor, gen: torch.Generator, rows: slice = ALL,
             sup: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
        tgt = self.target
        if tgt.device != batch.device:
            tgt.to(batch.device)
        B, T1 = batch.shape
        g = self.block_size
        dev = batch.device
        A = self.anchors_per_window(T1)
        n_pos = T1 - g + 1
        score = torch.rand(B, n_pos, generator=gen, device=dev)
        if sup is not None:  # responses only (SpecForge): a block's first label is a response token
            score = score.masked_fill(~sup[:, 1:n_pos + 1], 2.0)  # other anchors are drawn last, and dropped
        anchors = score.argsort(dim=1)[:, :A].sort(dim=1).values  # (B, A)
        if sup is None:
            keep = torch.ones(B, A, g - 1, dtype=torch.bool, device=dev)
        else:  # a block's slots up to its first label that is not a response (the next document's prompt)
            lab = sup.gather(1, (anchors[:, :, None] + torch.arange(1, g, device=dev)).view(B, -1)).view(B, A, g - 1)
            keep = lab.int().cumprod(-1).bool()
        n_blocks = max(1, int(keep[:, :, 0].sum())) / share(batch, rows)  # the batch's blocks, as this slice's share
        batch, anchors, keep = batch[rows], anchors[rows], keep[rows]  # this slice's rows: the target runs over them
        B = batch.shape[0]
        with torch.no_grad():  # the frozen target's features, once per batch, without gradient
            taps: dict[int, Tensor] = {}
            if model.target_features:  # only as deep as the deepest tap
                x = tgt.embed_tokens(batch)
                _, taps = run_blocks(tgt.layers[:max(model.layer_ids) + 1], tgt.inv_freq, x, taps=model.layer_ids)
            feats = model.features(tgt, batch, taps)  # (B, T1, F)
        ctx = model.context(feats)  # (B, T1, D)
        idx = anchors[:, :, None] + torch.arange(g, device=dev)  # (B, A, g) positions of each block
        block = torch.full((B, A, g), model.mask_id, dtype=torch.long, device=dev)
        block[:, :, 0] = batch.gather(1, anchors)
        labels = batch.gather(1, idx[:, :, 1:].reshape(B, -1)).view(B, A, g - 1)
        with torch.no_grad():
            x = tgt.embed_tokens(block.view(B, A * g))  # (B, A*g, D)
        mask = multi_block_mask(anchors, T1, g, causal_ctx=model.injection == "input")
        h = model(x, ctx, pos=idx.view(B, A * g), ctx_pos=torch.arange(T1, device=dev), mask=mask)
        h = h.view(B, A, g, -1)[:, :, 1:]  # (B, A, g-1, D): slot 0 is the anchor, unsupervised
        logits = tgt.lm_head(h).float()  # (B, A, g-1, V)
        ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(B, A, g - 1)
        w = slot_weights(g, dev)
        loss = (ce * w * keep).sum() / n_blocks
        with torch.no_grad():
            hit = (logits.argmax(-1) == labels) & keep  # (B, A, g-1)
            accepted = hit.int().cumprod(-1).sum(-1).float()[keep[:, :, 0]]  # greedy acceptance of each block
            first = hit[:, :, 0][keep[:, :, 0]].float()
        return loss, {"acc_slot1": float(first.mean()) if first.numel() else 0.0,
                      "tau_train": 1.0 + (float(accepted.mean()) if accepted.numel() else 0.0)}

    def meta(self) -> dict[str, Any]:
        tc = self.target.cfg
        return {"dflash": {
            "target_layer_ids": self.layer_ids, "block_size": self.block_size, "mask_token_id": self.mask_id,
            "injection": self.cfg.injection, "target_features": self.cfg.target_features,
            "last_layer": "normed",  # the target's last layer after its final norm, as public engines feed it
            "gamma_w": gamma_w(self.block_size),
            # the target by its folder's name: a checkpoint records no path of the machine it was trained on
            # (the target is given again at inference, and checked by its shapes, tokenizer and fingerprint)
            "target": {"name": Path(self.cfg.target).resolve().name, "model": tc.to_dict(),
                       "tokenizer_sha256": self.target_ck.tokenizer.sha256,
                       "fingerprint": target_fingerprint(self.target)},
        }}
