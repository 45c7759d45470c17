"""Held-out evaluation of a checkpoint on a corpus split.

AR checkpoints: next-token loss and perplexity. Diffusion checkpoints register an evaluator that
reports their likelihood bound (`perplexity_bound`) beside it. Every evaluator takes
(model, checkpoint, corpus, split, seq_len, batch_size, max_batches, seed, samples) and returns a
dict (`samples`: Monte-Carlo samples of a likelihood bound; exact evaluators ignore it). For a
non-AR checkpoint, `evaluate` also scores the same windows with a reference AR model, so the bound
can be read next to the AR perplexity.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from dlm.checkpoint import Checkpoint, load_model, open_checkpoint, shipped
from dlm.data.corpus import Corpus
from dlm.data.tokens import Batches, load_tokens
from dlm.errors import DlmError
from dlm.model import Transformer
from dlm.objectives import mdlm, usdm
from dlm.tokenizer import Tokenizer


@torch.inference_mode()
def ar_loss(model: Transformer, tok: Tokenizer, corpus: Corpus, split: str, seq_len: int, batch_size: int = 8,
            max_batches: int | None = None) -> dict[str, Any]:
    """Mean next-token cross-entropy over every non-overlapping window of the split."""
    batches = Batches(load_tokens(corpus, tok, split), min(seq_len, model.cfg.max_seq_len), batch_size,
                      where=f"{corpus.spec}, its {split} split")
    total, count = 0.0, 0
    for batch in batches.sequential(max_batches):
        batch = batch.to(model.device)
        logits = model(batch[:, :-1]).logits
        total += float(F.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten(), reduction="sum"))
        count += batch[:, 1:].numel()
    loss = total / count
    return {"loss": loss, "perplexity": math.exp(loss), "tokens": count}


def ar_eval(model: Transformer, ck: Checkpoint, corpus: Corpus, split: str, seq_len: int, batch_size: int,
            max_batches: int | None, seed: int, samples: int) -> dict[str, Any]:
    return ar_loss(model, ck.tokenizer, corpus, split, seq_len, batch_size, max_batches)


def joint_eval(model: Transformer, ck: Checkpoint, corpus: Corpus, split: str, seq_len: int, batch_size: int,
               max_batches: int | None, seed: int, samples: int) -> dict[str, Any]:
    """A joint checkpoint's AR mode (the clean half's causal loss): the perplexity that its self-speculation
    reproduces, read beside the reference AR model's on the same windows (did the diffusion loss cost it?)."""
    res = ar_loss(model, ck.tokenizer, corpus, split, seq_len, batch_size, max_batches)
    return {"ar_mode_loss": res["loss"], "ar_mode_perplexity": res["perplexity"], "tokens": res["tokens"]}


# objective -> its held-out evaluation (the likelihood bounds live beside their losses)
EVALUATORS = {
    "ar": ar_eval,
    "mdlm": mdlm.mdlm_eval,
    "usdm": usdm.evaluate,
    "joint": joint_eval,
}


def resolve_reference(ck: Checkpoint, reference: str | None) -> tuple[Checkpoint | None, str]:
    """The reference AR checkpoint: --reference, else the checkpoint's --init-from when that names a shipped
    reference checkpoint (ar-small), else the shipped ar-small. A path recorded in a checkpoint is never
    followed (a checkpoint from elsewhere could name any folder): pass it as --reference.

    Returns (checkpoint or None, a note: why none, or which recorded path was not followed). An explicit
    reference must exist and share the tokenizer.
    """
    if reference:
        ref = open_checkpoint(reference, "--reference")
        if ref.objective != "ar":
            raise DlmError(f"--reference {reference}: must be an ar checkpoint, got objective {ref.objective!r}")
        if ref.tokenizer.sha256 != ck.tokenizer.sha256:
            raise DlmError(f"--reference {reference}: its tokenizer differs from {ck.path}'s (must be shared)")
        return ref, ""
    recorded = ck.config.get("train", {}).get("init_from")
    by_name = shipped(recorded) if recorded else None
    itself = recorded and Path(recorded).name == Path(ck.path).name  # (a later stage of the same run)
    note = "" if not recorded or by_name or itself else (
        f"{ck.path} records --init-from {recorded}, a path, which is not followed: pass --reference {recorded} "
        "to score with it, if it is an AR checkpoint with the same tokenizer")
    for cand in (by_name, shipped("ar-small")):
        if cand is not None:
            ref = open_checkpoint(cand, "--reference")
            if ref.objective == "ar" and ref.tokenizer.sha256 == ck.tokenizer.sha256:
                return ref, note
    return None, note or "no reference AR checkpoint with the same tokenizer (tried the shipped ar-small)"


def evaluate(model, ck: Checkpoint, corpus: Corpus, split: str, seq_len: int, batch_size: int = 8,
             max_batches: int | None = None, seed: int = 0, samples: int = 4,
             reference: str | None = None) -> dict[str, Any]:
    if ck.objective not in EVALUATORS:
        raise DlmError(f"dlm eval: objective {ck.objective!r} has no evaluator (have {sorted(EVALUATORS)})")
    res = EVALUATORS[ck.objective](model, ck, corpus, split, seq_len, batch_size, max_batches, seed, samples)
    if ck.objective != "ar":
        ref, note = resolve_reference(ck, reference)
        if note:
            res["reference_note"] = note
        if ref is None:
            res["reference"] = None
        else:
            net, _ = load_model(ref.path, device=model.device)
            ar = ar_loss(net, ref.tokenizer, corpus, split, seq_len, batch_size, max_batches)
            res.update(reference=str(ref.path), reference_loss=ar["loss"], reference_perplexity=ar["perplexity"])
    return res
