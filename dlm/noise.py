"""Forward processes of discrete diffusion: time sampling and corruption.

One time t per example, t ~ U(eps, 1 - eps), linear schedule: each token is corrupted with
probability t. Mask (absorbing) corruption replaces it with <mask>; uniform corruption replaces it
with a token drawn uniformly from the whole vocabulary (which may be the token itself).
"""

from __future__ import annotations

import torch
from torch import Tensor

EPS = 1e-3


def sample_t(batch: int, gen: torch.Generator, device: torch.device | str, eps: float = EPS) -> Tensor:
    """(B,) times in [eps, 1 - eps]."""
    u = torch.rand(batch, generator=gen, device=device)
    return eps + (1 - 2 * eps) * u


def corrupt_positions(shape: tuple[int, ...], t: Tensor, gen: torch.Generator) -> Tensor:
    """Bool (B, T): True where a token is corrupted, with probability t[b] (t (B,)) or t[b, i] (t (B, T))."""
    u = torch.rand(shape, generator=gen, device=t.device)
    return u < (t if t.dim() == len(shape) else t.view(-1, *([1] * (len(shape) - 1))))


def mask_corrupt(x: Tensor, t: Tensor, mask_id: int, gen: torch.Generator,
                 corruptible: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Absorbing corruption. Returns (x_t, corrupted bool)."""
    where = corrupt_positions(tuple(x.shape), t, gen)
    if corruptible is not None:
        where &= corruptible
    return torch.where(where, torch.full_like(x, mask_id), x), where


def uniform_corrupt(x: Tensor, t: Tensor, vocab_size: int, gen: torch.Generator,
                    corruptible: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Uniform-state corruption. Returns (x_t, replaced bool) (a replacement may equal the original)."""
    where = corrupt_positions(tuple(x.shape), t, gen)
    if corruptible is not None:
        where &= corruptible
    noise = torch.randint(0, vocab_size, x.shape, generator=gen, device=x.device)
    return torch.where(where, noise, x), where
