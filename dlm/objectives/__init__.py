"""Training objectives: one file per paradigm, one small interface.

An objective builds the model it trains and turns a batch of token windows (B, T + 1) into a
loss. The training loop (dlm.train) is the same for all of them.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from dlm.config import ModelConfig, preset
from dlm.errors import DlmError

if TYPE_CHECKING:
    from dlm.tokenizer import Tokenizer
    from dlm.train import TrainConfig

# name -> "module:Class"; a paradigm registers itself here
REGISTRY: dict[str, str] = {
    "ar": "dlm.objectives.ar:AR",
    "mdlm": "dlm.objectives.mdlm:MDLM",
    "usdm": "dlm.objectives.usdm:USDM",
    "dflash": "dlm.objectives.dflash:DFlash",
}


class Objective(ABC):
    """Base class: builds a Transformer from a preset (or from --init-from); subclasses define the loss."""

    name = "base"
    self_cond = False  # the model carries a self-conditioning module (usdm)

    def __init__(self, cfg: TrainConfig, tokenizer: Tokenizer):
        self.cfg = cfg
        self.tok = tokenizer

    def model_config(self) -> ModelConfig:
        if self.cfg.init_from:
            from dlm.checkpoint import open_checkpoint

            mc = open_checkpoint(self.cfg.init_from).model_config
            mc.self_cond = self.self_cond
            mc.max_seq_len = max(mc.max_seq_len, self.cfg.seq_len)
            return mc
        base = preset(self.cfg.preset)
        return preset(self.cfg.preset, vocab_size=self.tok.vocab_size, self_cond=self.self_cond,
                      max_seq_len=max(base.max_seq_len, self.cfg.seq_len))

    def build_model(self) -> nn.Module:
        from dlm.model import Transformer

        model = Transformer(self.model_config())
        if self.cfg.init_from:
            from dlm.checkpoint import load_weights, open_checkpoint

            ck = open_checkpoint(self.cfg.init_from)
            tensors = ck.tensors()
            if self.self_cond:  # a new module: keep its fresh initialisation
                tensors.update({k: v for k, v in model.state_dict().items() if k.startswith("self_cond.")})
            load_weights(model, tensors, ck.path / "model.safetensors")
        return model

    def trainable(self, model: nn.Module) -> list[nn.Parameter]:
        return [p for p in model.parameters() if p.requires_grad]

    @abstractmethod
    def loss(self, model: nn.Module, batch: Tensor, gen: torch.Generator) -> tuple[Tensor, dict[str, float]]:
        """(loss, extra metrics for metrics.jsonl) of a batch of windows (B, T + 1)."""

    def meta(self) -> dict[str, Any]:
        """Extra entries for config.json."""
        return {}


def make_objective(name: str, cfg: TrainConfig, tokenizer: Tokenizer) -> Objective:
    if name not in REGISTRY:
        raise DlmError(f"--objective must be one of {sorted(REGISTRY)}, got {name!r}")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)(cfg, tokenizer)
