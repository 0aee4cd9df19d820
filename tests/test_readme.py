"""The README's Python examples run as written, on the bundled model, so the first code a user
copies never drifts from the API. The attach example needs a vLLM deployment and is left out."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
PROMPTS = ["The list type", "A dictionary is", "The list type is mutable"]


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def block_with(needle: str) -> str:
    """The one README example that contains ``needle``."""
    found = [b for b in python_blocks() if needle in b]
    assert len(found) == 1, f"expected one README example with {needle!r}, found {len(found)}"
    return found[0]


def run(block: str, namespace: dict) -> str:
    """Execute an example as a notebook cell would; what it prints."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block, str(README), "exec"), namespace)
    return printed.getvalue()


def test_the_quickstart_runs_and_prints_each_completion():
    printed = run(block_with("from kvscope import LLM, SamplingParams   # was:"), {})
    assert len(re.findall(r" (length|stop) \d+\n", printed)) == 2  # text, finish reason, cached tokens


def test_the_recording_example_runs_and_its_saved_trace_loads_back(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch):
    pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    import kvscope

    monkeypatch.chdir(tmp_path)  # the example saves "run.trace" in the working directory
    ns = {"kvscope": kvscope, "llm": kvscope.LLM(), "prompts": PROMPTS,
          "params": kvscope.SamplingParams(temperature=0, max_tokens=8)}
    run(block_with("llm.record(level=\"blocks\")"), ns)
    trace = ns["trace"]
    assert len(trace.requests) == len(PROMPTS) and (tmp_path / "run.trace").is_dir()
    loaded = kvscope.Trace.load(tmp_path / "run.trace")
    assert loaded.steps.equals(trace.steps) and loaded.block_events.equals(trace.block_events)
    ns["llm"].check_invariants()


def test_the_dashboard_example_runs_and_follows_the_generation():
    pytest.importorskip("anywidget")
    ns = {"prompts": PROMPTS}
    run(block_with("kvscope.dashboard(llm); dash"), ns)
    dash, llm = ns["dash"], ns["llm"]
    try:
        steps = llm.llm_engine.scheduler.step_count
        assert steps > 0 and dash.trace.step_ids[-1] == steps
    finally:
        dash.detach()
