"""Helpers shared by every sharded layer: divisibility checks and reading one shard.

A ``weight_loader`` receives either a tensor or a lazy safetensors slice
(``safe_open(...).get_slice(name)``). Both support ``[a:b]``-style indexing, so a loader
reads only its own rows/columns and no rank ever materialises a full weight it does not own.
"""
from __future__ import annotations

from typing import Any

import torch

WeightSource = Any  # torch.Tensor or a safetensors slice (has ``get_shape()`` and ``[...]``)


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator``, or a ValueError naming ``what`` when it does not divide."""
    if numerator % denominator:
        raise ValueError(
            f"{what}={numerator} is not divisible by the tensor-parallel size {denominator}"
        )
    return numerator // denominator


def pad_vocab_size(vocab_size: int, pad_to: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``pad_to`` (vLLM's name), so any vocabulary
    splits evenly over the tensor-parallel ranks."""
    return -(-vocab_size // pad_to) * pad_to


def source_shape(src: WeightSource) -> tuple[int, ...]:
    return tuple(src.shape) if isinstance(src, torch.Tensor) else tuple(src.get_shape())


def read_shard(src: WeightSource, dim: int | None = None, start: int = 0,
               size: int | None = None) -> torch.Tensor:
    """Read ``src[..., start:start+size, ...]`` along ``dim`` (everything when ``dim`` is None)."""
    if dim is None:
        return src[...] if isinstance(src, torch.Tensor) else src[:]
    index = [slice(None)] * dim + [slice(start, start + size)]
    return src[tuple(index)]


def copy_checked(dst: torch.Tensor, shard: torch.Tensor) -> None:
    """Copy ``shard`` into ``dst`` (casting dtype/device), refusing any shape mismatch."""
    if tuple(dst.shape) != tuple(shard.shape):
        raise ValueError(f"shape mismatch: parameter shard {tuple(dst.shape)} "
                         f"vs checkpoint shard {tuple(shard.shape)}")
    dst.copy_(shard)


def default_weight_loader(param: torch.Tensor, src: WeightSource,
                          shard_id: object = None) -> None:
    """Loader for replicated parameters (norms, row-parallel biases): copy the whole tensor."""
    if shard_id is not None:
        raise ValueError(f"replicated parameter got a shard id {shard_id!r}")
    copy_checked(param.data, read_shard(src))
