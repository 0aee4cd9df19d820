"""Results returned by ``LLM.generate`` and ``LLM.step`` (vLLM's field names)."""
from __future__ import annotations

import warnings
from dataclasses import InitVar, dataclass, field
from typing import Any, ClassVar

from kvscope.arg_checks import check_inert


@dataclass
class RequestMetrics:
    """Wall-clock times (``time.perf_counter`` seconds) of one request's life, and its cache use."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_s(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


class Logprob(float):
    """One token's log-probability, as vLLM's ``Logprob``: ``.logprob`` (the value), ``.rank``
    (as vLLM counts it, the tokens at least as likely as this one, itself included: 1 for the
    likeliest, and tokens that tie share the worse rank; a top-``k`` entry is ranked by its
    place, 1..k) and ``.decoded_token`` (its text, None
    without a tokenizer). It is the float itself too, so code that reads the value as a number
    keeps working."""

    __slots__ = ("rank", "decoded_token")

    def __new__(cls, logprob: float, rank: int | None = None, decoded_token: str | None = None) -> "Logprob":
        self = super().__new__(cls, logprob)
        self.rank, self.decoded_token = rank, decoded_token
        return self

    @property
    def logprob(self) -> float:
        return float(self)

    def __reduce__(self) -> tuple:
        return Logprob, (float(self), self.rank, self.decoded_token)

    def __repr__(self) -> str:
        return f"Logprob(logprob={float(self)!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


@dataclass
class CompletionOutput:
    """One completion of a request. Positional arguments take vLLM's order, so a call ported from
    vLLM fills the same fields: ``routed_experts`` is vLLM's (the MoE routing of each token, which
    kvscope does not record), taken only at its default, None, so that ``finish_reason`` and
    ``stop_reason`` come where vLLM's do. kvscope's own ``error`` is keyword-only."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    routed_experts: InitVar[None] = None
    finish_reason: str | None = None  # vLLM's: "stop", "length", "abort" (by the caller) or "error"
    stop_reason: int | str | None = None
    error: str | None = field(default=None, kw_only=True)  # why a request that failed alone inside a step ended
    # vLLM's fields for what kvscope has not (LoRA, a KV connector): read as None, vLLM's value then
    lora_request: ClassVar[None] = None
    kv_transfer_params: ClassVar[None] = None

    def __post_init__(self, routed_experts: None) -> None:
        check_inert("routed_experts", routed_experts, "kvscope records no MoE routing")

    def finished(self) -> bool:
        return self.finish_reason is not None


class _Required:
    """The default of a parameter that must be given but follows an optional one (vLLM's order)."""

    def __repr__(self) -> str:
        return "<required>"


_REQUIRED: Any = _Required()


@dataclass(init=False)
class RequestOutput:
    """One request's output. As vLLM's, positional arguments take the order ``request_id, prompt,
    prompt_token_ids, prompt_logprobs, outputs, finished, metrics, lora_request, encoder_prompt,
    encoder_prompt_token_ids, num_cached_tokens``: the three kvscope has not (no LoRA, no
    encoder-decoder models) are taken only at vLLM's default, None, and read back as None, as is
    vLLM's ``kv_transfer_params`` (no KV connector). Other keywords are ignored
    with a warning naming them, as vLLM ignores them (for code written against a newer vLLM).
    ``prompt_logprobs``, which vLLM requires, may be left out (None) when given by keyword.

    ``metrics`` and ``num_cached_tokens`` are None on an output built by hand (vLLM's defaults);
    the engine's outputs carry both."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    # vLLM's: one entry per prompt token, None for the first, {token: Logprob} plus the top-k
    prompt_logprobs: list[dict[int, Logprob] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None
    num_cached_tokens: int | None
    # Whether this is the output of a DELTA request, to add up with the request's earlier one
    # nobody read yet (see add); its request's params say so when the engine builds it, however
    # the request was added. A field so that dataclasses.replace and copies keep it; private,
    # keyword-only and out of repr and ==, as vLLM's RequestOutput has no such field.
    _is_delta: bool = field(default=False, repr=False, compare=False)
    # vLLM's attributes for what kvscope has not (LoRA, encoder-decoder models, a KV connector),
    # taken by __init__ only at None: read as None, as vLLM's are then
    lora_request: ClassVar[None] = None
    encoder_prompt: ClassVar[None] = None
    encoder_prompt_token_ids: ClassVar[None] = None
    kv_transfer_params: ClassVar[None] = None

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        prompt_logprobs: list[dict[int, Logprob] | None] | None = None,
        outputs: list[CompletionOutput] = _REQUIRED,
        finished: bool = _REQUIRED,
        metrics: RequestMetrics | None = None,
        lora_request: None = None,
        encoder_prompt: None = None,
        encoder_prompt_token_ids: None = None,
        num_cached_tokens: int | None = None,
        *,
        _is_delta: bool = False,
        **kwargs: Any,
    ) -> None:
        missing = [name for name, value in (("outputs", outputs), ("finished", finished)) if value is _REQUIRED]
        if missing:
            raise TypeError(f"RequestOutput() missing required argument(s): {', '.join(map(repr, missing))}")
        check_inert("lora_request", lora_request, "kvscope has no LoRA adapters")
        check_inert("encoder_prompt", encoder_prompt, "kvscope runs no encoder-decoder models")
        check_inert("encoder_prompt_token_ids", encoder_prompt_token_ids, "kvscope runs no encoder-decoder models")
        if kwargs:
            warnings.warn(f"RequestOutput: ignoring extra arguments: {', '.join(map(repr, sorted(kwargs)))}",
                          UserWarning, stacklevel=2)
        self.request_id, self.prompt, self.prompt_token_ids = request_id, prompt, prompt_token_ids
        self.prompt_logprobs, self.outputs, self.finished = prompt_logprobs, outputs, finished
        self.metrics, self.num_cached_tokens, self._is_delta = metrics, num_cached_tokens, _is_delta

    def add(self, next_output: "RequestOutput", aggregate: bool) -> None:
        """vLLM's: merge the request's next output into this one, which nobody has read yet.

        ``aggregate`` (``RequestOutputKind.DELTA`` outputs) appends each completion's new text,
        tokens and log-probs to this one's of the same ``index``, so nothing is lost; otherwise
        the newer completion replaces it. A completion of an index not here yet is added."""
        self.finished |= next_output.finished
        if self.prompt_logprobs is None:  # (a delta carries them once, in the first output)
            self.prompt_logprobs = next_output.prompt_logprobs
        for new in next_output.outputs:
            for i, old in enumerate(self.outputs):
                if old.index != new.index:
                    continue
                if aggregate:
                    old.text += new.text
                    old.token_ids = old.token_ids + new.token_ids
                    if new.logprobs:
                        old.logprobs = old.logprobs + new.logprobs
                    old.cumulative_logprob = new.cumulative_logprob
                    old.finish_reason, old.stop_reason, old.error = new.finish_reason, new.stop_reason, new.error
                else:
                    self.outputs[i] = new
                break
            else:
                self.outputs.append(new)
