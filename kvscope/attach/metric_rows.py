"""The scraped metric rows, held as columns in a ring: ``src.metrics`` and the timeline read them.

A long-lived source holds up to ``max_events`` rows; a row per Python tuple cost several
hundred bytes and a table built row by row, so rows are kept as numpy columns instead.
Each row is numbered in the order it was added, from 0 over the source's life, and the ring
holds rows ``first .. added - 1``: once full, the earliest added are dropped first. A reader
that keeps the number of the next row it has not read (:meth:`MetricRows.columns` from it)
takes only the rows added since, whatever the table's size.

Not thread-safe: :class:`~kvscope.attach.attached.Attached` calls it under its lock.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pandas as pd

from kvscope.attach.metrics import METRICS
from kvscope.attach.tables import SCHEMAS
from kvscope.trace.tables import frame

_FIRST_CAPACITY = 1024  # the ring starts this small and doubles as rows come, up to its capacity


class MetricColumns(NamedTuple):
    """Rows ``start .. start + len(time_s) - 1`` in the order they were added, as columns."""

    start: int                      # the number of the first row here
    first: int                      # the oldest row the source still held (those before were dropped)
    added: int                      # the rows it had ever added (the number its next row gets)
    time_s: np.ndarray              # float64
    instance: np.ndarray            # int32 codes into ``names``
    names: tuple[str, ...]
    data_parallel_rank: np.ndarray  # int64
    values: np.ndarray              # float64, one row per column of METRICS: shape (len(METRICS), rows)

    @property
    def num_rows(self) -> int:
        return len(self.time_s)

    def since(self, number: int) -> "MetricColumns":
        """The rows numbered ``number`` and after."""
        k = min(max(number - self.start, 0), self.num_rows)
        return self._replace(start=self.start + k, time_s=self.time_s[k:], instance=self.instance[k:],
                             data_parallel_rank=self.data_parallel_rank[k:], values=self.values[:, k:])


class MetricRows:
    """At most ``capacity`` metric rows (:data:`kvscope.attach.metrics.COLUMNS` tuples, as
    ``parse_metrics`` makes them); the earliest added are dropped first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.added = 0  # rows ever added: the number the next row gets
        self.first = 0  # the oldest row held
        self._names: list[str] = []
        self._codes: dict[str, int] = {}
        self._alloc(min(capacity, _FIRST_CAPACITY))

    def __len__(self) -> int:
        return self.added - self.first

    def _alloc(self, size: int) -> None:
        self._time = np.empty(size)
        self._instance = np.empty(size, np.int32)
        self._rank = np.empty(size, np.int64)
        self._values = np.empty((len(METRICS), size))

    def _spans(self, start: int, stop: int) -> list[tuple[slice, slice]]:
        """``(ring positions, offsets from start)`` of rows ``start .. stop - 1``: one span, or two
        where they wrap around the ring's end."""
        size = len(self._time)
        pos, n = start % size, stop - start
        head = min(n, size - pos)
        spans = [(slice(pos, pos + head), slice(0, head))]
        if head < n:
            spans.append((slice(0, n - head), slice(head, n)))
        return spans

    def extend(self, rows: list[tuple]) -> None:
        if not rows:
            return
        kept = rows[-self.capacity:]  # (more rows than it holds at once: the earlier ones are dropped unseen)
        start = self.added + len(rows) - len(kept)
        stop = start + len(kept)
        need = min(stop - self.first, self.capacity)
        if len(self._time) < need:
            self._grow(need)
        self.added = stop
        self.first = max(self.first, stop - len(self._time))
        times, names, ranks, *values = zip(*kept)
        self._write(start, np.array(times, float), np.array([self._code(name) for name in names], np.int32),
                    np.array(ranks, np.int64), np.array(values, float))

    def _code(self, name: str) -> int:
        code = self._codes.get(name)
        if code is None:
            code = self._codes[name] = len(self._names)
            self._names.append(name)
        return code

    def _grow(self, need: int) -> None:
        """A ring of twice the size (at least ``need``, at most ``capacity``), the held rows in it."""
        held = self.columns()
        self._alloc(min(self.capacity, max(2 * len(self._time), need)))
        self._write(held.start, held.time_s, held.instance, held.data_parallel_rank, held.values)

    def _write(self, start: int, time_s: np.ndarray, instance: np.ndarray, rank: np.ndarray,
               values: np.ndarray) -> None:
        """Rows numbered from ``start`` into their places in the ring."""
        for ring, offset in self._spans(start, start + len(time_s)):
            self._time[ring], self._instance[ring], self._rank[ring] = time_s[offset], instance[offset], rank[offset]
            self._values[:, ring] = values[:, offset]

    def columns(self, start: int = 0, stop: int | None = None) -> MetricColumns:
        """Copies of the held rows numbered ``start .. stop - 1`` (rows dropped already are left out)."""
        start = max(start, self.first)
        stop = max(start, min(self.added if stop is None else stop, self.added))
        n = stop - start
        out = MetricColumns(start, self.first, self.added, np.empty(n), np.empty(n, np.int32), tuple(self._names),
                            np.empty(n, np.int64), np.empty((len(METRICS), n)))
        for ring, offset in self._spans(start, stop):
            out.time_s[offset] = self._time[ring]
            out.instance[offset] = self._instance[ring]
            out.data_parallel_rank[offset] = self._rank[ring]
            out.values[:, offset] = self._values[:, ring]
        return out


def metrics_frame(columns: MetricColumns) -> pd.DataFrame:
    """``src.metrics`` of these rows: ordered by ``time_s``, stably, so rows of one time keep the
    order they were added in (a scrape's its rank order, each instance its scrape order)."""
    order = np.argsort(columns.time_s, kind="stable")
    names = np.array(columns.names, dtype=object)
    return frame(SCHEMAS["metrics"], {
        "time_s": columns.time_s[order], "instance": names[columns.instance[order]],
        "data_parallel_rank": columns.data_parallel_rank[order],
        **{c: v[order] for c, v in zip(METRICS, columns.values)},
    })
