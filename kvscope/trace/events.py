"""Event types of the trace: where in its step a block event fired, and vLLM's KV-cache events
derived from kvscope's block events.

The block events themselves (:class:`~kvscope.engine.hooks.BlockEvent`) are the engine's: it
emits them, the trace only consumes them. The vLLM-schema dataclasses are what
:meth:`Trace.kv_events` exports: vLLM keys its events by content hash only; kvscope's carry
the physical ``block_id`` and ``ref_count`` as well.
"""
from __future__ import annotations

from dataclasses import dataclass

# Where in its step an event fired. "idle": between two steps (abort_request,
# reset_prefix_cache, the rollback of a failed step); it belongs to the next recorded step.
IDLE, SCHEDULE, POSTPROCESS = "idle", "schedule", "postprocess"


# --- vLLM's KV-cache event schema (vllm/distributed/kv_events.py), plus block_id and ref_count.
@dataclass
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    block_id: int | None = None
    ref_count: int | None = None


@dataclass
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = None
    block_id: int | None = None
    ref_count: int | None = None


@dataclass
class AllBlocksCleared:
    pass
