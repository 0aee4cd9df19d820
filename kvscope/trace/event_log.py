"""``EventLog``: one record's block events, packed into a numpy structured array.

A ``blocks`` recording of a real workload holds millions of block events; kept as
:class:`~kvscope.engine.hooks.BlockEvent` tuples each costs a tuple, two ints and often a
hash int. Packed, an event is one row of five narrow integers, each field in the smallest dtype
that holds the log's values (:mod:`kvscope.trace.narrow`): the kind as a code into
``BLOCK_EVENTS`` (its top bit set when the event carries a hash), the block, the request as
1 + an index into a :class:`RequestIds` table that records share (0 for none), the
reference count, and the engine step as an offset from the log's first event's. Hashes are kept
apart, one per event that has one. The log still reads as a sequence of ``BlockEvent`` for the
replay, and hands its columns, decoded, to the replay and the table builder as arrays.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import overload

import numpy as np

from kvscope.engine.hooks import BLOCK_EVENTS, NO_HASH, BlockEvent, BlockEvents
from kvscope.trace.narrow import narrow_dtype

NONE = NO_HASH  # a missing request id or block hash in the decoded columns (as in a batch's hashes)
# The decoded columns and their dtypes (a column's values must fit its dtype).
COLUMNS: dict[str, np.dtype] = {name: np.dtype(t) for name, t in (
    ("event", np.uint8), ("block_id", np.int32), ("request", np.int32), ("ref_count", np.int32),
    ("block_hash", np.int64), ("engine_step", np.int32))}
_HAS_HASH = 0x80  # set in a row's event code when the event carries a hash
_CODES = {name: i for i, name in enumerate(BLOCK_EVENTS)}
_FIELDS = ("event", "block_id", "request", "ref_count", "engine_step")  # a row's fields


class RequestIds:
    """Request ids interned to small ints, shared by the event logs and scheduled rows of a
    trace's records (appended to, never reordered, so the indices stored stay valid; a live ring
    buffer moves on to a new table now and then, see ``Recorder._renew_request_ids``)."""

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

    def codes(self, request_ids: Sequence[str | None]) -> list[int]:
        """:meth:`code` of each (known ids are looked up in one pass)."""
        found = list(map(self._index.get, request_ids))
        if None in found:
            found = [self.code(r) if c is None else c for r, c in zip(request_ids, found)]
        return found


@lru_cache(maxsize=None)
def _row_dtype(*field_dtypes: np.dtype) -> np.dtype:
    return np.dtype(list(zip(_FIELDS, field_dtypes)))


class EventLog(Sequence[BlockEvent]):
    """A read-only sequence of ``BlockEvent`` stored as narrow columns (see the module)."""

    __slots__ = ("rows", "hashes", "first_step", "requests")

    def __init__(self, rows: np.ndarray, hashes: np.ndarray, first_step: int, requests: RequestIds) -> None:
        self.rows, self.hashes, self.first_step, self.requests = rows, hashes, first_step, requests

    @classmethod
    def pack(cls, items: Sequence[BlockEvent | BlockEvents], requests: RequestIds) -> "EventLog":
        """The events, given one by one or in batches (a ``columns=True`` block sink's list), as
        one array; the hot path of a recording (once per chunk of records). The decoded columns
        are gathered as flat lists (a batch's with ``tolist``: a chunk may hold thousands of
        small batches) and become arrays once."""
        event: list[int] = []
        block: list[int] = []
        request: list[int] = []
        ref: list[int] = []
        hashes: list[int] = []
        step: list[int] = []
        run: list[BlockEvent] = []
        for item in [*items, None]:
            if type(item) is BlockEvents or item is None:
                if run:  # the events given one by one since the last batch
                    kind, b, rid, c, h, s = zip(*run)
                    event += map(_CODES.__getitem__, kind)
                    block += b
                    request += requests.codes(rid)
                    ref += c
                    hashes += [NONE if x is None else x for x in h]
                    step += s
                    run = []
                if item is not None:
                    n, rid = len(item.block_id), item.request_id
                    kind = item.event
                    event += [_CODES[kind]] * n if isinstance(kind, str) else map(_CODES.__getitem__, kind)
                    block += item.block_id.tolist()
                    request += [requests.code(rid)] * n if isinstance(rid, str) else requests.codes(rid)
                    ref += item.ref_count.tolist()
                    hashes += item.block_hash.tolist()
                    step += [item.engine_step] * n
            else:
                run.append(item)
        return cls.from_columns(requests, event=event, block_id=block, request=request, ref_count=ref,
                                block_hash=hashes, engine_step=step)

    @classmethod
    def from_columns(cls, requests: RequestIds, **columns: np.ndarray | list[int]) -> "EventLog":
        """A log from its decoded columns (a loaded trace): one array per ``COLUMNS`` entry,
        ``event`` as codes into ``BLOCK_EVENTS``, ``request`` into ``requests``, -1 for none."""
        if set(columns) != set(COLUMNS):
            raise ValueError(f"EventLog.from_columns: columns must be {tuple(COLUMNS)}, got {tuple(columns)}")
        h = np.asarray(columns["block_hash"], np.int64)
        has = h != NONE
        steps = np.asarray(columns["engine_step"], np.int64)
        first = int(steps[0]) if len(steps) else 0
        fields = [np.asarray(columns["event"], np.uint8) | np.where(has, _HAS_HASH, 0).astype(np.uint8),
                  np.asarray(columns["block_id"]), np.asarray(columns["request"], np.int64) + 1,
                  np.asarray(columns["ref_count"]), steps - first]
        return cls(_rows(fields), h[has], first, requests)

    def split(self, ends: Sequence[int]) -> list["EventLog"]:
        """The log cut into consecutive logs, the i-th ending before event ``ends[i]`` (the last
        at ``len(self)``), sharing this one's arrays."""
        hashed = np.concatenate(([0], np.cumsum(self.rows["event"] >= _HAS_HASH))).tolist()
        logs, start = [], 0
        for end in ends:
            logs.append(EventLog(self.rows[start:end], self.hashes[hashed[start]:hashed[end]], self.first_step,
                                 self.requests))
            start = end
        return logs

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, i: int) -> BlockEvent: ...
    @overload
    def __getitem__(self, i: slice) -> "EventLog": ...

    def __getitem__(self, i: int | slice) -> "BlockEvent | EventLog":
        if isinstance(i, slice):
            return EventLog.from_columns(self.requests, **{c: self.column(c)[i] for c in COLUMNS})
        return self._events(np.arange(len(self))[i:][:1])[0]

    def __iter__(self) -> Iterator[BlockEvent]:
        return iter(self._events(slice(None)))

    def _events(self, at: slice | np.ndarray) -> list[BlockEvent]:
        names = self.requests.names
        return [BlockEvent(BLOCK_EVENTS[k], b, None if r == NONE else names[r], c, None if h == NONE else h, s)
                for k, b, r, c, h, s in zip(*(self.column(c)[at].tolist() for c in COLUMNS))]

    def __repr__(self) -> str:
        return f"EventLog({len(self)} events)"

    def column(self, name: str) -> np.ndarray:
        """One decoded column, in its ``COLUMNS`` dtype: ``event`` codes, ``request`` indices
        (-1 for none), ``block_hash`` (-1 for none), ``engine_step``."""
        rows = self.rows
        if name == "event":
            return rows["event"] & ~np.uint8(_HAS_HASH)
        if name == "block_hash":
            h = np.full(len(rows), NONE, np.int64)
            h[rows["event"] >= _HAS_HASH] = self.hashes
            return h
        if name == "request":
            return rows["request"].astype(np.int32) - 1
        if name == "engine_step":
            return rows["engine_step"].astype(np.int32) + np.int32(self.first_step)
        return rows[name].astype(COLUMNS[name])


def joined_column(logs: Sequence[EventLog], name: str) -> np.ndarray:
    """Column ``name`` (see :meth:`EventLog.column`) of ``logs``, one after another."""
    return np.concatenate([log.column(name) for log in logs]) if logs else np.zeros(0, COLUMNS[name])


def num_events(items: Sequence[BlockEvent | BlockEvents]) -> int:
    """How many events a ``columns=True`` block sink's list holds."""
    return sum(len(item) if type(item) is BlockEvents else 1 for item in items)


def num_events_until(items: Sequence[BlockEvent | BlockEvents], step: int) -> int:
    """How many of a ``columns=True`` block sink's events come before the first one fired
    after engine step ``step``."""
    n = 0
    for item in items:
        if item.engine_step > step:
            break
        n += len(item) if type(item) is BlockEvents else 1
    return n


def _rows(fields: list[np.ndarray]) -> np.ndarray:
    """The packed rows of ``_FIELDS`` (the event code with its hash bit, the rest decoded but
    for ``request`` + 1 and the step less the first), each field in its narrowest dtype."""
    event, *rest = fields
    dtypes = [narrow_dtype(int(f.min()), int(f.max()), COLUMNS[name]) if len(f) else np.dtype(np.uint8)
              for name, f in zip(_FIELDS[1:], rest)]
    rows = np.empty(len(event), _row_dtype(np.dtype(np.uint8), *dtypes))
    for name, values in zip(_FIELDS, fields):
        rows[name] = values
    return rows

