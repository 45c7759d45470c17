"""Training state for --resume: OUT/state/ (model + optimizer in safetensors, trainer.json), swapped in as a whole
folder so a kill at any moment leaves either the old or the new state."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dlm.checkpoint import WEIGHTS, state_tensors
from dlm.files import write_json, write_tensors


def optimizer_tensors(opt: torch.optim.Optimizer | dict) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An optimizer's state (or its state_dict(): a sharded optimizer's gathered state) as tensors + JSON."""
    sd = opt if isinstance(opt, dict) else opt.state_dict()
    tensors = {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            tensors[f"state.{idx}.{k}"] = v if torch.is_tensor(v) else torch.tensor(v)
    return tensors, {"param_groups": sd["param_groups"]}


def restore_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, v in tensors.items():
        _, idx, k = name.split(".", 2)
        state.setdefault(int(idx), {})[k] = v
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


def save_state(out: Path, model: nn.Module | dict[str, torch.Tensor], opt: torch.optim.Optimizer | dict,
               trainer: dict[str, Any]) -> None:
    """Write OUT/state as a whole: build state.tmp, then swap it in. (model and opt: objects, or their state dicts.)"""
    out = Path(out)
    tmp, cur, old = out / "state.tmp", out / "state", out / "state.old"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_tensors(tmp / WEIGHTS, state_tensors(model))
    t, m = optimizer_tensors(opt)
    write_tensors(tmp / "optimizer.safetensors", t)
    write_json(tmp / "optimizer.json", m)
    write_json(tmp / "trainer.json", trainer)
    if cur.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(cur, old)
    os.replace(tmp, cur)
    shutil.rmtree(old, ignore_errors=True)


def find_state(out: Path) -> Path | None:
    """The newest complete state folder (state/, or state.old/ if a swap was cut short)."""
    for name in ("state", "state.old"):
        p = Path(out) / name
        if (p / "trainer.json").is_file():
            return p
    return None
