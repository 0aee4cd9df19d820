"""Builds real engines on tiny checkpoints for tests, with the invariant validator switched on."""
from __future__ import annotations

from typing import Any

from kvscope import LLM, SamplingParams
from tiny_models import tiny_checkpoint


def make_llm(arch: str = "qwen3", tie: bool = False, validate: bool = True, **config: Any) -> LLM:
    config.setdefault("device", "cpu")
    config.setdefault("dtype", "float32")
    llm = LLM(str(tiny_checkpoint(arch, tie)), **config)
    llm.llm_engine.validate_every_step = validate
    return llm


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]
