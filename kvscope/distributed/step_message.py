"""What rank 0 sends its workers each step: this step's work as a few flat arrays, block tables
as deltas.

A worker needs, per scheduled row, only what ``build_step_inputs`` reads: the seq id, this
step's tokens, the first position, whether to sample, and the block table. Tokens are already
per step. Block tables are not: a decode row's table is the whole history, so re-sending it
costs O(context) per row per step. Between preemptions a sequence's table only grows at the
end, so rank 0 sends just the appended ids; the worker keeps each sequence's table.

Rank 0 records, per sequence, how many entries the workers hold and the last one. A row whose
table no longer extends that record (preempted, or forgotten) is sent whole with ``RESET``.
Preempted sequences, and when the record outgrows ``max_tracked`` every sequence not in the
step (finished ones), go in ``forget`` so both sides drop them; a forgotten sequence that runs
again is simply sent whole.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np

from kvscope.engine.scheduler_output import ScheduledRequest, SchedulerOutput

SAMPLE, PREFILL, RESET = 1, 2, 4


@dataclass
class StepMessage:
    step: int
    seq_ids: np.ndarray        # int64 [B]
    starts: np.ndarray         # int64 [B]
    num_tokens: np.ndarray     # int64 [B]
    flags: np.ndarray          # uint8 [B]: SAMPLE | PREFILL | RESET
    token_ids: np.ndarray      # int64 [sum(num_tokens)]
    table_counts: np.ndarray   # int64 [B]: entries appended (the whole table under RESET)
    table_entries: np.ndarray  # int32 [sum(table_counts)]
    forget: np.ndarray         # int64 [K]: seq ids to drop before applying this step

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, f).nbytes for f in self.__dataclass_fields__ if f != "step")


class StepEncoder:
    """Rank 0's side: turns a ``SchedulerOutput`` into a ``StepMessage``."""

    def __init__(self, max_tracked: int) -> None:
        self.max_tracked = max_tracked
        self._sent: dict[int, tuple[int, int]] = {}  # seq_id -> (entries workers hold, last entry)

    def encode(self, out: SchedulerOutput) -> StepMessage:
        forget = [s for s in out.preempted_seq_ids if self._sent.pop(s, None) is not None]
        reqs = out.requests
        b = len(reqs)
        flags = np.zeros(b, dtype=np.uint8)
        counts = np.zeros(b, dtype=np.int64)
        appended: list[list[int]] = []
        for i, r in enumerate(reqs):
            table = r.block_table
            held, last = self._sent.get(r.seq_id, (0, -1))
            extends = 0 < held <= len(table) and table[held - 1] == last
            new = table[held:] if extends else table
            flags[i] = (SAMPLE if r.sample else 0) | (PREFILL if r.is_prefill else 0) | (0 if extends else RESET)
            counts[i] = len(new)
            appended.append(new)
            self._sent[r.seq_id] = (len(table), table[-1])
        if len(self._sent) > self.max_tracked:
            scheduled = {r.seq_id for r in reqs}
            stale = [s for s in self._sent if s not in scheduled]
            for s in stale:
                del self._sent[s]
            forget.extend(stale)
        num_tokens = np.fromiter((len(r.token_ids) for r in reqs), dtype=np.int64, count=b)
        return StepMessage(
            step=out.step,
            seq_ids=np.fromiter((r.seq_id for r in reqs), dtype=np.int64, count=b),
            starts=np.fromiter((r.start for r in reqs), dtype=np.int64, count=b),
            num_tokens=num_tokens,
            flags=flags,
            token_ids=np.fromiter(chain.from_iterable(r.token_ids for r in reqs), dtype=np.int64,
                                  count=int(num_tokens.sum())),
            table_counts=counts,
            table_entries=np.fromiter(chain.from_iterable(appended), dtype=np.int32,
                                      count=int(counts.sum())),
            forget=np.asarray(forget, dtype=np.int64),
        )


class StepDecoder:
    """A worker's side: rebuilds the ``SchedulerOutput`` (what the runner consumes) from messages."""

    def __init__(self) -> None:
        self.tables: dict[int, list[int]] = {}

    def decode(self, msg: StepMessage) -> SchedulerOutput:
        for s in msg.forget.tolist():
            self.tables.pop(s, None)
        tokens, entries = msg.token_ids.tolist(), msg.table_entries.tolist()
        reqs = []
        t = e = 0
        for seq_id, start, flags, n, m in zip(msg.seq_ids.tolist(), msg.starts.tolist(), msg.flags.tolist(),
                                              msg.num_tokens.tolist(), msg.table_counts.tolist()):
            if flags & RESET:
                table = self.tables[seq_id] = entries[e:e + m]
            else:
                table = self.tables[seq_id]  # KeyError here means rank 0 and this worker diverged
                table.extend(entries[e:e + m])
            reqs.append(ScheduledRequest(seq_id, tokens[t:t + n], start, table, bool(flags & PREFILL),
                                         bool(flags & SAMPLE)))
            t, e = t + n, e + m
        return SchedulerOutput(step=msg.step, requests=reqs)
