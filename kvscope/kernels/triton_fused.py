"""Fused Triton kernels for the decoder's elementwise work: RMSNorm (optionally with the residual
add), Qwen3's per-head q/k RMSNorm with RoPE, RoPE alone (either optionally writing the step's
K/V into the paged pool), and SiLU-and-mul.

Unfused, each of these is a chain of tiny torch kernels (RMSNorm alone is cast, pow, mean, add,
rsqrt, mul, cast, mul); at decode batch sizes every one of them costs a launch and a round trip
through memory for a few kilobytes. Here each is one launch, one program per token row, math in
fp32 whatever the storage dtype (``bf16`` tensors are cast right after loading, so the kernels
also run correctly in the Triton interpreter for fp32/fp16). Nothing reads device memory on the
host, so every launch can be captured in a CUDA graph.

The torch code in :mod:`kvscope.layers` stays the reference and the CPU path; the layers call
these only for CUDA tensors (see :func:`kvscope.kernels.fused.fused_kernels`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscope.kernels.base import KVWrite
from kvscope.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_options
from kvscope.kernels.triton_attention import quantize_for_pool

_SILU_BLOCK = 1024  # columns per silu_and_mul program: a 2-D grid keeps small batches busy


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr,
    x_stride, res_stride, out_stride, res_out_stride, eps,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr,
):
    """One row: ``out = rmsnorm(x [+ res]) * w``; with a residual also ``res_out = x + res``.

    The sum is rounded to the residual's dtype before it is normalised, as the torch path does,
    so the stored residual stream and the normalised value agree.
    """
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        x = (x + res).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * res_out_stride + cols, x, mask=mask)
        x = x.to(tl.float32)
    rrms = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (x * rrms * w).to(out_ptr.dtype.element_ty),
             mask=mask)


@triton.jit
def _norm_rope_heads(ptr, head_stride, w_ptr, cos, sin, eps,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_HALF: tl.constexpr, NORM: tl.constexpr):
    """In place on one token's ``NUM_HEADS`` heads at ``ptr``: optional per-head RMSNorm, then
    rotate-half RoPE with this token's ``cos``/``sin`` (``[BLOCK_HALF]``, fp32). Returns the two
    rotated halves as stored (``[BLOCK_H, BLOCK_HALF]`` in the tensor's dtype)."""
    half = HEAD_DIM // 2
    h = tl.arange(0, BLOCK_H)[:, None]
    j = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < NUM_HEADS) & (j < half)
    lo = ptr + h * head_stride + j
    x1 = tl.load(lo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(lo + half, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        rrms = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / HEAD_DIM + eps)
        w1 = tl.load(w_ptr + j, mask=j < half, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + half + j, mask=j < half, other=0.0).to(tl.float32)
        x1 = x1 * rrms[:, None] * w1
        x2 = x2 * rrms[:, None] * w2
    dtype = ptr.dtype.element_ty
    r1 = (x1 * cos - x2 * sin).to(dtype)
    r2 = (x2 * cos + x1 * sin).to(dtype)
    tl.store(lo, r1, mask=mask)
    tl.store(lo + half, r2, mask=mask)
    return r1, r2


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr,
    v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
    q_stride, q_head_stride, k_stride, k_head_stride, v_stride, v_head_stride, cs_stride,
    c_stride_slot, c_stride_h, eps,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr,
    NORM: tl.constexpr, STORE: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):
    """One token: q and k heads normalised (if ``NORM``) and rotated in place; with ``STORE``
    its rotated k and its v also go to pool slot ``slot_ptr[t]`` (none when it is negative),
    exactly as the attention backend's store would write them."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    cs_mask = j < HEAD_DIM // 2
    cos = tl.load(cos_ptr + t * cs_stride + j, mask=cs_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + t * cs_stride + j, mask=cs_mask, other=0.0).to(tl.float32)[None, :]
    _norm_rope_heads(q_ptr + t * q_stride, q_head_stride, qw_ptr, cos, sin, eps,
                     NUM_Q_HEADS, HEAD_DIM, BLOCK_QH, BLOCK_HALF, NORM)
    k1, k2 = _norm_rope_heads(k_ptr + t * k_stride, k_head_stride, kw_ptr, cos, sin, eps,
                              NUM_K_HEADS, HEAD_DIM, BLOCK_KH, BLOCK_HALF, NORM)
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            half = HEAD_DIM // 2
            h = tl.arange(0, BLOCK_KH)[:, None]
            mask = (h < NUM_K_HEADS) & cs_mask[None, :]
            pool = slot * c_stride_slot + h * c_stride_h + j[None, :]
            tl.store(k_cache_ptr + pool, quantize_for_pool(k1, k_scale_ptr, k_cache_ptr, FP8), mask=mask)
            tl.store(k_cache_ptr + pool + half,
                     quantize_for_pool(k2, k_scale_ptr, k_cache_ptr, FP8), mask=mask)
            v = v_ptr + t * v_stride + h * v_head_stride + j[None, :]
            v1 = tl.load(v, mask=mask, other=0.0)
            v2 = tl.load(v + half, mask=mask, other=0.0)
            tl.store(v_cache_ptr + pool, quantize_for_pool(v1, v_scale_ptr, v_cache_ptr, FP8), mask=mask)
            tl.store(v_cache_ptr + pool + half,
                     quantize_for_pool(v2, v_scale_ptr, v_cache_ptr, FP8), mask=mask)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, x_stride, out_stride,
                         N: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """``out[row, cols] = silu(x[row, cols]) * x[row, N + cols]`` for one block of columns."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + N + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * out_stride + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, last dim]`` with a unit stride in the last dim (a view when possible)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])


def _norm_warps(block: int) -> int:
    """Enough warps that a row of ``block`` fp32 values stays around 8-16 per thread."""
    return max(1, min(16, block // 256))


def _rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
              eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    n = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    # Without a residual the kernel never touches res / res_out: pass x and out in their place.
    res2 = x2 if residual is None else _rows(residual)
    res_out = out if residual is None else torch.empty_like(res2)
    if x2.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight, out, res_out,
            x2.stride(0), res2.stride(0), out.stride(0), res_out.stride(0), eps,
            N=n, BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=_norm_warps(block),
            **pdl_options(x.device))
    return out.view(x.shape), None if residual is None else res_out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dim; output in ``x``'s dtype."""
    return _rms_norm(x, None, weight, eps)[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)`` in one pass; both are new tensors."""
    return _rms_norm(x, residual, weight, eps)


def _check_heads(x: torch.Tensor) -> None:
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"expected [T, heads, head_dim] with a unit last stride, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                 eps: float = 0.0, store: KVWrite | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hkv, D]`` in place by RoPE, after a per-head
    RMSNorm with ``q_weight``/``k_weight`` when given (Qwen3); one launch for both.

    ``cos``/``sin``: ``[T, D/2]`` rows of the rotary table for this step's positions (any
    row stride, e.g. the two halves of ``RotaryEmbedding.cos_sin[positions]``). ``q`` and ``k``
    may be strided views (heads of the packed qkv projection); they are returned for chaining.
    With ``store``, the same launch writes the rotated k and ``store.v`` into the pool, so the
    attention backend is told to skip its own store (one launch less per layer and step).
    """
    for x in (q, k):
        _check_heads(x)
    if (q_weight is None) != (k_weight is None):
        raise ValueError("give both q and k norm weights or neither")
    t, hq, d = q.shape
    hk = k.shape[1]
    if cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0):
        cos, sin = cos.contiguous(), sin.contiguous()
    norm = q_weight is not None
    if store is not None:
        _check_heads(store.v)
        if store.v.shape != k.shape or store.k_cache.shape[2:] != k.shape[1:]:
            raise ValueError(f"store: v {tuple(store.v.shape)} and pool pages "
                             f"{tuple(store.k_cache.shape)} do not match k {tuple(k.shape)}")
        v, k_cache, v_cache = store.v, store.k_cache, store.v_cache
        slots, k_scale, v_scale = store.slot_mapping, store.k_scale, store.v_scale
    else:  # the STORE=False kernel never touches these: pass any tensor of the right kind
        v, k_cache, v_cache, slots, k_scale, v_scale = k, k, k, cos, cos, cos
    if t:
        _qk_norm_rope_kernel[(t,)](
            q, k, cos, sin, q_weight if norm else cos, k_weight if norm else cos,
            v, k_cache, v_cache, slots, k_scale, v_scale,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos.stride(0), k_cache.stride(1), k_cache.stride(2), eps,
            NUM_Q_HEADS=hq, NUM_K_HEADS=hk, HEAD_DIM=d,
            BLOCK_QH=triton.next_power_of_2(hq), BLOCK_KH=triton.next_power_of_2(hk),
            BLOCK_HALF=triton.next_power_of_2(d // 2), NORM=norm, STORE=store is not None,
            FP8=k_cache.dtype == torch.float8_e4m3fn,
            num_warps=4 if hq * d >= 2048 else 2, **pdl_options(q.device))
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` on the last dim; output in ``x``'s dtype."""
    n = x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, _SILU_BLOCK))](
            x2, out, x2.stride(0), out.stride(0), N=n, BLOCK=_SILU_BLOCK, num_warps=4,
            **pdl_options(x.device))
    return out.view(*x.shape[:-1], n)
