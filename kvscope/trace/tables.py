"""Column schemas of every trace table, and the conversions records <-> tables <-> parquet.

One schema per table fixes names and dtypes, so an empty table, a filtered one and one read
back from parquet all compare equal. Strings are ``object`` columns (``None`` for missing),
hashes nullable ``Int64``, token and owner lists Python lists; ``block_events``, the longest
table, uses categoricals and int32 instead.
"""
from __future__ import annotations

from functools import partial
from itertools import chain
from operator import attrgetter
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import pandas as pd

from kvscope.engine.hooks import BLOCK_EVENTS
from kvscope.trace.event_log import NONE, EventLog, RequestIds, joined_column
from kvscope.trace.events import POSTPROCESS
from kvscope.trace.pool import PoolState
from kvscope.trace.record import PHASES, STEP_COLUMNS, Launch, PoolDelta, Scheduled, StepRecord
from kvscope.trace.saved_files import SavedFiles
from kvscope.trace.scheduled import RowEncoder, RowTable

_I, _F, _S, _B, _H, _L = "int64", "float64", object, "bool", "Int64", object  # _L: Python lists
_LISTS = {"token_ids", "block_hashes", "owners", "block_table"}  # the _L columns

SCHEMAS: dict[str, dict[str, Any]] = {
    "steps": {
        **{c: _I for c in STEP_COLUMNS}, "time_s": _F, "duration_s": _F,
        "kv_cache_usage_perc": _F, "cuda_graph": _B,
        **{c: _F for c in ("schedule_s", "prepare_s", "forward_s", "sample_s", "postprocess_s")},
    },
    "requests": {
        "request_id": _S, "prompt_len": _I, "output_len": _I, "num_cached_tokens": _I,
        "num_preemptions": _I, "arrival_time": _F, "first_scheduled_time": _F,
        "first_token_time": _F, "finished_time": _F, "finish_reason": _S, "ttft_s": _F,
        "mean_itl_s": _F, "e2e_s": _F,
    },
    "scheduled": {
        "step": _I, "request_id": _S, "start": _I, "num_new_tokens": _I, "num_cached_tokens": _I,
        "is_prefill": _B, "sample": _B, "token_ids": _L,
    },
    # compact: a real recording has millions of rows (categories: the request ids present, sorted)
    "block_events": {
        "step": "int32", "event": pd.CategoricalDtype(BLOCK_EVENTS), "block_id": "int32",
        "request_id": "category", "ref_count": "int32", "block_hash": _H,
        "phase": pd.CategoricalDtype(PHASES), "scheduled_step": "Int32",
    },
    "queues": {"step": _I, "queue": _S, "position": _I, "request_id": _S},
    # a saved ``blocks``/``full`` trace: where in each record's block events rows were launched
    "launches": {"step": _I, "launched_step": _I, "num_events_before": _I},
    "block_tables": {"step": _I, "request_id": _S, "logical_block": _I, "physical_block": _I},
    "slot_mapping": {
        "step": _I, "request_id": _S, "position": _I, "token_id": _I, "slot": _I, "block_id": _I,
        "offset": _I,
    },
    "blocks": {
        "block_id": _I, "state": _S, "ref_count": _I, "block_hash": _H, "num_tokens": _I,
        "owners": _L,
    },
    "kv_events": {
        "step": _I, "type": _S, "block_hashes": _L, "parent_block_hash": _H, "token_ids": _L,
        "block_size": _H, "lora_id": _H, "medium": _S, "block_id": _H, "ref_count": _H,
    },
    "lifecycle": {
        "request_id": _S, "state": _S, "start_step": _I, "end_step": _I, "num_steps": _I,
        "start_time": _F, "end_time": _F, "num_tokens": _I, "num_cached_tokens": _I,
    },
    "tokens": {"token_id": _I, "text": _S},
    "baseline_tables": {"request_id": _S, "num_computed_tokens": _I, "block_table": _L},
    # a saved ``full`` trace's PoolDelta per step: changed blocks, and each live table's last block
    "pool_changes": {"step": _I, "block_id": _I, "ref_count": _I, "block_hash": _I},
    "pool_fills": {"step": _I, "block_id": _I, "num_tokens": _I},
}
QUEUES = ("running", "waiting", "preempted", "finished")


def frame(name: str | dict[str, Any], data: Iterable[tuple] | dict[str, Any]) -> pd.DataFrame:
    """A table with exactly the schema of ``name`` (rows as tuples, or columns as a dict); ``name``
    may also be a schema itself (``{column: dtype}``), for tables defined outside the trace."""
    schema = SCHEMAS[name] if isinstance(name, str) else name
    if not isinstance(data, dict):
        rows = list(data)
        data = dict(zip(schema, zip(*rows))) if rows else {c: () for c in schema}
    # Each column built straight in its dtype: one pass, no object->Arrow->object round trips
    # (which made even small tables slow under pandas 3), and None stays None / <NA>.
    return pd.DataFrame({c: pd.Series(list(data[c]) if isinstance(data[c], tuple) else data[c], dtype=t)
                         for c, t in schema.items()})


# ------------------------------------------------------------- records -> tables
def steps_frame(records: Sequence[StepRecord]) -> pd.DataFrame:
    get = attrgetter(*STEP_COLUMNS)
    return frame("steps", (get(r) for r in records))


def scheduled_frame(records: Sequence[StepRecord], tail: Sequence[tuple[int, Scheduled]] = ()) -> pd.DataFrame:
    """The records' rows, then ``tail``'s ``(step, rows)`` (launched for steps after the last record)."""
    steps = [r.step for r in records] + [step for step, _ in tail]
    parts = [r.scheduled for r in records] + [p for _, p in tail]
    lens = np.concatenate([p.num_new_tokens for p in parts]) if parts else np.zeros(0, np.int32)
    tokens = np.concatenate([p.token_ids for p in parts]) if parts else np.zeros(0, np.int32)
    return frame("scheduled", {
        "step": np.repeat(steps, [len(p) for p in parts]).astype(np.int64),
        "request_id": [rid for p in parts for rid in p.request_ids],
        **{c: np.concatenate([getattr(p, c) for p in parts]) if parts else []
           for c in ("start", "num_new_tokens", "num_cached_tokens", "is_prefill", "sample")},
        "token_ids": [a.tolist() for a in np.split(tokens, np.cumsum(lens)[:-1])] if len(lens) else [],
    })


def pool_frames(records: Sequence[StepRecord]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The ``full`` level's pool deltas as two long tables (``pool_changes``, ``pool_fills``)."""
    def cat(field: str) -> np.ndarray:
        return np.concatenate([getattr(r.pool, field) for r in records] or [np.zeros(0, np.int64)])

    def steps(field: str) -> np.ndarray:
        return np.repeat([r.step for r in records], [len(getattr(r.pool, field)) for r in records])

    return (
        frame("pool_changes", {"step": steps("block_ids"), "block_id": cat("block_ids"),
                               "ref_count": cat("ref_count"), "block_hash": cat("block_hash")}),
        frame("pool_fills", {"step": steps("last_blocks"), "block_id": cat("last_blocks"),
                             "num_tokens": cat("last_counts")}),
    )


def block_events_frame(records: Sequence[StepRecord]) -> pd.DataFrame:
    """Built from the records' packed columns, never through a tuple per event."""
    logs = [rec.block_events for rec in records]
    column = partial(joined_column, logs)
    block_hash = column("block_hash")
    phases = [rec.event_phases() for rec in records]
    phase = np.concatenate([p for p, _ in phases]) if phases else np.zeros(0, np.int8)
    scheduled = np.concatenate([s for _, s in phases]) if phases else np.zeros(0, np.int64)
    return frame("block_events", {
        "step": np.repeat([rec.step for rec in records], [len(log) for log in logs]).astype(np.int32),
        "event": pd.Categorical.from_codes(column("event"), dtype=SCHEMAS["block_events"]["event"]),
        "block_id": column("block_id"),
        "request_id": _request_ids(logs),
        "ref_count": column("ref_count"),
        "block_hash": pd.arrays.IntegerArray(block_hash, block_hash == NONE),
        "phase": pd.Categorical.from_codes(phase, dtype=SCHEMAS["block_events"]["phase"]),
        "scheduled_step": pd.arrays.IntegerArray(scheduled.astype(np.int32), scheduled == NONE),
    })


def _request_ids(logs: Sequence[EventLog]) -> pd.Categorical:
    """The logs' request columns as one categorical whose categories are the ids present, sorted
    (what a table read back from parquet has, whatever the interning order was)."""
    tables: dict[int, tuple[RequestIds, list[np.ndarray]]] = {}
    for log in logs:
        tables.setdefault(id(log.requests), (log.requests, []))[1].append(log.column("request"))
    used = sorted({t.names[c] for t, cols in tables.values() for c in np.unique(np.concatenate(cols)).tolist()
                   if c != NONE})
    index = {r: i for i, r in enumerate(used)}
    remap = {k: np.array([index.get(r, NONE) for r in t.names] + [NONE], np.int32) for k, (t, _) in tables.items()}
    codes = [remap[id(log.requests)][log.column("request")] for log in logs]
    return pd.Categorical.from_codes(np.concatenate(codes) if codes else np.zeros(0, np.int32), categories=used)


def launches_frame(records: Sequence[StepRecord]) -> pd.DataFrame:
    return frame("launches", ((rec.step, launch.step, launch.num_events_before)
                              for rec in records for launch in rec.launches))


def launched_beyond(records: Sequence[StepRecord]) -> list[tuple[int, Scheduled]]:
    """Rows launched for a step that has no record: an async recording's last launch, and a
    step rolled back after a later launch failed (its rows ran, and wrote K/V)."""
    recorded = {rec.step for rec in records}
    return [(launch.step, launch.rows) for rec in records for launch in rec.launches if launch.step not in recorded]


def queues_frame(records: Sequence[StepRecord]) -> pd.DataFrame:
    return frame("queues", (
        (rec.step, q, i, rid)
        for rec in records for q in QUEUES for i, rid in enumerate(getattr(rec, q))
    ))


# ------------------------------------------------------------- tables -> records
def records_from_frames(
    level: str, steps: pd.DataFrame, scheduled: pd.DataFrame | None = None,
    block_events: pd.DataFrame | None = None, queues: pd.DataFrame | None = None,
    launches: pd.DataFrame | None = None, pool: tuple[pd.DataFrame, pd.DataFrame] | None = None,
) -> list[StepRecord]:
    """Rebuild the records a saved trace was made of (the inverse of the ``*_frame`` functions).

    ``scheduled`` may hold steps that ``steps`` lacks: rows an async recording launched in its
    last record for the step after it (the replay writes them). Each table's columns are taken
    out as arrays once and sliced per record: a pandas slice or comparison per step costs far
    more than the rows it holds."""
    cols = [steps[c].tolist() for c in STEP_COLUMNS]
    records = [StepRecord(*vals) for vals in zip(*cols)]
    if level == "summary":
        return records
    step_ids = steps["step"].to_numpy(np.int64)
    requests = RequestIds(block_events["request_id"].cat.categories)
    _set_launches(records, launches, step_ids, RowTable(requests), scheduled)
    _set_block_events(records, block_events, step_ids, requests)
    _set_queues(records, queues, step_ids)
    if pool is not None:
        _set_pool(records, *pool, step_ids)
    return records


def _set_launches(records: Sequence[StepRecord], launches: pd.DataFrame, step_ids: np.ndarray, table: RowTable,
                  scheduled: pd.DataFrame) -> None:
    """Each record's scheduled rows and launches (a launch's rows: its step's, if any)."""
    rows_of = _scheduled_by_step(scheduled, table)
    none = Scheduled.from_columns(table, *(np.zeros(0, t) for t in (np.int32,) * 4 + (bool,) * 2 + (np.int32,)))
    launched, before = launches["launched_step"].tolist(), launches["num_events_before"].tolist()
    for rec, (a, b) in zip(records, _bounds(launches, step_ids)):
        rec.scheduled = rows_of.get(rec.step, none)
        rec.launches = tuple(Launch(s, k, rows_of.get(s, none)) for s, k in zip(launched[a:b], before[a:b]))


def _set_block_events(records: Sequence[StepRecord], events: pd.DataFrame, step_ids: np.ndarray,
                      requests: RequestIds) -> None:
    """Each record's block events. An event with no scheduled step (an ``idle`` one) gets the
    step before the record's first launch, or before the record: an engine step that makes
    :meth:`StepRecord.event_phases` call it ``idle`` again."""
    columns = {
        "event": events["event"].cat.codes.to_numpy(), "block_id": events["block_id"].to_numpy(),
        "request": events["request_id"].cat.codes.to_numpy(), "ref_count": events["ref_count"].to_numpy(),
        "block_hash": events["block_hash"].to_numpy(np.int64, na_value=NONE),
    }
    scheduled_step = events["scheduled_step"].to_numpy(np.int64, na_value=NONE)
    idle = events["scheduled_step"].isna().to_numpy()
    post = events["phase"].cat.codes.to_numpy() == PHASES.index(POSTPROCESS)
    pre_forward = np.concatenate([[0], np.cumsum(~post)]).tolist()  # [i]: rows before i not post-processing
    for rec, (a, b) in zip(records, _bounds(events, step_ids)):
        idle_step = (rec.launches[0].step if rec.launches else rec.step) - 1
        rec.block_events = EventLog.from_columns(
            requests, **{name: col[a:b] for name, col in columns.items()},
            engine_step=np.where(idle[a:b], idle_step, scheduled_step[a:b]),
        )
        rec.num_pre_forward_events = pre_forward[b] - pre_forward[a]


def _set_queues(records: Sequence[StepRecord], queues: pd.DataFrame, step_ids: np.ndarray) -> None:
    """Each record's queues, from the rows sorted once by (step, queue); the sort is stable, so
    a queue keeps its rows' order. A queue of another name sorts apart and is never read."""
    width = len(QUEUES) + 1
    keys = queues["step"].to_numpy(np.int64) * width + _queue_codes(queues["queue"])
    order = np.argsort(keys, kind="stable")
    keys, ids = keys[order], queues["request_id"].to_numpy(object)[order]
    wanted = step_ids[:, None] * width + np.arange(1, width)  # per record, per queue
    lo = np.searchsorted(keys, wanted, side="left").tolist()
    hi = np.searchsorted(keys, wanted, side="right").tolist()
    for rec, starts, ends in zip(records, lo, hi):
        for name, a, b in zip(QUEUES, starts, ends):
            setattr(rec, name, ids[a:b].tolist())


def _queue_codes(names: pd.Series) -> np.ndarray:
    """Per row, 1 + its queue's index in ``QUEUES``, 0 for another name or none. A step's rows
    of one queue come together, so only the first name of each run of equal ones is looked up
    (comparing neighbours costs less than hashing every string)."""
    values = names.to_numpy(object)
    starts = np.ones(len(values), bool)
    starts[1:] = values[1:] != values[:-1]
    first = np.flatnonzero(starts)
    codes, uniques = pd.factorize(values[first])
    of_unique = np.array([QUEUES.index(u) + 1 if u in QUEUES else 0 for u in uniques] + [0], np.int64)
    return np.repeat(of_unique[codes], np.diff(first, append=len(values)))  # (code -1, no name: the 0 appended)


def _set_pool(records: Sequence[StepRecord], changes: pd.DataFrame, fills: pd.DataFrame, step_ids: np.ndarray) -> None:
    """Each record's ``full``-level pool delta."""
    block_ids, ref_count = changes["block_id"].to_numpy(np.int32), changes["ref_count"].to_numpy(np.int32)
    block_hash = changes["block_hash"].to_numpy(np.int64)
    last_blocks, last_counts = fills["block_id"].to_numpy(np.int32), fills["num_tokens"].to_numpy(np.int32)
    for rec, (a, b), (c, d) in zip(records, _bounds(changes, step_ids), _bounds(fills, step_ids)):
        rec.pool = PoolDelta(block_ids[a:b], ref_count[a:b], block_hash[a:b], last_blocks[c:d], last_counts[c:d])


def _scheduled_by_step(rows: pd.DataFrame, table: RowTable) -> dict[int, Scheduled]:
    """Each step's rows of a ``scheduled`` table (rows of a step are contiguous), encoded in
    order, each against the step before, as the recorder encoded them."""
    code = table.requests.code
    request = np.array([code(r) for r in rows["request_id"].tolist()], np.int64)
    start, lens, cached = (rows[c].to_numpy(np.int64) for c in ("start", "num_new_tokens", "num_cached_tokens"))
    prefill, sample = (rows[c].to_numpy(bool) for c in ("is_prefill", "sample"))
    tokens = np.fromiter(chain.from_iterable(rows["token_ids"]), dtype=np.int64, count=int(lens.sum()))
    steps = rows["step"].to_numpy()
    bounds = [0, *(np.flatnonzero(np.diff(steps)) + 1).tolist(), len(steps)]
    first_token = np.concatenate([[0], np.cumsum(lens)])
    encoder = RowEncoder(table)
    out = {}
    for a, b in zip(bounds, bounds[1:]) if len(steps) else ():
        ids = request[a:b]
        out[int(steps[a])] = encoder.encode(ids, ids.__getitem__, start[a:b], lens[a:b], cached[a:b], prefill[a:b],
                                            sample[a:b], tokens[first_token[a]:first_token[b]])
    return out


def _bounds(df: pd.DataFrame, step_ids: np.ndarray) -> Iterable[tuple[int, int]]:
    """Per recorded step, where its rows of ``df`` (which is sorted by step) begin and end."""
    steps = df["step"].to_numpy()
    return zip(np.searchsorted(steps, step_ids, side="left").tolist(),
               np.searchsorted(steps, step_ids, side="right").tolist())


# ------------------------------------------------------------------- parquet
def write_frame(df: pd.DataFrame, path: Path) -> None:
    df.to_parquet(path, index=False)


def read_frame(name: str, files: SavedFiles) -> pd.DataFrame:
    """Table ``name`` of a saved trace, in its schema; a file that is missing, not parquet, or
    lacks a column of the schema or holds one of another type is refused naming it."""
    path = files.path / f"{name}.parquet"
    schema = SCHEMAS[name]
    strings = [c for c, t in schema.items() if t is _S and c not in _LISTS]
    df = _read_parquet(files, path.name, lambda source: pd.read_parquet(source, read_dictionary=strings))
    missing = [c for c in schema if c not in df.columns]
    if missing:
        raise ValueError(f"{path}: no column {', '.join(map(repr, missing))} of the {name!r} table; "
                         "not a file saved by Trace.save?")
    out = {}
    for c, t in schema.items():
        col = df[c]
        try:
            if c in _LISTS:  # parquet lists come back as numpy arrays
                col = pd.Series([None if x is None else x.tolist() for x in col], dtype=object)
            elif t is _S:
                col = _objects(col)
            elif isinstance(t, pd.CategoricalDtype):  # (a name it lacks is left missing: verify refuses it by name)
                col = col.where(col.isin(t.categories))
            out[c] = col.astype(t)
        except (TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{path}: column {c!r} of the {name!r} table is not of type {t}: {e}") from None
    return pd.DataFrame(out, copy=False)  # (not consolidated: stacking the columns into blocks copies them all)


def _objects(col: pd.Series) -> pd.Series:
    """A column as Python objects, ``None`` where missing. Strings are read as a dictionary (a
    categorical here), so each distinct one becomes a Python string once, not once per row."""
    if not isinstance(col.dtype, pd.CategoricalDtype):
        return col.astype(object).where(col.notna(), None)
    values = np.full(len(col.cat.categories) + 1, None, object)  # (the last, for code -1: missing)
    values[:-1] = col.cat.categories.to_numpy(object)
    return pd.Series(values[col.cat.codes.to_numpy()], index=col.index, dtype=object, copy=False)


def _read_parquet(files: SavedFiles, name: str, parse: Callable[[Any], Any]) -> Any:
    """``parse`` of file ``name`` of the save, given the bytes ``files`` read (and hashed) once;
    a file that is missing or is not readable parquet is refused by name."""
    import pyarrow as pa

    path = files.path / name
    if not path.is_file():
        raise ValueError(f"{path}: missing; a trace saved by Trace.save has it (cut short, or not a trace?)")
    try:
        return parse(pa.BufferReader(files.read(name)))
    except (OSError, TypeError, ValueError, pa.ArrowException) as e:
        raise ValueError(f"{path}: not a readable parquet file ({e})") from None


def write_arrays(path: Path, columns: dict[str, np.ndarray]) -> None:
    """2-D arrays (rows x width) as fixed-size list columns; 1-D arrays as plain columns."""
    import pyarrow as pa  # only saving and loading need it
    import pyarrow.parquet as pq

    table = {}
    for name, a in columns.items():
        a = np.ascontiguousarray(a)
        table[name] = pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1)), a.shape[1]) if a.ndim == 2 \
            else pa.array(a)
    pq.write_table(pa.table(table), path)


def read_arrays(files: SavedFiles, file: str) -> dict[str, np.ndarray]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = _read_parquet(files, file, pq.read_table)
    out = {}
    for name in table.column_names:
        col = table.column(name).combine_chunks()
        if pa.types.is_fixed_size_list(col.type):
            out[name] = col.flatten().to_numpy(zero_copy_only=False).reshape(len(col), col.type.list_size)
        else:
            out[name] = col.to_numpy(zero_copy_only=False)
    return out


def read_baseline(files: SavedFiles, num_blocks: int, block_size: int) -> dict[str, np.ndarray]:
    """The baseline pool's arrays, refused by name unless they are integers sized by the pool
    (``num_blocks`` rows of ``block_size`` tokens, as ``meta.json`` says)."""
    path = files.path / "baseline.parquet"
    arrays = read_arrays(files, path.name)
    for name, shape in (("ref_count", (num_blocks,)), ("block_hash", (num_blocks,)),
                        ("contents", (num_blocks, block_size))):
        a = arrays.get(name)
        if a is None or a.shape != shape or a.dtype.kind not in "iu":
            got = "no such column" if a is None else f"{a.dtype} of shape {a.shape}"
            raise ValueError(f"{path}: {name!r} must be integers of shape {shape} (meta.json's num_blocks and "
                             f"block_size), got {got}")
    return arrays


def baseline_frames(state: PoolState) -> tuple[dict[str, np.ndarray], pd.DataFrame]:
    arrays = {"ref_count": state.ref_count, "block_hash": state.block_hash, "contents": state.contents}
    tables = frame("baseline_tables", (
        (rid, state.computed.get(rid, 0), list(t)) for rid, t in state.tables.items()
    ))
    return arrays, tables


def baseline_from_frames(arrays: dict[str, np.ndarray], tables: pd.DataFrame) -> PoolState:
    return PoolState(
        arrays["ref_count"].astype(np.int32), arrays["block_hash"].astype(np.int64),
        arrays["contents"].astype(np.int32),
        dict(zip(tables["request_id"], tables["block_table"])),
        dict(zip(tables["request_id"], tables["num_computed_tokens"].tolist())),
    )
