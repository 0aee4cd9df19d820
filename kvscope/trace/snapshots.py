"""``full`` level: the whole pool after every step, kept as each step's changes.

A step changes few blocks (a decode step of 256 sequences: a few dozen of tens of thousands),
so copying the whole pool every step would cost far more than the step's news, in time and in
memory. :class:`SnapshotTaker` compares the block manager's arrays with its own copy of the
previous step's and keeps only the blocks that differ (:class:`PoolDelta`). The oldest record
a trace keeps is a keyframe listing every block; when the ring buffer drops it, the next
record becomes the keyframe (:func:`merge_keyframe`).

The snapshots are read from the block manager, never from the block events, so they stay an
independent witness of the pool that the event replay (:mod:`kvscope.trace.pool`) must match.
"""
from __future__ import annotations

import bisect
from operator import attrgetter
from typing import TYPE_CHECKING, Sequence

import numpy as np

from kvscope.trace.pool import fill_counts, last_fills
from kvscope.trace.record import PoolDelta, StepRecord

if TYPE_CHECKING:
    from kvscope.engine.llm_engine import LLMEngine

_STEP = attrgetter("step")


class SnapshotTaker:
    """Takes each step's :class:`PoolDelta` from an engine; the first one is a keyframe."""

    def __init__(self, num_blocks: int) -> None:
        self._ref = np.full(num_blocks, -1, dtype=np.int32)  # no real refcount: all differ at first
        self._hash = np.full(num_blocks, -1, dtype=np.int64)

    def take(self, engine: "LLMEngine") -> PoolDelta:
        bm = engine.block_manager
        ref, hashes = bm.ref_count, bm.block_hash
        changed = np.flatnonzero((ref != self._ref) | (hashes != self._hash)).astype(np.int32)
        new_ref, new_hash = ref[changed], hashes[changed]
        self._ref[changed], self._hash[changed] = new_ref, new_hash
        rows = [(s.block_table[-1], len(s.block_table), s.num_computed_tokens)
                for s in engine.scheduler.running if s.block_table]
        last = last_fills(rows, bm.block_size)
        return PoolDelta(changed, new_ref, new_hash, *last)


def merge_keyframe(keyframe: PoolDelta, delta: PoolDelta) -> PoolDelta:
    """The keyframe of ``delta``'s step: ``keyframe`` (the step before) with ``delta`` applied."""
    ref, hashes = keyframe.ref_count.copy(), keyframe.block_hash.copy()
    ref[delta.block_ids], hashes[delta.block_ids] = delta.ref_count, delta.block_hash
    return PoolDelta(keyframe.block_ids, ref, hashes, delta.last_blocks, delta.last_counts)


class SnapshotCursor:
    """Rebuilds the pool arrays of any recorded step from the keyframe and the deltas after it.

    It remembers where it stopped, so stepping forward applies only the deltas in between.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self._step: int | None = None
        self._ref = np.empty(num_blocks, dtype=np.int32)
        self._hash = np.empty(num_blocks, dtype=np.int64)

    def arrays(self, records: Sequence[StepRecord], i: int) -> dict[str, np.ndarray]:
        """``ref_count``, ``block_hash`` and ``num_tokens`` after ``records[i]`` (``records[0]`` is
        the keyframe); new arrays, the caller's to keep."""
        c = self._step
        lo = bisect.bisect_right(records, c, key=_STEP) if c is not None and records[0].step <= c <= records[i].step else 0
        for rec in records[lo:i + 1]:
            d = rec.pool
            self._ref[d.block_ids], self._hash[d.block_ids] = d.ref_count, d.block_hash
        self._step = records[i].step
        d = records[i].pool
        return {
            "ref_count": self._ref.copy(),
            "block_hash": self._hash.copy(),
            "num_tokens": fill_counts(self._ref, self._hash, self.block_size, d.last_blocks, d.last_counts),
        }
