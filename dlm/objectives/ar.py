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
        ans = self.answers(batch)
        if ans is not None:  # supervised pairs: only the answer's tokens are targets
            keep = ans[:, 1:]  # (B, T)
            if not bool(keep.any()):
                return model(x).logits.sum() * 0.0, {"answer_tokens": 0}
            return next_token_loss(model(x).logits[keep][None], y[keep][None]), {"answer_tokens": int(keep.sum())}
        return next_token_loss(model(x).logits, y), {}
