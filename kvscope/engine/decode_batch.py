"""The running requests of a step in which every one of them sampled, as numpy columns.

If the next step finds ``running`` unchanged (the same requests, in the same order), nothing
waiting that could be admitted and no request at its last token, that step is one decode row
per request: its starts are this step's ends, and only the rows that cross into a new block
ask the block manager. The scheduler then plans the step from these columns
(:meth:`Scheduler._schedule_steady`) instead of walking every request's state.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvscope.engine.request import Request
from kvscope.engine.scheduler_output import StepColumns


@dataclass(slots=True)
class DecodeBatch:
    reqs: list[Request]      # ``running`` when the step was scheduled (a copy)
    seq_id: np.ndarray       # int64 [B]
    end: np.ndarray          # int64 [B]: num_computed_tokens after the step (the next row's start)
    capacity: np.ndarray     # int64 [B]: tokens each block table covers
    last_start: np.ndarray   # int64 [B]: max_total_tokens - 1, past which a request gets no row
    index_base: np.ndarray   # int64 [B]: num_prompt_tokens - 1 (a row's output_index is start - it)
    ones: np.ndarray         # int64 [B] of 1, read-only: every steady step's num_new_tokens
    all_true: np.ndarray     # bool [B], read-only: every steady step's sample
    all_false: np.ndarray    # bool [B], read-only: every steady step's is_prefill
    zeros: np.ndarray        # int64 [B] of 0, read-only: every steady step's num_cached_tokens

    @classmethod
    def after(cls, running: list[Request], cols: StepColumns, block_size: int) -> "DecodeBatch | None":
        """The batch a step leaves behind, or None unless its rows were all of ``running``, in
        order, and every row sampled (so each request has exactly one token left to compute)."""
        if len(cols.seq_id) != len(running) or not cols.sample.all():
            return None
        reqs = list(running)
        n = len(reqs)
        seq_id = np.fromiter((r.seq_id for r in reqs), dtype=np.int64, count=n)
        if not np.array_equal(seq_id, cols.seq_id):
            return None
        ones, all_true = np.ones(n, dtype=np.int64), np.ones(n, dtype=bool)
        all_false, zeros = np.zeros(n, dtype=bool), np.zeros(n, dtype=np.int64)
        for column in (ones, all_true, all_false, zeros):
            column.flags.writeable = False  # shared by the columns of many steps
        return cls(
            reqs=reqs,
            seq_id=cols.seq_id,
            end=cols.start + cols.num_new_tokens,
            capacity=np.fromiter((len(r.block_table) for r in reqs), dtype=np.int64, count=n) * block_size,
            last_start=np.fromiter((r.max_total_tokens - 1 for r in reqs), dtype=np.int64, count=n),
            index_base=np.fromiter((r.num_prompt_tokens - 1 for r in reqs), dtype=np.int64, count=n),
            ones=ones,
            all_true=all_true,
            all_false=all_false,
            zeros=zeros,
        )
