"""A mixture of experts in place of the Qwen3/Llama block's SwiGLU MLP (`ModelConfig.moe`): LLaDA 2's BailingMoeV2
layers (and GLM 4 MoE's, DeepSeek V3's router).

- router (`gate`): fp32 logits of the layer's input, sigmoid scores; the experts are chosen on score +
  `expert_bias` (a per-expert bias used only for the choice, never as a weight), limited to the `topk_group` best of
  `n_group` groups of experts (a group's score: the sum of its two best), top `top_k`; the chosen experts' weights
  are their plain sigmoid scores, normalised to sum 1 (top_k > 1) and multiplied by `scale`
  (routed_scaling_factor);
- experts: SwiGLU, stored fused as dlm.gemma4's (gate_up_proj (E, 2I, D), down_proj (E, D, I)) and run by its
  grouped kernel;
- `shared` shared experts: one SwiGLU MLP of shared x I hidden units that every token goes through, added;
- the first `first_dense` layers keep the dense MLP (ffn_dim).

Parameter names: layers.N.mlp.gate.weight, layers.N.mlp.gate.expert_bias (a buffer: the public checkpoints store
it), layers.N.mlp.experts.{gate_up_proj, down_proj}, layers.N.mlp.shared_experts.{gate,up,down}_proj.weight.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dlm.errors import check
from dlm.gemma4 import Experts

MOE_KEYS = ("n_experts", "top_k", "ffn_dim", "shared", "first_dense", "n_group", "topk_group", "scale")


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_moe(moe: Any, n_layers: int) -> None:
    """The fields of ModelConfig.moe, each with a one-line error."""
    check(isinstance(moe, dict) and set(moe) == set(MOE_KEYS),
          f"model.moe must be null or {{{', '.join(MOE_KEYS)}}}, got {moe!r}"[:200])
    for k in MOE_KEYS[:-1]:
        check(_int(moe[k]) and moe[k] >= 0, f"model.moe.{k} must be an integer >= 0, got {moe[k]!r}")
    E, g = moe["n_experts"], moe["n_group"]
    check(0 < moe["top_k"] <= E <= 4096 and 0 < moe["ffn_dim"] <= 1 << 18,
          f"model.moe needs 0 < top_k <= n_experts <= 4096 and ffn_dim > 0, got {moe}"[:200])
    check(g > 0 and E % g == 0 and E // g >= 2 and 0 < moe["topk_group"] <= g,
          f"model.moe: n_group ({g}) must divide n_experts ({E}) into groups of 2 or more, and 0 < topk_group <= "
          "n_group")
    check(moe["top_k"] <= moe["topk_group"] * (E // g),
          f"model.moe: top_k ({moe['top_k']}) must be at most the experts of topk_group groups "
          f"({moe['topk_group'] * (E // g)})")
    check(moe["first_dense"] <= n_layers, f"model.moe.first_dense must be in [0, {n_layers}], got {moe['first_dense']}")
    s = moe["scale"]
    check(isinstance(s, (int, float)) and not isinstance(s, bool) and 0 < s <= 1000,
          f"model.moe.scale must be a number in (0, 1000], got {s!r}")


def is_moe_layer(cfg, i: int) -> bool:
    return bool(cfg.moe) and i >= cfg.moe["first_dense"]


class Router(nn.Module):
    """Sigmoid scores, group-limited top-k on score + expert_bias, weights normalised and scaled."""

    def __init__(self, dim: int, moe: dict[str, Any]):
        super().__init__()
        E = moe["n_experts"]
        self.top_k, self.n_group, self.topk_group = moe["top_k"], moe["n_group"], moe["topk_group"]
        self.scale = moe["scale"]
        self.weight = nn.Parameter(torch.empty(E, dim))
        nn.init.normal_(self.weight, std=0.02)
        self.register_buffer("expert_bias", torch.zeros(E))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x (N, D) -> weights (N, k) in fp32, expert ids (N, k)."""
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))  # (N, E)
        choice = scores + self.expert_bias.float()
        N, E = choice.shape
        grouped = choice.view(N, self.n_group, E // self.n_group)
        best = grouped.topk(2, dim=-1).values.sum(-1)  # (N, G): a group's two best
        keep = torch.zeros_like(best, dtype=torch.bool).scatter_(1, best.topk(self.topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep[:, :, None].expand_as(grouped).reshape(N, E), float("-inf"))
        idx = choice.topk(self.top_k, dim=-1).indices  # (N, k)
        w = scores.gather(1, idx)
        if self.top_k > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * self.scale, idx


class SparseMoE(nn.Module):
    """Routed SwiGLU experts plus the shared experts, over x (B, T, D)."""

    def __init__(self, dim: int, moe: dict[str, Any], mlp: Callable[[int, int], nn.Module]):
        """mlp(dim, hidden): the backbone's SwiGLU MLP (dlm.model.MLP), the shared experts' module."""
        super().__init__()
        self.gate = Router(dim, moe)
        self.experts = Experts(dim, moe["n_experts"], moe["ffn_dim"], act="silu")
        self.shared_experts = mlp(dim, moe["ffn_dim"] * moe["shared"]) if moe["shared"] else None

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N, D)
        w, idx = self.gate(flat)
        y = self.experts(flat, w, idx).reshape(x.shape)
        return y if self.shared_experts is None else y + self.shared_experts(x)


def num_params(cfg) -> int:
    """Parameters of one MoE layer's feed-forward (the expert_bias buffer not counted)."""
    m, D = cfg.moe, cfg.dim
    return m["n_experts"] * (3 * m["ffn_dim"] * D + D) + 3 * D * m["ffn_dim"] * m["shared"]
