"""One publisher's prefix cache rebuilt from its events: the blocks it holds, by hash.

vLLM's events name blocks by content hash, never by physical id or refcount, so this is a set
of hashes with their parent links (the prefix chains) and, where the publisher sent them, their
token ids. A block is keyed by ``(block_hash, medium, group_idx)``: the same content may sit on
the GPU and in a CPU offload tier, or in two KV-cache groups of a hybrid model. Each key maps to
the ``BlockStored`` event that stored it and the block's index in it, so applying an event
builds nothing per block beyond that pair; :meth:`PrefixCache.block` unpacks it when read.
"""
from __future__ import annotations

from typing import Any, Hashable, NamedTuple


class Block(NamedTuple):
    parent_block_hash: Hashable | None
    token_ids: list[int]
    block_size: int | None
    lora_name: str | None
    extra_keys: Any


Key = tuple[Hashable, Any, Any]  # (block_hash, medium, group_idx)


class PrefixCache:
    """The blocks one (instance, data-parallel rank) holds; ``apply`` takes decoded events in order."""

    __slots__ = ("blocks", "unknown_removes")

    def __init__(self) -> None:
        self.blocks: dict[Key, tuple[Any, int]] = {}  # key -> (its BlockStored event, index in it)
        self.unknown_removes = 0  # BlockRemoved of a hash this consumer never saw stored

    def apply(self, events: list) -> None:
        blocks = self.blocks
        for ev in events:
            kind = type(ev).__name__
            if kind == "BlockStored":
                medium, group = ev.medium, ev.group_idx
                for i, h in enumerate(ev.block_hashes):
                    blocks[(h, medium, group)] = (ev, i)
            elif kind == "BlockRemoved":
                medium, group = ev.medium, ev.group_idx
                for h in ev.block_hashes:
                    if blocks.pop((h, medium, group), None) is None:
                        self.unknown_removes += 1
            else:
                blocks.clear()

    def reset(self) -> None:
        """Forget every block (the publisher restarted, so its cache started empty)."""
        self.blocks.clear()

    def hashes(self) -> set[Hashable]:
        return {k[0] for k in self.blocks}

    def block(self, key: Key) -> Block:
        """The block stored under ``key``: its parent, its own slice of the event's token ids, ..."""
        ev, i = self.blocks[key]
        size, tokens = ev.block_size, ev.token_ids
        chunk = tokens[i * size:(i + 1) * size] if size else tokens if len(ev.block_hashes) == 1 else []
        extra = ev.extra_keys[i] if isinstance(ev.extra_keys, list) and i < len(ev.extra_keys) else None
        return Block(ev.parent_block_hash if i == 0 else ev.block_hashes[i - 1], chunk, size, ev.lora_name, extra)
