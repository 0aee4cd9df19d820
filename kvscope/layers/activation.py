"""Gated activation for SwiGLU MLPs."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvscope.kernels.fused import fused_kernels


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` for ``x = [gate | up]`` packed on the last dim (from gate_up_proj);
    one fused kernel on CUDA."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = fused_kernels(x)
        if fused is not None:
            return fused.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
