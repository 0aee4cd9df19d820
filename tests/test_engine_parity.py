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


DEMO_PROMPTS = [
    "Help on topic assert:\n\n",
    "Help on method str.split in module builtins:\n\nsplit(self, /, sep=None, maxsplit=-1)\n\n",
    "Help on function join in module posixpath:\n\njoin(a, *p)\n\n",
    "Help on class Thread in module threading:\n\nclass Thread\n\n",
]


def test_bundled_model_greedy_matches_transformers():
    """LLM() loads the bundled model; its greedy outputs (EOS included) equal transformers'."""
    from kvscope import LLM, SamplingParams
    from kvscope.model_source import BUNDLED_MODEL
    from transformers import AutoModelForCausalLM, AutoTokenizer

    llm = LLM(device="cpu", block_size=8)
    assert llm.model_dir == str(BUNDLED_MODEL)
    llm.llm_engine.validate_every_step = True
    outs = llm.generate(DEMO_PROMPTS, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    tok = AutoTokenizer.from_pretrained(BUNDLED_MODEL)
    hf = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL, dtype=torch.float32).eval()
    for prompt, out in zip(DEMO_PROMPTS, outs):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert out.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48,
                              do_sample=False, pad_token_id=tok.pad_token_id)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist()
        # (a character the last tokens leave unfinished is held back, as vLLM's detokenizers do)
        assert out.outputs[0].text == tok.decode(ref[0, ids.shape[1]:], skip_special_tokens=True).rstrip("\ufffd")
    assert sum(o.outputs[0].finish_reason == "stop" for o in outs) >= len(outs) // 2
