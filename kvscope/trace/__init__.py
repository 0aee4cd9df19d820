"""The trace layer: named hooks, per-step records and pandas views of scheduler and KV state."""
from kvscope.trace.hooks import HOOK_POINTS, HookRegistry
from kvscope.trace.record import StepRecord
from kvscope.trace.recorder import LEVELS, Recorder
from kvscope.trace.trace import Trace

__all__ = ["Trace", "Recorder", "StepRecord", "HookRegistry", "HOOK_POINTS", "LEVELS"]
