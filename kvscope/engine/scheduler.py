"""Spends a token budget and KV blocks on sequences, one step at a time.

Two policies (DESIGN.md, "Scheduling policies"):

* ``unified`` (vLLM V1): no phases. Running sequences first, each asking for the tokens it
  has not computed yet (one for decode, the rest of a prompt for a chunked prefill), clamped
  to the remaining budget; then waiting sequences with what is left. Prefill chunks and decode
  rows share one packed forward pass.
* ``prefill_first`` (nano-vLLM): a step is all prefill (chunks of running prompts, then new
  admissions) when there is prefill work that fits, otherwise all decode.

When blocks run out for a running sequence, the scheduler preempts from the tail of
``running`` (LIFO) by recompute: the victim's blocks are freed, its computed tokens reset, and
it goes to the head of ``waiting``.

Scheduling a chunk advances ``num_computed_tokens`` at once, and a chunk that samples adds a
pending token, so under async scheduling the next step can be planned while this one runs: a
decode row whose input token is still on the device carries ``PLACEHOLDER`` instead of its id.
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Callable

from kvscope.config import EngineConfig
from kvscope.engine.block_manager import BlockManager
from kvscope.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from kvscope.engine.sequence import Sequence, SequenceStatus

PLACEHOLDER = -1  # a token id sampled by the step in flight; the runner reads it on the device

if TYPE_CHECKING:
    from kvscope.trace.hooks import HookRegistry


class Scheduler:
    def __init__(
        self, config: EngineConfig, block_manager: BlockManager, hooks: "HookRegistry | None" = None
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.hooks = hooks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.step_count = 0
        self.num_preemptions = 0
        self.on_preempt: Callable[[Sequence], None] | None = None

    # ----------------------------------------------------------------- queues
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out of whichever queue holds it and release its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.block_manager.free_sequence(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)

    # --------------------------------------------------------------- schedule
    def schedule(self) -> SchedulerOutput:
        self.step_count += 1
        self.block_manager.step = self.step_count
        out = SchedulerOutput(step=self.step_count, token_budget=self.config.max_num_batched_tokens)
        if self.config.scheduling_policy == "prefill_first":
            self._schedule_prefill_first(out)
        else:
            self._schedule_unified(out)
        return out

    def _schedule_unified(self, out: SchedulerOutput) -> None:
        budget = self._schedule_running(out, out.token_budget, prefill_only=False)
        if not out.preempted_seq_ids:
            self._admit_waiting(out, budget)

    def _schedule_prefill_first(self, out: SchedulerOutput) -> None:
        budget = self._schedule_running(out, out.token_budget, prefill_only=True)
        # After a preemption, admit nothing this step: a prefill that preempted itself for want
        # of blocks would be re-admitted into the blocks it just gave up, step after step,
        # while the decoding sequences that hold the rest of the pool never ran (a livelock
        # the property test found). The step then falls through to decode.
        if not out.preempted_seq_ids:
            self._admit_waiting(out, budget)
        if not out.requests:
            self._schedule_running(out, out.token_budget, prefill_only=False)

    def _schedule_running(self, out: SchedulerOutput, budget: int, prefill_only: bool) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            start = seq.num_computed_tokens
            known = seq.num_known_tokens
            if (prefill_only and start >= seq.prefill_len) or known >= seq.max_total_tokens:
                i += 1  # (the second case: its last token is in flight; the sequence ends then)
                continue
            n = min(known - start, budget)
            while not self.block_manager.allocate(seq, start + n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.requests.append(self._scheduled(seq, n))
                budget -= n
                i += 1
                continue
            if prefill_only:
                break
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        chunked = self.config.enable_chunked_prefill
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending:
                break  # preempted with a token in flight: re-admit once its tokens are all known
            cached = self.block_manager.find_cached_prefix(seq)
            num_cached = len(cached) * self.block_manager.block_size
            n = seq.num_tokens - num_cached
            if n > budget and not chunked:
                break
            n = min(n, budget)
            if not self.block_manager.allocate(seq, num_cached + n, cached):
                break
            self.waiting.popleft()
            self.block_manager.count_admission(seq.num_tokens, num_cached)
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = num_cached
            seq.num_cached_tokens = num_cached
            seq.prefill_len = seq.num_tokens
            self.running.append(seq)
            out.requests.append(self._scheduled(seq, n, num_cached))
            budget -= n

    def _scheduled(self, seq: Sequence, n: int, num_cached: int = 0) -> ScheduledRequest:
        """The step's share of ``seq``; marks those tokens computed and the sample pending."""
        start = seq.num_computed_tokens
        end = start + n
        known = seq.num_known_tokens
        sample = end == known
        token_ids = seq.token_ids[start:end]
        if end > len(seq.token_ids):  # only a decode row's one input token can be in flight
            token_ids.append(PLACEHOLDER)
        row = ScheduledRequest(
            seq_id=seq.seq_id,
            token_ids=token_ids,
            start=start,
            block_table=seq.block_table,
            is_prefill=start < seq.prefill_len,
            sample=sample,
            num_cached_tokens=num_cached,
            params=seq.params if sample else None,
            output_index=seq.num_output_tokens + seq.num_pending,
        )
        seq.num_computed_tokens = end
        seq.num_pending += sample
        return row

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free_sequence(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted_seq_ids.append(seq.seq_id)
        if self.on_preempt is not None:
            self.on_preempt(seq)
