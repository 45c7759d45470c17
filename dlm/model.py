"""The backbone: a Qwen3/Llama-style decoder that every paradigm shares.

One code path serves every way the paradigms run it:

- causal attention (AR training, prefill, decoding)                          mask="causal"
- a block attending bidirectionally to itself and to a cached prefix        mask="full"
- any boolean attention mask (multi-block training)                          mask=Tensor
- explicit position ids (a canvas or draft block at positions of its own)    pos=...
- a preallocated KV cache with crop(length) rollback; reading without writing  cache=..., write=False
- hidden states of chosen layers (DFlash reads the target's)                 taps=(i, j, ...)
- extra context features whose K/V every layer prepends (the DFlash drafter)  ctx=..., ctx_pos=...

Keys seen by the queries are laid out as [cache[:L0] ; ctx (C) ; x (T)]. A boolean mask is
True where attention is allowed and has shape broadcastable to (B, 1, T, L0 + C + T); every mask
of every paradigm is built in dlm.masks.

Parameter names match transformers' Qwen3/Llama modules (without the `model.` prefix), so
import/export is a rename (dlm.hf).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from dlm import gemma4, moe
from dlm.config import ModelConfig
from dlm.errors import DlmError
from dlm.masks import Mask, sdpa_mask
from dlm.rope import apply_rope, query_scale, rope_attention_factor, rope_cos_sin, yarn_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if scale else None

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32:  # one fused kernel; same arithmetic as below
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        dtype = x.dtype  # half precision: normalise in fp32 like transformers, then scale
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = x.to(dtype)
        return x if self.weight is None else self.weight * x


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    hd = int(cfg.head_dim * cfg.partial_rotary)  # the rotated dimensions (partial rotary: the first ones)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))  # (hd/2,)
    rs = cfg.rope_scaling or {}
    if rs.get("rope_type", rs.get("type")) == "yarn":
        return yarn_inv_freq(hd, cfg.rope_theta, rs)
    if rs.get("rope_type", rs.get("type")) == "llama3":
        # Llama 3.1 frequency rescaling (same formula as the reference implementation)
        factor = rs["factor"]
        low, high = rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
        old_ctx = rs["original_max_position_embeddings"]
        low_wl, high_wl = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wl, inv_freq / factor, inv_freq)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


class KVCache:
    """Static K/V buffers for every layer: (n_layers, B, n_kv_heads, capacity, head_dim).

    `length` slots are valid. Writing appends at `length`; `crop(n)` rolls back to n slots.
    Slots need not equal positions (positions are baked into the keys by RoPE).
    """

    def __init__(
        self, n_layers: int, batch: int, n_kv_heads: int, capacity: int, head_dim: int,
        device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
    ):
        shape = (n_layers, batch, n_kv_heads, capacity, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[3]

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"crop({length}) outside [0, {self.length}]")
        self.length = length

    def reserve(self, n: int) -> None:
        if self.length + n > self.capacity:
            raise DlmError(f"KV cache full: {self.length} + {n} tokens > capacity {self.capacity}")


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        bias = cfg.attn_bias  # Qwen2: q, k and v carry a bias, o does not
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def project_kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        B, T, _ = x.shape
        k = self.k_proj(x).view(B, T, self.n_kv, self.hd)
        if self.k_norm is not None:
            k = self.k_norm(k)
        k = apply_rope(k.transpose(1, 2), cos, sin)  # (B, Hkv, T, hd)
        v = self.v_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        return k, v

    def forward(
        self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor | None, is_causal: bool,
        cache: KVCache | None, layer: int, write: bool,
        ctx: Tensor | None, ctx_rope: tuple[Tensor, Tensor] | None,
    ) -> Tensor:
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.hd)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = apply_rope(q.transpose(1, 2), rope[0], rope[1])  # (B, H, T, hd)
        if len(rope) > 2:  # the queries' attention temperature by position (rope_scaling llama_4_scaling_beta)
            q = q * rope[2].to(q.dtype)
        k, v = self.project_kv(x, rope[0], rope[1])  # (B, Hkv, T, hd)
        if ctx is not None:
            kc, vc = self.project_kv(ctx, ctx_rope[0], ctx_rope[1])  # (B, Hkv, C, hd)
        if cache is None:
            if ctx is not None:
                k, v = torch.cat((kc, k), 2), torch.cat((vc, v), 2)
        else:
            start = cache.length
            if ctx is not None:  # context K/V always persist in the cache
                C = kc.shape[2]
                cache.k[layer, :, :, start:start + C] = kc
                cache.v[layer, :, :, start:start + C] = vc
                start += C
            if write:
                cache.k[layer, :, :, start:start + T] = k
                cache.v[layer, :, :, start:start + T] = v
                k, v = cache.k[layer, :, :, :start + T], cache.v[layer, :, :, :start + T]
            else:
                k = torch.cat((cache.k[layer, :, :, :start], k), 2)
                v = torch.cat((cache.v[layer, :, :, :start], v), 2)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.hd ** -0.5, enable_gqa=self.n_kv != self.n_heads
        )  # (B, H, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.hd))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)); x + mlp(norm(x)). Context features enter raw."""

    def __init__(self, cfg: ModelConfig, i: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        # layer i's feed-forward: a mixture of experts (ModelConfig.moe, from its first_dense layer on) or SwiGLU
        self.mlp = moe.SparseMoE(cfg.dim, cfg.moe, MLP) if moe.is_moe_layer(cfg, i) else MLP(cfg.dim, cfg.ffn_dim)
        self.checkpointing = False  # activation checkpointing: recompute this layer in the backward pass

    def forward(self, x, rope, mask, is_causal, cache, layer, write, ctx=None, ctx_rope=None) -> Tensor:
        if self.checkpointing and cache is None and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self.layer, x, rope, mask, is_causal, None, layer, write, ctx,
                                                     ctx_rope, use_reentrant=False)
        return self.layer(x, rope, mask, is_causal, cache, layer, write, ctx, ctx_rope)

    def layer(self, x, rope, mask, is_causal, cache, layer, write, ctx=None, ctx_rope=None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, mask, is_causal, cache, layer, write, ctx, ctx_rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class SelfConditioning(nn.Module):
    """DiffusionGemma-style self-conditioning of canvas embeddings.

    soft = softmax(previous logits) @ E (zero on a canvas's first step);
    x = RMSNorm_noscale(token_embeddings + GatedMLP(RMSNorm(soft))) * cfg.canvas_rms.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        norm, mlp = (gemma4.RMSNorm, gemma4.MLP) if cfg.arch else (RMSNorm, MLP)  # Gemma: its norm and GeGLU
        self.norm = norm(cfg.dim, cfg.norm_eps)
        self.mlp = mlp(cfg.dim, cfg.ffn_dim)
        self.out_norm = norm(cfg.dim, cfg.norm_eps, scale=False)
        self.rms = cfg.canvas_rms

    def forward(self, tok_emb: Tensor, soft_emb: Tensor | None) -> Tensor:
        x = self.out_norm(tok_emb if soft_emb is None else tok_emb + self.mlp(self.norm(soft_emb)))
        return x if self.rms == 1.0 else x * self.rms


def canvas_embeds(model: Transformer, canvas: Tensor, probs: Tensor | None) -> Tensor:
    """The usdm denoiser's input: token embeddings of the canvas (B, L) plus the self-conditioning signal.

    probs (B, L, V): the previous pass's distribution (softmax of its processed logits), or None on
    a canvas's first step (a zero signal: rows of zeros in probs are the same as None).
    """
    emb = model.embed_tokens(canvas) * model.embed_scale  # (B, L, D)
    soft = None if probs is None else probs.to(emb.dtype) @ model.embed_tokens.weight * model.embed_scale  # (B, L, D)
    return model.self_cond(emb, soft)


def align_canvas_logits(den: Tensor, first: Tensor | None) -> Tensor:
    """The clean-token logits of a canvas from the denoiser's outputs den (B, L, V).

    first None (no shift): position j's output predicts token j. Otherwise (ModelConfig.canvas_shift)
    position j's output predicts token j + 1 and first (B, 1, V), the encoder's next-token logits at the
    last clean position before the canvas, predicts token 0; the last position's output is unused.
    """
    if first is None:
        return den
    return torch.cat([first.to(den.dtype), den[:, :-1]], 1)


@dataclass
class Output:
    logits: Tensor | None  # (B, T, V) or None when head=False
    last: Tensor  # final normed hidden state (B, T, D)
    taps: dict[int, Tensor] = field(default_factory=dict)  # layer index -> output of that layer (B, T, D)


def run_blocks(
    blocks: Sequence[Block], inv_freq: Tensor, x: Tensor, *, pos: Tensor | None = None,
    cache: KVCache | None = None, mask: Mask = "causal", write: bool = True,
    ctx: Tensor | None = None, ctx_pos: Tensor | None = None, taps: Sequence[int] = (),
    rope_scaling: dict | None = None,
) -> tuple[Tensor, dict[int, Tensor]]:
    """Run a stack of decoder layers over x (B, T, D); the one attention code path of dlm. rope_scaling: the
    model's (YaRN's attention factor, the queries' temperature by position); inv_freq already holds its
    frequencies."""
    B, T, _ = x.shape
    L0 = cache.length if cache is not None else 0
    C = ctx.shape[1] if ctx is not None else 0
    if pos is None:
        pos = torch.arange(L0 + C, L0 + C + T, device=x.device)
    if cache is not None:
        cache.reserve(C + T)
    factor = rope_attention_factor(rope_scaling)
    p = pos if pos.dim() == 2 else pos[None]
    rope = rope_cos_sin(inv_freq, p, x.dtype, factor)
    qs = query_scale(rope_scaling, p)
    if qs is not None:
        rope = (*rope, qs)
    ctx_rope = None
    if ctx is not None:
        if ctx_pos is None:
            raise ValueError("ctx needs ctx_pos")
        ctx_rope = rope_cos_sin(inv_freq, ctx_pos if ctx_pos.dim() == 2 else ctx_pos[None], x.dtype, factor)
    attn_mask, is_causal = sdpa_mask(mask, T, L0 + C + T, x.device)
    out_taps: dict[int, Tensor] = {}
    for i, block in enumerate(blocks):
        x = block(x, rope, attn_mask, is_causal, cache, i, write, ctx, ctx_rope)
        if i in taps:
            out_taps[i] = x
    if cache is not None:
        cache.length = L0 + C + (T if write else 0)
    return x, out_taps


RESIDUAL_OUT = ("o_proj.weight", "down_proj.weight")  # the projections that write into the residual stream


def init_weights(model: nn.Module, n_layers: int) -> None:
    """GPT-2 style: N(0, 0.02) for every linear and embedding; residual outputs scaled by 1/sqrt(2 n_layers)."""
    for m in model.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:  # (attn_bias) biases start at zero
            nn.init.zeros_(m.bias)
    for name, p in model.named_parameters():
        if name.endswith(RESIDUAL_OUT):
            nn.init.normal_(p, std=0.02 / math.sqrt(2 * n_layers))


def block_shapes(cfg: ModelConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the tensors of one Block(cfg), without building it."""
    D, F, hd = cfg.dim, cfg.ffn_dim, cfg.head_dim
    out = {"input_layernorm.weight": (D,), "post_attention_layernorm.weight": (D,),
           "self_attn.q_proj.weight": (cfg.n_heads * hd, D), "self_attn.k_proj.weight": (cfg.n_kv_heads * hd, D),
           "self_attn.v_proj.weight": (cfg.n_kv_heads * hd, D), "self_attn.o_proj.weight": (D, cfg.n_heads * hd),
           "mlp.gate_proj.weight": (F, D), "mlp.up_proj.weight": (F, D), "mlp.down_proj.weight": (D, F)}
    if cfg.qk_norm:
        out.update({"self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,)})
    if cfg.attn_bias:
        out.update({"self_attn.q_proj.bias": (cfg.n_heads * hd,), "self_attn.k_proj.bias": (cfg.n_kv_heads * hd,),
                    "self_attn.v_proj.bias": (cfg.n_kv_heads * hd,)})
    return {prefix + k: v for k, v in out.items()}


def param_shapes(cfg: ModelConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Name -> shape of every tensor of a Transformer(cfg), computed without building it (so a config.json can be
    held against its weights' header before anything is allocated), and the aliases of tied tensors
    (lm_head.weight -> embed_tokens.weight). tests hold this to the state_dict of built models."""
    D = cfg.dim
    if cfg.arch or cfg.moe:  # own layers, experts: read from the model built on the meta device (allocates nothing)
        with torch.device("meta"):
            m = Transformer(cfg)
        out = {k: tuple(v.shape) for k, v in m.state_dict().items() if k != "lm_head.weight" or not cfg.tie_embeddings}
        return out, ({"lm_head.weight": "embed_tokens.weight"} if cfg.tie_embeddings else {})
    out = {"embed_tokens.weight": (cfg.vocab_size, D)}
    for i in range(cfg.n_layers):
        out.update(block_shapes(cfg, f"layers.{i}."))
    out["norm.weight"] = (D,)
    aliases = {"lm_head.weight": "embed_tokens.weight"} if cfg.tie_embeddings else {}
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, D)
    if cfg.self_cond:
        F = cfg.ffn_dim
        out.update({"self_cond.norm.weight": (D,), "self_cond.mlp.gate_proj.weight": (F, D),
                    "self_cond.mlp.up_proj.weight": (F, D), "self_cond.mlp.down_proj.weight": (D, F)})
    if cfg.learned_pos:
        out["pos_embed.weight"] = (cfg.max_seq_len, D)
    if cfg.grid_pos:
        out.update({f"grid_embed.{k}.weight": (cfg.grid_pos + 1, D) for k in ("row", "col", "box")})
    return out, aliases


class GridEmbedding(nn.Module):
    """Row, column and box embeddings of the cell at each position of a side x side grid (ModelConfig.grid_pos).

    Position p is cell c = p mod (side^2 + 1) of its layout; c = side^2 (the separator after a quiz, the <eos>
    after a solution) has index `side` in all three tables."""

    def __init__(self, side: int, dim: int):
        super().__init__()
        self.side, self.width = side, math.isqrt(side)  # width: of a box
        self.row, self.col, self.box = (nn.Embedding(side + 1, dim) for _ in range(3))

    def forward(self, pos: Tensor) -> Tensor:
        n, b = self.side, self.width
        c = pos % (n * n + 1)
        cell = c < n * n
        r, k = torch.where(cell, c // n, n), torch.where(cell, c % n, n)
        bx = torch.where(cell, (r // b) * b + k // b, n)
        return self.row(r) + self.col(k) + self.box(bx)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim)
        if cfg.arch:  # a family's own layers, by configuration (dlm.gemma4)
            self.layers = nn.ModuleList(gemma4.Block(cfg, i) for i in range(cfg.n_layers))
            self.norm = gemma4.RMSNorm(cfg.dim, cfg.norm_eps)
        else:
            self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.embed_scale = math.sqrt(cfg.dim) if cfg.arch else 1.0  # Gemma: embeddings (and soft inputs) x sqrt(D)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.self_cond = SelfConditioning(cfg) if cfg.self_cond else None
        self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.dim) if cfg.learned_pos else None  # GPT-2's, beside RoPE
        self.grid_embed = GridEmbedding(cfg.grid_pos, cfg.dim) if cfg.grid_pos else None
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        init_weights(self, cfg.n_layers)

    def new_cache(self, batch: int, capacity: int | None = None, dtype: torch.dtype | None = None) -> KVCache:
        cfg = self.cfg
        p = self.embed_tokens.weight
        if cfg.arch:
            return gemma4.KVCache(cfg, batch, capacity or cfg.max_seq_len, p.device, dtype or p.dtype)
        return KVCache(cfg.n_layers, batch, cfg.n_kv_heads, capacity or cfg.max_seq_len, cfg.head_dim,
                       p.device, dtype or p.dtype)

    def forward(
        self,
        tokens: Tensor | None = None,  # (B, T) token ids
        *,
        embeds: Tensor | None = None,  # (B, T, D) instead of tokens (self-conditioned canvases)
        pos: Tensor | None = None,  # (T,) or (B, T) positions; default: next slots of the cache
        cache: KVCache | None = None,
        mask: Mask = "causal",
        write: bool = True,  # write this call's K/V into the cache (False: read only)
        ctx: Tensor | None = None,  # (B, C, D) context features, K/V only (DFlash-style injection)
        ctx_pos: Tensor | None = None,  # (C,) or (B, C)
        taps: Sequence[int] = (),  # return the outputs of these layers
        head: bool = True,  # compute logits
    ) -> Output:
        x = self.embed_tokens(tokens) * self.embed_scale if embeds is None else embeds  # (B, T, D)
        if self.pos_embed is not None or self.grid_embed is not None:  # absolute positions (learned_pos, grid_pos)
            if pos is None:
                start = (cache.length if cache is not None else 0) + (ctx.shape[1] if ctx is not None else 0)
                pos = torch.arange(start, start + x.shape[1], device=x.device)
            if self.pos_embed is not None:
                x = x + self.pos_embed(pos)  # (T, D) or (B, T, D)
            if self.grid_embed is not None:
                x = x + self.grid_embed(pos)
        if self.cfg.arch:
            x, out_taps = gemma4.run_blocks(self, x, pos=pos, cache=cache, mask=mask, write=write, ctx=ctx, taps=taps,
                                            resolve_mask=sdpa_mask)
        else:
            x, out_taps = run_blocks(self.layers, self.inv_freq, x, pos=pos, cache=cache, mask=mask, write=write,
                                     ctx=ctx, ctx_pos=ctx_pos, taps=taps, rope_scaling=self.cfg.rope_scaling)
        last = self.norm(x)
        logits = self.lm_head(last) if head else None
        if logits is not None and self.cfg.arch and self.cfg.arch.get("final_softcap"):
            logits = torch.tanh(logits / self.cfg.arch["final_softcap"]) * self.cfg.arch["final_softcap"]
        return Output(logits, last, out_taps)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
