"""The one switch every layer (and the sampler) asks before taking its Triton fused kernel on CUDA
instead of its torch code. It lives with the kernels, so layers depend on it and not on each other."""
from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

# Set False to run the torch code on CUDA too (A/B comparisons, debugging a kernel; the
# measured difference is in benchmarks/RESULTS.md).
USE_FUSED_KERNELS = True


@functools.cache
def _triton_module(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"kvscope.kernels.{name}")
    except Exception:  # no triton, or one that fails to load (built for another torch / CUDA)
        return None


def fused_kernels(x: torch.Tensor) -> ModuleType | None:
    """:mod:`kvscope.kernels.triton_fused` when ``x`` is on CUDA, Triton loads and
    ``USE_FUSED_KERNELS`` is set; else ``None``, meaning: use the torch code (always on CPU)."""
    return _triton_module("triton_fused") if x.is_cuda and USE_FUSED_KERNELS else None


def linear_kernels(x: torch.Tensor) -> ModuleType | None:
    """:mod:`kvscope.kernels.triton_linear` under the same conditions as :func:`fused_kernels`
    (it decides per call whether its kernel or ``F.linear`` does the matmul), else ``None``."""
    return _triton_module("triton_linear") if x.is_cuda and USE_FUSED_KERNELS else None


def sampling_kernels(device: torch.device, use_triton: bool | None = None) -> ModuleType | None:
    """:mod:`kvscope.kernels.triton_sampling` on a CUDA device under the same conditions as
    :func:`fused_kernels`, else ``None`` (the sampler's torch code). ``use_triton=True`` asks for
    it on any device (CPU tensors run under Triton's interpreter: the tests), ``False`` never."""
    return _sampler_module("triton_sampling", device, use_triton)


def penalty_kernels(device: torch.device, use_triton: bool | None = None) -> ModuleType | None:
    """:mod:`kvscope.kernels.triton_penalties` under the conditions of :func:`sampling_kernels`
    (the sampler asks for both with the same ``use_triton``)."""
    return _sampler_module("triton_penalties", device, use_triton)


def _sampler_module(name: str, device: torch.device, use_triton: bool | None) -> ModuleType | None:
    if use_triton is None:
        use_triton = device.type == "cuda" and USE_FUSED_KERNELS
    return _triton_module(name) if use_triton else None
