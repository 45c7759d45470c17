"""Held-out evaluation of a checkpoint on a corpus split.

AR checkpoints: next-token loss and perplexity. Diffusion checkpoints register an evaluator that
reports their likelihood bound (`perplexity_bound`) beside it. Every evaluator takes
(model, checkpoint, corpus, split, seq_len, batch_size, max_batches, seed) and returns a dict.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

import importlib

from dlm.checkpoint import Checkpoint
from dlm.data.corpus import Corpus
from dlm.errors import DlmError
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


def ar_eval(model: Transformer, ck: Checkpoint, corpus: Corpus, split: str, seq_len: int, batch_size: int,
            max_batches: int | None, seed: int) -> dict[str, Any]:
    return ar_loss(model, ck.tokenizer, corpus, split, seq_len, batch_size, max_batches)


# objective -> "module:function"
EVALUATORS: dict[str, str] = {
    "ar": "dlm.evaluate:ar_eval",
    "usdm": "dlm.objectives.usdm:evaluate",
}


def evaluate(model, ck: Checkpoint, corpus: Corpus, split: str, seq_len: int, batch_size: int = 8,
             max_batches: int | None = None, seed: int = 0) -> dict[str, Any]:
    if ck.objective not in EVALUATORS:
        raise DlmError(f"dlm eval: objective {ck.objective!r} has no evaluator (have {sorted(EVALUATORS)})")
    module, fn = EVALUATORS[ck.objective].split(":")
    return getattr(importlib.import_module(module), fn)(model, ck, corpus, split, seq_len, batch_size, max_batches, seed)
