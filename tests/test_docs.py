"""docs/TRACE_API.md (and the README's list of hook points) name exactly what the engine produces,
read from a real run of the bundled model: every trace table's columns, every public ``Trace``
member, every hook point and the keywords it fires with. A column, table, member or hook point
added, renamed or dropped without its doc fails here, naming it."""
from __future__ import annotations

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRACE_API = (ROOT / "docs" / "TRACE_API.md").read_text()
README = (ROOT / "README.md").read_text()


def names_in(code: str) -> list[str]:
    """``a, b (a note), c`` -> ``["a", "b", "c"]``: the names a doc lists in one code span."""
    return [n.strip() for n in re.sub(r"\([^)]*\)", "", code).split(",") if n.strip()]


def trace_entry(name: str) -> str:
    """The TRACE_API.md bullet of ``trace.<name>`` (up to the next bullet or heading)."""
    found = re.findall(rf"^- `trace\.{name}[`(].*?(?=^- |^#|\Z)", TRACE_API, flags=re.M | re.S)
    assert len(found) == 1, f"docs/TRACE_API.md: expected one bullet for trace.{name}, found {len(found)}"
    return found[0]


def documented_columns(name: str) -> list[str]:
    """The columns the bullet of ``trace.<name>`` lists: its first code span with a comma, after the dash."""
    body = trace_entry(name).split(" — ", 1)[-1]
    span = next((s for s in re.findall(r"`([^`]*)`", body) if "," in s), None)
    assert span is not None, f"docs/TRACE_API.md: the bullet of trace.{name} lists no columns"
    return names_in(span)


def test_every_trace_table_and_member_is_documented_as_a_real_recording_has_it():
    pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    import pandas as pd

    import kvscope
    from kvscope.demo import demo_prompts

    llm = kvscope.LLM(num_kv_blocks=24, max_num_batched_tokens=64)
    with llm.record(level="full") as trace:  # (the level that fills every table)
        llm.generate(demo_prompts(4), kvscope.SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    step = trace.step_ids[len(trace.step_ids) // 2]
    tables = {}
    for name, member in inspect.getmembers(kvscope.Trace):
        if name.startswith("_"):
            continue
        assert f"trace.{name}" in TRACE_API or f"Trace.{name}" in TRACE_API, \
            f"Trace.{name} is public but docs/TRACE_API.md never names it"
        fn = member.fget if isinstance(member, property) else member
        if inspect.signature(fn).return_annotation in ("pd.DataFrame", pd.DataFrame):
            value = getattr(trace, name)
            if callable(value):  # (a method: the whole table, or the one step it needs)
                needs_step = inspect.signature(value).parameters.get("step")
                value = value(step) if needs_step and needs_step.default is inspect.Parameter.empty else value()
            tables[name] = list(value.columns)
    assert {"steps", "requests", "block_events", "lifecycle", "scheduled", "blocks", "kv_events"} <= set(tables), \
        f"the DataFrames found: {sorted(tables)}"
    for name, columns in tables.items():
        assert documented_columns(name) == columns, f"trace.{name}: docs/TRACE_API.md lists other columns"
    pool = trace_entry("pool_arrays")
    for key in trace.pool_arrays(step):
        assert f"`{key}`" in pool, f"trace.pool_arrays: docs/TRACE_API.md does not name {key!r}"


def test_every_hook_point_fires_with_the_payload_its_doc_names():
    from kvscope import LLM, SamplingParams
    from kvscope.demo import demo_prompts
    from kvscope.engine.hooks import HOOK_POINTS

    payloads: dict[str, list[str]] = {}  # hook point -> the keywords TRACE_API.md's table names
    for points, payload in re.findall(r"^\| (`[a-z]+\.[a-z]+`(?: / `[a-z]+\.[a-z]+`)*) \| `([^`]*)`", TRACE_API,
                                      flags=re.M):
        for point in re.findall(r"`([^`]+)`", points):
            payloads[point] = names_in(payload)
    assert set(payloads) == set(HOOK_POINTS), "docs/TRACE_API.md's hook table is not HOOK_POINTS"
    listed = re.search(r"^Hook points: (.*?)\. ", README, flags=re.M | re.S)
    assert listed and set(re.findall(r"`([^`]+)`", listed[1])) == set(HOOK_POINTS), \
        "the README's 'Hook points:' list is not HOOK_POINTS"

    # A pool small enough to preempt and evict; the second run reuses cached blocks; the reset evicts.
    llm = LLM(num_kv_blocks=24, max_num_batched_tokens=96)
    fired: dict[str, set[str]] = {}
    infos = []
    for point in HOOK_POINTS:
        llm.hooks.add(point, lambda point=point, **kw: fired.setdefault(point, set()).update(kw))
    llm.hooks.add("step.end", lambda info: infos.append(info))
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    llm.generate(demo_prompts(6), params, use_tqdm=False)
    llm.generate(demo_prompts(2), params, use_tqdm=False)
    llm.reset_prefix_cache()
    assert set(fired) == set(HOOK_POINTS), f"never fired (extend this run so it does): {set(HOOK_POINTS) - set(fired)}"
    for point, keywords in fired.items():
        assert set(payloads[point]) == keywords, f"{point}: fired with {sorted(keywords)}, documented {payloads[point]}"
    row = next(line for line in TRACE_API.splitlines() if line.startswith("| `step.end` |"))
    for field in dataclasses.fields(infos[0]):
        assert re.search(rf"`[^`]*\b{field.name}\b[^`]*`", row), f"StepInfo.{field.name} is not in step.end's row"
