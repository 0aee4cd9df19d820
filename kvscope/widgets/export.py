"""A static, self-contained HTML page of a trace: the dashboard's views with a step slider.

The page runs the same ES modules as the Jupyter views, each driven by an in-page model, so
it opens in any browser without a kernel or a network connection (plotly.js is inlined,
deflated, unless ``include_plotlyjs="cdn"``). All exported steps travel as one deflated JSON
payload, the pool as block deltas, so the page grows with what changed, not with the pool.
"""
from __future__ import annotations

import base64
import functools
import html
import json
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import plotly.io as pio
from plotly.offline import get_plotlyjs, get_plotlyjs_version

from kvscope.arg_checks import is_index, is_int
from kvscope.widgets import snapshot
from kvscope.widgets.pool_sync import PoolSync, decode_blocks
from kvscope.widgets.snapshot import StepData
from kvscope.widgets.views import CSS, STATIC, esm_source, kv_pool_label, timeline_figure

EXPORTED_VIEWS = {  # view name -> snapshot function
    "pool": snapshot.pool_state,
    "queues": snapshot.queues_state,
    "tables": snapshot.tables_state,
    "slots": snapshot.slots_state,
    "lifecycle": snapshot.lifecycle_state,
}
BINARY = {"pool": ("delta", "tables"), "lifecycle": ("intervals",)}  # traits sent as base64
ACROSS_STEPS = ("lifecycle",)  # views of all steps at once: exported once, with the step per slider position
LINKED = {"tables": "pool"}  # views that read their data from another's model, as in the dashboard: the step alone


def exported_steps(step_ids: Any, max_steps: int) -> list[int]:
    """At most ``max_steps`` recorded steps, evenly spread, always with the first and last."""
    ids = [int(s) for s in step_ids]
    if len(ids) <= max_steps:
        return ids
    picks = np.unique(np.linspace(0, len(ids) - 1, max_steps).round().astype(int))
    return [ids[i] for i in picks]


def export_payload(trace: Any, steps: list[int]) -> dict[str, Any]:
    """Every view's state at each of ``steps``, plus hover facts of the blocks.

    The pool goes as block deltas from one exported step to the next (the first is a
    keyframe), and the hover facts likewise (a step lists the blocks whose facts it changed),
    so the page grows with what changed, not with the pool's size.
    """
    views: dict[str, list[dict[str, Any]]] = {name: [] for name in EXPORTED_VIEWS}
    details = []
    sync = PoolSync()
    for step in steps:
        data = StepData(trace, step)
        for name, fn in EXPORTED_VIEWS.items():
            views[name].append({"step": step} if name in ACROSS_STEPS or name in LINKED else fn(data))
        update = sync.update(*snapshot.pool_arrays(data))
        views["pool"][-1].update(delta=update.delta, delta_base=update.base, version=update.version)
        # hover facts change only where the state or refcount did, or tokens were written
        touched = np.union1d(decode_blocks(update.delta)[0], data.slot_mapping["block_id"].to_numpy())
        details.append(snapshot.block_details(data, touched.tolist()))
    fixed = {name: EXPORTED_VIEWS[name](StepData(trace, steps[-1])) for name in ACROSS_STEPS}
    fixed.update({name: {"pool": f"IPY_MODEL_{source}"} for name, source in LINKED.items()})
    for name, keys in BINARY.items():
        for state in views[name] + [fixed.get(name, {})]:
            for key in keys:
                if key in state:
                    state[key] = base64.b64encode(state[key]).decode("ascii")
    return {"steps": steps, "views": views, "fixed": fixed, "details": details,
            "binary": {k: list(v) for k, v in BINARY.items()}}


def export_html(
    trace: Any,
    path: str | Path,
    *,
    max_steps: int = 300,
    step: int | None = None,
    selected_request: str = "",
    include_plotlyjs: bool | str = True,
    title: str = "kvscope trace",
) -> Path:
    """Write ``trace`` as one HTML file that opens without a kernel; returns the path.

    ``max_steps`` bounds the file size: that many recorded steps, evenly spread, get a slider
    position (the timeline always covers every step). ``step`` is the step shown first.
    """
    if not is_int(max_steps) or max_steps < 2:
        raise ValueError(f"max_steps must be an integer >= 2 (the first and last recorded steps always get a "
                         f"slider position), got {max_steps!r}")
    if step is not None and not is_index(step):
        raise TypeError(f"step must be an integer (a recorded step; the nearest exported one is shown) or None, got {step!r}")
    if trace.level == "summary":
        raise ValueError("export_html needs a trace recorded at level 'blocks' or 'full' (the page shows the "
                         "block views); this one is 'summary'")
    with trace.hold_steps():  # (a live ring buffer would drop the oldest steps while they are read)
        ids = trace.step_ids
        if not len(ids):
            raise ValueError("the trace has no recorded steps to export")
        steps = exported_steps(ids, max_steps)
        payload = zlib.compress(json.dumps(export_payload(trace, steps), separators=(",", ":")).encode(), 9)
        figure = pio.to_json(timeline_figure(trace))
    start = steps[-1] if step is None else min(steps, key=lambda s: abs(s - step))
    meta = {"num_blocks": int(trace.num_blocks), "block_size": int(trace.block_size), "step": start,
            "selected_request": selected_request, "num_steps_recorded": len(ids),
            "model": str(trace.meta.get("model", ""))}
    modules = {name: esm_source(name) for name in EXPORTED_VIEWS}
    if include_plotlyjs is True:  # inflated by export.js: a third of plotly.js's size
        plotly_tag = f'<script type="application/octet-stream" id="kvscope-plotly">{_plotly_deflated()}</script>'
    elif include_plotlyjs == "cdn":
        plotly_tag = f'<script src="https://cdn.plot.ly/plotly-{get_plotlyjs_version()}.min.js"></script>'
    else:
        plotly_tag = ""
    sections = "\n".join(f'<section id="kvscope-{name}"></section>' for name in EXPORTED_VIEWS)
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{CSS}
body {{ margin: 16px; font: 13px system-ui, sans-serif; }}
section {{ margin: 10px 0; }}
#kvscope-queues, #kvscope-tables {{ display: inline-block; vertical-align: top; width: calc(50% - 12px); margin-right: 8px; }}
</style>
{plotly_tag}
</head><body data-kvscope-export="1" data-num-blocks="{int(trace.num_blocks)}">
<h2>{html.escape(title)}</h2>
<div class="kvs-dim">{html.escape(meta["model"])} · {int(trace.num_blocks)} KV blocks × {int(trace.block_size)} tokens{html.escape(kv_pool_label(trace.meta))} ·
{len(ids)} steps recorded, {len(steps)} exported · made by kvscope.widgets.export_html</div>
<p><input id="kvscope-slider" type="range" min="0" value="0" style="width:60%"> <span id="kvscope-step"></span></p>
{sections}
<div id="kvscope-timeline"></div>
<script type="application/json" id="kvscope-meta">{_json_script(meta)}</script>
<script type="application/json" id="kvscope-modules">{_json_script(modules)}</script>
<script type="application/json" id="kvscope-figure">{_json_script_raw(figure)}</script>
<script type="application/octet-stream" id="kvscope-data">{base64.b64encode(payload).decode("ascii")}</script>
<script type="module">{(STATIC / "common.js").read_text()}
{(STATIC / "export.js").read_text()}</script>
</body></html>
"""
    path = Path(path)
    path.write_text(page, encoding="utf-8")
    return path


@functools.lru_cache(maxsize=1)
def _plotly_deflated() -> str:
    return base64.b64encode(zlib.compress(get_plotlyjs().encode(), 1)).decode("ascii")


def _json_script_raw(text: str) -> str:
    # Inside <script>, only "</" can end the element early; JSON allows "<\/" for it.
    return text.replace("</", "<\\/")


def _json_script(obj: Any) -> str:
    return _json_script_raw(json.dumps(obj))


def load_payload(page: str) -> dict[str, Any]:
    """The exported steps' states back out of a page written by :func:`export_html`."""
    start = page.index('id="kvscope-data">') + len('id="kvscope-data">')
    blob = page[start: page.index("</script>", start)]
    return json.loads(zlib.decompress(base64.b64decode(blob)))
