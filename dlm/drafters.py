"""Drafters built in one place: any kind of drafter from what `--draft` names, for a target.

    load_drafter(spec, target, ck, sampling, passes, lookup_ngram, top_k) -> Drafter

'lookup' is prompt lookup; FOLDER+lookup that folder's drafter giving way to prompt lookup where the context's last
n-gram occurred before (speculative.WithLookup); a folder is a drafter checkpoint: a DFlash drafter (objective
dflash, trained by dlm or imported from z-lab's layout), a small AR model with the target's tokenizer, or a
masked-diffusion model (mdlm, or a joint model's diffusion mode) with the target's tokenizer. The samplers
(dlm.sampling.speculative) are pure computation over the drafter this returns; a server loads each drafter once
and `fork`s it per request. Adding a kind of drafter is a class (a `speculative.Drafter`) and a row of KINDS here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dlm.checkpoint import load_model, open_checkpoint
from dlm.config import DEFAULT_BLOCK_SIZE
from dlm.drafter import check_target
from dlm.errors import DlmError
from dlm.model import Transformer
from dlm.sampling.speculative import (ARDraft, DFlashDraft, DiffusionDraft, Drafter, PromptLookup, Sampling,
                                      WithLookup, drafter_capacity)

DIFFUSION = ("mdlm", "joint")  # checkpoint objectives that draft by masked diffusion
WITH_LOOKUP = "+lookup"  # FOLDER+lookup: that drafter, giving way to prompt lookup where the context repeats
BESIDE_LOOKUP = ("dflash", "ar", "diffusion")  # the kinds of drafter FOLDER+lookup takes


def drafter_kind(spec: str) -> str | None:
    """The kind of drafter `--draft SPEC` names (lookup, ar, dflash, diffusion, KIND+lookup), None for a spec that is
    no drafter."""
    if spec == "lookup":
        return "lookup"
    if spec.endswith(WITH_LOOKUP):
        main = drafter_kind(spec[:-len(WITH_LOOKUP)])
        return f"{main}+lookup" if main in BESIDE_LOOKUP else None
    try:
        objective = open_checkpoint(spec, "--draft").objective
    except DlmError:
        return None
    return "diffusion" if objective in DIFFUSION else objective if objective in KINDS else None


def load_drafter(spec: str, target: Transformer, ck, sampling: Sampling | None = None, passes: int = 1,
                 lookup_ngram: int = 3, top_k: int | None = None) -> Drafter:
    """'lookup', or a drafter checkpoint folder (any kind of KINDS) for this target."""
    sampling = sampling or Sampling()
    if spec == "lookup":
        return PromptLookup(lookup_ngram)
    if spec.endswith(WITH_LOOKUP):
        main = load_drafter(spec[:-len(WITH_LOOKUP)], target, ck, sampling, passes, lookup_ngram, top_k)
        if main.kind not in BESIDE_LOOKUP:
            raise DlmError(f"--draft {spec}: '+lookup' follows a drafter checkpoint folder")
        return WithLookup(main, PromptLookup(lookup_ngram))
    if not Path(spec).is_dir():
        raise DlmError(f"--draft must be 'lookup' or a drafter checkpoint folder, got {spec!r} (no such folder)")
    dck = open_checkpoint(spec, "--draft")
    if dck.tokenizer.sha256 != ck.tokenizer.sha256:
        raise DlmError(f"--draft {spec}: its tokenizer differs from the target's ({ck.path}); "
                       "a drafter must share the target's tokenizer")
    kind = "diffusion" if dck.objective in DIFFUSION else dck.objective
    if kind not in KINDS or kind == "lookup":
        raise DlmError(f"--draft {spec}: objective {dck.objective!r} cannot draft (dflash, ar, mdlm and joint "
                       "checkpoints can)")
    model, dck = load_model(spec, device=target.device, dtype=target.embed_tokens.weight.dtype, option="--draft")
    if kind != "dflash" and model.cfg.vocab_size != target.cfg.vocab_size:
        raise DlmError(f"--draft {spec}: vocabulary {model.cfg.vocab_size} differs from the target's "
                       f"{target.cfg.vocab_size}")
    return KINDS[kind].build(spec, model, dck, target, ck, sampling, drafter_capacity(target), passes, top_k)


# the kinds of drafter: what each is (`--draft` help, errors) and how it is built from its loaded checkpoint ---------

@dataclass(frozen=True)
class Kind:
    """A kind of drafter: its description, and build(spec, model, dck, target, ck, sampling, capacity, passes, top_k)
    -> the Drafter (None: it has no checkpoint)."""

    description: str
    build: Callable[..., Drafter] | None = None


def _ar(spec: str, model, dck, target: Transformer, ck, sampling: Sampling, capacity: int, passes: int,
        top_k: int | None) -> Drafter:
    return ARDraft(model, sampling, capacity, name=f"ar-draft ({Path(spec).name})")


def _diffusion(spec: str, model, dck, target: Transformer, ck, sampling: Sampling, capacity: int, passes: int,
               top_k: int | None) -> Drafter:
    if dck.mask_id is None:
        raise DlmError(f"--draft {spec}: its tokenizer has no <mask> token")
    if dck.config.get("shift") or dck.config.get("context") == "full":
        raise DlmError(f"--draft {spec}: a shifted or full-attention model ({dck.config.get('family')}) does not "
                       "draft yet (it generates on its own)")
    return DiffusionDraft(model, dck.mask_id, dck.block_size or DEFAULT_BLOCK_SIZE, sampling, capacity, passes,
                          causal_context=dck.objective == "joint", name=f"{dck.objective} ({Path(spec).name})")


def _dflash(spec: str, model, dck, target: Transformer, ck, sampling: Sampling, capacity: int, passes: int,
            top_k: int | None) -> Drafter:
    check_target(dck.config["dflash"], target, ck.tokenizer.sha256, spec)
    N = target.cfg.n_layers
    bad = [i for i in model.layer_ids if not 0 <= i < N]
    if bad:
        raise DlmError(f"--draft {spec}: reads target layers {bad}, the target has {N}")
    return DFlashDraft(model, target, sampling, capacity, passes, name=f"dflash ({Path(spec).name})", top_k=top_k)


KINDS = {"dflash": Kind("a DFlash drafter checkpoint", _dflash),
         "ar": Kind("a small AR model with the target's tokenizer", _ar),
         "diffusion": Kind("an mdlm or joint checkpoint with the target's tokenizer (its masked diffusion drafts a "
                           "block)", _diffusion),
         "lookup": Kind("prompt lookup (no model)")}
