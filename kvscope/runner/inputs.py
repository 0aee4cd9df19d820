"""Packs one step's scheduled work into flat arrays (numpy, no per-token Python loops)."""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import NamedTuple

import numpy as np

from kvscope.engine.scheduler_output import DecodeRows, SchedulerOutput


class Appended(NamedTuple):
    """The blocks the last ``BlockTables.update`` appended, one entry each: the step's row
    that took it, and its column in that row's table (the runner's graphs append the same)."""

    index: np.ndarray   # int64 [N]
    column: np.ndarray  # int64 [N]


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
    table_rows: np.ndarray      # int64 [B]: each sequence's row in the runner's BlockTables
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


class BlockTables:
    """The runner's copy of every scheduled request's block table: one numpy row per request,
    kept between steps and updated only from each step's deltas (``new_block_ids``), as vLLM's
    persistent batch is. Packing a step then copies whole rows, never walks a list.

    A row is made when a request is first scheduled or starts over
    (``resumed_from_preemption``), extended by the ids appended since, and dropped when the
    scheduler reports the request preempted or finished.
    """

    def __init__(self, capacity: int = 256, width: int = 64) -> None:
        self.table = np.full((capacity, width), -1, dtype=np.int32)
        self.lengths = np.zeros(capacity, dtype=np.int64)
        self.rows: dict[int, int] = {}  # seq_id -> row
        self._free_rows = list(range(capacity - 1, -1, -1))
        # The last step's (seq_ids, rows): a decode step usually schedules the same sequences
        # again, and while no row was taken their rows are the same (a dropped sequence comes
        # back only through a new row).
        self._last: tuple[np.ndarray, np.ndarray] | None = None
        self.appended = Appended(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))

    def update(self, out: SchedulerOutput) -> np.ndarray:
        """Apply ``out``'s deltas; returns each scheduled request's row, in step order.

        Only the rows with a delta (``StepColumns.table_changed``) are visited one by one; a
        new request always brings its first blocks, so every other row already exists. A
        steady decode step of the same sequences as the last step (``DecodeRows``, one block
        at most per row, ``DecodeRows.appended``) is applied as whole arrays.
        """
        for seq_id in chain(out.finished_seq_ids, out.preempted_seq_ids):
            self._drop(seq_id)
        reqs, cols = out.requests, out.columns
        last = self._last
        if type(reqs) is DecodeRows and last is not None and last[0] is cols.seq_id:
            rows = last[1]
            self._append_one_each(cols.table_changed, rows[cols.table_changed], reqs.appended)
            return rows
        index: list[int] = []
        columns: list[int] = []
        for i in cols.table_changed.tolist():
            r = reqs[i]
            row = self.rows.get(r.seq_id)
            if row is None or r.resumed_from_preemption:
                if row is None:
                    row = self.rows[r.seq_id] = self._take_row()
                self.table[row] = -1
                self.lengths[row] = 0
            new = r.new_block_ids
            if new:
                start = int(self.lengths[row])
                end = start + len(new)
                if end > self.table.shape[1]:
                    self._widen(end)
                self.table[row, start:end] = new
                self.lengths[row] = end
                index += [i] * len(new)
                columns += range(start, end)
        self.appended = Appended(np.array(index, dtype=np.int64), np.array(columns, dtype=np.int64))
        seq_ids, last = cols.seq_id, self._last  # (a row taken above forgot the last rows)
        # (The scheduler's steady decode steps share one seq_id array: identity answers first.)
        if last is not None and (last[0] is seq_ids or np.array_equal(last[0], seq_ids)):
            return last[1]
        rows = np.fromiter(map(self.rows.__getitem__, seq_ids.tolist()), dtype=np.int64, count=len(reqs))
        self._last = (seq_ids, rows)
        return rows

    def _append_one_each(self, index: np.ndarray, rows: np.ndarray, blocks: np.ndarray) -> None:
        """Append ``blocks[k]`` to table row ``rows[k]`` (the step's row ``index[k]``)."""
        columns = self.lengths[rows]
        if columns.size and columns.max() >= self.table.shape[1]:
            self._widen(int(columns.max()) + 1)
        self.table[rows, columns] = blocks
        self.lengths[rows] = columns + 1
        self.appended = Appended(index, columns)

    def get(self, seq_id: int) -> list[int]:
        """One request's table as the runner holds it (tests compare it with the scheduler's)."""
        row = self.rows[seq_id]
        return self.table[row, : self.lengths[row]].tolist()

    def pack(self, rows: np.ndarray) -> np.ndarray:
        """The tables of ``rows``, ``[len(rows), widest]`` int32, -1 past each table's end."""
        return self.table[rows, : int(self.lengths[rows].max())]

    def _drop(self, seq_id: int) -> None:
        row = self.rows.pop(seq_id, None)
        if row is not None:
            self._free_rows.append(row)

    def _take_row(self) -> int:
        self._last = None
        if not self._free_rows:
            n = self.table.shape[0]
            self.table = np.concatenate([self.table, np.full_like(self.table, -1)])
            self.lengths = np.concatenate([self.lengths, np.zeros_like(self.lengths)])
            self._free_rows = list(range(2 * n - 1, n - 1, -1))
        return self._free_rows.pop()

    def _widen(self, width: int) -> None:
        grown = np.full((self.table.shape[0], max(width, 2 * self.table.shape[1])), -1, dtype=np.int32)
        grown[:, : self.table.shape[1]] = self.table
        self.table = grown


def build_step_inputs(out: SchedulerOutput, block_size: int, tables: BlockTables,
                      table_rows: np.ndarray | None = None) -> StepInputs:
    """Apply ``out``'s block-table deltas to ``tables`` (the caller's, kept across its steps),
    then pack the step; ``table_rows``: what ``tables.update(out)`` returned, where the caller
    applied them already. A decode-only step (one token per row, the steady state) takes a
    shorter path: each numpy call costs microseconds of fixed overhead, whatever its size."""
    cols = out.columns
    q_lens, starts, input_ids = cols.num_new_tokens, cols.start, cols.token_ids
    b, t = len(q_lens), len(input_ids)
    ctx = starts + q_lens
    cu_k = np.zeros(b + 1, dtype=np.int32)
    np.cumsum(ctx, out=cu_k[1:])
    if table_rows is None:
        table_rows = tables.update(out)
    block_tables = tables.pack(table_rows)
    decode_only = t == b  # every row has at least one token
    if decode_only:
        row = np.arange(b)
        cu_q = np.arange(b + 1, dtype=np.int32)
        positions = starts
        logits_indices = np.flatnonzero(cols.sample)
    else:
        ends = np.cumsum(q_lens)
        row = np.repeat(np.arange(b), q_lens)
        positions = np.arange(t, dtype=np.int64) + (starts - ends + q_lens)[row]
        logits_indices = (ends - 1)[cols.sample]
        cu_q = np.zeros(b + 1, dtype=np.int32)
        cu_q[1:] = ends
    block, offset = np.divmod(positions, block_size)
    slots = block_tables[row, block].astype(np.int64)
    slots *= block_size
    slots += offset
    return StepInputs(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slots,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        context_lens=ctx.astype(np.int32),
        block_tables=block_tables,
        logits_indices=logits_indices,
        table_rows=table_rows,
        max_seqlen_q=1 if decode_only else int(q_lens.max()),
        max_seqlen_k=int(ctx.max()),
        decode_only=decode_only,
        no_prefix=not starts.any(),
    )
