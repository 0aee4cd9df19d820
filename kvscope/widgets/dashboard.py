"""The dashboard: the views composed over one trace, live on an ``LLM`` or replaying a ``Trace``.

Live, the dashboard records the engine (``llm.record``) and adds a trace listener. The listener
runs in the engine's thread and only queues the step's record and wakes an updater thread, so
the engine never waits for the browser. The updater pushes each update as one batch per view,
at most every ``interval`` seconds and rarer when updates are dear (``max_load``).
``generate_async`` runs the engine in a background thread so the kernel stays free, and
Pause / Step / Resume hold that thread between two engine steps; Stop ends its run there.
"""
from __future__ import annotations

import bisect
import html
import threading
import time
import traceback
import weakref
from concurrent.futures import CancelledError, Future, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

import ipywidgets as W

from kvscope.arg_checks import MAX_SECONDS, is_index
from kvscope.trace.trace import Trace
from kvscope.trace import frozen_heap
from kvscope.widgets.options import check_interval, check_max_load, view_names
from kvscope.widgets.snapshot import StepData, StepSeries
from kvscope.widgets.views import VIEW_CLASSES, kv_pool_label

if TYPE_CHECKING:
    from kvscope.widgets.attach_view import AttachDashboard

DEFAULT_VIEWS = ("pool", "queues", "tables", "lifecycle", "slots", "timeline")
SUMMARY_VIEWS = ("timeline",)  # what a recording without blocks can feed


class StepGate:
    """Where a background run waits between steps while paused; ``step_once`` lets one through."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.paused = False
        self._credits = 0
        self.waiting = False

    def wait(self, on_hold: Callable[[], None], stop: threading.Event | None = None) -> None:
        """Return at once unless paused; else call ``on_hold`` and block until let through.
        Once ``stop`` is set it never blocks, so a run being stopped is not held by a Pause that
        comes after the Stop (whoever sets ``stop`` wakes a waiter with :meth:`resume`)."""
        if not self.paused:  # the common case costs one attribute read
            return

        def held() -> bool:
            return self.paused and self._credits == 0 and not (stop is not None and stop.is_set())

        with self._cond:
            if held():
                self.waiting = True
                on_hold()
            while held():
                self._cond.wait()
            if self._credits:
                self._credits -= 1
            self.waiting = False

    def pause(self) -> None:
        with self._cond:
            self.paused = True

    def step_once(self) -> None:
        with self._cond:
            self._credits += 1
            self._cond.notify_all()

    def resume(self) -> None:
        with self._cond:
            self.paused, self._credits, self.waiting = False, 0, False
            self._cond.notify_all()


class _RunStop:
    """One background run's stop: ``requested`` by :meth:`Dashboard.stop`, raised between two
    steps once (``delivered``): not again from the steps the run's abort reads back, which
    under async scheduling include the one launched before the stop."""

    def __init__(self) -> None:
        self.requested = threading.Event()
        self.delivered = False


class _Stopped(KeyboardInterrupt):
    """What :meth:`Dashboard.stop` raises between two steps of the background run: a Ctrl-C to
    ``LLM.generate`` (which aborts its requests), told apart from a hook's own Ctrl-C."""


def _cancelled(stop: _Stopped) -> CancelledError:
    """What a stopped run's Future raises: a Future's own word for a run that did not finish."""
    error = CancelledError("the background run was stopped by Dashboard.stop(); the steps it ran stay in the trace")
    error.__cause__ = stop
    return error


class Dashboard:
    """Block pool, queues, block tables, request lifecycle, slot mapping and timeline over one trace.

    ``Dashboard(llm)`` is live: every later ``llm.generate`` (in any cell) updates it, until
    :meth:`detach`, or until a new run of the Jupyter cell that made it (which replaced its
    output) makes another live dashboard. ``Dashboard(trace)`` replays a recorded or loaded
    trace with a step slider.
    Display it like any widget (the last expression of a cell, or ``display(dash)``).

    ``views`` picks the views (a list of names, or one str of names separated by commas;
    default: all of them, or the timeline alone for a ``"summary"`` recording); ``level`` and
    ``max_steps`` go to ``llm.record`` (the block views need ``"blocks"`` or ``"full"``;
    ``"full"`` adds a whole-pool copy per step, which makes jumping back in a long replay
    cheaper but costs ``num_blocks * 16`` bytes per step). Live updates come at most every
    ``interval`` seconds, and rarer when updating would take more than ``max_load`` of the
    wall time: the updater shares the interpreter lock with the engine, so the time it spends
    is roughly what the engine loses. While live, the heap that existed when it attached is
    frozen for the garbage collector (see ``frozen_heap``).
    """

    def __init__(
        self,
        source: Any,
        views: Iterable[str] | str | None = None,
        level: str = "blocks",
        max_steps: int = 2000,
        interval: float = 0.25,
        max_load: float = 0.02,
    ) -> None:
        if not (hasattr(source, "record") or isinstance(source, Trace)):
            raise TypeError(f"dashboard source must be an LLM (live) or a kvscope.Trace (replay), "
                            f"got {type(source).__name__}")
        if isinstance(source, Trace):  # (a replay shows the level it was recorded at)
            level = source.level
        views = view_names(views if views is not None else SUMMARY_VIEWS if level == "summary" else DEFAULT_VIEWS)
        unknown = set(views) - set(VIEW_CLASSES)
        if unknown:
            raise ValueError(f"unknown views {sorted(unknown)}; choose from {', '.join(VIEW_CLASSES)}")
        if level == "summary" and set(views) != set(SUMMARY_VIEWS):
            raise ValueError("level 'summary' records no blocks: the only view it can feed is 'timeline'")
        self.interval, self.max_load = check_interval(interval), check_max_load(max_load)
        self.llm = source if hasattr(source, "record") else None
        self._closed = self.llm is None
        self._made_in = _running_cell() if self.llm is not None else None
        if self._made_in is not None:
            _detach_made_in_earlier_run(self._made_in)
        self._listener = self._recording = None
        if self.llm is not None:
            self._recording = self.llm.record(level=level, max_steps=max_steps)
            self.trace = self._recording.__enter__()
        else:
            self.trace = source
        self.series = StepSeries(self.trace)
        # _wake: a new step is there; _kick: update now (paused, or detaching), skipping the throttle
        self._wake, self._kick = threading.Event(), threading.Event()
        self.gate = StepGate()
        self._bg_thread: threading.Thread | None = None
        # Asked by stop(); a new one for each background run, so a late stop never reaches the next run.
        self._stop = _RunStop()
        self._run_control = threading.Lock()  # a run's start against stop(): which run is going
        if self.llm is not None:
            self._listener = self.trace.add_listener(self._on_step, block_events=False)
        self.views = {name: VIEW_CLASSES[name]() for name in views}
        if "pool" in self.views and "tables" in self.views:  # the block tables go once, with the pool
            self.views["tables"].pool = self.views["pool"]
        self._lock = threading.RLock()  # one thread at a time touches the widgets
        self._shown: int | None = None
        self._run: Future | None = None
        self.last_error: str | None = None
        self.num_updates, self.update_time_s = 0, 0.0  # live updates pushed, and their cost
        self._build_layout()
        self._link_selection()
        self._refresh(follow=True)
        self._updater = None
        if self.llm is not None:
            frozen_heap.hold()
            self._updater = threading.Thread(target=self._update_loop, name="kvscope-dashboard", daemon=True)
            self._updater.start()
            if self._made_in is not None:
                _LIVE.add(self)

    # ------------------------------------------------------------------ layout
    def _build_layout(self) -> None:
        live = self.llm is not None
        self.slider = W.IntSlider(value=0, min=0, max=0, description="step", continuous_update=True,
                                  layout=W.Layout(width="60%"))
        self.slider.observe(self._on_slider, "value")
        self.play = W.Play(interval=150, min=0, max=0, description="play")
        # Linked in the kernel, not the browser: the views need the kernel to show a step
        # anyway, and a browser-side link would echo the kernel's own moves back to it as
        # slider moves, which read as the user's.
        W.link((self.play, "value"), (self.slider, "value"))
        self.status = W.HTML()
        self.status.add_class("kvscope-status")
        header = [self.play, self.slider, self.status]
        if live:
            self.follow = W.Checkbox(value=True, description="follow live", indent=False,
                                     layout=W.Layout(width="110px"))
            self.follow.observe(self._on_follow, "value")
            self.pause_button = W.Button(description="Pause", icon="pause", tooltip="hold the background run after this step")
            self.step_button = W.Button(description="Step", icon="step-forward", tooltip="run one engine step")
            self.resume_button = W.Button(description="Resume", icon="play", tooltip="continue the background run")
            self.stop_button = W.Button(description="Stop", icon="stop",
                                        tooltip="end the background run after this step (its requests are aborted)")
            for b, fn in ((self.pause_button, self.pause), (self.step_button, self.step_once),
                          (self.resume_button, self.resume), (self.stop_button, self.stop)):
                b.add_class(f"kvscope-{b.description.lower()}")
                b.layout.width = "90px"
                b.on_click(lambda _b, fn=fn: fn())
            header = [self.pause_button, self.step_button, self.resume_button, self.stop_button, self.follow] + header
        v = self.views
        body: list[W.Widget] = [W.HBox(header, layout=W.Layout(align_items="center", flex_flow="row wrap"))]
        body += [v[n] for n in ("pool",) if n in v]
        side = [W.Box([v[n]], layout=W.Layout(flex="1 1 0", min_width="320px")) for n in ("queues", "tables") if n in v]
        if side:
            body.append(W.HBox(side, layout=W.Layout(width="100%", grid_gap="12px")))
        body += [v[n] for n in ("lifecycle", "slots", "timeline") if n in v]
        self.widget = W.VBox(body, layout=W.Layout(width="100%"))
        self.widget.add_class("kvscope-dashboard")
        self._set_status()

    def _link_selection(self) -> None:
        # Linked in the browser, so clicks propagate even while a cell keeps the kernel busy.
        linked = [v for v in self.views.values() if hasattr(v, "selected_request")]
        for a, b in zip(linked, linked[1:]):
            W.jslink((a, "selected_request"), (b, "selected_request"))

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        return self.widget._repr_mimebundle_(**kwargs)

    # ------------------------------------------------------------ showing steps
    def show_step(self, step: int) -> None:
        """Show recorded step ``step`` (the nearest recorded one at or before it) in every view."""
        if not is_index(step):  # (NaN, 1.5 or True once showed a step nobody asked for)
            raise TypeError(f"step must be an integer (the nearest recorded step at or before it is shown), got {step!r}")
        with self._lock, self.trace.hold_steps():  # (a live ring buffer would drop the oldest while it is read)
            ids = self.trace.step_ids
            if not ids:
                return
            step = ids[max(0, bisect.bisect_right(ids, step) - 1)]
            data = StepData(self.trace, step, self.series)
            for view in self.views.values():
                view.show(data)
            self._shown = step
            self._set_status()

    @property
    def step(self) -> int | None:
        """The step the views show now."""
        return self._shown

    def _on_slider(self, change: dict) -> None:
        if self.llm is not None and change["new"] != self.slider.max:
            self.follow.value = False  # moved away from the newest step: stop jumping there
        self.show_step(change["new"])

    def _on_follow(self, change: dict) -> None:
        if change["new"]:
            self._refresh(follow=True)  # following again: go to the newest step now, not at the next one

    def _refresh(self, follow: bool | None = None) -> None:
        """Take in new steps and extend the slider; show the newest step when following
        (``None``: as "follow live" says once the lock is held, so a slider move by the user
        that lands while this waits for the lock is not jumped back)."""
        with self._lock:
            if follow is None:
                follow = self.follow.value
            ids = self.trace.step_ids
            self.series.sync()
            # (A record joins trace.step_ids just before the series hears of it: show no newer step.)
            newest = self.series.last_step
            if not ids or newest is None or newest < ids[0]:
                return
            first, newest = ids[0], min(newest, ids[-1])
            # Steps only grow: widen the top, move to the newest, then raise the bottom, each in
            # a message of its own. Any other order clamps a slider, here or in the browser (which
            # applies a message's value before its max, and sends the clamped value back); the
            # clamped value reads as the user's move and stops the following.
            self.slider.max = self.play.max = newest
            if follow and self.slider.value != newest:
                self.slider.value = newest  # the observer shows it
            elif follow:
                self.show_step(newest)
            self.slider.min = self.play.min = first
            if not follow and self._shown is not None:  # not following: the views over all steps still grow
                data = StepData(self.trace, self._shown, self.series)
                for name in ("lifecycle", "timeline"):
                    if name in self.views:
                        self.views[name].show(data)
            if not follow:  # no step shown, so the status is written here: the run may have held since
                self._write_status()

    # --------------------------------------------------------------------- live
    def _on_step(self, record: Any) -> None:
        """Trace listener, in the engine's thread: queue the record, wake the updater, and, in
        the background run, look at Pause and Stop once this step has ended: between two steps,
        so the notebook's calls on the LLM go through while it holds, and a stop leaves the
        engine consistent. Looked at then, not now: a Pause or Stop that comes while the step
        ends still lands before the next one."""
        self.series.add(record)
        self._wake.set()
        if threading.current_thread() is self._bg_thread:
            stop = self._stop  # (this run's: the next run's comes once this one is over)
            self.llm.call_between_steps(lambda: self._hold_or_stop(stop))

    def _hold_or_stop(self, stop: _RunStop) -> None:
        """On the background run's thread between two steps: hold while paused, then end the
        run if stopped; ``LLM.generate`` aborts its requests on the way out."""
        self.gate.wait(on_hold=self._on_hold, stop=stop.requested)
        if stop.requested.is_set() and not stop.delivered:
            stop.delivered = True
            raise _Stopped("the background run was stopped by Dashboard.stop()")

    def _on_hold(self) -> None:
        """The background run holds (the engine is idle): an update at once, which shows this
        step and the paused status. Its own wake, not the step's: the update that the step's
        record woke may have run before the hold, and no step comes while paused."""
        self._wake.set()
        self._kick.set()

    def _update_loop(self) -> None:
        cost = 0.0
        while True:
            self._wake.wait()
            if self._closed:
                return
            self._wake.clear()
            # This thread's CPU time, not wall time: waiting for the interpreter lock while the
            # engine holds it costs the engine nothing, and would make updates look dearer.
            start = time.thread_time()
            try:
                self._refresh()
                self.num_updates += 1
            except Exception:  # a broken update must never stop the engine or this thread
                self.last_error = traceback.format_exc()
                self._set_status()
            spent = time.thread_time() - start
            self.update_time_s += spent
            cost = 0.5 * (cost + spent)  # smoothed: the first update is the dearest
            # (capped: a tiny max_load asks for a wait that threading refuses; a hold kicks it anyway)
            self._kick.wait(min(max(self.interval, cost / self.max_load - cost), MAX_SECONDS))
            self._kick.clear()

    def generate_async(self, prompts: Any, sampling_params: Any = None) -> Future:
        """Run ``llm.generate(prompts, sampling_params)`` in a background thread.

        The kernel stays free, so Pause / Step / Resume / Stop and hovering work during the run,
        and ``llm.add_request`` / ``abort_request`` from the notebook land at the run's next step.
        Returns a ``concurrent.futures.Future`` of the outputs; after :meth:`stop` it raises
        ``concurrent.futures.CancelledError`` (``Future.cancel`` cannot stop a running Future).
        """
        fut: Future = Future()
        fut.set_running_or_notify_cancel()

        def target() -> None:
            try:
                outputs = self.llm.generate(prompts, sampling_params, use_tqdm=False)
            except _Stopped as exc:
                self._end_run(fut, exception=_cancelled(exc))
            except BaseException as exc:
                self._end_run(fut, exception=exc)
            else:
                self._end_run(fut, outputs=outputs)

        with self._run_control:
            if self.llm is None or self._closed:
                raise RuntimeError("generate_async needs a live dashboard (kvscope.dashboard(llm))")
            if self._run is not None and not self._run.done():
                raise RuntimeError("a background run is still going; wait for dashboard.run_future "
                                   "(or end it with dashboard.stop())")
            self._stop = _RunStop()
            self._run = fut
            self._bg_thread = threading.Thread(target=target, name="kvscope-generate", daemon=True)
            self._bg_thread.start()
        self._set_status()
        return fut

    def _end_run(self, fut: Future, outputs: Any = None, exception: BaseException | None = None) -> None:
        """Let the gate go, then settle the run's Future: in this order, so that a run started
        as soon as the Future is done is not resumed by this one's end."""
        self.gate.resume()
        if exception is not None:
            fut.set_exception(exception)
        else:
            fut.set_result(outputs)
        self._set_status()

    @property
    def run_future(self) -> Future | None:
        """The Future of the latest :meth:`generate_async` run."""
        return self._run

    def pause(self) -> None:
        """Hold the background run after the step it is computing."""
        self.gate.pause()
        self._set_status()

    def step_once(self) -> None:
        """While paused, let the background run do exactly one more step."""
        if not self.gate.paused:
            self.gate.pause()
        self.gate.step_once()
        self._set_status()

    def resume(self) -> None:
        """Let the background run go on."""
        self.gate.resume()
        self._set_status()

    def stop(self) -> None:
        """End the background run between two engine steps (at once if paused there), as a
        Ctrl-C there would: ``Future.cancel`` cannot stop a running Future, and a Ctrl-C in the
        notebook only ends the wait for it. ``LLM.generate`` aborts the run's requests, the trace
        keeps the steps it ran, and :attr:`run_future` raises ``CancelledError``. No run going:
        nothing happens."""
        with self._run_control:
            if self._run is None or self._run.done():
                return
            self._stop.requested.set()
        self.gate.resume()  # (after the flag: a run held at the gate wakes to a stop)
        self._set_status()

    def _set_status(self) -> None:
        with self._lock:  # also called from the background run's thread
            self._write_status()

    def _write_status(self) -> None:
        running = self._run is not None and not self._run.done()
        if self.llm is None:
            text = f"replay · {len(self.trace.step_ids)} steps recorded"
        elif running and self.gate.waiting:
            text = f"background run · paused at step {self.trace.step_ids[-1]}"
        elif running and self._stop.requested.is_set():
            text = "background run · stopping…"
        elif running:
            text = "background run · pausing…" if self.gate.paused else "background run · running"
        else:
            text = "detached · replay" if self._closed else "live"  # (a cell's own generate may be running)
        text += kv_pool_label(self.trace.meta)
        if self._shown is not None:
            text += f" · showing step {self._shown}"
        if self.last_error:
            text += f' · <span title="{html.escape(self.last_error)}" style="color:#e63946">update error (hover)</span>'
        self.status.value = text
        if self.llm is not None:
            for b in (self.pause_button, self.step_button, self.resume_button, self.stop_button):
                b.disabled = not running

    def detach(self) -> None:
        """Stop recording and updating; the dashboard stays as a replay of what it recorded."""
        self._detach(show_last=True)

    def _detach(self, show_last: bool) -> None:
        """:meth:`detach`; ``show_last=False`` skips the views' last update, for a dashboard
        whose output is gone (the plotly timeline logs an error in the browser for an update
        to a figure it no longer shows)."""
        with self._run_control:  # closed first: no run may start while this one is waited for
            if self.llm is None or self._closed:
                return
            self._closed = True
        if self._run is not None:
            self.gate.resume()
            wait([self._run])  # its outputs or error stay in run_future
        self._listener.remove()
        self._recording.__exit__(None, None, None)
        _LIVE.discard(self)
        self._kick.set()
        self._wake.set()
        self._updater.join()
        try:
            if show_last:
                self._refresh()
            self._set_status()
        finally:
            frozen_heap.release(collect=True)

    def __enter__(self) -> "Dashboard":
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def to_html(self, path: str | Path, **kwargs: Any) -> Path:
        """Write a static, self-contained HTML page of this dashboard's trace (no kernel needed)."""
        from kvscope.widgets.export import export_html

        return export_html(self.trace, path, step=self._shown,
                           selected_request=self.views["pool"].selected_request if "pool" in self.views else "",
                           **kwargs)


# The live dashboards made in a Jupyter cell (those whose ``_made_in`` is known).
_LIVE: "weakref.WeakSet[Dashboard]" = weakref.WeakSet()


def _running_cell() -> tuple[str, str] | None:
    """``(cell id, execute request id)`` of the Jupyter cell running now, from the request's
    metadata (JupyterLab and Notebook 7 send ``cellId``); None outside a kernel, or from a
    front end that names no cell."""
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    get_parent = getattr(getattr(get_ipython(), "kernel", None), "get_parent", None)
    parent = get_parent() if get_parent is not None else None
    if not isinstance(parent, dict):
        return None
    cell = (parent.get("metadata") or {}).get("cellId")
    request = (parent.get("header") or {}).get("msg_id")
    return (cell, request) if isinstance(cell, str) and request else None


def _detach_made_in_earlier_run(made_in: tuple[str, str]) -> None:
    """Detach the live dashboards an earlier run of cell ``made_in[0]`` made: running the cell
    again replaced its output, so nobody sees them, yet each kept recording the engine and
    updating its widgets. A background run of theirs is stopped, not waited for: its controls
    went with the output, and the re-run (``%kvscope demo`` again, say) would wait for it to end."""
    cell, request = made_in
    for dash in list(_LIVE):
        if dash._made_in is not None and dash._made_in[0] == cell and dash._made_in[1] != request:
            dash.stop()
            dash._detach(show_last=False)


def dashboard(source: Any, **kwargs: Any) -> "Dashboard | AttachDashboard":
    """``kvscope.dashboard(llm)`` (live) or ``kvscope.dashboard(trace)`` (replay); see :class:`Dashboard`.
    ``kvscope.dashboard(attached)`` shows a ``kvscope.attach`` source; see :class:`AttachDashboard`."""
    if type(source).__module__ == "kvscope.attach.attached":  # no import: attach's extras are optional
        from kvscope.widgets.attach_view import AttachDashboard

        return AttachDashboard(source, **kwargs)
    return Dashboard(source, **kwargs)
