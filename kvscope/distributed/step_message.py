"""What rank 0 sends its workers each step: this step's work as a few flat arrays.

A worker needs, per scheduled row, only what its runner reads: the seq id, this step's tokens,
the first position, whether to sample, the row's block-table delta, and (for the few rows that
have them) how many prompt positions give prompt log-probs, since the LM head that computes
their logits is a collective every rank joins. The deltas are the
scheduler's own (``ScheduledRequest.new_block_ids``, ``resumed_from_preemption``), so each
worker's runner keeps its tables exactly as rank 0's does; the requests whose tables the
runners drop (preempted, finished) travel in ``dropped``.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np

from kvscope.engine.scheduler_output import ScheduledRequest, SchedulerOutput

SAMPLE, PREFILL, RESUMED = 1, 2, 4


@dataclass
class StepMessage:
    step: int
    seq_ids: np.ndarray        # int64 [B]
    starts: np.ndarray         # int64 [B]
    num_tokens: np.ndarray     # int64 [B]
    flags: np.ndarray          # uint8 [B]: SAMPLE | PREFILL | RESUMED
    token_ids: np.ndarray      # int64 [sum(num_tokens)]
    table_counts: np.ndarray   # int64 [B]: len(new_block_ids)
    table_entries: np.ndarray  # int32 [sum(table_counts)]
    dropped: np.ndarray        # int64 [K]: preempted and finished seq ids
    prompt_logits: np.ndarray  # int64 [P, 2]: (row, its num_prompt_logits) of the rows that have any

    @property
    def nbytes(self) -> int:
        return sum(getattr(self, f).nbytes for f in self.__dataclass_fields__ if f != "step")


def encode_step(out: SchedulerOutput) -> StepMessage:
    """Rank 0's side: ``out`` as flat arrays."""
    reqs = out.requests
    b = len(reqs)
    flags = np.fromiter(((SAMPLE if r.sample else 0) | (PREFILL if r.is_prefill else 0)
                         | (RESUMED if r.resumed_from_preemption else 0) for r in reqs), dtype=np.uint8, count=b)
    counts = np.fromiter((len(r.new_block_ids) for r in reqs), dtype=np.int64, count=b)
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
        table_entries=np.fromiter(chain.from_iterable(r.new_block_ids for r in reqs), dtype=np.int32,
                                  count=int(counts.sum())),
        dropped=np.asarray(out.preempted_seq_ids + out.finished_seq_ids, dtype=np.int64),
        prompt_logits=np.array([(i, reqs[i].num_prompt_logits) for i in out.columns.prompt_logit_rows.tolist()],
                               dtype=np.int64).reshape(-1, 2),
    )


def decode_step(msg: StepMessage) -> SchedulerOutput:
    """A worker's side: the ``SchedulerOutput`` its runner consumes."""
    tokens, entries = msg.token_ids.tolist(), msg.table_entries.tolist()
    prompt_logits = dict(msg.prompt_logits.tolist())
    reqs = []
    t = e = 0
    columns = zip(msg.seq_ids.tolist(), msg.starts.tolist(), msg.flags.tolist(), msg.num_tokens.tolist(),
                  msg.table_counts.tolist())
    for i, (seq_id, start, flags, n, m) in enumerate(columns):
        reqs.append(ScheduledRequest(seq_id, tokens[t:t + n], start, entries[e:e + m], bool(flags & RESUMED),
                                     bool(flags & PREFILL), bool(flags & SAMPLE),
                                     num_prompt_logits=prompt_logits.get(i, 0)))
        t, e = t + n, e + m
    return SchedulerOutput(step=msg.step, requests=reqs, finished_seq_ids=msg.dropped.tolist())
