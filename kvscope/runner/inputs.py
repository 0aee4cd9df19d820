"""Packs one step's scheduled work into flat arrays (numpy, no per-token Python loops)."""
from __future__ import annotations

from dataclasses import dataclass

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


class BlockTableCache:
    """Each sequence's block table kept as a numpy row between steps, so packing a step copies
    only the block ids appended since the sequence's last step (for decode, usually none)
    instead of every id of every table.

    While a sequence runs its table list only grows; freeing it replaces the list object
    (``BlockManager.free_sequence``). So a row is trusted only while the cached list *is* the
    scheduled one; the cache holds that list, so its ``id`` cannot be reused meanwhile.
    """

    def __init__(self, capacity: int = 512, width: int = 64) -> None:
        self.table = np.full((capacity, width), -1, dtype=np.int32)
        self.rows: dict[int, tuple[int, list[int], int]] = {}  # seq_id -> (row, list, cached length)

    def pack(self, reqs: list) -> np.ndarray:
        """The step's tables, ``[len(reqs), widest]`` int32, -1 past each table's end."""
        capacity = self.table.shape[0]
        if len(self.rows) + len(reqs) > capacity:  # forget finished sequences: start over
            self.rows.clear()
            if len(reqs) > capacity:
                self.table = np.full((2 * len(reqs), self.table.shape[1]), -1, dtype=np.int32)
        widest = max(len(r.block_table) for r in reqs)
        if widest > self.table.shape[1]:
            grown = np.full((self.table.shape[0], 2 * widest), -1, dtype=np.int32)
            grown[:, : self.table.shape[1]] = self.table
            self.table = grown
        rows = self.rows
        slots = np.empty(len(reqs), dtype=np.int64)
        for i, r in enumerate(reqs):
            table, n = r.block_table, len(r.block_table)
            entry = rows.get(r.seq_id)
            if entry is not None and entry[1] is table:
                row, _, cached = entry
            else:
                row = entry[0] if entry is not None else len(rows)
                self.table[row] = -1
                cached = 0
            if n > cached:
                self.table[row, cached:n] = table[cached:]
            rows[r.seq_id] = (row, table, n)
            slots[i] = row
        return self.table[slots, :widest]


def build_step_inputs(out: SchedulerOutput, block_size: int, tables: BlockTableCache) -> StepInputs:
    """Pack ``out``; ``tables`` is the caller's cache, kept across its steps."""
    reqs = out.requests
    b = len(reqs)
    cols = out.columns
    q_lens, starts, input_ids = cols.num_new_tokens, cols.start, cols.token_ids
    t = int(q_lens.sum())
    cu_q = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(q_lens, out=cu_q[1:])
    ctx = starts + q_lens
    cu_k = np.zeros(b + 1, dtype=np.int64)
    np.cumsum(ctx, out=cu_k[1:])

    block_tables = tables.pack(reqs)

    row = np.repeat(np.arange(b), q_lens)
    positions = np.arange(t, dtype=np.int64) - cu_q[:-1][row] + starts[row]
    slots = block_tables[row, positions // block_size].astype(np.int64) * block_size + positions % block_size

    sample = cols.sample
    return StepInputs(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slots,
        cu_seqlens_q=cu_q.astype(np.int32),
        cu_seqlens_k=cu_k.astype(np.int32),
        context_lens=ctx.astype(np.int32),
        block_tables=block_tables,
        logits_indices=(cu_q[1:] - 1)[sample],
        max_seqlen_q=int(q_lens.max()),
        max_seqlen_k=int(ctx.max()),
        decode_only=bool((q_lens == 1).all()),
        no_prefix=bool((starts == 0).all()),
    )
