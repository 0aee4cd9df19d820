"""``Trace.lifecycle``: each request's states across steps, checked against the engine's own
request metrics and against the recording's step coverage."""
from __future__ import annotations

import pytest

pytest.importorskip("pandas")

from engine_helpers import greedy, make_llm  # noqa: E402

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


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_steady_decode_steps_extend_the_rows_as_the_general_path_does(monkeypatch, async_scheduling):
    """Steps where every open row just goes on take a shortcut; over a run with waiting
    requests and long decodes it must give the general path's rows exactly, and be taken."""
    llm = make_llm(async_scheduling=async_scheduling, num_kv_blocks=64, block_size=8,
                   max_num_batched_tokens=64, max_num_seqs=3)
    with llm.record() as trace:
        llm.generate(PROMPTS, greedy(24), use_tqdm=False)
    records = trace._records()
    steady = LifecycleBuilder._extend_steady
    taken = []
    monkeypatch.setattr(LifecycleBuilder, "_extend_steady", lambda self, rec: taken.append(steady(self, rec)) or taken[-1])
    fast = LifecycleBuilder()
    for rec in records:
        fast.add(rec)
    monkeypatch.setattr(LifecycleBuilder, "_extend_steady", lambda self, rec: False)
    general = LifecycleBuilder()
    for rec in records:
        general.add(rec)
    assert fast.rows() == general.rows()
    assert sum(taken) > len(records) // 2, f"the shortcut ran in {sum(taken)} of {len(records)} steps"
    assert any(r[1] == "waiting" and r[4] > 1 for r in fast.rows()), "requests should wait while others decode"
