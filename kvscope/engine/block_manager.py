"""Physical KV blocks: reference counts, a free pool in LRU order, and prefix caching by hash.

State lives in numpy arrays so a snapshot of the whole pool is a few array copies. A block is
either *used* (``ref_count >= 1``, in ``used``) or *free* (in ``free``). A free block whose
contents are still registered in ``hash_to_block`` is *cached*: a later request with the same
prefix takes it back instead of recomputing it; otherwise it is evicted when reallocated.

Hashes chain: block ``i``'s hash covers its token ids and the hash of block ``i-1``, so equal
tokens after a different prefix never match. A lookup also compares the stored token ids;
the hash alone is never trusted.
"""
from __future__ import annotations

from array import array
from collections import OrderedDict
from typing import TYPE_CHECKING, Iterable, Sequence

import numpy as np
import xxhash

from kvscope.engine.hooks import NO_HASH, BlockEvents
from kvscope.engine.request import Request

if TYPE_CHECKING:
    from kvscope.engine.hooks import HookRegistry

_HASH_MASK = (1 << 63) - 1


def hash_block(token_ids: list[int], prefix_hash: int) -> int:
    """Chained 63-bit xxhash64 of one full block (non-negative, so ``-1`` can mean "none"): of
    the prefix hash as 8 little-endian bytes, then the token ids as int64s. (One call on
    ``array`` bytes: a decode step at a block boundary hashes a block per sequence.)"""
    data = prefix_hash.to_bytes(8, "little", signed=True) + array("q", token_ids).tobytes()
    return xxhash.xxh64_intdigest(data) & _HASH_MASK


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        hooks: "HookRegistry | None" = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hooks = hooks
        self.step = 0
        self.ref_count = np.zeros(num_blocks, dtype=np.int32)
        self.block_hash = np.full(num_blocks, NO_HASH, dtype=np.int64)
        self.block_tokens = np.zeros((num_blocks, block_size), dtype=np.int32)
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.used: set[int] = set()
        self.hash_to_block: dict[int, int] = {}
        self.num_cached_blocks = 0  # free blocks still in hash_to_block, kept so no step scans the pool
        self.prefix_cache_queries = 0  # tokens looked up at admission (vLLM's counter name)
        self.prefix_cache_hits = 0     # tokens found

    # ----------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def block_hash_of(self, req: Request, i: int) -> int:
        """Hash of ``request``'s full block ``i``, computed once and kept on the request."""
        hashes = req.block_hashes
        while len(hashes) <= i:
            j = len(hashes)
            hashes.append(hash_block(req.block_tokens(j, self.block_size), hashes[-1] if j else NO_HASH))
        return hashes[i]

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Block ids holding ``request``'s longest cached prefix of full blocks.

        The last token is never covered: at least one token must be computed so the step
        produces logits for the next one.
        """
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for i in range(self.num_cacheable_blocks(req)):
            b = self.hash_to_block.get(self.block_hash_of(req, i))
            # (the tokens, compared as lists: the cheapest check that a hit is no hash collision)
            if b is None or self.block_tokens[b].tolist() != req.block_tokens(i, self.block_size):
                break
            hits.append(b)
        return hits

    def num_cacheable_blocks(self, req: Request) -> int:
        """How many of ``req``'s blocks a prefix-cache hit may cover: full ones, never the one
        holding its last token (at least one token is computed, for the next token's logits)."""
        return (req.num_tokens - 1) // self.block_size

    def num_full_computed_blocks(self, req: Request) -> int:
        """``req``'s full blocks whose tokens are all computed, never past a token still in flight."""
        return min(req.num_computed_tokens, req.num_tokens) // self.block_size

    def count_admission(self, num_tokens: int, num_cached_tokens: int) -> None:
        """Count one successful admission in vLLM's prefix-cache counters (failed tries don't count)."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_cached_tokens

    # --------------------------------------------------------------- mutation
    def _emit(self, event: str, block_id: int, req: Request | None) -> None:
        hooks = self.hooks
        if hooks is not None and (hooks.block_sinks or hooks.active(event)):
            h = self.block_hash.item(block_id)
            hooks.emit_block(
                event, self.step, block_id, req.request_id if req is not None else None,
                self.ref_count.item(block_id), None if h == NO_HASH else h,
            )

    def _uncache(self, block_id: int, emit: bool = True) -> None:
        h = self.block_hash.item(block_id)
        if h != NO_HASH:  # only free blocks are ever uncached
            self.num_cached_blocks -= 1
            if emit:  # (before clearing, so the event carries the hash)
                self._emit("block.evicted", block_id, None)
            if self.hash_to_block.get(h) == block_id:
                del self.hash_to_block[h]
            self.block_hash[block_id] = NO_HASH

    def _take_free(self, req: Request) -> int:
        block_id, _ = self.free.popitem(last=False)
        self._uncache(block_id)
        self.ref_count[block_id] = 1
        self.used.add(block_id)
        self._emit("block.allocated", block_id, req)
        return block_id

    def allocate(self, req: Request, num_tokens: int, cached: list[int] = ()) -> bool:
        """Extend ``request``'s table to cover ``num_tokens`` tokens, first claiming ``cached``.

        All or nothing: returns False, changing nothing, when the free pool is too small.
        """
        if not cached and num_tokens <= len(req.block_table) * self.block_size:
            return True  # the common decode step: the last block still has room
        new_from_free = sum(1 for b in cached if self.ref_count[b] == 0) if cached else 0
        remaining = max(0, -(-num_tokens // self.block_size) - len(req.block_table) - len(cached))
        if new_from_free + remaining > len(self.free):
            return False
        if cached:
            self._claim_cached(req, cached)
        if remaining:
            req.block_table += self._take_free_blocks([req] * remaining)
        return True

    def _claim_cached(self, req: Request, cached: list[int]) -> None:
        """Put a prefix-cache hit's blocks into ``req``'s table: a live block shared (ref_count
        + 1), a cached free one reused. Block sinks get the events as one batch; a block hook
        gets each as it happens."""
        hooks = self.hooks
        per_block = hooks is not None and hooks.has_block_hooks()
        kinds: list[str] = []
        for b in cached:
            if self.ref_count[b] > 0:
                self.ref_count[b] += 1
                kind = "block.shared"
            else:
                del self.free[b]
                self.num_cached_blocks -= 1
                self.ref_count[b] = 1
                self.used.add(b)
                kind = "block.reused"
            req.block_table.append(b)
            req.num_hashed_blocks += 1
            if per_block:
                self._emit(kind, b, req)
            else:
                kinds.append(kind)
        if kinds and hooks is not None and hooks.block_sinks:
            taken = np.array(cached, dtype=np.int64)
            hooks.emit_blocks(BlockEvents(kinds, taken, req.request_id, self.ref_count[taken],
                                          self.block_hash[taken], self.step))

    def append_blocks(self, reqs: Sequence[Request]) -> list[int]:
        """One free block onto the end of each of ``reqs``' tables, in order: what ``allocate``
        does for each in turn when each needs exactly one more block (a steady decode step's
        rows that cross into a new block). The caller checked that enough blocks are free."""
        ids = self._take_free_blocks(reqs)
        for req, b in zip(reqs, ids):
            req.block_table.append(b)
        return ids

    def _take_free_blocks(self, reqs: Sequence[Request]) -> list[int]:
        """A free block for each of ``reqs``, in order, as :meth:`_take_free` takes them one by
        one (a cached block evicted first), but with one array update, and their events one
        batch; block by block for a block hook, which may read the pool at each event."""
        free, hooks, block_hash = self.free, self.hooks, self.block_hash
        if hooks is not None and hooks.has_block_hooks():
            return [self._take_free(req) for req in reqs]
        ids = [free.popitem(last=False)[0] for _ in range(len(reqs))]
        dropped = [block_hash.item(b) for b in ids]  # the hashes of cached blocks, evicted here
        for b, h in zip(ids, dropped):
            if h != NO_HASH:
                self._uncache(b, emit=False)
        self.ref_count[ids] = 1
        self.used.update(ids)
        if hooks is not None and hooks.block_sinks:
            hooks.emit_blocks(self._allocation_events(reqs, ids, dropped))
        return ids

    def _allocation_events(self, reqs: Sequence[Request], ids: list[int], dropped: list[int]) -> BlockEvents:
        """The events of :meth:`_take_free_blocks`: each block's ``block.allocated``, after its
        ``block.evicted`` where it was cached."""
        owners = [r.request_id for r in reqs]
        if dropped.count(NO_HASH) == len(ids):
            n = len(ids)
            return BlockEvents("block.allocated", np.array(ids, dtype=np.int64), owners, np.ones(n, np.int32),
                               np.full(n, NO_HASH, np.int64), self.step)
        events = []  # (kind, block, request, ref_count, hash)
        for b, rid, h in zip(ids, owners, dropped):
            if h != NO_HASH:
                events.append(("block.evicted", b, None, 0, h))
            events.append(("block.allocated", b, rid, 1, NO_HASH))
        kinds, blocks, rids, refs, hashes = zip(*events)
        return BlockEvents(list(kinds), np.array(blocks, dtype=np.int64), list(rids), np.array(refs, np.int32),
                           np.array(hashes, dtype=np.int64), self.step)

    def free_request(self, req: Request) -> None:
        """Release ``request``'s blocks, last block first, so a prefix's head outlives its tail in
        the cache. As whole arrays (a batch that finishes together frees thousands of blocks):
        a table never holds a block twice, so each block's count drops by one."""
        ids = np.array(req.block_table[::-1], dtype=np.int64)
        req.block_table = []
        req.num_hashed_blocks = 0
        if not len(ids):
            return
        self.ref_count[ids] -= 1
        left = self.ref_count[ids]
        hashes = self.block_hash[ids]
        zero = left == 0
        gone = ids[zero].tolist()
        self.used.difference_update(gone)
        self.free.update(dict.fromkeys(gone))
        self.num_cached_blocks += int(np.count_nonzero(hashes[zero] != NO_HASH))
        hooks = self.hooks
        if hooks is not None and (hooks.block_sinks or hooks.active("block.freed")):
            hooks.emit_blocks(BlockEvents("block.freed", ids, req.request_id, left, hashes, self.step))

    def hash_computed_blocks(self, reqs: Iterable[Request]) -> None:
        """Register every newly full, computed block of each of ``reqs``, in order, in the prefix
        cache. A step hashes its rows' blocks in one call, so the blocks' tokens go into the pool
        in one array write at the end (a block no hash covers yet belongs to one request, so
        nothing in the call reads them before), and their ``block.hashed`` events go to the block
        sinks as one batch; but for a block hook each block's tokens are in place when its event
        is emitted."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        hooks = self.hooks
        per_block = hooks is not None and hooks.has_block_hooks()
        block_hash, hash_to_block = self.block_hash, self.hash_to_block
        ids: list[int] = []
        tokens: list[list[int]] = []
        owners: list[str] = []
        for req in reqs:
            table = req.block_table
            for i in range(req.num_hashed_blocks, self.num_full_computed_blocks(req)):
                b = table[i]
                req.num_hashed_blocks = i + 1
                if block_hash.item(b) != NO_HASH:
                    continue
                h = self.block_hash_of(req, i)
                if h in hash_to_block:
                    continue  # the same content was computed twice in one step; keep the first copy
                block_hash[b] = h
                hash_to_block[h] = b
                block = req.block_tokens(i, bs)
                if per_block:
                    self.block_tokens[b] = block
                    self._emit("block.hashed", b, req)
                else:
                    ids.append(b)
                    tokens.append(block)
                    owners.append(req.request_id)
        if ids:
            taken = np.array(ids, dtype=np.int64)
            self.block_tokens[taken] = tokens
            if hooks is not None and hooks.block_sinks:
                hooks.emit_blocks(BlockEvents("block.hashed", taken, owners, self.ref_count[taken],
                                              block_hash[taken], self.step))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached free block (vLLM's ``AllBlocksCleared``); live blocks keep their
        hashes. True, as vLLM's, only if no cached block is left (vLLM then resets nothing)."""
        for b in [b for b in self.hash_to_block.values() if self.ref_count[b] == 0]:
            self._uncache(b)
        return not self.hash_to_block
