"""What the scheduler decided for one step: the contract between control plane and runner.

The runner receives only this (plus the sampling parameters of rows it must sample, and the
token history of rows whose penalties need it); it never reads scheduler or block-manager state. Block tables travel as deltas: each row carries the
block ids appended to its request's table since the runner last saw it, and the runner keeps
the tables (one owner on each side: the scheduler's requests, the runner's persistent batch).
Everything is plain Python so it can be pickled to tensor-parallel workers.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from kvscope.sampling_params import SamplingParams

PLACEHOLDER = -1  # an input token sampled by the step in flight; the runner reads it on the device
_NONE = np.zeros(0, dtype=np.int64)  # no rows (read-only)
_NONE.flags.writeable = False


@dataclass(slots=True, frozen=True)
class TokenHistory:
    """The tokens a request has so far, for what reads more than a row's own tokens: the
    sampler's penalties and bad words, and prompt log-probs (of the tokens after each row's
    last, too). Its prompt, then the outputs appended on the host: ``token_ids`` is the
    request's own list, read when the step launches (sliced only where read, never copied
    whole); an output still in flight is its row's ``PLACEHOLDER`` input."""

    token_ids: list[int]
    num_prompt_tokens: int
    prompt_logprobs: int | None = None  # the request's top-k of prompt log-probs, when it asks


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
    # EOS (unless ignore_eos) and params.stop_token_ids: what a sampled row may not draw before
    # its min_tokens-th token (vLLM's all_stop_token_ids)
    all_stop_token_ids: frozenset[int] = frozenset()
    history: TokenHistory | None = None  # set when ``sample`` and the params penalize or ban words, or prompt logits
    # leading positions whose logits give prompt log-probs (of the tokens after them), when asked
    num_prompt_logits: int = 0

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
    output_index: np.ndarray    # int64 [B]: each row's ScheduledRequest.output_index
    is_prefill: np.ndarray      # bool [B]
    num_cached_tokens: np.ndarray  # int64 [B]
    prompt_logit_rows: np.ndarray = field(default_factory=lambda: _NONE)  # int64 [P]: rows with prompt logits

    @classmethod
    def from_rows(cls, rows: list[ScheduledRequest]) -> "StepColumns":
        """One pass over the rows (a pass per column costs several times more at a few hundred rows)."""
        seq_ids: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        sample: list[bool] = []
        tokens: list[int] = []
        changed: list[int] = []
        index: list[int] = []
        prefill: list[bool] = []
        cached: list[int] = []
        prompt_logits: list[int] = []
        for i, r in enumerate(rows):
            seq_ids.append(r.seq_id)
            starts.append(r.start)
            t = r.token_ids
            lens.append(len(t))
            tokens += t
            sample.append(r.sample)
            index.append(r.output_index)
            prefill.append(r.is_prefill)
            cached.append(r.num_cached_tokens)
            if r.new_block_ids or r.resumed_from_preemption:
                changed.append(i)
            if r.num_prompt_logits:
                prompt_logits.append(i)
        return cls(
            seq_id=np.array(seq_ids, dtype=np.int64),
            start=np.array(starts, dtype=np.int64),
            num_new_tokens=np.array(lens, dtype=np.int64),
            sample=np.array(sample, dtype=bool),
            token_ids=np.array(tokens, dtype=np.int64),
            table_changed=np.array(changed, dtype=np.int64),
            output_index=np.array(index, dtype=np.int64),
            is_prefill=np.array(prefill, dtype=bool),
            num_cached_tokens=np.array(cached, dtype=np.int64),
            prompt_logit_rows=np.array(prompt_logits, dtype=np.int64),
        )


class DecodeRows(Sequence[ScheduledRequest]):
    """The rows of a steady decode step (one per running request, each one token that samples),
    made only when read: the scheduler plans such a step as columns, and the runner and the
    scheduler's post-processing read those, and so does a ``summary`` trace: a step nobody
    inspects row by row (no ``blocks`` or ``full`` trace, no ``step.scheduled`` hook) builds no
    per-row object. The rows are those the general path
    would have built; the first iteration builds them all and keeps them (one row read by
    index, as the runner reads the few whose tables grew, is built alone)."""

    __slots__ = ("_reqs", "_tokens", "_starts", "_new_block_ids", "_output_index", "_rows", "appended")

    def __init__(self, reqs: Sequence, tokens: list[int], starts: list[int],
                 new_block_ids: list[Sequence[int]], output_index: list[int], appended: np.ndarray) -> None:
        self._reqs, self._tokens, self._starts = reqs, tokens, starts
        self._new_block_ids, self._output_index = new_block_ids, output_index
        self._rows: list[ScheduledRequest] | None = None
        # int64 [K]: the one block id each row of ``StepColumns.table_changed`` appends (a steady
        # step's row crosses into one new block at most, and never starts its table over), so
        # the runner can apply the step's deltas as whole arrays.
        self.appended = appended

    def __len__(self) -> int:
        return len(self._reqs)

    @property
    def reqs(self) -> Sequence:
        """The scheduler's request of each row, in row order (its post-processing walks these)."""
        return self._reqs

    def __getitem__(self, i):
        if self._rows is not None or isinstance(i, slice):
            return self._all()[i]
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(i)
        return self._row(i)

    def __iter__(self) -> Iterator[ScheduledRequest]:
        return iter(self._all())

    def _all(self) -> list[ScheduledRequest]:
        if self._rows is None:
            self._rows = [self._row(i) for i in range(len(self))]
        return self._rows

    def _row(self, i: int) -> ScheduledRequest:
        # (Fields in order: not resumed, not prefill, samples, no cache hit.)
        req = self._reqs[i]
        return ScheduledRequest(req.seq_id, [self._tokens[i]], self._starts[i], self._new_block_ids[i],
                                False, False, True, 0, req.params, self._output_index[i], req.stop_token_set,
                                req.history)


@dataclass
class SchedulerOutput:
    """One step's rows, plus the requests whose tables the runner must drop (preempted, finished)."""

    step: int
    # (A steady decode step's are a DecodeRows: a read-only sequence, each row made when read.)
    requests: list[ScheduledRequest] | DecodeRows = field(default_factory=list)
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
