"""Refuses an explicit ``num_kv_blocks`` that the device's memory could never hold.

The pool is allocated in one piece after the weights load; a size beyond the machine's memory
used to surface as the allocator's raw error (or, on a CPU host, as the OOM killer), with no
word of which setting asked for it. Checked before any weight is read or worker spawned.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from kvscope.config import EngineConfig
from kvscope.runner.model_runner import kv_geometry, resolve_device, resolve_dtype


def check_num_kv_blocks(config: EngineConfig, hf_config: Any) -> None:
    """Raise ValueError naming ``num_kv_blocks`` if its pool exceeds the device's total memory."""
    if config.num_kv_blocks is None:
        return
    device = resolve_device(config)
    layers, kv_heads, head_dim = kv_geometry(hf_config, config.tensor_parallel_size)
    block_bytes = 2 * layers * config.block_size * kv_heads * head_dim \
        * resolve_dtype(config, hf_config, device).itemsize
    if device.type == "cuda":  # one shard per GPU
        need, total, where = config.num_kv_blocks * block_bytes, torch.cuda.mem_get_info(device)[1], f"{device}"
    else:  # every rank's shard lives in this host's memory
        need = config.num_kv_blocks * block_bytes * config.tensor_parallel_size
        total, where = _host_memory_bytes(), "this host's memory"
    if total is not None and need > total:
        raise ValueError(
            f"num_kv_blocks={config.num_kv_blocks} needs {need / 2**30:.1f} GiB of KV cache "
            f"({block_bytes} bytes per {config.block_size}-token block), more than the "
            f"{total / 2**30:.1f} GiB of {where}; lower num_kv_blocks or leave it unset to size "
            "the pool from memory"
        )


def _host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not a POSIX host: let the allocator decide
        return None
