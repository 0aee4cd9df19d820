"""Tensor-parallel state: which shard this process owns, and the collectives layers need.

Layers read ``get_tp_rank()`` / ``get_tp_size()`` when they are built (to size their shards)
and call the collectives in ``forward``. Until :func:`init_tp` is called the process is a
single rank (rank 0 of 1) and every collective is the identity, so the same model code runs
unchanged on a laptop CPU and on N GPUs. Worker start-up (process spawning,
``torch.distributed.init_process_group``) lives above this module; it only records the result.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class _TPState:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None


_STATE = _TPState()


def init_tp(rank: int, size: int, group: dist.ProcessGroup | None = None) -> None:
    """Record this process's tensor-parallel rank and size (and the group for collectives).

    With ``size > 1`` and no initialised ``torch.distributed``, shapes are sharded but
    collectives raise: that is enough to build and load one rank's shard, e.g. in tests.
    """
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"invalid tensor-parallel rank/size: rank={rank}, size={size}")
    global _STATE
    _STATE = _TPState(rank=rank, size=size, group=group)


def destroy_tp() -> None:
    """Return to the single-rank state (does not tear down ``torch.distributed``)."""
    global _STATE
    _STATE = _TPState()


def get_tp_rank() -> int:
    return _STATE.rank


def get_tp_size() -> int:
    return _STATE.size


def get_tp_group() -> dist.ProcessGroup | None:
    return _STATE.group


def _require_dist() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"tensor-parallel size is {_STATE.size} but torch.distributed is not initialised; "
            "call torch.distributed.init_process_group before running collectives"
        )


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel ranks (in place); identity at size 1."""
    if _STATE.size == 1:
        return x
    _require_dist()
    dist.all_reduce(x, group=_STATE.group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, in rank order; identity at size 1."""
    if _STATE.size == 1:
        return x
    _require_dist()
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_STATE.size)]
    dist.all_gather(parts, x, group=_STATE.group)
    return torch.cat(parts, dim=dim)


def tp_gather_to_rank0(x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Concatenate every rank's ``x`` along ``dim`` on TP rank 0; other ranks get ``None``.

    Cheaper than an all-gather when only rank 0 consumes the result (e.g. sampling logits).
    """
    if _STATE.size == 1:
        return x
    _require_dist()
    x = x.contiguous()
    is_root = _STATE.rank == 0
    parts = [torch.empty_like(x) for _ in range(_STATE.size)] if is_root else None
    root = dist.get_global_rank(_STATE.group, 0) if _STATE.group is not None else 0
    dist.gather(x, parts, dst=root, group=_STATE.group)
    return torch.cat(parts, dim=dim) if is_root else None
