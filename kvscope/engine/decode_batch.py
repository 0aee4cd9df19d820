"""The running requests of a step in which every one of them sampled, as numpy columns.

If the next step finds ``running`` unchanged (the same requests, in the same order) or less
some that finished, and nothing waiting that could be admitted, that step is one decode row per
request, but for a request at its last token (whose last token is still in flight): its starts
are this step's ends, and only the rows that cross into a new block ask the block manager. The
scheduler then plans the step from these columns (:meth:`Scheduler._schedule_steady`) instead
of walking every request's state.
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

    def kept_by(self, running: list[Request]) -> np.ndarray | None:
        """Which rows ``running`` still holds (bool per row) when it is these requests less
        some, in the same order; None otherwise."""
        reqs = self.reqs
        if len(running) >= len(reqs):
            return None
        keep = np.zeros(len(reqs), dtype=bool)
        i = 0
        for req in running:
            while i < len(reqs) and reqs[i] is not req:
                i += 1
            if i == len(reqs):
                return None
            keep[i] = True
            i += 1
        return keep

    def subset(self, keep: np.ndarray) -> "DecodeBatch":
        """The batch of the rows where ``keep`` (bool per row) is true."""
        m = int(np.count_nonzero(keep))
        return DecodeBatch(
            reqs=[r for r, k in zip(self.reqs, keep.tolist()) if k],
            seq_id=self.seq_id[keep], end=self.end[keep], capacity=self.capacity[keep],
            last_start=self.last_start[keep], index_base=self.index_base[keep],
            ones=self.ones[:m], all_true=self.all_true[:m], all_false=self.all_false[:m], zeros=self.zeros[:m],
        )
