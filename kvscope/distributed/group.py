"""One process group per engine, built on its own TCP store instead of the process-wide default.

``init_process_group`` allows one group per process, so a caller could hold only one
tensor-parallel engine at a time (re-running ``llm = LLM(...)`` in a notebook builds the new
engine before the old one is released). A group built directly on a store has no such limit,
and the collectives in ``parallel_state`` take it explicitly.
"""
from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def make_store(port: int, rank: int, size: int, timeout: timedelta) -> dist.TCPStore:
    """Rank 0 hosts the store; ``port=0`` lets the OS pick a free port (read it from ``.port``)."""
    return dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=timeout,
                         wait_for_workers=False)


def make_group(device: torch.device, store: dist.Store, rank: int, size: int,
               timeout: timedelta) -> dist.ProcessGroup:
    """Join the group of ``size`` ranks on ``store``; returns once every rank has joined."""
    if backend_for(device) == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(store, rank, size, options)
    else:
        group = dist.ProcessGroupGloo(store, rank, size, timeout)
    # NCCL connects lazily, at the first collective: make that happen here, where rank 0 watches
    # the workers' liveness, rather than in the middle of building the model.
    dist.all_reduce(torch.zeros(1, device=device), group=group)
    return group


def release_group(group: dist.ProcessGroup, device: torch.device, timeout_s: float) -> None:
    """Free an NCCL communicator without waiting on peers that may be gone.

    A plain destroy is collective, so a rank whose peers already left would hang in it (and in
    the group's destructor); ``abort`` is local. Even ``abort`` waits until every CUDA graph that
    captured one of the group's collectives has been destroyed, so free those graphs first; and
    it runs in a daemon thread so shutdown never blocks longer than ``timeout_s``. Gloo needs
    nothing: its sockets close with the group.
    """
    if backend_for(device) != "nccl":
        return
    thread = threading.Thread(target=group.abort, daemon=True, name="kvscope-nccl-abort")
    thread.start()
    thread.join(timeout_s)
