"""Held-out evaluation: next-token loss and perplexity of an AR checkpoint on a corpus split."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from dlm.data.corpus import Corpus
from dlm.data.tokens import Batches, load_tokens
from dlm.model import Transformer
from dlm.tokenizer import Tokenizer


@torch.inference_mode()
def ar_loss(model: Transformer, tok: Tokenizer, corpus: Corpus, split: str, seq_len: int, batch_size: int = 8,
            max_batches: int | None = None) -> dict[str, Any]:
    """Mean next-token cross-entropy over every non-overlapping window of the split."""
    batches = Batches(load_tokens(corpus, tok, split), min(seq_len, model.cfg.max_seq_len), batch_size)
    total, count = 0.0, 0
    for batch in batches.sequential(max_batches):
        batch = batch.to(model.device)
        logits = model(batch[:, :-1]).logits
        total += float(F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum"))
        count += batch[:, 1:].numel()
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": count}
