"""flash-attn 2 over the paged pool. UNTESTED: flash-attn is installed on no machine kvscope has
been run on; this follows the library's documented API and is kept deliberately small.

flash-attn 2 reads paged K/V only with pages of a multiple of 256 slots, so this backend refuses
other block sizes; ``select_backend("auto", ...)`` only picks it when the block size fits.
"""
from __future__ import annotations

import torch

from kvscope.kernels.base import AttentionMetadata

PAGE_MULTIPLE = 256


def check_block_size(block_size: int) -> None:
    """flash-attn 2's paged kernels need ``block_size % 256 == 0``."""
    if block_size % PAGE_MULTIPLE:
        raise ValueError(f"the flash backend needs block_size % {PAGE_MULTIPLE} == 0 "
                         f"(flash-attn 2 paged KV), got block_size={block_size}; use "
                         f"attention_backend='triton' or a block_size of 256, 512, ...")


class FlashAttentionBackend:
    """Store with the Triton kernel, then ``flash_attn_with_kvcache`` for decode-only steps
    (one query row per sequence) and ``flash_attn_varlen_func`` with a block table otherwise."""

    name = "flash"

    def __init__(self) -> None:
        try:
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        except ImportError as err:
            raise ImportError("attention_backend='flash' needs the flash-attn package "
                              "(pip install flash-attn)") from err
        from kvscope.kernels.triton_attention import store_kvcache

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache
        self._store = store_kvcache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        check_block_size(meta.block_size)
        self._store(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.decode_only:
            out = self._with_kvcache(q.unsqueeze(1), k_cache, v_cache,
                                     cache_seqlens=meta.context_lens,
                                     block_table=meta.block_tables, softmax_scale=scale,
                                     causal=True)
            return out.squeeze(1)
        return self._varlen(q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q,
                            cu_seqlens_k=meta.cu_seqlens_k, max_seqlen_q=meta.max_seqlen_q,
                            max_seqlen_k=meta.max_seqlen_k, softmax_scale=scale, causal=True,
                            block_table=meta.block_tables)
