"""``Trace``: a recording as pandas DataFrames and pool arrays (docs/TRACE_API.md).

A trace is live while its :class:`~kvscope.trace.recorder.Recorder` records (every read sees
the steps so far) and frozen once loaded. Pool state, block tables, slot mappings and block
contents at a step are rebuilt from the block events by a forward-only replay cursor, so moving
a step slider forward costs only the steps in between.
"""
from __future__ import annotations

import bisect
import json
import operator
import threading
from contextlib import contextmanager
from itertools import chain
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Protocol, Sequence

import numpy as np
import pandas as pd

from kvscope.arg_checks import is_index
from kvscope.engine.block_manager import hash_block
from kvscope.engine.hooks import BlockEvent
from kvscope.trace import frozen_heap
from kvscope.trace.events import IDLE, AllBlocksCleared, BlockRemoved, BlockStored
from kvscope.trace.lifecycle import LifecycleBuilder
from kvscope.trace.pool import NO_HASH, STATE_NAMES, PoolState, block_states, token_blocks
from kvscope.trace.record import PHASES, Launch, Scheduled, StepRecord
from kvscope.trace.saved_files import SavedFiles
from kvscope.trace.snapshots import SnapshotCursor
from kvscope.trace.summary_card import summary_card
from kvscope.trace.verify import (
    CHECKSUMS, check_checksums, check_frames, check_queues, check_replay, check_tokens, write_checksums,
)
from kvscope.trace.tables import (
    SCHEMAS, baseline_frames, baseline_from_frames, block_events_frame, frame, launched_beyond, launches_frame,
    pool_frames, queues_frame, read_baseline, read_frame, records_from_frames, scheduled_frame, steps_frame,
    write_arrays, write_frame,
)

if TYPE_CHECKING:
    from kvscope.trace.recorder import ListenerHandle, Listener

_STEP = attrgetter("step")


class TraceSource(Protocol):
    """Where a trace's records come from: a live :class:`Recorder` or a loaded directory."""

    def view(self, with_baseline: bool = False) -> tuple[list[StepRecord], PoolState | None, int | None]: ...

    def requests_frame(self) -> pd.DataFrame: ...

    def add_listener(self, fn: "Listener", *, block_events: bool = True) -> "ListenerHandle": ...

    def hold(self) -> None: ...

    def release(self) -> None: ...


class _Loaded:
    def __init__(self, records: list[StepRecord], baseline: PoolState | None, requests: pd.DataFrame) -> None:
        self.records, self.baseline, self.requests = records, baseline, requests

    def view(self, with_baseline: bool = False) -> tuple[list[StepRecord], PoolState | None, int | None]:
        return self.records, self.baseline.copy() if with_baseline and self.baseline else None, None

    def requests_frame(self) -> pd.DataFrame:
        return self.requests

    def add_listener(self, fn: "Listener", *, block_events: bool = True) -> "ListenerHandle":
        raise RuntimeError("a loaded trace does not record; listeners need a live trace from llm.record()")

    def hold(self) -> None:
        """Nothing to hold: a loaded trace drops no step."""

    def release(self) -> None:
        """Nothing held."""


class Trace:
    """Recorded engine steps. Get one from ``with llm.record(...) as trace`` or ``Trace.load``."""

    def __init__(
        self, meta: dict[str, Any], source: TraceSource, tokenizer: Any = None,
        token_texts: dict[int, str] | None = None,
    ) -> None:
        self.meta = meta
        self._source = source
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = dict(token_texts or {})
        self._frames: dict[str, tuple[tuple, pd.DataFrame]] = {}
        self._lock = threading.RLock()  # the replay cursor is shared by the notebook and the engine thread
        self._cursor: PoolState | None = None
        self._cursor_step: int | None = None
        self._cursor_arrays: dict[str, np.ndarray] | None = None
        self._forward: dict[str, list[int]] = {}  # tables of the forward pass of _cursor_step
        self._launches: dict[int, dict[str, list[int]]] = {}  # step -> tables at its launch, near the cursor
        self._lifecycle: LifecycleBuilder | None = None
        self._snapshots = (SnapshotCursor(self.num_blocks, self.block_size)  # the full level's pool snapshots
                           if self.level == "full" else None)

    # ---------------------------------------------------------------- basics
    @property
    def level(self) -> str:
        return self.meta["level"]

    @property
    def num_blocks(self) -> int:
        return self.meta["num_blocks"]

    @property
    def block_size(self) -> int:
        return self.meta["block_size"]

    @property
    def step_ids(self) -> list[int]:
        return [r.step for r in self._records()]

    def add_listener(self, fn: "Listener", *, block_events: bool = True) -> "ListenerHandle":
        """``fn(record: StepRecord)`` runs in the engine's thread after each recorded step;
        ``block_events=False`` when ``fn`` does not read ``record.block_events``, which then need
        not be packed every step (see :meth:`Recorder.add_listener`)."""
        return self._source.add_listener(fn, block_events=block_events)

    @contextmanager
    def hold_steps(self) -> Iterator["Trace"]:
        """While the block runs, a live ring buffer drops none of its steps (those run meanwhile
        are added), so several reads of one step find it; the excess goes when the block ends."""
        self._source.hold()
        try:
            yield self
        finally:
            self._source.release()

    def __repr__(self) -> str:
        recs = self._records()
        span = f"{recs[0].step}..{recs[-1].step}" if recs else "none"
        return f"<kvscope.Trace level={self.level!r} steps={len(recs)} ({span}) blocks={self.num_blocks}>"

    def _repr_html_(self) -> str:
        """A notebook's card of what the recording holds (:mod:`kvscope.trace.summary_card`)."""
        return summary_card(self)

    # ---------------------------------------------------------------- tables
    @property
    def steps(self) -> pd.DataFrame:
        return self._cached("steps", steps_frame)

    @property
    def requests(self) -> pd.DataFrame:
        return self._source.requests_frame().copy(deep=False)

    @property
    def kv_shards(self) -> pd.DataFrame:
        """One row per tensor-parallel rank: which KV heads it holds, its blocks, bytes and element type."""
        cols = ["rank", "kv_head_start", "kv_head_end", "num_kv_heads", "num_blocks", "bytes", "kv_cache_dtype"]
        return pd.DataFrame(self.meta.get("kv_shards") or [], columns=cols)

    @property
    def block_events(self) -> pd.DataFrame:
        """Block events; those fired between steps (abort, reset) belong to the next step, phase ``idle``."""
        self._need_blocks("block_events")
        return self._cached("block_events", block_events_frame)

    @property
    def lifecycle(self) -> pd.DataFrame:
        """One row per request per state interval (``waiting``, ``prefill``, ``recompute``,
        ``decode``, ``preempted``, ``idle``), and a zero-length ``finished`` / ``aborted`` row
        closing each life; see docs/TRACE_API.md."""
        self._need_blocks("lifecycle")
        recs = self._records()
        with self._lock:  # follows the ring buffer: new steps added, dropped ones dropped
            if self._lifecycle is None or not self._lifecycle.follows(recs):
                self._lifecycle = LifecycleBuilder()
            self._lifecycle.follow(recs)
            return frame("lifecycle", self._lifecycle.rows())

    def scheduled(self, step: int | None = None) -> pd.DataFrame:
        """Per step and request: ``start``, ``num_new_tokens``, ``num_cached_tokens`` (admissions),
        ``is_prefill`` (prefill chunk, else decode), ``sample`` and the ``token_ids`` computed."""
        return self._per_step("scheduled", scheduled_frame, step)

    def queues(self, step: int | None = None) -> pd.DataFrame:
        """``running`` and ``waiting`` after the step (head first); ``preempted`` and ``finished`` in it."""
        return self._per_step("queues", queues_frame, step)

    def block_tables(self, step: int | None = None) -> pd.DataFrame:
        """The block table of every request in the step's forward pass."""
        return self._forward_frame("block_tables", _table_columns, step)

    def slot_mapping(self, step: int | None = None) -> pd.DataFrame:
        """Where each computed token's K/V went: ``slot = block_id * block_size + offset``."""
        return self._forward_frame("slot_mapping", _slot_columns, step)

    # ------------------------------------------------------------- the pool
    def pool_arrays(self, step: int) -> dict[str, np.ndarray]:
        """``state`` (0 free, 1 used, 2 cached), ``ref_count``, ``block_hash`` (-1 none),
        ``num_tokens``: one entry per block after ``step``."""
        self._need_blocks("pool_arrays")
        if self.level == "full":
            recs = self._records()
            i = _index(recs, step)
            with self._lock:
                pool = self._snapshots.arrays(recs, i)
            return {"state": block_states(pool["ref_count"], pool["block_hash"]), **pool}
        with self._lock:
            self._move(step)
            if self._cursor_arrays is None:
                self._cursor_arrays = self._cursor.arrays()
                for a in self._cursor_arrays.values():
                    a.flags.writeable = False  # shared by every caller until the cursor moves
            return dict(self._cursor_arrays)

    def blocks(self, step: int, block_ids: Sequence[int] | None = None) -> pd.DataFrame:
        """The pool after ``step``, one row per block, with the requests owning it: the whole
        pool, or only ``block_ids`` (a hover on a pool of millions asks for a few)."""
        arrays = self.pool_arrays(step)
        ids = np.arange(self.num_blocks) if block_ids is None else np.asarray(block_ids)
        if ids.ndim != 1 or (len(ids) and (ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= self.num_blocks)):
            raise ValueError(f"block_ids must be integers in 0..{self.num_blocks - 1}, got {block_ids!r}")
        ids = ids.astype(np.int64)
        rows_of: dict[int, list[int]] = {}  # (a block asked for twice gets two rows)
        for i, b in enumerate(ids.tolist() if block_ids is not None else ()):
            rows_of.setdefault(b, []).append(i)
        with self._lock:
            self._move(step)
            owners: list[list[str]] = [[] for _ in range(len(ids))]
            for rid, table in self._cursor.tables.items():
                for b in table:
                    for i in rows_of.get(b, ()) if block_ids is not None else (b,):
                        owners[i].append(rid)
        h = arrays["block_hash"][ids]
        hashes = pd.array(h, dtype="Int64")
        hashes[h == NO_HASH] = pd.NA
        return frame("blocks", {
            "block_id": ids,
            "state": np.asarray(STATE_NAMES, dtype=object)[arrays["state"][ids]],
            "ref_count": arrays["ref_count"][ids],
            "block_hash": hashes,
            "num_tokens": arrays["num_tokens"][ids],
            "owners": owners,
        })

    def block_tokens(self, step: int, block_id: int) -> list[int]:
        """The token ids whose K/V block ``block_id`` holds after ``step``."""
        if not (is_index(block_id) and 0 <= block_id < self.num_blocks):  # (numpy reads a negative one from the end)
            raise ValueError(f"block_id must be an integer in 0..{self.num_blocks - 1}, got {block_id!r}")
        n = int(self.pool_arrays(step)["num_tokens"][block_id])
        with self._lock:
            self._move(step)
            return self._cursor.contents[block_id, :n].tolist()

    def decode(self, token_ids: Iterable[int]) -> str:
        """Text of ``token_ids``, token by token, from the texts the trace keeps (no tokenizer needed)."""
        ids = [operator.index(t) for t in token_ids]
        if any(t < 0 for t in ids):
            raise ValueError(f"token ids must be >= 0, got {[t for t in ids if t < 0][0]}")
        return "".join(self._token_text(t) for t in ids)

    def kv_events(self) -> pd.DataFrame:
        """vLLM's KV-cache events (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) with
        ``block_id`` and ``ref_count`` added; a reset that empties the cache is one ``AllBlocksCleared``."""
        self._need_blocks("kv_events")
        recs, state, _ = self._source.view(with_baseline=True)
        return _kv_events(recs, state)

    # ------------------------------------------------------------ save/load
    def save(self, path: str | Path) -> Path:
        """Write the trace as parquet files (plus ``meta.json``) into directory ``path``, and
        ``checksums.json``, the SHA-256 of each, so that a load can tell an edited file."""
        path = Path(path)
        if path.exists() and not path.is_dir():
            raise NotADirectoryError(f"{path}: not a directory; Trace.save writes a directory of files, "
                                     "so give it a directory's path (made if missing)")
        path.mkdir(parents=True, exist_ok=True)
        write_checksums(path, self._write(path))
        return path

    def _write(self, path: Path) -> list[str]:
        """Write the trace's files into ``path``; their names."""
        recs, base, _ = self._source.view(with_baseline=True)
        (path / "meta.json").write_text(json.dumps(self.meta, indent=1))
        frames = {"steps": steps_frame(recs), "requests": self._source.requests_frame()}
        if self.level != "summary":
            tail = launched_beyond(recs)  # saved, so that a loaded trace replays them too
            arrays, frames["baseline_tables"] = baseline_frames(base)
            write_arrays(path / "baseline.parquet", arrays)
            ids = np.unique(np.concatenate([base.held_token_ids(), *(r.scheduled.token_ids for r in recs),
                                            *(t.token_ids for _, t in tail)]))
            ids = ids[ids >= 0].tolist()  # (-1: an input a recording that began mid-step never saw)
            frames.update(scheduled=scheduled_frame(recs, tail), block_events=block_events_frame(recs),
                          queues=queues_frame(recs), launches=launches_frame(recs),
                          tokens=frame("tokens", {"token_id": ids, "text": [self._token_text(t) for t in ids]}))
            if self.level == "full":
                frames.update(zip(("pool_changes", "pool_fills"), pool_frames(recs)))
        for name, df in frames.items():
            write_frame(df, path / f"{name}.parquet")
        return ["meta.json", *(f"{name}.parquet" for name in frames), *(() if self.level == "summary" else ("baseline.parquet",))]

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        """A trace saved by :meth:`save`; it decodes tokens without a tokenizer. A directory
        that is not a whole, unedited save is refused with an error naming the file at fault."""
        files = SavedFiles(Path(path))
        meta = _read_meta(files)
        with frozen_heap.collector_paused():  # (what it builds is kept: no garbage to look for; see frozen_heap)
            trace = cls._read(files, meta)
        check_checksums(files)
        return trace

    @classmethod
    def _read(cls, files: SavedFiles, meta: dict[str, Any]) -> "Trace":
        """The trace in ``files``, its tables checked to fit together (see :mod:`kvscope.trace.verify`)."""
        path, level = files.path, meta["level"]
        steps = read_frame("steps", files)
        requests = read_frame("requests", files)
        if level == "summary":
            check_frames(path, {"steps": steps}, meta["num_blocks"])
            return cls(meta, _Loaded(records_from_frames(level, steps), None, requests))
        if not (path / "launches.parquet").exists() and not (path / CHECKSUMS).exists():  # (else: a file lost)
            raise ValueError(f"{path}: no launches.parquet; a {level!r} trace saved before kvscope kept "
                             "async scheduling on under block-level recording cannot be loaded: record it again")
        names = ("scheduled", "block_events", "queues", "launches", "baseline_tables", "tokens") + \
            (("pool_changes", "pool_fills") if level == "full" else ())
        frames = {"steps": steps, **{n: read_frame(n, files) for n in names}}
        check_frames(path, frames, meta["num_blocks"])
        records = records_from_frames(
            level, steps, *(frames[n] for n in ("scheduled", "block_events", "queues", "launches")),
            pool=(frames["pool_changes"], frames["pool_fills"]) if level == "full" else None,
        )
        check_queues(path, records, len(frames["queues"]))
        baseline = baseline_from_frames(read_baseline(files, meta["num_blocks"], meta["block_size"]),
                                        frames["baseline_tables"])
        tokens = frames["tokens"]
        check_tokens(path, tokens, frames["scheduled"], baseline)
        check_replay(path, records, baseline)
        return cls(meta, _Loaded(records, baseline, requests),
                   token_texts=dict(zip(tokens["token_id"].tolist(), tokens["text"])))

    # -------------------------------------------------------------- helpers
    def _records(self) -> list[StepRecord]:
        return self._source.view()[0]

    def _record(self, step: int) -> StepRecord:
        recs = self._records()
        return recs[_index(recs, step)]

    def _need_blocks(self, what: str) -> None:
        if self.level == "summary":
            raise ValueError(f"{what} needs a trace recorded at level 'blocks' or 'full'; this one is 'summary'")

    def _cached(self, name: str, build: Callable[[Sequence[StepRecord]], pd.DataFrame]) -> pd.DataFrame:
        recs = self._records()
        key = (len(recs), recs[0].step, recs[-1].step) if recs else (0,)
        hit = self._frames.get(name)
        if hit is None or hit[0] != key:
            hit = self._frames[name] = (key, build(recs))
        return hit[1].copy(deep=False)

    def _per_step(self, name: str, build: Callable[[Sequence[StepRecord]], pd.DataFrame],
                  step: int | None) -> pd.DataFrame:
        self._need_blocks(name)
        return self._cached(name, build) if step is None else build([self._record(step)])

    def _forward_frame(self, name: str, columns: Callable[..., dict[str, np.ndarray]],
                       step: int | None) -> pd.DataFrame:
        """A per-token or per-block table of forward passes, from the replayed tables."""
        self._need_blocks(name)
        bs = self.block_size
        if step is not None:
            rec = self._record(step)
            with self._lock:
                self._move(step)
                return frame(name, columns(rec, self._forward, bs))
        recs, state, _ = self._source.view(with_baseline=True)
        launches = _first_launch(recs, state)
        parts: list[dict[str, np.ndarray]] = []
        for rec in recs:
            _apply_keeping(state, rec, launches)
            parts.append(columns(rec, launches.pop(rec.step, {}), bs))
        return frame(name, {c: np.concatenate([p[c] for p in parts]) if parts else [] for c in SCHEMAS[name]})

    def _move(self, step: int) -> None:
        """Bring the replay cursor to the state after ``step`` (call with ``self._lock`` held).

        It moves forward from where it is while no record after it has been dropped, and
        restarts from the baseline otherwise.
        """
        if self._cursor is not None and self._cursor_step == step:
            return
        recs, _, dropped = self._source.view()
        i = _index(recs, step)
        c = self._cursor_step
        if self._cursor is not None and c < step and (dropped is None or dropped <= c):
            lo = bisect.bisect_right(recs, c, key=_STEP)
        else:
            recs, self._cursor, _ = self._source.view(with_baseline=True)
            i, lo = _index(recs, step), 0
            self._launches = _first_launch(recs, self._cursor)
        try:
            for k in range(lo, i + 1):  # (step's launch is in its own record, or the one before: async)
                _apply_keeping(self._cursor, recs[k], self._launches if k >= i - 1 else None)
        except BaseException:
            self._cursor = None  # (half applied: the next read starts over from the baseline)
            raise
        self._launches = {s: t for s, t in self._launches.items() if s >= step}
        self._forward = self._launches.get(step, {})
        self._cursor_step, self._cursor_arrays = step, None

    def _token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            if self._tokenizer is None:
                raise KeyError(f"token id {token_id} does not occur in this trace, and a loaded trace has no tokenizer")
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text


def _read_meta(files: SavedFiles) -> dict[str, Any]:
    """``meta.json`` of the trace directory ``files.path``, with the level and the pool's shape
    (which size every replay) checked."""
    from kvscope.trace.recorder import LEVELS  # (the recorder imports this module)

    path = files.path
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such directory; Trace.load takes the directory Trace.save wrote")
    if not path.is_dir():
        raise NotADirectoryError(f"{path}: not a directory; Trace.load takes the directory Trace.save wrote")
    file = path / "meta.json"
    try:
        meta = json.loads(files.read(file.name).decode())
    except FileNotFoundError:
        raise ValueError(f"{file}: missing; not a trace saved by Trace.save?") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{file}: not readable JSON ({e}); not a trace saved by Trace.save?") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{file}: must hold a JSON object, got {type(meta).__name__}; not a trace saved by Trace.save?")
    level = meta.get("level")
    if level not in LEVELS:
        raise ValueError(f"{file}: 'level' must be one of {', '.join(map(repr, LEVELS))}, "
                         f"got {level!r}; not a trace saved by Trace.save?")
    for key, least in (("num_blocks", 0), ("block_size", 1)):
        value = meta.get(key)
        if not (is_index(value) and value >= least):
            raise ValueError(f"{file}: {key!r} must be an integer >= {least}, got {value!r}")
    return meta


def _index(records: Sequence[StepRecord], step: int) -> int:
    if not is_index(step):
        raise TypeError(f"step must be an integer, one of trace.step_ids, got {step!r}")
    i = bisect.bisect_left(records, step, key=_STEP)
    if i == len(records) or records[i].step != step:
        span = f"{records[0].step}..{records[-1].step}" if records else "none"
        raise KeyError(f"step {step} is not in this trace (recorded steps: {span}; see trace.step_ids)")
    return i


def _launch_tables(sched: Scheduled, state: PoolState) -> dict[str, list[int]]:
    tables = state.tables
    return {rid: list(tables[rid]) for rid in sched.request_ids if rid in tables}


def _apply_keeping(state: PoolState, rec: StepRecord, launches: dict[int, dict[str, list[int]]] | None) -> None:
    """Advance ``state`` over ``rec``, keeping in ``launches`` the tables its launched rows used."""
    def keep(s: PoolState, launch: Launch) -> None:
        launches[launch.step] = _launch_tables(launch.rows, s)

    state.apply(rec, on_launch=keep if launches is not None else None)


def _first_launch(recs: Sequence[StepRecord], base: PoolState) -> dict[int, dict[str, list[int]]]:
    """The first record's forward tables when its step was launched before the trace begins
    (async scheduling): the baseline's, which lack only requests that finished in the step before."""
    if not recs or recs[0].launched(recs[0].step) is not None:
        return {}
    return {recs[0].step: _launch_tables(recs[0].scheduled, base)}


def _table_columns(rec: StepRecord, tables: dict[str, list[int]], block_size: int) -> dict[str, np.ndarray]:
    rids = rec.scheduled.holding(tables).request_ids
    rows = [tables[rid] for rid in rids]
    lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    total = int(lens.sum())
    return {
        "step": np.full(total, rec.step, dtype=np.int64),
        "request_id": np.repeat(np.asarray(rids, dtype=object), lens),
        "logical_block": np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens),
        "physical_block": np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=total),
    }


def _slot_columns(rec: StepRecord, tables: dict[str, list[int]], block_size: int) -> dict[str, np.ndarray]:
    sched = rec.scheduled.holding(tables)
    positions, blocks = token_blocks(sched, tables, block_size)
    offset = positions % block_size
    return {
        "step": np.full(len(positions), rec.step, dtype=np.int64),
        "request_id": np.repeat(np.asarray(sched.request_ids, dtype=object), sched.num_new_tokens),
        "position": positions,
        "token_id": sched.token_ids.astype(np.int64),
        "slot": blocks * block_size + offset,
        "block_id": blocks,
        "offset": offset,
    }


def _kv_events(records: Sequence[StepRecord], state: PoolState) -> pd.DataFrame:
    columns = list(SCHEMAS["kv_events"])[2:]
    return frame("kv_events", [(step, type(ev).__name__, *(vars(ev).get(c) for c in columns))
                               for step, ev in kv_event_list(records, state)])


def kv_event_list(records: Sequence[StepRecord], state: PoolState) -> list[tuple[int, Any]]:
    """``(step, event)`` in vLLM's schema for each record, advancing ``state`` through them.

    Each record's events are complete when it has been applied, so a live publisher can call
    this one record at a time (``kvscope.attach.publisher``) and send what ``kv_events()`` shows.
    """
    rows: list[tuple[int, Any]] = []
    resets: list[tuple[int, BlockRemoved]] = []  # an idle run of evictions: reset_prefix_cache

    def add(step: int, ev: Any) -> None:
        rows.append((step, ev))

    def flush(s: PoolState) -> None:
        if resets and not (s.block_hash != NO_HASH).any():
            add(resets[0][0], AllBlocksCleared())
        else:
            for step, ev in resets:
                add(step, ev)
        resets.clear()

    idle_code = PHASES.index(IDLE)
    for rec in records:
        phases = rec.event_phases()[0].tolist()

        def on_event(i: int, ev: BlockEvent, s: PoolState, rec: StepRecord = rec, phases: list[int] = phases) -> None:
            b = ev.block_id
            if ev.event == "block.evicted":
                removed = BlockRemoved([int(s.block_hash[b])], block_id=b, ref_count=ev.ref_count)
                if phases[i] == idle_code:
                    resets.append((rec.step, removed))
                    return
                flush(s)
                add(rec.step, removed)
                return
            flush(s)
            if ev.event == "block.hashed":
                table = s.tables[ev.request_id]
                j = table.index(b)
                add(rec.step, BlockStored(
                    [ev.block_hash], _chain_hash(s, table, j - 1), s.contents[b].tolist(), s.block_size,
                    block_id=b, ref_count=ev.ref_count,
                ))

        state.apply(rec, on_event=on_event)
        flush(state)
    return rows


def _chain_hash(s: PoolState, table: list[int], j: int) -> int | None:
    """The prefix-cache hash of logical block ``j`` of ``table`` (a block computed twice in one
    step keeps no hash in the pool, so rebuild it from the contents)."""
    if j < 0:
        return None
    h = int(s.block_hash[table[j]])
    if h != NO_HASH:
        return h
    parent = _chain_hash(s, table, j - 1)
    return hash_block(s.contents[table[j]].tolist(), NO_HASH if parent is None else parent)
