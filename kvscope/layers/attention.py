"""The attention layer: the one place the model touches the paged KV pool.

It owns no weights. The runner gives it its slice of the pool (``k_cache`` / ``v_cache``) and
a ``backend``; per step it reads the packed layout from the forward context. Swapping the
backend (torch, Triton) never changes model code.
"""
from __future__ import annotations

import torch
from torch import nn

from kvscope.kernels.base import AttentionBackend
from kvscope.kernels.torch_attention import TorchAttentionBackend, varlen_attention_no_cache
from kvscope.forward_context import get_forward_context


class Attention(nn.Module):
    """Causal paged attention for one layer's local heads.

    Attributes set by the runner (plain attributes, not buffers, so they are neither saved
    nor moved by ``.to()``):

    * ``k_cache``, ``v_cache``: ``[N, block_size, num_kv_heads, head_dim]`` views of the pool;
      empty until the pool is allocated.
    * ``backend``: an :class:`AttentionBackend`; the torch reference by default.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.backend: AttentionBackend = TorchAttentionBackend()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` ``[T, Hq*D]``, ``k``/``v`` ``[T, Hkv*D]`` (after RoPE) -> ``[T, Hq*D]``."""
        meta = get_forward_context().attn
        if meta is None:
            raise RuntimeError("Attention called outside kvscope.forward_context(...)")
        t = q.shape[0]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.k_cache.numel() == 0:
            if not meta.no_prefix:
                raise RuntimeError("KV cache is not allocated but this step reads a cached prefix "
                                   "(meta.no_prefix is False)")
            out = varlen_attention_no_cache(q, k, v, meta.cu_seqlens_q, self.scale)
        else:
            out = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
        return out.reshape(t, self.num_heads * self.head_dim)
