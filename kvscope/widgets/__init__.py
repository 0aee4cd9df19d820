"""Jupyter views of the engine, live or replayed: ``kvscope.dashboard(llm_or_trace)``.

Each view works alone (``BlockPoolView(trace, step)``); :class:`Dashboard` composes them.
``export_html(trace, path)`` writes a static page that opens without a kernel.
:class:`AttachDashboard` shows a ``kvscope.attach`` source (docs/ATTACH.md).
"""
from kvscope.widgets.attach_view import AttachDashboard
from kvscope.widgets.dashboard import Dashboard, dashboard
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
    "AttachDashboard", "Dashboard", "dashboard", "export_html",
    "BlockPoolView", "BlockTablesView", "LifecycleView", "QueuesView", "SlotMappingView", "TimelineView",
]
