"""dlm's own CPU kernels, built on first use with the machine's C++ compiler (torch.utils.cpp_extension; the build is
cached under torch's extensions folder). A kernel that cannot be built leaves its caller on PyTorch's own operator."""

from __future__ import annotations

import functools
import os
import warnings

import torch


def _flags() -> list[str]:
    """The vector width ATen's Vectorized<T> is compiled for: the one PyTorch itself runs at on this CPU."""
    cap = torch.backends.cpu.get_cpu_capability()
    if cap.startswith("AVX512"):
        return ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512dq", "-mavx512vl",
                "-mavx512bw", "-mfma"]
    if cap == "AVX2":
        return ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma"]
    return []


def _build(name: str, source: str, what: str) -> bool:
    """Build and load one kernel source of this folder (cached); False, with a warning, where it cannot be built."""
    try:
        from torch.utils.cpp_extension import load

        load(name=name, sources=[os.path.join(os.path.dirname(__file__), source)], extra_cflags=["-O3", *_flags()],
             is_python_module=False, verbose=False)
    except Exception as e:  # (no compiler, no ninja, a build error: PyTorch's operator does the same sums)
        warnings.warn(f"dlm: the {what} kernel was not built ({type(e).__name__}: {str(e)[:200]}); its callers "
                      "fall back to PyTorch's operator")
        return False
    return True


@functools.cache
def row_attention() -> bool:
    """Whether torch.ops.dlm.row_attention (row_attention.cpp) is loaded; builds it the first time."""
    if not _build("dlm_row_attention", "row_attention.cpp", "row attention"):
        return False

    @torch.library.register_fake("dlm::row_attention")
    def _(q, k, v, mask, scale):
        return q.new_empty(q.shape)

    return True


@functools.cache
def blocked_linear() -> bool:
    """Whether torch.ops.dlm.blocked_linear (blocked_linear.cpp) is loaded; builds it the first time. (Eager forwards
    only, model.PackedLinear: no fake registered, nothing traces it.)"""
    return _build("dlm_blocked_linear", "blocked_linear.cpp", "blocked linear")


def blocked_weight(w: torch.Tensor) -> torch.Tensor:
    """A linear layer's weight (N, K), N a multiple of 16, in blocked_linear's layout: (N / 16, K, 16), contiguous."""
    N, K = w.shape
    return w.detach().reshape(N // 16, 16, K).transpose(1, 2).contiguous()
