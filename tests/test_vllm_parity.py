"""Calls that mean one thing in vLLM mean the same here: each test names the vLLM behaviour it
matches (file and function in vllm-project/vllm) and runs it through a real engine."""
from __future__ import annotations

import pytest

from engine_helpers import make_llm, token_ids
from kvscope import SamplingParams

PROMPT = [5, 6, 7, 8, 9]


def near_tie(llm) -> tuple[int, int, float]:
    """The likeliest two first tokens after ``PROMPT`` and the bias that makes the second as
    likely as the first."""
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1, logprobs=2), use_tqdm=False)
    (a, la), (b, lb) = sorted(out[0].outputs[0].logprobs[0].items(), key=lambda kv: -kv[1])[:2]
    return a, b, float(la - lb)


def test_a_temperature_above_0_and_under_0_01_samples_at_0_01():
    """vLLM's ``SamplingParams.__post_init__`` (vllm/sampling_params.py) raises a temperature in
    (0, _MAX_TEMP=0.01) to 0.01, with a warning, so such a request samples; kvscope took one under
    1e-5 for greedy and divided by any other as given. Two tokens made as likely as each other:
    greedy always picks one, a draw at 0.01 picks either."""
    llm = make_llm()
    a, b, gap = near_tie(llm)
    with pytest.warns(UserWarning, match=r"temperature=1e-06 is under 0\.01"):
        tiny = SamplingParams(temperature=1e-6, max_tokens=1, allowed_token_ids=[a, b], logit_bias={b: gap})
    assert tiny.temperature == 0.01
    seen = []
    llm.hooks.add("request.added", lambda **e: seen.append(e["params"].temperature))
    with pytest.warns(UserWarning):
        rows = [SamplingParams(temperature=1e-6, seed=seed, max_tokens=1, allowed_token_ids=[a, b],
                               logit_bias={b: gap}) for seed in range(16)]
    drawn = token_ids(llm.generate([PROMPT] * 16, rows, use_tqdm=False))
    assert seen == [0.01] * 16
    at_001 = [SamplingParams(temperature=0.01, seed=seed, max_tokens=1, allowed_token_ids=[a, b],
                             logit_bias={b: gap}) for seed in range(16)]
    assert drawn == token_ids(llm.generate([PROMPT] * 16, at_001, use_tqdm=False))
    assert {t for [t] in drawn} == {a, b}
