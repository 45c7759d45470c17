"""The DFlash drafter (arXiv 2602.06036): a block-diffusion model conditioned on a target's hidden states.

The drafter is a short stack of the backbone's own decoder layers at the target's width, plus
`fc` (concatenated target features -> D, bias-free) and `hidden_norm`, and a final `norm`. It has
no embedding or LM head: it reads the target's, frozen.

    target features  outputs of L target layers, concatenated (C, L*D) -> fc -> hidden_norm = ctx (C, D);
                     the target's last layer is read after its final norm (last_layer "normed", what
                     the public engines feed: transformers' hidden_states[id + 1]; "prenorm" in drafters
                     trained before)
    block            [last committed token, <mask> x (B-1)] at positions start .. start+B-1,
                     embedded by the target's embedding
    every layer      queries from the block only; keys/values = [ctx K/V ; block K/V], each layer
                     projecting ctx with its own k/v projections (injection "kv"); bidirectional
    output           norm(h) -> the target's lm_head: logits for slots 1 .. B-1 are the draft

At inference the drafter's cache holds context K/V only: each draft writes the K/V of the newly
committed positions' features and reads the block without writing it (run_blocks write=False).

Ablations: injection "input" (the context enters once, as tokens at the input, and passes through
the layers like ordinary hidden states), and target_features=False (the context is the target's
token embeddings, not its hidden states: an unconditioned block-diffusion drafter).

Its training objective (anchors, the multi-block mask, slot weights) is dlm.objectives.dflash; its
sampler is the speculative loop (dlm.sampling.speculative.DFlashDraft); its export in the public
DFlash layout is dlm.hf.export_drafter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dlm.config import ModelConfig
from dlm.errors import DlmError, check
from dlm.masks import dflash_draft_mask
from dlm.model import (
    Block, KVCache, RMSNorm, Transformer, block_shapes, init_weights, rope_inv_freq, run_blocks, softcap,
)

# DFlash 2 ("Keep Drafting Parallel", z-lab 2026): every draft layer wraps its attention and its MLP in a grouped
# dynamic causal convolution over the block's positions, and a candidate selector picks each slot's token among
# the top-k of its logits, left to right, by a low-rank bilinear score with the token before it.


class DynamicConv(nn.Module):
    """Grouped dynamic causal convolution over the block's positions, one before and one after a sublayer.

    y_t = sum over offsets o < K of (base[i, o] + d_t[i, o, g]) * x_{t-o}: base (2, K, D) a kernel per channel,
    d_t (2, K, D / G) one scalar per group of G channels projected from the sublayer's input x_t; i = 0 before
    the sublayer (`prepare`), 1 after it (`finish`, with the d_t of its input); zeros before the block's first
    position. Identity-initialised (base[:, 0] = 1, the rest and the projection 0): a DFlash 1 layer."""

    def __init__(self, dim: int, kernel: int, group: int):
        super().__init__()
        check(kernel >= 1 and group >= 1 and dim % group == 0,
              f"conv_kernel_size must be >= 1 and conv_group_size divide the width {dim}, got {kernel}, {group}")
        self.kernel, self.group = kernel, group
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel, dim))
        self.kernel_projection = nn.Linear(dim, 2 * kernel * (dim // group), bias=False)
        self.reset_identity()

    def reset_identity(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    segment = 0  # > 0: the positions are blocks of this many laid end to end (training), each convolved alone

    def _conv(self, x: Tensor, base: Tensor, dyn: Tensor, residual: Tensor | None = None) -> Tensor:
        """x (B, T, D) convolved with the kernels base (K, D) + dyn (B, T, K, D / G), then residual added if given.

        The arithmetic is the `dflash` package's, term for term: from zeros, per offset o, + base[o] * x_{t-o}, then
        + d_t[o] * x_{t-o}, the residual last. (base + d) * x rounds differently, and a draft's argmax can turn on
        that last bit: then a cycle accepts another length than the reference's. With `segment` s, each run of s
        positions is a block of its own: nothing reaches across a block's start, as at decoding."""
        s, (B, T, D) = self.segment, x.shape
        if s and T > s:
            n = B * T // s
            out = self._conv(x.reshape(n, s, D), base, dyn.reshape(n, s, *dyn.shape[2:]),
                             None if residual is None else residual.reshape(n, s, D))
            return out.view(B, T, D)
        g = D // self.group
        xs = x.view(B, T, g, self.group)
        out = torch.zeros_like(xs)
        for o in range(min(self.kernel, T)):  # zeros before the first position
            v = xs if o == 0 else F.pad(xs[:, :-o], (0, 0, 0, 0, o, 0))
            out = torch.addcmul(out + base[o].view(1, 1, g, self.group).to(x.dtype) * v, dyn[:, :, o, :, None], v)
        out = out.view(B, T, D)
        return out if residual is None else residual + out

    def prepare(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """The sublayer's input convolved, and the dynamic kernels its output is convolved with (B, T, K, D / G)."""
        B, T, D = x.shape
        dyn = self.kernel_projection(x).view(B, T, 2, self.kernel, D // self.group)
        return self._conv(x, self.base_kernel[0], dyn[:, :, 0]), dyn[:, :, 1]

    def finish(self, h: Tensor, dyn: Tensor, residual: Tensor) -> Tensor:
        """residual + the sublayer's output h convolved with base_kernel[1] and the dynamic kernels `prepare` gave."""
        return self._conv(h, self.base_kernel[1], dyn, residual)


class ConvBlock(Block):
    """The backbone's decoder layer with DFlash 2's convolutions around its attention and its MLP."""

    def __init__(self, cfg: ModelConfig, kernel: int, group: int):
        super().__init__(cfg)
        self.attention_conv = DynamicConv(cfg.dim, kernel, group)
        self.mlp_conv = DynamicConv(cfg.dim, kernel, group)

    def layer(self, x, rope, mask, is_causal, cache, layer, write, ctx=None, ctx_rope=None, lo=0) -> Tensor:
        h, k = self.attention_conv.prepare(self.input_layernorm(x))
        a = self.self_attn(h, rope, mask, is_causal, cache, layer, write, ctx, ctx_rope, lo)
        x = self.attention_conv.finish(a, k, x)  # x + the convolved output
        h, k = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return self.mlp_conv.finish(self.mlp(h), k, x)


def inverse_cdf(q: Tensor, u: Tensor) -> Tensor:
    """q (..., k) distributions, u (...) uniforms -> (...): the first candidate whose cumulative probability exceeds u
    (the last one if rounding leaves none)."""
    return (q.double().cumsum(-1) <= u[..., None]).sum(-1).clamp_(max=q.shape[-1] - 1)


def first_draws(q: Tensor, width: int, gen: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """Up to `width` draws without replacement from q (k,) (a draft tree's first slot) -> their indices (W,) and
    (W, k) the distribution each was drawn from: q without the draws before it, renormalised (what the verifier's
    residual needs). One Gumbel-top-W over log q: the same law as drawing one after another; W <= the entries of q
    with mass."""
    W = min(width, int((q > 0).sum()))
    u = torch.rand(q.shape[0], generator=gen, device=q.device, dtype=torch.float64)
    pick = torch.topk(q.double().log() - (-u.log()).log(), W).indices
    qs = q[None].repeat(W, 1)
    for w in range(1, W):
        qs[w:, pick[w - 1]] = 0.0
    return pick, qs / qs.sum(-1, keepdim=True)


WALK_ABOVE = 64  # candidates per slot above which the selector walks slot by slot (see `select`; measured: the table is
# faster up to 64 candidates, the walk from 128)


class CandidateSelector(nn.Module):
    """DFlash 2's selector: each slot's token among the top-k of its draft logits, chosen left to right from the
    anchor (the last committed token) by score = logit + sum_r A[prev]_r (W h_t)_r B[cand]_r, with A, B vocabulary
    codebooks of rank R. Greedy: the argmax; temperature T: a draw from q = softmax(score / T) over the k
    candidates (the proposal distribution the verifier reads, zero outside them). The successor codebook starts
    at zero: the selector then picks each slot's argmax, as a DFlash 1 drafter does."""

    def __init__(self, vocab: int, dim: int, rank: int, top_k: int):
        super().__init__()
        check(rank >= 1 and top_k >= 1, f"selector_rank and selector_top_k must be >= 1, got {rank}, {top_k}")
        self.top_k = top_k
        self.predecessor_codebook = nn.Embedding(vocab, rank)
        self.successor_codebook = nn.Embedding(vocab, rank)
        self.hidden_projection = nn.Linear(dim, rank, bias=False)

    def scores(self, h: Tensor, cand_logits: Tensor, cands: Tensor, prev: Tensor) -> Tensor:
        """Scores (B, k) of one slot's candidates (B, k) after token prev (B,), its hidden state h (B, D)."""
        a = self.predecessor_codebook(prev) * self.hidden_projection(h)  # (B, R)
        return cand_logits + torch.einsum("br,bkr->bk", a, self.successor_codebook(cands))

    def select(self, h: Tensor, logits: Tensor, anchor: Tensor, temperature: float,
               gen: torch.Generator | None, top_k: int | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """h (B, S, D), logits (B, S, V), anchor (B,) -> tokens (B, S), candidates (B, S, k), q (B, S, k) or None.
        top_k: candidates per slot (default: the selector's own, what it was trained on).

        All scores are computed in one pass, as a table (B, S, k, k) of every candidate of a slot after every
        candidate of the slot before (slot 0: after the anchor, its k rows alike); each row's choice is made on
        the tensor (the argmax, or the inverse CDF at a uniform draw), so the walk left to right only follows
        (B, S, k) small integers in Python. With many candidates the table would cost k x k per slot, so the
        walk scores only the row it reads (`_walk`: the same choices, the same draws)."""
        unary, cands = torch.topk(logits, min(top_k or self.top_k, logits.shape[-1]), dim=-1, sorted=False)
        B, S, k = cands.shape
        if k > WALK_ABOVE:
            return self._walk(h, unary, cands, anchor, temperature, gen)
        prev = torch.cat((anchor[:, None, None].expand(B, 1, k), cands[:, :-1]), dim=1)  # (B, S, k) predecessors
        a = self.predecessor_codebook(prev) * self.hidden_projection(h)[:, :, None]  # (B, S, k, R)
        table = unary[:, :, None] + a @ self.successor_codebook(cands).transpose(-1, -2)  # (B, S, k, k)
        if temperature > 0:
            qt = torch.softmax(table.float() / temperature, -1)
            u = torch.rand(B, S, generator=gen, device=h.device, dtype=torch.float64)
            pick = inverse_cdf(qt, u[:, :, None])
        else:
            pick = table.argmax(-1)  # ties: the first
        nxt = pick.tolist()
        idx = []
        for b in range(B):
            j, path = 0, []
            for s in range(S):
                j = nxt[b][s][j]
                path.append(j)
            idx.append(path)
        idx_t = torch.tensor(idx, dtype=torch.long, device=cands.device)  # (B, S) positions among the candidates
        tokens = cands.gather(-1, idx_t[..., None])[..., 0]
        if temperature <= 0:
            return tokens, cands, None
        rows = torch.cat((idx_t.new_zeros(B, 1), idx_t[:, :-1]), dim=1)[:, :, None, None].expand(-1, -1, 1, k)
        return tokens, cands, qt.gather(2, rows)[:, :, 0]  # (B, S, k): the rows the walk read

    def branches(self, h: Tensor, logits: Tensor, anchor: Tensor, temperature: float, gen: torch.Generator | None,
                 width: int, top_k: int | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """Up to `width` paths that differ at the first slot (a draft tree for multi-draft verification): h (S, D),
        logits (S, V), anchor () -> tokens (W, S), candidates (S, k), q (W, S, k) or None.

        The first slot's W tokens: greedy, its W best scores (branch 0 is `select`'s path); T > 0, W draws without
        replacement from its q (`first_draws`), branch w's q there the distribution its own draw came from. Each
        branch then walks on after its own first token, as `select` does."""
        unary, cands = torch.topk(logits, min(top_k or self.top_k, logits.shape[-1]), dim=-1, sorted=False)
        S, k = cands.shape
        wh = self.hidden_projection(h)  # (S, R)
        succ = self.successor_codebook(cands)  # (S, k, R)
        first = unary[0] + succ[0] @ (self.predecessor_codebook(anchor) * wh[0])  # (k,)
        if temperature > 0:
            pick, q0 = first_draws(torch.softmax(first.float() / temperature, -1), width, gen)
            qs = [q0]
        else:
            pick, qs = torch.topk(first, min(width, k)).indices, []
        W = pick.shape[0]
        u = torch.rand(W, S - 1, generator=gen, device=h.device, dtype=torch.float64) if temperature > 0 else None
        prev = cands[0, pick]  # (W,)
        tokens = [prev]
        for s in range(1, S):
            score = unary[s] + (self.predecessor_codebook(prev) * wh[s]) @ succ[s].T  # (W, k)
            if u is None:
                pick = score.argmax(-1)
            else:
                q = torch.softmax(score.float() / temperature, -1)
                pick = inverse_cdf(q, u[:, s - 1])
                qs.append(q)
            prev = cands[s, pick]
            tokens.append(prev)
        return torch.stack(tokens, 1), cands, torch.stack(qs, 1) if qs else None

    def _walk(self, h: Tensor, unary: Tensor, cands: Tensor, anchor: Tensor, temperature: float,
              gen: torch.Generator | None) -> tuple[Tensor, Tensor, Tensor | None]:
        """`select` slot after slot: each slot's k scores after the token chosen before it."""
        B, S, k = cands.shape
        u = torch.rand(B, S, generator=gen, device=h.device, dtype=torch.float64) if temperature > 0 else None
        wh = self.hidden_projection(h)  # (B, S, R): `scores`' terms for every slot at once, outside the loop
        succ = self.successor_codebook(cands)  # (B, S, k, R)
        prev, tokens, qs = anchor, [], []
        for s in range(S):
            a = self.predecessor_codebook(prev) * wh[:, s]  # (B, R)
            score = unary[:, s] + (succ[:, s] @ a[:, :, None])[..., 0]  # (B, k)
            if u is None:
                pick = score.argmax(-1)
            else:
                q = torch.softmax(score.float() / temperature, -1)
                pick = inverse_cdf(q, u[:, s])
                qs.append(q)
            prev = cands[:, s].gather(-1, pick[:, None])[:, 0]
            tokens.append(prev)
        return torch.stack(tokens, 1), cands, torch.stack(qs, 1) if qs else None


INJECTIONS = ("kv", "input")
LAST_LAYER = ("normed", "prenorm")  # how the target's last layer is read: after its final norm, or before


# target layers ------------------------------------------------------------------------------------

def target_layer_ids(n_layers: int, n_features: int) -> list[int]:
    """Which target layers feed the drafter (0-based; the output of that decoder layer).

    DFlash: id_i = round(1 + i * (N - 4) / (L - 1)), i = 0 .. L-1, spread from layer 1 to N-3 (the
    middle layer N // 2 when L = 1); Qwen3-8B (N=36, L=5) -> [1, 9, 17, 25, 33].

    Small targets (N - 4 < L - 1, where that formula repeats layers; a 4-layer target gives
    N - 4 = 0): the L layers are spread over all of 0 .. N-1 instead, so that every feature is a
    different layer (N=4, L=4 -> [0, 1, 2, 3]; N=4, L=2 -> [0, 3]). L > N is an error.
    """
    check(n_features >= 1, f"--target-layers: need at least one target layer, got {n_features}")
    check(n_features <= n_layers,
          f"the target has {n_layers} layers: too shallow for {n_features} distinct target layers")
    if n_features == 1:
        return [n_layers // 2]
    if n_layers - 4 >= n_features - 1:
        return [int(round(1 + i * (n_layers - 4) / (n_features - 1))) for i in range(n_features)]
    return [int(round(i * (n_layers - 1) / (n_features - 1))) for i in range(n_features)]


def default_draft_layers(n_target_layers: int) -> int:
    """5 layers for deep targets (the paper's Qwen3-8B drafter); a quarter of the target when shallower, and at
    least 2: with one layer every mask slot has the same query up to RoPE, so the drafter cannot look up where
    a pattern occurred before (on ar-small, 2 layers beat 1 at fewer steps: docs/dflash.md)."""
    return max(2, min(5, n_target_layers // 4))


def default_features(n_target_layers: int) -> int:
    """5 target layers (the paper's), or every layer of a target shallower than that."""
    return min(5, n_target_layers)


# the drafter --------------------------------------------------------------------------------------

class DFlashDrafter(nn.Module):
    """Decoder layers + fc + hidden_norm + norm; embedding and LM head come from the target."""

    def __init__(self, cfg: ModelConfig, layer_ids: list[int], block_size: int, mask_id: int,
                 injection: str = "kv", target_features: bool = True, last_layer: str = "normed",
                 input_embedding_scale: float = 1.0, output_multiplier: float = 1.0,
                 logit_softcap: float | None = None, conv_kernel_size: int = 0, conv_group_size: int = 16,
                 selector_rank: int = 0, selector_top_k: int = 16, block_noise: str = "mask"):
        super().__init__()
        check(block_noise in ("mask", "uniform"), f"dflash block_noise must be mask or uniform, got {block_noise!r}")
        self.block_noise = block_noise  # uniform: the slots start as random tokens and later passes revise them
        check(injection in INJECTIONS, f"--injection must be one of {list(INJECTIONS)}, got {injection!r}")
        check(last_layer in LAST_LAYER, f"dflash last_layer must be one of {list(LAST_LAYER)}, got {last_layer!r}")
        check(block_size >= 2, f"--block-size must be >= 2, got {block_size}")
        self.cfg = cfg
        self.layer_ids = list(layer_ids)
        self.block_size = block_size
        self.mask_id = mask_id
        self.injection = injection
        self.target_features = target_features
        self.last_layer = last_layer
        # the public drafters' numerics (z-lab's dflash_config): the block's embeddings scaled, the logits
        # multiplied, then soft-capped (tanh(x / c) * c)
        self.input_embedding_scale = float(input_embedding_scale)
        self.output_multiplier = float(output_multiplier)
        self.logit_softcap = float(logit_softcap) if logit_softcap else None
        # DFlash 2 (0 = off): the convolutions around every layer's attention and MLP, the candidate selector
        self.conv_kernel_size, self.conv_group_size = int(conv_kernel_size), int(conv_group_size)
        self.selector_rank, self.selector_top_k = int(selector_rank), int(selector_top_k)
        if self.conv_kernel_size:
            self.layers = nn.ModuleList(ConvBlock(cfg, self.conv_kernel_size, self.conv_group_size)
                                        for _ in range(cfg.n_layers))
        else:
            self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        n_in = len(self.layer_ids) if target_features else 1
        self.fc = nn.Linear(n_in * cfg.dim, cfg.dim, bias=False)
        self.hidden_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.candidate_selector = (CandidateSelector(cfg.vocab_size, cfg.dim, self.selector_rank, self.selector_top_k)
                                   if self.selector_rank else None)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        init_weights(self, cfg.n_layers)
        self.grow_identity()

    @property
    def version(self) -> int:
        """1: DFlash; 2: DFlash 2 (convolutions and a candidate selector)."""
        return 2 if self.conv_kernel_size or self.candidate_selector is not None else 1

    def grow_identity(self) -> None:
        """DFlash 2's start: identity convolutions and a zero successor codebook, so the drafter computes exactly
        the DFlash 1 drafter its other weights come from (`--init-from` a DFlash 1 drafter)."""
        for m in self.modules():
            if isinstance(m, DynamicConv):
                m.reset_identity()
        if self.candidate_selector is not None:
            nn.init.zeros_(self.candidate_selector.successor_codebook.weight)

    @property
    def taps(self) -> tuple[int, ...]:
        """Target layers whose outputs this drafter reads (none without target features)."""
        return tuple(self.layer_ids) if self.target_features else ()

    def features(self, target: Transformer, tokens: Tensor, taps: dict[int, Tensor] | None) -> Tensor:
        """The context feature of each position, before fc: concatenated taps (the last layer as this drafter
        reads it, `norm_last`), or the token embedding. (B, T, F)"""
        if self.target_features:
            return self.norm_last(target, torch.cat([taps[i] for i in self.layer_ids], dim=-1))
        return target.embed_tokens(tokens)

    def norm_last(self, target: Transformer, feats: Tensor) -> Tensor:
        """Concatenated taps (..., L*D) -> the features this drafter reads: the target's last layer through
        the target's final norm (transformers' hidden_states[-1], what public DFlash engines feed), unless
        the drafter was trained on the pre-norm tap."""
        last = target.cfg.n_layers - 1
        if self.last_layer == "prenorm" or last not in self.layer_ids:
            return feats
        D = target.cfg.dim
        j = self.layer_ids.index(last) * D
        return torch.cat((feats[..., :j], target.norm(feats[..., j:j + D]), feats[..., j + D:]), dim=-1)

    def embed(self, target: Transformer, ids: Tensor) -> Tensor:
        """The block's input: the target's embeddings of ids (..., T) -> (..., T, D), times the input scale."""
        x = target.embed_tokens(ids)
        return x * self.input_embedding_scale if self.input_embedding_scale != 1.0 else x

    def head(self, target: Transformer, h: Tensor) -> Tensor:
        """Draft logits from normed hidden states: the target's LM head, the output multiplier, the soft-cap."""
        logits = target.lm_head(h)
        if self.output_multiplier != 1.0:
            logits = logits * self.output_multiplier
        return softcap(logits, self.logit_softcap or 0.0)

    def numerics(self) -> dict[str, Any]:
        """The config entries of the numerics that differ from the plain DFlash ones."""
        out: dict[str, Any] = {}
        if self.input_embedding_scale != 1.0:
            out["input_embedding_scale"] = self.input_embedding_scale
        if self.output_multiplier != 1.0:
            out["output_multiplier"] = self.output_multiplier
        if self.logit_softcap:
            out["final_logit_softcapping"] = self.logit_softcap
        if self.conv_kernel_size:
            out.update(conv_kernel_size=self.conv_kernel_size, conv_group_size=self.conv_group_size)
        if self.candidate_selector is not None:
            out.update(selector_rank=self.selector_rank, selector_top_k=self.selector_top_k)
        if self.block_noise != "mask":
            out["block_noise"] = self.block_noise
        return out

    def context(self, feats: Tensor) -> Tensor:
        """fc + hidden_norm: one context feature per position. (B, C, F) -> (B, C, D)"""
        return self.hidden_norm(self.fc(feats))

    def forward(self, x: Tensor, ctx: Tensor | None, pos: Tensor, ctx_pos: Tensor | None,
                cache: KVCache | None = None, mask: str | Tensor = "full", segment: int = 0) -> Tensor:
        """Block embeddings x (B, T, D) -> normed hidden states (B, T, D).

        segment: x is T / segment blocks laid end to end (training's anchors): DFlash 2's convolutions run inside
        each block alone, as they do at decoding over one block (kv injection; with input injection the context
        rows run ahead of the blocks and the convolutions see them, at decoding too).

        kv: ctx (B, C, D) enters every layer's K/V (and persists in `cache`; the block does not).
        input: ctx rows run through the layers ahead of the block as ordinary tokens; with a cache
        their K/V persist and the block's are cropped away. `mask` covers [cache ; ctx ; block] keys
        (for "input", queries are [ctx ; block]).
        """
        if self.injection == "kv":
            convs = [m for m in self.modules() if isinstance(m, DynamicConv)] if segment else []
            check(not convs or x.shape[1] % segment == 0,
                  f"{x.shape[1]} positions are not whole blocks of {segment}")
            for m in convs:
                m.segment = segment
            try:
                h, _ = run_blocks(self.layers, self.inv_freq, x, pos=pos, cache=cache, mask=mask, write=False,
                                  rope_scaling=self.cfg.rope_scaling,
                                  ctx=ctx, ctx_pos=ctx_pos)
            finally:
                for m in convs:
                    m.segment = 0
            return self.norm(h)
        C = 0 if ctx is None else ctx.shape[1]
        L0 = 0 if cache is None else cache.length
        if C:
            x = torch.cat((ctx, x), dim=1)
            pos = torch.cat((ctx_pos.expand(pos.shape[0], -1) if pos.dim() == 2 else ctx_pos, pos), dim=-1)
        h, _ = run_blocks(self.layers, self.inv_freq, x, pos=pos, cache=cache, mask=mask, write=True,
                          rope_scaling=self.cfg.rope_scaling)
        if cache is not None:
            cache.crop(L0 + C)
        return self.norm(h[:, C:])

    def new_cache(self, capacity: int, dtype: torch.dtype | None = None, rows: int = 1, fill: bool = True) -> KVCache:
        p = self.fc.weight
        return KVCache(self.cfg, rows, capacity, p.device, dtype or p.dtype, fill)

    # what the row batch (dlm.sampling.rows) asks of a model it serves, as of the backbone (dlm.model.Transformer)
    @property
    def rows_batchable(self) -> bool:
        return self.injection == "kv"  # (input injection: the context runs through the layers, rows in turn)

    def rows_cache(self, rows: int, capacity: int, fill: bool = True) -> KVCache:
        return self.new_cache(capacity, rows=rows, fill=fill)

    rows_band = 0

    def rows_forward(self, x: Tensor | None, embeds: Tensor | None, pos: Tensor, cache: KVCache, mask, write: bool,
                     ctx: Tensor | None, ctx_pos: Tensor | None, taps: tuple[int, ...]) -> tuple[Tensor, dict]:
        """One forward of rows: reads embeddings, writes the context's K/V into the cache, reads the window without
        writing it; "full" / "causal" = the draft mask of this injection."""
        if isinstance(mask, str):
            C = 0 if ctx is None else ctx.shape[1]
            mask = dflash_draft_mask(self.injection, cache.length, C, embeds.shape[1], embeds.device)
        return self(embeds, ctx, pos, ctx_pos, cache=cache, mask=mask), {}


def build_drafter(config: dict[str, Any]) -> DFlashDrafter:
    """The drafter a dflash checkpoint's config.json describes (weights not loaded)."""
    try:
        mc = ModelConfig.from_dict(config["model"])
        d = config["dflash"]
        return DFlashDrafter(mc, d["target_layer_ids"], d["block_size"], d["mask_token_id"],
                             d.get("injection", "kv"), d.get("target_features", True),
                             d.get("last_layer", "prenorm"),  # absent: trained before the public reading
                             d.get("input_embedding_scale", 1.0), d.get("output_multiplier", 1.0),
                             d.get("final_logit_softcapping"), d.get("conv_kernel_size", 0),
                             d.get("conv_group_size", 16), d.get("selector_rank", 0), d.get("selector_top_k", 16),
                             d.get("block_noise", "mask"))
    except KeyError as e:
        raise DlmError(f"dflash checkpoint config.json lacks {e}") from None


def drafter_shapes(config: dict[str, Any]) -> tuple[dict[str, tuple[int, ...]], dict[str, str]]:
    """Name -> shape of every tensor of the drafter a dflash config.json describes, without building it."""
    try:
        mc = ModelConfig.from_dict(config["model"])
        d = config["dflash"]
        n_in = len(d["target_layer_ids"]) if d.get("target_features", True) else 1
    except KeyError as e:
        raise DlmError(f"dflash checkpoint config.json lacks {e}") from None
    out: dict[str, tuple[int, ...]] = {}
    for i in range(mc.n_layers):
        out.update(block_shapes(mc, f"layers.{i}."))
    out.update({"fc.weight": (mc.dim, n_in * mc.dim), "hidden_norm.weight": (mc.dim,), "norm.weight": (mc.dim,)})
    K, G = d.get("conv_kernel_size", 0), d.get("conv_group_size", 16)
    if K:
        for i in range(mc.n_layers):
            for conv in ("attention_conv", "mlp_conv"):
                out[f"layers.{i}.{conv}.base_kernel"] = (2, K, mc.dim)
                out[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * K * (mc.dim // G), mc.dim)
    R = d.get("selector_rank", 0)
    if R:
        out.update({"candidate_selector.predecessor_codebook.weight": (mc.vocab_size, R),
                    "candidate_selector.successor_codebook.weight": (mc.vocab_size, R),
                    "candidate_selector.hidden_projection.weight": (R, mc.dim)})
    return out, {}


def target_fingerprint(target: Transformer | torch.Tensor) -> list[float]:
    """A cheap, dtype-tolerant identity of a target (or of its embedding, (V, D)): sums of 16 embedding rows."""
    E = target if isinstance(target, torch.Tensor) else target.embed_tokens.weight
    idx = torch.linspace(0, E.shape[0] - 1, 16).long()
    return [float(x) for x in E[idx].detach().float().sum(-1)]


def check_target(dflash: dict[str, Any], target: Transformer, tok_sha: str, where: str) -> None:
    """Raise unless `target` is the model the drafter was trained for."""
    rec = dflash.get("target", {})
    tc = target.cfg
    want = rec.get("model", {})
    for key in ("n_layers", "dim", "vocab_size"):
        if key in want and want[key] != getattr(tc, key):
            raise DlmError(f"--draft {where}: drafter was trained for a target with {key}={want[key]}, "
                           f"the target given has {getattr(tc, key)}")
    if rec.get("tokenizer_sha256") and rec["tokenizer_sha256"] != tok_sha:
        raise DlmError(f"--draft {where}: the drafter's target used a different tokenizer than the target given")
    fp = rec.get("fingerprint")
    if fp and not torch.allclose(torch.tensor(fp), torch.tensor(target_fingerprint(target)), rtol=1e-2, atol=1e-2):
        raise DlmError(f"--draft {where}: drafter was trained for another target ({rec.get('name', rec.get('path'))}); "
                       "its embeddings differ from the target given")


def mask_token_id(tok, vocab_size: int) -> int:
    """The drafter's mask token: the tokenizer's <mask>, else the first embedding row past the tokenizer."""
    if tok.mask_id is not None:
        return tok.mask_id
    if tok.vocab_size < vocab_size:
        return tok.vocab_size
    raise DlmError("the target's tokenizer has no <mask> token and its embedding has no spare row for one")
