"""``EventLog``: one record's block events, packed into a numpy structured array.

A ``blocks`` recording of a real workload holds millions of block events; kept as
:class:`~kvscope.engine.hooks.BlockEvent` tuples each costs a tuple, two ints and often a
hash int. Packed, an event is one 25-byte row: the kind as a code into ``BLOCK_EVENTS``, the
request as an index into a :class:`RequestIds` table the whole trace shares (-1 for none), and
-1 for a missing hash (hashes are non-negative 63-bit). The log still reads as a sequence of
``BlockEvent`` for the replay, and hands its columns to the table builder as arrays.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np

from kvscope.engine.hooks import BLOCK_EVENTS, BlockEvent

NONE = -1  # a missing request id or block hash in the packed columns
EVENT_DTYPE = np.dtype([("event", np.uint8), ("block_id", np.int32), ("request", np.int32),
                        ("ref_count", np.int32), ("block_hash", np.int64), ("engine_step", np.int32)])
_CODES = {name: i for i, name in enumerate(BLOCK_EVENTS)}


class RequestIds:
    """Request ids interned to small ints, shared by every log of a trace (appended to, never
    reordered, so a log's indices stay valid)."""

    __slots__ = ("names", "_index")

    def __init__(self, names: Sequence[str] = ()) -> None:
        self.names: list[str] = list(names)
        self._index: dict[str, int] = {r: i for i, r in enumerate(self.names)}

    def code(self, request_id: str | None) -> int:
        if request_id is None:
            return NONE
        i = self._index.get(request_id)
        if i is None:
            i = self._index[request_id] = len(self.names)
            self.names.append(request_id)
        return i


class EventLog(Sequence[BlockEvent]):
    """A read-only sequence of ``BlockEvent`` stored as columns (``EVENT_DTYPE`` rows)."""

    __slots__ = ("rows", "requests")

    def __init__(self, rows: np.ndarray, requests: RequestIds) -> None:
        self.rows, self.requests = rows, requests

    @classmethod
    def pack(cls, events: Sequence[BlockEvent], requests: RequestIds) -> "EventLog":
        """The events as one array; the hot path of a recording (once per step)."""
        code, hashes = requests.code, [NONE if e.block_hash is None else e.block_hash for e in events]
        rows = np.empty(len(events), EVENT_DTYPE)
        if events:
            kind, block, rid, ref, _, step = zip(*events)
            rows["event"] = [_CODES[k] for k in kind]
            rows["block_id"] = block
            rows["request"] = [code(r) for r in rid]
            rows["ref_count"] = ref
            rows["block_hash"] = hashes
            rows["engine_step"] = step
        return cls(rows, requests)

    @classmethod
    def from_columns(cls, requests: RequestIds, **columns: np.ndarray) -> "EventLog":
        """A log from its packed columns (a loaded trace): one array per ``EVENT_DTYPE`` field,
        ``event`` as codes into ``BLOCK_EVENTS``, ``request`` into ``requests``, -1 for none."""
        if set(columns) != set(EVENT_DTYPE.names):
            raise ValueError(f"EventLog.from_columns: columns must be {EVENT_DTYPE.names}, got {tuple(columns)}")
        rows = np.empty(len(columns["block_id"]), EVENT_DTYPE)
        for name, values in columns.items():
            rows[name] = values
        return cls(rows, requests)

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, i: int) -> BlockEvent: ...
    @overload
    def __getitem__(self, i: slice) -> "EventLog": ...

    def __getitem__(self, i: int | slice) -> "BlockEvent | EventLog":
        if isinstance(i, slice):
            return EventLog(self.rows[i], self.requests)
        return self._event(self.rows[i].item())

    def __iter__(self) -> Iterator[BlockEvent]:
        return map(self._event, self.rows.tolist())

    def _event(self, row: tuple) -> BlockEvent:
        kind, block, rid, ref, h, step = row
        return BlockEvent(BLOCK_EVENTS[kind], block, None if rid == NONE else self.requests.names[rid], ref,
                          None if h == NONE else h, step)

    def __repr__(self) -> str:
        return f"EventLog({len(self)} events)"

    def column(self, name: str) -> np.ndarray:
        """One packed column (a view): ``event`` codes, ``request`` indices, -1 hashes as stored."""
        return self.rows[name]
