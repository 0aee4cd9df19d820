"""L2 prefetch of the next GEMM's weights by the small Triton kernel that runs before it.

In a decode step every projection is a cuBLAS GEMM over a few rows and a few megabytes of
weights, and the kernel before it (an RMSNorm, SiLU-and-mul) touches a few kilobytes: while it
runs, device memory is idle, and the GEMM then waits on its weights' first bytes. With a
``prefetch`` weight, each program of that kernel asks the TMA unit to bring its share of the
weight into L2 (``cp.async.bulk.prefetch.L2``, issued by one thread) before it waits on the
kernel ahead of it (programmatic dependent launch, :mod:`kvscope.kernels.pdl`), so the bytes
move while the kernels ahead drain and the GEMM reads them from L2. A prefetch is a hint: it
changes no value, and what does not fit is read from memory as before.

It needs sm_90 (the bulk prefetch) and runs only where PDL does (``PREFETCH`` is off where
``PDL`` is). ``USE_WEIGHT_PREFETCH`` turns it on; it stays off until a GPU run measures it
(``benchmarks/profile_step_kinds.py --weight-prefetch``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

USE_WEIGHT_PREFETCH = False
_CHUNK = tl.constexpr(64 * 1024)  # bytes per bulk prefetch instruction


@triton.jit
def prefetch_share(nbytes, program, programs):
    """Bytes ``[start, end)`` of a ``nbytes`` buffer that ``program`` of ``programs`` prefetches:
    consecutive, 16-byte aligned shares that cover the buffer's whole 16-byte units once."""
    share = tl.cdiv(tl.cdiv(nbytes, programs), 16) * 16
    start = program.to(tl.int64) * share
    end = tl.minimum(start + share, nbytes // 16 * 16)
    return start, end


@triton.jit
def prefetch_to_l2(ptr, nbytes, program, programs):
    """Prefetch this program's share of ``nbytes`` bytes at ``ptr`` (16-byte aligned) into L2."""
    start, end = prefetch_share(nbytes, program, programs)
    base = ptr.to(tl.pointer_type(tl.int8))
    for off in range(start, end, _CHUNK):
        tl.inline_asm_elementwise(
            "{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [base + off, tl.minimum(end - off, _CHUNK).to(tl.int32)],
            dtype=tl.int32, is_pure=False, pack=1)


def prefetch_args(weight: torch.Tensor | None, pdl: dict[str, bool],
                  stand_in: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
    """``(pointer, bytes, PREFETCH)`` for a launch: ``weight``'s storage where it is prefetched
    (PDL on, ``USE_WEIGHT_PREFETCH``, a contiguous, 16-byte aligned tensor), else ``stand_in``
    and nothing."""
    if (weight is None or not USE_WEIGHT_PREFETCH or not pdl.get("PDL", False)
            or not weight.is_contiguous() or weight.data_ptr() % 16):
        return stand_in, 0, False
    return weight, weight.numel() * weight.element_size(), True
