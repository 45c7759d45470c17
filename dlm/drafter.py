"""The DFlash drafter (arXiv 2602.06036): a block-diffusion model conditioned on a target's hidden states.

The drafter is a short stack of the backbone's own decoder layers at the target's width, plus
`fc` (concatenated target features -> D, bias-free) and `hidden_norm`, and a final `norm`. It has
no embedding or LM head: it reads the target's, frozen.

    target features  outputs of L target layers, concatenated (C, L*D) -> fc -> hidden_norm = ctx (C, D);
                     the target's last layer is read after its final norm (last_layer "normed", what
                     the public engines feed: transformers' hidden_states[id + 1]; "prenorm" in drafters
                     trained before)
    block            [last committed token, <mask> x (B-1)] at positions start .. start+B-1,
                     embedded by the target's embedding
    every layer      queries from the block only; keys/values = [ctx K/V ; block K/V], each layer
                     projecting ctx with its own k/v projections (injection "kv"); bidirectional
    output           norm(h) -> the target's lm_head: logits for slots 1 .. B-1 are the draft

At inference the drafter's cache holds context K/V only: each draft writes the K/V of the newly
committed positions' features and reads the block without writing it (run_blocks write=False).

Ablations: injection "input" (the context enters once, as tokens at the input, and passes through
the layers like ordinary hidden states), and target_features=False (the context is the target's
token embeddings, not its hidden states: an unconditioned block-diffusion drafter).

Its training objective (anchors, the multi-block mask, slot weights) is dlm.objectives.dflash; its
sampler is the speculative loop (dlm.sampling.speculative.DFlashDraft); its export in the public
DFlash layout is dlm.hf.export_drafter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dlm.config import ModelConfig
from dlm.errors import DlmError, check
from dlm.model import (
    Block, KVCache, RMSNorm, Transformer, block_shapes, init_weights, rope_inv_freq, run_blocks,
)

INJECTIONS = ("kv", "input")
LAST_LAYER = ("normed", "prenorm")  # how the target's last layer is read: after its final norm, or before


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
    """5 layers for deep targets (the paper's Qwen3-8B drafter); a quarter of the target when shallower, and at
    least 2: with one layer every mask slot has the same query up to RoPE, so the drafter cannot look up where
    a pattern occurred before (on ar-small, 2 layers beat 1 at fewer steps: docs/dflash.md)."""
    return max(2, min(5, n_target_layers // 4))


def default_features(n_target_layers: int) -> int:
    """5 target layers (the paper's), or every layer of a target shallower than that."""
    return min(5, n_target_layers)


# the drafter --------------------------------------------------------------------------------------

class DFlashDrafter(nn.Module):
    """Decoder layers + fc + hidden_norm + norm; embedding and LM head come from the target."""

    def __init__(self, cfg: ModelConfig, layer_ids: list[int], block_size: int, mask_id: int,
                 injection: str = "kv", target_features: bool = True, last_layer: str = "normed",
                 input_embedding_scale: float = 1.0, output_multiplier: float = 1.0,
                 logit_softcap: float | None = None):
        super().__init__()
        check(injection in INJECTIONS, f"--injection must be one of {list(INJECTIONS)}, got {injection!r}")
        check(last_layer in LAST_LAYER, f"dflash last_layer must be one of {list(LAST_LAYER)}, got {last_layer!r}")
        check(block_size >= 2, f"--block-size must be >= 2, got {block_size}")
        self.cfg = cfg
        self.layer_ids = list(layer_ids)
        self.block_size = block_size
        self.mask_id = mask_id
        self.injection = injection
        self.target_features = target_features
        self.last_layer = last_layer
        # the public drafters' numerics (z-lab's dflash_config): the block's embeddings scaled, the logits
        # multiplied, then soft-capped (tanh(x / c) * c)
        self.input_embedding_scale = float(input_embedding_scale)
        self.output_multiplier = float(output_multiplier)
        self.logit_softcap = float(logit_softcap) if logit_softcap else None
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
        """The context feature of each position, before fc: concatenated taps (the last layer as this drafter
        reads it, `norm_last`), or the token embedding. (B, T, F)"""
        if self.target_features:
            return self.norm_last(target, torch.cat([taps[i] for i in self.layer_ids], dim=-1))
        return target.embed_tokens(tokens)

    def norm_last(self, target: Transformer, feats: Tensor) -> Tensor:
        """Concatenated taps (..., L*D) -> the features this drafter reads: the target's last layer through
        the target's final norm (transformers' hidden_states[-1], what public DFlash engines feed), unless
        the drafter was trained on the pre-norm tap."""
        last = target.cfg.n_layers - 1
        if self.last_layer == "prenorm" or last not in self.layer_ids:
            return feats
        D = target.cfg.dim
        j = self.layer_ids.index(last) * D
        return torch.cat((feats[..., :j], target.norm(feats[..., j:j + D]), feats[..., j + D:]), dim=-1)

    def embed(self, target: Transformer, ids: Tensor) -> Tensor:
        """The block's input: the target's embeddings of ids (..., T) -> (..., T, D), times the input scale."""
        x = target.embed_tokens(ids)
        return x * self.input_embedding_scale if self.input_embedding_scale != 1.0 else x

    def head(self, target: Transformer, h: Tensor) -> Tensor:
        """Draft logits from normed hidden states: the target's LM head, the output multiplier, the soft-cap."""
        logits = target.lm_head(h)
        if self.output_multiplier != 1.0:
            logits = logits * self.output_multiplier
        if self.logit_softcap:
            logits = torch.tanh(logits.float() / self.logit_softcap).to(logits.dtype) * self.logit_softcap
        return logits

    def numerics(self) -> dict[str, Any]:
        """The config entries of the numerics that differ from the plain DFlash ones."""
        out: dict[str, Any] = {}
        if self.input_embedding_scale != 1.0:
            out["input_embedding_scale"] = self.input_embedding_scale
        if self.output_multiplier != 1.0:
            out["output_multiplier"] = self.output_multiplier
        if self.logit_softcap:
            out["final_logit_softcapping"] = self.logit_softcap
        return out

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
                             d.get("injection", "kv"), d.get("target_features", True),
                             d.get("last_layer", "prenorm"),  # absent: trained before the public reading
                             d.get("input_embedding_scale", 1.0), d.get("output_multiplier", 1.0),
                             d.get("final_logit_softcapping"))
    except KeyError as e:
        raise DlmError(f"dflash checkpoint config.json lacks {e}") from None


def drafter_shapes(config: dict[str, Any]) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Name -> shape of every tensor of the drafter a dflash config.json describes, without building it."""
    try:
        mc = ModelConfig.from_dict(config["model"])
        d = config["dflash"]
        n_in = len(d["target_layer_ids"]) if d.get("target_features", True) else 1
    except KeyError as e:
        raise DlmError(f"dflash checkpoint config.json lacks {e}") from None
    out: dict[str, tuple[int, ...]] = {}
    for i in range(mc.n_layers):
        out.update(block_shapes(mc, f"layers.{i}."))
    out.update({"fc.weight": (mc.dim, n_in * mc.dim), "hidden_norm.weight": (mc.dim,), "norm.weight": (mc.dim,)})
    return out, {}


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
        raise DlmError(f"--draft {where}: drafter was trained for another target ({rec.get('name', rec.get('path'))}); "
                       "its embeddings differ from the target given")


def mask_token_id(tok, vocab_size: int) -> int:
    """The drafter's mask token: the tokenizer's <mask>, else the first embedding row past the tokenizer."""
    if tok.mask_id is not None:
        return tok.mask_id
    if tok.vocab_size < vocab_size:
        return tok.vocab_size
    raise DlmError("the target's tokenizer has no <mask> token and its embedding has no spare row for one")
