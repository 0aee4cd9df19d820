"""What each view shows at one step, computed from the trace alone.

The live widgets, the replay slider and the static HTML export all call these functions, so
the three always show the same facts, and a test can compare a view with the trace directly.
Everything here reads only the public :class:`~kvscope.trace.Trace` API.
"""
from __future__ import annotations

import bisect
import operator
from collections import deque
from functools import cached_property
from typing import Any

import numpy as np
import pandas as pd

from kvscope.trace.lifecycle import LIFECYCLE_STATES

MAX_SLOT_TOKENS = 128  # tokens per request sent to the slot-mapping view (the rest are counted)


# The ``trace.steps`` columns the views use.
STEP_FIELDS = (
    "step", "duration_s", "num_scheduled_tokens", "num_prefill_tokens", "num_decode_tokens", "token_budget",
    "num_preemptions", "num_used_blocks", "num_cached_blocks", "kv_cache_usage_perc", "prefix_cache_queries",
    "prefix_cache_hits",
)


# The timeline's per-step columns, in the order ``StepSeries`` keeps their bins.
TIMELINE_COLUMNS = (
    "step", "prefill_tokens", "decode_tokens", "kv_usage_pct", "prefix_hit_pct", "preemptions", "latency_ms",
)


class StepSeries:
    """Per-step summary of a trace at a cost that does not grow with the run.

    Two parts, both fed from ``trace.steps`` once and then by each record a live dashboard's
    trace listener receives (:meth:`add`: one append in the engine's thread; :meth:`sync`
    takes them in), so an update costs the new steps only:

    * the rows (``STEP_FIELDS``) of the newest ``max_rows`` steps (default: the recording's
      ``max_steps``, the most steps its ring buffer holds, so every step a view can show);
    * the timeline's columns (``TIMELINE_COLUMNS``) over every step seen, as sums over bins of
      ``width`` consecutive steps from the first, ``width`` the smallest power of two that
      needs at most ``max_points`` bins. When the bins are full, neighbours merge in pairs, so
      a long live run keeps at most ``max_points`` bins and every bin still covers whole,
      aligned steps (what :func:`kvscope.widgets.views.timeline_frame` averages).
    """

    def __init__(self, trace: Any, max_points: int = 1500, max_rows: int | None = None) -> None:
        self.trace = trace
        self.max_points = int(max_points)
        self.max_rows = max_rows if max_rows is not None else trace.meta.get("max_steps")
        self._columns: dict[str, list] | None = None
        self._pending: deque = deque()  # STEP_FIELDS of the steps added since the last sync
        self._fields_of = operator.attrgetter(*STEP_FIELDS)
        self._sums = np.zeros((self.max_points, len(TIMELINE_COLUMNS)))
        self._counts = np.zeros(self.max_points, np.int64)
        self._num_bins, self.width = 0, 1
        self._queries = self._hits = 0  # prefix-cache totals so far (the hit rate is cumulative)

    @property
    def columns(self) -> dict[str, list]:
        """The held rows' ``STEP_FIELDS``, oldest first."""
        if self._columns is None:  # read late, so records added before are not missed
            steps = self.trace.steps
            self._columns = {c: steps[c].tolist() for c in STEP_FIELDS}
            self._bin_all(steps)
            self._trim()
        return self._columns

    def add(self, record: Any) -> None:
        """Queue a ``StepRecord``'s ``STEP_FIELDS`` (any thread); :meth:`sync` takes them in. Only
        the fields: a record kept here would outlive the ring buffer that dropped it, with its
        block events and rows, for as long as updates wait."""
        self._pending.append(self._fields_of(record))

    def sync(self) -> None:
        columns = self.columns
        steps, new = columns["step"], []
        while self._pending:
            row = self._pending.popleft()
            if not steps or row[0] > steps[-1]:  # (STEP_FIELDS[0]: skip steps read from trace.steps already)
                for c, v in zip(STEP_FIELDS, row):
                    columns[c].append(v)
                new.append(row)
        if new:
            for values in self._values(dict(zip(STEP_FIELDS, map(np.array, zip(*new))))):
                self._bin_one(values)
        self._trim()

    @property
    def last_step(self) -> int | None:
        return self.columns["step"][-1] if self.columns["step"] else None

    def row(self, step: int) -> dict[str, Any]:
        """The ``STEP_FIELDS`` of ``step``; a step older than the held rows is read from ``trace.steps``."""
        steps = self.columns["step"]
        i = bisect.bisect_left(steps, step)
        if i < len(steps) and steps[i] == step:
            return {c: v[i] for c, v in self.columns.items()}
        df = self.trace.steps
        return {c: v.item() if hasattr(v, "item") else v for c, v in df.loc[df["step"] == step, list(STEP_FIELDS)].iloc[0].items()}

    def bins(self) -> tuple[np.ndarray, np.ndarray]:
        """``(sums, counts)``: per bin (oldest first), the sums of ``TIMELINE_COLUMNS`` over its steps, and how many."""
        self.columns  # (the bins are built with the rows)
        n = self._num_bins
        return self._sums[:n].copy(), self._counts[:n].copy()

    def _values(self, fields: dict[str, np.ndarray]) -> np.ndarray:
        """``TIMELINE_COLUMNS`` of consecutive steps after those seen, one row per step."""
        queries = self._queries + np.cumsum(fields["prefix_cache_queries"], dtype=np.int64)
        hits = self._hits + np.cumsum(fields["prefix_cache_hits"], dtype=np.int64)
        if len(queries):
            self._queries, self._hits = int(queries[-1]), int(hits[-1])
        queries, hits = queries.astype(float), hits.astype(float)
        return np.stack([
            np.asarray(fields["step"], float), np.asarray(fields["num_prefill_tokens"], float),
            np.asarray(fields["num_decode_tokens"], float), 100 * np.asarray(fields["kv_cache_usage_perc"], float),
            np.divide(100 * hits, queries, out=np.full_like(hits, np.nan), where=queries > 0),
            np.asarray(fields["num_preemptions"], float), 1000 * np.asarray(fields["duration_s"], float),
        ], axis=1)

    def _bin_all(self, steps: pd.DataFrame) -> None:
        """Bin every step of ``trace.steps`` at once (a replay's whole run)."""
        n = len(steps)
        if not n:
            return
        values = self._values({c: steps[c].to_numpy() for c in STEP_FIELDS})
        while -(-n // self.width) > self.max_points:
            self.width *= 2
        starts = np.arange(0, n, self.width)
        self._num_bins = len(starts)
        self._sums[:len(starts)] = np.add.reduceat(values, starts, axis=0)
        self._counts[:len(starts)] = np.diff(np.append(starts, n))

    def _bin_one(self, values: np.ndarray) -> None:
        """Add one step's values to the newest bin, or open a new one (merging the bins in pairs when all are full)."""
        n = self._num_bins
        if n == 0 or self._counts[n - 1] == self.width:
            if n == self.max_points:
                pairs = np.arange(0, n, 2)
                self._sums[:len(pairs)] = np.add.reduceat(self._sums[:n], pairs, axis=0)
                self._counts[:len(pairs)] = np.add.reduceat(self._counts[:n], pairs)
                self._sums[len(pairs):n], self._counts[len(pairs):n] = 0, 0
                n, self.width = len(pairs), 2 * self.width
            if n == 0 or self._counts[n - 1] == self.width:  # (an odd bin count leaves the last one half full)
                n += 1
            self._num_bins = n
        self._sums[n - 1] += values
        self._counts[n - 1] += 1

    def _trim(self) -> None:
        """Drop the oldest rows past ``max_rows`` (a slice at a time, so a step costs O(1) on average)."""
        columns = self._columns
        if self.max_rows is not None and len(columns["step"]) > 2 * self.max_rows:
            for v in columns.values():
                del v[:-self.max_rows]


class StepData:
    """One step of a trace, each trace table read at most once.

    A dashboard update feeds one of these to every view, so views that need the same table
    (the pool arrays, the block tables) do not each pay for it.
    """

    def __init__(self, trace: Any, step: int, series: StepSeries | None = None) -> None:
        self.trace, self.step = trace, int(step)
        if series is not None:
            self.series = series

    @cached_property
    def series(self) -> StepSeries:
        return StepSeries(self.trace)

    @cached_property
    def arrays(self) -> dict[str, np.ndarray]:
        return self.trace.pool_arrays(self.step)

    @cached_property
    def table_arrays(self) -> tuple[list[str], np.ndarray, np.ndarray]:
        """The block tables of the step's forward pass: request ids, each table's length (int32),
        and every table's physical blocks in logical order, one table after another (int32)."""
        df = self.trace.block_tables(self.step)
        codes, request_ids = pd.factorize(df["request_id"], sort=False)
        order = np.lexsort((df["logical_block"].to_numpy(), codes))
        return ([str(r) for r in request_ids], np.bincount(codes, minlength=len(request_ids)).astype(np.int32),
                df["physical_block"].to_numpy(np.int32)[order])

    @cached_property
    def slot_mapping(self) -> pd.DataFrame:
        return self.trace.slot_mapping(self.step)

    @property
    def row(self) -> dict[str, Any]:
        """The step's summary (``trace.steps`` row, ``STEP_FIELDS`` only)."""
        return self.series.row(self.step)


def encode_tables(d: StepData) -> tuple[list[str], bytes]:
    """The step's block tables in the form the browser gets them, once for the pool and the
    block-tables views: the request ids, and one int32 buffer ``lengths | tokens held |
    physical blocks | their refcounts`` (a value per request, then per block of every table in
    logical order, one table after another). Binary, so ipywidgets need not walk a JSON list
    per block, and the pool's refcounts are read where the block tables show them."""
    ids, lengths, blocks = d.table_arrays
    owner = np.repeat(np.arange(len(ids)), lengths)
    tokens = np.bincount(owner, weights=d.arrays["num_tokens"][blocks], minlength=len(ids))
    parts = (lengths, tokens, blocks, d.arrays["ref_count"][blocks])
    return ids, np.concatenate([np.asarray(a, dtype=np.int32) for a in parts]).tobytes()


def table_traits(d: StepData) -> dict[str, Any]:
    """The ``table_ids`` and ``tables`` traits (:func:`encode_tables`) of the pool view, and of
    a block-tables view shown alone: the browser reads either with ``kvsDecodeTables``."""
    table_ids, tables = encode_tables(d)
    return {"table_ids": table_ids, "tables": tables}


def pool_state(d: StepData) -> dict[str, Any]:
    """Traits of ``BlockPoolView`` besides the pool itself, which goes as block deltas
    (:mod:`kvscope.widgets.pool_sync`): the step, the pool's size, the block tables."""
    return {
        "step": d.step,
        "block_size": int(d.trace.block_size),
        "num_blocks": int(d.trace.num_blocks),
        **table_traits(d),
    }


def pool_arrays(d: StepData) -> tuple[np.ndarray, np.ndarray]:
    """The step's ``state`` (uint8) and ``ref_count`` (int32) per block, as the pool view sends them."""
    return d.arrays["state"].astype(np.uint8, copy=False), d.arrays["ref_count"].astype(np.int32, copy=False)


def tables_state(d: StepData) -> dict[str, Any]:
    """Traits of a ``BlockTablesView`` shown alone: the step and its block tables, as the pool view sends them."""
    return {"step": d.step, **table_traits(d)}


def slots_state(d: StepData) -> dict[str, Any]:
    """Traits of ``SlotMappingView``: the step's tokens grouped by request, prefill or decode."""
    trace = d.trace
    df = d.slot_mapping
    sched = trace.scheduled(d.step)
    kinds = dict(zip(sched["request_id"], np.where(sched["is_prefill"], "prefill", "decode")))
    # Rows come grouped by request, positions ascending (the runner's packing order).
    rids = df["request_id"].to_numpy()
    starts = np.flatnonzero(np.r_[True, rids[1:] != rids[:-1]]) if len(rids) else np.zeros(0, int)
    ends = np.r_[starts[1:], len(rids)]
    cols = [df[c].to_numpy().tolist() for c in ("position", "token_id", "slot", "block_id", "offset")]
    groups = []
    for a, b in zip(starts.tolist(), ends.tolist()):
        shown = range(a, min(b, a + MAX_SLOT_TOKENS))
        # (token id -1: an input a recording that began with a step in flight never saw)
        tokens = [[cols[0][i], cols[1][i], trace.decode([cols[1][i]]) if cols[1][i] >= 0 else "?", cols[2][i],
                   cols[3][i], cols[4][i]] for i in shown]
        rid = str(rids[a])
        groups.append({"id": rid, "kind": str(kinds.get(rid, "prefill")), "num_tokens": b - a, "tokens": tokens})
    return {"step": d.step, "block_size": int(trace.block_size), "groups": groups}


def queues_state(d: StepData) -> dict[str, Any]:
    """Traits of ``QueuesView``: queues after the step (head first), budget use, KV usage, and
    the KV pool's shards over tensor-parallel ranks (which heads each rank holds, its bytes)."""
    q = d.trace.queues(d.step)
    lanes: dict[str, list[str]] = {"running": [], "waiting": [], "preempted": [], "finished": []}
    for name, rid in zip(q["queue"].tolist(), q["request_id"].tolist()):  # rows come in queue order
        lanes.setdefault(name, []).append(str(rid))
    row = d.row
    return {
        "step": d.step,
        "queues": {
            **lanes,
            "scheduled_tokens": int(row["num_scheduled_tokens"]),
            "prefill_tokens": int(row["num_prefill_tokens"]),
            "decode_tokens": int(row["num_decode_tokens"]),
            "token_budget": int(row["token_budget"]),
            "kv_usage": float(row["kv_cache_usage_perc"]),
            "num_blocks": int(d.trace.num_blocks),
            "used": int(row["num_used_blocks"]),
            "cached": int(row["num_cached_blocks"]),
            "kv_shards": d.trace.kv_shards.to_dict("records"),
        },
    }


def lifecycle_state(d: StepData) -> dict[str, Any]:
    """Traits of ``LifecycleView``: ``Trace.lifecycle`` as int32 columns (request index, state
    code, start step, end step, tokens, cached tokens; one binary buffer), each request's hover
    facts from ``Trace.requests``, and the recorded steps' range. An id that named several
    requests (one after another) is one lane, with the facts of the newest."""
    life = d.trace.lifecycle
    req = d.trace.requests.drop_duplicates("request_id", keep="last")
    order = pd.unique(life["request_id"])
    facts = req.set_index("request_id").reindex(order)
    states = {s: i for i, s in enumerate(LIFECYCLE_STATES)}
    cols = np.stack([
        pd.Index(order).get_indexer(life["request_id"]), life["state"].map(states).to_numpy(),
        life["start_step"].to_numpy(), life["end_step"].to_numpy(),
        life["num_tokens"].to_numpy(), life["num_cached_tokens"].to_numpy(),
    ], axis=1).astype(np.int32) if len(life) else np.zeros((0, 6), np.int32)
    keys = ("prompt_len", "output_len", "num_cached_tokens", "num_preemptions", "ttft_s", "mean_itl_s", "finish_reason")
    columns = [[_plain(v) for v in facts[k].tolist()] for k in keys]  # whole columns: no per-cell lookups
    requests = [{"id": str(rid), **dict(zip(keys, row))} for rid, *row in zip(order, *columns)]
    ids = d.trace.step_ids
    return {"step": d.step, "first_step": int(ids[0]), "last_step": int(ids[-1]), "states": list(LIFECYCLE_STATES),
            "requests": requests, "intervals": cols.tobytes()}


def _plain(v: Any) -> Any:
    """A JSON-ready scalar (NaN and NA as None)."""
    if v is None or (not isinstance(v, str) and pd.isna(v)):
        return None
    return v if isinstance(v, str) else v.item() if hasattr(v, "item") else v


def block_details(d: StepData, block_ids: list[int]) -> dict[str, dict[str, Any]]:
    """Hover facts of some blocks after the step: content hash, tokens, their text, owners."""
    blocks = d.trace.blocks(d.step, block_ids=[int(b) for b in block_ids])
    out = {}
    for b, h, owners in zip(blocks["block_id"].tolist(), blocks["block_hash"], blocks["owners"]):
        tokens = d.trace.block_tokens(d.step, b)
        out[str(b)] = {
            "hash": None if pd.isna(h) else f"{int(h):016x}",
            "tokens": tokens, "text": d.trace.decode(tokens), "owners": [str(o) for o in owners],
        }
    return out
