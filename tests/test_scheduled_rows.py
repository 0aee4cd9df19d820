"""Scheduled rows as a trace stores them (each step told against the one before, a keyframe
every ``KEYFRAME_EVERY`` steps, token ids in narrow dtypes) read back exactly as the engine
scheduled them.

The truth is the engine's own: every ``SchedulerOutput`` as the ``step.scheduled`` hook sees it
(each row's request, start, length, cache hit and flags), and the requests' token sequences at
the end (a row computed its request's tokens at its positions). Covered: sync and async
scheduling, preemption, chunked prefill, prefix-cache hits, a ring buffer that dropped steps,
reads of single steps in any order with nothing decoded yet, and save / load.
"""
from __future__ import annotations

import random

import numpy as np
import pandas as pd
import pytest
from pandas.testing import assert_frame_equal

from engine_helpers import greedy, make_llm
from kvscope import Trace
from kvscope.config import EngineConfig
from kvscope.engine.llm_engine import LLMEngine
from kvscope.runner.null_executor import NullExecutor
from kvscope.sampling_params import SamplingParams
from kvscope.trace.event_log import RequestIds
from kvscope.trace.recorder import Recorder
from kvscope.trace.scheduled import KEYFRAME_EVERY, RowEncoder, RowTable
from kvscope.trace.tables import SCHEMAS

VOCAB = 320
BIG_VOCAB = 100_003  # sampled ids beyond 16 bits, prompt ids within 8


def _watch(engine: LLMEngine) -> tuple[dict[int, list[tuple]], dict[str, object]]:
    """Each launched step's rows, from the engine's ``SchedulerOutput``, and the requests."""
    steps: dict[int, list[tuple]] = {}
    requests: dict[str, object] = {}

    def on_scheduled(scheduler_output, request_ids, **_):
        rows = steps[scheduler_output.step] = []
        for r in scheduler_output.requests:
            rid = request_ids[r.seq_id]
            requests[rid] = engine.requests[rid]
            rows.append((rid, r.start, r.num_new_tokens, r.num_cached_tokens, r.is_prefill, r.sample))

    engine.hooks.add("step.scheduled", on_scheduled)
    return steps, requests


def _expected(steps: dict[int, list[tuple]], requests: dict, step_ids: list[int]) -> pd.DataFrame:
    rows = [(step, rid, start, n, cached, prefill, sample, list(requests[rid].token_ids[start:start + n]))
            for step in step_ids for rid, start, n, cached, prefill, sample in steps[step]]
    return pd.DataFrame(rows, columns=list(SCHEMAS["scheduled"])).astype(SCHEMAS["scheduled"])


def _steady(before: list[tuple], rows: list[tuple]) -> int:
    """Rows that go on from the step before: one decode token right after the request's last row."""
    ends = {rid: start + n for rid, start, n, *_ in before}
    return sum(ends.get(rid) == start and n == 1 and not cached and not prefill and sample
               for rid, start, n, cached, prefill, sample in rows)


def _assert_each_step_reads_alone(trace: Trace, expected: pd.DataFrame, seed: int) -> None:
    steps = trace.step_ids
    decoded = trace._source.records[0].scheduled.table.decoded
    for step in random.Random(seed).sample(steps, len(steps)):
        decoded.cache_clear()  # nothing decoded: a step decodes from its keyframe
        want = expected[expected.step == step].reset_index(drop=True)
        assert_frame_equal(trace.scheduled(step), want)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_rows_are_the_engines_through_preemption_chunks_and_prefix_hits(async_scheduling, tmp_path):
    llm = make_llm(block_size=4, num_kv_blocks=16, max_num_batched_tokens=24, async_scheduling=async_scheduling)
    steps, requests = _watch(llm.llm_engine)
    rng = random.Random(5)
    system = [rng.randrange(3, VOCAB) for _ in range(13)]
    prompts = [system + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 30))] for _ in range(8)]
    with llm.record("blocks") as trace:
        llm.generate(prompts, [greedy(rng.randrange(6, 24)) for _ in prompts], use_tqdm=False)

    expected = _expected(steps, requests, trace.step_ids)
    assert trace.steps.num_preemptions.sum() > 0  # the workload does what the test is about
    assert (expected.is_prefill & (expected.start > expected.num_cached_tokens)).any()  # a later chunk
    assert (expected.num_cached_tokens > 0).any()
    assert_frame_equal(trace.scheduled(), expected)
    _assert_each_step_reads_alone(trace, expected, seed=1)
    loaded = Trace.load(trace.save(tmp_path / "trace"))
    assert_frame_equal(loaded.scheduled(), expected)
    _assert_each_step_reads_alone(loaded, expected, seed=2)


class _Tok:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _null_engine(async_scheduling: bool) -> LLMEngine:
    config = EngineConfig.from_kwargs(block_size=4, max_num_seqs=6, max_num_batched_tokens=40,
                                      async_scheduling=async_scheduling)
    return LLMEngine(config, NullExecutor(48, BIG_VOCAB, 4), _Tok(), max_model_len=512)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_long_recording_keeps_steady_rows_implied_and_reads_back_after_the_ring_buffer_dropped_steps(
        async_scheduling):
    engine = _null_engine(async_scheduling)
    steps, requests = _watch(engine)
    rng = random.Random(9)
    max_steps = KEYFRAME_EVERY + 37
    with Recorder(engine, "blocks", max_steps=max_steps) as trace:
        for _ in range(14):
            engine.add_request([rng.randrange(1, 200) for _ in range(rng.randrange(3, 70))],
                               SamplingParams(temperature=0, ignore_eos=True, max_tokens=rng.randrange(20, 90)))
        while engine.has_unfinished_requests():
            engine.step()

    step_ids = trace.step_ids
    assert len(step_ids) == max_steps and step_ids[0] > KEYFRAME_EVERY  # the ring buffer dropped steps
    assert trace.steps.num_preemptions.sum() > 0
    expected = _expected(steps, requests, step_ids)
    assert expected.token_ids.map(max).max() >= 2**16  # token ids of more than one width
    assert_frame_equal(trace.scheduled(), expected)
    _assert_each_step_reads_alone(trace, expected, seed=3)

    # Stored compactly: a step's rows are kept whole only where they do not go on from the step
    # before (or in a keyframe), and no step is more than a keyframe interval from one.
    records = trace._source.records
    implied = whole = 0
    for rec in records:
        s = rec.scheduled
        rows = steps[rec.step]
        if s.prev is None:
            whole += len(rows)
            continue
        prev_step = max(k for k in steps if k < rec.step)  # the step launched before (a step may launch nothing)
        kept = len(s.explicit) if s.explicit is not None else 0
        assert kept == len(rows) - _steady(steps[prev_step], rows), rec.step
        implied += len(rows) - kept
        whole += kept
        depth, p = 0, s
        while p.prev is not None:
            depth, p = depth + 1, p.prev
        assert depth < KEYFRAME_EVERY
    assert implied > 4 * whole


def test_the_encoder_round_trips_any_run_of_rows():
    """Rows that come, go, change order, restart (preemption), carry placeholder (-1) or wide
    token ids, and steps with no rows: each step decodes to exactly what was encoded."""
    rng = np.random.default_rng(0)
    requests = RequestIds()
    table = RowTable(requests)
    encoder = RowEncoder(table)
    ends: dict[int, int] = {}
    encoded = []
    for step in range(3 * KEYFRAME_EVERY + 5):
        ids = [i for i in ends if rng.random() > 0.08]  # some go
        ids += [int(i) for i in rng.integers(0, 40, rng.integers(0, 3)) if int(i) not in ids]  # some come back or are new
        if rng.random() < 0.2:
            rng.shuffle(ids)
        if rng.random() < 0.03:
            ids = []
        ident = np.array(ids, np.int64)
        start = np.array([ends.get(i, 0) if rng.random() > 0.05 else int(rng.integers(0, 50)) for i in ids], np.int64)
        decode = np.array([i in ends and rng.random() > 0.1 for i in ids], bool)
        lens = np.where(decode, 1, rng.integers(1, 9, len(ids)))
        cached = np.where(decode | (rng.random(len(ids)) < 0.7), 0, rng.integers(0, 5, len(ids)))
        sample = rng.random(len(ids)) < np.where(decode, 0.9, 0.5)  # (any columns: a decode row that does not sample is kept whole)
        wide = rng.random() < 0.5
        tokens = rng.integers(-1, 2**31 - 1 if wide else 200, int(lens.sum()))
        codes = np.array([requests.code(f"r{i}") for i in ids], np.int64)
        s = encoder.encode(ident, codes.__getitem__, start, lens, cached, ~decode, sample, tokens)
        encoded.append((s, [f"r{i}" for i in ids], start, lens, cached, ~decode, sample, tokens))
        ends = dict(zip(ids, (start + lens).tolist()))
    assert sum(s.prev is None for s, *_ in encoded) == -(-len(encoded) // KEYFRAME_EVERY)
    table.decoded.cache_clear()
    for i in np.random.default_rng(1).permutation(len(encoded)).tolist():
        s, ids, *columns = encoded[i]
        assert s.request_ids == ids and len(s) == len(ids)
        for name, want in zip(("start", "num_new_tokens", "num_cached_tokens", "is_prefill", "sample", "token_ids"),
                              columns):
            np.testing.assert_array_equal(getattr(s, name), want, err_msg=f"step {i}: {name}")
