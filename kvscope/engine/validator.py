"""Checks the control plane's invariants against live state (tests run it after every step).

The invariants are listed in docs/ARCHITECTURE.md, "Invariants".
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from kvscope.engine.block_manager import NO_HASH, BlockManager, hash_block
from kvscope.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from kvscope.engine.scheduler import Scheduler


class InvariantError(AssertionError):
    pass


def check_invariants(scheduler: "Scheduler") -> None:
    """Raise :class:`InvariantError` naming the first broken invariant."""
    running, waiting = list(scheduler.running), list(scheduler.waiting)
    _check_queues(scheduler.requests, running, waiting)
    check_pool(scheduler.block_manager, running)
    for r in waiting:
        if r.block_table or r.num_computed_tokens:
            raise InvariantError(f"waiting request {r.request_id} holds blocks or computed tokens")


def _check_queues(requests: dict[int, Request], running: list[Request], waiting: list[Request]) -> None:
    """Every unfinished request is in exactly one queue, with the status of that queue."""
    for queue, status in ((running, RequestStatus.RUNNING), (waiting, RequestStatus.WAITING)):
        for r in queue:
            if r.status is not status:
                raise InvariantError(f"request {r.request_id} is {r.status.value} but queued as {status.value}")
    queued = Counter(r.seq_id for r in running + waiting)
    twice = [i for i, c in queued.items() if c > 1]
    if twice:
        raise InvariantError(f"requests queued more than once: seq ids {twice[:10]}")
    if set(queued) != set(requests):
        lost = sorted(set(requests) - set(queued))[:10]
        stray = sorted(set(queued) - set(requests))[:10]
        raise InvariantError(f"queues and tracked requests differ: in no queue {lost}, untracked {stray}")


def check_pool(bm: BlockManager, running: list[Request]) -> None:
    """The block pool agrees with the block tables of the running requests."""
    n = bm.num_blocks
    free, used = set(bm.free), bm.used
    if len(free) != len(bm.free):
        raise InvariantError("a block appears twice in the free pool")
    if free & used:
        raise InvariantError(f"blocks both free and used: {sorted(free & used)[:10]}")
    if len(free) + len(used) != n:
        raise InvariantError(f"free ({len(free)}) + used ({len(used)}) != num_blocks ({n})")

    refs = Counter(b for r in running for b in r.block_table)
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
        raise InvariantError("the used set differs from the blocks live requests hold")

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
    for r in running:
        need = -(-r.num_computed_tokens // bs)
        if len(r.block_table) != need:
            raise InvariantError(
                f"request {r.request_id}: block table has {len(r.block_table)} blocks, "
                f"{r.num_computed_tokens} computed tokens need {need}"
            )
        prev = NO_HASH
        for i in range(min(r.num_computed_tokens, r.num_tokens) // bs):
            tokens = r.block_tokens(i, bs)
            prev = hash_block(tokens, prev)
            b = r.block_table[i]
            if bm.block_hash[b] != NO_HASH and (
                bm.block_hash[b] != prev or not np.array_equal(bm.block_tokens[b], tokens)
            ):
                raise InvariantError(f"request {r.request_id}: block {b} is cached under another content")
