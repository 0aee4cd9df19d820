"""``SamplingParams.prompt_logprobs``: every prompt token's log-prob given the tokens before it,
and the top-k there, against transformers' log-softmax over the same prompt; chunked, async,
preempted, from a prompt whose blocks are cached, streamed, with n > 1, and at TP=2."""
from __future__ import annotations

import random

import pytest
import torch

from engine_helpers import drain, greedy, make_llm
from kvscope import SamplingParams
from tiny_models import load_hf_model, tiny_checkpoint

CONFIGS = {
    "sync": dict(),
    "async": dict(async_scheduling=True),
    "chunked": dict(max_num_batched_tokens=8),
    "preempting": dict(num_kv_blocks=14, max_num_seqs=4, max_num_batched_tokens=16, async_scheduling=True),
    "sliced": dict(max_num_seqs=2),  # (the LM head takes a prompt's positions two rows at a time)
}


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 320) for _ in range(n)] for n in (2, 7, 19, 30)]


@pytest.fixture(scope="module")
def truth():
    """transformers' log-softmax at every position of each prompt (row i predicts token i + 1)."""
    model = load_hf_model(tiny_checkpoint("qwen3"))

    def of(prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    return of


def check(out, prompt: list[int], k: int, lp: torch.Tensor) -> None:
    got = out.prompt_logprobs
    assert got is not None and len(got) == len(prompt) and got[0] is None
    for i in range(1, len(prompt)):
        entry, want = got[i], lp[i - 1]
        assert entry[prompt[i]] == pytest.approx(want[prompt[i]].item(), abs=1e-4), i
        top = want.topk(k)
        assert set(entry) == set(top.indices.tolist()) | {prompt[i]}, i
        for token, value in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[token] == pytest.approx(value, abs=1e-4)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_prompt_logprobs_are_transformers_log_softmax(config, truth):
    llm = make_llm(block_size=4, **CONFIGS[config])
    prompts = _prompts()
    params = [greedy(6, prompt_logprobs=k) for k in (0, 3, 1, 5)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out, prompt, p in zip(outs, prompts, params):
        check(out, prompt, p.prompt_logprobs, truth(prompt))
    plain = llm.generate(prompts, greedy(6), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    assert all(o.prompt_logprobs is None for o in plain)
    if config == "preempting":
        assert any(o.metrics.num_preemptions for o in outs), "the pool was meant to force preemption"


def test_a_cached_prompt_is_computed_again_for_its_logprobs(truth):
    """The prefix cache holds the prompt's blocks, but cached blocks give no logits: the request
    asking for prompt log-probs computes its whole prompt; one that does not still hits."""
    llm = make_llm(block_size=4, enable_prefix_caching=True)
    prompt = _prompts()[3]
    first = llm.generate([prompt], greedy(2), use_tqdm=False)[0]
    again = llm.generate([prompt], greedy(2, prompt_logprobs=2), use_tqdm=False)[0]
    third = llm.generate([prompt], greedy(2), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 0 and third.num_cached_tokens > 0
    check(again, prompt, 2, truth(prompt))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_streamed_outputs_carry_them_once_the_prompt_is_done(async_scheduling, truth):
    llm = make_llm(block_size=4, max_num_batched_tokens=8, async_scheduling=async_scheduling)
    prompt = _prompts()[2]
    rid = llm.add_request(prompt, greedy(4, prompt_logprobs=1))
    seen = []
    while llm.has_unfinished_requests():
        seen += [o for o in llm.step() if o.request_id == rid]
    assert seen and all(o.prompt_logprobs is not None for o in seen)  # (every output comes after the prompt)
    check(seen[-1], prompt, 1, truth(prompt))


def test_each_output_of_a_parallel_sampled_request_has_them(truth):
    llm = make_llm(block_size=4)
    prompt = _prompts()[1]
    out = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=3, prompt_logprobs=2),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 3
    check(out, prompt, 2, truth(prompt))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_they_match_single_rank_at_tensor_parallel_2(async_scheduling):
    config = dict(block_size=4, num_kv_blocks=32, max_num_batched_tokens=8, max_num_seqs=3)  # (slices of 3)
    prompts = _prompts()
    params = [greedy(5, prompt_logprobs=2), greedy(5), greedy(5, prompt_logprobs=0), greedy(5)]
    single = make_llm(**config).generate(prompts, params, use_tqdm=False)
    with make_llm(tensor_parallel_size=2, async_scheduling=async_scheduling, **config) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    for ours, theirs in zip(outs, single):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        assert (ours.prompt_logprobs is None) == (theirs.prompt_logprobs is None)
        for a, b in zip(ours.prompt_logprobs or [], theirs.prompt_logprobs or []):
            assert (a is None and b is None) or (a.keys() == b.keys() and
                                                 all(a[t] == pytest.approx(b[t], abs=1e-4) for t in a))


@pytest.mark.parametrize("value, error", [(-2, "prompt_logprobs must be an integer >= 0"),
                                          (1.5, "prompt_logprobs must be an integer >= 0"),
                                          (False, "prompt_logprobs must be an integer >= 0")])
def test_bad_values_are_refused_by_name(value, error):
    with pytest.raises(ValueError, match=error):
        SamplingParams(prompt_logprobs=value)


def test_more_than_the_vocabulary_is_refused_and_the_engine_serves_on():
    llm = make_llm(block_size=4, max_logprobs=-1)
    with pytest.raises(ValueError, match=r"prompt_logprobs=321 exceeds the vocabulary size \(320\)"):
        llm.add_request([5, 6, 7], greedy(2, prompt_logprobs=321))
    rid = llm.add_request([5, 6, 7], greedy(2, prompt_logprobs=320))
    assert len(drain(llm)[rid].prompt_logprobs[1]) == 320
