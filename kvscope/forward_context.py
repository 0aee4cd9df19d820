"""The forward context: how one step's attention metadata reaches every Attention layer.

The model code never sees requests: the runner packs one step's work into an
:class:`~kvscope.kernels.base.AttentionMetadata` and publishes it here for the duration of the
forward pass; each attention layer reads it with :func:`get_forward_context`. It lives at the
package's top level (as in vLLM) because both the runner, which sets it, and the attention
layer, which reads it, import it, and neither may import the other.

The context is per thread, like the tensor-parallel state: two engines in one process (a
notebook's demo running in the background beside the user's own ``LLM``) each run their
forward passes in their own thread, and neither may read the other's metadata.
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator

from kvscope.kernels.base import AttentionMetadata


@dataclass(frozen=True)
class ForwardContext:
    attn: AttentionMetadata | None = None


class _Local(threading.local):
    context = ForwardContext()


_LOCAL = _Local()


def get_forward_context() -> ForwardContext:
    return _LOCAL.context


@contextlib.contextmanager
def forward_context(attn: AttentionMetadata | None) -> Iterator[ForwardContext]:
    """Make ``attn`` visible to this thread's attention layers for the duration of one forward pass."""
    prev = _LOCAL.context
    _LOCAL.context = context = ForwardContext(attn=attn)
    try:
        yield context
    finally:
        _LOCAL.context = prev
