"""Jupyter views of the engine, live or replayed: ``kvscope.dashboard(llm_or_trace)``.

Each view works alone (``BlockPoolView(trace, step)``); :class:`Dashboard` composes them.
``export_html(trace, path)`` writes a static page that opens without a kernel.
"""
from kvscope.widgets.dashboard import Dashboard, dashboard
from kvscope.widgets.demo import demo, demo_prompts
from kvscope.widgets.export import export_html
from kvscope.widgets.views import (
    BlockPoolView,
    BlockTablesView,
    LifecycleView,
    QueuesView,
    SlotMappingView,
    TimelineView,
)

__all__ = [
    "Dashboard", "dashboard", "demo", "demo_prompts", "export_html",
    "BlockPoolView", "BlockTablesView", "LifecycleView", "QueuesView", "SlotMappingView", "TimelineView",
]
