"""Keep CPython's cyclic garbage collector off the heap that existed when a recording started.

A recording keeps what it records (a ``blocks`` one makes a tuple per block event before
packing them), and a live dashboard also rebuilds views in a second thread. The objects they
make drive the collector to run full (oldest-generation) collections now and then, and each
one walks the whole interpreter heap (torch, transformers, pandas and the widgets are hundreds
of thousands of objects) while holding the interpreter lock: the engine's step loop stalls for
all of it. ``gc.freeze()`` moves what exists into the permanent generation, so those
collections walk only what was made since. vLLM freezes its engine's startup heap the same way.

Frozen objects are never collected as cyclic garbage, so the heap thaws when the last holder
lets go. A live dashboard then runs the one full collection that was put off, in ``detach``,
not in the middle of the next ``generate``; a recording leaves it to the collector's own
schedule, so stopping one costs nothing. A freeze the program made itself is left alone.

:func:`collector_paused` keeps the collector off while a trace is built in bulk (``Trace.load``):
the objects it makes are not garbage, yet they set off collections, full ones among them, that
walk them all again and again as the heap grows.
"""
from __future__ import annotations

import contextlib
import gc
import threading
from typing import Iterator

_lock = threading.Lock()
_holders = 0
_frozen_here = False
_pausers = 0
_paused_enabled = False  # whether the collector was on when the first pauser came


def hold() -> None:
    """One more holder (a recording, a live dashboard): freeze the heap if this is the first
    and nothing else froze it."""
    global _holders, _frozen_here
    with _lock:
        _holders += 1
        if _holders == 1 and gc.get_freeze_count() == 0:
            gc.freeze()
            _frozen_here = True


def release(collect: bool) -> None:
    """One holder fewer: after the last, thaw what :func:`hold` froze, and then run a full
    collection if ``collect``."""
    global _holders, _frozen_here
    with _lock:
        _holders -= 1
        thaw = _holders == 0 and _frozen_here
        if thaw:
            gc.unfreeze()
            _frozen_here = False
    if thaw and collect:
        gc.collect()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic collector off inside (it is process-wide): the last of overlapping pauses, from
    any thread, leaves it as the first found it, also when the body raises. Cyclic garbage made
    meanwhile waits for the first collection after."""
    global _pausers, _paused_enabled
    with _lock:
        if _pausers == 0:
            _paused_enabled = gc.isenabled()
            gc.disable()
        _pausers += 1
    try:
        yield
    finally:
        with _lock:
            _pausers -= 1
            if _pausers == 0 and _paused_enabled:
                gc.enable()
