"""Block deltas: how the pool view's state reaches the browser at a cost that follows the changes.

A GPU pool has millions of blocks and a step changes a few hundred, so an update carries only
the blocks whose state or refcount changed since the previous update, as one binary buffer:
``int32 block ids | int32 refcounts | uint8 states`` (9 bytes per changed block). A keyframe
is the same encoding taken against an all-free pool, so it costs the used and cached blocks,
not the pool. Each update names the version it applies to (``base``, -1 for a keyframe); a
browser that does not hold that version asks for a keyframe (``pool.js``).
"""
from __future__ import annotations

import threading
from typing import NamedTuple

import numpy as np

KEYFRAME = -1  # the ``base`` of an update that starts from an all-free pool


class PoolUpdate(NamedTuple):
    delta: bytes  # the encoded changed blocks
    base: int     # the version it applies to (KEYFRAME: to an all-free pool)
    version: int  # the version it makes


def encode_blocks(block_ids: np.ndarray, state: np.ndarray, ref_count: np.ndarray) -> bytes:
    """The wire form of some blocks' new state and refcount."""
    return (np.ascontiguousarray(block_ids, dtype=np.int32).tobytes()
            + np.ascontiguousarray(ref_count, dtype=np.int32).tobytes()
            + np.ascontiguousarray(state, dtype=np.uint8).tobytes())


def decode_blocks(delta: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(block_ids, state, ref_count)`` of an encoded delta (the inverse of :func:`encode_blocks`)."""
    if len(delta) % 9:
        raise ValueError(f"a block delta is 9 bytes per block, got {len(delta)} bytes")
    n = len(delta) // 9
    ids = np.frombuffer(delta, dtype=np.int32, count=n)
    refs = np.frombuffer(delta, dtype=np.int32, count=n, offset=4 * n)
    return ids, np.frombuffer(delta, dtype=np.uint8, count=n, offset=8 * n), refs


def apply_update(state: np.ndarray, ref_count: np.ndarray, update: PoolUpdate) -> None:
    """Apply ``update`` in place to a pool held as ``state`` / ``ref_count`` arrays (what the browser does)."""
    if update.base == KEYFRAME:
        state[:], ref_count[:] = 0, 0
    ids, new_state, new_refs = decode_blocks(update.delta)
    state[ids], ref_count[ids] = new_state, new_refs


class PoolSync:
    """The pool as the browser holds it after the last update, and the updates that move it.

    ``update(state, ref_count)`` returns the delta to the new arrays and remembers them;
    ``keyframe()`` re-sends what the browser should hold, for a view that attached late.
    """

    def __init__(self) -> None:
        self._state = np.zeros(0, dtype=np.uint8)
        self._refs = np.zeros(0, dtype=np.int32)
        self.version = 0
        self._lock = threading.Lock()  # updates come from the dashboard thread, resyncs from the kernel's

    def update(self, state: np.ndarray, ref_count: np.ndarray) -> PoolUpdate:
        """The delta from the previous arrays to these (a keyframe when the pool size changed)."""
        with self._lock:
            if len(state) != len(self._state):
                self._state = np.zeros(len(state), dtype=np.uint8)
                self._refs = np.zeros(len(state), dtype=np.int32)
                base = KEYFRAME
            else:
                base = self.version
            changed = np.flatnonzero((state != self._state) | (ref_count != self._refs))
            self._state[changed], self._refs[changed] = state[changed], ref_count[changed]
            return self._next(changed, base)

    def keyframe(self) -> PoolUpdate:
        """Everything the browser should hold now: the used and cached blocks."""
        with self._lock:
            return self._next(np.flatnonzero(self._state), KEYFRAME)

    def _next(self, ids: np.ndarray, base: int) -> PoolUpdate:
        self.version += 1
        return PoolUpdate(encode_blocks(ids, self._state[ids], self._refs[ids]), base, self.version)
