"""How an fp8 KV pool stores K/V (``kv_cache_dtype="fp8"``): ``x / scale`` as e4m3, per layer
scales; shared by the torch backends (the Triton kernels do the same in registers)."""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | float, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as stored in a pool of ``cache_dtype``: an fp8 pool holds ``x / scale``, clamped to
    the e4m3 range (a cast alone turns out-of-range values into NaN)."""
    if cache_dtype != FP8_DTYPE:
        return x if x.dtype == cache_dtype else x.to(cache_dtype)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(cache_dtype)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """Pool contents back in the compute ``dtype``; the inverse of :func:`quantize_kv`."""
    if x.dtype != FP8_DTYPE:
        return x
    return (x.float() * scale).to(dtype)
