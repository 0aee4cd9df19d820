"""Picks the attention backend for a device: Triton on CUDA, else batched pure torch."""
from __future__ import annotations

import importlib

import torch

from kvscope.kernels.base import AttentionBackend


def _importable(module: str) -> bool:
    """Really import it: an installed package built for another torch or CUDA fails here."""
    try:
        importlib.import_module(module)
    except Exception:  # ImportError, or an extension's OSError / RuntimeError at load
        return False
    return True


def select_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """``auto`` is the Triton backend on CUDA (when triton imports), else (on CPU) the batched
    torch backend, whose few large tensor operations per layer are what a CPU runs fastest."""
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" and _importable("triton") else "torch"
    if name == "torch":
        from kvscope.kernels.torch_attention import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        if not _importable("triton"):
            raise ImportError("attention_backend='triton' needs triton, not importable here: "
                              "pip install triton, or pick attention_backend='torch' (or 'auto')")
        from kvscope.kernels.triton_attention import TritonAttentionBackend, interpreted

        if device.type != "cuda" and not interpreted():  # else the first step fails inside Triton
            raise ValueError(f"attention_backend='triton' runs on CUDA devices, not on {device.type!r}: "
                             "pick attention_backend='torch' (or 'auto'); Triton's interpreter runs "
                             "the kernels on CPU if TRITON_INTERPRET=1 is set before kvscope is imported")
        return TritonAttentionBackend()
    raise ValueError(f"attention_backend must be 'auto', 'torch' or 'triton', got {name!r}")
