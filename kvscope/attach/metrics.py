"""vLLM's Prometheus ``/metrics``: parsed into rows of the metric time series, scraped at an interval.

Metric names are those of vLLM's V1 engine (``vllm/v1/metrics/loggers.py``); counters are
exposed with prometheus_client's ``_total`` suffix. Each row is one scrape of one engine
(vLLM labels a data-parallel engine with ``engine="<rank>"``); the columns reuse the names of
``trace.steps``, which come from the same vLLM metrics.
"""
from __future__ import annotations

import functools
import http.client
import math
import re
import socket
import threading
import time
import urllib.request
from typing import Any, Callable

# column -> the vLLM metric names that fill it, newest first (gpu_cache_usage_perc: before v0.10)
METRICS: dict[str, tuple[str, ...]] = {
    "num_requests_running": ("vllm:num_requests_running",),
    "num_requests_waiting": ("vllm:num_requests_waiting",),
    "kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "prefix_cache_queries": ("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
    "prefix_cache_hits": ("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
    "num_preemptions": ("vllm:num_preemptions_total",),
}
COLUMNS: tuple[str, ...] = ("time_s", "instance", "data_parallel_rank", *METRICS)
MAX_PAGE_BYTES = 32 << 20  # far above any vLLM /metrics page; a server that sends more is not one
_BY_NAME = {name: (col, rank) for col, names in METRICS.items() for rank, name in enumerate(names)}
_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?\s*$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
_ENGINE = re.compile(r"[0-9]{1,18}")  # a data-parallel rank, as the int64 column can hold it
_LOOKUP_POLL_S = 0.05  # how often a wait for a host's lookup checks that its fetch was not shut (close())


def parse_metrics(text: str, instance: str, time_s: float) -> list[tuple]:
    """Rows of :data:`COLUMNS`, one per ``engine`` label (vLLM's data-parallel rank), from a
    Prometheus text exposition.

    Series of one engine under other labels (several models) are summed; a column whose metric
    is absent is NaN. When two names fill one column (a renamed metric), the newer one wins.
    """
    found: dict[str, dict[str, tuple[int, float]]] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _LINE.match(line)
        if m is None or m.group(1) not in _BY_NAME:
            continue
        col, rank = _BY_NAME[m.group(1)]
        labels = dict(_LABEL.findall(m.group(2) or ""))
        engine = labels.get("engine", "0")
        if not _ENGINE.fullmatch(engine):  # int() would take " 1_0 " or a number the table cannot hold
            continue
        try:
            value, engine = float(m.group(3)), int(engine)
        except ValueError:
            continue
        cols = found.setdefault(engine, {})
        old = cols.get(col)
        if old is None or rank < old[0]:
            cols[col] = (rank, value)
        elif rank == old[0]:
            cols[col] = (rank, old[1] + value)
    return [(time_s, instance, engine, *(cols.get(c, (0, math.nan))[1] for c in METRICS))
            for engine, cols in sorted(found.items())]


class MetricsScraper:
    """Daemon threads, one per URL, each fetching its URL every ``interval`` seconds and handing rows
    to ``sink`` (so ``sink`` is called from several threads).

    A failed fetch is counted in ``errors[url]`` and retried at the next interval, never raised:
    no answer, one that is not HTTP, or a page that takes longer than ``timeout`` or is larger
    than :data:`MAX_PAGE_BYTES` (a server that never stops sending would otherwise hold the
    thread and fill memory). Each URL has its own thread so that one whose fetch hangs until its
    deadline delays no other: scraped one after another, every URL listed after it waited that
    deadline out at each round.

    Host names are resolved in daemon threads (see :func:`_resolve`): a lookup that hangs outlives
    the scrape that started it, and ``close()``, until the resolver answers. Each URL (with the
    hosts it redirects to) starts a new one only once its last has returned, so a hung resolver
    holds at most one thread per URL, however many scrapes fail meanwhile; a URL never waits on
    another's lookup. Being daemons, they never hold up the interpreter's exit.
    """

    def __init__(self, urls: dict[str, str], interval: float, sink: Callable[[list[tuple]], None],
                 timeout: float = 2.0) -> None:
        self.urls, self.interval, self.timeout, self.sink = urls, float(interval), timeout, sink
        self.errors = dict.fromkeys(urls, 0)
        self._stop = threading.Event()
        self._fetching: dict[str, _Deadline] = {}  # each URL's fetch in progress, which close() cuts short
        self._threads = [threading.Thread(target=self._run, args=(instance, url), name="kvscope-metrics",
                                          daemon=True) for instance, url in urls.items()]
        for thread in self._threads:
            thread.start()

    def _run(self, instance: str, url: str) -> None:
        started: list[_Lookup | None] = [None]  # the last lookup this URL's fetches started
        while not self._stop.is_set():
            try:
                text = self._fetch(instance, url, started)
            except (OSError, ValueError, http.client.HTTPException):
                if not self._stop.is_set():  # (not one close() cut short)
                    self.errors[instance] += 1
            else:
                self.sink(parse_metrics(text, instance, time.time()))
            self._stop.wait(self.interval)

    def _fetch(self, instance: str, url: str, started: list[_Lookup | None]) -> str:
        """The page at ``url``, read in chunks against one deadline for the whole answer, headers
        included; ``started`` holds the last lookup that fetches of this URL started."""
        chunks, size = [], 0
        with _Deadline(self.timeout, started) as deadline:
            self._fetching[instance] = deadline
            if self._stop.is_set():  # close() came before it could see this fetch
                deadline.shut()
            with deadline.open(url) as resp:
                while chunk := resp.read1(1 << 16):
                    size += len(chunk)
                    if size > MAX_PAGE_BYTES:
                        raise ValueError(f"{url} sent more than {MAX_PAGE_BYTES} bytes")
                    chunks.append(chunk)
                if resp.length:  # the connection closed before the Content-Length promised: a cut page
                    raise http.client.IncompleteRead(b"".join(chunks), resp.length)
        if deadline.passed.is_set():  # the deadline shut the connection: what came is not the page
            raise TimeoutError(f"{url} took longer than {self.timeout} s")
        return b"".join(chunks).decode("utf-8", "replace")

    def close(self) -> None:
        """Stop scraping: the fetches in progress are cut short, and their threads waited for (not
        the lookups they wait on)."""
        self._stop.set()
        for deadline in list(self._fetching.values()):
            deadline.shut()
        end = time.monotonic() + self.timeout + 1.0
        for thread in self._threads:
            thread.join(timeout=max(end - time.monotonic(), 0.0))


class _Deadline:
    """Shuts the connections of one fetch once ``seconds`` pass: http.client's timeout bounds each
    read, not the answer, so a server sending its headers a byte at a time would hold its URL's
    thread for ever, past ``close()``. Resolving the host and connecting count too; ``started`` is
    the URL's slot for the lookup it last started (:func:`_resolve`)."""

    def __init__(self, seconds: float, started: list[_Lookup | None]) -> None:
        self.seconds, self.started = seconds, started
        self.passed = threading.Event()
        self._sockets: list[socket.socket] = []
        self._timer = threading.Timer(seconds, self.shut)
        self._timer.daemon = True
        self._end = math.inf

    def __enter__(self) -> "_Deadline":
        self._end = time.monotonic() + self.seconds
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()

    def left(self) -> float:
        return max(self._end - time.monotonic(), 0.0)

    def open(self, url: str) -> http.client.HTTPResponse:
        """``urlopen(url)`` (redirects and https included), its sockets recorded for :meth:`shut`."""
        opener = urllib.request.build_opener(_HTTPHandler(self), _HTTPSHandler(self))
        return opener.open(url, timeout=self.seconds)  # noqa: S310 - the user's URL

    def shut(self) -> None:
        """End the fetch now: its sockets are shut, and a wait for its host's lookup gives up."""
        self.passed.set()
        for sock in list(self._sockets):
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the read blocked on it
            except OSError:  # closed already
                pass

    def connect(self, address: tuple[str, int], timeout: float,
                source_address: tuple[str, int] | None = None) -> socket.socket:
        """``socket.create_connection`` within the deadline, the socket recorded for :meth:`shut`
        (before any TLS handshake)."""
        err: OSError = TimeoutError(f"connecting to {address[0]!r} took longer than {self.seconds} s")
        for family, kind, proto, _, sockaddr in _resolve(*address, deadline=self, started=self.started):
            if self.passed.is_set() or self.left() == 0:
                break
            sock = socket.socket(family, kind, proto)
            try:
                sock.settimeout(self.left())
                if source_address:
                    sock.bind(source_address)
                sock.connect(sockaddr)
            except OSError as exc:
                sock.close()
                err = exc
                continue
            sock.settimeout(timeout)
            self._sockets.append(sock)
            if self.passed.is_set():  # shut while it connected: too late to be shut with the others
                sock.close()
                break
            return sock
        raise err


class _Lookup:
    """One host's ``getaddrinfo``, running in a daemon thread; its answer is a list or the exception."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.done = threading.Event()
        self.answer: list[tuple] | Exception = []
        threading.Thread(target=self._run, name="kvscope-metrics-resolve", daemon=True).start()

    def _run(self) -> None:
        try:  # port 0: the answer serves every port of the host
            self.answer = socket.getaddrinfo(self.host, 0, 0, socket.SOCK_STREAM)
        except Exception as exc:  # noqa: BLE001 - raised in the scraper's thread, by _resolve
            self.answer = exc
        self.done.set()


def _resolve(host: str, port: int, deadline: _Deadline, started: list[_Lookup | None]) -> list[tuple]:
    """``getaddrinfo(host, port)`` in a daemon thread, waited for until ``deadline`` passes (or is
    shut): a resolver cannot be interrupted, and a slow one would hold the URL's thread past its
    deadline (and past ``close()``).

    ``started[0]`` is the lookup that this URL's fetches last started: one of the same host still
    running is waited for again rather than started anew, and one of another host (a redirect's)
    fails the fetch at once, so a resolver that hangs holds one thread per URL at most, not one per
    scrape. A lookup is never shared with another URL: a hung one (a query lost on its way) holds
    only the URL that started it, while the others' own lookups may well be answered."""
    lookup = started[0]
    if lookup is None or lookup.done.is_set():
        lookup = started[0] = _Lookup(host)
    elif lookup.host != host:
        raise TimeoutError(f"resolving {host!r}: this URL's lookup of {lookup.host!r} has not returned yet")
    while not lookup.done.wait(min(deadline.left(), _LOOKUP_POLL_S)):
        if deadline.passed.is_set() or deadline.left() == 0:
            raise TimeoutError(f"resolving {host!r} took longer than the scrape's deadline")
    if isinstance(lookup.answer, Exception):
        raise lookup.answer
    return [(*info[:4], (info[4][0], port, *info[4][2:])) for info in lookup.answer]


class _Bounded:
    """A connection mixin opening its socket through a :class:`_Deadline`."""

    def __init__(self, *args: Any, deadline: _Deadline, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._create_connection = deadline.connect


class _HTTP(_Bounded, http.client.HTTPConnection):
    pass


class _HTTPS(_Bounded, http.client.HTTPSConnection):
    pass


class _HTTPHandler(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self.deadline = deadline

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_HTTP, deadline=self.deadline), req)


class _HTTPSHandler(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline) -> None:
        super().__init__()
        self.deadline = deadline

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(functools.partial(_HTTPS, deadline=self.deadline), req, context=self._context)
