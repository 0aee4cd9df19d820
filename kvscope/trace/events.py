"""Event types of the trace: kvscope's block events, and vLLM's KV-cache events derived from them.

A :class:`BlockEvent` is one ``block.*`` hook call, kept as a small tuple because a busy step
fires many. The vLLM-schema dataclasses are what :meth:`Trace.kv_events` exports: vLLM keys
its events by content hash only; kvscope's carry the physical ``block_id`` and ``ref_count``
as well.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

BLOCK_EVENTS: tuple[str, ...] = (
    "block.allocated",  # a free block taken (its old cached content, if any, evicted first)
    "block.shared",     # a prefix-cache hit on a live block: ref_count + 1
    "block.reused",     # a prefix-cache hit on a cached free block: back in use
    "block.freed",      # one owner let go: ref_count - 1 (free at 0, cached if hashed)
    "block.evicted",    # a cached block's hash dropped (reallocation or reset_prefix_cache)
    "block.hashed",     # a full, computed block registered in the prefix cache
)

# Where in its step an event fired. "idle": between two steps (abort_request,
# reset_prefix_cache, the rollback of a failed step); it belongs to the next recorded step.
IDLE, SCHEDULE, POSTPROCESS = "idle", "schedule", "postprocess"
PHASES: tuple[str, ...] = (IDLE, SCHEDULE, POSTPROCESS)


class BlockEvent(NamedTuple):
    event: str
    block_id: int
    request_id: str | None
    ref_count: int          # after the event
    block_hash: int | None  # None for evicted blocks (the engine clears the hash first)
    engine_step: int        # the engine's step counter when it fired (< the record's step: idle)


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
