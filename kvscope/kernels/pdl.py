"""Programmatic dependent launch (PDL) for kvscope's Triton kernels on Hopper and newer GPUs.

A decode step is a few hundred small kernels back to back, and between two of them the GPU
idles while the first finishes and the second is launched. A kernel launched with PDL may be
scheduled as soon as the kernel before it in the stream has let its blocks go, and waits
(``griddepcontrol.wait``) before it touches memory, so it computes exactly what it would have
without PDL. Captured CUDA graphs keep the launch attribute as a programmatic edge.

Every kernel here that takes a ``PDL`` constexpr calls that wait first thing when it is set; a
launch passes :func:`pdl_options` so the constexpr and the launch attribute always go together.
Off CUDA (the Triton interpreter) both stay off.
"""
from __future__ import annotations

import functools

import torch

try:  # the wait the kernels call; Triton < 3.3 has none, and then PDL stays off
    from triton.language.extra.cuda import gdc_wait
except ImportError:
    gdc_wait = None

# Set False to launch without PDL (A/B comparisons; the measured difference is in
# benchmarks/RESULTS.md).
USE_PDL = True


@functools.lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    return gdc_wait is not None and torch.cuda.get_device_capability(index)[0] >= 9


def pdl_options(device: torch.device) -> dict[str, bool]:
    """Launch options for a kernel with a ``PDL`` constexpr on ``device``'s tensors:
    ``{"PDL": True, "launch_pdl": True}`` where PDL runs, else ``{"PDL": False}``."""
    if USE_PDL and device.type == "cuda" and _supported(device.index or 0):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
