"""Autoregressive next-token prediction: the baseline and the target of speculation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dlm.objectives.base import Objective


def next_token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy of logits (B, T, V) against targets (B, T), in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class AR(Objective):
    name = "ar"

    def loss(self, model: nn.Module, batch: Tensor, gen: torch.Generator) -> tuple[Tensor, dict[str, float]]:
        x, y = batch[:, :-1], batch[:, 1:]  # (B, T)
        return next_token_loss(model(x).logits, y), {}
