"""The KV pool rebuilt from block events: what a trace knows at any step without a snapshot.

A :class:`PoolState` starts from the control plane as it was when recording began (or, once the
ring buffer has wrapped, right before its oldest step) and advances one :class:`StepRecord` at
a time: the events before the launch, then the token writes of the launched rows, then the
post-processing events. After record n it is the block manager as of step n's ``step.end``. Reference counts are recounted from the events (not copied from
their payloads), so the replay checks the event stream rather than echoing it.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Callable

import numpy as np

from kvscope.engine.block_manager import NO_HASH
from kvscope.engine.hooks import BLOCK_EVENTS, BlockEvent
from kvscope.trace.record import Launch, Scheduled, StepRecord

if TYPE_CHECKING:
    from kvscope.engine.llm_engine import LLMEngine

FREE, USED, CACHED = 0, 1, 2  # pool_arrays()["state"]
_FREED, _EVICTED, _HASHED = (BLOCK_EVENTS.index(f"block.{e}") for e in ("freed", "evicted", "hashed"))
# By event code: the events that add the block to the request's table and take a reference.
_TAKES = np.array([e in ("block.allocated", "block.shared", "block.reused") for e in BLOCK_EVENTS])
STATE_NAMES = ("free", "used", "cached")

EventCallback = Callable[[int, BlockEvent, "PoolState"], None]  # (index in record, event, state before it)


def block_states(ref_count: np.ndarray, block_hash: np.ndarray) -> np.ndarray:
    """uint8 per block: used while referenced, cached when free but still hashed, else free."""
    state = np.where(block_hash != NO_HASH, CACHED, FREE).astype(np.uint8)
    state[ref_count > 0] = USED
    return state


def after_each_event(blocks: np.ndarray, codes: np.ndarray, hashes: np.ndarray, ref_count: np.ndarray,
                     block_hash: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The reference count and hash of each event's block right after the event, for events
    sorted by block (stably, so in replay order within one) that start from ``ref_count`` and
    ``block_hash``: :meth:`PoolState.apply`'s arithmetic over a whole trace at once (tables and
    token writes aside), so a check need not replay the counts step by step."""
    n = len(blocks)
    first = np.ones(n, bool)
    first[1:] = blocks[1:] != blocks[:-1]
    starts = np.flatnonzero(first)
    start = np.repeat(starts, np.diff(starts, append=n))  # per event: its block's first event
    delta = _TAKES[codes].astype(np.int64) - (codes == _FREED)
    total = np.cumsum(delta)
    ref = ref_count[blocks] + total - (total - delta)[start]
    newest = np.maximum.accumulate(np.where((codes == _HASHED) | (codes == _EVICTED), np.arange(n), -1))
    set_hash = np.where(codes == _HASHED, hashes, NO_HASH)[newest]
    return ref, np.where(newest >= start, set_hash, block_hash[blocks])


def last_fills(rows: list[tuple[int, int, int]], block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Each live table's last block and the tokens with K/V in it, from one
    ``(last block id, table length, num_computed_tokens)`` row per non-empty table."""
    a = np.fromiter(chain.from_iterable(rows), dtype=np.int32, count=3 * len(rows)).reshape(len(rows), 3)
    return a[:, 0].copy(), a[:, 2] - (a[:, 1] - 1) * block_size


def fill_counts(
    ref_count: np.ndarray, block_hash: np.ndarray, block_size: int,
    last_blocks: np.ndarray, last_counts: np.ndarray,
) -> np.ndarray:
    """Tokens with K/V per block: full if used or cached, except each live table's last block
    (``last_blocks``, holding ``last_counts`` tokens; see :func:`last_fills`)."""
    counts = np.where((ref_count > 0) | (block_hash != NO_HASH), block_size, 0).astype(np.int32)
    counts[last_blocks] = last_counts
    return counts


def token_blocks(
    sched: Scheduled, tables: dict[str, list[int]], block_size: int
) -> tuple[np.ndarray, np.ndarray]:
    """Positions and physical blocks of every token a step computes (the runner's arithmetic)."""
    bs = block_size
    n = sched.num_new_tokens.astype(np.int64)
    starts = sched.start.astype(np.int64)
    first = starts // bs
    if (n == 1).all():  # one token per row (decode): one block per row
        blocks = [tables[rid][f] for rid, f in zip(sched.request_ids, first.tolist())]
        return starts, np.array(blocks, dtype=np.int64)
    width = (starts + n - 1) // bs - first + 1  # blocks each row writes into
    spans = [tables[rid][f:f + w] for rid, f, w in zip(sched.request_ids, first.tolist(), width.tolist())]
    flat = np.fromiter(chain.from_iterable(spans), dtype=np.int64, count=int(width.sum()))
    row = np.repeat(np.arange(len(n)), n)
    positions = np.arange(int(n.sum()), dtype=np.int64) - (np.cumsum(n) - n)[row] + starts[row]
    blocks = flat[(np.cumsum(width) - width)[row] + positions // bs - first[row]]
    return positions, blocks


@dataclass
class PoolState:
    ref_count: np.ndarray  # int32 [num_blocks]
    block_hash: np.ndarray  # int64 [num_blocks]
    contents: np.ndarray   # int32 [num_blocks, block_size]; valid up to num_tokens()
    tables: dict[str, list[int]]  # request id -> block table, for requests holding blocks
    computed: dict[str, int]      # request id -> tokens with K/V

    @property
    def block_size(self) -> int:
        return self.contents.shape[1]

    def copy(self) -> "PoolState":
        return PoolState(
            self.ref_count.copy(), self.block_hash.copy(), self.contents.copy(),
            {r: list(t) for r, t in self.tables.items()}, dict(self.computed),
        )

    def apply(
        self, rec: StepRecord, on_event: EventCallback | None = None,
        on_launch: Callable[["PoolState", Launch], None] | None = None,
    ) -> None:
        """Advance over one record; ``on_launch`` sees the tables each launch's rows used (step
        n's synchronously, step n+1's under async scheduling).

        Without ``on_event`` the record's reference counts and hashes change at once, as
        arrays, and only the events that edit a table run one by one (so ``on_launch`` sees
        the record's final counts and hashes); ``on_event`` sees the state before each event.
        """
        if on_event is not None:
            self._apply_each(rec, on_event, on_launch)
            return
        log = rec.block_events
        codes, blocks = log.column("event"), log.column("block_id")
        takes = _TAKES[codes]
        np.add.at(self.ref_count, blocks[takes], 1)
        gives = codes == _FREED
        np.subtract.at(self.ref_count, blocks[gives], 1)
        hashing = np.flatnonzero((codes == _HASHED) | (codes == _EVICTED))[::-1]  # newest first
        if len(hashing):
            hashed, last = np.unique(blocks[hashing], return_index=True)
            newest = hashing[last]
            self.block_hash[hashed] = np.where(codes[newest] == _HASHED, log.column("block_hash")[newest], NO_HASH)
        edits = np.flatnonzero(takes | gives)
        ops = list(zip(edits.tolist(), gives[edits].tolist(), blocks[edits].tolist(),
                       log.column("request")[edits].tolist()))
        done = 0

        def advance(stop: int) -> None:
            nonlocal done
            done = self._edit_tables(ops, done, stop, log.requests.names)

        self._walk_launches(rec, advance, on_launch)

    def _walk_launches(self, rec: StepRecord, advance: Callable[[int], None],
                       on_launch: Callable[["PoolState", Launch], None] | None) -> None:
        """``advance(stop)`` applies the record's events up to index ``stop``; each launch's
        rows are written at their place among them."""
        for launch in rec.launches:
            advance(launch.num_events_before)
            if on_launch is not None:
                on_launch(self, launch)
            if launch.rows:
                self.write(launch.rows)
        advance(len(rec.block_events))

    def _edit_tables(self, ops: list[tuple[int, bool, int, int]], k: int, stop: int,
                     names: list[str]) -> int:
        """Apply the table edits ``ops[k:]`` (index in the record, a free, block, request)
        of events before ``stop``; returns where it stopped."""
        tables = self.tables
        while k < len(ops) and ops[k][0] < stop:
            _, freed, b, r = ops[k]
            rid = names[r]
            if freed:
                self._drop(rid, b)
            else:  # allocated / shared / reused: the request's table grows by one block
                tables.setdefault(rid, []).append(b)
            k += 1
        return k

    def _drop(self, rid: str, b: int) -> None:
        table = self.tables[rid]
        if table[-1] == b:  # the engine frees a table tail first
            table.pop()
        else:
            table.remove(b)
        if not table:
            del self.tables[rid]
            self.computed.pop(rid, None)

    def _apply_each(self, rec: StepRecord, on_event: EventCallback,
                    on_launch: Callable[["PoolState", Launch], None] | None) -> None:
        events = list(rec.block_events)  # unpacked once: indexing the packed log builds an event per read
        done = 0

        def advance(stop: int) -> None:
            nonlocal done
            for i in range(done, stop):
                self._event(i, events[i], on_event)
            done = stop

        self._walk_launches(rec, advance, on_launch)

    def write(self, sched: Scheduled) -> None:
        """The K/V writes of launched rows: their tokens into their blocks. A row whose request
        holds no table here (it finished before a recording began) wrote into freed blocks."""
        tables = self.tables
        sched = sched.holding(tables)
        positions, blocks = token_blocks(sched, tables, self.block_size)
        self.contents[blocks, positions % self.block_size] = sched.token_ids
        self.computed.update(zip(sched.request_ids, sched.end.tolist()))

    def _event(self, i: int, ev: BlockEvent, on_event: EventCallback) -> None:
        on_event(i, ev, self)
        b, rid, name = ev.block_id, ev.request_id, ev.event
        if name == "block.hashed":
            self.block_hash[b] = ev.block_hash
        elif name == "block.evicted":
            self.block_hash[b] = NO_HASH
        elif name == "block.freed":
            self.ref_count[b] -= 1
            self._drop(rid, b)
        else:  # allocated / shared / reused: the request's table grows by one block
            self.ref_count[b] += 1
            self.tables.setdefault(rid, []).append(b)

    def num_tokens(self) -> np.ndarray:
        rows = [(t[-1], len(t), self.computed.get(r, 0)) for r, t in self.tables.items() if t]
        last = last_fills(rows, self.block_size)
        return fill_counts(self.ref_count, self.block_hash, self.block_size, *last)

    def held_token_ids(self) -> np.ndarray:
        """The token ids the blocks hold, block by block (``-1`` where a recording that began
        mid-step never saw an input)."""
        return self.contents[np.arange(self.block_size) < self.num_tokens()[:, None]]

    def sparse(self) -> "SparsePool":
        """This state as its used and cached blocks only (shares the tables; drop this one)."""
        ids = np.flatnonzero((self.ref_count > 0) | (self.block_hash != NO_HASH))
        return SparsePool(len(self.ref_count), ids, self.ref_count[ids], self.block_hash[ids],
                          self.contents[ids], self.tables, self.computed)

    def arrays(self) -> dict[str, np.ndarray]:
        """``Trace.pool_arrays`` of this state."""
        return {
            "state": block_states(self.ref_count, self.block_hash),
            "ref_count": self.ref_count.copy(),
            "block_hash": self.block_hash.copy(),
            "num_tokens": self.num_tokens(),
        }


@dataclass
class SparsePool:
    """A :class:`PoolState` kept as its used and cached blocks only. A recording holds its
    baseline this way (until its ring buffer first drops a step), so a pool that starts empty
    or nearly so costs bytes per non-empty block, not per block: at GPU pool sizes the dense
    copy would be most of the trace. Free, unhashed blocks hold nothing a replay reads."""

    num_blocks: int
    block_ids: np.ndarray   # the used and cached blocks
    ref_count: np.ndarray   # theirs, and so on
    block_hash: np.ndarray
    contents: np.ndarray    # [len(block_ids), block_size]
    tables: dict[str, list[int]]
    computed: dict[str, int]

    @classmethod
    def capture(cls, engine: "LLMEngine") -> "SparsePool":
        """The control plane now: copies of its used and cached blocks' rows (never a whole
        GPU-sized pool's), plus the tables of the running sequences."""
        bm = engine.block_manager
        ids = np.flatnonzero((bm.ref_count > 0) | (bm.block_hash != NO_HASH))
        pool = cls(len(bm.ref_count), ids, bm.ref_count[ids], bm.block_hash[ids], bm.block_tokens[ids], {}, {})
        bs = bm.block_size
        for seq in engine.scheduler.running:
            table = list(seq.block_table)
            pool.tables[seq.request_id] = table
            pool.computed[seq.request_id] = seq.num_computed_tokens
            for i, b in enumerate(table):  # unhashed blocks keep no copy of their tokens
                if bm.block_hash[b] == NO_HASH:
                    toks = seq.token_ids[i * bs:min((i + 1) * bs, seq.num_computed_tokens)]
                    pool.contents[np.searchsorted(ids, b), :len(toks)] = toks
        return pool

    def expand(self) -> PoolState:
        """The dense state (new arrays and tables: a replay may advance it)."""
        n, ids = self.num_blocks, self.block_ids
        state = PoolState(
            np.zeros(n, self.ref_count.dtype), np.full(n, NO_HASH, self.block_hash.dtype),
            np.zeros((n, self.contents.shape[1]), self.contents.dtype),
            {r: list(t) for r, t in self.tables.items()}, dict(self.computed),
        )
        state.ref_count[ids], state.block_hash[ids], state.contents[ids] = self.ref_count, self.block_hash, self.contents
        return state
