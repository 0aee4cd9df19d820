"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm block."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvscope.kernels.fused import fused_kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm over the last dim: normalised in float32, scaled by ``weight`` (broadcast
    from the right, e.g. ``[D]`` or one row per head ``[H, D]``) in ``x``'s dtype.

    On float32 input torch's own ``rms_norm`` gives the same bits in one call instead of six
    (a CPU step on the small model is many small ops, each paying its dispatch).
    """
    if x.dtype == torch.float32:
        if weight.dim() == 1:
            return F.rms_norm(x, weight.shape, weight, eps)
        return weight * F.rms_norm(x, x.shape[-1:], None, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


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

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        fused = fused_kernels(x)
        if fused is not None:
            if residual is None:
                return fused.rms_norm(x, self.weight, self.eps)
            return fused.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        x = x + residual
        return rms_norm(x, self.weight, self.eps), x
