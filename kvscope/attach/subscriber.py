"""The SUB side: one socket per publisher, sequence tracking, and gap recovery through replay.

A background thread polls every publisher's SUB socket. Each message's 8-byte sequence number
is checked against the next one expected from that publisher:

- a skip (the publisher's high-water mark dropped batches, or the network did) asks the
  publisher's ROUTER replay socket for the missing range: a DEALER sends ``[b"", start_seq]``
  and reads ``[b"", seq, payload]`` replies until ``seq == -1``. What replay cannot return is
  counted as lost;
- a sequence number at or below the last live one means the publisher restarted (a new
  process counts from 0): its cache started empty, so the rebuilt one is cleared;
- the first message from a publisher that started before we connected asks replay for
  everything it still buffers, so a late subscriber sees the blocks stored before it joined;
- a publisher that has gone quiet is asked once a second for anything after the last batch
  applied, since a dropped *last* batch leaves no later sequence number to reveal the gap. Nothing
  live bounds that answer, so each batch it brings is checked against the live one of the same
  number when that comes: one that differs means the replay socket is not this publisher's (or
  ran ahead of it), and the stream starts over as after a restart;
- a replayed batch stamped with another ``data_parallel_rank`` than the live batches comes from
  another rank's replay socket (each rank binds its own, on port + rank): that answer is dropped
  before it applies anything more, the replay counted a mismatch. Replicas of one deployment all
  stamp rank 0 (or none), and nothing else in vLLM's batches names the publisher, so a replica's
  replay socket given for another's shows only through the live batches it contradicts;
- after the connection dropped (a socket monitor reports it, and that ZMQ reconnects), the
  publisher may be a new process whose numbers happen to continue past ours, so the next message
  starts over: the rebuilt cache is cleared and refilled from what replay still buffers;
- a message over ``max_message_bytes`` is refused by ZMQ at its header, before it is read, and
  ZMQ then drops the connection for good: the monitor reports the drop without the retry that
  follows any other at once, so the subscriber connects again itself, and the batches it missed
  meanwhile come back through replay like any gap (without a replay socket they are lost). A replay answer cut short the same way is asked
  for again, past the batch that cannot come through.

A replay never blocks the thread: it runs as a task of its stream (a generator resumed when its
replay socket has something or its deadline passes), so a replay socket that is dead, mute or
drops requests delays only the stream that asked it, by at most ``replay_timeout`` per replay. A
gap's replay holds back that stream's later live batches until it is over (they must apply after
it): once its answer has brought or passed the gap's last batch, or ended, or once an attempt to
connect to the replay address fails (refused, or its host name does not resolve); only a replay
socket that says nothing is waited for until the timeout. An idle probe gives way to the stream's
next live batch, whose own numbers then show any gap. The other streams keep being read
meanwhile, and ``close()`` ends the thread within one poll (:data:`_POLL_MS`), plus what a
listener running at that moment takes (waited for :data:`_CLOSE_WAIT_S` at most).

Nothing here raises into the caller: every fault is a counter (:data:`FAULTS`).
"""
from __future__ import annotations

import math
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Generator

from kvscope.attach._deps import require
from kvscope.attach.wire import END_SEQ, Batch, Codec, WireError, seq_bytes, split_frames

FAULTS: tuple[str, ...] = (
    "bad_msgpack",        # a payload that is not a msgpack KVEventBatch (the batch is skipped)
    "unknown_tag",        # an event tagged other than BlockStored / BlockRemoved / AllBlocksCleared, or mistyped
    "missing_frames",     # a message without exactly [topic, 8-byte seq, payload]
    "oversize_messages",  # a live message over max_message_bytes: refused unread, the connection made again
    "gaps",               # sequence skips seen on the live socket
    "missed_batches",     # batches those skips left out
    "replayed_batches",   # batches recovered through the replay socket
    "lost_batches",       # batches neither received nor replayed
    "duplicate_batches",  # live batches already applied from a replay
    "publisher_restarts", # the sequence went back: the publisher restarted
    "replay_mismatches",  # a live batch differs from the one the idle probe's replay gave under its number,
                          # or a replayed batch is stamped with another data-parallel rank than the live ones
    "reconnects",         # the connection dropped and came back: the cache was rebuilt from replay
)

_POLL_MS = 100  # the longest the thread waits on its sockets before it checks for close()
_CLOSE_WAIT_S = 2.0  # how long close() waits for a listener to return (the thread then closes its sockets itself)
_RETRY_WAIT_MS = 50  # ZMQ reports its retry right after any drop it will reconnect from
_DROP_GRACE_MS = 20  # replies read before a drop reach the socket just after ZMQ reports the drop
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20  # far above a vLLM batch (a step's blocks and token ids)


@dataclass
class Stream:
    """One publisher (an instance, or one data-parallel rank of it) and what was read from it."""

    instance: str
    data_parallel_rank: int
    endpoint: str
    replay_endpoint: str | None
    name: str = ""  # how tables and views label it: the instance, plus "/dp<r>" if it has several ranks
    faults: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FAULTS, 0))
    next_seq: int | None = None  # the next sequence number to apply
    last_live: int | None = None  # the last sequence number read from the SUB socket
    # hash() of each payload the idle probe applied past last_live (last_live + 1 .. next_seq - 1), None
    # for one it skipped: only replay vouches for them until the live socket brings the same numbers
    ahead: deque[int | None] = field(default_factory=deque)
    disconnected: bool = False
    live_rank: int | None = None  # the data_parallel_rank the live batches carry
    heard: float = 0.0  # time.monotonic() of the last message (or tail probe)
    # the replay in progress, as a task (see Subscriber._start); while it runs the live socket waits,
    # unless the task is an idle probe, which a live batch cancels
    task: Generator[float, None, Any] | None = None
    wake: float = math.inf  # when the task's deadline passes: it is resumed then if nothing came before
    probing: bool = False
    sub: Any = None
    replay: Any = None
    monitor: Any = None
    replay_monitor: Any = None
    replay_last_event: int | None = None  # the replay monitor's last event read (see Subscriber._replay_news)


ApplyFn = Callable[[Stream, int, Batch], None]
ResetFn = Callable[[Stream], None]
# A replay in progress: a generator that yields the time.monotonic() by which it must be resumed
# (if its replay socket brings nothing before), and returns what the replay returns.
Task = Generator[float, None, Any]


class Subscriber:
    """Reads every stream in a daemon thread; calls ``apply`` per batch in sequence order."""

    def __init__(self, streams: list[Stream], topic: str, apply: ApplyFn, reset: ResetFn,
                 hwm: int = 100_000, replay_timeout: float = 2.0, idle_probe: float = 1.0,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        zmq = require("zmq", "kvscope.attach")
        self._zmq = zmq
        self.max_message_bytes = max_message_bytes
        self.streams, self.apply, self.reset = streams, apply, reset
        self.replay_timeout, self.idle_probe = replay_timeout, idle_probe
        self.topic = topic.encode()
        self.codec = Codec()
        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
        self._by_socket: dict[Any, Stream] = {}
        for s in streams:
            try:
                self._connect(s, hwm)
            except zmq.ZMQError as exc:  # an address ZMQ refuses, or too many sockets: none stay open
                self._close_sockets()
                raise ValueError(f"cannot subscribe to {s.name!r} at {s.endpoint!r} "
                                 f"(replay {s.replay_endpoint!r}): {exc}") from exc
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvscope-attach", daemon=True)
        self._thread.start()

    def _connect(self, s: Stream, hwm: int) -> None:
        zmq = self._zmq
        s.sub = self._ctx.socket(zmq.SUB)
        s.sub.setsockopt(zmq.RCVHWM, hwm)
        s.sub.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        s.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        s.sub.connect(s.endpoint)
        s.monitor = s.sub.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
        if s.replay_endpoint is not None:
            s.replay = self._ctx.socket(zmq.DEALER)
            s.replay.setsockopt(zmq.LINGER, 0)
            s.replay.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
            s.replay.connect(s.replay_endpoint)
            # a drop, and a failed attempt to connect (EVENT_CLOSED: refused, nothing listens there; a bare
            # EVENT_CONNECT_RETRIED: no socket to close, the host name did not resolve)
            s.replay_monitor = s.replay.get_monitor_socket(
                zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED | zmq.EVENT_CONNECT_RETRIED)
            self._by_socket[s.replay] = s  # polled only while a task of the stream waits on it
        for sock in (s.sub, s.monitor, s.replay_monitor):
            if sock is not None:
                self._poller.register(sock, zmq.POLLIN)
                self._by_socket[sock] = s

    def close(self) -> None:
        """Stop the thread, which closes the sockets itself (ZMQ sockets are not thread-safe).

        Waits for it (a pending replay gives up at once: the thread never waits on one longer than
        :data:`_POLL_MS`; a listener still running, :data:`_CLOSE_WAIT_S` at most), except from the
        thread itself (a listener): the sockets close once the listener returns. Closing twice is
        harmless."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=_CLOSE_WAIT_S)

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        try:
            self._poll_until_stopped()
        finally:
            self._close_sockets()

    def _close_sockets(self) -> None:
        for s in self.streams:
            for sock, monitor in ((s.sub, s.monitor), (s.replay, s.replay_monitor)):
                if monitor is not None:
                    sock.disable_monitor()
            for sock in (s.sub, s.replay, s.monitor, s.replay_monitor):
                if sock is not None:
                    sock.close(linger=0)
        self._ctx.term()

    def _poll_until_stopped(self) -> None:
        zmq = self._zmq
        while not self._stop.is_set():
            now = time.monotonic()
            wait = _POLL_MS
            for s in self.streams:
                if s.task is not None:
                    if now >= s.wake:
                        self._resume(s)
                    if s.task is not None:
                        wait = min(wait, math.ceil((s.wake - now) * 1000))
                elif s.replay is not None and s.next_seq is not None and now - s.heard > self.idle_probe:
                    s.heard = now
                    if not s.sub.poll(0):  # batches waiting: not quiet, only unread for a while (a listener)
                        self._start(s, self._probe_tail(s), probing=True)
            for sock, _ in self._poller.poll(max(wait, 0)):
                s = self._by_socket[sock]
                if sock is s.monitor:
                    self._on_sub_events(s)
                    continue
                if sock is s.replay or sock is s.replay_monitor:
                    if s.task is not None:
                        self._resume(s)
                    elif sock is s.replay_monitor:
                        self._replay_dropped(s)
                    continue  # (the replay socket of a task that ended in this round: nothing to read)
                if s.task is not None:
                    if not s.probing:  # (a gap's replay began in this round)
                        continue
                    self._cancel(s)  # the stream speaks again: its live numbers show any gap
                # drain in bursts bounded in count and time (a listener may be slow), so one busy
                # publisher cannot starve the others
                burst_end = time.monotonic() + _POLL_MS / 1000
                for _ in range(1000):
                    if self._stop.is_set():
                        return
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        break
                    task = self._on_message(s, frames)
                    s.heard = time.monotonic()
                    if (task is not None and self._start(s, task)) or s.heard > burst_end:
                        break

    # ------------------------------------------------------- replay tasks
    def _start(self, s: Stream, task: Task, probing: bool = False) -> bool:
        """Run ``task`` until it first waits; True if it waits (it is then the stream's task, resumed
        by the loop when its replay socket has something or its deadline passes)."""
        try:
            s.wake = next(task)
        except StopIteration:
            return False
        s.task, s.probing = task, probing
        self._poller.register(s.replay, self._zmq.POLLIN)
        if not probing:  # a gap's replay: the live batches after it wait until it ends
            self._poller.unregister(s.sub)
        return True

    def _resume(self, s: Stream) -> None:
        try:
            s.wake = s.task.send(None)
        except StopIteration:
            self._end_task(s)

    def _end_task(self, s: Stream) -> None:
        self._poller.unregister(s.replay)
        if not s.probing:
            self._poller.register(s.sub, self._zmq.POLLIN)
        s.task, s.wake, s.probing = None, math.inf, False

    def _cancel(self, s: Stream) -> None:
        """Give up the stream's task; its answer, still to come, goes to the old connection."""
        s.task.close()
        self._end_task(s)
        self._reconnect(s.replay, s.replay_endpoint)

    def _events(self, monitor: Any) -> list[int]:
        """The events a socket monitor holds now."""
        from zmq.utils.monitor import parse_monitor_message

        events = []
        while monitor.poll(0):
            events.append(parse_monitor_message(monitor.recv_multipart())["event"])
        return events

    def _on_sub_events(self, s: Stream) -> None:
        """A drop, then ZMQ's retry: a lost connection, maybe to a new publisher process. A drop
        with no retry within :data:`_RETRY_WAIT_MS` is one ZMQ gave up on: :meth:`_refused` (the
        sooner it is made again, the fewer batches go by meanwhile, lost if there is no replay)."""
        disconnected = self._zmq.EVENT_DISCONNECTED
        events = self._events(s.monitor)
        while events and events[-1] == disconnected and s.monitor.poll(_RETRY_WAIT_MS):
            events += self._events(s.monitor)
        dropped = False
        for event in events:
            if event == disconnected:
                dropped = True
            elif dropped:  # a retry after a drop (retries alone: a publisher not up yet)
                dropped, s.disconnected = False, True
        if dropped:
            self._refused(s)

    def _refused(self, s: Stream) -> None:
        """ZMQ refused a message over ``max_message_bytes`` at its header and closed the connection
        for good: connect again. The same publisher is still there, so the cache stays; the next
        batch shows the gap, which replay fills."""
        s.faults["oversize_messages"] += 1
        self._reconnect(s.sub, s.endpoint)

    def _replay_dropped(self, s: Stream) -> bool:
        """Whether the replay connection dropped since last asked; if so it is made again (after a
        message over the limit ZMQ would not; after any other drop this only starts it at once)."""
        if not self._replay_news(s)[0]:
            return False
        self._reconnect(s.replay, s.replay_endpoint)
        return True

    def _replay_news(self, s: Stream) -> tuple[bool, bool]:
        """What the replay socket's monitor reported since last read: whether the connection dropped,
        and whether an attempt to make it failed.

        A failed attempt is one whose socket ZMQ closed (refused, or the host unreachable), or one
        that failed before it had a socket: the host name did not resolve. ZMQ reports no event of
        its own for that one, only the retry it schedules after it; any other retry directly follows
        the drop or the closed attempt it retries, so a retry after neither is that failure (the
        last event is kept across reads, which may split such a pair). The monitor is read only here."""
        zmq = self._zmq
        dropped = failed = False
        for event in self._events(s.replay_monitor):
            dropped = dropped or event == zmq.EVENT_DISCONNECTED
            failed = failed or event == zmq.EVENT_CLOSED or (
                event == zmq.EVENT_CONNECT_RETRIED
                and s.replay_last_event not in (zmq.EVENT_DISCONNECTED, zmq.EVENT_CLOSED))
            s.replay_last_event = event
        return dropped, failed

    def _reconnect(self, sock: Any, endpoint: str) -> None:
        try:
            sock.disconnect(endpoint)
        except self._zmq.ZMQError:  # ZMQ dropped the endpoint already
            pass
        sock.connect(endpoint)

    def _on_message(self, s: Stream, frames: list[bytes]) -> Task | None:
        """Handle one live message; a task, not yet started, if it needs a replay first."""
        try:
            topic, seq, payload = split_frames(frames)
        except WireError as exc:
            s.faults[exc.kind] += 1
            return None
        if topic != self.topic:  # ZMQ subscribes by prefix: "kv-events-b" is another stream, with its own numbers
            return None
        restarted = s.last_live is not None and seq <= s.last_live
        mismatched = not (restarted or s.disconnected) and self._contradicts_replay(s, seq, payload)
        if restarted or s.disconnected or mismatched:
            s.faults["publisher_restarts" if restarted else "replay_mismatches" if mismatched else "reconnects"] += 1
            s.next_seq, s.disconnected = None, False
            s.ahead.clear()
            self.reset(s)
        if s.ahead:  # the live socket has passed these now
            for _ in range(min(len(s.ahead), seq - s.last_live)):
                s.ahead.popleft()
        s.last_live = seq
        if s.next_seq is None:
            if seq > 0 and s.replay is not None:
                return self._replay_then_apply(s, 0, seq, payload)  # joined late: what the publisher still buffers
        elif seq < s.next_seq:
            s.faults["duplicate_batches"] += 1
            return None
        elif seq > s.next_seq:
            s.faults["gaps"] += 1
            s.faults["missed_batches"] += seq - s.next_seq
            return self._replay_then_apply(s, s.next_seq, seq, payload)
        self._apply(s, seq, payload)
        return None

    def _replay_then_apply(self, s: Stream, start: int, seq: int, payload: bytes) -> Task:
        """The task of a live batch ``seq`` that follows a gap (or a late join, from 0): replay the
        batches before it, then apply it. From the first batch replay returned on, what it left out
        was lost."""
        if s.replay is not None:  # the rank replayed batches must carry, known before any of them applies
            self._note_rank(s, payload)
        yield from self._replay(s, start, seq)
        if s.next_seq is not None:
            s.faults["lost_batches"] += seq - s.next_seq
        self._apply(s, seq, payload)
        s.heard = time.monotonic()

    def _contradicts_replay(self, s: Stream, seq: int, payload: bytes) -> bool:
        """Whether live batch ``seq`` is one the idle probe's replay gave (or skipped) differently: the
        replay socket is not this publisher's, or ran ahead of it. Its numbers then say nothing about
        what the publisher sent, and the cache holds batches it never did."""
        i = seq - s.last_live - 1 if s.last_live is not None else -1
        return 0 <= i < len(s.ahead) and s.ahead[i] != hash(payload)

    def _apply(self, s: Stream, seq: int, payload: bytes, live: bool = True) -> None:
        s.next_seq = seq + 1
        try:
            batch = self.codec.decode(payload)
        except WireError as exc:
            s.faults[exc.kind] += 1
            return
        if live and batch.data_parallel_rank is not None:
            s.live_rank = batch.data_parallel_rank
        s.faults["unknown_tag"] += batch.unknown_tags
        self.apply(s, seq, batch)

    def _note_rank(self, s: Stream, payload: bytes) -> None:
        try:
            rank = self.codec.decode(payload).data_parallel_rank
        except WireError:
            return
        if rank is not None:
            s.live_rank = rank

    def _foreign(self, s: Stream, payload: bytes) -> bool:
        """Whether a replayed batch carries another data-parallel rank than the live batches: the replay
        socket is another rank's (a port offset by the wrong rank), whose blocks this cache never held."""
        if s.live_rank is None:
            return False
        try:
            rank = self.codec.decode(payload).data_parallel_rank
        except WireError:  # counted when applied, as any malformed batch
            return False
        return rank is not None and rank != s.live_rank

    def _ask(self, s: Stream, start: int) -> bool:
        """Send a replay request from ``start``; False if it cannot go out now (a replay peer that is
        down queues requests up to the high-water mark, then would block)."""
        try:
            s.replay.send_multipart([b"", seq_bytes(start)], self._zmq.NOBLOCK)
        except self._zmq.Again:
            return False
        return True

    def _probe_tail(self, s: Stream) -> Task:
        """The idle probe's task: ask replay for batches after the last one applied; any that come
        back were dropped live (counted so even if a live batch cancels the task midway)."""
        before = s.next_seq
        try:
            if not (yield from self._replay(s, before, sys.maxsize, contiguous=True)):
                s.heard = math.inf  # no full answer (the publisher is gone?): probe again only after it speaks
        finally:
            if s.next_seq > before:
                s.faults["gaps"] += 1
                s.faults["missed_batches"] += s.next_seq - before

    def _replay(self, s: Stream, start: int, end: int, contiguous: bool = False) -> Generator[float, None, bool]:
        """(A task's part.) Apply the batches ``start <= seq < end`` that the publisher's replay socket
        returns; False if it did not finish its answer within ``replay_timeout``.

        A batch the answer skips (past the publisher's buffer, or dropped by its high-water mark)
        is counted lost, except before the first one returned to a stream that is joining. The
        replay ends as soon as the answer has brought, or gone past, the batch before ``end``
        (its own end may never come: the publisher's ROUTER drops what exceeds its high-water
        mark, the end marker included), or once an attempt to connect fails after the ask
        (nothing listens there, or the host name does not resolve: no answer will come).
        ``contiguous`` takes only the batch the answer owes next: with no live batch to bound the
        answer (the idle probe), a number far ahead would make every later live batch look like one
        already applied; what a skip leaves out comes back at the next gap. Even so the answer may
        run ahead of the publisher (a replay socket that is not its own), so what it applies is
        kept in ``Stream.ahead`` until the live socket brings the same numbers.

        An answer the connection dropped in the middle of is asked for again from the batch it
        still owes; a second drop there with no reply between means that batch cannot come
        through under ``max_message_bytes``, so the next ask starts after it (it is lost once a
        later one comes: a connection that drops at every ask moves nothing)."""
        if s.replay is None:
            return False
        sock = s.replay
        joining = s.next_seq is None
        owed, stuck = start, None  # the first batch the answer has not brought; where it last dropped
        # whether a batch came (or was skipped) before owed (the probe takes only owed itself: it
        # need not look past it); and how many were skipped
        known, skipped = contiguous, 0
        self._replay_dropped(s)  # what the monitor said before this ask is not about its answer
        if not self._ask(s, owed):
            return False
        dropped = failed = False
        deadline = time.monotonic() + self.replay_timeout
        while deadline > time.monotonic():
            if not sock.poll(0):
                news = self._replay_news(s)
                dropped, failed = dropped or news[0], failed or news[1]
                if not (dropped or failed):
                    yield deadline
                    continue
                if dropped and sock.poll(_DROP_GRACE_MS):  # the replies read before a drop reach us after ZMQ reports it
                    continue
                if failed:  # an attempt to connect failed since the ask: nothing there will answer
                    break
                dropped = False
                self._reconnect(sock, s.replay_endpoint)  # the rest of the answer went with the connection: ask again
                if owed >= end:  # all that was asked for came; what broke the connection lies past it
                    return True
                if owed == stuck:  # dropped twice at this batch, nothing between: it is over the size limit
                    if not known:  # the answer's first batch, whose number it never showed
                        owed = yield from self._bisect_stuck(s, owed, end, deadline)
                    # lost, if a later batch comes: counted as any hole is
                    owed, stuck, known, skipped = owed + 1, None, True, skipped + 1
                else:
                    stuck = owed
                if not self._ask(s, owed):
                    return False
                continue
            reply = sock.recv_multipart()
            if len(reply) != 3 or len(reply[1]) != 8:
                s.faults["missing_frames"] += 1
                continue
            seq = int.from_bytes(reply[1], "big", signed=True)
            if seq == END_SEQ:
                return True
            if contiguous and seq != owed:
                continue
            if (start if joining else s.next_seq) <= seq < end:
                if self._foreign(s, reply[2]):  # the rest of the answer is that rank's too
                    s.faults["replay_mismatches"] += 1
                    break
                s.faults["lost_batches"] += skipped if joining else seq - s.next_seq
                if contiguous:
                    s.ahead.extend([None] * (seq - s.next_seq))
                    s.ahead.append(hash(reply[2]))
                joining = False
                s.faults["replayed_batches"] += 1
                self._apply(s, seq, reply[2], live=False)
                owed, known = seq + 1, True
            if seq >= end or owed >= end:  # the gap is settled; the rest of the answer goes to the old connection
                self._reconnect(sock, s.replay_endpoint)
                return True
        # the answer may still come: a new connection leaves it to the old one, so that no reply of it
        # (its end above all) is taken for part of the next answer
        self._reconnect(sock, s.replay_endpoint)
        return False

    def _bisect_stuck(self, s: Stream, lo: int, hi: int, deadline: float) -> Generator[float, None, int]:
        """The number of the batch over the size limit that an answer from ``lo`` drops at before
        any reply (the first one the publisher still buffers: a join asks from 0).

        An answer from ``k`` drops so for ``lo <= k <=`` that number, and brings a reply for any
        ``k`` past it, so bisection over ``lo..hi-1`` finds it in a few asks instead of one ask
        per number (a join would walk from 0 to the publisher's buffer, and time out)."""
        while hi - lo > 1:
            mid = (lo + hi) // 2
            drops = yield from self._drops_first(s, mid, deadline)
            if drops is None:
                break
            lo, hi = (mid, hi) if drops else (lo, mid)
        return lo

    def _drops_first(self, s: Stream, start: int, deadline: float) -> Generator[float, None, bool | None]:
        """Whether the answer from ``start`` drops the connection before its first reply; None if
        it cannot be asked or says nothing in time. The answer is left unread either way: the
        connection is made again, which discards what ZMQ still holds of it."""
        if not self._ask(s, start):
            return None
        while deadline > time.monotonic():
            replied = bool(s.replay.poll(0))
            dropped, failed = (False, False) if replied else self._replay_news(s)
            if replied or dropped or failed:
                replied = replied or (dropped and bool(s.replay.poll(_DROP_GRACE_MS)))
                self._reconnect(s.replay, s.replay_endpoint)
                return None if failed and not replied else not replied
            yield deadline
        return None
