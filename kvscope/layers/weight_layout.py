"""How the matmul weights are held on a CPU: packed once for oneDNN.

A decode step multiplies a few rows by every weight of the model. oneDNN's matmul on a weight
reordered once into its own blocked layout does that faster than the BLAS call ``F.linear``
makes on a plain matrix (benchmarks/RESULTS.md, issue 19), so the CPU runner packs each
float32 matmul weight at load time and the matmul layers multiply by the packed copy.

Where oneDNN is missing (or the weights are not float32) the weights are laid out
input-major instead: the transpose of a contiguous ``[in, out]`` matrix, which the BLAS takes
as a plain row-major operand.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvscope.kernels.fused import linear_kernels


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias``, by the packed copy of ``weight`` when there is one; on CUDA a
    decode step's few rows take kvscope's own kernel (:mod:`kvscope.kernels.triton_linear`)."""
    if packed is None:
        kernels = linear_kernels(x)
        return F.linear(x, weight, bias) if kernels is None else kernels.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def can_pack(dtype: torch.dtype) -> bool:
    """Whether this torch build packs ``dtype`` weights for oneDNN."""
    return dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack_cpu_weights(model: nn.Module) -> bool:
    """Pack every matmul weight of ``model`` (the modules with a ``packed_weight`` slot) for
    oneDNN, or lay them out input-major where that cannot be done; returns whether they were
    packed.

    A packed weight is a copy; the plain one is kept only where another module reads it (a
    tied embedding reads its LM head's weight). The others move to the meta device, so the
    model holds its weights once and any read of a dropped value fails loudly.
    """
    matmuls = [m for m in model.modules() if hasattr(m, "packed_weight")]
    if not matmuls:
        return False
    if not can_pack(matmuls[0].weight.dtype):
        for m in matmuls:
            m.weight.data = m.weight.data.t().contiguous().t()
        return False
    read_elsewhere = {id(p) for m in model.modules() if not hasattr(m, "packed_weight")
                      for p in m.parameters(recurse=False)}
    for m in matmuls:
        m.packed_weight = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), None)
        if id(m.weight) not in read_elsewhere:
            m.weight = nn.Parameter(torch.empty_like(m.weight, device="meta"), requires_grad=False)
    return True
