"""The interface every training objective implements.

An objective checks its own options, builds the model it trains and turns a batch of token windows
(B, T + 1) into a loss. The training loop (dlm.train) is the same for all of them.

Data parallelism and gradient accumulation split a step's batch into equal slices of rows, one
forward each. So that the slices add up to the whole batch exactly, a loss takes the whole batch and
the rows it computes (`rows`): every random draw is made for the whole batch and then sliced (the
same generator gives every slice the noise it would get in one pass), and the loss is normalised
over the whole batch, scaled by its share (B / rows), so that the mean of the losses of equal slices
that partition the batch is the whole batch's loss.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
from torch import Tensor, nn

from dlm.checkpoint import load_weights, open_checkpoint
from dlm.config import ModelConfig, TrainConfig, preset
from dlm.errors import DlmError
from dlm.model import RESIDUAL_OUT, Transformer
from dlm.tokenizer import Tokenizer


def _last_marks(x: Tensor, sep_id: int, eos_id: int) -> tuple[Tensor, Tensor, Tensor]:
    """(positions, last separator at or before each position, last <eos> at or before it), each (B, T); -1 = none."""
    idx = torch.arange(x.shape[1], device=x.device).expand_as(x)
    last_sep = torch.where(x == sep_id, idx, -1).cummax(1).values
    last_eos = torch.where(x == eos_id, idx, -1).cummax(1).values
    return idx, last_sep, last_eos


def answer_positions(x: Tensor, sep_id: int, eos_id: int) -> Tensor:
    """Bool (B, T): the positions of windows x (B, T) that belong to an answer, i.e. that follow a separator
    token of their document (no <eos> in between). A window that starts inside an answer marks nothing
    until its next separator."""
    _, last_sep, last_eos = _last_marks(x, sep_id, eos_id)
    return (last_sep > last_eos) & (x != sep_id)


def given_positions(x: Tensor, sep_id: int, eos_id: int) -> Tensor:
    """Bool (B, T): the answer positions of windows x (B, T) whose token equals the prompt's token at the same
    offset from the document's start: for an answer that edits a prompt of its own length (a sudoku quiz and
    its solution), the cells the prompt already gives. Exact when each window starts at a document's start
    (a .csv task corpus with --seq-len equal to a document's length); a window that starts inside a document
    may pin a few answer tokens by chance, never a prompt token."""
    idx, last_sep, last_eos = _last_marks(x, sep_id, eos_id)
    start = last_eos + 1  # the document's first position (0 when the window starts inside it)
    offset = idx - last_sep - 1  # position inside the answer
    inside = (last_sep > last_eos) & (x != sep_id) & (offset < last_sep - start)  # answer, within the prompt's length
    same = x.gather(1, (start + offset).clamp(0, x.shape[1] - 1)) == x  # the prompt's token at the same offset
    return inside & same


ALL = slice(None)  # every row of the batch


def share(batch: Tensor, rows: slice) -> float:
    """B / (rows in the slice): the factor that turns a slice's part of the batch loss into a loss of its own."""
    return batch.shape[0] / len(range(*rows.indices(batch.shape[0])))


class Objective(ABC):
    """Base class: builds a Transformer from a preset (or from --init-from); subclasses define the loss."""

    name = "base"
    self_cond = False  # the model carries a self-conditioning module (usdm)
    uses_every_param = True  # every trainable parameter gets a gradient at every step (DDP: no unused-param search)
    step = 0  # the optimizer step being computed (set by the training loop; a loss may ramp a weight with it)

    def __init__(self, cfg: TrainConfig, tokenizer: Tokenizer):
        self.cfg = cfg
        self.tok = tokenizer
        self.sep_id: int | None = None  # supervised pairs (--answer-sep): the separator's token
        sep = getattr(cfg, "answer_sep", None)
        if sep:
            ids = tokenizer.encode(sep, specials=False)
            if len(ids) != 1:
                raise DlmError(f"--answer-sep {sep!r} must be one token of the tokenizer, "
                               f"it is {len(ids)}")
            self.sep_id = ids[0]

    def answers(self, x: Tensor, sup: Tensor | None = None) -> Tensor | None:
        """Bool (B, T) of the answer positions of windows x (B, T), or None (every position): the answers after
        --answer-sep, and the response tokens of a prompted corpus (sup: its flags (B, >= T), from position 0)."""
        ans = None if self.sep_id is None else answer_positions(x, self.sep_id, self.tok.eos_id)
        if sup is not None:
            sup = sup[:, :x.shape[1]]
            ans = sup if ans is None else ans & sup
        return ans

    def unknowns(self, x: Tensor, sup: Tensor | None = None) -> Tensor | None:
        """Bool (B, T) of the answer positions a diffusion objective may noise: every answer position, less the
        givens with --keep-given (answer tokens the prompt already holds at the same place). None = all."""
        ans = self.answers(x, sup)
        if ans is None or self.sep_id is None or not getattr(self.cfg, "keep_given", False):
            return ans
        return ans & ~given_positions(x, self.sep_id, self.tok.eos_id)

    @classmethod
    def check_config(cls, cfg: TrainConfig) -> None:
        """Refuse this objective's bad options before anything is written (the shared ones: cfg.validate())."""

    def model_config(self) -> ModelConfig:
        if self.cfg.init_from:
            mc = open_checkpoint(self.cfg.init_from, "--init-from").model_config
            mc.self_cond = self.self_cond
            mc.n_layers += getattr(self.cfg, "grow_layers", 0)
            mc.max_seq_len = max(mc.max_seq_len, self.cfg.seq_len)
            return mc
        base = preset(self.cfg.preset)
        return preset(self.cfg.preset, vocab_size=self.tok.vocab_size, self_cond=self.self_cond,
                      max_seq_len=max(base.max_seq_len, self.cfg.seq_len))

    def build_model(self) -> nn.Module:
        model = Transformer(self.model_config())
        if self.cfg.init_from:
            ck = open_checkpoint(self.cfg.init_from, "--init-from")
            tensors = ck.tensors()
            fresh = model.state_dict()
            if self.self_cond:  # from a checkpoint without it (AR, mdlm): a new module keeps its fresh initialisation
                tensors.update({k: v for k, v in fresh.items() if k.startswith("self_cond.") and k not in tensors})
            grown = tuple(f"layers.{i}." for i in range(ck.model_config.n_layers, model.cfg.n_layers))
            # --grow-layers: the new layers on top keep their fresh weights, but write nothing into the residual
            # stream (zero o_proj and down_proj): each is the identity at first
            tensors.update({k: torch.zeros_like(v) if k.endswith(RESIDUAL_OUT) else v
                            for k, v in fresh.items() if k.startswith(grown)})
            load_weights(model, tensors, ck.path / "model.safetensors")
        return model

    def trainable(self, model: nn.Module) -> list[nn.Parameter]:
        return [p for p in model.parameters() if p.requires_grad]

    @abstractmethod
    def loss(self, model: nn.Module, batch: Tensor, gen: torch.Generator, rows: slice = ALL,
             sup: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
        """(loss, extra metrics for metrics.jsonl) of the rows `rows` of a batch of windows (B, T + 1): the
        random draws are the whole batch's, the loss is normalised as the module docstring says. sup (B, T + 1):
        the response flags of a prompted corpus (the loss reads response tokens only), or None."""

    def meta(self) -> dict[str, Any]:
        """Extra entries for config.json."""
        return {}
