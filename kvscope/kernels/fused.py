"""The one switch every layer asks before taking its Triton fused kernel on CUDA instead of its
torch code. It lives with the kernels, so layers depend on it and not on each other."""
from __future__ import annotations

import functools
from types import ModuleType

import torch

# Set False to run the torch code on CUDA too (A/B comparisons, debugging a kernel; the
# measured difference is in benchmarks/RESULTS.md).
USE_FUSED_KERNELS = True


@functools.cache
def _triton_fused() -> ModuleType | None:
    try:
        from kvscope.kernels import triton_fused
    except Exception:  # no triton, or one that fails to load (built for another torch / CUDA)
        return None
    return triton_fused


def fused_kernels(x: torch.Tensor) -> ModuleType | None:
    """:mod:`kvscope.kernels.triton_fused` when ``x`` is on CUDA, Triton loads and
    ``USE_FUSED_KERNELS`` is set; else ``None``, meaning: use the torch code (always on CPU)."""
    return _triton_fused() if x.is_cuda and USE_FUSED_KERNELS else None
