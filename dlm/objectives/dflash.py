"""DFlash: a block-diffusion drafter conditioned on the target's hidden states (arXiv 2602.06036).

The drafter is a short stack of the backbone's own decoder layers at the target's width, plus
`fc` (concatenated target features -> D, bias-free) and `hidden_norm`, and a final `norm`. It has
no embedding or LM head: it reads the target's, frozen.

    target features  taps of L target layers, concatenated (C, L*D) -> fc -> hidden_norm = ctx (C, D)
    block            [last committed token, <mask> x (gamma-1)] at positions start .. start+gamma-1,
                     embedded by the target's embedding
    every layer      queries from the block only; keys/values = [ctx K/V ; block K/V], each layer
                     projecting ctx with its own k/v projections (injection "kv"); bidirectional
    output           norm(h) -> the target's lm_head: logits for slots 1 .. gamma-1 are the draft

At inference the drafter's cache holds context K/V only: each draft writes the K/V of the newly
committed positions' features and reads the block without writing it (run_blocks write=False).

Training (objective "dflash"): the target runs over a window of its own generations (`dlm distill`),
anchors are drawn at random positions, each anchor starts a block whose labels are the next gamma-1
tokens, and all blocks of a window are trained in one forward under a mask where a block sees the
context strictly before its anchor and itself (`multi_block_mask`). The loss at slot k is weighted
exp(-(k-1)/gamma_w), normalised.

Ablations: injection "input" (the context enters once, as tokens at the input, and passes through
the layers like ordinary hidden states), and target_features=False (the context is the target's
token embeddings, not its hidden states: an unconditioned block-diffusion drafter).

HF export (`export_hf`) writes the layout of the public DFlash checkpoints (z-lab/*-DFlash-b16):
architectures ["DFlashDraftModel"], model_type qwen3, `dflash_config` {target_layer_ids,
mask_token_id, block_size}, top-level block_size and num_target_layers; weights layers.N.*,
fc.weight, hidden_norm.weight, norm.weight (no embedding, no lm_head).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dlm.config import ModelConfig
from dlm.errors import DlmError, check
from dlm.model import Block, KVCache, RMSNorm, Transformer, init_weights, rope_inv_freq, run_blocks
from dlm.objectives import Objective

INJECTIONS = ("kv", "input")
DEFAULT_BLOCK_SIZE = 16
GAMMA_W = {16: 7.0, 10: 5.0, 8: 4.0}  # loss decay of the paper, per block size


# target layers ------------------------------------------------------------------------------------

def target_layer_ids(n_layers: int, n_features: int) -> list[int]:
    """Which target layers feed the drafter (0-based; the output of that decoder layer).

    DFlash: id_i = round(1 + i * (N - 4) / (L - 1)), i = 0 .. L-1, spread from layer 1 to N-3 (the
    middle layer N // 2 when L = 1); Qwen3-8B (N=36, L=5) -> [1, 9, 17, 25, 33].

    Small targets (N - 4 < L - 1, where that formula repeats layers; a 4-layer target gives
    N - 4 = 0): the L layers are spread over all of 0 .. N-1 instead, so that every feature is a
    different layer (N=4, L=4 -> [0, 1, 2, 3]; N=4, L=2 -> [0, 3]). L > N is an error.
    """
    check(n_features >= 1, f"--target-layers: need at least one target layer, got {n_features}")
    check(n_features <= n_layers,
          f"the target has {n_layers} layers: too shallow for {n_features} distinct target layers")
    if n_features == 1:
        return [n_layers // 2]
    if n_layers - 4 >= n_features - 1:
        return [int(round(1 + i * (n_layers - 4) / (n_features - 1))) for i in range(n_features)]
    return [int(round(i * (n_layers - 1) / (n_features - 1))) for i in range(n_features)]


def default_draft_layers(n_target_layers: int) -> int:
    """5 layers for deep targets (the paper's Qwen3-8B drafter); a quarter of the target when shallower."""
    return max(1, min(5, n_target_layers // 4))


def default_features(n_target_layers: int) -> int:
    """5 target layers (the paper's), or every layer of a target shallower than that."""
    return min(5, n_target_layers)


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


# the drafter --------------------------------------------------------------------------------------

class DFlashDrafter(nn.Module):
    """Decoder layers + fc + hidden_norm + norm; embedding and LM head come from the target."""

    def __init__(self, cfg: ModelConfig, layer_ids: list[int], block_size: int, mask_id: int,
                 injection: str = "kv", target_features: bool = True):
        super().__init__()
        check(injection in INJECTIONS, f"--injection must be one of {list(INJECTIONS)}, got {injection!r}")
        check(block_size >= 2, f"--block-size must be >= 2, got {block_size}")
        self.cfg = cfg
        self.layer_ids = list(layer_ids)
        self.block_size = block_size
        self.mask_id = mask_id
        self.injection = injection
        self.target_features = target_features
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        n_in = len(self.layer_ids) if target_features else 1
        self.fc = nn.Linear(n_in * cfg.dim, cfg.dim, bias=False)
        self.hidden_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        init_weights(self, cfg.n_layers)

    @property
    def taps(self) -> tuple[int, ...]:
        """Target layers whose outputs this drafter reads (none without target features)."""
        return tuple(self.layer_ids) if self.target_features else ()

    def features(self, target: Transformer, tokens: Tensor, taps: dict[int, Tensor] | None) -> Tensor:
        """The raw context feature of each position: concatenated taps, or the token embedding. (B, T, F)"""
        if self.target_features:
            return torch.cat([taps[i] for i in self.layer_ids], dim=-1)
        return target.embed_tokens(tokens)

    def context(self, feats: Tensor) -> Tensor:
        """fc + hidden_norm: one context feature per position. (B, C, F) -> (B, C, D)"""
        return self.hidden_norm(self.fc(feats))

    def forward(self, x: Tensor, ctx: Tensor | None, pos: Tensor, ctx_pos: Tensor | None,
                cache: KVCache | None = None, mask: str | Tensor = "full") -> Tensor:
        """Block embeddings x (B, T, D) -> normed hidden states (B, T, D).

        kv: ctx (B, C, D) enters every layer's K/V (and persists in `cache`; the block does not).
        input: ctx rows run through the layers ahead of the block as ordinary tokens; with a cache
        their K/V persist and the block's are cropped away. `mask` covers [cache ; ctx ; block] keys
        (for "input", queries are [ctx ; block]).
        """
        if self.injection == "kv":
            h, _ = run_blocks(self.layers, self.inv_freq, x, pos=pos, cache=cache, mask=mask, write=False,
                              ctx=ctx, ctx_pos=ctx_pos)
            return self.norm(h)
        C = 0 if ctx is None else ctx.shape[1]
        L0 = 0 if cache is None else cache.length
        if C:
            x = torch.cat((ctx, x), dim=1)
            pos = torch.cat((ctx_pos.expand(pos.shape[0], -1) if pos.dim() == 2 else ctx_pos, pos), dim=-1)
        h, _ = run_blocks(self.layers, self.inv_freq, x, pos=pos, cache=cache, mask=mask, write=True)
        if cache is not None:
            cache.crop(L0 + C)
        return self.norm(h[:, C:])

    def new_cache(self, capacity: int, dtype: torch.dtype | None = None) -> KVCache:
        p = self.fc.weight
        return KVCache(self.cfg.n_layers, 1, self.cfg.n_kv_heads, capacity, self.cfg.head_dim, p.device,
                       dtype or p.dtype)

    def draft_mask(self, cache_len: int, n_ctx: int, T: int) -> str | Tensor:
        """Inference mask: the block sees everything; for "input" the new ctx rows are causal."""
        if self.injection == "kv" or n_ctx == 0:
            return "full"
        S = cache_len + n_ctx + T
        dev = self.fc.weight.device
        q = torch.arange(n_ctx + T, device=dev)[:, None]
        k = torch.arange(S, device=dev)[None, :]
        return (k <= q + cache_len) | (q >= n_ctx)  # (n_ctx + T, S)


def build_drafter(config: dict[str, Any]) -> DFlashDrafter:
    """The drafter a dflash checkpoint's config.json describes (weights not loaded)."""
    try:
        mc = ModelConfig.from_dict(config["model"])
        d = config["dflash"]
        return DFlashDrafter(mc, d["target_layer_ids"], d["block_size"], d["mask_token_id"],
                             d.get("injection", "kv"), d.get("target_features", True))
    except KeyError as e:
        raise DlmError(f"dflash checkpoint config.json lacks {e}") from None


def target_fingerprint(target: Transformer) -> list[float]:
    """A cheap, dtype-tolerant identity of a target: sums of 16 embedding rows."""
    E = target.embed_tokens.weight
    idx = torch.linspace(0, E.shape[0] - 1, 16).long()
    return [float(x) for x in E[idx].detach().float().sum(-1)]


def check_target(dflash: dict[str, Any], target: Transformer, tok_sha: str, where: str) -> None:
    """Raise unless `target` is the model the drafter was trained for."""
    rec = dflash.get("target", {})
    tc = target.cfg
    want = rec.get("model", {})
    for key in ("n_layers", "dim", "vocab_size"):
        if key in want and want[key] != getattr(tc, key):
            raise DlmError(f"--draft {where}: drafter was trained for a target with {key}={want[key]}, "
                           f"the target given has {getattr(tc, key)}")
    if rec.get("tokenizer_sha256") and rec["tokenizer_sha256"] != tok_sha:
        raise DlmError(f"--draft {where}: the drafter's target used a different tokenizer than the target given")
    fp = rec.get("fingerprint")
    if fp and not torch.allclose(torch.tensor(fp), torch.tensor(target_fingerprint(target)), rtol=1e-2, atol=1e-2):
        raise DlmError(f"--draft {where}: drafter was trained for another target ({rec.get('path')}); "
                       "its embeddings differ from the target given")


# the objective ------------------------------------------------------------------------------------

def check_config(cfg) -> None:
    """Refuse bad dflash options before anything is written (cfg: TrainConfig)."""
    from dlm.checkpoint import open_checkpoint

    check(bool(cfg.target), "--objective dflash needs --target AR_CHECKPOINT (the model to speed up)")
    check(cfg.block_size >= 2, f"--block-size must be >= 2, got {cfg.block_size}")
    check(cfg.block_size <= cfg.seq_len + 1, f"--block-size {cfg.block_size} exceeds --seq-len + 1 ({cfg.seq_len + 1})")
    check(cfg.injection in INJECTIONS, f"--injection must be one of {list(INJECTIONS)}, got {cfg.injection!r}")
    check(cfg.draft_layers >= 0, f"--draft-layers must be >= 0 (0 = default), got {cfg.draft_layers}")
    check(cfg.anchors >= 0, f"--anchors must be >= 0 (0 = default), got {cfg.anchors}")
    tck = open_checkpoint(cfg.target)
    if tck.objective != "ar":
        raise DlmError(f"--target {cfg.target}: a DFlash target must be an AR checkpoint, got objective {tck.objective!r}")
    N = tck.model_config.n_layers
    ids = [int(i) for i in cfg.target_layers]
    check(len(ids) <= N, f"--target-layers: {len(ids)} layers requested, the target is too shallow ({N} layers)")
    for i in ids:
        check(0 <= i < N, f"--target-layers: layer {i} is outside the target's layers 0 .. {N - 1} (too shallow)")
    check(len(set(ids)) == len(ids), f"--target-layers must be distinct, got {ids}")


class DFlash(Objective):
    """Train a DFlash drafter against a frozen AR target (`--target DIR`)."""

    name = "dflash"

    def __init__(self, cfg, tokenizer):
        super().__init__(cfg, tokenizer)
        from dlm.checkpoint import load_model

        check_config(cfg)
        target, tck = load_model(cfg.target)
        if tck.tokenizer.sha256 != tokenizer.sha256:
            raise DlmError(f"--tokenizer does not match the target's ({cfg.target}/tokenizer.json); "
                           "leave --tokenizer unset to use the target's")
        self.target = target.requires_grad_(False)
        self.target_ck = tck
        N = target.cfg.n_layers
        self.layer_ids = [int(i) for i in cfg.target_layers] or target_layer_ids(N, default_features(N))
        self.mask_id = mask_token_id(tck.tokenizer, target.cfg.vocab_size)
        self.n_layers = cfg.draft_layers or default_draft_layers(N)
        self.gamma = cfg.block_size

    def build_model(self) -> DFlashDrafter:
        tc = self.target.cfg
        mc = ModelConfig(**{**tc.to_dict(), "n_layers": self.n_layers, "qk_norm": True, "self_cond": False,
                            "tie_embeddings": False})
        model = DFlashDrafter(mc, self.layer_ids, self.gamma, self.mask_id, self.cfg.injection,
                              self.cfg.target_features)
        with torch.no_grad():  # the drafter's output feeds the target's head: start at the target's scale
            model.norm.weight.copy_(self.target.norm.weight)
        if self.cfg.init_from:  # warm start: continue a drafter of the same shape (e.g. longer, or on more data)
            from dlm.checkpoint import load_weights, open_checkpoint

            ck = open_checkpoint(self.cfg.init_from)
            if ck.objective != "dflash":
                raise DlmError(f"--init-from {ck.path}: a dflash run starts from a dflash drafter, "
                               f"not from objective {ck.objective!r}")
            d = ck.config["dflash"]
            check_target(d, self.target, self.target_ck.tokenizer.sha256, str(ck.path))
            if (d["target_layer_ids"], d["block_size"], d["injection"]) != (self.layer_ids, self.gamma,
                                                                              self.cfg.injection):
                raise DlmError(f"--init-from {ck.path}: target layers {d['target_layer_ids']}, block size "
                               f"{d['block_size']}, injection {d['injection']!r}; this run has {self.layer_ids}, "
                               f"{self.gamma}, {self.cfg.injection!r}")
            load_weights(model, ck.tensors(), ck.path / "model.safetensors")
        return model

    def trainable(self, model: nn.Module) -> list[nn.Parameter]:
        return list(model.parameters())  # the target lives here, not in the drafter

    def anchors_per_window(self, T1: int) -> int:
        """--anchors, or the paper's coverage: 512 blocks of 16 per 3072 tokens, each position in ~2.7 blocks."""
        n_pos = T1 - self.gamma + 1
        return max(1, min(n_pos, self.cfg.anchors or round(T1 * 8 / (3 * self.gamma))))

    def loss(self, model: DFlashDrafter, batch: Tensor, gen: torch.Generator) -> tuple[Tensor, dict[str, float]]:
        tgt = self.target
        if tgt.device != batch.device:
            tgt.to(batch.device)
        B, T1 = batch.shape
        g = self.gamma
        dev = batch.device
        with torch.no_grad():
            taps: dict[int, Tensor] = {}
            if model.target_features:  # only as deep as the deepest tap
                x = tgt.embed_tokens(batch)
                _, taps = run_blocks(tgt.layers[:max(model.layer_ids) + 1], tgt.inv_freq, x, taps=model.layer_ids)
            feats = model.features(tgt, batch, taps)  # (B, T1, F)
        ctx = model.context(feats)  # (B, T1, D)
        A = self.anchors_per_window(T1)
        n_pos = T1 - g + 1
        anchors = torch.rand(B, n_pos, generator=gen, device=dev).argsort(dim=1)[:, :A].sort(dim=1).values  # (B, A)
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
        loss = (ce * w).sum(-1).mean()
        with torch.no_grad():
            hit = logits.argmax(-1) == labels  # (B, A, g-1)
            accepted = hit.int().cumprod(-1).sum(-1).float()  # greedy acceptance of each block
        return loss, {"acc_slot1": float(hit[:, :, 0].float().mean()), "tau_train": 1.0 + float(accepted.mean())}

    def meta(self) -> dict[str, Any]:
        tc = self.target.cfg
        return {"dflash": {
            "target_layer_ids": self.layer_ids, "block_size": self.gamma, "mask_token_id": self.mask_id,
            "injection": self.cfg.injection, "target_features": self.cfg.target_features,
            "gamma_w": gamma_w(self.gamma),
            "target": {"path": str(Path(self.cfg.target).resolve()), "model": tc.to_dict(),
                       "tokenizer_sha256": self.target_ck.tokenizer.sha256,
                       "fingerprint": target_fingerprint(self.target)},
        }}


def mask_token_id(tok, vocab_size: int) -> int:
    """The drafter's mask token: the tokenizer's <mask>, else the first embedding row past the tokenizer."""
    if tok.mask_id is not None:
        return tok.mask_id
    if tok.vocab_size < vocab_size:
        return tok.vocab_size
    raise DlmError("the target's tokenizer has no <mask> token and its embedding has no spare row for one")


# export -------------------------------------------------------------------------------------------

def hf_config(drafter: DFlashDrafter, ck, dtype: str) -> dict[str, Any]:
    """config.json in the layout of the public DFlash drafters (Qwen3 layers + dflash_config)."""
    from dlm.hf import hf_config as qwen3_config

    cfg = drafter.cfg
    out = qwen3_config(cfg, ck.tokenizer, dtype)
    out.update({
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "tie_word_embeddings": False,
        "layer_types": ["full_attention"] * cfg.n_layers,
        "block_size": drafter.block_size,  # top level, where the z-lab checkpoints keep it
        "num_target_layers": ck.config["dflash"]["target"]["model"]["n_layers"],
        "dflash_config": {"target_layer_ids": drafter.layer_ids, "mask_token_id": drafter.mask_id,
                          "block_size": drafter.block_size},
    })
    return out


def export_hf(drafter: DFlashDrafter, ck, out: str | os.PathLike, dtype: torch.dtype = torch.float32) -> Path:
    """Write the drafter as a public-layout DFlash folder (config.json + model.safetensors)."""
    from dlm.checkpoint import state_tensors, write_json, write_tensors

    if not drafter.target_features or drafter.injection != "kv":
        raise DlmError("--format hf: only drafters with target features and K/V injection have the public DFlash "
                       "layout (this one is an ablation)")
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_tensors(tmp / "model.safetensors", state_tensors(drafter, dtype), metadata={"format": "pt"})
    write_json(tmp / "config.json", hf_config(drafter, ck, str(dtype).removeprefix("torch.")))
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out
