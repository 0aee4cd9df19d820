"""``LLM``: vLLM's offline API over the kvscope engine, plus the handles kvscope adds (hooks, record)."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Sequence as Seq

from kvscope.arg_checks import check_inert, check_text, is_index
from kvscope.config import EngineConfig
from kvscope.engine.hooks import HookRegistry, warn_detached
from kvscope.engine.input_checks import check_prompt
from kvscope.interrupts import deferred_interrupts, interrupt_pending
from kvscope.engine.llm_engine import LLMEngine, PromptType
from kvscope.generation_defaults import read_defaults
from kvscope.model_source import resolve_model_dir, resolve_tokenizer_dir
from kvscope.outputs import RequestOutput
from kvscope.sampling_params import SamplingParams
from kvscope.step_lock import StepLock

if TYPE_CHECKING:
    from kvscope.trace.trace import Trace


class _NoTokenizer:
    """Stands in for a tokenizer under ``skip_tokenizer_init`` (vLLM's flag): token ids in, ids out."""

    eos_token_id = None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        raise ValueError("skip_tokenizer_init=True: pass prompts as token ids, not text")

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def _eos_ids(model_dir: str, tokenizer: Any) -> set[int]:
    from transformers import GenerationConfig

    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(model_dir).eos_token_id
    except (OSError, ValueError):
        eos = None
    if eos is not None:
        ids.update([eos] if isinstance(eos, int) else eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


STEP_WAIT_S = 30.0  # how long a call waits for a step another thread is in to end
CALL_POLL_S = 0.1  # how often generate()/step() look whether another thread's call still steps


def _make_executor(config: EngineConfig, hf_config: Any, model_dir: str, max_model_len: int) -> Any:
    if config.tensor_parallel_size > 1:
        from kvscope.distributed.executor import TensorParallelExecutor

        return TensorParallelExecutor(config, hf_config, model_dir, max_model_len)
    from kvscope.runner.model_runner import ModelRunner

    return ModelRunner(config, hf_config, model_dir, max_model_len)


class LLM:
    """An offline inference engine: ``LLM(model).generate(prompts, SamplingParams(...))``.

    ``model`` is a local HF-format directory or a hub id already in the local cache; with no
    model, kvscope's bundled demo model is used. Every other keyword is an engine setting
    (see :class:`~kvscope.config.EngineConfig`); unknown ones raise.
    """

    def __init__(self, model: str | os.PathLike | None = None, **kwargs: Any) -> None:
        from transformers import AutoConfig, AutoTokenizer

        from kvscope.kv_pool_check import check_kv_pool_fits
        from kvscope.models.decoder import check_supported
        from kvscope.models.loader import checkpoint_files

        self._shut_down = False
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        model_dir = resolve_model_dir(model)
        hf_config = AutoConfig.from_pretrained(model_dir)
        tokenizer = (
            _NoTokenizer() if self.config.skip_tokenizer_init
            else AutoTokenizer.from_pretrained(resolve_tokenizer_dir(self.config.tokenizer, model_dir))
        )
        max_pos = getattr(hf_config, "max_position_embeddings", None) or 2048
        max_model_len = self.config.max_model_len or max_pos
        if max_model_len > max_pos:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings ({max_pos})"
            )
        if not self.config.enable_chunked_prefill and self.config.max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"with enable_chunked_prefill=False, max_num_batched_tokens "
                f"({self.config.max_num_batched_tokens}) must be >= max_model_len ({max_model_len}), "
                "or a long prompt could never be scheduled"
            )
        # (the model first: a rank count it cannot shard would be taken for a pool too large)
        check_supported(hf_config, self.config.tensor_parallel_size)
        check_kv_pool_fits(self.config, hf_config)
        self._sampling_defaults = read_defaults(self.config.generation_config, model_dir)
        self.model_dir = model_dir
        self.hf_config = hf_config
        publisher = _kv_event_publisher(self.config)  # (before the weights: a port in use fails at once)
        with _closed_on_failure() as closers:
            if publisher is not None:
                closers.append(publisher.close)
            checkpoint_files(model_dir)  # (here, not in a tensor-parallel worker's traceback)
            executor = _make_executor(self.config, hf_config, model_dir, max_model_len)
            closers.append(executor.shutdown)
            self._start_engine(executor, tokenizer, max_model_len, publisher)

    def _start_engine(self, executor: Any, tokenizer: Any, max_model_len: int, publisher: Any) -> None:
        """The engine over ``executor``, and the KV events of ``publisher`` (bound already) from it."""
        self.llm_engine = LLMEngine(
            self.config, executor, tokenizer, max_model_len, sorted(_eos_ids(self.model_dir, tokenizer))
        )
        # One generate() or step() at a time (other threads' wait; a hook re-enters on its
        # thread), and outputs of streamed requests that finished while generate() stepped.
        self._lock = threading.RLock()
        # Held around each engine step and each request added or aborted, not a whole call: a
        # request added or aborted, or a recording attached, from another thread lands between
        # two steps of a generate() under way.
        self._step_lock = StepLock()
        self._between_steps_calls = _ThreadsCalls()  # each thread's, for call_between_steps
        self._holds = 0  # engine steps (and batches of adds) taken so far: another call's progress
        self._undelivered: dict[str, RequestOutput] = {}
        self._generating: set[str] = set()  # ids of requests a generate() call runs
        self.llm_engine.held_outputs = self._undelivered  # (kept, never replaced: the engine holds it)
        self.kv_events = None
        if publisher is not None:
            from kvscope.attach.publisher import EngineKVEvents

            self.kv_events = EngineKVEvents(self.llm_engine, publisher)

    # ------------------------------------------------------------ vLLM API
    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: what a prompt given no ``SamplingParams`` samples with, the model's
        generation_config.json's temperature, top-k, top-p, min-p, repetition penalty and
        max_new_tokens (as ``max_tokens``) over ``SamplingParams()`` (``generation_config``, an
        engine setting, says where they come from). A new object each call: change it freely."""
        return SamplingParams(**self._sampling_defaults)

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        *,
        lora_request: Seq[None] | None = None,
        priority: Seq[int] | None = None,
        tokenization_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in input order, each request's final
        cumulative output whatever its ``output_kind`` (as vLLM's ``generate``). ``use_tqdm``
        may also be what makes the progress bar (vLLM's: ``tqdm``-like, called with ``total``).

        vLLM's keywords, so ported calls run: ``lora_request`` must be None (no LoRA here) and
        ``priority`` all 0 (first come, first served), as vLLM refuses them when neither LoRA nor
        priority scheduling is enabled; ``tokenization_kwargs`` may hold ``truncate_prompt_tokens``
        (vLLM's place for it now), for the params that do not set their own.

        Calls from several threads run one after another. Requests added with
        :meth:`add_request` keep running meanwhile; their outputs come from the next
        :meth:`step`. Ctrl-C aborts this call's requests (their blocks are freed) and re-raises.
        """
        self._check_open()
        if not (isinstance(use_tqdm, bool) or callable(use_tqdm)):
            raise TypeError(f"use_tqdm must be a bool or a tqdm-like callable, got {type(use_tqdm).__name__}")
        prompt_list = _as_prompt_list(prompts)
        for p in prompt_list:
            check_prompt(p)
        _check_no_lora(lora_request, len(prompt_list))
        _check_no_priority(priority, len(prompt_list))
        truncate = _truncation(tokenization_kwargs)
        params_list = self._params_per_prompt(sampling_params, len(prompt_list))
        if truncate is not None:  # (vLLM's: the params' own truncate_prompt_tokens wins)
            params_list = [p if p.truncate_prompt_tokens is not None
                           else dataclasses.replace(p, truncate_prompt_tokens=truncate) for p in params_list]
        with self._one_call("LLM.generate"):
            engine = self.llm_engine
            ids: list[str] = []
            try:
                with self._one_step():  # a Ctrl-C lands once every added id is in ids
                    # (asked holding the step lock: another thread's add or abort is then done,
                    # so a step or transition under way is this thread's, and this is its hook)
                    if engine.in_step:
                        raise RuntimeError(
                            "LLM.generate was called from inside a kvscope hook while the engine was in a "
                            "step; only step.end hooks may call it (or add_request / abort_request from any hook)")
                    for p, sp in zip(prompt_list, params_list):
                        ids.append(engine.add_request(p, sp, final_only=True))
                        self._generating.add(ids[-1])
                return self._run(ids, use_tqdm)
            finally:
                with self._one_step():
                    for rid in ids:  # (and an output of theirs a nested generate or step kept)
                        engine.abort_request(rid, report=False)
                        self._generating.discard(rid)

    def _params_per_prompt(self, sampling_params: Any, num_prompts: int) -> list[SamplingParams]:
        """``generate``'s ``sampling_params`` as one ``SamplingParams`` per prompt (None: the
        model's defaults), each entry checked here, where its place in the list can be named."""
        if not isinstance(sampling_params, (SamplingParams, list, tuple, type(None))):
            raise TypeError(
                f"sampling_params must be a SamplingParams or a list of them, got "
                f"{type(sampling_params).__name__}; build one with SamplingParams(...)"
            )
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            return [sampling_params or self.get_default_sampling_params()] * num_prompts
        for i, p in enumerate(sampling_params):
            if not isinstance(p, (SamplingParams, type(None))):
                raise TypeError(f"sampling_params[{i}] must be a SamplingParams (or None), got "
                                f"{type(p).__name__}; build one with SamplingParams(...)")
        if len(sampling_params) != num_prompts:
            raise ValueError(f"got {len(sampling_params)} sampling_params for {num_prompts} prompts; "
                             "pass one SamplingParams or one per prompt")
        # (a None in the list samples as sampling_params=None does)
        return [self.get_default_sampling_params() if p is None else p for p in sampling_params]

    def chat(
        self,
        messages: Seq[Any],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        *,
        lora_request: None = None,
        chat_template_content_format: str = "auto",
        tokenization_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``chat``: ``messages`` (one conversation of ``{"role", "content"}`` dicts, or a
        list of them) rendered by the chat template (``chat_template``, else the tokenizer's),
        then generated like :meth:`generate`'s prompts. Each output's ``prompt`` is the
        rendered text.

        vLLM's other keywords, so ported calls run: content is rendered as one string (text
        parts joined), vLLM's ``chat_template_content_format="string"``, which ``"auto"`` picks
        here; ``lora_request`` and ``mm_processor_kwargs`` must be None (no LoRA, no multimodal
        models), and ``tokenization_kwargs`` is :meth:`generate`'s.
        """
        from kvscope import chat

        self._check_open()
        if not isinstance(chat_template_content_format, str) or chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format must be 'auto' or 'string' (kvscope renders each "
                             f"message's content as one string, its text parts joined), got "
                             f"{chat_template_content_format!r}")
        check_inert("mm_processor_kwargs", mm_processor_kwargs, "kvscope runs no multimodal models")
        if self.config.skip_tokenizer_init:
            raise ValueError("chat() needs a tokenizer, and this LLM has skip_tokenizer_init=True; "
                             "render the conversation yourself and pass its token ids to generate()")
        tokenizer = self.llm_engine.tokenizer
        options = chat.template_options(tokenizer, chat_template, add_generation_prompt,
                                        continue_final_message, tools, chat_template_kwargs)
        prompts = []
        for conversation in chat.as_conversations(messages):
            text = chat.render(tokenizer, conversation, options)
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request,
                             tokenization_kwargs=tokenization_kwargs)

    def _run(self, ids: list[str], use_tqdm: bool | Callable[..., Any]) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            make_bar = use_tqdm if callable(use_tqdm) else tqdm
            bar = make_bar(total=len(ids), desc="kvscope generate", unit="req")
        try:
            while True:
                # Outputs land in _undelivered first: a step.end hook's own generate() or step()
                # may have stepped the engine and kept this call's finished outputs there.
                for rid in [rid for rid, o in self._undelivered.items() if rid in pending and o.finished]:
                    done[rid] = self._undelivered.pop(rid)
                    pending.discard(rid)
                    if bar is not None:
                        bar.update(1)
                if not pending:
                    break
                if not engine.has_unfinished_requests():
                    raise RuntimeError(f"{len(pending)} requests vanished from the engine")
                with self._one_step():  # a Ctrl-C lands once the outputs are kept
                    self._check_open()  # (another thread's shutdown() waits for a step, then lands here)
                    self._keep(engine.step())
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]

    def add_request(
        self, prompt: PromptType, params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request for :meth:`step` (streaming); safe from inside any hook, and from
        another thread while a :meth:`generate` runs (it joins that run's next step)."""
        self._check_open()
        check_prompt(prompt)
        if request_id is not None:
            if not isinstance(request_id, str):
                raise TypeError(f"request_id must be a str (as in vLLM), got {type(request_id).__name__} "
                                f"{request_id!r}")
            check_text("request_id", request_id)  # (a trace of it is saved as UTF-8)
        with self._between_steps("LLM.add_request"):
            self._check_open()  # (again: another thread may have shut it down while this one waited)
            return self.llm_engine.add_request(
                prompt, self.get_default_sampling_params() if params is None else params, request_id)

    def step(self) -> list[RequestOutput]:
        """One engine step: an output for every streamed request that progressed or finished
        since the last call (while :meth:`generate` ran the engine too, or a Ctrl-C ended it);
        of a ``FINAL_ONLY`` request, only its final one.

        One output per request, as vLLM coalesces the outputs not collected yet: a cumulative
        one replaces the older, a ``DELTA`` one is added to it (text, tokens and log-probs
        appended), so nothing is lost or repeated.
        """
        self._check_open()
        with self._one_call("LLM.step"), deferred_interrupts():
            with self._one_step():
                self._check_open()
                self._keep(self.llm_engine.step())  # (kept before other threads get in between steps)
            if interrupt_pending():  # the caller gets KeyboardInterrupt instead: the next step delivers them
                return []
            return self._take_undelivered()

    def _keep(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:  # (newest last)
            earlier = self._undelivered.pop(out.request_id, None)
            if earlier is not None and out._is_delta:
                earlier.add(out, aggregate=True)
                out = earlier
            self._undelivered[out.request_id] = out

    def _take_undelivered(self) -> list[RequestOutput]:
        """The kept outputs that are the caller's: not those of generate()'s requests (a hook's
        step() may run while generate() does), nor the progress of a request aborted meanwhile
        without a report."""
        engine = self.llm_engine
        taken = [rid for rid in self._undelivered if rid not in self._generating]
        outputs = [self._undelivered.pop(rid) for rid in taken]
        return [o for o in outputs if o.finished or engine.has_request(o.request_id)]

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        """Abort requests wherever they are (the next :meth:`step` reports each with
        ``finish_reason="abort"``); safe from inside any hook, and from another thread while a
        :meth:`generate` runs (between two of its steps)."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id) \
            if isinstance(request_id, Iterable) else [request_id]
        if not all(isinstance(rid, str) for rid in ids):
            raise TypeError(f"request_id must be a str or an iterable of str, got {request_id!r}")
        self._check_open()
        with self._between_steps("LLM.abort_request"):
            self._check_open()
            for rid in ids:
                self.llm_engine.abort_request(rid)  # (one that already finished is still delivered)

    def has_unfinished_requests(self) -> bool:
        """Whether :meth:`step` has anything left to report. Read between two steps: from another
        thread while a :meth:`generate` steps, the kept outputs change under it (iterating them
        raised "dictionary changed size"), and a request moving between queues is in none."""
        with self._between_steps("LLM.has_unfinished_requests"):
            return self.llm_engine.has_unfinished_requests() or any(  # (a copy: generate() pops its own)
                rid not in self._generating for rid in list(self._undelivered))

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget the cached free blocks; True when no cached block is left (False: running
        requests' blocks keep their hashes, where vLLM returns False and forgets nothing).

        vLLM's keywords, at their defaults only: kvscope neither preempts running requests to
        reset their blocks (``reset_running_requests``) nor has a KV connector (``reset_connector``)."""
        check_inert("reset_running_requests", reset_running_requests,
                    "kvscope does not preempt running requests to reset their blocks", default=False)
        check_inert("reset_connector", reset_connector, "kvscope has no KV connector", default=False)
        self._check_open()
        with self._between_steps("LLM.reset_prefix_cache"):
            self._check_open()
            return self.llm_engine.reset_prefix_cache()

    # ---------------------------------------------------------- kvscope API
    @property
    def hooks(self) -> HookRegistry:
        return self.llm_engine.hooks

    @contextlib.contextmanager
    def record(self, level: str = "blocks", max_steps: int = 10_000) -> Iterator["Trace"]:
        """``with llm.record() as trace: llm.generate(...)``: record each step (docs/TRACE_API.md).

        Levels: ``"summary"`` < ``"blocks"`` < ``"full"``; the last ``max_steps`` steps are kept.
        """
        try:
            from kvscope.trace.recorder import Recorder
        except ImportError as exc:  # pandas / pyarrow come with the notebook extra
            raise ImportError(
                f"recording a trace needs pandas and pyarrow ({exc}); install them with "
                "pip install 'kvscope[notebook]'"
            ) from exc
        # A Ctrl-C in start() or stop() is held until the recorder is whole: landing in either, it
        # left the recorder attached for good (its hooks fed on every step, the heap frozen).
        self._check_open()
        recorder = None
        try:
            with self._between_steps("llm.record"):  # (another thread may be stepping the engine)
                self._check_open()  # (again: another thread may have shut it down while this one waited)
                if self.llm_engine.in_step:  # (this thread, from a hook: its first record would be half a step)
                    raise RuntimeError("llm.record was called from inside a kvscope hook while the engine was in a "
                                       "step; start a recording between steps or from a step.end hook")
                with deferred_interrupts():  # (one held here lands inside the try, and stops it)
                    recorder = Recorder(self.llm_engine, level, max_steps, model=self.model_dir)
                    trace = recorder.start()
            yield trace
        finally:
            if recorder is not None:  # (stop() also detaches what a start() that raised had attached)
                with deferred_interrupts(), self._between_steps("leaving llm.record"):
                    recorder.stop()

    @contextlib.contextmanager
    def _one_call(self, what: str) -> Iterator[None]:
        """Run after another thread's generate() or step(), waiting as long as it keeps
        stepping; raise, rather than hang, when it stays inside one step, or between two for
        ``STEP_WAIT_S`` (a paused dashboard's run: the Resume it waits for cannot reach a
        kernel busy with this call)."""
        taken, seen, since = False, self._holds, time.monotonic()
        try:
            while not taken:
                with deferred_interrupts():  # (see _between_steps)
                    taken = self._lock.acquire(timeout=CALL_POLL_S)
                if taken:
                    break
                with self._between_steps(what):
                    pass
                if self._holds != seen:
                    seen, since = self._holds, time.monotonic()
                elif time.monotonic() - since >= STEP_WAIT_S:
                    raise RuntimeError(f"{what}: another thread's call has not stepped the engine for "
                                       f"{STEP_WAIT_S:g} s (a paused dashboard's background run? resume it, "
                                       "or wait for dash.run_future)")
            yield
        finally:
            if taken:
                self._lock.release()

    @contextlib.contextmanager
    def _one_step(self) -> Iterator[None]:
        """Hold the engine for one step (or the requests' adds and aborts), Ctrl-C deferred;
        then let in the threads waiting between two steps before this thread's next one."""
        with deferred_interrupts(), self._step_lock:
            yield
        self._holds += 1
        if not self._step_lock.held_here():  # (the outermost hold of this thread)
            self._step_lock.let_waiters_in(STEP_WAIT_S)
            self._run_between_steps_calls()

    def call_between_steps(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` on this thread once the engine step it is in has ended and the engine is
        free, before this thread's next step (outside a step: at once). For a hook that must
        wait without holding the engine: a dashboard paused between two steps of its background
        run, while the notebook adds, aborts or records. A function that raises there is reported
        as a hook that raises is (a RuntimeWarning with its traceback), and the call goes on."""
        if not callable(fn):
            raise TypeError(f"fn must be callable, got {fn!r}")
        if self._step_lock.held_here():
            self._between_steps_calls.fns.append(fn)
        else:
            fn()

    def _run_between_steps_calls(self) -> None:
        calls = self._between_steps_calls.fns
        while calls:
            fn = calls.pop(0)
            try:
                fn()
            except Exception:  # (a hook's own code: reported as a hook's error is, and the call stepping goes on)
                warn_detached(fn, "llm.call_between_steps")

    @contextlib.contextmanager
    def _between_steps(self, what: str) -> Iterator[None]:
        """Hold the engine between two steps; raise, rather than hang, when another thread
        stays inside one (a hook of its waits on something; a paused dashboard waits between
        steps instead, see call_between_steps).

        The wait goes in slices with Ctrl-C held: a Ctrl-C lands between two slices, so the
        wait stays interruptible, but never between the lock taken and the ``try`` that
        releases it, where it would leave the lock held for ever."""
        taken, deadline = False, time.monotonic() + STEP_WAIT_S
        try:
            while not taken:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"{what}: another thread has been inside one engine step for "
                                       f"{STEP_WAIT_S:g} s (a hook of its that waits? let it go on first, or "
                                       "wait with llm.call_between_steps)")
                with deferred_interrupts():
                    taken = self._step_lock.acquire(timeout=min(left, CALL_POLL_S))
            yield
        finally:
            if taken:
                self._step_lock.release()

    def check_invariants(self) -> None:
        """Raise if any control-plane invariant (docs/ARCHITECTURE.md) is broken right now:
        between two steps when another thread is stepping (half-way through a transition the
        engine's tables disagree by design), at once from a hook. Refused from a ``block.*``
        hook, which fires half-way through such a transition."""
        with self._between_steps("llm.check_invariants"):
            self.llm_engine.check_invariants()

    def __repr__(self) -> str:
        """One line for a notebook's ``llm``: the model, its device, the KV blocks the requests
        hold and the queues. Read without waiting for a step another thread runs (a repr must
        not block), so from there it may be a step behind."""
        name = Path(self.model_dir).name
        if self._shut_down:
            return f"<kvscope.LLM {name!r}: shut down>"
        engine = self.llm_engine
        pool, scheduler = engine.block_manager, engine.scheduler
        tp = self.config.tensor_parallel_size
        return (f"<kvscope.LLM {name!r} on {engine.executor.device}{f' (TP={tp})' if tp > 1 else ''}: "
                f"{len(pool.used)} of {pool.num_blocks} KV blocks of "
                f"{pool.block_size} tokens in use, {len(scheduler.running)} running, "
                f"{len(scheduler.waiting)} waiting, step {scheduler.step_count}>")

    def _check_open(self) -> None:
        """After ``shutdown()`` the weights and KV pool are gone: say so instead of failing inside."""
        if self._shut_down:
            raise RuntimeError("this LLM was shut down; create a new LLM(...) to generate again")

    def shutdown(self) -> None:
        """Release the weights, the KV pool and any workers now. From another thread while a
        step runs, it waits for that step to end; the call stepping the engine then raises that
        this LLM was shut down, as every later call does. From a hook inside a step it is
        refused (the step would go on without its model); a ``step.end`` hook may call it."""
        with deferred_interrupts():  # (see _between_steps)
            if self._step_lock.acquire(blocking=False):  # (free, or this thread's: then is it in a step?)
                in_step = self.llm_engine.in_step
                self._step_lock.release()
                if in_step:
                    raise RuntimeError("LLM.shutdown was called from inside a kvscope hook while the engine was "
                                       "in a step; call it from a step.end hook or once the call returns")
        # First the flag: a generate() in another thread stops at its next step.
        was, self._shut_down, waited = self._shut_down, True, False
        try:
            with self._between_steps("LLM.shutdown"):
                waited = True
                if self.kv_events is not None:
                    self.kv_events.close()
                    self.kv_events = None
                self.llm_engine.executor.shutdown()
        finally:
            if not waited:  # (another thread stays inside its step, or a Ctrl-C: nothing shut down)
                self._shut_down = was

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


class _ThreadsCalls(threading.local):
    """The functions each thread asked for between its steps (``LLM.call_between_steps``)."""

    def __init__(self) -> None:
        self.fns: list[Callable[[], None]] = []


def _kv_event_publisher(config: EngineConfig) -> Any:
    """``kv_events_config`` enabled: the sockets that publish the engine's KV events in vLLM's
    format (kvscope.attach), bound, once pandas (the events' recorder's) is known to import. An
    endpoint ZMQ refuses raises a ValueError naming the setting and the address, where ZMQ's own
    error names neither."""
    kv = config.kv_events_config
    if kv is None or not kv.publishes:
        return None
    from kvscope.attach.publisher import EndpointError, EngineKVEvents, KVEventPublisher

    EngineKVEvents.require_dependencies()
    try:
        return KVEventPublisher(kv.endpoint, kv.replay_endpoint, kv.buffer_steps, kv.hwm, kv.topic,
                                config.data_parallel_rank)
    except EndpointError as exc:
        raise ValueError(f"kv_events_config.{exc}") from exc.__cause__


@contextlib.contextmanager
def _closed_on_failure() -> Iterator[list[Callable[[], None]]]:
    """A list for the closers of what start-up has built so far; if the block raises, they run,
    newest first, and the error goes on: a failed ``LLM(...)`` leaves no worker running and no
    port bound (a retry binds it again). A closer that raises too is only warned about, so the
    caller sees the error that stopped start-up."""
    closers: list[Callable[[], None]] = []
    try:
        yield closers
    except BaseException:
        for close in reversed(closers):
            try:
                close()
            except Exception as exc:  # (the start-up error is the one to report)
                warnings.warn(f"closing a failed LLM's {close.__qualname__} raised {exc!r}", RuntimeWarning,
                              stacklevel=3)
        raise


def _check_no_lora(lora_request: Any, num_prompts: int) -> None:
    """vLLM's ``lora_request``: None, or one per prompt (all None here, as kvscope has no LoRA)."""
    if isinstance(lora_request, (list, tuple)):
        if len(lora_request) != num_prompts:
            raise ValueError(f"got {len(lora_request)} lora_request for {num_prompts} prompts; pass None or one "
                             f"per prompt")
        if all(r is None for r in lora_request):
            return
    elif lora_request is None:
        return
    raise ValueError(f"lora_request must be None: kvscope has no LoRA adapters (vLLM refuses one too when LoRA "
                     f"is not enabled), got {lora_request!r}")


def _check_no_priority(priority: Any, num_prompts: int) -> None:
    """vLLM's ``priority``: one int per prompt (numpy's too), each 0 here, as vLLM requires without
    priority scheduling."""
    if priority is None:
        return
    if not isinstance(priority, (list, tuple)) or not all(is_index(p) for p in priority):
        raise TypeError(f"priority must be a list of ints, one per prompt, got {priority!r}")
    if len(priority) != num_prompts:
        raise ValueError(f"got {len(priority)} priority for {num_prompts} prompts; pass None or one per prompt")
    if any(priority):
        raise ValueError(f"priority must be 0 for every prompt: kvscope schedules first come, first served (vLLM "
                         f"refuses a nonzero one too unless priority scheduling is enabled), got {list(priority)!r}")


def _truncation(tokenization_kwargs: Any) -> int | None:
    """The ``truncate_prompt_tokens`` of vLLM's ``tokenization_kwargs``, the one key kvscope takes."""
    if tokenization_kwargs is None:
        return None
    if not isinstance(tokenization_kwargs, dict):
        raise TypeError(f"tokenization_kwargs must be a dict, got {type(tokenization_kwargs).__name__}")
    other = sorted(map(str, set(tokenization_kwargs) - {"truncate_prompt_tokens"}))
    if other:
        raise ValueError(f"tokenization_kwargs may only set truncate_prompt_tokens in kvscope (text prompts are "
                         f"tokenized as vLLM's defaults do), got {', '.join(other)}")
    return tokenization_kwargs.get("truncate_prompt_tokens")


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and not isinstance(prompts[0], (str, dict, list, tuple)):  # one prompt of token ids
            return [list(prompts)]
        return list(prompts)
    raise TypeError(f"prompts must be a str, a dict, or a list of them, got {type(prompts).__name__}")
