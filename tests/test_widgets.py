"""The widgets show exactly what the trace (and the engine) hold, live, replayed and exported."""
from __future__ import annotations

import base64
import re
import time

import numpy as np
import pytest

pytest.importorskip("anywidget")
pytest.importorskip("plotly")

from engine_helpers import greedy, make_llm, token_ids  # noqa: E402

from kvscope.trace import Trace  # noqa: E402
from kvscope.widgets import BlockPoolView, Dashboard, export_html  # noqa: E402
from kvscope.widgets.export import load_payload  # noqa: E402

PROMPTS = ["the quick brown fox jumps over the lazy dog while the cat sleeps"] * 3 + [
    "a paged key value cache stores attention keys and values in blocks",
    "every sequence owns a block table",
]
ENGINE = dict(num_kv_blocks=12, block_size=8, max_num_batched_tokens=32)


def wait_for(cond, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError("condition not reached")
        time.sleep(0.005)


def tables_of(trace, step) -> dict[str, list[int]]:
    df = trace.block_tables(step).sort_values(["request_id", "logical_block"], kind="stable")
    return {rid: g["physical_block"].tolist() for rid, g in df.groupby("request_id", sort=False)}


def check_views(dash: Dashboard, step: int) -> None:
    """Every view at ``step`` against the trace read directly."""
    trace, v = dash.trace, dash.views
    arrays = trace.pool_arrays(step)
    pool = v["pool"]
    assert pool.step == step and pool.num_blocks == trace.num_blocks
    assert pool.state == arrays["state"].astype(np.uint8).tobytes()
    assert pool.ref_count == arrays["ref_count"].astype(np.int32).tobytes()
    assert pool.tables == tables_of(trace, step)
    assert {r["id"]: r["blocks"] for r in v["tables"].rows} == tables_of(trace, step)
    for row in v["tables"].rows:
        assert row["refs"] == arrays["ref_count"][row["blocks"]].tolist()
    slots = trace.slot_mapping(step)
    shown = [t for g in v["slots"].groups for t in g["tokens"]]
    assert [t[3] for t in shown] == slots["slot"].tolist()
    assert [(t[4], t[5]) for t in shown] == list(zip(slots["block_id"], slots["offset"]))
    kinds = dict(zip(trace.scheduled(step)["request_id"], trace.scheduled(step)["is_prefill"]))
    assert {g["id"]: g["kind"] == "prefill" for g in v["slots"].groups} == kinds
    q = trace.queues(step)
    for lane in ("running", "waiting", "preempted", "finished"):
        want = q[q["queue"] == lane].sort_values("position")["request_id"].tolist()
        assert v["queues"].queues[lane] == want
    assert v["timeline"].data[0].x[-1] == trace.step_ids[-1]


def test_live_views_equal_trace_and_engine_after_each_step():
    llm = make_llm(**ENGINE)
    dash = Dashboard(llm, interval=0.001, max_load=1.0)
    engine = llm.llm_engine
    for p in PROMPTS:
        llm.add_request(p, greedy(10))
    n = 0
    while llm.has_unfinished_requests():
        llm.step()
        n += 1
        wait_for(lambda: dash.step == n)
        check_views(dash, n)
        # ... and the engine itself agrees with what the browser gets
        assert dash.views["pool"].ref_count == engine.block_manager.ref_count.tobytes()
        assert dash.views["queues"].queues["running"] == [s.request_id for s in engine.scheduler.running]
    assert dash.trace.steps["num_preemptions"].sum() > 0, "the workload should exercise preemption"
    dash.detach()
    assert dash.slider.max == n and dash.status.value.startswith("detached")


def test_replay_of_a_loaded_trace_shows_the_same_steps(tmp_path):
    llm = make_llm(**ENGINE)
    with llm.record(level="full") as trace:
        llm.generate(PROMPTS, greedy(8), use_tqdm=False)
    loaded = Trace.load(trace.save(tmp_path / "t"))
    live, replay = Dashboard(trace), Dashboard(loaded)
    for step in trace.step_ids[::3]:
        replay.slider.value = step  # what dragging the slider does
        live.show_step(step)
        check_views(replay, step)
        for name in ("pool", "tables", "slots", "queues"):
            a, b = live.views[name], replay.views[name]
            keys = [k for k in a.keys if not k.startswith("_") and k not in ("layout", "tabbable", "tooltip")]
            assert a.get_state(keys) == b.get_state(keys)


def test_a_huge_pool_draws_its_first_blocks(monkeypatch):
    from kvscope.widgets import snapshot

    monkeypatch.setattr(snapshot, "MAX_POOL_BLOCKS", 8)
    llm = make_llm(**ENGINE)  # 12 blocks, more than the 8 drawn
    with llm.record() as trace:
        llm.generate(PROMPTS[:2], greedy(4), use_tqdm=False)
    pool = BlockPoolView(trace, step=2)
    assert pool.num_blocks == 12
    assert pool.state == trace.pool_arrays(2)["state"][:8].tobytes()
    assert pool.ref_count == trace.pool_arrays(2)["ref_count"][:8].astype(np.int32).tobytes()


def test_a_view_is_usable_alone():
    llm = make_llm(**ENGINE)
    with llm.record() as trace:  # "blocks" level: the pool is replayed from events
        llm.generate(PROMPTS[:2], greedy(4), use_tqdm=False)
    pool = BlockPoolView(trace, step=2)
    assert pool.step == 2 and pool.state == trace.pool_arrays(2)["state"].tobytes()
    sent = []
    pool.send = lambda content, buffers=None: sent.append(content)
    b = int(np.flatnonzero(trace.pool_arrays(2)["num_tokens"])[0])
    pool._on_msg(pool, {"type": "inspect", "step": 2, "blocks": [b]}, [])
    facts = sent[0]["blocks"][str(b)]
    assert facts["tokens"] == trace.block_tokens(2, b)
    assert facts["text"] == trace.decode(facts["tokens"])
    assert facts["owners"] == trace.blocks(2)["owners"][b]


def test_pause_step_resume_hold_the_background_run_between_steps():
    llm = make_llm(**ENGINE)
    want = token_ids(llm.generate(PROMPTS, greedy(12), use_tqdm=False))
    dash = Dashboard(llm, interval=0.001, max_load=1.0)
    dash.pause()  # paused before it starts: it stops right after its first step
    run = dash.generate_async(PROMPTS, greedy(12))
    wait_for(lambda: dash.gate.waiting)
    first = dash.trace.step_ids[-1]
    time.sleep(0.2)
    assert dash.trace.step_ids[-1] == first and not run.done()
    wait_for(lambda: dash.step == first)
    assert "paused" in dash.status.value and not dash.step_button.disabled
    for k in (1, 2):
        dash.step_once()
        wait_for(lambda: dash.trace.step_ids[-1] == first + k and dash.gate.waiting)
        time.sleep(0.05)
        assert dash.trace.step_ids[-1] == first + k
    dash.resume()
    assert token_ids(run.result(timeout=30)) == want  # pausing changes nothing
    wait_for(lambda: dash.step == dash.trace.step_ids[-1])
    assert dash.step_button.disabled
    dash.detach()


def test_html_export_contains_the_pool(tmp_path):
    llm = make_llm(**ENGINE)
    dash = Dashboard(llm, interval=0.001, max_load=1.0)
    llm.generate(PROMPTS, greedy(8), use_tqdm=False)
    dash.detach()
    trace = dash.trace
    page = dash.to_html(tmp_path / "trace.html").read_text()
    assert not re.search(r"<script[^>]+src=", page), "the page must not load anything"
    assert f'data-num-blocks="{trace.num_blocks}"' in page
    assert '<section id="kvscope-pool">' in page and "poolGeometry" in page
    payload = load_payload(page)
    assert payload["steps"] == trace.step_ids
    last = trace.step_ids[-1]
    pool = payload["views"]["pool"][-1]
    assert base64.b64decode(pool["state"]) == trace.pool_arrays(last)["state"].tobytes()
    assert pool["tables"] == tables_of(trace, last)
    cached = np.flatnonzero(trace.pool_arrays(last)["num_tokens"])
    assert sorted(map(int, payload["details"][-1])) == cached.tolist()
    small = export_html(trace, tmp_path / "small.html", max_steps=5, include_plotlyjs="cdn")
    assert len(load_payload(small.read_text())["steps"]) == 5


def test_queues_view_shows_each_ranks_kv_shard():
    """Under tensor parallelism the scheduler view lists which KV heads, blocks and bytes each rank holds."""
    from kvscope.widgets.views import QueuesView

    with make_llm(tensor_parallel_size=2, num_kv_blocks=16) as llm:
        with llm.record() as trace:
            llm.generate([[5, 6, 7]], greedy(2), use_tqdm=False)
        shards = llm.llm_engine.executor.kv_shards()
    view = QueuesView(trace)
    assert view.queues["kv_shards"] == shards
    assert [(s["kv_head_start"], s["kv_head_end"]) for s in shards] == [(0, 1), (1, 2)]
