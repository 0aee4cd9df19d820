"""Loopback publishers and waiting helpers for the attach tests (every wait has a timeout)."""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator

LOOPBACK = "tcp://127.0.0.1:*"  # a free port on loopback, bound by the publisher


def wait_for(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError(f"{what} not reached within {timeout} s")
        time.sleep(0.01)


def free_port() -> int:
    """A tcp port free on this host now: bound, then released before this returns (the socket's
    own context is terminated, which waits for ZMQ to close it; ``close`` alone leaves that to
    the I/O thread, and a bind right after may still find the port in use)."""
    import zmq

    with zmq.Context() as ctx, ctx.socket(zmq.PUB) as sock:
        sock.setsockopt(zmq.LINGER, 0)
        return sock.bind_to_random_port("tcp://*")


def publisher(**kw):
    from kvscope.attach.publisher import KVEventPublisher

    kw.setdefault("replay_endpoint", LOOPBACK)
    kw.setdefault("topic", "kv-events")
    return KVEventPublisher(LOOPBACK, **kw)


def attach_to(*pubs, **kw):
    """``kvscope.attach`` to publishers named p0, p1, ... (batches sent before the subscription
    reached a publisher come back through its replay socket when the first one arrives)."""
    import kvscope

    kw.setdefault("replay_timeout", 1.0)
    names = {f"p{i}": p.endpoint for i, p in enumerate(pubs)}
    replays = {f"p{i}": p.replay_endpoint for i, p in enumerate(pubs) if p.replay_endpoint}
    att = kvscope.attach(names, topic="kv-events", replay_endpoints=replays or None, **kw)
    time.sleep(0.3)  # ZMQ's slow joiner: the subscription reaches the PUB socket asynchronously
    return att


def applied(att, name: str, seq: int) -> Callable[[], bool]:
    """True once batch ``seq`` of ``name`` has been applied (the stream expects the next one)."""
    stream = next(s for s in att.streams if s.name == name)
    return lambda: stream.next_seq is not None and stream.next_seq > seq


@contextlib.contextmanager
def raw_stream(serve: Callable | None = None, **kw) -> Iterator[tuple]:
    """A bare ZMQ PUB socket on loopback (the test writes every frame itself, well formed or not)
    and ``kvscope.attach`` subscribed to it, the subscription live (an empty batch 0 arrived).
    With ``serve``, a bare ROUTER is its replay socket, ``serve(router, stop)`` answering it in a
    thread until the block ends (``stop``: a threading.Event)."""
    import threading

    import zmq

    import kvscope

    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.PUB)
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    router, stop = ctx.socket(zmq.ROUTER), threading.Event()
    server = threading.Thread(target=serve, args=(router, stop), daemon=True) if serve is not None else None
    if server is not None:
        kw["replay_endpoints"] = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
        server.start()
    kw.setdefault("replay_timeout", 0.2)
    att = kvscope.attach(f"tcp://127.0.0.1:{port}", topic="kv-events", **kw)
    try:
        wait_for(lambda: probed(raw, att), what="subscription")
        yield raw, att
    finally:
        att.close()
        stop.set()
        if server is not None:
            server.join()
        router.close(linger=0)
        raw.close(linger=0)


@contextlib.contextmanager
def mute_and_good(replay_timeout: float) -> Iterator[tuple]:
    """Two publishers attached as "bad" and "good": a bare PUB socket whose replay socket takes
    requests and never answers, and a real publisher. Yields ``(raw, att, good, mute)`` once both
    subscriptions are live (the good one's first batch, storing block 0, applied: if the
    subscription had not reached the publisher yet, an empty batch after it brings it back through
    replay); ``mute`` is the bare ROUTER replay socket, where the test can read the requests that go
    unanswered."""
    import zmq

    import kvscope
    from kvscope.attach.wire import stored

    ctx = zmq.Context.instance()
    raw, mute = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    port, mute_port = raw.bind_to_random_port("tcp://127.0.0.1"), mute.bind_to_random_port("tcp://127.0.0.1")
    with publisher() as good:
        att = kvscope.attach({"bad": f"tcp://127.0.0.1:{port}", "good": good.endpoint}, topic="kv-events",
                             replay_endpoints={"bad": f"tcp://127.0.0.1:{mute_port}", "good": good.replay_endpoint},
                             replay_timeout=replay_timeout)
        try:
            wait_for(lambda: probed(raw, att), what="subscription")
            first = good.publish([stored([0], None, [1, 2], 2)])
            for _ in range(20):  # (ZMQ's slow joiner: a PUB socket drops what it sends before the subscription comes)
                with contextlib.suppress(TimeoutError):
                    wait_for(applied(att, "good", first), timeout=0.5)
                    break
                good.publish([])
            wait_for(applied(att, "good", first), timeout=0.1, what="the first good batch")
            yield raw, att, good, mute
        finally:
            att.close()
            raw.close(linger=0)
            mute.close(linger=0)


def probed(raw, att, stream: int = 0) -> bool:
    """Send an empty batch 0 on ``raw``; True once stream ``stream`` of ``att`` has it (its
    subscription is then live)."""
    from kvscope.attach.wire import Codec, seq_bytes

    raw.send_multipart([b"kv-events", seq_bytes(0), Codec().encode(0.0, [], 0)])
    return att.streams[stream].next_seq == 1


@contextlib.contextmanager
def metrics_server(page: Callable[[], str]) -> Iterator[str]:
    """A Prometheus ``/metrics`` page on loopback, its body ``page()`` at each request; yields
    its URL (after the block nothing listens there)."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = page().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()
