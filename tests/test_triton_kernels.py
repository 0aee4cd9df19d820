"""Triton KV store and paged attention against a dense torch reference, on random paged layouts.

Three tiers:
- CPU, Triton interpreter (always, when triton imports): tiny fp32/fp16 shapes.
- CPU, sm_90 compile check: the kernels' real launch arguments compiled to a Hopper cubin,
  which catches what the interpreter accepts but the compiler rejects (e.g. tl.dot with K<16).
- GPU (``-m gpu``): bf16 at real head dims and page sizes, split-KV, CUDA-graph capture.

Why the interpreter runs in a subprocess: see ``triton_testing``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

triton = pytest.importorskip("triton")

from kvscope.kernels import gluon_attention
from kvscope.kernels import triton_attention as ta
from kvscope.kernels.base import AttentionMetadata
from triton_testing import (INTERPRETED, REPO, compile_recorded, compile_sm90, compiled_only, interpreted_only,
                            needs_cuda, record_launches, rel_err, run_interpreted_tests)

SCALE_OF_HEAD_DIM = 0.5  # scale = 0.5 / sqrt(D), not 1 / sqrt(D): a dropped scale shows


@dataclass
class PagedCase:
    """One step: packed q/k/v of the new tokens, a NaN-poisoned pool holding the cached prefixes."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    meta: AttentionMetadata
    hist_k: list[torch.Tensor]   # per sequence [ctx, H_kv, D]: the whole history, true values
    hist_v: list[torch.Tensor]
    scale: float


def make_case(specs: list[tuple[int, int]], block_size: int, num_q_heads: int, num_kv_heads: int,
              head_dim: int, dtype: torch.dtype, device: str | torch.device,
              seed: int) -> PagedCase:
    """``specs``: (cached tokens, new tokens) per sequence. Pages are a random permutation of
    the pool (fragmented, out of order), spare pages stay NaN, tables are padded with -1."""
    gen = torch.Generator().manual_seed(seed)
    ctx = [c + n for c, n in specs]
    pages = [-(-n // block_size) for n in ctx]
    num_blocks = sum(pages) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(pages) + 1
    tables = torch.full((len(specs), width), -1, dtype=torch.int32)
    owned = []
    for i, n in enumerate(pages):
        owned.append(perm[:n])
        perm = perm[n:]
        tables[i, :n] = torch.tensor(owned[i], dtype=torch.int32)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    hist_k, hist_v, new_k, new_v, slots = [], [], [], [], []
    for (cached, new), blocks in zip(specs, owned):
        hk = rand(cached + new, num_kv_heads, head_dim)
        hv = rand(cached + new, num_kv_heads, head_dim)
        pos = torch.arange(cached + new)
        page = torch.tensor(blocks, dtype=torch.int64)[pos // block_size]
        slot = page * block_size + pos % block_size
        k_cache.view(-1, num_kv_heads, head_dim)[slot[:cached]] = hk[:cached]
        v_cache.view(-1, num_kv_heads, head_dim)[slot[:cached]] = hv[:cached]
        hist_k.append(hk)
        hist_v.append(hv)
        new_k.append(hk[cached:])
        new_v.append(hv[cached:])
        slots.append(slot[cached:])
    q_lens = torch.tensor([n for _, n in specs])
    num_tokens = int(q_lens.sum())
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        cu_seqlens_q=torch.cat([torch.zeros(1), q_lens.cumsum(0)]).to(torch.int32),
        cu_seqlens_k=torch.cat([torch.zeros(1), torch.tensor(ctx).cumsum(0)]).to(torch.int32),
        context_lens=torch.tensor(ctx, dtype=torch.int32),
        block_tables=tables,
        max_seqlen_q=int(q_lens.max()),
        max_seqlen_k=max(ctx),
        num_seqs=len(specs),
        num_tokens=num_tokens,
        block_size=block_size,
        decode_only=all(n == 1 for _, n in specs),
        no_prefix=all(c == 0 for c, _ in specs),
    )
    for name in ("slot_mapping", "cu_seqlens_q", "cu_seqlens_k", "context_lens", "block_tables"):
        setattr(meta, name, getattr(meta, name).to(device))
    to = lambda t: t.to(device)  # noqa: E731
    return PagedCase(
        q=to(rand(num_tokens, num_q_heads, head_dim)),
        k=to(torch.cat(new_k)), v=to(torch.cat(new_v)),
        k_cache=to(k_cache), v_cache=to(v_cache), meta=meta,
        hist_k=[to(h) for h in hist_k], hist_v=[to(h) for h in hist_v],
        scale=SCALE_OF_HEAD_DIM / head_dim ** 0.5,
    )


def reference(case: PagedCase, acc_dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Dense causal softmax attention of each sequence's rows over its true history."""
    cu = case.meta.cu_seqlens_q.tolist()
    outs = []
    for i, (hk, hv) in enumerate(zip(case.hist_k, case.hist_v)):
        q = case.q[cu[i]:cu[i + 1]].to(acc_dtype)
        group = q.shape[1] // hk.shape[1]
        k = hk.to(acc_dtype).repeat_interleave(group, dim=1)
        v = hv.to(acc_dtype).repeat_interleave(group, dim=1)
        ctx, q_len = k.shape[0], q.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q, k) * case.scale
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]
        k_pos = torch.arange(ctx, device=q.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)


def gathered_history(case: PagedCase, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence ``i``'s history as read back from the pool through its block table."""
    bs, ctx = case.meta.block_size, int(case.meta.context_lens[i])
    pos = torch.arange(ctx, device=case.k_cache.device)
    slot = case.meta.block_tables[i].long()[pos // bs] * bs + pos % bs
    return (case.k_cache.flatten(0, 1)[slot], case.v_cache.flatten(0, 1)[slot])


# --- CPU: Triton interpreter ---------------------------------------------------------------

@compiled_only
def test_interpreter_suite() -> None:
    run_interpreted_tests(__file__)


# (specs, block_size, group, head_dim, dtype, config, num_splits): every page size against tiles
# that span several pages, one page, or part of one; GQA 1/2/4; every kind of row in one batch.
MIXED = [(0, 7), (5, 3), (13, 1), (0, 1), (16, 9), (30, 1)]
# Prefills long enough for key tiles wholly below the causal diagonal (the unmasked loop) next
# to the diagonal's masked tiles, chunked after a cached prefix, and decode rows in between.
LONG = [(0, 40), (37, 20), (5, 1), (0, 1), (90, 17)]
LONG256 = [(0, 40), (5, 1), (330, 20)]  # unmasked key tiles on two pages of 256
CFG16, CFG32 = ta.KernelConfig(16, 16, 4, 1), ta.KernelConfig(32, 16, 4, 1)
F32, F16 = torch.float32, torch.float16
INTERP_CASES = [
    (MIXED, 4, 2, 32, F32, None, None),
    (MIXED, 1, 4, 32, F16, CFG16, None),
    (MIXED, 16, 1, 32, F32, CFG16, None),
    (MIXED, 16, 2, 32, F16, ta.KernelConfig(16, 8, 4, 1), 3),      # tile inside a page, split
    ([(40, 1), (3, 1), (0, 1), (17, 1)], 4, 4, 32, F32, None, 4),   # decode, split-KV
    ([(70, 1), (9, 1)], 16, 2, 32, F32, CFG16, 32),                 # empty splits
    ([(0, 12), (0, 5)], 16, 2, 32, F32, CFG16, None),               # fresh prefill
    (LONG, 1, 2, 32, F32, CFG32, None),                             # a page per key position
    (LONG, 24, 2, 32, F32, CFG32, None),                            # tiles straddle pages
    (LONG, 48, 4, 24, F16, CFG32, None),                            # 3 tiles a page; D < BLOCK_D
    (LONG256, 256, 8, 32, F32, None, None),                         # default: a lookup a tile
    (LONG, 16, 2, 32, F16, None, None),                             # default: 4 pages a tile
    (LONG, 16, 2, 32, F32, ta.KernelConfig(32, 16, 4, 1, fold_scale=False), None),  # scale in exp2
    (LONG, 32, 2, 32, F32, ta.KernelConfig(32, 16, 4, 1, tma=True), None),   # TMA, 2 tiles a page
    (LONG256, 256, 4, 32, F16, ta.KernelConfig(128, 64, 8, 3, tma=True), None),
    (LONG, 16, 2, 32, F16, ta.KernelConfig(32, 16, 4, 2, maxnreg=128), None),  # register cap
]


@interpreted_only
@pytest.mark.parametrize("specs,block_size,group,head_dim,dtype,config,num_splits", INTERP_CASES)
def test_interpreted_paged_attention(specs, block_size, group, head_dim, dtype, config,
                                     num_splits) -> None:
    case = make_case(specs, block_size, 2 * group, 2, head_dim, dtype, "cpu",
                     seed=block_size + group)
    ta.store_kvcache(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    for i in range(len(specs)):
        k, v = gathered_history(case, i)
        assert torch.equal(k, case.hist_k[i]) and torch.equal(v, case.hist_v[i])
    out = ta.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                             config=config, num_splits=num_splits)
    assert rel_err(out, reference(case)) < (1e-5 if dtype == torch.float32 else 3e-3)


@interpreted_only
def test_interpreted_sequences_found_over_several_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Programs find their sequence by counting first tiles chunk by chunk; with chunks of 4,
    six sequences take two (a batch beyond the real chunk of 256 does so too)."""
    monkeypatch.setattr(ta, "_SEQ_CHUNK", 4)
    case = make_case(MIXED, 4, 2, 2, 32, torch.float32, "cpu", seed=8)
    ta.store_kvcache(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    out = ta.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                             config=CFG16)
    assert rel_err(out, reference(case)) < 1e-5


@interpreted_only
def test_interpreted_store_skips_negative_slots() -> None:
    case = make_case([(0, 5), (3, 2)], 4, 2, 2, 32, torch.float32, "cpu", seed=1)
    before = case.k_cache.clone()
    slots = case.meta.slot_mapping.clone()
    slots[1::2] = -1
    ta.store_kvcache(case.k, case.v, case.k_cache, case.v_cache, slots)
    flat, old = case.k_cache.flatten(0, 1), before.flatten(0, 1)
    written = slots >= 0
    assert torch.equal(flat[slots[written]], case.k[written])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots[written]] = False
    assert torch.equal(flat[untouched].isnan(), old[untouched].isnan())


@interpreted_only
def test_interpreted_backend_empty_history_row() -> None:
    """A padding row (context 0, slot -1, as in a padded CUDA-graph batch) yields zeros, not NaN."""
    case = make_case([(6, 1), (0, 1)], 4, 4, 2, 32, torch.float32, "cpu", seed=2)
    case.meta.context_lens[1] = 0
    case.meta.slot_mapping[1] = -1
    case.hist_k[1], case.hist_v[1] = case.hist_k[1][:0], case.hist_v[1][:0]
    out = ta.TritonAttentionBackend().forward(case.q, case.k, case.v, case.k_cache,
                                                  case.v_cache, case.meta, case.scale)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert rel_err(out[:1], reference(case)[:1]) < 1e-5


def fp8_pools(case: PagedCase, k_scale: torch.Tensor,
              v_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The case's pools as an fp8 engine would hold them (spare pages stay NaN)."""
    from kvscope.kernels.kv_quant import FP8_DTYPE, quantize_kv
    return (quantize_kv(case.k_cache, k_scale, FP8_DTYPE), quantize_kv(case.v_cache, v_scale, FP8_DTYPE))


def snap_to_fp8(case: PagedCase, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """Make the new keys/values exact multiples of e4m3 values by the (power-of-two) scales,
    then push one key and one value past the e4m3 range.

    The interpreter's float -> fp8 cast rounds wrongly when rounding carries into the exponent
    (e.g. 124 -> 64, triton 3.7.1); on values that need no rounding it is exact, so the store's
    scaling, clamping and addressing are checked here and the rounding itself on the GPU.
    """
    from kvscope.kernels.kv_quant import FP8_DTYPE, dequantize_kv, quantize_kv
    for name, scale in (("k", k_scale), ("v", v_scale)):
        x = getattr(case, name)
        x = dequantize_kv(quantize_kv(x, scale, FP8_DTYPE), scale, x.dtype)
        x[0, 0, 0] = 1000 * scale  # stored as 448
        setattr(case, name, x)


FP8_CASES = [
    (MIXED, 4, 2, torch.float32, None, None),
    (MIXED, 16, 4, torch.float16, None, None),
    ([(40, 1), (3, 1), (0, 1), (17, 1)], 4, 2, torch.float32, 4, None),   # decode, split-KV
    (LONG256, 256, 2, torch.float16, None, None),                         # default prefill tiles
    (LONG, 32, 2, torch.float32, None, ta.KernelConfig(32, 16, 4, 1, fold_scale=False, tma=True)),
]


@interpreted_only
@pytest.mark.parametrize("specs,block_size,group,dtype,num_splits,config", FP8_CASES)
def test_interpreted_fp8_kv_cache(specs, block_size, group, dtype, num_splits, config) -> None:
    """Triton store + paged attention over fp8 pools equal the torch reference backend (which
    reads only each sequence's own slots; the pools' unused slots hold NaN): the same bytes
    stored, the same output."""
    from kvscope.kernels.torch_attention import TorchReferenceBackend
    case = make_case(specs, block_size, 2 * group, 2, 32, dtype, "cpu", seed=5 + block_size)
    k_scale, v_scale = torch.tensor(2.0 ** -6), torch.tensor(2.0 ** -5)
    snap_to_fp8(case, k_scale, v_scale)
    k8, v8 = fp8_pools(case, k_scale, v_scale)
    k8_ref, v8_ref = k8.clone(), v8.clone()
    ta.store_kvcache(case.k, case.v, k8, v8, case.meta.slot_mapping, k_scale, v_scale)
    out = ta.paged_attention(case.q, k8, v8, case.meta, case.scale, k_scale, v_scale,
                             config=config, num_splits=num_splits)
    expect = TorchReferenceBackend().forward(case.q, case.k, case.v, k8_ref, v8_ref, case.meta,
                                             case.scale, k_scale, v_scale)
    u8 = lambda t: t.view(torch.uint8)  # noqa: E731  (NaN != NaN: compare the bytes)
    assert torch.equal(u8(k8), u8(k8_ref)) and torch.equal(u8(v8), u8(v8_ref))
    assert k8.float().abs().nan_to_num().max() == 448
    assert rel_err(out, expect) < (1e-5 if dtype == torch.float32 else 3e-3)


@interpreted_only
def test_interpreted_tuned_config_cached_on_disk(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tuning runs every candidate (each computes the right output), caches the fastest on
    disk, and a later process's default call launches it; an unreadable cache file is
    reported and the static default applies."""
    from kvscope.kernels import attention_configs as ac
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(ac, "_choices", None)
    candidates = (CFG16, ta.KernelConfig(32, 16, 4, 1, fold_scale=False),
                  ta.KernelConfig(16, 32, 4, 1))
    monkeypatch.setattr(ac, "TUNE_CANDIDATES", candidates)
    case = make_case([(0, 24), (7, 9), (5, 1)], 16, 4, 2, 32, torch.float32, "cpu", seed=9)
    ta.store_kvcache(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    times, outs = iter([3.0, 1.0, 2.0]), []

    def timer(fn) -> float:
        outs.append(fn())
        return next(times)

    best = ta.tune_paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                                   timer=timer)
    assert best == candidates[1] and len(outs) == 3
    assert all(rel_err(out, reference(case)) < 1e-5 for out in outs)
    saved = json.loads((tmp_path / "attention_configs.json").read_text())
    assert list(saved.values()) == [dataclasses.asdict(best)]

    def launched() -> dict:
        monkeypatch.setattr(ac, "_choices", None)  # as a new process: read the file again
        with monkeypatch.context() as patch:
            kernels = record_launches(patch, ta, ("_paged_attention_kernel",))
            ta.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
        return kernels["_paged_attention_kernel"].calls[0]

    call = launched()
    assert (call["BLOCK_M"], call["BLOCK_N"], call["FOLD_SCALE"]) == (32, 16, False)
    (tmp_path / "attention_configs.json").write_text("{not json")
    with pytest.warns(UserWarning, match="ignoring the attention config cache"):
        call = launched()
    default = ta.MIXED_CONFIG  # the step has cached prefixes
    assert (call["BLOCK_M"], call["BLOCK_N"]) == (default.block_m, default.block_n)


# --- CPU: compile the real launches for sm_90 -----------------------------------------------

@pytest.mark.slow
@compiled_only
def test_kernels_compile_for_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    kernels = record_launches(monkeypatch, ta, ("_store_kvcache_kernel", "_paged_attention_kernel", "_merge_splits_kernel"))
    mixed = make_case([(0, 20), (33, 1), (16, 40)], 16, 8, 2, 128, torch.bfloat16, "cpu", seed=3)
    decode = make_case([(100, 1), (7, 1)], 16, 8, 2, 128, torch.bfloat16, "cpu", seed=4)
    ta.store_kvcache(mixed.k, mixed.v, mixed.k_cache, mixed.v_cache, mixed.meta.slot_mapping)
    ta.paged_attention(mixed.q, mixed.k_cache, mixed.v_cache, mixed.meta, mixed.scale)
    ta.paged_attention(decode.q, decode.k_cache, decode.v_cache, decode.meta, decode.scale,
                       num_splits=4)
    scales = torch.tensor(0.5), torch.tensor(0.25)
    k8, v8 = fp8_pools(decode, *scales)
    ta.store_kvcache(decode.k, decode.v, k8, v8, decode.meta.slot_mapping, *scales)
    ta.paged_attention(decode.q, k8, v8, decode.meta, decode.scale, *scales)
    ta.paged_attention(mixed.q, *fp8_pools(mixed, *scales), mixed.meta, mixed.scale, *scales)
    narrow = make_case([(100, 1), (7, 1)], 16, 14, 2, 64, torch.bfloat16, "cpu", seed=6)
    for splits in (1, 4):  # heads of 64 (Qwen2.5-0.5B's): decode's 128-key tiles
        ta.paged_attention(narrow.q, narrow.k_cache, narrow.v_cache, narrow.meta, narrow.scale,
                           num_splits=splits)
    ta.paged_attention(narrow.q, *fp8_pools(narrow, *scales), narrow.meta, narrow.scale, *scales)
    prefill = make_case([(0, 300), (40, 200)], 256, 16, 8, 128, torch.bfloat16, "cpu", seed=5)
    monkeypatch.setattr(ta, "_has_tma", lambda device: True)  # CPU tensors, sm_90 code
    ta.paged_attention(prefill.q, prefill.k_cache, prefill.v_cache, prefill.meta, prefill.scale,
                       config=ta.KernelConfig(128, 64, 8, 3, tma=True))
    ta.paged_attention(prefill.q, prefill.k_cache, prefill.v_cache, prefill.meta, prefill.scale,
                       config=ta.KernelConfig(128, 64, 8, 2, maxnreg=128))
    wide = ta.KernelConfig(256, 64, 16, 3, fold_scale=False)
    ta.paged_attention(prefill.q, prefill.k_cache, prefill.v_cache, prefill.meta, prefill.scale, config=wide)
    ta.paged_attention(prefill.q, prefill.k_cache, prefill.v_cache, prefill.meta, prefill.scale)
    assert [len(r.calls) for r in kernels.values()] == [2, 11, 2]
    compile_recorded(kernels)
    attention = kernels["_paged_attention_kernel"]
    # A config's register cap reaches the compiler; the default prefill tiles and the 256-row
    # ones fit one H100/H200 block's shared memory (227 KiB).
    assert ".maxnreg 128" in compile_sm90(attention.fn, attention.calls[-3]).asm["ptx"]
    for call in attention.calls[-2:]:
        assert compile_sm90(attention.fn, call).metadata.shared <= 227 * 1024


@pytest.mark.slow
@compiled_only
def test_gluon_prefill_compiles_for_sm90_with_pv_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """Which steps the Gluon kernel takes on sm_90 (fresh prefills of any length by default,
    every step with prefill rows under a gluon config; never decode steps, fp8 pools, other head
    dims, pages of other than a power-of-two size or more sequences than its grid holds), and its
    real launches compiled for sm_90: TMA copies issued by a warp-specialised loader, one wgmma
    (the P @ V) in flight across the softmax, and with one compute warpgroup two blocks per SM
    (registers capped at 128, shared memory for two)."""
    monkeypatch.setattr(gluon_attention, "_is_sm90", lambda device: True)  # CPU tensors, sm_90 code
    gluon = record_launches(monkeypatch, gluon_attention, ("_prefill_kernel",))["_prefill_kernel"]
    triton_k = record_launches(monkeypatch, ta, ("_paged_attention_kernel",))["_paged_attention_kernel"]
    wide = ta.KernelConfig(128, 128, 8, 2, fold_scale=False, gluon=True)
    fresh = make_case([(0, 300), (0, 77)], 16, 16, 8, 128, torch.bfloat16, "cpu", seed=6)
    mixed = make_case([(0, 20), (33, 1), (16, 40)], 256, 8, 2, 64, torch.float16, "cpu", seed=7)
    decode = make_case([(100, 1), (7, 1)], 16, 8, 2, 128, torch.bfloat16, "cpu", seed=8)
    ta.paged_attention(fresh.q, fresh.k_cache, fresh.v_cache, fresh.meta, fresh.scale)
    ta.paged_attention(mixed.q, mixed.k_cache, mixed.v_cache, mixed.meta, mixed.scale, config=wide)
    fresh.meta.max_seqlen_q = 8192  # as if one prompt were long: still Gluon
    ta.paged_attention(fresh.q, fresh.k_cache, fresh.v_cache, fresh.meta, fresh.scale)
    assert len(gluon.calls) == 3 and not triton_k.calls
    odd = make_case([(0, 50)], 16, 4, 2, 96, torch.bfloat16, "cpu", seed=9)
    ta.paged_attention(odd.q, odd.k_cache, odd.v_cache, odd.meta, odd.scale)
    pages_of_24 = make_case([(0, 50)], 24, 4, 2, 128, torch.bfloat16, "cpu", seed=10)
    ta.paged_attention(pages_of_24.q, pages_of_24.k_cache, pages_of_24.v_cache, pages_of_24.meta,
                       pages_of_24.scale)
    fresh.meta.max_seqlen_q, fresh.meta.num_seqs = 300, 65536  # more sequences than a grid axis holds
    ta.paged_attention(fresh.q, fresh.k_cache, fresh.v_cache, fresh.meta, fresh.scale, config=wide)
    fresh.meta.num_seqs = 2
    ta.paged_attention(mixed.q, mixed.k_cache, mixed.v_cache, mixed.meta, mixed.scale)
    ta.paged_attention(decode.q, decode.k_cache, decode.v_cache, decode.meta, decode.scale, config=wide)
    scales = torch.tensor(0.5), torch.tensor(0.25)
    ta.paged_attention(fresh.q, *fp8_pools(fresh, *scales), fresh.meta, fresh.scale, *scales, config=wide)
    assert len(gluon.calls) == 3 and len(triton_k.calls) == 6
    for call in gluon.calls:
        kernel = compile_sm90(gluon.fn, call)
        ptx = kernel.asm["ptx"]
        waits = [ln.split()[-1] for ln in ptx.splitlines() if "wgmma.wait_group" in ln]
        assert "1;" in waits, waits
        assert "cp.async.bulk.tensor" in ptx and "setmaxnreg" in ptx
        blocks = 2 if call["num_warps"] == 4 else 1
        assert blocks * kernel.metadata.shared <= 227 * 1024
        assert f".maxnreg {gluon_attention._launch_registers(call['num_warps'])}" in ptx
    assert gluon_attention._launch_registers(4) == 128


@pytest.mark.slow
@compiled_only
def test_gluon_prefill_compiles_at_every_page_size_it_takes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pages of fewer than 8 slots stay on the Triton kernel: a TMA box of fewer rows would
    slice the 8-row atom of a key tile's swizzled buffer, which Gluon refuses to compile (an
    engine with ``block_size=4`` failed at start-up on sm_90). Every page size the Gluon kernel
    takes compiles for sm_90, at both head dims."""
    monkeypatch.setattr(gluon_attention, "_is_sm90", lambda device: True)  # CPU tensors, sm_90 code
    gluon = record_launches(monkeypatch, gluon_attention, ("_prefill_kernel",))["_prefill_kernel"]
    record_launches(monkeypatch, ta, ("_paged_attention_kernel",))
    taken = set()
    for block_size in (1, 2, 4, 8, 16, 128):
        for head_dim in (64, 128):
            case = make_case([(0, 50), (3, 7)], block_size, 4, 2, head_dim, torch.bfloat16, "cpu", seed=block_size)
            before = len(gluon.calls)
            ta.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                               config=ta.GLUON_PREFILL_CONFIG)
            if len(gluon.calls) > before:
                taken.add(block_size)
    assert sorted(taken) == [8, 16, 128]
    for call in gluon.calls:
        compile_sm90(gluon.fn, call)


@compiled_only
def test_a_triton_without_gluon_runs_every_step_on_the_triton_kernel() -> None:
    """Where Gluon does not import (Triton before 3.6), the backend still imports and picks the
    Triton kernel's configs for every step, on any device."""
    code = (
        "import sys; sys.modules['triton.experimental.gluon'] = None\n"
        "import torch\n"
        "from kvscope.kernels import triton_attention as ta\n"
        "from kvscope.kernels.base import AttentionMetadata\n"
        "assert ta.gluon_attention is None\n"
        "i = torch.zeros(2, dtype=torch.int32)\n"
        "meta = AttentionMetadata(i, i, i, i, i.view(2, 1), max_seqlen_q=8, max_seqlen_k=8, num_seqs=1,\n"
        "                         num_tokens=8, block_size=16, decode_only=False, no_prefix=True)\n"
        "q, k = torch.zeros(8, 4, 128, dtype=torch.bfloat16), torch.zeros(1, 16, 2, 128, dtype=torch.bfloat16)\n"
        "assert ta.default_config(q, k, meta) == ta.PREFILL_CONFIG\n"
        "assert not ta._gluon_runs(q, k, meta)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("fields", [dict(block_m=64, num_warps=8, num_stages=2),
                                    dict(block_m=128, num_warps=8, num_stages=1),
                                    dict(block_m=32, num_warps=2, num_stages=2)])
def test_a_gluon_config_its_kernel_cannot_run_is_refused_when_made(fields: dict) -> None:
    with pytest.raises(ValueError, match="gluon config needs num_warps 4 or 8"):
        ta.KernelConfig(block_n=64, gluon=True, **fields)
    ta.KernelConfig(block_n=64, **fields)  # the Triton kernel runs these tiles


# --- GPU -----------------------------------------------------------------------------------

GPU_MIXED = [(0, 300), (48, 77), (517, 130), (1000, 1), (33, 1), (0, 1), (255, 2), (96, 160)]
GPU_CASES = [(bs, g, d) for bs in (16, 32, 256) for g, d in ((1, 128), (2, 64), (4, 128), (8, 64))]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("block_size,group,head_dim", GPU_CASES)
def test_gpu_mixed_step(block_size: int, group: int, head_dim: int) -> None:
    """Fresh, prefix-cached and chunked prefills plus decode rows, one packed bf16 step."""
    case = make_case(GPU_MIXED, block_size, 2 * group, 2, head_dim, torch.bfloat16, "cuda",
                     seed=block_size * group + head_dim)
    out = ta.TritonAttentionBackend().forward(case.q, case.k, case.v, case.k_cache,
                                              case.v_cache, case.meta, case.scale)
    for i in range(len(GPU_MIXED)):
        k, v = gathered_history(case, i)
        assert torch.equal(k, case.hist_k[i]) and torch.equal(v, case.hist_v[i])
    assert rel_err(out, reference(case, torch.float32)) <= 1e-2


GPU_CONFIGS = [ta.PREFILL_CONFIG, ta.KernelConfig(128, 64, 8, 3, fold_scale=False),
               ta.KernelConfig(128, 64, 8, 3, tma=True), ta.KernelConfig(128, 128, 8, 2, tma=True),
               ta.KernelConfig(128, 64, 8, 2, maxnreg=128), ta.KernelConfig(256, 64, 16, 3, fold_scale=False)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config", GPU_CONFIGS)
@pytest.mark.parametrize("specs", [GPU_MIXED, [(0, 1000), (0, 333), (0, 64)]])
@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_prefill_configs(config: ta.KernelConfig, specs: list, block_size: int) -> None:
    """Every prefill variant the bench times, on mixed and on fresh-prefill steps (where the
    key loop runs unmasked below the diagonal, through TMA where a tile sits in one page)."""
    case = make_case(specs, block_size, 16, 8, 128, torch.bfloat16, "cuda", seed=block_size)
    ta.store_kvcache(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    out = ta.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                             config=config)
    assert rel_err(out, reference(case, torch.float32)) <= 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("block_size,group,head_dim", GPU_CASES[::4])
@pytest.mark.parametrize("config", [None, ta.KernelConfig(128, 64, 8, 3, tma=True)])
def test_gpu_fp8_kv_cache(block_size: int, group: int, head_dim: int,
                          config: ta.KernelConfig | None) -> None:
    """fp8 pools on the GPU: the store rounds as torch does (incl. clamping), the attention
    (default or TMA tiles) matches the torch reference backend over the same pools."""
    from kvscope.kernels.torch_attention import TorchReferenceBackend
    case = make_case(GPU_MIXED, block_size, 2 * group, 2, head_dim, torch.bfloat16, "cuda",
                     seed=block_size + group)
    k_scale = torch.tensor(0.006, device="cuda")
    v_scale = torch.tensor(0.02, device="cuda")
    k8, v8 = fp8_pools(case, k_scale, v_scale)
    k8_ref, v8_ref = k8.clone(), v8.clone()
    ta.store_kvcache(case.k, case.v, k8, v8, case.meta.slot_mapping, k_scale, v_scale)
    out = ta.paged_attention(case.q, k8, v8, case.meta, case.scale, k_scale, v_scale,
                             config=config)
    expect = TorchReferenceBackend().forward(case.q, case.k, case.v, k8_ref, v8_ref, case.meta,
                                             case.scale, k_scale, v_scale)
    assert torch.equal(k8.view(torch.uint8), k8_ref.view(torch.uint8))
    assert torch.equal(v8.view(torch.uint8), v8_ref.view(torch.uint8))
    assert rel_err(out, expect) <= 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("block_size,group,head_dim", GPU_CASES[::3])
@pytest.mark.parametrize("num_splits", [None, 1, 5, 16])
def test_gpu_decode_split_kv(block_size: int, group: int, head_dim: int,
                             num_splits: int | None) -> None:
    """Decode with and without splitting histories (None: the heuristic, which splits here)."""
    specs = [(c, 1) for c in (0, 700, 2048, 63, 4100)]
    case = make_case(specs, block_size, 2 * group, 2, head_dim, torch.bfloat16, "cuda", seed=7)
    if num_splits is None:
        assert ta.choose_num_splits(case.meta, 2, case.q.device) > 1
    ta.store_kvcache(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    out = ta.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale,
                             num_splits=num_splits)
    assert rel_err(out, reference(case, torch.float32)) <= 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("block_size", [16, 256])
def test_gpu_decode_narrow_heads_over_whole_histories(block_size: int) -> None:
    """Heads of 64 with enough sequences to fill the GPU unsplit take 128-key tiles (fewer
    sequences split, on 64-key tiles); either way the output is the reference's."""
    gen = torch.Generator().manual_seed(block_size)
    for num_seqs in (300, 8):
        specs = [(int(c), 1) for c in torch.randint(0, 1500, (num_seqs,), generator=gen)]
        case = make_case(specs, block_size, 14, 2, 64, torch.bfloat16, "cuda", seed=num_seqs)
        splits = ta.choose_num_splits(case.meta, 2, case.q.device)
        assert (splits == 1) == (num_seqs == 300)
        config = ta.default_config(case.q, case.k_cache, case.meta)
        assert config == (ta.attention_configs.NARROW_DECODE_CONFIG if splits == 1
                          else ta.DECODE_CONFIG)
        ta.store_kvcache(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
        out = ta.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale)
        assert rel_err(out, reference(case, torch.float32)) <= 1e-2


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("num_seqs", [4, 96])  # split-KV and plain decode inside the graph
def test_gpu_cuda_graph_replay(num_seqs: int) -> None:
    """Capture one decode step (store + attend), replay it on new data: equals eager."""
    gen = torch.Generator().manual_seed(num_seqs)
    lens = torch.randint(1, 900, (num_seqs,), generator=gen).tolist()
    case = make_case([(n, 1) for n in lens], 16, 8, 2, 128, torch.bfloat16, "cuda", seed=11)
    meta, backend = case.meta, ta.TritonAttentionBackend()
    meta.max_seqlen_k = 2048  # what a runner captures with: the bucket's largest context
    # Pages for one more token per sequence, so the replay can advance every context by one.
    spare = torch.randperm(num_seqs, generator=gen).to("cuda", torch.int32) + case.k_cache.shape[0]
    pool = (torch.full((num_seqs, *case.k_cache.shape[1:]), float("nan"), dtype=torch.bfloat16,
                       device="cuda"))
    k_cache, v_cache = torch.cat([case.k_cache, pool]), torch.cat([case.v_cache, pool])
    args = [case.q, case.k, case.v]

    def step() -> torch.Tensor:
        return backend.forward(*args, k_cache, v_cache, meta, case.scale)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()

    # Next step: every sequence grows by one token into a new page of its own.
    pos = meta.context_lens.long()
    for i in range(num_seqs):
        if int(pos[i]) % 16 == 0:
            meta.block_tables[i, int(pos[i]) // 16] = spare[i]
    meta.context_lens += 1
    meta.slot_mapping.copy_(meta.block_tables.gather(1, (pos // 16)[:, None])[:, 0].long() * 16
                            + pos % 16)
    for t in args:
        t.copy_(torch.randn(t.shape, generator=gen).to(t))
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()
    eager = step()
    assert torch.isfinite(eager).all() and torch.equal(replayed, eager)


GLUON_CONFIGS = [ta.GLUON_PREFILL_CONFIG, ta.KernelConfig(128, 128, 8, 2, fold_scale=False, gluon=True),
                 ta.KernelConfig(64, 64, 4, 3, gluon=True)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config", GLUON_CONFIGS)
@pytest.mark.parametrize("block_size,group,head_dim", GPU_CASES[::2] + GPU_CASES[1::6])
@pytest.mark.parametrize("specs", [GPU_MIXED, [(0, 1000), (0, 333), (0, 64)]])
def test_gpu_gluon_prefill(config: ta.KernelConfig, block_size: int, group: int, head_dim: int,
                           specs: list) -> None:
    """The Gluon kernel on fresh prefills and on mixed steps (prefix-cached and chunked
    prefills, decode rows) over a NaN-poisoned pool, against the dense reference."""
    case = make_case(specs, block_size, 2 * group, 2, head_dim, torch.bfloat16, "cuda",
                     seed=block_size + group + head_dim)
    assert gluon_attention.supports(case.q, case.k_cache, case.meta)
    ta.store_kvcache(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    out = ta.paged_attention(case.q, case.k_cache, case.v_cache, case.meta, case.scale, config=config)
    assert rel_err(out, reference(case, torch.float32)) <= 1e-2


@pytest.mark.gpu
@needs_cuda
def test_gpu_gluon_prefill_fp16_and_strided_q_in_a_cuda_graph() -> None:
    """fp16, q a strided view of a packed qkv projection, launched from a captured graph and
    replayed on new queries: equals the eager launch and the reference."""
    case = make_case([(0, 700), (0, 129), (0, 1)], 16, 16, 4, 128, torch.float16, "cuda", seed=12)
    ta.store_kvcache(case.k, case.v, case.k_cache, case.v_cache, case.meta.slot_mapping)
    qkv = torch.zeros(case.q.shape[0], 24, 128, dtype=torch.float16, device="cuda")
    q = qkv[:, :16]
    q.copy_(case.q)

    def step() -> torch.Tensor:
        return ta.paged_attention(q, case.k_cache, case.v_cache, case.meta, case.scale)

    assert ta.default_config(q, case.k_cache, case.meta).gluon
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    q.copy_(torch.randn(q.shape, generator=torch.Generator().manual_seed(13)).to(q))
    graph.replay()
    torch.cuda.synchronize()
    case.q = q.clone()
    assert torch.equal(out, step())
    assert rel_err(out, reference(case, torch.float32)) <= 1e-2


# --- backend selection ---------------------------------------------------------------------

def test_select_backend() -> None:
    from kvscope.kernels.select import select_backend
    assert select_backend("auto", "cpu").name == "torch"
    if INTERPRETED:
        assert select_backend("triton", "cpu").name == "triton"
    else:
        with pytest.raises(ValueError, match="attention_backend='triton' runs on CUDA devices, not on 'cpu'"):
            select_backend("triton", "cpu")
    if torch.cuda.is_available():
        assert select_backend("auto", "cuda").name == "triton"
    with pytest.raises(ValueError, match="attention_backend"):
        select_backend("flash", "cpu")
