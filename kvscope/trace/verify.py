"""Checks that a saved trace is whole before :meth:`Trace.load` hands it out.

A save cut short, merged from two recordings or edited by hand may still parse; replayed, it
would show a pool the engine never had. So the tables must fit together (sorted steps, blocks
inside the pool, rows whose tokens add up, launches inside their records), and the replay of
the block events must give, after every step, the used and cached block counts the engine
reported in ``steps`` and the reference count each block's last event carried. A ``full``
trace's snapshots, read from the block manager, must equal that replay too. What no such check
can see (a changed token, hash, time or request row) the SHA-256 of each file, which
:meth:`Trace.save` writes to ``checksums.json``, does; a save made before it was written is
checked by its contents alone.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from kvscope.engine.hooks import BLOCK_EVENTS
from kvscope.trace.event_log import joined_column
from kvscope.trace.pool import CACHED, NO_HASH, USED, PoolState, after_each_event, block_states, last_fills
from kvscope.trace.record import PHASES, StepRecord
from kvscope.trace.saved_files import SavedFiles
from kvscope.trace.tables import QUEUES

CHECKSUMS = "checksums.json"
# Tables with a row per event, queue entry, launch or pool change of a recorded step.
_PER_STEP = ("block_events", "queues", "launches", "pool_changes", "pool_fills")


def write_checksums(path: Path, names: Sequence[str]) -> None:
    """Write the SHA-256 of the files ``names`` in ``path`` to its ``checksums.json``."""
    files = SavedFiles(path)
    (path / CHECKSUMS).write_text(json.dumps({"sha256": {n: files.digest(n) for n in names}}, indent=1))


def check_checksums(files: SavedFiles) -> None:
    """Refuse a file whose SHA-256 is not the one ``checksums.json`` lists (none: nothing to
    check); a file the load read is checked as it was read."""
    path = files.path
    file = path / CHECKSUMS
    if not file.exists():
        return
    try:
        sums = json.loads(file.read_text())["sha256"]
        items = [(str(n), str(h)) for n, h in sums.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{file}: not the checksums Trace.save writes ({e!r})") from None
    for name, digest in items:
        if name in ("", ".", "..") or Path(name).name != name:  # (a path would read a file outside the save)
            raise ValueError(f"{file}: lists {name!r}, which is not a file name of the save")
        if not (path / name).is_file():
            _refuse(path / name, f"missing, though {CHECKSUMS} lists it")
        if files.digest(name) != digest:
            _refuse(path / name, f"its SHA-256 is not the one {CHECKSUMS} lists: edited or damaged since the save")


def check_frames(path: Path, frames: dict[str, pd.DataFrame], num_blocks: int) -> None:
    """Refuse tables that cannot belong to one save: unsorted or unknown steps, blocks outside
    the pool, scheduled rows that are not what ``steps`` counted, launches outside their
    records (the queues :func:`check_queues` checks, once rebuilt). A ``summary`` save has only
    ``steps``."""
    st = frames["steps"]
    steps = st["step"].to_numpy()
    if (np.diff(steps) <= 0).any():
        _refuse(path / "steps.parquet", "steps are not strictly increasing")
    if ((st["num_free_blocks"] + st["num_used_blocks"]) != num_blocks).any():
        _refuse(path / "steps.parquet", f"free and used blocks do not add up to meta.json's num_blocks ({num_blocks})")
    if "scheduled" not in frames:
        return
    for name in _PER_STEP:
        if name in frames:
            _check_steps(path / f"{name}.parquet", frames[name]["step"].to_numpy(), steps)
    launches, sched = frames["launches"], frames["scheduled"]
    launched = np.unique(launches["launched_step"].to_numpy())
    # (the first step's rows may have been launched before the recording began)
    rows = sched["step"].to_numpy()  # (each step's rows together; those of steps without a record come last)
    if np.count_nonzero(np.diff(rows)) + 1 != len(np.unique(rows)) and len(rows):
        _refuse(path / "scheduled.parquet", "a step's rows are not all together")
    _check_steps(path / "scheduled.parquet", np.sort(rows), np.union1d(steps[:1], launched), "launched")
    lens = np.fromiter(map(len, sched["token_ids"]), np.int64, len(sched))
    if (lens != sched["num_new_tokens"].to_numpy()).any() or (lens < 1).any() or (sched["start"] < 0).any():
        _refuse(path / "scheduled.parquet", "a row's token_ids do not number its num_new_tokens (>= 1), or it starts below 0")
    if sched.duplicated(["step", "request_id"]).any():
        _refuse(path / "scheduled.parquet", "a request has two rows in one step")
    per_step = sched.groupby("step").agg(tokens=("num_new_tokens", "sum"), rows=("request_id", "size"))
    per_step = per_step.reindex(steps, fill_value=0)
    if ((per_step["tokens"].to_numpy() != st["num_scheduled_tokens"].to_numpy()).any()
            or (per_step["rows"].to_numpy() != (st["num_prefill_seqs"] + st["num_decode_seqs"]).to_numpy()).any()):
        _refuse(path / "scheduled.parquet", "a step's rows or tokens are not what steps.parquet counted")
    for name in ("block_events", "pool_changes", "pool_fills"):
        if name in frames:
            _check_blocks(path / f"{name}.parquet", frames[name]["block_id"].to_numpy(), num_blocks)
    tables = frames["baseline_tables"]
    _check_blocks(path / "baseline_tables.parquet",
                  np.fromiter((b for t in tables["block_table"] for b in t), np.int64), num_blocks)
    if tables["request_id"].duplicated().any():
        _refuse(path / "baseline_tables.parquet", "a request has two block tables")
    events = frames["block_events"]
    if events["event"].isna().any():  # (read_frame leaves a name BLOCK_EVENTS lacks missing)
        _refuse(path / "block_events.parquet", f"an event other than {', '.join(BLOCK_EVENTS)}")
    if events["phase"].isna().any():  # (the same for a phase name PHASES lacks)
        _refuse(path / "block_events.parquet", f"a phase other than {', '.join(PHASES)}")
    if (events["ref_count"] < 0).any():
        _refuse(path / "block_events.parquet", "a reference count below 0")
    in_record = events.groupby("step").size().reindex(launches["step"], fill_value=0).to_numpy()
    before = launches["num_events_before"].to_numpy()
    later = launches["step"].duplicated().to_numpy()  # a record's second launch comes after its first
    if ((before < 0) | (before > in_record)).any() or (later & (np.diff(before, prepend=0) < 0)).any():
        _refuse(path / "launches.parquet", "a launch lies outside its record's block events")
    if frames["tokens"]["token_id"].duplicated().any():
        _refuse(path / "tokens.parquet", "a token id has two texts")


def check_queues(path: Path, records: Sequence[StepRecord], num_rows: int) -> None:
    """Refuse queues that are not what ``steps`` counted: the records' queues, rebuilt from the
    ``num_rows`` rows of ``queues.parquet``, must hold them all (a row of an unknown queue is in
    none; one of an unrecorded step :func:`check_frames` refused) and number the counts."""
    if sum(len(getattr(rec, queue)) for rec in records for queue in QUEUES) != num_rows:
        _refuse(path / "queues.parquet", f"a queue other than {', '.join(QUEUES)}")
    for queue, column in (("running", "num_requests_running"), ("waiting", "num_requests_waiting"),
                          ("preempted", "num_preemptions")):
        if any(len(getattr(rec, queue)) != getattr(rec, column) for rec in records):
            _refuse(path / "queues.parquet", f"a step's {queue} queue is not the {column} of steps.parquet")


def check_tokens(path: Path, tokens: pd.DataFrame, sched: pd.DataFrame, baseline: PoolState) -> None:
    """Every token id the scheduled rows or the baseline's blocks hold needs its text."""
    used = np.concatenate([np.fromiter((t for ids in sched["token_ids"] for t in ids), np.int64),
                           baseline.held_token_ids()])
    lacking = np.setdiff1d(used[used >= 0], tokens["token_id"].to_numpy())
    if len(lacking):
        _refuse(path / "tokens.parquet", f"no text for token id {lacking[0]}, which the trace holds")


def check_replay(path: Path, records: Sequence[StepRecord], baseline: PoolState) -> None:
    """Replay ``records`` from ``baseline``: after each step its used and cached blocks must be
    the counts the step reported, each block's count the one its last event carried, and a
    ``full`` trace's snapshot this replay. The counts are worked out for every step at once
    (:func:`_counts_after`); the replay step by step edits the tables and writes the tokens,
    which refuses events that free a block no table holds, and the like."""
    state = baseline.copy()
    if (state.ref_count < 0).any():
        _refuse(path / "baseline.parquet", "a reference count below 0")
    recounted, used, cached = _counts_after(records, state)
    snapshot = None
    for rec, ok, n_used, n_cached in zip(records, recounted.tolist(), used.tolist(), cached.tolist()):
        try:
            state.apply(rec)
        except (KeyError, IndexError, ValueError) as e:  # a freed block no table holds, and the like
            _refuse(path / "block_events.parquet", f"the events of step {rec.step} do not replay ({e!r})")
        if not ok:
            _refuse(path / "block_events.parquet", f"a reference count of step {rec.step} is not its events' recount")
        if (n_used, n_cached) != (rec.num_used_blocks, rec.num_cached_blocks):
            _refuse(path, f"the block events replay to {n_used} used and {n_cached} cached blocks after step "
                          f"{rec.step}, where steps.parquet says {rec.num_used_blocks} and {rec.num_cached_blocks}")
        if rec.pool is not None:
            snapshot = _check_snapshot(path, rec, state, snapshot)


def _counts_after(records: Sequence[StepRecord], baseline: PoolState) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per record, replayed from ``baseline``: whether every block its events touch ends it with
    the count its last event there carried (and not below 0), and the used and cached blocks
    after it. Worked out over all events at once, sorted by block (a loop over the steps costs
    several array operations per step, for a handful of events each)."""
    logs = [rec.block_events for rec in records]
    columns = {c: joined_column(logs, c) for c in ("block_id", "event", "block_hash", "ref_count")}
    order = np.argsort(columns["block_id"], kind="stable")  # a block's events stay in replay order
    blocks, events, hashes, carried = (col[order] for col in columns.values())
    record = np.repeat(np.arange(len(logs)), [len(log) for log in logs])[order]
    ref, block_hash = after_each_event(blocks, events, hashes, baseline.ref_count, baseline.block_hash)
    ends = _run_ends(blocks, record)  # each block's last event in each record that touches it
    block, ref_end, of_run, n = blocks[ends], ref[ends], record[ends], len(logs)
    initial = block_states(baseline.ref_count, baseline.block_hash)
    after = block_states(ref_end, block_hash[ends])
    before = initial[block]
    again = np.flatnonzero(block[1:] == block[:-1]) + 1  # a block's later run starts where its run before ended
    before[again] = after[again - 1]

    def count(state: int) -> np.ndarray:
        """The blocks in ``state`` after each record."""
        gained = np.bincount(of_run[after == state], minlength=n) - np.bincount(of_run[before == state], minlength=n)
        return int((initial == state).sum()) + np.cumsum(gained)

    wrong = (ref_end != carried[ends]) | (ref_end < 0)
    return np.bincount(of_run[wrong], minlength=n) == 0, count(USED), count(CACHED)


def _run_ends(blocks: np.ndarray, record: np.ndarray) -> np.ndarray:
    """Where each run of events of one block in one record ends (the events sorted by block)."""
    end = np.ones(len(blocks), bool)
    end[:-1] = (blocks[1:] != blocks[:-1]) | (record[1:] != record[:-1])
    return np.flatnonzero(end)


def _check_snapshot(path: Path, rec: StepRecord, state: PoolState,
                    snapshot: tuple[np.ndarray, np.ndarray] | None) -> tuple[np.ndarray, np.ndarray]:
    """A ``full`` record's pool snapshot (``snapshot``: the one before, its changes applied
    to) must be ``state``, the replay after it; returns the snapshot after it."""
    d = rec.pool
    if snapshot is None:  # the keyframe lists every block
        if not np.array_equal(np.sort(d.block_ids), np.arange(len(state.ref_count))):
            _refuse(path / "pool_changes.parquet", f"its first step, {rec.step}, does not list every block")
        snapshot = np.empty_like(state.ref_count), np.empty_like(state.block_hash)
        touched = d.block_ids
    else:
        touched = np.unique(rec.block_events.column("block_id"))
    snap_ref, snap_hash = snapshot
    snap_ref[d.block_ids], snap_hash[d.block_ids] = d.ref_count, d.block_hash
    check = np.union1d(touched, d.block_ids)
    if not (np.array_equal(snap_ref[check], state.ref_count[check])
            and np.array_equal(snap_hash[check], state.block_hash[check])):
        _refuse(path / "pool_changes.parquet", f"the pool snapshot of step {rec.step} is not the replay of the block events")
    replayed = last_fills([(t[-1], len(t), state.computed.get(r, 0)) for r, t in state.tables.items() if t],
                          state.block_size)
    if _fills(state, *replayed) != _fills(state, d.last_blocks, d.last_counts):
        _refuse(path / "pool_fills.parquet", f"the tokens in the blocks of step {rec.step} are not the replay's")
    return snapshot


def _fills(state: PoolState, last_blocks: np.ndarray, last_counts: np.ndarray) -> dict[int, int]:
    """Tokens per block where the tables' last blocks make it differ from a full or empty block."""
    full = np.where((state.ref_count[last_blocks] > 0) | (state.block_hash[last_blocks] != NO_HASH), state.block_size, 0)
    return {b: c for b, c, f in zip(last_blocks.tolist(), last_counts.tolist(), full.tolist()) if c != f}


def _check_steps(file: Path, steps: np.ndarray, known: np.ndarray, what: str = "recorded") -> None:
    """Refuse rows out of step order, or of a step not ``known``; once in order, each step is
    looked up once (a long table has many rows per step)."""
    gaps = np.diff(steps)
    if (gaps < 0).any():
        _refuse(file, "rows are not in step order")
    distinct = np.concatenate([steps[:1], steps[1:][gaps > 0]])
    unknown = distinct[~np.isin(distinct, known)]
    if len(unknown):
        _refuse(file, f"step {unknown[0]} has rows but was not {what}")


def _check_blocks(file: Path, blocks: np.ndarray, num_blocks: int) -> None:
    if len(blocks) and (blocks.min() < 0 or blocks.max() >= num_blocks):
        _refuse(file, f"a block id outside 0..{num_blocks - 1} (meta.json's num_blocks)")


def _refuse(file: Path, what: str) -> None:
    raise ValueError(f"{file}: {what}; not a whole, unedited save of Trace.save")
