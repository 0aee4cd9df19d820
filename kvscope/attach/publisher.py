"""The PUB side, in vLLM's wire format: kvscope's own KV events for any consumer of vLLM's.

:class:`KVEventPublisher` is the transport (vLLM's ``ZmqEventPublisher`` protocol): a PUB socket
sends ``[topic, seq, payload]``, the last ``buffer_steps`` batches are kept for the ROUTER replay
socket, and a data-parallel rank r moves both ports up by r. :class:`EngineKVEvents` feeds it
from an engine through the public hook API, one batch per step that changed the prefix cache,
with the events ``trace.kv_events()`` would show for that step.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from kvscope.arg_checks import offset_endpoint
from kvscope.attach._deps import MODULES, require
from kvscope.attach.wire import END_SEQ, Codec, cleared, removed, seq_bytes, stored
from kvscope.trace.events import AllBlocksCleared, BlockRemoved, BlockStored


def _binds(endpoint: str) -> bool:
    """vLLM's heuristic: a wildcard address, ipc or inproc is bound; a concrete host is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class EndpointError(ValueError):
    """An endpoint ZMQ would not bind or connect (a port in use, an address not on this host),
    named by the argument that gave it: ZMQ's own error names neither. Its cause is ZMQ's error."""


def _open(sock: Any, binds: bool, setting: str, endpoint: str, address: str) -> None:
    """Bind or connect ``sock`` to ``address`` (``endpoint``, moved by the data-parallel rank)."""
    import zmq

    try:
        (sock.bind if binds else sock.connect)(address)
    except zmq.ZMQError as exc:
        where = repr(endpoint) if address == endpoint else f"{endpoint!r} ({address!r} at this data_parallel_rank)"
        raise EndpointError(f"{setting} {where} cannot be {'bound' if binds else 'connected to'}: "
                            f"{zmq.strerror(exc.errno)}") from exc


class KVEventPublisher:
    """Publishes batches of vLLM-schema events; ``endpoint`` / ``replay_endpoint`` are the bound addresses.

    ``bind=None`` follows vLLM: bind a wildcard address (``tcp://*:5557``), connect to a concrete one.
    """

    def __init__(self, endpoint: str = "tcp://*:5557", replay_endpoint: str | None = None,
                 buffer_steps: int = 10_000, hwm: int = 100_000, topic: str = "",
                 data_parallel_rank: int = 0, bind: bool | None = None) -> None:
        zmq = require("zmq", "KVEventPublisher")
        self._zmq = zmq
        self._codec = Codec()
        self.topic = topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._seq = 0
        self._stop = threading.Event()
        self.replay_endpoint = None
        self._thread = None
        self._ctx = zmq.Context()
        self._pub = self._router = None
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            address = offset_endpoint(endpoint, data_parallel_rank)
            binds = _binds(address) if bind is None else bind
            _open(self._pub, binds, "endpoint", endpoint, address)
            self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) if binds else address
            if replay_endpoint is not None:
                self._router = self._ctx.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                # a ROUTER drops what a peer's queue cannot hold: room for one whole answer and its end
                self._router.setsockopt(zmq.SNDHWM, buffer_steps + 1)
                _open(self._router, True, "replay_endpoint", replay_endpoint,
                      offset_endpoint(replay_endpoint, data_parallel_rank))
                self.replay_endpoint = self._router.getsockopt_string(zmq.LAST_ENDPOINT)
        except Exception:  # a port in use, an address refused: unbind the rest, so that a retry can have it
            self._close_sockets()
            raise
        if self._router is not None:
            self._thread = threading.Thread(target=self._serve_replay, name="kvscope-kv-replay", daemon=True)
            self._thread.start()

    def publish(self, events: list[dict[str, Any]], ts: float | None = None) -> int:
        """Send one batch (events from :func:`~kvscope.attach.wire.stored` etc.); returns its sequence number.

        Never blocks: past the high-water mark ZMQ drops the batch for that subscriber, who sees a
        gap and asks the replay socket for it.
        """
        return self.send(self._codec.encode(time.time() if ts is None else ts, events, self.data_parallel_rank))

    def send(self, payload: bytes) -> int:
        """Send an already encoded ``KVEventBatch`` payload as the next batch; returns its sequence number."""
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
            self._pub.send_multipart((self.topic, seq_bytes(seq), payload))
        return seq

    def _serve_replay(self) -> None:
        zmq = self._zmq
        router = self._router
        while not self._stop.is_set():
            if not router.poll(100):
                continue
            request = router.recv_multipart()
            if len(request) != 3 or len(request[2]) != 8:
                continue  # not [identity, b"", start_seq]: vLLM ignores it too
            client, start = request[0], int.from_bytes(request[2], "big", signed=True)
            with self._lock:
                batches = [b for b in self._buffer if b[0] >= start]
            try:
                for seq, payload in batches:
                    router.send_multipart((client, b"", seq_bytes(seq), payload))
                router.send_multipart((client, b"", seq_bytes(END_SEQ), b""))
            except zmq.ZMQError:
                continue  # the client went away

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._router, self._pub):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> "KVEventPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wire_event(ev: BlockStored | BlockRemoved | AllBlocksCleared) -> dict[str, Any]:
    """A trace event (``kvscope.trace.events``) as vLLM sends it (kvscope's block id and refcount stay home)."""
    if isinstance(ev, BlockStored):
        return stored(ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size, ev.lora_id, ev.medium)
    if isinstance(ev, BlockRemoved):
        return removed(ev.block_hashes, ev.medium)
    return cleared()


class EngineKVEvents:
    """Publishes an engine's prefix-cache events, one batch per step, while attached.

    It records the engine at the ``blocks`` level (a one-step ring buffer, through the hook
    registry the engine hands it) and turns each step record into vLLM's events with the same
    code as ``trace.kv_events()``; like any recorder, it leaves async scheduling on.
    """

    @staticmethod
    def require_dependencies() -> None:
        """Import the attach extra (pandas too: the events come from a kvscope recorder): ``LLM``
        calls this before the weights load, so that a missing one is refused at once, naming
        ``kv_events_config``, not once they have loaded."""
        for module in MODULES:
            require(module, "kv_events_config")

    def __init__(self, engine: Any, publisher: KVEventPublisher) -> None:
        from kvscope.trace.recorder import Recorder
        from kvscope.trace.trace import kv_event_list

        self.publisher = publisher
        self._events_of = kv_event_list
        self._recorder = Recorder(engine, level="blocks", max_steps=1)
        self._recorder.start()
        self._state = self._recorder.view(with_baseline=True)[1]
        self._listener = self._recorder.add_listener(self._on_step)

    def _on_step(self, record: Any) -> None:
        events = [wire_event(ev) for _, ev in self._events_of([record], self._state)]
        if events:  # vLLM publishes only steps that changed the cache
            self.publisher.publish(events)

    def close(self) -> None:
        self._listener.remove()
        self._recorder.stop()
        self.publisher.close()
