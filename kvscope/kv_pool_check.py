"""Refuses an explicit KV pool size (``num_kv_blocks`` or ``kv_cache_memory_bytes``, or the CPU's
default budget) that the device's memory could never hold.

The pool is allocated in one piece after the weights load; a size beyond the machine's memory
used to surface as the allocator's raw error (or, on a CPU host, as the OOM killer), with no
word of which setting asked for it. Checked before any weight is read or worker spawned.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from kvscope.config import EngineConfig
from kvscope.runner.model_runner import kv_block_bytes, resolve_device, resolve_dtype, resolve_kv_cache_dtype


def check_kv_pool_fits(config: EngineConfig, hf_config: Any) -> None:
    """Raise ValueError naming the setting if the pool it asks for exceeds the device's total memory.

    (On CUDA a pool set by neither is sized from free memory: only its one block at least, set
    by ``block_size``, is checked.)
    """
    device = resolve_device(config)
    # Over all ranks' shards together (LLM refuses a rank count the model cannot shard first).
    kv_dtype = resolve_kv_cache_dtype(config, resolve_dtype(config, hf_config, device))
    block_bytes = kv_block_bytes(hf_config, 1, config.block_size, kv_dtype)
    tp = config.tensor_parallel_size
    budget = config.kv_cache_budget(device.type == "cuda")
    if config.num_kv_blocks is not None:
        setting, need = f"num_kv_blocks={config.num_kv_blocks}", config.num_kv_blocks * block_bytes
    elif budget is None or block_bytes > budget:
        # sized from free memory, or from a byte budget smaller than a block: one block at least
        setting, need = f"block_size={config.block_size}", block_bytes * tp
    else:  # each rank fills this byte budget
        setting, need = f"kv_cache_memory_bytes={budget}", budget * tp
    if device.type == "cuda":  # one shard per GPU
        need, total, where = need // tp, torch.cuda.mem_get_info(device)[1], f"{device}"
    else:  # every rank's shard lives in this host's memory
        total, where = _host_memory_bytes(), "this host's memory"
    if total is not None and need > total:
        raise ValueError(
            f"{setting} needs {need / 2**30:.1f} GiB of KV cache ({block_bytes} bytes per "
            f"{config.block_size}-token block), more than the {total / 2**30:.1f} GiB of {where}; "
            f"lower {setting.split('=')[0]}"
        )


def _host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # not a POSIX host: let the allocator decide
        return None
