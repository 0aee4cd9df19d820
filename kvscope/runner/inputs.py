"""Packs one step's scheduled work into flat arrays (numpy, no per-token Python loops)."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from kvscope.engine.scheduler_output import SchedulerOutput


@dataclass
class StepInputs:
    """Host-side packed inputs of one step; the runner copies them to the device."""

    input_ids: np.ndarray       # int64 [T]
    positions: np.ndarray       # int64 [T]
    slot_mapping: np.ndarray    # int64 [T]
    cu_seqlens_q: np.ndarray    # int32 [B+1]
    cu_seqlens_k: np.ndarray    # int32 [B+1]
    context_lens: np.ndarray    # int32 [B]
    block_tables: np.ndarray    # int32 [B, W], -1 padded
    logits_indices: np.ndarray  # int64 [S]: last row of each sequence that samples
    max_seqlen_q: int
    max_seqlen_k: int
    decode_only: bool
    no_prefix: bool

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])


@dataclass
class DeviceInputs:
    """The same arrays on the runner's device (int64 ids/positions/slots, int32 metadata)."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    logits_indices: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor


def build_step_inputs(out: SchedulerOutput, block_size: int) -> StepInputs:
    reqs = out.requests
    b = len(reqs)
    q_lens = np.fromiter((len(r.token_ids) for r in reqs), dtype=np.int64, count=b)
    starts = np.fromiter((r.start for r in reqs), dtype=np.int64, count=b)
    t = int(q_lens.sum())
    cu_q = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu_q[1:])
    ctx = starts + q_lens
    cu_k = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(ctx, out=cu_k[1:])

    table_lens = np.fromiter((len(r.block_table) for r in reqs), dtype=np.int64, count=b)
    width = int(table_lens.max())
    tables = np.full((b, width), -1, dtype=np.int32)
    # Row-major order of the mask equals the concatenation order of the tables.
    tables[np.arange(width) < table_lens[:, None]] = np.fromiter(
        chain.from_iterable(r.block_table for r in reqs), dtype=np.int32, count=int(table_lens.sum())
    )

    input_ids = np.fromiter(chain.from_iterable(r.token_ids for r in reqs), dtype=np.int64, count=t)
    row = np.repeat(np.arange(b), q_lens)
    positions = np.arange(t, dtype=np.int64) - cu_q[:-1][row] + starts[row]
    slots = tables[row, positions // block_size].astype(np.int64) * block_size + positions % block_size

    sample = np.fromiter((r.sample for r in reqs), dtype=bool, count=b)
    return StepInputs(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slots,
        cu_seqlens_q=cu_q.astype(np.int32),
        cu_seqlens_k=cu_k.astype(np.int32),
        context_lens=ctx.astype(np.int32),
        block_tables=tables,
        logits_indices=(cu_q[1:] - 1)[sample],
        max_seqlen_q=int(q_lens.max()),
        max_seqlen_k=int(ctx.max()),
        decode_only=bool((q_lens == 1).all()),
        no_prefix=bool((starts == 0).all()),
    )
