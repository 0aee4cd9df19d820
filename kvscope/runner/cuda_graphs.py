"""Decode under CUDA graphs: one graph per bucketed batch size, replayed with static buffers.

Only decode-only steps whose batch fits a bucket and whose block tables fit the captured
width replay a graph; anything else runs eagerly (never a crash).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable

import torch

from kvscope.forward_context import forward_context
from kvscope.kernels.base import AttentionMetadata
from kvscope.runner.inputs import DeviceInputs, StepInputs

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphs:
    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        hidden_size: int,
        max_batch: int,
        max_blocks_per_seq: int,
        max_model_len: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.buckets = [b for b in BUCKETS if b <= max_batch] or [1]
        self.width = max_blocks_per_seq
        self.block_size = block_size
        self.max_model_len = max_model_len
        n = self.buckets[-1]
        i32 = dict(dtype=torch.int32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(n, **i64)
        self.positions = torch.zeros(n, **i64)
        self.slot_mapping = torch.full((n,), -1, **i64)
        self.context_lens = torch.zeros(n, **i32)
        self.cu_seqlens_q = torch.arange(n + 1, **i32)
        self.cu_seqlens_k = torch.zeros(n + 1, **i32)
        self.block_tables = torch.full((n, self.width), -1, **i32)
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._views: dict[int, _BatchViews] = {}
        self._forward = forward
        self._capture_all()

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:b], cu_seqlens_q=self.cu_seqlens_q[: b + 1],
            cu_seqlens_k=self.cu_seqlens_k[: b + 1], context_lens=self.context_lens[:b],
            block_tables=self.block_tables[:b], max_seqlen_q=1, max_seqlen_k=self.max_model_len,
            num_seqs=b, num_tokens=b, block_size=self.block_size, decode_only=True,
        )

    def _capture_all(self) -> None:
        pool = None
        for b in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with forward_context(self._meta(b)):
                self.hidden[:b] = self._forward(self.input_ids[:b], self.positions[:b])  # warm-up
                torch.cuda.synchronize()
                with torch.cuda.graph(graph, pool=pool):
                    self.hidden[:b] = self._forward(self.input_ids[:b], self.positions[:b])
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()

    def can_run(self, inputs: StepInputs) -> bool:
        return (
            inputs.decode_only
            and inputs.num_seqs <= self.buckets[-1]
            and inputs.block_tables.shape[1] <= self.width
        )

    def _batch_views(self, b: int) -> "_BatchViews":
        """The static buffers' slices for a batch of ``b``, made once: each slice is a host call."""
        v = self._views.get(b)
        if v is None:
            g = self.buckets[bisect.bisect_left(self.buckets, b)]
            v = self._views[b] = _BatchViews(
                graph=self.graphs[g], padded=b < g, input_ids=self.input_ids[:b],
                positions=self.positions[:b], slot_mapping=self.slot_mapping[:b],
                context_lens=self.context_lens[:b], cu_seqlens_k=self.cu_seqlens_k[: b + 1],
                block_tables=self.block_tables[:b], hidden=self.hidden[:b],
                pad_slots=self.slot_mapping[b:g], pad_context_lens=self.context_lens[b:g],
                pad_cu_seqlens_k=self.cu_seqlens_k[b + 1: g + 1], last_cu_seqlen_k=self.cu_seqlens_k[b],
            )
        return v

    def run(self, inputs: StepInputs, d: DeviceInputs) -> torch.Tensor:
        """Copy this step's device inputs into the static buffers, replay, return hidden [B, H]."""
        v = self._batch_views(inputs.num_seqs)
        w = inputs.block_tables.shape[1]
        v.input_ids.copy_(d.input_ids)
        v.positions.copy_(d.positions)
        v.slot_mapping.copy_(d.slot_mapping)
        v.context_lens.copy_(d.context_lens)
        v.cu_seqlens_k.copy_(d.cu_seqlens_k)
        if v.padded:  # the bucket's padding rows: no slot, no context
            v.pad_slots.fill_(-1)
            v.pad_context_lens.zero_()
            v.pad_cu_seqlens_k.copy_(v.last_cu_seqlen_k)
        v.block_tables[:, :w].copy_(d.block_tables)
        if w < self.width:
            v.block_tables[:, w:].fill_(-1)
        v.graph.replay()
        return v.hidden


@dataclass(frozen=True)
class _BatchViews:
    """Views of :class:`DecodeGraphs`' static buffers for one batch size, and its bucket's graph."""

    graph: torch.cuda.CUDAGraph
    padded: bool
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    context_lens: torch.Tensor
    cu_seqlens_k: torch.Tensor
    block_tables: torch.Tensor
    hidden: torch.Tensor
    pad_slots: torch.Tensor
    pad_context_lens: torch.Tensor
    pad_cu_seqlens_k: torch.Tensor
    last_cu_seqlen_k: torch.Tensor
