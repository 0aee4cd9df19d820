"""Checks DESIGN.md's invariants against live control-plane state (tests run it after every step)."""
from __future__ import annotations

from collections import Counter
from typing import Iterable

import numpy as np

from kvscope.engine.block_manager import NO_HASH, BlockManager, hash_block
from kvscope.engine.sequence import Sequence


class InvariantError(AssertionError):
    pass


def check_invariants(bm: BlockManager, running: Iterable[Sequence], waiting: Iterable[Sequence]) -> None:
    """Raise :class:`InvariantError` naming the first broken invariant."""
    running, waiting = list(running), list(waiting)
    n = bm.num_blocks
    free, used = set(bm.free), bm.used
    if len(free) != len(bm.free):
        raise InvariantError("a block appears twice in the free pool")
    if free & used:
        raise InvariantError(f"blocks both free and used: {sorted(free & used)[:10]}")
    if len(free) + len(used) != n:
        raise InvariantError(f"free ({len(free)}) + used ({len(used)}) != num_blocks ({n})")

    refs = Counter(b for s in running for b in s.block_table)
    expected = np.zeros(n, dtype=np.int64)
    for b, c in refs.items():
        expected[b] = c
    if not np.array_equal(expected, bm.ref_count):
        bad = np.flatnonzero(expected != bm.ref_count)[:10]
        raise InvariantError(
            f"ref_count disagrees with live block tables at blocks {bad.tolist()}: "
            f"stored {bm.ref_count[bad].tolist()}, live {expected[bad].tolist()}"
        )
    if used != set(refs):
        raise InvariantError("the used set differs from the blocks live sequences hold")

    for h, b in bm.hash_to_block.items():
        if bm.block_hash[b] != h:
            raise InvariantError(f"hash_to_block maps {h} to block {b}, which stores hash {bm.block_hash[b]}")
    for b in np.flatnonzero(bm.block_hash != NO_HASH):
        if bm.hash_to_block.get(int(bm.block_hash[b])) != b:
            raise InvariantError(f"block {b} has a hash that does not map back to it")
    cached = int(np.count_nonzero((bm.ref_count == 0) & (bm.block_hash != NO_HASH)))
    if bm.num_cached_blocks != cached:
        raise InvariantError(f"num_cached_blocks is {bm.num_cached_blocks}, the pool holds {cached} cached blocks")

    bs = bm.block_size
    for s in running:
        need = -(-s.num_computed_tokens // bs)
        if len(s.block_table) != need:
            raise InvariantError(
                f"request {s.request_id}: block table has {len(s.block_table)} blocks, "
                f"{s.num_computed_tokens} computed tokens need {need}"
            )
        prev = NO_HASH
        for i in range(min(s.num_computed_tokens, s.num_tokens) // bs):
            tokens = s.block_tokens(i, bs)
            prev = hash_block(tokens, prev)
            b = s.block_table[i]
            if bm.block_hash[b] != NO_HASH and (
                bm.block_hash[b] != prev or not np.array_equal(bm.block_tokens[b], tokens)
            ):
                raise InvariantError(f"request {s.request_id}: block {b} is cached under another content")
    for s in waiting:
        if s.block_table or s.num_computed_tokens:
            raise InvariantError(f"waiting request {s.request_id} holds blocks or computed tokens")
