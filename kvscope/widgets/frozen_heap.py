"""Keep CPython's cyclic garbage collector off the heap that existed when a live dashboard attached.

A live dashboard keeps what it records and rebuilds views in a second thread. The objects both
keep make the collector run full (oldest-generation) collections now and then, and each one
walks the whole interpreter heap (torch, transformers, ipywidgets and plotly are hundreds of
thousands of objects) while holding the interpreter lock: the engine's step loop stalls for
all of it. ``gc.freeze()`` moves what exists into the permanent generation, so those
collections walk only what was made since. vLLM freezes its engine's startup heap the same way.

Frozen objects are never collected as cyclic garbage, so the heap thaws when the last live
dashboard detaches, and the one full collection that was put off runs then, in ``detach``,
not in the middle of the next ``generate``. A freeze the program made itself is left alone.
"""
from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_holders = 0
_frozen_here = False


def hold() -> None:
    """One more live dashboard: freeze the heap if this is the first and nothing else froze it."""
    global _holders, _frozen_here
    with _lock:
        _holders += 1
        if _holders == 1 and gc.get_freeze_count() == 0:
            gc.freeze()
            _frozen_here = True


def release() -> None:
    """One live dashboard fewer: after the last, thaw what :func:`hold` froze and collect."""
    global _holders, _frozen_here
    with _lock:
        _holders -= 1
        thaw = _holders == 0 and _frozen_here
        if thaw:
            gc.unfreeze()
            _frozen_here = False
    if thaw:
        gc.collect()
