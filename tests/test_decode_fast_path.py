"""The scheduler's steady-state decode path skips the block manager between block boundaries
and hashes a request's blocks only when one fills. Nothing may be skipped that the full
path would have done: after every synchronous step each running request's table covers its
computed tokens (the validator) and every full, computed block is in the prefix cache, so a
later request with the same tokens finds all of them."""
from __future__ import annotations

import random

import pytest

from kvscope.config import EngineConfig
from kvscope.engine.llm_engine import LLMEngine
from kvscope.runner.null_executor import NullExecutor
from kvscope.sampling_params import SamplingParams


class _NoText:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return ""


@pytest.mark.parametrize("block_size,budget", [(1, 7), (4, 13), (16, 64)])
def test_every_full_computed_block_is_hashed_after_each_step(block_size, budget):
    rng = random.Random(block_size)
    config = EngineConfig.from_kwargs(block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=6)
    engine = LLMEngine(config, NullExecutor(4096, 500, block_size), _NoText(), max_model_len=256)
    engine.validate_every_step = True
    prompts = [[rng.randrange(1, 500) for _ in range(rng.randrange(1, 40))] for _ in range(10)]
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=rng.randrange(1, 30), ignore_eos=True))
    outputs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outputs[o.request_id] = o
        for req in engine.scheduler.running:
            full = min(req.num_computed_tokens, req.num_tokens) // block_size
            assert req.num_hashed_blocks == full, (req.request_id, req.num_hashed_blocks, full)
    # Every finished sequence's full blocks stayed cached: its whole text comes back as a hit.
    for rid, o in outputs.items():
        tokens = o.prompt_token_ids + o.outputs[0].token_ids[:-1]  # the last token never got K/V
        again = engine.add_request(tokens + [1], SamplingParams(max_tokens=1))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == again:
                    assert out.metrics.num_cached_tokens == len(tokens) // block_size * block_size, rid
