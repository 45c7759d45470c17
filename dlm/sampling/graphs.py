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
from torch import Tensor, nn

from dlm import kernels
from dlm.model import Attention, KVCache, PackedLinear, Transformer
from dlm.rope import query_scale, rope_attention_factor, rope_cos_sin


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


def compilable(model) -> bool:
    """Whether the row batch can run the model's one-token steps as one compiled static step (RowsStep): a plain
    backbone (not a drafter), no sliding-window layers, no mixture of experts, no absolute positions."""
    cfg = getattr(model, "cfg", None)
    return (getattr(model, "rows_static", False) and "sliding" not in cfg.layer_types and cfg.moe is None
            and not cfg.learned_pos and not cfg.grid_pos)


class RowsStep:
    """One token for each of R rows of a row batch (dlm.sampling.rows) as a static step: row b writes its K/V at its
    own slot and attends to the slots its `valid` row allows, over the first S slots of every row. Nothing in it
    depends on a Python number but the shapes, so torch.compile (inductor: C++ on a CPU, Triton on a GPU) can trace
    it for every R and S at once (dynamic shapes) and fuse the elementwise work between the matrix products.

    What is compiled is the decoder stack, the final norm and the LM head in one graph (one call into compiled code
    a step), with the weights frozen (inductor's `freezing`: constants of the compiled code, which may keep them
    prepacked for its products: their memory once more); the embedding and RoPE tables stay eager. The step takes
    each layer's whole buffer and writes into it at [row, :, slot] (a write into a view made outside the graph, or
    inside it, is traced as a copy of the view's rows and slots out and back, every layer: docs/log/batching.md).
    On a CPU, the one-row step's products are written as the multiply-and-sum they are (RowLinear): inductor
    generates them as reductions over the frozen row-major weights, fused with the work around them, which read the
    weights ~2x as fast as MKL's matrix-vector product of a transposed weight does here. The attention of those
    steps is dlm's own kernel (dlm/kernels/row_attention.cpp, `row_attention`). Several rows' products are
    inductor's generated C++ matrix products where its autotuning finds them faster than the library's (max_autotune,
    CPU only), and each is blocked for the row count it was tuned at: so the step is compiled for three spans of row
    counts, one row, FEW - 1 rows at most, more (`mark_dynamic` ranges; ar-mid's 4-row step ~9 -> ~5 ms,
    docs/log/batching.md). Dynamo's guards skip the model's modules (the step's model is fixed; its weights are
    frozen constants anyway).

    `step(tokens (R,), pos (R,), slot (R,), valid (R, S), ks, vs)` -> logits (R, V), ks / vs each layer's whole
    buffer (>= R rows, >= S slots; per-layer buffers: KVCache(per_layer=True)), of which rows 0..R-1 and slots
    0..S-1 are read. compile=False runs the same step eagerly (what the compiled one is checked against)."""

    FEW = 8  # (the row counts below it share one compiled step, tuned at 4 rows; from it on, one tuned at 16)

    def __init__(self, model: Transformer, compile: bool = True):
        self.model, self.compile = model, compile
        cpu = model.device.type == "cpu"
        if compile and cpu:
            row_linears(model)
            row_attention(model)
        # (inductor's options, read when a call compiles: frozen weights; on a CPU several rows' products autotuned,
        # the timings unprinted)
        self.options = dict(freezing=True)
        if cpu:
            self.options.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN",
                                autotune_num_choices_displayed=0, max_autotune_report_choices_stats=False)
        guards = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
        self.stack = torch.compile(self._stack, dynamic=True, options=guards) if compile else self._stack
        self.wstack = torch.compile(self._wstack, dynamic=True, options=guards) if compile else self._wstack

    def warm(self, capacity: int) -> None:
        """Compile now, for buffers of `capacity` slots per row (their strides are part of the compiled code: buffers
        of another capacity may compile again), for each span of row counts (one row; 2..FEW-1; FEW and more), under
        inference mode as the row batch runs; raises what the compiler raises."""
        model, dev = self.model, self.model.device
        with torch.inference_mode():  # (inference tensors, as the row batch's buffers: their dispatch keys are guarded)
            cache = model.rows_cache(16, capacity, per_layer=True)  # (a buffer of 1 row would be traced apart)
            S = min(5, capacity)
            for R in (4, 16, 1):  # (the row counts each span is tuned at)
                length = torch.arange(R, device=dev).clamp(max=S - 1)
                valid = torch.arange(S, device=dev)[None] <= length[:, None]  # (R, S)
                self(torch.zeros(R, dtype=torch.long, device=dev), length, length, valid, cache.k, cache.v)

    def _stack(self, x: Tensor, rope: tuple[Tensor, ...], mask: Tensor, slot: Tensor, ks: list[Tensor],
               vs: list[Tensor]) -> Tensor:
        return self._wstack(x, rope, mask, slot, ks, vs)[0]  # (the layers' outputs unused: traced away)

    def _wstack(self, x: Tensor, rope: tuple[Tensor, ...], mask: Tensor, slot: Tensor, ks: list[Tensor],
                vs: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        out = []  # (every layer's output: the graph holds them anyway, and no tap list is traced as a constant)
        for block, k, v in zip(self.model.layers, ks, vs):
            cache = RowsCache.over([k], [v], 0)
            cache.slot, cache.span = slot, mask.shape[-1]
            x = block(x, rope, mask, False, cache, 0, True)
            out.append(x)
        return self.model.head(self.model.norm(x)), out

    def window(self, tokens: Tensor, pos: Tensor, slot: Tensor, valid: Tensor, ks: list[Tensor], vs: list[Tensor],
               taps: tuple[int, ...] = ()) -> tuple[Tensor, list[Tensor]]:
        """T new tokens of each of R rows (a speculative verify's window): tokens, pos, slot (R, T), valid (R, T, S)
        (the slots each query sees: its row's cache and the window up to itself) -> logits (R, T, V) and the outputs
        of layers `taps`, each (R, T, D). Compiled apart from the one-token step: a graph per T, its products tuned at
        R x T rows (`warm_window`); compile=False runs the same stack eagerly."""
        x, rope = self._inputs(tokens, pos)  # (R, T, D)
        mask = valid[:, None]  # (R, 1, T, S)
        if not self.compile:
            logits, out = self.wstack(x, rope, mask, slot, ks, vs)
        else:
            import torch._inductor.config as inductor

            torch._dynamo.mark_static(x, 1)  # (a graph per window width: its products tuned at its rows)
            with inductor.patch(**self.options), torch.fx.experimental._config.patch(use_duck_shape=False):
                logits, out = self.wstack(x, rope, mask, slot, ks, vs)
        return logits, [out[i] for i in taps]

    def _inputs(self, tokens: Tensor, pos: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        """tokens, pos (R, T) -> their embeddings (R, T, D) and rotary tables (with the queries' scale where the
        model's rope scaling has one), outside the compiled stack."""
        model = self.model
        x = model.embed(tokens)
        rs = model.cfg.rope_scaling
        rope = rope_cos_sin(model.inv_freq, pos, x.dtype, rope_attention_factor(rs))
        qs = query_scale(rs, pos)
        return x, rope if qs is None else (*rope, qs)

    def warm_window(self, capacity: int, T: int) -> None:
        """Compile the one-row window of T tokens now (buffers of `capacity` slots per row, as warm)."""
        model, dev = self.model, self.model.device
        with torch.inference_mode():
            cache = model.rows_cache(2, capacity, per_layer=True)
            S = min(T + 4, capacity)
            slot = torch.arange(S - T, S, device=dev)[None]  # (1, T)
            valid = torch.arange(S, device=dev)[None, None] <= slot[:, :, None]  # (1, T, S)
            self.window(torch.zeros(1, T, dtype=torch.long, device=dev), slot, slot, valid, cache.k, cache.v)

    def __call__(self, tokens: Tensor, pos: Tensor, slot: Tensor, valid: Tensor, ks: list[Tensor],
                 vs: list[Tensor]) -> Tensor:
        x, rope = self._inputs(tokens[:, None], pos[:, None])  # (R, 1, D)
        mask, slot = valid[:, None, None, :], slot[:, None]  # (R, 1, 1, S), (R, 1)
        if self.compile:  # (freezing is read when a call compiles; duck sizing off: R == n_kv_heads is no reason to
            # retrace)
            import torch._inductor.config as inductor

            R = x.shape[0]
            if R > 1:  # (the span of row counts this step is compiled for)
                lo, hi = (2, self.FEW - 1) if R < self.FEW else (self.FEW, 1 << 16)
                torch._dynamo.mark_dynamic(x, 0, min=lo, max=hi)
            with inductor.patch(**self.options), torch.fx.experimental._config.patch(use_duck_shape=False):
                x = self.stack(x, rope, mask, slot, ks, vs)
        else:
            x = self.stack(x, rope, mask, slot, ks, vs)
        return x[:, 0]


class RowLinear(nn.Module):
    """A linear layer whose product of one row, inside a compiled graph, is `(x * W).sum(-1)`: inductor then
    generates it as a reduction over the frozen (out, in) weight, fused with its neighbours, instead of calling MKL's
    matrix-vector product of the transposed weight (~9 GB/s on an AVX2 CPU where a contiguous read runs at 25-35:
    ar-mid's one-row step 9.1 -> ~4 ms, docs/log/batching.md). Everywhere else (eager, several rows) it is the layer
    it wraps, bit for bit. The weight and bias are the layer's own (state_dict names unchanged, tied weights tied)."""

    def __init__(self, lin: nn.Module):
        super().__init__()
        self.weight, self.bias = lin.weight, lin.bias
        self.__dict__["wrapped"] = lin  # (not a child: its parameters are these)

    def forward(self, x: Tensor) -> Tensor:
        if torch.compiler.is_compiling() and x.numel() == x.shape[-1]:
            y = (x[..., None, :] * self.weight).sum(-1)
            return y if self.bias is None else y + self.bias
        return self.wrapped(x)


def row_linears(model: nn.Module) -> int:
    """Every linear layer of the model (nn.Linear, dlm.model.PackedLinear) as a RowLinear; the number wrapped."""
    todo = [(parent, name, m) for parent in model.modules() for name, m in parent.named_children()
            if type(m) in (nn.Linear, PackedLinear)]
    for parent, name, m in todo:
        setattr(parent, name, RowLinear(m))
    return len(todo)


def row_attention(model: nn.Module) -> int:
    """Every attention layer of the model on dlm's row attention kernel in compiled one-token steps, where the kernel
    builds (dlm.kernels; else PyTorch's attention stays); the number of layers set."""
    if not kernels.row_attention():
        return 0
    n = 0
    for m in model.modules():
        if isinstance(m, Attention):
            m.row_kernel = True
            n += 1
    return n


class RowsCache(KVCache):
    """RowsStep's view of one layer's whole buffers: row b of the step's R rows writes its K/V at slot[b], and the
    attention reads rows 0..R-1, slots 0..span-1."""

    span: int = 0

    def update(self, layer: int, k: Tensor, v: Tensor, write: bool, kc: Tensor | None = None,
               vc: Tensor | None = None, lo: int = 0) -> tuple[Tensor, Tensor]:
        ck, cv = self.k[layer], self.v[layer]  # (rows, Hkv, capacity, hd)
        R = k.shape[0]
        b = torch.arange(R, device=ck.device)[:, None]  # (R, 1)
        ck[b, :, self.slot] = k.transpose(1, 2).to(ck.dtype)  # (R, T, Hkv, hd) at [b, :, slot[b, t]]; a bfloat16
        cv[b, :, self.slot] = v.transpose(1, 2).to(cv.dtype)  # cache (Transformer.kv_dtype) rounds them here
        return ck[:R, :, :self.span], cv[:R, :, :self.span]
