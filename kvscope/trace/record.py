"""``StepRecord``: everything one engine step decided, as recorded by a :class:`Recorder`.

The summary fields (one ``trace.steps`` row) are always present. ``blocks`` level adds what was
scheduled per request, the queues and the block events; ``full`` adds the pool as read from the
block manager after the step (stored as the change since the previous step).

A record covers the engine's work between two ``step.end`` calls, so replaying records through
step n gives the block manager's state at step n's ``step.end``. Its :class:`Launch` es say where
in its block events rows were launched (their K/V written). Synchronously that is step n's rows;
under async scheduling the window holds step n+1's scheduling and launch before step n's
post-processing, so it launches step n+1 (and step n too when the engine had nothing in flight)
(docs/ARCHITECTURE.md, "Async scheduling and the trace").

Block tables and slot mappings are not copied per step: a table only ever changes through
block events (allocate / share / reuse append, free drops), so :class:`~kvscope.trace.Trace`
rebuilds the tables of any step from the events, and the slot mapping from the tables and the
scheduled rows. That keeps recording O(events) instead of O(blocks in all tables).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from kvscope.trace.event_log import EventLog
from kvscope.trace.events import IDLE, POSTPROCESS, SCHEDULE
from kvscope.trace.scheduled import Scheduled

__all__ = ["Launch", "PoolDelta", "Scheduled", "StepRecord", "PHASES", "STEP_COLUMNS"]


class Launch(NamedTuple):
    """Rows launched inside a record: after ``num_events_before`` of its block events."""

    step: int
    num_events_before: int
    rows: Scheduled


class PoolDelta(NamedTuple):
    """The pool after a step (``full`` level), as what changed since the previous step.

    ``block_ids`` are the blocks whose ``ref_count`` or ``block_hash`` changed, with their new
    values; the oldest record a trace keeps lists every block (a keyframe). ``last_blocks`` and
    ``last_counts`` give each live table's last block and the tokens in it; every other used or
    cached block is full. Read from the block manager, never from the block events.
    """

    block_ids: np.ndarray    # int32
    ref_count: np.ndarray    # int32
    block_hash: np.ndarray   # int64, -1 for none
    last_blocks: np.ndarray  # int32
    last_counts: np.ndarray  # int32


@dataclass(slots=True)
class StepRecord:
    step: int
    time_s: float           # perf_counter at the start of the step
    duration_s: float
    num_scheduled_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_prefill_seqs: int
    num_decode_seqs: int
    token_budget: int
    num_requests_running: int
    num_requests_waiting: int
    num_preemptions: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int  # free blocks whose content is still in the prefix cache
    kv_cache_usage_perc: float  # used / num_blocks, a fraction as in vLLM's gauge
    prefix_cache_queries: int   # tokens looked up by this step's admissions
    prefix_cache_hits: int      # of which found in the cache
    cuda_graph: bool
    schedule_s: float
    prepare_s: float
    forward_s: float
    sample_s: float
    postprocess_s: float
    # ``blocks`` and ``full`` levels
    scheduled: Scheduled | None = None
    block_events: EventLog | None = None
    num_pre_forward_events: int = 0  # block_events[:n] came before the last launch (after it: post-processing)
    launches: tuple[Launch, ...] = ()  # step's own, and/or step + 1's (async); none at the end of an async run
    running: list[str] | None = None  # queues after the step, head first
    waiting: list[str] | None = None
    preempted: list[str] | None = None
    finished: list[str] | None = None
    # ``full`` level
    pool: PoolDelta | None = field(default=None)

    def event_phases(self) -> tuple[np.ndarray, np.ndarray]:
        """Per block event, its phase (an index into ``PHASES``) and the step whose scheduling
        (``schedule``) or post-processing (``postprocess``) fired it, -1 for ``idle`` events."""
        events = self.block_events
        n = len(events) if events is not None else 0
        i = np.arange(n)
        launches = self.launches
        post = i >= self.num_pre_forward_events
        idle = ~post
        if launches:
            idle &= events.column("engine_step") < launches[0].step
        bounds = np.array([launch.num_events_before for launch in launches], np.int64)
        steps = np.array([launch.step for launch in launches] + [-1], np.int64)  # (-1: never read)
        scheduled = steps[np.searchsorted(bounds, i, side="right")]
        scheduled[post], scheduled[idle] = self.step, -1
        phase = np.full(n, PHASES.index(SCHEDULE), np.int8)
        phase[post], phase[idle] = PHASES.index(POSTPROCESS), PHASES.index(IDLE)
        return phase, scheduled

    def launched(self, step: int) -> Launch | None:
        return next((launch for launch in self.launches if launch.step == step), None)


PHASES: tuple[str, ...] = (IDLE, SCHEDULE, POSTPROCESS)  # the codes of StepRecord.event_phases
_FIELDS = tuple(StepRecord.__dataclass_fields__)
STEP_COLUMNS: tuple[str, ...] = _FIELDS[: _FIELDS.index("postprocess_s") + 1]  # one trace.steps row
