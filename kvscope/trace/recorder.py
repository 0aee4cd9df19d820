"""``Recorder``: turns the engine's hook calls into one :class:`StepRecord` per step.

It attaches only the hooks its level needs, so ``summary`` pays for ``step.end`` and the
request hooks alone, and a detached recorder costs the engine nothing. It reads control-plane
state (numpy arrays, queues, sequences' ids and tables), never a tensor, so recording cannot
force a device synchronisation. Records sit in a ring buffer of ``max_steps``; the oldest
record is folded into the replay baseline when it is dropped, so every retained step stays
fully reconstructible.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import threading
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import pandas as pd

from kvscope.arg_checks import check_int
from kvscope.engine.hooks import BlockEvent, BlockEvents, HookHandle, warn_detached
from kvscope.engine.scheduler_output import PLACEHOLDER
from kvscope.trace import frozen_heap
from kvscope.trace.event_log import EventLog, RequestIds, num_events, num_events_until
from kvscope.trace.pool import PoolState, SparsePool
from kvscope.trace.record import Launch, Scheduled, StepRecord
from kvscope.trace.scheduled import RowEncoder, RowTable
from kvscope.trace.snapshots import SnapshotTaker, merge_keyframe
from kvscope.trace.tables import frame
from kvscope.trace.trace import Trace

if TYPE_CHECKING:
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.engine.request import Request
    from kvscope.engine.scheduler_output import SchedulerOutput, StepColumns
    from kvscope.engine.step_info import StepInfo
    from kvscope.outputs import RequestMetrics

LEVELS: tuple[str, ...] = ("summary", "blocks", "full")
# Records' block events are packed together once this many records, or events, wait (or on a
# read): enough to spread a pack's own cost thin, few enough that no one step's host work spikes
# (under async scheduling an even load hides behind the GPU's steps; a spike stalls the GPU).
CHUNK_STEPS = 16
CHUNK_EVENTS = 4096
# A ring buffer that drops steps starts a new request-id table once its table names this many ids
# (and twice the engine's requests): see Recorder._renew_request_ids.
REQUEST_IDS_PER_TABLE = 4096
Listener = Callable[[StepRecord], Any]
_NAN = math.nan


class ListenerHandle:
    """Returned by :meth:`Recorder.add_listener`; ``remove()`` detaches it (idempotent)."""

    def __init__(self, listeners: dict[int, tuple[Listener, bool]], key: int) -> None:
        self._listeners, self._key = listeners, key

    def remove(self) -> None:
        self._listeners.pop(self._key, None)


class _RequestRow:
    """One request's row of ``trace.requests``: live fields read from its request until it ends."""

    __slots__ = ("request_id", "prompt_len", "seq", "metrics", "output_len", "finish_reason")

    def __init__(self, req: "Request") -> None:
        self.request_id = req.request_id
        self.prompt_len = req.num_prompt_tokens
        self.seq: Request | None = req
        self.metrics: RequestMetrics = req.metrics
        self.output_len = 0
        self.finish_reason: str | None = None

    def freeze(self) -> None:
        """Stop following a request that is still running (the recording ended)."""
        if self.seq is not None:
            self.output_len = len(self.seq.token_ids) - self.prompt_len
            self.seq, self.metrics = None, dataclasses.replace(self.metrics)

    def row(self) -> tuple:
        m = self.metrics
        out = self.output_len if self.seq is None else len(self.seq.token_ids) - self.prompt_len
        itl = None if out < 2 or m.last_token_time is None else (m.last_token_time - m.first_token_time) / (out - 1)
        return (
            self.request_id, self.prompt_len, out, m.num_cached_tokens, m.num_preemptions,
            m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time,
            self.finish_reason, m.ttft_s, itl, m.e2e_s,
        )


class Recorder:
    """Records an engine's steps at ``level`` into a ring buffer of ``max_steps`` records.

    ``with Recorder(engine, "blocks") as trace: ...`` attaches on entry and detaches on exit.
    """

    def __init__(
        self, engine: "LLMEngine", level: str = "blocks", max_steps: int = 10_000,
        model: str | None = None,
    ) -> None:
        if not (hasattr(engine, "hooks") and hasattr(engine, "block_manager")):
            hint = "; for an LLM, use llm.record(...) or pass llm.llm_engine" if hasattr(engine, "llm_engine") else ""
            raise TypeError(f"engine must be an LLMEngine, got {type(engine).__name__}{hint}")
        if not isinstance(level, str) or level not in LEVELS:  # (an array's `in` raises numpy's own error)
            raise ValueError(f"level must be one of {', '.join(map(repr, LEVELS))}, got {level!r}")
        check_int("max_steps", max_steps)
        self.engine = engine
        self.level = level
        self.max_steps = max_steps
        self.records: deque[StepRecord] = deque()
        self.baseline: SparsePool | PoolState | None = None  # dense once the ring buffer drops a step
        self.last_dropped_step: int | None = None
        self.lock = threading.Lock()
        self._holds = 0  # readers holding the retained steps (Trace.hold_steps): none is dropped meanwhile
        self._blocks = level != "summary"
        self._snapshots = SnapshotTaker(engine.block_manager.num_blocks) if level == "full" else None
        # A request id is free again once its request's final output is out, so one id may name
        # several requests: each gets its own row; the newest row of each id is the one hooks update.
        self._request_rows: dict[_RequestRow, None] = {}  # every row of trace.requests, in the order added
        self._requests: dict[str, _RequestRow] = {}  # request id -> its newest row
        self._finished: deque[tuple[int, _RequestRow]] = deque()  # (step, row), for pruning
        self._finishing: list[_RequestRow] = []  # finished since the last record: they end in the next one
        self._pending: list[BlockEvent | BlockEvents] = []  # the engine's sink: this window's events
        # Records whose block events wait to be packed, each with where its events end in the
        # chunk of events they share (packed as one log: see _pack_chunk).
        self._unpacked: list[tuple[StepRecord, int]] = []
        self._chunk: list[BlockEvent | BlockEvents] = []
        self._chunk_events = 0
        self._new_request_ids()
        # Steps launched since the last step.end: (step, events before it, its output, its request ids).
        self._launches: list[tuple[int, int, "SchedulerOutput", dict[int, str]]] = []
        self._ahead: Launch | None = None  # launched in the last record for the next one (async)
        self._listeners: dict[int, tuple[Listener, bool]] = {}  # key -> (fn, reads block_events)
        self._keys = itertools.count()
        self._handles: list[HookHandle] = []
        self._started = False
        self._holds_heap = False
        bm = engine.block_manager
        shards = getattr(engine.executor, "kv_shards", None)
        kv_shards = shards() if shards is not None else None
        self.meta: dict[str, Any] = {
            "model": model,
            "engine_config": dataclasses.asdict(engine.config),
            "kv_shards": kv_shards,
            "num_blocks": bm.num_blocks,
            "block_size": bm.block_size,
            # The pool's element type and one block's bytes over all ranks (None without a pool).
            "kv_cache_dtype": kv_shards[0]["kv_cache_dtype"] if kv_shards else None,
            "bytes_per_block": sum(s["bytes"] // s["num_blocks"] for s in kv_shards) if kv_shards else None,
            "level": level,
            "max_steps": max_steps,
        }
        self.trace = Trace(self.meta, self, tokenizer=engine.tokenizer)

    # ----------------------------------------------------------- lifecycle
    def start(self) -> "Trace":
        """Attach to the engine (between steps); returns the live :class:`Trace`."""
        if self._started:
            raise RuntimeError("a Recorder records once; make a new one to record again")
        self._started = True
        for rid, req in self.engine.requests.items():  # already queued or running: rows from the start
            if not req.is_finished:
                self._add_row(rid)
        hooks = self.engine.hooks
        if self._blocks:
            self.baseline = SparsePool.capture(self.engine)
            self._handles.append(hooks.add("step.scheduled", self._on_scheduled))
            self._handles.append(hooks.add_block_sink(self._pending, columns=True))
        self._handles += [
            hooks.add("request.added", self._on_added),
            hooks.add("request.finished", self._on_finished),
            hooks.add("step.end", self._on_step_end, first=True),
            # (a listener may step the engine again: only once every recorder has recorded step n)
            hooks.add("step.end", self._call_listeners, after_first=True),
        ]
        frozen_heap.hold()  # (see frozen_heap: no full collection walks the heap while recording)
        self._holds_heap = True
        return self.trace

    def stop(self) -> None:
        """Detach and let go of the engine; the trace keeps what was recorded, frozen.

        Block events fired after the last recorded step (they would open the next one) are dropped.
        """
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._pending.clear()
        self._launches.clear()
        with self.lock:
            self._pack_chunk()
        for req in list(self._request_rows):
            req.freeze()
        self.engine = None
        if self._holds_heap:
            self._holds_heap = False
            frozen_heap.release(collect=False)

    def __enter__(self) -> "Trace":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def add_listener(self, fn: Listener, *, block_events: bool = True) -> ListenerHandle:
        """Call ``fn(record)`` in the engine's thread after each recorded step.

        While a listener that reads ``record.block_events`` is attached, each record's events are
        packed before it is called, one pack per step. ``block_events=False`` says ``fn`` leaves
        them alone (it may find them ``None``), so the recording keeps packing them a chunk of
        steps at a time; a read of the trace still finds every record's events.
        A listener that raises is reported with a RuntimeWarning and detached, like a hook; one
        that raises ``KeyboardInterrupt`` or ``SystemExit`` stops the call as a hook's does, once
        every listener has had the step.
        """
        if not callable(fn):
            raise TypeError(f"listener must be callable, got {type(fn).__name__}")
        key = next(self._keys)
        self._listeners[key] = (fn, bool(block_events))
        return ListenerHandle(self._listeners, key)

    # ------------------------------------------------------ for the Trace
    def view(self, with_baseline: bool = False) -> tuple[list[StepRecord], PoolState | None, int | None]:
        """The retained records, a copy of their baseline if asked, and the last dropped step,
        consistent with each other even while the engine runs in another thread."""
        with self.lock:
            self._pack_chunk()
            base = None
            if with_baseline and self.baseline is not None:
                base = self.baseline.expand() if isinstance(self.baseline, SparsePool) else self.baseline.copy()
            return list(self.records), base, self.last_dropped_step

    def requests_frame(self) -> pd.DataFrame:
        return frame("requests", [r.row() for r in list(self._request_rows)])

    def hold(self) -> None:
        """Keep every retained step until :meth:`release`: the steps run meanwhile are added and
        none is dropped, so a reader's several reads of one step find it (the engine never waits)."""
        with self.lock:
            self._holds += 1

    def release(self) -> None:
        """End a :meth:`hold`; the last one drops at once the steps past ``max_steps``."""
        with self.lock:
            self._holds -= 1
            self._drop_excess()

    # ---------------------------------------------------------------- hooks
    def _add_row(self, request_id: str) -> _RequestRow:
        row = self._requests[request_id] = _RequestRow(self.engine.requests[request_id])
        self._request_rows[row] = None
        return row

    def _on_added(self, request_id: str, **_: Any) -> None:
        self._add_row(request_id)

    def _on_finished(self, request_id: str, finish_reason: str, output_token_ids: list[int], **_: Any) -> None:
        req = self._requests.get(request_id) or self._add_row(request_id)
        req.seq, req.output_len, req.finish_reason = None, len(output_token_ids), finish_reason
        # Its record is the next one appended, whatever ``step`` says (under async scheduling the
        # step scheduled next) and whichever steps scheduled nothing, so had no record, in between.
        self._finishing.append(req)

    def _on_scheduled(self, scheduler_output: "SchedulerOutput", request_ids: dict[int, str], **_: Any) -> None:
        self._launches.append((scheduler_output.step, num_events(self._pending), scheduler_output, request_ids))

    def _on_step_end(self, info: "StepInfo") -> None:
        out = info.scheduler_output
        bm = self.engine.block_manager
        rows, cols = out.requests, out.columns
        lens = cols.num_new_tokens
        prefill, cached = cols.is_prefill, cols.num_cached_tokens
        sched = self._step_rows(info) if self._blocks else None
        prefill_seqs = int(np.count_nonzero(prefill))
        prefill_tokens = int(lens[prefill].sum()) if prefill_seqs else 0
        admitted = np.flatnonzero(cols.start == cached).tolist()  # admissions: start right after the cached prefix
        hits = int(cached[admitted].sum()) if admitted else 0
        queries = self._queries(rows, admitted, info.request_ids) if bm.enable_prefix_caching else 0
        t = info.timings
        total = len(cols.token_ids)  # (every row's tokens, concatenated)
        rec = StepRecord(
            step=info.step, time_s=info.time_s, duration_s=info.duration_s,
            num_scheduled_tokens=total, num_prefill_tokens=prefill_tokens,
            num_decode_tokens=total - prefill_tokens, num_prefill_seqs=prefill_seqs,
            num_decode_seqs=len(out.requests) - prefill_seqs, token_budget=out.token_budget,
            num_requests_running=len(info.running), num_requests_waiting=len(info.waiting),
            num_preemptions=len(out.preempted_seq_ids), num_free_blocks=len(bm.free),
            num_used_blocks=len(bm.used),
            num_cached_blocks=bm.num_cached_blocks,
            kv_cache_usage_perc=len(bm.used) / bm.num_blocks,
            prefix_cache_queries=queries, prefix_cache_hits=hits, cuda_graph=bool(info.cuda_graph),
            schedule_s=t.get("schedule_s", _NAN), prepare_s=t.get("prepare_s", _NAN),
            forward_s=t.get("forward_s", _NAN), sample_s=t.get("sample_s", _NAN),
            postprocess_s=t.get("postprocess_s", _NAN),
        )
        if sched is not None:
            rec.scheduled = sched
            self._close_window(rec, info)
            last = self.records[-1] if self.records else None
            rec.running = _unchanged_or(info.running, last and last.running)
            rec.waiting = _unchanged_or(info.waiting, last and last.waiting)
            rec.finished = _unchanged_or(info.finished, last and last.finished)
            rec.preempted = _unchanged_or([info.request_ids[i] for i in out.preempted_seq_ids], last and last.preempted)
        if self._snapshots is not None:
            rec.pool = self._snapshots.take(self.engine)
        self._append(rec)

    def _call_listeners(self, info: "StepInfo") -> None:
        """Hand each listener the record of the step that just ended (none if it left the ring
        buffer already, or went unrecorded: a step stepped by a ``first`` hook of the user's).
        The search stops at the first older record: those after the step's own are of steps run
        inside its ``step.end``, so later ones.

        A listener's ``KeyboardInterrupt`` or ``SystemExit`` is a stop, not a fault: the other
        listeners still get the record, then the first one is raised, for the hook registry to
        hold as a Ctrl-C."""
        rec = next((r for r in reversed(self.records) if r.step <= info.step), None)
        if rec is None or rec.step != info.step:
            return
        stop: BaseException | None = None
        for key, (fn, _) in list(self._listeners.items()):
            try:
                fn(rec)
            except Exception:
                warn_detached(fn, "trace listener")
                self._listeners.pop(key, None)
            except BaseException as exc:
                if stop is None:
                    stop = exc
        if stop is not None:
            raise stop

    def _step_rows(self, info: "StepInfo") -> Scheduled:
        """Step n's rows: built once, when they were launched, in this
        record or (async) in the previous one. A step launched before the recording began is
        built now, and its tokens go into the baseline, which predates their write."""
        for step, _, out, request_ids in self._launches:
            if step == info.step:
                return self._scheduled(out, request_ids)
        ahead = self._ahead
        if ahead is not None and ahead.step == info.step:
            return ahead.rows
        out = info.scheduler_output
        # Its decode inputs were sampled by the step before the recording: each the token at its
        # row's start (-1 stays for a request aborted meanwhile).
        reqs, ids = self.engine.requests, info.request_ids
        sched = self._scheduled(out, ids, {r.seq_id: reqs[ids[r.seq_id]].token_ids[r.start]
                                                  for r in out.requests
                                                  if r.token_ids[-1] == PLACEHOLDER and ids[r.seq_id] in reqs})
        with self.lock:  # (only the first steps of a recording: the dense state is made again)
            base = self._dense_baseline()
            base.write(sched)
            self.baseline = base.sparse()
        return sched

    def _scheduled(self, out: "SchedulerOutput", request_ids: dict[int, str],
                   sampled: dict[int, int] | None = None) -> Scheduled:
        """The step's rows, told against the step encoded before; ``sampled`` fills its
        ``PLACEHOLDER`` inputs (see :func:`_filled`)."""
        cols = out.columns
        seq_ids, code = cols.seq_id, self._request_ids.code
        return self._rows.encode(
            seq_ids, lambda rows: [code(request_ids[s]) for s in seq_ids[rows].tolist()], cols.start,
            cols.num_new_tokens, cols.num_cached_tokens, cols.is_prefill, cols.sample,
            cols.token_ids if sampled is None else _filled(cols, sampled),
        )

    def _dense_baseline(self) -> PoolState:
        return self.baseline.expand() if isinstance(self.baseline, SparsePool) else self.baseline

    def _close_window(self, rec: StepRecord, info: "StepInfo") -> None:
        """Hand the record the rows launched in its window (its block events join the chunk in
        :meth:`_append`); under async scheduling those include step n+1's, whose decode inputs
        (sampled by step n) are known now."""
        step, sampled = info.step, info.sampled
        launches = []
        for launched, k, out, request_ids in self._launches:
            if launched == step:
                launches.append(Launch(step, k, rec.scheduled))
            elif launched > step:
                launches.append(Launch(launched, k, self._scheduled(out, request_ids, sampled)))
            # (an older launch failed and was rolled back: its events stay, as idle ones)
        self._launches.clear()
        rec.launches = tuple(launches)
        self._ahead = launches[-1] if launches and launches[-1].step > step else None
        if launches:
            rec.num_pre_forward_events = launches[-1].num_events_before
        else:  # nothing launched (the last step of an async run): idle events, then post-processing
            rec.num_pre_forward_events = num_events_until(self._pending, step)

    def _queries(self, rows: list, admitted: list[int], request_ids: dict[int, str]) -> int:
        """Tokens the step's admissions looked up: each whole sequence, its prompt and what it
        generated so far (a request aborted before the recording, with a step in flight, is unknown)."""
        reqs = self._requests
        total = 0
        for i in admitted:
            req = reqs.get(request_ids[rows[i].seq_id])
            if req is not None:
                total += req.prompt_len + rows[i].output_index
        return total

    def _append(self, rec: StepRecord) -> None:
        with self.lock:
            self.records.append(rec)
            self._finished.extend((rec.step, row) for row in self._finishing)
            self._finishing.clear()
            if self._blocks:  # the window's events join the chunk; packed when it is full or read
                events = self._pending
                self._chunk += events
                self._chunk_events += num_events(events)
                events.clear()
                self._unpacked.append((rec, self._chunk_events))
                if self._listeners_read_events() or len(self._unpacked) >= CHUNK_STEPS or self._chunk_events >= CHUNK_EVENTS:
                    self._pack_chunk()
            if self._drop_excess():
                self._renew_request_ids()

    def _drop_excess(self) -> bool:
        """Drop the oldest records past ``max_steps``, unless a reader holds them (with the lock
        held); whether any went."""
        if self._holds or len(self.records) <= self.max_steps:
            return False
        self._pack_chunk()  # (a dropped record's events move the baseline)
        while len(self.records) > self.max_steps:
            old = self.records.popleft()
            if self.baseline is not None:  # dense from the first drop on: one apply per step
                self.baseline = self._dense_baseline()
                self.baseline.apply(old)
            if old.pool is not None:
                self.records[0].pool = merge_keyframe(old.pool, self.records[0].pool)
            self.last_dropped_step = old.step
        oldest = self.records[0].step
        while self._finished and self._finished[0][0] < oldest:
            self._drop_row(self._finished.popleft()[1])
        return True

    def _renew_request_ids(self) -> None:
        """Code what comes next with a new request-id table once the current one names
        ``REQUEST_IDS_PER_TABLE`` ids and twice as many as the engine holds requests.

        A table only grows (the codes stored in packed records must stay valid), so one table for
        a whole live run would keep every request id the run ever saw. Each record keeps the table
        it was coded with, so an old table goes with the last retained record coded with it, and
        a ring buffer holds the ids of about its own steps. (Twice the engine's requests: those
        still live are coded again in each new table, and a bound below them would renew it at
        every step.) The next step's rows are a keyframe: rows are never told against a step coded
        with another table.
        """
        if len(self._request_ids.names) >= max(REQUEST_IDS_PER_TABLE, 2 * len(self.engine.requests)):
            self._new_request_ids()

    def _new_request_ids(self) -> None:
        """A new request-id table for new event logs and scheduled rows to be coded with (each
        record keeps the one it was coded with), and the encoder that tells each step's rows
        against the step before in it: its first step is a keyframe."""
        self._request_ids = RequestIds()
        self._rows = RowEncoder(RowTable(self._request_ids))

    def _drop_row(self, row: _RequestRow) -> None:
        """Forget the row of a request that finished before the oldest retained step."""
        self._request_rows.pop(row, None)
        if self._requests.get(row.request_id) is row:
            del self._requests[row.request_id]

    def _listeners_read_events(self) -> bool:
        """Whether a listener reads ``record.block_events``: then each record is packed before it is called."""
        return any(reads for _, reads in self._listeners.values())

    def _pack_chunk(self) -> None:
        """Give each waiting record its block events, packed for all of them in one call (a
        step's few events cost little beside a call's own work). With the lock held: by the
        engine's thread when the chunk is full, before a record leaves the ring buffer, or each
        step while a listener may read the record; by a reader (``view``) for the records so far."""
        if not self._unpacked:
            return
        logs = EventLog.pack(self._chunk, self._request_ids).split([end for _, end in self._unpacked])
        for (rec, _), log in zip(self._unpacked, logs):
            rec.block_events = log
        self._unpacked.clear()
        self._chunk.clear()
        self._chunk_events = 0


def _unchanged_or(queue: list[str], last: list[str] | None) -> list[str]:
    """The previous record's list when ``queue`` equals it (records never change their queues):
    a long decode keeps one running queue for many steps, and it is then held once."""
    return last if last is not None and last == queue else queue


def _filled(cols: "StepColumns", sampled: dict[int, int]) -> np.ndarray:
    """The step's token ids with the real ids in place of ``PLACEHOLDER`` inputs (decode rows
    launched before the previous step's tokens came back), from ``sampled`` (seq id -> token:
    what that step sampled): a decode batch has one per row."""
    tokens = cols.token_ids
    at = np.flatnonzero(tokens == PLACEHOLDER)
    if not len(at) or not sampled:
        return tokens
    seqs = cols.seq_id
    if len(tokens) != len(seqs):  # several tokens in some row: find each placeholder's row
        seqs = seqs[np.searchsorted(np.cumsum(cols.num_new_tokens), at, side="right")]
    elif len(at) != len(seqs):  # (one token per row: a token's index is its row's)
        seqs = seqs[at]
    # (a row whose step failed for it sampled nothing: it stays -1)
    filled = np.fromiter(map(sampled.get, seqs.tolist(), itertools.repeat(PLACEHOLDER)), dtype=tokens.dtype,
                         count=len(at))
    if len(at) == len(tokens):  # every input was one (a decode batch)
        return filled
    tokens = tokens.copy()  # (the step's columns are the runner's too)
    tokens[at] = filled
    return tokens
