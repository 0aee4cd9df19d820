"""The trace layer on real tiny engines.

One recorded workload per scheduling policy, synchronous and with async scheduling, shares a
prefix, runs chunked prefill (a small token budget), preempts (a 16-block pool) and has requests
stop on a token (under async scheduling, after their next step was already scheduled). Two
recorders watch it at once: ``full`` keeps a pool snapshot per step (the block manager at
``step.end``), ``blocks`` only the events, so the pool rebuilt from the events can be compared
with the snapshot at every step. A wrapper around the runner's launch copies the block tables
the runner holds for each forward pass, as an independent witness for ``block_tables`` and
``slot_mapping``.
"""
from __future__ import annotations

import json
import random
import re
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
import pytest
from pandas.testing import assert_frame_equal

from engine_helpers import Cycle, greedy, make_llm, token_ids, watch_launches
import kvscope.trace.trace as trace_module
from kvscope import LLM, RequestOutput, Trace
from kvscope.trace import Recorder
from kvscope.engine.hooks import BLOCK_EVENTS, HOOK_POINTS
from kvscope.trace.record import PHASES
from kvscope.engine.block_manager import hash_block
from kvscope.engine.scheduler_output import PLACEHOLDER

VOCAB = 320
POOL = ("state", "ref_count", "block_hash", "num_tokens")


def _workload(seed: int = 7, n: int = 8, stops: bool = True) -> tuple[list[list[int]], list]:
    rng = random.Random(seed)
    system = [rng.randrange(3, VOCAB) for _ in range(21)]
    prompts = [(system if i % 2 == 0 else system[:9]) + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 30))]
               for i in range(n)]
    # Every third request stops on a token (a third of the vocabulary), at a step no length predicts.
    return prompts, [greedy(rng.randrange(6, 20), **({"stop_token_ids": list(range(3, VOCAB // 3)), "min_tokens": 2}
                                                  if stops and i % 3 == 2 else {})) for i in range(n)]


def _tight_llm(**config) -> LLM:
    """Small pool (preemption), small budget (chunked prefill), prefix caching on."""
    return make_llm(**{"block_size": 4, "num_kv_blocks": 16, "max_num_batched_tokens": 24, **config})


@dataclass
class Run:
    llm: LLM
    full: Trace
    blocks: Trace
    outputs: list[RequestOutput]
    runner_tables: dict[int, dict[str, list[int]]]  # step -> request id -> table the runner got
    ahead: list[bool] = None  # per launch: whether it was planned before the step before came back


def _record(llm: LLM, max_steps: int = 10_000, hooks: dict | None = None) -> Run:
    tables, ahead = watch_launches(llm)
    prompts, params = _workload()
    with llm.record("full", max_steps) as full, llm.record("blocks", max_steps) as blocks, llm.hooks(hooks or {}):
        outputs = llm.generate(prompts, params, use_tqdm=False)
    assert any(ahead) == llm.llm_engine.async_scheduling, "block-level recording must keep the engine's mode"
    return Run(llm, full, blocks, outputs, tables, ahead)


@pytest.fixture(scope="module", params=[("unified", False), ("prefill_first", False), ("unified", True),
                                        ("prefill_first", True)], ids=lambda p: f"{p[0]}-{'async' if p[1] else 'sync'}")
def run(request) -> Run:
    policy, async_scheduling = request.param
    return _record(_tight_llm(scheduling_policy=policy, async_scheduling=async_scheduling))


def _assert_replay_equals_snapshot(run: Run) -> None:
    assert run.full.step_ids == run.blocks.step_ids
    steps = run.full.step_ids
    for step in steps + random.Random(0).sample(steps, len(steps)):  # in order, then jumping around
        snap, replay = run.full.pool_arrays(step), run.blocks.pool_arrays(step)
        for k in POOL:
            np.testing.assert_array_equal(replay[k], snap[k], err_msg=f"{k} at step {step}")


def test_each_block_event_carries_the_count_and_hash_it_leaves(run):
    """Walked in order from the pool the ``full`` snapshot saw after the step before, each event
    of a step changes its block's count by its kind (taken +1, freed -1) and carries the count
    it leaves; a hashed event carries the hash it leaves, an evicted one the hash it drops. The
    walk ends at the step's own snapshot."""
    delta = {"block.allocated": 1, "block.shared": 1, "block.reused": 1, "block.freed": -1}
    events = run.blocks.block_events
    steps = run.full.step_ids
    for prev, step in zip(steps, steps[1:]):
        pool = run.full.pool_arrays(prev)
        ref, hashes = pool["ref_count"].copy(), pool["block_hash"].copy()
        for ev in events[events.step == step].itertuples():
            b = ev.block_id
            ref[b] += delta.get(ev.event, 0)
            assert ev.ref_count == ref[b], (step, ev)
            if ev.event == "block.hashed":
                hashes[b] = ev.block_hash
            elif ev.event == "block.evicted":
                assert ev.block_hash == hashes[b], (step, ev)
                hashes[b] = -1
        after = run.full.pool_arrays(step)
        np.testing.assert_array_equal(ref, after["ref_count"], err_msg=f"ref_count at step {step}")
        np.testing.assert_array_equal(hashes, after["block_hash"], err_msg=f"block_hash at step {step}")


def test_workload_shares_prefixes_preempts_and_chunks(run):
    events = run.blocks.block_events["event"].value_counts()
    assert events["block.shared"] > 0 and events["block.reused"] > 0 and events["block.evicted"] > 0
    assert run.full.steps["num_preemptions"].sum() > 0
    prefill = run.blocks.scheduled().query("is_prefill")
    assert (prefill.groupby("request_id").size() > 1).any(), "some prompt should span several steps"
    stopped = run.blocks.queues().query("queue == 'finished'").set_index("request_id").step
    assert len(stopped) == len(run.outputs) and any(o.outputs[0].finish_reason == "stop" for o in run.outputs)
    if run.llm.llm_engine.async_scheduling:  # a request stopped while its next step was already launched
        sched = run.blocks.scheduled()
        assert (sched.step > sched.request_id.map(stopped)).any()


def test_replay_equals_snapshot(run):
    _assert_replay_equals_snapshot(run)
    bm = run.llm.llm_engine.block_manager
    last = run.blocks.step_ids[-1]
    for b in np.flatnonzero(bm.block_hash >= 0):  # token contents rebuilt from the scheduled rows
        assert run.blocks.block_tokens(last, int(b)) == bm.block_tokens[b].tolist()


def test_each_life_ends_once_with_its_last_row(run):
    """Under async scheduling a request that stopped may have a row in the next step: it ran,
    but the request's life ended with the step before."""
    for rid, life in run.blocks.lifecycle.groupby("request_id", sort=False):
        ended = life.state.isin(["finished", "aborted"]).tolist()
        assert ended == [False] * (len(life) - 1) + [True], f"{rid}: {life.state.tolist()}"


def test_step_counts_add_up(run):
    steps, trace = run.full.steps, run.full
    assert (steps.num_prefill_tokens + steps.num_decode_tokens == steps.num_scheduled_tokens).all()
    assert (steps.num_free_blocks + steps.num_used_blocks == trace.num_blocks).all()
    assert np.allclose(steps.kv_cache_usage_perc, steps.num_used_blocks / trace.num_blocks)
    sched = trace.scheduled()
    per_step = sched.assign(p=sched.num_new_tokens.where(sched.is_prefill, 0)).groupby("step").agg(
        tokens=("num_new_tokens", "sum"), prefill=("p", "sum"), prefill_seqs=("is_prefill", "sum"),
        seqs=("request_id", "size"))
    s = steps.set_index("step").loc[per_step.index]
    assert (per_step.tokens == s.num_scheduled_tokens).all() and (per_step.prefill == s.num_prefill_tokens).all()
    assert (per_step.prefill_seqs == s.num_prefill_seqs).all()
    assert (per_step.seqs == s.num_prefill_seqs + s.num_decode_seqs).all()
    assert (steps.num_scheduled_tokens <= steps.token_budget).all()
    queues = trace.queues().groupby(["step", "queue"]).size().unstack(fill_value=0).reindex(steps.step, fill_value=0)
    assert (queues["running"].to_numpy() == steps.num_requests_running).all()
    assert (queues.get("preempted", 0) == steps.set_index("step").num_preemptions).all()
    for step, cached in zip(steps.step, steps.num_cached_blocks):
        assert (trace.pool_arrays(step)["state"] == 2).sum() == cached
    timings = steps[["schedule_s", "prepare_s", "forward_s", "postprocess_s"]]
    assert (timings >= 0).all().all()
    if not run.llm.llm_engine.async_scheduling:  # (async: a step's launch overlaps the step before)
        assert (steps.duration_s >= timings.sum(axis=1) - 1e-9).all()


def test_requests_agree_with_request_outputs(run):
    rows = run.full.requests.set_index("request_id")
    assert len(rows) == len(run.outputs)
    for o in run.outputs:
        r, m = rows.loc[o.request_id], o.metrics
        assert (r.prompt_len, r.output_len) == (len(o.prompt_token_ids), len(o.outputs[0].token_ids))
        assert (r.num_cached_tokens, r.num_preemptions) == (o.num_cached_tokens, m.num_preemptions)
        assert r.finish_reason == o.outputs[0].finish_reason
        assert (r.arrival_time, r.first_scheduled_time, r.first_token_time, r.finished_time) == \
            (m.arrival_time, m.first_scheduled_time, m.first_token_time, m.finished_time)
        assert (r.ttft_s, r.e2e_s) == (m.ttft_s, m.e2e_s)
        assert r.mean_itl_s == pytest.approx((m.last_token_time - m.first_token_time) / (r.output_len - 1))
    assert rows.num_preemptions.sum() == run.full.steps.num_preemptions.sum()


def test_prefix_cache_hits_are_the_admissions_cached_tokens(run):
    steps, sched = run.full.steps, run.full.scheduled()
    admissions = sched[sched.start == sched.num_cached_tokens]
    assert steps.prefix_cache_hits.sum() == admissions.num_cached_tokens.sum() > 0
    # a query covers the whole sequence at admission: its prompt plus what it generated before
    sampled_before = sched.groupby("request_id")["sample"].cumsum() - sched["sample"]
    prompt = run.full.requests.set_index("request_id").prompt_len
    queried = prompt.loc[admissions.request_id].to_numpy() + sampled_before.loc[admissions.index].to_numpy()
    assert steps.prefix_cache_queries.sum() == queried.sum()
    assert (steps.prefix_cache_hits <= steps.prefix_cache_queries).all()


def test_block_tables_and_slot_mapping_are_the_runners(run):
    _assert_tables_are_the_runners(run)


def _assert_tables_are_the_runners(run: Run) -> None:
    trace, bs = run.blocks, run.blocks.block_size
    for step in trace.step_ids:
        tables = trace.block_tables(step)
        got = {rid: g.sort_values("logical_block").physical_block.tolist() for rid, g in tables.groupby("request_id")}
        assert got == run.runner_tables[step]
        slots = trace.slot_mapping(step)
        table = tables.set_index(["request_id", "logical_block"]).physical_block
        expect = table.loc[list(zip(slots.request_id, slots.position // bs))].to_numpy() * bs + slots.position % bs
        assert (slots.slot.to_numpy() == expect).all()
        assert (slots.block_id * bs + slots.offset == slots.slot).all() and slots.slot.is_unique
        sched = trace.scheduled(step)
        assert slots.token_id.tolist() == [t for ts in sched.token_ids for t in ts]
        assert slots.position.tolist() == [p for s, n in zip(sched.start, sched.num_new_tokens) for p in range(s, s + n)]
    per_step = pd.concat([trace.slot_mapping(s) for s in trace.step_ids], ignore_index=True)
    assert_frame_equal(trace.slot_mapping(), per_step)
    assert_frame_equal(trace.block_tables(), pd.concat([trace.block_tables(s) for s in trace.step_ids],
                                                       ignore_index=True))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_replay_holds_across_aborts_from_hooks(async_scheduling, tmp_path):
    """Aborts from a ``step.scheduled`` hook (the row is dropped before its launch), a
    ``step.end`` hook (under async scheduling the request's next row is already launched) and a
    ``request.preempted`` hook keep the replay equal to the snapshots and the tables the
    runner's, survive save/load, and change no token against the same run unrecorded."""
    victims: dict[LLM, list[str]] = {}
    ended: dict[LLM, str] = {}  # the request a step.end hook aborted: the first running at step 8's end

    def hooks(llm: LLM) -> dict:
        def abort_at_schedule(step: int, **_) -> None:
            if step == 5:
                llm.abort_request("1")

        def abort_at_end(info, **_) -> None:
            if info.step == 8 and info.running:
                ended[llm] = info.running[0]
                llm.abort_request(ended[llm])

        def abort_first_victim(request_id: str, **_) -> None:
            if not victims.setdefault(llm, []):
                victims[llm].append(request_id)
                llm.abort_request(request_id)
        return {"step.scheduled": abort_at_schedule, "step.end": abort_at_end,
                "request.preempted": abort_first_victim}

    # 14 blocks: with in-batch prefix sharing the usual 16 leave the async run without a preemption.
    plain = _tight_llm(async_scheduling=async_scheduling, num_kv_blocks=14)
    with plain.hooks(hooks(plain)):
        expected = plain.generate(*_workload(), use_tqdm=False)
    llm = _tight_llm(async_scheduling=async_scheduling, num_kv_blocks=14)
    run = _record(llm, hooks=hooks(llm))
    assert victims.get(plain), "the workload should preempt"
    assert token_ids(run.outputs) == token_ids(expected) and victims.get(llm) == victims[plain]
    assert ended.get(llm) == ended[plain] not in ("1", *victims[plain])
    reasons = {o.request_id: o.outputs[0].finish_reason for o in run.outputs}
    assert [reasons[r] for r in ("1", ended[llm], *victims[llm])] == ["abort"] * 3
    sched = run.blocks.scheduled()
    assert sched.query("request_id == '1' and step == 5").empty  # its row never ran
    if async_scheduling:  # aborted at step 8's end, with its step-9 row in flight
        assert not sched.query(f"request_id == '{ended[llm]}' and step == 9").empty
    _assert_replay_equals_snapshot(run)
    _assert_tables_are_the_runners(run)
    _assert_same_trace(run.blocks, Trace.load(run.blocks.save(tmp_path / "blocks")))


def test_blocks_view(run):
    trace = run.full
    step = trace.step_ids[len(trace.step_ids) // 2]
    blocks, arrays = trace.blocks(step), trace.pool_arrays(step)
    assert (blocks.block_id == np.arange(trace.num_blocks)).all()
    assert (blocks.owners.map(len) == blocks.ref_count).all()
    assert (blocks.state.map({"free": 0, "used": 1, "cached": 2}) == arrays["state"]).all()
    for b in blocks.itertuples():
        assert len(trace.block_tokens(step, b.block_id)) == b.num_tokens
    assert set(trace.queues(step).queue) <= {"running", "waiting", "preempted", "finished"}


def test_kv_events_follow_vllm_schema(run):
    kv, events = run.blocks.kv_events(), run.blocks.block_events
    stored, removed = kv[kv.type == "BlockStored"], kv[kv.type == "BlockRemoved"]
    assert len(stored) == (events.event == "block.hashed").sum()
    assert len(removed) == (events.event == "block.evicted").sum()
    assert (stored.block_size == run.blocks.block_size).all()
    for ev in stored.itertuples():  # the hash chain checks out from the exported tokens alone
        parent = -1 if pd.isna(ev.parent_block_hash) else int(ev.parent_block_hash)
        assert ev.block_hashes == [hash_block(ev.token_ids, parent)]


def test_recording_mid_run_and_reset_prefix_cache():
    llm = make_llm(block_size=4)
    prompts, params = _workload(seed=3, n=3)
    llm.generate(prompts, params, use_tqdm=False)  # leaves cached blocks behind, unrecorded
    contents = llm.llm_engine.block_manager.block_tokens.copy()
    with llm.record("full", max_steps=1000) as full, llm.record("blocks") as blocks:
        again = llm.generate(prompts, params, use_tqdm=False)
        llm.reset_prefix_cache()
        cold = llm.generate(prompts, params, use_tqdm=False)
    assert token_ids(again) == token_ids(cold)
    # After the reset a run hits only the blocks its own prompts share, as on a fresh engine.
    fresh = make_llm(block_size=4).generate(prompts, params, use_tqdm=False)
    assert [o.num_cached_tokens for o in cold] == [o.num_cached_tokens for o in fresh]
    assert sum(o.num_cached_tokens for o in again) > sum(o.num_cached_tokens for o in cold)
    _assert_replay_equals_snapshot(Run(llm, full, blocks, [], {}))
    first = blocks.step_ids[0]
    reused = blocks.block_events.query("step == @first and event == 'block.reused'")
    assert len(reused)
    for b in reused.block_id:  # contents that predate the recording come from its baseline
        assert blocks.block_tokens(first, b) == contents[b].tolist()
    kv = blocks.kv_events()
    cleared = kv[kv.type == "AllBlocksCleared"]
    assert len(cleared) == 1
    idle = blocks.block_events.query("phase == 'idle'")
    assert set(idle.event) == {"block.evicted"} and (idle.step == cleared.step.iloc[0]).all()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_ring_buffer_lists_the_requests_that_finished_in_the_steps_it_kept(async_scheduling):
    """trace.requests of a 6-step ring buffer: the requests that finished at or after its oldest
    step, by a recording that kept every step."""
    llm = make_llm(block_size=4, num_kv_blocks=32, max_num_batched_tokens=64, async_scheduling=async_scheduling)
    prompts = [[5 + i, 6, 7, 8] for i in range(6)]
    with llm.record("blocks") as whole, llm.record("blocks", max_steps=6) as ring:
        llm.generate(prompts, [greedy(2 + 3 * i) for i in range(6)], use_tqdm=False)
    finished_at = whole.queues().query("queue == 'finished'").set_index("request_id").step
    kept = sorted(finished_at[finished_at >= ring.step_ids[0]].index)
    assert len(kept) < len(prompts) and sorted(ring.requests.request_id) == kept


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_ring_buffer_lists_a_request_that_finished_right_after_a_step_without_a_record(async_scheduling):
    """A step that schedules nothing gets no record, so recorded step ids have gaps. A request
    finishing in the first recorded step after one is listed by a ring buffer that kept that
    step (it was pruned as if it had finished in the step before), as a recording that kept
    every step says."""
    llm = make_llm(block_size=4, num_kv_blocks=16, async_scheduling=async_scheduling)
    with llm.record("blocks") as whole, llm.record("blocks", max_steps=1) as ring:
        for prompt, tokens in (([5, 6, 7, 8, 9], 3), ([9, 8, 7], 1)):
            llm.generate([prompt], greedy(tokens), use_tqdm=False)
            llm.step()  # nothing to schedule: a step id without a record
    steps = whole.step_ids
    assert steps[-1] - steps[0] + 1 > len(steps)
    finished_at = whole.queues().query("queue == 'finished'").set_index("request_id").step
    kept = sorted(finished_at[finished_at >= ring.step_ids[0]].index)
    assert kept and sorted(ring.requests.request_id) == kept


def _reuse_an_id(llm: LLM) -> list[RequestOutput]:
    """Request "r" stops on a token (under async scheduling its next step is already launched),
    and as soon as its final output is out a new request takes the id "r"; the final outputs."""
    llm.add_request([5, 6, 7], greedy(12, stop_token_ids=list(range(3, VOCAB)), min_tokens=2), "r")
    llm.add_request([9, 6, 7, 1, 2], greedy(6), "other")
    final: list[RequestOutput] = []
    while llm.has_unfinished_requests():
        done = [o for o in llm.step() if o.finished and o.request_id == "r"]
        if done and not final:
            llm.add_request([5, 6, 7, 8, 9, 10, 11, 12, 13], greedy(4), "r")
        final += done
    return final


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_request_id_used_again_names_a_new_request_in_requests_and_lifecycle(async_scheduling):
    """A request id is free once its final output is out. The new request with it gets its own
    row in trace.requests (it updated the finished one's row: the old prompt, the new output)
    and a life of its own in trace.lifecycle (it showed as idle), each as its RequestOutput
    says; a ring buffer that dropped the first one's steps lists the second only."""
    llm = make_llm(block_size=4, num_kv_blocks=16, async_scheduling=async_scheduling)
    with llm.record("blocks") as trace, llm.record("blocks", max_steps=3) as ring:
        outputs = _reuse_an_id(llm)
    want = [(len(o.prompt_token_ids), len(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outputs]
    rows = trace.requests.query("request_id == 'r'")
    assert list(zip(rows.prompt_len, rows.output_len, rows.finish_reason)) == want
    life = trace.lifecycle.query("request_id == 'r'").reset_index(drop=True)
    ends = life.index[life.state == "finished"].tolist()
    assert len(ends) == 2
    for (prompt, out, _), part in zip(want, (life[:ends[0] + 1], life[ends[0] + 1:])):
        assert part.state.tolist()[0] in ("waiting", "idle", "prefill") and "prefill" in part.state.tolist()
        assert part.num_tokens.sum() == prompt + out - 1  # every token computed once, the last one sampled only
    assert ring.requests.query("request_id == 'r'").prompt_len.tolist() == [want[1][0]]


def _late_preemptions(trace: Trace) -> list[tuple[int, str]]:
    """(step, request id) of each preemption of a request that is then in no queue: under async
    scheduling step n+1's scheduling preempted it, and step n's post-processing finished it."""
    q = trace.queues()
    queued = set(q[q.queue.isin(["running", "waiting"])][["step", "request_id"]].itertuples(index=False, name=None))
    return [p for p in q[q.queue == "preempted"][["step", "request_id"]].itertuples(index=False, name=None)
            if p not in queued]


def test_a_ring_buffer_shows_no_life_of_a_request_that_ended_before_its_oldest_step():
    """The async workload has a preemption landing in the record after the request's finish. A
    ring buffer whose oldest step is that record showed the request preempted, then aborted
    (no queue held it), while trace.requests leaves it out: it finished before, as a recording
    of every step says. The rest of the ring's lifecycle is the whole recording's, from there."""
    def record(max_steps: int) -> Trace:
        llm = _tight_llm(async_scheduling=True)
        prompts, params = _workload()
        with llm.record("blocks", max_steps) as trace:
            llm.generate(prompts, params, use_tqdm=False)
        return trace

    whole = record(10_000)
    step, rid = _late_preemptions(whole)[0]
    finished = whole.queues().query("queue == 'finished' and request_id == @rid").step.tolist()
    assert finished and finished[0] < step
    ring = record(len(whole.step_ids) - whole.step_ids.index(step))
    assert ring.step_ids[0] == step and rid not in set(ring.requests.request_id)
    life = ring.lifecycle
    assert rid not in set(life.request_id)
    clipped = whole.lifecycle.query("end_step >= @step and request_id in @life.request_id")
    assert life.query("start_step > @step")[["request_id", "state", "end_step"]].reset_index(drop=True).equals(
        clipped.query("start_step > @step")[["request_id", "state", "end_step"]].reset_index(drop=True))


def test_a_step_that_is_not_an_integer_is_refused_by_name_and_a_failed_replay_leaves_the_trace_readable(
        monkeypatch):
    import kvscope.trace.trace as trace_module

    llm = _tight_llm()
    prompts, params = _workload()
    with llm.record("blocks") as trace:
        llm.generate(prompts, params, use_tqdm=False)
    for read in (trace.blocks, trace.pool_arrays, lambda step: trace.block_tokens(step, 0)):
        for bad in ("3", None, True, 2.0):
            with pytest.raises(TypeError, match=rf"^step must be an integer, one of trace.step_ids, got {bad!r}"):
                read(bad)
    first, last = trace.step_ids[0], trace.step_ids[-1]
    expected = trace.blocks(last)
    trace.blocks(first)
    apply = trace_module._apply_keeping
    calls = []

    def fails_at_the_third(*args):
        calls.append(1)
        if len(calls) == 3:
            raise MemoryError("injected")
        apply(*args)

    monkeypatch.setattr(trace_module, "_apply_keeping", fails_at_the_third)
    with pytest.raises(MemoryError):
        trace.blocks(last)
    monkeypatch.setattr(trace_module, "_apply_keeping", apply)
    assert_frame_equal(trace.blocks(last), expected)


def test_blocks_asked_for_by_id_equal_the_whole_pools_rows_also_when_repeated():
    llm = _tight_llm()
    prompts, params = _workload()
    with llm.record("blocks") as trace:
        llm.generate(prompts, params, use_tqdm=False)
    step = trace.step_ids[len(trace.step_ids) // 2]
    whole = trace.blocks(step)
    owned = whole[whole.owners.map(len) > 0].block_id.tolist()
    asked = [owned[0], owned[-1], owned[0], 0]
    picked = trace.blocks(step, asked)
    expected = whole.set_index("block_id").loc[asked].reset_index()
    assert_frame_equal(picked.reset_index(drop=True), expected[picked.columns], check_dtype=False)
    for bad in (-1, trace.num_blocks, 1.0, True):
        with pytest.raises(ValueError, match=rf"^block_id must be an integer in 0..{trace.num_blocks - 1}"):
            trace.block_tokens(step, bad)
    for bad in ([1.5], [-1], [[1]]):  # (a float was truncated to a block id)
        with pytest.raises(ValueError, match=rf"^block_ids must be integers in 0..{trace.num_blocks - 1}"):
            trace.blocks(step, bad)
    assert trace.decode(np.array(trace.block_tokens(step, owned[0]))) == trace.decode(trace.block_tokens(step, owned[0]))
    with pytest.raises(ValueError, match=r"^token ids must be >= 0, got -1"):
        trace.decode([5, -1])


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_recording_asked_for_mid_step_is_refused_and_one_from_step_end_replays_the_pool(async_scheduling):
    """From a hook inside a step, llm.record() is refused (its first record would hold half a
    step); from step.end it starts, and its replay equals the engine's pool at each later step.end."""
    llm = _tight_llm(async_scheduling=async_scheduling)
    prompts, params = _workload()
    refused, late, pools = [], {}, {}

    def mid_step(**_) -> None:
        if not refused:
            with pytest.raises(RuntimeError) as err:
                llm.record("blocks").__enter__()
            refused.append(str(err.value))

    def at_step_end(info) -> None:
        pools[info.step] = llm.llm_engine.block_manager.ref_count.copy()
        if info.step >= 3 and not late:
            late["cm"] = llm.record("blocks")
            late["trace"] = late["cm"].__enter__()

    with llm.hooks({"block.allocated": mid_step, "step.end": at_step_end}):
        llm.generate(prompts, params, use_tqdm=False)
    late["cm"].__exit__(None, None, None)
    assert refused and refused[0].startswith("llm.record was called from inside a kvscope hook while the engine")
    trace = late["trace"]
    assert len(trace.step_ids) > 3
    for step in trace.step_ids:
        assert np.array_equal(trace.pool_arrays(step)["ref_count"], pools[step])


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_recording_started_with_requests_queued_and_running(async_scheduling):
    """Requests that were waiting or running when recording began get their rows, and the
    rows agree with the outputs they end with."""
    llm = _tight_llm(async_scheduling=async_scheduling)
    prompts, params = _workload()
    tables, _ = watch_launches(llm)
    ids = [llm.llm_engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    outputs = {}
    for _ in range(3):
        outputs.update({o.request_id: o for o in llm.step() if o.finished})
    engine = llm.llm_engine
    assert engine.scheduler.running and engine.scheduler.waiting
    unfinished = set(ids) - set(outputs)
    with llm.record("summary") as trace, llm.record("full") as full, llm.record("blocks") as blocks:
        while llm.has_unfinished_requests():  # (async: the first recorded step was launched before)
            outputs.update({o.request_id: o for o in llm.step() if o.finished})
    run = Run(llm, full, blocks, [], tables)
    first = blocks._records()[0]
    assert (first.launched(first.step) is None) == async_scheduling  # async: launched before the recording
    _assert_replay_equals_snapshot(run)
    _assert_tables_are_the_runners(run)
    rows = trace.requests.set_index("request_id")
    assert set(outputs) == set(ids) and set(rows.index) == unfinished
    for rid in rows.index:
        r, o = rows.loc[rid], outputs[rid]
        assert (r.prompt_len, r.output_len, r.finish_reason) == \
            (len(o.prompt_token_ids), len(o.outputs[0].token_ids), o.outputs[0].finish_reason)
        assert r.num_cached_tokens == o.num_cached_tokens


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_ring_buffer_keeps_the_last_steps(async_scheduling):
    llm = _tight_llm(async_scheduling=async_scheduling)
    with llm.record("summary") as everything:
        ring = _record(llm, max_steps=7)
    assert ring.full.step_ids == everything.step_ids[-7:] == ring.blocks.step_ids
    assert_frame_equal(ring.full.steps, everything.steps.iloc[-7:].reset_index(drop=True))
    _assert_replay_equals_snapshot(ring)  # the baseline moved over every dropped step
    live = set(ring.full.scheduled().request_id)
    assert live <= set(ring.full.requests.request_id) <= set(everything.requests.request_id)
    with pytest.raises(KeyError, match="not in this trace"):
        ring.full.pool_arrays(everything.step_ids[0])


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_ring_buffer_drops_no_step_while_held_and_the_steps_kept_meanwhile_go_after(async_scheduling):
    """Reading one step's several tables of a live ring buffer raced the engine: the step could
    be dropped between two reads (a dashboard showing its oldest step, an export). While
    ``hold_steps()`` holds it, a step run meanwhile drops none (the engine does not wait); once
    released, the excess goes at once, and the pool replays as before. Checked against a
    recording of every step."""
    llm = _tight_llm(async_scheduling=async_scheduling)
    prompts, params = _workload(n=6)
    with llm.record("full") as everything, llm.record("blocks", 3) as ring:
        for p, sp in zip(prompts, params):
            llm.add_request(p, sp)
        for _ in range(4):
            llm.step()
        held = ring.step_ids
        with ring.hold_steps():
            for _ in range(3):
                llm.step()
            assert ring.step_ids[:3] == held and ring.step_ids == everything.step_ids[everything.step_ids.index(held[0]):]
            for step in held:  # (read after the steps that would have dropped it)
                for k in POOL:
                    np.testing.assert_array_equal(ring.pool_arrays(step)[k], everything.pool_arrays(step)[k])
        assert ring.step_ids == everything.step_ids[-3:]
        while llm.has_unfinished_requests():
            llm.step()
    assert ring.step_ids == everything.step_ids[-3:]
    for step in ring.step_ids:
        assert_frame_equal(ring.blocks(step), everything.blocks(step))
        assert_frame_equal(ring.scheduled(step), everything.scheduled(step))


def _assert_same_trace(a: Trace, b: Trace) -> None:
    assert a.meta == b.meta and a.step_ids == b.step_ids
    assert (a.level, a.num_blocks, a.block_size) == (b.level, b.num_blocks, b.block_size)
    assert_frame_equal(a.steps, b.steps)
    assert_frame_equal(a.requests, b.requests)
    if a.level == "summary":
        return
    assert_frame_equal(a.block_events, b.block_events)
    for name in ("scheduled", "queues", "block_tables", "slot_mapping"):
        assert_frame_equal(getattr(a, name)(), getattr(b, name)())
    assert_frame_equal(a.kv_events(), b.kv_events())
    for step in a.step_ids[::3]:
        assert_frame_equal(a.blocks(step), b.blocks(step))
        pa, pb = a.pool_arrays(step), b.pool_arrays(step)
        for k in POOL:
            np.testing.assert_array_equal(pa[k], pb[k])
            assert pa[k].dtype == pb[k].dtype
        for blk in range(a.num_blocks):
            tokens = a.block_tokens(step, blk)
            assert tokens == b.block_tokens(step, blk)
            assert a.decode(tokens) == b.decode(tokens)


def test_save_load_round_trip(run, tmp_path):
    for trace in (run.full, run.blocks):
        _assert_same_trace(trace, Trace.load(trace.save(tmp_path / trace.level)))
    assert run.full.meta["kv_shards"][0]["num_blocks"] == run.full.num_blocks == 16


def test_a_trace_round_trips_the_rows_of_a_step_rolled_back_after_a_failed_launch(tmp_path):
    """Async scheduling, the third launch raises: the step in flight then is rolled back and gets
    no record, but its rows ran and wrote K/V. A saved and loaded trace replays them as the live
    one does, and both replay the full level's pool."""
    llm = make_llm(block_size=4, num_kv_blocks=12, max_num_batched_tokens=16, max_num_seqs=8, async_scheduling=True)
    runner = llm.llm_engine.executor
    launch, calls = runner.execute_async, []

    def third_fails(out):
        calls.append(out.step)
        if len(calls) == 3:
            raise RuntimeError("injected device error")
        return launch(out)

    runner.execute_async = third_fails
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11] for i in range(4)]
    with llm.record("full", max_steps=1000) as full, llm.record("blocks") as blocks:
        with pytest.raises(RuntimeError, match="injected device error"):
            llm.generate(prompts, greedy(6), use_tqdm=False)
        llm.generate(prompts, greedy(6), use_tqdm=False)
    assert calls[1] not in blocks.step_ids  # the step in flight when the third launch failed
    _assert_replay_equals_snapshot(Run(llm, full, blocks, [], {}))
    for trace in (full, blocks):
        _assert_same_trace(trace, Trace.load(trace.save(tmp_path / trace.level)))


def test_a_trace_saved_without_launches_is_refused_clearly(run, tmp_path):
    """Saved before launches were recorded (and so before checksums.json): record it again. A
    save that has checksums.json lost the file: it is missing."""
    path = run.blocks.save(tmp_path / "old")
    (path / "launches.parquet").unlink()
    with pytest.raises(ValueError, match=f"^{re.escape(str(path / 'launches.parquet'))}: missing"):
        Trace.load(path)
    (path / "checksums.json").unlink()
    with pytest.raises(ValueError, match="no launches.parquet.*record it again"):
        Trace.load(path)


def _drop_column(path, column):
    import pyarrow.parquet as pq

    pq.write_table(pq.read_table(path).drop([column]), path)


def _strings_in(path, column):
    import pyarrow as pa
    import pyarrow.parquet as pq

    t = pq.read_table(path)
    i = t.column_names.index(column)
    pq.write_table(t.set_column(i, column, pa.array([f"x{v}" for v in t.column(i).to_pylist()])), path)


def _edit_meta(path, **changes):
    meta = json.loads(path.read_text())
    meta.update(changes)
    path.write_text(json.dumps(meta))


def _halve_rows(path):
    import pyarrow.parquet as pq

    t = pq.read_table(path)
    pq.write_table(t.slice(0, t.num_rows // 2), path)


# (file, edit, what the error says about it: after the file's name, or another file's name and what)
_DAMAGE = [
    ("steps.parquet", lambda p: p.unlink(), "missing"),
    ("block_events.parquet", lambda p: p.write_bytes(p.read_bytes()[:len(p.read_bytes()) // 2]), "not a readable parquet"),
    ("scheduled.parquet", lambda p: p.write_bytes(b""), "not a readable parquet"),
    ("queues.parquet", lambda p: _drop_column(p, "queue"), "no column 'queue'"),
    ("tokens.parquet", lambda p: _drop_column(p, "text"), "no column 'text'"),
    ("launches.parquet", lambda p: _strings_in(p, "launched_step"), "column 'launched_step'"),
    ("baseline.parquet", lambda p: _drop_column(p, "contents"), "'contents' must be integers of shape"),
    ("baseline.parquet", _halve_rows, "'ref_count' must be integers of shape"),
    ("meta.json", lambda p: p.write_text("{not json"), "not readable JSON"),
    ("meta.json", lambda p: p.write_text("[1, 2]"), "must hold a JSON object"),
    ("meta.json", lambda p: _edit_meta(p, block_size=None), "'block_size' must be an integer >= 1"),
    ("meta.json", lambda p: _edit_meta(p, num_blocks=-1), "'num_blocks' must be an integer >= 0"),
    ("meta.json", lambda p: _edit_meta(p, num_blocks=17), "steps.parquet: free and used blocks do not add up"),
]


@pytest.mark.parametrize("name,damage,says", _DAMAGE, ids=[f"{f}-{s.split()[0]}" for f, _, s in _DAMAGE])
def test_a_damaged_save_is_refused_naming_the_file_and_what_is_wrong(run, tmp_path, name, damage, says):
    """A file cut short, emptied, edited or taken away: Trace.load names it and says what is
    wrong, never a KeyError or IndexError from inside the replay. The undamaged copy loads as the
    live trace (test_save_load_round_trip)."""
    path = run.blocks.save(tmp_path / "t")
    damage(path / name)
    named = path if "parquet:" in says else path / name
    with pytest.raises(ValueError, match=f"^{re.escape(str(named))}.*{says}"):
        Trace.load(path)


def _edit_rows(path, edit):
    import pyarrow as pa
    import pyarrow.parquet as pq

    df = pq.read_table(path).to_pandas()
    pq.write_table(pa.Table.from_pandas(edit(df).reset_index(drop=True), preserve_index=False), path)


def _set(df, column, value, row=0):
    df.loc[df.index[row], column] = value(df[column].iloc[row]) if callable(value) else value
    return df


# (file, edit): each still parses and has every column, but no longer is what the engine did
_EDITS = [
    ("block_events.parquet", lambda df: _set(df, "block_id", lambda b: (b + 1) % 16, row=len(df) // 2)),
    ("block_events.parquet", lambda df: df.drop(df.index[len(df) // 3])),
    ("block_events.parquet", lambda df: _set(df, "block_id", 16)),
    ("block_events.parquet", lambda df: df.iloc[::-1]),
    ("scheduled.parquet", lambda df: pd.concat([df.iloc[:5], df.iloc[4:]])),
    ("scheduled.parquet", lambda df: df.drop(df.index[len(df) // 2])),
    ("launches.parquet", lambda df: df.iloc[:0]),
    ("launches.parquet", lambda df: _set(df, "num_events_before", 10**6)),
    ("steps.parquet", lambda df: _set(df, "num_used_blocks", lambda n: n + 1, row=len(df) // 2)),
    ("steps.parquet", lambda df: _set(_set(df, "num_used_blocks", lambda n: n + 1, row=len(df) // 2),
                                      "num_free_blocks", lambda n: n - 1, row=len(df) // 2)),
    ("steps.parquet", lambda df: _set(df, "num_cached_blocks", lambda n: n + 1, row=len(df) // 2)),
    ("steps.parquet", lambda df: df.drop(df.index[1])),
    ("queues.parquet", lambda df: df[df["queue"] != "waiting"]),
    ("pool_changes.parquet", lambda df: df.drop(df.index[3])),
    ("pool_changes.parquet", lambda df: _set(df, "ref_count", lambda n: n + 1, row=len(df) - 1)),
    ("pool_fills.parquet", lambda df: _set(df, "num_tokens", lambda n: n % 4 + 1 if n != 4 else 2, row=len(df) // 2)),
    ("tokens.parquet", lambda df: df.iloc[1:]),
]


@pytest.mark.parametrize("name,edit", _EDITS, ids=[f"{f.split('.')[0]}-{i}" for i, (f, _) in enumerate(_EDITS)])
def test_a_save_edited_so_it_replays_another_pool_is_refused(run, tmp_path, name, edit):
    """Rows dropped, doubled, reordered or changed: the tables must fit together, and the events
    must replay, after every step, to the used and cached blocks the engine counted, to the
    count each block's last event carried, and to the full level's snapshot (read from the block
    manager). A trace that loads but shows another pool is the one outcome not allowed."""
    path = run.full.save(tmp_path / "t")
    _edit_rows(path / name, edit)
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}.*not a whole, unedited save"):
        Trace.load(path)


def _first(df, column, value):
    """The position of the first row whose ``column`` is ``value``."""
    return int(np.flatnonzero(df[column].to_numpy() == value)[0])


def _named(file, edit, says, named=None):
    """A ``_NAMED_EDITS`` entry: ``edit`` of ``file`` is refused naming ``named`` (``""``: the
    save itself; None: ``file``), then saying ``says``."""
    return file, edit, says, file if named is None else named


def _freed_by(df, request):
    """The first block freed, freed by ``request`` instead."""
    df["request_id"] = df["request_id"].cat.add_categories([request])
    return _set(df, "request_id", request, row=_first(df, "event", "block.freed"))


def _renamed(df, column, name, new_name):
    """The first row whose ``column`` (a categorical) is ``name`` given ``new_name`` instead."""
    df[column] = df[column].cat.add_categories([new_name])
    return _set(df, column, new_name, row=_first(df, column, name))


_REPLAYED = "the block events replay to [0-9]+ used and [0-9]+ cached blocks after step [0-9]+, where steps.parquet says"
# (file, edit, what the error says and names): one fault each, refused by its own check
_NAMED_EDITS = [
    _named("queues.parquet", lambda df: _set(df, "queue", "wating", row=_first(df, "queue", "waiting")),
           "a queue other than running, waiting, preempted, finished"),
    _named("queues.parquet", lambda df: _set(df, "queue", None, row=_first(df, "queue", "finished")),
           "a queue other than running, waiting, preempted, finished"),
    _named("queues.parquet", lambda df: _set(df, "queue", "finished", row=_first(df, "queue", "waiting")),
           "a step's waiting queue is not the num_requests_waiting of steps.parquet"),
    _named("queues.parquet", lambda df: _set(df, "queue", "running", row=_first(df, "queue", "finished")),
           "a step's running queue is not the num_requests_running of steps.parquet"),
    _named("queues.parquet", lambda df: _set(df, "queue", "preempted", row=_first(df, "queue", "finished")),
           "a step's preempted queue is not the num_preemptions of steps.parquet"),
    _named("queues.parquet", lambda df: _set(df, "step", lambda s: s + 1, row=len(df) - 1),
           "step [0-9]+ has rows but was not recorded"),
    _named("block_events.parquet", lambda df: _set(df, "step", lambda s: s - 1), "step -?[0-9]+ has rows but was not recorded"),
    _named("block_events.parquet", lambda df: _set(df, "step", lambda s: s + 1, row=len(df) - 1),
           "step [0-9]+ has rows but was not recorded"),
    _named("block_events.parquet", lambda df: df.iloc[::-1], "rows are not in step order"),
    _named("scheduled.parquet", lambda df: _set(df, "step", lambda s: s + 100, row=len(df) - 1),
           "step [0-9]+ has rows but was not launched"),
    _named("block_events.parquet", lambda df: _set(df, "ref_count", lambda n: n + 1, row=len(df) - 1),
           "a reference count of step [0-9]+ is not its events' recount"),
    _named("block_events.parquet", lambda df: _freed_by(df, "nobody"), "the events of step [0-9]+ do not replay"),
    _named("block_events.parquet", lambda df: _renamed(df, "event", "block.allocated", "block.bogus"),
           f"an event other than {', '.join(BLOCK_EVENTS)}"),
    _named("block_events.parquet", lambda df: _renamed(df, "phase", df["phase"].iloc[0], "bogus"),
           f"a phase other than {', '.join(PHASES)}"),
    _named("steps.parquet", lambda df: _set(_set(df, "num_used_blocks", lambda n: n + 1, row=len(df) // 2),
                                            "num_free_blocks", lambda n: n - 1, row=len(df) // 2),
           _REPLAYED, named=""),
    _named("steps.parquet", lambda df: _set(df, "num_cached_blocks", lambda n: n + 1, row=len(df) // 2), _REPLAYED, named=""),
]


# (an event or phase name outside the categories was refused through pandas' deprecated cast,
# which leaves it missing today and is to raise an error in its own words later)
@pytest.mark.filterwarnings("error::DeprecationWarning")
@pytest.mark.parametrize("name,edit,says,named", _NAMED_EDITS,
                         ids=[f"{f.split('.')[0]}-{i}" for i, (f, *_) in enumerate(_NAMED_EDITS)])
def test_a_save_edited_in_one_place_is_refused_by_the_check_for_it(run, tmp_path, name, edit, says, named):
    """Each edit breaks one thing the tables must agree on, and the check for that thing names it
    (the checksums would refuse every edit too, but the tables are checked first)."""
    path = run.blocks.save(tmp_path / "t")
    _edit_rows(path / name, edit)
    with pytest.raises(ValueError, match=f"^{re.escape(str(path / named))}: {says}.*; not a whole, unedited save"):
        Trace.load(path)


def test_a_steps_queue_rows_interleaved_load_as_the_same_queues(run, tmp_path):
    """A step's rows of different queues mixed (each queue's rows still in order) are still its
    queues: the load groups them by queue whatever order they come in. Without checksums.json a
    save is checked by its contents alone."""
    path = run.blocks.save(tmp_path / "t")
    (path / "checksums.json").unlink()
    file = path / "queues.parquet"
    saved = pd.read_parquet(file)["queue"]
    _edit_rows(file, lambda df: df.sort_values(["step", "position"], kind="stable"))
    assert not pd.read_parquet(file)["queue"].equals(saved)
    _assert_same_trace(run.blocks, Trace.load(path))


# (file, edit): each leaves the tables fitting together, so only the checksums tell
_UNSEEN_EDITS = [
    ("tokens.parquet", lambda df: _set(df, "text", "EDITED")),
    ("requests.parquet", lambda df: _set(df, "prompt_len", lambda n: n + 1)),
    ("block_events.parquet", lambda df: _set(df, "block_hash", lambda h: h + 1, row=int(df["block_hash"].notna().argmax()))),
    ("scheduled.parquet", lambda df: _set(df, "token_ids", lambda t: t[::-1])),
    ("steps.parquet", lambda df: _set(df, "duration_s", lambda d: d * 2)),
]


@pytest.mark.parametrize("name,edit", _UNSEEN_EDITS, ids=[f.split(".")[0] for f, _ in _UNSEEN_EDITS])
def test_an_edit_the_tables_cannot_show_is_refused_by_the_checksums(run, tmp_path, name, edit):
    """A token's text, a request's length, an event's hash, a token a row computed, a step's
    time: the edited save would load and show what the engine never did (the live trace is the
    truth: the unedited save loads equal to it). The SHA-256 the save wrote names the file."""
    path = run.blocks.save(tmp_path / "t")
    _assert_same_trace(run.blocks, Trace.load(path))
    _edit_rows(path / name, edit)
    with pytest.raises(ValueError, match=f"^{re.escape(str(path / name))}: its SHA-256 is not the one checksums.json lists"):
        Trace.load(path)
    meta = path / "meta.json"
    _edit_meta(meta, model="another model")
    (path / "checksums.json").write_text(json.dumps({"sha256": {"meta.json": "0" * 64}}))
    with pytest.raises(ValueError, match=f"^{re.escape(str(meta))}: its SHA-256"):
        Trace.load(path)
    outside = tmp_path / "outside.txt"  # (a file beside the save: its digest must never be read)
    outside.write_text("x")
    (path / "checksums.json").write_text(json.dumps({"sha256": {"../outside.txt": "0" * 64}}))
    with pytest.raises(ValueError, match=r"lists '\.\./outside\.txt', which is not a file name of the save"):
        Trace.load(path)


def test_the_checksums_check_the_bytes_the_load_parsed(run, tmp_path, monkeypatch):
    """A file edited while the load parses it and put back before the digests are checked: the
    load must refuse it, since what it parsed is the edit. Each file is read once, and its
    digest is the one of the bytes parsed (a second read for the digest saw the file put back)."""
    path = run.blocks.save(tmp_path / "t")
    file = path / "tokens.parquet"
    saved = file.read_bytes()
    _edit_rows(file, lambda df: _set(df, "text", "EDITED"))
    replay = trace_module.check_replay

    def put_back_then_replay(*args):
        file.write_bytes(saved)
        replay(*args)

    monkeypatch.setattr(trace_module, "check_replay", put_back_then_replay)
    with pytest.raises(ValueError, match=f"^{re.escape(str(file))}: its SHA-256 is not the one checksums.json lists"):
        Trace.load(path)


def test_a_save_with_a_step_launched_without_rows_loads_as_recorded(tmp_path):
    """Async scheduling, a ``step.scheduled`` hook aborts the only request: its step is launched
    with no row. The save is whole, so it loads, and equals the live trace (a check that every
    launch has rows refused it)."""
    llm = make_llm(block_size=4, num_kv_blocks=16, async_scheduling=True)

    def abort_at_schedule(step, request_ids, **_):
        if step == 4:
            llm.abort_request(list(request_ids.values()))

    with llm.record("full") as full, llm.record("blocks") as blocks, llm.hooks({"step.scheduled": abort_at_schedule}):
        llm.generate([[5, 6, 7, 8, 9]], greedy(8), use_tqdm=False)
        llm.generate([[9, 8, 7]], greedy(3), use_tqdm=False)
    assert 4 not in set(blocks.scheduled().step)
    for trace in (full, blocks):
        path = trace.save(tmp_path / trace.level)
        assert 4 in set(pd.read_parquet(path / "launches.parquet").launched_step)
        _assert_same_trace(trace, Trace.load(path))


def test_a_path_that_is_no_trace_directory_is_refused_by_name(tmp_path):
    file = tmp_path / "trace.zip"
    file.write_bytes(b"PK")
    for path, error, says in ((tmp_path / "nope", FileNotFoundError, "no such directory"),
                              (file, NotADirectoryError, "not a directory")):
        with pytest.raises(error, match=f"^{re.escape(str(path))}: {says}"):
            Trace.load(path)
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path / 'meta.json'))}: missing"):
        Trace.load(tmp_path)


def test_round_trip_of_summary_and_wrapped_traces(tmp_path):
    llm = _tight_llm()
    with llm.record("summary") as summary:
        ring = _record(llm, max_steps=5)
    for trace in (summary, ring.full, ring.blocks):
        _assert_same_trace(trace, Trace.load(trace.save(tmp_path / f"{trace.level}-{len(trace.step_ids)}")))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_round_trip_of_a_ring_buffer_whose_steps_hold_every_queue_and_preemptions(async_scheduling, tmp_path):
    """The last 30 steps of the workload: each queue is filled in some kept step, one with
    several requests in order, and a request is preempted; a load rebuilds all of it."""
    ring = _record(_tight_llm(async_scheduling=async_scheduling), max_steps=30)
    queues = ring.blocks.queues()
    assert ring.blocks.step_ids[0] > 1 and set(queues.queue) == {"running", "waiting", "preempted", "finished"}
    assert queues.groupby(["step", "queue"]).size().max() > 2 and ring.blocks.steps.num_preemptions.any()
    for trace in (ring.full, ring.blocks):
        _assert_same_trace(trace, Trace.load(trace.save(tmp_path / trace.level)))


@pytest.mark.parametrize("use_dictionary", [True, False], ids=["dictionary", "plain"])
def test_a_tables_strings_read_back_as_python_strings_and_none_over_row_groups(tmp_path, use_dictionary):
    """Strings are read as a dictionary and each distinct one made a Python string once: the
    table must still be the one written, ``None`` where missing, whether the file stores its
    strings as a dictionary or not, with a dictionary per row group of its own."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from kvscope.trace.saved_files import SavedFiles
    from kvscope.trace.tables import frame, read_frame

    queues = frame("queues", [(s, q, i, rid) for s in range(6) for i, (q, rid) in
                              enumerate([("running", f"r{s}"), ("waiting", None), ("finished", f"r{s % 2}")])])
    pq.write_table(pa.Table.from_pandas(queues, preserve_index=False), tmp_path / "queues.parquet",
                   row_group_size=4, use_dictionary=use_dictionary)
    read = read_frame("queues", SavedFiles(tmp_path))
    assert_frame_equal(read, queues)
    assert read["request_id"].map(type).value_counts().to_dict() == {str: 12, type(None): 6}


def test_levels_attach_only_their_hooks():
    llm = make_llm(block_size=4)
    prompts, params = _workload(n=2)
    with llm.record("summary") as summary:
        assert not llm.hooks.block_sinks and not llm.hooks.active("step.scheduled")
        llm.generate(prompts, params, use_tqdm=False)
    assert not llm.hooks.block_sinks  # nothing listens once recording stops
    assert not any(llm.hooks.active(name) for name in HOOK_POINTS)
    assert len(summary.steps) and len(summary.requests) == 2
    for read in (lambda: summary.block_events, lambda: summary.pool_arrays(1), summary.kv_events):
        with pytest.raises(ValueError, match="level 'blocks' or 'full'"):
            read()
    with llm.record("blocks"):
        assert len(llm.hooks.block_sinks) == 1 and llm.hooks.active("step.scheduled")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_step_scheduled_fires_right_before_each_launch(async_scheduling):
    """``step.scheduled`` fires for the step about to be launched (under async scheduling step
    n+1's, before step n's ``step.end``) with its rows' request ids, and stops no planning ahead."""
    llm = make_llm(block_size=4, async_scheduling=async_scheduling)
    order = []
    runner = llm.llm_engine.executor
    launch = runner.execute_async
    runner.execute_async = lambda out: order.append(("launch", out.step, len(out.requests))) or launch(out)

    def scheduled(step, scheduler_output, request_ids):
        assert sorted(request_ids) == sorted(r.seq_id for r in scheduler_output.requests)
        order.append(("scheduled", step, len(scheduler_output.requests)))

    with llm.hooks({"step.scheduled": scheduled, "step.end": lambda info: order.append(("end", info.step, 0))}):
        outputs = llm.generate(*_workload(n=4), use_tqdm=False)
    assert token_ids(outputs) == token_ids(make_llm(block_size=4).generate(*_workload(n=4), use_tqdm=False))
    launches = [i for i, e in enumerate(order) if e[0] == "launch"]
    assert launches and all(order[i - 1] == ("scheduled", *order[i][1:]) for i in launches)
    ends = {e[1]: i for i, e in enumerate(order) if e[0] == "end"}
    ahead = [n for n, i in ends.items() if ("scheduled", n + 1) in {e[:2] for e in order[:i]}]
    assert bool(ahead) == async_scheduling


def test_block_hooks_see_the_events_the_recorder_keeps():
    """User hooks (one Python call per event) and the recorder's block sink get the same stream."""
    llm = _tight_llm()
    seen = []
    hooks = {name: (lambda name: lambda **p: seen.append((name, p["block_id"], p["request_id"], p["ref_count"],
                                                          p["block_hash"])))(name) for name in BLOCK_EVENTS}
    with llm.hooks(hooks), llm.record("blocks") as trace:
        llm.generate(*_workload(), use_tqdm=False)
    ev = trace.block_events
    hashes = [None if pd.isna(h) else int(h) for h in ev.block_hash]
    rids = [None if pd.isna(r) else r for r in ev.request_id]  # (a categorical: NaN for none)
    assert seen == list(zip(ev.event, ev.block_id, rids, ev.ref_count, hashes))
    assert len(set(ev.event)) >= 5


def test_raising_hook_is_detached_and_generation_completes():
    llm = make_llm(block_size=4)
    prompts, params = _workload(n=3)
    expected = token_ids(llm.generate(prompts, params, use_tqdm=False))
    calls = []

    def bad(**payload):
        calls.append(payload)
        raise RuntimeError("boom")

    llm.hooks.add("block.allocated", bad)
    with pytest.warns(RuntimeWarning, match="raised and was detached"):
        assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == expected
    assert len(calls) == 1 and not llm.hooks.active("block.allocated")

    seen = []
    llm.hooks.add("step.end", lambda info: seen.append(info.step)).remove()
    with llm.hooks({"request.finished": lambda request_id, **_: seen.append(request_id)}):
        llm.generate(prompts[:1], params[:1], use_tqdm=False)
    llm.generate(prompts[:1], params[:1], use_tqdm=False)
    assert len(seen) == 1 and isinstance(seen[0], str)  # one finish, and no step.end at all


def test_listeners_see_each_record_and_a_raising_one_is_detached(tmp_path):
    llm = make_llm(block_size=4)
    prompts, params = _workload(n=3)
    got, bad_calls = [], []

    def bad(record):
        bad_calls.append(record.step)
        raise ValueError("listener bug")

    with llm.record("blocks") as trace:
        handle = trace.add_listener(got.append)
        trace.add_listener(bad)
        with pytest.warns(RuntimeWarning, match="trace listener"):
            llm.generate(prompts, params, use_tqdm=False)
        handle.remove()
        llm.generate(prompts[:1], params[:1], use_tqdm=False)
    assert [r.step for r in got] == trace.step_ids[:len(got)] and len(got) < len(trace.step_ids)
    assert len(bad_calls) == 1
    assert got[0].num_scheduled_tokens == trace.steps.num_scheduled_tokens.iloc[0]
    with pytest.raises(RuntimeError, match="does not record"):
        Trace.load(trace.save(tmp_path)).add_listener(print)


def test_a_listener_that_leaves_block_events_alone_lets_them_wait_for_their_chunk():
    """A listener finds each record's block events packed when it is called, so a recording with
    one packs every step. One added with ``block_events=False`` (the live dashboard's) leaves the
    packing to the chunks, as with no listener; either way the trace ends with the same events."""
    def record(listen: dict | None) -> tuple[Trace, list[bool]]:
        llm = _tight_llm(async_scheduling=True)
        packed: list[bool] = []
        with llm.record("blocks") as trace:
            if listen is not None:
                trace.add_listener(lambda rec: packed.append(rec.block_events is not None), **listen)
            llm.generate(*_workload(), use_tqdm=False)
        return trace, packed

    alone, _ = record(None)
    reading, packed_for_reader = record({})
    leaving, packed_for_other = record({"block_events": False})
    assert len(packed_for_reader) == len(alone.step_ids) and all(packed_for_reader)
    assert len(packed_for_other) == len(alone.step_ids) and not any(packed_for_other[:3])
    for trace in (reading, leaving):
        assert_frame_equal(trace.block_events, alone.block_events)
        assert_frame_equal(trace.block_tables(), alone.block_tables())


def test_stopping_freezes_the_trace_and_releases_the_engine():
    llm = make_llm(block_size=4)
    prompts, params = _workload(n=1)
    recorder = Recorder(llm.llm_engine, "blocks")
    with recorder as trace:
        llm.add_request(prompts[0], params[0])
        for _ in range(3):
            llm.step()
    frozen = trace.requests
    assert frozen.output_len.tolist() == [3] and frozen.finish_reason.isna().all()
    while llm.has_unfinished_requests():
        llm.step()
    assert_frame_equal(trace.requests, frozen)
    assert recorder.engine is None and trace.step_ids == [1, 2, 3]
    with pytest.raises(RuntimeError, match="records once"):
        recorder.start()


def test_summary_recording_keeps_async_scheduling_and_agrees_with_sync():
    """A ``summary`` recorder needs no block-level hook, so the engine keeps planning ahead;
    its tables agree with the outputs and with the same recording made synchronously."""
    prompts, params = _workload(stops=False)  # (a stop wastes the row async scheduling planned ahead)
    tables = {}
    for mode in (False, True):
        llm = make_llm(block_size=4, enable_prefix_caching=True, async_scheduling=mode)
        runner, ahead = llm.llm_engine.executor, []
        launch = runner.execute_async
        runner.execute_async = lambda out: ahead.append(any(PLACEHOLDER in r.token_ids for r in out.requests)) or launch(out)
        with llm.record(level="summary") as trace:
            t0 = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.perf_counter() - t0
        assert any(ahead) == mode, "summary recording must not switch async scheduling off"
        steps, rows = trace.steps, trace.requests.set_index("request_id")
        # Steps follow each other: no overlap, and together no longer than the run.
        assert (steps.time_s.iloc[1:].to_numpy() >= (steps.time_s + steps.duration_s).iloc[:-1].to_numpy()).all()
        assert steps.duration_s.sum() <= wall
        assert (steps.num_prefill_tokens + steps.num_decode_tokens == steps.num_scheduled_tokens).all()
        assert steps.step.is_unique and steps.step.is_monotonic_increasing
        for o in outputs:
            r = rows.loc[o.request_id]
            assert (r.output_len, r.num_cached_tokens, r.finish_reason) == \
                (len(o.outputs[0].token_ids), o.num_cached_tokens, o.outputs[0].finish_reason)
        tables[mode] = (token_ids(outputs), int(steps.num_scheduled_tokens.sum()),
                        int(steps.prefix_cache_hits.sum()), rows.sort_index()[["prompt_len", "output_len"]])
    assert tables[True][:3] == tables[False][:3]
    assert_frame_equal(tables[True][3], tables[False][3])


def test_full_snapshots_keep_only_what_each_step_changed(run):
    """A ``full`` record keeps the blocks whose refcount or hash changed (read from the block
    manager); each of them must be named by one of that step's block events, and after the
    keyframe they are a small part of the pool."""
    recs = run.full._records()
    assert len(recs[0].pool.block_ids) == run.full.num_blocks  # the keyframe
    for rec in recs[1:]:
        named = {e.block_id for e in rec.block_events}
        assert set(rec.pool.block_ids.tolist()) <= named, f"step {rec.step}"
    changed = sum(len(r.pool.block_ids) for r in recs[1:])
    assert 0 < changed < run.full.num_blocks * (len(recs) - 1) / 3

@pytest.mark.parametrize("how", ["remove", "clear"])
def test_a_hook_removed_by_a_hook_before_it_is_not_called_in_that_firing(how):
    """Removing hooks takes effect at once: a later hook of the same firing that an earlier one
    removed (by its handle, or by clearing the registry) is not called, then or after."""
    llm = make_llm(block_size=4)
    calls = []
    handles = {}

    def first(info) -> None:
        calls.append("first")
        if calls.count("first") == 3:
            handles["second"].remove() if how == "remove" else llm.hooks.clear()

    handles["first"] = llm.hooks.add("step.end", first)
    handles["second"] = llm.hooks.add("step.end", lambda info: calls.append("second"))
    llm.generate([[3, 4, 5, 6, 7]], greedy(5), use_tqdm=False)
    assert calls[:5] == ["first", "second"] * 2 + ["first"]
    assert calls.count("second") == 2
    assert calls.count("first") == (5 if how == "remove" else 3)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_step_end_hook_that_steps_the_engine_leaves_the_records_in_order(async_scheduling):
    """A ``step.end`` hook added before the recorder runs ``generate``: the recorder's own
    ``step.end`` fires first, so step n's record is closed before the nested steps are recorded,
    and the replay still equals the full level's snapshots at every step."""
    llm = _tight_llm(async_scheduling=async_scheduling)
    fired: list[int] = []

    def nested(info, **_) -> None:
        if not fired:
            fired.append(info.step)
            llm.generate([[3, 4, 5]], greedy(2), use_tqdm=False)

    llm.hooks.add("step.end", nested)
    with llm.record("full") as full, llm.record("blocks") as blocks:
        llm.generate([[3]], greedy(4), use_tqdm=False)
    assert fired and blocks.step_ids == sorted(set(blocks.step_ids)) == full.step_ids
    for step in blocks.step_ids:
        snap, replay = full.pool_arrays(step), blocks.pool_arrays(step)
        assert all(np.array_equal(snap[k], replay[k]) for k in snap)


def test_a_recording_keeps_full_collections_off_the_heap_it_started_on():
    """While recording, the heap that existed when the recording started is frozen (a full
    collection in the engine's thread would walk it all); what is made meanwhile is collected
    as usual; stopping thaws it without forcing a collection, and nested recordings thaw only
    when the last one stops."""
    import gc
    import weakref

    assert gc.get_freeze_count() == 0, "a recording (or a freeze) was left behind by an earlier test"
    llm = make_llm()
    old = Cycle()
    gone = weakref.ref(old)
    del old
    with llm.record(level="blocks"):
        with llm.record(level="summary"):
            llm.generate([[5, 6, 7, 8]], greedy(4), use_tqdm=False)
            new = Cycle()
            new_gone = weakref.ref(new)
            del new
            gc.collect()
            assert new_gone() is None, "what is made while recording is collected as usual"
        gc.collect()
        assert gone() is not None, "the heap from before the recording must be frozen while it runs"
    assert gc.get_freeze_count() == 0 and gone() is not None, "stopping thaws, and forces no collection"
    gc.collect()
    assert gone() is None


def test_a_load_builds_the_trace_with_the_collector_off_and_leaves_it_as_it_was(run, tmp_path, monkeypatch):
    """Trace.load builds its records with the cyclic collector off (what it builds is kept, so a
    collection finds nothing, and full ones walk the growing heap), and leaves the collector as
    it found it: on, off, and after a load that is refused."""
    import gc

    path = run.blocks.save(tmp_path / "t")
    seen = []
    build = trace_module.records_from_frames

    def watched(*args, **kwargs):
        seen.append(gc.isenabled())
        return build(*args, **kwargs)

    monkeypatch.setattr(trace_module, "records_from_frames", watched)
    assert gc.isenabled()
    _assert_same_trace(run.blocks, Trace.load(path))
    assert seen == [False] and gc.isenabled()
    gc.disable()
    try:
        Trace.load(path)
        assert seen == [False, False] and not gc.isenabled()
    finally:
        gc.enable()
    _edit_meta(path / "meta.json", num_blocks=17)
    with pytest.raises(ValueError, match="do not add up"):
        Trace.load(path)
    assert gc.isenabled()


def test_overlapping_pauses_of_the_collector_leave_it_as_the_first_found_it():
    """Two threads' pauses overlap (each a Trace.load, say): the collector stays off until the last
    one ends, whichever ends first, and is then as it was before the first began."""
    import gc
    import threading

    from kvscope.trace.frozen_heap import collector_paused

    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        try:
            inside, leave = threading.Event(), threading.Event()

            def other():
                with collector_paused():
                    inside.set()
                    leave.wait(10)

            with collector_paused():
                thread = threading.Thread(target=other)
                thread.start()
                assert inside.wait(10) and not gc.isenabled()
            assert not gc.isenabled(), "the other pause still runs"
            leave.set()
            thread.join(10)
            assert gc.isenabled() == enabled
            with pytest.raises(KeyError), collector_paused():
                raise KeyError("a refused load")
            assert gc.isenabled() == enabled
        finally:
            gc.enable()


def test_a_recording_started_mid_run_knows_the_tokens_of_blocks_not_yet_full():
    """A block that is not full has no hash and the block manager keeps no copy of its tokens:
    a recording that starts while it is in use must take them from its sequence."""
    llm = make_llm(block_size=4)
    prompts, params = _workload(seed=3, n=3, stops=False)
    engine = llm.llm_engine
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    for _ in range(3):
        llm.step()
    partial = []  # (block, the tokens it holds) for each running sequence's last block, if not full
    for req in engine.scheduler.running:
        n = req.num_computed_tokens
        if n % 4:
            partial.append((req.block_table[(n - 1) // 4], list(req.token_ids[n - n % 4:n])))
    assert partial
    with llm.record("blocks") as trace:
        llm.step()
    first = trace.step_ids[0]
    for block, tokens in partial:
        assert trace.block_tokens(first, block)[:len(tokens)] == tokens


@pytest.mark.parametrize("chunk_steps, chunk_events", [(64, 1 << 16), (1, 1 << 16), (3, 1 << 16), (64, 5)])
def test_block_events_are_the_same_however_their_packing_is_chunked(monkeypatch, chunk_steps, chunk_events):
    """A recording packs its records' block events a chunk of records at a time: when the chunk
    is full (in steps or events), before a record leaves the ring buffer, and when the trace is
    read. Reading the trace while the engine runs (from a step.end hook, every few steps), chunks
    of every size, and a ring buffer all give each step the same events as one pack at the end."""
    def record(max_steps: int, read_every: int | None) -> tuple[Trace, list[pd.DataFrame]]:
        llm = _tight_llm(async_scheduling=True)
        reads: list[pd.DataFrame] = []
        with llm.record("blocks", max_steps) as trace:
            def read(info, **_):
                if read_every and info.step % read_every == 0:
                    reads.append(trace.block_events)
            with llm.hooks({"step.end": read}):
                llm.generate(*_workload(), use_tqdm=False)
        return trace, reads

    whole, _ = record(10_000, None)
    monkeypatch.setattr("kvscope.trace.recorder.CHUNK_STEPS", chunk_steps)
    monkeypatch.setattr("kvscope.trace.recorder.CHUNK_EVENTS", chunk_events)
    chunked, reads = record(10_000, 4)
    assert len(whole.step_ids) > 3 * 4 and len(reads) >= 3
    assert_frame_equal(chunked.block_events, whole.block_events)
    assert_frame_equal(chunked.block_tables(), whole.block_tables())
    for step in whole.step_ids[::5]:  # the pool replayed through the events
        for k, v in whole.pool_arrays(step).items():
            np.testing.assert_array_equal(chunked.pool_arrays(step)[k], v)
    for read in reads:  # what a reader saw mid-run: the same events, up to its step
        assert_frame_equal(read, whole.block_events.iloc[:len(read)], check_categorical=False)
    ring, _ = record(7, 5)
    assert_frame_equal(ring.block_events.reset_index(drop=True),
                       whole.block_events[whole.block_events.step >= ring.step_ids[0]].reset_index(drop=True),
                       check_categorical=False)


def _interned_request_ids(trace: Trace) -> tuple[int, int]:
    """The request-id tables a live trace's recorder and records reach, and how many ids they name."""
    source = trace._source
    records = trace._records()  # (a read: every record's block events packed)
    tables = [source._request_ids, *(r.block_events.requests for r in records),
              *(s.table.requests for r in records for s in (r.scheduled, *(launch.rows for launch in r.launches)))]
    unique = {id(t): t for t in tables}
    return len(unique), sum(len(t.names) for t in unique.values())


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_live_ring_buffer_holds_the_request_ids_of_its_own_steps(monkeypatch, async_scheduling, tmp_path):
    """Requests keep arriving and finishing under a 12-step ring buffer: the request ids its
    tables intern stay about those of its own steps (the ids its tables show) after N steps and
    after 4N, while a recording that keeps every step names every request. And what it keeps reads
    as the whole recording's last 12 steps, across the tables its records were coded with."""
    monkeypatch.setattr("kvscope.trace.recorder.REQUEST_IDS_PER_TABLE", 16)
    llm = make_llm(block_size=4, num_kv_blocks=64, max_num_seqs=4, async_scheduling=async_scheduling)
    rng = random.Random(3)
    counts = []
    with llm.record("blocks") as whole, llm.record("blocks", max_steps=12) as ring:
        for n in range(1, 601):
            while len(llm.llm_engine.requests) < 6:
                llm.add_request([rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 9))], greedy(rng.randrange(1, 4)))
            llm.step()
            if n in (150, 600):
                shown = set(ring.scheduled().request_id) | set(ring.block_events.request_id.dropna())
                counts.append((len(shown), *_interned_request_ids(ring)))
    assert len(whole.requests) > 500
    for shown, tables, interned in counts:
        assert interned <= 2 * shown + 2 * 16, counts
    assert counts[-1][2] < len(whole.requests) / 4 and max(tables for _, tables, _ in counts) > 1, counts
    kept = whole.step_ids[-12:]
    assert ring.step_ids == kept
    assert_frame_equal(ring.steps, whole.steps.iloc[-12:].reset_index(drop=True))
    assert_frame_equal(ring.requests, whole.requests[whole.requests.request_id.isin(ring.requests.request_id)]
                       .reset_index(drop=True))
    for name in ("scheduled", "queues", "block_tables", "slot_mapping"):
        table = getattr(whole, name)()
        assert_frame_equal(getattr(ring, name)(), table[table.step >= kept[0]].reset_index(drop=True))
    events = whole.block_events
    assert_frame_equal(ring.block_events, events[events.step >= kept[0]].reset_index(drop=True), check_categorical=False)
    for step in kept:
        for k, v in whole.pool_arrays(step).items():
            np.testing.assert_array_equal(ring.pool_arrays(step)[k], v)
    _assert_same_trace(ring, Trace.load(ring.save(tmp_path / "ring")))


def test_saving_to_a_path_that_names_a_file_is_refused_by_name(tmp_path):
    """``save`` writes a directory of files: a path that names a file is refused naming it and
    what it must be (it raised mkdir's bare FileExistsError), and the file is left as it was."""
    llm = make_llm(block_size=4)
    with llm.record("blocks") as trace:
        llm.generate([[3, 4, 5]], greedy(2), use_tqdm=False)
    file = tmp_path / "trace.parquet"
    file.write_bytes(b"mine")
    with pytest.raises(NotADirectoryError, match=f"^{re.escape(str(file))}: not a directory;"):
        trace.save(file)
    assert file.read_bytes() == b"mine"
    _assert_same_trace(trace, Trace.load(trace.save(tmp_path / "trace")))
