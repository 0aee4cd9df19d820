"""Ctrl-C lands between two engine transitions, never inside one.

Python raises ``KeyboardInterrupt`` wherever the main thread happens to be, so a Ctrl-C in
the middle of a step could leave a block allocated to nobody or a request in no queue. While
:func:`deferred_interrupts` is active the SIGINT handler only notes the signal; when the
outermost block ends, the caller's handler runs (by default: ``KeyboardInterrupt`` is raised),
so the interrupt arrives with the engine in a consistent state.

A hook may raise ``KeyboardInterrupt`` or ``SystemExit`` itself (to stop a run) in any
thread: :func:`hold` keeps it the same way, and the outermost block of that thread raises it.
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
_thread = threading.local()  # per thread: ``depth`` of nested blocks, ``raised``: the exception a hook raised


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold SIGINT (in the main thread; elsewhere Python never delivers it) and what a hook
    raises through :func:`hold` (in any thread) for the duration of the block."""
    depth = getattr(_thread, "depth", 0)
    # Every step swaps the handler twice, so the swaps go through the C core (see the import).
    swap = not depth and threading.current_thread() is threading.main_thread()
    previous = _signal.signal(signal.SIGINT, _hold) if swap else None
    _thread.depth = depth + 1
    try:
        yield
    finally:
        _thread.depth = depth
        if swap:
            _signal.signal(signal.SIGINT, previous)
        if not depth:
            raised, _thread.raised = getattr(_thread, "raised", None), None
            signalled = swap and bool(_held)
            if swap:
                _held.clear()
            if raised is not None:
                try:
                    raise raised
                finally:  # this frame is in the traceback: holding the exception would be a cycle
                    raised = None
            if signalled:
                _deliver(previous)


def _hold(signum: int, frame: object) -> None:
    _held.append(signum)


def hold(exc: BaseException) -> None:
    """Raise ``exc`` (a hook's ``KeyboardInterrupt`` or ``SystemExit``) when this thread's
    outermost block ends, as a held Ctrl-C is (the first one, if several); at once outside
    any block."""
    if not getattr(_thread, "depth", 0):
        raise exc
    if getattr(_thread, "raised", None) is None:
        _thread.raised = exc


def interrupt_pending() -> bool:
    """Whether a held Ctrl-C or hook exception will be raised when the current (outermost)
    block ends, so the operation running in it can put its result aside before its caller gets
    the exception instead. Inside a nested block the result still reaches its caller: False
    there. A Ctrl-C only ever reaches the main thread."""
    if getattr(_thread, "depth", 0) != 1:
        return False
    return getattr(_thread, "raised", None) is not None or (
        bool(_held) and threading.current_thread() is threading.main_thread())


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
