"""Tensor-parallel linear layers (Megatron style).

Column-parallel layers split the output features across ranks and need no communication;
row-parallel layers split the input features and sum partial outputs with an all-reduce.
A column-parallel layer may pack several logical projections (q/k/v, gate/up) into one
matrix; each is sharded on its own so a rank's slice holds its part of every projection.
Every parameter carries ``weight_loader(param, src, shard_id)`` that copies only this rank's
shard from ``src`` (a tensor or a lazy safetensors slice).
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import nn

from kvscope.distributed.parallel_state import get_tp_rank, get_tp_size, tp_all_reduce
from kvscope.layers.sharding import (
    WeightSource, copy_checked, divide, read_shard, source_shape,
)
from kvscope.layers.weight_layout import linear


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class ColumnParallelLinear(nn.Module):
    """``y = x W^T + b`` with the output features of each packed projection split over ranks.

    ``output_sizes`` lists the (full, unsharded) sizes of the projections packed in this
    matrix and ``shard_ids`` the ids the loader uses to address them (``(None,)`` for a plain
    layer). The local output is ``[proj0_shard, proj1_shard, ...]``.
    """

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False,
                 shard_ids: Sequence[Hashable] = (None,)) -> None:
        super().__init__()
        if len(output_sizes) != len(shard_ids):
            raise ValueError("one shard id per packed output is required")
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size = input_size
        self.output_sizes = list(output_sizes)
        self.shard_ids = tuple(shard_ids)
        self.local_sizes = [divide(n, self.tp_size, "output size") for n in self.output_sizes]
        self.local_offsets = [sum(self.local_sizes[:i]) for i in range(len(self.local_sizes))]
        self.weight = _param(sum(self.local_sizes), input_size)
        self.bias = _param(sum(self.local_sizes)) if bias else None
        self.packed_weight: torch.Tensor | None = None  # set on a CPU (layers/weight_layout.py)
        for p in (self.weight, self.bias):
            if p is not None:
                p.weight_loader = self.weight_loader
                p.shard_ids = self.shard_ids

    def weight_loader(self, param: nn.Parameter, src: WeightSource,
                      shard_id: Hashable = None) -> None:
        if shard_id not in self.shard_ids:
            raise ValueError(f"unknown shard id {shard_id!r}; expected one of {self.shard_ids}")
        i = self.shard_ids.index(shard_id)
        full = source_shape(src)[0]
        if full != self.output_sizes[i]:
            raise ValueError(f"shard {shard_id!r}: checkpoint has {full} output rows, "
                             f"expected {self.output_sizes[i]}")
        size = self.local_sizes[i]
        dst = param.data.narrow(0, self.local_offsets[i], size)
        copy_checked(dst, read_shard(src, 0, self.tp_rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed_weight)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several same-input projections in one matmul, addressed by integer shard ids (gate=0, up=1)."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False) -> None:
        super().__init__(input_size, output_sizes, bias, shard_ids=range(len(output_sizes)))


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections in one matmul; with GQA k and v have fewer heads than q.

    Each rank owns ``num_heads / tp`` query heads and the ``num_kv_heads / tp`` KV heads they
    attend to, so attention needs no communication.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        tp = get_tp_size()
        self.num_heads = divide(num_heads, tp, "num_attention_heads")
        self.num_kv_heads = divide(num_kv_heads, tp, "num_key_value_heads")
        self.head_dim = head_dim
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden_size, sizes, bias, shard_ids=("q", "k", "v"))

    def split_qk_v(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's packed output as the q and k heads together, ``[T, Hq + Hkv, D]`` (views;
        q first), and v ``[T, Hkv*D]``."""
        qk, v = qkv.split([self.local_sizes[0] + self.local_sizes[1], self.local_sizes[2]], dim=-1)
        return qk.view(qk.shape[0], self.num_heads + self.num_kv_heads, self.head_dim), v


class RowParallelLinear(nn.Module):
    """``y = x W^T + b`` with the input features split over ranks; partial outputs all-reduced.

    The bias is replicated and added once, after the reduction.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size, self.output_size = input_size, output_size
        self.local_input = divide(input_size, self.tp_size, "input size")
        self.weight = _param(output_size, self.local_input)
        self.bias = _param(output_size) if bias else None
        self.packed_weight: torch.Tensor | None = None  # set on a CPU (layers/weight_layout.py)
        for p in (self.weight, self.bias):
            if p is not None:
                p.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, src: WeightSource,
                      shard_id: Hashable = None) -> None:
        if shard_id is not None:
            raise ValueError(f"RowParallelLinear takes no shard id, got {shard_id!r}")
        if param is self.bias:
            copy_checked(param.data, read_shard(src))
            return
        full = source_shape(src)
        if tuple(full) != (self.output_size, self.input_size):
            raise ValueError(f"checkpoint shape {tuple(full)}, expected "
                             f"{(self.output_size, self.input_size)}")
        n = self.local_input
        copy_checked(param.data, read_shard(src, 1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return linear(x, self.weight, self.bias, self.packed_weight)
        y = tp_all_reduce(linear(x, self.weight, None, self.packed_weight))
        return y if self.bias is None else y + self.bias
