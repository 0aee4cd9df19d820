"""What the prefix cache gives back, counted off the prompts and the pool's size independently
of the block manager: a hit needs the block's tokens, not only its hash; and the free pool is a
least-recently-freed queue into which a request frees its blocks last first, so when blocks
must be evicted a finished prompt loses its tail before its head, and a later request with the
same prompt still finds the head."""
from __future__ import annotations

import pytest

from engine_helpers import NumberTokenizer
from kvscope.config import EngineConfig
from kvscope.engine.llm_engine import LLMEngine
from kvscope.runner.null_executor import NullExecutor
from kvscope.sampling_params import SamplingParams

BLOCK = 4
NUM_BLOCKS = 12


def _run(engine: LLMEngine, prompt: list[int]) -> int:
    """Generate one token for ``prompt``; its prefix-cache hit in tokens."""
    rid = engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    hit = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                hit = out.num_cached_tokens
    return hit


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_eviction_takes_a_finished_prompts_tail_before_its_head(async_scheduling):
    config = EngineConfig.from_kwargs(block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=256,
                                      async_scheduling=async_scheduling)
    engine = LLMEngine(config, NullExecutor(NUM_BLOCKS, 64, BLOCK), NumberTokenizer(), max_model_len=64, eos_token_ids=[0])
    engine.validate_every_step = True
    a = [1 + i % 50 for i in range(4 * BLOCK + 1)]  # 4 full blocks + 1 token: 5 blocks, 4 cached after
    assert _run(engine, a) == 0
    # B takes every block A never touched (7), then A's partial last block, then evicts 2 more
    # of A's: with the tail freed first, those are A's blocks 3 and 2, and blocks 0-1 stay cached.
    untouched = NUM_BLOCKS - 5
    b = [51 + i % 10 for i in range((untouched + 3) * BLOCK - 2)]
    assert -(-len(b) // BLOCK) == untouched + 3
    assert _run(engine, b) == 0
    assert _run(engine, a) == 2 * BLOCK


def test_a_hash_collision_is_no_hit(monkeypatch):
    """A cached block is a hit only if its tokens are the request's, whatever the hashes say:
    with a hash that collides for every block of the same position, a different prompt of the
    same length must find nothing in the cache."""
    import kvscope.engine.block_manager as bm_module

    monkeypatch.setattr(bm_module, "hash_block", lambda tokens, prev: (prev * 31 + 7) % (1 << 62))
    config = EngineConfig.from_kwargs(block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=256)
    engine = LLMEngine(config, NullExecutor(NUM_BLOCKS, 64, BLOCK), NumberTokenizer(), max_model_len=64, eos_token_ids=[0])
    a = [1 + i % 50 for i in range(3 * BLOCK + 1)]
    assert _run(engine, a) == 0
    assert _run(engine, a) == 3 * BLOCK  # the same prompt: a real hit
    assert _run(engine, [t + 1 for t in a]) == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_reset_prefix_cache_says_whether_the_cache_is_empty(async_scheduling):
    """``reset_prefix_cache()`` returns True, as vLLM's does, only when no cached block is left:
    while a running request holds full blocks they keep their hashes (vLLM refuses the whole
    reset then; kvscope still forgets the free ones) and it returns False. The hits counted
    afterwards tell which blocks stayed cached."""
    config = EngineConfig.from_kwargs(block_size=BLOCK, max_num_seqs=4, max_num_batched_tokens=256,
                                      async_scheduling=async_scheduling)
    engine = LLMEngine(config, NullExecutor(NUM_BLOCKS, 64, BLOCK), NumberTokenizer(), max_model_len=64, eos_token_ids=[0])
    engine.validate_every_step = True
    done, live = [1 + i for i in range(2 * BLOCK + 1)], [30 + i for i in range(2 * BLOCK + 1)]
    assert _run(engine, done) == 0
    rid = engine.add_request(live, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.step()
    engine.step()  # (async scheduling: the prompt's blocks are hashed when its step is read back)
    assert engine.reset_prefix_cache() is False
    assert _run(engine, done) == 0  # the finished prompt's free blocks were forgotten
    assert _run(engine, live) == 2 * BLOCK  # the running one's kept their hashes
    engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.reset_prefix_cache() is True
    assert _run(engine, live) == 0 and _run(engine, done) == 0
