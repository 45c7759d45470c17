"""Training objectives: losses and batch builders, one file per paradigm.

    ar      next-token cross-entropy (objectives/ar.py)
    mdlm    masked diffusion, whole-sequence or block (BD3-LM) (objectives/mdlm.py)
    usdm    uniform-state diffusion: encoder + self-conditioned canvas denoiser (objectives/usdm.py)
    dflash  a DFlash drafter against a frozen AR target (objectives/dflash.py)
    joint   AR + masked diffusion on one backbone (objectives/joint.py)

Models live in the model layer (dlm.model, dlm.drafter); samplers in dlm.sampling.
"""

from __future__ import annotations

from dlm.config import TrainConfig
from dlm.errors import DlmError
from dlm.objectives import ar, dflash, joint, mdlm, usdm
from dlm.objectives.base import Objective
from dlm.tokenizer import Tokenizer

OBJECTIVES: dict[str, type[Objective]] = {
    "ar": ar.AR,
    "mdlm": mdlm.MDLM,
    "usdm": usdm.USDM,
    "dflash": dflash.DFlash,
    "joint": joint.Joint,
}


def objective_class(name: str) -> type[Objective]:
    if name not in OBJECTIVES:
        raise DlmError(f"--objective must be one of {sorted(OBJECTIVES)}, got {name!r}")
    return OBJECTIVES[name]


def make_objective(cfg: TrainConfig, tokenizer: Tokenizer) -> Objective:
    return objective_class(cfg.objective)(cfg, tokenizer)
