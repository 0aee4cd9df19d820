"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm block.

Also home of :func:`fused_kernels`, the one switch every layer asks before taking its Triton
fused kernel on CUDA instead of its torch code.
"""
from __future__ import annotations

import functools
from types import ModuleType

import torch
from torch import nn

# Set False to run the torch code on CUDA too (A/B comparisons, debugging a kernel); the
# fused kernels roughly double decode throughput on an H200 (benchmarks/RESULTS.md).
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


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, normalised in float32 and scaled in the input dtype (as HF does).

    Called with ``residual`` it first adds it to ``x`` and returns ``(normed, x + residual)``:
    the pre-norm decoder carries the running residual stream through every layer this way.
    On CUDA either form is one fused kernel (fp32 math, rounded once to ``x``'s dtype).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        fused = fused_kernels(x)
        if fused is not None:
            if residual is None:
                return fused.rms_norm(x, self.weight, self.eps)
            return fused.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
