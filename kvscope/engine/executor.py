"""What the engine needs from whatever runs the model (one process, or tensor-parallel ranks)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvscope.engine.scheduler_output import SchedulerOutput


@dataclass
class StepResult:
    """Sampled tokens for the rows the scheduler marked ``sample``, keyed by ``seq_id``."""

    tokens: dict[int, int]
    logprobs: dict[int, dict[int, float]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)  # prepare_s, forward_s, sample_s
    errors: dict[int, str] = field(default_factory=dict)  # seq_id -> why its row could not be sampled
    cuda_graph: bool = False
    # seq_id -> the prompt log-probs of the tokens after its row's first num_prompt_logits positions
    prompt_logprobs: dict[int, list[dict[int, float]]] = field(default_factory=dict)


class StepHandle(Protocol):
    """A launched step; ``result()`` waits for its tokens (and only for them)."""

    def result(self) -> StepResult: ...


class DoneStep:
    """A step whose result is already on the host (CPU runs, executors without overlap)."""

    def __init__(self, result: StepResult) -> None:
        self._result = result

    def result(self) -> StepResult:
        return self._result


class Executor(Protocol):
    """``execute_async`` is needed only under ``async_scheduling``: it launches the step and
    returns at once; a decode row whose input token is ``PLACEHOLDER`` takes the token the
    previous launched step sampled for that sequence."""

    num_kv_blocks: int
    vocab_size: int

    def execute(self, out: SchedulerOutput) -> StepResult: ...

    def execute_async(self, out: SchedulerOutput) -> StepHandle: ...

    def shutdown(self) -> None: ...
