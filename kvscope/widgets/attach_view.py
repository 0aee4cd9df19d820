"""``kvscope.dashboard(attached)``: the views that fit what vLLM's KV events carry.

vLLM names cached blocks by content hash, without physical ids or refcounts, so the attach
dashboard shows each instance's prefix forest, the overlap between instances, the stream's
fault counters and the metric timelines; the block pool, block tables, slot mapping and
per-request queues say that this source cannot fill them. It reads only the
:class:`~kvscope.attach.attached.Attached`'s public tables, and redraws from a daemon thread
at most every ``interval`` seconds while events or scrapes arrive.
"""
from __future__ import annotations

import json
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable

import anywidget
import ipywidgets as W
import plotly.graph_objects as go
import traitlets
from plotly.subplots import make_subplots

from kvscope.arg_checks import check_int
from kvscope.widgets import attach_snapshot as snap
from kvscope.widgets.metric_bins import MetricBins
from kvscope.widgets.options import check_interval, view_names
from kvscope.widgets.views import CSS, esm_source

ATTACH_VIEWS = ("cache", "timeline")


class AttachView(anywidget.AnyWidget):
    """Prefix forests per instance, cross-instance overlap, fault counters (one canvas per instance)."""

    STATE = ("title", "forest", "overlap", "faults", "unavailable")  # the synced traits the module draws

    _esm = traitlets.Unicode(esm_source("attach")).tag(sync=True)
    _css = traitlets.Unicode(CSS).tag(sync=True)
    title = traitlets.Unicode("").tag(sync=True)
    forest = traitlets.Dict().tag(sync=True)
    overlap = traitlets.Dict().tag(sync=True)
    faults = traitlets.List().tag(sync=True)
    unavailable = traitlets.Dict().tag(sync=True)

    def show(self, attached: Any, decode: Callable[[list[int]], str] | None, max_nodes: int) -> None:
        n = len(attached.instances)
        with self.hold_sync():
            self.title = f"{n} attached instance{'s' if n != 1 else ''} \u00b7 topic {attached.topic!r}"
            self.forest = snap.forest_state(attached, decode, max_nodes)
            self.overlap = snap.overlap_state(attached)
            self.faults = snap.faults_state(attached)


METRIC_PLOTS = (  # (series key, subplot row, label)
    ("running", 1, "running"), ("waiting", 1, "waiting"), ("kv_usage_pct", 2, "KV usage %"),
    ("hit_rate_pct", 2, "prefix hit rate %"), ("preemptions", 3, "preemptions"),
)


def _js(value: Any) -> str:
    """``value`` as a JavaScript literal that is safe inside a <script> element."""
    return json.dumps(value).replace("</", "<\\/")


class MetricsTimelineView(go.FigureWidget):
    """Per instance, from the Prometheus scrapes: queues, KV usage, prefix hit rate, preemptions.

    Its series (:class:`~kvscope.widgets.metric_bins.MetricBins`) take in only the rows added
    since the last update, so an update costs those and the points drawn, not the whole table."""

    def __init__(self, height: int = 420, max_points: int = 1500) -> None:
        fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.07,
                            subplot_titles=("requests running / waiting", "KV usage and prefix hit rate (%)",
                                            "preemptions per scrape"))
        fig.update_layout(height=height, margin=dict(l=50, r=30, t=40, b=40), hovermode="x unified",
                          legend=dict(orientation="h", y=-0.08, yanchor="top", font=dict(size=11)))
        fig.update_xaxes(title_text="time (s since attach)", row=3, col=1)
        super().__init__(fig)
        self._keys: list[str] = []
        self._max_points = max_points
        self._bins: MetricBins | None = None

    @property
    def bins(self) -> MetricBins | None:
        """The series drawn (None until the first :meth:`show`)."""
        return self._bins

    def show(self, attached: Any, t0: float) -> None:
        """Draw ``attached``'s metrics, times from ``t0`` (a new source or ``t0`` starts the series anew)."""
        if self._bins is None or self._bins.attached is not attached or self._bins.origin != t0:
            self._bins = MetricBins(attached, t0, self._max_points)
        self._bins.update()
        series = self._bins.series()
        with self.batch_update():
            if list(series) != self._keys:  # a new instance: one trace per (instance, series)
                self.data = []
                for key in series:
                    for col, row, label in METRIC_PLOTS:
                        self.add_scatter(x=[], y=[], mode="lines", name=f"{key} {label}", row=row, col=1)
                self._keys = list(series)
            for i, s in enumerate(series.values()):
                for j, (col, *_rest) in enumerate(METRIC_PLOTS):
                    trace_obj = self.data[i * len(METRIC_PLOTS) + j]
                    trace_obj.x, trace_obj.y = s["time_s"], s[col]


class AttachDashboard:
    """The attach views over one :class:`~kvscope.attach.attached.Attached`, updated live until :meth:`detach`.

    ``views`` picks from ``"cache"`` (forests, overlap, faults) and ``"timeline"``; asking for a
    view that needs physical block ids (``"pool"``, ``"tables"``, ``"slots"``, ``"queues"``)
    shows why a vLLM source cannot fill it. ``tokenizer`` (anything with ``decode``) adds text to
    the token ids on hover.
    """

    def __init__(self, attached: Any, views: Iterable[str] | str = ATTACH_VIEWS, interval: float = 0.5,
                 tokenizer: Any = None, max_nodes: int = 5000) -> None:
        views = view_names(views)
        unknown = set(views) - set(ATTACH_VIEWS) - set(snap.NEEDS_BLOCK_IDS)
        if unknown:
            raise ValueError(f"unknown views {sorted(unknown)} for an attached source; choose from "
                             f"{', '.join(ATTACH_VIEWS)}")
        self.attached, self.interval = attached, check_interval(interval)
        self.max_nodes = check_int("max_nodes", max_nodes)
        self.decode = tokenizer.decode if tokenizer is not None else None
        self.t0 = time.time()
        self.cache = AttachView(unavailable=dict(snap.NEEDS_BLOCK_IDS))
        self.timeline = MetricsTimelineView() if "timeline" in views else None
        self.status = W.HTML()
        show_cache = "cache" in views or bool(set(views) & set(snap.NEEDS_BLOCK_IDS))  # the latter: to say why not
        parts = [self.status] + ([self.cache] if show_cache else []) + ([self.timeline] if self.timeline else [])
        self.widget = W.VBox(parts, layout=W.Layout(width="100%"))
        self.widget.add_class("kvscope-attach-dashboard")
        self.last_error: str | None = None
        self.num_updates = 0
        self._seen = -1
        self._stop = threading.Event()
        self.refresh()
        self._thread = threading.Thread(target=self._loop, name="kvscope-attach-dashboard", daemon=True)
        self._thread.start()

    def refresh(self) -> None:
        """Redraw from the attached tables now (the live loop calls this when they changed)."""
        version = self.attached.version
        self.cache.show(self.attached, self.decode, self.max_nodes)
        if self.timeline is not None:
            self.timeline.show(self.attached, self.t0)
        self._seen = version
        self.num_updates += 1
        self.status.value = f"{'detached' if self._stop.is_set() else 'live'} \u00b7 {self.attached.num_events} events"

    def _loop(self) -> None:
        cost = 0.0
        while not self._stop.wait(max(self.interval, 4 * cost)):  # a big cache redraws less often
            if self.attached.version == self._seen:
                continue
            start = time.perf_counter()
            try:
                self.refresh()
            except Exception:  # a broken update must never stop the stream or this thread
                self.last_error = traceback.format_exc()
            cost = time.perf_counter() - start

    def to_html(self, path: str | Path) -> Path:
        """Write the cache view as it is now (forests, overlap, faults) as one self-contained page:
        the same ES module, driven by an in-page model, so it opens in any browser without a kernel."""
        state = {k: getattr(self.cache, k) for k in AttachView.STATE}
        script = (f"const state = {_js(state)};\n"
                  "const model = {get: (k) => state[k], on() {}, off() {}};\n"
                  f"const url = URL.createObjectURL(new Blob([{_js(esm_source('attach'))}], {{type: 'text/javascript'}}));\n"
                  "(await import(url)).default.render({model, el: document.getElementById('kvscope-attach')});\n"
                  "document.body.dataset.done = '1';")
        path = Path(path)
        path.write_text(f"<!doctype html><html><head><meta charset='utf-8'><title>kvscope attach</title>"
                        f"<style>{CSS}</style></head><body><div id='kvscope-attach'></div>"
                        f"<script type='module'>\n{script}\n</script></body></html>")
        return path

    def detach(self) -> None:
        """Stop redrawing (the attached subscription keeps running; ``attached.close()`` ends it)."""
        self._stop.set()
        self._thread.join(timeout=self.interval + 5.0)

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        return self.widget._repr_mimebundle_(**kwargs)

    def __enter__(self) -> "AttachDashboard":
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()
