"""One-token decoding steps captured once as a CUDA graph and replayed (gpt-fast's habit, without a compiler).

At batch 1 a GPU decode step is hundreds of small kernels, and eager PyTorch spends longer launching them than the
GPU spends running them (docs/BENCHMARKS.md, "On a GPU": a Qwen3-0.6B-shaped step takes ~20 ms eager on an H200
whose memory could read its weights in 0.4 ms). A graph replays the whole step in one launch. It needs a step
whose shapes and offsets are the same every time: the cache's write slot is a tensor (KVCache.slot), every slot is
attended to under a bool mask of the valid ones, and the token, position, slot and mask are copied into the
graph's static inputs before each replay. The logits are the eager step's up to the order of floating-point sums
(the masked keys add exact zeros).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dlm.model import KVCache, Transformer


def graphable(model: Transformer) -> bool:
    """Whether the model's decode step can be captured: on a CUDA device, no sliding-window layers (their band is
    computed from the step's offset), no mixture of experts (its routing sizes the experts' batches on the host)."""
    cfg = model.cfg
    return model.device.type == "cuda" and "sliding" not in cfg.layer_types and cfg.moe is None


class StepGraph:
    """The model's step of T new tokens over `cache` for B rows: `step(tokens (B, T) or (B,), pos likewise,
    mask (B, T, capacity) or, for T = 1, valid (B, capacity))` -> logits (B, T, V) (or (B, V) for T = 1), writing
    the tokens' K/V at slots cache.length.. and advancing it. capture=False runs the same static step eagerly (the
    check of the step itself, on any device)."""

    def __init__(self, model: Transformer, cache: KVCache, capture: bool = True, tokens: int = 1):
        B, dev, T = cache.k[0].shape[-4], model.device, tokens
        self.model, self.cache, self.T = model, cache, T
        self.tok = torch.zeros(B, T, dtype=torch.long, device=dev)
        self.pos = torch.zeros(B, T, dtype=torch.long, device=dev)
        self.mask = torch.zeros(B, 1, T, cache.capacity, dtype=torch.bool, device=dev)
        self.offsets = torch.arange(T, device=dev)
        cache.slot = self.offsets + cache.length
        self.graph = None
        if capture:
            length = cache.length
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):  # warm-up (kernel choices, workspaces) off the capture
                for _ in range(2):
                    self._run()
                    cache.length = length  # it wrote at the next step's slot, which that step overwrites
            torch.cuda.current_stream(dev).wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self._run()
            cache.length = length

    def _run(self) -> Tensor:
        logits = self.model(self.tok, pos=self.pos, cache=self.cache, mask=self.mask).logits
        return logits[:, -1] if self.T == 1 else logits

    def __call__(self, tokens: Tensor, pos: Tensor, mask: Tensor) -> Tensor:
        cache, T = self.cache, self.T
        cache.reserve(T)
        self.tok.copy_(tokens.view(self.tok.shape))
        self.pos.copy_(pos.view(self.pos.shape))
        self.mask.copy_(mask.view(self.mask.shape))
        torch.add(self.offsets, cache.length, out=cache.slot)
        if self.graph is None:
            logits = self._run()
        else:
            self.graph.replay()
            logits = self.logits
        cache.length += T
        return logits

    def close(self) -> None:
        """The cache back to ordinary steps (writes at cache.length, keys sliced)."""
        self.cache.slot = None
