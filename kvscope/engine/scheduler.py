"""Owns every request transition: admission, scheduling, preemption, post-processing of sampled
tokens, finishing, aborting, and the rollback of a step whose launch failed.

Two policies (docs/ARCHITECTURE.md, "Scheduling policies"):

* ``unified`` (vLLM V1): no phases. Running requests first, each asking for the tokens it
  has not computed yet (one for decode, the rest of a prompt for a chunked prefill), clamped
  to the remaining budget; then waiting requests with what is left. Prefill chunks and decode
  rows share one packed forward pass.
* ``prefill_first`` (nano-vLLM): a step is all prefill (chunks of running prompts, then new
  admissions) when there is prefill work that fits, otherwise all decode.

When blocks run out for a running request, the scheduler preempts from the tail of
``running`` (LIFO) by recompute: the victim's blocks are freed, its computed tokens reset, and
it goes to the head of ``waiting``.

Scheduling a chunk advances ``num_computed_tokens`` at once, and a chunk that samples adds a
pending token, so under async scheduling the next step can be planned while this one runs: a
decode row whose input token is still on the device carries ``PLACEHOLDER`` instead of its id.

The engine keeps what needs a tokenizer (stop strings, text) and the hooks; it asks the
scheduler for every change of a request's state (vLLM's split between
``Scheduler.update_from_output`` and the ``OutputProcessor``).
"""
from __future__ import annotations

import time
from collections import deque

import numpy as np

from kvscope.config import EngineConfig
from kvscope.engine.block_manager import BlockManager
from kvscope.engine.decode_batch import DecodeBatch
from kvscope.engine.executor import StepResult
from kvscope.engine.request import Request, RequestStatus
from kvscope.engine.scheduler_output import PLACEHOLDER, DecodeRows, ScheduledRequest, SchedulerOutput, StepColumns

_NONE: tuple[int, ...] = ()  # the usual decode row's new block ids (shared, never mutated)
_NO_BLOCKS = np.zeros(0, dtype=np.int64)  # a steady step's appended blocks when no row crosses (read-only)
_NO_BLOCKS.flags.writeable = False


def _unsent_blocks(req: Request) -> list[int] | tuple[int, ...]:
    """The block ids appended to ``req``'s table since the runner last saw it (a row's
    ``new_block_ids``), marked sent."""
    table, sent = req.block_table, req.num_sent_blocks
    req.num_sent_blocks = len(table)
    return table[sent:] if len(table) > sent else _NONE


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.requests: dict[int, Request] = {}  # seq_id -> every unfinished request
        # seq_id -> request_id of the requests finished since the last schedule(): a step
        # launched before they finished still has their rows (async scheduling)
        self.recently_finished: dict[int, str] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.step_count = 0
        self._finished_seq_ids: list[int] = []  # for the runner, in the next step that has rows
        # The last step's running requests when all of them sampled (the steady decode path's
        # state); ``steady_decode`` False plans every step on the general path (tests compare them).
        self._batch: DecodeBatch | None = None
        self.steady_decode = True
        self.num_steady_steps = 0

    # ----------------------------------------------------------------- queues
    def add_request(self, request: Request) -> None:
        self.requests[request.seq_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish_request(self, request: Request, reason: str) -> None:
        """End ``request`` ("stop", "length", "abort" or "error"): out of its queue, its blocks released."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.block_manager.free_request(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.metrics.finished_time = time.perf_counter()
        del self.requests[request.seq_id]
        self.recently_finished[request.seq_id] = request.request_id
        if request.num_sent_blocks or request.resumed:  # the runner holds a table for it
            self._finished_seq_ids.append(request.seq_id)

    # --------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        self.step_count += 1
        self.block_manager.step = self.step_count
        self.recently_finished = {}
        out = SchedulerOutput(step=self.step_count, token_budget=self.config.max_num_batched_tokens)
        if self._schedule_steady(out):
            self.num_steady_steps += 1
        else:
            if self.config.scheduling_policy == "prefill_first":
                self._schedule_prefill_first(out)
            else:
                self._schedule_unified(out)
            self._batch = (DecodeBatch.after(self.running, out.columns, self.block_manager.block_size)
                           if self.steady_decode and out.requests else None)
        if out.requests:  # a step without rows never reaches the runner: keep them for the next
            out.finished_seq_ids, self._finished_seq_ids = self._finished_seq_ids, []
        return out

    def discard_finished_rows(self, out: SchedulerOutput) -> None:
        """Drop the rows of requests finished after they were scheduled, before the step runs
        (a hook aborted them while the step was being scheduled)."""
        out.requests = [r for r in out.requests if r.seq_id in self.requests]
        out.__dict__.pop("columns", None)  # (if a hook already read them, they name the dropped rows)
        if not out.requests:  # the step will not reach the runner: keep its news for the next
            self._finished_seq_ids += out.finished_seq_ids
            out.finished_seq_ids = []

    def _schedule_steady(self, out: SchedulerOutput) -> bool:
        """Plan a step of one decode row per running request from the last step's columns
        (:mod:`~kvscope.engine.decode_batch`); False, changing nothing, when the general path
        must plan it. Both policies plan such a step the same way: nothing to admit, nothing to
        prefill, every running request once, in order (but one at its last token, still in
        flight, which gets no row), and blocks only at block boundaries."""
        batch, running = self._batch, self.running
        if batch is None:
            return False
        has_row = batch.end < batch.last_start  # a request at its last token gets no row
        if running != batch.reqs:  # (identity: a Request compares by identity)
            keep = batch.kept_by(running)  # requests that finished since: their rows go
            if keep is None:
                return False
            has_row &= keep
        if self.waiting and len(running) < self.config.max_num_seqs:
            return False
        if not has_row.all():
            if not has_row.any():
                return False
            batch = batch.subset(has_row)
        n = len(batch.reqs)
        if n > out.token_budget:
            return False
        start = batch.end
        bm = self.block_manager
        cross = np.flatnonzero(start >= batch.capacity)
        if len(cross) > bm.num_free_blocks:  # the general path preempts
            return False
        self._batch = batch
        new_ids: list = [_NONE] * n
        appended = _NO_BLOCKS
        if len(cross):
            # One block each, taken in row order as the general path takes them. Every row's
            # earlier blocks went to the runner with the last step, so its delta is this block.
            rows = cross.tolist()
            crossing = [batch.reqs[i] for i in rows]
            blocks = bm.append_blocks(crossing)
            for i, req, b in zip(rows, crossing, blocks):
                req.num_sent_blocks += 1
                new_ids[i] = [b]
            appended = np.array(blocks, dtype=np.int64)
            batch.capacity[cross] += bm.block_size
        tokens: list[int] = []
        starts = start.tolist()
        for req, s in zip(batch.reqs, starts):
            ids = req.token_ids
            tokens.append(ids[s] if s < len(ids) else PLACEHOLDER)
            req.num_computed_tokens = s + 1
            req.num_pending += 1
        batch.end = start + 1
        index = start - batch.index_base
        out.requests = DecodeRows(batch.reqs, tokens, starts, new_ids, index.tolist(), appended)
        out.columns = StepColumns(
            seq_id=batch.seq_id, start=start, num_new_tokens=batch.ones, sample=batch.all_true,
            token_ids=np.array(tokens, dtype=np.int64), table_changed=cross, output_index=index,
            is_prefill=batch.all_false, num_cached_tokens=batch.zeros,
        )
        return True

    def _schedule_unified(self, out: SchedulerOutput) -> None:
        budget = self._schedule_running(out, out.token_budget, prefill_only=False)
        if not out.preempted_seq_ids:
            self._admit_waiting(out, budget)

    def _schedule_prefill_first(self, out: SchedulerOutput) -> None:
        budget = self._schedule_running(out, out.token_budget, prefill_only=True)
        # After a preemption, admit nothing this step: a prefill that preempted itself for want
        # of blocks would be re-admitted into the blocks it just gave up, step after step,
        # while the decoding requests that hold the rest of the pool never ran (a livelock
        # the property test found). The step then falls through to decode.
        if not out.preempted_seq_ids:
            self._admit_waiting(out, budget)
        if not out.requests:
            self._schedule_running(out, out.token_budget, prefill_only=False)

    def _schedule_running(self, out: SchedulerOutput, budget: int, prefill_only: bool) -> int:
        bs = self.block_manager.block_size
        running = self.running
        rows = out.requests
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            start = req.num_computed_tokens
            known = len(req.token_ids) + req.num_pending
            if (prefill_only and start >= req.prefill_len) or known >= req.max_total_tokens:
                i += 1  # (the second case: its last token is in flight; the request ends then)
                continue
            n = known - start if known - start < budget else budget
            # Only a row that crosses into a new block asks the block manager (a decode row
            # does once every block_size steps).
            if start + n > len(req.block_table) * bs and not self._make_room(req, start + n, out):
                if prefill_only:
                    break
                continue  # ``req`` preempted itself: the next request now stands at ``i``
            rows.append(self._scheduled(req, n))
            budget -= n
            i += 1
        return budget

    def _make_room(self, req: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        """Extend ``req``'s table to ``num_tokens``, preempting from the tail of ``running``
        until the blocks fit; False when ``req`` itself had to go."""
        while not self.block_manager.allocate(req, num_tokens):
            victim = self.running[-1]
            self.preempt(victim, out)
            if victim is req:
                return False
        return True

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        chunked = self.config.enable_chunked_prefill
        bs = self.block_manager.block_size
        share = self.block_manager.enable_prefix_caching
        in_flight: set[int] | None = None  # made on first need
        deferred: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if req.num_pending:
                break  # preempted with a token in flight: re-admit once its tokens are all known
            # (a request owed prompt log-probs computes its prompt: cached blocks give no logits)
            cached = [] if req.num_prompt_logits else self.block_manager.find_cached_prefix(req)
            if share and out.requests and not req.num_prompt_logits and self._may_hit_more(req, len(cached)):
                if in_flight is None:
                    in_flight = self._blocks_in_flight()
                if self.block_manager.block_hash_of(req, len(cached)) in in_flight:
                    deferred.append(self.waiting.popleft())
                    continue
            num_cached = len(cached) * bs
            n = req.num_tokens - num_cached
            if n > budget and not chunked:
                break
            n = min(n, budget)
            if not self.block_manager.allocate(req, num_cached + n, cached):
                break
            self.waiting.popleft()
            self.block_manager.count_admission(req.num_tokens, num_cached)
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_cached
            req.prefill_len = req.num_tokens
            if req.metrics.first_scheduled_time is None:
                req.metrics.num_cached_tokens = num_cached
            self.running.append(req)
            out.requests.append(self._scheduled(req, n, num_cached))
            budget -= n
            if in_flight is not None:
                in_flight.update(self._unhashed_blocks(req))
        self.waiting.extendleft(reversed(deferred))  # back at the head, in their order

    # In-batch prefix sharing. A waiting request whose next uncached block is being computed
    # by a running request (in this step, or in one still in flight under async scheduling)
    # waits, and is admitted once that block is in the prefix cache instead of computing it a
    # second time. Each wait is for a block that the next update registers (or that leaves
    # with its preempted or finished request), so a request waits at most a step or two per
    # block of its prompt, and never while nothing else is scheduled.
    def _may_hit_more(self, req: Request, num_cached_blocks: int) -> bool:
        """Whether ``req`` has a block past its cached prefix that the cache could give it
        (full, and not holding its last token), so waiting could help."""
        return num_cached_blocks < self.block_manager.num_cacheable_blocks(req)

    def _blocks_in_flight(self) -> set[int]:
        """Hashes of the computed (or being computed) full prompt blocks of running requests
        that the prefix cache does not hold yet. The scan starts at the tail of ``running``
        (the latest admissions) and stops at the first request that has sampled a token and
        has its whole prompt in the cache, so a step of steady decode pays one check; a
        prefilling request further in (rare) is missed, and one that shares its blocks then
        computes them again, as it would without this."""
        hashes: set[int] = set()
        bs = self.block_manager.block_size
        for req in reversed(self.running):
            if req.num_hashed_blocks >= req.prefill_len // bs and req.num_output_tokens:
                break
            hashes.update(self._unhashed_blocks(req))
        return hashes

    def _unhashed_blocks(self, req: Request) -> list[int]:
        bm = self.block_manager
        return [bm.block_hash_of(req, i) for i in range(req.num_hashed_blocks, bm.num_full_computed_blocks(req))]

    def _scheduled(self, req: Request, n: int, num_cached: int = 0) -> ScheduledRequest:
        """The step's share of ``req``; marks those tokens computed and the sample pending."""
        start = req.num_computed_tokens
        end = start + n
        tokens = req.token_ids
        num_tokens = len(tokens)
        pending = req.num_pending
        sample = end == num_tokens + pending
        # (prompt positions below the last whose logits give the next prompt token's log-prob)
        prompt_logits = max(0, min(end, req.num_prompt_tokens - 1) - start) if req.num_prompt_logits else 0
        token_ids = tokens[start:end]
        if end > num_tokens:  # only a decode row's one input token can be in flight
            token_ids.append(PLACEHOLDER)
        # Positional arguments, in field order: keyword construction costs several times more
        # and this runs once per row per step.
        row = ScheduledRequest(
            req.seq_id, token_ids, start, _unsent_blocks(req), req.resumed,
            start < req.prefill_len, sample, num_cached, req.params if sample else None,
            num_tokens - req.num_prompt_tokens + pending, req.stop_token_set,
            req.history if sample or prompt_logits else None, prompt_logits,
        )
        req.resumed = False
        req.num_computed_tokens = end
        if sample:
            req.num_pending = pending + 1
        return row

    def preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Preempt a running request by recompute: its blocks go, it waits at the head again."""
        self._back_to_waiting(request)
        request.metrics.num_preemptions += 1
        out.preempted_seq_ids.append(request.seq_id)

    def _back_to_waiting(self, request: Request) -> None:
        self.running.remove(request)
        self.block_manager.free_request(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = 0
        request.num_sent_blocks = 0
        request.resumed = True
        self.waiting.appendleft(request)

    # ----------------------------------------------------------- post-process
    def update_from_output(self, out: SchedulerOutput, result: StepResult, now: float
                           ) -> tuple[list[Request], list[Request]]:
        """Apply a step's sampled tokens: append them, hash the blocks they completed, and finish
        requests that hit a token-level stop (EOS, ``stop_token_ids``, length).

        Returns the requests that got a token and those among them that finished. Stop strings
        need text, so the engine checks those and calls :meth:`finish_request` itself.
        """
        tokens, errors = result.tokens, result.errors
        if type(out.requests) is DecodeRows and not errors and not result.logprobs:
            return self._update_steady(out, tokens, now)
        if result.prompt_logprobs:
            self._keep_prompt_logprobs(out, result.prompt_logprobs)
        progressed, finished = [], []
        bm = self.block_manager
        bs = bm.block_size if bm.enable_prefix_caching else 0
        live = self.requests
        running = RequestStatus.RUNNING
        cols = out.columns  # (read as columns: a steady decode step's rows are never built here)
        seq_ids = cols.seq_id.tolist()
        step_reqs = [live.get(seq_id) for seq_id in seq_ids]  # None: finished or aborted since
        # Every row's blocks are hashed before any row finishes (the steady path does the same),
        # only where a block just filled (never past a token still in flight).
        if bs:
            bm.hash_computed_blocks([
                req for req in step_reqs if req is not None and req.status is running
                and min(req.num_computed_tokens, len(req.token_ids)) // bs > req.num_hashed_blocks])
        for req, seq_id, sample in zip(step_reqs, seq_ids, cols.sample.tolist()):
            if req is None:
                continue  # finished or aborted while this step was in flight: its work is dropped
            ids = req.token_ids
            m = req.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
            if not sample:
                continue
            if errors and seq_id in errors:  # this request failed alone
                req.num_pending -= 1
                req.error = errors[seq_id]
                self.finish_request(req, "error")  # (vLLM's: a request-level internal error)
                finished.append(req)
                continue
            token = tokens[seq_id]
            ids.append(token)
            req.num_pending -= 1
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            if req.output_logprobs is not None:
                lp = result.logprobs.get(seq_id, {})
                req.output_logprobs.append(lp)
                req.cumulative_logprob += lp.get(token, 0.0)
            progressed.append(req)
            if token in req.stop_token_set or len(ids) >= req.max_total_tokens:
                self._finish_if_stopped(req, token, finished)
        return progressed, finished

    def _keep_prompt_logprobs(self, out: SchedulerOutput, prompt_logprobs: dict[int, list[dict[int, float]]]) -> None:
        """Append each row's prompt log-probs to its request's: those of prompt tokens
        ``start + 1`` on, each kept once (a request recomputed after a preemption owes fewer)."""
        cols, live = out.columns, self.requests
        for row in cols.prompt_logit_rows.tolist():
            req = live.get(int(cols.seq_id[row]))
            if req is None or req.prompt_logprobs is None:
                continue  # finished or aborted while the step was in flight
            first = int(cols.start[row]) + 1  # the prompt token the row's first position predicts
            kept = req.prompt_logprobs
            if first <= len(kept):  # (chunks come back in order: the row starts where the last ended, or before)
                kept += prompt_logprobs[req.seq_id][len(kept) - first:]

    def _update_steady(self, out: SchedulerOutput, tokens: dict[int, int], now: float
                       ) -> tuple[list[Request], list[Request]]:
        """:meth:`update_from_output` of a steady decode step (every row one token that samples,
        no row failed, no log-probs), row by row in the same order, with the same effects.

        What it leaves out is what such a step cannot need: every row was scheduled and sampled
        by the step before (its first times are set, its blocks hashed up to its input token),
        so a row's blocks need hashing only when its input token was the last of a block."""
        progressed, finished = [], []
        bm = self.block_manager
        reqs = out.requests.reqs
        if bm.enable_prefix_caching:  # (before any row finishes, as on the general path)
            running = RequestStatus.RUNNING
            filled = np.flatnonzero((out.columns.start + 1) % bm.block_size == 0).tolist()
            bm.hash_computed_blocks([r for r in map(reqs.__getitem__, filled) if r.status is running])
        done = RequestStatus.FINISHED
        for req in reqs:
            if req.status is done:
                continue  # finished or aborted while this step was in flight: its work is dropped
            token = tokens[req.seq_id]
            ids = req.token_ids
            ids.append(token)
            req.num_pending -= 1
            req.metrics.last_token_time = now
            progressed.append(req)
            if token in req.stop_token_set or len(ids) >= req.max_total_tokens:
                self._finish_if_stopped(req, token, finished)
        return progressed, finished

    def _finish_if_stopped(self, req: Request, token: int, finished: list[Request]) -> None:
        """Finish ``req`` (into ``finished``) if ``token`` (or its length) stops it; called only
        when the per-token check found a stop token or the length limit."""
        reason = self._stop_reason(req, token)
        if reason is not None:
            self.finish_request(req, reason)
            finished.append(req)

    @staticmethod
    def _stop_reason(req: Request, token: int) -> str | None:
        p = req.params
        if req.num_output_tokens >= p.min_tokens:
            if token in req.eos_token_ids:
                return "stop"
            if token in p.stop_token_ids:
                req.stop_reason = token
                return "stop"
        if req.num_tokens >= req.max_total_tokens:
            return "length"
        return None

    def rollback(self, *outs: SchedulerOutput | None, forget_prefix_cache: bool = False) -> None:
        """Launched steps failed: their requests go back to waiting with no blocks (their tokens
        in flight are lost). Under async scheduling the prefix cache is forgotten too
        (``forget_prefix_cache``): it may already have registered blocks that a failed step
        was still writing."""
        self._batch = None
        for out in outs:
            if out is None:
                continue
            # The runner may never have seen this step: tell it again which tables to drop.
            self._finished_seq_ids += out.finished_seq_ids
            for r in reversed(out.requests):
                req = self.requests.get(r.seq_id)
                if req is None:
                    continue
                if req.status is RequestStatus.RUNNING:
                    self._back_to_waiting(req)
                req.num_computed_tokens = 0
                req.num_pending = 0
        if forget_prefix_cache:
            self.block_manager.reset_prefix_cache()
