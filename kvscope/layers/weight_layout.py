"""The memory order of the matmul weights on a CPU."""
from __future__ import annotations

from torch import nn

from kvscope.layers.embedding import ParallelLMHead
from kvscope.layers.linear import ColumnParallelLinear, RowParallelLinear


def input_major_weights(model: nn.Module) -> None:
    """Lay every matmul weight ``W`` ``[out, in]`` of ``model`` out as the transpose of a
    contiguous ``[in, out]`` matrix: the same values and shape, another memory order.

    ``F.linear`` computes ``x @ W.T``; in this order the CPU's BLAS gets ``W.T`` as a plain
    row-major operand instead of a transposed one, and multiplies it faster with the few rows
    of a decode step (benchmarks/RESULTS.md, issue 19). The parameters stay the same objects,
    so a tied embedding still shares its LM head's weight.
    """
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)):
            module.weight.data = module.weight.data.t().contiguous().t()
