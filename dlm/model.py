"""The backbone: one decoder that every paradigm and every family shares.

A family is a set of ModelConfig fields, not a class: the Qwen3/Llama block by default, Gemma 4's layers
(sliding and full layer types with their own head dims, KV heads and RoPE, K = V, sandwich norms, GeGLU,
experts beside the MLP, layer scalars, soft-cap) and LLaDA 2's experts by their fields. One RMSNorm, one
gated MLP, one Attention, one Block, one KVCache and one run_blocks serve them all.

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

Parameter names match transformers' Qwen3/Llama modules (and Gemma 4's) without the `model.` prefix, so
import/export is a rename (dlm.hf, dlm.hf_gemma).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from dlm import kernels, moe
from dlm.config import ModelConfig
from dlm.errors import DlmError
from dlm.masks import LayerMasks, Mask, sdpa_mask, sliding_band
from dlm.rope import apply_rope, query_scale, rope_attention_factor, rope_cos_sin, yarn_inv_freq


class RMSNorm(nn.Module):
    """x / rms(x) x weight. upcast (Gemma): the weight multiplies in fp32, then the cast; else (Llama, Qwen) the
    normed x is cast, then scaled. scale=False: no weight."""

    def __init__(self, dim: int, eps: float = 1e-6, scale: bool = True, upcast: bool = False):
        super().__init__()
        self.eps, self.upcast = eps, upcast
        self.weight = nn.Parameter(torch.ones(dim)) if scale else None

    def forward(self, x: Tensor) -> Tensor:
        if self.upcast:
            h = x.float()
            h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
            return (h if self.weight is None else h * self.weight.float()).type_as(x)
        if x.dtype == torch.float32:  # one fused kernel; same arithmetic as below
            return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)
        dtype = x.dtype  # half precision: normalise in fp32 like transformers, then scale
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = x.to(dtype)
        return x if self.weight is None else self.weight * x


def norm(cfg: ModelConfig, dim: int, scale: bool = True) -> RMSNorm:
    return RMSNorm(dim, cfg.norm_eps, scale, cfg.norm_upcast)


def rope_inv_freq(cfg: ModelConfig, kind: str = "full") -> Tensor:
    """The RoPE inverse frequencies of one layer kind: (rotated dims / 2,), or (head_dim / 2,) with zeros past the
    turned fraction for Gemma 4's proportional RoPE of the full layers (full_rotary)."""
    spec = cfg.layer(cfg.layer_types.index(kind) if kind in cfg.layer_types else 0)
    theta = (cfg.full_rope_theta or cfg.rope_theta) if kind == "full" else cfg.rope_theta
    if kind == "full" and cfg.full_rotary < 1:  # proportional: frequencies over the whole head, the first ones turn
        hd = spec.head_dim
        n = int(cfg.full_rotary * hd // 2)
        rot = 1.0 / (theta ** (torch.arange(0, 2 * n, 2, dtype=torch.int64).float() / hd))
        return torch.cat((rot, torch.zeros(hd // 2 - n)))
    hd = int(spec.head_dim * cfg.partial_rotary)  # the rotated dimensions (partial rotary: the first ones)
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))  # (hd/2,)
    rs = cfg.rope_scaling or {}
    if rs.get("rope_type", rs.get("type")) == "yarn":
        return yarn_inv_freq(hd, theta, rs)
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
    """Static K/V buffers of every layer, rows at dim -4 and slots at dim -2: one (n_layers, B, n_kv_heads, capacity,
    head_dim) tensor each for K and V when the layers' shapes agree, else one (B, n_kv_heads_i, capacity, head_dim_i)
    per layer (Gemma 4's sliding and full layers, or `per_layer`: a compiled step writes a buffer of its own in place,
    where a write into a view of the stacked one copies the whole stack); `k[i]` is layer i's either way.

    `length` slots are valid. `update` writes at `length`; `crop(n)` rolls back to n slots.
    Slots need not equal positions (positions are baked into the keys by RoPE).

    `slot`, when set (a (T,) long tensor on the cache's device, or (B, T): each row's own), is where a step of T tokens
    writes instead, and every slot is attended to (the caller's mask hides the unwritten ones): no Python number decides a shape or an offset, so the
    step can be captured once as a CUDA graph and replayed (dlm.sampling.graphs).
    """

    def __init__(self, cfg: ModelConfig, batch: int, capacity: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, fill: bool = True, per_layer: bool = False):
        """fill=False: the buffers are left unfilled (torch.empty); the caller keeps unwritten slots from being read."""
        shapes = [cfg.layer(i)[1:3] for i in range(cfg.n_layers)]  # (head_dim, n_kv_heads)
        make = torch.zeros if fill else torch.empty
        if len(set(shapes)) == 1 and not per_layer:
            hd, kv = shapes[0]
            self.k = make((cfg.n_layers, batch, kv, capacity, hd), device=device, dtype=dtype)
            self.v = make(self.k.shape, device=device, dtype=dtype)
        else:
            self.k = [make(batch, kv, capacity, hd, device=device, dtype=dtype) for hd, kv in shapes]
            self.v = [make(k.shape, device=device, dtype=dtype) for k in self.k]
        self.length = 0
        self.slot: Tensor | None = None

    @classmethod
    def over(cls, k: Tensor | list[Tensor], v: Tensor | list[Tensor], length: int) -> KVCache:
        """A cache over these buffers (no copy: writes land in them)."""
        cache = cls.__new__(cls)
        cache.k, cache.v, cache.length, cache.slot = k, v, length, None
        return cache

    def buffers(self) -> list[Tensor]:
        """Every K and V buffer (rows at dim -4, slots at dim -2)."""
        return [self.k, self.v] if isinstance(self.k, Tensor) else [*self.k, *self.v]

    def map(self, f: Callable[[Tensor], Tensor], length: int | None = None) -> KVCache:
        """A cache over f of each buffer (f a view, such as some rows: writes land in this cache's buffers), `length`
        slots valid (default this one's)."""
        def each(x):
            return f(x) if isinstance(x, Tensor) else [f(t) for t in x]

        return KVCache.over(each(self.k), each(self.v), self.length if length is None else length)

    @property
    def rows(self) -> int:
        return self.k[0].shape[-4] if isinstance(self.k, list) else self.k.shape[-4]

    @property
    def capacity(self) -> int:
        return self.k[0].shape[-2]

    def crop(self, length: int, take: tuple[int, int] | None = None) -> None:
        """Back to the first `length` slots; take (src, dst): the slots src.. first copied to dst..length-1 (within
        the slots written)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"crop({length}) outside [0, {self.length}]")
        if take is not None:
            src, dst = take
            n = length - dst
            if not (0 <= dst <= length and n >= 0 and src + n <= self.length):
                raise ValueError(f"crop({length}, take={take}) outside the {self.length} slots written")
            for t in self.buffers():
                t[..., dst:length, :] = t[..., src:src + n, :].clone()
        self.length = length

    def reserve(self, n: int) -> None:
        if self.length + n > self.capacity:
            raise DlmError(f"KV cache full: {self.length} + {n} tokens > capacity {self.capacity}")

    def update(self, layer: int, k: Tensor, v: Tensor, write: bool, kc: Tensor | None = None,
               vc: Tensor | None = None, lo: int = 0) -> tuple[Tensor, Tensor]:
        """Layer `layer`'s keys and values to attend to: the cache's slots lo..length-1 (lo: the slots before are
        seen by no query), the context's K/V kc, vc (B, Hkv, C, hd: always kept, from slot `length`), then this call's
        k, v (B, Hkv, T, hd), kept when `write`."""
        ck, cv = self.k[layer], self.v[layer]  # (B, Hkv, capacity, hd)
        if self.slot is not None:  # a step at the slot tensor, over every slot (the class docstring)
            k, v = k.to(ck.dtype), v.to(cv.dtype)  # (a cache of another dtype: index_put_ does not cast)
            if self.slot.dim() == 2:  # (B, T): each row's own slots (the row batch's step, dlm.sampling.graphs)
                b = torch.arange(ck.shape[0], device=ck.device)[:, None]  # (B, 1)
                ck[b, :, self.slot] = k.transpose(1, 2)  # (B, T, Hkv, hd) at [b, :, slot[b, t]]
                cv[b, :, self.slot] = v.transpose(1, 2)
            else:
                ck[:, :, self.slot] = k  # (index_put_: a compiled step writes it in place, gpt-fast's habit)
                cv[:, :, self.slot] = v
            return ck, cv
        start = self.length
        if kc is not None:
            C = kc.shape[2]
            ck[:, :, start:start + C] = kc
            cv[:, :, start:start + C] = vc
            start += C
        if write:
            T = k.shape[2]
            ck[:, :, start:start + T] = k
            cv[:, :, start:start + T] = v
            return ck[:, :, lo:start + T], cv[:, :, lo:start + T]
        return torch.cat((ck[:, :, lo:start], k), 2), torch.cat((cv[:, :, lo:start], v), 2)  # (cat promotes dtypes)


class Attention(nn.Module):
    """Grouped-query attention of layer i (ModelConfig.layer: its head dim, KV heads, K = V). row_kernel: a compiled
    one-token step calls dlm's row attention kernel (graphs.row_attention sets it where the kernel is built)."""

    row_kernel = False

    def __init__(self, cfg: ModelConfig, i: int = 0):
        super().__init__()
        _, self.hd, self.n_kv, k_eq_v, _ = cfg.layer(i)
        self.n_heads = cfg.n_heads
        self.scale = cfg.attn_scale or self.hd ** -0.5
        bias = cfg.attn_bias  # Qwen2: q, k and v carry a bias, o does not
        self.q_proj = nn.Linear(cfg.dim, cfg.n_heads * self.hd, bias=bias)
        self.k_proj = nn.Linear(cfg.dim, self.n_kv * self.hd, bias=bias)
        self.v_proj = None if k_eq_v else nn.Linear(cfg.dim, self.n_kv * self.hd, bias=bias)
        self.o_proj = nn.Linear(cfg.n_heads * self.hd, cfg.dim, bias=False)
        if cfg.qk_norm:
            self.q_norm = norm(cfg, self.hd)
            self.k_norm = norm(cfg, self.hd)
        else:
            self.q_norm = self.k_norm = None
        self.v_norm = norm(cfg, self.hd, scale=False) if cfg.v_norm else None

    def project_kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        B, T, _ = x.shape
        k = self.k_proj(x).view(B, T, self.n_kv, self.hd)
        v = k if self.v_proj is None else self.v_proj(x).view(B, T, self.n_kv, self.hd)
        if self.k_norm is not None:
            k = self.k_norm(k)
        k = apply_rope(k.transpose(1, 2), cos, sin)  # (B, Hkv, T, hd)
        if self.v_norm is not None:
            v = self.v_norm(v)
        return k, v.transpose(1, 2)

    def forward(
        self, x: Tensor, rope: tuple[Tensor, ...], mask: Tensor | None, is_causal: bool,
        cache: KVCache | None, layer: int, write: bool,
        ctx: Tensor | None, ctx_rope: tuple[Tensor, ...] | None, lo: int = 0,
    ) -> Tensor:
        """lo: the cache slots before it are seen by no query (a sliding layer's window) and are left out of the keys;
        mask covers the keys from slot lo on."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.hd)
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = apply_rope(q.transpose(1, 2), rope[0], rope[1])  # (B, H, T, hd)
        if len(rope) > 2:  # the queries' attention temperature by position (rope_scaling llama_4_scaling_beta)
            q = q * rope[2].to(q.dtype)
        k, v = self.project_kv(x, rope[0], rope[1])  # (B, Hkv, T, hd)
        kc = vc = None
        if ctx is not None:
            kc, vc = self.project_kv(ctx, ctx_rope[0], ctx_rope[1])  # (B, Hkv, C, hd)
        if cache is not None:  # context K/V always persist in the cache
            k, v = cache.update(layer, k, v, write, kc, vc, lo)  # (in the cache's dtype: the row batch's may be
            # bfloat16 under float32 weights, Transformer.kv_dtype)
        elif ctx is not None:
            k, v = torch.cat((kc, k), 2), torch.cat((vc, v), 2)
        # one query per row in a compiled step: the query heads that share a K/V head as that head's G queries, so the
        # attention kernel reads each K/V head once rather than once per query head (the same sums; ar-mid's compiled
        # step 2-5% faster at 4-16 rows, docs/log/batching.md)
        rows = (T == 1 and (self.n_kv != self.n_heads or self.row_kernel) and not is_causal
                and (mask is None or mask.shape[1] == 1) and torch.compiler.is_compiling())
        # there, dlm's CPU kernel (dlm/kernels/row_attention.cpp): each row's allowed K, then V slots streamed once;
        # SDPA reads them at half that speed here (ar-mid's 16-row step, docs/log/batching.md); it widens K/V kept in
        # bfloat16 as it reads them
        kernel = (rows and self.row_kernel and mask is not None and mask.dtype == torch.bool and mask.dim() == 4
                  and mask.shape[0] == B == k.shape[0] and mask.shape[-1] == k.shape[2]
                  and q.dtype in (torch.float32, torch.float64)
                  and (k.dtype == q.dtype or (q.dtype == torch.float32 and k.dtype == torch.bfloat16)))
        if not kernel:  # (a cache of another dtype, Transformer.kv_dtype; no copy when it holds q's)
            k, v = k.to(q.dtype), v.to(q.dtype)
        if rows:
            qg = q.reshape(B, self.n_kv, self.n_heads // self.n_kv, self.hd)
            if kernel:
                y = torch.ops.dlm.row_attention(qg, k, v, mask, self.scale)
            else:
                y = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=self.scale)
            y = y.reshape(B, self.n_heads, 1, self.hd)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=is_causal, scale=self.scale, enable_gqa=self.n_kv != self.n_heads
            )  # (B, H, T, hd)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.n_heads * self.hd))


BLOCKED_ROWS = 16  # rows up to which a blocked weight's product (dlm.kernels.blocked_linear) beats MKL's here


class PackedLinear(nn.Module):
    """A linear layer (inference only) whose weight also sits in a layout that a product of a few rows reads at the
    machine's speed, where MKL's float32 product of 2-16 rows of `F.linear` (the weight transposed) costs 2-4x one row
    on an AVX2 CPU (docs/log/batching.md). layout "blocked": dlm's own kernel (dlm/kernels/blocked_linear.cpp) over the
    weight cut into blocks of 16 output columns, each one sequential stream, for 1-16 rows of float32 in eager
    forwards (ar-mid's decoding step 1.4x faster than over column-major weights, a verify of 4 tokens 1.4x; each
    row's sums in the same order whatever the rows beside it; docs/log/dflash.md); "onednn": a large weight in
    oneDNN's blocked layout; "transposed": a small one (oneDNN's ~20 us per call would lose) transposed and contiguous,
    for a plain `x @ W^T` product (1.3-1.5x F.linear at 2-8 rows of ar-mid's 256-640 wide layers). Past those (more
    rows, another dtype), one row under "onednn" and "transposed", and a traced forward (torch.compile) keep F.linear.
    The weight and bias are the layer's own (tied weights stay tied); the copy is extra memory, the size of the
    weight."""

    def __init__(self, lin: nn.Linear, layout: str = "onednn"):
        super().__init__()
        if layout not in ("onednn", "transposed", "blocked"):
            raise ValueError(f"PackedLinear layout must be onednn, transposed or blocked, got {layout!r}")
        self.weight, self.bias = lin.weight, lin.bias
        w = lin.weight.detach()
        # (none is a buffer: not saved)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, 16) if layout == "onednn" else None
        self.wt = w.t().contiguous() if layout == "transposed" else None  # (in, out)
        self.blocked = kernels.blocked_weight(w) if layout == "blocked" else None  # (out / 16, in, 16)

    def forward(self, x: Tensor) -> Tensor:
        # (a traced step: F.linear, whose product inductor chooses; a branch on the rows here would guard the row
        # count the compiled row step leaves dynamic)
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return F.linear(x, self.weight, self.bias)
        if self.blocked is not None:
            if x.dtype != torch.float32 or x.numel() > BLOCKED_ROWS * x.shape[-1]:
                return F.linear(x, self.weight, self.bias)
            y = torch.ops.dlm.blocked_linear(x.reshape(-1, x.shape[-1]), self.blocked)
            y = y.view(*x.shape[:-1], y.shape[-1])
            return y if self.bias is None else y + self.bias
        if x.numel() == x.shape[-1]:
            return F.linear(x, self.weight, self.bias)
        if self.packed is None:
            y = x @ self.wt
            return y if self.bias is None else y + self.bias
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module, min_elements: int = 1 << 20, min_transposed: int = 1 << 14,
                 blocked: bool = False) -> int:
    """Every linear layer of a model for inference, float32 or bfloat16 on a CPU, as a PackedLinear: with `blocked`, a
    float32 one with a multiple of 16 outputs in dlm's blocked layout (where its kernel builds: `dlm bench --blocked`);
    else in oneDNN's layout from `min_elements` weights on, transposed from `min_transposed` (0: none); the number
    packed."""
    todo = [(parent, name, m) for parent in model.modules() for name, m in parent.named_children()
            if type(m) is nn.Linear and m.weight.device.type == "cpu"
            and m.weight.dtype in (torch.float32, torch.bfloat16)]
    n = 0
    for parent, name, m in todo:
        size = m.weight.numel()
        if (blocked and m.weight.dtype == torch.float32 and m.weight.shape[0] % 16 == 0
                and kernels.blocked_linear()):
            setattr(parent, name, PackedLinear(m, "blocked"))
        elif size >= min_elements and torch.backends.mkldnn.is_available():
            setattr(parent, name, PackedLinear(m))
        elif min_transposed and size >= min_transposed:
            setattr(parent, name, PackedLinear(m, "transposed"))
        else:
            continue
        n += 1
    return n


def column_major(model: nn.Module) -> int:
    """Every linear layer's weight (float32, on a CPU) stored column-major: the same (out, in) tensor, its transpose
    contiguous, so that F.linear's product is MKL's plain one rather than its transposed one. A forward of 4-16 new
    tokens then costs much less relative to one (ar-mid at one AVX2 thread: 8 tokens 1.5x -> 1.2x one token, which
    is what a speculative verify pays; docs/log/dflash.md), one token about the same. Decoding only: the values are
    the same, the products' rounding is not bit-identical to the row-major ones, and a checkpoint is written from
    row-major weights. A weight shared with an embedding (a tied LM head) stays as it is; a PackedLinear is left
    alone. (`pack_linears(blocked=True)`, the bench's --blocked, keeps a copy beside the weight instead: dlm's blocked
    layout, faster than this one from one row to 16 in eager forwards, at the cost of the copy's memory; this replaces
    the weight for every row count.) The number relaid."""
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    n = 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        if (type(m) is nn.Linear and id(w) not in tied and w.device.type == "cpu" and w.dtype == torch.float32
                and w.is_contiguous()):
            m.weight = nn.Parameter(w.detach().t().contiguous().t(), requires_grad=w.requires_grad)
            n += 1
    return n


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class MLP(nn.Module):
    """The gated MLP: down(act(gate(x)) * up(x)); act silu (SwiGLU) or gelu_tanh (GeGLU)."""

    def __init__(self, dim: int, hidden: int, act: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.act = ACTIVATIONS[act]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Decoder layer i, its shape from the config:

    pre-norm (Qwen3/Llama)   x + attn(norm(x)); x + mlp(norm(x))
    sandwich (Gemma)         x + norm(attn(norm(x))); x + norm(mlp(norm(x)) [+ the softmax router's experts]) [x scalar]

    The MLP is a mixture of experts in the sigmoid and topk routers' layers (MoEConfig.replaces_mlp). Context
    features enter raw."""

    def __init__(self, cfg: ModelConfig, i: int = 0):
        super().__init__()
        D, m = cfg.dim, cfg.moe
        self.kind, self.window = cfg.layer(i).kind, cfg.layer(i).window
        self.input_layernorm = norm(cfg, D)
        self.self_attn = Attention(cfg, i)
        self.post_attention_layernorm = norm(cfg, D)
        act = ACTIVATIONS[cfg.mlp_act]
        if moe.is_moe_layer(cfg, i):
            self.mlp = moe.SparseMoE(D, m, lambda hidden: MLP(D, hidden, cfg.mlp_act), act)
        else:
            self.mlp = MLP(D, cfg.ffn_dim, cfg.mlp_act)
        self.sandwich = cfg.sandwich_norm
        if self.sandwich:
            self.pre_feedforward_layernorm = norm(cfg, D)
            self.post_feedforward_layernorm = norm(cfg, D)
        self.router = self.experts = None
        if m is not None and m.router == "softmax":  # experts beside the MLP, each branch normed
            self.router = moe.SoftmaxRouter(D, m, norm(cfg, D, scale=False))
            self.experts = moe.Experts(D, m.n_experts, m.ffn_dim, act)
            self.post_feedforward_layernorm_1 = norm(cfg, D)
            self.post_feedforward_layernorm_2 = norm(cfg, D)
            self.pre_feedforward_layernorm_2 = norm(cfg, D)
        if cfg.layer_scalar:
            self.register_buffer("layer_scalar", torch.ones(1))
        else:
            self.layer_scalar = None
        self.checkpointing = False  # activation checkpointing: recompute this layer in the backward pass

    def forward(self, x, rope, mask, is_causal, cache, layer, write, ctx=None, ctx_rope=None, lo=0) -> Tensor:
        if self.checkpointing and cache is None and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self.layer, x, rope, mask, is_causal, None, layer, write, ctx,
                                                     ctx_rope, use_reentrant=False)
        return self.layer(x, rope, mask, is_causal, cache, layer, write, ctx, ctx_rope, lo)

    def layer(self, x, rope, mask, is_causal, cache, layer, write, ctx=None, ctx_rope=None, lo=0) -> Tensor:
        h = self.self_attn(self.input_layernorm(x), rope, mask, is_causal, cache, layer, write, ctx, ctx_rope, lo)
        if not self.sandwich:
            x = x + h
            x = x + self.mlp(self.post_attention_layernorm(x))
        else:
            x = x + self.post_attention_layernorm(h)
            h = self.mlp(self.pre_feedforward_layernorm(x))
            if self.router is not None:
                flat = x.reshape(-1, x.shape[-1])  # the router and experts read the residual stream
                w, idx = self.router(flat)
                e = self.experts(self.pre_feedforward_layernorm_2(flat), w, idx).reshape(x.shape)
                h = self.post_feedforward_layernorm_1(h) + self.post_feedforward_layernorm_2(e)
            x = x + self.post_feedforward_layernorm(h)
        return x if self.layer_scalar is None else x * self.layer_scalar


class SelfConditioning(nn.Module):
    """DiffusionGemma-style self-conditioning of canvas embeddings.

    soft = softmax(previous logits) @ E (zero on a canvas's first step);
    x = RMSNorm_noscale(token_embeddings + GatedMLP(RMSNorm(soft))) * cfg.canvas_rms.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = norm(cfg, cfg.dim)
        self.mlp = MLP(cfg.dim, cfg.ffn_dim, cfg.mlp_act)
        self.out_norm = norm(cfg, cfg.dim, scale=False)
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
    blocks: Sequence[Block], inv_freq: Tensor | dict[str, Tensor], x: Tensor, *, pos: Tensor | None = None,
    cache: KVCache | None = None, mask: Mask = "causal", write: bool = True,
    ctx: Tensor | None = None, ctx_pos: Tensor | None = None, taps: Sequence[int] = (),
    rope_scaling: dict | None = None,
) -> tuple[Tensor, dict[int, Tensor]]:
    """Run a stack of decoder layers over x (B, T, D); the one attention code path of dlm.

    inv_freq: the RoPE frequencies of every layer, or one table per layer kind ({"full": ..., "sliding": ...}).
    rope_scaling: the model's (YaRN's attention factor, the queries' temperature by position); inv_freq already
    holds its frequencies. Sliding-window layers see `mask` within their band (dlm.masks.sliding_band, slots as
    positions), or the sliding mask of a LayerMasks."""
    B, T, _ = x.shape
    static = cache is not None and cache.slot is not None  # a step over every slot (KVCache.slot)
    # (a slot step reads no Python length: its caller reserves, sets the slot and advances the length, so a compiled
    # step does not specialise on it)
    L0 = cache.length if cache is not None and not static else 0
    C = ctx.shape[1] if ctx is not None else 0
    if pos is None:
        pos = torch.arange(L0 + C, L0 + C + T, device=x.device)
    if cache is not None and not static:
        cache.reserve(C + T)
    freqs = inv_freq if isinstance(inv_freq, dict) else {"full": inv_freq}
    factor = rope_attention_factor(rope_scaling)
    p = pos if pos.dim() == 2 else pos[None]
    qs = query_scale(rope_scaling, p)
    kinds = {b.kind for b in blocks}
    ropes = {}
    for kind in kinds:
        rope = rope_cos_sin(freqs[kind], p, x.dtype, factor)
        ropes[kind] = rope if qs is None else (*rope, qs)
    ctx_rope = None
    if ctx is not None:
        if ctx_pos is None:
            raise ValueError("ctx needs ctx_pos")
        if "sliding" in kinds:
            raise DlmError("context features (DFlash drafter injection) are not supported with sliding-window layers")
        ctx_rope = rope_cos_sin(freqs["full"], ctx_pos if ctx_pos.dim() == 2 else ctx_pos[None], x.dtype, factor)
    layered = isinstance(mask, LayerMasks)
    if static:
        if C or "sliding" in kinds or not write or not isinstance(mask, Tensor):
            raise DlmError("a cache step at a slot tensor takes a bool mask over every slot, writes, and has no "
                           "context features or sliding-window layers")
        masks = {"full": (sdpa_mask(mask, T, cache.capacity, x.device)[0], False, 0)}
    else:
        masks = layer_masks(blocks, kinds, mask, layered, T, L0, C, x.device)
    out_taps: dict[int, Tensor] = {}
    for i, block in enumerate(blocks):
        m, c, lo = masks[block.kind]
        x = block(x, ropes[block.kind], m, c, cache, i, write, ctx, ctx_rope, lo)
        if i in taps:
            out_taps[i] = x
    if cache is not None and not static:  # (a slot step's caller advances the length)
        cache.length = L0 + C + (T if write else 0)
    return x, out_taps


def layer_masks(blocks, kinds, mask, layered: bool, T: int, L0: int, C: int, device) -> dict:
    """Each layer kind's (SDPA mask, is_causal, lo: the first cache slot any query sees) for a forward of T
    queries after L0 cached slots and C context slots."""
    attn_mask, is_causal = sdpa_mask(mask.full if layered else mask, T, L0 + C + T, device)
    masks = {"full": (attn_mask, is_causal, 0)}  # (mask, is_causal, lo: the first cache slot any query sees)
    if "sliding" in kinds:
        if layered:  # a training layout: the caller built the sliding layers' mask (dlm.masks)
            masks["sliding"] = (sdpa_mask(mask.sliding, T, L0 + T, device)[0], False, 0)
        elif isinstance(mask, Tensor):  # which keys form a canvas (seen whole) is not in a bool mask
            raise DlmError("a backbone with sliding-window layers needs its sliding layers' mask beside a "
                           "bool mask (dlm.masks.LayerMasks); this layout has none yet")
        else:  # slots are positions: query i at slot L0 + i; a "full" block over the cache starts at slot L0
            window = next(b.window for b in blocks if b.kind == "sliding")
            q = torch.arange(L0, L0 + T, device=device)[:, None]
            band = sliding_band(q, torch.arange(L0 + T, device=device)[None], window,
                                L0 if mask == "full" else None)[None, None]  # (1, 1, T, S)
            # the keys before the cache's last window - 1 are seen by no query: left out (transformers' sliding cache
            # keeps no more, and a longer row of keys rounds differently)
            lo = max(0, L0 - (window - 1))
            masks["sliding"] = ((band if attn_mask is None else attn_mask & band)[..., lo:], False, lo)
    return masks


def softcap(logits: Tensor, cap: float) -> Tensor:
    """cap x tanh(logits / cap) (Gemma's final soft-cap, in the logits' dtype as transformers'); cap 0: as is."""
    return torch.tanh(logits / cap) * cap if cap else logits


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


def block_shapes(cfg: ModelConfig, prefix: str, i: int = 0) -> dict[str, tuple[int, ...]]:
    """Name -> shape of the tensors of Block(cfg, i), read from one built on the meta device (allocates nothing)."""
    with torch.device("meta"):
        b = Block(cfg, i)
    return {prefix + k: tuple(v.shape) for k, v in b.state_dict().items()}


def param_shapes(cfg: ModelConfig) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Name -> shape of every tensor of a Transformer(cfg), read from the model built on the meta device (allocates
    nothing, so a config.json can be held against its weights' header first), and the aliases of tied tensors
    (lm_head.weight -> embed_tokens.weight). tests hold this to the state_dict of built models."""
    with torch.device("meta"):
        m = Transformer(cfg)
    out = {k: tuple(v.shape) for k, v in m.state_dict().items() if k != "lm_head.weight" or not cfg.tie_embeddings}
    return out, ({"lm_head.weight": "embed_tokens.weight"} if cfg.tie_embeddings else {})


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
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = norm(cfg, cfg.dim)
        self.embed_scale = cfg.embed_scale  # Gemma: embeddings (and soft inputs) x sqrt(D)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.self_cond = SelfConditioning(cfg) if cfg.self_cond else None
        self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.dim) if cfg.learned_pos else None  # GPT-2's, beside RoPE
        self.grid_embed = GridEmbedding(cfg.grid_pos, cfg.dim) if cfg.grid_pos else None
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        if "sliding" in cfg.layer_types:
            self.register_buffer("inv_freq_sliding", rope_inv_freq(cfg, "sliding"), persistent=False)
        init_weights(self, cfg.n_layers)

    @property
    def freqs(self) -> dict[str, Tensor]:
        """The RoPE frequencies of each layer kind (run_blocks)."""
        if "sliding" in self.cfg.layer_types:
            return {"full": self.inv_freq, "sliding": self.inv_freq_sliding}
        return {"full": self.inv_freq}

    def new_cache(self, batch: int, capacity: int | None = None, dtype: torch.dtype | None = None,
                  fill: bool = True, per_layer: bool = False) -> KVCache:
        p = self.embed_tokens.weight
        return KVCache(self.cfg, batch, capacity or self.cfg.max_seq_len, p.device, dtype or self.kv_dtype or p.dtype,
                       fill, per_layer)

    # what the row batch (dlm.sampling.rows) asks of a model it serves: rows_batchable, rows_cache, rows_band,
    # rows_forward (a DFlash drafter answers the same four)
    rows_batchable = True
    rows_static = True  # its rows' one-token steps can run as one static step (dlm.sampling.graphs.RowsStep)
    # the dtype of the K/V caches the model makes (None: the weights'): bfloat16 under float32 weights halves their
    # memory (`dlm serve --kv-dtype bfloat16`); keys and values are then rounded to bfloat16, so the tokens are those
    # of the model with that cache, not always the float32 cache's
    kv_dtype: torch.dtype | None = None

    def rows_cache(self, rows: int, capacity: int, fill: bool = True, per_layer: bool = False) -> KVCache:
        return self.new_cache(rows, capacity, fill=fill, per_layer=per_layer)

    @property
    def rows_band(self) -> int:
        """The sliding-window layers' window (0: none)."""
        return self.cfg.sliding_window if "sliding" in self.cfg.layer_types else 0

    def rows_forward(self, x: Tensor | None, embeds: Tensor | None, pos: Tensor, cache: KVCache, mask, write: bool,
                     ctx: Tensor | None, ctx_pos: Tensor | None, taps: tuple[int, ...]) -> tuple[Tensor, dict]:
        """One forward of rows: the final hidden states (B, T, D) and the taps."""
        out = self(x, embeds=embeds, pos=pos, cache=cache, mask=mask, write=write, ctx=ctx, ctx_pos=ctx_pos, taps=taps,
                   head=False)
        return out.last, out.taps

    def embed(self, tokens: Tensor) -> Tensor:
        """Token embeddings (B, T) -> (B, T, D), times the config's embed_scale."""
        x = self.embed_tokens(tokens)
        return x * self.embed_scale if self.embed_scale != 1.0 else x

    def head(self, h: Tensor) -> Tensor:
        """Logits of final normed hidden states (..., D) -> (..., V): the LM head, then the soft-cap."""
        return softcap(self.lm_head(h), self.cfg.logit_softcap)

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
        x = self.embed(tokens) if embeds is None else embeds  # (B, T, D)
        if self.pos_embed is not None or self.grid_embed is not None:  # absolute positions (learned_pos, grid_pos)
            if pos is None:
                start = (cache.length if cache is not None else 0) + (ctx.shape[1] if ctx is not None else 0)
                pos = torch.arange(start, start + x.shape[1], device=x.device)
            if self.pos_embed is not None:
                x = x + self.pos_embed(pos)  # (T, D) or (B, T, D)
            if self.grid_embed is not None:
                x = x + self.grid_embed(pos)
        x, out_taps = run_blocks(self.layers, self.freqs, x, pos=pos, cache=cache, mask=mask, write=write,
                                 ctx=ctx, ctx_pos=ctx_pos, taps=taps, rope_scaling=self.cfg.rope_scaling)
        last = self.norm(x)
        return Output(self.head(last) if head else None, last, out_taps)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
