"""What the scheduler decided for one step: the contract between control plane and runner.

The runner receives only this (plus the sampling parameters of rows it must sample); it never
reads scheduler or block-manager state. Block tables travel as deltas: each row carries the
block ids appended to its request's table since the runner last saw it, and the runner keeps
the tables (one owner on each side: the scheduler's requests, the runner's persistent batch).
Everything is plain Python so it can be pickled to tensor-parallel workers.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from kvscope.sampling_params import SamplingParams

PLACEHOLDER = -1  # an input token sampled by the step in flight; the runner reads it on the device


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: ``num_new_tokens`` tokens starting at ``start``.

    After applying ``new_block_ids`` the request's table covers positions ``[0, start + n)``.
    """

    seq_id: int
    token_ids: list[int]        # the tokens computed this step: request.token_ids[start:start+n]
    start: int                  # num_computed_tokens before this step (first position)
    new_block_ids: Sequence[int]  # block ids appended to the table since the runner last saw it
    resumed_from_preemption: bool  # the table starts over: new_block_ids is all of it
    is_prefill: bool            # False only for a one-token decode row of a running request
    sample: bool                # True when this chunk reaches the sequence's last token
    num_cached_tokens: int = 0  # prefix-cache hit on admission (0 on later steps)
    params: SamplingParams | None = None  # set when ``sample``
    output_index: int = 0       # how many tokens the sequence has generated so far

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class StepColumns:
    """A step's rows as numpy columns, for code that works on whole steps (input packing, the
    sampler's bookkeeping, the trace)."""

    seq_id: np.ndarray          # int64 [B]
    start: np.ndarray           # int64 [B]
    num_new_tokens: np.ndarray  # int64 [B]
    sample: np.ndarray          # bool [B]
    token_ids: np.ndarray       # int64 [T]: every row's tokens, concatenated
    table_changed: np.ndarray   # int64 [K]: the rows with a block-table delta (new ids or a restart)

    @classmethod
    def from_rows(cls, rows: list[ScheduledRequest]) -> "StepColumns":
        """One pass over the rows (a pass per column costs several times more at a few hundred rows)."""
        seq_ids: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        sample: list[bool] = []
        tokens: list[int] = []
        changed: list[int] = []
        for i, r in enumerate(rows):
            seq_ids.append(r.seq_id)
            starts.append(r.start)
            t = r.token_ids
            lens.append(len(t))
            tokens += t
            sample.append(r.sample)
            if r.new_block_ids or r.resumed_from_preemption:
                changed.append(i)
        return cls(
            seq_id=np.array(seq_ids, dtype=np.int64),
            start=np.array(starts, dtype=np.int64),
            num_new_tokens=np.array(lens, dtype=np.int64),
            sample=np.array(sample, dtype=bool),
            token_ids=np.array(tokens, dtype=np.int64),
            table_changed=np.array(changed, dtype=np.int64),
        )


@dataclass
class SchedulerOutput:
    """One step's rows, plus the requests whose tables the runner must drop (preempted, finished)."""

    step: int
    requests: list[ScheduledRequest] = field(default_factory=list)
    preempted_seq_ids: list[int] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)  # finished or aborted since the last step
    token_budget: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.requests

    @functools.cached_property
    def columns(self) -> StepColumns:
        """Built once per step: the runner packs its inputs from it and a recorder reuses it."""
        return StepColumns.from_rows(self.requests)
