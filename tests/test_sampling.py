"""Sampling: exact masks on a known distribution, frequencies, and per-request seeds."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_helpers import make_llm
from kvscope import SamplingParams
from kvscope.runner.sampler import GREEDY_BELOW, Sampler, apply_min_p, apply_top_k_top_p, exponential_

PROBS = torch.tensor([0.05, 0.5, 0.15, 0.3])  # sorted: 1 (0.5), 3 (0.3), 2 (0.15), 0 (0.05)


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs CUDA")])


def _draw(params: SamplingParams, n: int = 40000, seed: int = 0, device: str = "cpu") -> torch.Tensor:
    """``n`` draws; on CUDA through the Triton kernels (on masked logits under top-k/top-p)."""
    sampler = Sampler(seed, torch.device(device))
    logits = PROBS.log().repeat(n, 1).to(device)
    return torch.tensor(sampler.sample(logits, [params] * n, [0] * n).to_output().tokens)


def _freq(tokens: torch.Tensor) -> torch.Tensor:
    return torch.bincount(tokens, minlength=4).float() / len(tokens)


@pytest.mark.parametrize("params,expected", [
    (SamplingParams(temperature=1.0), PROBS),
    (SamplingParams(temperature=1.0, top_k=2), torch.tensor([0, 0.5, 0, 0.3]) / 0.8),
    (SamplingParams(temperature=1.0, top_p=0.7), torch.tensor([0, 0.5, 0, 0.3]) / 0.8),
    (SamplingParams(temperature=1.0, top_p=0.81), torch.tensor([0, 0.5, 0.15, 0.3]) / 0.95),
    (SamplingParams(temperature=1.0, top_p=0.5), torch.tensor([0, 1.0, 0, 0])),
    (SamplingParams(temperature=1.0, top_k=3, top_p=0.7), torch.tensor([0, 0.5, 0, 0.3]) / 0.8),
    (SamplingParams(temperature=0.5), PROBS ** 2 / (PROBS ** 2).sum()),
    (SamplingParams(temperature=1.0, min_p=0.2), torch.tensor([0, 0.5, 0.15, 0.3]) / 0.95),
    (SamplingParams(temperature=1.0, min_p=0.5), torch.tensor([0, 0.5, 0, 0.3]) / 0.8),
    # min-p reads the distribution at the temperature: 0.15 ** 2 is under 0.2 * 0.5 ** 2
    (SamplingParams(temperature=0.5, min_p=0.2), torch.tensor([0, 0.25, 0, 0.09]) / 0.34),
    # min-p before top-p (vLLM's order): top-p first would keep token 2
    (SamplingParams(temperature=1.0, min_p=0.2, top_p=0.81), torch.tensor([0, 0.5, 0, 0.3]) / 0.8),
])
@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_sampling_frequencies_match_the_truncated_distribution(params, expected, device):
    freq = _freq(_draw(params, device=device))
    assert (freq[expected == 0] == 0).all(), "a masked token was sampled"
    # 40k draws: 5 standard errors of the largest-variance cell is < 0.0125
    assert torch.allclose(freq, expected, atol=0.0125), (freq, expected)


def test_the_cpu_race_draws_are_exponential():
    """The torch path's noise against Exp(1)'s CDF: Kolmogorov-Smirnov at the 1 % level."""
    n = 200_000
    draws = exponential_(torch.empty(n), torch.Generator().manual_seed(0)).double().sort().values
    cdf = 1 - torch.exp(-draws)
    ranks = torch.arange(n + 1, dtype=torch.float64) / n
    distance = max((ranks[1:] - cdf).abs().max().item(), (cdf - ranks[:-1]).abs().max().item())
    assert distance < 1.63 / math.sqrt(n), distance


def test_top_k_top_p_mask_is_exact():
    logits = PROBS.log().repeat(3, 1)
    masked = apply_top_k_top_p(logits, torch.tensor([0, 2, 0]), torch.tensor([1.0, 1.0, 0.6]))
    keep = torch.isfinite(masked)
    assert keep.tolist() == [[True] * 4, [False, True, False, True], [False, True, False, True]]
    assert torch.equal(masked[keep], logits[keep])


def test_min_p_mask_is_transformers_min_p():
    """Row by row against transformers' MinPLogitsWarper on the same logits."""
    from transformers import MinPLogitsWarper

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    min_p = torch.tensor([0.0, 1e-3, 0.05, 0.3, 0.9, 1.0])
    masked = apply_min_p(logits, min_p)
    for i, p in enumerate(min_p.tolist()):
        truth = logits[i:i + 1] if p == 0 else MinPLogitsWarper(p)(None, logits[i:i + 1].clone())
        assert torch.isfinite(masked[i]).tolist() == torch.isfinite(truth[0]).tolist(), p
    keep = torch.isfinite(masked)
    assert torch.equal(masked[keep], logits[keep]) and keep[0].all() and 1 < keep[3].sum() < 50


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_min_p_of_one_draws_the_greedy_tokens_through_the_engine(async_scheduling):
    """min_p=1 leaves only the likeliest token of each step (random logits have no ties), so a
    hot temperature must give greedy's tokens, seeded or not."""
    llm = make_llm(block_size=4, num_kv_blocks=64, async_scheduling=async_scheduling)
    prompts = [[5, 6, 7, 8, 9], [11, 12], [40, 41, 42, 43, 44, 45, 46]]
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    hot = [SamplingParams(temperature=5.0, min_p=1.0, max_tokens=8, ignore_eos=True, seed=s) for s in (None, 1, None)]
    drawn = llm.generate(prompts, hot, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in drawn] == [o.outputs[0].token_ids for o in greedy]


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_vanishing_temperature_samples_greedily(device):
    """``logits / T`` overflows float32 for a tiny ``T``; such a row must still take the argmax
    (as vLLM does below its sampling epsilon), beside rows that really sample."""
    logits = (torch.randn(6, 50, generator=torch.Generator().manual_seed(4)) - 2).to(device)
    params = [SamplingParams(temperature=t) for t in (1e-300, 1e-6, 1.0, 1e-45, 0.0, 1e-300)]
    tokens = Sampler(0, torch.device(device)).sample(logits, params, [0] * 6).to_output().tokens
    greedy = logits.argmax(-1).tolist()
    assert [tokens[i] for i in (0, 1, 3, 4, 5)] == [greedy[i] for i in (0, 1, 3, 4, 5)]
    shared = Sampler(0, torch.device(device)).sample(logits, [params[0]] * 6, [0] * 6).to_output().tokens
    assert shared == greedy


def test_greedy_rows_ignore_noise_in_mixed_batch():
    sampler = Sampler(0, torch.device("cpu"))
    logits = PROBS.log().repeat(500, 1)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)] * 250
    toks = torch.tensor(sampler.sample(logits, params, [0] * 500).to_output().tokens)
    assert (toks[0::2] == 1).all() and len(set(toks[1::2].tolist())) > 1


def test_seeded_requests_reproduce_regardless_of_batch():
    llm = make_llm(block_size=4)
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([[7, 8, 9]], p, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)] * 3
    batch = llm.generate([[1, 2], [7, 8, 9], [4, 4, 4, 4], [3]], [others[0], p, others[1], others[2]],
                         use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, seed=4321, max_tokens=16, ignore_eos=True)
    assert llm.generate([[7, 8, 9]], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone
    # and under preemption (a pool too small for everyone at once)
    tight = make_llm(block_size=4, num_kv_blocks=8)
    outs = tight.generate([[7, 8, 9]] + [[5] * 9] * 3, [p] + others, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert outs[0].outputs[0].token_ids == alone


def test_logprob_of_sampled_token_matches_distribution():
    sampler = Sampler(0, torch.device("cpu"))
    out = sampler.sample(PROBS.log().unsqueeze(0), [SamplingParams(temperature=1.0, logprobs=2)], [0]).to_output()
    lp = out.logprobs[0]
    assert set(lp) >= {1, 3}
    assert lp[1] == pytest.approx(math.log(0.5), abs=1e-6)
    assert lp[out.tokens[0]] == pytest.approx(math.log(PROBS[out.tokens[0]].item()), abs=1e-6)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0),
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.3, top_k=5, top_p=0.9),
    SamplingParams(temperature=0.9, seed=77),
    SamplingParams(temperature=0.8, logprobs=3),
])
def test_rows_sharing_one_params_object_sample_as_rows_with_equal_copies(params):
    """All rows sharing one SamplingParams take the sampler's shared path; the same rows, each
    with its own equal copy, take the per-row path: tokens and log-probs must be identical."""
    logits = torch.randn(48, 40, generator=torch.Generator().manual_seed(3)) * 3
    index = list(range(48))
    shared = Sampler(5, torch.device("cpu")).sample(logits, [params] * 48, index).to_output()
    copies = [dataclasses.replace(params) for _ in range(48)]
    per_row = Sampler(5, torch.device("cpu")).sample(logits, copies, index).to_output()
    assert shared.tokens == per_row.tokens
    assert shared.logprobs == per_row.logprobs
    if params.temperature > 0:
        assert len(set(shared.tokens)) > 1  # really sampled, not a constant


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_a_call_on_the_last_calls_params_list_samples_as_a_fresh_one(device):
    """Steady decode hands the sampler the very params list of the last step (one token
    further), and the sampler reuses what it read from it: the same tokens and log-probs as a
    sampler given a fresh copy of the list every step, seeded rows (whose randomness follows the
    output index) included. (On CUDA the kernels' path; its CPU tier is in test_sampling_kernels.)"""
    kinds = [SamplingParams(temperature=0.8, seed=11), SamplingParams(temperature=0), SamplingParams(temperature=1.2),
             SamplingParams(temperature=0.8, seed=12, logprobs=2), SamplingParams(temperature=0.5, top_k=3)]
    params = [kinds[i % 5] for i in range(10)]
    reusing, fresh = Sampler(5, torch.device(device)), Sampler(5, torch.device(device))
    gen = torch.Generator().manual_seed(9)
    seen = []
    for step in range(4):
        logits = torch.randn(10, 40, generator=gen).to(device)
        index = [step + i for i in range(10)]
        a = reusing.sample(logits, params, index).to_output()
        b = fresh.sample(logits, list(params), list(index)).to_output()
        assert a.tokens == b.tokens and a.logprobs == b.logprobs
        seen.append(a.tokens)
    assert len({tuple(t) for t in seen}) > 1


# Valid settings at their edges, to mix in one batch: no combination may fail a step.
EDGE_VOCAB = 50
EDGE_PARAMS = st.builds(
    SamplingParams,
    temperature=st.sampled_from([0.0, 1e-300, 1e-6, 0.5, 1.0, 7.0, 1e30, 3.4028234663852886e38]),
    top_k=st.sampled_from([-1, 0, 1, 2, EDGE_VOCAB - 1, EDGE_VOCAB, EDGE_VOCAB + 1, 2**31, 2**63, 10**30]),
    top_p=st.sampled_from([5e-324, 1e-3, 0.5, 1.0]),
    seed=st.sampled_from([None, 0, -1, 2**63, -2**63, 2**64 - 1]),  # (the ends of torch's seed range)
    logprobs=st.sampled_from([None, 0, 3, EDGE_VOCAB]),
    min_p=st.sampled_from([0.0, 5e-324, 0.1, 1.0]),
    allowed_token_ids=st.sampled_from([None, [7], [0, 13, EDGE_VOCAB - 1], list(range(EDGE_VOCAB))]),
)
EDGE_BATCHES = st.lists(EDGE_PARAMS, min_size=1, max_size=6)


def check_any_valid_batch_samples(sampler: Sampler, params: list[SamplingParams], seed: int) -> None:
    """Every row of a batch of valid settings, however extreme and however mixed, gets a token
    that its settings allow, checked against the order of its logits: a greedy row their argmax,
    a top-k row one of its k largest, a row whose top-p the largest alone covers that one, a
    min-p row one at least min-p times as likely as the likeliest, all among its allowed tokens
    (with a temperature that leaves float32 room to rank them); and the log-probs it asked for."""
    raw = torch.randn(len(params), EDGE_VOCAB, generator=torch.Generator().manual_seed(seed))
    out = sampler.sample(raw, params, list(range(len(params)))).to_output()
    logits = raw.clone()  # (what a row may draw from: its allowed tokens)
    for i, p in enumerate(params):
        if p.allowed_token_ids is not None:
            logits[i, [t for t in range(EDGE_VOCAB) if t not in p.allowed_token_ids]] = float("-inf")
    ranks = logits.argsort(dim=-1, descending=True).argsort(dim=-1)
    for i, p in enumerate(params):
        token = out.tokens[i]
        assert 0 <= token < EDGE_VOCAB
        rank = int(ranks[i, token])
        if p.temperature < GREEDY_BELOW:
            assert rank == 0, (i, p)
        elif p.temperature <= 7.0:
            assert rank < (p.top_k if 0 < p.top_k < EDGE_VOCAB else EDGE_VOCAB), (i, p)
            assert p.allowed_token_ids is None or token in p.allowed_token_ids, (i, p)
            assert p.top_p > 1e-3 or rank == 0, (i, p)
            probs = (logits[i] / p.temperature).softmax(dim=-1)
            assert probs[token] >= p.min_p * probs.max() * (1 - 1e-5), (i, p)
        if p.logprobs is not None:
            assert token in out.logprobs[i] and len(out.logprobs[i]) in (p.logprobs, p.logprobs + 1), (i, p)


@settings(max_examples=80, deadline=None)
@given(EDGE_BATCHES, st.integers(0, 2**16))
def test_any_batch_of_valid_settings_samples(params: list[SamplingParams], seed: int) -> None:
    check_any_valid_batch_samples(Sampler(0, torch.device("cpu")), params, seed)

