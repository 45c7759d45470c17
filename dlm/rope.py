"""Rotary position embeddings applied (rotate-half layout, in fp32 like transformers); the frequency tables are the
backbone's (dlm.model.rope_inv_freq, one per layer kind)."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def rope_cos_sin(inv_freq: Tensor, pos: Tensor, dtype: torch.dtype, scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """pos (B, T) -> cos, sin (B, 1, T, hd), computed in fp32 like transformers; scale: YaRN's attention factor
    (both tables multiplied, so q.k scales by its square)."""
    freqs = pos.float()[..., None] * inv_freq.float()  # (B, T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


def yarn_inv_freq(hd: int, theta: float, rs: dict) -> Tensor:
    """YaRN (Peng et al. 2023): per frequency, a blend of the original (extrapolated) and the factor-divided
    (interpolated) frequency, by a linear ramp between the dimensions that turn beta_fast and beta_slow times
    over the original context."""
    factor, orig = float(rs["factor"]), int(rs["original_max_position_embeddings"])
    fast, slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:
        return hd * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, hd - 1)
    if low == high:
        high += 0.001
    base = theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ramp = ((torch.arange(hd // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return (1.0 / (factor * base)) * (1 - extrapolate) + (1.0 / base) * extrapolate


def rope_attention_factor(rs: dict | None) -> float:
    """YaRN's cos/sin scale: attention_factor if given, else 0.1 ln(factor) + 1 (with mscale / mscale_all_dim,
    their ratio); 1 for other kinds of RoPE."""
    if not rs or rs.get("rope_type", rs.get("type")) != "yarn":
        return 1.0
    if rs.get("attention_factor") is not None:
        return float(rs["attention_factor"])
    factor = float(rs["factor"])

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if rs.get("mscale") and rs.get("mscale_all_dim"):
        return mscale(rs["mscale"]) / mscale(rs["mscale_all_dim"])
    return mscale()


def query_scale(rs: dict | None, pos: Tensor) -> Tensor | None:
    """Llama 4's attention temperature (Ministral 3 uses it): queries x (1 + beta ln(1 + floor(pos / n))), n the
    original context; (B, 1, T, 1) or None without it."""
    beta = (rs or {}).get("llama_4_scaling_beta")
    if not beta:
        return None
    n = rs["original_max_position_embeddings"]
    return (1 + beta * torch.log(1 + torch.floor(pos.float() / n)))[:, None, :, None]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (..., hd); cos, sin (..., r): the first r dimensions turn, the rest pass (partial rotary when r < hd)."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
