"""Each request's life across steps, as state intervals: the data of ``Trace.lifecycle``.

Derived from what every ``blocks``-level record holds: the scheduled rows (prefill chunk or
decode, tokens, prefix-cache hit at admission), the queues after the step, and the requests
preempted and finished in it. A request that leaves every queue without finishing was
aborted.

The table is what a reading of the retained records from the oldest gives. A live trace must
not read them all again at each look, with thousands of requests waiting: the builder follows
the ring buffer instead. A new step costs the requests it changes (a waiting request's row goes
on by itself), and dropping the oldest step undoes only what a reading that began with it knew
and one that begins after it does not: the step's rows and tokens, the preemptions and ends
in it, and the rows of the requests gone in the step after it.
"""
from __future__ import annotations

import bisect
from collections import deque
from itertools import chain
from operator import attrgetter
from typing import NamedTuple, Sequence

from kvscope.trace.record import Scheduled, StepRecord

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
_CLOSING = ("finished", "aborted")
# What a reading that begins after a preemption calls the states that preemption gave.
_UNPREEMPTED = {"preempted": "waiting", "recompute": "prefill"}
_STEP = attrgetter("step")


class _Row:
    """A row of the table, its steps as record numbers (``end`` None while open). ``pos``: the
    request's place in the record where the row starts, among the requests first seen there
    (a closing row: its place among the record's finished ones)."""

    __slots__ = ("state", "start", "end", "tokens", "cached", "pos")

    def __init__(self, state: str, start: int, end: int | None, tokens: int, cached: int, pos: tuple) -> None:
        self.state, self.start, self.end, self.tokens, self.cached, self.pos = state, start, end, tokens, cached, pos


class _Zone:
    """The steps one preemption labels: from the one after it until the request decodes, is
    preempted again (``end``, not labelled by it) or ends (``end``, labelled: ``labels_end``)."""

    __slots__ = ("rid", "start", "end", "labels_end")

    def __init__(self, rid: str, start: int) -> None:
        self.rid, self.start, self.end, self.labels_end = rid, start, None, False


class _Held(NamedTuple):
    """What the table reads of a record: held instead of it, so that a dropped record's block
    events and pool are not kept alive until the next read."""

    step: int
    time_s: float
    duration_s: float
    scheduled: Scheduled
    running: list[str]
    waiting: list[str]
    preempted: list[str]
    finished: list[str]


class LifecycleBuilder:
    """Follows a trace's retained records, in order, as lifecycle rows (see ``docs/TRACE_API.md``)."""

    def __init__(self) -> None:
        self._recs: deque[_Held] = deque()
        self._base = 0  # the number of the oldest record held (records are numbered as added)
        self._lanes: dict[str, list[_Row]] = {}  # request id -> its rows, by step
        self._open: dict[str, _Row] = {}
        self._quiet: set[str] = set()  # waiting and left alone: the open row goes on by itself
        self._busy: set[str] = set()  # the other open rows' ids
        self._ending: dict[int, list[tuple[str, _Row]]] = {}  # record -> the closed rows ending in it
        # Finished or aborted, with the record its life ended in: no state after that, until the
        # id is queued again (a request id is free once its final output is out).
        self._ended: dict[str, int] = {}
        self._ends: dict[int, list[str]] = {}  # record -> the requests that ended in it
        # (request, record it ended in) -> the later records whose scheduled row of it that end hid
        self._hidden: dict[tuple[str, int], list[int]] = {}
        self._zones: dict[str, _Zone] = {}  # preempted, and not decoding again yet
        self._zones_from: dict[int, list[_Zone]] = {}  # record -> the preemptions in it
        self._launched: set[int] = set()  # the steps the last record launched
        self._waiting: tuple[list[str] | None, set[str]] = (None, set())  # the last waiting queue, as a set
        self._first_places: tuple[int, dict[str, tuple]] = (-1, {})

    # ------------------------------------------------------------ following
    def follows(self, records: Sequence[StepRecord]) -> bool:
        """Whether ``records`` (a trace's retained ones) continue what the builder holds: some
        dropped from its start, some added at its end."""
        if not self._recs:
            return True
        return bool(records) and self._recs[0].step <= records[0].step <= self._recs[-1].step <= records[-1].step

    def follow(self, records: Sequence[StepRecord]) -> None:
        """Take in the records after the last one held and drop those before ``records[0]``."""
        last = self._recs[-1].step if self._recs else None
        for rec in records[bisect.bisect_right(records, last, key=_STEP) if last is not None else 0:]:
            self.add(rec)
        while records and self._recs[0].step < records[0].step:
            self._drop()

    # ------------------------------------------------------------ a new step
    def add(self, rec: StepRecord) -> None:
        """Take in the next recorded step."""
        seq = self._base + len(self._recs)
        self._recs.append(_Held(rec.step, rec.time_s, rec.duration_s, rec.scheduled, rec.running, rec.waiting,
                                rec.preempted, rec.finished))
        waiting = rec.waiting
        wset = self._waiting[1] if waiting is self._waiting[0] else set(waiting)
        self._waiting = (waiting, wset)
        queued = (wset, set(rec.running))
        moved = wset ^ self._quiet  # queued but not left alone, or left alone and no longer waiting
        now = self._states(rec, seq, queued, moved)
        for rid, (state, n, cached, place) in now.items():
            row = self._open.get(rid)
            if row is not None:
                if row.state == state:
                    row.tokens, row.cached = row.tokens + n, row.cached + cached
                    continue
                self._close(rid, seq - 1)
            self._open[rid] = row = _Row(state, seq, None, n, cached, place)
            self._lanes.setdefault(rid, []).append(row)
        for i, rid in enumerate(rec.finished):  # scheduled in its last step, then gone
            if rid in self._open:
                self._close(rid, seq if rid in now or _queued(rid, queued) else seq - 1)
            self._end(rid, _Row("finished", seq, seq, 0, 0, (i,)))
        # gone without finishing: aborted between steps
        for rid in [r for r in chain(self._busy, moved) if r in self._open and r not in now and r not in wset]:
            self._close(rid, seq - 1)
            self._end(rid, _Row("aborted", seq, seq, 0, 0, (0,)))
        self._busy = {r for r in now if r in self._open and r not in self._quiet}
        self._launched = {launch.step for launch in rec.launches}

    def _states(self, rec: StepRecord, seq: int, queued: tuple[set[str], set[str]],
                moved: set[str]) -> dict[str, list]:
        """The state in ``rec`` of each request whose row may change: request id -> [state,
        tokens, cached tokens, its place in the record]. A waiting one left alone is not there."""
        wset, rset = queued
        # Under async scheduling a row may belong to a request that ended after it was launched
        # (it finished in the step before, or was aborted): only a live request's row counts.
        # An ended id queued again is a new request's; a row launched before the old one ended
        # (in the record before) is still the old one's.
        ended = self._ended
        old = {r for r in self._ends.get(seq - 1, ()) if ended.get(r) == seq - 1} \
            if rec.step in self._launched else set()
        for rid in chain(moved, rec.running):
            if rid in ended and _queued(rid, queued):
                del ended[rid]
        # Under async scheduling step n+1's scheduling may preempt a request that step n's
        # post-processing then finishes: the preemption lands in a later record than the finish
        # (one a ring buffer may have dropped), and the request is in no queue.
        preempted = {r for r in rec.preempted if _queued(r, queued)}
        finished = set(rec.finished)
        now: dict[str, list] = {}
        sched = rec.scheduled
        for i, (rid, prefill, start, n, cached) in enumerate(zip(
                sched.request_ids, sched.is_prefill.tolist(), sched.start.tolist(),
                sched.num_new_tokens.tolist(), sched.num_cached_tokens.tolist())):
            if not _queued(rid, queued) and rid not in finished:
                continue
            if rid in old or rid in ended:  # hidden while that end is in the trace
                self._hidden.setdefault((rid, seq - 1 if rid in old else ended[rid]), []).append(seq)
                continue
            if prefill:
                state = "recompute" if rid in self._zones else "prefill"
            else:
                state = "decode"
                self._end_zone(rid, seq, labels_end=False)
            # an admission starts right after its cached prefix; later chunks carry no hit
            now[rid] = [state, n, cached if start == cached else 0, (0, i)]
        for i, rid in enumerate(rec.preempted):
            if rid in preempted:
                now[rid] = ["preempted", 0, 0, now[rid][3] if rid in now else (1, i)]
                self._end_zone(rid, seq, labels_end=False)
                zone = self._zones[rid] = _Zone(rid, seq)
                self._zones_from.setdefault(seq, []).append(zone)
        entered = [r for r in moved if r in wset and r not in now]
        places = _places(rec.waiting, {r for r in entered if r not in self._open})
        for rid in entered:
            now[rid] = ["preempted" if rid in self._zones else "waiting", 0, 0, (2, places.get(rid))]
        for i, rid in enumerate(rec.running):
            if rid not in now:
                now[rid] = ["idle", 0, 0, (3, i)]
        self._quiet.difference_update(now)
        self._quiet.update(entered)
        return now

    def _close(self, rid: str, end: int) -> None:
        row = self._open.pop(rid)
        row.end = end
        self._ending.setdefault(end, []).append((rid, row))

    def _end(self, rid: str, row: _Row) -> None:
        """``rid``'s life ends in record ``row.start`` with the closing ``row``."""
        seq = row.start
        self._end_zone(rid, seq, labels_end=True)
        self._ended[rid] = seq
        self._ends.setdefault(seq, []).append(rid)
        self._lanes.setdefault(rid, []).append(row)
        self._ending.setdefault(seq, []).append((rid, row))
        self._quiet.discard(rid)
        self._busy.discard(rid)

    def _end_zone(self, rid: str, seq: int, labels_end: bool) -> None:
        zone = self._zones.pop(rid, None)
        if zone is not None:
            zone.end, zone.labels_end = seq, labels_end

    # ------------------------------------------------------- the oldest step
    def _drop(self) -> None:
        """Forget the oldest record: leave what a reading from the next one gives."""
        i = self._base
        rec = self._recs.popleft()
        self._base = i + 1
        for rid, row in self._ending.pop(i, ()):
            self._remove(rid, row)
        # The tokens the step computed for requests that go on (a reading from it counted each
        # queued one's, but a preempted one's or a finished one's).
        counted = set(rec.waiting).union(rec.running).difference(rec.preempted, rec.finished)
        sched = rec.scheduled
        for rid, start, n, cached in zip(sched.request_ids, sched.start.tolist(), sched.num_new_tokens.tolist(),
                                         sched.num_cached_tokens.tolist()):
            row = self._lanes[rid][0] if rid in counted and rid in self._lanes else None
            if row is not None and row.start <= i:
                row.tokens, row.cached = row.tokens - n, row.cached - (cached if start == cached else 0)
        # A reading from the next record finds nothing open in it, so nothing aborted in it.
        ending = self._ending.get(i + 1, [])
        for rid, row in [e for e in ending if e[1].state == "aborted"]:
            self._remove(rid, row)
            ending.remove((rid, row))
            self._unend(rid, i + 1)
        for rid in self._ends.pop(i, ()):
            self._unend(rid, i)
        for zone in self._zones_from.pop(i, ()):
            self._unpreempt(zone)

    def _remove(self, rid: str, row: _Row) -> None:
        lane = self._lanes[rid]
        lane.remove(row)
        if not lane:
            del self._lanes[rid]

    def _unend(self, rid: str, seq: int) -> None:
        """Forget that ``rid`` ended in record ``seq``: show the rows of it that end hid."""
        if self._ended.get(rid) == seq:
            del self._ended[rid]
        for j in self._hidden.pop((rid, seq), ()):
            self._reveal(rid, j)

    def _reveal(self, rid: str, j: int) -> None:
        """``rid``'s scheduled row of record ``j`` counts: it was queued again just then (its
        waiting or idle row starts there; a preemption there keeps it so) or finished there."""
        rec = self._recs[j - self._base]
        sched = rec.scheduled
        k = sched.request_ids.index(rid)
        start, n, cached = int(sched.start[k]), int(sched.num_new_tokens[k]), int(sched.num_cached_tokens[k])
        row = _Row("prefill" if sched.is_prefill[k] else "decode", j, j, n, cached if start == cached else 0, (0, k))
        lane = self._lanes.setdefault(rid, [])
        at = next((x for x, r in enumerate(lane) if r.end is None or r.end >= j), len(lane))
        there = lane[at] if at < len(lane) and lane[at].start == j and lane[at].state not in _CLOSING else None
        if there is None:  # finished in j, never queued
            lane.insert(at, row)
            self._ending.setdefault(j, []).append((rid, row))
        elif rid in rec.preempted:
            there.pos = row.pos
        elif there.end == j:
            there.state, there.tokens, there.cached, there.pos = row.state, row.tokens, row.cached, row.pos
            after = lane[at + 1] if at + 1 < len(lane) else None
            if after is not None and after.state == there.state:  # now one interval
                after.start, after.tokens, after.cached, after.pos = j, after.tokens + there.tokens, \
                    after.cached + there.cached, there.pos
                self._ending[j].remove((rid, there))
                lane.pop(at)
        elif there.end is None and j == self._base + len(self._recs) - 1:  # the open row is this one
            there.state, there.tokens, there.cached, there.pos = row.state, row.tokens, row.cached, row.pos
            self._quiet.discard(rid)
            self._busy.add(rid)
        else:
            there.start = j + 1
            lane.insert(at, row)
            self._ending.setdefault(j, []).append((rid, row))

    def _unpreempt(self, zone: _Zone) -> None:
        """Label the steps of ``zone`` as a reading that begins after its preemption does."""
        rid = zone.rid
        if self._zones.get(rid) is zone:
            del self._zones[rid]
        last = self._base + len(self._recs) - 1
        hi = last if zone.end is None else zone.end if zone.labels_end else zone.end - 1
        lane = self._lanes.get(rid, []) if hi >= self._base else []
        for at, row in enumerate(list(lane)):
            if row.start > hi:
                break
            new = _UNPREEMPTED.get(row.state)
            if new is None:
                continue
            if (last if row.end is None else row.end) > hi:  # preempted again at its end, still waiting
                head = _Row(new, row.start, hi, 0, 0, row.pos)
                row.start = hi + 1
                lane.insert(lane.index(row), head)
                self._ending.setdefault(hi, []).append((rid, head))
            else:
                row.state = new

    # --------------------------------------------------------------- reading
    def rows(self) -> list[tuple]:
        """Every row, the open ones as they stand: requests in the order a reading from the oldest
        record first saw them, each one's rows by start step (its closing row last)."""
        recs, base = self._recs, self._base
        if not recs:
            return []
        last = base + len(recs) - 1
        first = self._first_record_places()
        keyed = []
        for rid, lane in self._lanes.items():
            body = next((r for r in lane if r.state not in _CLOSING), None)
            order = (-1,) if body is None else (base, *first[rid]) if body.start <= base else (body.start, *body.pos)
            for row in lane:
                s = max(row.start, base)
                rec = recs[s - base]
                if row.state in _CLOSING:
                    t = rec.time_s + rec.duration_s if row.state == "finished" else rec.time_s
                    keyed.append(((order, s, True, row.pos), (rid, row.state, rec.step, rec.step, 0, t, t, 0, 0)))
                    continue
                e = last if row.end is None else row.end
                end = recs[e - base]
                keyed.append(((order, s, False, ()), (rid, row.state, rec.step, end.step, e - s + 1, rec.time_s,
                                                      end.time_s + end.duration_s, row.tokens, row.cached)))
        keyed.sort(key=lambda k: k[0])
        return [r for _, r in keyed]

    def _first_record_places(self) -> dict[str, tuple]:
        """Each request's place in the oldest record, as a reading from it first saw them: the
        scheduled ones (but one in no queue and not finished), the preempted, waiting, running."""
        if self._first_places[0] == self._base:
            return self._first_places[1]
        rec = self._recs[0]
        queued = set(rec.waiting).union(rec.running)
        places: dict[str, tuple] = {}
        for group, (ids, keep) in enumerate(((rec.scheduled.request_ids, queued.union(rec.finished)),
                                             (rec.preempted, queued), (rec.waiting, None), (rec.running, None))):
            for i, rid in enumerate(ids):
                if keep is None or rid in keep:
                    places.setdefault(rid, (group, i))
        self._first_places = (self._base, places)
        return places


def _queued(rid: str, queued: tuple[set[str], set[str]]) -> bool:
    return rid in queued[0] or rid in queued[1]


def _places(items: list[str], wanted: set[str]) -> dict[str, int]:
    """Where ``wanted`` are in ``items``, looked for from the end (new requests queue there)."""
    found: dict[str, int] = {}
    for i in range(len(items) - 1, -1, -1):
        if len(found) == len(wanted):
            break
        if items[i] in wanted:
            found[items[i]] = i
    return found
