"""The contract between the runner and every attention backend: the packed step layout
(:class:`AttentionMetadata`) and the backend interface (:class:`AttentionBackend`)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

# The kernels compute softmaxes with exp2: a score scaled by this gives exp(score) as exp2.
LOG2E = math.log2(math.e)


@dataclass
class AttentionMetadata:
    """Packed, variable-length description of one forward pass.

    Sequences are packed back to back: sequence ``i`` owns query rows
    ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``; its whole KV history (cached prefix + this step's
    tokens) has length ``context_lens[i]`` and lives in the pages ``block_tables[i, :]``.
    The query rows of sequence ``i`` sit at the *end* of its history, so query row ``j`` of
    it has absolute position ``context_lens[i] - q_len_i + j`` and attends causally to
    positions ``<= `` that.
    """

    slot_mapping: torch.Tensor      # int64 [T]; KV slot for each packed token, -1 = skip the write
    cu_seqlens_q: torch.Tensor      # int32 [B+1]
    cu_seqlens_k: torch.Tensor      # int32 [B+1]; cumulative context_lens
    context_lens: torch.Tensor      # int32 [B]; KV length per sequence after this step's writes
    block_tables: torch.Tensor      # int32 [B, W]; padded with -1 beyond a sequence's blocks
    max_seqlen_q: int               # host int: max query rows of one sequence
    max_seqlen_k: int               # host int: max context_lens
    num_seqs: int                   # host int: B
    num_tokens: int                 # host int: T
    block_size: int
    decode_only: bool               # every sequence has exactly one query row
    no_prefix: bool = False         # every sequence computes its whole history this step


@dataclass
class KVWrite:
    """Where one layer's step K/V go in the pool: handed to a kernel that holds k and v anyway
    (the fused RoPE kernel), which writes them as the backend's store would; the backend is
    then called with ``kv_stored=True``."""

    v: torch.Tensor             # [T, Hkv, D] (a strided view of the qkv projection is fine)
    k_cache: torch.Tensor       # [N, block_size, Hkv, D]
    v_cache: torch.Tensor
    slot_mapping: torch.Tensor  # the step's meta.slot_mapping
    k_scale: torch.Tensor       # 0-d fp32, read only by an fp8 pool
    v_scale: torch.Tensor


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,        # [T, Hq, D]
        k: torch.Tensor,        # [T, Hkv, D]
        v: torch.Tensor,        # [T, Hkv, D]
        k_cache: torch.Tensor,  # [N, block_size, Hkv, D] (one layer's slice of the pool)
        v_cache: torch.Tensor,  # [N, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
        k_scale: torch.Tensor | float = 1.0,  # fp32 scalar tensor in the engine (see below)
        v_scale: torch.Tensor | float = 1.0,
        kv_stored: bool = False,  # this step's k/v are in the pool already (see KVWrite)
    ) -> torch.Tensor:          # [T, Hq, D]
        """Store k/v at ``meta.slot_mapping`` (unless ``kv_stored``) then return causal paged
        attention output.

        A pool of dtype ``float8_e4m3fn`` (``kv_cache_dtype="fp8"``) holds ``k / k_scale`` and
        ``v / v_scale``, clamped to +-448; a backend dequantizes as it reads. The scales are
        ignored for any other pool dtype. The engine passes 0-d fp32 tensors on the device, so
        a captured CUDA graph sees scales computed after the capture.
        """
        ...
