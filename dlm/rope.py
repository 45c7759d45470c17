"""Rotary position embeddings applied (rotate-half layout, in fp32 like transformers): shared by every backbone
family (dlm.model, dlm.gemma4); the frequency tables are each family's own."""

from __future__ import annotations

import torch
from torch import Tensor


def rope_cos_sin(inv_freq: Tensor, pos: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """pos (B, T) -> cos, sin (B, 1, T, hd), computed in fp32 like transformers."""
    freqs = pos.float()[..., None] * inv_freq.float()  # (B, T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
