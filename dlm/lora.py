"""Low-rank adaptation for fine-tuning large checkpoints (`dlm train --lora-rank R`), through peft.

peft wraps the named linear layers of dlm's model (by default every attention and MLP projection: q_proj, k_proj,
v_proj, o_proj, gate_proj, up_proj, down_proj; a gemma4 backbone's fused experts are parameters, not layers, and
stay frozen) with a trainable pair A (R x in), B (out x R), B starting at zero, scaled by alpha / R; every other
weight is frozen. The training state keeps the adapters apart (resume continues them); the checkpoint a run
writes holds the merged weights W + (alpha / R) B A under dlm's own names, so every dlm command and
`dlm export --format hf` read it as an ordinary checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn

from dlm.errors import DlmError

def add_lora(model: nn.Module, rank: int, alpha: float, targets: tuple[str, ...]) -> nn.Module:
    """Wrap the layers named in targets with rank-R adapters (peft) and freeze every other weight. In place."""
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise DlmError("--lora-rank needs peft: pip install 'dlm[lora]'") from None
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    missing = [t for t in targets if t not in names]
    if missing:
        raise DlmError(f"--lora-targets: the model has no linear layer named {', '.join(missing)} "
                       f"(it has: {', '.join(sorted(names))})")
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(targets), bias="none")
    inject_adapter_in_model(config, model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


@torch.no_grad()
def merged_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's weights with every adapter merged in, under the names of the model without adapters."""
    from peft.tuners.lora import LoraLayer

    state = {}
    deltas = {}
    for name, m in model.named_modules():
        if isinstance(m, LoraLayer):
            deltas[f"{name}.base_layer.weight"] = m.get_delta_weight("default")
    for name, t in model.state_dict().items():
        if "lora_" in name:
            continue
        if name in deltas:
            t = t + deltas[name].to(t.dtype)
        state[name.replace(".base_layer.", ".")] = t
    return state
