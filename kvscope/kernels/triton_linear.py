"""``y = x W^T + b`` for a decode step's few rows, in Triton, with the weights loaded before the
programmatic-dependent-launch wait.

At a decode step's few rows a matmul reads its whole weight for very little arithmetic, and
cuBLAS's kernel takes several times the weight's bytes at the copy bandwidth: it starts only
once the kernel before it has finished, then streams the weight through a pipeline that first
has to fill (benchmarks/RESULTS.md). Here each program owns one ``[BLOCK_N, BLOCK_K]`` tile of
the weight, small enough to hold whole, and loads it first thing, while the kernel before it
(launched with PDL, it lets its dependents go at its start) is still running; only then does
it wait for that kernel, read its ``[rows, BLOCK_K]`` slice of ``x`` and multiply. So the
weight's bytes move during the kernel before, and the whole weight is in flight at once.

Splitting ``K`` over programs makes partial sums. They are reduced deterministically: each
program writes its fp32 partial, and the last of a column block's programs to finish (counted
with one atomic per block) adds them in split order, adds the bias, rounds once to ``x``'s
dtype and resets its counter for the next launch. So a launch needs no zeroed memory and is
captured in a CUDA graph as one kernel.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvscope.kernels.pdl import gdc_launch_dependents, gdc_wait, pdl_options
from kvscope.kernels.triton_attention import sm_count

# Set False to take F.linear (cuBLAS) at every row count (A/B comparisons; the measured
# difference is in benchmarks/RESULTS.md).
USE_SKINNY_LINEAR = True
# The most rows for which linear() takes this kernel; more go to F.linear, whose GEMMs use the
# arithmetic better (benchmarks/RESULTS.md has the crossover).
MAX_ROWS = 8
TILE_ROWS = 32  # the most rows one launch takes: they are one tile
BLOCK_N = 32
BLOCK_K = 512
# Programs per SM a launch may have: the weights loaded before the wait only overlap the kernel
# before when every program is resident at once, and this many of them fit on an SM. Larger
# matmuls (an LM head) stay with F.linear.
PROGRAMS_PER_SM = 4


@triton.jit
def _skinny_linear_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, x_stride, y_stride,
    N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
):
    """Program ``(n, s)``: all ``M <= BLOCK_M`` rows, columns ``n*BLOCK_N...``, over the
    ``s``-th ``BLOCK_K`` slice of K."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if PDL:
        gdc_launch_dependents()
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = cols < N
    w = tl.load(w_ptr + cols.to(tl.int64)[:, None] * K + ks[None, :],
                mask=col_ok[:, None] & (ks < K)[None, :], other=0.0)
    if PDL:
        gdc_wait()  # everything below reads what the kernels before wrote
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    x = tl.load(x_ptr + rows[:, None] * x_stride + ks[None, :],
                mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)
    acc = tl.dot(x.to(w.dtype), tl.trans(w))
    out_mask = row_ok[:, None] & col_ok[None, :]
    if SPLITS > 1:
        at = rows[:, None] * N + cols[None, :]
        tl.store(part_ptr + pid_k * M * N + at, acc, mask=out_mask)
        tl.debug_barrier()  # every thread's partial is written before the count says so
        if tl.atomic_add(count_ptr + pid_n, 1) != SPLITS - 1:
            return
        tl.store(count_ptr + pid_n, 0)  # the last of this column block: reset, then reduce
        own = acc
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in tl.static_range(SPLITS):  # unrolled: the loads go out together; in split order
            other = tl.load(part_ptr + s * M * N + at, mask=out_mask & (pid_k != s), other=0.0,
                            cache_modifier=".cg")
            acc += tl.where(pid_k == s, own, other)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * y_stride + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=out_mask)


_counters_made: dict[torch.device, list[torch.Tensor]] = {}


def _counters(device: torch.device, blocks: int) -> torch.Tensor:
    """At least ``blocks`` arrival counts on ``device``, zero between launches (each launch's
    last programs reset theirs). A larger buffer is made only on an eager call (CUDA graphs are
    captured after a warm-up run of the same shapes); the smaller ones stay alive, as a
    captured graph may point at them. Every launch on a device shares them, so two launches
    must not run at once on two streams: the engine runs one stream per device."""
    made = _counters_made.setdefault(device, [])
    if not made or made[-1].numel() < blocks:
        made.append(torch.zeros(max(blocks, 1024), dtype=torch.int32, device=device))
    return made[-1]


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`linear` takes :func:`skinny_linear` for ``x @ weight.T``: on CUDA, at
    most ``MAX_ROWS`` rows, a contiguous half-precision weight whose programs all fit on the
    GPU at once."""
    if not (USE_SKINNY_LINEAR and x.is_cuda and weight.is_contiguous() and x.dtype == weight.dtype
            and x.dtype in (torch.bfloat16, torch.float16) and 0 < x.numel() // x.shape[-1] <= MAX_ROWS):
        return False
    n, k = weight.shape
    programs = triton.cdiv(n, BLOCK_N) * triton.cdiv(k, BLOCK_K)
    return programs <= PROGRAMS_PER_SM * sm_count(x.device)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """``x @ weight.T + bias`` (``x`` ``[..., K]`` of at most ``TILE_ROWS`` rows, ``weight``
    ``[N, K]`` contiguous) as one launch; fp32 accumulation, rounded once to ``x``'s dtype.
    Any device (the Triton interpreter on CPU); :func:`linear` decides when it is worth it."""
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight {k}")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m > TILE_ROWS:
        raise ValueError(f"x has {m} rows; skinny_linear takes at most TILE_ROWS={TILE_ROWS}")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        splits = triton.cdiv(k, BLOCK_K)
        part = torch.empty((splits, m, n) if splits > 1 else (1,), dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(n, BLOCK_N), splits)
        _skinny_linear_kernel[grid](
            x2, weight, weight if bias is None else bias, y, part, _counters(x.device, grid[0]),
            m, x2.stride(0), y.stride(0), N=n, K=k, BLOCK_M=max(16, triton.next_power_of_2(m)),
            BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLITS=splits, HAS_BIAS=bias is not None,
            num_warps=4, **pdl_options(x.device))
    return y.view(*x.shape[:-1], n)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias``: :func:`skinny_linear` where :func:`takes` says so, else F.linear."""
    if takes(x, weight):
        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)
