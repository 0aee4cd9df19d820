"""Rotary position embedding (RoPE) over packed token positions.

The cos/sin table is computed once, in float32, for every position up to
``max_position_embeddings`` and indexed by the packed ``positions`` tensor, so a step that mixes
sequences at different offsets needs no per-sequence work. The model owns one table and
shares it across layers. Rotation is the "half split" (GPT-NeoX) convention used by
Llama / Qwen checkpoints in Hugging Face format. On CUDA, :func:`rotate_qk` rotates q and k
(after Qwen3's per-head norms) in one fused kernel.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kvscope.kernels.base import KVWrite
from kvscope.kernels.fused import fused_kernels
from kvscope.layers.norm import RMSNorm, rms_norm

SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    params: dict[str, Any] = field(default_factory=dict)


def rope_config_from_hf(hf_config: Any) -> RopeConfig:
    """Read RoPE settings from either spelling of a Hugging Face config.

    transformers 5 keeps them in ``config.rope_parameters`` (with ``rope_theta`` inside);
    earlier versions used ``config.rope_theta`` plus an optional ``config.rope_scaling``.
    """
    merged: dict[str, Any] = {}
    for source in (getattr(hf_config, "rope_scaling", None),
                   getattr(hf_config, "rope_parameters", None)):
        if isinstance(source, dict):
            merged.update(source)
    theta = merged.pop("rope_theta", None) or getattr(hf_config, "rope_theta", None) or 10000.0
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(
            f"rope_type {rope_type!r} is not supported (supported: {SUPPORTED_ROPE_TYPES})")
    if merged.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError("partial_rotary_factor != 1 is not supported")
    return RopeConfig(theta=float(theta), rope_type=rope_type, params=merged)


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency rescaling: long wavelengths slowed by ``factor``, short ones kept,
    and a linear blend between the two bands."""
    factor = p["factor"]
    low, high = p["low_freq_factor"], p["high_freq_factor"]
    old_context = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    slowed = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    blend = (old_context / wavelen - low) / (high - low)
    blended = (1 - blend) * slowed / factor + blend * slowed
    in_between = (wavelen >= old_context / high) & (wavelen <= old_context / low)
    return torch.where(in_between, blended, slowed)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, rope: RopeConfig) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (rope.theta ** exponents)
        if rope.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope.params)
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.max_position = max_position
        self.register_buffer("cos_sin", torch.cat([angles.cos(), angles.sin()], dim=-1),
                             persistent=False)

    def forward(self, positions: torch.Tensor, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's rotation tables for activations like ``like``, made once per step and
        shared by every layer.

        On CUDA they are what the fused kernel reads: ``cos``, ``sin`` ``[T, head_dim / 2]``
        (float32). Elsewhere they are ``[T, 1, head_dim]`` in ``like``'s dtype, ``cos|cos`` and
        ``-sin|sin``, so a layer rotates with :func:`apply_rotary`'s four operations instead of
        splitting, broadcasting and casting the halves again.
        """
        cos, sin = self.cos_sin[positions].chunk(2, dim=-1)
        if fused_kernels(like) is not None:
            return cos, sin
        cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
        return cos.unsqueeze(1).to(like.dtype), sin.unsqueeze(1).to(like.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, H, D]`` by the full-width tables ``RotaryEmbedding`` makes off CUDA
    (``[T, 1, D]``, in ``x``'s dtype): ``x1*cos - x2*sin | x2*cos + x1*sin``, the same products
    and sums as HF's ``rotate_half`` form, so the same bits."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin


def rotate_qk(qk: torch.Tensor, num_q_heads: int, cos: torch.Tensor, sin: torch.Tensor,
              q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None,
              store: KVWrite | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on the query and key heads ``qk`` ``[T, Hq + Hkv, D]`` (the first ``num_q_heads``
    are q), each head first normalised when the norms are given (Qwen3: both, with one ``eps``).
    ``cos``, ``sin``: the step's tables from :class:`RotaryEmbedding` (made for ``qk``'s device).
    Returns q ``[T, Hq, D]`` and k ``[T, Hkv, D]``.

    q and k sit side by side in the packed qkv projection, so the torch path normalises and
    rotates them together (one weight row per head), half the small ops of doing each apart.
    On CUDA this is one kernel that works in place on the q and k views of ``qk``, and that
    also writes k and v into the KV pool when given the layer's ``store``
    (:meth:`~kvscope.layers.attention.Attention.kv_write`, which hands one out only there).
    """
    fused = fused_kernels(qk)
    if fused is not None:
        q, k = qk[:, :num_q_heads], qk[:, num_q_heads:]
        if q_norm is None:
            return fused.qk_norm_rope(q, k, cos, sin, store=store)
        return fused.qk_norm_rope(q, k, cos, sin, q_norm.weight, k_norm.weight, q_norm.eps,
                                  store=store)
    if store is not None:
        raise ValueError("a KV store rides on the fused RoPE kernel, which does not run here")
    if q_norm is not None:
        d, num_k_heads = qk.shape[-1], qk.shape[1] - num_q_heads
        weight = torch.cat((q_norm.weight.expand(num_q_heads, d), k_norm.weight.expand(num_k_heads, d)))
        qk = rms_norm(qk, weight, q_norm.eps)
    qk = apply_rotary(qk, cos, sin)
    return qk[:, :num_q_heads], qk[:, num_q_heads:]
