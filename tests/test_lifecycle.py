"""``Trace.lifecycle``: each request's states across steps, checked against the engine's own
request metrics and against the recording's step coverage; and, as a live trace's table follows
its ring buffer, after every step against the reference read of the retained steps from scratch
(tests/lifecycle_reference.py)."""
from __future__ import annotations

import itertools
import random
import types

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

pytest.importorskip("pandas")

from engine_helpers import greedy, make_llm  # noqa: E402
from lifecycle_reference import ReferenceBuilder, reference_table  # noqa: E402
from pandas.testing import assert_frame_equal  # noqa: E402

from kvscope import SamplingParams  # noqa: E402
from kvscope.trace import Trace  # noqa: E402
from kvscope.trace.lifecycle import LifecycleBuilder  # noqa: E402

PROMPTS = ["the quick brown fox jumps over the lazy dog while the cat sleeps"] * 3 + [
    "a paged key value cache stores attention keys and values in blocks",
    "every sequence owns a block table",
]
ENGINE = dict(num_kv_blocks=12, block_size=8, max_num_batched_tokens=32)


def run(policy: str = "unified", abort_at: int | None = None, async_scheduling: bool = False):
    """The PROMPTS on a pool small enough to preempt; the last request aborted at step ``abort_at``."""
    llm = make_llm(scheduling_policy=policy, async_scheduling=async_scheduling, **ENGINE)
    with llm.record() as trace:
        ids = [llm.add_request(p, greedy(10)) for p in PROMPTS]
        mid = None
        while llm.has_unfinished_requests():
            llm.step()
            if trace.step_ids and trace.step_ids[-1] == abort_at:
                llm.abort_request(ids[-1])
            if mid is None and len(trace.step_ids) == 6:
                mid = trace.lifecycle  # read while recording: later reads extend it
    return trace, mid


def lives(trace) -> dict:
    return {rid: g for rid, g in trace.lifecycle.groupby("request_id", sort=False)}


@pytest.mark.parametrize("policy,async_scheduling", [("unified", False), ("prefill_first", False), ("unified", True)])
def test_lifecycle_agrees_with_the_engines_request_metrics(policy, async_scheduling):
    trace, _ = run(policy, async_scheduling=async_scheduling)
    req = trace.requests.set_index("request_id")
    assert req["num_preemptions"].sum() > 0, "the workload should exercise preemption"
    steps = set(trace.step_ids)
    for rid, life in lives(trace).items():
        r = req.loc[rid]
        body, end = life[life["num_steps"] > 0], life[life["num_steps"] == 0]
        # one closing row, after every step the request lived through, each covered once
        assert end["state"].tolist() == ["finished"] and end["end_step"].item() == body["end_step"].max()
        # (recorded steps: under async scheduling a schedule that found nothing to run leaves no record)
        spans = [[s for s in sorted(steps) if a <= s <= b] for a, b in zip(body["start_step"], body["end_step"])]
        covered = [s for span in spans for s in span]
        assert covered == sorted(set(covered)) == [s for s in sorted(steps) if covered[0] <= s <= covered[-1]]
        assert body["num_steps"].tolist() == [len(span) for span in spans]
        # the engine's own counters
        assert (life["state"] == "preempted").sum() == r["num_preemptions"]
        first = body[body["state"] == "prefill"].iloc[0]
        assert first["num_cached_tokens"] == r["num_cached_tokens"]
        assert first["start_time"] <= r["first_scheduled_time"] <= body[body["state"] == "prefill"]["end_time"].max()
        if r["num_preemptions"] == 0:
            assert body.loc[body["state"] == "prefill", ["num_tokens", "num_cached_tokens"]].to_numpy().sum() == r["prompt_len"]
            assert body.loc[body["state"] == "decode", "num_steps"].sum() == r["output_len"] - 1
        else:
            assert "recompute" in set(body["state"])
    if policy == "prefill_first":  # decodes wait while others prefill
        assert (trace.lifecycle["state"] == "idle").any()


def test_lifecycle_read_live_extends_to_the_same_table_as_a_loaded_trace(tmp_path):
    trace, mid = run(abort_at=4)
    whole = trace.lifecycle
    loaded = Trace.load(trace.save(tmp_path / "t")).lifecycle  # built from scratch
    assert whole.equals(loaded)
    assert len(mid) < len(whole) and mid["end_step"].max() < whole["end_step"].max()
    aborted = whole[whole["state"] == "aborted"]
    assert aborted["request_id"].tolist() == [r for r, why in zip(trace.requests["request_id"], trace.requests["finish_reason"])
                                              if why == "abort"]
    assert aborted["start_step"].item() == 5  # aborted after step 4: gone from the queues of step 5


def drive(seed: int, async_scheduling: bool, policy: str = "unified", max_steps: int = 6,
          read_every: int = 1, num_steps: int = 120):
    """A random live run on a pool small enough to preempt, its ring buffer wrapping: requests
    arrive (some n=2, some of one token, some taking a finished request's id) and are aborted;
    every ``read_every`` steps ``trace.lifecycle`` is read and checked against the reference
    read of the retained records from scratch."""
    rng = random.Random(seed)
    llm = make_llm(scheduling_policy=policy, async_scheduling=async_scheduling, num_kv_blocks=12, block_size=4,
                   max_num_batched_tokens=24, max_num_seqs=4)
    shared = [rng.randrange(3, 200) for _ in range(8)]
    finished: list[str] = []
    reads = 0
    with llm.record(max_steps=max_steps) as trace:
        for k in range(num_steps):
            for _ in range(rng.choice([0, 0, 1, 2])):
                prompt = shared[:rng.choice([0, 4, 8])] + [rng.randrange(3, 200) for _ in range(rng.randrange(2, 14))]
                reuse = finished and rng.random() < 0.5  # the newest finished id, or any
                rid = finished.pop(rng.choice([-1, rng.randrange(len(finished))])) if reuse else None
                llm.add_request(prompt, greedy(rng.choice([1, 2, 5, 9, 14]), n=rng.choice([1, 1, 1, 2])), rid)
            unfinished = list(llm.llm_engine.requests)
            if unfinished and rng.random() < 0.1:
                llm.abort_request(rng.choice(unfinished).split("#")[0])  # (an n=2 child's parent)
            finished += [o.request_id for o in llm.step() if o.finished]
            if k % read_every == 0 and trace.step_ids:
                assert_frame_equal(trace.lifecycle, reference_table(trace._records()))
                reads += 1
    assert reads and len(trace.step_ids) == max_steps
    return trace


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("seed", range(3))
def test_a_live_table_that_follows_the_ring_buffer_is_the_retained_steps_read_from_scratch(seed, async_scheduling):
    drive(seed, async_scheduling)


@pytest.mark.parametrize("read_every", [3, 7], ids=["drops-between-reads", "ring-buffer-passed-between-reads"])
def test_reads_several_drops_apart_give_the_same_table(read_every):
    drive(10 + read_every, True, max_steps=5, read_every=read_every)


def test_prefill_first_idle_rows_follow_the_ring_buffer():
    drive(20, False, policy="prefill_first")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_an_id_taken_again_right_after_its_request_ended(monkeypatch, async_scheduling):
    """One id taken by request after request, each as soon as the last ended (some of one
    token, done in the step that admits them), beside others: a reading that begins after an
    end knows nothing of it, so the rows it hid (a scheduled row of the new request) show."""
    revealed = []
    reveal = LifecycleBuilder._reveal
    monkeypatch.setattr(LifecycleBuilder, "_reveal", lambda self, rid, j: revealed.append(j) or reveal(self, rid, j))
    rng = random.Random(async_scheduling)
    llm = make_llm(async_scheduling=async_scheduling, num_kv_blocks=64, block_size=4, max_num_batched_tokens=32,
                   max_num_seqs=4)
    with llm.record(max_steps=3) as trace:
        llm.add_request(PROMPTS[0], greedy(3), "x")
        for k in range(60):
            if k % 9 == 0:
                llm.add_request(PROMPTS[3], greedy(rng.choice([1, 4])))
            if any(o.finished and o.request_id == "x" for o in llm.step()):  # (a stop no step foresaw)
                params = SamplingParams(temperature=1.0, seed=k, max_tokens=rng.choice([1, 1, 8]),
                                        stop_token_ids=list(range(3, 320, 4)))
                llm.add_request(PROMPTS[k % 2 + 3], params, "x")
            assert_frame_equal(trace.lifecycle, reference_table(trace._records()))
    assert revealed, "the run should hide a row behind an end that is then dropped"


IDS = "abcd"


def step_record(step: int, running=(), waiting=(), rows=(), preempted=(), finished=(), ahead=False,
                duration_s=0.1) -> types.SimpleNamespace:
    """What the lifecycle reads of a record; ``rows``: (request, is_prefill, start, tokens, cached)."""
    ids, prefill, start, n, cached = (list(c) for c in zip(*rows)) if rows else ([], [], [], [], [])
    return types.SimpleNamespace(
        step=step, time_s=step * 0.5, duration_s=duration_s, running=list(running), waiting=waiting,
        preempted=list(preempted), finished=list(finished),
        launches=[types.SimpleNamespace(step=step + 1)] if ahead else [],
        scheduled=types.SimpleNamespace(request_ids=ids, is_prefill=np.array(prefill, bool),
                                        start=np.array(start, np.int64), num_new_tokens=np.array(n, np.int64),
                                        num_cached_tokens=np.array(cached, np.int64)))


@st.composite
def records(draw) -> list:
    """Steps over a few request ids with any queues, rows, preemptions, ends and launches ahead
    (beyond what the engine does: the reference reads them all the same)."""
    recs, step, waiting = [], 0, []
    for _ in range(draw(st.integers(1, 24))):
        step += draw(st.sampled_from([1, 1, 1, 2]))
        ids = draw(st.permutations(IDS))
        cut = sorted(draw(st.lists(st.integers(0, len(IDS)), min_size=2, max_size=2)))
        new_waiting = list(ids[cut[0]:cut[1]])
        waiting = waiting if new_waiting == waiting else new_waiting  # (a recording shares an unchanged queue)
        rows = [(rid, draw(st.booleans()), start, draw(st.integers(1, 4)), draw(st.sampled_from([0, start])))
                for rid, start in zip(draw(st.lists(st.sampled_from(IDS), unique=True, max_size=4)),
                                      draw(st.lists(st.integers(0, 3), min_size=4, max_size=4)))]
        recs.append(step_record(
            step, ids[:cut[0]], waiting, rows, draw(st.lists(st.sampled_from(IDS), unique=True, max_size=2)),
            draw(st.lists(st.sampled_from(IDS), unique=True, max_size=2)), draw(st.booleans()),
            draw(st.sampled_from([0.1, 0.25]))))
    return recs


FINISHED_AHEAD = step_record(1, rows=[("a", False, 5, 1, 0)], finished=["a"], ahead=True)  # a row of step 2 launched
QUEUED_AGAIN = step_record(2, waiting=["a"], rows=[("a", False, 6, 1, 0)])  # that row: the old request's


@example([FINISHED_AHEAD, QUEUED_AGAIN], 1, [1])
@example([FINISHED_AHEAD, QUEUED_AGAIN, step_record(3, waiting=["a"])], 2, [1])
@example([FINISHED_AHEAD, QUEUED_AGAIN, step_record(3, ["a"], rows=[("a", False, 1, 1, 0)])], 2, [1])
@example([step_record(1, waiting=["a"]), step_record(2, ahead=True),  # aborted, then taken again
          step_record(3, waiting=["a"], rows=[("a", False, 6, 1, 0)]), step_record(4)], 2, [1])
@example([step_record(1, waiting=["a"], preempted=["a"]), step_record(2, waiting=["a"]),
          step_record(3, waiting=["a"], preempted=["a"]), step_record(4, waiting=["a"])], 3, [1])
@settings(max_examples=400, deadline=None)
@given(records(), st.integers(1, 5), st.lists(st.integers(1, 7), min_size=1))
def test_a_builder_following_any_ring_buffer_gives_the_rows_read_from_scratch(recs, size, gaps):
    """Windows of ``size`` records slide over ``recs``, read ``gaps`` steps apart (cycled): the
    builder that follows them gives, at each read, what the reference reads from scratch."""
    builder, k = LifecycleBuilder(), 0
    for gap in itertools.cycle(gaps):
        k += gap
        window = recs[max(0, min(k, len(recs)) - size):k]
        if not builder.follows(window):
            builder = LifecycleBuilder()
        builder.follow(window)
        reference = ReferenceBuilder()
        for rec in window:
            reference.add(rec)
        assert builder.rows() == reference.rows()
        if k >= len(recs):
            break
