"""vLLM's logit adjustments: allowed_token_ids, logit_bias, and the repetition, frequency and
presence penalties. The penalties' arithmetic against transformers' processor and the formula;
whole runs against transformers ``generate`` and a step-by-step torch reference, under async
scheduling, chunked prefill and preemption; draws against the adjusted distribution."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from engine_helpers import bias_logits, greedy, make_llm, token_ids
from kvscope import SamplingParams
from kvscope.runner.logit_adjustments import Adjustments, apply_penalties
from kvscope.runner.sampler import Sampler
from tiny_models import load_hf_model, tiny_checkpoint

MAX_NEW = 24
CONFIGS = [
    dict(),
    dict(async_scheduling=True),
    dict(max_num_batched_tokens=8),  # prompts prefilled in chunks
    dict(num_kv_blocks=14, max_num_seqs=4, async_scheduling=True),  # preemption by recompute
]


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (3, 9, 20)] + [[5, 6, 5, 6, 5, 6]]


def test_repetition_penalty_is_transformers_processor_and_the_others_the_formula():
    from transformers import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 40, generator=gen) * 4
    prompts, outputs = [[1, 2, 2, 9], [], [30]], [[9, 9, 9, 4], [0, 39], []]
    prompt_mask = torch.zeros(3, 40, dtype=torch.bool)
    counts = torch.zeros(3, 40)
    for i in range(3):
        prompt_mask[i, prompts[i]] = True
        for t in outputs[i]:
            counts[i, t] += 1
    repetition, frequency = torch.tensor([1.3, 0.7, 2.0]), torch.tensor([0.5, -1.0, 2.0])
    presence = torch.tensor([0.25, 1.5, -2.0])
    got = apply_penalties(logits, prompt_mask, counts, repetition, frequency, presence)
    for i in range(3):
        seen = torch.tensor([prompts[i] + outputs[i] or [0]])
        want = logits[i:i + 1].clone() if not prompts[i] + outputs[i] else \
            RepetitionPenaltyLogitsProcessor(float(repetition[i]))(seen, logits[i:i + 1].clone())
        want = want[0] - frequency[i] * counts[i] - presence[i] * (counts[i] > 0).float()
        torch.testing.assert_close(got[i], want)
    torch.testing.assert_close(apply_penalties(logits, prompt_mask, counts, torch.ones(3), torch.zeros(3),
                                               torch.zeros(3)), logits)


def reference_tokens(model, prompt: list[int], params: SamplingParams, bias: dict[int, float] = {},
                     max_new: int = MAX_NEW) -> list[int]:
    """Greedy tokens with ``params``' allowed tokens, logit bias and penalties applied to
    transformers' logits (plus ``bias``, part of the model here) one step at a time, on the
    model's device."""
    ids = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(torch.tensor([ids], device=model.device)).logits[0, -1].float()
            for token, b in bias.items():
                logits[token] += b
            if params.allowed_token_ids is not None:
                logits[[t for t in range(logits.numel()) if t not in params.allowed_token_ids]] = float("-inf")
            for token, b in (params.logit_bias or {}).items():
                logits[token] += b
            seen = torch.zeros_like(logits, dtype=torch.bool)
            seen[ids] = True
            logits = torch.where(seen, torch.where(logits > 0, logits / params.repetition_penalty,
                                                   logits * params.repetition_penalty), logits)
            counts = torch.bincount(torch.tensor(out, dtype=torch.long, device=model.device),
                                    minlength=logits.numel()).float()
            logits = logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).float()
            out.append(int(logits.argmax()))
            ids.append(out[-1])
    return out


@pytest.mark.parametrize("config", CONFIGS, ids=["sync", "async", "chunked", "preempting"])
def test_greedy_with_a_repetition_penalty_matches_transformers_generate(config):
    llm = make_llm(block_size=4, **config)
    prompts = _prompts(llm.hf_config.vocab_size)
    ours = token_ids(llm.generate(prompts, greedy(MAX_NEW, repetition_penalty=1.8), use_tqdm=False))
    model = load_hf_model(tiny_checkpoint("qwen3"))
    with torch.no_grad():
        theirs = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=MAX_NEW, do_sample=False, repetition_penalty=1.8, pad_token_id=2,
                                 eos_token_id=None)[0, len(p):].tolist() for p in prompts]
    assert ours == theirs
    plain = token_ids(llm.generate(prompts, greedy(MAX_NEW), use_tqdm=False))
    assert plain != ours  # (the penalty changed something the test can see)


@pytest.mark.parametrize("config", CONFIGS, ids=["sync", "async", "chunked", "preempting"])
def test_greedy_with_frequency_and_presence_penalties_matches_a_torch_reference(config):
    llm = make_llm(block_size=4, **config)
    prompts = _prompts(llm.hf_config.vocab_size)
    model = load_hf_model(tiny_checkpoint("qwen3"))
    rows = [greedy(MAX_NEW, frequency_penalty=1.5), greedy(MAX_NEW, presence_penalty=2.0),
            greedy(MAX_NEW, frequency_penalty=-0.5, presence_penalty=1.0, repetition_penalty=1.2), greedy(MAX_NEW)]
    ours = token_ids(llm.generate(prompts, rows, use_tqdm=False))
    assert ours == [reference_tokens(model, p, r) for p, r in zip(prompts, rows)]


@pytest.mark.parametrize("config", CONFIGS, ids=["sync", "async", "chunked", "preempting"])
def test_penalties_count_the_newest_token_and_the_prompt(config):
    """A token the model favours by far (biased) repeats until the penalties of its own
    repetitions outweigh the bias: each count, the newest included (under async scheduling still
    on the device), moves the step where it stops; a prompt holding it starts it penalized.
    (The penalty kernel's path: test_penalty_kernels.py, under Triton's interpreter.)"""
    check_penalties_count_the_newest_token_and_the_prompt(make_llm(block_size=4, **config))


def check_penalties_count_the_newest_token_and_the_prompt(llm) -> None:
    bias = {5: 6.0}
    bias_logits(llm, bias)
    prompts = [[9, 10, 11], [5, 9, 5, 10, 5], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [5, 6, 5, 6, 5, 6]]
    rows = [greedy(MAX_NEW, frequency_penalty=0.7), greedy(MAX_NEW, repetition_penalty=2.0),
            greedy(MAX_NEW, frequency_penalty=0.4, presence_penalty=0.5), greedy(MAX_NEW, repetition_penalty=1.5,
                                                                              frequency_penalty=0.3)]
    ours = token_ids(llm.generate(prompts, rows, use_tqdm=False))
    model = load_hf_model(tiny_checkpoint("qwen3"))
    assert ours == [reference_tokens(model, p, r, bias) for p, r in zip(prompts, rows)]
    assert all(t.count(5) > 1 for t in ours[::2])  # (it did repeat before stopping)


def test_a_penalized_row_leaves_its_neighbours_tokens_as_they_are():
    """Seeded and greedy rows beside a penalized one draw what they draw without it."""
    llm = make_llm(block_size=4, async_scheduling=True)
    prompts = _prompts(llm.hf_config.vocab_size)
    others = [SamplingParams(temperature=0.9, seed=3, max_tokens=12, ignore_eos=True), greedy(12),
              SamplingParams(temperature=0.7, top_k=5, seed=4, max_tokens=12, ignore_eos=True)]
    alone = token_ids(llm.generate(prompts[:3], others, use_tqdm=False))
    beside = token_ids(llm.generate(prompts, others + [greedy(12, presence_penalty=2.0)], use_tqdm=False))
    assert beside[:3] == alone


def test_penalties_without_a_history_leave_the_logits_as_they_are():
    """A sampler called with no histories (start-up's memory probe) applies nothing."""
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(1))
    params = [greedy(1, repetition_penalty=2.0, frequency_penalty=2.0, presence_penalty=2.0)] * 4
    tokens = Sampler(0, torch.device("cpu")).sample(logits, params, [0] * 4).to_output().tokens
    assert tokens == logits.argmax(-1).tolist()


@pytest.mark.parametrize("kwargs, name", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"), (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"), (dict(repetition_penalty=True), "repetition_penalty"),
    (dict(repetition_penalty=1e39), "repetition_penalty"),
])
def test_penalties_out_of_vllm_s_ranges_are_refused_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("config", CONFIGS, ids=["sync", "async", "chunked", "preempting"])
def test_allowed_tokens_and_logit_bias_match_a_torch_reference(config):
    """In vLLM's order: tokens outside the allowed set dropped, then the bias added, then the
    penalties; greedy rows obey them too."""
    llm = make_llm(block_size=4, **config)
    prompts = _prompts(llm.hf_config.vocab_size)
    model = load_hf_model(tiny_checkpoint("qwen3"))
    plain = token_ids(llm.generate(prompts, greedy(MAX_NEW), use_tqdm=False))
    favoured = {plain[0][3]: -50.0, 77: 4.0, 78: 2.5}
    rows = [greedy(MAX_NEW, logit_bias=favoured), greedy(MAX_NEW, allowed_token_ids=[9, 77, 150, 301]),
            greedy(MAX_NEW, allowed_token_ids=[9, 77, 150], logit_bias={150: 1.0}, repetition_penalty=1.9),
            greedy(MAX_NEW)]
    ours = token_ids(llm.generate(prompts, rows, use_tqdm=False))
    assert ours == [reference_tokens(model, p, r) for p, r in zip(prompts, rows)]
    assert ours[3] == plain[3] and ours[0] != plain[0] and set(ours[1]) <= {9, 77, 150, 301}


PROBS = torch.tensor([0.05, 0.5, 0.15, 0.3])


ADJUSTED = [
    (SamplingParams(temperature=1.0, allowed_token_ids=[1, 3]), torch.tensor([0, 0.5, 0, 0.3]) / 0.8),
    (SamplingParams(temperature=1.0, logit_bias={0: math.log(10.0)}), torch.tensor([0.5, 0.5, 0.15, 0.3]) / 1.45),
    (SamplingParams(temperature=1.0, allowed_token_ids=[0, 2], logit_bias={0: math.log(3.0)}),
     torch.tensor([0.15, 0, 0.15, 0]) / 0.3),
]


def check_draws_follow_the_adjusted_distribution(sampler: Sampler, n: int, atol: float) -> None:
    """``n`` draws of each of ``ADJUSTED`` on a known distribution: never a dropped token, and
    frequencies within ``atol`` of the adjusted distribution."""
    for params, expected in ADJUSTED:
        tokens = sampler.sample(PROBS.log().repeat(n, 1), [params] * n, [0] * n).to_output().tokens
        freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / n
        assert (freq[expected == 0] == 0).all(), params
        assert torch.allclose(freq, expected, atol=atol), (params, freq, expected)


def test_draws_follow_the_adjusted_distribution():
    """(The kernels' path: test_sampling_kernels.py, under Triton's interpreter.)"""
    check_draws_follow_the_adjusted_distribution(Sampler(0, torch.device("cpu")), 40_000, 0.0125)


@pytest.mark.parametrize("kwargs, error", [
    (dict(logit_bias=[1, 2]), "logit_bias must be a dict"),
    (dict(logit_bias={"12": 1.0}), "logit_bias keys must be non-negative token ids"),
    (dict(logit_bias={-1: 1.0}), "logit_bias keys must be non-negative token ids"),
    (dict(logit_bias={5: float("-inf")}), "logit_bias values must be finite"),
    (dict(logit_bias={5: 1e39}), "logit_bias values must be finite"),
    (dict(allowed_token_ids=[]), "allowed_token_ids must be a non-empty list"),
    (dict(allowed_token_ids=[3, -1]), "allowed_token_ids must be a non-empty list"),
    (dict(allowed_token_ids=[True]), "allowed_token_ids must be a non-empty list"),
    (dict(allowed_token_ids={3, 4}), "allowed_token_ids must be one int or a list"),
])
def test_bad_biases_and_allowed_tokens_are_refused_by_name(kwargs, error):
    with pytest.raises(ValueError, match=error):
        SamplingParams(**kwargs)


def test_tokens_outside_the_vocabulary_or_nothing_left_to_draw_are_refused_at_add_request():
    llm = make_llm(block_size=4)
    for params, error in [(greedy(2, allowed_token_ids=[3, 320]), r"allowed_token_ids contains 320, outside"),
                          (greedy(2, logit_bias={400: 1.0}), r"logit_bias contains 400, outside"),
                          (SamplingParams(max_tokens=3, min_tokens=2, allowed_token_ids=[0, 7], stop_token_ids=[7]),
                           "cover every token of allowed_token_ids")]:
        with pytest.raises(ValueError, match=error):
            llm.add_request([5, 6, 7], params)
    assert not llm.has_unfinished_requests()
    numpy = SamplingParams(max_tokens=2, temperature=0, allowed_token_ids=np.array([7, 9]).tolist(),
                           logit_bias={np.int64(9): np.float32(3.0)})
    assert set(token_ids(llm.generate([[5, 6, 7]], numpy, use_tqdm=False))[0]) <= {7, 9}


def test_one_rows_allowed_tokens_upload_nothing_per_vocabulary_entry_of_the_others():
    """A batch's settings go to the device in proportion to what its rows ask for: beside a row
    with ``allowed_token_ids``, the other adjusted rows (penalized here) upload nothing per
    vocabulary entry (they used to send every token id as an allowed pair: seconds of host work
    at each change of a large batch), and the mask still lets them draw every token."""
    vocab, sent = 50_000, []

    def upload(values, dtype: torch.dtype) -> torch.Tensor:
        sent.append(len(values))
        return torch.as_tensor(values, dtype=dtype)

    params = [SamplingParams(repetition_penalty=1.1)] * 8 + [SamplingParams(allowed_token_ids=[5, 9, 11])]
    adjustments = Adjustments.of(params, vocab, torch.device("cpu"), upload)
    assert sum(sent) < 100
    assert adjustments.allowed[:8].all()
    assert adjustments.allowed[8].nonzero().squeeze(1).tolist() == [5, 9, 11]
