"""The Triton sampling kernels (``kvscope.kernels.triton_sampling``) and the sampler on them.

Truths: torch's argmax over ``logits / T - log E`` with the noise kernel's ``log E`` (the fused
kernel must pick exactly that token), the Exp(1) law for the noise, and the metamorphic
properties of the streams (a seeded row draws the same noise at any batch position and on
either path; distinct streams draw distinct noise).

Tiers, as in test_triton_kernels.py: CPU under the Triton interpreter (few rows: each program
runs in Python), the sm_90 compile check of the real launches, and on a GPU the sampling
frequencies and an engine whose seeded request is batched with rows that take the torch path.
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

triton = pytest.importorskip("triton")

from kvscope import SamplingParams
from kvscope.kernels import triton_sampling as ts
from kvscope.runner.sampler import Sampler
from triton_testing import (compile_recorded, compiled_only, interpreted_only, needs_cuda, record_launches,
                            run_interpreted_tests)

KEY = (1 << 62) | 12345


def reference_tokens(logits: torch.Tensor, temps: torch.Tensor, log_e: torch.Tensor) -> torch.Tensor:
    """torch's exponential race in log space; greedy rows take the plain argmax."""
    scaled = logits.float() / torch.where(temps > 0, temps, 1.0).unsqueeze(1)
    return torch.where(temps > 0, (scaled - log_e).argmax(-1), logits.float().argmax(-1))


def check_fused_matches_reference(rows: int, vocab: int, dtype: torch.dtype, device: str, seeded: bool) -> None:
    gen = torch.Generator().manual_seed(rows * vocab)
    logits = (3 * torch.randn(rows, vocab, generator=gen)).to(dtype).to(device)
    temps = torch.rand(rows, generator=gen) + 0.3
    temps[::3] = 0  # greedy rows among the random ones
    per_row = None
    if seeded:
        per_row = torch.stack([torch.full((rows,), KEY), torch.arange(rows), torch.full((rows,), 9)], dim=1)
        per_row[1::2] = torch.tensor([77, 5, ts.SEEDED])
        per_row = per_row.to(device)
    streams = ts.Streams(KEY, 9, per_row)
    tokens = ts.sample(logits, temps.to(device), streams)
    log_e = ts.log_exponential_noise(rows, vocab, streams, torch.device(device))
    assert torch.equal(tokens.cpu(), reference_tokens(logits.cpu(), temps, log_e.cpu()))
    one = ts.sample(logits, 0.8, streams)  # one temperature for every row
    assert torch.equal(one.cpu(), reference_tokens(logits.cpu(), torch.full((rows,), 0.8), log_e.cpu()))
    assert torch.equal(ts.sample(logits, 0.0, streams).cpu(), logits.cpu().float().argmax(-1))


def check_noise_is_exponential(vocab: int, device: str) -> None:
    """Four streams, each ``vocab`` draws of ``log E``: ``E`` has Exp(1)'s mean, variance and
    CDF (Kolmogorov-Smirnov distance within 1.63 / sqrt(n), the 1 % level), the streams differ,
    and a stream draws the same values wherever its row is."""
    per_row = torch.tensor([[KEY, 0, 9], [KEY, 1, 9], [77, 5, ts.SEEDED], [KEY, 3, 10]], device=device)
    log_e = ts.log_exponential_noise(4, vocab, ts.Streams(KEY, 9, per_row), torch.device(device)).cpu()
    assert torch.isfinite(log_e).all()
    e = log_e.double().exp()
    for row in e:
        assert abs(row.mean().item() - 1) < 5 / math.sqrt(vocab)
        assert abs(row.var().item() - 1) < 15 / math.sqrt(vocab)
        x = row.sort().values
        cdf = 1 - torch.exp(-x)
        grid = torch.arange(1, vocab + 1, dtype=torch.float64) / vocab
        ks = torch.maximum(grid - cdf, cdf - (grid - 1 / vocab)).max().item()
        assert ks < 1.63 / math.sqrt(vocab), ks
    assert len({tuple(r[:64].tolist()) for r in log_e}) == 4, "two streams drew the same noise"
    shared = ts.log_exponential_noise(2, vocab, ts.Streams(KEY, 9), torch.device(device)).cpu()
    assert torch.equal(shared, log_e[:2]), "rows 0 and 1 of a step are the streams (key, 0, step), (key, 1, step)"
    moved = torch.tensor([[KEY, 0, 0], [KEY, 1, 0], [77, 5, ts.SEEDED]], device=device)
    again = ts.log_exponential_noise(3, vocab, ts.Streams(KEY, 0, moved), torch.device(device)).cpu()
    assert torch.equal(again[2], log_e[2]), "a seeded stream drew other noise at another row"


def check_seeded_row_keeps_its_token(device: str) -> None:
    """A seeded row alone, in a batch on the fused path, and in a batch that takes the torch path
    (a neighbour asks for top-k): the same token, at every output index tried."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 300, generator=gen).to(device)
    seeded = SamplingParams(temperature=0.9, seed=2024)
    plain, topk = SamplingParams(temperature=1.1), SamplingParams(temperature=1.1, top_k=20)
    for index in (0, 1, 17):
        sampler = Sampler(3, torch.device(device), use_triton=True)
        alone = sampler.sample(logits[2:3], [seeded], [index]).to_output().tokens[0]
        for others in (plain, topk):
            params = [others, plain, seeded, others, plain]
            tokens = sampler.sample(logits, params, [4, 0, index, 9, 1]).to_output().tokens
            assert tokens[2] == alone, (index, others)
    differs = [Sampler(3, torch.device(device), use_triton=True).sample(logits[2:3], [seeded], [i])
               .to_output().tokens[0] for i in range(8)]
    assert len(set(differs)) > 1, "the output index does not reach the noise"


def check_sampler_paths_agree(device: str) -> None:
    """The same rows through the fused launch and through the torch path (forced by a top-k that
    keeps every token): the same tokens, seeded rows and greedy rows included."""
    gen = torch.Generator().manual_seed(1)
    logits = (2 * torch.randn(6, 257, generator=gen)).to(device)
    rows = [SamplingParams(temperature=0.7), SamplingParams(temperature=0), SamplingParams(temperature=1.3, seed=5),
            SamplingParams(temperature=0.7), SamplingParams(temperature=2.0), SamplingParams(temperature=0.7, seed=6)]
    index = [3, 1, 4, 1, 5, 9]
    fused = Sampler(8, torch.device(device), use_triton=True).sample(logits, rows, index).to_output().tokens
    whole = [dataclasses.replace(p, top_k=257) for p in rows]
    masked = Sampler(8, torch.device(device), use_triton=True).sample(logits, whole, index).to_output().tokens
    assert fused == masked
    assert fused[1] == int(logits[1].argmax())


# --- CPU: Triton interpreter -----------------------------------------------------------------

@compiled_only
def test_interpreter_suite() -> None:
    run_interpreted_tests(__file__)


@interpreted_only
@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("rows,vocab,dtype", [(1, 7, torch.float32), (4, 2049, torch.float32),
                                              (5, 4100, torch.float16)])
def test_interpreted_fused_matches_reference(rows: int, vocab: int, dtype: torch.dtype, seeded: bool) -> None:
    check_fused_matches_reference(rows, vocab, dtype, "cpu", seeded)


@interpreted_only
def test_interpreted_noise_is_exponential() -> None:
    check_noise_is_exponential(20000, "cpu")


@interpreted_only
def test_interpreted_seeded_row_keeps_its_token() -> None:
    check_seeded_row_keeps_its_token("cpu")


@interpreted_only
def test_interpreted_sampler_paths_agree() -> None:
    check_sampler_paths_agree("cpu")


@pytest.mark.slow
@compiled_only
def test_kernels_compile_for_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    kernels = record_launches(monkeypatch, ts, ("_sample_chunks_kernel", "_pick_chunk_kernel", "_noise_kernel"))
    ts.compile_variants(151936, torch.bfloat16, torch.device("cpu"))
    assert [len(r.calls) for r in kernels.values()] == [4, 4, 2]
    compile_recorded(kernels)


# --- GPU -------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("rows,vocab,dtype", [(1, 151936, torch.bfloat16), (256, 151936, torch.bfloat16),
                                              (7, 5000, torch.float32)])
def test_gpu_fused_matches_reference(rows: int, vocab: int, dtype: torch.dtype, seeded: bool) -> None:
    check_fused_matches_reference(rows, vocab, dtype, "cuda", seeded)


@pytest.mark.gpu
@needs_cuda
def test_gpu_noise_and_seeds() -> None:
    check_noise_is_exponential(200000, "cuda")
    check_seeded_row_keeps_its_token("cuda")
    check_sampler_paths_agree("cuda")


@pytest.mark.gpu
@needs_cuda
def test_gpu_kernel_compiles_once_across_steps() -> None:
    """The step number and temperature change from call to call: neither may select a new
    compiled variant (a mid-run compile costs more than many steps)."""
    logits = torch.randn(8, 1000, device="cuda")
    variants = lambda: sum(len(c[0]) for c in ts._sample_chunks_kernel.device_caches.values())
    ts.sample(logits, 0.7, ts.Streams(KEY, 1))
    first = variants()
    for step, temp in ((16, 1.0), (17, 0.5), (2**20, 2.0), (2**31 - 1, 1.0)):
        ts.sample(logits, temp, ts.Streams(KEY, step))
    assert variants() == first
