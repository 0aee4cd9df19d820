"""The attach timeline's series, kept up to date from the metric rows added since the last update.

``src.metrics`` holds up to ``max_events`` rows; a timeline rebuilt from it at every update costs
the whole table each time. :class:`MetricBins` reads only the rows added since it last did
(``attached.metric_rows`` from its cursor), so an update costs those rows and the points drawn.

Each series (an instance's engine) is cut into bins of time ``[origin + j * width, origin + (j +
1) * width)``; ``width`` is a power of two seconds, the smallest since the timeline began that
keeps every bin between the oldest and the newest held row within ``max_points`` (it starts
finer than any scrape interval, so each scrape is its own point until then; when a row falls
past that, neighbours merge in pairs). A point is its bin's mean time and gauges, the prefix
hit rate between the bin's last scrape and the scrape before its first (or its first, where
that one is no longer held), and the preemptions per scrape over the same span.

Only what ``src.metrics`` holds is shown: a bin whose rows were all dropped goes, one with some
dropped is recomputed from the rows still held (at most a bin's worth per series).
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # (attach's extras are optional: the widgets import without them)
    from kvscope.attach.metric_rows import MetricColumns

FIRST_WIDTH = 2.0 ** -10  # seconds: finer than any scrape interval (MIN_METRICS_INTERVAL is 0.1 s)
CHUNK_ROWS = 1 << 16  # rows taken in at once: bounds the per-row bins a long backlog makes
_COUNTERS = 3  # values[3:]: prefix_cache_queries, prefix_cache_hits, num_preemptions (METRICS' order)
BIN = np.dtype([
    ("j", np.int64), ("n", np.int64),  # the bin, its rows
    ("lo", np.int64), ("hi", np.int64),  # the numbers of its first and last rows
    ("t", np.float64),  # sum of time_s - origin
    ("gauge", np.float64, 3), ("gauge_n", np.int64, 3),  # running, waiting, KV usage: sums and counts of non-NaN
    ("first", np.float64, _COUNTERS), ("last", np.float64, _COUNTERS),  # the counters at its first and last rows
    ("pre", np.float64, _COUNTERS), ("pre_row", np.int64),  # the scrape before its first: counters, number (-1: none)
])


class MetricBins:
    """The timeline's series of one attached source, at most ``max_points`` bins each."""

    def __init__(self, attached: Any, origin: float, max_points: int = 1500) -> None:
        self.attached, self.origin, self.max_points = attached, float(origin), int(max_points)
        self.width = FIRST_WIDTH
        self.cursor = 0  # the number of the next row to read
        self.held_from = 0  # the oldest row the source held at the last update
        self.rows_read = 0  # rows read from the source, over all updates
        self._series: dict[tuple[str, int], _Series] = {}
        self._lock = threading.Lock()  # the live loop's thread and a notebook's refresh() may update at once

    def update(self) -> None:
        """Take in the rows added since the last update, and forget those the source dropped.
        Rows added meanwhile wait for the next update (so that one always ends)."""
        with self._lock:
            end = None
            while end is None or self.cursor < end:
                new = self.attached.metric_rows(self.cursor, self.cursor + CHUNK_ROWS)
                end = new.added if end is None else end
                self.rows_read += new.num_rows
                self._forget(new.first)
                self._take(new.since(self.held_from))
                self.cursor = new.start + new.num_rows  # (past rows dropped before they were read, too)

    def _forget(self, first: int) -> None:
        """Drop the bins of rows numbered below ``first``; a bin left with some rows is recomputed."""
        while first > self.held_from:
            self.held_from = first
            partial, stop = {}, first  # the bins left with some rows, by series; the row after their last
            for key, s in list(self._series.items()):
                s.bins = s.bins[s.bins["hi"] >= first]
                cut = s.bins[s.bins["lo"] < first]
                if not len(s.bins):
                    del self._series[key]
                elif len(cut):
                    partial[key], stop = cut["j"], max(stop, int(cut["hi"].max()) + 1)
            if partial:
                held = self.attached.metric_rows(first, stop)
                self.rows_read += held.num_rows
                for key, rows in self._by_series(held):
                    if key in partial:
                        self._series[key].recompute(rows, partial[key])
                first = held.first  # (more rows may have gone meanwhile)

    def _take(self, columns: MetricColumns) -> None:
        """Add rows after every row taken in so far."""
        if not columns.num_rows:  # (nothing to fit)
            return
        self._fit(columns.time_s - self.origin)
        for key, rows in self._by_series(columns):
            self._series.setdefault(key, _Series()).add(rows)

    def _by_series(self, columns: MetricColumns) -> list[tuple[tuple[str, int], "_Rows"]]:
        """The rows of each series (instance, rank), in the order added, binned at the current width."""
        if not columns.num_rows:
            return []
        x = columns.time_s - self.origin
        j = np.floor(x / self.width).astype(np.int64)
        rows = np.arange(columns.start, columns.start + columns.num_rows)
        codes, ranks = columns.instance, columns.data_parallel_rank
        order = np.lexsort((ranks, codes))  # (stable: each series' rows stay in the order added)
        cuts = np.flatnonzero((np.diff(codes[order]) != 0) | (np.diff(ranks[order]) != 0)) + 1
        return [((columns.names[codes[idx[0]]], int(ranks[idx[0]])),
                 _Rows(j[idx], x[idx], rows[idx], columns.values[:, idx])) for idx in np.split(order, cuts)]

    def _fit(self, x: np.ndarray) -> None:
        """Widen the bins, merging neighbours in pairs, until the held rows and ``x`` (new rows'
        times from the origin) span at most ``max_points`` of them."""
        lo, hi = int(np.floor(x.min() / self.width)), int(np.floor(x.max() / self.width))
        for s in self._series.values():
            lo, hi = min(lo, int(s.bins["j"][0])), max(hi, int(s.bins["j"][-1]))
        doublings = 0
        while hi - lo + 1 > self.max_points:
            lo, hi, doublings = lo // 2, hi // 2, doublings + 1
        if doublings:
            self.width *= 2 ** doublings
            for s in self._series.values():
                s.bins = _combine(s.bins, s.bins["j"] >> doublings)

    def series(self) -> dict[str, dict[str, np.ndarray]]:
        """Per series (``instance``, or ``instance/dp<rank>`` when several ranks show), in the order
        of (instance, rank): ``time_s`` (from the origin), ``running``, ``waiting``,
        ``kv_usage_pct``, ``hit_rate_pct``, ``preemptions`` (per scrape), one point per bin."""
        with self._lock:
            multi = len({rank for _, rank in self._series}) > 1
            return {f"{instance}/dp{rank}" if multi else instance: self._series[(instance, rank)].points(self.held_from)
                    for instance, rank in sorted(self._series)}


class _Rows:
    """One series' new rows: bins, times from the origin, numbers, values (METRICS' order, by column)."""

    def __init__(self, j: np.ndarray, x: np.ndarray, rows: np.ndarray, values: np.ndarray) -> None:
        self.j, self.x, self.rows, self.values = j, x, rows, values

    def bins(self, pre: np.ndarray, pre_row: int) -> np.ndarray:
        """A bin per row, each row's predecessor the row before it (the first's: ``pre``, ``pre_row``)."""
        b = np.zeros(len(self.j), BIN)
        if not len(b):
            return b
        gauges, counters = self.values[:3].T, self.values[3:].T
        b["j"], b["n"], b["lo"], b["hi"], b["t"] = self.j, 1, self.rows, self.rows, self.x
        b["gauge"], b["gauge_n"] = np.nan_to_num(gauges, nan=0.0), ~np.isnan(gauges)
        b["first"] = b["last"] = counters
        b["pre"][0], b["pre_row"][0] = pre, pre_row
        b["pre"][1:], b["pre_row"][1:] = counters[:-1], self.rows[:-1]
        return b


class _Series:
    """One series' bins, ordered by ``j``, and its last row (the predecessor of its next)."""

    def __init__(self) -> None:
        self.bins = np.zeros(0, BIN)
        self.last = np.full(_COUNTERS, np.nan)
        self.last_row = -1

    def add(self, rows: _Rows) -> None:
        new = rows.bins(self.last, self.last_row)
        self.last, self.last_row = new["last"][-1], int(rows.rows[-1])
        self.bins = _merged(self.bins, new)

    def recompute(self, rows: _Rows, js: np.ndarray) -> None:
        """Bins ``js`` from the rows still held (``rows``, from the oldest held on): their first
        held row's predecessor is gone."""
        mine = np.isin(rows.j, js)
        kept = _Rows(rows.j[mine], rows.x[mine], rows.rows[mine], rows.values[:, mine])
        self.bins = _merged(self.bins[~np.isin(self.bins["j"], js)], kept.bins(np.full(_COUNTERS, np.nan), -1))

    def points(self, held_from: int) -> dict[str, np.ndarray]:
        b = self.bins
        with np.errstate(invalid="ignore", divide="ignore"):
            gauges = b["gauge"] / b["gauge_n"]
        held = b["pre_row"] >= held_from  # the scrape before the bin is still held
        ref = np.where(held[:, None], b["pre"], b["first"])
        spans = np.where(held, b["n"], b["n"] - 1)  # scrapes after the reference one
        (dq, dh, dp) = (b["last"] - ref).T
        return {
            "time_s": b["t"] / b["n"],
            "running": gauges[:, 0], "waiting": gauges[:, 1], "kv_usage_pct": 100 * gauges[:, 2],
            "hit_rate_pct": np.divide(100 * dh, dq, out=np.full(len(b), np.nan), where=dq > 0),
            "preemptions": np.divide(dp, spans, out=np.full(len(b), np.nan), where=spans > 0),
        }


def _merged(bins: np.ndarray, new: np.ndarray) -> np.ndarray:
    """``bins`` with ``new`` (later rows) merged in: only the bins from the first new one on are touched."""
    if not len(new):
        return bins
    tail = np.searchsorted(bins["j"], new["j"].min())
    both = np.concatenate([bins[tail:], new])
    return np.concatenate([bins[:tail], _combine(both, both["j"])])


def _combine(bins: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """One bin per key (ascending): the bins of a key summed, its first and predecessor from its
    earliest rows, its last from its latest."""
    order = np.lexsort((bins["lo"], keys))
    b, k = bins[order], keys[order]
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
    ends = np.r_[starts[1:], len(b)] - 1
    out = np.zeros(len(starts), BIN)
    out["j"] = k[starts]
    for name in ("n", "t", "gauge", "gauge_n"):
        out[name] = np.add.reduceat(b[name], starts, axis=0)
    out["lo"], out["hi"] = np.minimum.reduceat(b["lo"], starts), np.maximum.reduceat(b["hi"], starts)
    out["first"], out["pre"], out["pre_row"] = b["first"][starts], b["pre"][starts], b["pre_row"][starts]
    out["last"] = b["last"][ends]
    return out
