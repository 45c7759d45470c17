"""Every attention mask of dlm, training and inference side by side.

Each mask is a predicate of (batch, head, query index, key index) -> bool, True where the query may
attend to the key (the `mask_mod` signature of torch's flex_attention), closed over whatever
per-position facts it needs (block ids, anchors, valid keys). One helper, `dense`, evaluates a
predicate over a grid of indices into the boolean tensor scaled_dot_product_attention takes; a GPU
path may hand the same predicate to flex_attention instead. The predicates use only tensor
operations (no Python branching on values), as flex_attention requires.

Layouts (keys left to right, queries top to bottom):

training
  block_causal          clean tokens; a token sees its own block and the blocks before (BD3-LM's x_0)
  block_diffusion_train [x_t | x_0]: a noisy block sees itself and the clean blocks before (MDLM/BD3-LM)
  joint_train           [x_t | x_0]: the diffusion half as above, the clean half causal (AR + diffusion)
  usdm_canvas_train     [clean | canvas]: clean causal; the canvas sees the clean keys before its start
  dflash_train          [context | A blocks]: a block sees the context before its anchor and itself
  elbo_noisy_block      [cached clean | noisy]: a noisy block sees the clean blocks before and itself
inference
  causal                a causal query block over a cached prefix (the model's mask="causal")
  padded_prefill        left-padded prompts, causal over real keys; a pad sees itself
  key_valid             one decoding step of a batch: the keys each row really holds
  mdlm_denoise          block-causal rows of a sequence being denoised, optionally causal context
  quadratic_self_spec   a joint model's quadratic self-speculation pass (first tokens, rows of masks)
  dflash_draft          a DFlash drafter's block over [cache ; context ; block]
sliding-window layers see one of these within their band (sliding_band), from positions
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

class LayerMasks(NamedTuple):
    """One bool mask for the full-attention layers and one for the sliding-window layers (a backbone with both,
    in a training forward whose layout a single mask plus a band cannot describe)."""

    full: Tensor
    sliding: Tensor


Mask = str | Tensor | LayerMasks  # what the model takes: "causal" | "full" | bool tensor | one per layer kind
# (batch, head, query, key) index tensors -> bool tensor, True = may attend (flex_attention's mask_mod)
Predicate = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def dense(pred: Predicate, queries: int, keys: int, device: torch.device | str = "cpu",
          batch: int | None = None) -> Tensor:
    """The predicate over every (query, key): (queries, keys) bool, or (batch, queries, keys) when batch is given."""
    q = torch.arange(queries, device=device)[:, None]
    k = torch.arange(keys, device=device)[None, :]
    zero = torch.zeros((), dtype=torch.long, device=device)
    if batch is None:
        return pred(zero, zero, q, k).expand(queries, keys)
    b = torch.arange(batch, device=device)[:, None, None]
    return pred(b, zero, q[None], k[None]).expand(batch, queries, keys)


def _block(i: Tensor, size: int) -> Tensor:
    return torch.div(i, size, rounding_mode="floor")


# training -----------------------------------------------------------------------------------------

def block_causal(L: int) -> Predicate:
    """A token sees every token of its own block of L and of the blocks before."""
    return lambda b, h, q, k: _block(q, L) >= _block(k, L)


def block_causal_mask(T: int, L: int, device: torch.device | str = "cpu") -> Tensor:
    """(T, T): block-causal clean tokens (mdlm's clean pass, its ELBO's cached context)."""
    return dense(block_causal(L), T, T, device)


def _noisy_rows(T: int, L: int) -> Predicate:
    """Rows of x_t over [x_t | x_0]: its own noisy block, the clean blocks strictly before."""
    def pred(b, h, q, k):
        bq, bk = _block(q, L), _block(k % T, L)
        return torch.where(k < T, bq == bk, bq > bk)
    return pred


def block_diffusion_train(T: int, L: int) -> Predicate:
    """[x_t | x_0] of 2T: a noisy block sees itself and the clean blocks before; a clean block sees the
    clean blocks up to its own (block diffusion, BD3-LM)."""
    noisy = _noisy_rows(T, L)

    def pred(b, h, q, k):
        clean = (k >= T) & (_block(q % T, L) >= _block(k % T, L))
        return torch.where(q < T, noisy(b, h, q, k), clean)
    return pred


def block_diffusion_train_mask(T: int, L: int, device: torch.device | str = "cpu") -> Tensor:
    """(2T, 2T): mdlm's training forward over [x_t | x_0]."""
    return dense(block_diffusion_train(T, L), 2 * T, 2 * T, device)


def joint_train(T: int, L: int, draft: Tensor | None = None) -> Predicate:
    """[x_t | x_0] of 2T: the diffusion half as block_diffusion_train, the clean half causal (the AR half).

    draft (B, T // L) bool: the draft-form blocks of each row (--draft-ar-first), whose first (kept)
    token does not see the masks after it, as a self-speculation draft's first token does not.
    """
    noisy = _noisy_rows(T, L)

    def pred(b, h, q, k):
        out = torch.where(q < T, noisy(b, h, q, k), (k >= T) & (k <= q))
        if draft is not None:
            blk, n = _block(q % T, L), draft.shape[1]  # a last block shorter than L is never draft-form
            kept = (q < T) & (q % L == 0) & (blk < n) & draft[b, blk.clamp(max=n - 1)]
            out = out & ~(kept & (k < T) & (k > q) & (_block(k % T, L) == _block(q % T, L)))
        return out
    return pred


def joint_train_mask(T: int, L: int, device: torch.device | str = "cpu", draft: Tensor | None = None) -> Tensor:
    """(2T, 2T), or (B, 2T, 2T) with draft (B, T // L): the joint objective's forward over [x_t | x_0]."""
    if draft is None:
        return dense(joint_train(T, L), 2 * T, 2 * T, device)
    return dense(joint_train(T, L, draft), 2 * T, 2 * T, draft.device, batch=draft.shape[0])


def usdm_canvas_train(T: int, start: Tensor) -> Predicate:
    """[clean (T) | canvas]: clean keys causal; canvas rows see the clean keys before start[b] and the whole canvas."""
    return lambda b, h, q, k: torch.where(q < T, k <= q, (k >= T) | (k < start[b]))


def usdm_canvas_train_mask(T: int, L: int, start: Tensor, window: int | None = None) -> Tensor | LayerMasks:
    """(B, 1, T + L, T + L): usdm's encoder + denoiser forward, the canvas of row b placed at start[b]; with a
    window, also the sliding-window layers' mask (LayerMasks): that mask within the band (sliding_band) of the
    positions, clean rows causal, the canvas a block from start[b] (DiffusionGemma's decoder over a cache, what the
    sampler computes)."""
    B, dev = start.shape[0], start.device
    full = dense(usdm_canvas_train(T, start), T + L, T + L, dev, batch=B)[:, None]
    if window is None:
        return full
    pos = torch.cat([torch.arange(T, device=dev).expand(B, T), start[:, None] + torch.arange(L, device=dev)], 1)
    block = torch.cat([torch.full((B, T), -1, device=dev, dtype=start.dtype), start[:, None].expand(B, L)], 1)
    band = sliding_band(pos[:, :, None], pos[:, None, :], window, block[:, :, None])  # (B, T + L, T + L)
    return LayerMasks(full, full & band[:, None])


def dflash_train(anchors: Tensor, n_ctx: int, block_size: int, causal_ctx: bool = False) -> Predicate:
    """[context (n_ctx) | A blocks of block_size]: a block's queries see the context strictly before its
    anchor (anchors (B, A)) and the block itself. causal_ctx (input injection): the context positions
    are queries too, causal among themselves, ahead of the blocks."""
    first = n_ctx if causal_ctx else 0  # the first block query

    def pred(b, h, q, k):
        slot = (q - first).clamp(min=0)
        a = _block(slot, block_size)  # the block of the query
        sees = torch.where(k < n_ctx, k < anchors[b, a], _block((k - n_ctx).clamp(min=0), block_size) == a)
        return torch.where(q < first, k <= q, sees)
    return pred


def dflash_train_mask(anchors: Tensor, n_ctx: int, block_size: int, causal_ctx: bool = False) -> Tensor:
    """(B, 1, Q, n_ctx + A * block_size), Q = A * block_size (+ n_ctx with causal_ctx): DFlash's multi-block forward."""
    B, A = anchors.shape
    Q = A * block_size + (n_ctx if causal_ctx else 0)
    pred = dflash_train(anchors, n_ctx, block_size, causal_ctx)
    return dense(pred, Q, n_ctx + A * block_size, anchors.device, batch=B)[:, None]


def elbo_noisy_block(T: int, L: int) -> Predicate:
    """[cached clean (T) | noisy (T)]: a noisy block sees the clean blocks strictly before it and itself."""
    def pred(b, h, q, k):
        bq, bk = _block(q, L), _block(k % T, L)
        return torch.where(k < T, bq > bk, bq == bk)
    return pred


def elbo_noisy_block_mask(T: int, L: int, device: torch.device | str = "cpu") -> Tensor:
    """(T, 2T): the noisy pass of mdlm's block ELBO over the clean blocks' cache."""
    return dense(elbo_noisy_block(T, L), T, 2 * T, device)


# inference ----------------------------------------------------------------------------------------

def causal(offset: int = 0) -> Predicate:
    """Query i (key index offset + i) sees every key up to itself."""
    return lambda b, h, q, k: k <= q + offset


def causal_mask(T: int, S: int, device: torch.device | str = "cpu") -> Tensor:
    """(T, S): T causal queries, the last T of S keys (a cached prefix of S - T before them)."""
    return dense(causal(S - T), T, S, device)


def sdpa_mask(mask: Mask, T: int, S: int, device: torch.device) -> tuple[Tensor | None, bool]:
    """Resolve a mask spec over T queries and S keys into what SDPA takes: (bool mask or None, is_causal)."""
    if isinstance(mask, Tensor):
        if mask.dtype != torch.bool:
            raise ValueError(f"attention mask must be bool, got {mask.dtype}")
        if mask.shape[-2:] != (T, S):
            raise ValueError(f"attention mask must end in (T={T}, S={S}), got {tuple(mask.shape)}")
        while mask.dim() < 4:
            mask = mask.unsqueeze(0) if mask.dim() < 3 else mask.unsqueeze(1)
        return mask, False
    if mask == "full" or (mask == "causal" and T == 1):
        return None, False
    if mask == "causal":
        if S == T:
            return None, True
        return causal_mask(T, S, device), False
    raise ValueError(f"mask must be 'causal', 'full' or a bool tensor, got {mask!r}")


def padded_prefill(valid: Tensor) -> Predicate:
    """Left-padded prompts: a query sees the real keys (valid (B, P)) up to itself; a pad query sees itself."""
    return lambda b, h, q, k: ((k <= q) & valid[b, k]) | (q == k)


def padded_prefill_mask(valid: Tensor) -> Tensor:
    """(B, 1, P, P) for the prefill of a batch of left-padded prompts, valid (B, P)."""
    B, P = valid.shape
    return dense(padded_prefill(valid), P, P, valid.device, batch=B)[:, None]


def key_valid(valid: Tensor) -> Predicate:
    """Every query of row b sees the keys valid[b] marks (the real ones of a padded batch cache)."""
    return lambda b, h, q, k: valid[b, k]


def key_valid_mask(valid: Tensor) -> Tensor:
    """(B, 1, 1, S): one new token per row over S cached keys, valid (B, S)."""
    B, S = valid.shape
    return dense(key_valid(valid), 1, S, valid.device, batch=B)[:, None]


def sliding_band(q: Tensor, k: Tensor, window: int, block: Tensor | int | None = None) -> Tensor:
    """A sliding-window layer's band, from positions: q (..., T, 1) of the queries, k (..., 1, S) of the keys ->
    (..., T, S) bool. A causal query at position p sees the keys at (p - window, p]; a query of a bidirectional
    block that starts at position s (block: s per query, broadcastable to q, -1 where the query is causal; or one s
    for all; None: all causal) sees the keys from s - (window - 1) on: the window - 1 before the block and the whole
    block (DiffusionGemma's decoder over a cache). The layer's mask is its full mask and this band."""
    causal = (k > q - window) & (k <= q)
    if block is None:
        return causal
    seen = k >= block - (window - 1)
    if isinstance(block, int):
        return seen.expand_as(causal)
    return torch.where(block >= 0, seen, causal)


def causal_layers(cfg, mask: Tensor) -> Tensor | LayerMasks:
    """A causal layout given as a bool mask (B, 1, T, S) over [cache (S - T) ; T queries] (left-padded prompts, a
    batch's decoding step), for a backbone with sliding-window layers (ModelConfig.layer_types; any other gets mask
    as it is): those layers see the mask within the band of the last window keys. Key index = position within each
    row (its keys contiguous, ending at its last query), as the padded layouts keep them."""
    if "sliding" not in cfg.layer_types:
        return mask
    T, S = mask.shape[-2:]
    q = torch.arange(S - T, S, device=mask.device)[:, None]
    return LayerMasks(mask, mask & sliding_band(q, torch.arange(S, device=mask.device)[None], cfg.sliding_window))


def mdlm_denoise(block_of: Tensor, start: int, keys: int, causal_context: bool = False) -> Predicate:
    """Rows from position start (block_of: the block of each position) see keys whose block is not after
    theirs. causal_context: rows of finished blocks see only the keys up to themselves (the causal K/V
    a joint model's AR half computes); rows of the last block (the one denoised) still see all of it."""
    last = block_of[keys - 1]

    def pred(b, h, q, k):
        qa = q + start
        allowed = block_of[qa] >= block_of[k]
        if causal_context:
            allowed = allowed & ((k <= qa) | (block_of[qa] == last))
        return allowed
    return pred


def mdlm_denoise_mask(block_of: Tensor, start: int, stop: int, causal_context: bool = False) -> Tensor:
    """(stop - start, stop): a denoising pass over positions [start, stop) whose keys are positions 0..stop-1."""
    return dense(mdlm_denoise(block_of, start, stop, causal_context), stop - start, stop, block_of.device)


def quadratic_self_spec(m: int, L: int, cached: int) -> Predicate:
    """A quadratic pass over [cache (cached) ; m+1 row-first tokens ; m+1 rows of L masks].

    Row-first token i sees the cache and row-first tokens <= i; mask slot j of row i sees the cache,
    row-first tokens <= i and every mask of row i.
    """
    R = m + 1

    def row(i):
        return torch.where(i < R, i, _block((i - R).clamp(min=0), L))

    def pred(b, h, q, k):
        kk = k - cached
        q_first, k_first = q < R, kk < R
        q_row, k_row = row(q), row(kk.clamp(min=0))
        sees = (k_first & (k_row <= q_row)) | (~q_first & ~k_first & (k_row == q_row))
        return (k < cached) | sees
    return pred


def quadratic_self_spec_mask(m: int, L: int, cached: int, device: torch.device | str = "cpu") -> Tensor:
    """(Q, cached + Q), Q = (m + 1)(L + 1): quadratic self-speculation; m = 0 with L masks is one row (linear-ar)."""
    Q = (m + 1) * (L + 1)
    return dense(quadratic_self_spec(m, L, cached), Q, cached + Q, device)


def dflash_draft(cache_len: int, n_ctx: int) -> Predicate:
    """Queries [new context (n_ctx) ; block] over keys [cache ; new context ; block]: context rows causal,
    the block sees everything."""
    return lambda b, h, q, k: (k <= q + cache_len) | (q >= n_ctx)


def dflash_draft_mask(injection: str, cache_len: int, n_ctx: int, T: int, device: torch.device | str) -> Mask:
    """A DFlash drafter's inference mask for a block of T: "full" for kv injection (or no new context),
    else (n_ctx + T, cache_len + n_ctx + T) for input injection."""
    if injection == "kv" or n_ctx == 0:
        return "full"
    return dense(dflash_draft(cache_len, n_ctx), n_ctx + T, cache_len + n_ctx + T, device)
