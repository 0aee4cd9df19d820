"""``LLM``: vLLM's offline API over the kvscope engine, plus the handles kvscope adds (hooks, record)."""
from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence as Seq

from kvscope.config import EngineConfig
from kvscope.engine.llm_engine import LLMEngine, PromptType
from kvscope.model_source import resolve_model_dir
from kvscope.outputs import RequestOutput
from kvscope.sampling_params import SamplingParams
from kvscope.trace.hooks import HookRegistry

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

        model_dir = resolve_model_dir(model)
        self.config = EngineConfig.from_kwargs(model=str(model) if model is not None else None, **kwargs)
        hf_config = AutoConfig.from_pretrained(model_dir)
        tokenizer = (
            _NoTokenizer() if self.config.skip_tokenizer_init
            else AutoTokenizer.from_pretrained(self.config.tokenizer or model_dir)
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
        self.model_dir = model_dir
        self.hf_config = hf_config
        executor = _make_executor(self.config, hf_config, model_dir, max_model_len)
        self.llm_engine = LLMEngine(
            self.config, executor, tokenizer, max_model_len, sorted(_eos_ids(model_dir, tokenizer))
        )
        self.kv_events = _kv_event_publisher(self.llm_engine, self.config)

    # ------------------------------------------------------------ vLLM API
    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Seq[PromptType],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in input order."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params or SamplingParams()] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompt_list)} prompts; "
                    "pass one SamplingParams or one per prompt"
                )
        engine = self.llm_engine
        ids: list[str] = []
        try:
            for p, sp in zip(prompt_list, params_list):
                ids.append(engine.add_request(p, sp))
            return self._run(ids, use_tqdm)
        finally:
            for rid in ids:
                engine.abort_request(rid)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        pending = set(ids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="kvscope generate", unit="req")
        try:
            while pending:
                if not engine.has_unfinished_requests():
                    raise RuntimeError(f"{len(pending)} requests vanished from the engine")
                for seq in engine._step():
                    if seq.is_finished and seq.request_id in pending:
                        done[seq.request_id] = engine.request_output(seq)
                        engine.release(seq.request_id)
                        pending.discard(seq.request_id)
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]

    def add_request(
        self, prompt: PromptType, params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        return self.llm_engine.add_request(prompt, params, request_id)

    def step(self) -> list[RequestOutput]:
        return self.llm_engine.step()

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            self.llm_engine.abort_request(rid)

    def has_unfinished_requests(self) -> bool:
        return self.llm_engine.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.block_manager.reset_prefix_cache()

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
        with Recorder(self.llm_engine, level, max_steps, model=self.model_dir) as trace:
            yield trace

    def check_invariants(self) -> None:
        """Raise if any control-plane invariant of DESIGN.md is broken right now."""
        self.llm_engine.check_invariants()

    def shutdown(self) -> None:
        if getattr(self, "kv_events", None) is not None:
            self.kv_events.close()
            self.kv_events = None
        executor = getattr(getattr(self, "llm_engine", None), "executor", None)
        if executor is not None:
            executor.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _kv_event_publisher(engine: LLMEngine, config: EngineConfig) -> Any:
    """``kv_events_config`` enabled: publish the engine's KV events in vLLM's format (kvscope.attach)."""
    kv = config.kv_events_config
    if kv is None or not kv.publishes:
        return None
    from kvscope.attach.publisher import EngineKVEvents, KVEventPublisher

    return EngineKVEvents(engine, KVEventPublisher(
        kv.endpoint, kv.replay_endpoint, kv.buffer_steps, kv.hwm, kv.topic, config.data_parallel_rank))


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]
        return list(prompts)
    raise TypeError(f"prompts must be a str, a dict, or a list of them, got {type(prompts).__name__}")
