"""The interface every attention backend implements."""
from __future__ import annotations

from typing import Protocol

import torch

from kvscope.runner.forward_context import AttentionMetadata


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
    ) -> torch.Tensor:          # [T, Hq, D]
        """Store k/v at ``meta.slot_mapping`` then return causal paged attention output."""
        ...
