"""The reference of ``Trace.lifecycle``: the builder kvscope had before its table followed the
ring buffer (kvscope/trace/lifecycle.py at 3b41ac8, less its shortcut for steady decode steps).
Read over a trace's retained records from scratch, it gives the table a live trace must show
after every step."""
from __future__ import annotations

from typing import Sequence

import pandas as pd

from kvscope.trace.record import StepRecord
from kvscope.trace.tables import frame


def reference_table(records: Sequence[StepRecord]) -> pd.DataFrame:
    """``Trace.lifecycle`` of ``records``, read from the first."""
    builder = ReferenceBuilder()
    for rec in records:
        builder.add(rec)
    return frame("lifecycle", builder.rows())

# A row of ``Trace.lifecycle`` while it is open: [state, start_step, end_step, num_steps,
# start_time, end_time, num_tokens, num_cached_tokens].
Row = list


class ReferenceBuilder:
    """Turns step records, in order, into lifecycle rows (see ``docs/TRACE_API.md``)."""

    def __init__(self) -> None:
        self.closed: list[tuple] = []
        self._open: dict[str, Row] = {}
        self._preempted: set[str] = set()  # preempted, and not decoding again yet
        # Finished or aborted, with the step of the record its life ended in: no state after that,
        # until the id is queued again (a request id is free once its final output is out).
        self._ended: dict[str, int] = {}
        self._order: dict[str, int] = {}  # request id -> when first seen
        self.first_step: int | None = None
        self.last_step: int | None = None
        self._launched: set[int] = set()  # the steps the last record launched

    def add(self, rec: StepRecord) -> None:
        """Take in the next recorded step."""
        if self.first_step is None:
            self.first_step = rec.step
        self._add(rec)
        self._launched = {launch.step for launch in rec.launches}
        self.last_step = rec.step

    def _add(self, rec: StepRecord) -> None:
        """Any step: each request's state now, then its rows opened, extended or closed."""
        now: dict[str, tuple[str, int, int]] = {}  # request id -> (state, tokens, cached tokens)
        sched = rec.scheduled
        # Under async scheduling a row may belong to a request that ended after it was launched
        # (it finished in the step before, or was aborted): only a live request's row counts.
        # An ended id queued again is a new request's; a row launched before the old one ended
        # (in the record before) is still the old one's.
        ahead = rec.step in self._launched
        old = {rid for rid, step in self._ended.items() if ahead and step == self.last_step}
        queued = {*rec.running, *rec.waiting}
        for rid in self._ended.keys() & queued:
            del self._ended[rid]
        live = (queued | {*rec.finished}) - self._ended.keys() - old
        for rid, prefill, start, n, cached in zip(
                sched.request_ids, sched.is_prefill.tolist(), sched.start.tolist(),
                sched.num_new_tokens.tolist(), sched.num_cached_tokens.tolist()):
            if rid not in live:
                continue
            if prefill:
                state = "recompute" if rid in self._preempted else "prefill"
            else:
                state = "decode"
                self._preempted.discard(rid)
            # an admission starts right after its cached prefix; later chunks carry no hit
            now[rid] = (state, n, cached if start == cached else 0)
        # Under async scheduling step n+1's scheduling may preempt a request that step n's
        # post-processing then finishes: the preemption lands in a later record than the finish
        # (one a ring buffer may have dropped), and the request is in no queue.
        for rid in (r for r in rec.preempted if r in queued):
            now[rid] = ("preempted", 0, 0)
            self._preempted.add(rid)
        for rid in rec.waiting:
            now.setdefault(rid, ("preempted" if rid in self._preempted else "waiting", 0, 0))
        for rid in rec.running:
            now.setdefault(rid, ("idle", 0, 0))
        start, end = rec.time_s, rec.time_s + rec.duration_s
        for rid in now:
            self._order.setdefault(rid, len(self._order))
        for rid, (state, n, cached) in now.items():
            row = self._open.get(rid)
            if row is not None and row[0] == state and row[2] == self.last_step:
                row[2], row[3], row[5], row[6], row[7] = rec.step, row[3] + 1, end, row[6] + n, row[7] + cached
                continue
            if row is not None:
                self._close(rid)
            self._open[rid] = [state, rec.step, rec.step, 1, start, end, n, cached]
        for rid in rec.finished:  # scheduled in its last step, then gone
            if rid in self._open:
                self._close(rid)
            self._preempted.discard(rid)
            self._ended[rid] = rec.step
            self.closed.append((rid, "finished", rec.step, rec.step, 0, end, end, 0, 0))
            now.pop(rid, None)
        for rid in [r for r in self._open if r not in now]:  # gone without finishing: aborted between steps
            self._close(rid)
            self._preempted.discard(rid)
            self._ended[rid] = rec.step
            self.closed.append((rid, "aborted", rec.step, rec.step, 0, start, start, 0, 0))

    def rows(self) -> list[tuple]:
        """Every row so far, the open ones as they stand: requests in the order they were first
        seen, each one's rows by start step (its closing row last)."""
        rows = self.closed + [(rid, *row) for rid, row in self._open.items()]
        order = self._order
        return sorted(rows, key=lambda r: (order.get(r[0], -1), r[2], r[4] == 0))

    def _close(self, rid: str) -> None:
        self.closed.append((rid, *self._open.pop(rid)))
