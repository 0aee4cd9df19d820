"""The attention layer: the one place the model touches the paged KV pool.

It owns no weights. The runner gives it its slice of the pool (``k_cache`` / ``v_cache``) and
a ``backend``; per step it reads the packed layout from the forward context. Swapping the
backend (torch, Triton) never changes model code.
"""
from __future__ import annotations

import torch
from torch import nn

from kvscope.kernels.base import AttentionBackend, KVWrite
from kvscope.kernels.fused import fused_kernels
from kvscope.kernels.kv_quant import FP8_MAX
from kvscope.kernels.torch_attention import TorchAttentionBackend, varlen_attention_no_cache
from kvscope.forward_context import get_forward_context


class Attention(nn.Module):
    """Causal paged attention for one layer's local heads.

    Attributes set by the runner (plain attributes, not buffers, so they are neither saved
    nor moved by ``.to()``):

    * ``k_cache``, ``v_cache``: ``[N, block_size, num_kv_heads, head_dim]`` views of the pool;
      empty until the pool is allocated.
    * ``backend``: an :class:`AttentionBackend`; the torch reference by default.
    * ``k_scale``, ``v_scale``: 0-d fp32 tensors, the fp8 pool's per-layer scales (1.0, vLLM's
      default); updated in place, so captured CUDA graphs read the current values.
    * ``calculate_kv_scales``: set the scales from the first prefill that writes the pool
      (vLLM's option): ``amax(|k|) / 448``, the e4m3 maximum, and likewise for v.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        self.backend: AttentionBackend = TorchAttentionBackend()
        self.k_scale = torch.ones((), dtype=torch.float32)
        self.v_scale = torch.ones((), dtype=torch.float32)
        self.calculate_kv_scales = False

    def kv_write(self, v: torch.Tensor) -> KVWrite | None:
        """This step's pool write for the fused RoPE kernel to do, where it runs (CUDA, Triton)
        and the pool is allocated; ``None`` leaves the store to :meth:`forward`. Also ``None``
        on a step that sets the fp8 scales, which must see k and v before anything is stored."""
        meta = get_forward_context().attn
        if (meta is None or self.k_cache.numel() == 0 or fused_kernels(v) is None
                or (self.calculate_kv_scales and not meta.decode_only)):
            return None
        return KVWrite(v.view(v.shape[0], self.num_kv_heads, self.head_dim), self.k_cache,
                       self.v_cache, meta.slot_mapping, self.k_scale, self.v_scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_stored: bool = False) -> torch.Tensor:
        """``q`` ``[T, Hq*D]`` or ``[T, Hq, D]``, ``k``/``v`` ``[T, Hkv*D]`` or ``[T, Hkv, D]``
        (after RoPE; strided head views of the packed projection are fine) -> ``[T, Hq*D]``.
        ``kv_stored``: the write :meth:`kv_write` handed out was done."""
        meta = get_forward_context().attn
        if meta is None:
            raise RuntimeError("Attention called outside kvscope.forward_context(...)")
        t = q.shape[0]
        if q.dim() == 2:  # (a view costs a dispatch; the decoder already passes heads)
            q = q.view(t, self.num_heads, self.head_dim)
        if k.dim() == 2:
            k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.k_cache.numel() == 0:
            if not meta.no_prefix:
                raise RuntimeError("KV cache is not allocated but this step reads a cached prefix "
                                   "(meta.no_prefix is False)")
            out = varlen_attention_no_cache(q, k, v, meta.cu_seqlens_q, self.scale)
        else:
            if self.calculate_kv_scales and not meta.decode_only:
                self._calculate_kv_scales(k, v)
            out = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale,
                                       self.k_scale, self.v_scale, kv_stored=kv_stored)
        return out.reshape(t, self.num_heads * self.head_dim)

    def _calculate_kv_scales(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Once, from this (prefill) step's K/V: scales that map their largest value to 448.

        Decode steps never set them: the CUDA graph capture runs decode steps on dummy inputs
        before any real prefill. An all-zero tensor keeps its scale at 1.0.
        """
        for x, scale in ((k, self.k_scale), (v, self.v_scale)):
            amax = x.detach().abs().amax().float()
            scale.copy_(torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)))
        self.calculate_kv_scales = False
