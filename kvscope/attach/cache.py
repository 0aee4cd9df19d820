"""One publisher's prefix cache rebuilt from its events: the blocks it holds, by hash.

vLLM's events name blocks by content hash, never by physical id or refcount, so this is a set
of hashes with their parent links (the prefix chains) and, where the publisher sent them, their
token ids. A block is keyed by ``(block_hash, medium, group_idx)``: the same content may sit on
the GPU and in a CPU offload tier, or in two KV-cache groups of a hybrid model.
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
    """The blocks one (instance, data-parallel rank) holds; ``apply`` takes decoded event rows."""

    __slots__ = ("blocks", "stored", "removed", "cleared", "unknown_removes")

    def __init__(self) -> None:
        self.blocks: dict[Key, Block] = {}
        self.stored = self.removed = self.cleared = 0
        self.unknown_removes = 0  # BlockRemoved of a hash this consumer never saw stored

    def apply(self, rows: list[tuple]) -> None:
        """Apply rows of :data:`kvscope.attach.wire.EVENT_FIELDS` in order."""
        blocks = self.blocks
        for kind, hashes, parent, tokens, size, _lora_id, medium, lora_name, group, extra in rows:
            if kind == "BlockStored":
                n = len(hashes)
                for i, h in enumerate(hashes):
                    chunk = tokens[i * size:(i + 1) * size] if size else tokens if n == 1 else []
                    blocks[(h, medium, group)] = Block(
                        parent if i == 0 else hashes[i - 1], chunk, size, lora_name,
                        extra[i] if isinstance(extra, list) and i < len(extra) else None,
                    )
                self.stored += n
            elif kind == "BlockRemoved":
                for h in hashes:
                    if blocks.pop((h, medium, group), None) is None:
                        self.unknown_removes += 1
                self.removed += len(hashes)
            else:
                blocks.clear()
                self.cleared += 1

    def reset(self) -> None:
        """Forget every block (the publisher restarted, so its cache started empty)."""
        self.blocks.clear()

    def hashes(self) -> set[Hashable]:
        return {k[0] for k in self.blocks}
