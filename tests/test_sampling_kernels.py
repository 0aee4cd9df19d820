"""The Triton sampling kernels (``kvscope.kernels.triton_sampling``) and the sampler on them.

Truths: a torch Philox-4x32-10 written from its specification (Salmon et al., "Parallel random
numbers: as easy as 1, 2, 3", SC 2011) gives each row's uniform, and a float64 CDF of
``softmax(logits / T)`` the token that uniform must pick; the frequencies of many draws against
that distribution (chi-square); and the metamorphic properties of the streams (a seeded row
samples the same token at any batch position and whatever path its neighbours take; distinct
streams draw distinct uniforms).

Tiers, as in test_triton_kernels.py: CPU under the Triton interpreter (few rows: each program
runs in Python), the sm_90 compile check of the real launches, and on a GPU the same checks at
model shapes (the sampling frequencies at model shapes are in test_sampling.py).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from engine_helpers import bias_logits, greedy, make_llm, token_ids
from kvscope import LLM, SamplingParams
from kvscope.kernels import launch
from kvscope.kernels import triton_sampling as ts
from kvscope.kernels.launch import _arg_key
from kvscope.runner.sampler import Sampler
from test_sampling import EDGE_BATCHES, check_any_valid_batch_samples
from test_logit_adjustments import check_draws_follow_the_adjusted_distribution
from tiny_models import EOS_ID
from triton_testing import (compile_recorded, compiled_only, interpreted_only, needs_cuda, record_launches,
                            run_interpreted_tests)

KEY = (1 << 62) | 12345
M32 = 0xFFFFFFFF


def philox(key: int, c0: torch.Tensor, c1: int, c2: int, c3: int = 0, rounds: int = 10) -> list[torch.Tensor]:
    """Philox-4x32: ``rounds`` of (two 32x32 multiplies, hi/lo swapped and xored with the key),
    the key bumped by the Weyl constants between rounds. int64 tensors hold the uint32 words."""
    k0, k1 = key & M32, (key >> 32) & M32
    x = [c0.to(torch.int64) & M32] + [torch.full_like(c0, c & M32, dtype=torch.int64) for c in (c1, c2, c3)]
    for _ in range(rounds):
        p0, p1 = 0xD2511F53 * x[0], 0xCD9E8D57 * x[2]
        x = [((p1 >> 32) ^ x[1] ^ k0) & M32, p1 & M32, ((p0 >> 32) ^ x[3] ^ k1) & M32, p0 & M32]
        k0, k1 = (k0 + 0x9E3779B9) & M32, (k1 + 0xBB67AE85) & M32
    return x


def reference_uniform(key: int, a: int, b: int) -> float:
    """The stream's uniform: the top 24 bits of word 0 of Philox at counter ``(0, a, b, 0)``."""
    return (int(philox(key, torch.zeros(1), a, b)[0]) >> 8) / 2**24


def stream_of(streams: ts.Streams, row: int) -> tuple[int, int, int]:
    if streams.per_row is None:
        return streams.key, row, streams.step
    key, a, b = streams.per_row[row].tolist()
    return key & (2**64 - 1), a, b


def check_tokens(logits: torch.Tensor, scale: torch.Tensor, streams: ts.Streams, tokens: torch.Tensor) -> None:
    """A greedy row (``scale == 0``) takes the first largest logit. A random row's token is where
    its uniform ``u`` lands on the float64 CDF of ``2 ** (logits * scale)``: ``cdf[t - 1] <= u <
    cdf[t]``, up to float32 rounding of the sums, and never a token of zero probability."""
    for row in range(logits.shape[0]):
        x, t = logits[row].double(), int(tokens[row])
        if scale[row] == 0:
            assert t == int(x.argmax()), (row, t)
            continue
        p = torch.exp2(x * float(scale[row]) - (x * float(scale[row])).max())
        cdf = p.cumsum(0) / p.sum()
        u = reference_uniform(*stream_of(streams, row))
        below = float(cdf[t - 1]) if t else 0.0
        assert p[t] > 0 and below - 1e-5 <= u <= float(cdf[t]) + 1e-5, (row, t, below, u, float(cdf[t]))


def check_fused_matches_reference(rows: int, vocab: int, dtype: torch.dtype, device: str, seeded: bool) -> None:
    gen = torch.Generator().manual_seed(rows * vocab)
    logits = (3 * torch.randn(rows, vocab, generator=gen)).to(dtype)
    logits[1::4, ::3] = float("-inf")  # masked tokens (top-k / top-p rows)
    temps = torch.rand(rows, generator=gen) + 0.3
    temps[::3] = 0  # greedy rows among the random ones
    scale = torch.tensor([ts.scale_of(float(t)) for t in temps], dtype=torch.float32)
    per_row = None
    if seeded:
        per_row = torch.stack([torch.full((rows,), KEY), torch.arange(rows), torch.full((rows,), 9)], dim=1)
        per_row[1::2] = torch.tensor([77, 5, ts.SEEDED])
        per_row = per_row.to(device)
    streams = ts.Streams(KEY, 9, per_row)
    on = logits.to(device)
    check_tokens(logits, scale, streams, ts.sample(on, scale.to(device), streams).cpu())
    one = ts.scale_of(0.8)  # one temperature for every row
    check_tokens(logits, torch.full((rows,), one), streams, ts.sample(on, one, streams).cpu())
    assert torch.equal(ts.sample(on, 0.0, streams).cpu(), logits.float().argmax(-1))


def check_frequencies(device: str, rows: int) -> None:
    """``rows`` draws of one distribution (one row per draw, each its own stream) against its
    probabilities: chi-square below the 0.1 % level."""
    probs = torch.tensor([0.05, 0.4, 0.0, 0.15, 0.3, 0.1], dtype=torch.float64)
    logits = probs.log().float().expand(rows, -1).contiguous()
    tokens = ts.sample(logits.to(device), ts.scale_of(1.0), ts.Streams(KEY, 3)).cpu()
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    assert counts[2] == 0
    keep = probs > 0
    expected = probs[keep] * rows
    chi2 = float(((counts[keep] - expected) ** 2 / expected).sum())
    assert chi2 < 18.47, (chi2, counts.tolist())  # 4 degrees of freedom, 0.1 %


def check_rows_without_a_distribution(device: str) -> None:
    """A row of NaN logits (a broken model) or of only ``-inf`` has no distribution to sample:
    its token is still a valid id (never a negative one, which the next step would embed), and
    its neighbours sample as they would without it."""
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 5000, generator=gen)
    logits[1] = float("nan")
    logits[2] = float("-inf")
    per_row = torch.tensor([[KEY, row, 2] for row in range(4)])
    fine = [0, 3]
    for scale in (ts.scale_of(0.9), 0.0):
        tokens = ts.sample(logits.to(device), scale, ts.Streams(KEY, 2, per_row.to(device))).cpu()
        assert ((tokens >= 0) & (tokens < 5000)).all(), tokens
        streams = ts.Streams(KEY, 2, per_row[fine].to(device))
        alone = ts.sample(logits[fine].to(device), scale, streams).cpu()
        assert tokens[fine].tolist() == alone.tolist()
        check_tokens(logits[fine], torch.full((2,), scale), ts.Streams(KEY, 2, per_row[fine]), alone)


@triton.jit
def _uniform_of_streams(out_ptr, a_ptr, key, b, N: tl.constexpr):
    for j in range(N):
        tl.store(out_ptr + j, ts._uniform(key, tl.load(a_ptr + j), b))


@triton.jit
def _token_in_chunk_test(logits_ptr, residual_ptr, out_ptr, vocab, top, N: tl.constexpr, CHUNK: tl.constexpr):
    for j in range(N):
        tl.store(out_ptr + j, ts._token_in_chunk(logits_ptr, 0, vocab, 1.0, top, tl.load(residual_ptr + j), CHUNK))


def check_uniform_and_chunk_edges(device: str) -> None:
    """The kernels' uniform equals the reference's and lies in [0, 1). The scan of a chunk takes
    the first entry of nonzero mass at residual 0, skips masked entries, and falls back to the
    last entry of nonzero mass when rounding leaves the residual at or past the chunk's mass."""
    a = torch.tensor([0, 1, 2, 3, 1000, 2**20, 2**31 - 1, 12345], dtype=torch.int64)
    out = torch.empty(a.numel(), dtype=torch.float32, device=device)
    _uniform_of_streams[(1,)](out, a.to(device), KEY, 9, N=a.numel())
    ref = torch.tensor([reference_uniform(KEY, int(x), 9) for x in a], dtype=torch.float32)
    assert torch.equal(out.cpu(), ref) and (ref >= 0).all() and (ref < 1).all()
    logits = torch.tensor([float("-inf"), 0.0, 1.0, float("-inf"), 0.0, float("-inf")], device=device)
    mass = 0.5 + 1.0 + 0.5  # 2 ** (logit - top), top 1.0
    residual = torch.tensor([0.0, 0.49, 0.51, 1.51, mass - 1e-3, mass, 10.0], device=device)
    got = torch.empty(residual.numel(), dtype=torch.int32, device=device)
    _token_in_chunk_test[(1,)](logits, residual, got, 6, 1.0, N=residual.numel(), CHUNK=8)
    assert got.cpu().tolist() == [1, 1, 2, 4, 4, 4, 4]


def check_seeded_row_keeps_its_token(device: str) -> None:
    """A seeded row alone, in a batch, and in a batch whose neighbours ask for top-k (the
    masked launch): the same token, at every output index tried."""
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
    assert len(set(differs)) > 1, "the output index does not reach the random stream"


def check_reused_params_list(device: str) -> None:
    """The kernels' path of the sampler's reuse of the last call's params list (its per-row
    scale stays on the device): tokens equal a sampler given fresh lists, seeded rows included."""
    params = [SamplingParams(temperature=t, seed=s) for t, s in ((0.7, 3), (1.3, None), (0, None), (0.4, 8))]
    reusing = Sampler(2, torch.device(device), use_triton=True)
    fresh = Sampler(2, torch.device(device), use_triton=True)
    gen = torch.Generator().manual_seed(3)
    for step in range(3):
        logits = torch.randn(4, 300, generator=gen).to(device)
        index = [step, 2 * step, 0, step + 5]
        assert reusing.sample(logits, params, index).to_output().tokens == \
            fresh.sample(logits, list(params), list(index)).to_output().tokens


def check_sampler_paths_agree(device: str) -> None:
    """The same rows through the plain launch and through the masked one (forced by a top-k that
    keeps every token), and a top-k that keeps one token: the same tokens, seeded and greedy rows
    included; top-1 is the argmax."""
    gen = torch.Generator().manual_seed(1)
    logits = (2 * torch.randn(6, 257, generator=gen)).to(device)
    rows = [SamplingParams(temperature=0.7), SamplingParams(temperature=0), SamplingParams(temperature=1.3, seed=5),
            SamplingParams(temperature=0.7), SamplingParams(temperature=2.0), SamplingParams(temperature=0.7, seed=6)]
    index = [3, 1, 4, 1, 5, 9]
    whole = [dataclasses.replace(p, top_k=257) for p in rows]
    top1 = [dataclasses.replace(p, top_k=1) for p in rows]
    for each in (rows, whole, top1):  # greedy in the sampler: 1 / T overflows float32 (set past
        each[3].temperature = 1e-300  # SamplingParams, which raises one under 0.01 to 0.01 as vLLM does)
    fused = Sampler(8, torch.device(device), use_triton=True).sample(logits, rows, index).to_output().tokens
    masked = Sampler(8, torch.device(device), use_triton=True).sample(logits, whole, index).to_output().tokens
    assert fused == masked
    assert fused[1] == int(logits[1].argmax()) and fused[3] == int(logits[3].argmax())
    assert Sampler(8, torch.device(device), use_triton=True).sample(logits, top1, index).to_output().tokens \
        == logits.argmax(-1).tolist()
    # A penalized row (no history yet: its penalties change nothing) sends every row's logits to
    # the kernels as float32: half logits drawn so give the tokens drawn from them as they are.
    half = logits.half()
    penalized = rows[:-1] + [dataclasses.replace(rows[-1], presence_penalty=1.0)]
    assert Sampler(8, torch.device(device), use_triton=True).sample(half, penalized, index).to_output().tokens \
        == Sampler(8, torch.device(device), use_triton=True).sample(half, rows, index).to_output().tokens


def check_captured_draws_match_eager(device: str) -> None:
    """The draw a decode graph captures (scales and step number read from device memory, the
    step bumped by the draw itself) against the sampler's eager calls, step by step: the same
    tokens through a change of rows (new scales), eager calls in between (the step in memory
    catches up), and rows the captured draw refuses (log-probs, top-k, seeds, min-p, penalties),
    which change nothing. The step number read from memory draws as the number passed by value."""
    gen = torch.Generator().manual_seed(4)
    logits = (2 * torch.randn(3, 300, generator=gen)).to(device)
    scale = torch.tensor([ts.scale_of(0.7), 0.0, ts.scale_of(1.4)], device=device)
    assert torch.equal(ts.sample(logits, scale, ts.Streams(KEY, 9)),
                       ts.sample(logits, scale, ts.Streams(KEY, torch.tensor([9], device=device))))
    one = [SamplingParams(temperature=0.8)] * 3
    mixed = [SamplingParams(temperature=t) for t in (0.5, 0, 1.7)]
    refused = ([SamplingParams(temperature=0.8, logprobs=1)] * 3, [SamplingParams(temperature=0.8, top_k=5)] * 3,
               [SamplingParams(temperature=0.8, seed=1)] * 3, [SamplingParams(temperature=0.8, min_p=0.5)] * 3,
               [SamplingParams(temperature=0.8, presence_penalty=0.5)] * 3)
    captured, eager = Sampler(6, torch.device(device), use_triton=True), Sampler(6, torch.device(device), use_triton=True)
    captured.enable_captured_draws(4)
    replay = lambda: captured.draw_captured(logits)
    plan = [(one, "graph"), (one, "graph"), (mixed, "graph"), (mixed, "eager"), (one, "graph"),
            *((r, "refused") for r in refused), (mixed, "graph"), (mixed, "graph")]
    for step, (params, how) in enumerate(plan):
        index = [step, step + 1, 2 * step]
        if how == "refused":
            assert captured.sample_captured(params, index, replay) is None
            continue
        want = eager.sample(logits, params, index).to_output().tokens
        got = (captured.sample_captured(params, index, replay) if how == "graph"
               else captured.sample(logits, params, index))
        assert got.to_output().tokens == want, (step, how)


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
def test_interpreted_uniform_and_chunk_edges() -> None:
    check_uniform_and_chunk_edges("cpu")


@interpreted_only
def test_interpreted_rows_without_a_distribution() -> None:
    check_rows_without_a_distribution("cpu")


@interpreted_only
def test_interpreted_seeded_row_keeps_its_token() -> None:
    check_seeded_row_keeps_its_token("cpu")


@interpreted_only
def test_interpreted_sampler_paths_agree() -> None:
    check_sampler_paths_agree("cpu")
    check_reused_params_list("cpu")


@interpreted_only
def test_interpreted_captured_draws_match_eager() -> None:
    check_captured_draws_match_eager("cpu")


@interpreted_only
def test_interpreted_draws_follow_the_adjusted_distribution() -> None:
    """test_logit_adjustments.py's allowed tokens and logit bias on the kernels' path."""
    check_draws_follow_the_adjusted_distribution(Sampler(0, torch.device("cpu"), use_triton=True), 4_000, 0.04)


@interpreted_only
@settings(max_examples=25, deadline=None)
@given(EDGE_BATCHES, st.integers(0, 2**16))
def test_interpreted_any_batch_of_valid_settings_samples(params: list[SamplingParams], seed: int) -> None:
    """test_sampling.py's property on the kernels' path: the kernels' scale of a float32-sized
    temperature, masks beside greedy rows, streams of any seed."""
    check_any_valid_batch_samples(Sampler(0, torch.device("cpu"), use_triton=True), params, seed)


def _engine_on_the_kernels(**config) -> LLM:
    """A CPU engine whose runner samples through the Triton kernels (interpreted), as on CUDA."""
    llm = make_llm(block_size=4, **config)
    llm.llm_engine.executor.sampler = Sampler(0, torch.device("cpu"), use_triton=True)
    return llm


@interpreted_only
def test_interpreted_engine_on_the_kernels_holds_back_eos_until_min_tokens():
    """The kernels' path draws no stop token before ``min_tokens`` (test_api.py's test on the
    torch path): on a model that all but always picks EOS, plain, greedy and top-k rows give
    exactly ``min_tokens`` other tokens, then EOS."""
    llm = _engine_on_the_kernels()
    bias_logits(llm, {EOS_ID: 1e4})
    params = [SamplingParams(temperature=1.0, max_tokens=6, min_tokens=3),
              SamplingParams(temperature=0, max_tokens=6, min_tokens=2),
              SamplingParams(temperature=0.7, top_k=5, max_tokens=6, min_tokens=4)]
    outs = [o.outputs[0].token_ids for o in llm.generate([[1, 2], [7, 8, 9], [4]], params, use_tqdm=False)]
    assert [len(t) for t in outs] == [4, 3, 5]
    assert all(t[-1] == EOS_ID not in t[:-1] for t in outs)


@interpreted_only
def test_interpreted_engine_on_the_kernels_reproduces_a_seeded_request():
    """The runner's use of the kernels (steady-decode reuse of the rows' settings, the masked
    launch for top-k neighbours, streams by output index): a seeded request gives the same
    tokens alone, in a batch with random, top-k and greedy neighbours, and under preemption."""
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    alone = token_ids(_engine_on_the_kernels().generate([[7, 8, 9]], p, use_tqdm=False))[0]
    others = [SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=5, max_tokens=10, ignore_eos=True), greedy(10)]
    prompts = [[1, 2], [7, 8, 9], [4, 4, 4, 4], [3]]
    batch = _engine_on_the_kernels().generate(prompts, [others[0], p, others[1], others[2]], use_tqdm=False)
    assert token_ids(batch)[1] == alone
    tight = _engine_on_the_kernels(num_kv_blocks=8)
    outs = tight.generate([[7, 8, 9]] + [[5] * 9] * 3, [p] + others, use_tqdm=False)
    assert sum(o.metrics.num_preemptions for o in outs) > 0
    assert token_ids(outs)[0] == alone
    other_seed = dataclasses.replace(p, seed=4321)
    assert token_ids(_engine_on_the_kernels().generate([[7, 8, 9]], other_seed, use_tqdm=False))[0] != alone


@interpreted_only
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_interpreted_engine_launches_no_variant_its_start_up_compile_did_not(monkeypatch: pytest.MonkeyPatch,
                                                                            async_scheduling: bool):
    """The CPU twin of test_gpu_engine.py's start-up compile test, for the sampling and penalty
    kernels: every launch a bfloat16 engine's run makes, keyed as Triton picks a compiled variant
    (:func:`kvscope.kernels.launch._arg_key`), was made by :meth:`Sampler.compile_kernels`. The
    rows are of every kind, stepped synchronously and not; an adjusted row's draw reads float32
    logits, not the model's dtype."""
    made: set[tuple] = set()
    run = launch.Launcher.__call__

    def recording(self, grid, *args):
        unspecialized = self._fn.kwargs["do_not_specialize"] or ()  # (Triton keys these by type alone)
        made.add((self._fn.__name__, tuple(sorted(self._options.items())),
                  *(type(a) if name in unspecialized else _arg_key(a, isinstance(a, bool))
                    for name, a in zip(self._fn.arg_names, args))))
        run(self, grid, *args)

    monkeypatch.setattr(launch.Launcher, "__call__", recording)
    llm = _engine_on_the_kernels(dtype="bfloat16", async_scheduling=async_scheduling)
    llm.llm_engine.executor.sampler.compile_kernels(llm.llm_engine.executor.vocab_size, torch.bfloat16)
    started = set(made)
    kinds = [dict(temperature=0), dict(temperature=0.8), dict(temperature=1.2), dict(temperature=0.8, seed=3),
             dict(temperature=0.8, top_k=5), dict(temperature=0.8, repetition_penalty=1.2),
             dict(temperature=0, logit_bias={5: 2.0}), dict(temperature=0.7, presence_penalty=0.5, top_p=0.9)]
    params = [SamplingParams(max_tokens=4 + i, ignore_eos=True, **kind) for i, kind in enumerate(kinds)]
    llm.generate([[1 + i, 2, 3][: 1 + i % 3] for i in range(len(kinds))], params, use_tqdm=False)
    assert {key[0] for key in made} == {"_chunk_mass_kernel", "_pick_kernel", "_penalize_kernel"}
    assert made <= started, sorted(made - started, key=str)


@pytest.mark.slow
@compiled_only
def test_kernels_compile_for_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    kernels = record_launches(monkeypatch, ts, ("_chunk_mass_kernel", "_pick_kernel"))
    ts.compile_variants(151936, torch.bfloat16, torch.device("cpu"))
    assert [len(r.calls) for r in kernels.values()] == [6, 6]
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
def test_gpu_seeds_and_paths() -> None:
    check_uniform_and_chunk_edges("cuda")
    check_rows_without_a_distribution("cuda")
    check_frequencies("cuda", 200000)
    check_seeded_row_keeps_its_token("cuda")
    check_reused_params_list("cuda")
    check_sampler_paths_agree("cuda")
    check_captured_draws_match_eager("cuda")


@pytest.mark.gpu
@needs_cuda
def test_gpu_kernel_compiles_once_across_steps() -> None:
    """The step number and temperature change from call to call: neither may select a new
    compiled variant (a mid-run compile costs more than many steps)."""
    logits = torch.randn(8, 1000, device="cuda")
    variants = lambda: sum(len(c[0]) for c in ts._pick_kernel.device_caches.values())
    ts.sample(logits, ts.scale_of(0.7), ts.Streams(KEY, 1))
    first = variants()
    for step, temp in ((16, 1.0), (17, 0.5), (2**20, 2.0), (2**31 - 1, 1.0)):
        ts.sample(logits, ts.scale_of(temp), ts.Streams(KEY, step))
    assert variants() == first
