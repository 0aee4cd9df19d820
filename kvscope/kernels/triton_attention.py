"""Triton kernels over the paged KV pool: the KV store and one paged attention kernel.

Everything lives in this one module on purpose: the CPU tests load a private copy of it with
``TRITON_INTERPRET=1`` (Triton picks interpreter or compiler when ``@triton.jit`` runs), which
only works if no kernel it runs there is imported from a sibling module (``gluon_attention``'s
sm_90 kernel never runs on CPU).

One attention kernel serves every step shape (fresh prefill, chunked or prefix-cached prefill,
decode, and mixtures of them in one packed batch): each program takes a tile of query rows of
one sequence and one KV head, walks that sequence's history through its block table, and keeps
an online softmax in fp32. For decode batches too small to fill the GPU, the same kernel splits
each history across programs (flash-decoding) and a second kernel merges the partial results.
Nothing reads device memory on the host, so both launches can be captured in a CUDA graph.
On sm_90, fresh prefills and any step with prefill rows under a config with ``gluon=True`` go
to ``gluon_attention`` instead (warp-specialised TMA loads, hand-scheduled wgmma that overlaps
``P @ V`` with the softmax); :func:`paged_attention` dispatches.

Prefill is compute-bound, so its key loop does the least work per key tile: q carries the
softmax scale (scores feed ``exp2`` directly), tiles wholly below the causal diagonal run a
loop with no masks at all, a tile that sits inside one page costs one block-table lookup and
loads contiguous rows (optionally by TMA), and the next tile's pages are looked up one
iteration ahead so K/V loads pipeline ``num_stages - 1`` tiles deep. Decode is memory-bound
and keeps its small tiles; in a mixed step, decode rows get small tiles of their own.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import triton
import triton.language as tl

from kvscope.kernels import attention_configs
from kvscope.kernels.attention_configs import (DECODE_CONFIG, GLUON_PREFILL_CONFIG,
                                               MIXED_CONFIG, PREFILL_CONFIG,
                                               KernelConfig)
from kvscope.kernels.base import LOG2E, AttentionMetadata
from kvscope.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_options

try:
    from kvscope.kernels import gluon_attention
except ImportError:  # a Triton without Gluon's Hopper ops (before 3.6): every step runs the Triton kernel
    gluon_attention = None

FP8_MAX = tl.constexpr(448.0)  # largest finite float8_e4m3fn
_SEQ_CHUNK = tl.constexpr(256)  # sequences a program scans per load to find its own


@triton.jit
def _store_kvcache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    k_stride_t, k_stride_h, v_stride_t, v_stride_h,
    c_stride_slot, c_stride_h,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):
    """One program per token: copy its K and V (all KV heads) into its slot, unless slot < 0.
    FP8: store ``x / scale`` clamped to the e4m3 range."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h < NUM_KV_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    cache_off = slot * c_stride_slot + h[:, None] * c_stride_h + d[None, :]
    k = tl.load(k_ptr + t * k_stride_t + h[:, None] * k_stride_h + d[None, :], mask=mask)
    tl.store(k_cache_ptr + cache_off, quantize_for_pool(k, k_scale_ptr, k_cache_ptr, FP8), mask=mask)
    v = tl.load(v_ptr + t * v_stride_t + h[:, None] * v_stride_h + d[None, :], mask=mask)
    tl.store(v_cache_ptr + cache_off, quantize_for_pool(v, v_scale_ptr, v_cache_ptr, FP8), mask=mask)


@triton.jit
def quantize_for_pool(x, scale_ptr, cache_ptr, FP8: tl.constexpr):
    """``x`` as the cache stores it (see ``kv_quant.quantize_kv``); every kernel that writes the
    pool goes through here."""
    if FP8:
        x = x.to(tl.float32) / tl.load(scale_ptr)
        x = tl.minimum(tl.maximum(x, -FP8_MAX), FP8_MAX)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _tile_pages(table, t, t_end, kv_end, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Block-table entries of key tile ``t`` (zeros for a tile at or past ``t_end``). A tile
    inside one page (page size a multiple of BLOCK_N) needs one entry and its slots are
    contiguous; otherwise each key position has its own (zero past ``kv_end``)."""
    if PAGE_SIZE % BLOCK_N == 0:
        pages = tl.load(table + (t * BLOCK_N) // PAGE_SIZE, mask=t < t_end, other=0)
    else:
        pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
        pages = tl.load(table + pos // PAGE_SIZE, mask=(pos < kv_end) & (t < t_end), other=0)
    return pages


@triton.jit
def _load_keys(ptr, desc, slot, row0, col0, c_stride_slot, pos_ok, d, HEAD_DIM: tl.constexpr,
               BLOCK_D: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr):
    """[BLOCK_N, BLOCK_D] rows of the pool; zeros where masked. Unmasked tiles load with no
    mask at all when the head dim fills BLOCK_D, so the loads vectorise fully; with TMA (a tile
    inside one page, BLOCK_D == HEAD_DIM) they are one bulk copy from ``desc`` at row0, col0."""
    if TMA and not MASKED:
        return desc.load([row0, col0])
    ptrs = ptr + slot[:, None] * c_stride_slot + d[None, :]
    if MASKED:
        return tl.load(ptrs, mask=pos_ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    if HEAD_DIM == BLOCK_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(d < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def _attend_key_tiles(q, q_pos, m_i, l_i, acc, k_ptr, v_ptr, k_desc, v_desc, col0, table,
                      c_stride_slot, t_begin, t_end, kv_end, d, qk_scale,
                      PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                      BLOCK_D: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr):
    """Online-softmax update over key tiles [t_begin, t_end); ``q . k * qk_scale`` are the
    scores in log2 units (``qk_scale`` is the constant 1 when q carries the scale, and the
    multiply folds away; else it fuses into the exp2's subtraction). MASKED tiles (the causal
    diagonal, the history's end) compare every key with every row; the others are wholly
    visible to every row and skip that work."""
    pages = _tile_pages(table, t_begin, t_end, kv_end, PAGE_SIZE, BLOCK_N)
    for t in range(t_begin, t_end):
        pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
        pos_ok = pos < kv_end
        slot = pages.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE
        row0 = 0
        if TMA:  # one page per tile: the tile's first slot
            row0 = pages * PAGE_SIZE + (t * BLOCK_N) % PAGE_SIZE
        # Look up the next tile's pages now: a K/V address that depends on a load of the same
        # iteration keeps Triton's pipeliner from fetching K/V more than one tile ahead.
        pages = _tile_pages(table, t + 1, t_end, kv_end, PAGE_SIZE, BLOCK_N)
        k = _load_keys(k_ptr, k_desc, slot, row0, col0, c_stride_slot, pos_ok, d, HEAD_DIM,
                       BLOCK_D, MASKED, TMA)
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
        if MASKED:
            s = tl.where(pos[None, :] <= q_pos[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            m_safe = m_new
        p = tl.exp2(s * qk_scale - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_keys(v_ptr, v_desc, slot, row0, col0, c_stride_slot, pos_ok, d, HEAD_DIM,
                       BLOCK_D, MASKED, TMA)
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None])
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _attend_query_tile(
    q_ptr, k_cache_ptr, v_cache_ptr, k_desc, v_desc, out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr,
    table, k_scale_ptr, v_scale_ptr, tok0, q_begin, q_end, ctx, kv_head, split,
    num_splits, num_q_heads, scale_log2, q_stride_t, q_stride_h, o_stride_t, o_stride_h,
    c_stride_slot, c_stride_h,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, UNMASKED_FIRST: tl.constexpr, FP8: tl.constexpr,
    FOLD_SCALE: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr,
):
    """Attention of query tokens [tok0, tok0 + BLOCK_Q) of one sequence (x GROUP query heads
    of one KV head) over its history, or over one split's share of it. With PDL, everything up
    to q's load (the step's uploaded metadata) overlaps the kernel before, which writes q and
    this step's K/V."""
    first_pos = ctx - (q_end - q_begin)  # absolute position of the sequence's first query row
    r = tl.arange(0, BLOCK_M)
    tok = tok0 + r // GROUP
    head = kv_head * GROUP + r % GROUP
    row_ok = (r < BLOCK_Q * GROUP) & (tok < q_end)
    q_pos = first_pos + (tok - q_begin)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    if PDL:
        gdc_wait()
    q = tl.load(q_ptr + tok[:, None] * q_stride_t + head[:, None] * q_stride_h + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if FP8:
        scale_log2 = scale_log2 * tl.load(k_scale_ptr)
    if FOLD_SCALE:  # scores come out of the dot ready for exp2
        q = (q.to(tl.float32) * scale_log2).to(q.dtype)
        qk_scale = 1.0
    else:
        qk_scale = scale_log2

    # Keys this tile can see end at its last query row; with SPLIT, take one share of them.
    kv_end = first_pos + (tl.minimum(tok0 + BLOCK_Q, q_end) - q_begin)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    if SPLIT:
        per_split = tl.cdiv(num_tiles, num_splits)
        t_begin = split * per_split
        t_end = tl.minimum(t_begin + per_split, num_tiles)
    else:
        t_begin = 0
        t_end = num_tiles

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_off = kv_head * c_stride_h
    k_ptr, v_ptr = k_cache_ptr + kv_off, v_cache_ptr + kv_off
    t_masked = t_begin
    if UNMASKED_FIRST:
        # Key tiles every row of this tile sees whole need no causal mask: run them apart.
        # (Decode skips this: it masks one tile at most, and a second loop costs registers.)
        t_masked = tl.minimum(tl.maximum((first_pos + (tok0 - q_begin) + 1) // BLOCK_N, t_begin),
                              t_end)
        m_i, l_i, acc = _attend_key_tiles(
            q, q_pos, m_i, l_i, acc, k_ptr, v_ptr, k_desc, v_desc, kv_head * HEAD_DIM, table,
            c_stride_slot, t_begin, t_masked, kv_end, d, qk_scale, PAGE_SIZE, BLOCK_N,
            HEAD_DIM, BLOCK_D, False, TMA)
    m_i, l_i, acc = _attend_key_tiles(
        q, q_pos, m_i, l_i, acc, k_ptr, v_ptr, k_desc, v_desc, kv_head * HEAD_DIM, table,
        c_stride_slot, t_masked, t_end, kv_end, d, qk_scale, PAGE_SIZE, BLOCK_N,
        HEAD_DIM, BLOCK_D, True, TMA)
    if FP8:
        acc = acc * tl.load(v_scale_ptr)

    if SPLIT:
        row = (tok * num_q_heads + head) * num_splits + split
        tl.store(part_m_ptr + row, m_i, mask=row_ok)
        tl.store(part_l_ptr + row, l_i, mask=row_ok)
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc,
                 mask=row_ok[:, None] & d_ok[None, :])
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # empty history -> zeros, not NaN
        tl.store(out_ptr + tok[:, None] * o_stride_t + head[:, None] * o_stride_h + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _owning_sequence(cu_q_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr):
    """The last sequence whose first tile is at or before ``tile`` (first tiles are monotone).
    Counting them over a vector of sequences costs one load latency per _SEQ_CHUNK sequences,
    where a binary search waits on log2(num_seqs) loads in a row before the tile can start."""
    count = tl.full([], 0, tl.int32)
    for first in range(0, num_seqs, _SEQ_CHUNK):
        s = first + tl.arange(0, _SEQ_CHUNK)
        starts = (tl.load(cu_q_ptr + s, mask=s < num_seqs, other=0) + s * (BLOCK_Q - 1)) // BLOCK_Q
        count += tl.sum(((starts <= tile) & (s < num_seqs)).to(tl.int32), 0)
    return count - 1


# Arguments that change from step to step are not specialised on (Triton compiles a variant per
# value class of an int: 1, a multiple of 16, other), so a run compiles no new variant midway.
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "bt_stride"])
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_desc, v_desc, out_ptr,
    part_acc_ptr, part_m_ptr, part_l_ptr,
    cu_q_ptr, ctx_ptr, block_table_ptr, k_scale_ptr, v_scale_ptr,
    num_seqs, num_splits, num_q_heads, scale_log2,
    q_stride_t, q_stride_h, o_stride_t, o_stride_h,
    c_stride_slot, c_stride_h, bt_stride,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, DECODE: tl.constexpr, FP8: tl.constexpr,
    FOLD_SCALE: tl.constexpr, SMALL_M: tl.constexpr, TMA: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (query tiles, KV heads, splits). A tile is BLOCK_Q query tokens x GROUP query heads.

    FP8 pools are dequantized in registers: keys and values are cast to q's dtype as they load
    (exact: every e4m3 value is a bf16/fp16 value), ``k_scale`` multiplies the scores and
    ``v_scale`` the accumulated output, both read from device memory (CUDA-graph safe).

    Sequence ``s`` owns tiles starting at ``(cu_q[s] + s * (BLOCK_Q - 1)) // BLOCK_Q``: that
    index is monotone and leaves room for ``ceil(q_len / BLOCK_Q)`` tiles per sequence, so the
    grid needs only host ints (T, B) and a program finds its sequence by counting.

    DECODE (every sequence has one query row): sequence s owns tile s, with no counting.

    SMALL_M > 0 (mixed steps): a sequence of at most SMALL_M query rows, such as a decode row,
    runs a tile of SMALL_M rows instead of BLOCK_M, so it does not pay for a prefill-sized dot.
    """
    if PDL:
        gdc_launch_dependents()
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if DECODE:
        seq = tile
    else:
        # Causal prefill: the last tiles of a sequence see the most keys, so start them first
        # and let the short ones fill the tail of the grid.
        tile = tl.num_programs(0) - 1 - tile
        seq = _owning_sequence(cu_q_ptr, num_seqs, tile, BLOCK_Q)
    q_begin = tl.load(cu_q_ptr + seq)
    q_end = tl.load(cu_q_ptr + seq + 1)
    tok0 = q_begin + (tile - (q_begin + seq * (BLOCK_Q - 1)) // BLOCK_Q) * BLOCK_Q
    if tok0 >= q_end:
        return
    ctx = tl.load(ctx_ptr + seq)
    table = block_table_ptr + seq.to(tl.int64) * bt_stride
    if SMALL_M > 0:
        if (q_end - q_begin) * GROUP <= SMALL_M:
            _attend_query_tile(
                q_ptr, k_cache_ptr, v_cache_ptr, k_desc, v_desc, out_ptr,
                part_acc_ptr, part_m_ptr, part_l_ptr,
                table, k_scale_ptr, v_scale_ptr, tok0, q_begin, q_end, ctx, kv_head, split,
                num_splits, num_q_heads, scale_log2, q_stride_t, q_stride_h,
                o_stride_t, o_stride_h, c_stride_slot, c_stride_h,
                PAGE_SIZE, GROUP, HEAD_DIM, BLOCK_D,
                SMALL_M, SMALL_M // GROUP, BLOCK_N, SPLIT, False, FP8, FOLD_SCALE, False, PDL)
            return
    _attend_query_tile(
        q_ptr, k_cache_ptr, v_cache_ptr, k_desc, v_desc, out_ptr,
        part_acc_ptr, part_m_ptr, part_l_ptr,
        table, k_scale_ptr, v_scale_ptr, tok0, q_begin, q_end, ctx, kv_head, split,
        num_splits, num_q_heads, scale_log2, q_stride_t, q_stride_h, o_stride_t, o_stride_h,
        c_stride_slot, c_stride_h, PAGE_SIZE, GROUP, HEAD_DIM, BLOCK_D,
        BLOCK_M, BLOCK_Q, BLOCK_N, SPLIT, not DECODE, FP8, FOLD_SCALE, TMA, PDL)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    part_acc_ptr, part_m_ptr, part_l_ptr, out_ptr,
    num_splits, o_stride_t, o_stride_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr,
):
    """Grid (tokens, query heads): merge the per-split softmax states of one output row."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(0)
    h = tl.program_id(1)
    row0 = (t * tl.num_programs(1) + h) * num_splits
    s = tl.arange(0, BLOCK_S)
    s_ok = s < num_splits
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    m = tl.load(part_m_ptr + row0 + s, mask=s_ok, other=float("-inf"))
    l = tl.load(part_l_ptr + row0 + s, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    acc = tl.load(part_acc_ptr + (row0 + s)[:, None] * HEAD_DIM + d[None, :],
                  mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    denom = tl.sum(w * l, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + t * o_stride_t + h * o_stride_h + d, out.to(out_ptr.dtype.element_ty),
             mask=d_ok)


MAX_SPLITS = 32


def _check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """The kernels address a layer cache as flat slots; both caches share one layout."""
    if k_cache.stride() != v_cache.stride() or k_cache.shape != v_cache.shape:
        raise ValueError("k_cache and v_cache must have the same shape and strides")
    if k_cache.stride(-1) != 1 or k_cache.stride(0) != k_cache.shape[1] * k_cache.stride(1):
        raise ValueError(f"cache must be [N, block_size, H_kv, D] with flat slots, got strides "
                         f"{tuple(k_cache.stride())}")


def _scale_arg(scale: torch.Tensor | float, cache: torch.Tensor) -> torch.Tensor:
    """The pointer a kernel reads a scale from: the engine's 0-d fp32 device tensors pass
    through; a pool that is not fp8 never reads it, so the cache itself stands in (no host
    copy, which a CUDA graph capture would refuse)."""
    if cache.dtype != torch.float8_e4m3fn:
        return cache
    if isinstance(scale, torch.Tensor) and scale.dtype == torch.float32 and scale.device == cache.device:
        return scale
    return torch.as_tensor(scale, dtype=torch.float32, device=cache.device)


def _tma_descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, config: KernelConfig,
                     block_size: int, block_d: int) -> tuple:
    """Host-side TMA descriptors of the pools seen as [slots, H_kv * D] (encoded at launch, so a
    captured CUDA graph keeps them), or the caches themselves where TMA does not apply."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if not (config.tma and block_size % config.block_n == 0 and head_dim == block_d
            and k_cache.stride(2) == head_dim and _has_tma(k_cache.device)):
        return k_cache, v_cache
    from triton.tools.tensor_descriptor import TensorDescriptor
    shape = [k_cache.shape[0] * block_size, num_kv_heads * head_dim]
    return tuple(TensorDescriptor(c, shape, [k_cache.stride(1), 1], [config.block_n, head_dim])
                 for c in (k_cache, v_cache))


@functools.lru_cache(maxsize=None)
def _has_tma(device: torch.device) -> bool:
    """TMA needs sm_90+; the interpreter (CPU tensors) emulates it."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device)[0] >= 9


def store_kvcache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  k_scale: torch.Tensor | float = 1.0, v_scale: torch.Tensor | float = 1.0) -> None:
    """Write ``k[t]``/``v[t]`` ([T, H_kv, D]) into slot ``slot_mapping[t]``; -1 skips a token.
    An fp8 cache stores them quantized with ``k_scale`` / ``v_scale``."""
    _check_cache(k_cache, v_cache)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v must be contiguous in the head dimension")
    _store_kvcache_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        _scale_arg(k_scale, k_cache), _scale_arg(v_scale, k_cache),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=k_cache.dtype == torch.float8_e4m3fn, **pdl_options(k.device),
    )


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """The SMs of ``device`` (0 off CUDA): how many programs a launch keeps resident."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(meta: AttentionMetadata, num_kv_heads: int, device: torch.device,
                      block_n: int = DECODE_CONFIG.block_n) -> int:
    """Split decode histories when (sequences x KV heads) programs leave SMs idle.

    Below two programs per SM, aim at about eight (two waves of the ~4 decode programs an SM
    holds; on an H200 this picked the fastest of the split counts measured for B=4 and B=16 at
    8 KV heads), keep at least two key tiles per split, and round down to a power of two so few
    kernel variants get compiled.
    """
    programs = meta.num_seqs * num_kv_heads
    sms = sm_count(device)
    if not meta.decode_only or programs == 0 or programs >= 2 * sms:
        return 1
    most = max(1, meta.max_seqlen_k // (2 * block_n))
    want = min(MAX_SPLITS, triton.cdiv(8 * sms, programs), most)
    return 1 << (want.bit_length() - 1)


def _gluon_runs(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
    return gluon_attention is not None and gluon_attention.supports(q, k_cache, meta)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, k_scale: torch.Tensor | float = 1.0,
                    v_scale: torch.Tensor | float = 1.0, *, config: KernelConfig | None = None,
                    num_splits: int | None = None) -> torch.Tensor:
    """Causal attention of packed query rows ``q`` [T, Hq, D] over their paged histories;
    an fp8 cache is dequantized with ``k_scale`` / ``v_scale``.

    ``config`` defaults to :func:`default_config` (tuned per GPU and shape class where
    :func:`tune_paged_attention` ran) and ``num_splits`` to :func:`choose_num_splits`; tests
    and benchmarks pass them to reach every path.
    """
    _check_cache(k_cache, v_cache)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads} query heads do not group over {num_kv_heads} KV heads")
    if k_cache.shape[1] != meta.block_size:
        raise ValueError(f"cache page holds {k_cache.shape[1]} slots, meta.block_size is "
                         f"{meta.block_size}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    group = num_q_heads // num_kv_heads
    config = config or default_config(q, k_cache, meta)
    if config.gluon and not meta.decode_only and _gluon_runs(q, k_cache, meta):
        return gluon_attention.prefill_attention(q, k_cache, v_cache, out, meta, scale, config.block_m,
                                                 config.block_n, config.num_warps, config.num_stages)
    if num_splits is None:
        num_splits = choose_num_splits(meta, num_kv_heads, q.device, config.block_n)
    block_m = max(config.block_m, triton.next_power_of_2(group))
    # Decode rows next to prefills (a mixed step) get their own small tiles; a fresh prefill
    # or a decode batch has no use for them.
    small_m = max(16, triton.next_power_of_2(group))
    small_m = small_m if not (meta.decode_only or meta.no_prefix) and small_m < block_m else 0
    block_q = block_m // group
    num_tiles = (num_tokens + meta.num_seqs * (block_q - 1)) // block_q
    block_d = triton.next_power_of_2(head_dim)
    split = num_splits > 1
    if split:
        part_acc = torch.empty((num_tokens, num_q_heads, num_splits, head_dim),
                               dtype=torch.float32, device=q.device)
        part_m = torch.empty((num_tokens, num_q_heads, num_splits),
                             dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = out  # unused: the SPLIT=False branch never touches them
    k_desc, v_desc = _tma_descriptors(k_cache, v_cache, config, meta.block_size, block_d)
    pdl = pdl_options(q.device)
    _paged_attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        q, k_cache, v_cache, k_desc, v_desc, out,
        part_acc, part_m, part_l,
        meta.cu_seqlens_q, meta.context_lens, meta.block_tables,
        _scale_arg(k_scale, k_cache), _scale_arg(v_scale, k_cache),
        meta.num_seqs, num_splits, num_q_heads, scale * LOG2E,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
        PAGE_SIZE=meta.block_size, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=config.block_n, SPLIT=split,
        DECODE=meta.decode_only, FP8=k_cache.dtype == torch.float8_e4m3fn,
        FOLD_SCALE=config.fold_scale, SMALL_M=small_m, TMA=k_desc is not k_cache,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl,
        **({} if config.maxnreg is None else {"maxnreg": config.maxnreg}),
    )
    if split:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            part_acc, part_m, part_l, out,
            num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits),
            **pdl,
        )
    return out


def _shape_key(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> str:
    return attention_configs.shape_key(
        q.device, "prefill" if meta.no_prefix else "mixed", meta.block_size,
        q.shape[1] // k_cache.shape[2], q.shape[2], q.dtype, k_cache.dtype, meta.max_seqlen_q)


def default_config(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> KernelConfig:
    """For decode steps :func:`attention_configs.decode_config` (by head size and whether the
    histories split); for others the tuned choice of their shape class on this GPU (see
    :func:`tune_paged_attention`), else, for fresh prefills, GLUON_PREFILL_CONFIG where the
    Gluon kernel runs and PREFILL_CONFIG otherwise, and MIXED_CONFIG for steps with cached
    prefixes (decode rows, chunked prefill)."""
    if meta.decode_only:
        return attention_configs.decode_config(
            q.shape[2], choose_num_splits(meta, k_cache.shape[2], q.device))
    tuned = attention_configs.tuned_config(_shape_key(q, k_cache, meta))
    if tuned is not None:
        return tuned
    if not meta.no_prefix:
        return MIXED_CONFIG
    if _gluon_runs(q, k_cache, meta):
        return GLUON_PREFILL_CONFIG
    return PREFILL_CONFIG


def tune_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         meta: AttentionMetadata, scale: float,
                         timer: Callable[[Callable[[], object]], float] | None = None
                         ) -> KernelConfig:
    """Pick the fastest of ``attention_configs.TUNE_CANDIDATES`` for this prefill or mixed step's
    shape class on this GPU and cache it on disk; later calls of that class use it. ``timer``
    (ms of a callable) defaults to ``triton.testing.do_bench``'s median."""
    if meta.decode_only:
        raise ValueError("tune_paged_attention tunes prefill and mixed steps; decode keeps "
                         "attention_configs.decode_config and its split heuristic")
    if timer is None:
        from triton.testing import do_bench

        def timer(fn: Callable[[], object]) -> float:
            return do_bench(fn, warmup=25, rep=100, return_mode="median")

    def run(config: KernelConfig) -> torch.Tensor:
        return paged_attention(q, k_cache, v_cache, meta, scale, config=config)

    return attention_configs.tune(_shape_key(q, k_cache, meta), run, timer)


def interpreted() -> bool:
    """Whether this module's kernels run in Triton's interpreter (``TRITON_INTERPRET=1`` when it
    was imported): the only way they run on CPU tensors."""
    return not isinstance(_paged_attention_kernel, triton.runtime.JITFunction)


class TritonAttentionBackend:
    """Store this step's K/V into the pool (unless the fused RoPE kernel did), then run the
    paged kernel over every row."""

    name = "triton"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, k_scale: torch.Tensor | float = 1.0,
                v_scale: torch.Tensor | float = 1.0, kv_stored: bool = False) -> torch.Tensor:
        if not kv_stored:
            store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        return paged_attention(q, k_cache, v_cache, meta, scale, k_scale, v_scale)
