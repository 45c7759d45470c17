"""Gemma 4 layers of the backbone, selected by `ModelConfig.arch` (family "gemma4").

The backbone stays one model (dlm.model.Transformer): a config whose `arch` says "gemma4" builds these
decoder layers instead of the Qwen3/Llama ones and runs them through `run_blocks` below. What differs:

- per-layer attention specs (`arch["layer_types"]`: "sliding" | "full"): sliding layers use the config's
  head_dim / n_kv_heads / rope_theta and a window; full layers their own head dim, KV heads, RoPE theta
  and partial ("proportional") rotary fraction, and with k_eq_v no v_proj (V is the K projection);
- RMSNorm numerics x * w in fp32, then cast; q_norm and k_norm with a scale, v_norm without;
  attention scale 1.0;
- sandwich norms around attention and the feed-forward, a dense GeGLU MLP (gelu tanh) and, with
  `arch["moe"]`, a mixture of experts in parallel (router: RMSNorm without scale, learned scale x D^-0.5,
  linear, fp32 softmax, top-k, renormalised, per-expert scale); `layer_scalar` on the layer's output;
- embeddings scaled by sqrt(D) (dlm.model.Transformer.embed), final logits soft-capped.

Parameter names are transformers' Gemma 4 names (without the `model.language_model.` prefix).
The KV cache keeps one K/V buffer per layer (their shapes differ), with the same `length` and `crop`.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dlm.errors import DlmError, check
from dlm.masks import LayerMasks
from dlm.rope import apply_rope, rope_cos_sin

ARCH_KEYS = {"family", "layer_types", "sliding_window", "full_head_dim", "full_kv_heads", "full_rope_theta",
             "full_partial_rotary", "k_eq_v", "moe", "final_softcap", "layer_scalar"}


def check_arch(arch: dict[str, Any], n_layers: int) -> None:
    """The fields of ModelConfig.arch (family gemma4), each with a one-line error."""
    check(arch.get("family") == "gemma4", f"model.arch.family must be 'gemma4', got {arch.get('family')!r}")
    unknown = sorted(set(arch) - ARCH_KEYS)
    check(not unknown, f"model.arch has unknown fields {unknown}; known: {sorted(ARCH_KEYS)}")
    lt = arch.get("layer_types")
    check(isinstance(lt, list) and len(lt) == n_layers and all(t in ("sliding", "full") for t in lt),
          f"model.arch.layer_types must list 'sliding' or 'full' for each of the {n_layers} layers, got {lt!r}"[:200])
    for k in ("sliding_window", "full_head_dim", "full_kv_heads"):
        v = arch.get(k)
        check(isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 1 << 20, f"model.arch.{k} must be a positive integer, got {v!r}")
    check(arch["full_head_dim"] % 2 == 0, f"model.arch.full_head_dim must be even, got {arch['full_head_dim']}")
    p = arch.get("full_partial_rotary", 1.0)
    check(isinstance(p, (int, float)) and 0 < p <= 1, f"model.arch.full_partial_rotary must be in (0, 1], got {p!r}")
    moe = arch.get("moe")
    if moe is not None:
        check(isinstance(moe, dict) and set(moe) == {"n_experts", "top_k", "ffn_dim"},
              f"model.arch.moe must be null or {{n_experts, top_k, ffn_dim}}, got {moe!r}"[:200])
        check(0 < moe["top_k"] <= moe["n_experts"] <= 4096 and 0 < moe["ffn_dim"] <= 1 << 18,
              f"model.arch.moe needs 0 < top_k <= n_experts <= 4096 and ffn_dim > 0, got {moe}")


class RMSNorm(nn.Module):
    """Gemma 4's: normalise in fp32, multiply by w (not 1 + w) in fp32, then cast."""

    def __init__(self, dim: int, eps: float = 1e-6, scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if scale else None

    def forward(self, x: Tensor) -> Tensor:
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            h = h * self.weight.float()
        return h.type_as(x)


def layer_spec(cfg, i: int) -> tuple[int, int, bool]:
    """(head_dim, n_kv_heads, k_eq_v) of layer i."""
    a = cfg.arch
    if a["layer_types"][i] == "full":
        return a["full_head_dim"], a["full_kv_heads"], bool(a.get("k_eq_v", False))
    return cfg.head_dim, cfg.n_kv_heads, False


def inv_freqs(cfg) -> dict[str, Tensor]:
    """RoPE inverse frequencies per layer type; "proportional" partial RoPE on full layers (the rotated
    fraction of the head's angles gets theta's frequencies over the whole head dim, the rest frequency 0)."""
    a = cfg.arch
    hd = cfg.head_dim
    out = {"sliding": 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))}
    hd = a["full_head_dim"]
    n_rot = int(a.get("full_partial_rotary", 1.0) * hd // 2)
    rot = 1.0 / (a.get("full_rope_theta", cfg.rope_theta) ** (torch.arange(0, 2 * n_rot, 2, dtype=torch.int64).float() / hd))
    out["full"] = torch.cat((rot, torch.zeros(hd // 2 - n_rot)))
    return out


class Attention(nn.Module):
    def __init__(self, cfg, i: int):
        super().__init__()
        self.hd, self.n_kv, k_eq_v = layer_spec(cfg, i)
        self.n_heads = cfg.n_heads
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * self.hd, bias=False)
        self.k_proj = nn.Linear(cfg.dim, self.n_kv * self.hd, bias=False)
        self.v_proj = None if k_eq_v else nn.Linear(cfg.dim, self.n_kv * self.hd, bias=False)
        self.o_proj = nn.Linear(cfg.n_heads * self.hd, cfg.dim, bias=False)
        self.q_norm = RMSNorm(self.hd, cfg.norm_eps)
        self.k_norm = RMSNorm(self.hd, cfg.norm_eps)
        self.v_norm = RMSNorm(self.hd, cfg.norm_eps, scale=False)

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor | None, is_causal: bool,
                cache, layer: int, write: bool, lo: int = 0) -> Tensor:
        """lo: the cache slots before it are seen by no query (a sliding layer's window) and are left out of the
        keys; mask covers the keys from slot lo on."""
        B, T, _ = x.shape
        q = apply_rope(self.q_norm(self.q_proj(x).view(B, T, self.n_heads, self.hd)).transpose(1, 2), *rope)
        k = self.k_proj(x).view(B, T, self.n_kv, self.hd)
        v = k if self.v_proj is None else self.v_proj(x).view(B, T, self.n_kv, self.hd)
        k = apply_rope(self.k_norm(k).transpose(1, 2), *rope)  # (B, Hkv, T, hd)
        v = self.v_norm(v).transpose(1, 2)
        if cache is not None:
            start = cache.length
            ck, cv = cache.k[layer], cache.v[layer]  # (B, Hkv, capacity, hd)
            if write:
                ck[:, :, start:start + T] = k
                cv[:, :, start:start + T] = v
                k, v = ck[:, :, lo:start + T], cv[:, :, lo:start + T]
            else:
                k, v = torch.cat((ck[:, :, lo:start], k), 2), torch.cat((cv[:, :, lo:start], v), 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=1.0,
                                           enable_gqa=self.n_kv != self.n_heads)  # (B, H, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.hd))


class MLP(nn.Module):
    """GeGLU (gelu, tanh approximation)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Router(nn.Module):
    def __init__(self, dim: int, n_experts: int, top_k: int, eps: float):
        super().__init__()
        self.top_k, self.root = top_k, dim ** -0.5
        self.norm = RMSNorm(dim, eps, scale=False)
        self.proj = nn.Linear(dim, n_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(dim))
        self.per_expert_scale = nn.Parameter(torch.ones(n_experts))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x (N, D) -> weights (N, k), expert ids (N, k)."""
        probs = F.softmax(self.proj(self.norm(x) * self.scale * self.root), dim=-1, dtype=torch.float32)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        return w * self.per_expert_scale[idx], idx


class Experts(nn.Module):
    """Expert weights stored fused: gate_up_proj (E, 2I, D), down_proj (E, D, I). act: gelu_tanh (GeGLU, Gemma 4's) or
    silu (SwiGLU, dlm.moe's)."""

    def __init__(self, dim: int, n_experts: int, hidden: int, act: str = "gelu_tanh"):
        super().__init__()
        self.act = act
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, hidden))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)
        self.grouped = True  # False: the eager reference (a loop over experts, token by token slot)

    def expert(self, e: int, x: Tensor) -> Tensor:
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        gate = F.silu(gate) if self.act == "silu" else F.gelu(gate, approximate="tanh")
        return F.linear(gate * up, self.down_proj[e])

    def forward(self, x: Tensor, w: Tensor, idx: Tensor) -> Tensor:
        return (self.forward_grouped if self.grouped else self.forward_eager)(x, w, idx)

    def forward_eager(self, x: Tensor, w: Tensor, idx: Tensor) -> Tensor:
        """Reference: for each expert, the (token, slot) pairs routed to it, one at a time per expert."""
        out = torch.zeros_like(x)
        for e in range(self.gate_up_proj.shape[0]):
            tok, slot = torch.where(idx == e)
            if tok.numel():
                out.index_add_(0, tok, (self.expert(e, x[tok]) * w[tok, slot, None]).to(out.dtype))
        return out

    def forward_grouped(self, x: Tensor, w: Tensor, idx: Tensor) -> Tensor:
        """Tokens sorted by expert once (one argsort), one matmul pair per expert on its contiguous slice,
        weighted and scattered back with one index_add."""
        N, K = idx.shape
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (N*K,) slots grouped by expert
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        tok = order // K
        xs = x.index_select(0, tok)  # (N*K, D)
        ys = torch.empty_like(xs)
        s = 0
        for e, c in enumerate(counts):
            if c:
                ys[s:s + c] = self.expert(e, xs[s:s + c])
                s += c
        ys = ys * w.reshape(-1)[order, None].to(ys.dtype)
        return torch.zeros_like(x).index_add_(0, tok, ys)


class Block(nn.Module):
    def __init__(self, cfg, i: int):
        super().__init__()
        D, eps = cfg.dim, cfg.norm_eps
        self.kind = cfg.arch["layer_types"][i]
        self.self_attn = Attention(cfg, i)
        self.mlp = MLP(D, cfg.ffn_dim)
        self.input_layernorm = RMSNorm(D, eps)
        self.post_attention_layernorm = RMSNorm(D, eps)
        self.pre_feedforward_layernorm = RMSNorm(D, eps)
        self.post_feedforward_layernorm = RMSNorm(D, eps)
        self.register_buffer("layer_scalar", torch.ones(1))
        moe = cfg.arch.get("moe")
        self.router = self.experts = None
        if moe:
            self.router = Router(D, moe["n_experts"], moe["top_k"], eps)
            self.experts = Experts(D, moe["n_experts"], moe["ffn_dim"])
            self.post_feedforward_layernorm_1 = RMSNorm(D, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(D, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(D, eps)
        self.checkpointing = False

    def forward(self, x, rope, mask, is_causal, cache, layer, write, lo: int = 0) -> Tensor:
        x = x + self.post_attention_layernorm(
            self.self_attn(self.input_layernorm(x), rope, mask, is_causal, cache, layer, write, lo))
        h = self.mlp(self.pre_feedforward_layernorm(x))
        if self.router is not None:
            flat = x.reshape(-1, x.shape[-1])  # the router and experts read the residual stream
            w, idx = self.router(flat)
            m = self.experts(self.pre_feedforward_layernorm_2(flat), w, idx).reshape(x.shape)
            h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(m)
        return (x + self.post_feedforward_layernorm(h)) * self.layer_scalar


class KVCache:
    """One (B, n_kv_heads_i, capacity, head_dim_i) K/V buffer per layer; `length` valid slots; crop rolls back."""

    def __init__(self, cfg, batch: int, capacity: int, device, dtype):
        specs = [layer_spec(cfg, i) for i in range(cfg.n_layers)]
        self.k = [torch.zeros(batch, kv, capacity, hd, device=device, dtype=dtype) for hd, kv, _ in specs]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k[0].shape[2]

    def crop(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"crop({length}) outside [0, {self.length}]")
        self.length = length

    def reserve(self, n: int) -> None:
        if self.length + n > self.capacity:
            raise DlmError(f"KV cache full: {self.length} + {n} tokens > capacity {self.capacity}")


def sliding_mask(base: Tensor | None, full_mask: bool, T: int, L0: int, window: int,
                 device) -> Tensor:
    """The sliding layers' mask over keys [cache (L0) ; x (T)], slots as positions.

    Causal queries (slot L0 + i) see the keys of the last `window` slots up to themselves; a
    bidirectional block over a cached prefix (mask "full") sees the prefix's last window - 1 slots and
    the whole block (DiffusionGemma's decoder)."""
    S = L0 + T
    k = torch.arange(S, device=device)[None, :]
    if full_mask:
        band = (k >= L0 - (window - 1)).expand(T, S)
    else:
        q = torch.arange(T, device=device)[:, None] + L0
        band = (k > q - window) & (k <= q)
    band = band[None, None]
    return band if base is None else base & band


def run_blocks(model, x: Tensor, *, pos: Tensor | None, cache, mask, write: bool, ctx: Tensor | None,
               taps: Sequence[int], resolve_mask) -> tuple[Tensor, dict[int, Tensor]]:
    """The gemma4 layers over x (B, T, D). resolve_mask(mask, T, S, device) -> (bool mask or None, is_causal)
    is the backbone's mask builder (full-attention layers use it as is; sliding layers add their band)."""
    if ctx is not None:
        raise DlmError("context features (DFlash drafter injection) are not supported on a gemma4 backbone")
    B, T, _ = x.shape
    L0 = cache.length if cache is not None else 0
    if pos is None:
        pos = torch.arange(L0, L0 + T, device=x.device)
    if cache is not None:
        cache.reserve(T)
    p = pos if pos.dim() == 2 else pos[None]
    # RoPE tables per layer type, from the config (a few numbers: computed per call, nothing to move or load)
    ropes = {kind: rope_cos_sin(f.to(x.device), p, x.dtype) for kind, f in inv_freqs(model.cfg).items()}
    per_kind = isinstance(mask, LayerMasks)
    base, is_causal = resolve_mask(mask.full if per_kind else mask, T, L0 + T, x.device)
    window = model.cfg.arch["sliding_window"]
    masks = {"full": (base, is_causal)}
    if "sliding" in model.cfg.arch["layer_types"]:
        if per_kind:  # a training layout: the caller built the sliding layers' mask (dlm.masks)
            masks["sliding"] = (resolve_mask(mask.sliding, T, L0 + T, x.device)[0], False)
        elif isinstance(mask, Tensor):  # which keys form a canvas (seen whole) is not in a bool mask
            raise DlmError("a gemma4 backbone with sliding-window layers needs its sliding layers' mask beside a "
                           "bool mask (dlm.masks.LayerMasks); this layout has none yet")
        else:
            # the keys before the prefix's last window - 1 are seen by no query: left out (transformers' sliding
            # cache keeps no more, and a longer row of keys rounds differently)
            full = isinstance(mask, str) and mask == "full"
            lo = max(0, L0 - (window - 1))
            masks["sliding"] = (sliding_mask(base, full, T, L0, window, x.device)[..., lo:], False, lo)
    out_taps: dict[int, Tensor] = {}
    for i, block in enumerate(model.layers):
        m, c, *lo = masks[block.kind]
        x = block(x, ropes[block.kind], m, c, cache, i, write, *lo)
        if i in taps:
            out_taps[i] = x
    if cache is not None:
        cache.length = L0 + (T if write else 0)
    return x, out_taps


def softcap(logits: Tensor, cap: float | None) -> Tensor:
    return logits if not cap else torch.tanh(logits / cap) * cap


def embed_scale(cfg) -> float:
    return math.sqrt(cfg.dim)


def num_params(cfg) -> int:
    """Parameter count of a gemma4 backbone (without self-conditioning), from the config alone."""
    a, D = cfg.arch, cfg.dim
    moe = a.get("moe")
    total = cfg.vocab_size * D * (1 if cfg.tie_embeddings else 2) + D  # embeddings (+ head), final norm
    for i in range(cfg.n_layers):
        hd, kv, k_eq_v = layer_spec(cfg, i)
        attn = D * hd * (2 * cfg.n_heads + kv * (1 if k_eq_v else 2)) + 2 * hd
        layer = attn + 3 * D * cfg.ffn_dim + 4 * D
        if moe:
            E, I = moe["n_experts"], moe["ffn_dim"]
            layer += E * 3 * I * D + E * D + D + E + 3 * D  # experts, router (proj, scale, per-expert), 3 norms
        total += layer
    return total
