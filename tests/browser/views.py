"""One kvscope view alone in a plain page, fed a state the test writes, for browser checks that
need no kernel: a page opens in about a second, where JupyterLab takes tens of seconds.

The page holds the dashboard's CSS and the view's ES module (``esm_source``), rendered with a
small in-page model; ``window.kvsSet(name, value)`` changes a trait as a kernel update would.
Traits named in ``int32`` are given as lists and arrive as the binary buffer a kernel sends.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvscope.widgets.views import CSS, esm_source

PAGE = """<!doctype html>
<html><head><meta charset="utf-8"><style>{css}</style></head>
<body style="{body_style}"><div id="view" style="width: {width}px"></div>
<script type="application/json" id="state">{state}</script>
<script type="application/json" id="module">{module}</script>
<script type="module">
const handlers = {{}};
const state = JSON.parse(document.getElementById("state").textContent);
for (const name of {int32}) state[name] = Int32Array.from(state[name]).buffer;
const model = {{
  get: (name) => state[name],
  set: (name, value) => {{ state[name] = value; for (const fn of handlers[`change:${{name}}`] || []) fn(); }},
  on: (events, fn) => {{ for (const e of events.split(" ")) (handlers[e] ||= []).push(fn); }},
  off: (events, fn) => {{ for (const e of events.split(" ")) handlers[e] = (handlers[e] || []).filter((f) => f !== fn); }},
  save_changes: () => {{}},
  send: () => {{}},
}};
window.kvsSet = model.set;
const src = JSON.parse(document.getElementById("module").textContent);
const mod = (await import(URL.createObjectURL(new Blob([src], {{ type: "text/javascript" }})))).default;
mod.render({{ model, el: document.getElementById("view") }});
document.body.dataset.ready = "1";
</script></body></html>
"""


def tables_state(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The block-tables traits of ``rows`` (``id, blocks, refs, num_tokens``) as the kernel sends
    them (``snapshot.encode_tables``): request ids and one int32 buffer, ``lengths | tokens |
    blocks | refcounts``; open the view with ``int32=("tables",)``."""
    values = ([len(r["blocks"]) for r in rows] + [r["num_tokens"] for r in rows]
              + [b for r in rows for b in r["blocks"]] + [ref for r in rows for ref in r["refs"]])
    return {"table_ids": [r["id"] for r in rows], "tables": values}


def open_view(page: Any, tmp: Path, view: str, state: dict[str, Any], width: int = 700,
              body_style: str = "", int32: tuple[str, ...] = ()) -> Any:
    """Render ``view`` (``"tables"``, ``"queues"``, ...) with ``state`` in ``page``; returns its element."""
    path = tmp / f"{view}.html"
    path.write_text(PAGE.format(css=CSS, body_style=body_style, width=width, int32=json.dumps(list(int32)),
                                state=json.dumps(state).replace("</", "<\\/"),
                                module=json.dumps(esm_source(view)).replace("</", "<\\/")), encoding="utf-8")
    page.goto(path.as_uri())
    page.wait_for_function("() => document.body.dataset.ready === '1'", timeout=10_000)
    return page.locator("#view")
