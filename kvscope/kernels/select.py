"""Picks the attention backend for a device: flash-attn, then Triton, then pure torch."""
from __future__ import annotations

import importlib.util

import torch

from kvscope.kernels.base import AttentionBackend


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto`` takes the fastest backend that can run on ``device``."""
    if name == "auto":
        if device.type == "cuda" and importlib.util.find_spec("flash_attn") is not None:
            name = "flash"
        elif device.type == "cuda" and importlib.util.find_spec("triton") is not None:
            name = "triton"
        else:
            name = "torch"
    if name == "torch":
        from kvscope.kernels.torch_attention import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        from kvscope.kernels.triton_attention import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "flash":
        from kvscope.kernels.flash_attention import FlashAttentionBackend

        return FlashAttentionBackend()
    raise ValueError(f"attention_backend must be 'auto', 'torch', 'triton' or 'flash', got {name!r}")
