"""Drafters built in one place: any kind of drafter from what `--draft` names, for a target.

    load_drafter(spec, target, ck, sampling, passes, lookup_ngram, top_k) -> Drafter

'lookup' is prompt lookup; a folder is a drafter checkpoint: a DFlash drafter (objective dflash, trained by dlm or
imported from z-lab's layout), a small AR model with the target's tokenizer, or a masked-diffusion model (mdlm, or
a joint model's diffusion mode) with the target's tokenizer. The samplers
(dlm.sampling.speculative) are pure computation over the drafter this returns; a server loads each drafter once
and `fork`s it per request. Adding a kind of drafter is a class beside the others and a branch here.
"""

from __future__ import annotations

from pathlib import Path

from dlm.checkpoint import load_model, open_checkpoint
from dlm.config import DEFAULT_BLOCK_SIZE
from dlm.drafter import check_target
from dlm.errors import DlmError
from dlm.model import Transformer
from dlm.sampling.speculative import (ARDraft, DFlashDraft, DiffusionDraft, Drafter, PromptLookup, Sampling,
                                      drafter_capacity)

KINDS = {"dflash": "a DFlash drafter checkpoint", "ar": "a small AR model with the target's tokenizer",
         "diffusion": "an mdlm or joint checkpoint with the target's tokenizer (its masked diffusion drafts a block)",
         "lookup": "prompt lookup (no model)"}
DIFFUSION = ("mdlm", "joint")  # checkpoint objectives that draft by masked diffusion


def drafter_kind(spec: str) -> str | None:
    """The kind of drafter `--draft SPEC` names (lookup, ar, dflash), None for a spec that is no drafter."""
    if spec == "lookup":
        return "lookup"
    try:
        objective = open_checkpoint(spec, "--draft").objective
    except DlmError:
        return None
    return "diffusion" if objective in DIFFUSION else objective if objective in KINDS else None


def load_drafter(spec: str, target: Transformer, ck, sampling: Sampling | None = None, passes: int = 1,
                 lookup_ngram: int = 3, top_k: int | None = None) -> Drafter:
    """'lookup', or a drafter checkpoint folder (a dflash drafter or an AR model) for this target."""
    sampling = sampling or Sampling()
    if spec == "lookup":
        return PromptLookup(lookup_ngram)
    if not Path(spec).is_dir():
        raise DlmError(f"--draft must be 'lookup' or a drafter checkpoint folder, got {spec!r} (no such folder)")
    dck = open_checkpoint(spec, "--draft")
    if dck.tokenizer.sha256 != ck.tokenizer.sha256:
        raise DlmError(f"--draft {spec}: its tokenizer differs from the target's ({ck.path}); "
                       "a drafter must share the target's tokenizer")
    if dck.objective not in ("dflash", "ar", *DIFFUSION):
        raise DlmError(f"--draft {spec}: objective {dck.objective!r} cannot draft (dflash, ar, mdlm and joint "
                       "checkpoints can)")
    model, dck = load_model(spec, device=target.device, dtype=target.embed_tokens.weight.dtype, option="--draft")
    capacity = drafter_capacity(target)
    if dck.objective != "dflash" and model.cfg.vocab_size != target.cfg.vocab_size:
        raise DlmError(f"--draft {spec}: vocabulary {model.cfg.vocab_size} differs from the target's "
                       f"{target.cfg.vocab_size}")
    if dck.objective == "ar":
        return ARDraft(model, sampling, capacity, name=f"ar-draft ({Path(spec).name})")
    if dck.objective in DIFFUSION:
        if dck.mask_id is None:
            raise DlmError(f"--draft {spec}: its tokenizer has no <mask> token")
        if dck.config.get("shift") or dck.config.get("context") == "full":
            raise DlmError(f"--draft {spec}: a shifted or full-attention model ({dck.config.get('family')}) does not "
                           "draft yet (it generates on its own)")
        return DiffusionDraft(model, dck.mask_id, dck.block_size or DEFAULT_BLOCK_SIZE, sampling, capacity,
                              passes, causal_context=dck.objective == "joint",
                              name=f"{dck.objective} ({Path(spec).name})")
    check_target(dck.config["dflash"], target, ck.tokenizer.sha256, spec)
    N = target.cfg.n_layers
    bad = [i for i in model.layer_ids if not 0 <= i < N]
    if bad:
        raise DlmError(f"--draft {spec}: reads target layers {bad}, the target has {N}")
    return DFlashDraft(model, target, sampling, capacity, passes, name=f"dflash ({Path(spec).name})", top_k=top_k)
