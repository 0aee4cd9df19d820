"""Ctrl-C lands between two engine transitions, never inside one.

Python raises ``KeyboardInterrupt`` wherever the main thread happens to be, so a Ctrl-C in
the middle of a step could leave a block allocated to nobody or a request in no queue. While
:func:`deferred_interrupts` is active the SIGINT handler only notes the signal; when the
outermost block ends, the caller's handler runs (by default: ``KeyboardInterrupt`` is raised),
so the interrupt arrives with the engine in a consistent state.
"""
from __future__ import annotations

import _signal  # signal's C core: its wrapper turns each handler into an enum, via an exception for a function
import contextlib
import functools
import signal
import threading
from typing import Any, Callable, Iterator, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_held: list[int] = []        # signals noted while deferring (main thread only)
_depth = 0


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold SIGINT for the duration of the block (in the main thread; elsewhere Python never
    delivers it, so the block runs as is)."""
    global _depth
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if _depth:
        _depth += 1
        try:
            yield
        finally:
            _depth -= 1
        return
    # Every step swaps the handler twice, so the swaps go through the C core (see the import).
    previous = _signal.signal(signal.SIGINT, _hold)
    _depth = 1
    try:
        yield
    finally:
        _depth = 0
        _signal.signal(signal.SIGINT, previous)
        if _held:
            _held.clear()
            _deliver(previous)


def _hold(signum: int, frame: object) -> None:
    _held.append(signum)


def interrupt_pending() -> bool:
    """Whether a held Ctrl-C will be raised when the current (outermost) block ends, so the
    operation running in it can put its result aside before its caller gets the interrupt
    instead. Inside a nested block the result still reaches its caller: False there, and in
    any thread but the main one, which a Ctrl-C never reaches."""
    return bool(_held) and _depth == 1 and threading.current_thread() is threading.main_thread()


def _deliver(handler: object) -> None:
    """Run the handler that was in place for the SIGINT that arrived meanwhile."""
    if callable(handler):
        handler(signal.SIGINT, None)
    elif handler == signal.SIG_DFL:
        raise KeyboardInterrupt


def atomic(fn: F) -> F:
    """Run ``fn`` with Ctrl-C held until it returns (see :func:`deferred_interrupts`)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with deferred_interrupts():
            return fn(*args, **kwargs)
    return wrapper  # type: ignore[return-value]
