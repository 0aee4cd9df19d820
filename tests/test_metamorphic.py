"""Greedy outputs are a property of the model, not of how the engine schedules it.

The same workload must give identical tokens with prefix caching on or off, any chunk budget,
any block size, a pool small enough to force preemption, and either scheduling policy. The
invariant validator runs after every step of every run.
"""
from __future__ import annotations

import random

import pytest

from engine_helpers import greedy, make_llm, token_ids

VOCAB = 320


def _workload() -> tuple[list[list[int]], list]:
    rng = random.Random(7)
    system = [rng.randrange(3, VOCAB) for _ in range(21)]
    prompts = []
    for i in range(8):
        tail = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 30))]
        prompts.append((system if i % 2 == 0 else system[:9]) + tail)
    params = [greedy(rng.randrange(6, 20)) for _ in prompts]
    return prompts, params


@pytest.fixture(scope="module")
def baseline() -> list[list[int]]:
    prompts, params = _workload()
    llm = make_llm(block_size=16, enable_prefix_caching=False, max_num_batched_tokens=4096)
    return token_ids(llm.generate(prompts, params, use_tqdm=False))


VARIANTS = {
    "prefix_caching": dict(block_size=4, enable_prefix_caching=True),
    "budget_1": dict(block_size=4, max_num_batched_tokens=1),
    "budget_7": dict(block_size=4, max_num_batched_tokens=7),
    "budget_64": dict(block_size=4, max_num_batched_tokens=64),
    "block_size_1": dict(block_size=1),
    "block_size_16_cached": dict(block_size=16, enable_prefix_caching=True),
    "prefill_first": dict(block_size=4, scheduling_policy="prefill_first", max_num_batched_tokens=40),
    "prefill_first_no_chunking": dict(block_size=4, scheduling_policy="prefill_first",
                                      enable_chunked_prefill=False, max_model_len=128,
                                      max_num_batched_tokens=128),
    "max_num_seqs_2": dict(block_size=4, max_num_seqs=2),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_outputs_do_not_depend_on_engine_config(name, baseline):
    prompts, params = _workload()
    llm = make_llm(**VARIANTS[name])
    assert token_ids(llm.generate(prompts, params, use_tqdm=False)) == baseline


@pytest.mark.parametrize("policy", ["unified", "prefill_first"])
@pytest.mark.parametrize("caching", [True, False])
def test_preemption_preserves_outputs(policy, caching, baseline):
    prompts, params = _workload()
    llm = make_llm(block_size=4, num_kv_blocks=16, scheduling_policy=policy,
                   enable_prefix_caching=caching, max_num_batched_tokens=48)
    preempted = []
    llm.hooks.add("request.preempted", lambda request_id, **_: preempted.append(request_id))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert preempted, "the pool was meant to be small enough to force preemption"
    assert sum(o.metrics.num_preemptions for o in outputs) == len(preempted)
    assert token_ids(outputs) == baseline


def test_prefix_cache_hit_computes_only_the_suffix():
    llm = make_llm(block_size=4, enable_prefix_caching=True)
    rng = random.Random(3)
    shared = [rng.randrange(3, VOCAB) for _ in range(40)]
    first = llm.generate([shared + [5, 6, 7]], greedy(4), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    scheduled = []
    llm.hooks.add("step.scheduled", lambda scheduler_output, **_: scheduled.extend(scheduler_output.requests))
    second_prompt = shared + [9, 10, 11, 12, 13]
    second = llm.generate([second_prompt], greedy(4), use_tqdm=False)[0]
    assert second.num_cached_tokens == 40  # all ten full blocks of the shared prefix
    assert second.metrics.num_cached_tokens == 40
    bm = llm.llm_engine.block_manager  # vLLM's counters: tokens queried / found at admissions
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (43 + len(second_prompt), 40)
    prefill = [r for r in scheduled if r.is_prefill]
    assert sum(r.num_new_tokens for r in prefill) == len(second_prompt) - 40
    assert prefill[0].start == 40
    # and the answer is the one a cold engine gives
    cold = make_llm(block_size=4, enable_prefix_caching=False)
    assert cold.generate([second_prompt], greedy(4), use_tqdm=False)[0].outputs[0].token_ids == \
        second.outputs[0].token_ids
