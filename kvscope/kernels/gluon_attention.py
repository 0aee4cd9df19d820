"""Prefill attention over the paged pool for Hopper (sm_90), written in Gluon.

Why a second kernel next to ``triton_attention``: on Hopper, Triton's ``tl.dot`` waits for
each wgmma it issues (``wgmma.wait_group 0``), so the tensor cores sit idle while every key
tile's softmax runs. Gluon exposes the asynchronous wgmma and its wait, and this kernel
schedules them by hand as FlashAttention-3 does inside one warpgroup: the scores of key tile
``j`` and the ``P @ V`` of tile ``j - 1`` are in flight together, and the softmax of tile ``j``
runs while ``P @ V`` still computes. With 64-key tiles Q sits in registers as the scores'
operand, so only K is read from shared memory there.

The rest is the paged kernel's contract (``AttentionMetadata``): each program takes ``BM``
query rows of one sequence and one query head, walks that sequence's keys through its block
table in ``BN``-key tiles held in a ring of ``STAGES`` shared buffers, masks only tiles that
reach the causal diagonal, and starts with the query tiles that have the most keys. How a
tile gets there depends on the page size:

- pages of at least a tile (``block_size % BN == 0``): one TMA copy each for K and V, issued
  by one thread and landing on the buffer's mbarrier, so the warps spend no instructions on
  loads;
- smaller pages: every thread copies its rows with ``cp.async`` from slots looked up one tile
  ahead (Triton puts a CTA barrier before each TMA copy, and a tile of four pages would take
  eight of them).

Positions past a sequence's context never reach the output: ``cp.async`` zero-fills them, and
the last TMA tile's stale V rows (which may hold anything, NaN included) are zeroed in shared
memory before ``P @ V`` reads them (their scores are masked already).

It runs where :func:`supports` says (sm_90, a bf16 or fp16 pool, head dim 64 or 128); the
Triton kernel serves every other case and the CPU interpreter, which Gluon lacks.
"""
from __future__ import annotations

import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kvscope.kernels.base import AttentionMetadata

_LOG2E = 1.4426950408889634
# Triton 3.6 names the CTA-wide barrier thread_barrier; later versions call it barrier.
_cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
HEAD_DIMS = (64, 128)
_MAX_GRID_Z = 65535
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@gluon.jit
def _page_rows(table, pos0, ctx, c_stride_slot, BS: gl.constexpr, BN: gl.constexpr,
               layout: gl.constexpr):
    """Element offsets of the pool slots holding positions ``[pos0, pos0 + BN)``, and which
    of them exist (``< ctx``); K and V share them."""
    pos = pos0 + gl.arange(0, BN, layout=gl.SliceLayout(1, layout))
    ok = pos < ctx
    page = gl.load(table + pos // BS, mask=ok, other=0)
    return (page.to(gl.int64) * BS + pos % BS) * c_stride_slot, ok


@gluon.jit
def _load_rows(smem, cache, rows, ok, col0, D: gl.constexpr, layout: gl.constexpr):
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    async_copy.async_copy_global_to_shared(smem, cache + rows[:, None] + col0 + cols[None, :],
                                           mask=ok[:, None] & (cols < D)[None, :])


@gluon.jit
def _copy_tile(k_src, v_src, k_buf, v_buf, bar, table, pos0, ctx, kv_col, BS: gl.constexpr,
               BN: gl.constexpr, D: gl.constexpr):
    """TMA copies of key tile ``[pos0, pos0 + BN)``, which lies in one page, onto ``bar``."""
    mbarrier.expect(bar, 2 * BN * D * k_src.dtype.primitive_bitwidth // 8)
    row = gl.load(table + pos0 // BS, mask=pos0 < ctx, other=0) * BS + pos0 % BS
    tma.async_copy_global_to_shared(k_src, [row, kv_col], bar, k_buf)
    tma.async_copy_global_to_shared(v_src, [row, kv_col], bar, v_buf)


@gluon.jit
def _zero_stale_rows(v_buf, keys, BN: gl.constexpr, layout: gl.constexpr):
    """Zero the rows of a TMA-loaded V tile from ``keys`` on: slots past the context, which
    ``P @ V`` would otherwise multiply by zero (NaN * 0 is NaN)."""
    if keys < BN:
        pos = gl.arange(0, BN, layout=gl.SliceLayout(1, layout))
        v = v_buf.load(layout)
        v_buf.store(gl.where((pos < keys)[:, None], v, gl.zeros_like(v)))
        fence_async_shared()
        _cta_barrier()


@gluon.jit
def _softmax_tile(s, m_i, l_i, qpos0, kpos0, scale_log2, BM: gl.constexpr, BN: gl.constexpr,
                  s_layout: gl.constexpr):
    """One key tile's online-softmax step on raw scores (the scale rides in the exp2's FMA):
    probabilities, running max and sum, and the factor that rescales the accumulator. Only a
    tile reaching past the first query's position masks."""
    if kpos0 + BN - 1 > qpos0:
        qpos = qpos0 + gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))
        kpos = kpos0 + gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
        s = gl.where(kpos[None, :] <= qpos[:, None], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_scaled = m_new * scale_log2
    p = gl.exp2(s * scale_log2 - m_scaled[:, None])
    alpha = gl.exp2(m_i * scale_log2 - m_scaled)
    return p, m_new, l_i * alpha + gl.sum(p, 1), alpha


@gluon.jit(do_not_specialize=["table_stride"])  # block tables widen as contexts grow
def _prefill_kernel(q_ptr, k_src, v_src, out_ptr, tables_ptr, cu_q_ptr, ctx_ptr, scale_log2,
                    q_stride_t, q_stride_h, o_stride_t, o_stride_h, c_stride_slot, c_stride_head,
                    table_stride, GROUP: gl.constexpr, D: gl.constexpr, BS: gl.constexpr,
                    BM: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr, TMA: gl.constexpr):
    """``k_src`` / ``v_src``: TMA descriptors of the pools as [slots, H_kv * D] with ``TMA``,
    else the pools themselves."""
    PF: gl.constexpr = STAGES - 2  # tiles loaded ahead: one buffer computes scores, one P @ V
    # Q as the scores' register operand spares shared-memory reads; next to the scores of
    # 128-key tiles it would spill.
    Q_IN_REGS: gl.constexpr = BN <= 64
    W: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    m_tile = gl.num_programs(0) - 1 - gl.program_id(0)
    h = gl.program_id(1)
    seq = gl.program_id(2)
    q_start = gl.load(cu_q_ptr + seq)
    q_len = gl.load(cu_q_ptr + seq + 1) - q_start
    ctx = gl.load(ctx_ptr + seq)
    row0 = m_tile * BM
    if row0 < q_len:
        table = tables_ptr + seq.to(gl.int64) * table_stride
        qpos0 = ctx - q_len + row0  # the position of the tile's first query
        load_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])
        s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                                      instr_shape=[16, BN, 16])
        o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                                      instr_shape=[16, D, 16])
        p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
        q_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_l, k_width=2)
        q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, D], dtype)
        if TMA:
            kv_sl: gl.constexpr = k_src.layout
            kv_col = (h // GROUP) * D
        else:
            kv_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, D], dtype)
            kv_col = (h // GROUP) * c_stride_head
        q_s = gl.allocate_shared_memory(dtype, [BM, D], q_sl)
        k_s = gl.allocate_shared_memory(dtype, [STAGES, BN, D], kv_sl)
        v_s = gl.allocate_shared_memory(dtype, [STAGES, BN, D], kv_sl)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())

        rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, load_l))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, load_l))
        row_ok = (rows < q_len)[:, None] & (cols < D)[None, :]
        q_rows = (q_start + rows).to(gl.int64)
        async_copy.async_copy_global_to_shared(
            q_s, q_ptr + (q_rows * q_stride_t + h * q_stride_h)[:, None] + cols[None, :], mask=row_ok)
        n_tiles = gl.cdiv(gl.minimum(ctx, qpos0 + BM), BN)
        tail = ctx - (n_tiles - 1) * BN  # the last tile's keys that exist
        if TMA:
            async_copy.commit_group()
            for b in gl.static_range(STAGES):
                mbarrier.init(bars.index(b), count=1)
            fence_async_shared()
            for t in gl.static_range(PF + 1):
                if t < n_tiles:
                    _copy_tile(k_src, v_src, k_s.index(t), v_s.index(t), bars.index(t), table,
                               t * BN, ctx, kv_col, BS, BN, D)
            async_copy.wait_group(0)
            fence_async_shared()
            _cta_barrier()
            mbarrier.wait(bars.index(0), 0)
            if n_tiles == 1:
                _zero_stale_rows(v_s.index(0), tail, BN, load_l)
        else:
            for t in gl.static_range(PF):
                r, ok = _page_rows(table, t * BN, ctx, c_stride_slot, BS, BN, load_l)
                _load_rows(k_s.index(t), k_src, r, ok, kv_col, D, load_l)
                _load_rows(v_s.index(t), v_src, r, ok, kv_col, D, load_l)
                async_copy.commit_group()
            r, ok = _page_rows(table, PF * BN, ctx, c_stride_slot, BS, BN, load_l)
            async_copy.wait_group(PF - 1)
            fence_async_shared()
            _cta_barrier()
            if PF < n_tiles:
                _load_rows(k_s.index(PF), k_src, r, ok, kv_col, D, load_l)
                _load_rows(v_s.index(PF), v_src, r, ok, kv_col, D, load_l)
            async_copy.commit_group()
            r, ok = _page_rows(table, (PF + 1) * BN, ctx, c_stride_slot, BS, BN, load_l)

        m_i = gl.full([BM], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_l))
        l_i = gl.zeros([BM], gl.float32, layout=gl.SliceLayout(1, s_l))
        acc = gl.zeros([BM, D], gl.float32, layout=o_l)
        s_zero = gl.zeros([BM, BN], gl.float32, layout=s_l)
        if Q_IN_REGS:
            q = q_s.load(q_l)
        else:
            q = q_s

        # Key tile 0 alone: there is no P @ V to overlap with yet.
        s = warpgroup_mma(q, k_s.index(0).permute((1, 0)), s_zero, use_acc=False)
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, qpos0, 0, scale_log2, BM, BN, s_l)

        for j in range(1, n_tiles):
            cur = j % STAGES
            # Every warp is done with tile j - 2 (its P @ V was waited for in iteration j - 1),
            # whose buffers tile j + PF now takes; with cp.async, tile j has landed too.
            if TMA:
                _cta_barrier()
                if j + PF < n_tiles:
                    nxt = (j + PF) % STAGES
                    _copy_tile(k_src, v_src, k_s.index(nxt), v_s.index(nxt), bars.index(nxt),
                               table, (j + PF) * BN, ctx, kv_col, BS, BN, D)
                mbarrier.wait(bars.index(cur), (j // STAGES) & 1)
                if j == n_tiles - 1:
                    _zero_stale_rows(v_s.index(cur), tail, BN, load_l)
            else:
                async_copy.wait_group(PF - 1)
                fence_async_shared()
                _cta_barrier()
                if j + PF < n_tiles:
                    nxt = (j + PF) % STAGES
                    _load_rows(k_s.index(nxt), k_src, r, ok, kv_col, D, load_l)
                    _load_rows(v_s.index(nxt), v_src, r, ok, kv_col, D, load_l)
                async_copy.commit_group()
                r, ok = _page_rows(table, (j + PF + 1) * BN, ctx, c_stride_slot, BS, BN, load_l)
            s_tok = warpgroup_mma(q, k_s.index(cur).permute((1, 0)), s_zero, use_acc=False,
                                  is_async=True)
            pv_tok = warpgroup_mma(gl.convert_layout(p.to(dtype), p_l), v_s.index((j - 1) % STAGES),
                                   acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=[s_tok])
            p, m_i, l_i, alpha_next = _softmax_tile(s, m_i, l_i, qpos0, j * BN, scale_log2, BM, BN, s_l)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=[pv_tok])
            acc = acc * gl.convert_layout(alpha_next, gl.SliceLayout(1, o_l))[:, None]

        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_l), v_s.index((n_tiles - 1) % STAGES), acc)
        if TMA:
            for b in gl.static_range(STAGES):
                mbarrier.invalidate(bars.index(b))
        acc = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_l))[:, None]
        out = gl.convert_layout(acc.to(dtype), load_l)
        gl.store(out_ptr + (q_rows * o_stride_t + h * o_stride_h)[:, None] + cols[None, :], out,
                 mask=row_ok)


@functools.lru_cache(maxsize=None)
def _is_sm90(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def supports(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether this kernel can run the step: wgmma exists on sm_90 only, the tiles are laid
    out for 16-bit pools of head dim 64 or 128 (fp8 pools stay on the Triton kernel), and the
    sequences index the grid's third axis, which CUDA caps at 65,535."""
    return (q.dtype in (torch.bfloat16, torch.float16) and k_cache.dtype == q.dtype
            and q.shape[-1] in HEAD_DIMS and meta.num_seqs <= _MAX_GRID_Z and _is_sm90(q.device))


def loads_by_tma(k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int,
                 block_n: int) -> bool:
    """Whether key tiles of ``block_n`` positions reach this kernel by TMA (see the module
    docstring): where a tile lies in one page and the pools are laid out page after page, as
    [slots, H_kv * D] rows of a 16-byte aligned tensor."""
    slot = k_cache.shape[2] * k_cache.shape[3]
    return block_size % block_n == 0 and all(
        c.stride() == (block_size * slot, slot, c.shape[3], 1) and c.data_ptr() % 16 == 0
        for c in (k_cache, v_cache))


def _tile_sources(k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int,
                  block_n: int) -> tuple[object, object, bool]:
    """TMA descriptors of the pools (encoded at launch, so a captured CUDA graph keeps them)
    where :func:`loads_by_tma`, else the pools themselves for ``cp.async``; and which."""
    if not loads_by_tma(k_cache, v_cache, block_size, block_n):
        return k_cache, v_cache, False
    num_blocks, _, num_kv_heads, head_dim = k_cache.shape
    layout = gl.NVMMASharedLayout.get_default_for([block_n, head_dim], _GL_DTYPES[k_cache.dtype])
    shape, strides = [num_blocks * block_size, num_kv_heads * head_dim], [num_kv_heads * head_dim, 1]
    k_desc, v_desc = (TensorDescriptor(c, shape, strides, [block_n, head_dim], layout)
                      for c in (k_cache, v_cache))
    return k_desc, v_desc, True


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      out: torch.Tensor, meta: AttentionMetadata, scale: float, block_m: int,
                      block_n: int, num_warps: int, num_stages: int) -> torch.Tensor:
    """Causal attention of packed rows ``q`` [T, Hq, D] over their paged histories into
    ``out``; the caller checked the cache layout and :func:`supports`, and ``KernelConfig``
    the tiles. ``num_stages`` is the ring of K/V buffers: ``num_stages - 2`` tiles load ahead."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    k_src, v_src, by_tma = _tile_sources(k_cache, v_cache, meta.block_size, block_n)
    grid = (triton.cdiv(meta.max_seqlen_q, block_m), num_q_heads, meta.num_seqs)
    _prefill_kernel[grid](
        q, k_src, v_src, out, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
        scale * _LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
        GROUP=num_q_heads // k_cache.shape[2], D=head_dim, BS=meta.block_size, BM=block_m,
        BN=block_n, STAGES=num_stages, TMA=by_tma, num_warps=num_warps,
    )
    return out

