"""The engine loop: validate and admit requests, schedule, execute, post-process, report.

The engine is torch-free: it drives an :class:`~kvscope.engine.executor.Executor` through
:class:`SchedulerOutput` and receives sampled token ids back.

With ``async_scheduling`` (vLLM's flag) a step is scheduled and launched before the previous
step's tokens are read back, so the CPU work of step n+1 overlaps the GPU work of step n; the
outputs then trail by one step. ``step.end`` and the ``request.*`` hooks still fire once per
step (when its tokens are processed, so queues and pool counts already include step n+1's
scheduling). Block-level hooks and ``step.scheduled`` need each step's pool state exactly as it
ends, so while one is attached (a ``blocks``/``full`` recorder, a dashboard) the engine steps
synchronously.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any, Sequence as Seq

from kvscope.config import EngineConfig
from kvscope.engine.block_manager import BlockManager
from kvscope.engine.detokenizer import IncrementalDetokenizer
from kvscope.engine.executor import DoneStep, Executor, StepHandle, StepResult
from kvscope.engine.scheduler import Scheduler
from kvscope.engine.scheduler_output import SchedulerOutput
from kvscope.engine.sequence import Sequence, SequenceStatus
from kvscope.engine.step_info import StepInfo
from kvscope.engine.validator import check_invariants
from kvscope.inputs_validation import check_request_ids
from kvscope.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvscope.sampling_params import SamplingParams
from kvscope.trace.hooks import HookRegistry

PromptType = str | list[int] | dict[str, Any]


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        tokenizer: Any,
        max_model_len: int,
        eos_token_ids: Seq[int] = (),
    ) -> None:
        self.config = config
        self.executor = executor
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = executor.vocab_size
        self.hooks = HookRegistry()
        self.block_manager = BlockManager(
            executor.num_kv_blocks, config.block_size, config.enable_prefix_caching, self.hooks
        )
        self.scheduler = Scheduler(config, self.block_manager, self.hooks)
        self.scheduler.on_preempt = self._on_preempt
        self.seqs: dict[int, Sequence] = {}
        self.by_request_id: dict[str, Sequence] = {}
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self.validate_every_step = False
        self.async_scheduling = config.async_scheduling
        self._in_flight: _InFlight | None = None
        self._last_step_end = 0.0

    # ------------------------------------------------------------- requests
    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Validate and queue one request; bad input raises here, never inside a step."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        text, token_ids = self._tokenize(prompt)
        n = len(token_ids)
        if n == 0:
            raise ValueError("prompt is empty: a request needs at least one prompt token")
        token_ids = check_request_ids(token_ids, params, self.vocab_size)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt length ({n}) + max_tokens ({max_tokens}) = {n + max_tokens} exceeds "
                f"max_model_len ({self.max_model_len})"
            )
        if max_tokens < 1:
            raise ValueError(f"prompt length ({n}) leaves no room to generate within max_model_len ({self.max_model_len})")
        bs, pool = self.config.block_size, self.block_manager.num_blocks
        need = -(-(n + max_tokens) // bs)
        if need > pool:
            raise ValueError(
                f"request needs up to {need} KV blocks (prompt {n} + max_tokens {max_tokens} tokens at "
                f"block_size {bs}) but the whole KV pool has num_kv_blocks={pool}; it could never run"
            )
        if request_id is None:
            request_id = str(next(self._request_ids))
        elif request_id in self.by_request_id:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seq = Sequence(
            seq_id=next(self._seq_ids),
            request_id=request_id,
            prompt=text,
            token_ids=list(token_ids),
            params=params,
            metrics=RequestMetrics(arrival_time=time.perf_counter() if arrival_time is None else arrival_time),
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
            max_total_tokens=n + max_tokens,
        )
        self.seqs[seq.seq_id] = seq
        self.by_request_id[request_id] = seq
        self.scheduler.add(seq)
        if self.hooks.active("request.added"):
            self.hooks.fire(
                "request.added", step=self.scheduler.step_count, request_id=request_id,
                prompt_token_ids=list(token_ids), params=params, time_s=seq.metrics.arrival_time,
            )
        return request_id

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer.encode(prompt, add_special_tokens=False))
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise ValueError("a prompt dict needs a 'prompt' or 'prompt_token_ids' key")
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise TypeError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is; returns False if it is unknown or already finished."""
        seq = self.by_request_id.get(request_id)
        if seq is None or seq.is_finished:
            return False
        self.scheduler.remove(seq)
        self._finish(seq, "abort")
        self.release(request_id)
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ----------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """Run one step; return a RequestOutput for every request that progressed or finished.

        Finished requests are forgotten once reported, as in vLLM.
        """
        outputs = [self.request_output(s) for s in self._step()]
        for o in outputs:
            if o.finished:
                self.release(o.request_id)
        return outputs

    def _step(self) -> list[Sequence]:
        exact = self.hooks.active("step.scheduled") or self.hooks.wants_block_events()
        if self.async_scheduling and not exact:
            return self._step_async()
        if self._in_flight is not None:  # a block-level hook was attached: finish the launched step
            return self._resolve(self._in_flight)
        return self._step_sync()

    def _no_progress(self) -> None:
        if self.scheduler.has_unfinished():
            raise RuntimeError(
                "scheduler made no progress with unfinished requests; this is a kvscope bug "
                f"(waiting={len(self.scheduler.waiting)}, running={len(self.scheduler.running)}, "
                f"free blocks={self.block_manager.num_free_blocks})"
            )

    def _step_async(self) -> list[Sequence]:
        """Schedule and launch step n, then read back and post-process step n-1."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        t1 = time.perf_counter()
        launched = None
        if out.requests or out.preempted_seq_ids:  # (a step of preemptions alone is reported too)
            try:
                handle = self.executor.execute_async(out) if out.requests else DoneStep(StepResult(tokens={}))
            except BaseException:
                self._rollback_in_flight(self._in_flight.out if self._in_flight else None, out)
                raise
            launched = _InFlight(out, handle, t0, t1 - t0, self._step_request_ids(out))
        previous, self._in_flight = self._in_flight, launched
        if previous is None:
            if launched is None:
                self._no_progress()
            return []
        return self._resolve(previous, launched=out)

    def _resolve(self, step: "_InFlight", launched: SchedulerOutput | None = None) -> list[Sequence]:
        if launched is None:
            self._in_flight = None
        try:
            result = step.handle.result()
        except BaseException:
            self._rollback_in_flight(step.out, launched)
            raise
        return self._end_step(step.out, result, step.t0, step.schedule_s, step.request_ids)

    def _step_request_ids(self, out: SchedulerOutput) -> dict[int, str] | None:
        """seq_id -> request_id of the step's rows and preemptions, taken while all are known
        (only when a ``step.end`` hook will want them)."""
        if not self.hooks.active("step.end"):
            return None
        ids = {r.seq_id: self.seqs[r.seq_id].request_id for r in out.requests}
        ids.update({i: self.seqs[i].request_id for i in out.preempted_seq_ids})
        return ids

    def _end_step(self, out: SchedulerOutput, result: StepResult, t0: float, schedule_s: float,
                  request_ids: dict[int, str] | None) -> list[Sequence]:
        """Post-process a step whose tokens are back, check invariants, fire ``step.end``."""
        t2 = time.perf_counter()
        progressed, finished = self._postprocess(out, result, t2)
        t3 = time.perf_counter()
        if self.validate_every_step:
            self.check_invariants()
        # Under async scheduling a step starts before the previous one ends; starting the
        # clock at the later of the two makes durations add up to wall time, as in sync mode.
        start, self._last_step_end = max(t0, self._last_step_end), t3
        if self.hooks.active("step.end"):
            timings = {"schedule_s": schedule_s, **result.timings, "postprocess_s": t3 - t2}
            self.hooks.fire("step.end", info=StepInfo(
                step=out.step, time_s=start, duration_s=t3 - start, scheduler_output=out,
                request_ids=request_ids if request_ids is not None else self._step_request_ids(out),
                sampled=result.tokens, finished=[s.request_id for s in finished],
                waiting=[s.request_id for s in self.scheduler.waiting],
                running=[s.request_id for s in self.scheduler.running],
                timings=timings, cuda_graph=result.cuda_graph,
            ))
        return progressed

    def _rollback_in_flight(self, *outs: SchedulerOutput | None) -> None:
        """A launched step failed: roll back every step in flight, and forget the prefix cache,
        which may already have registered blocks those steps were still writing."""
        self._in_flight = None
        for out in outs:
            if out is not None:
                self._rollback(out)
        self.block_manager.reset_prefix_cache()

    def _step_sync(self) -> list[Sequence]:
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        t1 = time.perf_counter()
        if out.is_empty and not out.preempted_seq_ids:
            self._no_progress()
            return []
        if self.hooks.active("step.scheduled"):
            self.hooks.fire("step.scheduled", step=out.step, scheduler_output=out)
        try:
            result = self.executor.execute(out) if out.requests else StepResult(tokens={})
        except BaseException:
            self._rollback(out)
            raise
        return self._end_step(out, result, t0, t1 - t0, None)

    def _rollback(self, out: SchedulerOutput) -> None:
        """The executor failed: put this step's sequences back to waiting with no blocks."""
        for r in reversed(out.requests):
            seq = self.seqs.get(r.seq_id)
            if seq is None or seq.is_finished:
                continue
            if seq.status is SequenceStatus.RUNNING:
                self.scheduler.running.remove(seq)
                self.block_manager.free_sequence(seq)
                seq.status = SequenceStatus.WAITING
                self.scheduler.waiting.appendleft(seq)
            seq.num_computed_tokens = 0
            seq.num_pending = 0

    def _postprocess(
        self, out: SchedulerOutput, result: StepResult, now: float
    ) -> tuple[list[Sequence], list[Sequence]]:
        progressed, finished = [], []
        bm = self.block_manager
        for r in out.requests:
            seq = self.seqs.get(r.seq_id)
            if seq is None or seq.is_finished:
                continue  # finished or aborted while this step was in flight: its work is dropped
            if seq.status is SequenceStatus.RUNNING:
                bm.hash_computed_blocks(seq)
            m = seq.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now
                m.num_cached_tokens = r.num_cached_tokens
            if not r.sample:
                continue
            token = result.tokens[r.seq_id]
            seq.token_ids.append(token)
            seq.num_pending -= 1
            if m.first_token_time is None:
                m.first_token_time = now
            m.last_token_time = now
            if seq.output_logprobs is not None:
                lp = result.logprobs.get(r.seq_id, {})
                seq.output_logprobs.append(lp)
                seq.cumulative_logprob += lp.get(token, 0.0)
            progressed.append(seq)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self.scheduler.remove(seq)
                self._finish(seq, reason)
                finished.append(seq)
        return progressed, finished

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens:
            if token in seq.eos_token_ids:
                return "stop"
            if token in p.stop_token_ids:
                seq.stop_reason = token
                return "stop"
            if p.stop_strings and self._hit_stop_string(seq):
                return "stop"
        if seq.num_tokens >= seq.max_total_tokens:
            return "length"
        return None

    def _hit_stop_string(self, seq: Sequence) -> bool:
        """Search only the text added since the last check (and the stop strings' reach back
        into it); on a hit, cut the exact full decode at the earliest stop string."""
        stops = seq.params.stop_strings
        checked = len(seq.streamed_text)
        text = self._stream_text(seq)
        start = max(0, checked - max(map(len, stops)) + 1)
        if not any(text.find(s, start) >= 0 for s in stops):
            return False
        full = self._decode(seq)
        found = ([(i, s, full) for s in stops if (i := full.find(s)) >= 0]
                 or [(i, s, text) for s in stops if (i := text.find(s, start)) >= 0])
        i, s, source = min(found)
        seq.text = source[: i + len(s)] if seq.params.include_stop_str_in_output else source[:i]
        seq.stop_reason = s
        return True

    def _stream_text(self, seq: Sequence) -> str:
        """``seq``'s output text so far, decoded incrementally (an incomplete last character is held back)."""
        if seq.detokenizer is None:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, seq.params.skip_special_tokens)
        return seq.detokenizer.update(seq.output_token_ids)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.metrics.finished_time = time.perf_counter()
        if not (reason == "stop" and isinstance(seq.stop_reason, str)):
            seq.text = self._decode(seq)
        if self.hooks.active("request.finished"):
            self.hooks.fire(
                "request.finished", step=self.scheduler.step_count, request_id=seq.request_id,
                finish_reason=reason, num_prompt_tokens=seq.num_prompt_tokens,
                output_token_ids=list(seq.output_token_ids), metrics=seq.metrics,
            )

    def _on_preempt(self, seq: Sequence) -> None:
        if self.hooks.active("request.preempted"):
            self.hooks.fire(
                "request.preempted", step=self.scheduler.step_count, request_id=seq.request_id,
                num_computed_tokens_lost=seq.num_tokens,
            )

    def _decode(self, seq: Sequence) -> str:
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens)

    # -------------------------------------------------------------- outputs
    def request_output(self, seq: Sequence) -> RequestOutput:
        text = seq.text if seq.is_finished else self._stream_text(seq)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(seq.output_token_ids),
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=None if seq.output_logprobs is None else list(seq.output_logprobs),
            cumulative_logprob=None if seq.output_logprobs is None else seq.cumulative_logprob,
        )
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.token_ids[: seq.num_prompt_tokens],
            outputs=[completion],
            finished=seq.is_finished,
            metrics=seq.metrics,
            num_cached_tokens=seq.metrics.num_cached_tokens,
        )

    def release(self, request_id: str) -> None:
        """Forget a finished request (``LLM.generate`` calls this once it has the output)."""
        seq = self.by_request_id.pop(request_id, None)
        if seq is not None:
            self.seqs.pop(seq.seq_id, None)

    def check_invariants(self) -> None:
        check_invariants(self.block_manager, self.scheduler.running, self.scheduler.waiting)


@dataclass(slots=True)
class _InFlight:
    """A launched step whose tokens have not been read back yet (async scheduling)."""

    out: SchedulerOutput
    handle: StepHandle
    t0: float
    schedule_s: float
    request_ids: dict[int, str] | None
