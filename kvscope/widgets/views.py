"""The dashboard's views. Each one is usable alone: ``BlockPoolView(trace, step)`` shows one
step of a trace, and ``view.update_from(trace, step)`` moves it to another.

The four custom views are anywidgets (an ES module per view, traitlets synced, the block
pool as binary buffers); the timeline is a plotly ``FigureWidget``. All of them read only
the trace, through :mod:`kvscope.widgets.snapshot`.
"""
from __future__ import annotations

import threading
from importlib import resources
from typing import Any, Callable

import anywidget
import ipywidgets as W
import numpy as np
import plotly.graph_objects as go
import traitlets
from plotly.subplots import make_subplots

from kvscope.arg_checks import is_index
from kvscope.widgets import snapshot
from kvscope.widgets.pool_sync import KEYFRAME, PoolSync, PoolUpdate
from kvscope.widgets.snapshot import TIMELINE_COLUMNS, StepData, StepSeries

STATIC = resources.files("kvscope.widgets") / "static"
CSS = (STATIC / "style.css").read_text()


def kv_pool_label(meta: dict) -> str:
    """Header text naming the KV pool's element type and bytes per block, so an fp8 pool is
    visible at a glance; empty when the trace has no pool (a null executor)."""
    if not meta.get("kv_cache_dtype"):
        return ""
    return f" · KV {meta['kv_cache_dtype']}, {meta['bytes_per_block']:,} B/block"


def esm_source(view: str) -> str:
    """The ES module of one view: the shared helpers followed by the view's own code."""
    return (STATIC / "common.js").read_text() + "\n" + (STATIC / f"{view}.js").read_text()


class _ShowsSteps:
    """What every view offers: built on a step of a trace, moved by ``update_from`` or ``show``."""

    def _start(self, trace: Any, step: int | None) -> None:
        """Show ``step`` of ``trace``, by default its newest; a trace with no step yet shows nothing."""
        if trace is not None and (step is not None or trace.step_ids):
            self.update_from(trace, trace.step_ids[-1] if step is None else step)

    def update_from(self, trace: Any, step: int) -> None:
        """Show ``step`` of ``trace``, one of its ``step_ids``."""
        ids = trace.step_ids
        if not (is_index(step) and step in ids):
            span = f"{ids[0]}..{ids[-1]}" if ids else "none yet"
            raise ValueError(f"step must be one of trace.step_ids (recorded steps: {span}), got {step!r}")
        self.show(StepData(trace, step))

    def show(self, data: StepData) -> None:
        raise NotImplementedError


class _StepView(_ShowsSteps, anywidget.AnyWidget):
    """An anywidget showing one step of a trace; subclasses name their snapshot function."""

    _css = traitlets.Unicode(CSS).tag(sync=True)
    step = traitlets.Int(-1).tag(sync=True)
    selected_request = traitlets.Unicode("").tag(sync=True)
    snapshot_fn: Callable[[StepData], dict[str, Any]]

    def __init__(self, trace: Any = None, step: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.trace = None
        self._start(trace, step)

    def show(self, data: StepData) -> None:
        """Show one step; all changed traits go to the browser in one message."""
        state = type(self).snapshot_fn(data)
        self.trace = data.trace
        with self.hold_sync():
            for name, value in state.items():
                setattr(self, name, value)


class _CarriesTables(traitlets.HasTraits):
    """The block tables as the browser reads them (``kvsDecodeTables``): request ids, and one
    int32 buffer of every table's blocks, refcounts and tokens (``snapshot.encode_tables``)."""

    table_ids = traitlets.List(traitlets.Unicode()).tag(sync=True)
    tables = traitlets.Bytes(b"").tag(sync=True)


class BlockPoolView(_CarriesTables, _StepView):
    """The KV pool on one canvas: free, used (shaded by refcount), cached, at any pool size.

    A pool larger than the canvas is drawn as an overview, one cell per bucket of blocks
    coloured by its highest state; drag to zoom into a range, down to single blocks, or tick
    "live only" to see just the used and cached blocks. Hover a block for its id, refcount,
    hash, tokens and owners; click it to select its request (clicking a shared block again
    cycles through its owners). Updates carry only the blocks that changed
    (:mod:`kvscope.widgets.pool_sync`).
    """

    _esm = traitlets.Unicode(esm_source("pool")).tag(sync=True)
    snapshot_fn = staticmethod(snapshot.pool_state)
    block_size = traitlets.Int(0).tag(sync=True)
    num_blocks = traitlets.Int(0).tag(sync=True)
    delta = traitlets.Bytes(b"").tag(sync=True)   # the blocks changed since version ``delta_base``
    delta_base = traitlets.Int(KEYFRAME).tag(sync=True)
    version = traitlets.Int(0).tag(sync=True)     # the version the browser holds after ``delta``
    selected_block = traitlets.Int(-1).tag(sync=True)
    max_height = traitlets.Int(360).tag(sync=True)

    def __init__(self, trace: Any = None, step: int | None = None, **kwargs: Any) -> None:
        self.pool_sync = PoolSync()
        # hold_sync is per widget, not per thread: a resync (kernel thread) during an update
        # (dashboard thread) would lose its traits, so the two take turns
        self._sending = threading.RLock()
        super().__init__(trace, step, **kwargs)
        self.on_msg(self._on_msg)

    def show(self, data: StepData) -> None:
        """Show one step: its traits and the blocks that changed, in one message."""
        self.trace = data.trace
        with self._sending, self.hold_sync():
            update = self.pool_sync.update(*snapshot.pool_arrays(data))
            for name, value in snapshot.pool_state(data).items():
                setattr(self, name, value)
            self._set_update(update)

    def _set_update(self, update: PoolUpdate) -> None:
        self.delta, self.delta_base, self.version = update

    def _on_msg(self, _widget: Any, content: dict[str, Any], _buffers: list[bytes]) -> None:
        kind = content.get("type")
        if kind == "resync":  # a view that attached late, or missed an update
            with self._sending, self.hold_sync():
                self._set_update(self.pool_sync.keyframe())
        # The browser asks for the tokens of a hovered block; they are not sent up front
        # because a large pool would make every update heavy.
        elif kind == "inspect" and self.trace is not None:
            step = int(content["step"])
            # A live ring buffer may have dropped the step the browser showed: no facts, and no
            # traceback in the notebook (ipywidgets shows a handler's); ``held`` tells the browser
            # to say so rather than wait for facts. Held while read: it is not dropped meanwhile.
            with self.trace.hold_steps():
                held = step in self.trace.step_ids
                details = snapshot.block_details(StepData(self.trace, step), content["blocks"]) if held else {}
            self.send({"type": "details", "step": step, "held": held, "blocks": details})


class BlockTablesView(_CarriesTables, _StepView):
    """Per request, logical block -> physical block, with shared blocks (ref > 1) marked.

    Alone, the view sends the tables as the pool view does (binary, not a JSON list per block).
    Given a ``pool`` view (the dashboard gives it its own), the browser reads them from the
    pool's update of the same step instead, so the block tables go to the browser once: such a
    view sends only its step, and shows it together with its pool view.
    """

    _esm = traitlets.Unicode(esm_source("tables")).tag(sync=True)
    snapshot_fn = staticmethod(snapshot.tables_state)
    pool = traitlets.Instance(BlockPoolView, allow_none=True).tag(sync=True, **W.widget_serialization)

    def show(self, data: StepData) -> None:
        """Show one step: its tables when alone, only the step when the pool view carries them."""
        if self.pool is None:
            super().show(data)
            return
        self.trace = data.trace
        self.step = data.step


class SlotMappingView(_StepView):
    """The step's tokens -> slots (block, offset), for prefill chunks and decode rows alike."""

    _esm = traitlets.Unicode(esm_source("slots")).tag(sync=True)
    snapshot_fn = staticmethod(snapshot.slots_state)
    block_size = traitlets.Int(0).tag(sync=True)
    groups = traitlets.List().tag(sync=True)


class QueuesView(_StepView):
    """Running and waiting queues, preemptions, token-budget use and a KV usage gauge."""

    _esm = traitlets.Unicode(esm_source("queues")).tag(sync=True)
    snapshot_fn = staticmethod(snapshot.queues_state)
    queues = traitlets.Dict().tag(sync=True)


class LifecycleView(_StepView):
    """One row per request across steps: waiting, prefill chunks (the cached prefix apart),
    decode, preempted, recompute, finished or aborted; from ``Trace.lifecycle``. Hover a row
    for the request's TTFT, ITL, tokens, cached tokens and preemptions; click it to select the
    request (linked with the pool and the block tables)."""

    _esm = traitlets.Unicode(esm_source("lifecycle")).tag(sync=True)
    snapshot_fn = staticmethod(snapshot.lifecycle_state)
    first_step = traitlets.Int(0).tag(sync=True)
    last_step = traitlets.Int(0).tag(sync=True)
    states = traitlets.List().tag(sync=True)
    requests = traitlets.List().tag(sync=True)
    intervals = traitlets.Bytes(b"").tag(sync=True)
    _steps_shown: tuple[int, int, int] | None = None  # (count, first, last) of the steps the lanes cover

    def show(self, data: StepData) -> None:
        """Move the step marker; rebuild the lanes only when the trace's steps changed (they
        cover every step, so scrubbing a replay of thousands of requests rebuilt the same
        lanes at each step)."""
        ids = data.trace.step_ids
        steps = (len(ids), ids[0], ids[-1]) if ids else None
        if data.trace is self.trace and steps == self._steps_shown:
            self.step = data.step
        else:
            super().show(data)
            self._steps_shown = steps


# --------------------------------------------------------------------------- timeline
TIMELINE_SERIES = (  # (column of timeline_frame, label, subplot row, secondary y, kind)
    ("prefill_tokens", "prefill tokens", 1, False, "bar"),
    ("decode_tokens", "decode tokens", 1, False, "bar"),
    ("kv_usage_pct", "KV usage %", 2, False, "line"),
    ("prefix_hit_pct", "prefix hit rate % (cumulative)", 2, False, "line"),
    ("preemptions", "preemptions", 3, False, "bar"),
    ("latency_ms", "step latency ms", 3, True, "line"),
)


def timeline_frame(series: StepSeries, max_points: int = 1500) -> dict[str, np.ndarray]:
    """The timeline's per-step columns, averaged over bins of consecutive steps: one point per
    step up to ``max_points`` steps; beyond, bins of a power-of-two width from the first step, the
    narrowest that needs at most ``max_points`` (at most the series' own ``max_points``: its bins
    are merged, never split), so a point means the same whether the run is live or replayed."""
    sums, counts = series.bins()
    width = 1
    while -(-len(counts) // width) > max_points:
        width *= 2
    if width > 1:
        starts = np.arange(0, len(counts), width)
        sums, counts = np.add.reduceat(sums, starts, axis=0), np.add.reduceat(counts, starts)
    means = sums / counts[:, None] if len(counts) else sums
    return {c: means[:, i] for i, c in enumerate(TIMELINE_COLUMNS)}


def timeline_figure(trace: Any | None = None, height: int = 420) -> go.Figure:
    """The timeline as a plain plotly figure (the static export draws this one)."""
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        specs=[[{}], [{}], [{"secondary_y": True}]],
                        subplot_titles=("tokens per step", "KV usage and prefix hits (%)", "preemptions and step latency (ms) per step"))
    data = timeline_frame(StepSeries(trace)) if trace is not None else None
    for col, label, row, secondary, kind in TIMELINE_SERIES:
        x = data["step"] if data else []
        y = data[col] if data else []
        trace_obj = go.Bar(x=x, y=y, name=label) if kind == "bar" else go.Scatter(x=x, y=y, name=label, mode="lines")
        fig.add_trace(trace_obj, row=row, col=1, secondary_y=secondary if row == 3 else None)
    fig.update_layout(barmode="stack", height=height, margin=dict(l=50, r=50, t=40, b=50),
                      legend=dict(orientation="h", y=-0.06, yanchor="top", font=dict(size=11)),
                      hovermode="x unified",
                      shapes=[dict(type="line", xref="x", yref="paper", x0=0, x1=0, y0=0, y1=1,
                                   line=dict(color="#e63946", width=1, dash="dot"), visible=False)])
    return fig


class TimelineView(_ShowsSteps, go.FigureWidget):
    """One chart over steps: prefill/decode tokens, KV usage, prefix hit rate, preemptions, latency.

    A dotted line marks the step the other views show.
    """

    def __init__(self, trace: Any = None, step: int | None = None, height: int = 420) -> None:
        super().__init__(timeline_figure(height=height))
        self._last_step_seen: int | None = None
        self._start(trace, step)

    def show(self, data: StepData) -> None:
        """Refresh the series when the trace has new steps; always move the step marker."""
        last = data.series.last_step
        with self.batch_update():
            if last != self._last_step_seen:
                series = timeline_frame(data.series)
                for trace_obj, (col, *_rest) in zip(self.data, TIMELINE_SERIES):
                    trace_obj.x, trace_obj.y = series["step"], series[col]
                self._last_step_seen = last
            self.layout.shapes[0].update(x0=data.step, x1=data.step, visible=True)


VIEW_CLASSES: dict[str, type] = {
    "pool": BlockPoolView,
    "tables": BlockTablesView,
    "slots": SlotMappingView,
    "queues": QueuesView,
    "lifecycle": LifecycleView,
    "timeline": TimelineView,
}
