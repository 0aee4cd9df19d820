"""In-batch prefix sharing at admission: prompts that share full blocks, arriving together,
compute each shared block once.

A waiting request whose next uncached block is one this step already computes is admitted a
step later, from the prefix cache. The truth each test checks against is independent of the
scheduler: greedy tokens of the same prompts with prefix caching off, and the longest prefix of
full blocks each prompt shares with an earlier one, read off the token lists.
"""
from __future__ import annotations

import random

import pytest

from engine_helpers import greedy, make_llm, token_ids

VOCAB = 320
BLOCK = 4


def _prompts() -> list[list[int]]:
    """Three levels of sharing: a system prompt for all, a question for some, exact repeats."""
    rng = random.Random(3)
    system = [rng.randrange(3, VOCAB) for _ in range(10)]
    questions = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(5, 14))] for _ in range(3)]
    prompts = []
    for i in range(12):
        tail = [rng.randrange(3, VOCAB) for _ in range(i % 3)]  # some repeats are exact
        prompts.append(system + questions[i % 3] + tail)
    return prompts


def _shared_full_blocks(prompt: list[int], earlier: list[list[int]]) -> int:
    """Full blocks of ``prompt`` an earlier prompt starts with too (never the block of its last
    token: that one is always computed)."""
    best = 0
    for other in earlier:
        n = 0
        while n < len(prompt) and n < len(other) and prompt[n] == other[n]:
            n += 1
        best = max(best, n // BLOCK)
    return min(best, (len(prompt) - 1) // BLOCK)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_each_shared_block_is_computed_once_and_tokens_do_not_change(async_scheduling: bool) -> None:
    prompts = _prompts()
    expected = [_shared_full_blocks(p, prompts[:i]) * BLOCK for i, p in enumerate(prompts)]
    assert sum(expected) > 0
    plain = make_llm(block_size=BLOCK, enable_prefix_caching=False)
    want = token_ids(plain.generate(prompts, greedy(6), use_tqdm=False))
    llm = make_llm(block_size=BLOCK, async_scheduling=async_scheduling)  # validates the invariants every step
    outs = llm.generate(prompts, greedy(6), use_tqdm=False)
    assert [o.metrics.num_cached_tokens for o in outs] == expected
    assert token_ids(outs) == want


@pytest.mark.parametrize("config", [dict(max_num_batched_tokens=7), dict(scheduling_policy="prefill_first"),
                                    dict(num_kv_blocks=24, max_num_batched_tokens=16)])
def test_tokens_do_not_change_under_chunking_another_policy_or_preemption(config: dict) -> None:
    prompts = _prompts()
    plain = make_llm(block_size=BLOCK, enable_prefix_caching=False)
    want = token_ids(plain.generate(prompts, greedy(6), use_tqdm=False))
    llm = make_llm(block_size=BLOCK, **config)
    assert token_ids(llm.generate(prompts, greedy(6), use_tqdm=False)) == want


def _running_after_first_step(prompts: list[list[int]], **config) -> int:
    llm = make_llm(block_size=BLOCK, **config)
    engine = llm.llm_engine
    for p in prompts:
        engine.add_request({"prompt_token_ids": p}, greedy(4))
    engine.step()
    return len(engine.scheduler.running)


def test_only_requests_that_share_a_block_wait() -> None:
    rng = random.Random(5)
    distinct = [[rng.randrange(3, VOCAB) for _ in range(9)] for _ in range(5)]
    assert _running_after_first_step(distinct) == 5
    shared = _prompts()[:3]  # all three start with the same full block
    assert _running_after_first_step(shared) == 1
    assert _running_after_first_step(shared, enable_prefix_caching=False) == 3
    assert _running_after_first_step(shared, async_scheduling=True) == 1
