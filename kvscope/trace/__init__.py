"""The trace layer: named hooks, per-step records and pandas views of scheduler and KV state.

Hooks need nothing beyond the standard library (the engine always imports them); the records
and DataFrames need pandas and pyarrow (the notebook extra), so they load on first use.
"""
from kvscope.engine.hooks import HOOK_POINTS, HookRegistry

__all__ = ["Trace", "Recorder", "StepRecord", "HookRegistry", "HOOK_POINTS", "LEVELS"]

_LAZY = {"Trace": "kvscope.trace.trace", "Recorder": "kvscope.trace.recorder",
         "LEVELS": "kvscope.trace.recorder", "StepRecord": "kvscope.trace.record"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvscope.trace' has no attribute {name!r}")
