"""Each request's life across steps, as state intervals: the data of ``Trace.lifecycle``.

Derived from what every ``blocks``-level record holds: the scheduled rows (prefill chunk or
decode, tokens, prefix-cache hit at admission), the queues after the step, and the requests
preempted and finished in it. A request that leaves every queue without finishing was
aborted. The builder takes records one at a time, so a live view pays for new steps only.
"""
from __future__ import annotations

from itertools import chain, repeat

from kvscope.trace.record import StepRecord

# Per step a request is in exactly one of these (the last two close its life: zero-length rows).
LIFECYCLE_STATES: tuple[str, ...] = (
    "waiting",    # queued, not yet scheduled
    "prefill",    # computing its prompt (a chunk per step)
    "recompute",  # computing again what a preemption dropped
    "decode",     # one token per step
    "preempted",  # its KV freed; waiting to be recomputed
    "idle",       # running but not scheduled this step (e.g. prefill_first's prefill steps)
    "finished",
    "aborted",
)

# A row of ``Trace.lifecycle`` while it is open: [state, start_step, end_step, num_steps,
# start_time, end_time, num_tokens, num_cached_tokens].
Row = list


class LifecycleBuilder:
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
        self._queues: tuple[list[str] | None, list[str] | None] = (None, None)  # the last record's
        self._launched: set[int] = set()  # the steps the last record launched

    def add(self, rec: StepRecord) -> None:
        """Take in the next recorded step."""
        if self.first_step is None:
            self.first_step = rec.step
        if not self._extend_steady(rec):
            self._add(rec)
        self._queues = (rec.running, rec.waiting)
        self._launched = {launch.step for launch in rec.launches}
        self.last_step = rec.step

    def _extend_steady(self, rec: StepRecord) -> bool:
        """A step of steady decode: every open row goes on one step, and no row opens or closes.

        That is the case when the queues are the last record's own lists (a recording shares an
        unchanged queue), nothing finished or was preempted, every running request decoded and
        its row is a decode row up to the last step, and every waiting one's row goes on too.
        Returns False, changing nothing, when any of it does not hold.
        """
        running, waiting = rec.running, rec.waiting
        sched = rec.scheduled
        if (running is not self._queues[0] or waiting is not self._queues[1] or rec.finished
                or rec.preempted or sched.request_ids != running or sched.is_prefill.any()
                or len(self._open) != len(running) + len(waiting)):
            return False
        rows, last, preempted = self._open, self.last_step, self._preempted
        for rid, state in chain(zip(running, repeat("decode")), (
                (r, "preempted" if r in preempted else "waiting") for r in waiting)):
            row = rows.get(rid)
            if row is None or row[0] != state or row[2] != last:
                return False
        end = rec.time_s + rec.duration_s
        for rid, start, n, cached in zip(running, sched.start.tolist(), sched.num_new_tokens.tolist(),
                                         sched.num_cached_tokens.tolist()):
            row = rows[rid]
            row[2], row[3], row[5] = rec.step, row[3] + 1, end
            row[6], row[7] = row[6] + n, row[7] + (cached if start == cached else 0)
        for rid in waiting:
            row = rows[rid]
            row[2], row[3], row[5] = rec.step, row[3] + 1, end
        return True

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
