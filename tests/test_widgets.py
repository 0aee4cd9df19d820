"""The widgets show exactly what the trace (and the engine) hold, live, replayed and exported."""
from __future__ import annotations

import base64
import importlib
import json
import re
import shutil
import subprocess
import threading
import time
from concurrent.futures import CancelledError, Future
from typing import Callable

import numpy as np
import pytest

pytest.importorskip("anywidget")
pytest.importorskip("plotly")

from engine_helpers import Cycle, greedy, make_llm, token_ids, watch_launches  # noqa: E402
from pool_reference import bucket_summary  # noqa: E402

from kvscope.trace import Recorder, Trace  # noqa: E402
from kvscope.widgets import BlockPoolView, BlockTablesView, Dashboard, export_html  # noqa: E402
from kvscope.widgets.export import load_payload  # noqa: E402
from kvscope.widgets.pool_sync import KEYFRAME, PoolUpdate, apply_update  # noqa: E402
from kvscope.widgets.snapshot import StepData, block_details  # noqa: E402
from kvscope.widgets.views import STATIC, VIEW_CLASSES  # noqa: E402

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


class BrowserPool:
    """The pool as a browser holds it: every message the view sends is taken off the wire and
    applied in order; an update that does not follow the version held asks for a keyframe,
    as ``pool.js`` does."""

    def __init__(self, view: BlockPoolView) -> None:
        self.view, self.version = view, None
        self.model = view.get_state(["delta", "delta_base", "version", "table_ids", "tables"])  # what a browser opened now gets
        self.state = self.ref_count = None
        self.sizes: list[int] = []  # bytes of each pool update on the wire
        self.keyframes = 0
        send = view._send

        def wire(msg, buffers=None):
            send(msg, buffers)
            self.receive(msg["state"], msg["buffer_paths"], buffers or [])

        view._send = wire
        view._on_msg(view, {"type": "resync"}, [])  # attached late, as a browser opened after the run

    def receive(self, state: dict, paths: list, buffers: list) -> None:
        """One update message; traits it leaves out keep their last value (as in the browser's model)."""
        state = dict(state)
        for path, buf in zip(paths, buffers):
            state[path[0]] = bytes(buf)
        self.model.update(state)
        if "version" not in state:
            return
        m = self.model
        binary = {path[0] for path in paths}
        self.sizes.append(len(json.dumps({k: v for k, v in state.items() if k not in binary}))
                          + sum(len(state[k]) for k in binary))
        update = PoolUpdate(m["delta"], m["delta_base"], m["version"])
        if update.base == KEYFRAME:
            self.keyframes += 1
            n = self.view.num_blocks
            self.state, self.ref_count = np.zeros(n, np.uint8), np.zeros(n, np.int32)
        elif update.base != self.version:
            self.view._on_msg(self.view, {"type": "resync"}, [])
            return
        apply_update(self.state, self.ref_count, update)
        self.version = update.version


def decode_tables(ids: list[str], data: bytes) -> list[dict]:
    """The rows (``id, blocks, refs, num_tokens``) of the block tables as sent (``snapshot.encode_tables``:
    ``lengths | tokens | blocks | refcounts``), read as ``kvsDecodeTables`` reads them."""
    values = np.frombuffer(data, dtype=np.int32)
    n = len(ids)
    lengths, tokens = values[:n], values[n:2 * n]
    blocks, refs = np.split(values[2 * n:], 2)
    cuts = np.cumsum(lengths)[:-1]
    return [{"id": rid, "blocks": b.tolist(), "refs": r.tolist(), "num_tokens": int(t)}
            for rid, b, r, t in zip(ids, np.split(blocks, cuts), np.split(refs, cuts), tokens)]


def tables_of(trace, step) -> dict[str, list[int]]:
    df = trace.block_tables(step).sort_values(["request_id", "logical_block"], kind="stable")
    return {rid: g["physical_block"].tolist() for rid, g in df.groupby("request_id", sort=False)}


def assert_rows_match(trace, step: int, rows: list[dict]) -> None:
    """Decoded table rows (blocks, refcounts, tokens per request) as the trace has them at ``step``."""
    arrays = trace.pool_arrays(step)
    assert {r["id"]: r["blocks"] for r in rows} == tables_of(trace, step)
    for r in rows:
        assert r["refs"] == arrays["ref_count"][r["blocks"]].tolist()
        assert r["num_tokens"] == int(arrays["num_tokens"][r["blocks"]].sum())


def check_views(dash: Dashboard, step: int, browser: BrowserPool) -> None:
    """Every view at ``step`` against the trace read directly; the pool as the browser holds it."""
    trace, v = dash.trace, dash.views
    arrays = trace.pool_arrays(step)
    pool = v["pool"]
    assert pool.step == step and pool.num_blocks == trace.num_blocks
    assert (browser.state == arrays["state"]).all()
    assert (browser.ref_count == arrays["ref_count"]).all()
    # the block tables go once, with the pool's update, for the pool and the block-tables views
    rows = decode_tables(browser.model["table_ids"], browser.model["tables"])
    assert {r["id"]: r["blocks"] for r in rows} == tables_of(trace, step)
    for row in rows:
        assert row["refs"] == arrays["ref_count"][row["blocks"]].tolist()
        assert row["num_tokens"] == int(arrays["num_tokens"][row["blocks"]].sum())
    assert v["tables"].pool is pool and v["tables"].step == step
    assert v["tables"].table_ids == [] and v["tables"].tables == b""
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
    life, want = v["lifecycle"], trace.lifecycle
    cols = np.frombuffer(life.intervals, np.int32).reshape(-1, 6)
    assert [life.requests[i]["id"] for i in cols[:, 0]] == want["request_id"].tolist()
    assert [life.states[c] for c in cols[:, 1]] == want["state"].tolist()
    assert cols[:, 2:].tolist() == want[["start_step", "end_step", "num_tokens", "num_cached_tokens"]].to_numpy().tolist()
    req = trace.requests.set_index("request_id")
    for r in life.requests:
        assert r["num_preemptions"] == req.at[r["id"], "num_preemptions"]
        ttft = req.at[r["id"], "ttft_s"]
        assert r["ttft_s"] is None if np.isnan(ttft) else r["ttft_s"] == pytest.approx(ttft)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_live_views_equal_trace_and_engine_after_each_step(async_scheduling):
    """The live dashboard keeps the engine's mode; after each step its views equal the trace,
    and its pool the block manager's (under async scheduling: with the next step scheduled)."""
    llm = make_llm(async_scheduling=async_scheduling, **ENGINE)
    _, ahead = watch_launches(llm)
    dash = Dashboard(llm, interval=0.001, max_load=1.0)
    engine = llm.llm_engine
    for p in PROMPTS:
        llm.add_request(p, greedy(10))
    n = 0
    browser = None
    while llm.has_unfinished_requests():
        llm.step()
        if not dash.trace.step_ids or dash.trace.step_ids[-1] == n:
            continue  # (async: a step() that only launched; a step of preemptions alone)
        n = dash.trace.step_ids[-1]
        wait_for(lambda: dash.step == n or dash.last_error, 10)
        assert dash.last_error is None, dash.last_error
        browser = browser or BrowserPool(dash.views["pool"])
        check_views(dash, n, browser)
        # ... and the engine itself agrees with what the browser holds
        assert (browser.ref_count == engine.block_manager.ref_count).all()
        assert dash.views["queues"].queues["running"] == [s.request_id for s in engine.scheduler.running]
    assert dash.trace.steps["num_preemptions"].sum() > 0, "the workload should exercise preemption"
    assert any(ahead) == async_scheduling, "the dashboard must not switch async scheduling off"
    dash.detach()
    assert dash.slider.max == n and dash.status.value.startswith("detached")


def test_replay_of_a_loaded_trace_shows_the_same_steps(tmp_path):
    llm = make_llm(**ENGINE)
    with llm.record(level="full") as trace:
        llm.generate(PROMPTS, greedy(8), use_tqdm=False)
    loaded = Trace.load(trace.save(tmp_path / "t"))
    live, replay = Dashboard(trace), Dashboard(loaded)
    browser = BrowserPool(replay.views["pool"])
    for step in trace.step_ids[::-3]:  # backwards: each update is a delta back in time
        replay.slider.value = step  # what dragging the slider does
        live.show_step(step)
        check_views(replay, step, browser)
        assert (browser.state == block_states(trace.blocks(step))).all()  # the full level's snapshots
        for name in ("pool", "tables", "slots", "queues"):
            a, b = live.views[name], replay.views[name]
            keys = [k for k in a.keys if not k.startswith("_")
                    and k not in ("layout", "tabbable", "tooltip", "delta", "delta_base", "version", "pool")]
            assert a.get_state(keys) == b.get_state(keys)
    # the play button's ticks move the slider and the views (linked in the kernel)
    replay.play.value = trace.step_ids[1]
    assert replay.slider.value == replay.step == trace.step_ids[1]


def block_states(blocks) -> np.ndarray:
    return blocks["state"].map({"free": 0, "used": 1, "cached": 2}).to_numpy(np.uint8)


def pool_updates(num_kv_blocks: int) -> tuple[list[int], list[int], BrowserPool]:
    """Replay one workload on a pool of ``num_kv_blocks``: the bytes of each update after the
    keyframe, and the blocks whose state or refcount changed from the step before."""
    llm = make_llm(num_kv_blocks=num_kv_blocks, block_size=4, max_num_batched_tokens=64, validate=False)
    with llm.record(level="full") as trace:
        llm.generate(PROMPTS, greedy(6), use_tqdm=False)
    steps = trace.step_ids
    view = BlockPoolView(trace, step=steps[0])
    browser = BrowserPool(view)
    changed = []
    for prev, step in zip(steps, steps[1:]):
        view.update_from(trace, step)
        a, b = trace.blocks(prev), trace.blocks(step)
        changed.append(int(((block_states(a) != block_states(b)) | (a["ref_count"] != b["ref_count"])).sum()))
        assert (browser.state == block_states(b)).all() and (browser.ref_count == b["ref_count"]).all()
    return browser.sizes[1:], changed, browser


def test_pool_updates_are_block_deltas_whose_size_follows_the_changes():
    small, changed_small, _ = pool_updates(64)
    big, changed_big, browser = pool_updates(64 * 256)
    assert changed_small == changed_big  # the same workload changes the same number of blocks
    assert max(changed_big) > 0 and browser.keyframes == 1  # after it, every update follows the one before
    # the same bytes on the wire for a pool 256 times larger: 9 per changed block, plus the
    # step's block tables and a small envelope
    assert big == small
    assert all(size >= 9 * c for size, c in zip(big, changed_big))
    # a keyframe costs the blocks in use, not the pool
    view = browser.view
    view._on_msg(view, {"type": "resync"}, [])
    assert browser.model["delta_base"] == KEYFRAME
    assert len(browser.model["delta"]) == 9 * int((browser.state != 0).sum()) < view.num_blocks


@pytest.mark.parametrize("option, pattern", [
    (dict(max_load=0), r"^max_load must be a share of the wall time in \(0, 1\], got 0$"),
    (dict(interval=float("nan")), r"^interval must be a finite number of seconds >= 0 and <= 86400, got nan$"),
    (dict(interval=-1), r"^interval must be a finite number of seconds >= 0 and <= 86400, got -1$"),
    (dict(interval=86_401), r"^interval must be a finite number of seconds >= 0 and <= 86400, got 86401$"),
    (dict(views=[]), r"^views must name at least one view$"),
    (dict(views=3), r"^views must be view names \(a list of str, or one str separated by commas\), got int$"),
])
def test_bad_dashboard_options_are_refused_by_name_and_attach_nothing(option, pattern):
    """max_load=0 used to stop live updates in the update thread (a division by zero) after
    the first step, with nothing said in the notebook; an interval past threading's longest
    wait killed that thread the same way (an OverflowError there): one past a day is refused."""
    llm = make_llm(num_kv_blocks=16)
    with pytest.raises((ValueError, TypeError), match=pattern):
        Dashboard(llm, **option)
    assert not llm.llm_engine.hooks.active("step.end")
    assert llm.generate([[5, 6, 7]], greedy(3), use_tqdm=False)[0].finished


def test_a_summary_trace_is_not_exported_and_nothing_is_written(tmp_path):
    """The page shows the block views: a summary trace is refused by its level up front (the
    error named block_tables, from inside the page's build)."""
    llm = make_llm(**ENGINE)
    with llm.record("summary") as trace:
        llm.generate(PROMPTS[:2], greedy(4), use_tqdm=False)
    with pytest.raises(ValueError, match="export_html needs a trace recorded at level 'blocks' or 'full'.*'summary'"):
        export_html(trace, tmp_path / "page.html")
    assert not (tmp_path / "page.html").exists()


def test_a_summary_trace_replays_in_the_timeline_and_block_views_are_refused_by_name(tmp_path):
    """The level check reads the replayed trace's level (it read the ``level`` option, so a
    summary trace failed inside the pool view, naming pool_arrays). Without ``views`` the
    replay shows the timeline, the one view a summary feeds (the default views were refused)."""
    llm = make_llm(**ENGINE)
    with llm.record("summary") as trace:
        llm.generate(PROMPTS[:2], greedy(4), use_tqdm=False)
    loaded = Trace.load(trace.save(tmp_path / "t"))
    for source in (trace, loaded):
        with pytest.raises(ValueError, match=re.escape("level 'summary' records no blocks: the only view it can "
                                                       "feed is 'timeline'")):
            Dashboard(source, views="pool,timeline")
        for dash in (Dashboard(source), Dashboard(source, views="timeline")):
            assert list(dash.views) == ["timeline"] and dash.step == trace.step_ids[-1]
            assert list(dash.views["timeline"].data[0].x) == trace.step_ids


def test_show_step_takes_integers_only_and_a_refused_step_leaves_the_views_where_they_were():
    """``show_step`` shows the nearest recorded step at or before an integer; NaN showed the
    newest, 1.5 and True step 1, None and a str raised a bare comparison error."""
    llm = make_llm(**ENGINE)
    with llm.record("blocks") as trace:
        llm.generate(PROMPTS[:2], greedy(4), use_tqdm=False)
    dash = Dashboard(trace, views="pool")
    ids = trace.step_ids
    dash.show_step(np.int64(ids[1]))
    assert dash.step == dash.views["pool"].step == ids[1]
    for step in (float("nan"), 1.5, True, None, "3"):
        with pytest.raises(TypeError, match=f"step must be an integer .*got {re.escape(repr(step))}"):
            dash.show_step(step)
        assert dash.step == dash.views["pool"].step == ids[1]
    dash.show_step(ids[-1] + 100)
    assert dash.step == ids[-1] and (BrowserPool(dash.views["pool"]).state == trace.pool_arrays(ids[-1])["state"]).all()


@pytest.mark.parametrize("options, error, says", [
    (dict(max_tokens=0), ValueError, "max_tokens must be an integer >= 1"),
    (dict(num_prompts=0), ValueError, "num_prompts must be an integer >= 1"),
    (dict(num_prompts=2.5), ValueError, "num_prompts must be an integer >= 1"),
])
def test_a_demo_refused_for_its_workload_leaves_the_llm_unrecorded(options, error, says):
    """``demo(llm, ...)`` with a workload it refuses: the dashboard attached first, so the refusal
    left ``llm`` recording with no dashboard to detach (num_prompts 0 ran nothing, unsaid)."""
    from kvscope.demo import demo
    from kvscope.trace import HOOK_POINTS

    llm = make_llm(**ENGINE)
    with pytest.raises(error, match=says):
        demo(llm, **options)
    assert not llm.hooks.block_sinks and not any(llm.hooks.active(name) for name in HOOK_POINTS)


def test_views_as_one_comma_separated_str_are_the_views_as_a_list():
    llm = make_llm(num_kv_blocks=16)
    for views in (["pool", "queues"], "pool, queues"):
        dash = Dashboard(llm, views=views)
        assert list(dash.views) == ["pool", "queues"]
        dash.detach()


def test_a_view_is_usable_alone():
    llm = make_llm(**ENGINE)
    with llm.record() as trace:  # "blocks" level: the pool is replayed from events
        llm.generate(PROMPTS[:2], greedy(4), use_tqdm=False)
    pool = BlockPoolView(trace, step=2)
    assert pool.step == 2 and (BrowserPool(pool).state == trace.pool_arrays(2)["state"]).all()
    tables = BlockTablesView(trace, step=2)  # alone, it sends its own tables
    assert tables.pool is None
    assert_rows_match(trace, 2, decode_tables(tables.table_ids, tables.tables))
    sent = []
    pool.send = lambda content, buffers=None: sent.append(content)
    b = int(np.flatnonzero(trace.pool_arrays(2)["num_tokens"])[0])
    pool._on_msg(pool, {"type": "inspect", "step": 2, "blocks": [b]}, [])
    facts = sent[0]["blocks"][str(b)]
    assert facts["tokens"] == trace.block_tokens(2, b)
    assert facts["text"] == trace.decode(facts["tokens"])
    assert facts["owners"] == trace.blocks(2)["owners"][b]


@pytest.mark.parametrize("name", list(VIEW_CLASSES))
def test_a_view_of_a_trace_with_no_steps_yet_shows_nothing_and_a_step_not_recorded_is_refused(name):
    """A view built on a live trace before its first step is empty (an IndexError before) and
    shows the newest step once there is one, as the trace holds it; a step the trace does not
    hold is refused by name (the lifecycle and timeline views showed it, the others raised a
    KeyError from inside the trace)."""
    llm = make_llm(**ENGINE)
    with llm.record("blocks") as trace:
        view = VIEW_CLASSES[name](trace)
        assert getattr(view, "step", -1) == -1
        llm.generate(PROMPTS[:2], greedy(4), use_tqdm=False)
    newest = trace.step_ids[-1]
    view.update_from(trace, newest)
    if name == "pool":
        assert (BrowserPool(view).state == trace.pool_arrays(newest)["state"]).all()
    for step in (newest + 1, trace.step_ids[0] - 1, 1.0):
        with pytest.raises(ValueError, match=f"step must be one of trace.step_ids .*got {step!r}"):
            view.update_from(trace, step)


def test_a_request_id_used_again_is_one_lifecycle_lane_with_the_newest_requests_facts():
    """Two requests, one after the other, with the id "r": trace.requests has a row for each,
    and the lifecycle view (it failed: reindex on duplicate labels) shows one lane for "r"
    with its two lives and the facts of the newest, as its RequestOutput says."""
    llm = make_llm(**ENGINE)
    final = []
    with llm.record("blocks") as trace:
        for prompt, n in (([5, 6, 7], 2), ([5, 6, 7, 8, 9, 10, 11, 12, 13], 4)):
            llm.add_request(prompt, greedy(n), "r")
            while llm.has_unfinished_requests():
                final += [o for o in llm.step() if o.finished]
    view = Dashboard(trace).views["lifecycle"]
    lanes = [r for r in view.requests if r["id"] == "r"]
    newest = final[-1]
    assert len(lanes) == 1 and (lanes[0]["prompt_len"], lanes[0]["output_len"]) == (
        len(newest.prompt_token_ids), len(newest.outputs[0].token_ids))
    states = [view.states[c] for c in np.frombuffer(view.intervals, np.int32).reshape(-1, 6)[:, 1]]
    assert states.count("finished") == 2


def test_a_hover_on_a_step_the_ring_buffer_dropped_gets_no_facts_and_raises_nothing():
    """Live, with a small ring buffer, the browser may ask for the blocks of a step the trace
    has dropped since it showed it: the answer is empty and says the step is not held (a
    KeyError from the trace before, whose traceback ipywidgets prints in the notebook), and a
    held step's answer is its facts (test_browser: what the tooltip then says)."""
    llm = make_llm(**ENGINE)
    dash = Dashboard(llm, views="pool", max_steps=2, interval=0.001, max_load=1.0)
    llm.generate(PROMPTS, greedy(6), use_tqdm=False)
    dash.detach()
    pool, trace = dash.views["pool"], dash.trace
    sent = []
    pool.send = lambda content, buffers=None: sent.append(content)
    dropped, held = trace.step_ids[0] - 1, trace.step_ids[-1]
    block = int(np.argmax(trace.pool_arrays(held)["num_tokens"]))
    pool._on_msg(pool, {"type": "inspect", "step": dropped, "blocks": [block]}, [])
    pool._on_msg(pool, {"type": "inspect", "step": held, "blocks": [block]}, [])
    assert sent == [{"type": "details", "step": dropped, "held": False, "blocks": {}},
                    {"type": "details", "step": held, "held": True,
                     "blocks": block_details(StepData(trace, held), [block])}]


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


def step_held_run(dash: Dashboard, check: Callable[[int], None] = lambda newest: None, holds: int = 2) -> None:
    """Through ``holds`` holds of a paused background run: each time, wait until the status says
    it is paused at the newest step, ``check`` that step, then Step once past it."""
    for _ in range(holds):
        wait_for(lambda: dash.gate.waiting)
        newest = dash.trace.step_ids[-1]
        wait_for(lambda: f"paused at step {newest}" in dash.status.value, timeout=5)
        check(newest)
        dash.step_once()
        wait_for(lambda: dash.trace.step_ids[-1] > newest)


@pytest.mark.parametrize("follow", [True, False], ids=["following", "not-following"])
def test_the_paused_status_comes_when_the_steps_update_ran_before_the_hold(follow):
    """A step's listener wakes the updater before the run holds after that step: an update in
    between reads "not held yet" and writes "pausing…". The hold then needs an update of its own,
    which writes the status whether or not the views follow the newest step. The hold only cut
    short the throttle of an update that a new step wakes, and no step comes while paused: the
    status said "pausing…" until the next Step; and an update that showed no step (follow live
    unticked) never wrote the status at all. The first hold is forced into that moment (a long
    interval: one update per step woken, none else)."""
    llm = make_llm(**ENGINE)
    dash = Dashboard(llm, interval=10.0, max_load=1.0)
    dash.follow.value = follow  # unticked: the user keeps the step shown (none yet)
    hold, seen = dash.gate.wait, []

    def late_hold(on_hold, stop) -> None:
        if not seen:
            wait_for(lambda: dash.num_updates == 1)  # the update the first step woke is over
            seen.append(dash.status.value)
        hold(on_hold, stop)

    dash.gate.wait = late_hold
    dash.pause()
    run = dash.generate_async(PROMPTS, greedy(12))
    def shown(newest: int) -> None:  # (unticked: the slider's first step)
        assert dash.step == (newest if follow else dash.trace.step_ids[0])

    step_held_run(dash, shown)  # the forced hold, then one after a Step
    assert "pausing" in seen[0]
    dash.resume()
    run.result(timeout=30)
    dash.detach()


def test_a_tiny_max_load_throttles_updates_without_killing_the_updater():
    """The throttle waits ``cost / max_load``: with a ``max_load`` the options take (any share in
    (0, 1]) but tiny, that wait passed threading's longest, and the updater thread died of an
    OverflowError after its first update: no update came again, not even the one a held run
    asks for to show that it is paused. A tiny share throttles the updates, but a hold still
    gets its update."""
    llm = make_llm(**ENGINE)
    dash = Dashboard(llm, interval=0.0, max_load=1e-15)
    llm.generate(PROMPTS, greedy(4), use_tqdm=False)
    wait_for(lambda: dash.num_updates >= 1)  # the first update is over: the throttle waits now
    dash.pause()
    run = dash.generate_async(PROMPTS, greedy(6))
    step_held_run(dash)  # the first hold, then one after a Step
    dash.resume()
    run.result(timeout=30)
    dash.detach()


def test_while_paused_the_notebook_adds_and_aborts_requests_and_steps_run_them(monkeypatch):
    """Paused, the background run waits between two steps, not inside one: the notebook's
    add_request, abort_request and check_invariants go through at once (they waited for the
    step, and raised after STEP_WAIT_S), and Steps run the added request beside the run's."""
    import kvscope.llm as llm_module

    monkeypatch.setattr(llm_module, "STEP_WAIT_S", 1.0)
    llm = make_llm(**ENGINE)
    want = token_ids(llm.generate(PROMPTS, greedy(12), use_tqdm=False))
    extra = "a fox and a dog"
    want_extra = token_ids(llm.generate([extra], greedy(4), use_tqdm=False))
    scheduled = []
    llm.hooks.add("step.end", lambda info: scheduled.append(set(info.request_ids.values())))
    dash = Dashboard(llm, interval=0.001, max_load=1.0)
    dash.pause()
    run = dash.generate_async(PROMPTS, greedy(12))
    wait_for(lambda: dash.gate.waiting)
    added = llm.add_request(extra, greedy(4))
    dropped = llm.add_request(extra, greedy(4))
    llm.abort_request(dropped)
    llm.check_invariants()
    while not any(added in ids for ids in scheduled):  # (it waits its turn for blocks)
        seen = len(scheduled)
        dash.step_once()
        wait_for(lambda: len(scheduled) > seen and (dash.gate.waiting or run.done()))
        assert not run.done(), "the added request did not run beside the background run"
    assert not any(dropped in ids for ids in scheduled)
    dash.resume()
    assert token_ids(run.result(timeout=30)) == want
    final = {}
    while llm.has_unfinished_requests():
        final.update({o.request_id: o for o in llm.step() if o.finished})
    assert final[dropped].outputs[0].finish_reason == "abort"
    assert [final[added].outputs[0].token_ids] == want_extra
    dash.detach()


@pytest.mark.parametrize("call", ["generate", "step"])
def test_a_generate_while_paused_says_the_run_is_paused_instead_of_waiting_for_ever(call, monkeypatch):
    """Paused, the background run holds the LLM's call between two steps: the notebook's own
    generate() or step() would wait for that call to end, which needs a Resume that a busy
    kernel cannot receive. It raises after STEP_WAIT_S without a step taken, and the run then
    resumes to its tokens."""
    import kvscope.llm as llm_module

    monkeypatch.setattr(llm_module, "STEP_WAIT_S", 1.0)
    llm = make_llm(**ENGINE)
    want = token_ids(llm.generate(PROMPTS, greedy(12), use_tqdm=False))
    dash = Dashboard(llm, interval=0.001, max_load=1.0)
    dash.pause()
    run = dash.generate_async(PROMPTS, greedy(12))
    wait_for(lambda: dash.gate.waiting)
    errors = []
    calls = {"generate": lambda: llm.generate(PROMPTS[:1], greedy(2), use_tqdm=False), "step": llm.step}

    def notebook() -> None:
        try:
            calls[call]()
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=notebook, daemon=True)
    thread.start()
    thread.join(10)
    alive = thread.is_alive()
    dash.resume()
    assert not alive and len(errors) == 1, "the call waited for the paused run"
    assert re.match(rf"LLM\.{call}: another thread's call has not stepped the engine for 1 s", str(errors[0]))
    assert token_ids(run.result(timeout=30)) == want
    dash.detach()


def fresh_tokens(async_scheduling: bool = False) -> list[list[int]]:
    """The background runs' tokens from an engine nothing ran on before."""
    llm = make_llm(async_scheduling=async_scheduling, **ENGINE)
    return token_ids(llm.generate(PROMPTS, greedy(12), use_tqdm=False))


def assert_stopped(run, llm) -> None:
    """The run's Future says it was stopped, and the engine kept nothing of it: no request, no
    step in flight (async scheduling), every block free, its tables consistent."""
    with pytest.raises(CancelledError, match=r"stopped by Dashboard\.stop\(\)") as stopped:
        run.result(timeout=30)
    assert isinstance(stopped.value.__cause__, KeyboardInterrupt)
    assert not llm.has_unfinished_requests()
    llm.check_invariants()
    assert llm.llm_engine.block_manager.num_free_blocks == ENGINE["num_kv_blocks"]


def assert_live_after_stop(dash: Dashboard, llm, want: list[list[int]]) -> None:
    """After a stop the dashboard is as live as before: a new background run gives a fresh
    engine's tokens, and the cell's own generate moves the views."""
    wait_for(lambda: dash.stop_button.disabled)  # (the status follows the Future's end)
    assert "stopping" not in dash.status.value
    run = dash.generate_async(PROMPTS, greedy(12))
    assert token_ids(run.result(timeout=30)) == want
    shown = dash.trace.step_ids[-1]
    llm.generate(PROMPTS[:1], greedy(3), use_tqdm=False)
    newest = dash.trace.step_ids[-1]
    assert newest > shown
    wait_for(lambda: dash.step == newest)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_stop_ends_the_background_run_after_the_step_under_way(async_scheduling):
    """Stop ends a running background run at the next point between two steps, as a Ctrl-C
    there would (generate aborts its requests); the Future raises CancelledError, where
    ``Future.cancel`` did nothing and a Ctrl-C in the notebook only ended the wait. The stop
    comes after the dashboard's listener had the step (a hook of the user's, later, waits for
    it) and still lands before the next step is launched. The trace keeps the steps run, the
    last one the step launched already (under async scheduling the one after the step held,
    read back as its requests are aborted)."""
    want = fresh_tokens(async_scheduling)
    llm = make_llm(async_scheduling=async_scheduling, **ENGINE)
    dash = Dashboard(llm, interval=0.001, max_load=1.0)
    reached, stopped = threading.Event(), threading.Event()
    at, launched = [], []

    def hold_third_step(info) -> None:
        if threading.current_thread() is dash._bg_thread and len(at) < 3:
            at.append(info.step)
            if len(at) == 3:
                launched.append(llm.llm_engine.scheduler.step_count)
                reached.set()
                stopped.wait(10)

    hook = llm.hooks.add("step.end", hold_third_step)
    run = dash.generate_async(PROMPTS, greedy(12))
    assert reached.wait(10) and not dash.stop_button.disabled
    dash.stop()
    assert "stopping" in dash.status.value
    stopped.set()
    assert_stopped(run, llm)
    hook.remove()
    assert launched == [at[-1] + async_scheduling]
    assert llm.llm_engine.scheduler.step_count == dash.trace.step_ids[-1] == launched[0], "a step ran after the stop"
    assert_live_after_stop(dash, llm, want)
    dash.detach()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_stop_while_paused_ends_the_run_with_no_further_step(async_scheduling):
    """Paused between two steps, Stop ends the run there, even when Pause is pressed again
    before the run wakes: no step after the one it was paused at (under async scheduling, the
    one launched before the pause is read back as its requests are aborted, and no other)."""
    want = fresh_tokens(async_scheduling)
    llm = make_llm(async_scheduling=async_scheduling, **ENGINE)
    dash = Dashboard(llm, interval=0.001, max_load=1.0)
    dash.pause()
    run = dash.generate_async(PROMPTS, greedy(12))
    wait_for(lambda: dash.gate.waiting)
    dash.step_once()
    wait_for(lambda: dash.gate.waiting and dash.trace.step_ids[-1] > dash.trace.step_ids[0])
    held, launched = dash.trace.step_ids[-1], llm.llm_engine.scheduler.step_count
    assert launched == held + async_scheduling
    with dash.gate._cond:  # the run wakes only once Pause has come after the Stop
        dash.stop()
        dash.pause()
    assert_stopped(run, llm)
    assert llm.llm_engine.scheduler.step_count == dash.trace.step_ids[-1] == launched, "a step ran after the stop"
    assert not dash.gate.paused  # the next run starts unpaused
    assert_live_after_stop(dash, llm, want)
    dash.detach()


def test_stop_with_no_background_run_going_does_nothing():
    """Before any run, after one has finished, and on a replay: stop() changes nothing, and a
    stop after a run has finished does not reach the next run."""
    want = fresh_tokens()
    llm = make_llm(**ENGINE)
    dash = Dashboard(llm, interval=0.001, max_load=1.0)
    status = dash.status.value
    dash.stop()
    assert dash.status.value == status and dash.run_future is None and dash.stop_button.disabled
    first = dash.generate_async(PROMPTS, greedy(12))
    assert token_ids(first.result(timeout=30)) == want
    dash.stop()
    assert token_ids(first.result()) == want
    second = dash.generate_async(PROMPTS, greedy(12))
    assert token_ids(second.result(timeout=30)) == want
    dash.detach()
    replay = Dashboard(dash.trace)
    replay.stop()
    assert replay.status.value.startswith("replay")


def test_a_background_run_asked_for_while_the_dashboard_detaches_is_refused(monkeypatch):
    """detach() lets the background run finish before it stops recording. A generate_async
    from another thread in that wait started a run on a dashboard about to stop recording it;
    it is refused as on a detached dashboard, and the first run's outputs stand."""
    module = importlib.import_module("kvscope.widgets.dashboard")  # (the package names a function so)
    llm = make_llm(**ENGINE)
    dash = Dashboard(llm, interval=0.001, max_load=1.0)
    dash.pause()
    run = dash.generate_async(PROMPTS, greedy(12))
    wait_for(lambda: dash.gate.waiting)
    asked = []

    def wait_then_ask(futures):
        done = real_wait(futures)
        try:
            asked.append(dash.generate_async(PROMPTS, greedy(12)))
        except RuntimeError as exc:
            asked.append(exc)
        return done

    real_wait = module.wait
    monkeypatch.setattr(module, "wait", wait_then_ask)
    dash.detach()
    assert len(asked) == 1 and isinstance(asked[0], RuntimeError), asked
    assert "live dashboard" in str(asked[0])
    assert token_ids(run.result(timeout=30)) == fresh_tokens()
    assert dash.status.value.startswith("detached")


def test_the_stop_button_is_enabled_only_while_a_background_run_goes_and_clicking_it_stops_the_run():
    """Stop sits beside Pause / Step / Resume and, like them, is enabled only during a
    background run; clicking it is dash.stop()."""
    want = fresh_tokens()
    llm = make_llm(**ENGINE)
    dash = Dashboard(llm, interval=0.001, max_load=1.0)
    buttons = dash.widget.children[0].children
    assert buttons[:4] == (dash.pause_button, dash.step_button, dash.resume_button, dash.stop_button)
    assert dash.stop_button.icon == "stop" and "kvscope-stop" in dash.stop_button._dom_classes
    assert dash.stop_button.disabled
    dash.pause()
    run = dash.generate_async(PROMPTS, greedy(12))
    wait_for(lambda: dash.gate.waiting)
    assert not dash.stop_button.disabled
    dash.stop_button.click()
    assert_stopped(run, llm)
    wait_for(lambda: all(b.disabled for b in buttons[:4]))
    assert_live_after_stop(dash, llm, want)
    dash.detach()


@pytest.mark.parametrize("max_steps", [2000, 3], ids=["whole-run", "ring-of-3"])
def test_a_live_dashboard_follows_the_newest_step_until_the_user_moves_away(max_steps):
    """The dashboard's own slider moves never switch "follow live" off: not a first update that
    finds several steps (a busy machine), not the ring buffer dropping the step shown. A move
    by the user does, and ticking "follow live" again goes back to the newest step."""
    llm = make_llm(**ENGINE)
    dash = Dashboard(llm, max_steps=max_steps, interval=0.001, max_load=1.0)
    with dash._lock:  # the updater waits, as on a busy machine, while the first steps run
        run = dash.generate_async(PROMPTS, greedy(12))
        wait_for(lambda: len(dash.trace.step_ids) and dash.trace.step_ids[-1] >= 8)
    run.result(timeout=30)
    wait_for(lambda: dash.step == dash.trace.step_ids[-1])
    with dash._lock:  # (the update that showed it may still be moving the linked play widget)
        assert dash.follow.value
        assert dash.slider.value == dash.play.value == dash.trace.step_ids[-1]
        assert dash.slider.min == dash.trace.step_ids[0]

    first = dash.trace.step_ids[0]
    dash.slider.value = first  # what dragging the slider does
    assert not dash.follow.value and dash.step == first
    llm.generate(PROMPTS[:1], greedy(4), use_tqdm=False)
    # it stays on the step chosen, or on the oldest one kept once the ring buffer dropped that
    wait_for(lambda: dash.slider.max == dash.trace.step_ids[-1] and dash.step == max(first, dash.trace.step_ids[0]))
    assert not dash.follow.value
    dash.follow.value = True
    assert dash.step == dash.trace.step_ids[-1]
    dash.detach()


def _long_background_run(max_steps: int) -> tuple[Dashboard, Recorder, Future]:
    """A live dashboard whose ring buffer drops a step at every step of a background run, and
    a recording of every step of it beside (the test stops both)."""
    llm = make_llm(num_kv_blocks=64, block_size=4, max_num_batched_tokens=32)
    everything = Recorder(llm.llm_engine, "full")
    everything.start()
    dash = Dashboard(llm, max_steps=max_steps, interval=0.01, max_load=1.0)
    run = dash.generate_async([[5 + i, 6, 7, 8 + i] for i in range(6)], greedy(240))  # (stopped by the test)
    wait_for(lambda: len(dash.trace.step_ids) == max_steps)
    return dash, everything, run


def test_showing_the_oldest_step_while_the_ring_buffer_drops_it_shows_a_whole_step():
    """Scrubbing back in a live run longer than ``max_steps``: the step shown (and the slider's
    minimum, which the updater raises) is the oldest kept, which the engine drops meanwhile. A
    view that read it after the drop raised a KeyError (an IndexError from the step's summary
    row), in the notebook or as a lasting "update error" in the status. Each show now holds the
    steps it reads: every view shows one step, as a recording of every step has it."""
    dash, recorder, run = _long_background_run(max_steps=4)
    everything = recorder.trace
    for _ in range(12):
        oldest = dash.trace.step_ids[0]
        dash.show_step(oldest)
        v, step = dash.views, dash.step
        assert v["pool"].step == v["slots"].step == v["queues"].step == v["tables"].step == step
        assert v["queues"].queues["used"] == everything.steps.set_index("step").at[step, "num_used_blocks"]
        wait_for(lambda: dash.trace.step_ids[0] > oldest)  # (the next show's oldest is a new one)
    dash.stop()
    recorder.stop()
    dash.detach()
    assert dash.last_error is None


def test_an_export_during_a_background_run_is_the_pool_of_the_steps_it_names(tmp_path):
    """``dash.to_html`` while the run goes: the export reads each of the steps it picked, and
    the ring buffer dropped the oldest of them meanwhile (a KeyError, most exports). It holds
    them now: each exported step's pool, rebuilt from the page's deltas as the browser does, is
    the pool a recording of every step saw."""
    dash, recorder, run = _long_background_run(max_steps=8)
    everything, pages = recorder.trace, []
    for i in range(3):
        oldest = dash.trace.step_ids[0]
        pages.append(load_payload(dash.to_html(tmp_path / f"{i}.html").read_text()))
        wait_for(lambda: dash.trace.step_ids[0] > oldest)  # (the next export's steps are new ones)
    dash.stop()
    recorder.stop()
    dash.detach()
    for payload in pages:
        n = dash.trace.num_blocks
        state, refs = np.zeros(n, np.uint8), np.zeros(n, np.int32)
        for step, view in zip(payload["steps"], payload["views"]["pool"]):
            update = PoolUpdate(base64.b64decode(view["delta"]), view["delta_base"], view["version"])
            apply_update(state, refs, update)
            want = everything.pool_arrays(step)
            assert (state == want["state"]).all() and (refs == want["ref_count"]).all()


def test_a_slider_move_while_an_update_waits_for_the_lock_is_not_undone():
    """The updater reads "follow live" once it holds the widgets' lock. It used to read it
    before: an update woken by new steps read "on", waited while the user dragged the slider
    back, then jumped to the newest step anyway."""
    llm = make_llm(**ENGINE)
    dash = Dashboard(llm, max_steps=2000, interval=0.001, max_load=1.0)
    llm.generate(PROMPTS, greedy(6), use_tqdm=False)
    wait_for(lambda: dash.step == dash.trace.step_ids[-1])
    first = dash.trace.step_ids[0]
    with dash._lock:
        updates = dash.num_updates
        llm.generate(PROMPTS[:1], greedy(3), use_tqdm=False)  # wakes the updater, which waits here
        time.sleep(0.3)
        dash.slider.value = first  # the user's move, while that update waits
    wait_for(lambda: dash.num_updates > updates and dash.slider.max == dash.trace.step_ids[-1])
    with dash._lock:
        assert dash.step == first and dash.slider.value == first and not dash.follow.value
    dash.detach()


def test_an_update_between_a_records_append_and_its_listener_shows_the_steps_the_series_holds():
    """The recorder appends step n (trace.step_ids shows it) and then calls the dashboard's
    listener; an update by the updater thread in between shows step n - 1 (it raised IndexError
    reading step n's row before). Each step's update is forced into that moment."""
    llm = make_llm(**ENGINE)
    dash = Dashboard(llm, max_steps=2000, interval=10.0, max_load=1.0)  # (the updater thread stays out)
    queue, shown = dash.series.add, []

    def update_first(record) -> None:
        dash._refresh(follow=True)
        shown.append((record.step, dash.step))
        queue(record)

    dash.series.add = update_first
    llm.generate(PROMPTS, greedy(6), use_tqdm=False)
    dash.detach()
    assert dash.last_error is None
    assert len(shown) > 2 and [seen for _, seen in shown[1:]] == [step for step, _ in shown[:-1]]


def test_live_dashboards_keep_full_collections_off_the_heap_they_attached_to():
    """Objects that existed when the first live dashboard attached are frozen until the last one
    detaches, which collects those that became garbage; a freeze the program made itself is
    neither thawed nor doubled."""
    import gc
    import weakref

    assert gc.get_freeze_count() == 0, "a live dashboard (or a freeze) was left behind by an earlier test"
    llm = make_llm(**ENGINE)
    old = Cycle()
    gone = weakref.ref(old)
    first = Dashboard(llm, interval=0.001, max_load=1.0)
    del old
    second = Dashboard(llm, interval=0.001, max_load=1.0)
    llm.generate(PROMPTS[:2], greedy(4), use_tqdm=False)
    gc.collect()
    assert gone() is not None, "the heap from before attaching must be frozen while live"
    first.detach()
    gc.collect()
    assert gone() is not None, "still frozen: the second dashboard is live"
    new = Cycle()
    new_gone = weakref.ref(new)
    del new
    gc.collect()
    assert new_gone() is None, "what is made while live is collected as usual"
    second.detach()
    assert gone() is None and gc.get_freeze_count() == 0, "the last detach thaws and collects"

    # The program's own freeze, told apart by what the collector frees (the freeze count itself
    # drops whenever another thread frees a frozen object): a cycle frozen by the program stays
    # frozen through an attach and a detach, and one made after it is not frozen by the attach.
    mine = Cycle()
    mine_gone = weakref.ref(mine)
    gc.freeze()
    try:
        del mine
        later = Cycle()
        later_gone = weakref.ref(later)
        dash = Dashboard(llm, interval=0.001, max_load=1.0)
        del later
        gc.collect()
        assert later_gone() is None, "attaching froze the heap again over the program's freeze"
        dash.detach()
        gc.collect()
        assert mine_gone() is not None, "detaching thawed the program's own freeze"
    finally:
        gc.unfreeze()
    gc.collect()
    assert mine_gone() is None


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
    state, refs = np.zeros(trace.num_blocks, np.uint8), np.zeros(trace.num_blocks, np.int32)
    for step, pool in zip(trace.step_ids, payload["views"]["pool"]):  # the deltas, folded in order
        apply_update(state, refs, PoolUpdate(base64.b64decode(pool["delta"]), pool["delta_base"], pool["version"]))
        assert (state == trace.pool_arrays(step)["state"]).all() and (refs == trace.pool_arrays(step)["ref_count"]).all()
    last = trace.step_ids[-1]
    rows = decode_tables(pool["table_ids"], base64.b64decode(pool["tables"]))
    assert {r["id"]: r["blocks"] for r in rows} == tables_of(trace, last)
    assert all(t == {"step": s} for t, s in zip(payload["views"]["tables"], payload["steps"]))  # read from the pool
    facts = {}  # each step lists the blocks whose hover facts it changed
    for changed in payload["details"]:
        facts.update(changed)
    held = np.flatnonzero(trace.pool_arrays(last)["num_tokens"])
    assert sorted(int(b) for b, f in facts.items() if f["tokens"]) == held.tolist()
    assert facts == block_details(StepData(trace, last), list(map(int, facts)))
    small = export_html(trace, tmp_path / "small.html", max_steps=5, include_plotlyjs="cdn")
    assert len(load_payload(small.read_text())["steps"]) == 5


@pytest.mark.parametrize("options, error, says", [
    (dict(max_steps=0), ValueError, "max_steps must be an integer >= 2"),
    (dict(max_steps=1), ValueError, "max_steps must be an integer >= 2"),
    (dict(max_steps=2.5), ValueError, "max_steps must be an integer >= 2"),
    (dict(max_steps=None), ValueError, "max_steps must be an integer >= 2"),
    (dict(max_steps=True), ValueError, "max_steps must be an integer >= 2"),
    (dict(step="last"), TypeError, "step must be an integer"),
])
def test_export_options_out_of_range_are_refused_by_name_and_write_nothing(tmp_path, options, error, says):
    """Before, max_steps 0 raised an IndexError, a float or None a bare TypeError, and 1 wrote a
    page of the first step only, though the first and last are always exported; the smallest
    accepted, 2, exports exactly those two."""
    llm = make_llm(**ENGINE)
    with llm.record("blocks") as trace:
        llm.generate(PROMPTS[:2], greedy(4), use_tqdm=False)
    with pytest.raises(error, match=says):
        export_html(trace, tmp_path / "bad.html", **options)
    assert not (tmp_path / "bad.html").exists()
    page = export_html(trace, tmp_path / "two.html", max_steps=2, step=-10**9).read_text()
    assert load_payload(page)["steps"] == [trace.step_ids[0], trace.step_ids[-1]]


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


def wire_log(view) -> list[tuple[dict, list, list]]:
    """Every update message ``view`` sends to the browser: (state, buffer paths, buffers)."""
    log, send = [], view._send

    def wire(msg, buffers=None):
        send(msg, buffers)
        if msg.get("method") == "update":
            log.append((msg["state"], msg["buffer_paths"], [bytes(b) for b in buffers or []]))

    view._send = wire
    return log


def test_a_live_dashboard_sends_the_block_tables_once_per_update_as_one_binary_buffer():
    """The pool view's update carries the block tables as a binary buffer; the block-tables
    view, linked to it, sends only its step (it sent the same tables again, as JSON lists)."""
    llm = make_llm(**ENGINE)
    dash = Dashboard(llm, interval=0.001, max_load=1.0)
    pool_log, tables_log = wire_log(dash.views["pool"]), wire_log(dash.views["tables"])
    llm.generate(PROMPTS, greedy(8), use_tqdm=False)
    dash.detach()
    assert sum(["tables"] in paths for _, paths, _ in pool_log) > 3  # the tables went as a binary buffer ...
    assert all("tables" not in state for state, _, _ in pool_log)  # ... never as JSON
    assert {k for state, _, _ in tables_log for k in state} == {"step"}


def test_a_block_tables_view_alone_sends_its_tables_as_one_binary_buffer():
    """With no pool view to read them from, the block-tables view sends each step's tables as the
    pool view does: the request ids and one int32 buffer, which holds the trace's tables with
    their refcounts and tokens (it sent a JSON list per table, and one per table's refcounts)."""
    llm = make_llm(**ENGINE)
    with llm.record() as trace:
        llm.generate(PROMPTS, greedy(8), use_tqdm=False)
    view = BlockTablesView(trace, step=trace.step_ids[0])
    held = view.get_state(["table_ids", "tables"])  # what a browser opened now gets
    log = wire_log(view)
    for step in trace.step_ids[1:]:
        view.update_from(trace, step)
    assert sum(paths == [["tables"]] for _, paths, _ in log) > 3
    for step, (state, paths, buffers) in zip(trace.step_ids[1:], log, strict=True):
        assert state["step"] == step and "tables" not in state and paths in ([], [["tables"]])
        held.update(state, **{path[0]: buf for path, buf in zip(paths, buffers)})  # (a trait is sent when it changed)
        assert_rows_match(trace, step, decode_tables(held["table_ids"], held["tables"]))


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the view's JavaScript")
def test_block_tables_decoded_in_javascript_equal_the_trace():
    """common.js's kvsDecodeTables, run by node on the bytes the pool view sent at every step
    of a run (shared prefixes, preemptions), gives each request's blocks, refcounts and tokens
    as the trace has them."""
    llm = make_llm(**ENGINE)
    with llm.record() as trace:
        llm.generate(PROMPTS, greedy(8), use_tqdm=False)
    view = BlockPoolView(trace, step=trace.step_ids[0])
    sent = []
    for step in trace.step_ids:
        view.update_from(trace, step)
        sent.append([view.table_ids, base64.b64encode(view.tables).decode()])
    script = (STATIC / "common.js").read_text() + """
const input = JSON.parse(require("fs").readFileSync(0, "utf8"));
console.log(JSON.stringify(input.map(([ids, b64]) => kvsDecodeTables(ids, Uint8Array.from(Buffer.from(b64, "base64")))
  .map((r) => ({ id: r.id, blocks: Array.from(r.blocks), refs: Array.from(r.refs), num_tokens: r.num_tokens })))));
"""
    run = subprocess.run(["node", "--input-type=commonjs", "-e", script], input=json.dumps(sent),
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    decoded = json.loads(run.stdout)
    assert any(len(rows) > 1 for rows in decoded) and any(max(r["refs"]) > 1 for rows in decoded for r in rows)
    for step, rows in zip(trace.step_ids, decoded):
        assert_rows_match(trace, step, rows)


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node to run the view's JavaScript")
def test_overview_buckets_in_javascript_equal_the_numpy_reference():
    """pool.js's poolBuckets, run by node on random pools (used, shared, cached, free; a bucket
    that does not divide the range; the "live only" block list), against numpy."""
    rng = np.random.default_rng(0)
    n = 10_007
    state = rng.choice(np.array([0, 1, 2], np.uint8), n, p=[0.9, 0.06, 0.04])
    refs = np.where(state == 1, rng.integers(1, 4, n), 0).astype(np.int32)
    live = np.flatnonzero(state).astype(np.int32)
    cases = [(None, 0, n, 1), (None, 0, n, 7), (None, 123, 5000, 64), (live, 0, len(live), 5), (live, 10, 97, 3)]
    module = (STATIC / "common.js").read_text() + (STATIC / "pool.js").read_text()
    script = module.replace("export default { render };", "") + """
const input = JSON.parse(require("fs").readFileSync(0, "utf8"));
const state = Uint8Array.from(input.state), refs = Int32Array.from(input.refs);
console.log(JSON.stringify(input.cases.map(([ids, lo, count, bucket]) => {
  const { top, busy } = poolBuckets(state, refs, ids && Int32Array.from(ids), lo, count, bucket);
  return [Array.from(top), Array.from(busy)];
})));
"""
    payload = {"state": state.tolist(), "refs": refs.tolist(),
               "cases": [[None if ids is None else ids.tolist(), lo, count, b] for ids, lo, count, b in cases]}
    run = subprocess.run(["node", "--input-type=commonjs", "-e", script], input=json.dumps(payload),
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    for (ids, lo, count, bucket), (top, busy) in zip(cases, json.loads(run.stdout)):
        chosen = (np.arange(n) if ids is None else ids)[lo:lo + count]
        want_top, want_busy = bucket_summary(state, refs, bucket, chosen)
        assert top == want_top.tolist() and busy == want_busy.tolist()


def test_scrubbing_a_replay_reads_the_lifecycle_once_and_shows_it_at_every_step(monkeypatch):
    """The lifecycle covers every step, so moving the slider over a replay only moves its step
    marker; it rebuilt the whole view from ``trace.lifecycle`` at each step."""
    llm = make_llm(**ENGINE)
    with llm.record() as trace:
        llm.generate(PROMPTS, greedy(8), use_tqdm=False)
    reads = []
    lifecycle = type(trace).lifecycle
    monkeypatch.setattr(type(trace), "lifecycle", property(lambda t: reads.append(1) or lifecycle.fget(t)))
    dash = Dashboard(trace)
    before = len(reads)
    for step in trace.step_ids[::-2]:
        dash.slider.value = step
        life = dash.views["lifecycle"]
        assert life.step == step
        cols = np.frombuffer(life.intervals, np.int32).reshape(-1, 6)
        want = lifecycle.fget(trace)
        assert [life.requests[i]["id"] for i in cols[:, 0]] == want["request_id"].tolist()
        assert cols[:, 2:4].tolist() == want[["start_step", "end_step"]].to_numpy().tolist()
    assert len(reads) - before == 0


class FakeKernel:
    """What a live dashboard reads of ipykernel: the execute request running now, with the
    ``cellId`` JupyterLab and Notebook 7 put in its metadata."""

    def __init__(self) -> None:
        self.parent: dict = {}

    def run(self, cell: str, execution: int) -> None:
        self.parent = {"header": {"msg_id": f"execute-{execution}"}, "metadata": {"cellId": cell}}

    def get_parent(self) -> dict:
        return self.parent


def test_running_again_the_cell_that_made_a_live_dashboard_detaches_that_dashboard(monkeypatch):
    """Running a cell again replaces its output, and with it the live dashboard it showed; that
    dashboard stayed attached, recording every step and pushing updates to widgets nobody sees
    (JupyterLab logged an error per timeline update, and a few re-runs left as many updater
    threads and recordings). Now the new dashboard of that cell detaches it; a dashboard of
    another cell, and a second one the same run of the cell makes, stay live."""
    import IPython

    kernel = FakeKernel()
    monkeypatch.setattr(IPython, "get_ipython", lambda: type("Shell", (), {"kernel": kernel})())
    llm, other = make_llm(**ENGINE), make_llm(**ENGINE)
    made: list[Dashboard] = []

    def live(source, interval: float = 0.001) -> Dashboard:
        made.append(Dashboard(source, interval=interval, max_load=1.0))
        return made[-1]

    try:
        kernel.run("cell-a", 1)
        first = live(llm, interval=10.0)  # (one update, then none for 10 s)
        beside = live(other)  # the same run of the cell: both stay
        llm.generate(PROMPTS[:2], greedy(3), use_tqdm=False)
        wait_for(lambda: first.num_updates >= 1)
        llm.generate(PROMPTS[:1], greedy(3), use_tqdm=False)  # steps its updater has not shown
        kernel.run("cell-b", 2)
        elsewhere = live(llm)
        assert not any(d._closed for d in made)
        shown = first.slider.max
        assert shown < first.trace.step_ids[-1]
        kernel.run("cell-a", 3)
        again = live(llm)
        assert first._closed and beside._closed and not elsewhere._closed
        assert "detached" in first.status.value
        # its output is gone: no last update of its views (the timeline's logged an error in the browser)
        assert first.slider.max == shown
        llm.generate(PROMPTS[:2], greedy(3), use_tqdm=False)
        newest = llm.llm_engine.scheduler.step_count
        assert again.trace.step_ids[-1] == elsewhere.trace.step_ids[-1] == newest
        assert not first.trace.step_ids or first.trace.step_ids[-1] < newest
        assert len(llm.hooks.block_sinks) == 2
        assert [t.name for t in threading.enumerate()].count("kvscope-dashboard") == 2
    finally:
        for d in made:
            d.detach()


def test_running_again_the_cell_of_a_dashboard_with_a_background_run_stops_that_run(monkeypatch):
    """The dashboard a re-run replaces may have a background run going (``%kvscope demo`` run
    again, say): it is stopped, not waited for, so the re-run goes on at once; its requests are
    aborted and its Future raises CancelledError. The new dashboard's run is unaffected."""
    import IPython

    kernel = FakeKernel()
    monkeypatch.setattr(IPython, "get_ipython", lambda: type("Shell", (), {"kernel": kernel})())
    llm = make_llm(**ENGINE)
    made: list[Dashboard] = []
    try:
        kernel.run("cell-a", 1)
        made.append(Dashboard(llm, interval=0.001, max_load=1.0))
        made[0].pause()  # held after its first step, so it is still going when the cell runs again
        old = made[0].generate_async(PROMPTS, greedy(12))
        wait_for(lambda: made[0].gate.waiting)
        kernel.run("cell-a", 2)
        made.append(Dashboard(llm, interval=0.001, max_load=1.0))
        with pytest.raises(CancelledError):
            old.result(timeout=60)
        assert made[0]._closed and made[0].trace.step_ids[-1] <= 2
        assert not llm.has_unfinished_requests()
        new = made[1].generate_async(PROMPTS[:2], greedy(4))
        fresh = make_llm(**ENGINE).generate(PROMPTS[:2], greedy(4), use_tqdm=False)
        assert token_ids(new.result(timeout=60)) == token_ids(fresh)
        llm.check_invariants()
    finally:
        for d in made:
            d.detach()


def test_outside_a_kernel_every_live_dashboard_stays_attached():
    """No kernel (a script, IPython's terminal, the test shell): no cell to tell re-runs by, so
    dashboards detach only when told to."""
    llm = make_llm(**ENGINE)
    dashes = [Dashboard(llm, interval=0.001, max_load=1.0) for _ in range(2)]
    try:
        assert not any(d._closed for d in dashes)
    finally:
        for d in dashes:
            d.detach()


def test_a_live_dashboard_does_not_say_idle_while_a_cell_generates():
    """``llm.generate`` in a cell runs the engine in the kernel's own thread, not a background
    run: the status said "live · idle" while the views moved step by step. It says "live"."""
    llm = make_llm(**ENGINE)
    dash = Dashboard(llm, interval=0.001, max_load=1.0)
    seen: list[str] = []
    llm.hooks.add("step.end", lambda info: seen.append(dash.status.value))
    try:
        llm.generate(PROMPTS[:2], greedy(4), use_tqdm=False)
        wait_for(lambda: dash.step == dash.trace.step_ids[-1])
    finally:
        dash.detach()
    assert seen and all(s.startswith("live · ") and "idle" not in s for s in seen)
