"""Programmatic dependent launch (PDL) for kvscope's Triton kernels on Hopper and newer GPUs.

A decode step is a few hundred small kernels back to back, and between two of them the GPU
idles while the first finishes and the second is launched. A kernel launched with PDL may be
scheduled as soon as every block of the kernel before it in the stream has let it go
(``griddepcontrol.launch_dependents``, or its exit), and waits (``griddepcontrol.wait``) for
that kernel to finish before it reads what it wrote, so it computes exactly what it would have
without PDL. Captured CUDA graphs keep the launch attribute as a programmatic edge.

Every kernel here that takes a ``PDL`` constexpr lets its dependents go first thing
(:func:`gdc_launch_dependents`), and waits before its first read of anything a kernel of the
same forward pass writes. What it reads before the wait is only the step's inputs (uploaded,
and copied into place before the forward pass starts) or what no kernel writes (weights): every
chain of PDL launches starts after a kernel launched without PDL (a cuBLAS GEMM, a torch op),
which starts only once all earlier work is done. A launch passes :func:`pdl_options` so the constexpr and the launch attribute
always go together. Off CUDA (the Triton interpreter) both stay off.
"""
from __future__ import annotations

import functools

import torch

try:  # the two instructions the kernels call; Triton < 3.3 has none, and then PDL stays off
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None

# Set False to launch without PDL (A/B comparisons; the measured difference is in
# benchmarks/RESULTS.md).
USE_PDL = True


@functools.lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    return gdc_wait is not None and torch.cuda.get_device_capability(index)[0] >= 9


def pdl_options(device: torch.device) -> dict[str, bool]:
    """Launch options for a kernel with a ``PDL`` constexpr on ``device``'s tensors:
    ``{"PDL": True, "launch_pdl": True}`` where PDL runs, else ``{"PDL": False}``."""
    pdl = USE_PDL and device.type == "cuda" and _supported(device.index or 0)
    return {"PDL": pdl, **launch_options(pdl)}


def launch_options(pdl: bool) -> dict[str, bool]:
    """The launch attribute that goes with a ``PDL`` constexpr of ``pdl``, for launches that
    pass the constexpr as an argument (:class:`~kvscope.kernels.launch.Launcher`)."""
    return {"launch_pdl": True} if pdl else {}
