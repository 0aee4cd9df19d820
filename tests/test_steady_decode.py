"""The scheduler's steady decode path (kvscope/engine/decode_batch.py) plans a step from the
last step's columns. It must decide exactly what the general path decides: the same engine run
twice on the same workload, once with ``steady_decode`` off, must produce the same
SchedulerOutputs (rows, columns, preemptions, finished ids), the same block events in the same
order, the same outputs, and each request's first and last token times from the step that
post-processed them, across block boundaries, finishes (length, EOS), preemption,
waiting requests, prefix caching, aborts, both policies, sync and async. With nothing watching
block events (``watch_blocks=False``: the block manager then updates the pool as whole arrays),
the pool itself and the runner's block tables are compared after every step instead."""
from __future__ import annotations

import itertools
from dataclasses import astuple

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from engine_helpers import NumberTokenizer
from kvscope.config import EngineConfig
from kvscope.engine.llm_engine import LLMEngine
from kvscope.engine.scheduler_output import StepColumns
from kvscope.runner.null_executor import NullExecutor
from kvscope.sampling_params import SamplingParams

VOCAB = 64


def _pool(engine) -> tuple:
    """The block pool's state and every request's table, scheduler's and runner's."""
    bm, runner_tables = engine.scheduler.block_manager, engine.executor.block_tables
    tables = {}
    for seq_id, req in engine.scheduler.requests.items():
        runner = runner_tables.get(seq_id) if seq_id in runner_tables.rows else None
        tables[seq_id] = (list(req.block_table), req.num_sent_blocks, runner)
    hashed = bm.block_hash != -1
    return (list(bm.free), bm.ref_count.tolist(), bm.block_hash.tolist(), bm.block_tokens[hashed].tolist(),
            sorted(bm.used), dict(bm.hash_to_block), bm.num_cached_blocks, tables)


def _run(steady: bool, reqs, block_size, num_blocks, max_num_seqs, policy, caching, async_scheduling, abort_at,
         watch_blocks=True):
    config = EngineConfig.from_kwargs(
        block_size=block_size, max_num_seqs=max_num_seqs, max_num_batched_tokens=256,
        scheduling_policy=policy, enable_prefix_caching=caching, async_scheduling=async_scheduling)
    engine = LLMEngine(config, NullExecutor(num_blocks, VOCAB, block_size, eos_every=29), NumberTokenizer(),
                       max_model_len=256, eos_token_ids=[0])
    engine.scheduler.steady_decode = steady
    engine.validate_every_step = True
    steps, events, outputs = [], [], []
    if watch_blocks:
        engine.hooks.add_block_sink(events)

    def on_scheduled(scheduler_output, **_):
        out = scheduler_output
        cols = out.columns
        steps.append((out.step, [astuple(r) for r in out.requests], list(out.preempted_seq_ids),
                      list(out.finished_seq_ids), cols, StepColumns.from_rows(out.requests)))
        if not watch_blocks:  # (the last step's pool, once its deltas reached the runner)
            events.append(_pool(engine))

    engine.hooks.add("step.scheduled", on_scheduled)
    first_token, last_token = {}, {}  # request -> the ``now`` of its first and last post-processed token
    update = engine.scheduler.update_from_output

    def timed_update(out, result, now):
        progressed, finished = update(out, result, now)
        for req in progressed:
            first_token.setdefault(req.request_id, now)
            last_token[req.request_id] = now
        return progressed, finished

    engine.scheduler.update_from_output = timed_update
    ids = [engine.add_request(p, SamplingParams(max_tokens=m, temperature=0)) for p, m in reqs]
    requests = [engine.requests[i] for i in ids]
    n = 0
    while engine.has_unfinished_requests():
        n += 1
        if n == abort_at:
            engine.abort_request(ids[len(ids) // 2])
        outputs += [(o.request_id, list(o.outputs[0].token_ids), o.outputs[0].finish_reason, o.finished)
                    for o in engine.step()]
        assert n < 2000
    for req in requests:  # the metrics each path keeps: its first and last token's times
        m = req.metrics
        assert (m.first_token_time, m.last_token_time) == (first_token.get(req.request_id), last_token.get(req.request_id))
    return steps, events, outputs, engine.scheduler.num_steady_steps


def _check_same(**kw):
    general = _run(False, **kw)
    steady = _run(True, **kw)
    assert general[3] == 0
    assert len(steady[0]) == len(general[0])
    for (step, rows, pre, fin, cols, from_rows), (g_step, g_rows, g_pre, g_fin, g_cols, _) in zip(steady[0], general[0]):
        assert (step, rows, pre, fin) == (g_step, g_rows, g_pre, g_fin)
        for name in StepColumns.__slots__:  # the columns a step carries are its rows' columns
            assert np.array_equal(getattr(cols, name), getattr(g_cols, name)), name
            assert np.array_equal(getattr(cols, name), getattr(from_rows, name)), name
    assert steady[1] == general[1]
    assert steady[2] == general[2]
    return steady[3], len(steady[0])


def test_long_decode_takes_the_steady_path_across_block_boundaries():
    prompts = [[1 + (i * 7 + j) % 60 for j in range(5 + 3 * i)] for i in range(6)]
    reqs = [(p, 20 + 9 * i) for i, p in enumerate(prompts)]  # finishes at different steps
    for async_scheduling, watch_blocks in itertools.product((False, True), (False, True)):
        num_steady, num_steps = _check_same(reqs=reqs, block_size=4, num_blocks=200, max_num_seqs=8,
                                            policy="unified", caching=True, async_scheduling=async_scheduling,
                                            abort_at=None, watch_blocks=watch_blocks)
        assert num_steady >= num_steps - 1  # every step but the prefill, finishes included


def test_preemption_under_a_small_pool():
    reqs = [([1 + i, 2, 3, 4, 5], 40) for i in range(4)]
    for async_scheduling, watch_blocks in itertools.product((False, True), (False, True)):
        num_steady, _ = _check_same(reqs=reqs, block_size=4, num_blocks=24, max_num_seqs=4, policy="unified",
                                    caching=False, async_scheduling=async_scheduling, abort_at=30,
                                    watch_blocks=watch_blocks)
        assert num_steady > 0


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(st.tuples(st.lists(st.integers(1, 4), min_size=1, max_size=30), st.integers(1, 40)),
                  min_size=1, max_size=8),
    block_size=st.sampled_from([1, 2, 4, 8]),
    spare_blocks=st.integers(0, 20),
    max_num_seqs=st.integers(1, 8),
    policy=st.sampled_from(["unified", "prefill_first"]),
    caching=st.booleans(),
    async_scheduling=st.booleans(),
    abort_at=st.one_of(st.none(), st.integers(1, 30)),
    watch_blocks=st.booleans(),
)
@example(reqs=[([1, 2, 3], 30), ([2, 3], 30)], block_size=2, spare_blocks=0, max_num_seqs=2,
         policy="unified", caching=False, async_scheduling=True, abort_at=None, watch_blocks=False)
def test_steady_path_decides_as_the_general_path(reqs, block_size, spare_blocks, max_num_seqs, policy, caching,
                                                 async_scheduling, abort_at, watch_blocks):
    longest = max(len(p) + m for p, m in reqs)
    _check_same(reqs=reqs, block_size=block_size, num_blocks=-(-longest // block_size) + spare_blocks,
                max_num_seqs=max_num_seqs, policy=policy, caching=caching, async_scheduling=async_scheduling,
                abort_at=abort_at, watch_blocks=watch_blocks)


def _trace(steady: bool, async_scheduling: bool):
    from kvscope.trace.recorder import Recorder

    config = EngineConfig.from_kwargs(block_size=4, max_num_seqs=4, max_num_batched_tokens=256,
                                      async_scheduling=async_scheduling)
    engine = LLMEngine(config, NullExecutor(40, VOCAB, 4, eos_every=29), NumberTokenizer(), max_model_len=256, eos_token_ids=[0])
    engine.scheduler.steady_decode = steady
    recorder = Recorder(engine, "blocks")
    trace = recorder.start()
    for i in range(6):
        engine.add_request([1 + i % 3, 2, 3, 4, 5, 6][: 3 + i % 4], SamplingParams(max_tokens=30 + i, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    recorder.stop()
    return trace, engine.scheduler.num_steady_steps


def test_a_recorded_trace_is_the_same_with_the_steady_path():
    for async_scheduling in (False, True):
        (general, n_general), (steady, n_steady) = _trace(False, async_scheduling), _trace(True, async_scheduling)
        assert n_general == 0 < n_steady
        timing = [c for c in general.steps.columns if c.endswith("_s") or c.endswith("time")]
        assert steady.steps.drop(columns=timing).equals(general.steps.drop(columns=timing))
        assert steady.block_events.equals(general.block_events)
        for table in ("scheduled", "queues", "block_tables", "slot_mapping"):
            assert getattr(steady, table)().equals(getattr(general, table)()), table
        for step in general.step_ids:
            assert steady.blocks(step).equals(general.blocks(step))


def test_a_steady_steps_rows_read_by_index_equal_its_rows_read_in_order():
    """A steady step's rows (a ``DecodeRows``, built when read) read one by one by index, as the
    runner reads the rows whose tables grew, before and after the whole sequence is iterated:
    the same rows as iteration gives, negative indices and slices included; past the end, IndexError."""
    from kvscope.engine.scheduler_output import DecodeRows

    config = EngineConfig.from_kwargs(block_size=4, max_num_seqs=4, max_num_batched_tokens=256)
    engine = LLMEngine(config, NullExecutor(40, VOCAB, 4), NumberTokenizer(), max_model_len=256, eos_token_ids=[0])
    for i in range(3):
        engine.add_request([1 + i, 2, 3], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    seen = 0
    while engine.has_unfinished_requests():
        out = engine.scheduler.schedule()
        if isinstance(out.requests, DecodeRows):
            seen += 1
            rows = out.requests
            one_by_one = [astuple(rows[i]) for i in range(len(rows))] + [astuple(rows[-1])]
            listed = [astuple(r) for r in rows]
            assert one_by_one == listed + [listed[-1]]
            assert [astuple(r) for r in rows[1:]] == listed[1:] and astuple(rows[0]) == listed[0]
            with pytest.raises(IndexError):
                rows[len(rows)]
        engine.scheduler.update_from_output(out, engine.executor.execute(out), 0.0)
    assert seen > 5


def test_a_summary_recording_builds_no_row_of_a_steady_step():
    """``DecodeRows`` exist so that a steady step costs no per-row object; a ``summary``
    recording (its step.end hook, and the request ids the engine takes for it) must read such a
    step as columns too, or recording would add a Python object per row and step."""
    from kvscope.engine.scheduler_output import DecodeRows
    from kvscope.trace.recorder import Recorder

    config = EngineConfig.from_kwargs(block_size=4, max_num_seqs=4, max_num_batched_tokens=256)
    engine = LLMEngine(config, NullExecutor(40, VOCAB, 4), NumberTokenizer(), max_model_len=256, eos_token_ids=[0])
    for i in range(3):
        engine.add_request([1 + i, 2, 3], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    recorder = Recorder(engine, "summary")
    trace = recorder.start()
    built = []
    engine.hooks.add("step.end", lambda info: built.append(
        info.scheduler_output.requests._rows is not None
        if isinstance(info.scheduler_output.requests, DecodeRows) else None))
    while engine.has_unfinished_requests():
        engine.step()
    recorder.stop()
    assert built.count(False) > 5 and True not in built
    assert trace.steps.num_decode_seqs.iloc[-1] == 3
