"""The forward context: how one step's attention metadata reaches every Attention layer.

The model code never sees requests: the runner packs one step's work into an
:class:`~kvscope.kernels.base.AttentionMetadata` and publishes it here for the duration of the
forward pass; each attention layer reads it with :func:`get_forward_context`. It lives at the
package's top level (as in vLLM) because both the runner, which sets it, and the attention
layer, which reads it, import it, and neither may import the other.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

from kvscope.kernels.base import AttentionMetadata


@dataclass
class ForwardContext:
    attn: AttentionMetadata | None = None


_CONTEXT = ForwardContext()


def get_forward_context() -> ForwardContext:
    return _CONTEXT


@contextlib.contextmanager
def forward_context(attn: AttentionMetadata | None) -> Iterator[ForwardContext]:
    """Make ``attn`` visible to attention layers for the duration of one forward pass."""
    global _CONTEXT
    prev = _CONTEXT
    _CONTEXT = ForwardContext(attn=attn)
    try:
        yield _CONTEXT
    finally:
        _CONTEXT = prev
