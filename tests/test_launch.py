"""The Triton launcher that skips Triton's per-call binding (``kvscope.kernels.launch``).

Truths: Triton's own specialisation of an argument (``native_specialize_impl``, what its JIT
keys compiled variants on), which the launcher's key must tell apart at least as finely; and on
a GPU, the same kernel launched by Triton's ``kernel[grid]`` on the same arguments.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import triton
import triton.language as tl

from kvscope.kernels.launch import Launcher, _arg_key
from triton_testing import needs_cuda


def _arguments() -> list:
    """Arguments of every kind a kernel takes, with the values where Triton's choice turns."""
    base = torch.zeros(64, dtype=torch.float32)
    return [
        1, 2, 15, 16, 32, -16, 2**31 - 16, 2**31, 2**40 + 1, 2**63, -(2**31), -(2**31) - 16,
        True, False, 0.5, 1.0, None,
        base, base[1:], base[4:], torch.zeros(8, dtype=torch.bfloat16), torch.zeros(8, dtype=torch.int64),
        torch.zeros(8, dtype=torch.int32), torch.zeros(8, dtype=torch.float16)[1:],
    ]


def _triton_specialisation(arg) -> tuple:
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    return native_specialize_impl(BaseBackend, arg, False, True, True)


def test_a_key_tells_apart_every_specialisation_triton_makes() -> None:
    """Two arguments that Triton compiles differently never share a launcher key: a kept
    variant is only ever launched on arguments Triton would have launched it on."""
    args = _arguments()
    for a, b in itertools.combinations(args, 2):
        if _triton_specialisation(a) != _triton_specialisation(b):
            assert _arg_key(a, False) != _arg_key(b, False), (a, b)


def test_a_constexpr_is_keyed_by_its_value() -> None:
    assert _arg_key(4096, True) != _arg_key(2048, True)
    assert _arg_key(True, True) != _arg_key(False, True)


@triton.jit
def _scaled_copy(src, dst, n, scale, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src + i, mask=i < n)
    tl.store(dst + i, x * scale, mask=i < n)


@pytest.mark.gpu
@needs_cuda
def test_gpu_launcher_runs_what_triton_runs_on_every_kind_of_argument() -> None:
    """Launches alternating between argument kinds (dtypes, aligned and misaligned pointers,
    sizes divisible by 16 or not, block sizes) each write what Triton's own launch writes, and
    every launch after a kind's first takes the kept variant."""
    launch = Launcher(_scaled_copy, num_warps=4)
    big = torch.randn(4099, device="cuda")
    cases = [(big, 4096, 128), (big[1:], 4097, 128), (big.half(), 4099, 64), (big[3:], 4000, 128),
             (big.bfloat16()[1:], 33, 32)]
    for src, n, block in cases * 3:
        grid = (triton.cdiv(n, block),)
        want = torch.zeros(n, dtype=src.dtype, device="cuda")
        got = torch.zeros_like(want)
        _scaled_copy[grid](src, want, n, 0.5, BLOCK=block, num_warps=4)
        launch(grid, src, got, n, 0.5, block)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(launch._variants) == len({(c[0].dtype, c[0].data_ptr() % 16 == 0, c[1] % 16 == 0, c[2])
                                         for c in cases})
