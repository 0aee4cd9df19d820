"""The penalty kernel (``kvscope.kernels.triton_penalties``) and the sampler on it.

Truths: torch's :func:`~kvscope.runner.logit_adjustments.apply_penalties` on the rows gathered
from the pool with their outputs in flight counted (the same bits: the kernel rounds as torch
does), and transformers' logits with the penalties applied step by step
(test_logit_adjustments.py's reference) for whole runs on the kernel's path.

Tiers, as in test_sampling_kernels.py: CPU under the Triton interpreter, the sm_90 compile check
of the real launch, and on a GPU the same check at a model's vocabulary.
"""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from engine_helpers import make_llm
from kvscope.kernels import triton_penalties as tp
from kvscope.runner.logit_adjustments import apply_penalties
from kvscope.runner.sampler import Sampler
from test_logit_adjustments import check_penalties_count_the_newest_token_and_the_prompt
from triton_testing import (compile_recorded, compiled_only, interpreted_only, needs_cuda, record_launches,
                            run_interpreted_tests)


def check_penalize_matches_torch(rows: int, vocab: int, device: str) -> None:
    """Rows ``at`` of a batch (some at -inf, zero or positive) penalized in place from pool rows
    in any order, some with an output in flight, equal torch's penalties on the gathered rows
    bit for bit; the other rows stay as they were."""
    gen = torch.Generator().manual_seed(rows * 7 + vocab)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[logits.abs() < 0.05] = 0.0
    logits[:, ::17] = float("-inf")
    pool = rows + 3
    mask = torch.rand(pool, vocab, generator=gen) < 0.1
    counts = torch.randint(0, 4, (pool, vocab), generator=gen).float() * (torch.rand(pool, vocab, generator=gen) < 0.05)
    mask[:, 1], counts[:, 2] = True, 2.0  # (every row sees a token in its prompt and one in its outputs)
    at = torch.randperm(rows, generator=gen)[: max(1, rows - 1)]
    pool_rows = torch.randperm(pool, generator=gen)[: at.numel()]
    in_flight = torch.randint(0, vocab, (at.numel(),), generator=gen)
    in_flight[::2] = -1
    settings = [torch.rand(at.numel(), generator=gen) * 2 + 0.5, torch.randn(at.numel(), generator=gen),
                torch.randn(at.numel(), generator=gen)]
    seen = counts[pool_rows]
    flying = in_flight >= 0
    seen[flying.nonzero().squeeze(1), in_flight[flying]] += 1
    want = logits.clone()
    want[at] = apply_penalties(logits[at], mask[pool_rows], seen, *settings)
    got = logits.to(device, copy=True)
    tp.penalize_(got, *(t.to(device) for t in (at, mask, counts, pool_rows, in_flight, *settings)))
    assert torch.equal(got.cpu(), want)
    assert not torch.equal(want, logits)  # (the penalties changed something the test can see)


# --- CPU: Triton interpreter -----------------------------------------------------------------

@compiled_only
def test_interpreter_suite() -> None:
    run_interpreted_tests(__file__)


@interpreted_only
@pytest.mark.parametrize("rows,vocab", [(1, 5), (3, 2049), (6, 4100)])
def test_interpreted_penalize_matches_torch(rows: int, vocab: int) -> None:
    check_penalize_matches_torch(rows, vocab, "cpu")


@interpreted_only
@pytest.mark.parametrize("config", [dict(), dict(async_scheduling=True),
                                    dict(num_kv_blocks=14, max_num_seqs=4, async_scheduling=True)],
                         ids=["sync", "async", "preempting"])
def test_interpreted_engine_on_the_kernel_counts_the_newest_token_and_the_prompt(config) -> None:
    """test_logit_adjustments.py's whole runs against transformers, the penalties by the kernel
    from the counts kept on the device (the newest output still in flight under async)."""
    llm = make_llm(block_size=4, **config)
    sampler = llm.llm_engine.executor.sampler = Sampler(0, torch.device("cpu"), use_triton=True)
    assert sampler.penalty_kernels is tp
    check_penalties_count_the_newest_token_and_the_prompt(llm)


@pytest.mark.slow
@compiled_only
def test_penalty_kernel_compiles_for_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    kernels = record_launches(monkeypatch, tp, ("_penalize_kernel",))
    tp.compile_variants(151936, torch.device("cpu"))
    assert len(kernels["_penalize_kernel"].calls) == 1
    compile_recorded(kernels)


# --- GPU -------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows,vocab", [(1, 151936), (256, 151936), (7, 32001)])
def test_gpu_penalize_matches_torch(rows: int, vocab: int) -> None:
    check_penalize_matches_torch(rows, vocab, "cuda")
