"""Prefill attention over the paged pool for Hopper (sm_90), written in Gluon.

Why a second kernel next to ``triton_attention``: on Hopper, Triton's ``tl.dot`` waits for
each wgmma it issues (``wgmma.wait_group 0``), so the tensor cores sit idle while every key
tile's softmax runs, and every warp spends instructions on loads. Gluon exposes the
asynchronous wgmma, TMA and warp specialisation, and this kernel uses them as FlashAttention-3
does:

- a one-warp loader partition copies each ``BN``-key tile of K and V from the pool by TMA (one
  box per page it spans, looked up in the block table) into rings of ``STAGES`` shared buffers,
  K and V each with ``ready`` / ``empty`` mbarriers, so the compute warps never issue a load;
- the compute warps (one or two warpgroups, ``BM`` query rows of one sequence and one query
  head) keep the scores of key tile ``j`` and the ``P @ V`` of tile ``j - 1`` in flight
  together and run tile ``j``'s softmax while ``P @ V`` still computes; with 64-key tiles Q
  is the scores' register operand, so only K is read from shared memory there;
- the launch caps registers so that two blocks of one compute warpgroup share an SM (the
  loader gives its registers back to the compute warps).

The rest is the paged kernel's contract (``AttentionMetadata``): block tables, cached
prefixes, GQA, bf16 and fp16, and the query tiles with the most keys start first. Only tiles
reaching the causal diagonal mask. Positions past a sequence's context never reach the output:
their scores are masked, and the last tile's V rows there (stale slots, which may hold
anything, NaN included) are zeroed in shared memory before ``P @ V`` reads them.

It runs where :func:`supports` says (sm_90, a bf16 or fp16 pool laid out page after page with
a power-of-two page size, head dim 64 or 128); the Triton kernel serves every other case and
the CPU interpreter, which Gluon lacks.
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

from kvscope.kernels.base import LOG2E, AttentionMetadata

# Triton 3.6 names the CTA-wide barrier thread_barrier; later versions call it barrier.
# Inside a warp-specialised partition it spans that partition's warps only.
_cta_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier
HEAD_DIMS = (64, 128)
_MAX_GRID_Z = 65535
# A TMA box lands in a slice of a key tile's shared buffer, and Gluon cannot slice through the
# 8-row atom of the buffer's swizzle: a box is a page (or a tile within one), so pages of fewer
# slots stay on the Triton kernel.
_MIN_PAGE = 8
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
_LOADER_REGS = gl.constexpr(24)  # the loader warp only looks pages up and issues TMA copies


@gluon.jit
def _copy_tile(desc, buf, bar, table, pos0, ctx, col, BS: gl.constexpr, BN: gl.constexpr,
               BOX: gl.constexpr, D: gl.constexpr):
    """TMA copies of key positions ``[pos0, pos0 + BN)`` of one pool into ``buf``, landing on
    ``bar``: one box of ``BOX`` slots per page (pages past the context read page 0)."""
    mbarrier.expect(bar, BN * D * desc.dtype.primitive_bitwidth // 8)
    for i in gl.static_range(BN // BOX):
        pos = pos0 + i * BOX
        row = gl.load(table + pos // BS, mask=pos < ctx, other=0) * BS + pos % BS
        tma.async_copy_global_to_shared(desc, [row, col], bar, buf.slice(i * BOX, BOX))


@gluon.jit
def _loader(k_desc, v_desc, k_s, v_s, k_ready, k_empty, v_ready, v_empty, table, ctx, kv_col,
            n_tiles, BS: gl.constexpr, BN: gl.constexpr, BOX: gl.constexpr, D: gl.constexpr,
            STAGES: gl.constexpr):
    """The loader partition: tile t's K, then its V, each into buffer ``t % STAGES`` once the
    compute warps gave that buffer back (the first round finds every buffer free)."""
    for t in range(n_tiles):
        b = t % STAGES
        free = ((t // STAGES) & 1) ^ 1
        mbarrier.wait(k_empty.index(b), free)
        _copy_tile(k_desc, k_s.index(b), k_ready.index(b), table, t * BN, ctx, kv_col, BS, BN, BOX, D)
        mbarrier.wait(v_empty.index(b), free)
        _copy_tile(v_desc, v_s.index(b), v_ready.index(b), table, t * BN, ctx, kv_col, BS, BN, BOX, D)


@gluon.jit
def _give_back(bar):
    """Every compute warp is done reading a buffer (its wgmma waited for): hand it back."""
    _cta_barrier()
    mbarrier.arrive(bar)


@gluon.jit
def _zero_stale_rows(v_buf, keys, BN: gl.constexpr, layout: gl.constexpr):
    """Zero the rows of the last V tile from ``keys`` on: slots past the context, which
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


@gluon.jit
def _compute(q_s, k_s, v_s, k_ready, k_empty, v_ready, v_empty, out_ptr, q_rows, o_stride_t,
             o_stride_h, h, q_len, row0, qpos0, ctx, n_tiles, scale_log2, BM: gl.constexpr,
             BN: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
    """The compute partition: the key loop over the loader's buffers, then the output rows."""
    W: gl.constexpr = gl.num_warps()
    dtype: gl.constexpr = q_s.dtype
    load_l: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [W, 1], [1, 0])
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                                  instr_shape=[16, BN, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[W, 1],
                                                  instr_shape=[16, D, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    q_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_l, k_width=2)
    m_i = gl.full([BM], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_l))
    l_i = gl.zeros([BM], gl.float32, layout=gl.SliceLayout(1, s_l))
    acc = gl.zeros([BM, D], gl.float32, layout=o_l)
    s_zero = gl.zeros([BM, BN], gl.float32, layout=s_l)
    # Q as the scores' register operand spares shared-memory reads; next to the scores of
    # 128-key tiles it would spill.
    if BN <= 64:
        q = q_s.load(q_l)
    else:
        q = q_s

    # Key tile 0 alone: there is no P @ V to overlap with yet.
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q, k_s.index(0).permute((1, 0)), s_zero, use_acc=False)
    _give_back(k_empty.index(0))
    p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, qpos0, 0, scale_log2, BM, BN, s_l)
    for j in range(1, n_tiles):
        kb = j % STAGES
        vb = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(kb), (j // STAGES) & 1)
        s_tok = warpgroup_mma(q, k_s.index(kb).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        mbarrier.wait(v_ready.index(vb), ((j - 1) // STAGES) & 1)
        pv_tok = warpgroup_mma(gl.convert_layout(p.to(dtype), p_l), v_s.index(vb), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=[s_tok])
        _give_back(k_empty.index(kb))
        p, m_i, l_i, alpha_next = _softmax_tile(s, m_i, l_i, qpos0, j * BN, scale_log2, BM, BN, s_l)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=[pv_tok])
        _give_back(v_empty.index(vb))
        acc = acc * gl.convert_layout(alpha_next, gl.SliceLayout(1, o_l))[:, None]
    last = (n_tiles - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((n_tiles - 1) // STAGES) & 1)
    _zero_stale_rows(v_s.index(last), ctx - (n_tiles - 1) * BN, BN, load_l)
    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_l), v_s.index(last), acc)

    acc = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_l))[:, None]
    out = gl.convert_layout(acc.to(dtype), load_l)
    rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, load_l))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, load_l))
    row_ok = (rows < q_len)[:, None] & (cols < D)[None, :]
    gl.store(out_ptr + (q_rows * o_stride_t + h * o_stride_h)[:, None] + cols[None, :], out, mask=row_ok)


@gluon.jit(do_not_specialize=["table_stride"])  # block tables widen as contexts grow
def _prefill_kernel(q_ptr, k_desc, v_desc, out_ptr, tables_ptr, cu_q_ptr, ctx_ptr, scale_log2,
                    q_stride_t, q_stride_h, o_stride_t, o_stride_h, table_stride,
                    GROUP: gl.constexpr, D: gl.constexpr, BS: gl.constexpr, BM: gl.constexpr,
                    BN: gl.constexpr, STAGES: gl.constexpr):
    """``k_desc`` / ``v_desc``: TMA descriptors of the pools as [slots, H_kv * D] rows."""
    BOX: gl.constexpr = BS if BS < BN else BN  # slots per TMA box: a page, or a tile within one
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
        q_s = gl.allocate_shared_memory(dtype, [BM, D], gl.NVMMASharedLayout.get_default_for([BM, D], dtype))
        k_s = gl.allocate_shared_memory(dtype, [STAGES, BN, D], k_desc.layout)
        v_s = gl.allocate_shared_memory(dtype, [STAGES, BN, D], k_desc.layout)
        bar_l: gl.constexpr = mbarrier.MBarrierLayout()
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_l)
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_l)
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_l)
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar_l)
        for b in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(b), count=1)
            mbarrier.init(k_empty.index(b), count=1)
            mbarrier.init(v_ready.index(b), count=1)
            mbarrier.init(v_empty.index(b), count=1)

        rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, load_l))
        cols = gl.arange(0, D, layout=gl.SliceLayout(0, load_l))
        q_rows = (q_start + rows).to(gl.int64)
        async_copy.async_copy_global_to_shared(
            q_s, q_ptr + (q_rows * q_stride_t + h * q_stride_h)[:, None] + cols[None, :],
            mask=(rows < q_len)[:, None] & (cols < D)[None, :])
        async_copy.commit_group()
        async_copy.wait_group(0)
        fence_async_shared()
        _cta_barrier()
        n_tiles = gl.cdiv(gl.minimum(ctx, qpos0 + BM), BN)
        gl.warp_specialize([
            (_compute, (q_s, k_s, v_s, k_ready, k_empty, v_ready, v_empty, out_ptr, q_rows,
                        o_stride_t, o_stride_h, h, q_len, row0, qpos0, ctx, n_tiles, scale_log2,
                        BM, BN, D, STAGES)),
            (_loader, (k_desc, v_desc, k_s, v_s, k_ready, k_empty, v_ready, v_empty, table, ctx,
                       (h // GROUP) * D, n_tiles, BS, BN, BOX, D, STAGES)),
        ], [1], [_LOADER_REGS])


@functools.lru_cache(maxsize=None)
def _is_sm90(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def supports(q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether this kernel can run the step: wgmma exists on sm_90 only; the tiles are laid
    out for 16-bit pools of head dim 64 or 128 (fp8 pools stay on the Triton kernel); TMA reads
    the pool as [slots, H_kv * D] rows of a 16-byte aligned tensor, in boxes of whole pages or
    of tiles within one (a power-of-two page size of at least ``_MIN_PAGE`` slots); and the
    sequences index the grid's third axis, which CUDA caps at 65,535."""
    bs = meta.block_size
    slot = k_cache.shape[2] * k_cache.shape[3]
    return (q.dtype in (torch.bfloat16, torch.float16) and k_cache.dtype == q.dtype
            and q.shape[-1] in HEAD_DIMS and meta.num_seqs <= _MAX_GRID_Z
            and bs >= _MIN_PAGE and bs & (bs - 1) == 0
            and k_cache.stride() == (bs * slot, slot, q.shape[-1], 1) and k_cache.data_ptr() % 16 == 0
            and _is_sm90(q.device))


def _launch_registers(num_warps: int) -> int:
    """Registers per thread at launch: two blocks of one compute warpgroup (plus the loader's
    warpgroup, as Triton pads it) share an SM's 64k, a block of two warpgroups has it alone."""
    blocks = 2 if num_warps == 4 else 1
    return 65536 // (blocks * 32 * (num_warps + 4)) // 8 * 8


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      out: torch.Tensor, meta: AttentionMetadata, scale: float, block_m: int,
                      block_n: int, num_warps: int, num_stages: int) -> torch.Tensor:
    """Causal attention of packed rows ``q`` [T, Hq, D] over their paged histories into
    ``out``; the caller checked the cache layout and :func:`supports`, and ``KernelConfig``
    the tiles. ``num_stages`` buffers each hold K and V tiles in flight from the loader."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    layout = gl.NVMMASharedLayout.get_default_for([block_n, head_dim], _GL_DTYPES[k_cache.dtype])
    rows, width = num_blocks * block_size, num_kv_heads * head_dim
    box = [min(block_size, block_n), head_dim]
    k_desc, v_desc = (TensorDescriptor(c, [rows, width], [width, 1], box, layout)  # encoded at launch,
                      for c in (k_cache, v_cache))                                # so graphs keep them
    grid = (triton.cdiv(meta.max_seqlen_q, block_m), q.shape[1], meta.num_seqs)
    _prefill_kernel[grid](
        q, k_desc, v_desc, out, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
        scale * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        meta.block_tables.stride(0), GROUP=q.shape[1] // num_kv_heads, D=head_dim, BS=block_size,
        BM=block_m, BN=block_n, STAGES=num_stages, num_warps=num_warps,
        maxnreg=_launch_registers(num_warps),
    )
    return out
