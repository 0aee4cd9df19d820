"""The notebook card of a :class:`~kvscope.trace.trace.Trace` (its ``_repr_html_``).

A trace as a cell's last expression should say what it holds without a query: the steps and
wall time it covers, the requests and tokens, how full the KV pool got, the prefix-cache hit
rate and the preemptions, and where to look next. Everything is read from ``trace.steps``,
``trace.requests`` and ``trace.meta``, which a saved trace keeps exactly, so a loaded trace
shows the card of the live one. Each number sits in an element with a ``data-key`` attribute,
so code (and the tests) can read it back. Plain HTML with inline styles: no script, no
stylesheet, colours inherited so that it reads on light and dark themes.
"""
from __future__ import annotations

import html
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

import pandas as pd

if TYPE_CHECKING:
    from kvscope.trace.trace import Trace

_CARD = ("display:inline-block;max-width:52em;padding:6px 12px;border:1px solid rgba(128,128,128,.45);"
         "border-radius:6px;font-size:12px;line-height:1.5;color:inherit;text-align:left")
_TABLE = "border-collapse:collapse;margin:4px 0;background:transparent;color:inherit;font-size:inherit"
_TH = ("text-align:left;vertical-align:top;font-weight:normal;opacity:.7;padding:1px 14px 1px 0;"
       "white-space:nowrap;background:transparent;border:none")
_TD = "text-align:left;vertical-align:top;padding:1px 0;background:transparent;border:none"
_DIM = "opacity:.7"
_CODE = "font-family:monospace;font-size:11px;padding:0 2px;border-radius:3px;background:rgba(128,128,128,.15)"


def summary_card(trace: "Trace") -> str:
    """The card's HTML: only what ``trace.level`` records, a short card for a trace with no steps."""
    steps = trace.steps
    requests = trace.requests
    head = _header(trace.meta)
    if steps.empty:
        body = '<div><span data-key="steps">0</span> steps recorded: the recording saw no engine step.</div>'
        return f'<div class="kvscope-trace-card" style="{_CARD}">{head}{body}</div>'
    rows = [
        ("steps", _steps(steps, trace.meta.get("max_steps"))),
        ("wall time", _wall_time(steps)),
        ("requests", _requests(requests)),
        ("tokens", _tokens(steps, requests)),
        ("KV pool", _pool(steps, trace.num_blocks, trace.block_size, trace.meta.get("kv_cache_dtype"))),
        ("prefix cache", _prefix_cache(steps, trace.meta)),
        ("preemptions", _value("preemptions", int(steps["num_preemptions"].sum()))),
    ]
    table = "".join(f'<tr><th style="{_TH}">{html.escape(label)}</th><td style="{_TD}">{cell}</td></tr>'
                    for label, cell in rows)
    explore = _explore(trace.level, _peak_step(steps))
    return (f'<div class="kvscope-trace-card" style="{_CARD}">{head}'
            f'<table style="{_TABLE}"><tbody>{table}</tbody></table>{explore}</div>')


def _header(meta: dict[str, Any]) -> str:
    """``kvscope.Trace · level · model`` (the model's folder name; its whole path on hover)."""
    parts = [f'<b>kvscope.Trace</b> · level <b data-key="level">{html.escape(str(meta["level"]))}</b>']
    model = meta.get("model")
    if model:
        name = PurePath(str(model)).name or str(model)
        parts.append(f'<span title="{html.escape(str(model))}" data-key="model">{html.escape(name)}</span>')
    return f'<div>{" · ".join(parts)}</div>'


def _value(key: str, value: int | str) -> str:
    text = f"{value:,}" if isinstance(value, int) else value
    return f'<span data-key="{key}">{html.escape(text)}</span>'


def _dim(text: str) -> str:
    return f'<span style="{_DIM}">{text}</span>'


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f} %"


def _steps(steps: pd.DataFrame, max_steps: int | None) -> str:
    """How many steps, which, and whether the ring buffer may have dropped older ones (the
    trace keeps ``max_steps``, not what it dropped, so a full buffer is all a loaded one knows)."""
    n = len(steps)
    text = (f'{_value("steps", n)} recorded ({_value("first_step", int(steps["step"].iloc[0]))}..'
            f'{_value("last_step", int(steps["step"].iloc[-1]))})')
    if max_steps is not None and n >= max_steps:
        text += " " + _dim(f'· ring buffer full (max_steps={_value("max_steps", int(max_steps))}): '
                           "older steps may have been dropped")
    return text


def _wall_time(steps: pd.DataFrame) -> str:
    """From the first step's start to the last step's end (idle time between steps included)."""
    seconds = float(steps["time_s"].iloc[-1] + steps["duration_s"].iloc[-1] - steps["time_s"].iloc[0])
    if seconds < 1:
        text = f"{seconds * 1e3:.1f} ms"
    elif seconds < 120:
        text = f"{seconds:.2f} s"
    else:
        text = f"{seconds / 60:.1f} min"
    return _value("wall_time", text) + " " + _dim("(first step's start to last step's end)")


def _requests(requests: pd.DataFrame) -> str:
    reasons = requests["finish_reason"].dropna()
    text = f'{_value("requests", len(requests))} seen, {_value("finished", len(reasons))} finished'
    if len(reasons):
        counts = reasons.value_counts(sort=False).sort_index()
        text += " " + _dim("(" + ", ".join(f"{n:,} {html.escape(str(r))}" for r, n in counts.items()) + ")")
    return text


def _tokens(steps: pd.DataFrame, requests: pd.DataFrame) -> str:
    return (f'{_value("prefill_tokens", int(steps["num_prefill_tokens"].sum()))} prefill '
            + _dim("(prompts, and recomputation after preemption)")
            + f' · {_value("decode_tokens", int(steps["num_decode_tokens"].sum()))} decode'
            + f' · {_value("generated_tokens", int(requests["output_len"].sum()))} generated '
            + _dim("(the requests' outputs)"))


def _peak_step(steps: pd.DataFrame) -> int:
    """The first step at which the most blocks were in use."""
    return int(steps["step"].iloc[int(steps["num_used_blocks"].to_numpy().argmax())])


def _pool(steps: pd.DataFrame, num_blocks: int, block_size: int, dtype: str | None) -> str:
    peak = int(steps["num_used_blocks"].max())
    share = _percent(peak, num_blocks) if num_blocks else "-"
    return (f'{_value("num_blocks", num_blocks)} blocks × {_value("block_size", block_size)} tokens'
            + (" " + _dim(f"({html.escape(str(dtype))})") if dtype else "")
            + f' · peak {_value("peak_blocks", peak)} used ({_value("peak_share", share)})'
            + f' at step {_value("peak_step", _peak_step(steps))}')


def _prefix_cache(steps: pd.DataFrame, meta: dict[str, Any]) -> str:
    """Hits over queries, in tokens looked up at admission (vLLM's counters), over the recording."""
    if not (meta.get("engine_config") or {}).get("enable_prefix_caching", True):
        return _value("hit_rate", "off") + " " + _dim("(enable_prefix_caching=False)")
    hits, queries = int(steps["prefix_cache_hits"].sum()), int(steps["prefix_cache_queries"].sum())
    if not queries:
        return _value("hit_rate", "no lookups") + " " + _dim("(no request was admitted in these steps)")
    return (f'{_value("hit_rate", _percent(hits, queries))} hit rate '
            f'({_value("prefix_hits", hits)} of {_value("prefix_queries", queries)} tokens looked up '
            "at admission were cached)")


def _explore(level: str, peak_step: int) -> str:
    """What to read next; the pool and the lifecycle only where the level records blocks."""
    names = ["trace.steps", "trace.requests"]
    if level != "summary":
        names += ["trace.lifecycle", f"trace.blocks({peak_step})"]
    names.append("kvscope.dashboard(trace)")
    code = " · ".join(f'<code style="{_CODE}">{html.escape(n)}</code>' for n in names)
    note = "" if level != "summary" else " " + _dim("(a 'summary' recording keeps no blocks: record at "
                                                  "level 'blocks' for the pool and the lifecycle)")
    return f'<div data-key="explore"><span style="{_DIM}">explore:</span> {code}{note}</div>'
