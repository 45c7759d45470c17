"""Autoregressive next-token prediction: the baseline and the target of speculation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dlm.objectives.base import ALL, Objective, share


def next_token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy of logits (B, T, V) against targets (B, T), in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class AR(Objective):
    name = "ar"

    def loss(self, model: nn.Module, batch: Tensor, gen: torch.Generator, rows: slice = ALL,
             sup: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
        x, y = batch[rows, :-1], batch[rows, 1:]  # (b, T)
        ans = self.answers(batch, sup)
        if ans is not None:  # supervised pairs, responses: only their tokens are targets, averaged over the whole batch
            n = int(ans[:, 1:].sum())
            keep = ans[rows, 1:]  # (b, T)
            logits = model(x).logits
            if n == 0:
                return logits.sum() * 0.0, {"answer_tokens": 0}
            ce = F.cross_entropy(logits[keep].float(), y[keep], reduction="sum")
            return ce / (n / share(batch, rows)), {"answer_tokens": n}
        return next_token_loss(model(x).logits, y), {}
