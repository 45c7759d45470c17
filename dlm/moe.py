"""Mixtures of experts of the backbone (`ModelConfig.moe`, a MoEConfig), by router kind:

- "sigmoid" (LLaDA 2's BailingMoeV2 layers; GLM 4 MoE's, DeepSeek V3's router), `SigmoidRouter` + `SparseMoE` in
  place of the MLP: fp32 logits of the layer's input, sigmoid scores; the experts are chosen on score +
  `expert_bias` (a per-expert bias used only for the choice, never as a weight), limited to the `topk_group` best
  of `n_group` groups of experts (a group's score: the sum of its two best), top `top_k`; the chosen experts'
  weights are their plain sigmoid scores, normalised to sum 1 (top_k > 1) and multiplied by `scale`
  (routed_scaling_factor); `shared` shared experts: one gated MLP of shared x I hidden units that every token goes
  through, added; the first `first_dense` layers keep the dense MLP (ffn_dim).
- "softmax" (Gemma 4's), `SoftmaxRouter` + `Experts` beside the dense MLP (dlm.model.Block): the residual stream
  normed without a scale, times a learned scale and D^-0.5, a linear, fp32 softmax, top-k, renormalised, times a
  per-expert scale.
- "topk" (Qwen3-MoE's, Mixtral's), `TopkRouter` + `SparseMoE` in place of the MLP (except the first `first_dense`
  layers and the `dense_layers`): a linear of the layer's input, fp32 softmax, top `top_k`, renormalised to sum 1
  when `norm_topk`, cast back to the input's dtype.

The experts of both are stored fused (gate_up_proj (E, 2I, D), down_proj (E, D, I)) and run by one grouped kernel.
Parameter names: layers.N.mlp.gate.weight, layers.N.mlp.gate.expert_bias (a buffer: the public checkpoints store
it), layers.N.mlp.experts.*, layers.N.mlp.shared_experts.* (sigmoid); layers.N.router.{proj.weight, scale,
per_expert_scale}, layers.N.experts.* (softmax).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dlm.config import MoEConfig


def is_moe_layer(cfg, i: int) -> bool:
    """Whether layer i's MLP is the sigmoid or topk router's experts (SparseMoE)."""
    return cfg.moe is not None and cfg.moe.replaces_mlp(i)


class SigmoidRouter(nn.Module):
    """Sigmoid scores, group-limited top-k on score + expert_bias, weights normalised and scaled."""

    def __init__(self, dim: int, moe: MoEConfig):
        super().__init__()
        self.top_k, self.n_group, self.topk_group, self.scale = moe.top_k, moe.n_group, moe.topk_group, moe.scale
        self.weight = nn.Parameter(torch.empty(moe.n_experts, dim))
        nn.init.normal_(self.weight, std=0.02)
        self.register_buffer("expert_bias", torch.zeros(moe.n_experts))

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


class TopkRouter(nn.Module):
    """fp32 softmax over a linear of the input, the top_k kept (renormalised when norm_topk)."""

    def __init__(self, dim: int, moe: MoEConfig):
        super().__init__()
        self.top_k, self.norm_topk = moe.top_k, moe.norm_topk
        self.weight = nn.Parameter(torch.empty(moe.n_experts, dim))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x (N, D) -> weights (N, k) in x's dtype, expert ids (N, k)."""
        probs = F.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float32)  # (N, E)
        w, idx = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            w = w / w.sum(-1, keepdim=True)
        return w.to(x.dtype), idx


class SoftmaxRouter(nn.Module):
    """Gemma 4's: softmax over the scaled, normed input's logits, top-k renormalised, times a per-expert scale."""

    def __init__(self, dim: int, moe: MoEConfig, norm: nn.Module):
        """norm: the backbone's RMSNorm without a scale (dlm.model.RMSNorm)."""
        super().__init__()
        self.top_k, self.root = moe.top_k, dim ** -0.5
        self.norm = norm
        self.proj = nn.Linear(dim, moe.n_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(dim))
        self.per_expert_scale = nn.Parameter(torch.ones(moe.n_experts))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x (N, D) -> weights (N, k), expert ids (N, k)."""
        probs = F.softmax(self.proj(self.norm(x) * self.scale * self.root), dim=-1, dtype=torch.float32)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        return w * self.per_expert_scale[idx], idx


class Experts(nn.Module):
    """Expert weights stored fused: gate_up_proj (E, 2I, D), down_proj (E, D, I); act: the gated MLP's activation."""

    def __init__(self, dim: int, n_experts: int, hidden: int, act: Callable[[Tensor], Tensor]):
        super().__init__()
        self.act = act
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, hidden))
        nn.init.normal_(self.gate_up_proj, std=0.02)
        nn.init.normal_(self.down_proj, std=0.02)
        self.grouped = True  # False: the eager reference (a loop over experts, token by token slot)

    def expert(self, e: int, x: Tensor) -> Tensor:
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, self.down_proj[e])

    def forward(self, x: Tensor, w: Tensor, idx: Tensor) -> Tensor:
        return (self.forward_grouped if self.grouped else self.forward_eager)(x, w, idx)

    def forward_eager(self, x: Tensor, w: Tensor, idx: Tensor) -> Tensor:
        """Reference: for each expert, the (token, slot) pairs routed to it, one at a time per expert."""
        out = torch.zeros_like(x)
        for e in range(self.gate_up_proj.shape[0]):
            tok, slot = torch.where(idx == e)
            if tok.numel():
                out.index_add_(0, tok, (self.expert(e, x[tok]) * w[tok, slot, None]).to(out.dtype))
        return out

    def forward_grouped(self, x: Tensor, w: Tensor, idx: Tensor) -> Tensor:
        """Tokens sorted by expert once (one argsort), one matmul pair per expert on its contiguous slice,
        weighted and scattered back with one index_add."""
        N, K = idx.shape
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (N*K,) slots grouped by expert
        counts = torch.bincount(flat, minlength=self.gate_up_proj.shape[0]).tolist()
        tok = order // K
        xs = x.index_select(0, tok)  # (N*K, D)
        ys = torch.empty_like(xs)
        s = 0
        for e, c in enumerate(counts):
            if c:
                ys[s:s + c] = self.expert(e, xs[s:s + c])
                s += c
        ys = ys * w.reshape(-1)[order, None].to(ys.dtype)
        return torch.zeros_like(x).index_add_(0, tok, ys)


class SparseMoE(nn.Module):
    """The sigmoid or topk router's routed experts plus the shared experts, over x (B, T, D), in place of the MLP."""

    def __init__(self, dim: int, moe: MoEConfig, mlp: Callable[[int], nn.Module], act: Callable[[Tensor], Tensor]):
        """mlp(hidden): the backbone's gated MLP (dlm.model.MLP) of that many hidden units, the shared experts."""
        super().__init__()
        self.gate = SigmoidRouter(dim, moe) if moe.router == "sigmoid" else TopkRouter(dim, moe)
        self.experts = Experts(dim, moe.n_experts, moe.ffn_dim, act)
        self.shared_experts = mlp(moe.ffn_dim * moe.shared) if moe.shared else None

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])  # (N, D)
        w, idx = self.gate(flat)
        y = self.experts(flat, w, idx).reshape(x.shape)
        return y if self.shared_experts is None else y + self.shared_experts(x)
