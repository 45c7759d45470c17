"""The DFlash training objective: anchors, the multi-block mask and the slot-weighted loss.

The drafter itself (the model) is dlm.drafter. Training: the frozen target runs over a window of
its own generations (`dlm distill`), anchors are drawn at random positions, each anchor starts a
block whose labels are the next B-1 tokens, and all blocks of a window are trained in one forward
under a mask where a block sees the context strictly before its anchor and itself
(`dlm.masks.dflash_train_mask`). The loss at slot k is weighted exp(-(k-1)/gamma_w), normalised.

--distill-logits: the loss at a slot is the soft cross-entropy against the target's softmax at the same
position (self logit distillation), not the hard next token.

DFlash 2 (--conv-kernel-size, --selector-rank): the drafter's convolutions start as the identity and the
selector's successor codebook at zero, so `--init-from` a DFlash 1 drafter starts as exactly that drafter.
The selector adds w x the cross-entropy of the gold token among each slot's top-k candidates, scored
after the gold token before it (teacher forcing), slots whose gold token is not a candidate dropped,
with the same slot weights; w rises linearly over --selector-ramp of the run. --selector-soft: the selector's
target is the target's softmax over the candidates instead (acceptance at temperature 1 is sum min(p, q)).
--draft-layers above an --init-from drafter's grows it by depth: the new layers start adding nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dlm.checkpoint import load_model, load_weights, open_checkpoint
from dlm.config import ModelConfig, TrainConfig, block_size_of, plain_layers
from dlm.drafter import (
    INJECTIONS, CandidateSelector, DFlashDrafter, check_target, default_draft_layers, default_features, mask_token_id,
    target_fingerprint, target_layer_ids,
)
from dlm.errors import DlmError, check
from dlm.masks import dflash_train_mask
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


def selector_terms(selector: CandidateSelector, h: Tensor, logits: Tensor, anchor: Tensor,
                   labels: Tensor, teacher: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The selector's training term, teacher-forced: slots' hidden states h (..., S, D), draft logits (..., S, V),
    the anchor tokens (...,) and the gold tokens (..., S) -> the cross-entropy of the gold token among the slot's
    top-k candidates, scored after the gold token before it (0 where the gold is not a candidate), whether it is a
    candidate, and whether the selector picks it (the greedy path, as long as it follows the gold). Each (..., S).
    teacher (..., S, V): the target's logits at each slot; the cross-entropy is then against its softmax over the
    candidates, renormalised (--selector-soft), at every slot."""
    unary, cands = torch.topk(logits, min(selector.top_k, logits.shape[-1]), dim=-1)
    prev = torch.cat((anchor[..., None], labels[..., :-1]), dim=-1)
    k = cands.shape[-1]
    score = selector.scores(h.reshape(-1, h.shape[-1]), unary.reshape(-1, k), cands.reshape(-1, k),
                            prev.reshape(-1)).float()
    gold = cands.reshape(-1, k) == labels.reshape(-1, 1)
    is_cand = gold.any(-1)
    idx = gold.int().argmax(-1)
    if teacher is None:
        ce = F.cross_entropy(score, idx, reduction="none") * is_cand
    else:  # p over the candidates: the softmax of the teacher's logits gathered there
        soft = torch.softmax(teacher.float().gather(-1, cands).reshape(-1, k), -1)
        ce = -(soft * torch.log_softmax(score, -1)).sum(-1)
    picked = (score.argmax(-1) == idx) & is_cand
    return ce.view(labels.shape), is_cand.view(labels.shape), picked.view(labels.shape)


def soft_cross_entropy(logits: Tensor, teacher_logits: Tensor) -> Tensor:
    """-sum_v softmax(teacher)_v log softmax(logits)_v over the last dimension."""
    return -(torch.softmax(teacher_logits.float(), -1) * torch.log_softmax(logits.float(), -1)).sum(-1)


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
        for f in ("conv_kernel_size", "selector_rank"):
            check(getattr(cfg, f, 0) >= 0, f"--{f.replace('_', '-')} must be >= 0 (0 = off), got {getattr(cfg, f)}")
        check(getattr(cfg, "conv_group_size", 16) >= 1, f"--conv-group-size must be >= 1, got {cfg.conv_group_size}")
        k = getattr(cfg, "selector_top_k", None)
        check(k is None or k >= 1, f"--selector-top-k must be >= 1, got {k}")
        check(getattr(cfg, "selector_weight", 1.0) >= 0, f"--selector-weight must be >= 0, got {cfg.selector_weight}")
        check(0 <= getattr(cfg, "selector_ramp", 0.0) <= 1, f"--selector-ramp must be in [0, 1], got {cfg.selector_ramp}")
        check(not getattr(cfg, "selector_soft", False) or getattr(cfg, "distill_logits", False),
              "--selector-soft needs --distill-logits (its targets are the target's softmax at each slot)")
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
        g = lambda name, default: getattr(self.cfg, name, default)  # noqa: E731 (duck-typed configs)
        dflash2 = dict(conv_kernel_size=g("conv_kernel_size", 0), conv_group_size=g("conv_group_size", 16),
                       selector_rank=g("selector_rank", 0), selector_top_k=g("selector_top_k", None) or 16)
        ck, d, kw = None, {}, {}
        # plain draft layers at the target's width (a Gemma 4 target's too, as public Gemma 4 drafters are), reading
        # the block through the target's embedding scale and writing logits through its soft-cap
        mc = ModelConfig(**{**tc.to_dict(), "n_layers": self.n_layers, "qk_norm": True, "self_cond": False,
                            "tie_embeddings": False, "moe": None, **plain_layers()})
        kw = dict(input_embedding_scale=float(tc.embed_scale), logit_softcap=tc.logit_softcap or None)
        if self.cfg.init_from:  # warm start: continue a drafter (longer, on more data), or grow DFlash 1 into DFlash 2
            ck = open_checkpoint(self.cfg.init_from, "--init-from")
            if ck.objective != "dflash":
                raise DlmError(f"--init-from {ck.path}: a dflash run starts from a dflash drafter, "
                               f"not from objective {ck.objective!r}")
            d = ck.config["dflash"]
            check_target(d, self.target, self.target_ck.tokenizer.sha256, str(ck.path))
            # (the block size may change: no weight depends on it, and a drafter decodes at any block)
            if (d["target_layer_ids"], d.get("injection", "kv")) != (self.layer_ids, self.cfg.injection):
                raise DlmError(f"--init-from {ck.path}: target layers {d['target_layer_ids']}, injection "
                               f"{d.get('injection', 'kv')!r}; this run has {self.layer_ids}, {self.cfg.injection!r}")
            for name, default in (("conv_kernel_size", 0), ("selector_rank", 0)):
                had = d.get(name, default)
                grown = name == "selector_rank" and had < dflash2[name]  # a wider selector: see the loading below
                if had and had != dflash2[name] and not grown:
                    raise DlmError(f"--init-from {ck.path}: a DFlash 2 drafter with {name} {had}; this run has "
                                   f"--{name.replace('_', '-')} {dflash2[name]} (give the drafter's own to continue "
                                   f"it, or a larger --selector-rank to widen its selector)")
            if d.get("conv_kernel_size", 0) and d.get("conv_group_size", 16) != dflash2["conv_group_size"]:
                raise DlmError(f"--init-from {ck.path}: conv_group_size {d.get('conv_group_size', 16)}; this run has "
                               f"--conv-group-size {dflash2['conv_group_size']}")
            if g("selector_top_k", None) is None:  # the drafter's own candidates, unless the run gives others
                dflash2["selector_top_k"] = d.get("selector_top_k", 16)
            # the drafter's own shape and numerics (an imported public drafter keeps its scales and soft-cap)
            mc = ModelConfig.from_dict({**ck.config["model"], "max_seq_len": max(ck.config["model"].get(
                "max_seq_len", 0), self.cfg.seq_len)})
            had_layers = mc.n_layers
            if self.cfg.draft_layers and self.cfg.draft_layers < mc.n_layers:
                raise DlmError(f"--init-from {ck.path}: a drafter of {mc.n_layers} layers; this run has "
                               f"--draft-layers {self.cfg.draft_layers} (give its own to continue it, or more to "
                               "grow it)")
            if self.cfg.draft_layers > mc.n_layers:  # grown by depth: see the loading below
                mc = ModelConfig.from_dict({**mc.to_dict(), "n_layers": self.cfg.draft_layers})
            kw = dict(last_layer=d.get("last_layer", "prenorm"),
                      input_embedding_scale=d.get("input_embedding_scale", 1.0),
                      output_multiplier=d.get("output_multiplier", 1.0),
                      logit_softcap=d.get("final_logit_softcapping"))
        noise = getattr(self.cfg, "block_noise", "mask")
        if ck is not None and d.get("block_noise", "mask") != noise and noise == "mask":
            noise = d.get("block_noise", "mask")  # continuing a uniform drafter keeps its noise
        model = DFlashDrafter(mc, self.layer_ids, self.block_size, self.mask_id, self.cfg.injection,
                              self.cfg.target_features, **kw, **dflash2, block_noise=noise)
        if ck is None:
            with torch.no_grad():  # the drafter's output feeds the target's head: start at the target's scale
                model.norm.weight.copy_(self.target.norm.weight)
        else:
            tensors = ck.tensors()
            # DFlash 1 -> 2: the parts the checkpoint lacks keep their start (identity convolutions, the selector
            # with a zero successor codebook): the drafter computes what the checkpoint's did
            fresh = model.state_dict()
            tensors.update({k: v for k, v in fresh.items()
                            if k not in tensors and ("_conv." in k or k.startswith("candidate_selector."))})
            # grown by depth: the layers after the checkpoint's start with their output projections at zero, each
            # adding nothing to the residual stream, so the grown drafter computes what the checkpoint's did
            for k, v in fresh.items():
                if k.startswith("layers.") and int(k.split(".")[1]) >= had_layers and k not in tensors:
                    zero = k.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight"))
                    tensors[k] = torch.zeros_like(v) if zero else v
            # a selector widened from rank r to R: the new predecessor codes and projection rows keep their random
            # start, the new successor codes their zeros, so the extra terms add nothing until trained
            for k, v in fresh.items():
                if k.startswith("candidate_selector.") and tensors[k].shape != v.shape:
                    old_t, grown_t = tensors[k], v.clone()
                    grown_t[tuple(slice(0, n) for n in old_t.shape)] = old_t.to(v.dtype)
                    tensors[k] = grown_t
            load_weights(model, tensors, ck.path / "model.safetensors")
        self.numerics = {"last_layer": model.last_layer, **model.numerics()}
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
        distill = getattr(self.cfg, "distill_logits", False)
        idx = anchors[:, :, None] + torch.arange(g, device=dev)  # (B, A, g) positions of each block
        with torch.no_grad():  # the frozen target's features, once per batch, without gradient
            taps: dict[int, Tensor] = {}
            if distill:  # the whole target: its next-token logits at each slot's position are the soft labels
                out = tgt(batch, taps=model.taps, head=False)
                taps = out.taps
                teacher = tgt.head(out.last.gather(1, idx[:, :, :-1].reshape(B, -1, 1).expand(
                    -1, -1, out.last.shape[-1]))).float().view(B, A, g - 1, -1)
            elif model.target_features:  # only as deep as the deepest tap
                _, taps = run_blocks(tgt.layers[:max(model.layer_ids) + 1], tgt.freqs, tgt.embed(batch),
                                     taps=model.layer_ids, rope_scaling=tgt.cfg.rope_scaling)
            feats = model.features(tgt, batch, taps)  # (B, T1, F)
        ctx = model.context(feats)  # (B, T1, D)
        block = torch.full((B, A, g), model.mask_id, dtype=torch.long, device=dev)
        block[:, :, 0] = batch.gather(1, anchors)
        labels = batch.gather(1, idx[:, :, 1:].reshape(B, -1)).view(B, A, g - 1)
        if model.block_noise == "uniform":  # slots: the true token, or with probability t a uniform random one
            t = 1.0 - torch.rand(B, A, 1, generator=gen, device=dev)  # (0, 1]: t = 1 is the first draft pass
            noisy = torch.rand(B, A, g - 1, generator=gen, device=dev) < t
            rand = torch.randint(0, model.cfg.vocab_size, (B, A, g - 1), generator=gen, device=dev)
            block[:, :, 1:] = torch.where(noisy, rand, labels)
        with torch.no_grad():
            x = model.embed(tgt, block.view(B, A * g))  # (B, A*g, D)
        mask = dflash_train_mask(anchors, T1, g, causal_ctx=model.injection == "input")
        h = model(x, ctx, pos=idx.view(B, A * g), ctx_pos=torch.arange(T1, device=dev), mask=mask, segment=g)
        h = h.view(B, A, g, -1)[:, :, 1:]  # (B, A, g-1, D): slot 0 is the anchor, unsupervised
        logits = model.head(tgt, h).float()  # (B, A, g-1, V)
        if distill:
            ce = soft_cross_entropy(logits, teacher)
        else:
            ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view(B, A, g - 1)
        w = slot_weights(g, dev)
        loss = (ce * w * keep).sum() / n_blocks
        extra: dict[str, float] = {}
        sel = model.candidate_selector
        if sel is not None:
            soft = getattr(self.cfg, "selector_soft", False)
            sce, is_cand, picked = selector_terms(sel, h, logits, block[:, :, 0], labels, teacher if soft else None)
            loss = loss + self.selector_weight() * (sce * w * keep).sum() / n_blocks
            kept = keep.sum().clamp(min=1)
            counted = keep if soft else is_cand & keep
            extra = {"selector_ce": float((sce.detach() * keep).sum() / counted.sum().clamp(min=1)),
                     "gold_in_top_k": float((is_cand & keep).sum() / kept)}
        with torch.no_grad():
            hit = (picked if sel is not None else logits.argmax(-1) == labels) & keep  # (B, A, g-1)
            accepted = hit.int().cumprod(-1).sum(-1).float()[keep[:, :, 0]]  # greedy acceptance of each block
            first = hit[:, :, 0][keep[:, :, 0]].float()
        return loss, {"acc_slot1": float(first.mean()) if first.numel() else 0.0,
                      "tau_train": 1.0 + (float(accepted.mean()) if accepted.numel() else 0.0), **extra}

    def selector_weight(self) -> float:
        """w at this step: --selector-weight, reached linearly over the first --selector-ramp share of the run."""
        full = getattr(self.cfg, "selector_weight", 1.0)
        ramp = getattr(self.cfg, "selector_ramp", 0.0) * self.cfg.max_steps
        return full if ramp <= 0 else full * min(1.0, self.step / ramp)

    def meta(self) -> dict[str, Any]:
        tc = self.target.cfg
        return {"dflash": {
            "target_layer_ids": self.layer_ids, "block_size": self.block_size, "mask_token_id": self.mask_id,
            "injection": self.cfg.injection, "target_features": self.cfg.target_features,
            "last_layer": "normed",  # the target's last layer after its final norm, as public engines feed it
            **getattr(self, "numerics", {}),  # a warm start keeps its drafter's reading and numerics; DFlash 2's parts
            "gamma_w": gamma_w(self.block_size),
            # the target by its folder's name: a checkpoint records no path of the machine it was trained on
            # (the target is given again at inference, and checked by its shapes, tokenizer and fingerprint)
            "target": {"name": Path(self.cfg.target).resolve().name, "model": tc.to_dict(),
                       "tokenizer_sha256": self.target_ck.tokenizer.sha256,
                       "fingerprint": target_fingerprint(self.target)},
        }}
