"""The packed block-event log: exactly the events it was built from, and small per event."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_helpers import NumberTokenizer, greedy, make_llm
from kvscope.config import EngineConfig
from kvscope.engine.hooks import BLOCK_EVENTS, BlockEvent, BlockEvents
from kvscope.engine.llm_engine import LLMEngine
from kvscope.runner.null_executor import NullExecutor
from kvscope.sampling_params import SamplingParams
from kvscope.trace.event_log import COLUMNS, EventLog, RequestIds, num_events

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
from bench_trace_scale import deep_sizeof  # noqa: E402

VOCAB = 320


def _prompts(n: int, seed: int = 3) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(3, VOCAB) for _ in range(24)]
    return [system[: rng.randrange(0, 24)] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(4, 40))]
            for _ in range(n)]


def _edge_events() -> list[BlockEvent]:
    """Every kind, missing request ids and hashes, and the extremes of each packed field."""
    return [
        BlockEvent(kind, block, rid, ref, h, step)
        for kind, block, rid, ref, h, step in zip(
            BLOCK_EVENTS, (0, 2**31 - 1, 5, 6, 7, 8), ("a", None, "a", "b", None, "c"),
            (1, 0, 3, 2**31 - 1, 0, 1), (None, 0, 2**63 - 1, None, None, 123456789), (0, 1, 2**31 - 1, 3, 4, 5),
        )
    ]


def test_packed_log_equals_the_events_it_was_built_from():
    llm = make_llm(block_size=4, num_kv_blocks=24, max_num_batched_tokens=32, enable_prefix_caching=True)
    events: list[BlockEvent] = []
    with llm.llm_engine.hooks.add_block_sink(events):
        llm.generate(_prompts(12), [greedy(8)] * 12, use_tqdm=False)
        llm.reset_prefix_cache()  # evictions: events without a request id or hash
    events += _edge_events()
    assert {e.event for e in events} == set(BLOCK_EVENTS)
    assert any(e.request_id is None for e in events) and any(e.block_hash is None for e in events)

    requests = RequestIds()
    log = EventLog.pack(events, requests)
    assert len(log) == len(events) and list(log) == events
    assert all(log[i] == events[i] for i in (0, len(events) // 2, -1))
    assert list(log[5:-7]) == events[5:-7]
    again = EventLog.pack(events[::-1], requests)  # a second log on the same table reuses its indices
    assert list(again) == events[::-1] and len(requests.names) == len({e.request_id for e in events} - {None})
    assert list(EventLog.pack([], requests)) == []
    rebuilt = EventLog.from_columns(requests, **{c: log.column(c) for c in COLUMNS})  # as a loaded trace builds it
    assert list(rebuilt) == events and rebuilt.rows.dtype == log.rows.dtype
    assert list(EventLog.pack(events[:-6], requests)[3:]) == events[3:-6]


def test_a_log_of_small_values_packs_each_field_narrow():
    """A pool's first blocks, few requests, single references, one step: one byte per field,
    the hash apart for the events that have one; a wider value widens its field only."""
    small = [BlockEvent("block.allocated", b, f"r{b % 3}", 1, None, 7) for b in range(200)]
    small += [BlockEvent("block.hashed", b, f"r{b % 3}", 1, 2**62 + b, 7) for b in range(10)]
    log = EventLog.pack(small, RequestIds())
    assert log.rows.itemsize == 5 and log.hashes.nbytes == 10 * 8 and list(log) == small
    wide = EventLog.pack(small + [small[0]._replace(block_id=70_000, engine_step=9)], RequestIds())
    assert wide.rows.dtype["block_id"].itemsize == 4 and wide.rows.itemsize == 8
    assert list(wide)[-1].block_id == 70_000


def test_block_events_cost_at_most_64_bytes_each_in_a_recorded_trace():
    """bench_trace_scale's measure (issue 15 part 6) on a CPU recording of 64 requests: what the
    block events add to the trace (its memory with them, less without them), per event; and the
    ``block_events`` table's memory per row. (Per-step data and the baseline pool come on top.)"""
    llm = make_llm(block_size=4, max_num_seqs=64, max_num_batched_tokens=512, async_scheduling=True, validate=False)
    prompts = _prompts(64, seed=11)
    with llm.record(level="blocks") as trace:
        llm.generate(prompts, [greedy(48)] * len(prompts), use_tqdm=False)
    events = trace.block_events
    with_events, torch_objects = deep_sizeof(trace)
    recorder = trace._source
    for rec in recorder.records:
        rec.block_events = None
    recorder._request_ids = None
    without, _ = deep_sizeof(trace)
    assert torch_objects == 0 and len(events) > 2000
    per_event = (with_events - without) / len(events)
    assert per_event <= 64, f"{per_event:.1f} bytes per block event over {len(events)} events"
    assert events.memory_usage(deep=True).sum() / len(events) <= 40


@pytest.mark.parametrize("field, value", [("block_id", 2**31), ("ref_count", -2**31 - 1), ("block_hash", 2**63)])
def test_a_value_beyond_its_packed_column_is_refused_not_wrapped(field, value):
    event = _edge_events()[0]._replace(**{field: value})
    with pytest.raises(OverflowError):
        EventLog.pack([event], RequestIds())


def _sink_run(reqs, block_size: int, num_blocks: int, async_scheduling: bool, abort_at: int | None,
              hooked: bool) -> tuple[list, list, list]:
    """One NullExecutor run; what a tuple sink, a column sink and (``hooked``) a hook on every
    block event saw. A block hook makes the block manager go block by block."""
    config = EngineConfig.from_kwargs(block_size=block_size, max_num_seqs=4, max_num_batched_tokens=64,
                                      async_scheduling=async_scheduling)
    engine = LLMEngine(config, NullExecutor(num_blocks, 64, block_size, eos_every=23), NumberTokenizer(),
                       max_model_len=256, eos_token_ids=[0])
    engine.validate_every_step = True
    tuples: list[BlockEvent] = []
    columns: list = []
    called: list[BlockEvent] = []
    engine.hooks.add_block_sink(tuples)
    engine.hooks.add_block_sink(columns, columns=True)
    for kind in BLOCK_EVENTS if hooked else ():
        engine.hooks.add(kind, lambda kind=kind, **e: called.append(BlockEvent(
            kind, e["block_id"], e["request_id"], e["ref_count"], e["block_hash"], e["step"])))
    ids = [engine.add_request(p, SamplingParams(max_tokens=m, temperature=0)) for p, m in reqs]
    n = 0
    while engine.has_unfinished_requests():
        n += 1
        if n == abort_at:
            engine.abort_request(ids[len(ids) // 2])
        engine.step()
        assert n < 2000
    engine.reset_prefix_cache()
    return tuples, columns, called


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(st.tuples(st.lists(st.integers(1, 3), min_size=1, max_size=24), st.integers(1, 24)),
                  min_size=1, max_size=8),
    block_size=st.sampled_from([1, 2, 4]),
    spare_blocks=st.integers(0, 12),
    async_scheduling=st.booleans(),
    abort_at=st.one_of(st.none(), st.integers(1, 20)),
)
def test_a_sink_sees_the_same_events_however_they_are_delivered(reqs, block_size, spare_blocks, async_scheduling,
                                                                abort_at):
    """The block manager hands a block sink its batches whole (``BlockEvents``) and a block hook
    each event as it happens, going block by block. Both must give the same events in the same
    order: a column sink's batches expanded, and packed, equal a tuple sink's events, and those
    equal the run's with a hook on every block event, whose calls equal them too. Prompts of
    few distinct tokens in a small pool give prefix hits, evictions and preemptions."""
    longest = max(len(p) + m for p, m in reqs)
    kw = dict(reqs=reqs, block_size=block_size, num_blocks=-(-longest // block_size) + spare_blocks,
              async_scheduling=async_scheduling, abort_at=abort_at)
    tuples, columns, _ = _sink_run(hooked=False, **kw)
    expanded = [e for item in columns for e in (item.expand() if isinstance(item, BlockEvents) else [item])]
    assert expanded == tuples
    assert list(EventLog.pack(columns, RequestIds())) == tuples
    assert num_events(columns) == len(tuples)
    hooked_tuples, hooked_columns, called = _sink_run(hooked=True, **kw)
    assert hooked_tuples == tuples and called == tuples
    batches = set().union(*(item.kinds() for item in columns if isinstance(item, BlockEvents)))
    if any(e.event == "block.allocated" for e in tuples):  # (the first takes fresh blocks: a batch)
        assert "block.allocated" in batches
    assert set().union(*(item.kinds() for item in hooked_columns if isinstance(item, BlockEvents))) <= {"block.freed"}
