"""``Attached``: a live, trace-like view of vLLM deployments' prefix caches, from their KV events.

The subscriber thread applies each batch under a lock; every property returns a fresh pandas
DataFrame (the ``kvscope.trace`` conventions: one schema per table, fixed column names and
dtypes), so a notebook can read while events arrive.
"""
from __future__ import annotations

import itertools
import threading
from collections import deque
from typing import Any, Callable, Hashable

import pandas as pd

from kvscope.attach.cache import PrefixCache
from kvscope.attach.metric_rows import MetricColumns, MetricRows, metrics_frame
from kvscope.attach.metrics import MetricsScraper
from kvscope.attach.subscriber import DEFAULT_MAX_MESSAGE_BYTES, FAULTS, Stream, Subscriber
from kvscope.attach.wire import INT64_MAX, Batch, event_row
from kvscope.attach.tables import SCHEMAS
from kvscope.engine.hooks import warn_detached
from kvscope.trace.recorder import ListenerHandle
from kvscope.trace.tables import frame

Listener = Callable[[str, int], Any]  # (instance name, sequence number) after each applied batch


class Attached:
    """Built by :func:`kvscope.attach`; ``close()`` (or ``with``) disconnects."""

    def __init__(self, streams: list[Stream], topic: str, metrics_urls: dict[str, str] | None = None,
                 metrics_interval: float = 1.0, hwm: int = 100_000, max_events: int = 1_000_000,
                 replay_timeout: float = 2.0, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.streams = streams
        self.topic = topic
        self.lock = threading.Lock()
        self.version = 0  # bumped on every change; views redraw when it moves
        self.caches: dict[str, PrefixCache] = {s.name: PrefixCache() for s in streams}
        self.max_events = max_events
        self._events: deque[tuple] = deque()  # (instance, rank, seq, ts, events): rows built when read
        self._num_events = 0
        self._metrics = MetricRows(max_events)  # as added: each URL's thread adds its own
        self._metrics_table: tuple[int, pd.DataFrame] | None = None  # (rows added when built, src.metrics)
        self._listeners: dict[int, Listener] = {}
        self._keys = itertools.count()
        self._subscriber = Subscriber(streams, topic, self._apply, self._reset, hwm, replay_timeout,
                                      max_message_bytes=max_message_bytes)
        self._scraper = MetricsScraper(metrics_urls, metrics_interval, self._add_metrics) if metrics_urls else None

    # ------------------------------------------------------ subscriber side
    def _apply(self, s: Stream, seq: int, batch: Batch) -> None:
        rank = batch.data_parallel_rank if batch.data_parallel_rank is not None else s.data_parallel_rank
        with self.lock:
            self.caches[s.name].apply(batch.events)
            self._events.append((s.instance, rank, seq, batch.ts, batch.events))
            self._num_events += len(batch.events)
            while self._num_events > self.max_events and len(self._events) > 1:
                self._num_events -= len(self._events.popleft()[4])
            self.version += 1
        self._notify(s.name, seq)

    def _reset(self, s: Stream) -> None:
        with self.lock:
            self.caches[s.name].reset()
            self.version += 1

    def _add_metrics(self, rows: list[tuple]) -> None:
        with self.lock:
            self._metrics.extend(rows)
            self.version += 1

    def _notify(self, name: str, seq: int) -> None:
        for key, fn in list(self._listeners.items()):
            try:
                fn(name, seq)
            except Exception:  # reported and detached, like a hook: a broken listener must not stop the stream
                warn_detached(fn, "attach listener")
                self._listeners.pop(key, None)

    def add_listener(self, fn: Listener) -> ListenerHandle:
        """Call ``fn(instance, seq)`` in the subscriber thread after each applied batch (holding no lock).

        A listener that raises is reported with a RuntimeWarning and detached."""
        if not callable(fn):
            raise TypeError(f"listener must be callable, got {type(fn).__name__}")
        key = next(self._keys)
        self._listeners[key] = fn
        return ListenerHandle(self._listeners, key)

    # ------------------------------------------------------------- tables
    @property
    def instances(self) -> list[str]:
        """Each publisher's name: the instance, plus ``/dp<r>`` for a data-parallel rank."""
        return list(self.caches)

    @property
    def num_events(self) -> int:
        """Events held for :attr:`events` (without building the table)."""
        return self._num_events

    @property
    def events(self) -> pd.DataFrame:
        """Every cache event received (about the last ``max_events``, whole batches): instance, rank,
        seq, ts, then vLLM's fields."""
        with self.lock:
            batches = list(self._events)
        return frame(SCHEMAS["events"], [(*head, *event_row(ev)) for *head, events in batches for ev in events])

    @property
    def blocks(self) -> pd.DataFrame:
        """The blocks each instance holds now, by hash, with depth in its prefix chain and token ids."""
        rows = []
        with self.lock:
            for s in self.streams:
                cache = self.caches[s.name]
                depth = _depths(cache)
                for key in cache.blocks:
                    (h, medium, group), b = key, cache.block(key)
                    rows.append((s.instance, s.data_parallel_rank, h, b.parent_block_hash, depth[key], b.token_ids,
                                 b.block_size, medium, b.lora_name, group, b.extra_keys))
        return frame(SCHEMAS["blocks"], rows)

    def block_hashes(self, instance: str) -> set[Hashable]:
        """The content hashes ``instance`` (one of :attr:`instances`) holds now."""
        cache = self.caches.get(instance) if isinstance(instance, str) else None
        if cache is None:
            raise ValueError(f"instance must be one of {self.instances}, got {instance!r}")
        with self.lock:
            return cache.hashes()

    @property
    def metrics(self) -> pd.DataFrame:
        """One row per scrape and engine, in ``time_s`` order: vLLM's queue, KV usage, prefix-cache
        and preemption metrics (the last ``max_events`` rows added).

        Each URL is scraped in its own thread, which adds a scrape's rows once its page is parsed, so
        rows of different URLs are added out of time order (a long page's after later rows of a short
        one); the sort is stable, so a scrape's rows keep their rank order and each instance its
        scrape order. The table is built once per change, and each read gets its own copy of it."""
        with self.lock:
            added, table = self._metrics.added, self._metrics_table
            columns = self._metrics.columns() if table is None or table[0] != added else None
        if columns is not None:
            table = self._metrics_table = (added, metrics_frame(columns))
        return table[1].copy()  # (changing one read changes no other)

    def metric_rows(self, start: int = 0, stop: int | None = None) -> MetricColumns:
        """The metric rows numbered ``start .. stop - 1`` that are still held, as numpy columns in the
        order added. Rows are numbered from 0 as they are added, over the source's life, so a reader
        that asks from the number after the last row it read gets only the rows added since
        (``first`` says which rows were dropped meanwhile)."""
        with self.lock:
            return self._metrics.columns(start, stop)

    @property
    def faults(self) -> pd.DataFrame:
        """Per instance, every fault counter (:data:`kvscope.attach.subscriber.FAULTS`), the
        removals of blocks its rebuilt cache never held, and scrape errors.

        A counter saturates at the int64 column's largest value (sequence numbers that jump by
        nearly 2**63 more than once can count more missed batches than it holds)."""
        errors = self._scraper.errors if self._scraper is not None else {}
        return frame(SCHEMAS["faults"], [
            (s.instance, s.data_parallel_rank, *(min(s.faults[f], INT64_MAX) for f in FAULTS),
             self.caches[s.name].unknown_removes, errors.get(s.instance, 0))
            for s in self.streams
        ])

    def overlap(self) -> pd.DataFrame:
        """One row per content hash held anywhere: which instances hold it (a KV-aware router's question)."""
        holders: dict[Hashable, list[str]] = {}
        with self.lock:
            for name, cache in self.caches.items():
                for h in cache.hashes():
                    holders.setdefault(h, []).append(name)
        return frame(SCHEMAS["overlap"], [(h, len(names), sorted(names)) for h, names in holders.items()])

    def overlap_matrix(self) -> pd.DataFrame:
        """Blocks held by both instances of each pair (the diagonal: each instance's own count)."""
        with self.lock:
            sets = {name: cache.hashes() for name, cache in self.caches.items()}
        names = list(sets)
        return pd.DataFrame([[len(sets[a] & sets[b]) for b in names] for a in names], index=names, columns=names)

    def duplication(self) -> dict[str, float]:
        """``total_blocks`` held over all instances, ``unique_blocks`` (distinct hashes),
        ``duplicated_blocks`` (copies beyond the first) and ``duplicated_fraction`` of the total."""
        counts = self.overlap()["num_instances"]
        total, unique = int(counts.sum()), len(counts)
        return {"total_blocks": total, "unique_blocks": unique, "duplicated_blocks": total - unique,
                "duplicated_fraction": (total - unique) / total if total else 0.0}

    # ---------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Stop the subscriber and the scraper; the tables keep what was received."""
        if self._scraper is not None:
            self._scraper.close()
        self._subscriber.close()

    def __enter__(self) -> "Attached":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<kvscope.Attached {', '.join(self.instances)} topic={self.topic!r}>"


def _depths(cache: PrefixCache) -> dict[Any, int]:
    """Each held block's depth: the held ancestors above it (an orphan, whose parent was evicted, is a root)."""
    blocks, depth = cache.blocks, {}
    for key in blocks:
        chain, seen, k = [], set(), key
        while k in blocks and k not in depth and k not in seen:  # ``seen``: a malformed stream may loop
            chain.append(k)
            seen.add(k)
            ev, i = blocks[k]
            k = (ev.parent_block_hash if i == 0 else ev.block_hashes[i - 1], k[1], k[2])
        d = depth.get(k, -1)
        for c in reversed(chain):
            d += 1
            depth[c] = d
    return depth
