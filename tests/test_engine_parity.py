"""Greedy token-for-token parity with transformers ``generate`` on tiny random checkpoints."""
from __future__ import annotations

import random

import pytest
import torch

from engine_helpers import greedy, make_llm, token_ids
from tiny_models import load_hf_model, tiny_checkpoint

MAX_NEW = 32


def _prompts(seed: int, vocab: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (5, 17, 33, 64)]


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=2,
        )
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch,tie", [("qwen3", False), ("qwen3", True), ("qwen2", False), ("llama", False)])
def test_greedy_matches_transformers_generate(arch, tie):
    llm = make_llm(arch, tie, block_size=4)
    prompts = _prompts(1, llm.hf_config.vocab_size)
    ours = token_ids(llm.generate(prompts, greedy(MAX_NEW), use_tqdm=False))
    model = load_hf_model(tiny_checkpoint(arch, tie))
    model.generation_config.eos_token_id = None  # kvscope side runs with ignore_eos
    theirs = [_hf_greedy(model, p) for p in prompts]
    assert all(len(t) == MAX_NEW for t in ours)
    assert ours == theirs
