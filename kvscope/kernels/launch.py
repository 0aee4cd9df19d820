"""Launching a jitted Triton kernel again without Triton's per-call binding.

``kernel[grid](*args)`` works out on every call what the kernel is specialised on (each
argument's type, each integer's size and divisibility by 16, each pointer's alignment), reads
Triton's runtime settings, looks the compiled variant up and only then launches it: on the
hosts kvscope runs on, several times what the launch itself costs (benchmarks/RESULTS.md,
session 21). The sampler launches its kernels once per step on arguments of the same kinds, so
:class:`Launcher` keeps each compiled variant under a key made from the arguments, at least as
fine as Triton's own, and launches it through the compiled kernel's own launcher, as Triton does
after its lookup.

Anything that is not a compiled CUDA kernel (Triton's interpreter on CPU tensors) goes through
``kernel[grid]`` every time, so the tests on CPU run the same kernels the same way. One check of
Triton's is not repeated on a kept variant's launches: that the globals the kernel read when it
was compiled still hold their values; a kernel launched through this module reads no global that
changes.
"""
from __future__ import annotations

import functools
from typing import Any, Hashable

import torch

try:
    from triton import knobs
    from triton.runtime import driver
except ImportError:  # a Triton without these (older releases): every launch takes ``kernel[grid]``
    knobs = driver = None

_I32 = range(-(2**31), 2**31)


def _arg_key(arg: Any, constexpr: bool) -> Hashable:
    """What one argument can change in Triton's choice of compiled variant: a constexpr's value;
    a tensor's dtype, device and 16-byte alignment; an integer's 32/64-bit type, being 1 and
    divisibility by 16; a float's or bool's type (a bool's value too, as Triton may fold it)."""
    if constexpr or arg is None:
        return arg
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.device.index, arg.data_ptr() % 16 == 0
    if isinstance(arg, bool):
        return bool, arg
    if isinstance(arg, int):
        return int, arg in _I32, arg == 1, arg % 16 == 0, arg >= 2**63
    if isinstance(arg, float):
        return float
    return type(arg), arg


class Launcher:
    """``launcher(grid, *args)`` launches ``fn`` as ``fn[grid](*args, **options)`` would: ``args``
    are all of ``fn``'s parameters in order, constexprs included; ``options`` the launch's
    (``num_warps``, ``launch_pdl``, ...), fixed for this launcher."""

    def __init__(self, fn: Any, **options: Any) -> None:
        self._fn = fn
        self._options = options
        params = getattr(fn, "params", None)
        self._constexpr = tuple(p.is_constexpr for p in params) if params is not None else None
        self._variants: dict[tuple, Any] = {}

    def __call__(self, grid: tuple[int, ...], *args: Any) -> None:
        if self._constexpr is None or driver is None:
            self._fn[grid](*args, **self._options)
            return
        device = driver.active.get_current_device()
        key = (device, *map(_arg_key, args, self._constexpr))
        kernel = self._variants.get(key)
        if kernel is None:
            kernel = self._fn[grid](*args, **self._options)
            if hasattr(kernel, "packed_metadata"):  # a compiled kernel (not the interpreter's None)
                self._variants[key] = kernel
            return
        stream = driver.active.get_current_stream(device)
        runtime = knobs.runtime
        kernel.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                   kernel.function, kernel.packed_metadata, kernel.launch_metadata(grid, stream, *args),
                   runtime.launch_enter_hook, runtime.launch_exit_hook, *args)


@functools.cache
def launcher(fn: Any, **options: Any) -> Launcher:
    """The one :class:`Launcher` of ``fn`` with ``options`` (made on first use), so that its
    compiled variants are kept for every later launch."""
    return Launcher(fn, **options)
