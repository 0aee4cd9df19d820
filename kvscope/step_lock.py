"""The lock an ``LLM`` holds around each engine step, fair to threads waiting between steps.

A thread that steps the engine in a loop (``generate``, a dashboard's background run) releases
the lock after each step and takes it again at once: a plain lock lets it win that race every
time, so a notebook's ``add_request`` or ``llm.record()`` from another thread would wait for the
whole run. :meth:`StepLock.let_waiters_in` closes the gap: the stepping thread calls it between
two steps and goes on only once every thread that was waiting has had its turn.
"""
from __future__ import annotations

import threading
import time

_POLL_S = 0.0002  # how often a stepping thread looks again whether its waiters got in


class StepLock:
    """A re-entrant lock that counts the threads blocked on it."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._count_lock = threading.Lock()
        self._waiting = 0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        got = self._lock.acquire(blocking=False)
        if not got and blocking:
            with self._count_lock:
                self._waiting += 1
            try:
                got = self._lock.acquire(timeout=timeout)
            finally:
                with self._count_lock:
                    self._waiting -= 1
        return got

    def release(self) -> None:
        self._lock.release()

    def held_here(self) -> bool:
        """Whether this thread holds the lock (a hook's nested call runs inside an outer hold)."""
        return self._lock._is_owned()  # (what threading.Condition asks an RLock too)

    def __enter__(self) -> "StepLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def let_waiters_in(self, timeout: float) -> None:
        """Wait until every thread blocked on the lock has taken it (each then holds it for its
        own short call), or ``timeout`` seconds. Only once this thread has let go of the lock:
        inside a hook's nested call nobody can get in before the outer step ends."""
        deadline = time.monotonic() + timeout
        while self._waiting and time.monotonic() < deadline:
            time.sleep(_POLL_S)
