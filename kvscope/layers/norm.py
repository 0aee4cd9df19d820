"""RMSNorm, optionally fused with the residual add that precedes it in a pre-norm block."""
from __future__ import annotations

import torch
from torch import nn

from kvscope.kernels.fused import fused_kernels


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
        # (The dtype casts are skipped when they would change nothing: a CPU step on the small
        # model is many small ops, each paying its dispatch.)
        x32 = x if x.dtype == torch.float32 else x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + self.eps)
        return self.weight * (x32 if x.dtype == torch.float32 else x32.to(x.dtype))

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
