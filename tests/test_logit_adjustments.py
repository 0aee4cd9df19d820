"""vLLM's repetition, frequency and presence penalties: the logits arithmetic against
transformers' processor and the formula, and whole runs against transformers ``generate`` and a
step-by-step torch reference, under async scheduling, chunked prefill and preemption."""
from __future__ import annotations

import random

import pytest
import torch

from engine_helpers import bias_logits, greedy, make_llm, token_ids
from kvscope import SamplingParams
from kvscope.runner.sampler import Sampler, apply_penalties
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


def _hf_reference(model, prompt: list[int], params: SamplingParams, bias: dict[int, float] = {}) -> list[int]:
    """Greedy tokens with the penalties applied to transformers' logits (plus ``bias``) one
    step at a time."""
    ids = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(MAX_NEW):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            for token, b in bias.items():
                logits[token] += b
            seen = torch.zeros_like(logits, dtype=torch.bool)
            seen[ids] = True
            logits = torch.where(seen, torch.where(logits > 0, logits / params.repetition_penalty,
                                                   logits * params.repetition_penalty), logits)
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).float()
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
    assert ours == [_hf_reference(model, p, r) for p, r in zip(prompts, rows)]


@pytest.mark.parametrize("config", CONFIGS, ids=["sync", "async", "chunked", "preempting"])
def test_penalties_count_the_newest_token_and_the_prompt(config):
    """A token the model favours by far (biased) repeats until the penalties of its own
    repetitions outweigh the bias: each count, the newest included (under async scheduling still
    on the device), moves the step where it stops; a prompt holding it starts it penalized."""
    bias = {5: 6.0}
    llm = make_llm(block_size=4, **config)
    bias_logits(llm, bias)
    prompts = [[9, 10, 11], [5, 9, 5, 10, 5], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [5, 6, 5, 6, 5, 6]]
    rows = [greedy(MAX_NEW, frequency_penalty=0.7), greedy(MAX_NEW, repetition_penalty=2.0),
            greedy(MAX_NEW, frequency_penalty=0.4, presence_penalty=0.5), greedy(MAX_NEW, repetition_penalty=1.5,
                                                                              frequency_penalty=0.3)]
    ours = token_ids(llm.generate(prompts, rows, use_tqdm=False))
    model = load_hf_model(tiny_checkpoint("qwen3"))
    assert ours == [_hf_reference(model, p, r, bias) for p, r in zip(prompts, rows)]
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
    (dict(repetition_penalty=2.5), "repetition_penalty"), (dict(repetition_penalty=True), "repetition_penalty"),
])
def test_penalties_out_of_vllm_s_ranges_are_refused_by_name(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SamplingParams(**kwargs)
