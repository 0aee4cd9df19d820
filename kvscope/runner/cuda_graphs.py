"""Decode under CUDA graphs: one graph per bucketed batch size, replayed with static buffers.

Only decode-only steps whose batch fits a bucket and whose block tables fit the captured
width replay a graph; anything else runs eagerly (never a crash).
"""
from __future__ import annotations

import bisect
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

    def run(self, inputs: StepInputs, d: DeviceInputs) -> torch.Tensor:
        """Copy this step's device inputs into the static buffers, replay, return hidden [B, H]."""
        b = inputs.num_seqs
        g = self.buckets[bisect.bisect_left(self.buckets, b)]
        w = inputs.block_tables.shape[1]
        self.input_ids[:b].copy_(d.input_ids)
        self.positions[:b].copy_(d.positions)
        self.slot_mapping[:b].copy_(d.slot_mapping)
        self.context_lens[:b].copy_(d.context_lens)
        self.cu_seqlens_k[: b + 1].copy_(d.cu_seqlens_k)
        if b < g:  # the bucket's padding rows: no slot, no context (each call costs host time)
            self.slot_mapping[b:g].fill_(-1)
            self.context_lens[b:g].zero_()
            self.cu_seqlens_k[b + 1: g + 1] = self.cu_seqlens_k[b]
        self.block_tables[:b, :w].copy_(d.block_tables)
        if w < self.width:
            self.block_tables[:b, w:].fill_(-1)
        self.graphs[g].replay()
        return self.hidden[:b]
