"""Picks the attention backend for a device: flash-attn, then Triton, then batched pure torch."""
from __future__ import annotations

import importlib

import torch

from kvscope.kernels.base import AttentionBackend

# module -> pip package, for each backend (flash stores K/V with the Triton kernel).
_REQUIRES = {"triton": {"triton": "triton"}, "flash": {"flash_attn": "flash-attn", "triton": "triton"}}


def _importable(module: str) -> bool:
    """Really import it: an installed package built for another torch or CUDA fails here."""
    try:
        importlib.import_module(module)
    except Exception:  # ImportError, or an extension's OSError / RuntimeError at load
        return False
    return True


def select_backend(name: str, device: torch.device | str,
                   block_size: int | None = None) -> AttentionBackend:
    """``auto`` takes the fastest backend that can run on ``device``.

    flash-attn serves only pages of a multiple of 256 slots, so ``auto`` picks it only when
    ``block_size`` is given and fits; otherwise Triton on CUDA, else (on CPU) the batched torch
    backend, whose few large tensor operations per layer are what a CPU runs fastest.
    """
    device = torch.device(device)
    if name == "auto":
        on_cuda = device.type == "cuda"
        if (on_cuda and block_size is not None and block_size % 256 == 0
                and _importable("flash_attn")):
            name = "flash"
        elif on_cuda and _importable("triton"):
            name = "triton"
        else:
            name = "torch"
    if name == "torch":
        from kvscope.kernels.torch_attention import TorchAttentionBackend

        return TorchAttentionBackend()
    missing = [pip for module, pip in _REQUIRES.get(name, {}).items() if not _importable(module)]
    if missing:
        raise ImportError(f"attention_backend={name!r} needs {' and '.join(missing)}, not importable here: "
                          f"pip install {' '.join(missing)}, or pick attention_backend='torch' (or 'auto')")
    if name == "triton":
        from kvscope.kernels.triton_attention import TritonAttentionBackend

        return TritonAttentionBackend()
    if name == "flash":
        from kvscope.kernels.flash_attention import FlashAttentionBackend, check_block_size

        if block_size is not None:
            check_block_size(block_size)
        return FlashAttentionBackend()
    raise ValueError(f"attention_backend must be 'auto', 'torch', 'triton' or 'flash', got {name!r}")
