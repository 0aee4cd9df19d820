"""Tensor-parallel state: which shard this process owns, and the collectives layers need.

Layers read ``get_tp_rank()`` / ``get_tp_size()`` when they are built (to size their shards)
and call the collectives in ``forward``. Until :func:`init_tp` is called the process is a
single rank (rank 0 of 1) and every collective is the identity, so the same model code runs
unchanged on a laptop CPU and on N GPUs. Worker start-up (process spawning, process groups)
lives above this module; it only records the result.

The state is per thread: rank 0 of a tensor-parallel engine lives in the caller's process next
to other engines (a single-rank one, or a second tensor-parallel one), so it sets its state only
around its own work with :func:`tp_scope`. ``group`` may be the default group
(``init_process_group``) or a group built directly on a store (one per engine); the
collectives address it by group rank, so either works.
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class _TPState:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None


class _Local(threading.local):
    state = _TPState()


_LOCAL = _Local()


def init_tp(rank: int, size: int, group: dist.ProcessGroup | None = None) -> None:
    """Record this process's tensor-parallel rank and size (and the group for collectives).

    With ``size > 1`` and no initialised ``torch.distributed``, shapes are sharded but
    collectives raise: that is enough to build and load one rank's shard, e.g. in tests.
    """
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"invalid tensor-parallel rank/size: rank={rank}, size={size}")
    _LOCAL.state = _TPState(rank=rank, size=size, group=group)


def destroy_tp() -> None:
    """Return to the single-rank state (does not tear down ``torch.distributed``)."""
    _LOCAL.state = _TPState()


@contextmanager
def tp_scope(rank: int, size: int, group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Be ``rank`` of ``size`` (in this thread) for the duration of the block, then restore."""
    saved = _LOCAL.state
    init_tp(rank, size, group)
    try:
        yield
    finally:
        _LOCAL.state = saved


def get_tp_rank() -> int:
    return _LOCAL.state.rank


def get_tp_size() -> int:
    return _LOCAL.state.size


def _require_dist() -> _TPState:
    state = _LOCAL.state
    if state.group is None and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"tensor-parallel size is {state.size} but torch.distributed is not initialised; "
            "call torch.distributed.init_process_group (or pass a group to init_tp) before "
            "running collectives"
        )
    return state


def tp_all_reduce(x: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """Reduce ``x`` over the tensor-parallel ranks (in place; a sum unless ``op`` says otherwise);
    identity at size 1."""
    if _LOCAL.state.size == 1:
        return x
    state = _require_dist()
    dist.all_reduce(x, op=op, group=state.group)
    return x


def tp_gather_to_rank0(x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
    """Concatenate every rank's ``x`` along ``dim`` on TP rank 0; other ranks get ``None``.

    Cheaper than an all-gather when only rank 0 consumes the result (e.g. sampling logits).
    """
    if _LOCAL.state.size == 1:
        return x
    state = _require_dist()
    x = x.contiguous()
    is_root = state.rank == 0
    parts = [torch.empty_like(x) for _ in range(state.size)] if is_root else None
    dist.gather(x, parts, group=state.group, group_dst=0)
    return torch.cat(parts, dim=dim) if is_root else None


def tp_broadcast_from_rank0(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``x`` on every rank (in place: the other ranks pass a buffer of its shape and
    dtype); identity at size 1."""
    if _LOCAL.state.size == 1:
        return x
    state = _require_dist()
    dist.broadcast(x, group=state.group, group_src=0)
    return x
