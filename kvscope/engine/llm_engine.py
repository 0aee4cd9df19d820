"""The engine loop: validate and admit requests, schedule, execute, post-process, report.

The scheduler owns every request transition; the engine keeps what needs a tokenizer
(tokenization, detokenization, stop strings), builds the outputs and fires the hooks.
The engine is torch-free: it drives an :class:`~kvscope.engine.executor.Executor` through
:class:`SchedulerOutput` and receives sampled token ids back.

With ``async_scheduling`` (vLLM's flag) a step is scheduled and launched before the previous
step's tokens are read back, so the CPU work of step n+1 overlaps the GPU work of step n; the
outputs then trail by one step. Every hook keeps working: ``step.scheduled`` fires for step
n+1 after it is scheduled and before it is launched; ``step.end`` and the ``request.*`` hooks
fire once per step, when its tokens are processed, so the block manager then already holds
step n+1's allocations (docs/ARCHITECTURE.md, "Async scheduling and the trace").
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import time
from dataclasses import dataclass
from itertools import chain
from typing import Any, Iterator, MutableMapping, Sequence as Seq

from kvscope.config import EngineConfig
from kvscope.engine.block_manager import BlockManager
from kvscope.engine.detokenizer import IncrementalDetokenizer, final_text
from kvscope.engine.executor import DoneStep, Executor, StepHandle, StepResult
from kvscope.engine.hooks import HookRegistry
from kvscope.engine.input_checks import check_request_ids
from kvscope.interrupts import atomic, interrupt_pending
from kvscope.engine.parallel_sampling import ParentRequest, child_params, child_request_ids
from kvscope.engine.request import Request
from kvscope.engine.scheduler import Scheduler
from kvscope.engine.scheduler_output import SchedulerOutput
from kvscope.engine.step_info import StepInfo
from kvscope.engine.validator import check_invariants
from kvscope.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvscope.sampling_params import RequestOutputKind, SamplingParams

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
        # vLLM's split (``update_from_generation_config``): the tokenizer's EOS ends a request as
        # EOS, the others join each request's stop token ids (all of them without a tokenizer)
        self._eos_as_eos = self.eos_token_ids.intersection([getattr(tokenizer, "eos_token_id", None)])
        self._eos_as_stop = sorted(t for t in self.eos_token_ids - self._eos_as_eos if t < self.vocab_size)
        self.hooks = HookRegistry()
        self.block_manager = BlockManager(
            executor.num_kv_blocks, config.block_size, config.enable_prefix_caching, self.hooks
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self.requests: dict[str, Request] = {}  # every request whose last output is not delivered yet
        self._num_streaming = 0  # of those, the ones step() reports while they run
        self._sent: dict[Request, _Sent] = {}  # what the outputs of each DELTA request carried so far
        # n > 1: each parent by its id, and each child's (parent, index) by the child's id
        self._parents: dict[str, ParentRequest] = {}
        self._children: dict[str, tuple[ParentRequest, int]] = {}
        self._seq_ids = itertools.count()
        self._request_ids = itertools.count()
        self.validate_every_step = False
        self.async_scheduling = config.async_scheduling
        self._in_flight: _InFlight | None = None
        self._last_step_end = 0.0
        # Re-entry from hooks: while the scheduler is inside a transition (``_busy``), an abort
        # or a prefix-cache reset a hook asks for waits until the transition ends.
        self._busy = 0
        self._pending_aborts: list[tuple[str, bool]] = []  # (request id, report)
        self._pending_reset = False
        self._num_aborts = 0
        self._stepping = False               # inside step(), before its step.end hooks
        self._num_released = 0               # requests released so far (see step())
        self._aborted: list[Request] = []    # aborted requests the next step() reports
        self._held: list[RequestOutput] = []  # a step's outputs that a Ctrl-C kept from its caller
        # Outputs a caller above the engine still holds, by request id (LLM's undelivered
        # ones): their ids are not free for a new request, whose outputs would be taken for
        # theirs, and abort_request(report=False) takes them back.
        self.held_outputs: MutableMapping[str, RequestOutput] = {}
        # What was just built (the free pool alone holds an entry per KV block) goes to the
        # oldest generation now, in one pass over the young objects; left young, each of the
        # first young collections of a run would walk all of it again.
        gc.collect(1)

    # ------------------------------------------------------------- requests
    @atomic
    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        final_only: bool = False,
    ) -> str:
        """Validate and queue one request; bad input raises here, never inside a step.

        ``params.output_kind`` says what :meth:`step` reports of it; ``final_only=True`` makes it
        ``RequestOutputKind.FINAL_ONLY`` whatever ``params`` say (``LLM.generate``'s requests):
        reported only when it finishes, it is never detokenized incrementally.

        With ``params.n > 1`` the engine runs ``n`` child requests (see
        :mod:`kvscope.engine.parallel_sampling`) and returns the parent's id.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        # The request's own copy, checked again: a SamplingParams may be changed after it was
        # built (and after this request was added), as vLLM's requests clone theirs.
        params = (dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY) if final_only
                  else dataclasses.replace(params))
        if params.stop_strings and self.config.skip_tokenizer_init:
            raise ValueError("stop strings need text, which skip_tokenizer_init=True leaves out; "
                             "stop on token ids with stop_token_ids instead")
        if params.bad_words and self.config.skip_tokenizer_init:
            raise ValueError("bad_words need a tokenizer, which skip_tokenizer_init=True leaves out; "
                             "ban token ids with logit_bias or allowed_token_ids instead")
        if params.n == 1:
            request_id = self._add(prompt, params, request_id, arrival_time)
        else:
            request_id = self._add_parent(prompt, params, request_id, arrival_time)
        if interrupt_pending():  # Ctrl-C while adding: the caller never gets the id, so undo it
            self.abort_request(request_id, report=False)
        return request_id

    def _add_parent(self, prompt: PromptType, params: SamplingParams, request_id: str | None,
                    arrival_time: float | None) -> str:
        """Add the ``params.n`` children of one request; all of them or none."""
        pool = self.block_manager.num_blocks
        if params.n > pool:  # (and a huge n would make a child list that never ends)
            raise ValueError(f"n={params.n} exceeds the KV pool's num_kv_blocks={pool}: each of the n "
                             f"child requests needs a KV block of its own")
        if request_id is None:
            request_id = self._new_request_id(params.n)
        parent = ParentRequest(request_id, params.n, params.output_kind)
        taken = [i for i in [request_id, *parent.child_ids] if self._id_in_use(i)]
        if taken:
            raise ValueError(f"request_id {taken[0]!r} is already in use (a request with n={params.n} "
                             f"takes its id and its children's ids)")
        text, token_ids = self._tokenize(prompt)  # (once for all children)
        prompt = {"prompt": text, "prompt_token_ids": token_ids}
        children = [self._new_request(prompt, child_params(params, index), child_id, arrival_time)
                    for index, child_id in enumerate(parent.child_ids)]
        # Every child is valid, and every id taken, before the first request.added hook runs.
        self._parents[request_id] = parent
        for index, child_id in enumerate(parent.child_ids):
            self._children[child_id] = (parent, index)
        for child in children:
            if self._parents.get(request_id) is not parent:  # a hook took it back (report=False)
                break
            self._queue(child)
        return request_id

    def _add(self, prompt: PromptType, params: SamplingParams, request_id: str | None,
             arrival_time: float | None) -> str:
        req = self._new_request(prompt, params, request_id, arrival_time)
        self._queue(req)
        return req.request_id

    def _new_request(self, prompt: PromptType, params: SamplingParams, request_id: str | None,
                     arrival_time: float | None) -> Request:
        """A validated request under a free id, not queued yet."""
        text, token_ids = self._tokenize(prompt)
        params.update_from_tokenizer(self.tokenizer)  # (each child's copy too: bad words as token ids)
        params.update_from_vocabulary(self.vocab_size)
        keep = params.truncate_prompt_tokens
        if keep is not None:  # (vLLM's left truncation: the prompt's last tokens)
            token_ids = token_ids[-(self.max_model_len if keep == -1 else keep):]
        n = len(token_ids)
        if n == 0:
            raise ValueError("prompt is empty: a request needs at least one prompt token")
        eos = frozenset() if params.ignore_eos else self._take_other_eos_ids(params)
        token_ids = check_request_ids(token_ids, params, self.vocab_size, eos, self.config.max_logprobs)
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
            request_id = self._new_request_id(1)
        elif self._id_in_use(request_id):
            raise ValueError(f"request_id {request_id!r} is already in use")
        return Request(
            seq_id=next(self._seq_ids),
            request_id=request_id,
            prompt=text,
            token_ids=list(token_ids),
            params=params,
            metrics=RequestMetrics(arrival_time=time.perf_counter() if arrival_time is None else arrival_time),
            eos_token_ids=eos,
            max_total_tokens=n + max_tokens,
            final_only=params.output_kind is RequestOutputKind.FINAL_ONLY,
        )

    def _take_other_eos_ids(self, params: SamplingParams) -> frozenset[int]:
        """The EOS ids that end a request as EOS (no ``stop_reason``): the tokenizer's alone, as in
        vLLM's ``update_from_generation_config``. The generation config's other EOS ids join the
        request's ``stop_token_ids`` (``params`` is its own copy), so the one that ends it is its
        ``stop_reason``; without a tokenizer, all of them do."""
        others = [t for t in self._eos_as_stop if t not in params.stop_token_ids]
        if others:
            params.stop_token_ids = params.stop_token_ids + others
        return self._eos_as_eos

    def _queue(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self._num_streaming += not req.final_only
        if req.params.output_kind is RequestOutputKind.DELTA:
            self._sent[req] = _Sent()
        with self._transition():
            self.scheduler.add_request(req)
            if self.hooks.active("request.added"):
                self.hooks.fire(
                    "request.added", step=self.scheduler.step_count, request_id=req.request_id,
                    prompt_token_ids=req.token_ids[: req.num_prompt_tokens], params=req.params,
                    time_s=req.metrics.arrival_time,
                )

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` names a request (or a parent of ``n > 1``) whose last output
        is not out yet."""
        return request_id in self.requests or request_id in self._parents

    def _id_in_use(self, request_id: str) -> bool:
        """Whether ``request_id`` is taken: a request's, a child's of ``n > 1`` (until the
        parent's last output), or one with an output still to deliver (an abort's, one a
        Ctrl-C kept, one a caller holds)."""
        return (self.has_request(request_id) or request_id in self._children or request_id in self.held_outputs
                or any(r.request_id == request_id for r in self._aborted)
                or any(o.request_id == request_id for o in self._held))

    def _new_request_id(self, n: int) -> str:
        """The next automatic id that is free, and (``n > 1``) whose children's ids are free too:
        a caller's own ids may look like automatic ones."""
        while True:
            request_id = str(next(self._request_ids))
            if not any(self._id_in_use(i) for i in [request_id, *child_request_ids(request_id, n)]):
                return request_id

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):  # (with the tokenizer's special tokens, a Llama's BOS, as vLLM does)
            return prompt, list(self.tokenizer.encode(prompt))
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._tokenize(prompt["prompt"])
            raise ValueError("a prompt dict needs a 'prompt' or 'prompt_token_ids' key")
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise TypeError(f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")

    @atomic
    def abort_request(self, request_id: str, report: bool = True) -> bool:
        """Stop a request wherever it is; returns False if it is unknown or already finished.

        The next :meth:`step` reports it (``finish_reason="abort"``). With ``report=False``
        nothing more of it is reported, not even an output still waiting (the one the step
        under way finished it with, one a caller above holds in :attr:`held_outputs`). Safe
        from any hook: inside a scheduler transition the abort is applied as soon as the
        transition ends (and the request's row, if it was just scheduled, never runs). A
        request with ``n > 1`` is aborted child by child.
        """
        if self._busy and self.has_request(request_id):
            self._pending_aborts.append((request_id, report))
            return self._unfinished(request_id)
        if not report:  # nor report what is still waiting to be reported
            self._held = [o for o in self._held if o.request_id != request_id]
            self._aborted = [r for r in self._aborted if r.request_id != request_id]
            self.held_outputs.pop(request_id, None)
            if self._sent:  # (no output of its will take the rest)
                self._sent = {r: sent for r, sent in self._sent.items() if r.request_id != request_id}
        parent = self._parents.get(request_id)
        if parent is not None:
            aborted = [self.abort_request(child_id, report) for child_id in parent.child_ids]
            if not report:  # (the parent's own outputs are not reported either)
                self._forget_parent(parent)
            return any(aborted)
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            if req is not None and not report:  # finished by the step under way
                self._release(req)
            return False
        self._abort(req, report)
        self._settle()
        return True

    def _unfinished(self, request_id: str) -> bool:
        parent = self._parents.get(request_id)
        ids = parent.child_ids if parent is not None else [request_id]
        return any(not req.is_finished for i in ids if (req := self.requests.get(i)) is not None)

    def _abort(self, req: Request, report: bool = True) -> None:
        # Its report is queued before any hook runs (request.finished, those of the aborts the
        # transition's end applies), as a hook may take it back.
        if report:
            self._aborted.append(req)
        with self._transition():
            self.scheduler.finish_request(req, "abort")
        self._num_aborts += 1
        self._finished(req)
        self._release(req)

    def _settle(self) -> None:
        """Nothing left to run but a launched step (async scheduling, everything aborted): read
        it back, so ``has_unfinished_requests()`` is false again."""
        if self._in_flight is not None and not (self._busy or self._stepping or self.scheduler.has_unfinished()):
            self._resolve(self._in_flight)

    @contextlib.contextmanager
    def _transition(self) -> Iterator[None]:
        """Mark a scheduler transition; apply what hooks asked for meanwhile once it ends."""
        self._busy += 1
        try:
            yield
        finally:
            self._busy -= 1
        if not self._busy:
            self._apply_pending()

    def _apply_pending(self) -> None:
        while self._pending_aborts:
            self.abort_request(*self._pending_aborts.pop(0))
        if self._pending_reset:
            self._pending_reset = False
            with self._transition():
                self.block_manager.reset_prefix_cache()

    @property
    def in_step(self) -> bool:
        """True while a step or a scheduler transition is under way (hooks run then): a nested
        ``step()`` or ``LLM.generate`` would corrupt it. ``step.end`` hooks run after it."""
        return self._stepping or self._busy > 0

    def has_unfinished_requests(self) -> bool:
        """Whether :meth:`step` has anything to do: requests to run, a step in flight, or
        aborted requests to report."""
        return (self.scheduler.has_unfinished() or self._in_flight is not None
                or bool(self._aborted) or bool(self._held))

    @atomic
    def reset_prefix_cache(self) -> bool:
        """Forget every cached free block (vLLM's ``reset_prefix_cache``); from a hook inside a
        scheduler transition it happens when the transition ends (and True says it was queued).

        Returns True when no cached block is left. Blocks a running request holds keep their
        hashes, and then it returns False: vLLM returns False then too, but forgets nothing."""
        if self._busy:
            self._pending_reset = True
            return True
        with self._transition():
            return self.block_manager.reset_prefix_cache()

    # ----------------------------------------------------------------- step
    @atomic
    def step(self) -> list[RequestOutput]:
        """Run one step; return a RequestOutput for every request that progressed or finished
        (a ``FINAL_ONLY`` request only when it finished; a request a hook aborted during the
        step, too). A ``DELTA`` request's output carries only what is new since its last one;
        two of its outputs in one list (a Ctrl-C kept the first) follow each other in order.

        Finished requests are forgotten once reported, as in vLLM, so each is reported finished
        once, also when a ``step.end`` hook steps the engine again. Ctrl-C is held until the
        step is done, so it never lands inside a transition.
        """
        if self.in_step:
            raise RuntimeError(
                "the engine was stepped (step() or LLM.generate) from inside a kvscope hook while a "
                "step was under way; only step.end hooks may do that")
        self._stepping = True
        try:
            self._apply_pending()
            released = self._num_released
            progressed, finished = self._step()
        finally:
            self._stepping = False
        if self._num_released != released:  # hooks aborted requests or stepped the engine again
            progressed, finished = self._unreported(progressed), self._unreported(finished)
        # (An aborted request is never among those the step finished: a finished one is not aborted.)
        finished += self._aborted
        self._aborted = []
        reported = finished
        if self._num_streaming:
            reported = [r for r in progressed if not r.final_only or r.is_finished]
            seen = {id(r) for r in reported}
            reported += [r for r in finished if id(r) not in seen]  # ended without a token
        outputs = [self._output(r) for r in reported]
        if self._children:
            outputs = self._merge_children(outputs)
        for req in finished:
            self._release(req)
        if self._held:
            outputs, self._held = self._held + outputs, []
        if self._in_flight is not None and not self.scheduler.has_unfinished():
            outputs = self._read_back_leftover(outputs)
        if interrupt_pending():  # the caller gets KeyboardInterrupt instead: keep them for the next step
            self._held = outputs
            return []
        return outputs

    def _read_back_leftover(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Async scheduling launched a step before this one's tokens showed that its last
        requests stop (a stop token): read it back now, so that ``has_unfinished_requests()`` is
        false once the last output is out. Should that fail, ``outputs`` wait for the next step."""
        self._held = outputs
        self._settle()
        outputs, self._held = self._held, []
        return outputs

    def _unreported(self, reqs: list[Request]) -> list[Request]:
        """Those of ``reqs`` still to report: not released meanwhile by a hook, through an abort
        (one to report is in ``_aborted``) or a step of its own, which reported them."""
        return [r for r in reqs if self.requests.get(r.request_id) is r]

    def _merge_children(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Children's outputs as their parents' (one per parent, after its children's)."""
        merged: dict[str, RequestOutput] = {}
        kept = []
        for out in outputs:
            child = self._children.get(out.request_id)
            if child is None:
                kept.append(out)
                continue
            parent, index = child
            parent_out = parent.merge(index, out)
            if parent_out is not None:
                earlier = merged.pop(parent.request_id, None)
                if parent.output_kind is RequestOutputKind.DELTA and earlier is not None:
                    earlier.add(parent_out, aggregate=True)  # (another child's delta of this step)
                    parent_out = earlier
                merged[parent.request_id] = parent_out
            if parent.finished:
                self._forget_parent(parent)
        return kept + list(merged.values())

    def _forget_parent(self, parent: ParentRequest) -> None:
        self._parents.pop(parent.request_id, None)
        for child_id in parent.child_ids:
            self._children.pop(child_id, None)

    def _step(self) -> tuple[list[Request], list[Request]]:
        """One step; returns the requests that got a token and those that finished."""
        return self._step_async() if self.async_scheduling else self._step_sync()

    def _schedule(self) -> tuple[SchedulerOutput, float, float, dict[int, str] | None]:
        """Schedule one step, report its preemptions and fire ``step.scheduled`` (before the
        launch, in both modes). Returns the output, its start, its duration, and (for
        ``step.end`` / ``step.scheduled`` hooks) the request ids of its rows."""
        t0 = time.perf_counter()
        aborts = self._num_aborts
        with self._transition():
            out = self.scheduler.schedule()
            t1 = time.perf_counter()
            if out.preempted_seq_ids and self.hooks.active("request.preempted"):
                for seq_id in out.preempted_seq_ids:
                    req = self.scheduler.requests[seq_id]
                    self.hooks.fire("request.preempted", step=out.step, request_id=req.request_id,
                                    num_computed_tokens_lost=req.num_tokens)
            request_ids = self._step_request_ids(out)
        self._discard_aborted_rows(out, aborts)
        if (out.requests or out.preempted_seq_ids) and self.hooks.active("step.scheduled"):
            aborts = self._num_aborts
            with self._transition():  # an abort from the hook drops its row before the launch
                self.hooks.fire("step.scheduled", step=out.step, scheduler_output=out, request_ids=request_ids)
            self._discard_aborted_rows(out, aborts)
        return out, t0, t1 - t0, request_ids

    def _discard_aborted_rows(self, out: SchedulerOutput, aborts: int) -> None:
        if self._num_aborts != aborts:  # a hook aborted requests while this step was scheduled
            self.scheduler.discard_finished_rows(out)

    def _no_progress(self, aborts: int) -> None:
        """An empty step is a bug unless a hook aborted the rows it had scheduled (``aborts``:
        the abort count before scheduling); the next step then schedules what they held back."""
        if self.scheduler.has_unfinished() and self._num_aborts == aborts:
            raise RuntimeError(
                "scheduler made no progress with unfinished requests; this is a kvscope bug "
                f"(waiting={len(self.scheduler.waiting)}, running={len(self.scheduler.running)}, "
                f"free blocks={self.block_manager.num_free_blocks})"
            )

    def _step_async(self) -> tuple[list[Request], list[Request]]:
        """Schedule and launch step n, then read back and post-process step n-1."""
        aborts = self._num_aborts
        out, t0, schedule_s, request_ids = self._schedule()
        launched = None
        if out.requests or out.preempted_seq_ids:  # (a step of preemptions alone is reported too)
            try:
                handle = self.executor.execute_async(out) if out.requests else DoneStep(StepResult(tokens={}))
            except BaseException:
                self._rollback_in_flight(self._in_flight.out if self._in_flight else None, out)
                raise
            launched = _InFlight(out, handle, t0, schedule_s, request_ids, self.scheduler.recently_finished)
        previous, self._in_flight = self._in_flight, launched
        if previous is None:
            if launched is None:
                self._no_progress(aborts)
            return [], []
        return self._resolve(previous, launched=out)

    def _resolve(self, step: "_InFlight", launched: SchedulerOutput | None = None
                 ) -> tuple[list[Request], list[Request]]:
        if launched is None:
            self._in_flight = None
        try:
            result = step.handle.result()
        except BaseException:
            self._rollback_in_flight(step.out, launched)
            raise
        return self._end_step(step.out, result, step.t0, step.schedule_s, step.request_ids, step.finished_ids)

    def _rollback_in_flight(self, *outs: SchedulerOutput | None) -> None:
        """A launched step failed: roll back every step in flight."""
        self._in_flight = None
        with self._transition():
            self.scheduler.rollback(*outs, forget_prefix_cache=True)

    def _name_logprob_tokens(self, progressed: list[Request], result: StepResult) -> None:
        """Give the log-probs this step added their ``decoded_token`` (each token decoded alone,
        as vLLM's are): each progressed request's newest, and a prompt's once all are in."""
        if self.config.skip_tokenizer_init:
            return
        rows = [r.output_logprobs[-1] for r in progressed if r.output_logprobs and r.params.detokenize]
        live = self.scheduler.requests
        for seq_id in result.prompt_logprobs:
            req = live.get(seq_id)
            if req is not None and req.params.detokenize and not req.num_prompt_logits \
                    and req.num_prompt_tokens > 1 and next(iter(req.prompt_logprobs[1].values())).decoded_token is None:
                rows += req.prompt_logprobs[1:]
        decode = self.tokenizer.decode
        for row in rows:
            for token, logprob in row.items():
                logprob.decoded_token = decode([token])

    def _step_request_ids(self, out: SchedulerOutput, finished_ids: dict[int, str] | None = None
                          ) -> dict[int, str] | None:
        """seq_id -> request_id of the step's rows and preemptions (only when a ``step.end`` or
        ``step.scheduled`` hook will want them). A row's request may have finished since the
        step was scheduled (async scheduling: while the step was in flight). The scheduler's
        ``recently_finished`` of the step's own schedule (``finished_ids``) and of the one after it
        still name it."""
        if not (self.hooks.active("step.end") or self.hooks.active("step.scheduled")):
            return None
        live, recent, earlier = self.scheduler.requests, self.scheduler.recently_finished, finished_ids or {}
        names = {}
        for i in chain(out.columns.seq_id.tolist(), out.preempted_seq_ids):
            req = live.get(i)
            name = req.request_id if req is not None else recent.get(i, earlier.get(i))
            if name is not None:
                names[i] = name
        return names

    def _step_sync(self) -> tuple[list[Request], list[Request]]:
        aborts = self._num_aborts
        out, t0, schedule_s, request_ids = self._schedule()
        if out.is_empty and not out.preempted_seq_ids:
            self._no_progress(aborts)
            return [], []
        try:
            result = self.executor.execute(out) if out.requests else StepResult(tokens={})
        except BaseException:
            with self._transition():
                self.scheduler.rollback(out)
            raise
        return self._end_step(out, result, t0, schedule_s, request_ids)

    def _end_step(self, out: SchedulerOutput, result: StepResult, t0: float, schedule_s: float,
                  request_ids: dict[int, str] | None, finished_ids: dict[int, str] | None = None
                  ) -> tuple[list[Request], list[Request]]:
        """Post-process a step whose tokens are back, check invariants, fire ``step.end``.
        ``finished_ids``: see :meth:`_step_request_ids`."""
        t2 = time.perf_counter()
        if request_ids is None:  # launched before a step.end hook was attached
            request_ids = self._step_request_ids(out, finished_ids)
        with self._transition():
            progressed, finished = self.scheduler.update_from_output(out, result, t2)
            if result.logprobs or result.prompt_logprobs:
                self._name_logprob_tokens(progressed, result)
            for req in progressed:
                if not req.stop_strings or req.error:
                    continue
                # As in vLLM, the text of the token that stopped a request is searched too when it
                # is output text (include_stop_str_in_output).
                if req.finish_reason not in (None, "length") and not (
                        req.finish_reason == "stop" and req.params.include_stop_str_in_output):
                    continue
                min_tokens = req.params.min_tokens
                if req.num_output_tokens > min_tokens:
                    # A stop string beats "length" (the token that completes it may also be the last).
                    if self._hit_stop_string(req):
                        if req.finish_reason is None:
                            self.scheduler.finish_request(req, "stop")
                            finished.append(req)
                        req.finish_reason = "stop"
                elif req.num_output_tokens == min_tokens:
                    # As in vLLM, no stop string may end in the first min_tokens tokens' text: mark it checked.
                    self._stream_text(req)
        for req in finished:
            self._finished(req)
        t3 = time.perf_counter()
        if self.validate_every_step:
            self.check_invariants()
        # Under async scheduling a step starts before the previous one ends; starting the
        # clock at the later of the two makes durations add up to wall time, as in sync mode.
        start, self._last_step_end = max(t0, self._last_step_end), t3
        self._stepping = False  # step.end hooks may step the engine again (e.g. LLM.generate)
        if self.hooks.active("step.end"):
            timings = {"schedule_s": schedule_s, **result.timings, "postprocess_s": t3 - t2}
            self.hooks.fire("step.end", info=StepInfo(
                step=out.step, time_s=start, duration_s=t3 - start, scheduler_output=out,
                request_ids=request_ids, sampled=result.tokens, finished=[r.request_id for r in finished],
                waiting=[r.request_id for r in self.scheduler.waiting],
                running=[r.request_id for r in self.scheduler.running],
                timings=timings, cuda_graph=result.cuda_graph,
            ))
        return progressed, finished

    # ------------------------------------------------------------ text
    def _hit_stop_string(self, req: Request) -> bool:
        """Search only the text added since the last check (and each stop string's reach back
        into it); on a hit, cut the streamed text at the first stop string of the list found
        there, as vLLM's ``check_stop_strings`` does, wherever another one lies in the same new
        text (the final text extends the text streamed so far)."""
        checked = len(req.streamed_text)
        text = self._stream_text(req)
        found = next(((i, s) for s in req.stop_strings if (i := text.find(s, max(0, checked - len(s) + 1))) >= 0),
                     None)
        if found is None:
            return False
        i, s = found
        req.text = text[: i + len(s)] if req.params.include_stop_str_in_output else text[:i]
        req.stop_reason = s
        return True

    def _stream_text(self, req: Request) -> str:
        """``req``'s output text so far, decoded incrementally (an incomplete last character is held back)."""
        if req.detokenizer is None:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, req.params.skip_special_tokens)
        return req.detokenizer.update(req.output_token_ids)

    def _finished(self, req: Request) -> None:
        """The scheduler finished ``req``: its final text, and the ``request.finished`` hook."""
        if req.params.detokenize and not (req.finish_reason == "stop" and isinstance(req.stop_reason, str)):
            # As in vLLM, the token that stopped the request (EOS or one of stop_token_ids) stays
            # out of the text unless include_stop_str_in_output.
            by_token = req.finish_reason == "stop" and not req.params.include_stop_str_in_output
            ids = req.output_token_ids[:-1] if by_token else req.output_token_ids
            # The text streamed so far, finished; a request never read as it ran (final-only, no
            # stop string) gets the same text from one whole decode (see the detokenizer).
            req.text = (req.detokenizer.finish(ids) if req.detokenizer is not None
                        else final_text(self.tokenizer, ids, req.params.skip_special_tokens))
        if self.hooks.active("request.finished"):
            with self._transition():
                self.hooks.fire(
                    "request.finished", step=self.scheduler.step_count, request_id=req.request_id,
                    finish_reason=req.finish_reason, num_prompt_tokens=req.num_prompt_tokens,
                    output_token_ids=list(req.output_token_ids), metrics=req.metrics,
                )

    # -------------------------------------------------------------- outputs
    def _output(self, req: Request) -> RequestOutput:
        token_ids, text, logprobs = req.output_token_ids, self._text(req), req.output_logprobs
        prompt_logprobs = self._prompt_logprobs(req)
        sent = self._sent.get(req) if self._sent else None
        if sent is not None:  # DELTA: what is new since the last output
            token_ids, text, logprobs, prompt_logprobs = sent.take(token_ids, text, logprobs, prompt_logprobs)
            if req.is_finished:
                del self._sent[req]
        elif logprobs is not None:
            logprobs = list(logprobs)
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=token_ids,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
            logprobs=logprobs,
            cumulative_logprob=None if logprobs is None else req.cumulative_logprob,
            error=req.error,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.token_ids[: req.num_prompt_tokens],
            outputs=[completion],
            finished=req.is_finished,
            metrics=req.metrics,
            num_cached_tokens=req.metrics.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            _is_delta=sent is not None,
        )

    def _text(self, req: Request) -> str:
        """The text an output of ``req`` carries: the final text once it finished; while it runs,
        the text so far less vLLM's hold-back for stop strings (a stop string found later may
        cut the text back no further); none with ``detokenize=False``."""
        if not req.params.detokenize:
            return ""
        if req.is_finished:
            return req.text
        text = self._stream_text(req)
        held = req.params.output_text_buffer_length
        return text[:max(0, len(text) - held)] if held else text

    @staticmethod
    def _prompt_logprobs(req: Request) -> list[dict[int, float] | None] | None:
        """The request's prompt log-probs once its whole prompt has them (vLLM's first entry,
        the first token's, is None), else None."""
        kept = req.prompt_logprobs
        return list(kept) if kept is not None and not req.num_prompt_logits else None

    def _release(self, req: Request) -> None:
        """Forget a finished request once its last output is out."""
        if self.requests.get(req.request_id) is req:
            del self.requests[req.request_id]
            self._num_streaming -= not req.final_only
            self._num_released += 1

    def check_invariants(self) -> None:
        """Run the validator; refused from a block event's hook, where the tables disagree by design."""
        if self.hooks.block_hook_firing is not None:
            raise RuntimeError(
                f"check_invariants() from a {self.hooks.block_hook_firing!r} hook: block events fire "
                "half-way through a change of the engine's tables, which disagree there by design; "
                "check from a 'step.scheduled', 'step.end' or 'request.*' hook, or between steps")
        check_invariants(self.scheduler)


@dataclass(slots=True)
class _Sent:
    """How much of a ``DELTA`` request its outputs carried so far: its next output carries the rest."""

    num_tokens: int = 0
    text_len: int = 0
    prompt_logprobs: bool = False

    def take(self, token_ids: list[int], text: str, logprobs: list | None, prompt_logprobs: list | None
             ) -> tuple[list[int], str, list | None, list | None]:
        """The part of a cumulative output not sent yet; then it counts as sent. Prompt
        log-probs go with the first output that has them, as in vLLM."""
        new = (token_ids[self.num_tokens:], text[self.text_len:],
               None if logprobs is None else logprobs[self.num_tokens:],
               None if self.prompt_logprobs else prompt_logprobs)
        self.num_tokens, self.text_len = len(token_ids), len(text)
        self.prompt_logprobs |= prompt_logprobs is not None
        return new


@dataclass(slots=True)
class _InFlight:
    """A launched step whose tokens have not been read back yet (async scheduling)."""

    out: SchedulerOutput
    handle: StepHandle
    t0: float
    schedule_s: float
    request_ids: dict[int, str] | None
    finished_ids: dict[int, str]  # the scheduler's ``recently_finished`` of this step's schedule
